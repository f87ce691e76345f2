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

On CPU the same code builds the tables (tests/test_benchmarks.py, tiny shapes): fdecode runs
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
from _records import machine_line, record, write  # benchmarks/ is on sys.path when a script here runs
from _timing import timeit

NEEDS_GPU = "n/a (needs GPU)"
FORMATS = ("contiguous", "paged16", "paged64", "int8", "fp8")
FLOOR_BF16 = "floor: read K, V (bf16)"
FDECODE = "fdecode pallas"
GQA_KERNEL = "jax pallas gqa kernel (head-major)"
TARGETS = ("fdecode >= 0.8 of the floor at S >= 32k", "fdecode >= 1.2x JAX Pallas gqa",
           "paged within 1.1x of contiguous", "int8 >= 1.6x faster than bf16",
           "fp8 >= 1.6x faster than bf16")


@dataclasses.dataclass
class Row:
  fmt: str                 # cache format the row reads
  name: str                # contender
  nbytes: int              # bytes of K, V (and scales) read per call
  floor: str | None        # name of the floor row of the same bytes (None: this is a floor)
  seconds: float | None = None
  compile_s: float | None = None
  note: str = ""


def reason(e: BaseException) -> str:
  msg = (str(e).strip().splitlines() or [""])[0]
  return f"{type(e).__name__}: {msg}"[:200].replace("|", "/")


def measure(rows, fmt, name, fn, args, nbytes, floor, *, iters, inner, skip=None, note="", expect=None):
  """Times ``jit(fn)(*args)`` into a new Row; a failure (a peer refusing a shape, out of
  memory) becomes the row's note instead of ending the run. ``expect``: an output to
  compare with (the max abs difference goes in the note)."""
  row = Row(fmt, name, nbytes, floor, note=note)
  rows.append(row)
  if skip:
    row.note = skip
    return
  try:
    f = jax.jit(fn)
    row.seconds, row.compile_s = timeit(f, *args, iters=iters, inner=inner)
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
  m("contiguous", FDECODE, contiguous, (q, k, v, lengths), bf16_bytes, FLOOR_BF16, note=fd_note)
  expect = jax.jit(contiguous)(q, k, v, lengths) if rows[-1].seconds else None
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


