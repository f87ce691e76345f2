"""Timing shared by the benchmarks: warm-up (compile) timed apart, then the median of runs."""

from __future__ import annotations

import statistics
import sys
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


def timeit_interleaved(fns, args, *, iters):
  """``{name: (median seconds per call, seconds of the first call incl. compile)}`` for
  ``fns`` (name -> function of ``args``), timed in ``iters`` rounds that call each once in
  turn: a shared machine's slow phases then fall on every contender alike (one after the
  other, a contender can draw a quiet minute and the next a busy one)."""
  out, times = {}, {name: [] for name in fns}
  for name, fn in fns.items():
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    out[name] = time.perf_counter() - t0
  for _ in range(iters):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - t0)
  return {name: (statistics.median(times[name]), out[name]) for name in fns}


def print_rows(title, rows):
  """A markdown table of ``(name, seconds, compile seconds, bytes)`` rows: median ms, MB
  each must read, GB/s of those bytes and the fraction of the floor, i.e. of the time of
  the nearest row above whose name starts with "floor" (its own bytes' streaming read)."""
  print(f"\n### {title}\n")
  print("| contender | median ms | compile s | MB read | GB/s | fraction of floor |")
  print("|---|---:|---:|---:|---:|---:|")
  floor = None
  for name, sec, comp, by in rows:
    if name.startswith("floor"):
      floor = sec
    print(f"| {name} | {sec * 1e3:.2f} | {comp:.2f} | {by / 1e6:.1f} | {by / sec / 1e9:.2f} | "
          f"{floor / sec:.2f} |")
  sys.stdout.flush()
