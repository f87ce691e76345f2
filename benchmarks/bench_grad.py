"""The derivative of a decode: `jax.grad` of `fdecode.flash_decode` (its forward kernel, then
the chunked backward of `fdecode.derivatives`) against the ways a JAX user would otherwise
get it, on the same data in one run:

* plain autodiff of fdecode's XLA path (`fdecode.kernels.xla.xla_partials` and the merge:
  JAX differentiating the forward kernel as written);
* `jax.grad` of `jax.nn.dot_product_attention` with a length (and causal) mask;
* the forward alone (`flash_decode`), the yardstick of "within 3x of its forward".

  python benchmarks/bench_grad.py            # T = 1, 16, 256 at S up to 64k (B=1, Hq=8, Hkv=2, D=64, f32)
  python benchmarks/bench_grad.py --quick    # tiny shapes, seconds (the test suite runs this)

Each gradient is of ``sum(out * w)`` with respect to q, k and v. The contenders of a shape
are timed in interleaved rounds (`_timing.timeit_interleaved`: each called once per round),
so a shared machine's slow phases fall on all of them. Reported per contender: median ms
(compile excluded), the compiled program's temporary bytes
(``compiled.memory_analysis().temp_size_in_bytes``), the ratio to fdecode's grad, and the
MB of K+V each must read at least once (the floor row: one streaming read of them). A
contender whose temporaries would not fit this machine is compiled (its bytes reported)
but not run.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import fdecode
from _records import add_json_arg, machine_line, record, write  # benchmarks/ is on sys.path
from _timing import timeit_interleaved
from bench_decode import as_float32_words, floor_fn
from fdecode.cache.layout import CacheView
from fdecode.combine import merge_states
from fdecode.kernels import xla as xla_kernels

# Past this many temporary bytes a contender is compiled, not run (the VM has 24 GiB).
RUN_LIMIT = 6 << 30


def plain_xla(q, k, v, lengths, t, num_splits):
  """fdecode's XLA path as a plain JAX function (no custom derivative): q ``[B, T, Hq, D]``."""
  b, _, hq, d = q.shape
  hkv = k.shape[1]
  g = hq // hkv
  rows = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
  o, lse = xla_kernels.xla_partials(rows, CacheView.of(k, v), lengths, dict(mask=None, bias=None, alibi=None),
                                    num_tokens=t, softmax_scale=1.0 / np.sqrt(d), num_splits=num_splits)
  o, _ = merge_states(o, lse, axis=2)
  return o.reshape(b, hkv, t, g, -1).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, -1)


def dpa(q, k, v, lengths, t):
  """`jax.nn.dot_product_attention` (BTNH layout) with each row's visible keys as a mask."""
  s = k.shape[2]
  kpos = jnp.arange(s)[None, None, None, :]
  qpos = (lengths[:, None] - t + jnp.arange(t)[None, :])[:, None, :, None]
  mask = (kpos < lengths[:, None, None, None]) & (kpos <= qpos)  # [B, 1, T, S]
  return jax.nn.dot_product_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask=mask)


def temp_bytes(fn, *args):
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, compiled.memory_analysis().temp_size_in_bytes


def rows_for(b, t, s, hkv, hq, d, iters):
  """(contender, seconds or None, compile s, temporary bytes) rows of one shape."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, t, hq, d), np.float32))
  k = jnp.asarray(rng.standard_normal((b, hkv, s, d), np.float32))
  v = jnp.asarray(rng.standard_normal((b, hkv, s, d), np.float32))
  w = jnp.asarray(rng.standard_normal((b, t, hq, d), np.float32))
  lengths = jnp.full((b,), s, jnp.int32)
  splits = fdecode.plan(q, k, v, lengths, platform="cpu")[0].num_splits  # the split count flash_decode runs
  grad = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2))
  contenders = [
      ("forward: flash_decode", lambda q, k, v: fdecode.flash_decode(q, k, v, lengths)),
      ("grad: fdecode (flash_decode)", grad(lambda q, k, v: fdecode.flash_decode(q, k, v, lengths))),
      ("grad: plain autodiff of the XLA path", grad(lambda q, k, v: plain_xla(q, k, v, lengths, t, splits))),
      ("grad: jax.nn.dot_product_attention", grad(lambda q, k, v: dpa(q, k, v, lengths, t))),
  ]
  floor = jax.jit(floor_fn)
  words = tuple(map(as_float32_words, (k, v)))
  compiled, run = {}, {}
  for name, fn in contenders:
    compiled[name], nbytes = temp_bytes(fn, q, k, v)
    if nbytes <= RUN_LIMIT:
      run[name] = compiled[name]
  timed = timeit_interleaved({"floor": lambda *_: floor(*words), **run}, (q, k, v), iters=iters)
  rows = [("floor: read K+V once", *timed["floor"], 0)]
  for name, _ in contenders:
    nbytes = compiled[name].memory_analysis().temp_size_in_bytes
    rows.append((name, *timed[name], nbytes) if name in run else (name, None, None, nbytes))
  return rows, 2 * k.size * k.dtype.itemsize


def print_table(title, rows, kv_bytes):
  print(f"\n### {title}\n")
  print("| contender | median ms | compile s | temporary MiB | x fdecode grad | GB/s of K+V |")
  print("|---|---:|---:|---:|---:|---:|")
  ours = next(sec for name, sec, _, _ in rows if name.startswith("grad: fdecode"))
  for name, sec, comp, nbytes in rows:
    timed = sec is not None
    print(f"| {name} | {f'{sec * 1e3:.2f}' if timed else 'not run'} | {f'{comp:.2f}' if timed else '-'} | "
          f"{nbytes / 2**20:.1f} | {f'{sec / ours:.2f}' if timed else '-'} | "
          f"{f'{kv_bytes / sec / 1e9:.2f}' if timed else '-'} |")


def main(argv=None):
  """Prints one table per shape; writes its rows as records (benchmarks/_records.py):
  shape B, T, S, Hkv, Hq, D; extra fields ``compile_s`` and ``temp_bytes``."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
  p.add_argument("--iters", type=int, default=5)
  add_json_arg(p, "bench_grad")
  a = p.parse_args(argv)
  b, hkv, hq, d = 1, 2, 8, 64
  shapes = [(1, 512), (4, 1024)] if a.quick else [(1, 8192), (16, 8192), (1, 65536), (256, 65536)]
  iters = min(a.iters, 2) if a.quick else a.iters
  machine = machine_line()
  print(f"machine: {machine}")
  records = []
  for t, s in shapes:
    rows, kv_bytes = rows_for(b, t, s, hkv, hq, d, min(iters, 3) if t * s > 1 << 22 else iters)
    print_table(f"B={b} T={t} S={s} Hq={hq} Hkv={hkv} D={d} float32", rows, kv_bytes)
    floor = rows[0][1]
    for name, sec, comp, nbytes in rows:
      records.append(record("bench_grad", name, shape=dict(B=b, T=t, S=s, Hkv=hkv, Hq=hq, D=d), dtype="float32",
                            seconds=sec, nbytes=kv_bytes, floor_seconds=floor, machine=machine, compile_s=comp,
                            temp_bytes=nbytes))
  write(a.json, "bench_grad", records, machine=machine, argv=argv)


if __name__ == "__main__":
  main()
