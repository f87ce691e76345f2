"""Sparse top-k attention (DeepSeek V3.2, FlashMLA sparse): ``flash_decode(..., indices=...)``.

The oracle is `reference_decode` over the whole cache with a boolean mask built here, in
numpy, from the index lists (independent of `fdecode.kernels.common.sparse`): position j is visible to a
query iff some entry of its list equals j (duplicates count once, -1 and out-of-cache
entries select nothing), ANDed with lengths, causality and the window as usual.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.cache.paged import gather_pages
from fdecode.cache.quant import dequantize, quantize
from fdecode.reference import reference_decode
from helpers import (assert_attention_reordered, assert_close, impl_param, interpreted_once, make_problem,
                     max_abs, randn, tol)
from helpers.layout import largest_new_array_bytes, nhd
from helpers.lowering import TPU_CALL, TRITON_CALL, lower_for_cuda, lower_for_tpu
from helpers.sparse import index_mask, random_indices

BLOCK = 16
S = 3 * BLOCK + 5


def check(q, k, v, lengths, indices, *, impl, dtype=jnp.float32, kv_offset=0, ref_kv=None, **kw):
  out, lse = fdecode.flash_decode(q, k, v, lengths, indices=indices, impl=impl, return_lse=True,
                                  kv_offset=kv_offset if kv_offset else None, **kw)
  kf, vf = ref_kv if ref_kv is not None else (k, v)
  q4 = q if q.ndim == 4 else q[:, None]
  hkv, s = kf.shape[1], kf.shape[2]
  mask = index_mask(indices, q.shape, hkv, s, kv_offset)
  mods = {n: kw[n] for n in ("window", "logits_soft_cap", "causal", "sinks", "alibi_slopes") if n in kw}
  ref, ref_lse = reference_decode(q4, kf.astype(jnp.float32), vf.astype(jnp.float32),
                                  jnp.asarray(lengths) - kv_offset, mask=jnp.asarray(mask), **mods)
  if q.ndim == 3:
    ref, ref_lse = ref[:, 0], ref_lse[:, 0]
  t = tol(dtype)
  assert_close(out, ref, atol=t["atol"], rtol=t["rtol"], what="out")
  assert_close(lse, ref_lse, atol=t["lse"], rtol=t["lse"], what="lse")
  return out, lse


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("form", ["[B,K]", "[B,T,K]", "[B,T,Hkv,K]"])
def test_sparse_matches_reference(request, impl, dtype, form):
  """T = 3 new tokens; lengths 0, 1, block±1 and S; K = 40 (not a block multiple), with
  -1 entries, out-of-cache entries and duplicates; num_splits 3."""
  if dtype == jnp.bfloat16 or form == "[B,T,K]":  # per-token lists: folded like per-head ones
    interpreted_once(request, "bf16 and per-token folding once, with per-head lists", form="[B,T,Hkv,K]")
  lengths = [0, 1, BLOCK - 1, BLOCK + 1, S]
  q, k, v = make_problem(0, b=5, t=3, hq=8, hkv=2, s=S, dk=32, dtype=dtype)
  shape = {"[B,K]": (5, 40), "[B,T,K]": (5, 3, 40), "[B,T,Hkv,K]": (5, 3, 2, 40)}[form]
  idx = random_indices(1, shape, S)
  out, lse = check(q, k, v, jnp.array(lengths), idx, impl=impl, dtype=dtype, block_k=BLOCK, num_splits=3)
  assert np.all(np.asarray(out[0]) == 0) and np.isneginf(np.asarray(lse[0])).all()


def test_single_token_forms(request, impl):
  """q ``[B, Hq, D]`` with ``[B, K]`` and ``[B, Hkv, K]``; more splits than blocks."""
  interpreted_once(request, "the TPU kernel reads these lists as test_sparse_matches_reference's", impl="pallas")
  q, k, v = make_problem(2, b=3, t=None, hq=6, hkv=3, s=S, dk=32)
  lengths = jnp.array([S, 20, 3])
  for shape in ((3, 24), (3, 3, 24)):
    check(q, k, v, lengths, random_indices(3, shape, S), impl=impl, block_k=BLOCK, num_splits=5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged(request, impl, page_size):
  """Gathered through the block table; stale (-1) table entries past each length."""
  interpreted_once(request, "page size 1: one DMA per token either way", page_size=1)
  b, s = 3, 37
  q, k, v = make_problem(4, b=b, t=2, hq=4, hkv=2, s=s, dk=32)
  n = -(-s // page_size)
  r = np.random.default_rng(0)
  tables = r.permutation(b * n + 2)[: b * n].reshape(b, n).astype(np.int32)
  pool = lambda x: jnp.asarray(r.normal(size=(2, b * n + 2, page_size, 32)), jnp.float32)
  kp, vp = pool(k), pool(v)
  lengths = np.array([s, 10, 0])
  tables[1, -(-10 // page_size):] = -1
  full = lambda x: gather_pages(x, jnp.asarray(np.maximum(tables, 0)))
  idx = random_indices(5, (b, 2, 2, 20), n * page_size)
  check(q, kp, vp, lengths, idx, impl=impl, block_tables=tables, block_k=BLOCK, num_splits=2,
        ref_kv=(full(kp), full(vp)))


def test_mla_fp8_with_rope(impl):
  """Sparse over FlashMLA's cache: fp8 latent (1x32 tiles) + bf16 RoPE columns, v=None."""
  b, s, dc, dr = 2, 40, 64, 32
  q = randn(6, (b, 2, 16, dc + dr), jnp.bfloat16)
  k = randn(7, (b, 1, s, dc + dr), jnp.bfloat16)
  latent, scale = quantize(k[..., :dc], jnp.float8_e4m3fn, tile=32)
  rope = k[..., dc:]
  full = jnp.concatenate([dequantize(latent, scale), rope.astype(jnp.float32)], axis=-1)
  idx = random_indices(8, (b, 2, 12), s)
  check(q, latent, None, jnp.array([40, 25]), idx, impl=impl, dtype=jnp.bfloat16, v_head_dim=dc,
        k_scale=scale, k_rope=rope, block_k=BLOCK, ref_kv=(full, full[..., :dc]))


