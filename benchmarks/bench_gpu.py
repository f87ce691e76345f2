"""Decode attention on a GPU: fdecode's compiled Pallas kernel, its peers and the memory
floor, side by side in one run on the same data. `scripts/gpu_check` runs it.

Shape: Hq=32, Hkv=8, D=128 (Llama-3-8B-like), one new token per sequence, every sequence
full (lengths = S), bf16 queries; B in {1, 8, 64}, S in {4096, 32768, 131072}. Per (B, S):

  bf16 cache, head-major [B, Hkv, S, D]:
    floor                  a jitted reduction (f32 accumulation) over the same K and V arrays
    fdecode pallas         fdecode.flash_decode(impl="pallas", interpret=False), default tuning
    jax pallas gqa kernel  the Triton kernel of jax.experimental.pallas.ops.gpu.decode_attention.gqa
                           on the head-major cache it reads (`jax_gqa_head_major`)
  bf16 cache, token-major [B, S, Hkv, D] (the same values, made before timing):
    dot_product_attention  jax.nn.dot_product_attention, implementation "cudnn" and "xla",
                           with key_value_seq_lengths (a refused shape reads "n/a: reason")
    jax pallas gqa (public API)  gqa as documented: token-major in; it swaps the cache to
                           head-major inside the call (a full copy, in the timed region)
  paged bf16 pools (page 16, page 64), shuffled block tables: fdecode (floor: the bf16 one,
    same bytes); int8 and float8_e4m3fn caches with per-token f32 scales: their own floor
    over values + scales, and fdecode.

Times: the median of --iters samples; a sample is --inner back-to-back calls ended by one
block_until_ready, divided by --inner (benchmarks/_timing.py); compile time (the first
call) apart. GB/s: bytes of K, V and scales read / time. fraction of floor: floor time /
time, the floor reading the same bytes. Configurations that do not fit the device are skipped with a note.
bench_gpu.json holds "meta", the raw "rows" and the same rows as "records" (benchmarks/_records.py;
extra fields ``format``, ``compile_s``, ``note``); `benchmarks/plot.py` draws it.

  python benchmarks/bench_gpu.py --out DIR            # the full grid (minutes on an H100)
  python benchmarks/bench_gpu.py --out DIR --quick    # smoke run: B 1, 8 x S 4k, 32k, few samples

On CPU the same code builds the tables (tests/tools/test_benchmarks.py, tiny shapes): fdecode runs
in interpret mode and the GPU-only peers (cudnn, the Triton gqa kernel) read "n/a (needs GPU)".
"""

from __future__ import annotations

import os

# Before JAX starts: room for the largest cache (B=64, S=128k: 32 GiB of K and V).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import argparse
import dataclasses
import datetime
import functools
import math
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp

import fdecode
import _device
from _records import machine_line, record, write  # benchmarks/ is on sys.path when a script here runs
from _timing import timeit

NEEDS_GPU = "n/a (needs GPU)"
FORMATS = ("contiguous", "paged16", "paged64", "int8", "fp8")
FLOOR_BF16 = "floor: read K, V (bf16)"
FDECODE = "fdecode pallas"
FDECODE_DEVICE = "fdecode pallas (device time)"
TORCH = "torch sdpa"
TORCH_GRAPH = "torch sdpa (cuda graph)"
GQA_KERNEL = "jax pallas gqa kernel (head-major)"
TARGETS = ("fdecode >= 0.8 of the floor at S >= 32k", "fdecode >= 1.2x JAX Pallas gqa",
           "paged within 1.1x of contiguous", "int8 >= 1.6x faster than bf16",
           "fp8 >= 1.6x faster than bf16", "device time at or below torch SDPA's (CUDA graph)",
           ">= 0.85 of spec bandwidth where K+V >= 256 MB (device time)", "<= 2 kernels per decode call")


@dataclasses.dataclass
class Row:
  fmt: str                 # cache format the row reads
  name: str                # contender
  nbytes: int              # bytes of K, V (and scales) read per call
  floor: str | None        # name of the floor row of the same bytes (None: this is a floor)
  seconds: float | None = None
  compile_s: float | None = None
  note: str = ""
  kernels: int | None = None      # launches per call (compiled HLO's entry computation)


def reason(e: BaseException) -> str:
  msg = (str(e).strip().splitlines() or [""])[0]
  return f"{type(e).__name__}: {msg}"[:200].replace("|", "/")


