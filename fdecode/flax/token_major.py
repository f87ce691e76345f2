"""`attention_fn`: FlashDecode on decode steps of Flax's own attention modules, over Flax's
token-major cache ``[B, L, Hkv, D]`` (legend in `fdecode.flax`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike
from flax import linen
from flax import nnx

from fdecode.api import flash_decode

__all__ = ["attention_fn", "decode_token_major"]


def attention_fn(query: Array, key: Array, value: Array, bias: Array | None = None, mask: Array | None = None,
                 broadcast_dropout: bool = True, dropout_rng: Array | None = None, dropout_rate: float = 0.0,
                 deterministic: bool = False, dtype: Any = None, precision: Any = None, module: Any = None, *,
                 num_splits: int | str | None = None, **kwargs: Any) -> Array:
  """Drop-in ``attention_fn`` for Flax attention modules, FlashDecode on decode steps.

  Same signature and result as ``flax.nnx.dot_product_attention``. A call is a decode
  step, and runs `decode_token_major` (`fdecode.flash_decode` on the token-major cache:
  the XLA path on CPU, the Pallas kernels on GPU and TPU), when all of these hold (each is static, so the
  choice is made at trace time): the query length is 1, a ``mask`` is given whose query
  axis is 1 and whose head axis is 1 or Hq, there is no ``bias``, no active dropout
  (``dropout_rate == 0`` or ``deterministic``), no ``module`` to sow weights into and no
  ``is_causal``. Flax's decode mode always passes such a mask (its cache-index mask).
  Any other call goes to ``flax.nnx.dot_product_attention`` (or the linen one when
  ``module`` is a linen module) with every argument unchanged.

  Args:
    query: ``[batch..., 1, Hq, Dk]`` on decode steps (``[batch..., T, Hq, Dk]`` otherwise).
    key: ``[batch..., L, Hkv, Dk]`` token-major, Flax's whole cache on decode steps.
    value: ``[batch..., L, Hkv, Dv]``.
    bias: optional additive bias; forces the Flax path.
    mask: bool (or 0/1 float, as Flax's ``combine_masks`` makes) broadcastable to
      ``[batch..., Hq, 1, L]``; False hides a key. Any pattern is exact, not only prefixes.
    broadcast_dropout, dropout_rng, dropout_rate, deterministic, precision, module:
      as in Flax; only used on the Flax path (``precision`` is ignored on decode steps,
      which accumulate in float32).
    dtype: result dtype; ``None``: the promoted dtype of query, key and value.
    num_splits: chunks of the L axis on decode steps (merged with
      `fdecode.merge_states`); ``None``: the split heuristic. Bind it with
      ``functools.partial(attention_fn, num_splits=4)``.
    **kwargs: passed to Flax's ``dot_product_attention`` (``is_causal``,
      ``promote_dtype``, ...).

  Returns:
    ``[batch..., T, Hq, Dv]``. On decode steps a query whose mask hides every key gives
    0 (Flax gives the mean of all values there); Flax's decode mode never does that.
  """
  if not _is_decode_step(query, key, value, bias, mask, dropout_rate, deterministic,
                         module, kwargs):
    if isinstance(module, linen.Module):
      return linen.dot_product_attention(
          query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
          dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
          dtype=dtype, precision=precision, module=module, **kwargs)
    return nnx.dot_product_attention(
        query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
        dtype=dtype, precision=precision, module=module, **kwargs)
  with jax.numpy_dtype_promotion("standard"):  # promoted as documented, whatever the caller's mode
    out_dtype = dtype if dtype is not None else jnp.result_type(query, key, value)
  *batch, _, hq, dk = query.shape
  length, hkv = key.shape[-3], key.shape[-2]
  b = math.prod(batch)
  q = query.reshape(b, hq, dk)
  k = key.reshape(b, length, hkv, dk)
  v = value.reshape(b, length, hkv, value.shape[-1])
  hm = mask.shape[-3]
  m = jnp.broadcast_to(mask, (*batch, hm, 1, length)).reshape(b, hm, length).astype(jnp.bool_)
  out = decode_token_major(q, k, v, m, num_splits=num_splits)
  return out.reshape(*batch, 1, hq, out.shape[-1]).astype(out_dtype)


def decode_token_major(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None,
                       **flash_decode_kwargs: Any) -> Array:
  """One new token per sequence over a token-major cache ``[B, L, Hkv, D]`` with a mask
  ``[B, 1|Hq, L]`` (True = visible): `fdecode.flash_decode` with ``kv_layout="NHD"``, the
  mask as its ``mask`` (``[B, S]`` or ``[B, T=1, Hq, S]``) and every cache slot counted
  (the mask alone decides visibility, as in Flax), read in place by every platform's
  path (`fdecode.cache.layout`). Returns ``[B, Hq, Dv]`` in q's dtype."""
  b, length = k.shape[0], k.shape[1]
  kernel_mask = mask[:, 0] if mask.shape[1] == 1 else mask[:, None]
  return flash_decode(q, k, v, jnp.full((b,), length, jnp.int32), mask=kernel_mask, kv_layout="NHD",
                      **flash_decode_kwargs)


def _is_decode_step(query, key, value, bias, mask, dropout_rate, deterministic, module,
                    kwargs) -> bool:
  """Static test: can `attention_fn` take the FlashDecode path for this call?"""
  if mask is None or bias is not None or module is not None or kwargs.get("is_causal"):
    return False
  if dropout_rate > 0.0 and not deterministic:
    return False
  if query.ndim < 4 or key.ndim != query.ndim or value.ndim != query.ndim:
    return False  # no batch axis: leave it to Flax
  hq, hkv, length = query.shape[-2], key.shape[-2], key.shape[-3]
  if query.shape[-3] != 1 or hkv == 0 or hq % hkv or length == 0:
    return False
  if query.shape[:-3] != key.shape[:-3] or key.shape[:-1] != value.shape[:-1]:
    return False
  if mask.ndim != query.ndim or mask.shape[-2:] not in ((1, length), (1, 1)):
    return False
  return mask.shape[-3] in (1, hq)
