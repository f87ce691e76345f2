"""The Hopper MLA kernel (`fdecode.kernels.mosaic_gpu`) on a GPU, in one short run.

MLA decode: one latent kv head, Dk = 576, values the first Dv = 512 columns, one new token
per sequence; bf16 caches, and 8-bit ones (int8 / float8_e4m3fn latents with one float32
scale per token: the kernel's opt-in path, `mla_decode(..., k_scale=)`, not yet measured
before this script). Two parts, each contender guarded (a kernel that fails to compile or
run prints its error and the run goes on):

1. correctness: `mla_decode` (and the Triton path, flash_decode(impl="pallas")) against a
   float64 numpy oracle on a few shapes (G 16 / 64 / 128, S 1 / 777 / 4096, B 1 / 4,
   lengths drawn in [0, S] with 0 and S included where B > 1): max |out - oracle|, max
   |lse - oracle| over finite rows, and whether the -inf rows (no visible key) agree;
   then int8 and e4m3 caches (quantized per token; the oracle dequantizes the same codes
   in float64): mosaic, mosaic with garbage past the lengths (extreme / NaN codes, NaN /
   inf scales), and the Triton path (flash_decode(k_scale=)).
2. device time, MLA B=64 S=4096 and B=8 S=32768 at G=16 and G=128, full lengths:
   floor            a jitted f32 sum over the cache (one streaming read of its bytes)
   mosaic           mla_decode (kernel + split merge)
   mosaic kernel    mla_partials alone (the kernel's launch, no merge)
   triton           fdecode.flash_decode(q, k, None, lengths, v_head_dim=512, impl="pallas")
   A sample is one jitted program of --chain dependent calls, unrolled (each call's q gets
   ``0 * out[..., :1]`` of the previous one added, so they run in order on the device),
   ended by block_until_ready, divided by --chain; the median of --iters samples;
   compile (the first call) apart. Reported: ms, TFLOP/s (2 * B * G * S * (576 + 512)
   flops), the fraction of the chip's spec bandwidth the cache read reaches
   (B * S * 576 * 2 bytes / time; H100 3.35 TB/s, H200 4.8 TB/s) and the fraction of the
   floor.
3. 8-bit device time (unless --skip-8bit), B=64 S=4096 at G=16 and 128, B=8 S=32768 at
   G=128: mosaic bf16 (mla_decode over the bf16 cache: the baseline), then per dtype
   mosaic 8-bit (mla_decode with k_scale) and triton 8-bit (flash_decode with k_scale,
   impl="pallas"); the bytes are B * S * (576 + 4) for 8-bit caches.

  python benchmarks/bench_mosaic_gpu.py --json PATH     # ~100 s on an H200 (jax 0.11.2), bf16 only;
                                                        # the 8-bit part adds about 2.5 min (unmeasured)
  python benchmarks/bench_mosaic_gpu.py --interpret     # CPU: two tiny shapes, interpreter, ~80 s

Each chained call of the Mosaic kernel is compiled by ptxas on its own (about 2 s each),
so --chain sets the compile time too: the default 4 keeps the run under 2 minutes;
--chain 10 gives steadier device times (run-to-run spread of the 0.1-0.3 ms rows was up
to 2x with 4) at about 4 minutes. The JSON file holds "records" (benchmarks/_records.py:
timing rows, with tflops, spec_bw_fraction, chip and compile_s) and "rows" (every row,
the correctness checks included).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import fdecode
from _records import add_json_arg, machine_line, record, write  # benchmarks/ is on sys.path when a script here runs
from fdecode.kernels import mosaic_gpu
from fdecode.cache.quant import quantize

DK, DV = 576, 512
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


def spec_bandwidth() -> tuple[str, float]:
  kind = jax.devices()[0].device_kind
  for name, bw in SPEC_BANDWIDTH.items():
    if name in kind:
      return name, bw
  return kind + " (taken as H100)", SPEC_BANDWIDTH["H100"]


def short_error(e: BaseException) -> str:
  lines = [l for l in str(e).strip().splitlines() if l.strip()]
  return f"{type(e).__name__}: {(lines[-1] if lines else '')[:300]}"


def oracle(q, k, lengths, scale, k_scale=None):
  """float64 MLA decode of q [B, G, 576] over k [B, 1, S, 576] (values k[..., :512]);
  8-bit: the real latent is ``k * k_scale`` (k_scale [B, 1, S, 1])."""
  q, k = np.asarray(q, np.float64), np.asarray(np.asarray(k, np.float32), np.float64)[:, 0]
  if k_scale is not None:
    k = k * np.asarray(k_scale, np.float64)[:, 0]
  b, g, _ = q.shape
  s = k.shape[1]
  out = np.zeros((b, g, DV))
  lse = np.full((b, g), -np.inf)
  for i in range(b):
    n = int(lengths[i])
    if n == 0:
      continue
    scores = q[i] @ k[i, :n].T * scale  # [G, n]
    m = scores.max(axis=1, keepdims=True)
    p = np.exp(scores - m)
    l = p.sum(axis=1, keepdims=True)
    out[i] = p @ k[i, :n, :DV] / l
    lse[i] = (m + np.log(l))[:, 0]
  return out, lse


def compare(name, fn, q, k, lengths, want_out, want_lse, rows, shape, *extra):
  try:
    out, lse = fn(q, k, lengths, *extra)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    inf_ok = bool(np.array_equal(np.isneginf(lse), np.isneginf(want_lse)))
    fin = np.isfinite(want_lse)
    err_o = float(np.max(np.abs(out - want_out))) if out.size else 0.0
    err_l = float(np.max(np.abs(lse[fin] - want_lse[fin]))) if fin.any() else 0.0
    nan = bool(np.isnan(out).any() or np.isnan(lse).any())
    ok = inf_ok and not nan and err_o < 2e-2 and err_l < 1e-2
    print(f"  {name:30s} max|out-oracle| {err_o:.2e}  max|lse-oracle| {err_l:.2e}  -inf rows agree {inf_ok}"
          f"  NaN {nan}  {'ok' if ok else 'FAIL'}", flush=True)
    rows.append(dict(section="correctness", contender=name, shape=shape, max_err_out=err_o,
                     max_err_lse=err_l, inf_rows_agree=inf_ok, nan=nan, ok=ok))
  except Exception as e:  # noqa: BLE001 - report and go on
    print(f"  {name:30s} FAILED: {short_error(e)}", flush=True)
    traceback.print_exc(limit=3)
    rows.append(dict(section="correctness", contender=name, shape=shape, error=short_error(e)))


def correctness(rows, shapes, interpret):
  print("\n## correctness against a float64 oracle (bf16 inputs; tolerance out 2e-2, lse 1e-2)", flush=True)
  params = mosaic_gpu_interpret_params() if interpret else None
  for b, g, s in shapes:
    rng = np.random.default_rng(b * 1000 + g + s)
    q = jnp.asarray(rng.standard_normal((b, g, DK)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, 1, s, DK)), jnp.bfloat16)
    lengths = rng.integers(0, s + 1, b)
    lengths[0] = s
    if b > 1:
      lengths[1] = 0
    lengths = jnp.asarray(lengths, jnp.int32)
    scale = 1 / math.sqrt(DK)
    want_out, want_lse = oracle(q, k, np.asarray(lengths), scale)
    shape = dict(B=b, G=g, S=s, lengths=[int(x) for x in lengths])
    print(f"B={b} G={g} S={s} lengths={shape['lengths']}", flush=True)
    mosaic = jax.jit(lambda q, k, n: mosaic_gpu.mla_decode(q, k, n, return_lse=True, interpret=params))
    compare("mosaic", mosaic, q, k, lengths, want_out, want_lse, rows, shape)
    # Dead slots hold garbage (NaN past each length): selected away, the same answer.
    dead = jnp.arange(s)[None, None, :, None] >= lengths[:, None, None, None]
    compare("mosaic, NaN past the lengths", mosaic, q, jnp.where(dead, jnp.nan, k).astype(k.dtype), lengths,
            want_out, want_lse, rows, shape)
    if not interpret:
      triton = jax.jit(lambda q, k, n: fdecode.flash_decode(q, k, None, n, v_head_dim=DV, impl="pallas",
                                                            return_lse=True))
      compare("triton", triton, q, k, lengths, want_out, want_lse, rows, shape)


def correctness_8bit(rows, shapes, interpret):
  print("\n## 8-bit caches (per-token scales) against a float64 oracle of the same codes", flush=True)
  params = mosaic_gpu_interpret_params() if interpret else None
  mosaic = jax.jit(lambda q, k, n, ks: mosaic_gpu.mla_decode(q, k, n, k_scale=ks, return_lse=True, interpret=params))
  triton = jax.jit(lambda q, k, n, ks: fdecode.flash_decode(q, k, None, n, v_head_dim=DV, k_scale=ks,
                                                            impl="pallas", return_lse=True))
  for b, g, s in shapes:
    rng = np.random.default_rng(b * 1000 + g + s + 1)
    q = jnp.asarray(rng.standard_normal((b, g, DK)), jnp.bfloat16)
    lengths = rng.integers(0, s + 1, b)
    lengths[0] = s
    if b > 1:
      lengths[1] = 0
    lengths = jnp.asarray(lengths, jnp.int32)
    dead = jnp.arange(s)[None, None, :, None] >= lengths[:, None, None, None]
    for dtype in (jnp.int8, jnp.float8_e4m3fn):
      k, ks = quantize(jnp.asarray(rng.standard_normal((b, 1, s, DK)), jnp.float32), dtype)
      want_out, want_lse = oracle(q, k, np.asarray(lengths), 1 / math.sqrt(DK), ks)
      shape = dict(B=b, G=g, S=s, dtype=jnp.dtype(dtype).name, lengths=[int(x) for x in lengths])
      print(f"B={b} G={g} S={s} {shape['dtype']} lengths={shape['lengths']}", flush=True)
      compare("mosaic 8-bit", mosaic, q, k, lengths, want_out, want_lse, rows, shape, ks)
      code, bad_scale = (127, jnp.nan) if dtype == jnp.int8 else (jnp.nan, jnp.inf)
      k_bad = jnp.where(dead, jnp.asarray(code, jnp.float32).astype(dtype), k)
      compare("mosaic 8-bit, garbage past", mosaic, q, k_bad, lengths, want_out, want_lse, rows, shape,
              jnp.where(dead, bad_scale, ks))
      if not interpret:
        compare("triton 8-bit", triton, q, k, lengths, want_out, want_lse, rows, shape, ks)


def mosaic_gpu_interpret_params():
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # pylint: disable=g-import-not-at-top
  return InterpretGPUParams()


def chained(fn, n):
  """n dependent calls of ``fn(q, *rest) -> out [B, G, 512]`` in one program."""
  def run(q, *rest):
    out = None
    for _ in range(n):
      out = fn(q, *rest)
      q = q + (out[..., :1] * 0).astype(q.dtype)
    return out
  return jax.jit(run)


def device_time(fn, args, *, chain, iters):
  f = chained(fn, chain)
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  compile_s = time.perf_counter() - t0
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    samples.append((time.perf_counter() - t0) / chain)
  return statistics.median(samples), min(samples), compile_s


def partials_only(q, k, lengths):
  """The kernel alone: mla_partials with mla_decode's plan, its split 0 as the output."""
  b, g, _ = q.shape
  plan = mosaic_gpu.mla_plan(batch=b, num_tokens=1, group=g, seq_len=k.shape[2], softmax_scale=1 / math.sqrt(DK))
  o, _ = mosaic_gpu.mla_partials(q.reshape(b, 1, g, DK), lengths, k, plan=plan)
  return o[:, 0, 0].reshape(b, g, DV)