def test_with_window_soft_cap_and_kv_offset(impl):
  """Indices are sequence positions: with kv_offset (a chunk of a longer sequence) the
  cache holds ``[kv_offset, kv_offset + S)``; a window and a soft cap still apply."""
  q, k, v = make_problem(9, b=2, t=2, hq=4, hkv=2, s=S, dk=32)
  offset = 30
  lengths = jnp.array([offset + S, offset + 20])
  idx = random_indices(10, (2, 2, 30), offset + S) 
  check(q, k, v, lengths, idx, impl=impl, kv_offset=offset, window=25, logits_soft_cap=5.0, block_k=BLOCK)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unselected_garbage_never_leaks(impl, dtype):
  """inf / NaN in every slot no list selects (and past the lengths) changes no bit. bf16
  (an even S): the TPU kernel DMAs 2-row units, so a selected token's neighbour arrives
  in VMEM holding NaN / inf and must be selected away."""
  s = S if dtype == jnp.float32 else S + 1
  q, k, v = make_problem(11, b=2, t=2, hq=4, hkv=2, s=s, dk=32, dtype=dtype)
  lengths = jnp.array([s, 30])
  idx = random_indices(12, (2, 2, 16), s, dup=False)
  sel = index_mask(idx, q.shape, 2, s)[:, :, ::2].any(axis=1)  # [B, Hkv, S]: a slot some query may read
  bad = jnp.asarray(~sel)[..., None]
  dirty = lambda x: jnp.where(bad, jnp.where(jnp.arange(s)[:, None] % 2 == 0, jnp.nan, jnp.inf), x).astype(dtype)
  run = lambda kk, vv: fdecode.flash_decode(q, kk, vv, lengths, indices=idx, impl=impl, block_k=BLOCK,
                                            return_lse=True)
  a, a_lse = check(q, k, v, lengths, idx, impl=impl, dtype=dtype, block_k=BLOCK)
  b, b_lse = run(dirty(k), dirty(v))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(a_lse), np.asarray(b_lse))


