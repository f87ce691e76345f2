"""The batch-invariant mode's cost: `flash_decode(batch_invariant=True)` against the default
path on the same data in one run, with the floor (one streaming read of K+V).

  python benchmarks/bench_invariant.py            # decode and a 64-token prefill chunk, bf16
  python benchmarks/bench_invariant.py --quick    # tiny shapes, seconds (the test suite runs this)

Reported per shape: median ms of the floor, the default path and the mode (compile
excluded), and the mode's time over the default's.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import fdecode
from _records import add_json_arg, machine_line, record, write  # benchmarks/ is on sys.path
from _timing import timeit
from bench_decode import as_float32_words, floor_fn


def rows_for(b, t, s, hkv, hq, d, iters):
  rng = np.random.default_rng(0)
  dt = jnp.bfloat16
  q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dt)
  k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dt)
  v = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dt)
  lengths = jnp.full((b,), s, jnp.int32)
  rows = [("floor: read K+V once", timeit(jax.jit(floor_fn), *map(as_float32_words, (k, v)), iters=iters)[0])]
  for name, mode in (("default", {}), ("batch_invariant", dict(batch_invariant=True))):
    fn = jax.jit(lambda q, k, v, mode=mode: fdecode.flash_decode(q, k, v, lengths, **mode))
    rows.append((name, timeit(fn, q, k, v, iters=iters)[0]))
  return rows, 2 * k.size * k.dtype.itemsize


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
  p.add_argument("--iters", type=int, default=10)
  add_json_arg(p, "bench_invariant")
  a = p.parse_args(argv)
  hkv, hq, d = 8, 32, 128
  shapes = ([(1, 1, 512), (2, 4, 1024)] if a.quick else
            [(1, 1, 8192), (8, 1, 4096), (1, 1, 32768), (1, 64, 4096)])
  iters = min(a.iters, 2) if a.quick else a.iters
  machine = machine_line()
  print(f"machine: {machine}")
  print("\n| B | T | S | floor ms | default ms | batch_invariant ms | invariant / default |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  records = []
  for b, t, s in shapes:
    rows, kv_bytes = rows_for(b, t, s, hkv, hq, d, iters)
    sec = dict(rows)
    print(f"| {b} | {t} | {s} | {sec['floor: read K+V once'] * 1e3:.2f} | {sec['default'] * 1e3:.2f} | "
          f"{sec['batch_invariant'] * 1e3:.2f} | {sec['batch_invariant'] / sec['default']:.2f} |")
    for name, seconds in rows:
      records.append(record("bench_invariant", name, shape=dict(B=b, T=t, S=s, Hkv=hkv, Hq=hq, D=d),
                            dtype="bfloat16", seconds=seconds, nbytes=kv_bytes,
                            floor_seconds=sec["floor: read K+V once"], machine=machine))
  write(a.json, "bench_invariant", records, machine=machine, argv=argv)


if __name__ == "__main__":
  main()