def floor_read(q, k, lengths):
  """One streaming read of the cache: a sum scaled by a scalar of q (so that chained
  calls are not one common subexpression), shaped like an output."""
  del lengths
  c = 1 + q[0, 0, 0].astype(jnp.float32) * 0
  total = jnp.sum(k.astype(jnp.float32) * c)
  return jnp.broadcast_to(total, q.shape[:2] + (DV,)).astype(q.dtype)


def timing(rows, configs, *, chain, iters):
  chip, bw = spec_bandwidth()
  print(f"\n## device time ({chip}, spec {bw / 1e12:.2f} TB/s; {chain} chained calls a sample, "
        f"median of {iters})", flush=True)
  print("| B | G | S | contender | ms | min ms | compile s | TFLOP/s | fraction of spec bw | fraction of floor |")
  print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
  for b, s, g in configs:
    key = jax.random.key(b * 7 + s + g)
    q = jax.random.normal(key, (b, g, DK), jnp.bfloat16)
    k = jax.random.normal(jax.random.fold_in(key, 1), (b, 1, s, DK), jnp.bfloat16)
    lengths = jnp.full((b,), s, jnp.int32)
    nbytes = b * s * DK * 2
    flops = 2 * b * g * s * (DK + DV)
    contenders = [
        ("floor (f32 sum of the cache)", floor_read),
        ("mosaic (mla_decode)", lambda q, k, n: mosaic_gpu.mla_decode(q, k, n)),
        ("mosaic kernel only (partials)", partials_only),
        ("triton (flash_decode pallas)",
         lambda q, k, n: fdecode.flash_decode(q, k, None, n, v_head_dim=DV, impl="pallas")),
    ]
    floor = None
    for name, fn in contenders:
      sec = time_row(rows, name, fn, (q, k, lengths), dict(B=b, G=g, S=s), nbytes=nbytes, flops=flops, floor=floor,
                     chain=chain, iters=iters)
      floor = sec if name.startswith("floor") else floor
    print(f"| {b} | {g} | {s} | bytes floor at spec | {nbytes / bw * 1e3:.3f} | | | "
          f"{flops / (nbytes / bw) / 1e12:.1f} | 1.00 | |", flush=True)


