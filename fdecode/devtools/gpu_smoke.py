"""A correctness smoke across every kernel family, for the first call on a lent GPU
(`scripts/gpu_first_call`): a few small shapes per family, each against fdecode's float32
reference path (``impl="reference"``, computed under ``jax.default_matmul_precision("highest")``
so a GPU's float32 matmuls are not TF32), each case in its own try/except.

    python -m fdecode.devtools.gpu_smoke --out DIR [--interpret] [--families a,b]

Families: contiguous (Triton, bf16 / f32, GQA, T > 1), paged (page size 16 and 1),
token_major (``kv_layout="NHD"``), quant (int8 per-token scales, fp8 e4m3: against the
reference of the same 8-bit cache, which dequantizes), mla (``v=None``, Dv 512 of 576, G 16,
bf16), sparse (``indices=``), splits (``num_splits=4``: the combine kernel; ``"balance"``),
ragged (`ragged_decode` with the fused write: outputs and written caches against the
same call with ``impl="reference"``), and hopper (``impl="mosaic_gpu"``: MLA bf16, MLA
int8, rows bf16 / int8 / paged; on a GPU only on sm_90, else "skipped: <reason>").

On a GPU the Triton cases run the default dispatch (``impl=None``) or ``impl="pallas"``
compiled. ``--interpret`` (CPU): Triton cases as ``impl="pallas", interpret=True``, Hopper
ones under ``fdecode.kernels.mosaic_gpu.InterpretGPUParams()``, with tiny shapes.

Tolerances (max abs error of out and of lse, each against ``tol * (1 + |ref|)``): bf16
2.5e-2 (8-bit caches with bf16 queries too); f32 3e-5 interpreted, 5e-3 compiled on a GPU
(Triton's f32 dots may run in TF32, as tests/kernels/test_gpu_compiled.py allows).

Writes DIR/smoke.json ({"env": {...}, "cases": [{name, family, status, err_out, err_lse,
tol, seconds, error}]}) and prints a table. Exit 0 only if no case failed or errored.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from fdecode.devtools.interpret import compiled_once

FAMILIES = ("contiguous", "paged", "token_major", "quant", "mla", "sparse", "splits", "ragged", "hopper")
TOL = {"bf16": 2.5e-2, "f32": 3e-5, "f32_gpu": 5e-3}


def compare(got, want, tol):
  """(out, lse) against the reference's: {"status": "pass" | "fail", "err_out", "err_lse"}.
  Fails where any element is off by more than ``tol * (1 + |ref|)``, where shapes differ, or
  where the non-finite entries (e.g. lse -inf of an empty row) differ."""
  errs, ok = [], True
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    if g.shape != w.shape:
      return {"status": "fail", "err_out": None, "err_lse": None}
    fin = np.isfinite(w)
    if not np.array_equal(np.isfinite(g), fin) or not np.array_equal(g[~fin], w[~fin]):
      ok = False
    with np.errstate(invalid="ignore"):
      diff = np.abs(np.where(fin, g - w, 0.0))
    diff = np.where(np.isnan(diff), np.inf, diff)
    errs.append(float(diff.max()) if diff.size else 0.0)
    ok = ok and bool(np.all(diff <= tol * (1 + np.abs(np.where(fin, w, 0.0)))))
  return {"status": "pass" if ok else "fail", "err_out": errs[0], "err_lse": errs[1] if len(errs) > 1 else None}


def _hopper_skip_reason(interpret):
  """None when the Hopper kernels can run here, else why not."""
  if interpret:
    return None
  dev = jax.devices()[0]
  if dev.platform != "gpu":
    return f"needs an sm_90 GPU or --interpret; device is {dev.platform}"
  cc = str(getattr(dev, "compute_capability", ""))
  if cc and not cc.startswith("9."):
    return f"needs an sm_90 GPU; {dev.device_kind} is sm_{cc.replace('.', '')}"
  return None


def _cases(interpret):
  """(name, family, fn) with fn() -> (got, want, tol) or (list of (got, want), tol)."""
  import fdecode
  from fdecode.cache.quant import quantize
  from fdecode.kernels import mosaic_gpu

  tri = dict(impl="pallas", interpret=True) if interpret else {}
  pal = dict(impl="pallas", interpret=True) if interpret else dict(impl="pallas")
  mgpu = dict(impl="mosaic_gpu", interpret=mosaic_gpu.InterpretGPUParams()) if interpret else dict(impl="mosaic_gpu")
  s, d = (40, 32) if interpret else (300, 128)
  f32_tol = TOL["f32"] if interpret else TOL["f32_gpu"]
  rng = np.random.default_rng(0)

  def rand(shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

  def ref(*args, **kw):
    kw = {n: x for n, x in kw.items() if n not in ("impl", "interpret")}
    with jax.default_matmul_precision("highest"):
      return fdecode.flash_decode(*args, impl="reference", return_lse=True, **kw)

  def both(q, k, v, lengths, opts, tol, **kw):
    lengths = jnp.asarray(lengths, jnp.int32)
    return fdecode.flash_decode(q, k, v, lengths, return_lse=True, **opts, **kw), ref(q, k, v, lengths, **kw), tol

  def contiguous(dtype, t, hq, hkv, tol, opts=tri, **kw):
    def fn():
      qs = (2, hq, d) if t is None else (2, t, hq, d)
      return both(rand(qs, dtype), rand((2, hkv, s, d), dtype), rand((2, hkv, s, d), dtype), [s, s // 2 + 1],
                  opts, tol, **kw)
    return fn

  def paged(page_size, dtype=jnp.bfloat16, kv_dtype=None, **kw):
    def fn():
      n = -(-s // page_size)
      pages = 2 * n + 1
      tables = jnp.asarray(rng.permutation(pages)[:2 * n].reshape(2, n), jnp.int32)
      k, v = rand((2, pages, page_size, d)), rand((2, pages, page_size, d))
      extra = {}
      if kv_dtype is not None:
        (k, ks), (v, vs) = quantize(k, kv_dtype), quantize(v, kv_dtype)
        extra = dict(k_scale=ks, v_scale=vs)
      else:
        k, v = k.astype(dtype), v.astype(dtype)
      return both(rand((2, 4, d), dtype), k, v, [n * page_size, 7], tri, TOL["bf16"] if dtype == jnp.bfloat16
                  else f32_tol, block_tables=tables, **extra, **kw)
    return fn

  def token_major():
    q, k, v = rand((2, 3, 4, d), jnp.bfloat16), rand((2, s, 2, d), jnp.bfloat16), rand((2, s, 2, d), jnp.bfloat16)
    return both(q, k, v, [s, 9], tri, TOL["bf16"], kv_layout="NHD")

  def quant(qdtype):
    def fn():
      (k, ks), (v, vs) = quantize(rand((2, 2, s, d)), qdtype), quantize(rand((2, 2, s, d)), qdtype)
      return both(rand((2, 8, d), jnp.bfloat16), k, v, [s, 5], pal, TOL["bf16"], k_scale=ks, v_scale=vs)
    return fn

  def mla():
    sm = 32 if interpret else 256
    q, k = rand((2, 16, 576), jnp.bfloat16), rand((2, 1, sm, 576), jnp.bfloat16)
    return both(q, k, None, [sm, 3], tri, TOL["bf16"], v_head_dim=512)

  def sparse():
    idx = jnp.asarray(np.stack([rng.choice(s, 12, replace=False) for _ in range(2)]), jnp.int32)
    idx = idx.at[1, -3:].set(-1)
    q, k, v = rand((2, 4, d), jnp.bfloat16), rand((2, 2, s, d), jnp.bfloat16), rand((2, 2, s, d), jnp.bfloat16)
    return both(q, k, v, [s, s - 4], tri, TOL["bf16"], indices=idx)

  def ragged():
    page_size, hkv, hq = 16, 2, 4
    n = -(-s // page_size)
    pages = 2 * n + 1
    tables = jnp.asarray(rng.permutation(pages)[:2 * n].reshape(2, n), jnp.int32)
    k, v = rand((hkv, pages, page_size, d), jnp.bfloat16), rand((hkv, pages, page_size, d), jnp.bfloat16)
    q_lens, kv_lens = [1, 5], [s - 3, 9]
    rows = sum(q_lens) + 2  # two padding rows
    cu = jnp.asarray([0, 1, 6], jnp.int32)
    q, nk, nv = rand((rows, hq, d), jnp.bfloat16), rand((rows, hkv, d), jnp.bfloat16), rand((rows, hkv, d), jnp.bfloat16)
    args = (q, k, v, jnp.asarray(kv_lens, jnp.int32), tables, cu, 2)
    got = fdecode.ragged_decode(*args, new_k=nk, new_v=nv, return_lse=True, **tri)
    try:
      with jax.default_matmul_precision("highest"):
        want = fdecode.ragged_decode(*args, new_k=nk, new_v=nv, return_lse=True, impl="reference")
    except (ValueError, NotImplementedError):  # the reference path does not write: the caches against XLA's
      with jax.default_matmul_precision("highest"):
        want = fdecode.ragged_decode(*args, new_k=nk, new_v=nv, return_lse=True, impl="xla")
    return [(got[:2], want[:2]), ((got[2], got[3]), (want[2], want[3]))], TOL["bf16"]

  def hopper_mla(qdtype):
    def fn():
      sm = 64 if interpret else 256
      q = rand((1 if interpret else 2, 16, 576), jnp.bfloat16)
      k = rand((q.shape[0], 1, sm, 576))
      kw = {}
      if qdtype is None:
        k = k.astype(jnp.bfloat16)
      else:
        k, kw["k_scale"] = quantize(k, qdtype)
      lengths = [sm - 5] + ([sm // 3] if q.shape[0] > 1 else [])
      return both(q, k, None, lengths, mgpu, TOL["bf16"], v_head_dim=512, num_splits=1 if interpret else None, **kw)
    return fn

  def hopper_rows(qdtype, page_size=None):
    def fn():
      b, sm, dh = (1, 64, 64) if interpret else (2, 256, 128)
      q = rand((b, 4, 16, dh), jnp.bfloat16)
      kw = dict(num_splits=1) if interpret else {}
      if page_size:
        n = sm // page_size
        kw["block_tables"] = jnp.asarray(rng.permutation(b * n + 1)[:b * n].reshape(b, n), jnp.int32)
        shape = (1, b * n + 1, page_size, dh)
      else:
        shape = (b, 1, sm, dh)
      k, v = rand(shape), rand(shape)
      if qdtype is None:
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
      else:
        (k, kw["k_scale"]), (v, kw["v_scale"]) = quantize(k, qdtype), quantize(v, qdtype)
      lengths = [sm - 3] + [sm // 2] * (b - 1)
      return both(q, k, v, lengths, mgpu, TOL["bf16"], **kw)
    return fn

  bf, f32 = TOL["bf16"], f32_tol
  return [
      ("contiguous_bf16_gqa4", "contiguous", contiguous(jnp.bfloat16, None, 8, 2, bf)),
      ("contiguous_f32_gqa2_T3", "contiguous", contiguous(jnp.float32, 3, 4, 2, f32)),
      ("contiguous_bf16_mqa_T3_pallas", "contiguous", contiguous(jnp.bfloat16, 3, 4, 1, bf, opts=pal)),
      ("paged16_bf16", "paged", paged(16)),
      ("paged1_f32", "paged", paged(1, jnp.float32)),
      ("token_major_nhd_bf16_T3", "token_major", token_major),
      ("quant_int8_per_token", "quant", quant(jnp.int8)),
      ("quant_fp8_e4m3_per_token", "quant", quant(jnp.float8_e4m3fn)),
      ("quant_int8_paged16", "quant", paged(16, kv_dtype=jnp.int8)),
      ("mla_bf16_g16", "mla", mla),
      ("sparse_indices_bf16", "sparse", sparse),
      ("splits4_bf16", "splits", contiguous(jnp.bfloat16, None, 8, 2, bf, num_splits=4)),
      ("splits_balance_paged16", "splits", paged(16, num_splits="balance")),
      ("ragged_fused_write_paged16", "ragged", ragged),
      ("hopper_mla_bf16", "hopper", hopper_mla(None)),
      ("hopper_mla_int8", "hopper", hopper_mla(jnp.int8)),
      ("hopper_rows_bf16", "hopper", hopper_rows(None)),
      ("hopper_rows_int8", "hopper", hopper_rows(jnp.int8)),
      ("hopper_rows_paged16_bf16", "hopper", hopper_rows(None, page_size=16)),
  ]


def run(interpret=False, families=None):
  """Every case (of ``families``, default all): a list of result dicts."""
  results = []
  hopper_skip = _hopper_skip_reason(interpret)
  for name, family, fn in _cases(interpret):
    if families and family not in families:
      continue
    rec = {"name": name, "family": family, "status": "error", "err_out": None, "err_lse": None, "tol": None,
           "seconds": 0.0, "error": None}
    start = time.perf_counter()
    try:
      if family == "hopper" and hopper_skip:
        rec.update(status="skipped", error=f"skipped: {hopper_skip}")
      else:
        with compiled_once() if (interpret and family == "hopper") else contextlib.nullcontext():
          res = fn()
        if isinstance(res[0], list):  # several (got, want) pairs, one tolerance
          pairs, tol = res
        else:
          pairs, tol = [(res[0], res[1])], res[2]
        rec["tol"] = tol
        outs = [compare(g, w, tol) for g, w in pairs]
        rec["status"] = "pass" if all(o["status"] == "pass" for o in outs) else "fail"
        rec["err_out"] = max(o["err_out"] if o["err_out"] is not None else float("inf") for o in outs)
        lses = [o["err_lse"] for o in outs if o["err_lse"] is not None]
        rec["err_lse"] = max(lses) if lses else None
    except ValueError as e:
      if family == "hopper" and ("sm_90" in str(e)):
        rec.update(status="skipped", error=f"skipped: {e}")
      else:
        rec.update(status="error", error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
    except Exception as e:  # noqa: BLE001  (one case's failure never stops the others)
      rec.update(status="error", error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
    rec["seconds"] = round(time.perf_counter() - start, 3)
    results.append(rec)
    print(_row(rec), flush=True)
  return results


def _fmt(x):
  return "-" if x is None else f"{x:.2e}"


def _row(r):
  msg = (r["error"] or "").splitlines()[0][:80] if r["status"] != "pass" and r["error"] else ""
  return (f"{r['name']:<30} {r['family']:<12} {r['status']:<8} {_fmt(r['err_out']):>9} {_fmt(r['err_lse']):>9} "
          f"{_fmt(r['tol']):>9} {r['seconds']:>7.2f}s {msg}")


def environment():
  return {"jax": jax.__version__, "backend": jax.default_backend(),
          "devices": [f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()],
          "compute_capability": str(getattr(jax.devices()[0], "compute_capability", "")),
          "python": sys.version.split()[0]}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="directory for smoke.json")
  parser.add_argument("--interpret", action="store_true", help="CPU: interpreted kernels, tiny shapes")
  parser.add_argument("--families", default="", help=f"comma-separated subset of {','.join(FAMILIES)}")
  args = parser.parse_args(argv)
  families = [f for f in args.families.split(",") if f]
  unknown = sorted(set(families) - set(FAMILIES))
  if unknown:
    parser.error(f"unknown families {unknown}; known: {list(FAMILIES)}")
  os.makedirs(args.out, exist_ok=True)
  env = environment()
  print(f"[gpu_smoke] jax {env['jax']} on {env['devices']}{' (interpreted)' if args.interpret else ''}", flush=True)
  print(f"{'case':<30} {'family':<12} {'status':<8} {'err_out':>9} {'err_lse':>9} {'tol':>9} {'time':>8}")
  start = time.perf_counter()
  results = run(args.interpret, families)
  env["seconds"] = round(time.perf_counter() - start, 3)
  env["interpret"] = args.interpret
  with open(os.path.join(args.out, "smoke.json"), "w") as f:
    json.dump({"env": env, "cases": results}, f, indent=1)
  counts = {s: sum(r["status"] == s for r in results) for s in ("pass", "fail", "error", "skipped")}
  print(f"[gpu_smoke] {counts} in {env['seconds']:.1f}s -> {os.path.join(args.out, 'smoke.json')}")
  return 0 if counts["fail"] == 0 and counts["error"] == 0 else 1


if __name__ == "__main__":
  sys.exit(main())
