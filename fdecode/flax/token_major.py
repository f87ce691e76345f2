"""`attention_fn`: FlashDecode on decode steps of Flax's own attention modules, over Flax's
token-major cache ``[B, L, Hkv, D]`` (legend in `fdecode.flax`)."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from flax import linen
from flax import nnx

from fdecode import config as config_lib
from fdecode.api import flash_decode
from fdecode.combine import MASK_VALUE, finalize_state, merge_states
from fdecode.validation import static_int, static_scale

__all__ = ["attention_fn", "decode_token_major", "token_major_decode"]


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, *, num_splits=None, **kwargs):
  """Drop-in ``attention_fn`` for Flax attention modules, FlashDecode on decode steps.

  Same signature and result as ``flax.nnx.dot_product_attention``. A call is a decode
  step, and runs `decode_token_major` (`token_major_decode` on CPU, the Pallas kernels
  on GPU and TPU), when all of these hold (each is static, so the
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


def decode_token_major(q, k, v, mask, *, num_splits=None):
  """One new token per sequence over a token-major cache ``[B, L, Hkv, D]`` with a mask
  ``[B, 1|Hq, L]`` (True = visible), by the platform lowered for: on CPU
  `token_major_decode` (in place, the fastest XLA:CPU form measured); on GPU and TPU
  `fdecode.flash_decode` with ``kv_layout="NHD"``, i.e. the Pallas kernels (Triton reads
  the cache in place; Mosaic a head-major view). Returns ``[B, Hq, Dv]`` in q's dtype."""
  on_cpu = lambda: token_major_decode(q, k, v, mask, num_splits=num_splits)
  on_chip = lambda: kernel_decode(q, k, v, mask, num_splits=num_splits)
  return lax.platform_dependent(cpu=on_cpu, default=on_chip)


def kernel_decode(q, k, v, mask, **flash_decode_kwargs):
  """`decode_token_major`'s GPU / TPU branch: `fdecode.flash_decode` on the token-major
  cache with the mask as its ``mask`` (``[B, S]`` or ``[B, T=1, Hq, S]``) and every
  cache slot counted (the mask alone decides visibility, as in Flax)."""
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


def token_major_decode(q, k, v, mask, *, softmax_scale=None, num_splits=None,
                       return_lse=False):
  """FlashDecode of one new token per sequence over a token-major cache, any mask.

  The L axis is split into ``n`` chunks (a free reshape); each chunk gives a partial
  state (`fdecode.combine.finalize_state`), merged with `fdecode.merge_states`. The
  scores and the value sum are written as broadcast-multiply-reduce over the
  contiguous head dim rather than as einsums: XLA lowers a dot whose batch dims
  (B, Hkv) are not leading by first transposing the whole cache. Measured on a 2-core
  CPU, B=4 S=4096 Hkv=8 G=4 D=128 (benchmarks/bench_flax.py): float32 27 ms per step
  vs 15 ms for `fdecode.flash_decode` on a head-major cache and 100 ms for transposing
  then calling it; bfloat16 is slower here (89 ms; transposing 52 ms), a known gap.

  Args:
    q: ``[B, Hq, Dk]`` float, the new token of each sequence.
    k: ``[B, L, Hkv, Dk]`` float, token-major keys (Flax's cache layout).
    v: ``[B, L, Hkv, Dv]`` float.
    mask: bool ``[B, 1, L]`` (same for all heads) or ``[B, Hq, L]``: True = visible.
    softmax_scale: scores multiplier, default ``1/sqrt(Dk)``.
    num_splits: chunks of L, dividing L; ``None``: `fdecode.config.default_num_splits`
      but at least 2, rounded down to a divisor of L.
    return_lse: also return the float32 natural-log LSE ``[B, Hq]``.

  Returns:
    ``out`` ``[B, Hq, Dv]`` in ``q.dtype`` (and ``lse``); a fully masked row gives 0
    (and -inf).

  Raises:
    ValueError: for inconsistent shapes (names the argument, shows the shapes), a
      ``softmax_scale`` outside float32 (as `fdecode.flash_decode`), or ``num_splits``
      not a positive int dividing L.
  """
  shapes = (f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}, "
            f"mask.shape={tuple(mask.shape)}")
  if q.ndim != 3 or k.ndim != 4 or v.ndim != 4 or mask.ndim != 3:
    raise ValueError("token_major_decode: want q [B, Hq, Dk], k [B, L, Hkv, Dk], "
                     f"v [B, L, Hkv, Dv], mask [B, 1|Hq, L]; got {shapes}")
  b, hq, dk = q.shape
  _, length, hkv, _ = k.shape
  dv = v.shape[-1]
  if k.shape[0] != b or k.shape[3] != dk or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"token_major_decode: q, k, v disagree on B, L, Hkv or Dk; got {shapes}")
  if hkv == 0 or hq % hkv:
    raise ValueError(f"token_major_decode: Hq ({hq}) must be a multiple of Hkv ({hkv}); "
                     f"got {shapes}")
  if mask.shape[0] != b or mask.shape[1] not in (1, hq) or mask.shape[2] != length:
    raise ValueError(f"token_major_decode: mask must be [B, 1, L] or [B, Hq, L]; got {shapes}")
  g = hq // hkv
  scale = static_scale(softmax_scale, dk, "token_major_decode")
  if num_splits is not None:
    num_splits = static_int("num_splits", num_splits, caller="token_major_decode")
  if num_splits is None:
    # At least 2: with a single chunk XLA:CPU fuses the final normalization into the
    # value reduction and the step is ~6x slower (benchmarks/bench_flax.py).
    heuristic = config_lib.default_num_splits(b, hkv, length, config_lib.num_parallel_units())
    num_splits = config_lib.largest_divisor_at_most(length, max(heuristic, 2))
  n = num_splits
  if length % n:
    raise ValueError(f"token_major_decode: num_splits={n} must divide L={length}; got {shapes}")
  c = length // n
  kc = k.reshape(b, n, c, hkv, 1, dk)
  vc = v.reshape(b, n, c, hkv, 1, dv)
  # [B, n, C, Hkv|1, G|1]: the mask in the scores' layout (tiny next to the cache).
  if mask.shape[1] == 1:
    valid = mask.reshape(b, n, c, 1, 1)
  else:
    valid = mask.reshape(b, hkv, g, n, c).transpose(0, 3, 4, 1, 2)
  qf = q.reshape(b, 1, 1, hkv, g, dk).astype(jnp.float32) * scale
  scores = jnp.sum(qf * kc, axis=-1)  # [B, n, C, Hkv, G] float32
  scores = jnp.where(valid, scores, MASK_VALUE)
  mx = jnp.max(scores, axis=2)  # [B, n, Hkv, G]
  p = jnp.where(valid, jnp.exp(scores - mx[:, :, None]), 0.0)
  l = jnp.sum(p, axis=2)

  def states(select):  # -> [B, Hkv, G, Dv], [B, Hkv, G]
    contrib = p[..., None] * vc
    if select:  # hidden slots selected away, never multiplied by 0: they may hold inf / NaN
      contrib = jnp.where(valid[..., None], contrib, 0.0)
    acc = jnp.sum(contrib, axis=2)  # [B, n, Hkv, G, Dv] float32
    return merge_states(*finalize_state(acc, mx, l), axis=1)

  # A hidden finite value meets p = 0 exactly (an exact 0 in the sum); a hidden inf / NaN
  # makes its row non-finite. So the select-free result stands when every non-empty row
  # is finite, and is recomputed with the select otherwise (as `fdecode.kernels.xla`
  # does: always selecting measured 9x slower here, 74 vs 8 ms in bench_flax.py).
  o, lse = states(False)
  clean = jnp.all(jnp.isfinite(o) | jnp.isneginf(lse)[..., None])
  o, lse = lax.cond(clean, lambda: (o, lse), lambda: states(True))
  out = o.reshape(b, hq, dv).astype(q.dtype)
  return (out, lse.reshape(b, hq)) if return_lse else out
