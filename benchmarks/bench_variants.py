"""Score modifiers (issue 9): what each costs over plain decode, and whether a sliding
window reads only the window. One run; every row against the same floor.

  python benchmarks/bench_variants.py            # the issue's shapes (a few minutes on 2 cores)
  python benchmarks/bench_variants.py --quick    # tiny shapes, seconds (the test suite runs this)

Sections:
* overhead: B=4, S=16384, Hkv=8, Hq=32, D=128 (the XLA path, this CPU's default): plain
  decode, each modifier alone, all combined; median ms, GB/s of K+V bytes, time over
  plain, fraction of the floor (one streaming read of K and V).
* window: S=65536 with window 4096 against plain decode at S=4096 and at S=65536: the
  XLA path's time, and the blocks the Pallas kernels read, counted with the kernels' own
  range function (`fdecode.kernels.common.block.split_range`, evaluated for every sequence and
  split with the block size and split count the Triton kernel uses on a GPU).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import fdecode
from fdecode import config as config_lib
from fdecode.kernels.common import block as blk
from fdecode.kernels.triton import block_size
from fdecode.kernels.common.modifiers import Modifiers
from fdecode.kernels.xla.plan import split_count
from _records import add_json_arg, machine_line, record, table_records, write  # benchmarks/ is on sys.path
from _timing import timeit
from bench_decode import as_float32_words, floor_fn


def _problem(b, s, hkv, hq, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, hkv, s, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, hkv, s, d), jnp.float32).astype(dtype)
  return q, k, v, jnp.full((b,), s, jnp.int32)


def overhead_rows(b, s, hkv, hq, d, dtype, iters, window):
  q, k, v, lengths = _problem(b, s, hkv, hq, d, dtype)
  r = np.random.default_rng(0)
  mask_bs = jnp.asarray(r.random((b, s)) > 0.1)
  cases = {
      "plain": {},
      "causal=False (T=1: same work)": dict(causal=False),
      "mask [B, S]": dict(mask=mask_bs),
      "mask [B, T, S] (T=1)": dict(mask=mask_bs[:, None]),
      "mask [B, 1, Hq, S] (per head)": dict(mask=jnp.asarray(r.random((b, 1, hq, s)) > 0.1)),
      "bias [B, S]": dict(bias=jnp.asarray(r.normal(size=(b, s)), jnp.float32)),
      "alibi_slopes [Hq]": dict(alibi_slopes=2.0 ** -jnp.arange(1, hq + 1)),
      f"window={window}": dict(window=window),
      "logits_soft_cap=30": dict(logits_soft_cap=30.0),
      "sinks [Hq]": dict(sinks=jnp.zeros((hq,))),
      "all of them": dict(mask=mask_bs, bias=jnp.asarray(r.normal(size=(b, s)), jnp.float32),
                          alibi_slopes=2.0 ** -jnp.arange(1, hq + 1), window=window,
                          logits_soft_cap=30.0, sinks=jnp.zeros((hq,))),
  }
  kv_bytes = 2 * k.size * k.dtype.itemsize
  rows = [("floor: read K, V", *timeit(jax.jit(floor_fn), as_float32_words(k), as_float32_words(v),
                                       iters=iters), kv_bytes)]
  for name, mods in cases.items():
    static = {n: x for n, x in mods.items() if n in ("causal", "window", "logits_soft_cap")}
    arrays = {n: x for n, x in mods.items() if n not in static}
    fn = jax.jit(lambda q, k, v, n, a, static=static: fdecode.flash_decode(q, k, v, n, **a, **static))
    rows.append((name, *timeit(fn, q, k, v, lengths, arrays, iters=iters), kv_bytes))
  return rows


def kernel_blocks(b, s, hkv, lengths, num_tokens, window):
  """Blocks the Triton kernel reads: (count, bk, splits), from the kernel's own ranges."""
  bk = block_size(config_lib.DEFAULT_BLOCK_K)
  from fdecode.kernels.common.modifiers import window_tokens  # pylint: disable=g-import-not-at-top
  mods = Modifiers(window=window)
  seen = window_tokens(s, num_tokens, mods)
  splits = split_count(b, hkv, max(-(-seen // bk), 1), config_lib.num_parallel_units("gpu"))
  count = 0
  for end in lengths:
    for j in range(splits):
      first, last = blk.split_range(jnp.int32(end), j, splits, num_tokens, s, bk, mods)
      count += max(int(last) - int(first), 0)
  return count * hkv, bk, splits  # every kv head reads its own blocks


def window_section(b, hkv, hq, d, dtype, iters, s_long, window):
  rows = []
  for name, s, mods in ((f"plain S={window}", window, {}), (f"window={window}, S={s_long}", s_long,
                        dict(window=window)), (f"plain S={s_long}", s_long, {})):
    q, k, v, lengths = _problem(b, s, hkv, hq, d, dtype)
    fn = jax.jit(lambda q, k, v, n, mods=mods: fdecode.flash_decode(q, k, v, n, **mods))
    sec, comp = timeit(fn, q, k, v, lengths, iters=iters)
    blocks, bk, splits = kernel_blocks(b, s, hkv, [s] * b, 1, mods.get("window"))
    rows.append((name, sec, comp, blocks, bk, splits, blocks * bk * 2 * d * jnp.dtype(dtype).itemsize, s))
    del q, k, v
  return rows


def main(argv=None):
  """Prints the tables; writes their rows as records (benchmarks/_records.py). Extra fields:
  ``section`` ("overhead", "window"), ``compile_s``; overhead rows ``time_over_plain``;
  window rows ``pallas_blocks``, ``block_k``, ``splits``, ``pallas_bytes`` (no GB/s or floor:
  the time is the XLA path's, the bytes the Pallas kernels')."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
  p.add_argument("--iters", type=int, default=11)
  add_json_arg(p, "bench_variants")
  a = p.parse_args(argv)
  if a.quick:
    b, s, hkv, hq, d, iters, s_long, window = 2, 1024, 2, 8, 64, a.iters, 4096, 256
  else:
    b, s, hkv, hq, d, iters, s_long, window = 4, 16384, 8, 32, 128, a.iters, 65536, 4096
  dtype = jnp.bfloat16
  machine = machine_line()
  print(f"# fdecode score-modifier benchmark\n\nmachine: {machine}")
  rows = overhead_rows(b, s, hkv, hq, d, dtype, iters, window)
  plain = next(sec for name, sec, *_ in rows if name == "plain")
  floor = rows[0][1]
  print(f"\n### modifier overhead, B={b} S={s} Hkv={hkv} Hq={hq} D={d} bfloat16, T=1 (default impl)\n")
  print("| contender | median ms | compile s | GB/s | time / plain | fraction of floor |")
  print("|---|---:|---:|---:|---:|---:|")
  for name, sec, comp, nbytes in rows:
    print(f"| {name} | {sec * 1e3:.2f} | {comp:.2f} | {nbytes / sec / 1e9:.1f} | {sec / plain:.2f} | "
          f"{floor / sec:.2f} |")
  sys.stdout.flush()
  shape = dict(B=b, S=s, Hkv=hkv, Hq=hq, D=d)
  records = [dict(r, time_over_plain=r["median_ms"] / (plain * 1e3)) for r in table_records(
      "bench_variants", rows, shape=shape, dtype="bfloat16", machine=machine, section="overhead")]
  rows = window_section(b, hkv, hq, d, dtype, iters, s_long, window)
  print(f"\n### sliding window reads only the window, B={b} Hkv={hkv} Hq={hq} D={d} bfloat16, "
        f"every sequence full\n")
  print(f"| decode | median ms | compile s | time / plain S={window} | Pallas blocks read "
        "(bk, splits) | Pallas K+V bytes read |")
  print("|---|---:|---:|---:|---:|---:|")
  base = rows[0][1]
  for name, sec, comp, blocks, bk, splits, nbytes, sl in rows:
    print(f"| {name} | {sec * 1e3:.2f} | {comp:.2f} | {sec / base:.2f} | {blocks} ({bk}, {splits}) | "
          f"{nbytes / 2**20:.1f} MiB |")
    records.append(record("bench_variants", name, shape=dict(shape, S=sl),
                          dtype="bfloat16", seconds=sec, nbytes=None, floor_seconds=None, machine=machine,
                          section="window", compile_s=comp, pallas_blocks=blocks, block_k=bk,
                          splits=splits, pallas_bytes=int(nbytes)))
  write(a.json, "bench_variants", records, machine=machine, argv=argv)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
