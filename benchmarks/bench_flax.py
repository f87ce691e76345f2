"""One decode step over Flax's token-major cache vs fdecode's head-major cache.

Peers, same data, same run (the token-major cache and its head-major copy):
  flash_decode (head-major)      fdecode.flash_decode on [B, Hkv, S, D] (what DecodeAttention does)
  flash_decode (NHD, mask)       fdecode.flash_decode(kv_layout="NHD") on [B, S, Hkv, D] with the
                                 cache-index mask: attention_fn's decode step (decode_token_major)
  transpose + flash_decode       what "just call flash_decode" from attention_fn would cost
  einsum on token-major          the naive split-free einsum 'bhgd,bshd->bhgs'
  flax dot_product_attention     Flax's default attention_fn (jax.nn.dot_product_attention)

Usage: python benchmarks/bench_flax.py [--b 4 --s 4096 --hkv 8 --g 4 --d 128 --dtype float32]
Prints compile time apart, the median of --iters runs, and GB/s of KV read.
"""

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import fdecode
from fdecode.flax.token_major import decode_token_major
from _timing import timeit  # benchmarks/ is on sys.path when a script here runs


def _einsum_token_major(q, k, v, mask):
  b, hq, d = q.shape
  hkv = k.shape[2]
  qr = q.reshape(b, hkv, hq // hkv, d)
  s = jnp.einsum("bhgd,bshd->bhgs", qr, k, preferred_element_type=jnp.float32) / math.sqrt(d)
  s = jnp.where(mask[:, :, None], s, -1e30)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bhgs,bshd->bhgd", p.astype(v.dtype), v).reshape(b, hq, d)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--b", type=int, default=4)
  ap.add_argument("--s", type=int, default=4096)
  ap.add_argument("--hkv", type=int, default=8)
  ap.add_argument("--g", type=int, default=4)
  ap.add_argument("--d", type=int, default=128)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--iters", type=int, default=10)
  a = ap.parse_args()
  dtype = jnp.dtype(a.dtype)
  b, s, hkv, hq, d = a.b, a.s, a.hkv, a.hkv * a.g, a.d
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, hq, d), np.float32), dtype)
  k_tm = jnp.asarray(rng.standard_normal((b, s, hkv, d), np.float32), dtype)
  v_tm = jnp.asarray(rng.standard_normal((b, s, hkv, d), np.float32), dtype)
  k_hm = jnp.asarray(k_tm.transpose(0, 2, 1, 3))
  v_hm = jnp.asarray(v_tm.transpose(0, 2, 1, 3))
  lengths = jnp.full((b,), s - s // 4, jnp.int32)
  mask = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, :]  # [B, 1, S]
  flax_mask = mask[:, :, None, :]  # [B, 1, 1, S]
  kv_gb = 2 * b * s * hkv * d * dtype.itemsize / 1e9
  peers = {
      "flash_decode (head-major)": (fdecode.flash_decode, (q, k_hm, v_hm, lengths)),
      "flash_decode (NHD, mask)": (decode_token_major, (q, k_tm, v_tm, mask)),
      "transpose + flash_decode": (
          lambda q, k, v, n: fdecode.flash_decode(q, k.transpose(0, 2, 1, 3),
                                                  v.transpose(0, 2, 1, 3), n),
          (q, k_tm, v_tm, lengths)),
      "einsum on token-major": (_einsum_token_major, (q, k_tm, v_tm, mask)),
      "flax dot_product_attention": (
          lambda q, k, v, m: nnx.dot_product_attention(
              q[:, None], jnp.repeat(k, a.g, axis=2), jnp.repeat(v, a.g, axis=2), mask=m),
          (q, k_tm, v_tm, flax_mask)),
  }
  print(f"B={b} S={s} Hkv={hkv} G={a.g} D={d} {dtype.name}, KV {kv_gb * 1e3:.0f} MB, "
        f"backend {jax.default_backend()}")
  for name, (fn, args) in peers.items():
    run_s, compile_s = timeit(jax.jit(fn), *args, iters=a.iters)
    print(f"{name:30s} {run_s * 1e3:8.2f} ms  {kv_gb / run_s:6.1f} GB/s  (compile {compile_s:.2f} s)")


if __name__ == "__main__":
  main()
