"""Shared-prefix (cascade) decode: B sequences sharing one long prefix, each with its own
short suffix. `fdecode.cascade_decode` (the prefix read once, every sequence's query rows
packed into one matmul against it) against `fdecode.flash_decode` over B full copies
(prefix + suffix materialized per sequence), both with the default impl, on the same data
in one run. Each is also set against its floor: one streaming read of the bytes it must
read (cascade: the prefix once + the suffixes; full: B copies).

  python benchmarks/bench_cascade.py            # the issue's shapes: 32 x (16k prefix + 256)
  python benchmarks/bench_cascade.py --quick    # tiny shapes, seconds (the test suite runs this)

Reported: median ms (compile excluded, reported apart), MB of K+V each must read, GB/s of
those bytes, fraction of its own floor, the speed-up of cascade over full copies, and the
largest difference between the two outputs (they compute the same attention).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import fdecode
from _records import add_json_arg, machine_line, table_records, write  # benchmarks/ is on sys.path
from _timing import print_rows, timeit
from bench_decode import as_float32_words, floor_fn


def make_data(b, prefix_len, suffix_len, hkv, hq, d, dtype):
  """q ``[B, Hq, D]``, one prefix ``[1, Hkv, Sp, D]`` and suffixes ``[B, Hkv, Ss, D]``, all full."""
  keys = jax.random.split(jax.random.key(0), 5)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  q = normal(keys[0], (b, hq, d))
  pk, pv = normal(keys[1], (1, hkv, prefix_len, d)), normal(keys[2], (1, hkv, prefix_len, d))
  k, v = normal(keys[3], (b, hkv, suffix_len, d)), normal(keys[4], (b, hkv, suffix_len, d))
  return jax.block_until_ready((q, pk, pv, k, v))


def rows_for(b, prefix_len, suffix_len, hkv, hq, d, dtype, iters):
  """Rows (name, seconds, compile seconds, bytes) and the outputs' largest difference."""
  q, pk, pv, k, v = make_data(b, prefix_len, suffix_len, hkv, hq, d, dtype)
  plens, ids, lens = (jnp.array([prefix_len], jnp.int32), jnp.zeros((b,), jnp.int32),
                      jnp.full((b,), suffix_len, jnp.int32))
  nbytes = lambda *xs: sum(x.size * x.dtype.itemsize for x in xs)
  cascade_bytes = nbytes(pk, pv, k, v)
  rows = []
  add = lambda name, fn, args, by: rows.append((name, *timeit(jax.jit(fn), *args, iters=iters), by))
  cascade = lambda q, pk, pv, pl, k, v, l, i: fdecode.cascade_decode(q, pk, pv, pl, k, v, l, prefix_ids=i)
  args = (q, pk, pv, plens, k, v, lens, ids)
  add("floor: read prefix once + suffixes", floor_fn, tuple(map(as_float32_words, (pk, pv, k, v))), cascade_bytes)
  add("cascade_decode (default impl)", cascade, args, cascade_bytes)
  out_cascade = jax.jit(cascade)(*args)
  # The full copies, made outside the timed region: [B, Hkv, Sp + Ss, D] each.
  full = lambda p, s: jnp.concatenate([jnp.broadcast_to(p, (b,) + p.shape[1:]), s], axis=2)
  fk, fv = jax.block_until_ready((jax.jit(full)(pk, k), jax.jit(full)(pv, v)))
  del k, v
  full_lens = jnp.full((b,), prefix_len + suffix_len, jnp.int32)
  full_bytes = nbytes(fk, fv)
  words = tuple(map(as_float32_words, (fk, fv)))
  add(f"floor: read {b} full copies", floor_fn, words, full_bytes)
  del words
  plain = lambda q, k, v, l: fdecode.flash_decode(q, k, v, l)
  add(f"flash_decode over {b} full copies (default impl)", plain, (q, fk, fv, full_lens), full_bytes)
  out_full = jax.jit(plain)(q, fk, fv, full_lens)
  diff = float(jnp.max(jnp.abs(out_cascade.astype(jnp.float32) - out_full.astype(jnp.float32))))
  return rows, diff


def main(argv=None):
  """Prints the table; writes its rows as records (benchmarks/_records.py): shape B, prefix
  Sp, suffix Ss, Hkv, Hq, D; extra fields ``compile_s`` and ``max_abs_diff`` (cascade vs full)."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
  p.add_argument("--iters", type=int, default=7)
  p.add_argument("--hkv", type=int, default=8, help="kv heads (Hq = 4 * Hkv)")
  add_json_arg(p, "bench_cascade")
  a = p.parse_args(argv)
  if a.quick:
    b, prefix_len, suffix_len, hkv, d, iters = 4, 512, 32, 2, 64, min(a.iters, 3)
  else:
    b, prefix_len, suffix_len, hkv, d, iters = 32, 16384, 256, a.hkv, 128, a.iters
  hq, dtype = 4 * hkv, jnp.bfloat16
  machine = machine_line()
  print(f"# fdecode cascade (shared-prefix) benchmark\n\nmachine: {machine}")
  rows, diff = rows_for(b, prefix_len, suffix_len, hkv, hq, d, dtype, iters)
  print_rows(f"B={b} sharing one prefix of {prefix_len} tokens, suffix {suffix_len} each, Hkv={hkv} "
              f"Hq={hq} D={d} {jnp.dtype(dtype).name}, T=1", rows)
  t = {r[0].split(" (")[0]: r for r in rows}
  cascade, full = t["cascade_decode"], t[f"flash_decode over {b} full copies"]
  print(f"\ncascade speed-up over full copies: {full[1] / cascade[1]:.2f}x; bytes read: "
        f"{full[3] / cascade[3]:.1f}x fewer; max |cascade - full| = {diff:.3g}")
  write(a.json, "bench_cascade", table_records(
      "bench_cascade", rows, shape=dict(B=b, Sp=prefix_len, Ss=suffix_len, Hkv=hkv, Hq=hq, D=d),
      dtype=jnp.dtype(dtype).name, machine=machine, max_abs_diff=diff), machine=machine, argv=argv)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