def measure(rows, fmt, name, fn, args, nbytes, floor, *, iters, inner, skip=None, note="", expect=None,
            count_kernels=False):
  """Times ``jit(fn)(*args)`` into a new Row; a failure (a peer refusing a shape, out of
  memory) becomes the row's note instead of ending the run. ``expect``: an output to
  compare with (the max abs difference goes in the note). ``count_kernels``: the
  launches of one call (`_device.kernels_per_call`)."""
  row = Row(fmt, name, nbytes, floor, note=note)
  rows.append(row)
  if skip:
    row.note = skip
    return
  try:
    f = jax.jit(fn)
    row.seconds, row.compile_s = timeit(f, *args, iters=iters, inner=inner)
    if count_kernels:
      row.kernels = _device.kernels_per_call(fn, args)
    if expect is not None:
      diff = float(jnp.max(jnp.abs(f(*args).astype(jnp.float32) - expect.astype(jnp.float32))))
      row.note = "; ".join(filter(None, [row.note, f"max abs diff vs fdecode {diff:.1e}"]))
  except Exception as e:  # noqa: BLE001 - report any refusal and go on with the other rows
    row.note = "n/a: " + reason(e)


def floor_fn(*arrays):
  """The floor: one streaming read of the arrays' bytes (a sum, accumulated in f32)."""
  return sum(jnp.sum(a, dtype=jnp.float32) for a in arrays)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "token_major"))
