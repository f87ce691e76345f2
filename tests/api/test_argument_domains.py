"""Every argument is checked in the domain it is used in (issue 18, items 2, 3, 6-9, 13):
static floats as float32, integers as int32, lists like arrays, and the messages name
the argument, show the value or shape (never a whole array) and say what is allowed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fdecode
from fdecode.cache import copy_pages, write_contiguous
from fdecode.flax import DecodeAttention, MLADecodeAttention, alibi_slopes
from fdecode.reference import reference_decode
from fdecode.validation import to_int32
from helpers import TPU_INTERPRET, assert_close

B, HQ, HKV, S, D = 2, 4, 2, 16, 8
LENGTHS = np.array([5, 16], np.int32)


def _qkv(seed=0, t=None):
  r = np.random.default_rng(seed)
  q_shape = (B, HQ, D) if t is None else (B, t, HQ, D)
  return tuple(jnp.asarray(r.normal(size=s), jnp.float32) for s in (q_shape, (B, HKV, S, D), (B, HKV, S, D)))


def _raises(exc, pattern, fn, *args, **kw):
  """Asserts ``fn`` raises ``exc`` matching ``pattern`` with a short message (no array dump)."""
  with pytest.raises(exc, match=pattern) as err:
    fn(*args, **kw)
  assert len(str(err.value)) < 400, str(err.value)


# --- item 2: static floats in float32 -----------------------------------------------------


@pytest.mark.parametrize("kw,pattern", [
    (dict(logits_soft_cap=1e39), r"logits_soft_cap must be positive, finite and in \[1.1754944e-38, "
                                 r"1.2676506e\+30\] as a float32.*got logits_soft_cap=1e\+39"),
    (dict(logits_soft_cap=1e38), r"logits_soft_cap must be .*1 / logits_soft_cap.*got logits_soft_cap=1e\+38"),
    (dict(logits_soft_cap=1e-40), r"logits_soft_cap must be positive.*got logits_soft_cap=1e-40"),
    (dict(logits_soft_cap=float("inf")), r"logits_soft_cap must be positive, finite"),
    (dict(softmax_scale=1e39), r"softmax_scale must be finite and 0 or of magnitude in \[1.1754944e-38, "
                               r"3.4028235e\+38\] as a float32.*got softmax_scale=1e\+39"),
    (dict(softmax_scale=-1e39), r"softmax_scale must be finite.*got softmax_scale=-1e\+39"),
    (dict(softmax_scale=1e-42), r"softmax_scale must be finite.*got softmax_scale=1e-42"),
    (dict(softmax_scale=np.float64("nan")), r"softmax_scale must be finite"),
])
def test_static_floats_checked_as_float32(kw, pattern):
  q, k, v = _qkv()
  _raises(ValueError, pattern, fdecode.flash_decode, q, k, v, LENGTHS, impl="xla", **kw)


def test_float32_extremes_that_are_allowed_match_the_reference():
  """The largest allowed cap is a no-op; a zero scale is uniform attention."""
  q, k, v = _qkv()
  want = reference_decode(q[:, None], k, v, LENGTHS)[0][:, 0]
  got = fdecode.flash_decode(q, k, v, LENGTHS, impl="xla", logits_soft_cap=2.0 ** 100)
  assert_close(got, want, atol=2e-5, rtol=2e-5)
  got = fdecode.flash_decode(q, k, v, LENGTHS, impl="pallas", interpret=True, logits_soft_cap=2.0 ** 100)
  assert_close(got, want, atol=2e-5, rtol=2e-5)
  uniform = fdecode.flash_decode(q, k, v, LENGTHS, impl="xla", softmax_scale=0.0)
  assert_close(uniform[0], jnp.broadcast_to(v[0, :, :5].mean(1)[:, None], (HKV, HQ // HKV, D)).reshape(HQ, D),
               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("kw,pattern", [
    (dict(softmax_scale=float("nan")), r"DecodeAttention: softmax_scale must be finite.*got softmax_scale=nan"),
    (dict(logits_soft_cap=1e39), r"DecodeAttention: logits_soft_cap must be positive, finite"),
    (dict(window=2 ** 31), r"DecodeAttention: window must be a positive int, at most 2147483647 \(int32; "
                           r"the sliding window, in tokens\); got window=2147483648"),
    (dict(rope_theta=float("nan")), r"DecodeAttention: rope_theta must be positive, finite and in \[1, "),
    (dict(qk_norm=True, norm_eps=-1e-6), r"DecodeAttention: norm_eps must be positive"),
    (dict(num_heads=0), r"DecodeAttention: num_heads must be a positive int"),
])
def test_decode_attention_statics_checked_at_construction(kw, pattern):
  args = dict(in_features=16, num_heads=4, num_kv_heads=2, head_dim=4, rngs=nnx.Rngs(0))
  _raises(ValueError, pattern, DecodeAttention, **{**args, **kw})


def test_decode_attention_reassigned_nan_scale_writes_nothing():
  """A static set after construction is checked at use, before any cache write."""
  layer = DecodeAttention(16, 4, 2, 4, rngs=nnx.Rngs(0))
  layer.init_cache(batch=2, max_len=8)
  before = np.asarray(layer.cached_key[...])
  layer.softmax_scale = float("nan")
  _raises(ValueError, r"DecodeAttention.prefill: softmax_scale must be finite", layer.prefill,
          jnp.ones((2, 4, 16)), jnp.array([2, 3]))
  np.testing.assert_array_equal(np.asarray(layer.cached_key[...]), before)
  np.testing.assert_array_equal(np.asarray(layer.lengths[...]), [0, 0])


def test_mla_statics_checked():
  args = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, rngs=nnx.Rngs(0))
  _raises(ValueError, r"MLADecodeAttention: softmax_scale must be finite.*got softmax_scale=inf",
          MLADecodeAttention, 16, 2, softmax_scale=float("inf"), **args)
  _raises(ValueError, r"MLADecodeAttention: rope_theta must be positive", MLADecodeAttention, 16, 2,
          rope_theta=0.0, **args)


# --- item 3: integers in int32 ------------------------------------------------------------


def test_window_past_int32_is_a_clear_error_and_the_int32_max_is_no_window():
  q, k, v = _qkv()
  _raises(ValueError, r"flash_decode: window must be a positive int, at most 2147483647 \(int32.*"
          r"got window=2147483648", fdecode.flash_decode, q, k, v, LENGTHS, window=2 ** 31)
  want = fdecode.flash_decode(q, k, v, LENGTHS, impl="xla")
  for impl in ("xla", "reference"):
    got = fdecode.flash_decode(q, k, v, LENGTHS, impl=impl, window=2 ** 31 - 1)
    assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_window_with_far_negative_ends_does_not_wrap(impl):
  """kv_offset near int32's max puts every query long before the cache: it sees nothing
  (out 0, lse -inf), also with the largest window (no int32 overflow in the bounds, in
  `fdecode.kernels.common.modifiers` nor in the kernels' `row_geometry`)."""
  q, k, v = _qkv(t=2)
  for window in (3, 2 ** 31 - 1):
    out, lse = fdecode.flash_decode(q, k, v, np.array([2, 3]), kv_offset=2 ** 31 - 1, causal=False,
                                    window=window, impl=impl, return_lse=True)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
  # The largest window is no window, in the kernels too. Non-causal T = 4 with length 1:
  # row 0 sits at position -3, and -3 - window + 1 wrapped to int32's max in the kernels'
  # `row_geometry`, hiding key 0 from it.
  q4, k4, v4 = _qkv(t=4)
  want = fdecode.flash_decode(q4, k4, v4, np.array([1, 3]), causal=False, impl="xla")
  got = fdecode.flash_decode(q4, k4, v4, np.array([1, 3]), causal=False, impl=impl, window=2 ** 31 - 1)
  assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kw,pattern", [
    (dict(indices=np.array([[2 ** 32 + 3], [1]], np.int64)),
     r"flash_decode: indices must lie in \[-2147483648, 2147483647\] \(int32\); got indices\[0, 0\] = 4294967299"),
    (dict(indices=np.array([[1], [-2 ** 32 + 3]], np.int64)), r"got indices\[1, 0\] = -4294967293"),
    (dict(kv_offset=2 ** 31), r"kv_offset must lie in \[-2147483648, 2147483647\] \(int32\); got kv_offset = 2147483648"),
    (dict(kv_offset=np.array([-5, 0]), lengths=np.array([2 ** 31 - 1, 3])),
     r"lengths - kv_offset must lie in .*sequence 0 has 2147483652"),
    (dict(kv_offset=0, lengths=np.array([2 ** 32 + 3, 3])),
     r"lengths must lie in \[0, 2147483647\] \(int32\); sequence 0 has length 4294967299"),
])
def test_integers_past_int32_are_errors_not_wraps(kw, pattern):
  q, k, v = _qkv()
  lengths = kw.pop("lengths", LENGTHS)
  _raises(ValueError, pattern, fdecode.flash_decode, q, k, v, lengths, impl="xla", **kw)


