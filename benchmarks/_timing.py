"""Timing shared by the benchmarks: warm-up (compile) timed apart, then the median of runs."""

from __future__ import annotations

import statistics
import time

import jax


def timeit(fn, *args, iters, inner=1):
  """(median seconds per call over ``iters`` samples, seconds of the first call incl. compile).

  One sample is ``inner`` back-to-back calls and one ``block_until_ready`` on the last,
  divided by ``inner``. Dispatch is asynchronous, so on an accelerator the calls queue
  on the device and a sample measures device time instead of one host round trip
  (which dominates a kernel of a few microseconds). ``inner=1``: one call per sample.
  """
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    for _ in range(inner - 1):
      fn(*args)
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) / inner)
  return statistics.median(times), compile_s
