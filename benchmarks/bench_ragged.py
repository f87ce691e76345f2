"""Serving-step attention: a packed ragged batch through `fdecode.ragged_decode` against the
ways `flash_decode` (one T for every sequence) can serve the same step, on one paged pool,
in one run.

Mixed step (the issue's shape): one prefill chunk of C tokens beside B - 1 decodes, every
sequence at context L. Contenders:
  * floor: one streaming read of the live K+V bytes;
  * ragged_decode: the one call (and the same writing the step's keys and values first
    into donated pools, the fused write; over a token-major "NHD" pool; over the same
    sequences as a contiguous cache);
  * two flash_decode calls: the B - 1 decodes (T = 1), then the chunk (B = 1, T = C);
  * flash_decode padded to T = C for every sequence (what one T forces).
Pure-decode step: B decodes at context L, ragged_decode against flash_decode (T = 1), the
same shapes (the target: within 1.1x).

  python benchmarks/bench_ragged.py          # B=64, L=4096, C=512, Hkv=2, Hq=8, D=128, bf16, pages of 64
  python benchmarks/bench_ragged.py --quick  # tiny shapes, seconds (the test suite runs this)
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


def make_step(b, ctx, chunk, hkv, hq, d, page_size, dtype):
  """A paged pool holding B sequences of ``ctx`` tokens, q for one chunk + B - 1 decodes."""
  n = -(-ctx // page_size)
  keys = jax.random.split(jax.random.key(0), 3)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  k, v = normal(keys[0], (hkv, b * n, page_size, d)), normal(keys[1], (hkv, b * n, page_size, d))
  tables = jnp.asarray(np.random.default_rng(0).permutation(b * n).reshape(b, n).astype(np.int32))
  q = normal(keys[2], (chunk + b - 1, hq, d))  # rows: the chunk (sequence 0), then one per decode
  q_lens = np.array([chunk] + [1] * (b - 1), np.int32)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
  lens = jnp.full((b,), ctx, jnp.int32)
  return jax.block_until_ready((q, k, v, tables, cu, lens))


def mixed_rows(b, ctx, chunk, hkv, hq, d, page_size, dtype, iters, slow_iters, inner=1):
  q, k, v, tables, cu, lens = make_step(b, ctx, chunk, hkv, hq, d, page_size, dtype)
  live_bytes = 2 * b * ctx * hkv * d * jnp.dtype(dtype).itemsize
  rows = []
  add = lambda name, fn, args, n=iters: rows.append((name, *timeit(jax.jit(fn), *args, iters=n, inner=inner), live_bytes))
  pages = -(-ctx // page_size)
  add("floor: read live K+V once", floor_fn, (as_float32_words(k[:, :b * pages]), as_float32_words(v[:, :b * pages])))
  ragged = lambda q, k, v, lens, tables, cu: fdecode.ragged_decode(q, k, v, lens, tables, cu, b)
  add("ragged_decode (one call)", ragged, (q, k, v, lens, tables, cu))
  # The same step writing its rows' keys and values first (the fused write), into pools it
  # donates, as a serving step does: each call takes the pools the one before returned.
  new_kv = jax.block_until_ready(jnp.ones((q.shape[0], hkv, d), dtype))
  step = jax.jit(lambda q, k, v, lens, tables, cu, new: fdecode.ragged_decode(
      q, k, v, lens, tables, cu, b, new_k=new, new_v=new), donate_argnums=(1, 2))
  pools = [jnp.copy(k), jnp.copy(v)]

  def written(q, lens, tables, cu, new):
    out, pools[0], pools[1] = step(q, pools[0], pools[1], lens, tables, cu, new)
    return out
  rows.append(("ragged_decode + fused write (donated pools)",
               *timeit(written, q, lens, tables, cu, new_kv, iters=iters, inner=inner), live_bytes))
  del pools[:]
  # The same pool token-major [P, page_size, Hkv, D] (made outside the timed region), read
  # in place by every path (fdecode.cache.layout).
  kn, vn = jax.block_until_ready((k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3)))
  ragged_nhd = lambda q, k, v, lens, tables, cu: fdecode.ragged_decode(q, k, v, lens, tables, cu, b, kv_layout="NHD")
  add("ragged_decode, NHD pool (one call)", ragged_nhd, (q, kn, vn, lens, tables, cu))
  del kn, vn
  # The same sequences as a contiguous cache [B, Hkv, pages * page_size, D] (each
  # sequence's pages in a row, made outside the timed region).
  kc, vc = jax.block_until_ready(tuple(x[:, tables].reshape(x.shape[0], b, -1, d).swapaxes(0, 1) for x in (k, v)))
  ragged_contiguous = lambda q, k, v, lens, cu: fdecode.ragged_decode(q, k, v, lens, None, cu, b)
  add("ragged_decode, contiguous cache (one call)", ragged_contiguous, (q, kc, vc, lens, cu))
  del kc, vc

  def two_calls(q, k, v, lens, tables):
    dec = fdecode.flash_decode(q[chunk:], k, v, lens[1:], block_tables=tables[1:])
    pre = fdecode.flash_decode(q[None, :chunk], k, v, lens[:1], block_tables=tables[:1])
    return jnp.concatenate([pre[0], dec])
  add("flash_decode: decodes + chunk, two calls", two_calls, (q, k, v, lens, tables))

  def padded(q, k, v, lens, tables):  # every sequence padded to T = chunk rows
    qp = jnp.zeros((b, chunk) + q.shape[1:], q.dtype).at[0].set(q[:chunk]).at[1:, -1].set(q[chunk:])
    o = fdecode.flash_decode(qp, k, v, lens, block_tables=tables)
    return jnp.concatenate([o[0], o[1:, -1]])
  add(f"flash_decode padded to T={chunk}", padded, (q, k, v, lens, tables), slow_iters)
  outs = [jax.jit(f)(*a) for f, a in ((ragged, (q, k, v, lens, tables, cu)), (two_calls, (q, k, v, lens, tables)))]
  diff = float(jnp.max(jnp.abs(outs[0].astype(jnp.float32) - outs[1].astype(jnp.float32))))
  return rows, diff


def decode_rows(b, ctx, hkv, hq, d, page_size, dtype, iters, inner=1):
  q, k, v, tables, _, lens = make_step(b, ctx, 1, hkv, hq, d, page_size, dtype)
  cu = jnp.arange(b + 1, dtype=jnp.int32)
  live_bytes = 2 * b * ctx * hkv * d * jnp.dtype(dtype).itemsize
  rows = []
  add = lambda name, fn, args: rows.append((name, *timeit(jax.jit(fn), *args, iters=iters, inner=inner), live_bytes))
  add("floor: read live K+V once", floor_fn, (as_float32_words(k), as_float32_words(v)))
  add("ragged_decode (B decodes)", lambda q, k, v, l, t, c: fdecode.ragged_decode(q, k, v, l, t, c, b),
      (q, k, v, lens, tables, cu))
  add("flash_decode (T=1)", lambda q, k, v, l, t: fdecode.flash_decode(q, k, v, l, block_tables=t),
      (q, k, v, lens, tables))
  return rows


def main(argv=None):
  """Prints both tables; records (benchmarks/_records.py) carry ``section`` ("mixed" /
  "decode"), ``compile_s`` and the shape B, L (context), C (chunk), Hkv, Hq, D, page_size."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
  p.add_argument("--iters", type=int, default=7)
  p.add_argument("--inner", type=int, default=None,
                 help="back-to-back calls per sample (default: 1 on CPU, 10 on an accelerator, where one "
                      "call's host round trip would otherwise be timed; benchmarks/_timing.py)")
  add_json_arg(p, "bench_ragged")
  a = p.parse_args(argv)
  if a.quick:
    b, ctx, chunk, hkv, d, ps, iters = 8, 256, 64, 2, 32, 16, min(a.iters, 3)
  else:
    b, ctx, chunk, hkv, d, ps, iters = 64, 4096, 512, 2, 128, 64, a.iters
  hq, dtype = 4 * hkv, jnp.bfloat16
  inner = a.inner or (1 if jax.default_backend() == "cpu" else 10)
  machine = machine_line()
  print(f"# fdecode ragged serving-step benchmark\n\nmachine: {machine}")
  rows, diff = mixed_rows(b, ctx, chunk, hkv, hq, d, ps, dtype, iters, slow_iters=max(1, iters // 3), inner=inner)
  title = (f"one {chunk}-token chunk + {b - 1} decodes at context {ctx}, Hkv={hkv} Hq={hq} D={d} "
           f"{jnp.dtype(dtype).name}, pages of {ps}")
  print_rows(title, rows)
  t = {r[0]: r[1] for r in rows}
  rag = t["ragged_decode (one call)"]
  print(f"\nragged vs two calls: {t['flash_decode: decodes + chunk, two calls'] / rag:.2f}x faster; vs padded: "
        f"{t[f'flash_decode padded to T={chunk}'] / rag:.2f}x faster; max |ragged - two calls| = {diff:.3g}")
  shape = dict(B=b, L=ctx, C=chunk, Hkv=hkv, Hq=hq, D=d, page_size=ps)
  recs = table_records("bench_ragged", rows, shape=shape, dtype=jnp.dtype(dtype).name, machine=machine,
                       section="mixed", max_abs_diff=diff)
  drows = decode_rows(b, ctx, hkv, hq, d, ps, dtype, iters, inner)
  print_rows(f"{b} decodes at context {ctx} (same shapes)", drows)
  t = {r[0]: r[1] for r in drows}
  print(f"\nragged_decode / flash_decode time on pure decodes: {t['ragged_decode (B decodes)'] / t['flash_decode (T=1)']:.2f}")
  recs += table_records("bench_ragged", drows, shape=dict(shape, C=1), dtype=jnp.dtype(dtype).name,
                        machine=machine, section="decode")
  write(a.json, "bench_ragged", recs, machine=machine, argv=argv)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
