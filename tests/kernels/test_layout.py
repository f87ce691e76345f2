"""flash_decode on token-major caches (kv_layout="NHD") on every impl: the same result as the
head-major call (the Triton kernel reads the token-major cache in place; the other paths
read a head-major view), within float32 reordering, since the two are different compiled
programs; dead-slot garbage changes nothing, bit for bit; and the float32 reference's
within tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.cache.layout import QUANT_ARRAYS, CacheView, head_major
from fdecode.kernels.xla.plan import CHUNK_TOKENS as XLA_CHUNK_TOKENS
from fdecode.cache.quant import dequantize, quantize
from fdecode.reference import reference_decode
from helpers import assert_attention_reordered, assert_close, impl_param, make_problem, max_abs, randn, tol
from helpers.layout import largest_new_array_bytes, nhd
from helpers.paged import paged_problem, with_garbage


def both_layouts(q, k, v, lengths, *, paged=False, k_rope=None, k_scale=None, v_scale=None, k_offset=None,
                 v_offset=None, **kw):
  """(head-major result, token-major result) of the same call, each (out, lse)."""
  quant = dict(k_scale=k_scale, v_scale=v_scale, k_offset=k_offset, v_offset=v_offset)
  hm = fdecode.flash_decode(q, k, v, lengths, k_rope=k_rope, **quant, return_lse=True, **kw)
  return hm, token_major_call(q, k, v, lengths, paged=paged, k_rope=k_rope, **quant, **kw)


def token_major_call(q, k, v, lengths, *, paged, k_rope=None, **kw):
  """flash_decode (out, lse) of head-major-shaped caches (and rank-4 scales) stored token-major."""
  arrays = {n: nhd(x, paged) if n in QUANT_ARRAYS else x for n, x in kw.items()}
  return fdecode.flash_decode(q, nhd(k, paged), nhd(v, paged), lengths, k_rope=nhd(k_rope, paged),
                              kv_layout="NHD", return_lse=True, **arrays)


def assert_same(a, b):
  """Two results of one compiled program (the same call on clean and dirty caches): bit for bit."""
  for x, y, what in zip(a, b, ("out", "lse")):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=what)


def assert_layouts_agree(hm, tm, q, lengths, values):
  """The head-major and token-major calls are different programs (another read, another
  fusion): equal within float32 reordering (`assert_attention_reordered`); ``values`` is
  the largest |value| (dequantized) the rows see."""
  assert_attention_reordered(tm, hm, keys=int(np.max(np.asarray(lengths))), dk=q.shape[-1], values=values)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("s,t", [(40, 2), (10, None)], ids=["S40-T2", "S10-shorter-than-a-block"])
def test_contiguous(impl, dtype, s, t):
  q, k, v = make_problem(0, b=4, t=t, hq=8, hkv=2, s=s, dk=32, dtype=dtype)
  lengths = jnp.array([s, 0, 1, 17 if s > 17 else s - 1], jnp.int32)
  hm, tm = both_layouts(q, k, v, lengths, impl=impl, block_k=16, num_splits=3)
  assert_layouts_agree(hm, tm, q, lengths, max_abs(v))
  q4 = q if t else q[:, None]
  ref, ref_lse = reference_decode(q4, k, v, lengths)
  if t is None:
    ref, ref_lse = ref[:, 0], ref_lse[:, 0]
  assert_close(tm[0], ref, atol=tol(dtype)["atol"], rtol=tol(dtype)["rtol"])
  assert_close(tm[1], ref_lse, atol=tol(dtype)["lse"], rtol=tol(dtype)["lse"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_with_garbage_table_entries(request, impl, page_size, dtype):
  pages_per_seq = 24 if page_size == 1 else 4
  cap = pages_per_seq * page_size
  q, kp, vp, tables = paged_problem(1, b=4, t=2, hq=4, hkv=2, pages_per_seq=pages_per_seq,
                                    page_size=page_size, dk=32, dtype=dtype)
  lengths = jnp.array([cap, 0, 1, cap - 3], jnp.int32)
  tables = with_garbage(tables, lengths, page_size, kp.shape[1])
  hm, tm = both_layouts(q, kp, vp, lengths, paged=True, block_tables=tables, impl=impl, num_splits=3)
  if impl_param(request) == "mosaic" and dtype == jnp.bfloat16 and page_size == 1:
    # On TPU a head-major pool of 1-token bf16 pages takes the XLA path (no DMA addresses
    # a lone 16-bit row); the token-major one the kernel (rows of head-pair words).
    t = tol(dtype)
    assert_close(tm[0], hm[0], atol=t["atol"], rtol=t["rtol"])
    assert_close(tm[1], hm[1], atol=t["lse"], rtol=t["lse"], what="lse")
  else:
    assert_layouts_agree(hm, tm, q, lengths, max_abs(vp))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_int8_per_token_scales(impl, paged):
  q, k, v = make_problem(2, b=2, t=None, hq=4, hkv=2, s=64, dk=32)
  kw, lengths = {}, jnp.array([64, 37], jnp.int32)
  if paged:  # sequence b's page j is pool page 2 * j + b (interleaved)
    to_pool = lambda x: x.reshape(2, 2, 4, 16, x.shape[-1]).transpose(1, 2, 0, 3, 4).reshape(2, 8, 16, -1)
    k, v = to_pool(k), to_pool(v)
    kw["block_tables"] = np.arange(8, dtype=np.int32).reshape(4, 2).T
  kq, ks = quantize(k, jnp.int8)
  vq, vs = quantize(v, jnp.int8)
  hm, tm = both_layouts(q, kq, vq, lengths, paged=paged, k_scale=ks, v_scale=vs, impl=impl, **kw)
  assert_layouts_agree(hm, tm, q, lengths, max_abs(vq) * max_abs(vs))


def test_mla_latent_cache_with_rope_columns(impl):
  """v=None: the values are the latent key's first columns; k_rope token-major too."""
  q, k, _ = make_problem(3, b=2, t=None, hq=8, hkv=1, s=48, dk=48)
  latent, rope = k[..., :32], k[..., 32:]
  hm, tm = both_layouts(q, latent, None, jnp.array([48, 20]), k_rope=rope, v_head_dim=32, impl=impl)
  assert_layouts_agree(hm, tm, q, [48, 20], max_abs(latent))