def test_int32_conversion_saturates():
  """Traced or unchecked wider integers (x64) are clipped into int32, never wrapped."""
  x = np.array([2 ** 32 + 3, -2 ** 32 + 1, 7], np.int64)
  np.testing.assert_array_equal(np.asarray(to_int32(x)), [2 ** 31 - 1, -2 ** 31, 7])
  np.testing.assert_array_equal(np.asarray(to_int32(np.array([2 ** 40], np.uint64))), [2 ** 31 - 1])
  with jax.enable_x64(True):
    got = jax.jit(to_int32)(jnp.asarray(x, jnp.int64))
  np.testing.assert_array_equal(np.asarray(got), [2 ** 31 - 1, -2 ** 31, 7])


def test_cache_writes_check_int32():
  k = jnp.zeros((B, HKV, S, D))
  new = jnp.ones((B, HKV, D))
  _raises(ValueError, r"write_contiguous: positions must lie in .*\(int32\); got positions\[0\] = 4294967299",
          write_contiguous, k, k, new, new, np.array([2 ** 32 + 3, 0], np.int64))
  pools = jnp.arange(2 * 4 * 2 * 1, dtype=jnp.float32).reshape(2, 4, 2, 1)
  # dst -2**32 + 1 is negative (skipped), and must not wrap to page 1.
  out, _ = copy_pages(pools, pools, np.array([0], np.int64), np.array([-2 ** 32 + 1], np.int64))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(pools))
  _raises(ValueError, r"copy_pages: dst ids must be distinct .*got dst\[0\] = dst\[2\] = 3",
          copy_pages, pools, pools, list(range(3)) * 1, [3, 1, 3])


