"""MLA decode and sparse top-k attention (issue 10). One run; every row against its floor.

  python benchmarks/bench_mla_sparse.py            # the issue's shapes (minutes on 2 cores)
  python benchmarks/bench_mla_sparse.py --quick    # tiny shapes, seconds (the test suite runs this)

Sections:
* MLA: B=8, Hq=128 query heads on one latent head, S=16384, Dk=576 (512 latent + 64
  RoPE), Dv=512. ``flash_decode(q, k, None, lengths, v_head_dim=512)`` reads the latent
  cache once for keys and values; against the floor (one streaming read of that cache),
  and against the two-cache way (a separate value copy ``k[..., :512]``, 1.9x the bytes).
  G = 128 rows make MLA compute-heavy (36 GFLOP per step here), so a compute floor row
  times the two matmuls alone.
  bf16, and FlashMLA's fp8 layout (float8_e4m3fn latent with 1x128 tile scales + bf16
  RoPE columns: 656 bytes per token).
* sparse: S=65536 with K=2048 selected positions per sequence (``indices [B, K]``)
  against a dense decode over a 2048-token cache (the target: within 1.5x) and over the
  whole 65536-token cache. B=4, Hkv=8, Hq=32, D=128, bf16. A second floor row times the
  gather of the selected rows alone: on a CPU, 2048 random rows of a 1 GiB cache are
  random reads (a TLB miss each), not a stream.
Median ms (compile apart), GB/s of the bytes each must read, fraction of the floor. The
default impl of this machine's backend (XLA on CPU, the Pallas kernels on GPU / TPU).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import fdecode
from fdecode.cache.quant import quantize
from _records import add_json_arg, machine_line, table_records, write  # benchmarks/ is on sys.path
from _timing import print_rows, timeit
from bench_decode import as_float32_words, floor_fn


def nbytes(*xs):
  return sum(x.size * x.dtype.itemsize for x in xs)


def mla_rows(b, hq, s, dc, dr, iters):
  """Rows (name, seconds, compile seconds, bytes) of one MLA configuration."""
  keys = jax.random.split(jax.random.key(0), 2)
  q = jax.random.normal(keys[0], (b, hq, dc + dr), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, 1, s, dc + dr), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.full((b,), s, jnp.int32)
  rows = []
  add = lambda name, fn, args, by: rows.append((name, *timeit(jax.jit(fn), *args, iters=iters), by))
  mla = lambda q, k, n: fdecode.flash_decode(q, k, None, n, v_head_dim=dc)
  add("floor: read the bf16 latent cache once", floor_fn, (as_float32_words(k),), nbytes(k))
  add("flash_decode v=None (one read)", mla, (q, k, lengths), nbytes(k))
  qk_pv = lambda q, k: jnp.einsum("bhs,bhd->bsd", jnp.einsum("bsd,bhd->bhs", q, k[:, 0], preferred_element_type=jnp.float32)
                                  .astype(k.dtype), k[:, 0, :, :dc], preferred_element_type=jnp.float32)
  add("compute floor: the QK and PV matmuls alone (no softmax)", qk_pv, (q, k), nbytes(k))
  v = jax.block_until_ready(k[..., :dc])  # the two-cache way: a value copy
  two = lambda q, k, v, n: fdecode.flash_decode(q, k, v, n)
  add("flash_decode with a value copy k[..., :Dv]", two, (q, k, v, lengths), nbytes(k, v))
  del v
  latent, scale = quantize(k[..., :dc], jnp.float8_e4m3fn, tile=min(128, dc))
  rope = k[..., dc:]
  latent, scale, rope = jax.block_until_ready((latent, scale, rope))
  fp8_bytes = nbytes(latent, scale, rope)
  add("floor: read the fp8 latent + scales + bf16 RoPE once", floor_fn,
      tuple(map(as_float32_words, (latent, scale, rope))), fp8_bytes)
  fp8 = lambda q, c, sc, r, n: fdecode.flash_decode(q, c, None, n, v_head_dim=dc, k_scale=sc, k_rope=r)
  add("flash_decode fp8 latent (FlashMLA layout)", fp8, (q, latent, scale, rope, lengths), fp8_bytes)
  return rows


def sparse_rows(b, hkv, hq, d, s, top_k, iters):
  keys = jax.random.split(jax.random.key(1), 3)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
  q = normal(keys[0], (b, hq, d))
  k, v = normal(keys[1], (b, hkv, s, d)), normal(keys[2], (b, hkv, s, d))
  r = np.random.default_rng(0)
  idx = jnp.asarray(np.stack([np.sort(r.choice(s, top_k, replace=False)) for _ in range(b)]), jnp.int32)
  full = jnp.full((b,), s, jnp.int32)
  small_k, small_v = jax.block_until_ready((k[:, :, :top_k], v[:, :, :top_k]))
  plain = lambda q, k, v, n: fdecode.flash_decode(q, k, v, n)
  sparse = lambda q, k, v, n, i: fdecode.flash_decode(q, k, v, n, indices=i)
  selected = 2 * b * hkv * top_k * d * k.dtype.itemsize  # the K selected tokens' K and V
  rows = []
  add = lambda name, fn, args, by: rows.append((name, *timeit(jax.jit(fn), *args, iters=iters), by))
  add(f"floor: read K+V of {top_k} tokens", floor_fn, tuple(map(as_float32_words, (small_k, small_v))),
      nbytes(small_k, small_v))
  add(f"dense decode, S={top_k}", plain, (q, small_k, small_v, jnp.full((b,), top_k, jnp.int32)),
      nbytes(small_k, small_v))
  rows_of = lambda x, i: jax.vmap(jax.vmap(lambda xh, ih: xh[ih], (0, None)))(x, i)  # [B, Hkv, K, D]
  add(f"floor: gather the {top_k} selected rows of K and V (random reads)", lambda k, v, i: (rows_of(k, i), rows_of(v, i)),
      (k, v, idx), selected)
  add(f"sparse decode, S={s}, K={top_k} (indices [B, K])", sparse, (q, k, v, full, idx), selected)
  add(f"dense decode, S={s}", plain, (q, k, v, full), nbytes(k, v))
  return rows


def main(argv=None):
  """Prints the tables; writes their rows as records (benchmarks/_records.py) with the extra
  fields ``section`` ("mla": shape B, Hq, S, Dk, Dv; "sparse": B, Hkv, Hq, D, S, K) and ``compile_s``."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
  p.add_argument("--iters", type=int, default=5)
  add_json_arg(p, "bench_mla_sparse")
  a = p.parse_args(argv)
  if a.quick:
    mla = dict(b=2, hq=16, s=512, dc=128, dr=64)
    sp = dict(b=2, hkv=2, hq=8, d=64, s=4096, top_k=256)
    iters = min(a.iters, 3)
  else:
    mla = dict(b=8, hq=128, s=16384, dc=512, dr=64)
    sp = dict(b=4, hkv=8, hq=32, d=128, s=65536, top_k=2048)
    iters = a.iters
  machine = machine_line()
  print(f"# fdecode MLA / sparse benchmark\n\nmachine: {machine}")
  rows = mla_rows(iters=iters, **mla)
  records = table_records("bench_mla_sparse", rows, machine=machine, dtype="bfloat16", section="mla", shape=dict(
      B=mla["b"], Hq=mla["hq"], S=mla["s"], Dk=mla["dc"] + mla["dr"], Dv=mla["dc"]))
  print_rows(f"MLA: B={mla['b']}, Hq={mla['hq']} on one latent head, S={mla['s']}, "
              f"Dk={mla['dc'] + mla['dr']}, Dv={mla['dc']}", rows)
  t = {r[0]: r[1] for r in rows}
  one, two = t["flash_decode v=None (one read)"], t["flash_decode with a value copy k[..., :Dv]"]
  print(f"\nMLA one read vs a value copy: {two / one:.2f}x; fp8 vs bf16: "
        f"{one / t['flash_decode fp8 latent (FlashMLA layout)']:.2f}x")
  rows = sparse_rows(iters=iters, **sp)
  records += table_records("bench_mla_sparse", rows, machine=machine, dtype="bfloat16", section="sparse",
                           shape=dict(B=sp["b"], Hkv=sp["hkv"], Hq=sp["hq"], D=sp["d"], S=sp["s"], K=sp["top_k"]))
  print_rows(f"sparse top-k: B={sp['b']}, Hkv={sp['hkv']}, Hq={sp['hq']}, D={sp['d']}, bf16, T=1", rows)
  small, _, sparse, big = (r[1] for r in rows[1:])
  print(f"\nsparse over S={sp['s']} (K={sp['top_k']}) / dense over S={sp['top_k']}: {sparse / small:.2f}x "
        f"(target <= 1.5x); dense S={sp['s']} / sparse: {big / sparse:.1f}x")
  write(a.json, "bench_mla_sparse", records, machine=machine, argv=argv)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
