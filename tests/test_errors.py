"""Bad input raises a clear error at trace time, naming the argument and the shapes."""

import jax
import jax.numpy as jnp
import pytest

import fdecode

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
    (dict(q=jnp.zeros((B, HQ, D), jnp.int32)), r"q must be floating point, got q.dtype=int32"),
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
    (dict(block_k=-4), "block_k must be a positive int"),
])
def test_bad_options(kw, pattern):
  with pytest.raises(ValueError, match=pattern):
    fdecode.flash_decode(**arrays(), **kw)
