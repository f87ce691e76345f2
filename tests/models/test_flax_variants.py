"""`DecodeAttention` with score modifiers, and a Gemma-3-like stack of local (windowed)
and global layers, against a naive float32 recomputation over the whole sequence."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fdecode.flax import DecodeAttention
from fdecode.flax.decode_attention import alibi_slopes
from fdecode.reference import reference_decode
from helpers import assert_close, randn

E, HQ, HKV, D = 32, 4, 2, 8


def _naive(layer, x):
  """The layer's attention over one whole sequence x ``[1, P, E]``, every position causal,
  with reference attention (float32): ``[1, P, E]``."""
  p = x.shape[1]
  positions = jnp.arange(p, dtype=jnp.int32)[None]
  q, k, v = layer._qkv(x, positions)  # pylint: disable=protected-access
  out, _ = reference_decode(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.array([p]),
                            **layer._modifiers())  # pylint: disable=protected-access
  return layer.o_proj(out.reshape(1, p, -1))


class Stack(nnx.Module):
  """Residual attention layers (a model's skeleton)."""

  def __init__(self, windows, **kw):
    self.layers = nnx.List([DecodeAttention(E, HQ, HKV, D, window=w, rope_theta=1e4 if w else 1e6,
                                            rngs=nnx.Rngs(i), **kw) for i, w in enumerate(windows)])

  def prefill(self, x, lengths):
    for layer in self.layers:
      x = x + layer.prefill(x, lengths)
    return x

  def decode(self, x):
    for layer in self.layers:
      x = x + layer.decode(x)
    return x

  def naive(self, x):
    for layer in self.layers:
      x = x + _naive(layer, x)
    return x


@pytest.mark.parametrize("windows,kw", [
    ([3, 3, 3, 3, 3, None], dict(qk_norm=True)),                       # Gemma 3: 5 local, 1 global
    ([None, 4], dict(logits_soft_cap=1.5, sinks=True, alibi=True)),
], ids=["gemma3-like", "softcap-sinks-alibi"])
def test_stack_prefill_and_decode_match_naive(windows, kw):
  stack = Stack(windows, **kw)
  for layer in stack.layers:  # non-trivial learned sinks
    if layer.sinks is not None:
      layer.sinks[...] = jnp.linspace(-1.0, 1.0, HQ)
  b, prompt, steps = 2, 7, 5
  lengths = jnp.array([7, 2])
  tokens = randn(0, (b, prompt + steps, E))
  for layer in stack.layers:
    layer.init_cache(batch=b, max_len=16)
  x = tokens[:, :prompt] * (jnp.arange(prompt) < lengths[:, None])[..., None]
  pre = stack.prefill(x, lengths)
  decode = nnx.jit(lambda m, x: m.decode(x))
  outs = []
  for i in range(steps):  # each sequence's next input at its own position
    nxt = jnp.stack([tokens[j, int(lengths[j]) + i] for j in range(b)])[:, None]
    outs.append(decode(stack, nxt)[:, 0])
  naive = nnx.jit(lambda m, x: m.naive(x))
  for j in range(b):
    n = int(lengths[j])
    seq = jnp.concatenate([tokens[j, :n], tokens[j, n:n + steps]])[None]
    want = naive(stack, seq)[0]
    assert_close(pre[j, :n], want[:n], atol=2e-4, rtol=2e-4, what=f"prefill {j}")
    assert_close(jnp.stack([o[j] for o in outs]), want[n:n + steps], atol=2e-4, rtol=2e-4,
                 what=f"decode {j}")


def test_alibi_slopes_standard_values():
  np.testing.assert_allclose(alibi_slopes(8), 2.0 ** -np.arange(1, 9), rtol=1e-6)
  # 12 heads: the 8-head slopes, then every other slope of 16 heads (BLOOM's rule).
  want = list(2.0 ** -np.arange(1, 9)) + list(2.0 ** -(np.arange(1, 17, 2) / 2))[:4]
  np.testing.assert_allclose(alibi_slopes(12), want, rtol=1e-6)


def test_bad_layer_options():
  with pytest.raises(ValueError, match="window must be a positive int"):
    DecodeAttention(E, HQ, HKV, D, window=0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="logits_soft_cap must be positive"):
    DecodeAttention(E, HQ, HKV, D, logits_soft_cap=-2.0, rngs=nnx.Rngs(0))
