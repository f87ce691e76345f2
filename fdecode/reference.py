"""Plain-jnp float32 oracle for every fdecode feature (not fast; obviously correct)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fdecode.combine import apply_sinks


def query_limits(lengths: jnp.ndarray, num_tokens: int, seq_capacity: int) -> jnp.ndarray:
  """int32 ``[B, T]``: query t of sequence b attends to key positions ``< limit[b, t]``.

  The T new tokens are the last T of each sequence, causal among themselves:
  ``limit = lengths - T + t + 1``, clipped to ``[0, S]``.
  """
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  limits = lengths.astype(jnp.int32)[:, None] - num_tokens + 1 + t[None, :]
  return jnp.clip(limits, 0, seq_capacity)


def _broadcast4(x, b, t, hq, s):
  """A ``[B|1, S]``, ``[B|1, T|1, S]`` or ``[B|1, T|1, Hq|1, S]`` array -> ``[B, T, Hq, S]``."""
  x = jnp.asarray(x)
  if x.ndim == 2:
    x = x[:, None, None, :]
  elif x.ndim == 3:
    x = x[:, :, None, :]
  return jnp.broadcast_to(x, (b, t, hq, s))


# One program rather than ~25 eager ops, each compiled on its own for every new shape (tests
# call the oracle outside jit). The scalars (scale, window, soft cap) are traced arguments,
# so the float math is the eager math: XLA would turn a division by a constant into a
# multiplication by its reciprocal.
@functools.partial(jax.jit, static_argnames=("causal",))
def reference_decode(q, k, v, lengths, *, softmax_scale=None, causal=True, mask=None, bias=None,
                     alibi_slopes=None, window=None, logits_soft_cap=None, sinks=None):
  """Softmax attention of the new tokens over a head-major contiguous cache, in float32.

  Args:
    q: ``[B, T, Hq, Dk]`` queries.
    k: ``[B, Hkv, S, Dk]`` keys.
    v: ``[B, Hkv, S, Dv]`` values.
    lengths: int ``[B]`` valid tokens per sequence (new tokens included).
    softmax_scale: defaults to ``1/sqrt(Dk)``.
    causal, mask, bias, alibi_slopes, window, logits_soft_cap, sinks: the score
      modifiers of `flash_decode` (semantics in `fdecode.kernels.common.modifiers`), built here densely
      at ``[B, T, Hq, S]``.

  Returns:
    ``(out, lse)``: float32 ``[B, T, Hq, Dv]`` and float32 ``[B, T, Hq]`` (natural log;
    with sinks, the LSE includes them). Rows with no visible key give out 0 and lse
    -inf (lse = sink with sinks). Slots no query may see never influence the result,
    whatever they hold (inf / NaN included); a NaN a row sees makes its out and lse NaN.
  """
  b, t, hq, dk = q.shape
  _, hkv, s, _ = k.shape
  g = hq // hkv
  scale = 1.0 / math.sqrt(dk) if softmax_scale is None else softmax_scale
  qf = q.astype(jnp.float32)
  # Every head's own copy of its kv head: [B, Hq, S, D].
  kf = jnp.repeat(k.astype(jnp.float32), g, axis=1)
  vf = jnp.repeat(v.astype(jnp.float32), g, axis=1)
  scores = jnp.einsum("bthd,bhsd->bths", qf, kf, precision="highest") * scale  # [B, T, Hq, S]
  if logits_soft_cap is not None:
    scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
  key_pos = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]
  query_pos = (lengths.astype(jnp.int32)[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :])
  query_pos = query_pos[:, :, None, None]  # [B, T, 1, 1]
  if alibi_slopes is not None:
    slopes = jnp.asarray(alibi_slopes, jnp.float32)[None, None, :, None]
    scores = scores + slopes * (key_pos - query_pos).astype(jnp.float32)
  if bias is not None:
    scores = scores + _broadcast4(bias, b, t, hq, s).astype(jnp.float32)
  visible = key_pos < jnp.clip(lengths, 0, s)[:, None, None, None]
  if causal:
    visible &= key_pos <= query_pos
  if window is not None:
    visible &= key_pos > query_pos - window
  if mask is not None:
    visible &= _broadcast4(mask, b, t, hq, s)
  visible = jnp.broadcast_to(visible, scores.shape)
  # A slot no query of a head sees is dead and may hold anything: select it away. A value
  # row holding inf / NaN is selected away too, and poisons its scores instead: the rows
  # that see it turn NaN, the others (earlier tokens of the step) never meet it.
  seen = jnp.any(visible, axis=1)[..., None]  # [B, Hq, S, 1]
  bad = ~jnp.all(jnp.isfinite(vf), axis=-1)  # [B, Hq, S]
  vf = jnp.where(seen & ~bad[..., None], vf, 0.0)
  scores = jnp.where(bad[:, None], jnp.nan, scores)
  scores = jnp.where(visible, scores, -jnp.inf)
  # m is -inf exactly for a row with no visible key (or only -inf scores); a NaN or +inf
  # score the row sees makes m (and then p, out and lse) NaN: corruption propagates.
  m = jnp.max(scores, axis=-1, keepdims=True)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.where(visible, jnp.exp(scores - m_safe), 0.0)
  l = jnp.sum(p, axis=-1)
  out = jnp.einsum("bths,bhsd->bthd", p, vf, precision="highest")
  empty = l == 0
  out = out / jnp.where(empty, 1.0, l)[..., None]
  lse = jnp.where(empty, -jnp.inf, m_safe[..., 0] + jnp.log(jnp.where(empty, 1.0, l)))
  if sinks is not None:
    out, lse = apply_sinks(out, lse, jnp.asarray(sinks))
  return out, lse