# --- item 6: sparse indices [B, 0] ----------------------------------------------------------


@pytest.mark.parametrize("impl,t", [("xla", None), ("reference", None), ("xla", 2), ("mosaic", None)])
def test_empty_index_lists_give_empty_rows(impl, t):
  """XLA raised "zero-size array to reduction operation max", the TPU kernel ZeroDivisionError."""
  q, k, v = _qkv(t=t)
  shape = (B, 0) if t is None else (B, t, 0)
  kw = {}
  if impl == "mosaic":
    impl, kw = "pallas", dict(interpret=TPU_INTERPRET)
  out, lse = fdecode.flash_decode(q, k, v, LENGTHS, indices=np.zeros(shape, np.int32), impl=impl,
                                  return_lse=True, **kw)
  assert out.shape == q.shape and lse.shape == q.shape[:-1]
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


# --- item 7: alibi_slopes -----------------------------------------------------------------------


@pytest.mark.parametrize("n,pattern", [
    (0, r"alibi_slopes: num_heads must be a positive int, .*got num_heads=0"),
    (-2, r"alibi_slopes: num_heads must be a positive int, .*got num_heads=-2"),
    (2.5, r"alibi_slopes: num_heads must be an integer"),
    (True, r"alibi_slopes: num_heads must be a static int"),
])
def test_alibi_slopes_needs_a_positive_head_count(n, pattern):
  _raises(ValueError, pattern, alibi_slopes, n)


def test_alibi_slopes_values():
  np.testing.assert_allclose(np.asarray(alibi_slopes(1)), [2.0 ** -8])
  assert alibi_slopes(6).shape == (6,)


# --- item 8: MLA cache dtypes -------------------------------------------------------------------


@pytest.mark.parametrize("kw,pattern", [
    (dict(rope_dtype=jnp.float8_e4m3fn), r"rope_dtype must be a floating dtype of 16 bits or more \(this "
                                         r"array is never quantized\); got rope_dtype=float8_e4m3fn"),
    (dict(rope_dtype=jnp.int8), r"rope_dtype must be a floating dtype"),
    (dict(dtype="not a dtype"), r"dtype must be a floating dtype of 16 bits or more, int8, .*got 'not a dtype'"),
    (dict(dtype=jnp.float8_e4m3fnuz), r"dtype must be .*got dtype=float8_e4m3fnuz"),
    (dict(max_len=2 ** 31), r"max_len must be a positive int, at most 2147483647"),
])
def test_mla_init_cache_rejects_unsupported_dtypes(kw, pattern):
  layer = MLADecodeAttention(16, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
                             rngs=nnx.Rngs(0))
  _raises(ValueError, r"MLADecodeAttention.init_cache: " + pattern, layer.init_cache,
          **{**dict(batch=2, max_len=8), **kw})
  assert layer.cached_latent is None  # nothing allocated


# --- item 9: cascade errors name the cascade's arguments -----------------------------------------


def _cascade(**over):
  q, k, v = _qkv()
  a = dict(q=q, prefix_k=jnp.zeros((1, HKV, S, D)), prefix_v=jnp.zeros((1, HKV, S, D)), prefix_lengths=[3],
           k=k, v=v, lengths=[5, 9], prefix_ids=[0, 0], impl="xla")
  a.update(over)
  return fdecode.cascade_decode(**a)