def time_row(rows, name, fn, args, shape, *, nbytes, flops, floor, chain, iters, dtype="bfloat16"):
  """One timing row (printed and appended to ``rows``); returns the median seconds or None."""
  chip, bw = spec_bandwidth()
  b, g, s = shape["B"], shape["G"], shape["S"]
  try:
    sec, best, comp = device_time(fn, args, chain=chain, iters=iters)
  except Exception as e:  # noqa: BLE001 - report and go on
    print(f"| {b} | {g} | {s} | {name} | failed: {short_error(e)} | | | | |", flush=True)
    rows.append(dict(section="timing", contender=name, shape=shape, error=short_error(e)))
    return None
  floor = sec if floor is None and name.startswith("floor") else floor
  frac_floor = floor / sec if floor else None
  print(f"| {b} | {g} | {s} | {name} | {sec * 1e3:.3f} | {best * 1e3:.3f} | {comp:.1f} | "
        f"{flops / sec / 1e12:.1f} | {nbytes / sec / bw:.2f} | {'' if frac_floor is None else f'{frac_floor:.2f}'} |",
        flush=True)
  rows.append(dict(section="timing", contender=name, shape=shape, median_ms=sec * 1e3, min_ms=best * 1e3,
                   compile_s=comp, tflops=flops / sec / 1e12, spec_bw_fraction=nbytes / sec / bw,
                   floor_fraction=frac_floor, chip=chip, nbytes=nbytes, seconds=sec, floor_seconds=floor, dtype=dtype))
  return sec


