"""DecodeAttention under bad calls: a failing step leaves the layer exactly as it was, and
overflow under jit is flagged, not silent (see the DecodeAttention docstring)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fdecode
import fdecode.flax as fflax
from helpers import randn

E, B, MAX_LEN = 16, 2, 8
XLA = functools.partial(fdecode.flash_decode, impl="xla")  # one object: layers share jit caches


@nnx.jit
def _decode(layer, x):
  return layer.decode(x)


@nnx.jit
def _prefill(layer, x, lengths):
  return layer.prefill(x, lengths)


def _layer(page_size=None, decode_fn=None):
  layer = fflax.DecodeAttention(E, num_heads=2, num_kv_heads=1, head_dim=8, rngs=nnx.Rngs(0),
                                decode_fn=decode_fn or XLA)
  layer.init_cache(B, MAX_LEN, page_size=page_size)
  x = randn(0, (B, 6, E))
  _prefill(layer, x, jnp.array([6, 2], jnp.int32))
  return layer


def _snapshot(layer):
  """Every array of the layer's state (params, caches, lengths, flags), by path."""
  flat, _ = jax.tree_util.tree_flatten_with_path(nnx.state(layer))
  name = lambda path: "/".join(str(k.key) for k in path if hasattr(k, "key"))
  return {name(path): np.array(x) for path, x in flat}


def _assert_same(before, after):
  assert before.keys() == after.keys()
  for name in before:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def test_eager_decode_past_max_len_raises_and_changes_nothing():
  layer = _layer()
  before = _snapshot(layer)
  for _ in range(2):  # a retry fails the same way: the first failure broke nothing
    with pytest.raises(ValueError, match=r"sequence 0 holds 6 tokens; 3 more exceed the cache capacity S=8"):
      layer.decode(jnp.ones((B, 3, E)))
    _assert_same(before, _snapshot(layer))
  _decode(layer, jnp.ones((B, 1, E)))  # a step that fits works
  np.testing.assert_array_equal(layer.lengths[...], [7, 3])


@pytest.mark.parametrize("page_size", [None, 4])
def test_jit_overflow_is_flagged_and_corrupts_nothing(page_size):
  """Sequence 0 (6 tokens) cannot take 3 more; sequence 1 (2 tokens) can."""
  layer, twin = _layer(page_size), _layer(page_size)
  twin.lengths.set_value(jnp.array([0, 2], jnp.int32))  # sequence 0 has room there
  before = _snapshot(layer)
  x = randn(1, (B, 3, E))
  out = _decode(layer, x)
  after = _snapshot(layer)
  assert np.isnan(np.asarray(out[0])).all()
  np.testing.assert_allclose(out[1], _decode(twin, x)[1], atol=1e-6, rtol=1e-6)
  np.testing.assert_array_equal(layer.lengths[...], [6, 5])
  np.testing.assert_array_equal(layer.overflowed[...], [True, False])
  # Sequence 0's cache is untouched; only sequence 1's slots 2..4 changed.
  changed = {n for n in before if not np.array_equal(before[n], after[n])}
  assert changed == {"cached_key", "cached_value", "lengths", "overflowed"}, changed
  k0, k1 = before["cached_key"], after["cached_key"]
  if page_size is None:
    np.testing.assert_array_equal(k1[0], k0[0])
    np.testing.assert_array_equal(k1[1, :, :2], k0[1, :, :2])
    assert not np.array_equal(k1[1, :, 2:5], k0[1, :, 2:5])
  else:
    table = np.asarray(layer.block_tables[...])
    np.testing.assert_array_equal(k1[:, table[0]], k0[:, table[0]])
  # The flag is sticky across steps and cleared by the next prefill.
  _decode(layer, jnp.ones((B, 1, E)))
  np.testing.assert_array_equal(layer.lengths[...], [7, 6])
  np.testing.assert_array_equal(layer.overflowed[...], [True, False])
  _prefill(layer, jnp.ones((B, 2, E)), jnp.array([1, 2], jnp.int32))
  np.testing.assert_array_equal(layer.overflowed[...], [False, False])


@pytest.mark.parametrize("lengths,pattern", [
    ([7, 2], r"lengths must lie in \[0, L=6\] \(L <= S=8\); sequence 0 has length 7"),
    ([2, 9], r"sequence 1 has length 9"),  # past max_len too
    ([-1, 2], r"sequence 0 has length -1"),
])
def test_prefill_rejects_bad_lengths(lengths, pattern):
  layer = _layer()
  before = _snapshot(layer)
  with pytest.raises(ValueError, match=pattern):
    layer.prefill(jnp.ones((B, 6, E)), jnp.array(lengths, jnp.int32))
  _assert_same(before, _snapshot(layer))


def test_prefill_under_jit_clips_lengths():
  layer = _layer()
  _prefill(layer, jnp.ones((B, 6, E)), jnp.array([7, -3], jnp.int32))
  np.testing.assert_array_equal(layer.lengths[...], [6, 0])


def _failing_decode_fn(*args, **kwargs):
  raise ValueError("decode_fn failed")


@pytest.mark.parametrize("jit", [False, True])
def test_failing_decode_fn_changes_nothing(jit):
  """An error after the cache write was computed (here in decode_fn) sets nothing."""
  layer = _layer(decode_fn=_failing_decode_fn)
  before = _snapshot(layer)
  with pytest.raises(ValueError, match="decode_fn failed"):
    (_decode if jit else type(layer).decode)(layer, jnp.ones((B, 1, E)))
  _assert_same(before, _snapshot(layer))


@pytest.mark.parametrize("call,pattern", [
    (lambda l: l.decode(jnp.ones((B, 0, E))), r"x must hold at least one token; got x.shape=\(2, 0, 16\)"),
    (lambda l: l.decode(jnp.ones((B, 1, E), jnp.int32)), r"x must be floating point, got x.dtype=int32"),
    (lambda l: l.decode(jnp.ones((1, 1, E))), r"x must be \[B, T, E\]=\[2, T, 16\]"),
    (lambda l: l.prefill(jnp.ones((B, 0, E)), jnp.array([0, 0])), r"x must hold at least one token"),
    (lambda l: l.prefill(jnp.ones((B, 4, E)), jnp.array([1.0, 2.0])), r"lengths must be int \[B\]"),
])
def test_bad_inputs_change_nothing(call, pattern):
  layer = _layer()
  before = _snapshot(layer)
  with pytest.raises(ValueError, match=pattern):
    call(layer)
  _assert_same(before, _snapshot(layer))


@pytest.mark.parametrize("kw,pattern", [
    (dict(batch=0, max_len=8), r"batch must be a positive int, at most 2147483647 \(int32\); got batch=0"),
    (dict(batch=2, max_len=-1), "max_len must be a positive int, .*got max_len=-1"),
    (dict(batch=2.0, max_len=8), "batch must be an integer, got batch=2.0"),
    (dict(batch=2, max_len=8, page_size=0), "page_size must be a positive int"),
    (dict(batch=2, max_len=8, dtype=jnp.int32), "dtype must be a floating dtype of 16 bits or more, int8, "
                                                 "float8_e4m3fn or float8_e5m2; got dtype=int32"),
])
def test_init_cache_rejects(kw, pattern):
  layer = _layer()
  before = _snapshot(layer)
  with pytest.raises(ValueError, match=pattern):
    layer.init_cache(**kw)
  _assert_same(before, _snapshot(layer))
