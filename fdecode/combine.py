"""The log-sum-exp (LSE) math of FlashDecode, written once.

A *state* is a pair (o, lse): o is a softmax-normalized partial output over some subset
of the keys and lse = log(sum(exp(scores))) over that subset (natural log). An empty
subset is (0, -inf). Merging states over disjoint subsets gives exactly the state of
their union. The kernels' split combine, the cross-device collective and the tests all
call this module.
"""

from __future__ import annotations

import jax.numpy as jnp


def merge_states(o: jnp.ndarray, lse: jnp.ndarray, axis: int = 0):
  """Merges partial attention states stacked along ``axis``.

  Args:
    o: ``[..., n, ..., D]`` partial outputs, each normalized over its own part. The
      trailing axis is the value head dim; ``o.shape[:-1] == lse.shape``.
    lse: ``[..., n, ...]`` float log-sum-exp of each part (natural log); ``-inf``
      marks an empty part, which contributes nothing.
    axis: the axis of ``lse`` (and of ``o``) holding the ``n`` parts.

  Returns:
    ``(o, lse)`` with ``axis`` removed: o in ``o.dtype``, lse in float32. If every part
    is empty the result is o = 0, lse = -inf (never NaN).
  """
  if o.shape[:-1] != lse.shape:
    raise ValueError(f"merge_states: o.shape[:-1] must equal lse.shape, got {o.shape=} {lse.shape=}")
  if not -lse.ndim <= axis < lse.ndim:
    raise ValueError(f"merge_states: axis={axis} out of range for {lse.shape=}")
  axis = axis % lse.ndim
  lse = lse.astype(jnp.float32)
  lse_max = jnp.max(lse, axis=axis, keepdims=True)
  # All parts empty: use 0 as the reference so that exp(-inf - 0) = 0 (no NaN).
  ref = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
  w = jnp.exp(lse - ref)  # [..., n, ...]; 0 for empty parts
  total = jnp.sum(w, axis=axis)
  acc = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=axis)
  out = acc / jnp.where(total > 0, total, 1.0)[..., None]
  out_lse = jnp.where(total > 0, jnp.squeeze(ref, axis) + jnp.log(total), -jnp.inf)
  return out.astype(o.dtype), out_lse


def finalize_state(acc: jnp.ndarray, m: jnp.ndarray, l: jnp.ndarray):
  """Online-softmax accumulators -> state.

  Args:
    acc: ``[..., D]`` float32 unnormalized sum of exp(s - m) * v.
    m: ``[...]`` float32 running max of the scores (finite, possibly a mask value).
    l: ``[...]`` float32 sum of exp(s - m) over the valid keys (0 if none).

  Returns:
    ``(o, lse)``: o = acc / l (0 where l == 0), lse = m + log(l) (-inf where l == 0).
  """
  nonempty = l > 0
  o = acc / jnp.where(nonempty, l, 1.0)[..., None]
  lse = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), -jnp.inf)
  return o, lse