@pytest.mark.parametrize("paged", [False, True])
def test_one_token_cache(paged):
  """S = 1 (contiguous) or one page of one slot: the XLA gather once took a token axis of
  1 for a per-head scale's and failed to reshape (found by tests/kernels/test_fuzz.py)."""
  q, k, v = make_problem(17, b=2, t=None, hq=4, hkv=2, s=1, dk=16)
  lengths, idx = np.array([1, 0]), np.array([[0, 0, -1, 0, 1], [0, 0, 0, 0, 0]], np.int32)
  if not paged:
    check(q, k, v, lengths, idx, impl="xla")
    return
  kp, vp = k.transpose(1, 0, 2, 3)[:, :1], v.transpose(1, 0, 2, 3)[:, :1]  # [Hkv, P=1, ps=1, D]
  tables = np.zeros((2, 1), np.int32)
  kd, vd = gather_pages(kp, tables), gather_pages(vp, tables)
  check(q, kp, vp, lengths, idx, impl="xla", block_tables=tables, ref_kv=(kd, vd))


def test_everything_selected_equals_dense():
  """Every position selected once: exactly the dense decode (one more independent check)."""
  q, k, v = make_problem(13, b=2, t=3, hq=4, hkv=2, s=S, dk=32)
  lengths = jnp.array([S, 19])
  idx = np.broadcast_to(np.random.default_rng(0).permutation(S), (2, S)).astype(np.int32)
  dense = fdecode.flash_decode(q, k, v, lengths, impl="xla")
  for impl in ("xla", "pallas"):
    out = fdecode.flash_decode(q, k, v, lengths, indices=idx, impl=impl, block_k=BLOCK)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), atol=3e-5, rtol=3e-5)


def test_sharded_over_sequence_and_heads():
  """Global positions, split with the sequences and the kv heads; each device's chunk of
  the cache reads only its own selected tokens."""
  q, k, v = make_problem(14, b=2, t=2, hq=8, hkv=2, s=64, dk=16)
  lengths = jnp.array([64, 21])
  idx = random_indices(15, (2, 2, 2, 24), 64)
  mesh = jax.make_mesh((2, 4), ("h", "s"))
  mask = jnp.asarray(index_mask(idx, q.shape, 2, 64))
  ref, ref_lse = reference_decode(q, k, v, lengths, mask=mask)
  for impl, extra in (("xla", {}), ("pallas", dict(interpret=True))):
    out, lse = fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, head_axis="h", seq_axis="s",
                                            indices=idx, impl=impl, return_lse=True, **extra)
    assert_close(out, ref, atol=3e-5, rtol=3e-5)
    assert_close(lse, ref_lse, atol=3e-5, rtol=3e-5, what="lse")


@pytest.mark.parametrize("indices, message", [
    (np.zeros((2,), np.int32), "indices must be"),
    (np.zeros((2, 3, 2, 4, 5), np.int32), "indices must be"),
    (np.zeros((2, 8), np.float32), "integer"),
    (np.zeros((3, 8), np.int32), "indices must be"),
    (np.zeros((2, 5, 8), np.int32), "indices must be"),
])
def test_bad_indices(indices, message):
  q, k, v = make_problem(16, b=2, t=3, hq=4, hkv=2, s=16, dk=16)
  with pytest.raises(ValueError, match=message):
    fdecode.flash_decode(q, k, v, jnp.array([16, 4]), indices=indices)


def test_indices_with_mask_is_an_error():
  q, k, v = make_problem(17, b=2, t=None, hq=4, hkv=2, s=16, dk=16)
  with pytest.raises(ValueError, match="mask"):
    fdecode.flash_decode(q, k, v, jnp.array([16, 4]), indices=np.zeros((2, 4), np.int32),
                         mask=jnp.ones((2, 16), bool))


