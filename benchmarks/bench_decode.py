"""Decode-attention benchmark: fdecode against its peers and the memory floor, in one run.

For each configuration every contender runs on the same data: fdecode.flash_decode
(each impl), jax.nn.dot_product_attention (given the cache in its own [B, S, H, D]
layout), JAX's own Pallas decode kernel (jax.experimental.pallas.ops.gpu.decode_attention.gqa;
interpret mode on CPU) and the floor: one streaming read of the same K and V bytes
(their bytes viewed as float32 words and summed). Reported: median ms (compile excluded, reported apart), GB/s of KV bytes, and
the fraction of the floor (floor time / contender time). Machines are noisy: compare the
ratios within one run.

  python benchmarks/bench_decode.py            # the issue's shapes (a few minutes on 2 cores)
  python benchmarks/bench_decode.py --quick    # tiny shapes, seconds (the test suite runs this)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

import fdecode
from fdecode.cache.quant import quantize
from _records import add_json_arg, machine_line, table_records, write  # benchmarks/ is on sys.path
from _timing import timeit


def as_float32_words(a):
  """The bytes of ``a`` viewed as float32 words, made once outside the timed region."""
  a = a.reshape(-1)
  if a.dtype.itemsize < 4:
    a = a[: a.size // (4 // a.dtype.itemsize) * (4 // a.dtype.itemsize)].reshape(-1, 4 // a.dtype.itemsize)
  return jax.block_until_ready(jax.lax.bitcast_convert_type(a, jnp.float32))


def floor_fn(*words):
  """The floor: one streaming read of the cache's bytes. XLA's CPU reductions stream
  float32 fastest (int and bf16 reductions run 2-20x slower here, compute-bound), so the
  same bytes, viewed as float32 words (`as_float32_words`), are summed as float32."""
  return sum(jnp.sum(w) for w in words)


def contiguous_rows(b, s, hkv, hq, d, dtype, iters, slow_iters, with_slow):
  """Rows for one contiguous-cache configuration: (name, seconds, compile, bytes)."""
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, hkv, s, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, hkv, s, d), jnp.float32).astype(dtype)
  lengths = jnp.full((b,), s, jnp.int32)
  kv_bytes = 2 * k.size * k.dtype.itemsize
  rows = []
  add = lambda name, fn, *a, n=iters: rows.append((name, *timeit(jax.jit(fn), *a, iters=n), kv_bytes))
  add("floor: read K, V", floor_fn, as_float32_words(k), as_float32_words(v))
  add("fdecode default (xla)", lambda q, k, v, n: fdecode.flash_decode(q, k, v, n), q, k, v, lengths)
  # Peers get the cache in their own token-major layout (made outside the timed region).
  kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  mask = jnp.ones((b, 1, 1, s), bool)
  add("jax.nn.dot_product_attention", lambda q, k, v: jax.nn.dot_product_attention(
      q[:, None], k, v, mask=mask)[:, 0], q, kt, vt)
  if with_slow:
    from jax.experimental.pallas.ops.gpu import decode_attention
    add("fdecode pallas (interpret)", lambda q, k, v, n: fdecode.flash_decode(
        q, k, v, n, impl="pallas", block_k=512), q, k, v, lengths, n=slow_iters)
    add("jax pallas gqa (interpret)", lambda q, k, v, n: decode_attention.gqa(
        q, k, v, kv_seq_len=n, interpret=True, k_splits=16, block_k=512), q, kt, vt, lengths, n=slow_iters)
    add("fdecode reference (f32)", lambda q, k, v, n: fdecode.flash_decode(
        q, k, v, n, impl="reference"), q, k, v, lengths, n=slow_iters)
  return rows


def cache_format_rows(b, s, hkv, hq, d, page_size, iters):
  """Paged and 8-bit caches against the contiguous float32 cache of the same shape."""
  keys = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(keys[0], (b, hq, d))
  k = jax.random.normal(keys[1], (b, hkv, s, d))
  v = jax.random.normal(keys[2], (b, hkv, s, d))
  lengths = jnp.full((b,), s, jnp.int32)
  n = s // page_size
  perm = jax.random.permutation(keys[3], b * n)
  tables = perm.reshape(b, n).astype(jnp.int32)
  to_pages = lambda x: x.reshape(b, hkv, n, page_size, d).transpose(1, 0, 2, 3, 4).reshape(hkv, b * n, page_size, d)
  inv = jnp.argsort(perm)
  kp, vp = to_pages(k)[:, inv], to_pages(v)[:, inv]  # page perm[i] holds chunk i
  k8, ks = quantize(k, jnp.int8)
  v8, vs = quantize(v, jnp.int8)
  f32_bytes, i8_bytes = 2 * k.size * 4, 2 * k.size + 2 * ks.size * 4
  rows = []
  add = lambda name, fn, args, nbytes: rows.append((name, *timeit(jax.jit(fn), *args, iters=iters), nbytes))
  add("floor f32: read K, V", floor_fn, tuple(map(as_float32_words, (k, v))), f32_bytes)
  add("contiguous f32 (xla)", lambda q, k, v, l: fdecode.flash_decode(q, k, v, l), (q, k, v, lengths), f32_bytes)
  add(f"paged f32, page {page_size} (xla)", lambda q, k, v, l, t: fdecode.flash_decode(
      q, k, v, l, block_tables=t), (q, kp, vp, lengths, tables), f32_bytes)
  add("floor int8: read K8, V8, scales", floor_fn, tuple(map(as_float32_words, (k8, v8, ks, vs))), i8_bytes)
  add("int8 per-token (xla)", lambda q, k, v, l, a, c: fdecode.flash_decode(
      q, k, v, l, k_scale=a, v_scale=c), (q, k8, v8, lengths, ks, vs), i8_bytes)
  return rows


def print_table(title, rows, floor_name_prefix="floor"):
  print(f"\n### {title}\n")
  print("| contender | median ms | compile s | GB/s | fraction of floor |")
  print("|---|---:|---:|---:|---:|")
  floor = None
  for name, sec, comp, nbytes in rows:
    if name.startswith(floor_name_prefix):
      floor = sec
    frac = f"{floor / sec:.2f}" if floor else "-"
    print(f"| {name} | {sec * 1e3:.2f} | {comp:.2f} | {nbytes / sec / 1e9:.1f} | {frac} |")
  sys.stdout.flush()


FORMAT_OF = {"contiguous": "contiguous", "paged": "paged", "int8": "int8", "floor f32": "contiguous",
             "floor int8": "int8"}  # a cache-format row's format, from its name's first words


def main(argv=None):
  """Prints the tables; writes every row as a record (benchmarks/_records.py) with the extra
  fields ``section`` ("main", "sweep", "formats"), ``compile_s`` and, for formats, ``format``."""
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
  p.add_argument("--iters", type=int, default=15)
  p.add_argument("--sections", default="main,sweep,formats")
  p.add_argument("--seqs", default=None, help="comma-separated S values of the sweep "
                 "(default 1024,4096,16384,65536; quick 256,512)")
  add_json_arg(p, "bench_decode")
  a = p.parse_args(argv)
  sections = a.sections.split(",")
  if a.quick:
    b, s, hkv, hq, d, iters, slow, sweep, page = 2, 512, 2, 8, 64, 3, 1, [256, 512], 16
  else:
    b, s, hkv, hq, d, iters, slow, sweep, page = 4, 16384, 8, 32, 128, a.iters, 3, [1024, 4096, 16384, 65536], 16
  sweep = [int(x) for x in a.seqs.split(",")] if a.seqs else sweep
  machine = machine_line()
  print(f"# fdecode decode benchmark\n\nmachine: {machine}")
  records = []
  shape = lambda sl: dict(B=b, S=sl, Hkv=hkv, Hq=hq, D=d)
  add = lambda rows, sl, dtype, **extra: records.extend(table_records(
      "bench_decode", rows, shape=shape(sl), dtype=jnp.dtype(dtype).name, machine=machine, **extra))
  if "main" in sections:
    for dtype in (jnp.float32, jnp.bfloat16):
      rows = contiguous_rows(b, s, hkv, hq, d, dtype, iters, slow, with_slow=True)
      print_table(f"B={b} S={s} Hkv={hkv} Hq={hq} D={d} {jnp.dtype(dtype).name}", rows)
      add(rows, s, dtype, section="main")
  if "sweep" in sections:
    for dtype in (jnp.float32, jnp.bfloat16):
      print(f"\n### sweep over S, B={b} Hkv={hkv} Hq={hq} D={d} {jnp.dtype(dtype).name}\n")
      print("| S | floor ms | fdecode ms | fdecode frac | dot_product_attention ms | speed-up vs dpa |")
      print("|---:|---:|---:|---:|---:|---:|")
      for sl in sweep:
        rows = contiguous_rows(b, sl, hkv, hq, d, dtype, iters, slow, with_slow=False)
        add(rows, sl, dtype, section="sweep")
        t = {r[0]: r[1] for r in rows}
        f, x, dpa = t["floor: read K, V"], t["fdecode default (xla)"], t["jax.nn.dot_product_attention"]
        print(f"| {sl} | {f * 1e3:.2f} | {x * 1e3:.2f} | {f / x:.2f} | {dpa * 1e3:.2f} | {dpa / x:.1f}x |")
        sys.stdout.flush()
  if "formats" in sections:
    rows = cache_format_rows(b, s, hkv, hq, d, page, iters)
    print_table(f"cache formats, B={b} S={s} Hkv={hkv} Hq={hq} D={d} (each against the floor above it)", rows)
    for r in table_records("bench_decode", rows, shape=shape(s), dtype="float32", machine=machine,
                           section="formats"):
      fmt = next(f for prefix, f in FORMAT_OF.items() if r["contender"].startswith(prefix))
      records.append(dict(r, dtype="int8" if fmt == "int8" else r["dtype"],
                          format=f"paged{page}" if fmt == "paged" else fmt))
    t = {r[0]: r[1] for r in rows}
    contiguous = t["contiguous f32 (xla)"]
    print(f"\npaged / contiguous time: {t[f'paged f32, page {page} (xla)'] / contiguous:.2f}x; "
          f"int8 speed-up over f32 cache: {contiguous / t['int8 per-token (xla)']:.2f}x")
  write(a.json, "bench_decode", records, machine=machine, argv=argv)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