def random_cache(key, shape, dtype, token_major=False):
  """A cache of ``shape`` ([B, Hkv, S, D] or a page pool) in ``dtype``; ``token_major``
  gives the same values as [B, S, Hkv, D]. Normal values drawn for at most 2^24 elements
  and tiled (the values do not change a timing; this keeps the 8.6e9-element caches cheap
  to make, with no f32 copy). int8 values are round(32 x), for per-token scales 1/32."""
  total = math.prod(shape)
  base = 2 ** 24 if total > 2 ** 24 and total % 2 ** 24 == 0 else total
  x = jnp.tile(jax.random.normal(key, (base,), jnp.bfloat16), total // base).reshape(shape)
  if token_major:
    x = x.transpose(0, 2, 1, 3)
  if jnp.dtype(dtype) == jnp.int8:
    return jnp.clip(jnp.round(x * 32), -127, 127).astype(jnp.int8)
  return x.astype(dtype)


def jax_gqa_head_major(q, k, v, lengths, interpret=False):
  """decode_attention.gqa on the layout its kernel reads, k/v ``[B, Hkv, S, D]``.

  gqa takes ``[B, S, Hkv, D]`` and swaps it to head-major before its Triton call (a full
  copy of the cache inside the call: its exported HLO has the transposes). Here we call
  what gqa calls after that swap, with gqa's defaults, so the kernel is timed alone.
  """
  from jax.experimental.pallas.ops.gpu import decode_attention as da
  b, hq, d = q.shape
  hkv = k.shape[1]
  kernel = functools.partial(
      da.decode_attn_unbatched, sm_scale=1 / math.sqrt(d), block_h=16, block_k=128, k_splits=16,
      num_warps=None, num_stages=2, grid=None, interpret=interpret, debug=False,
      return_residuals=False, normalize_output=True)
  kv_len = jnp.broadcast_to(lengths[:, None], (b, hkv))
  out = jax.vmap(jax.vmap(kernel))(q.reshape(b, hkv, hq // hkv, d), k, v, None, kv_len)
  return out.reshape(b, hq, d)


def config_rows(b, s, hq, hkv, d, *, formats, iters, inner, on_gpu):
  """All rows of one (B, S): a list of Row, or a one-row list saying why it was skipped."""
  bf16_bytes = 2 * b * hkv * s * d * 2
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  if limit and 1.1 * bf16_bytes + 2 ** 30 > limit:  # K and V resident, plus transients
    return [Row("-", "all", bf16_bytes, None, note=f"skipped: K and V take {bf16_bytes / 2**30:.1f} GiB, "
                f"the device offers {limit / 2**30:.1f} GiB")]
  rows = []
  m = functools.partial(measure, rows, iters=iters, inner=inner)
  gpu_only = None if on_gpu else NEEDS_GPU
  fd = dict(impl="pallas", interpret=not on_gpu)
  fd_note = "" if on_gpu else "interpret mode (CPU)"
  kq, kk, kv, kt = jax.random.split(jax.random.key(b * 1_000_003 + s), 4)
  q = jax.random.normal(kq, (b, hq, d), jnp.bfloat16)
  lengths = jnp.full((b,), s, jnp.int32)
  dims = (b, hkv, s, d)

  k, v = random_cache(kk, dims, jnp.bfloat16), random_cache(kv, dims, jnp.bfloat16)
  m("contiguous", FLOOR_BF16, floor_fn, (k, v), bf16_bytes, None)
  contiguous = lambda q, k, v, n: fdecode.flash_decode(q, k, v, n, **fd)
  m("contiguous", FDECODE, contiguous, (q, k, v, lengths), bf16_bytes, FLOOR_BF16, note=fd_note,
    count_kernels=True)
  expect = jax.jit(contiguous)(q, k, v, lengths) if rows[-1].seconds else None
  if True:  # Dv == Dk: a call's output feeds the next one's query
    device_rows(rows, q, k, v, lengths, contiguous, bf16_bytes, on_gpu, iters, expect)
  m("contiguous", GQA_KERNEL, jax_gqa_head_major, (q, k, v, lengths), bf16_bytes, FLOOR_BF16,
    skip=gpu_only, expect=expect)
  del k, v

  k, v = (random_cache(key, dims, jnp.bfloat16, token_major=True) for key in (kk, kv))
  for impl in ("cudnn", "xla"):
    dpa = functools.partial(jax.nn.dot_product_attention, implementation=impl)
    m("token-major", f"dot_product_attention ({impl})",
      lambda q, k, v, n, dpa=dpa: dpa(q[:, None], k, v, key_value_seq_lengths=n)[:, 0],
      (q, k, v, lengths), bf16_bytes, FLOOR_BF16, skip=gpu_only if impl == "cudnn" else None, expect=expect)
  from jax.experimental.pallas.ops.gpu import decode_attention
  m("token-major", "jax pallas gqa (public API, swaps inside)",
    lambda q, k, v, n: decode_attention.gqa(q, k, v, kv_seq_len=n), (q, k, v, lengths), bf16_bytes,
    FLOOR_BF16, skip=gpu_only, expect=expect)
  del k, v

  for ps in (16, 64):
    if f"paged{ps}" not in formats:
      continue
    name = f"fdecode pallas, paged (page {ps})"
    if s % ps:
      rows.append(Row(f"paged{ps}", name, bf16_bytes, FLOOR_BF16, note=f"skipped: S % {ps} != 0"))
      continue
    n = s // ps
    pool = (hkv, b * n, ps, d)
    k, v = random_cache(kk, pool, jnp.bfloat16), random_cache(kv, pool, jnp.bfloat16)
    tables = jax.random.permutation(kt, b * n).astype(jnp.int32).reshape(b, n)
    m(f"paged{ps}", name, lambda q, k, v, n, t: fdecode.flash_decode(q, k, v, n, block_tables=t, **fd),
      (q, k, v, lengths, tables), bf16_bytes, FLOOR_BF16, note=fd_note)
    del k, v

  for fmt, dtype in (("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)):
    if fmt not in formats:
      continue
    k, v = random_cache(kk, dims, dtype), random_cache(kv, dims, dtype)
    ks, vs = (jnp.full((b, hkv, s, 1), 1 / 32 if fmt == "int8" else 1.0, jnp.float32) for _ in "kv")
    nbytes = 2 * (k.size * k.dtype.itemsize + ks.size * 4)
    floor = f"floor: read K, V, scales ({fmt})"
    m(fmt, floor, floor_fn, (k, v, ks, vs), nbytes, None)
    m(fmt, f"fdecode pallas, {fmt} cache", lambda q, k, v, n, a, c: fdecode.flash_decode(
        q, k, v, n, k_scale=a, v_scale=c, **fd), (q, k, v, lengths, ks, vs), nbytes, floor, note=fd_note)
    del k, v, ks, vs
  return rows


def device_rows(rows, q, k, v, lengths, contiguous, nbytes, on_gpu, iters, expect):
  """fdecode's device time (dependent calls unrolled in one program) and torch SDPA's
  (per call, and as a CUDA graph) on the same arrays."""
  row = Row("contiguous", FDECODE_DEVICE, nbytes, FLOOR_BF16, note="dependent calls in one program")
  rows.append(row)
  try:
    row.seconds, row.compile_s = _device.device_seconds(contiguous, (q, k, v, lengths), iters=iters)
  except Exception as e:  # noqa: BLE001
    row.note = "n/a: " + reason(e)
  why = NEEDS_GPU if not on_gpu else _device.torch_available()
  eager, graph = Row("contiguous", TORCH, nbytes, FLOOR_BF16), Row("contiguous", TORCH_GRAPH, nbytes, FLOOR_BF16)
  rows += [eager, graph]
  if why:
    eager.note = graph.note = why
    return
  try:
    eager.seconds, graph.seconds, out = _device.torch_sdpa(q, k, v, iters=iters)
    if expect is not None:
      graph.note = f"max abs diff vs fdecode {float(jnp.max(jnp.abs(out - expect.astype(jnp.float32)))):.1e}"
  except Exception as e:  # noqa: BLE001
    eager.note = graph.note = "n/a: " + reason(e)


def summarize(results):
  """Per-config ratios, {(B, S): {column: value or None}}, from {(B, S): rows}."""
  out = {}
  spec = _device.spec_bandwidth()
  for key, rows in results.items():
    t = {r.name: r.seconds for r in rows}
    kern = {r.name: r.kernels for r in rows}
    nbytes = {r.name: r.nbytes for r in rows}
    ratio = lambda num, den: num / den if num and den else None
    fd = t.get(FDECODE)
    paged = [ratio(t.get(f"fdecode pallas, paged (page {ps})"), fd) for ps in (16, 64)]
    dev = t.get(FDECODE_DEVICE)
    out[key] = {
        "device ms": dev and dev * 1e3,
        "torch graph ms": t.get(TORCH_GRAPH) and t[TORCH_GRAPH] * 1e3,
        "vs torch (device)": ratio(t.get(TORCH_GRAPH), dev),
        "spec fraction": ratio(nbytes.get(FDECODE_DEVICE), dev and spec and dev * spec),
        "kernels": kern.get(FDECODE),
        "floor GB/s": ratio(nbytes.get(FLOOR_BF16), t.get(FLOOR_BF16) and t[FLOOR_BF16] * 1e9),
        "fdecode GB/s": ratio(nbytes.get(FDECODE), fd and fd * 1e9),
        "fdecode / floor": ratio(t.get(FLOOR_BF16), fd),
        "vs gqa kernel": ratio(t.get(GQA_KERNEL), fd),
        "vs cudnn": ratio(t.get("dot_product_attention (cudnn)"), fd),
        "vs xla dpa": ratio(t.get("dot_product_attention (xla)"), fd),
        "paged16 / contig": paged[0],
        "paged64 / contig": paged[1],
        "int8 speed-up": ratio(fd, t.get("fdecode pallas, int8 cache")),
        "fp8 speed-up": ratio(fd, t.get("fdecode pallas, fp8 cache")),
    }
    out[key]["paged / contig"] = max(filter(None, paged), default=None)
  return out


def target_rows(summary, on_gpu=True):
  """(target, measured, verdict) per target, each judged on the run's worst configuration
  (no verdict off GPU: interpret-mode times say nothing about the kernel's speed)."""
  def judge(target, column, threshold, *, at_most=False, configs=None):
    vals = [(v[column], c) for c, v in summary.items()
            if v[column] is not None and (configs is None or c in configs)]
    if not vals:
      return target, "not measured", "-"
    value, key = (max if at_most else min)(vals)
    met = value <= threshold if at_most else value >= threshold
    spread = f"; median {statistics.median(v for v, _ in vals):.2f} over {len(vals)} configs" if len(vals) > 1 else ""
    verdict = ("met" if met else "**missed**") if on_gpu else "n/a (not on GPU)"
    return target, f"worst {value:.2f} ({config_name(key)}){spread}", verdict
  big = [c for c in summary if 2 * c[0] * c[3] * c[1] * c[4] * 2 >= 256 * 2 ** 20]  # K+V >= 256 MB
  return [
      judge(TARGETS[5], "vs torch (device)", 1.0),
      judge(TARGETS[6], "spec fraction", 0.85, configs=big),
      judge(TARGETS[7], "kernels", 2, at_most=True),
      judge(TARGETS[0], "fdecode / floor", 0.8, configs=[c for c in summary if c[1] >= 32768]),
      judge(TARGETS[1], "vs gqa kernel", 1.2),
      judge(TARGETS[2], "paged / contig", 1.1, at_most=True),
      judge(TARGETS[3], "int8 speed-up", 1.6),
      judge(TARGETS[4], "fp8 speed-up", 1.6),
  ]


def config_name(key):
  b, s, hq, hkv, d = key
  return f"B={b} S={s} Hq={hq} Hkv={hkv} D={d}"


def fmt(x, spec=".2f", suffix=""):
  return "n/a" if x is None else f"{x:{spec}}{suffix}"


def markdown(results, meta):
  summary = summarize(results)
  lines = [f"# fdecode decode attention on {meta['device']}", "",
           f"{meta['date']}; backend {meta['backend']}, jax {meta['jax']}, jaxlib {meta['jaxlib']}; "
           f"`{meta['command']}`", "",
           f"T=1, lengths = S, bf16 queries. "
           f"Median of {meta['iters']} samples of {meta['inner']} back-to-back calls; compile apart. "
           "GB/s = K/V(/scale) bytes read / time; fraction of floor = floor time / time. "
           "Device time: 10 dependent calls unrolled in one program; torch SDPA as a CUDA graph of "
           f"50 calls; spec fraction = bytes / device time / {meta.get('spec_bandwidth')} B/s.", "",
           "## Targets (recorded, not asserted)", "",
           "| target | measured in this run | verdict |", "|---|---|---|"]
  lines += [f"| {t} | {m} | {v} |" for t, m, v in target_rows(summary, meta["backend"] == "gpu")]
  cols = list(next(iter(summary.values()), {}))
  cols.remove("paged / contig")
  lines += ["", "## Summary (ratios > 1 under \"vs\" and \"speed-up\": fdecode faster)", "",
            "| B | S | Hq | Hkv | D | " + " | ".join(cols) + " |", "|---:|---:|---:|---:|---:|" + "---:|" * len(cols)]
  for key, v in summary.items():
    lines.append("| " + " | ".join(map(str, key)) + " | "
                 + " | ".join(fmt(v[c], ".0f" if "GB/s" in c or c == "kernels" else ".3f" if " ms" in c else ".2f")
                              for c in cols) + " |")
  for key, rows in results.items():
    b, s, _, hkv, d = key
    lines += ["", f"## {config_name(key)} (K+V bf16: {2 * b * hkv * s * d * 2 / 2**20:.0f} MiB)", "",
              "| cache | contender | median ms | compile s | GB/s | fraction of floor | kernels | note |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    times = {r.name: r.seconds for r in rows}
    for r in rows:
      floor = times.get(r.floor) if r.floor else r.seconds
      lines.append(f"| {r.fmt} | {r.name} | {fmt(r.seconds and r.seconds * 1e3, '.3f')} | "
                   f"{fmt(r.compile_s)} | {fmt(r.seconds and r.nbytes / r.seconds / 1e9, '.1f')} | "
                   f"{fmt(floor and r.seconds and floor / r.seconds)} | {fmt(r.kernels, 'd')} | {r.note} |")
  lines += ["", "## Notes", "",
            "* Floor: a jitted sum (f32 accumulation) over the very K/V (and scale) arrays, one "
            "streaming read; paged rows use the bf16 floor (the pool holds the same bytes).",
            "* Peers get the cache in their own layout, made before timing: dot_product_attention "
            "and the public gqa take token-major `[B, S, Hkv, D]`; the public gqa swaps it to "
            "head-major inside the call (a full copy), so the gqa kernel row calls its kernel "
            "(`decode_attn_unbatched`, gqa's defaults) on the head-major cache directly.",
            "* Paged: pools of exactly B*S/page_size pages, block tables a random permutation. "
            "8-bit: per-token f32 scales (K and V: 2 * B*Hkv*S*4 bytes, counted).",
            "* \"max abs diff vs fdecode\": the peer's output against fdecode's on the same data "
            "(bf16 outputs: ~1e-2 is rounding)."]
  return "\n".join(lines) + "\n"


def records_of(results, meta, machine):
  """The rows as records (benchmarks/_records.py): one per (B, S) and contender."""
  dtypes = {"int8": "int8", "fp8": "float8_e4m3fn"}
  out = []
  for (b, s, hq, hkv, d), rows in results.items():
    times = {r.name: r.seconds for r in rows}
    for r in rows:
      out.append(record("bench_gpu", r.name, shape=dict(B=b, S=s, Hq=hq, Hkv=hkv, D=d),
                        dtype=dtypes.get(r.fmt, "bfloat16"), seconds=r.seconds, nbytes=r.nbytes,
                        floor_seconds=times.get(r.floor) if r.floor else r.seconds, machine=machine,
                        format=r.fmt, compile_s=r.compile_s, note=r.note, kernels=r.kernels))
  return out


HEADLINE = "1x8192x32x8x128,1x32768x32x8x128,16x8192x8x1x128,64x4096x32x8x128,4x131072x32x8x128,8x8192x16x8x256"


def parse_shapes(text):
  """``"BxSxHqxHkvxD,..."`` -> [(B, S, Hq, Hkv, D), ...]."""
  return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def split_sweep(key, *, iters, on_gpu, splits=(8, 16, 33, 66, 132, None)):
  """Device time of one config at several split counts (None: fdecode's own choice)."""
  b, s, hq, hkv, d = key
  kq, kk, kv = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(kq, (b, hq, d), jnp.bfloat16)
  k, v = random_cache(kk, (b, hkv, s, d), jnp.bfloat16), random_cache(kv, (b, hkv, s, d), jnp.bfloat16)
  lengths = jnp.full((b,), s, jnp.int32)
  out = []
  for n in splits:
    fn = lambda q, k, v, l, n=n: fdecode.flash_decode(q, k, v, l, impl="pallas", interpret=not on_gpu, num_splits=n)
    row = dict(section="split sweep", config=config_name(key), contender=f"num_splits={n or 'default'}",
               nbytes=2 * b * hkv * s * d * 2)
    try:
      row["seconds"], row["compile_s"] = _device.device_seconds(fn, (q, k, v, lengths), iters=iters)
    except Exception as e:  # noqa: BLE001
      row["note"] = "n/a: " + reason(e)
    out.append(row)
  return out


def mla_rows(*, iters, on_gpu, configs=((64, 4096, 16), (64, 4096, 128), (8, 32768, 16), (8, 32768, 128))):
  """MLA decode (DeepSeek: Dk 576 = 512 latent + 64 rope, Dv 512, one latent head, v=None),
  bf16: fdecode's Triton kernel (and the Mosaic GPU kernel where the package has it), device
  time, TFLOP/s and bytes against the spec bandwidth."""
  out = []
  for b, s, g in configs:
    kq, kk = jax.random.split(jax.random.key(11), 2)
    q = jax.random.normal(kq, (b, g, 576), jnp.bfloat16)
    k = random_cache(kk, (b, 1, s, 576), jnp.bfloat16)
    lengths = jnp.full((b,), s, jnp.int32)
    flops = 2 * b * g * s * (576 + 512)
    feed = lambda o: jnp.pad(o, [(0, 0), (0, 0), (0, 64)])  # [B, G, 512] -> the next call's q
    contenders = [("fdecode triton", lambda q, k, l: feed(fdecode.flash_decode(
        q, k, None, l, v_head_dim=512, impl="pallas", interpret=not on_gpu)))]
    try:
      from fdecode.kernels import mosaic_gpu  # pylint: disable=g-import-not-at-top
      contenders.append(("fdecode mosaic gpu", lambda q, k, l: feed(mosaic_gpu.mla_decode(q, k, l))))
    except Exception as e:  # noqa: BLE001 - not in this checkout, or does not build here
      out.append(dict(section="mla", config=f"B={b} S={s} G={g}", contender="fdecode mosaic gpu",
                      note="n/a: " + reason(e)))
    for name, fn in contenders:
      row = dict(section="mla", config=f"B={b} S={s} G={g}", contender=name, nbytes=b * s * 576 * 2, flops=flops)
      if not on_gpu and name != "fdecode triton":
        row["note"] = NEEDS_GPU
      else:
        try:
          row["seconds"], row["compile_s"] = _device.device_seconds(fn, (q, k, lengths), iters=iters)
        except Exception as e:  # noqa: BLE001
          row["note"] = "n/a: " + reason(e)
      out.append(row)
  return out


def extra_table(rows):
  spec = _device.spec_bandwidth()
  lines = ["| section | config | contender | device ms | compile s | GB/s | spec fraction | TFLOP/s | note |",
           "|---|---|---|---:|---:|---:|---:|---:|---|"]
  for r in rows:
    sec = r.get("seconds")
    gbs = sec and r.get("nbytes") and r["nbytes"] / sec / 1e9
    lines.append(f"| {r['section']} | {r['config']} | {r['contender']} | {fmt(sec and sec * 1e3, '.4f')} | "
                 f"{fmt(r.get('compile_s'))} | {fmt(gbs, '.0f')} | {fmt(gbs and spec and gbs * 1e9 / spec)} | "
                 f"{fmt(sec and r.get('flops') and r['flops'] / sec / 1e12, '.1f')} | {r.get('note', '')} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="directory for bench_gpu.md and bench_gpu.json")
  p.add_argument("--quick", action="store_true", help="smoke run: B 1, 8 x S 4k, 32k, few samples")
  p.add_argument("--batches", default=None, help="comma-separated B values (default 1,8,64)")
  p.add_argument("--seqs", default=None, help="comma-separated S values (default 4096,32768,131072)")
  p.add_argument("--heads", default="32,8", help="Hq,Hkv")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--formats", default=",".join(FORMATS), help=f"subset of {','.join(FORMATS)}")
  p.add_argument("--shapes", default=None,
                 help="configs as BxSxHqxHkvxD, comma-separated (\"headline\": issue 34's six); replaces the grid")
  p.add_argument("--split-sweep", default=None,
                 help="configs BxSxHqxHkvxD to time at several split counts (device time), comma-separated")
  p.add_argument("--mla", action="store_true", help="also MLA decode (576/512, one latent head) at G 16 and 128")
  p.add_argument("--iters", type=int, default=None, help="samples per row (default 20, quick 5)")
  p.add_argument("--inner", type=int, default=None,
                 help="calls per sample (default 10; quick: 10 on a GPU, 3 elsewhere)")
  a = p.parse_args(argv)
  batches = [int(x) for x in (a.batches or ("1,8" if a.quick else "1,8,64")).split(",")]
  seqs = [int(x) for x in (a.seqs or ("4096,32768" if a.quick else "4096,32768,131072")).split(",")]
  hq, hkv = (int(x) for x in a.heads.split(","))
  iters = a.iters or (5 if a.quick else 20)
  on_gpu = jax.default_backend() == "gpu"
  # A quick GPU run keeps 10 calls a sample: with 3, rows of ~0.1 ms timed host dispatch
  # and clock ramp-up (H100: B=1 S=32k read 0.221 ms quick, 0.079 ms in the full run).
  inner = a.inner or (3 if a.quick and not on_gpu else 10)
  formats = a.formats.split(",")
  dev = jax.devices()[0]
  meta = dict(device=dev.device_kind if on_gpu else f"{dev.device_kind} (CPU: no GPU numbers)",
              backend=jax.default_backend(), jax=jax.__version__, jaxlib=jax.lib.__version__,
              date=datetime.datetime.now().isoformat(timespec="minutes"),
              command="python benchmarks/bench_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
              hq=hq, hkv=hkv, d=a.head_dim, iters=iters, inner=inner)
  meta["spec_bandwidth"] = _device.spec_bandwidth()
  if a.shapes:
    configs = parse_shapes(HEADLINE if a.shapes == "headline" else a.shapes)
  else:
    configs = [(b, s, hq, hkv, a.head_dim) for b in batches for s in seqs]
  results, extra = {}, []
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  machine = machine_line()

  def save():  # after every config: a run cut short keeps what it measured
    text = markdown(results, meta)
    if extra:
      text += "\n## Split sweep and MLA (device time)\n\n" + extra_table(extra)
    (out / "bench_gpu.md").write_text(text)
    write(out / "bench_gpu.json", "bench_gpu", records_of(results, meta, machine), machine=machine, argv=argv,
          meta=meta, rows=[dict(b=k[0], s=k[1], hq=k[2], hkv=k[3], d=k[4], **dataclasses.asdict(r))
                           for k, rows in results.items() for r in rows], extra=extra)
    return text

  for key in configs:
    print(f"[bench_gpu] {config_name(key)}", file=sys.stderr, flush=True)
    try:
      results[key] = config_rows(*key, formats=formats, iters=iters, inner=inner, on_gpu=on_gpu)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory making the data: the next config
      results[key] = [Row("-", "all", 0, None, note="failed: " + reason(e))]
    save()
  for key in parse_shapes(a.split_sweep or ""):
    print(f"[bench_gpu] split sweep {config_name(key)}", file=sys.stderr, flush=True)
    extra += split_sweep(key, iters=iters, on_gpu=on_gpu)
    save()
  if a.mla:
    extra += mla_rows(iters=iters, on_gpu=on_gpu)
  text = save()
  print(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
