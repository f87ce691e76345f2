"""Paged and 8-bit caches: against the reference on the gathered / dequantized cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.cache import PageAllocator, PoolExhaustedError, gather_pages, write_contiguous, write_paged
from fdecode.cache.quant import dequantize, quantize
from fdecode.reference import reference_decode
from helpers import assert_close, impl_param, make_problem, randn, tol
from helpers.paged import paged_problem, with_garbage


@pytest.mark.parametrize("page_size", [1, 8, 16, 64])
@pytest.mark.parametrize("t", [None, 2], ids=["T1", "T2"])
def test_paged_matches_reference(impl, page_size, t):
  pages_per_seq = max(64 // page_size, 2) if page_size > 1 else 24  # page size 1: one DMA per token
  cap = pages_per_seq * page_size
  q, kp, vp, tables = paged_problem(0, b=4, t=t, hq=4, hkv=2, pages_per_seq=pages_per_seq,
                                    page_size=page_size, dk=32)
  lengths = jnp.array([cap, 0, 1, cap - page_size + 1 if page_size > 1 else cap - 3])
  tables = with_garbage(tables, lengths, page_size, kp.shape[1])
  out, lse = fdecode.flash_decode(q, kp, vp, lengths, block_tables=tables, impl=impl, num_splits=3,
                                  return_lse=True)
  q4 = q if t else q[:, None]
  ref, ref_lse = reference_decode(q4, gather_pages(kp, jnp.asarray(tables)),
                                  gather_pages(vp, jnp.asarray(tables)), lengths)
  if t is None:
    ref, ref_lse = ref[:, 0], ref_lse[:, 0]
  assert_close(out, ref, atol=3e-5, rtol=3e-5)
  assert_close(lse, ref_lse, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_gqa_bf16_and_under_jit(impl, dtype):
  q, kp, vp, tables = paged_problem(1, b=3, t=None, hq=8, hkv=1, pages_per_seq=5, page_size=16, dk=64, dtype=dtype)
  lengths = jnp.array([80, 17, 33])
  f = jax.jit(lambda q, kp, vp, bt, n: fdecode.flash_decode(q, kp, vp, n, block_tables=bt, impl=impl))
  out = f(q, kp, vp, jnp.asarray(tables), lengths)
  ref = fdecode.flash_decode(q, kp, vp, lengths, block_tables=tables, impl="reference")
  assert_close(out, ref, atol=tol(dtype)["atol"], rtol=tol(dtype)["rtol"])


def test_paged_equals_contiguous(impl):
  """The same cache stored paged and contiguous gives the same answer."""
  q, k, v = make_problem(2, b=2, t=None, hq=4, hkv=2, s=48, dk=32)
  page_size = 16
  kp = k.reshape(2, 2, 3, page_size, 32).transpose(1, 0, 2, 3, 4).reshape(2, 6, page_size, 32)
  vp = v.reshape(2, 2, 3, page_size, 32).transpose(1, 0, 2, 3, 4).reshape(2, 6, page_size, 32)
  tables = np.arange(6, dtype=np.int32).reshape(2, 3)
  lengths = jnp.array([48, 20])
  a = fdecode.flash_decode(q, kp, vp, lengths, block_tables=tables, impl=impl)
  b = fdecode.flash_decode(q, k, v, lengths, impl=impl)
  assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_against_jax_tpu_paged_attention():
  """JAX's own paged kernel (TPU interpret mode on CPU). It applies no softmax scale, so we
  pre-scale q; its matmuls round like a TPU, hence the ~1e-2 tolerance."""
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
  b, hq, hkv, d, ps, pps = 2, 8, 2, 128, 16, 8
  q, kp, vp, tables = paged_problem(3, b=b, t=None, hq=hq, hkv=hkv, pages_per_seq=pps, page_size=ps, dk=d, spare=0)
  lengths = jnp.array([128, 37], jnp.int32)
  ours = fdecode.flash_decode(q, kp, vp, lengths, block_tables=tables, impl="pallas")
  with pltpu.force_tpu_interpret_mode():
    theirs = paged_attention(q / np.sqrt(d), kp, vp, lengths, jnp.asarray(tables), pages_per_compute_block=4)
  assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


# --- quantized caches --------------------------------------------------------------------

GRANULARITIES = {
    "tensor": dict(per_tensor=True),
    "token": dict(tile=None),
    "tile32": dict(tile=32),   # n_tiles = D / 32 (FlashMLA-style tiles, scaled down)
}


@pytest.mark.parametrize("qdtype", [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("gran", list(GRANULARITIES))
def test_quantized_contiguous(impl, qdtype, gran):
  q, k, v = make_problem(4, b=3, t=None, hq=4, hkv=2, s=37, dk=64)
  kq, ks = quantize(k, qdtype, **GRANULARITIES[gran])
  vq, vs = quantize(v, qdtype, **GRANULARITIES[gran])
  lengths = jnp.array([37, 0, 16])
  out, lse = fdecode.flash_decode(q, kq, vq, lengths, k_scale=ks, v_scale=vs, impl=impl,
                                  block_k=16, num_splits=2, return_lse=True)
  # Exact check: reference on the dequantized cache.
  ref, ref_lse = reference_decode(q[:, None], dequantize(kq, ks if ks.ndim else ks.reshape(1, 1, 1, 1)),
                                  dequantize(vq, vs if vs.ndim else vs.reshape(1, 1, 1, 1)), lengths)
  assert_close(out, ref[:, 0], atol=3e-5, rtol=3e-5)
  assert_close(lse, ref_lse[:, 0], atol=3e-5, rtol=3e-5)
  # Close to the float-cache result (quantization error only).
  full = fdecode.flash_decode(q, k, v, lengths, impl="reference")
  err = float(jnp.max(jnp.abs(out - full)))
  assert err < {jnp.int8: 0.03, jnp.float8_e4m3fn: 0.12, jnp.float8_e5m2: 0.25}[qdtype], err


def test_quantized_per_head_scale_with_offset_and_bf16_query(impl):
  """Asymmetric int8 (Ascend antiquant): real = (x + offset) * scale, scale/offset per head."""
  q, k, v = make_problem(5, b=2, t=3, hq=4, hkv=2, s=40, dk=32, dtype=jnp.bfloat16)
  rng = np.random.default_rng(0)
  kq = jnp.asarray(rng.integers(-128, 128, k.shape), jnp.int8)
  vq = jnp.asarray(rng.integers(-128, 128, v.shape), jnp.int8)
  scale = jnp.asarray(rng.uniform(0.005, 0.02, (1, 2, 1, 1)), jnp.float32)
  offset = jnp.asarray(rng.integers(-5, 5, (1, 2, 1, 1)), jnp.float32)
  lengths = jnp.array([40, 9])
  out = fdecode.flash_decode(q, kq, vq, lengths, k_scale=scale, v_scale=scale, k_offset=offset,
                             v_offset=offset, impl=impl, block_k=16)
  ref, _ = reference_decode(q, dequantize(kq, scale, offset), dequantize(vq, scale, offset), lengths)
  assert_close(out, ref, atol=tol(jnp.bfloat16)["atol"], rtol=tol(jnp.bfloat16)["rtol"])


@pytest.mark.parametrize("gran", ["token", "tile32"])
def test_quantized_paged(impl, gran):
  q, kp, vp, tables = paged_problem(6, b=2, t=None, hq=4, hkv=2, pages_per_seq=4, page_size=8, dk=64)
  kq, ks = quantize(kp, jnp.int8, **GRANULARITIES[gran])  # ks: [Hkv, P, ps, nt]
  vq, vs = quantize(vp, jnp.int8, **GRANULARITIES[gran])
  lengths = jnp.array([32, 13])
  out = fdecode.flash_decode(q, kq, vq, lengths, block_tables=tables, k_scale=ks, v_scale=vs, impl=impl)
  ref = fdecode.flash_decode(q, dequantize(kq, ks), dequantize(vq, vs), lengths, block_tables=tables,
                             impl="reference")
  assert_close(out, ref, atol=3e-5, rtol=3e-5)


# --- validation ----------------------------------------------------------------------------

def test_paged_and_quant_errors():
  q, kp, vp, tables = paged_problem(7, b=2, t=None, hq=4, hkv=2, pages_per_seq=2, page_size=8, dk=32, spare=0)
  with pytest.raises(ValueError, match=r"block_tables must be \[B, n\] with B=2; got block_tables.shape=\(3, 2\)"):
    fdecode.flash_decode(q, kp, vp, jnp.array([3, 3]), block_tables=np.zeros((3, 2), np.int32))
  with pytest.raises(ValueError, match="block_tables must be integer"):
    fdecode.flash_decode(q, kp, vp, jnp.array([3, 3]), block_tables=np.zeros((2, 2), np.float32))
  bad = tables.copy(); bad[1, 1] = 4
  with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = 4 is out of range \[0, P=4\).*sequence 1"):
    fdecode.flash_decode(q, kp, vp, jnp.array([3, 9]), block_tables=bad)
  fdecode.flash_decode(q, kp, vp, jnp.array([3, 8]), block_tables=bad)  # entry past the length: fine
  with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=16\]"):
    fdecode.flash_decode(q, kp, vp, jnp.array([3, 17]), block_tables=tables)
  kq, ks = quantize(kp, jnp.int8)
  with pytest.raises(ValueError, match="k has dtype int8: pass k_scale"):
    fdecode.flash_decode(q, kq, vp, jnp.array([3, 3]), block_tables=tables)
  with pytest.raises(ValueError, match=r"k_scale must be a scalar or shaped like the cache.*\(2, 4, 8, 3\)"):
    fdecode.flash_decode(q, kq, vp, jnp.array([3, 3]), block_tables=tables, k_scale=jnp.ones((2, 4, 8, 3)))
  with pytest.raises(ValueError, match="v_scale/v_offset given but v is not quantized"):
    fdecode.flash_decode(q, kq, vp, jnp.array([3, 3]), block_tables=tables, k_scale=ks, v_scale=1.0)


def test_out_of_range_page_ids_under_jit_are_clipped_not_read_out_of_bounds(impl):
  q, kp, vp, tables = paged_problem(8, b=2, t=None, hq=2, hkv=1, pages_per_seq=2, page_size=8, dk=32, spare=0)
  bad = tables.copy(); bad[0, 1] = 99
  f = jax.jit(lambda bt: fdecode.flash_decode(q, kp, vp, jnp.array([16, 16]), block_tables=bt, impl=impl))
  out = f(jnp.asarray(bad))
  clipped = bad.copy(); clipped[0, 1] = kp.shape[1] - 1
  ref = fdecode.flash_decode(q, kp, vp, jnp.array([16, 16]), block_tables=clipped, impl="reference")
  assert_close(out, ref, atol=3e-5, rtol=3e-5)


# --- cache writes and the allocator -----------------------------------------------------------

def test_write_contiguous_round_trip_and_donation():
  q, k, v = make_problem(9, b=2, t=None, hq=4, hkv=2, s=32, dk=16)
  lengths = jnp.array([5, 30])
  k_new = randn(1, (2, 2, 2, 16))
  v_new = randn(2, (2, 2, 2, 16))
  step = jax.jit(write_contiguous, donate_argnums=(0, 1))
  k2, v2 = step(k + 0, v + 0, k_new, v_new, lengths)
  np.testing.assert_array_equal(k2[0, :, 5:7], k_new[0])
  np.testing.assert_array_equal(v2[1, :, 30:32], v_new[1])
  np.testing.assert_array_equal(k2[0, :, :5], k[0, :, :5])
  # A position past S is dropped, not written elsewhere.
  k3, _ = write_contiguous(k, v, k_new, v_new, jnp.array([31, 0]))
  np.testing.assert_array_equal(k3[0, :, 31], k_new[0, :, 0])
  np.testing.assert_array_equal(k3[0, :, :31], k[0, :, :31])
  # Donation: the compiled update aliases the donated caches to its outputs (updated in place).
  hlo = jax.jit(write_contiguous, donate_argnums=(0, 1)).lower(k, v, k_new, v_new, lengths).compile().as_text()
  assert "input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }" in hlo, hlo[:400]


@pytest.mark.parametrize("gran", ["tensor", "token"])
def test_write_then_read_quantized(gran):
  """Decode after writing tokens into an int8 cache = decode over the dequantized cache."""
  q, k, v = make_problem(10, b=2, t=None, hq=4, hkv=2, s=24, dk=32)
  kq, ks = quantize(k, jnp.int8, **GRANULARITIES[gran])
  vq, vs = quantize(v, jnp.int8, **GRANULARITIES[gran])
  k_new = randn(3, (2, 2, 32))
  v_new = randn(4, (2, 2, 32))
  kq2, vq2, ks2, vs2 = write_contiguous(kq, vq, k_new, v_new, jnp.array([10, 3]), k_scale=ks, v_scale=vs)
  kd = dequantize(kq2, ks2 if jnp.ndim(ks2) else jnp.reshape(ks2, (1, 1, 1, 1)))
  np.testing.assert_allclose(kd[0, :, 10], k_new[0], atol=0.03 if gran == "token" else 0.05)
  out = fdecode.flash_decode(q, kq2, vq2, jnp.array([11, 4]), k_scale=ks2, v_scale=vs2, impl="xla")
  ref = fdecode.flash_decode(q, kd, dequantize(vq2, vs2 if jnp.ndim(vs2) else jnp.reshape(vs2, (1, 1, 1, 1))),
                             jnp.array([11, 4]), impl="reference")
  assert_close(out, ref, atol=3e-5, rtol=3e-5)


def test_allocator_write_paged_decode_round_trip():
  page_size, hkv, d = 4, 2, 16
  alloc = PageAllocator(num_pages=10, page_size=page_size, max_pages_per_seq=4)
  kp = jnp.zeros((hkv, 10, page_size, d)); vp = jnp.zeros((hkv, 10, page_size, d))
  k_full = randn(5, (2, hkv, 13, d))
  v_full = randn(6, (2, hkv, 13, d))
  alloc.allocate("a", 6); alloc.allocate("b", 13)
  table = alloc.block_table(["a", "b"])
  kp, vp = write_paged(kp, vp, table, jnp.array([0, 0]), k_full[:, :, :6], v_full[:, :, :6])
  kp, vp = write_paged(kp, vp, table, jnp.array([6, 6]), k_full[:, :, 6:13], v_full[:, :, 6:13])  # "a" drops 7+
  got = gather_pages(kp, jnp.asarray(np.maximum(table, 0)))
  np.testing.assert_array_equal(got[1, :, :13], k_full[1])
  np.testing.assert_array_equal(got[0, :, :8], k_full[0, :, :8])  # "a" owns 2 pages = 8 slots
  q = randn(7, (2, 4, d))
  out = fdecode.flash_decode(q, kp, vp, jnp.array([6, 13]), block_tables=table, impl="xla")
  ref = fdecode.flash_decode(q, k_full, v_full, jnp.array([6, 13]), impl="reference")
  assert_close(out, ref, atol=3e-5, rtol=3e-5)


def test_allocator_properties():
  """Random allocate/extend/free: no page is ever owned twice; pages are conserved."""
  rng = np.random.default_rng(0)
  alloc = PageAllocator(num_pages=32, page_size=4, max_pages_per_seq=8)
  live = {}
  for step in range(400):
    op = rng.integers(3)
    if op == 0:
      n = int(rng.integers(1, 33))
      try:
        alloc.allocate(step, n); live[step] = n
      except PoolExhaustedError:
        assert alloc.num_free < -(-n // 4)
      except ValueError:
        assert n > 32
    elif op == 1 and live:
      sid = list(live)[rng.integers(len(live))]
      n = min(live[sid] + int(rng.integers(1, 9)), 32)
      try:
        alloc.extend(sid, n); live[sid] = n
      except PoolExhaustedError:
        pass
    elif live:
      sid = list(live)[rng.integers(len(live))]
      alloc.free(sid); del live[sid]
    owned = [p for sid in live for p in alloc.pages(sid)]
    assert len(owned) == len(set(owned)), "a page is owned by two live sequences"
    assert len(owned) + alloc.num_free == 32
    for sid, n in live.items():
      assert len(alloc.pages(sid)) >= -(-n // 4)
  with pytest.raises(KeyError):
    alloc.free("nope")
  with pytest.raises(PoolExhaustedError, match="more pages"):
    PageAllocator(2, 4, 8).allocate("x", 12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("t,window", [(None, None), (3, 24)], ids=["T1", "T3-window"])
def test_balanced_schedule_matches_reference(request, impl, dtype, page_size, t, window):
  """``num_splits="balance"`` (the Triton kernel's work items, `ragged_decode`'s prefill
  blocks): a batch of mostly empty rows beside lengths 1, block±1 and the capacity, NaN
  / inf in the pages past each length and garbage table entries, against the float32
  reference (the other paths pick their splits as for None)."""
  if impl_param(request) == "mosaic":
    pytest.skip("a Triton schedule: Mosaic picks its splits as for num_splits=None")
  block, pages_per_seq = 16, 64 // page_size
  cap = pages_per_seq * page_size
  q, kp, vp, tables = paged_problem(9, b=9, t=t, hq=8, hkv=2, pages_per_seq=pages_per_seq,
                                    page_size=page_size, dk=32, dtype=dtype)
  lengths = jnp.array([0, cap, 0, 1, 0, block - 1, block + 1, 0, cap - 3], jnp.int32)
  if t is not None:  # each sequence holds at least its T new tokens
    lengths = jnp.where(lengths > 0, jnp.maximum(lengths, t), 0)
  tables = with_garbage(tables, lengths, page_size, kp.shape[1])
  gather = lambda pool: jnp.take(pool, jnp.clip(jnp.asarray(tables), 0, pool.shape[1] - 1), axis=1) \
      .transpose(1, 0, 2, 3, 4).reshape(9, 2, cap, 32)
  k, v = gather(kp), gather(vp)  # the clean contiguous view, for the reference
  dead_pages = np.setdiff1d(np.arange(kp.shape[1]), np.asarray(tables)[
      np.arange(pages_per_seq)[None, :] < -(-np.asarray(lengths)[:, None] // page_size)])
  kp, vp = kp.at[:, dead_pages].set(jnp.nan), vp.at[:, dead_pages].set(jnp.inf)
  out, lse = fdecode.flash_decode(q, kp, vp, lengths, block_tables=tables, impl=impl, num_splits="balance",
                                  block_k=block, window=window, return_lse=True)
  q4 = q if t else q[:, None]
  ref, ref_lse = reference_decode(q4, k, v, lengths, window=window)
  if t is None:
    ref, ref_lse = ref[:, 0], ref_lse[:, 0]
  tl = tol(dtype)
  assert_close(out, ref, atol=tl["atol"], rtol=tl["rtol"])
  assert_close(lse, ref_lse, atol=tl["lse"], rtol=tl["lse"], what="lse")


def test_balanced_schedule_with_no_live_block():
  """Every length 0 (`ragged_decode`'s prefill call in a step of decodes only, which runs
  on GPU with no conditional around it): no work item is used, none stores a partial
  state, and every row comes out 0 with lse -inf, whatever the pool and q hold."""
  q, kp, vp, tables = paged_problem(3, b=5, t=4, hq=8, hkv=2, pages_per_seq=4, page_size=16, dk=32,
                                    dtype=jnp.float32)
  kp, vp, q = kp.at[:].set(jnp.nan), vp.at[:].set(jnp.inf), q.at[0].set(jnp.nan)
  out, lse = fdecode.flash_decode(q, kp, vp, jnp.zeros(5, jnp.int32), block_tables=tables, impl="pallas",
                                  interpret=True, num_splits="balance", return_lse=True)
  np.testing.assert_array_equal(np.asarray(out), 0)
  assert np.isneginf(np.asarray(lse)).all()


def test_balanced_schedule_covers_every_block_once():
  """`fdecode.kernels.triton.balanced_schedule`: every live block of every sequence belongs to exactly
  one used item, no item exceeds ceil(blocks / (items - live)) blocks, and the items
  needed never exceed the grid, for random lengths with many empty rows."""
  from fdecode.kernels.common import block as blk
  from fdecode.kernels.triton import balanced_schedule as _balanced_schedule
  from fdecode.kernels.common.modifiers import Modifiers
  bk, s = 16, 1024

  @functools.partial(jax.jit, static_argnums=1)
  def schedule(ends, items):  # and every item's blocks, as the kernel computes them
    seq, work, item_ends = _balanced_schedule(ends, items, bk, 1, s, Modifiers())
    return seq, work, item_ends, *blk.split_range(item_ends, work[:, 0], work[:, 1], 1, s, bk, Modifiers())
  rng = np.random.default_rng(0)
  for trial, (b, items) in enumerate([(1, 2), (5, 6), (5, 40), (37, 38), (37, 80)] * 4):
    ends = np.where(rng.random(b) < 0.7, 0, rng.integers(1, s + 1, b)).astype(np.int32)
    seq, work, item_ends, first, last = (np.asarray(x) for x in schedule(jnp.asarray(ends), items))
    covered, item_blocks = {i: [] for i in range(b)}, [0]
    for w in range(items):
      if seq[w] == b:
        assert item_ends[w] == 0 and first[w] == last[w]
        continue
      covered[int(seq[w])] += list(range(int(first[w]), int(last[w])))
      item_blocks.append(int(last[w]) - int(first[w]))
    blocks = -(-ends // bk)
    live = int((blocks > 0).sum())
    per = max(1, -(-int(blocks.sum()) // max(items - live, 1)))
    for i in range(b):
      assert sorted(covered[i]) == list(range(blocks[i])), (trial, i)
    assert max(item_blocks) <= per, (trial, max(item_blocks), per)
