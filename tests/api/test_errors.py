"""Bad input raises a clear error at trace time, naming the argument and the shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import fdecode
from fdecode.reference import reference_decode
from helpers import TPU_INTERPRET, assert_close, make_problem, tol

B, HQ, HKV, S, D = 2, 4, 2, 16, 8


def arrays(**over):
  a = dict(q=jnp.zeros((B, HQ, D)), k=jnp.zeros((B, HKV, S, D)), v=jnp.zeros((B, HKV, S, D)),
           lengths=jnp.array([3, 4], jnp.int32))
  a.update(over)
  return a


@pytest.mark.parametrize("over,pattern", [
    (dict(q=jnp.zeros((B, D))), r"q must be \[B, Hq, Dk\] or \[B, T, Hq, Dk\].*q.shape=\(2, 8\)"),
    (dict(k=jnp.zeros((B, S, D))), r"k must be \[B, Hkv, S, Dk\].*k.shape=\(2, 16, 8\)"),
    (dict(v=jnp.zeros((B, HKV, S))), r"v must be \[B, Hkv, S, Dv\].*v.shape=\(2, 2, 16\)"),
    (dict(q=jnp.zeros((B, 3, D))), r"Hq \(3\) must be a multiple of Hkv \(2\)"),
    (dict(q=jnp.zeros((B, HQ, 16))), r"head dim Dk of q \(16\) and k \(8\) must agree"),
    (dict(v=jnp.zeros((B, HKV, S + 1, D))), r"k and v must have the same \[B, Hkv, S\]"),
    (dict(v=jnp.zeros((B, 1, S, D))), r"k and v must have the same \[B, Hkv, S\]"),
    (dict(k=jnp.zeros((3, HKV, S, D))), r"batch of q, k and v must agree"),
    (dict(lengths=jnp.array([1, 2, 3])), r"lengths must be \[B\]=\(2,\); got lengths.shape=\(3,\)"),
    (dict(lengths=jnp.array([[1, 2]])), r"lengths must be \[B\]"),
    (dict(lengths=jnp.array([1.0, 2.0])), r"lengths must be integer"),
    (dict(k=jnp.zeros((B, HKV, S, D), jnp.int8)), r"k has dtype int8: pass k_scale"),
    (dict(v=jnp.zeros((B, HKV, S, D), jnp.int32)), r"v must be floating point or int8/float8 with v_scale"),
    (dict(q=jnp.zeros((B, HQ, D), jnp.int32)), r"q must be a floating dtype of 16 bits or more \(float16, "
                                               r"bfloat16, float32 or float64\); got q.dtype=int32$"),
    (dict(q=jnp.zeros((B, HQ, D), jnp.float8_e4m3fn)), r"q must be a floating dtype of 16 bits or more .*got "
                                                       r"q.dtype=float8_e4m3fn; cast it, e.g. q.astype"),
    (dict(q=jnp.zeros((B, HQ, D), jnp.float8_e5m2)), r"got q.dtype=float8_e5m2; cast it"),
    (dict(q=jnp.zeros((B, HQ, D), jnp.bool_)), r"q must be a floating dtype .*got q.dtype=bool$"),
    (dict(lengths=jnp.array([3, S + 1])), r"lengths must lie in \[0, S=16\]; sequence 1 has length 17"),
    (dict(lengths=jnp.array([-1, 2])), r"sequence 0 has length -1"),
])
def test_value_errors(over, pattern):
  with pytest.raises(ValueError, match=pattern):
    fdecode.flash_decode(**arrays(**over))


def test_shape_errors_raise_at_trace_time_under_jit():
  a = arrays(q=jnp.zeros((B, 3, D)))
  f = jax.jit(lambda q, k, v, n: fdecode.flash_decode(q, k, v, n))
  with pytest.raises(ValueError, match="must be a multiple of Hkv"):
    f.lower(a["q"], a["k"], a["v"], a["lengths"])


@pytest.mark.parametrize("kw,pattern", [
    (dict(impl="cuda"), "impl must be one of"),
    (dict(num_splits=0), "num_splits must be a positive int"),
    (dict(num_splits="fast"), "num_splits must be a positive int, None or 'balance', got 'fast'"),
    (dict(block_k=-4), "block_k must be a positive int"),
])
def test_bad_options(kw, pattern):
  with pytest.raises(ValueError, match=pattern):
    fdecode.flash_decode(**arrays(), **kw)


# --- odd but valid input, and options that must be static -----------------------------


def test_python_list_lengths_and_numpy_integer_options():
  a = arrays()
  ref = fdecode.flash_decode(**a, num_splits=2, block_k=8)
  out = fdecode.flash_decode(a["q"], a["k"], a["v"], [3, 4], num_splits=np.int64(2), block_k=np.int32(8))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@pytest.mark.parametrize("impl", ["xla", "pallas", "reference", None])
@pytest.mark.parametrize("b,t", [(0, 1), (2, 0), (0, 0)])
def test_empty_batch_or_no_new_tokens(impl, b, t):
  q = jnp.zeros((b, t, HQ, D))
  k, v = jnp.zeros((b, HKV, S, D)), jnp.zeros((b, HKV, S, 6))
  out, lse = fdecode.flash_decode(q, k, v, jnp.zeros((b,), jnp.int32), impl=impl, return_lse=True)
  assert out.shape == (b, t, HQ, 6) and lse.shape == (b, t, HQ)


@pytest.mark.parametrize("over", [dict(q=jnp.zeros((B, HQ, 0)), k=jnp.zeros((B, HKV, S, 0))),
                                  dict(v=jnp.zeros((B, HKV, S, 0)))])
def test_zero_head_dim(over):
  with pytest.raises(ValueError, match=r"head dims Dk and Dv must be positive"):
    fdecode.flash_decode(**arrays(**over))


@pytest.mark.parametrize("scale,pattern", [
    ("0.1", "softmax_scale must be a real number"),
    (1j, "softmax_scale must be a real number"),
    (jnp.ones(2), "softmax_scale must be a real number"),
    (float("nan"), "softmax_scale must be finite"),
])
def test_bad_softmax_scale(scale, pattern):
  with pytest.raises(ValueError, match=pattern):
    fdecode.flash_decode(**arrays(), softmax_scale=scale)


def test_traced_softmax_scale_is_refused():
  a = arrays()
  f = jax.jit(lambda s: fdecode.flash_decode(**a, softmax_scale=s))
  with pytest.raises(ValueError, match=r"softmax_scale is compiled into the kernel.*static_argnames=\('softmax_scale',\)"):
    f(0.5)
  np.testing.assert_allclose(np.asarray(fdecode.flash_decode(**a, softmax_scale=np.float32(0.5))),
                             np.asarray(fdecode.flash_decode(**a, softmax_scale=0.5)))


@pytest.mark.parametrize("kw,pattern", [
    (dict(interpret="yes"), "interpret must be None, a bool or"),
    (dict(interpret=pltpu.InterpretParams(), impl="xla"), "runs the TPU Pallas kernel: pass impl='pallas'"),
])
def test_bad_interpret(kw, pattern):
  with pytest.raises(ValueError, match=pattern):
    fdecode.flash_decode(**arrays(), **kw)


@pytest.mark.parametrize("impl", ["xla", "pallas", "mosaic"])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)])
def test_mixed_dtypes_compute_in_the_promoted_dtype(impl, q_dtype, cache_dtype):
  """A float32 query on a bfloat16 cache is never rounded to bfloat16 (and vice versa):
  every impl computes in the promoted dtype (float32 here) and agrees with the float32
  reference on the same inputs; the output has q's dtype."""
  q, k, v = make_problem(30, b=2, t=2, hq=4, hkv=2, s=40, dk=32)
  q, k, v = q.astype(q_dtype), k.astype(cache_dtype), v.astype(cache_dtype)
  lengths = jnp.array([40, 13])
  ref = reference_decode(q, k, v, lengths)[0]
  kw = dict(impl="pallas", interpret=TPU_INTERPRET) if impl == "mosaic" else dict(impl=impl)
  out = fdecode.flash_decode(q, k, v, lengths, block_k=16, **kw)
  assert out.dtype == q_dtype
  t = tol(q_dtype)  # the output's own rounding; no bfloat16 rounding of the inputs
  assert_close(out, ref.astype(q_dtype), atol=min(t["atol"], 1e-4) if q_dtype == jnp.float32 else t["atol"],
               rtol=min(t["rtol"], 1e-4) if q_dtype == jnp.float32 else t["rtol"])
