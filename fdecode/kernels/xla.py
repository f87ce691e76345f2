"""FlashDecode in plain jnp: the CPU default.

The cache's token axis is split into ``n`` equal chunks (a free reshape of the
head-major cache); each chunk yields a partial state with one batched matmul for the
scores and one for the values, and the states are merged with `merge_states`.

Measured on a 2-core AVX2 CPU (see benchmarks/RESULTS.md): keeping exactly the batch
dims (B, Hkv) leading and the split axis on K lets XLA use its native mixed
bf16 x bf16 -> f32 dot; token-major layouts or a flattened batch axis are 2-5x slower.
XLA has no dynamic shapes, so this path reads the full capacity S and masks; the Pallas
kernel is the one that skips blocks past each sequence's length.
"""

from __future__ import annotations

import jax.numpy as jnp

from fdecode.combine import finalize_state

# Finite "minus infinity" for masked scores, so that max/exp never see inf - inf.
MASK_VALUE = -1e30


def xla_partials(q_rows, k, v, row_limits, *, softmax_scale: float, num_splits: int):
  """Per-split partial states.

  Args:
    q_rows: ``[B, Hkv, R, Dk]`` queries, the G heads (times T tokens) of a kv head as rows.
    k: ``[B, Hkv, S, Dk]`` keys; v: ``[B, Hkv, S, Dv]`` values.
    row_limits: int32 ``[B, R]``: row r attends to key positions ``< row_limits[b, r]``.
    softmax_scale: multiplies the scores (in float32).
    num_splits: ``n`` chunks; if it does not divide S the cache is padded (a copy).

  Returns:
    ``(o, lse)``: float32 ``[B, Hkv, n, R, Dv]`` and ``[B, Hkv, n, R]``.
  """
  b, hkv, s, dk = k.shape
  dv = v.shape[-1]
  n = num_splits
  chunk = -(-s // n) if s else 1
  if chunk * n != s:
    pad = [(0, 0), (0, 0), (0, chunk * n - s), (0, 0)]
    k = jnp.pad(k, pad)
    v = jnp.pad(v, pad)
  kc = k.reshape(b, hkv, n, chunk, dk)
  vc = v.reshape(b, hkv, n, chunk, dv)
  scores = jnp.einsum("bhrd,bhncd->bhnrc", q_rows.astype(k.dtype), kc,
                      preferred_element_type=jnp.float32) * softmax_scale
  pos = jnp.arange(n * chunk, dtype=jnp.int32).reshape(n, 1, chunk)
  valid = pos[None, None] < row_limits[:, None, None, :, None]  # [B, 1, n, R, C]
  scores = jnp.where(valid, scores, MASK_VALUE)
  m = jnp.max(scores, axis=-1)
  p = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
  l = jnp.sum(p, axis=-1)
  acc = jnp.einsum("bhnrc,bhncd->bhnrd", p.astype(v.dtype), vc,
                   preferred_element_type=jnp.float32)
  return finalize_state(acc, m, l)
