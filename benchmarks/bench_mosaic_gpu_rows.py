"""The Hopper GQA rows kernel (`fdecode.kernels.mosaic_gpu.rows_decode`) on a GPU, in one
short run (prepared without a GPU: only ``--interpret`` has run).

GQA decode of T new tokens x G query heads per kv head (T * G rows a wgmma tile) over a
contiguous ``[B, Hkv, S, D]`` cache or a paged pool ``[Hkv, P, page_size, D]`` with a
shuffled block table (rows with a page size), bf16 and 8-bit with per-token scales. Two
parts, each contender guarded (one that fails prints its error and the run goes on):

1. correctness against a float64 numpy oracle (the dequantized cache, causal over the T
   tokens): max |out - oracle|, max |lse - oracle| over finite rows, -inf rows agree,
   and the same with NaN in every slot past the lengths (selected away).
2. device time at full lengths, ``rows_decode`` against the Triton path
   (``flash_decode(impl="pallas")``) on the same data (paged: the same pool and table):
   a sample is one jitted program of --chain dependent calls (each call's q gets
   ``0 * out[..., :1]`` of the previous one), median of --iters, compile apart; the
   fraction of the chip's spec bandwidth the cache read reaches (B * Hkv * S * 2D bytes
   per element byte).
3. ``ragged_decode(impl="mosaic_gpu")`` (opt-in: the decode part and the batched prefill
   blocks on the rows kernel) against ``ragged_decode`` as dispatched by default (Triton
   on GPU) on bench_ragged's mixed serving step (a prefill chunk beside decodes, one
   paged pool): correctness against ``impl="reference"``, then device time as in 2.

  python benchmarks/bench_mosaic_gpu_rows.py --json PATH   # GPU (jax 0.11.2); a few minutes
  python benchmarks/bench_mosaic_gpu_rows.py --interpret   # CPU: tiny shapes, interpreter
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
from _records import add_json_arg, machine_line, record, write  # benchmarks/ is on sys.path
from bench_mosaic_gpu import short_error, spec_bandwidth
from bench_ragged import make_step
from fdecode.kernels import mosaic_gpu
from fdecode.cache.quant import quantize


def make(seed, b, t, hq, hkv, s, d, dtype):
  """q bf16 [B, T, Hq, D]; k, v [B, Hkv, S, D] in dtype; scales f32 [B, Hkv, S, 1] or None."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((b, hkv, s, d)), jnp.float32) for _ in range(2))
  if dtype == "bfloat16":
    return q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), None, None
  (k, ks), (v, vs) = quantize(k, dtype), quantize(v, dtype)
  return q, k, v, ks, vs


def to_pool(x, page_size, perm):
  """``[B, Hkv, S, ...]`` -> a pool ``[Hkv, B * n, page_size, ...]`` holding page j of
  sequence b at ``perm[b * n + j]`` (the table is ``perm.reshape(B, n)``)."""
  b, hkv, s = x.shape[:3]
  n, rest = s // page_size, x.shape[3:]
  pages = jnp.moveaxis(x.reshape(b, hkv, n, page_size, *rest), 1, 0).reshape(hkv, b * n, page_size, *rest)
  return jnp.zeros_like(pages).at[:, perm].set(pages)