def timing_8bit(rows, configs, *, chain, iters):
  """Per config: mosaic bf16 (the baseline), then mosaic and triton over int8 and e4m3
  caches quantized per token from the same float cache."""
  chip, bw = spec_bandwidth()
  print(f"\n## 8-bit device time ({chip}, spec {bw / 1e12:.2f} TB/s; 8-bit bytes B * S * (576 + 4))", flush=True)
  print("| B | G | S | contender | ms | min ms | compile s | TFLOP/s | fraction of spec bw | |")
  print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
  mosaic8 = lambda q, k, n, ks: mosaic_gpu.mla_decode(q, k, n, k_scale=ks)
  triton8 = lambda q, k, n, ks: fdecode.flash_decode(q, k, None, n, v_head_dim=DV, k_scale=ks, impl="pallas")
  for b, s, g in configs:
    key = jax.random.key(b * 7 + s + g + 1)
    q = jax.random.normal(key, (b, g, DK), jnp.bfloat16)
    kf = jax.random.normal(jax.random.fold_in(key, 1), (b, 1, s, DK), jnp.float32)
    lengths = jnp.full((b,), s, jnp.int32)
    shape, flops = dict(B=b, G=g, S=s), 2 * b * g * s * (DK + DV)
    time_row(rows, "mosaic bf16 (mla_decode)", lambda q, k, n: mosaic_gpu.mla_decode(q, k, n),
             (q, kf.astype(jnp.bfloat16), lengths), shape, nbytes=b * s * DK * 2, flops=flops, floor=None,
             chain=chain, iters=iters)
    for dtype in (jnp.int8, jnp.float8_e4m3fn):
      k, ks = quantize(kf, dtype)
      name = jnp.dtype(dtype).name
      for contender, fn in ((f"mosaic {name} (mla_decode k_scale)", mosaic8),
                            (f"triton {name} (flash_decode pallas)", triton8)):
        time_row(rows, contender, fn, (q, k, lengths, ks), shape, nbytes=b * s * (DK + 4), flops=flops, floor=None,
                 chain=chain, iters=iters, dtype=name)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_json_arg(parser, "bench_mosaic_gpu")
  parser.add_argument("--chain", type=int, default=4)
  parser.add_argument("--iters", type=int, default=7)
  parser.add_argument("--interpret", action="store_true", help="CPU: tiny shapes under the interpreter, no timing")
  parser.add_argument("--skip-8bit", action="store_true", help="no 8-bit device times (their correctness still runs)")
  args = parser.parse_args(argv)
  start = time.time()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {jax.devices()[0].device_kind}", flush=True)
  rows = []
  if args.interpret:
    correctness(rows, [(1, 16, 1), (2, 16, 65)], interpret=True)  # no timing: the interpreter is no GPU
    correctness_8bit(rows, [(2, 16, 65)], interpret=True)
  else:
    correctness(rows, [(1, 16, 1), (4, 16, 777), (4, 64, 777), (1, 128, 4096), (4, 128, 4096)], interpret=False)
    correctness_8bit(rows, [(1, 16, 1), (4, 16, 777), (4, 128, 4096)], interpret=False)
    timing(rows, [(64, 4096, 16), (64, 4096, 128), (8, 32768, 16), (8, 32768, 128)],
           chain=args.chain, iters=args.iters)
    if not args.skip_8bit:
      timing_8bit(rows, [(64, 4096, 16), (64, 4096, 128), (8, 32768, 128)], chain=args.chain, iters=args.iters)
  print(f"\ntotal {time.time() - start:.0f} s", flush=True)
  machine = machine_line()
  records = [record("bench_mosaic_gpu", r["contender"], shape=r["shape"], dtype=r["dtype"], seconds=r["seconds"],
                    nbytes=r["nbytes"], floor_seconds=r["floor_seconds"], machine=machine, chip=r["chip"],
                    tflops=r["tflops"], spec_bw_fraction=r["spec_bw_fraction"], compile_s=r["compile_s"])
             for r in rows if r["section"] == "timing" and "seconds" in r]
  write(args.json, "bench_mosaic_gpu", records, machine=machine, rows=rows)
  failed = [r for r in rows if r["section"] == "correctness" and not r.get("ok")]
  print(f"correctness: {len(failed)} failed of {sum(r['section'] == 'correctness' for r in rows)}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