@pytest.mark.parametrize("over,pattern", [
    (dict(prefix_k=jnp.zeros((1, HKV, S, D), jnp.int8)),
     r"cascade_decode: prefix_k has dtype int8: pass prefix_k_scale .*prefix_k.shape=\(1, 2, 16, 8\)"),
    (dict(prefix_k=jnp.zeros((1, HKV, S, D), jnp.int8), k_scale=1.0),
     r"cascade_decode: k_scale given but the suffix cache k is not quantized \(k.dtype=float32\); the prefix "
     r"cache's are prefix_k_scale"),
    (dict(prefix_v_scale=1.0), r"cascade_decode: prefix_v_scale/prefix_v_offset given but prefix_v is not quantized"),
    (dict(prefix_v=jnp.zeros((1, HKV, S + 1, D))),
     r"cascade_decode: prefix_k and prefix_v must have the same \[N, Hkv, Sp\]; got prefix_k.shape=\(1, 2, 16, 8\), "
     r"prefix_v.shape=\(1, 2, 17, 8\)"),
    (dict(prefix_k=jnp.zeros((HKV, 4, 4, D)), prefix_v=jnp.zeros((HKV, 4, 4, D)),
          prefix_block_tables=np.array([[0.0, 1.0]])), r"cascade_decode: prefix_block_tables must be integer"),
    (dict(prefix_k=jnp.zeros((HKV, 4, 4, D)), prefix_v=jnp.zeros((HKV, 4, 4, D)),
          prefix_block_tables=np.array([[0, 9]]), prefix_lengths=[6]),
     r"cascade_decode: prefix_block_tables\[0, 1\] = 9 is out of range \[0, P=4\)"),
])
def test_cascade_errors_name_the_prefix_arguments(over, pattern):
  _raises(ValueError, pattern, _cascade, **over)


# --- item 13: lists are arrays ------------------------------------------------------------------


def test_lists_are_accepted_like_arrays():
  q, k, v = _qkv()
  mask = np.arange(S)[None, :] % 3 != 1
  mask = np.broadcast_to(mask, (B, S))
  slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
  idx = np.array([[0, 2, 4], [1, 3, 15]], np.int32)
  rope = np.random.default_rng(1).normal(size=(B, HKV, S, 2)).astype(np.float32)
  q_rope = jnp.concatenate([q, q[..., :2]], -1)
  cases = [(q, dict(mask=mask)), (q, dict(alibi_slopes=slopes)), (q, dict(indices=idx)),
           (q, dict(sinks=slopes)), (q, dict(bias=np.ones((B, S), np.float32))), (q_rope, dict(k_rope=rope))]
  for qq, kw in cases:
    want = fdecode.flash_decode(qq, k, v, LENGTHS, impl="xla", **kw)
    got = fdecode.flash_decode(qq, k, v, LENGTHS.tolist(), impl="xla", **{n: x.tolist() for n, x in kw.items()})
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6, err_msg=str(list(kw)))


@pytest.mark.parametrize("kw,pattern", [
    (dict(mask=[[True] * S, [True] * (S - 1)]),
     r"flash_decode: mask must be an array or a \(nested\) list of numbers of one rectangular shape; got a "
     r"list of length 2"),
    (dict(alibi_slopes=["a"] * HQ), r"alibi_slopes must be an array or a \(nested\) list of numbers"),
    (dict(indices="0, 1"), r"flash_decode: indices must be an array \(jax or numpy\) or a list of numbers; got str"),
    (dict(mask=[[1] * S] * B), r"mask must be boolean \(True = may attend\), got mask.dtype=int"),
])
def test_bad_lists_name_the_argument(kw, pattern):
  q, k, v = _qkv()
  _raises((TypeError, ValueError), pattern, fdecode.flash_decode, q, k, v, LENGTHS, **kw)


# --- no message prints a whole array ------------------------------------------------------------


@pytest.mark.parametrize("kw,pattern", [
    (dict(softmax_scale=np.ones(5000)), r"softmax_scale must be a real number .*got ndarray of shape \(5000,\)"),
    (dict(interpret=np.ones(5000)), r"interpret must be None, a bool or .*got ndarray of shape \(5000,\)"),
    (dict(window=np.arange(5000)), r"window must be a static int .*got ndarray of shape \(5000,\)"),
    (dict(causal=np.ones(5000, bool)), r"causal must be a bool, got ndarray of shape \(5000,\)"),
])
def test_messages_show_shapes_not_contents(kw, pattern):
  q, k, v = _qkv()
  _raises(ValueError, pattern, fdecode.flash_decode, q, k, v, LENGTHS, **kw)
