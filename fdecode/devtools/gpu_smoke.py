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
same call with ``impl="reference"``), grad (the backward of the default dispatch's decode,
contiguous and paged, against plain autodiff of dense float32 attention), invariant
(``batch_invariant=True``: a sequence alone and in a batch of 4, and a 5-token call's
rows against each token decoded alone, equal bit for bit), and hopper (``impl="mosaic_gpu"``: MLA bf16, MLA
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
import functools
import json
import os
import sys
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fdecode.devtools.interpret import compiled_once

FAMILIES = ("contiguous", "paged", "token_major", "quant", "mla", "sparse", "splits", "ragged", "grad", "invariant",
            "hopper")
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


class _Setup(NamedTuple):
  """What every case builder reads: the impl options, sizes, tolerances and one rng."""
  interpret: bool
  tri: dict    # the Triton path: the default dispatch, or interpreted
  pal: dict    # impl="pallas"
  mgpu: dict   # impl="mosaic_gpu"
  s: int       # cache length
  d: int       # head dim
  f32: float   # float32 tolerance
  rng: np.random.Generator

  def rand(self, shape, dtype=jnp.float32):
    return jnp.asarray(self.rng.standard_normal(shape), jnp.float32).astype(dtype)


def _setup(interpret) -> _Setup:
  from fdecode.kernels import mosaic_gpu  # pylint: disable=g-import-not-at-top
  s, d = (40, 32) if interpret else (300, 128)
  return _Setup(interpret=interpret, tri=dict(impl="pallas", interpret=True) if interpret else {},
                pal=dict(impl="pallas", interpret=True) if interpret else dict(impl="pallas"),
                mgpu=(dict(impl="mosaic_gpu", interpret=mosaic_gpu.InterpretGPUParams()) if interpret
                      else dict(impl="mosaic_gpu")),
                s=s, d=d, f32=TOL["f32"] if interpret else TOL["f32_gpu"], rng=np.random.default_rng(0))


def _ref(*args, **kw):
  import fdecode  # pylint: disable=g-import-not-at-top
  kw = {n: x for n, x in kw.items() if n not in ("impl", "interpret")}
  with jax.default_matmul_precision("highest"):
    return fdecode.flash_decode(*args, impl="reference", return_lse=True, **kw)


def _both(q, k, v, lengths, opts, tol, **kw):
  import fdecode  # pylint: disable=g-import-not-at-top
  lengths = jnp.asarray(lengths, jnp.int32)
  return fdecode.flash_decode(q, k, v, lengths, return_lse=True, **opts, **kw), _ref(q, k, v, lengths, **kw), tol


def _tol(st: _Setup, dtype):
  return TOL["bf16"] if dtype == jnp.bfloat16 else st.f32


def _contiguous(st: _Setup, dtype, t, hq, hkv, opts="tri", **kw):
  qs = (2, hq, st.d) if t is None else (2, t, hq, st.d)
  k, v = st.rand((2, hkv, st.s, st.d), dtype), st.rand((2, hkv, st.s, st.d), dtype)
  return _both(st.rand(qs, dtype), k, v, [st.s, st.s // 2 + 1], getattr(st, opts), _tol(st, dtype), **kw)


def _paged(st: _Setup, page_size, dtype=jnp.bfloat16, kv_dtype=None, **kw):
  from fdecode.cache.quant import quantize  # pylint: disable=g-import-not-at-top
  n = -(-st.s // page_size)
  pages = 2 * n + 1
  tables = jnp.asarray(st.rng.permutation(pages)[:2 * n].reshape(2, n), jnp.int32)
  k, v = st.rand((2, pages, page_size, st.d)), st.rand((2, pages, page_size, st.d))
  extra = {}
  if kv_dtype is not None:
    (k, ks), (v, vs) = quantize(k, kv_dtype), quantize(v, kv_dtype)
    extra = dict(k_scale=ks, v_scale=vs)
  else:
    k, v = k.astype(dtype), v.astype(dtype)
  return _both(st.rand((2, 4, st.d), dtype), k, v, [n * page_size, 7], st.tri, _tol(st, dtype), block_tables=tables,
               **extra, **kw)


def _token_major(st: _Setup):
  s, d = st.s, st.d
  q, k, v = st.rand((2, 3, 4, d), jnp.bfloat16), st.rand((2, s, 2, d), jnp.bfloat16), st.rand((2, s, 2, d), jnp.bfloat16)
  return _both(q, k, v, [s, 9], st.tri, TOL["bf16"], kv_layout="NHD")


def _quant(st: _Setup, qdtype):
  from fdecode.cache.quant import quantize  # pylint: disable=g-import-not-at-top
  s, d = st.s, st.d
  (k, ks), (v, vs) = quantize(st.rand((2, 2, s, d)), qdtype), quantize(st.rand((2, 2, s, d)), qdtype)
  return _both(st.rand((2, 8, d), jnp.bfloat16), k, v, [s, 5], st.pal, TOL["bf16"], k_scale=ks, v_scale=vs)


def _mla(st: _Setup):
  sm = 32 if st.interpret else 256
  q, k = st.rand((2, 16, 576), jnp.bfloat16), st.rand((2, 1, sm, 576), jnp.bfloat16)
  return _both(q, k, None, [sm, 3], st.tri, TOL["bf16"], v_head_dim=512)


def _sparse(st: _Setup):
  s, d = st.s, st.d
  idx = jnp.asarray(np.stack([st.rng.choice(s, 12, replace=False) for _ in range(2)]), jnp.int32)
  idx = idx.at[1, -3:].set(-1)
  q, k, v = st.rand((2, 4, d), jnp.bfloat16), st.rand((2, 2, s, d), jnp.bfloat16), st.rand((2, 2, s, d), jnp.bfloat16)
  return _both(q, k, v, [s, s - 4], st.tri, TOL["bf16"], indices=idx)


def _ragged(st: _Setup):
  import fdecode  # pylint: disable=g-import-not-at-top
  s, d, page_size, hkv, hq = st.s, st.d, 16, 2, 4
  n = -(-s // page_size)
  pages = 2 * n + 1
  tables = jnp.asarray(st.rng.permutation(pages)[:2 * n].reshape(2, n), jnp.int32)
  k, v = st.rand((hkv, pages, page_size, d), jnp.bfloat16), st.rand((hkv, pages, page_size, d), jnp.bfloat16)
  q_lens, kv_lens = [1, 5], [s - 3, 9]
  rows = sum(q_lens) + 2  # two padding rows
  cu = jnp.asarray([0, 1, 6], jnp.int32)
  q = st.rand((rows, hq, d), jnp.bfloat16)
  nk, nv = st.rand((rows, hkv, d), jnp.bfloat16), st.rand((rows, hkv, d), jnp.bfloat16)
  args = (q, k, v, jnp.asarray(kv_lens, jnp.int32), tables, cu, 2)
  got = fdecode.ragged_decode(*args, new_k=nk, new_v=nv, return_lse=True, **st.tri)
  try:
    with jax.default_matmul_precision("highest"):
      want = fdecode.ragged_decode(*args, new_k=nk, new_v=nv, return_lse=True, impl="reference")
  except (ValueError, NotImplementedError):  # the reference path does not write: the caches against XLA's
    with jax.default_matmul_precision("highest"):
      want = fdecode.ragged_decode(*args, new_k=nk, new_v=nv, return_lse=True, impl="xla")
  return [(got[:2], want[:2]), ((got[2], got[3]), (want[2], want[3]))], TOL["bf16"]


def _hopper_mla(st: _Setup, qdtype):
  from fdecode.cache.quant import quantize  # pylint: disable=g-import-not-at-top
  sm = 64 if st.interpret else 256
  q = st.rand((1 if st.interpret else 2, 16, 576), jnp.bfloat16)
  k = st.rand((q.shape[0], 1, sm, 576))
  kw = {}
  if qdtype is None:
    k = k.astype(jnp.bfloat16)
  else:
    k, kw["k_scale"] = quantize(k, qdtype)
  lengths = [sm - 5] + ([sm // 3] if q.shape[0] > 1 else [])
  return _both(q, k, None, lengths, st.mgpu, TOL["bf16"], v_head_dim=512, num_splits=1 if st.interpret else None, **kw)


def _hopper_rows(st: _Setup, qdtype, page_size=None):
  from fdecode.cache.quant import quantize  # pylint: disable=g-import-not-at-top
  b, sm, dh = (1, 64, 64) if st.interpret else (2, 256, 128)
  q = st.rand((b, 4, 16, dh), jnp.bfloat16)
  kw = dict(num_splits=1) if st.interpret else {}
  if page_size:
    n = sm // page_size
    kw["block_tables"] = jnp.asarray(st.rng.permutation(b * n + 1)[:b * n].reshape(b, n), jnp.int32)
    shape = (1, b * n + 1, page_size, dh)
  else:
    shape = (b, 1, sm, dh)
  k, v = st.rand(shape), st.rand(shape)
  if qdtype is None:
    k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  else:
    (k, kw["k_scale"]), (v, kw["v_scale"]) = quantize(k, qdtype), quantize(v, qdtype)
  lengths = [sm - 3] + [sm // 2] * (b - 1)
  return _both(q, k, v, lengths, st.mgpu, TOL["bf16"], **kw)


def _dense_attention(q, k, v, lengths):
  """Plain float32 attention, autodiff's oracle: q ``[B, Hq, D]``, k / v ``[B, Hkv, S, D]``."""
  b, hq, d = q.shape
  hkv = k.shape[1]
  qg = q.reshape(b, hkv, hq // hkv, d)
  sc = jnp.einsum("bkgd,bksd->bkgs", qg, k) / np.sqrt(d)
  seen = (jnp.arange(k.shape[2])[None, :] < lengths[:, None])[:, None, None, :]
  p = jax.nn.softmax(jnp.where(seen, sc, -jnp.inf), axis=-1)
  return jnp.einsum("bkgs,bksd->bkgd", p, v).reshape(b, hq, d)


def _grad(st: _Setup, paged: bool):
  """The backward (`fdecode.derivatives`) of the default dispatch's decode: d(q, k, v) of
  ``sum(out * w)`` against plain autodiff of dense float32 attention, both at "highest"."""
  import fdecode  # pylint: disable=g-import-not-at-top
  s, d = st.s, st.d
  q, k, v = st.rand((2, 8, d)), st.rand((2, 2, s, d)), st.rand((2, 2, s, d))
  w = st.rand((2, 8, d))
  lengths = jnp.asarray([s, s // 2 + 1], jnp.int32)
  opts = dict(st.tri)
  if paged:  # the pool [Hkv, P, 1, D] of page size 1, read through the identity table
    to_pool = lambda x: x.transpose(1, 0, 2, 3).reshape(2, 2 * s, 1, d)
    opts["block_tables"] = jnp.arange(2 * s, dtype=jnp.int32).reshape(2, s)
    fn = lambda q, k, v: jnp.sum(fdecode.flash_decode(q, to_pool(k), to_pool(v), lengths, **opts) * w)
  else:
    fn = lambda q, k, v: jnp.sum(fdecode.flash_decode(q, k, v, lengths, **opts) * w)
  with jax.default_matmul_precision("highest"):
    got = jax.grad(fn, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(_dense_attention(q, k, v, lengths) * w), argnums=(0, 1, 2))(q, k, v)
  return [(got, want)], st.f32


def _invariant(st: _Setup):
  """``batch_invariant=True``: a sequence's output and lse alone and as row 0 of a batch of
  4, compared for equality (tolerance 0)."""
  import fdecode  # pylint: disable=g-import-not-at-top
  s, d = st.s, st.d
  q, k, v = st.rand((4, 8, d), jnp.bfloat16), st.rand((4, 2, s, d), jnp.bfloat16), st.rand((4, 2, s, d), jnp.bfloat16)
  lengths = jnp.asarray([s - 1, 3, s, s // 2], jnp.int32)
  call = lambda b: fdecode.flash_decode(q[:b], k[:b], v[:b], lengths[:b], batch_invariant=True, split_size=16,
                                        return_lse=True)
  (o4, l4), (o1, l1) = call(4), call(1)
  return [((o4[:1], l4[:1]), (o1, l1))], 0.0


def _invariant_prefill(st: _Setup):
  """``batch_invariant=True`` (on a GPU the Triton kernels' invariant plan, key blocks of 16):
  each row of a 5-token call against that token decoded alone, for equality (tolerance 0)."""
  import fdecode  # pylint: disable=g-import-not-at-top
  s, d, t = st.s, st.d, 5
  q, k, v = st.rand((3, t, 12, d), jnp.bfloat16), st.rand((3, 4, s, d), jnp.bfloat16), st.rand((3, 4, s, d), jnp.bfloat16)
  lengths = jnp.asarray([s, 17 + t, s // 2 + 1], jnp.int32)
  mode = dict(batch_invariant=True, split_size=16, block_k=16, return_lse=True)
  out, lse = fdecode.flash_decode(q, k, v, lengths, **mode)
  pairs = []
  for i in range(t):
    o1, l1 = fdecode.flash_decode(q[:, i], k, v, lengths - (t - 1 - i), **mode)
    pairs.append(((out[:, i], lse[:, i]), (o1, l1)))
  return pairs, 0.0


# The cases, as data: (name, family, builder, its parameters); `_cases` binds each to a setup.
_BF16, _F32 = jnp.bfloat16, jnp.float32
CASES = (
    ("contiguous_bf16_gqa4", "contiguous", _contiguous, dict(dtype=_BF16, t=None, hq=8, hkv=2)),
    ("contiguous_f32_gqa2_T3", "contiguous", _contiguous, dict(dtype=_F32, t=3, hq=4, hkv=2)),
    ("contiguous_bf16_mqa_T3_pallas", "contiguous", _contiguous, dict(dtype=_BF16, t=3, hq=4, hkv=1, opts="pal")),
    ("paged16_bf16", "paged", _paged, dict(page_size=16)),
    ("paged1_f32", "paged", _paged, dict(page_size=1, dtype=_F32)),
    ("token_major_nhd_bf16_T3", "token_major", _token_major, {}),
    ("quant_int8_per_token", "quant", _quant, dict(qdtype=jnp.int8)),
    ("quant_fp8_e4m3_per_token", "quant", _quant, dict(qdtype=jnp.float8_e4m3fn)),
    ("quant_int8_paged16", "quant", _paged, dict(page_size=16, kv_dtype=jnp.int8)),
    ("mla_bf16_g16", "mla", _mla, {}),
    ("sparse_indices_bf16", "sparse", _sparse, {}),
    ("splits4_bf16", "splits", _contiguous, dict(dtype=_BF16, t=None, hq=8, hkv=2, num_splits=4)),
    ("splits_balance_paged16", "splits", _paged, dict(page_size=16, num_splits="balance")),
    ("ragged_fused_write_paged16", "ragged", _ragged, {}),
    ("grad_contiguous_f32", "grad", _grad, dict(paged=False)),
    ("grad_paged1_f32", "grad", _grad, dict(paged=True)),
    ("invariant_batch_of_4_bf16", "invariant", _invariant, {}),
    ("invariant_prefill_rows_bf16", "invariant", _invariant_prefill, {}),
    ("hopper_mla_bf16", "hopper", _hopper_mla, dict(qdtype=None)),
    ("hopper_mla_int8", "hopper", _hopper_mla, dict(qdtype=jnp.int8)),
    ("hopper_rows_bf16", "hopper", _hopper_rows, dict(qdtype=None)),
    ("hopper_rows_int8", "hopper", _hopper_rows, dict(qdtype=jnp.int8)),
    ("hopper_rows_paged16_bf16", "hopper", _hopper_rows, dict(qdtype=None, page_size=16)),
)


def _cases(interpret):
  """(name, family, fn) with fn() -> (got, want, tol) or (list of (got, want), tol)."""
  st = _setup(interpret)
  return [(name, family, functools.partial(build, st, **params)) for name, family, build, params in CASES]


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