def cache_args(k, v, ks, vs, page_size, seed):
  """(k, v, ks, vs, block_tables): the contiguous cache as it is (table None), or as a
  paged pool with a shuffled table."""
  if not page_size:
    return k, v, ks, vs, None
  b, _, s = k.shape[:3]
  perm = np.random.default_rng(seed).permutation(b * (s // page_size))
  pool = lambda x: None if x is None else to_pool(x, page_size, perm)
  return pool(k), pool(v), pool(ks), pool(vs), jnp.asarray(perm.reshape(b, -1), jnp.int32)


def oracle(q, k, v, ks, vs, lengths):
  """float64 causal decode: token t of a sequence of length L sees keys < L - T + t + 1."""
  deq = lambda x, sc: np.asarray(x.astype(jnp.float32), np.float64) * (1.0 if sc is None else np.asarray(sc))
  q, k, v = np.asarray(q, np.float64), deq(k, ks), deq(v, vs)
  b, t, hq, d = q.shape
  g = hq // k.shape[1]
  out, lse = np.zeros(q.shape), np.full((b, t, hq), -np.inf)
  for i in range(b):
    for j in range(t):
      n = int(lengths[i]) - t + j + 1
      if n <= 0:
        continue
      for h in range(hq):
        sc = k[i, h // g, :n] @ q[i, j, h] / math.sqrt(d)
        m = sc.max()
        p = np.exp(sc - m)
        out[i, j, h] = p @ v[i, h // g, :n] / p.sum()
        lse[i, j, h] = m + np.log(p.sum())
  return out, lse


def check(name, fn, args, want, rows, shape):
  try:
    out, lse = (np.asarray(x, np.float64) for x in fn(*args))
    inf_ok = bool(np.array_equal(np.isneginf(lse), np.isneginf(want[1])))
    fin = np.isfinite(want[1])
    err_o = float(np.max(np.abs(out - want[0])))
    err_l = float(np.max(np.abs(lse[fin] - want[1][fin]))) if fin.any() else 0.0
    nan = bool(np.isnan(out).any() or np.isnan(lse).any())
    ok = inf_ok and not nan and err_o < 3e-2 and err_l < 1e-2
    print(f"  {name:34s} max|out-oracle| {err_o:.2e}  max|lse-oracle| {err_l:.2e}  -inf rows agree {inf_ok}"
          f"  NaN {nan}  {'ok' if ok else 'FAIL'}", flush=True)
    rows.append(dict(section="correctness", contender=name, shape=shape, max_err_out=err_o, max_err_lse=err_l,
                     inf_rows_agree=inf_ok, nan=nan, ok=ok))
  except Exception as e:  # noqa: BLE001 - report and go on
    print(f"  {name:34s} FAILED: {short_error(e)}", flush=True)
    traceback.print_exc(limit=3)
    rows.append(dict(section="correctness", contender=name, shape=shape, error=short_error(e)))


def correctness(rows, shapes, interpret):
  print("\n## correctness against a float64 oracle (tolerance out 3e-2, lse 1e-2)", flush=True)
  params = None
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # pylint: disable=g-import-not-at-top
    params = InterpretGPUParams()
  for b, t, hq, hkv, s, d, dtype, *paged in shapes:
    ps = paged[0] if paged else None
    q, k, v, ks, vs = make(b + t + s + d, b, t, hq, hkv, s, d, dtype)
    lengths = np.random.default_rng(s).integers(0, s + 1, b)
    lengths[0] = s
    lengths = jnp.asarray(lengths, jnp.int32)
    want = oracle(q, k, v, ks, vs, np.asarray(lengths))
    shape = dict(B=b, T=t, Hq=hq, Hkv=hkv, S=s, D=d, dtype=dtype, lengths=[int(x) for x in lengths], page_size=ps)
    print(f"{shape}", flush=True)
    mosaic = jax.jit(lambda q, k, v, n, ks, vs, bt: mosaic_gpu.rows_decode(
        q, k, v, n, block_tables=bt, k_scale=ks, v_scale=vs, return_lse=True, interpret=params))

    def args(k, v):
      k, v, k_scale, v_scale, tables = cache_args(k, v, ks, vs, ps, s)
      return q, k, v, lengths, k_scale, v_scale, tables
    check("mosaic (rows_decode)", mosaic, args(k, v), want, rows, shape)
    dead = jnp.arange(s)[None, None, :, None] >= lengths[:, None, None, None]
    garbage = lambda x: jnp.where(dead, jnp.nan, x.astype(jnp.float32)).astype(x.dtype)
    check("mosaic, NaN past the lengths", mosaic, args(garbage(k), garbage(v)), want, rows, shape)
    if not interpret:
      triton = jax.jit(lambda q, k, v, n, ks, vs, bt: fdecode.flash_decode(
          q, k, v, n, block_tables=bt, k_scale=ks, v_scale=vs, impl="pallas", return_lse=True))
      check("triton (flash_decode pallas)", triton, args(k, v), want, rows, shape)


def device_time(fn, args, *, chain, iters):
  """Median / min seconds of one call of ``fn(q, *rest) -> out``, and the compile time."""
  def run(q, *rest):
    out = None
    for _ in range(chain):
      out = fn(q, *rest)
      q = q + (out[..., :1] * 0).astype(q.dtype)
    return out
  f = jax.jit(run)
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))
  compile_s = time.perf_counter() - t0
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    samples.append((time.perf_counter() - t0) / chain)
  return statistics.median(samples), min(samples), compile_s


def timing(rows, configs, *, chain, iters):
  chip, bw = spec_bandwidth()
  print(f"\n## device time ({chip}, spec {bw / 1e12:.2f} TB/s; {chain} chained calls a sample, median of {iters})")
  print("| B | T | Hq | Hkv | S | D | cache | page size | contender | ms | min ms | compile s | fraction of spec bw |")
  print("|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|", flush=True)
  for b, t, hq, hkv, s, d, dtype, *paged in configs:
    ps = paged[0] if paged else None
    q, k, v, ks, vs = make(0, b, t, hq, hkv, s, d, dtype)
    k, v, ks, vs, bt = cache_args(k, v, ks, vs, ps, 0)
    lengths = jnp.full((b,), s, jnp.int32)
    nbytes = 2 * b * hkv * s * d * k.dtype.itemsize + (0 if ks is None else 2 * b * hkv * s * 4)
    contenders = [("mosaic (rows_decode)", lambda q, k, v, n, ks, vs, bt: mosaic_gpu.rows_decode(
        q, k, v, n, block_tables=bt, k_scale=ks, v_scale=vs)),
                  ("triton (flash_decode pallas)", lambda q, k, v, n, ks, vs, bt: fdecode.flash_decode(
                      q, k, v, n, block_tables=bt, k_scale=ks, v_scale=vs, impl="pallas"))]
    shape = dict(B=b, T=t, Hq=hq, Hkv=hkv, S=s, D=d, page_size=ps)
    for name, fn in contenders:
      head = f"| {b} | {t} | {hq} | {hkv} | {s} | {d} | {dtype} | {ps or '-'} | {name} |"
      try:
        sec, best, comp = device_time(fn, (q, k, v, lengths, ks, vs, bt), chain=chain, iters=iters)
      except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{head} failed: {short_error(e)} | | | |", flush=True)
        rows.append(dict(section="timing", contender=name, shape=shape, dtype=dtype, error=short_error(e)))
        continue
      print(f"{head} {sec * 1e3:.3f} | {best * 1e3:.3f} | {comp:.1f} | {nbytes / sec / bw:.2f} |", flush=True)
      rows.append(dict(section="timing", contender=name, shape=shape, dtype=dtype, median_ms=sec * 1e3,
                       min_ms=best * 1e3, compile_s=comp, spec_bw_fraction=nbytes / sec / bw, chip=chip,
                       nbytes=nbytes, seconds=sec))


def ragged(rows, steps, *, params, timed, chain, iters):
  """Section 3 over ``steps`` (B, context, chunk, Hkv, Hq, D, page_size), bf16: one
  chunk of C tokens (sequence 0) beside B - 1 decodes, every sequence at the context;
  ``timed``: device time, else correctness against ``impl="reference"``."""
  print("\n## ragged_decode(impl='mosaic_gpu') against the default dispatch (mixed step: chunk + decodes)",
        flush=True)
  if timed:
    chip, bw = spec_bandwidth()
    print(f"({chip}; {chain} chained calls a sample, median of {iters})")
  for b, ctx, chunk, hkv, hq, d, ps in steps:
    q, k, v, tables, cu, lens = make_step(b, ctx, chunk, hkv, hq, d, ps, jnp.bfloat16)
    shape = dict(B=b, L=ctx, C=chunk, Hkv=hkv, Hq=hq, D=d, page_size=ps)
    print(f"{shape}", flush=True)
    step = lambda **kw: (lambda q, k, v, n, t, c: fdecode.ragged_decode(q, k, v, n, t, c, b, **kw))
    contenders = [("ragged_decode mosaic_gpu", dict(impl="mosaic_gpu", interpret=params)),
                  ("ragged_decode default", {})]
    args = (q, k, v, lens, tables, cu)
    if not timed:  # correctness only (small steps); timed steps: time only
      want = [np.asarray(x, np.float64) for x in step(impl="reference", return_lse=True)(*args)]
      for name, kw in contenders[:1 if params else 2]:  # on CPU the default is the XLA path: not this check's
        check(name, jax.jit(step(return_lse=True, **kw)), args, want, rows, shape)
      continue
    nbytes = 2 * b * ctx * hkv * d * 2
    for name, kw in contenders:
      fn = step(**kw)
      head = f"| ragged {b} x {ctx}, chunk {chunk} | Hkv={hkv} Hq={hq} D={d} pages {ps} | {name} |"
      try:
        sec, best, comp = device_time(fn, args, chain=chain, iters=iters)
      except Exception as e:  # noqa: BLE001 - report and go on
        print(f"{head} failed: {short_error(e)}", flush=True)
        rows.append(dict(section="timing", contender=name, shape=shape, dtype="bfloat16", error=short_error(e)))
        continue
      print(f"{head} {sec * 1e3:.3f} ms | min {best * 1e3:.3f} | compile {comp:.1f} s | "
            f"{nbytes / sec / bw:.2f} of spec bw |", flush=True)
      rows.append(dict(section="timing", contender=name, shape=shape, dtype="bfloat16", median_ms=sec * 1e3,
                       min_ms=best * 1e3, compile_s=comp, spec_bw_fraction=nbytes / sec / bw, chip=chip,
                       nbytes=nbytes, seconds=sec))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_json_arg(parser, "bench_mosaic_gpu_rows")
  parser.add_argument("--chain", type=int, default=4)
  parser.add_argument("--iters", type=int, default=7)
  parser.add_argument("--interpret", action="store_true", help="CPU: tiny shapes under the interpreter, no timing")
  args = parser.parse_args(argv)
  start = time.time()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {jax.devices()[0].device_kind}", flush=True)
  rows = []
  if args.interpret:  # no timing: the interpreter is no GPU
    correctness(rows, [(2, 4, 16, 1, 70, 64, "bfloat16"), (1, 5, 16, 1, 70, 64, "int8"),
                       (2, 4, 16, 1, 96, 64, "int8", 16)], interpret=True)
    ragged(rows, [(2, 100, 70, 1, 2, 64, 16)], params=mosaic_gpu.InterpretGPUParams(), timed=False,
           chain=args.chain, iters=args.iters)
  else:
    correctness(rows, [(2, 4, 32, 2, 777, 128, "bfloat16"), (2, 16, 32, 8, 300, 128, "int8"),
                       (2, 8, 16, 2, 513, 256, "float8_e4m3fn"), (3, 1, 64, 1, 1000, 64, "bfloat16"),
                       (2, 4, 32, 2, 768, 128, "bfloat16", 16), (2, 8, 16, 2, 512, 128, "int8", 64)],
                interpret=False)
    configs = [(b, t, hq, hkv, s, d, dtype)
               for b, t, hq, hkv, s, d in [(8, 16, 32, 8, 8192, 128), (64, 16, 32, 8, 4096, 128),
                                           (8, 32, 16, 8, 8192, 256)]
               for dtype in ("bfloat16", "int8")]
    configs += [(8, 16, 32, 8, 8192, 128, dtype, ps) for dtype in ("bfloat16", "int8") for ps in (16, 64)]
    timing(rows, configs, chain=args.chain, iters=args.iters)
    # bench_ragged's step (G = 4: a decode's 4 rows padded to a 64-row tile) and one at G = 8
    ragged(rows, [(4, 300, 130, 2, 16, 128, 16)], params=None, timed=False, chain=args.chain, iters=args.iters)
    ragged(rows, [(64, 4096, 512, 2, 8, 128, 64), (16, 8192, 1024, 4, 32, 128, 64)], params=None, timed=True,
           chain=args.chain, iters=args.iters)
  print(f"\ntotal {time.time() - start:.0f} s", flush=True)
  machine = machine_line()
  records = [record("bench_mosaic_gpu_rows", r["contender"], shape=r["shape"], dtype=r["dtype"],
                    seconds=r["seconds"], nbytes=r["nbytes"], floor_seconds=None, machine=machine, chip=r["chip"],
                    spec_bw_fraction=r["spec_bw_fraction"], compile_s=r["compile_s"])
             for r in rows if r["section"] == "timing" and "seconds" in r]
  write(args.json, "bench_mosaic_gpu_rows", records, machine=machine, rows=rows)
  failed = [r for r in rows if r["section"] == "correctness" and not r.get("ok")]
  print(f"correctness: {len(failed)} failed of {sum(r['section'] == 'correctness' for r in rows)}", flush=True)
  return 1 if failed else 0  # scripts/gpu_check reports a failed part


if __name__ == "__main__":
  sys.exit(main())
