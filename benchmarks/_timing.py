"""Timing shared by the benchmarks: warm-up (compile) timed apart, then the median of runs."""

from __future__ import annotations

import statistics
import time

import jax


def timeit(fn, *args, iters):
  """(median seconds over ``iters`` runs, seconds of the first call incl. compile)."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), compile_s