def test_modifiers_and_nan_in_dead_slots(impl):
  """Window, soft cap and a mask on a token-major cache whose dead slots hold NaN / inf."""
  q, k, v = make_problem(4, b=2, t=3, hq=4, hkv=2, s=48, dk=32)
  lengths = jnp.array([30, 48], jnp.int32)
  dead = (jnp.arange(48) >= lengths[:, None])[:, None, :, None]
  k_bad, v_bad = jnp.where(dead, jnp.nan, k), jnp.where(dead, jnp.inf, v)
  mask = jax.random.bernoulli(jax.random.key(5), 0.8, (2, 48))
  kw = dict(window=20, logits_soft_cap=30.0, mask=mask, impl=impl, block_k=16)
  hm, tm = both_layouts(q, k_bad, v_bad, lengths, **kw)
  assert_layouts_agree(hm, tm, q, lengths, max_abs(v))
  clean = fdecode.flash_decode(q, nhd(k, False), nhd(v, False), lengths, kv_layout="NHD", return_lse=True, **kw)
  assert_same(clean, tm)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_head_pairs_with_modifiers_and_nan(impl, paged):
  """bfloat16 with 4 kv heads: the Mosaic kernel reads a token-major cache as 32-bit words
  holding two heads each (`mosaic_tpu_token_major.words`), one program per pair. A per-head mask,
  ALiBi slopes, a window and NaN / inf in dead slots: the head-major call's result (within
  float32 reordering), and the clean cache's bit for bit."""
  b, s, hkv, ps = 2, 48, 4, 16
  q, k, v = make_problem(6, b=b, t=3, hq=8, hkv=hkv, s=s, dk=32, dtype=jnp.bfloat16)
  lengths = jnp.array([30, 48], jnp.int32)
  dead = (jnp.arange(s) >= lengths[:, None])[:, None, :, None]
  k_bad, v_bad = jnp.where(dead, jnp.nan, k), jnp.where(dead, jnp.inf, v)
  mask = jax.random.bernoulli(jax.random.key(5), 0.8, (b, 3, 8, s))
  kw = dict(window=20, mask=mask, alibi_slopes=jnp.linspace(0.1, 0.8, 8), impl=impl, block_k=16)
  if paged:  # sequence i's page j is pool page 2 * j + i (interleaved)
    to_pool = lambda x: x.reshape(b, hkv, s // ps, ps, 32).transpose(1, 2, 0, 3, 4).reshape(hkv, -1, ps, 32)
    k, v, k_bad, v_bad = (to_pool(x) for x in (k, v, k_bad, v_bad))
    kw["block_tables"] = jnp.arange(b * s // ps, dtype=jnp.int32).reshape(s // ps, b).T
  hm, tm = both_layouts(q, k_bad, v_bad, lengths, paged=paged, **kw)
  assert_layouts_agree(hm, tm, q, lengths, max_abs(v))
  clean = fdecode.flash_decode(q, nhd(k, paged), nhd(v, paged), lengths, kv_layout="NHD", return_lse=True, **kw)
  assert_same(clean, tm)


# The contiguous cases the Mosaic interpreter runs. A contiguous token-major cache is read
# as a pool of whole pages (`contiguous_as_pool`) by the kernel page16 runs for every read
# mode; what the contiguous form adds is that view, which depends on the scales' form and
# k_rope, not on the read mode: per-token scales, MLA latents with k_rope, and per-tensor
# scales (their pool view is a scalar).
PACKED_CONTIGUOUS = {(4, "int8-token"), (2, "mla-bf16-rope"), (8, "e5m2-tensor")}


@pytest.mark.parametrize("hkv,kind", [
    (1, "bf16"), (1, "int8-token"), (1, "mla-e4m3-tiles-rope"),     # one kv head: the head axis
    (4, "int8-token"), (4, "e4m3-tiles"), (8, "e5m2-tensor"), (4, "int8-head-offsets"),  # words of 4
    (2, "mla-bf16-rope"),                                           # bf16 words: latents and k_rope
    (3, "bf16"), (2, "int8-token"), (2, "mla-e4m3-tiles-rope")])   # the whole head axis
@pytest.mark.parametrize("page_size", [None, 1, 16], ids=["contiguous", "page1", "page16"])
def test_packed_heads_in_place(request, impl, hkv, kind, page_size):
  """Token-major 16- and 8-bit caches the Mosaic kernel reads in place beyond head pairs
  (`mosaic_tpu_token_major.token_major_read`): 8-bit caches of 4 or 8 kv heads as words
  of four heads (`unpack_head`; scales per token, per 16-column tile, per head with
  offsets, per tensor), and the rest through windows of the whole head axis: one kv
  head (MQA, MLA latents; there the XLA path and Triton read the head-major view, a
  free reshape), an odd Hkv in bfloat16, 8-bit with 2 heads, fp8 MLA with bf16 k_rope
  and 2 heads (bfloat16 MLA latents with k_rope, 2 heads: words of 2). NaN / inf in dead slots (and their scales) and garbage table entries past the
  lengths: the head-major call's result within float32 reordering, the clean cache's bit
  for bit, and the float32
  reference's within tolerance."""
  if impl_param(request) == "pallas" and hkv > 1:
    pytest.skip("the Triton kernel reads 8-bit token-major caches of several heads as test_int8_per_token_scales does")
  if impl_param(request) == "mosaic" and page_size == 1 and (hkv, kind) != (1, "int8-token"):
    pytest.skip("interpreted at page size 1 once, for one kv head with per-token scales (one DMA per "
                "token and per scale row, whatever the read mode)")
  if impl_param(request) == "mosaic" and page_size is None and (hkv, kind) not in PACKED_CONTIGUOUS:
    pytest.skip("a contiguous token-major cache is read as a pool of whole pages by the same kernel as "
                "page16 (`contiguous_as_pool`): interpreted once per form of scales and k_rope")
  if impl_param(request) == "xla" and page_size == 1 and hkv > 1:
    pytest.skip("the XLA path gathers listed pages whatever their size: page size 1 with one kv head")
  b, s, hq, dk = 3, 48, 2 * hkv, 64  # S = 3 pages of 16: Mosaic's contiguous blocks match
  q, k, v = make_problem(7, b=b, t=2, hq=hq, hkv=hkv, s=s, dk=dk, dtype=jnp.bfloat16)
  if kind != "bf16":  # a float32 query: 8-bit values dequantize exactly (the reference's tolerance)
    q = q.astype(jnp.float32)
  lengths = jnp.array([s, 1, 33], jnp.int32)
  dead = (jnp.arange(s) >= lengths[:, None])[:, None, :, None]
  kw, rope = dict(impl=impl, block_k=32, num_splits=3), None  # 32: int8 sublane tiles
  if kind.startswith("mla"):  # FlashMLA's layout: fp8 latent with tile scales, bf16 RoPE columns
    rope, k, v = k[..., 48:], k[..., :48], None
    kw["v_head_dim"] = 32
  dtype = next((d for name, d in (("int8", jnp.int8), ("e4m3", jnp.float8_e4m3fn), ("e5m2", jnp.float8_e5m2))
                if name in kind), None)

  def quant(k, v):
    if dtype is None:
      return k, v, {}
    if kind.endswith("head-offsets"):  # a scale and an offset per kv head: (values + offset) * scale
      def q8(x, name):
        offset = jnp.linspace(-0.5, 0.5, hkv).reshape(1, hkv, 1, 1)
        scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(0, 2, 3), keepdims=True) / 100
        return (jnp.clip(jnp.round(x / scale - offset), -127, 127).astype(dtype),
                {f"{name}_scale": scale, f"{name}_offset": offset})
      (kq, ks), (vq, vs) = q8(k, "k"), q8(v, "v")
      return kq, vq, {**ks, **vs}
    tile = 16 if "tiles" in kind else None
    q8 = lambda x: quantize(x.astype(jnp.float32), dtype, tile=tile, per_tensor=kind.endswith("tensor"))
    (kq, ks), (vq, vs) = q8(k), (None, None) if v is None else q8(v)
    return kq, vq, dict(k_scale=ks) if v is None else dict(k_scale=ks, v_scale=vs)
  bad = lambda x, fill: None if x is None else jnp.where(dead, fill, x)
  t = tol(jnp.bfloat16) if kind == "bf16" else dict(atol=3e-5, rtol=3e-5, lse=3e-5)
  if page_size:  # sequence i's page j is pool page b * j + i (interleaved), garbage past the lengths
    to_pool = lambda x: x if x is None or x.ndim < 4 else x.transpose(1, 0, 2, 3) if x.shape[2] == 1 else (
        x.reshape(b, x.shape[1], s // page_size, page_size, x.shape[-1]).transpose(1, 2, 0, 3, 4)
        .reshape(x.shape[1], -1, page_size, x.shape[-1]))
    tables = np.arange(b * s // page_size, dtype=np.int32).reshape(s // page_size, b).T
    kw["block_tables"] = with_garbage(tables, lengths, page_size, b * s // page_size)
  else:
    to_pool = lambda x: x
  clean = quant(k, v) + (rope,)
  deq = lambda x, n: x if x is None or f"{n}_scale" not in clean[2] else dequantize(
      x, jnp.atleast_1d(clean[2][f"{n}_scale"]), clean[2].get(f"{n}_offset"))
  kf, vf = deq(clean[0], "k"), deq(clean[1], "v")
  # Dead slots: NaN keys and inf values (int8: -128 bytes), and NaN / inf per-token scales.
  garbage = lambda x, fill: bad(x, fill if x.dtype != jnp.int8 else -128)
  dirty = (garbage(clean[0], jnp.nan), None if v is None else garbage(clean[1], jnp.inf),
           {n: bad(x, jnp.nan if n.startswith("k") else jnp.inf) if x.ndim == 4 and x.shape[2] == s else x
            for n, x in clean[2].items()},
           bad(rope, jnp.nan))
  # The dirty caches in both layouts; the clean ones token-major only (the same program as
  # the dirty token-major call, so bit for bit; head-major dead slots are test_dead_slots').
  pooled = lambda kq, vq, scales, rr: (to_pool(kq), to_pool(vq), to_pool(rr), {n: to_pool(x) for n, x in scales.items()})
  kq, vq, rr, scales = pooled(*dirty)
  hm, tm = both_layouts(q, kq, vq, lengths, paged=page_size is not None, k_rope=rr, **scales, **kw)
  if impl_param(request) == "mosaic" and page_size == 1:
    # A head-major pool of 1-token 16- / 8-bit pages takes the XLA path on TPU (no DMA
    # addresses a lone packed row); the token-major one the kernel (whole tile rows).
    assert_close(tm[0], hm[0], atol=t["atol"], rtol=t["rtol"])
    assert_close(tm[1], hm[1], atol=t["lse"], rtol=t["lse"], what="lse")
  else:
    assert_layouts_agree(hm, tm, q, lengths, max_abs(kf[..., :32] if vf is None else vf))
  kq, vq, rr, scales = pooled(*clean)
  assert_same(token_major_call(q, kq, vq, lengths, paged=page_size is not None, k_rope=rr, **scales, **kw), tm)
  kf, vf = (None if x is None else x.astype(jnp.float32) for x in (kf, vf))
  if rope is not None:
    kf, vf = jnp.concatenate([kf, rope.astype(jnp.float32)], -1), kf[..., :32]
  ref, ref_lse = reference_decode(q, kf, vf, lengths)
  assert_close(tm[0], ref, atol=t["atol"], rtol=t["rtol"])
  assert_close(tm[1], ref_lse, atol=t["lse"], rtol=t["lse"], what="lse")


def test_errors_name_the_token_major_shapes():
  q, k, v = make_problem(5, b=2, t=None, hq=4, hkv=2, s=40, dk=32)
  with pytest.raises(ValueError, match=r"head dim Dk of q \(16\).*kv_layout='NHD' the caches given are "
                                       r"k.shape=\(2, 40, 2, 32\), v.shape=\(2, 40, 2, 32\)"):
    fdecode.flash_decode(q[..., :16], nhd(k, False), nhd(v, False), jnp.array([40, 3]), kv_layout="NHD")
  with pytest.raises(ValueError, match=r"kv_layout=.NHD., k must be \[B, S, Hkv, D\]"):
    fdecode.flash_decode(q, k[0], v[0], jnp.array([40, 3]), kv_layout="NHD")
  with pytest.raises(ValueError, match="kv_layout must be one of"):
    fdecode.flash_decode(q, k, v, jnp.array([40, 3]), kv_layout="nhd")


@pytest.mark.parametrize("hkv", [1, 4])
def test_cache_view_geometry_and_read_rule(hkv):
  """The view flash_decode builds once: token axis, capacity, kv heads, page size and the
  read rule for HND / NHD x contiguous / paged; head-major shapes without a transpose;
  the head-major view built once; a pytree whose layout and paging are static."""
  b, s, ps, d = 2, 48, 16, 8
  sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  tables = jax.ShapeDtypeStruct((b, s // ps), jnp.int32)
  stored = {("HND", False): (b, hkv, s, d), ("NHD", False): (b, s, hkv, d),
            ("HND", True): (hkv, b * s // ps, ps, d), ("NHD", True): (b * s // ps, ps, hkv, d)}
  for (layout, paged), shape in stored.items():
    view = CacheView.of(sds(shape), sds(shape), block_tables=tables if paged else None, kv_layout=layout)
    case = (layout, paged, hkv)
    assert (view.layout, view.paged, view.kv_heads, view.capacity) == (layout, paged, hkv, s), case
    assert view.token_axis == (1 if layout == "NHD" else 2), case
    assert shape[view.token_axis] == (ps if paged else s), case
    assert (view.page_size, view.num_pages) == ((ps, b * s // ps) if paged else (None, None)), case
    assert view.read_layout == ("NHD" if layout == "NHD" and hkv > 1 else "HND"), case
    assert view.head_major_shapes()[0].shape == stored["HND", paged], case
    hm = view.head_major()
    assert hm.layout == "HND" and hm.k.shape == stored["HND", paged] and view.head_major() is hm, case
    assert view.read(layout) is view and view.read("HND") is hm, case
    leaves, tree = jax.tree_util.tree_flatten(view)
    assert len(leaves) == (3 if paged else 2), case
    assert jax.tree_util.tree_unflatten(tree, leaves).head_major_shapes() == view.head_major_shapes(), case
  k = jnp.zeros((b, s, hkv))  # rank 3: the same error as before the view
  with pytest.raises(ValueError, match=r"flash_decode: with kv_layout='NHD', k must be \[B, S, Hkv, D\]; "
                                       r"got k.shape=\(2, 48, " + str(hkv) + r"\)"):
    CacheView.of(k, k, kv_layout="NHD")
  with pytest.raises(ValueError, match=r"kv_layout=.NHD., k must be \[B, S, Hkv, D\]"):
    fdecode.flash_decode(jnp.zeros((b, hkv, d)), k, k, jnp.array([40, 3]), kv_layout="NHD")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("layout,paged", [("NHD", False), ("NHD", True), ("HND", True)],
                         ids=["nhd-contiguous", "nhd-pool", "hnd-pool"])
def test_xla_path_reads_caches_in_place(layout, paged, dtype):
  """The CPU path (XLA) reads a token-major cache, and any pool, chunk by chunk: the
  compiled step makes no array larger than a chunk (a quarter of the tokens, in float32):
  no transpose, copy or float32 widening of the whole cache. XLA:CPU widens a 16-bit float array it slices in a loop to
  float32 first; `fdecode.kernels.xla.dense` reads such caches as integer words. 8-bit: fp8
  values with a per-token scale."""
  b, s, hkv, g, d, ps = 2, 4 * XLA_CHUNK_TOKENS, 2, 2, 64, 16  # 4 chunks (at least)
  if paged:
    shape = (b * s // ps, ps, hkv, d) if layout == "NHD" else (hkv, b * s // ps, ps, d)
    tables = jnp.arange(b * s // ps, dtype=jnp.int32).reshape(b, s // ps)[:, ::-1]
  else:
    shape, tables = (b, s, hkv, d), None
  kw = dict(block_tables=tables, kv_layout=layout, impl="xla")
  quantized = dtype == jnp.float8_e4m3fn
  kf = randn(1, shape, jnp.float32)
  vf = randn(2, shape, jnp.float32)
  q = randn(0, (b, hkv * g, d), jnp.bfloat16 if quantized else dtype)
  lengths = jnp.array([s, s // 2 + 3], jnp.int32)
  if quantized:
    k, kw["k_scale"] = quantize(kf, jnp.float8_e4m3fn)
    v, kw["v_scale"] = quantize(vf, jnp.float8_e4m3fn)
  else:
    k, v = kf.astype(dtype), vf.astype(dtype)
  call = jax.jit(lambda q, k, v: fdecode.flash_decode(q, k, v, lengths, **kw))
  hlo = call.lower(q, k, v).compile().as_text()
  chunk_bytes = k.size // 4 * 4  # a quarter of the cache's tokens, widened to float32
  cache_bytes = k.size * k.dtype.itemsize
  assert largest_new_array_bytes(hlo) <= chunk_bytes, (
      f"{layout} {'pool' if paged else 'contiguous'} {jnp.dtype(dtype).name}: an array of "
      f"{largest_new_array_bytes(hlo)} B next to a {cache_bytes} B cache")
  # ... and the result is the head-major call's, within the reference's tolerance.
  hm = lambda x: head_major(x, layout, paged)
  want = fdecode.flash_decode(q, hm(k), hm(v), lengths, block_tables=tables, impl="reference",
                              **{n: hm(kw[n]) for n in ("k_scale", "v_scale") if n in kw})
  t = tol(jnp.bfloat16 if dtype != jnp.float32 else dtype)
  assert_close(call(q, k, v), want, atol=t["atol"], rtol=t["rtol"])
