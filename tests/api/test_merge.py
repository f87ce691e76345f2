"""merge_states: the one implementation of the LSE combine."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from helpers import assert_close, assert_reordered, make_problem, max_abs, randn


@pytest.mark.parametrize("cut", [0, 1, 17, 33, 63, 64])
def test_split_anywhere_then_merge_equals_whole(cut):
  """Attention over cache[:cut] and cache[cut:] merged == attention over the whole cache."""
  q, k, v = make_problem(10, b=3, t=None, hq=4, hkv=2, s=64, dk=32)
  lengths = jnp.array([64, 40, 5])
  whole, whole_lse = fdecode.flash_decode(q, k, v, lengths, impl="reference", return_lse=True)
  left = fdecode.flash_decode(q, k[:, :, :cut], v[:, :, :cut], jnp.minimum(lengths, cut),
                              impl="reference", return_lse=True) if cut else None
  # Right part: keys [cut, S). A query of a sequence of length n sees n - cut of them.
  right = fdecode.flash_decode(q, k[:, :, cut:], v[:, :, cut:], jnp.clip(lengths - cut, 0, 64 - cut),
                               impl="reference", return_lse=True) if cut < 64 else None
  parts = [p for p in (left, right) if p is not None]
  o, lse = fdecode.merge_states(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]))
  assert_close(o, whole, atol=2e-6, rtol=2e-6)
  assert_close(lse, whole_lse, atol=2e-6, rtol=2e-6)


def test_empty_parts_contribute_nothing_and_all_empty_is_zero():
  o = randn(0, (3, 2, 5))
  lse = jnp.array([[0.5, -jnp.inf], [-jnp.inf, -jnp.inf], [1.5, -jnp.inf]])
  out, out_lse = fdecode.merge_states(o, lse, axis=0)
  w = jax.nn.softmax(jnp.array([0.5, 1.5]))
  np.testing.assert_allclose(out[0], w[0] * o[0, 0] + w[1] * o[2, 0], rtol=1e-6)
  np.testing.assert_allclose(out_lse[0], jnp.logaddexp(0.5, 1.5), rtol=1e-6)
  np.testing.assert_array_equal(out[1], 0.0)
  assert np.isneginf(out_lse[1])


class MergeStatesVariantsTest(chex.TestCase):
  """`merge_states` called as it is and under ``jax.jit`` (``axis`` static)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_axis_and_order_invariance(self):
    merge = self.variant(fdecode.merge_states, static_argnames="axis")
    o = randn(1, (2, 4, 3, 8))
    lse = randn(2, (2, 4, 3))
    a = merge(o, lse, axis=1)
    perm = jnp.array([2, 0, 3, 1])
    b = merge(o[:, perm], lse[:, perm], axis=-2)  # negative axes count on lse
    c = merge(jnp.moveaxis(o, 1, 0), jnp.moveaxis(lse, 1, 0), axis=0)
    chex.assert_trees_all_close((b[0], c[0]), (a[0], a[0]), rtol=1e-5, atol=1e-6)  # out
    chex.assert_trees_all_close((b[1], c[1]), (a[1], a[1]), rtol=1e-6)  # lse


def test_single_part_is_identity():
  o = randn(3, (1, 4, 8))
  lse = jnp.array([[0.1, -jnp.inf, 3.0, -2.0]])
  out, out_lse = fdecode.merge_states(o, lse)
  np.testing.assert_allclose(out[jnp.array([0, 2, 3])], o[0, jnp.array([0, 2, 3])], rtol=1e-6)
  np.testing.assert_array_equal(out[1], 0.0)
  np.testing.assert_array_equal(out_lse, lse[0])


def test_shape_errors():
  with pytest.raises(ValueError, match=r"o.shape\[:-1\] must equal lse.shape"):
    fdecode.merge_states(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="axis=3 out of range"):
    fdecode.merge_states(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3)), axis=3)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("cuts", [(20,), (7, 33, 40)])
def test_chunks_with_kv_offset_merge_to_whole(impl, cuts):
  """A cache cut into chunks, each decoded with its kv_offset (causal T > 1 queries whose
  windows straddle chunk ends included), merges to the whole cache's answer."""
  q, k, v = make_problem(11, b=4, t=3, hq=4, hkv=2, s=48, dk=32)
  lengths = jnp.array([48, 21, 34, 2])
  whole, whole_lse = fdecode.flash_decode(q, k, v, lengths, impl="reference", return_lse=True)
  bounds = (0, *cuts, 48)
  parts = [fdecode.flash_decode(q, k[:, :, a:b], v[:, :, a:b], lengths, kv_offset=a, impl=impl,
                                block_k=8, return_lse=True) for a, b in zip(bounds, bounds[1:])]
  o, lse = fdecode.merge_states(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]))
  assert_close(o, whole, atol=3e-5, rtol=3e-5)
  assert_close(lse, whole_lse, atol=3e-5, rtol=3e-5)


def test_kv_offset_per_sequence_and_errors():
  q, k, v = make_problem(12, b=2, t=None, hq=2, hkv=1, s=16, dk=16)
  full_k = jnp.concatenate([jnp.zeros_like(k[:, :, :5]), k], axis=2)
  full_v = jnp.concatenate([jnp.zeros_like(v[:, :, :5]), v], axis=2)
  lengths = jnp.array([30, 9])  # past the chunk's end / inside it
  out = fdecode.flash_decode(q, k, v, lengths, kv_offset=jnp.array([5, 5]))
  # Same as masking positions < 5 of a cache that starts at 0.
  ref = fdecode.flash_decode(q, full_k[:, :, 5:], full_v[:, :, 5:], jnp.minimum(lengths - 5, 16), impl="reference")
  assert_close(out, ref, atol=3e-5, rtol=3e-5)
  with pytest.raises(ValueError, match=r"kv_offset must be a scalar or \[B\]=\(2,\)"):
    fdecode.flash_decode(q, k, v, lengths, kv_offset=jnp.array([1, 2, 3]))


