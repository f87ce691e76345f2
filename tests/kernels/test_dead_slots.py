"""Garbage never leaks: a slot no query may see cannot influence any output.

Random garbage (inf, -inf, NaN, huge) is poured into every dead slot of every cache form
(contiguous, paged with recycled pages and stale tables, 8-bit values, scales and
offsets) and the result is compared, bit for bit, with the same call on a clean cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.cache.quant import quantize
from helpers import make_problem
from helpers.paged import paged_problem, pour, with_garbage


def assert_same(a, b):
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.isnan(np.asarray(x, np.float32)).any()


def _quantized(k, v, dtype, with_offset):
  kq, ks = quantize(k, dtype)
  vq, vs = quantize(v, dtype)
  opts = dict(k_scale=ks, v_scale=vs)
  if with_offset:
    opts.update(k_offset=jnp.full_like(ks, 0.5), v_offset=jnp.full_like(vs, -0.5))
  return kq, vq, opts


CACHES = ["float32", "bfloat16", "int8+offset", "float8_e4m3fn", "float8_e5m2"]


def _cache(k, v, form):
  if form in ("float32", "bfloat16"):
    return k.astype(form), v.astype(form), {}
  name = form.split("+")[0]
  return _quantized(k, v, jnp.dtype(name), "offset" in form)


@pytest.mark.parametrize("form", CACHES)
@pytest.mark.parametrize("t", [None, 2], ids=["T1", "T2"])
def test_contiguous_dead_slots(impl, form, t):
  s = 37
  q, k, v = make_problem(20, b=4, t=t, hq=4, hkv=2, s=s, dk=32)
  lengths = jnp.array([s, 0, 1, 17])
  kc, vc, opts = _cache(k, v, form)
  q = q.astype(jnp.bfloat16) if form == "bfloat16" else q
  dead = (jnp.arange(s)[None, None, :, None] >= lengths[:, None, None, None])  # [B, 1, S, 1]
  dirty = {n: pour(a, dead, i) for i, (n, a) in enumerate(opts.items())}
  call = lambda k, v, o: fdecode.flash_decode(q, k, v, lengths, impl=impl, block_k=16,
                                              num_splits=2, return_lse=True, **o)
  assert_same(call(pour(kc, dead, 8), pour(vc, dead, 9), dirty), call(kc, vc, opts))


@pytest.mark.parametrize("form", ["float32", "int8+offset", "float8_e5m2"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_paged_dead_slots(impl, form, page_size):
  """Recycled pages: every pool slot that is not a live token (a sequence's last-page
  tail, spare pages, pages only stale table entries point to) holds garbage."""
  pages_per_seq = 48 // page_size
  q, kp, vp, tables = paged_problem(21, b=3, t=2, hq=4, hkv=2, pages_per_seq=pages_per_seq,
                                    page_size=page_size, dk=32)
  cap = pages_per_seq * page_size
  lengths = np.array([cap, 3, page_size + 2])
  tables = with_garbage(tables, lengths, page_size, kp.shape[1])
  kc, vc, opts = _cache(kp, vp, form)
  live = np.zeros(kp.shape[1:3], bool)  # [P, page_size]
  for b, n in enumerate(lengths):
    for tok in range(n):
      live[tables[b, tok // page_size], tok % page_size] = True
  dead = jnp.asarray(~live)[None, :, :, None]
  dirty = {n: pour(a, dead, i) for i, (n, a) in enumerate(opts.items())}
  call = lambda k, v, o: fdecode.flash_decode(q, k, v, jnp.asarray(lengths), block_tables=tables,
                                              impl=impl, block_k=16, num_splits=3,
                                              return_lse=True, **o)
  assert_same(call(pour(kc, dead, 8), pour(vc, dead, 9), dirty), call(kc, vc, opts))


def test_reference_ignores_dead_slots():
  q, k, v = make_problem(22, b=2, t=None, hq=4, hkv=2, s=64, dk=16)
  lengths = jnp.array([10, 64])
  dead = jnp.arange(64)[None, None, :, None] >= lengths[:, None, None, None]
  clean = fdecode.flash_decode(q, k, v, lengths, impl="reference", return_lse=True)
  dirty = fdecode.flash_decode(q, pour(k, dead, 1), pour(v, dead, 2), lengths, impl="reference",
                               return_lse=True)
  assert_same(dirty, clean)


def test_issue_example_inf_past_length(impl):
  q = jnp.ones((1, 4, 16))
  k = jnp.ones((1, 2, 64, 16))
  v = jnp.ones((1, 2, 64, 16)).at[0, :, 40:].set(jnp.inf)
  out = fdecode.flash_decode(q, k, v, jnp.array([10]), impl=impl)
  np.testing.assert_array_equal(np.asarray(out), 1.0)


def test_sharded_sequence_parallel_dead_slots():
  """Device chunks wholly past a length, and the partial one, hold garbage."""
  mesh = jax.make_mesh((4,), ("s",))
  q, k, v = make_problem(23, b=2, t=None, hq=4, hkv=2, s=64, dk=16)
  lengths = jnp.array([5, 40])
  dead = jnp.arange(64)[None, None, :, None] >= lengths[:, None, None, None]
  call = lambda k, v: fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, seq_axis="s",
                                                   impl="xla", return_lse=True)
  assert_same(call(pour(k, dead, 3), pour(v, dead, 4)), call(k, v))


def test_merge_states_empty_part_contributes_nothing():
  """lse = -inf marks an empty part: its o is ignored even when it is NaN or inf."""
  o = jnp.array([[1.0, 2.0], [jnp.nan, jnp.inf], [3.0, 4.0]])
  lse = jnp.array([0.5, -jnp.inf, 0.25])
  out, out_lse = fdecode.merge_states(o, lse)
  ref, ref_lse = fdecode.merge_states(o[jnp.array([0, 2])], lse[jnp.array([0, 2])])
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
  np.testing.assert_array_equal(np.asarray(out_lse), np.asarray(ref_lse))


def test_merge_states_nan_lse_propagates():
  o = jnp.ones((3, 2))
  out, out_lse = fdecode.merge_states(o, jnp.array([0.0, jnp.nan, 1.0]))
  assert np.isnan(np.asarray(out)).all() and np.isnan(float(out_lse))
