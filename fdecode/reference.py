"""Plain-jnp float32 oracle for every fdecode feature (not fast; obviously correct)."""

from __future__ import annotations

import math

import jax.numpy as jnp


def query_limits(lengths: jnp.ndarray, num_tokens: int, seq_capacity: int) -> jnp.ndarray:
  """int32 ``[B, T]``: query t of sequence b attends to key positions ``< limit[b, t]``.

  The T new tokens are the last T of each sequence, causal among themselves:
  ``limit = lengths - T + t + 1``, clipped to ``[0, S]``.
  """
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  limits = lengths.astype(jnp.int32)[:, None] - num_tokens + 1 + t[None, :]
  return jnp.clip(limits, 0, seq_capacity)


def reference_decode(q, k, v, lengths, *, softmax_scale=None):
  """Softmax attention of the new tokens over a head-major contiguous cache, in float32.

  Args:
    q: ``[B, T, Hq, Dk]`` queries.
    k: ``[B, Hkv, S, Dk]`` keys.
    v: ``[B, Hkv, S, Dv]`` values.
    lengths: int ``[B]`` valid tokens per sequence (new tokens included).
    softmax_scale: defaults to ``1/sqrt(Dk)``.

  Returns:
    ``(out, lse)``: float32 ``[B, T, Hq, Dv]`` and float32 ``[B, T, Hq]`` (natural log).
    Rows with no valid key give out 0 and lse -inf. Slots past a length never influence
    the result, whatever they hold (inf / NaN included).
  """
  b, t, hq, dk = q.shape
  _, hkv, s, _ = k.shape
  g = hq // hkv
  scale = 1.0 / math.sqrt(dk) if softmax_scale is None else softmax_scale
  qf = q.astype(jnp.float32).reshape(b, t, hkv, g, dk)
  kf = k.astype(jnp.float32)
  # Slots past a sequence's length are dead and may hold anything: select them away.
  live = jnp.arange(s)[None, :] < jnp.clip(lengths, 0, s)[:, None]  # [B, S]
  vf = jnp.where(live[:, None, :, None], v.astype(jnp.float32), 0.0)
  scores = jnp.einsum("bthgd,bhsd->bthgs", qf, kf, precision="highest") * scale
  limits = query_limits(lengths, t, s)  # [B, T]
  valid = jnp.arange(s)[None, None, :] < limits[:, :, None]  # [B, T, S]
  valid = valid[:, :, None, None, :]
  scores = jnp.where(valid, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(valid, jnp.exp(scores - m_safe), 0.0)
  l = jnp.sum(p, axis=-1)
  out = jnp.einsum("bthgs,bhsd->bthgd", p, vf, precision="highest")
  out = out / jnp.where(l > 0, l, 1.0)[..., None]
  lse = jnp.where(l > 0, m_safe[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
  return out.reshape(b, t, hq, -1), lse.reshape(b, t, hq)