def test_merge_segments_is_merge_states_per_segment():
  """`merge_segments` (the Triton combine kernel merges the balanced schedule's items so):
  each segment's parts give `merge_states` of them (within float32 reordering), with its semantics for empty
  parts, a NaN lse or o, and +inf; a segment with no part is (0, -inf); parts whose id
  is out of range are dropped, NaN and all."""
  from fdecode.combine import merge_segments
  o = randn(1, (9, 2, 4))
  lse = randn(2, (9, 2))
  lse = lse.at[1, 0].set(-jnp.inf).at[3, 1].set(jnp.nan).at[5, 0].set(jnp.inf)
  o = o.at[6, 1].set(jnp.nan).at[8].set(jnp.nan)
  lse = lse.at[8].set(jnp.nan)
  segments = jnp.array([0, 0, 2, 2, 2, 4, 4, 4, 7])  # 1, 3: no part; 7 out of range: dropped
  out, out_lse = merge_segments(o, lse, segments, 5)
  for seg, parts in ((0, slice(0, 2)), (2, slice(2, 5)), (4, slice(5, 8))):
    want, want_lse = fdecode.merge_states(o[parts], lse[parts], axis=0)
    # A segment sum and a reduction are two programs (their float32 sums of up to three
    # parts may round differently): NaN / inf positions exact, values within reordering.
    assert_reordered(out[seg], want, terms=3, scale=max_abs(o), what=f"segment {seg} o")
    assert_reordered(out_lse[seg], want_lse, terms=3, scale=max(1.0, max_abs(want_lse)), what=f"segment {seg} lse")
  for seg in (1, 3):
    np.testing.assert_array_equal(np.asarray(out[seg]), 0.0)
    assert np.isneginf(np.asarray(out_lse[seg])).all()
  with pytest.raises(ValueError, match="merge_segments"):
    merge_segments(o, lse, segments[:3], 5)


@pytest.mark.parametrize("rows,chunk", [(1, 4), (4, 2), (8, 1)])
def test_segmented_combine_kernel_is_merge_segments(rows, chunk):
  """The Triton combine kernel, segmented (the balanced schedule's merge, interpreted): each
  sequence merges the items the schedule gives it (derived in the kernel from the ends),
  as `merge_segments` does (empty parts, NaN lse or o, +inf; a sequence with no item
  gives 0, -inf; an empty item, NaN here, is no one's), then joins the sinks and lays the
  rows out as ``[B, T * Hq, Dv]``. A program merges a tile of ``rows`` query rows (8:
  past R = 4, masked), ``chunk`` items a loop step (sequence 2's three items in one step,
  two, or three)."""
  from fdecode.combine import apply_sinks, merge_segments
  from fdecode.kernels.common.modifiers import Modifiers
  from fdecode.kernels.triton import CombinePlan, Schedule, balanced_schedule, combine
  n, hkv, t, g, dv, b = 9, 2, 2, 2, 8, 5
  r = t * g
  o = randn(3, (n, hkv, r, 1, dv))
  lse = randn(4, (n, hkv, r, 1))
  lse = lse.at[1, 0, 0].set(-jnp.inf).at[3, 1, 2].set(jnp.nan).at[5, 0, 1].set(jnp.inf)
  o = o.at[6, 1, 3].set(jnp.nan).at[8].set(jnp.nan)
  lse = lse.at[8].set(jnp.nan)
  # Blocks of 16 keys [3, 0, 7, 0, 5]: 3 an item, items [0, 2, 2, 2, 4, 4] (1, 3: no item), 6-8 empty.
  ends = jnp.array([40, 0, 100, 0, 70], jnp.int32)
  sched = Schedule(items=n, batch=b, block=16, num_tokens=t, seq_len=128, mods=Modifiers())
  segments = balanced_schedule(ends, n, 16, t, 128, Modifiers())[0]
  np.testing.assert_array_equal(segments, [0, 2, 2, 2, 4, 4, b, b, b])
  sinks = jnp.linspace(-1.0, 1.0, hkv * g)
  plan = CombinePlan(num_splits=n, width=4, num_tokens=t, group=g, hq=hkv * g, dv=dv, out_dtype="float32",
                     interpret=True, schedule=sched, rows=rows, chunk=chunk)
  out, out_lse = combine(plan, o, lse, sinks, ends=ends)
  want, want_lse = merge_segments(o[:, :, :, 0], lse[:, :, :, 0], segments, b)  # [B, Hkv, R, Dv]
  want = want.reshape(b, hkv, t, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, hkv * g, dv)
  want_lse = want_lse.reshape(b, hkv, t, g).transpose(0, 2, 1, 3).reshape(b, t, hkv * g)
  want, want_lse = apply_sinks(want, want_lse, sinks)
  assert_reordered(out.reshape(b, t, hkv * g, dv), want, terms=3, scale=max_abs(o), what="o")
  assert_reordered(out_lse.reshape(b, t, hkv * g), want_lse, terms=3, scale=max(1.0, max_abs(want_lse)),
                   what="lse")