@pytest.mark.parametrize("page_size", [None, 64])
def test_sparse_mla_lowers_for_tpu_and_cuda(page_size):
  """DeepSeek V3.2: G = 64 rows on one 576-wide latent head, K = 2048 per token, T = 2."""
  b, s, hq = 2, 8192, 64
  sds = jax.ShapeDtypeStruct
  q = sds((b, 2, hq, 576), jnp.bfloat16)
  opts = dict(indices=sds((b, 2, 2048), jnp.int32))
  if page_size is None:
    k = sds((b, 1, s, 576), jnp.bfloat16)
  else:
    k = sds((1, b * s // page_size, page_size, 576), jnp.bfloat16)
    opts["block_tables"] = sds((b, s // page_size), jnp.int32)
  fn = lambda q, k, n, opts: fdecode.flash_decode(q, k, None, n, v_head_dim=512, impl="pallas", **opts)
  args = (q, k, sds((b,), jnp.int32), opts)
  assert TPU_CALL in lower_for_tpu(fn, *args)
  assert TRITON_CALL in lower_for_cuda(fn, *args)


@pytest.mark.parametrize("kind", [
    "f32-hkv2", "bf16-hkv2-paged16", "int8-hkv4-token-paged16",   # unit heads a DMA: 1, 2, 4
    "mla-e4m3-rope-hkv1-paged16", "bf16-hkv3"])                   # the whole head axis
def test_token_major_in_place(request, impl, kind):
  """Token-major caches (kv_layout="NHD"), read in place by the TPU kernel
  (`mosaic_tpu_token_major.sparse_token_major_read`): a listed token's DMA brings the
  2 / 4 heads of its packed sublane (or the whole head axis), so head h's buffer
  neighbours are other heads' rows. Per-kv-head lists (the MLA case shares one list),
  and NaN / inf in every (slot, head) its head's list does not select: the neighbours
  that arrive beside a selected row, and the slots never read. Within tolerance of the
  float32 reference; the XLA path and Triton the head-major call's (within float32
  reordering: another compiled program)."""
  paged = "paged16" in kind
  hkv = int(kind.split("hkv")[1][0])
  b, s, dk = 2, 48, 32
  dtype = jnp.float32 if kind.startswith("f32") else jnp.bfloat16
  q, k, v = make_problem(21, b=b, t=2, hq=2 * hkv, hkv=hkv, s=s, dk=dk, dtype=dtype)
  lengths = jnp.array([s, 29])
  mla = kind.startswith("mla")
  idx = random_indices(22, (b, 2, 12) if mla else (b, 2, hkv, 12), s, dup=False)
  sel = index_mask(idx, q.shape, hkv, s)[:, :, ::2].any(axis=1)  # [B, Hkv, S]: a slot its head may read
  bad = jnp.asarray(~sel)[..., None]
  kw, ref_kv = dict(impl=impl, block_k=BLOCK, num_splits=2, return_lse=True, indices=idx), None
  if mla:  # FlashMLA's cache: fp8 latent with 1x16 tile scales, bf16 RoPE columns
    latent, scale = quantize(k[..., :16].astype(jnp.float32), jnp.float8_e4m3fn, tile=16)
    rope = k[..., 16:]
    kf = jnp.concatenate([dequantize(latent, scale), rope.astype(jnp.float32)], -1)
    ref_kv = (kf, kf[..., :16])
    caches = dict(k=latent, v=None, k_rope=rope, k_scale=scale)
    kw["v_head_dim"] = 16
  elif kind.startswith("int8"):
    (kq, ks), (vq, vs) = (quantize(x.astype(jnp.float32), jnp.int8) for x in (k, v))
    ref_kv = (dequantize(kq, ks), dequantize(vq, vs))
    caches = dict(k=kq, v=vq, k_scale=ks, v_scale=vs)
  else:
    caches = dict(k=k, v=v)
  fill = lambda x, f: None if x is None else jnp.where(bad, f if x.dtype != jnp.int8 else -128, x).astype(x.dtype)
  dirty = {n: fill(x, jnp.nan if n.startswith("k") else jnp.inf) if n != "v" or x is not None else x
           for n, x in caches.items()}
  if paged:  # sequence i's page j is pool page 2 * j + i
    to_pool = lambda x: x if x is None or x.ndim < 4 else (
        x.reshape(b, hkv, s // 16, 16, x.shape[-1]).transpose(1, 2, 0, 3, 4).reshape(hkv, -1, 16, x.shape[-1]))
    dirty = {n: to_pool(x) for n, x in dirty.items()}
    kw["block_tables"] = jnp.arange(b * s // 16, dtype=jnp.int32).reshape(s // 16, b).T
  args = lambda c: (c["k"], c["v"])
  rest = lambda c: {n: x for n, x in c.items() if n not in ("k", "v")}
  tm = fdecode.flash_decode(q, *(nhd(x, paged) for x in args(dirty)), lengths, kv_layout="NHD",
                            **{n: nhd(x, paged) for n, x in rest(dirty).items()}, **kw)
  kf, vf = ref_kv if ref_kv is not None else (k, v)
  ref, ref_lse = reference_decode(q, kf.astype(jnp.float32), vf.astype(jnp.float32), lengths,
                                  mask=jnp.asarray(index_mask(idx, q.shape, hkv, s)))
  t = tol(dtype) if not mla and not kind.startswith("int8") else tol(jnp.bfloat16)
  assert_close(tm[0], ref, atol=t["atol"], rtol=t["rtol"], what="out")
  assert_close(tm[1], ref_lse, atol=t["lse"], rtol=t["lse"], what="lse")
  if impl_param(request) != "mosaic":  # XLA and Triton read either layout in the same block order
    hm = fdecode.flash_decode(q, *args(dirty), lengths, **rest(dirty), **kw)
    # Two layouts are two compiled programs: equal within float32 reordering.
    assert_attention_reordered(tm, hm, keys=idx.shape[-1], dk=q.shape[-1],
                               values=max_abs(v if ref_kv is None else ref_kv[1]))


@pytest.mark.parametrize("dtype,paged", [(jnp.bfloat16, False), (jnp.int8, True)], ids=["bf16-contiguous", "int8-pool"])
def test_xla_path_gathers_token_major_rows_in_place(dtype, paged):
  """The XLA path gathers the listed rows of a token-major cache where they lie: the
  compiled call makes no array of a quarter of the cache. (It gathers from the
  head-major view, whose transpose XLA fuses into the gather; this guards that.)"""
  b, s, hkv, d, kk = 2, 8192, 2, 64, 256
  shape = (b * s // 16, 16, hkv, d) if paged else (b, s, hkv, d)
  kw = dict(block_tables=jnp.arange(b * s // 16, dtype=jnp.int32).reshape(b, s // 16)) if paged else {}
  x = randn(0, shape, jnp.float32)
  if dtype == jnp.int8:
    k, kw["k_scale"] = quantize(x, jnp.int8)
    v, kw["v_scale"] = quantize(-x, jnp.int8)
  else:
    k, v = x.astype(dtype), (-x).astype(dtype)
  q = randn(1, (b, 2, 2 * hkv, d), jnp.bfloat16)
  lengths, idx = jnp.array([s, 3000]), random_indices(2, (b, kk), s)
  call = jax.jit(lambda q, k, v: fdecode.flash_decode(q, k, v, lengths, indices=idx, kv_layout="NHD",
                                                      impl="xla", **kw))
  cache_bytes = k.size * k.dtype.itemsize
  biggest = largest_new_array_bytes(call.lower(q, k, v).compile().as_text())
  assert biggest < cache_bytes / 4, f"an array of {biggest} B next to a {cache_bytes} B cache"
  hm = lambda a: a.transpose(2, 0, 1, 3) if paged else a.swapaxes(1, 2)
  want = fdecode.flash_decode(q, hm(k), hm(v), lengths, indices=idx, impl="xla",
                              **{n: hm(a) if jnp.ndim(a) == 4 else a for n, a in kw.items()})
  # The jitted token-major call and the head-major one are two programs: float32 reordering.
  assert_attention_reordered(call(q, k, v), want, keys=kk, dk=d,
                             values=max_abs(v) * (max_abs(kw["v_scale"]) if "v_scale" in kw else 1.0))
