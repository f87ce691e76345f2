"""The differential fuzzer's shared parts (tests/kernels/test_fuzz.py, test_fuzz_ragged.py,
test_fuzz_engine.py, test_gpu_fuzz.py): hypothesis profiles, the strategy of random valid
`flash_decode` calls (`valid_cases`, each a `Case`), the float64 numpy oracle written from the
documented semantics (`oracle`), dtype-keyed tolerances against it (`tolerances`) and the
NaN / inf-aware comparison (`assert_matches`); `check_valid` runs one drawn call on an impl and
checks it against the oracle.

Profiles (hypothesis settings profiles, applied per test so no other file is affected):
  * ``fdecode-ci`` (default): derandomized (fixed seed), bounded examples, impl="xla".
  * ``fdecode-long``: ``FDECODE_FUZZ=long``: many more examples, random seeds, and also the
    interpreted kernels (Triton in Pallas' interpreter, Mosaic in the TPU interpreter) and
    the float32 reference impl. ``FDECODE_FUZZ_EXAMPLES=N`` overrides its example count.
"""

import math
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, Phase, settings, strategies as st

import fdecode
from helpers import host_f32, tpu_interpret

LONG = os.environ.get("FDECODE_FUZZ") == "long"
COMMON = dict(deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
# CI skips shrinking (its time is unbounded while something fails); FDECODE_FUZZ_SHRINK=1
# turns it on to get a minimal failing call.
_CI_PHASES = tuple(Phase) if os.environ.get("FDECODE_FUZZ_SHRINK") else (
    Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.explain)
settings.register_profile("fdecode-ci", derandomize=True, max_examples=60, phases=_CI_PHASES, **COMMON)
settings.register_profile("fdecode-long", derandomize=False,
                          max_examples=int(os.environ.get("FDECODE_FUZZ_EXAMPLES", 400)), **COMMON)
PROFILE = settings.get_profile("fdecode-long" if LONG else "fdecode-ci")
# Invalid calls are cheap (most raise before any compile): more of them per run.
INVALID_PROFILE = settings(PROFILE, max_examples=PROFILE.max_examples * 2)
IMPLS = ["xla", "pallas", "mosaic", "reference"] if LONG else ["xla"]

F32, BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
QDTYPES = {"int8": np.dtype(np.int8), "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
           "e5m2": np.dtype(ml_dtypes.float8_e5m2)}
GARBAGE = np.array([np.inf, -np.inf, np.nan, 3e38, -3e38], np.float32)

# Shapes come from small sets, so that the jit cache serves many examples.
HEADS = [(2, 2), (4, 2), (6, 2), (4, 1)]          # G = 1, 2, 3, 4
HEAD_DIMS = [(16, 16), (32, 8)]                   # (Dk, Dv)
CONTIGUOUS_S = [1, 16, 37]
PAGES = [(1, 9), (4, 5), (5, 3), (16, 2)]         # (page_size, pages per sequence)
SPLITS = [None, 1, 2, 3, 64]                      # 64: more splits than blocks
BLOCK_K = [None, 8, 16]
ROPE = 8
# The shape sets a valid call draws from (tests/kernels/test_gpu_fuzz.py passes wider ones).
SHAPES = dict(b=[1, 3], t=[None, 1, 3], heads=HEADS, head_dims=HEAD_DIMS, contiguous_s=CONTIGUOUS_S,
              pages=PAGES, splits=SPLITS, block_k=BLOCK_K)


def call(impl, *args, **kw):
  """flash_decode on one impl: "mosaic" is the TPU kernel under the TPU interpreter."""
  if impl == "mosaic":
    with tpu_interpret():
      return fdecode.flash_decode(*args, impl="pallas", **kw)
  return fdecode.flash_decode(*args, impl=impl, **kw)


# --- the float64 oracle ------------------------------------------------------------------


def dequant64(x, scale=None, offset=None):
  """``(x + offset) * scale`` tile-wise (`fdecode.cache.quant`), in float64."""
  x = np.asarray(x).astype(np.float64)
  if scale is None:
    return x
  s = np.asarray(scale, np.float64)
  s = s.reshape(1, 1, 1, 1) if s.ndim == 0 else s
  o = np.zeros_like(s) if offset is None else np.asarray(offset, np.float64)
  o = o.reshape(1, 1, 1, 1) if o.ndim == 0 else o
  nt, d = s.shape[-1], x.shape[-1]
  xt = x.reshape(*x.shape[:-1], nt, d // nt)
  return ((xt + o[..., None]) * s[..., None]).reshape(x.shape)


def contiguous64(x, tables, scale=None, offset=None):
  """A cache (contiguous ``[B, Hkv, S, D]`` or paged pool) -> float64 ``[B, Hkv, S, D]``."""
  x = dequant64(x, scale, offset)
  if tables is None:
    return x
  hkv, p, ps, d = x.shape
  ids = np.clip(tables, 0, p - 1)
  b, n = ids.shape
  return x[:, ids].reshape(hkv, b, n * ps, d).transpose(1, 0, 2, 3)


def broadcast4(x, b, t, hq, s):
  x = np.asarray(x)
  x = x[:, None, None, :] if x.ndim == 2 else (x[:, :, None, :] if x.ndim == 3 else x)
  return np.broadcast_to(x, (b, t, hq, s))


def visibility(c):
  """bool ``[B, T, Hq, S]``: which cache slot each query row may see (positions, mask and
  sparse selection only; never the values)."""
  b, t, hq, s, hkv = c["B"], c["T"], c["Hq"], c["S"], c["Hkv"]
  kw = c["kw"]
  ends = c["lengths"].astype(np.int64) - c["offset"]
  j = np.arange(s)[None, None, None, :]
  p = (ends[:, None] - t + np.arange(t)[None, :])[:, :, None, None]  # [B, T, 1, 1]
  vis = j < np.clip(ends, 0, s)[:, None, None, None]
  if kw.get("causal", True):
    vis = vis & (j <= p)
  if kw.get("window") is not None:
    vis = vis & (j > p - kw["window"])
  if kw.get("mask") is not None:
    vis = vis & broadcast4(kw["mask"], b, t, hq, s)
  if kw.get("indices") is not None:
    idx = np.asarray(kw["indices"]).astype(np.int64)
    idx = idx[:, None, None, :] if idx.ndim == 2 else (
        (idx[:, None] if c["single"] else idx[:, :, None]) if idx.ndim == 3 else idx)  # [B, T|1, Hkv|1, K]
    local = idx - c["offset"].reshape(-1, 1, 1, 1)
    local = np.where((idx >= 0) & (local >= 0) & (local < s), local, s)
    sel = np.zeros(idx.shape[:3] + (s + 1,), bool)
    np.put_along_axis(sel, local, True, axis=-1)
    sel = np.repeat(sel[..., :s], hq // sel.shape[2], axis=2)  # per kv head -> per query head
    vis = vis & sel
  return np.broadcast_to(vis, (b, t, hq, s))


def oracle(c):
  """float64 ``(out [B, T, Hq, Dv], lse [B, T, Hq])`` of a drawn case, from the documented
  semantics: invisible slots are selected away; a visible NaN propagates."""
  kw = c["kw"]
  b, t, hq, s, hkv = c["B"], c["T"], c["Hq"], c["S"], c["Hkv"]
  g = hq // hkv
  tables = None if kw.get("block_tables") is None else np.asarray(kw["block_tables"])
  k = contiguous64(c["k"], tables, kw.get("k_scale"), kw.get("k_offset"))
  if c["v"] is None:
    v = k[..., :kw["v_head_dim"]]
  else:
    v = contiguous64(c["v"], tables, kw.get("v_scale"), kw.get("v_offset"))
  if kw.get("k_rope") is not None:
    k = np.concatenate([k, contiguous64(kw["k_rope"], tables)], -1)
  q = np.asarray(c["q"]).astype(np.float64)
  q = q[:, None] if c["single"] else q
  k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [B, Hq, S, D]
  vis = visibility(c)
  scale = 1.0 / math.sqrt(q.shape[-1]) if kw.get("softmax_scale") is None else float(kw["softmax_scale"])
  ends = c["lengths"].astype(np.int64) - c["offset"]
  with np.errstate(all="ignore"):
    sc = np.einsum("bthd,bhsd->bths", q, k) * scale
    cap = kw.get("logits_soft_cap")
    if cap is not None:
      sc = cap * np.tanh(sc / cap)
    if kw.get("alibi_slopes") is not None:
      p = (ends[:, None] - t + np.arange(t)[None, :])[:, :, None, None]
      sc = sc + np.asarray(kw["alibi_slopes"], np.float64)[None, None, :, None] * (np.arange(s) - p)
    if kw.get("bias") is not None:
      sc = sc + broadcast4(kw["bias"], b, t, hq, s).astype(np.float64)
    sc = np.where(vis, sc, -np.inf)
    empty = ~vis.any(-1)
    m = np.where(empty, 0.0, np.max(sc, -1))  # NaN propagates through max
    w = np.where(vis, np.exp(sc - m[..., None]), 0.0)
    l = w.sum(-1)
    pv = np.where(vis[..., None], w[..., None] * v[:, None], 0.0)  # [B, T, Hq, S, Dv]
    out = pv.sum(-2) / np.where(empty, 1.0, l)[..., None]
    lse = m + np.log(l)
    out = np.where(empty[..., None], 0.0, out)
    lse = np.where(empty, -np.inf, lse)
    # A corrupt (inf / NaN) value a row sees makes the whole row and its lse NaN.
    corrupt = ~np.isfinite(out).all(-1)
    out, lse = np.where(corrupt[..., None], np.nan, out), np.where(corrupt, np.nan, lse)
    if kw.get("sinks") is not None:
      sink = np.asarray(kw["sinks"], np.float64)[None, None, :]
      new = np.logaddexp(lse, sink)
      factor = np.where(np.isneginf(new), 1.0, np.exp(lse - new))  # -inf - -inf: nothing to scale
      out, lse = out * factor[..., None], new
  if c["single"]:
    out, lse = out[:, 0], lse[:, 0]
  return out, lse


# --- drawing valid calls -----------------------------------------------------------------


def _pour(x, dead, rng):
  """``x`` with random garbage wherever ``dead`` (broadcastable to x.shape) holds."""
  dead = np.broadcast_to(dead, x.shape)
  if x.dtype == np.int8:
    junk = rng.integers(-128, 128, size=x.shape).astype(np.int8)
  else:
    junk = rng.choice(GARBAGE, size=x.shape).astype(x.dtype)
  return np.where(dead, junk, x)


def _dead_entries(live, shape):
  """A scale / offset of ``shape`` (rank 4, over a cache whose slot liveness is ``live``
  [A0, A1, A2]): an entry is dead iff no live slot reads it."""
  for ax in range(3):
    if shape[ax] == 1:
      live = live.any(axis=ax, keepdims=True)
  return ~live[..., None]


def _scale(rng, gran, cache_shape, d, paged):
  """A float32 scale of a granularity: ``tensor`` (scalar), ``token`` (per token per head),
  ``head``, ``tile`` (per token, 4 tiles of D/4) or ``mixed`` (each leading axis kept or 1
  at random: per page, per slot, per sequence ..., with 1, 2 or D/4 tiles)."""
  a0, a1, a2 = cache_shape[:3]
  if gran == "mixed":
    keep = rng.random(3) < 0.5
    shape = tuple(n if k else 1 for n, k in zip((a0, a1, a2), keep)) + (int(rng.choice([1, 2, d // 4])),)
  else:
    shape = {"tensor": (), "token": (a0, a1, a2, 1), "tile": (a0, a1, a2, 4),
             "head": (a0, 1, 1, 1) if paged else (1, a1, 1, 1)}[gran]
  return rng.uniform(0.5, 2.0, size=shape).astype(np.float32)


def _quantized(rng, name, shape):
  if name == "int8":
    return rng.integers(-127, 128, size=shape).astype(np.int8), 1 / 100.0
  return np.clip(rng.normal(size=shape) * 100, -400, 400).astype(QDTYPES[name]), 1 / 100.0


@st.composite
def valid_cases(draw, nan_at_visible=False, shapes=None):
  """A random valid call: ``dict(q, k, v, lengths, kw, ...)`` with its oracle inputs;
  ``shapes``: the sets to draw shapes from (default `SHAPES`)."""
  shapes = SHAPES if shapes is None else shapes
  rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
  b = draw(st.sampled_from(shapes["b"]))
  t = draw(st.sampled_from(shapes["t"]))
  hq, hkv = draw(st.sampled_from(shapes["heads"]))
  dk, dv = draw(st.sampled_from(shapes["head_dims"]))
  dtype = draw(st.sampled_from(["float32", "bfloat16"]))
  cache_form = draw(st.sampled_from(["float", "other-float", "int8", "e4m3", "e5m2"]))
  paged = draw(st.booleans())
  mla = draw(st.integers(0, 5)) == 5
  rope = draw(st.integers(0, 5)) == 5
  qdt = F32 if dtype == "float32" else BF16
  cdt = {"float": qdt, "other-float": BF16 if qdt == F32 else F32}.get(cache_form)
  rope_dim = shapes.get("rope", ROPE)
  kdk = dk - rope_dim if rope else dk
  kw = {}
  if paged:
    ps, n = draw(st.sampled_from(shapes["pages"]))
    s = ps * n
    num_pages = b * n + 2
    lead = (hkv, num_pages, ps)
    tables = rng.permutation(num_pages)[: b * n].reshape(b, n).astype(np.int32)
  else:
    s = draw(st.sampled_from(shapes["contiguous_s"]))
    lead = (b, hkv, s)
    tables = None
  tt = 1 if t is None else t

  # Offsets of a chunked cache, then lengths (0, 1, S, S-1 or random; past S with an offset).
  offset_form = draw(st.sampled_from([None, None, "scalar", "per-seq"]))
  if offset_form is None:
    offset = np.zeros(b, np.int64)
  elif offset_form == "scalar":
    off = draw(st.sampled_from([0, 3, s, 2 * s + 1]))
    offset, kw["kv_offset"] = np.full(b, off, np.int64), off
  else:
    offset = rng.integers(0, s + 2, size=b)
    kw["kv_offset"] = offset.astype(np.int32)
  hi = s + (int(offset.max()) + 2 if offset_form else 0)
  lengths = np.array([draw(st.sampled_from([0, 1, s, max(s - 1, 0), int(rng.integers(0, hi + 1))]))
                      for _ in range(b)], np.int32)
  if offset_form is not None:
    lengths = np.clip(lengths + offset * rng.integers(0, 2, size=b), 0, None).astype(np.int32)

  # The cache.
  def cache(d):
    if cache_form in QDTYPES:
      return _quantized(rng, cache_form, lead + (d,))[0]
    return rng.normal(size=lead + (d,)).astype(cdt)
  k = cache(kdk)
  v = None if mla else cache(dv)
  if mla:
    dv = min(dv, kdk)
    kw["v_head_dim"] = dv
  if cache_form in QDTYPES:
    grans = ["tensor", "token", "head", "tile", "mixed"]
    for name in ("k",) + (() if mla else ("v",)):
      d = kdk if name == "k" else dv
      gran = draw(st.sampled_from(grans))
      sc = _scale(rng, gran, lead + (d,), d, paged) / 100.0
      kw[f"{name}_scale"] = sc
      if draw(st.integers(0, 3)) == 3:
        kw[f"{name}_offset"] = rng.uniform(-2, 2, size=np.shape(sc)).astype(np.float32)
  if rope:
    kw["k_rope"] = rng.normal(size=lead + (rope_dim,)).astype(qdt)
  q = rng.normal(size=(b, hq, dk) if t is None else (b, t, hq, dk)).astype(qdt)

  # Modifiers.
  causal = not draw(st.booleans()) if tt > 1 else True
  if not causal or draw(st.booleans()):
    kw["causal"] = causal
  if draw(st.integers(0, 2)) == 2:
    kw["window"] = draw(st.sampled_from([1, 2, 7, 5 * s + 3]))
  if draw(st.integers(0, 3)) == 3:
    kw["logits_soft_cap"] = draw(st.sampled_from([0.3, 2.0, 50.0, 1e-20, 2.0 ** 100]))
  if draw(st.integers(0, 3)) == 3:
    kw["softmax_scale"] = draw(st.sampled_from([0.05, 3.0, 0.0, -0.7, np.float32(0.25)]))
  if draw(st.integers(0, 3)) == 3:
    kw["alibi_slopes"] = (rng.uniform(0, 1, size=hq) ** 2).astype(np.float32)
  if draw(st.integers(0, 3)) == 3:
    sinks = rng.normal(size=hq).astype(np.float32)
    if draw(st.integers(0, 3)) == 3:  # the limits: exp(+inf) takes every row, exp(-inf) none
      sinks[rng.integers(hq)] = draw(st.sampled_from([np.inf, -np.inf]))
    kw["sinks"] = sinks
  sparse = draw(st.integers(0, 4)) == 4
  if sparse:
    kk = draw(st.sampled_from([0, 1, 5, 2 * s + 3]))
    forms = [(b, kk)] + ([(b, hkv, kk)] if t is None else [(b, tt, kk), (b, tt, hkv, kk), (b, 1, hkv, kk)])
    shape = draw(st.sampled_from(forms))
    if len(shape) >= 3 and t is not None and shape[1] > 1 and not causal:
      kw.pop("window", None), kw.pop("alibi_slopes", None)  # not combinable (fdecode.kernels.common.sparse)
    kw["indices"] = rng.integers(-2, hi + 3, size=shape).astype(np.int32)
  else:
    if draw(st.integers(0, 2)) == 2:
      form = draw(st.sampled_from([(b, s), (1, s), (b, tt, s), (b, tt, hq, s), (1, 1, hq, s), (b, 1, hq, s)]))
      kw["mask"] = rng.random(form) < draw(st.sampled_from([0.1, 0.7, 1.0]))
    if draw(st.integers(0, 3)) == 3:
      form = draw(st.sampled_from([(b, s), (b, tt, hq, s), (1, tt, 1, s)]))
      kw["bias"] = rng.normal(size=form).astype(np.float32)
  if paged:
    kw["block_tables"] = tables
  ns = draw(st.sampled_from(shapes["splits"]))
  bk = draw(st.sampled_from(shapes["block_k"]))
  if ns is not None:
    kw["num_splits"] = ns
  if bk is not None:
    kw["block_k"] = bk
  c = Case(q=q, k=k, v=v, lengths=lengths, kw=kw, B=b, T=tt, Hq=hq, Hkv=hkv, S=s, single=t is None,
           offset=offset, paged=paged, dtype=dtype, cache_form=cache_form)
  _add_garbage(c, rng)
  if nan_at_visible:
    c["nan"] = _nan_at_visible(c, rng, draw(st.sampled_from(["k", "v", "k_scale", "q", "bias", "alibi"])))
  return c


def _add_garbage(c, rng):
  """Garbage (inf / NaN / huge, random int8 bytes) in every dead slot: past a length,
  masked out, outside the window or the selection, unused / recycled pages, their scales
  and offsets; stale or out-of-range ids in unneeded table entries; bias entries no row
  sees."""
  kw = c["kw"]
  vis = visibility(c)
  b, hkv, hq, s = c["B"], c["Hkv"], c["Hq"], c["S"]
  seen = vis.any(1).reshape(b, hkv, hq // hkv, s).any(2)  # [B, Hkv, S]
  if c["paged"]:
    tables = kw["block_tables"]
    ps = c["k"].shape[2]
    live = np.zeros(c["k"].shape[:3], bool)  # [Hkv, P, ps]
    for i in range(b):
      for j in np.nonzero(seen[i].any(0))[0]:
        live[:, tables[i, j // ps], j % ps] |= seen[i, :, j]
    # Table entries no visible token needs: -1, a huge id, or another sequence's page.
    # (Columns in range for the page-id check, i.e. before the length and not wholly before
    # the window, keep their pages.)
    ends = c["lengths"].astype(np.int64) - c["offset"]
    cols = np.arange(tables.shape[1])
    window = kw.get("window")
    first = np.maximum(c["lengths"].astype(np.int64) - c["T"] + 1 - window, 0) if window else 0 * ends
    stale = tables.copy()
    for i in range(b):
      needed = (cols < -(-c["lengths"][i] // ps)) & ((cols + 1) * ps > first[i] if window else True)
      for j in cols[~needed & ~seen[i].any(0).reshape(-1, ps).any(1)]:
        stale[i, j] = [-1, 10 ** 6, tables[(i + 1) % b, 0]][int(rng.integers(3))]
    kw["block_tables"] = stale
  else:
    live = seen
  dead = ~live[..., None]
  c["k"] = _pour(c["k"], dead, rng)
  if c["v"] is not None:
    c["v"] = _pour(c["v"], dead, rng)
  if kw.get("k_rope") is not None:
    kw["k_rope"] = _pour(kw["k_rope"], dead, rng)
  for name in ("k_scale", "v_scale", "k_offset", "v_offset"):
    if kw.get(name) is not None and np.ndim(kw[name]):
      kw[name] = _pour(kw[name], _dead_entries(live, kw[name].shape), rng)
  if kw.get("bias") is not None:
    bias = kw["bias"]
    vis4 = vis if bias.ndim == 4 else (vis.any(2) if bias.ndim == 3 else vis.any((1, 2)))
    for ax in range(bias.ndim - 1):
      if bias.shape[ax] == 1:
        vis4 = vis4.any(axis=ax, keepdims=True)
    kw["bias"] = _pour(bias, ~vis4, rng)


def _nan_at_visible(c, rng, target):
  """Puts one NaN where some query sees it; returns what was hit (or None)."""
  kw = c["kw"]
  vis = visibility(c)
  hit = np.argwhere(vis)
  if not len(hit):
    return None
  bi, ti, hi, j = hit[rng.integers(len(hit))]
  g = c["Hq"] // c["Hkv"]
  h = hi // g
  if c["paged"]:
    ps = c["k"].shape[2]
    slot = (h, kw["block_tables"][bi, j // ps], j % ps)
  else:
    slot = (bi, h, j)
  if target in ("k", "v") and c[target] is not None and c[target].dtype != np.int8:
    x = c[target].copy()
    x[slot + (int(rng.integers(x.shape[-1])),)] = np.nan
    c[target] = x
  elif target == "k_scale" and kw.get("k_scale") is not None:
    x = np.array(kw["k_scale"])
    x[tuple(0 if n == 1 else i for n, i in zip(x.shape, slot + (0,)))] = np.nan
    kw["k_scale"] = x
  elif target == "bias" and kw.get("bias") is not None:
    x = kw["bias"].copy()
    full = (bi, ti, hi, j) if x.ndim == 4 else ((bi, ti, j) if x.ndim == 3 else (bi, j))
    x[tuple(0 if n == 1 else i for n, i in zip(x.shape, full))] = np.nan
    kw["bias"] = x
  elif target == "alibi" and kw.get("alibi_slopes") is not None:
    kw["alibi_slopes"] = kw["alibi_slopes"].copy()
    kw["alibi_slopes"][hi] = np.nan
  else:  # q (or the target is absent from this call)
    x = c["q"].copy()
    x[(bi, hi) if c["single"] else (bi, ti, hi)] = np.nan
    c["q"] = x
    target = "q"
  return target


def tolerances(c):
  """dtype-keyed (atol, rtol) for out and lse against the float64 oracle. float32:
  rounding of f32 scores and sums; bfloat16: the output's own rounding, the kernels' bf16
  softmax weights in the PV matmul, and an 8-bit cache dequantized to a bf16 query's dtype
  (that rounds each key by 2**-8, so the score error scales with the scores)."""
  bf16 = c["dtype"] == "bfloat16" or c["cache_form"] == "other-float"
  if not bf16:
    return dict(out=(1e-4, 1e-4), lse=(1e-4, 1e-5))
  score_err = 0.0
  if c["dtype"] == "bfloat16" and c["cache_form"] in QDTYPES:
    # |error of a score| <= |scale| * sum_i |q_i| |k_i| * 2**-8 (live keys only: garbage
    # in dead slots is ignored); the lse moves by at most that, out by twice it times |v|.
    kw = c["kw"]
    tables = None if kw.get("block_tables") is None else np.asarray(kw["block_tables"])
    with np.errstate(all="ignore"):
      k = np.abs(contiguous64(c["k"], tables, kw.get("k_scale"), kw.get("k_offset")))
      k = np.where(np.isfinite(k) & (k < 1e6), k, 0.0)
      q = np.abs(np.asarray(c["q"], np.float64))
      q = np.where(np.isfinite(q), q, 0.0).reshape(q.shape[0], -1, q.shape[-1])  # [B, T*Hq, D]
      dots = np.einsum("brd,bhsd->brhs", q[..., :k.shape[-1]], k)  # every (row, key) pair
      scale = 1.0 / math.sqrt(c["q"].shape[-1]) if kw.get("softmax_scale") is None else kw["softmax_scale"]
      score_err = abs(float(scale)) * float(np.max(dots, initial=0.0)) * 2.0 ** -8
  return dict(out=(3e-2 + 2 * score_err, 3e-2), lse=(1e-2 + score_err, 1e-2))


def assert_matches(actual, expected, atol, rtol, what):
  a = host_f32(actual).astype(np.float64)
  e = np.asarray(expected, np.float64)
  assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
  nan_a, nan_e = np.isnan(a), np.isnan(e)
  if (nan_e & ~nan_a).any():
    i = tuple(np.argwhere(nan_e & ~nan_a)[0])
    raise AssertionError(f"{what}: a visible NaN was hidden: expected NaN at {i}, got {a[i]}")
  if (nan_a & ~nan_e).any():
    i = tuple(np.argwhere(nan_a & ~nan_e)[0])
    raise AssertionError(f"{what}: NaN at {i} where the oracle gives {e[i]}")
  inf_a, inf_e = np.isinf(a) & ~nan_a, np.isinf(e)
  if (inf_a != inf_e).any() or (np.sign(a[inf_a]) != np.sign(e[inf_e])).any():
    i = tuple(np.argwhere(inf_a != inf_e)[0]) if (inf_a != inf_e).any() else None
    raise AssertionError(f"{what}: inf positions differ, e.g. at {i}: got "
                         f"{a[i] if i else a[inf_a]}, expected {e[i] if i else e[inf_e]}")
  fin = np.isfinite(e)
  np.testing.assert_allclose(a[fin], e[fin], atol=atol, rtol=rtol, err_msg=what)


class Case(dict):
  """A drawn call; prints compactly (shapes, dtypes, options) in hypothesis' reports."""

  def __repr__(self):
    return _describe(self)


def _describe(c):
  kw = {n: (f"array{np.shape(x)} {np.asarray(x).dtype}" if np.ndim(x) else x) for n, x in c["kw"].items()}
  return (f"q{c['q'].shape} {c['q'].dtype}, k{c['k'].shape} {c['k'].dtype}, "
          f"v{None if c['v'] is None else (c['v'].shape, c['v'].dtype)}, lengths={c['lengths'].tolist()}, "
          f"offset={c['offset'].tolist()}, {kw}, nan={c.get('nan')}")


def check_valid(impl, c):
  kw = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in c["kw"].items()}
  if impl in ("pallas", "mosaic") and kw.get("num_splits") == 64 and c["S"] > 16:
    kw["num_splits"] = 7  # interpreted kernels run a grid step per split: keep it short
  v = None if c["v"] is None else jnp.asarray(c["v"])
  note = _describe(c)
  out, lse = call(impl, jnp.asarray(c["q"]), jnp.asarray(c["k"]), v, jnp.asarray(c["lengths"]),
                   return_lse=True, **kw)
  ref_out, ref_lse = oracle(c)
  assert out.dtype == c["q"].dtype, note
  assert lse.dtype == jnp.float32, note
  tols = tolerances(c)
  assert_matches(out, ref_out, *tols["out"], what=f"out [{impl}] {note}")
  assert_matches(lse, ref_lse, *tols["lse"], what=f"lse [{impl}] {note}")

# Scalar types a static option or an index array may come as (the invalid-call fuzzers).
FLOATS = (np.float32, np.float64, jnp.float32)
INTS = (np.int32, np.int64, np.uint16, jnp.int32)
BOOLS = (np.bool_, jnp.bool_)
