"""Corruption never hides: a NaN a query sees propagates to its row on every impl, split
count and device count, while "no visible key" (out 0, lse -inf) is decided by positions.

The counterpart of tests/kernels/test_dead_slots.py (garbage a query may not see never leaks).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.combine import apply_sinks, merge_states
from helpers import impl_param, make_problem, randn

S = 64
LENGTHS = jnp.array([40, 64])


def _rows(out, lse):
  """Per row (sequence b, head h) of a T = 1 call: (out all NaN, lse NaN)."""
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  return np.isnan(out).all(axis=-1), np.isnan(lse)


def _expect_nan_rows(out, lse, nan_rows):
  """Rows in ``nan_rows`` (bool ``[B, Hq]``) are NaN in out and lse; every other row is
  finite and has a finite lse."""
  out_nan, lse_nan = _rows(out, lse)
  np.testing.assert_array_equal(out_nan, nan_rows)
  np.testing.assert_array_equal(lse_nan, nan_rows)
  others = ~nan_rows
  assert np.isfinite(np.asarray(out, np.float32)[others]).all()
  assert np.isfinite(np.asarray(lse)[others]).all()


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("where", ["k", "v", "v-inf"])
def test_visible_nan_propagates(impl, num_splits, where):
  """The issue's repro: a NaN in a key (or value) sequence 0 sees, at position 3. Before,
  the XLA and Pallas paths gave out 0, lse -inf (the "empty row" answer), and with splits
  the NaN chunk dropped out of the merge, leaving a finite, wrong value. A corrupt value
  (NaN or inf) makes the whole row and its lse NaN, as a key does and as the reference
  does: a single-token row once gave a NaN (or inf) in that value's column only, with a
  finite lse, while the rows of a prefill chunk and the reference gave the whole row."""
  q, k, v = make_problem(1, b=2, t=None, hq=4, hkv=2, s=S, dk=32)
  if where == "k":
    k = k.at[0, 0, 3, 0].set(jnp.nan)
  else:
    v = v.at[0, 0, 3, 5].set(jnp.nan if where == "v" else jnp.inf)
  out, lse = fdecode.flash_decode(q, k, v, LENGTHS, impl=impl, num_splits=num_splits,
                                  block_k=16, return_lse=True)
  nan_rows = np.zeros((2, 4), bool)
  nan_rows[0, :2] = True  # kv head 0 serves query heads 0, 1 (G = 2)
  _expect_nan_rows(out, lse, nan_rows)
  ref_out, ref_lse = fdecode.flash_decode(q, k, v, LENGTHS, impl="reference", return_lse=True)
  _expect_nan_rows(ref_out, ref_lse, nan_rows)


def test_nan_past_the_end_is_still_dead(impl):
  """The same NaN past sequence 0's length is selected away: bit-identical to clean."""
  q, k, v = make_problem(2, b=2, t=None, hq=4, hkv=2, s=S, dk=32)
  dirty = k.at[0, 0, 45, 0].set(jnp.nan)
  call = lambda kk: fdecode.flash_decode(q, kk, v, LENGTHS, impl=impl, num_splits=3, block_k=16,
                                         return_lse=True)
  for a, b in zip(call(dirty), call(k)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_empty_rows_from_positions(impl):
  """Length 0 (no visible key) is out 0, lse -inf, with other rows' NaN beside it."""
  q, k, v = make_problem(3, b=3, t=None, hq=4, hkv=2, s=S, dk=32)
  k = k.at[1, 1, 10, 3].set(jnp.nan)
  out, lse = fdecode.flash_decode(q, k, v, jnp.array([0, 30, 64]), impl=impl, num_splits=4,
                                  block_k=16, return_lse=True)
  assert (np.asarray(out)[0] == 0).all() and (np.asarray(lse)[0] == -np.inf).all()
  assert np.isnan(np.asarray(lse)[1, 2:]).all() and np.isfinite(np.asarray(lse)[1, :2]).all()
  assert np.isfinite(np.asarray(out)[2]).all()


@pytest.mark.parametrize("slope", [np.nan, np.inf])
def test_non_finite_alibi_slope_propagates(slope):
  """A NaN or inf ALiBi slope used to zero its head (out 0, lse -inf). ``inf * 0`` at the
  query's own position is NaN, so both give a NaN head, as the reference does."""
  q, k, v = make_problem(4, b=2, t=None, hq=4, hkv=2, s=S, dk=32)
  slopes = jnp.array([0.5, slope, 0.25, 0.125], jnp.float32)
  nan_rows = np.zeros((2, 4), bool)
  nan_rows[:, 1] = True
  for impl in ["xla", "reference"]:
    out, lse = fdecode.flash_decode(q, k, v, LENGTHS, impl=impl, num_splits=2,
                                    alibi_slopes=slopes, return_lse=True)
    _expect_nan_rows(out, lse, nan_rows)


def test_sharded_seq_axis_propagates():
  """Over a sequence axis, the device holding the NaN chunk no longer drops out."""
  mesh = jax.make_mesh((4,), ("s",), devices=jax.devices()[:4])
  q, k, v = make_problem(5, b=2, t=None, hq=4, hkv=2, s=S, dk=32)
  k = k.at[0, 0, 20, 0].set(jnp.nan)  # device 1's chunk [16, 32)
  out, lse = fdecode.sharded_flash_decode(q, k, v, LENGTHS, mesh=mesh, seq_axis="s",
                                          return_lse=True, impl="xla")
  nan_rows = np.zeros((2, 4), bool)
  nan_rows[0, :2] = True
  _expect_nan_rows(out, lse, nan_rows)


def test_sinks_limits():
  """A +inf sink takes all the weight: out 0, lse +inf (the limit), not NaN; a -inf sink
  is no sink; a NaN sink propagates to its head."""
  q, k, v = make_problem(6, b=2, t=None, hq=4, hkv=2, s=S, dk=32)
  sinks = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.5], jnp.float32)
  plain_out, plain_lse = fdecode.flash_decode(q, k, v, LENGTHS, impl="xla", return_lse=True)
  for impl in ["xla", "reference"]:
    out, lse = fdecode.flash_decode(q, k, v, LENGTHS, impl=impl, sinks=sinks, return_lse=True)
    out, lse = np.asarray(out), np.asarray(lse)
    assert (out[:, 0] == 0).all() and (lse[:, 0] == np.inf).all()
    np.testing.assert_allclose(out[:, 1], plain_out[:, 1], atol=1e-6)
    np.testing.assert_allclose(lse[:, 1], plain_lse[:, 1], atol=1e-6)
    assert np.isnan(out[:, 2]).all() and np.isnan(lse[:, 2]).all()
    assert np.isfinite(out[:, 3]).all() and np.isfinite(lse[:, 3]).all()