def summarize(results):
  """Per-config ratios, {(B, S): {column: value or None}}, from {(B, S): rows}."""
  out = {}
  for (b, s), rows in results.items():
    t = {r.name: r.seconds for r in rows}
    nbytes = {r.name: r.nbytes for r in rows}
    ratio = lambda num, den: num / den if num and den else None
    fd = t.get(FDECODE)
    paged = [ratio(t.get(f"fdecode pallas, paged (page {ps})"), fd) for ps in (16, 64)]
    out[(b, s)] = {
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
    out[(b, s)]["paged / contig"] = max(filter(None, paged), default=None)
  return out


def target_rows(summary, on_gpu=True):
  """(target, measured, verdict) per target, each judged on the run's worst configuration
  (no verdict off GPU: interpret-mode times say nothing about the kernel's speed)."""
  def judge(target, column, threshold, *, at_most=False, configs=None):
    vals = [(v[column], c) for c, v in summary.items()
            if v[column] is not None and (configs is None or c in configs)]
    if not vals:
      return target, "not measured", "-"
    value, (b, s) = (max if at_most else min)(vals)
    met = value <= threshold if at_most else value >= threshold
    spread = f"; median {statistics.median(v for v, _ in vals):.2f} over {len(vals)} configs" if len(vals) > 1 else ""
    verdict = ("met" if met else "**missed**") if on_gpu else "n/a (not on GPU)"
    return target, f"worst {value:.2f} (B={b} S={s}){spread}", verdict
  return [
      judge(TARGETS[0], "fdecode / floor", 0.8, configs=[c for c in summary if c[1] >= 32768]),
      judge(TARGETS[1], "vs gqa kernel", 1.2),
      judge(TARGETS[2], "paged / contig", 1.1, at_most=True),
      judge(TARGETS[3], "int8 speed-up", 1.6),
      judge(TARGETS[4], "fp8 speed-up", 1.6),
  ]


def fmt(x, spec=".2f", suffix=""):
  return "n/a" if x is None else f"{x:{spec}}{suffix}"


def markdown(results, meta):
  summary = summarize(results)
  lines = [f"# fdecode decode attention on {meta['device']}", "",
           f"{meta['date']}; backend {meta['backend']}, jax {meta['jax']}, jaxlib {meta['jaxlib']}; "
           f"`{meta['command']}`", "",
           f"Hq={meta['hq']} Hkv={meta['hkv']} D={meta['d']}, T=1, lengths = S, bf16 queries. "
           f"Median of {meta['iters']} samples of {meta['inner']} back-to-back calls; compile apart. "
           "GB/s = K/V(/scale) bytes read / time; fraction of floor = floor time / time.", "",
           "## Targets (recorded, not asserted)", "",
           "| target | measured in this run | verdict |", "|---|---|---|"]
  lines += [f"| {t} | {m} | {v} |" for t, m, v in target_rows(summary, meta["backend"] == "gpu")]
  cols = list(next(iter(summary.values()), {}))
  cols.remove("paged / contig")
  lines += ["", "## Summary (ratios > 1 under \"vs\" and \"speed-up\": fdecode faster)", "",
            "| B | S | " + " | ".join(cols) + " |", "|---:|---:|" + "---:|" * len(cols)]
  for (b, s), v in summary.items():
    lines.append(f"| {b} | {s} | " + " | ".join(fmt(v[c], ".0f" if "GB/s" in c else ".2f") for c in cols) + " |")
  for (b, s), rows in results.items():
    lines += ["", f"## B={b} S={s} (K+V bf16: {2 * b * meta['hkv'] * s * meta['d'] * 2 / 2**20:.0f} MiB)", "",
              "| cache | contender | median ms | compile s | GB/s | fraction of floor | note |",
              "|---|---|---:|---:|---:|---:|---|"]
    times = {r.name: r.seconds for r in rows}
    for r in rows:
      floor = times.get(r.floor) if r.floor else r.seconds
      lines.append(f"| {r.fmt} | {r.name} | {fmt(r.seconds and r.seconds * 1e3, '.3f')} | "
                   f"{fmt(r.compile_s)} | {fmt(r.seconds and r.nbytes / r.seconds / 1e9, '.1f')} | "
                   f"{fmt(floor and r.seconds and floor / r.seconds)} | {r.note} |")
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
  for (b, s), rows in results.items():
    times = {r.name: r.seconds for r in rows}
    for r in rows:
      out.append(record("bench_gpu", r.name, shape=dict(B=b, S=s, Hq=meta["hq"], Hkv=meta["hkv"], D=meta["d"]),
                        dtype=dtypes.get(r.fmt, "bfloat16"), seconds=r.seconds, nbytes=r.nbytes,
                        floor_seconds=times.get(r.floor) if r.floor else r.seconds, machine=machine,
                        format=r.fmt, compile_s=r.compile_s, note=r.note))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="directory for bench_gpu.md and bench_gpu.json")
  p.add_argument("--quick", action="store_true", help="smoke run: B 1, 8 x S 4k, 32k, few samples")
  p.add_argument("--batches", default=None, help="comma-separated B values (default 1,8,64)")
  p.add_argument("--seqs", default=None, help="comma-separated S values (default 4096,32768,131072)")
  p.add_argument("--heads", default="32,8", help="Hq,Hkv")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--formats", default=",".join(FORMATS), help=f"subset of {','.join(FORMATS)}")
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
  results = {}
  for b in batches:
    for s in seqs:
      print(f"[bench_gpu] B={b} S={s}", file=sys.stderr, flush=True)
      try:
        results[(b, s)] = config_rows(b, s, hq, hkv, a.head_dim, formats=formats, iters=iters,
                                      inner=inner, on_gpu=on_gpu)
      except Exception as e:  # noqa: BLE001 - e.g. out of memory making the data: the next config
        results[(b, s)] = [Row("-", "all", 0, None, note="failed: " + reason(e))]
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  text = markdown(results, meta)
  (out / "bench_gpu.md").write_text(text)
  machine = machine_line()
  write(out / "bench_gpu.json", "bench_gpu", records_of(results, meta, machine), machine=machine, argv=argv,
        meta=meta, rows=[dict(b=b, s=s, **dataclasses.asdict(r)) for (b, s), rows in results.items() for r in rows])
  print(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
