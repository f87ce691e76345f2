"""`scripts/demo`: one FlashDecode step over a long cache, timed and checked against the reference."""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import fdecode


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--context", type=int, default=16384, help="cache capacity S (tokens)")
  p.add_argument("--q-heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
  p.add_argument("--impl", choices=["xla", "pallas", "reference"], default=None)
  p.add_argument("--iters", type=int, default=10)
  a = p.parse_args(argv)

  dtype = jnp.dtype(a.dtype)
  kq, kk, kv, kl = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (a.batch, a.q_heads, a.head_dim), dtype)
  k = jax.random.normal(kk, (a.batch, a.kv_heads, a.context, a.head_dim), dtype)
  v = jax.random.normal(kv, (a.batch, a.kv_heads, a.context, a.head_dim), dtype)
  # Sequences at different positions, the longest filling the cache.
  lengths = jax.random.randint(kl, (a.batch,), a.context // 2, a.context + 1).at[0].set(a.context)
  impl = a.impl or ("xla" if jax.default_backend() == "cpu" else "pallas")
  kv_bytes = 2 * k.size * k.dtype.itemsize
  print(f"fdecode demo on {jax.devices()[0].device_kind} ({jax.default_backend()}): impl={impl}")
  print(f"  q {q.shape} {a.dtype}, cache k/v {k.shape} ({kv_bytes / 2**20:.0f} MiB), "
        f"lengths {np.asarray(lengths).tolist()}")

  step = jax.jit(lambda q, k, v, n: fdecode.flash_decode(q, k, v, n, impl=impl, return_lse=True))
  t0 = time.perf_counter()
  out, lse = jax.block_until_ready(step(q, k, v, lengths))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(a.iters):
    t0 = time.perf_counter()
    jax.block_until_ready(step(q, k, v, lengths))
    times.append(time.perf_counter() - t0)
  ms = statistics.median(times) * 1e3

  ref, ref_lse = fdecode.flash_decode(q, k, v, lengths, impl="reference", return_lse=True)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  lse_err = float(jnp.max(jnp.abs(lse - ref_lse)))
  tol = 2.5e-2 if dtype == jnp.bfloat16 else 3e-5
  ok = err <= tol and bool(jnp.all(jnp.isfinite(out)))
  print(f"  out {out.shape} {out.dtype}; first values {np.asarray(out[0, 0, :4], np.float32).round(4).tolist()}")
  print(f"  compile {compile_s:.2f}s; step median {ms:.2f} ms over {a.iters} runs "
        f"= {kv_bytes / (ms * 1e-3) / 1e9:.1f} GB/s of KV")
  print(f"  vs float32 reference: max |out diff| {err:.2e} (tol {tol:.0e}), max |lse diff| {lse_err:.2e}")
  print(f"{'OK' if ok else 'MISMATCH'}: decoded {a.batch}x{a.q_heads} heads over {a.context} tokens "
        f"in {ms:.2f} ms ({impl}, {a.dtype})")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