def test_merge_states_nan_in_negligible_part():
  """A non-empty part whose weight underflows to 0 still carries its NaN into the merge
  (one softmax would give 0 * NaN = NaN); an empty part's NaN o never does."""
  o = jnp.array([[1.0, 2.0], [jnp.nan, 0.0], [jnp.nan, jnp.nan]])
  lse = jnp.array([0.0, -200.0, -jnp.inf])
  out, out_lse = merge_states(o, lse)
  assert np.isnan(np.asarray(out)[0]) and np.asarray(out)[1] == 2.0
  assert np.asarray(out_lse) == 0.0
  out, out_lse = apply_sinks(jnp.array([[1.0, 2.0]]), jnp.array([0.0]), jnp.array([-jnp.inf]))
  np.testing.assert_array_equal(np.asarray(out), [[1.0, 2.0]])


@pytest.mark.parametrize("form", ["T=3 causal", "per-head mask", "paged T=3", "MLA T=3"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_corrupt_value_reaches_only_rows_that_see_it(request, impl, form, bad):
  """Rows of one kv head that see different slots: a non-finite value at a slot only some
  of them see (the last new token's own value; a slot one head's mask hides) turns those
  rows NaN and no other. The PV matmul shares value rows across a kv head's rows, so
  without the per-row select (`fdecode.kernels.common.block.guard_values`) 0 * NaN reached the
  earlier tokens too."""
  if impl_param(request) != "xla" and bad == np.inf:
    pytest.skip("interpreted kernels run this path once (the NaN case)")
  t = 1 if form == "per-head mask" else 3
  mla = form == "MLA T=3"
  q, k, v = make_problem(3, b=2, t=t, hq=4, hkv=2, s=S, dk=32)
  lengths = jnp.array([40, 64])
  kw, seen = {}, np.zeros((2, t, 4), bool)  # which (b, t, hq) rows see the corrupt slot
  if form == "per-head mask":
    mask = np.ones((2, 1, 4, S), bool)
    mask[0, 0, 1, 20] = False  # head 1 (kv head 0) does not see slot 20; head 0 does
    kw["mask"] = jnp.asarray(mask)
    slot, seen[0, 0, 0] = 20, True
  else:
    slot, seen[0, 2, :2] = 39, True  # sequence 0's last new token, kv head 0's two heads
  if mla:
    k = k.at[0, 0, slot, 5].set(bad)  # a value column of the latent (v = k[..., :16])
    args, kw = (q, k, None), dict(kw, v_head_dim=16)
  else:
    args = (q, k, v.at[0, 0, slot, 5].set(bad))
  if form == "paged T=3":
    tables = jnp.array([[3, 0, 1, 2], [7, 6, 5, 4]])
    pool = lambda x: jnp.zeros((2, 8, 16, x.shape[-1]), x.dtype).at[:, tables.reshape(-1)].set(
        x.transpose(1, 0, 2, 3).reshape(2, 8, 16, -1))
    args, kw = (q, pool(args[1]), pool(args[2])), dict(kw, block_tables=tables)
  clean = fdecode.flash_decode(q, *( (k, None) if mla else (k, v)), lengths, impl="xla",
                               **{n: x for n, x in kw.items() if n != "block_tables"})
  for impl_ in (impl, "reference") if impl == "xla" else (impl,):
    out, lse = fdecode.flash_decode(*args, lengths, impl=impl_, num_splits=3, block_k=16,
                                    return_lse=True, **kw)
    out, lse = np.asarray(out).reshape(2, t, 4, -1), np.asarray(lse).reshape(2, t, 4)
    np.testing.assert_array_equal(np.isnan(lse), seen, err_msg=impl_)
    assert np.isnan(out[seen]).all(), impl_
    np.testing.assert_allclose(out[~seen], np.asarray(clean).reshape(2, t, 4, -1)[~seen],
                               atol=2e-5, rtol=2e-5, err_msg=impl_)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_bias_garbage_a_row_may_not_see_stays_in_its_row(impl, bad):
  """A per-token bias entry of an earlier token at a later token's slot (causally hidden)
  may hold anything. The Mosaic kernel expands bias rows by a one-hot matmul, which once
  carried 0 * NaN / 0 * inf from that entry into every row (found by tests/kernels/test_fuzz.py)."""
  q, k, v = make_problem(5, b=2, t=3, hq=4, hkv=2, s=S, dk=32)
  lengths = jnp.array([40, 64])
  bias = randn(6, (2, 3, 4, S))
  dirty = bias.at[0, 0, :, 39].set(bad).at[1, 1, 2, 63].set(bad)  # t=0 / t=1 never see these
  call = lambda b: fdecode.flash_decode(q, k, v, lengths, bias=b, impl=impl, num_splits=3, block_k=16,
                                        return_lse=True)
  for a, b in zip(call(dirty), call(bias)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
