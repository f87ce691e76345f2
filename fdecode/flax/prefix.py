"""A shared prefix cache for `DecodeAttention`: N prompts prefilled once, attended by every
sequence of a decode batch through `fdecode.cascade_decode` (legend in `fdecode.flax`).

Use (one layer; for a stack, do each step for every layer)::

  layer.init_cache(batch=N, max_len=Sp)          # 1. prefill the N shared prompts
  layer.prefill(x_prefixes, prefix_lengths)
  prefix = shared_prefix(layer)                  # 2. keep them as the shared prefix
  layer.init_cache(batch=B, max_len=S)           # 3. each sequence's own cache
  layer.decode_fn = cascade_decode_fn(prefix, prefix_ids=ids)
  y = layer.decode(x_own_tokens)                 # [B, T, E]: tokens after the prefix

Positions. The layer numbers each sequence's own tokens from 0 (its cache holds only
the suffix). RoPE scores depend only on the distance between query and key positions,
so `shared_prefix` rotates prefix n's keys back by ``prefix_lengths[n]``: its token i
sits at position ``i - prefix_lengths[n]``, and every query at suffix position j sees it
at distance ``j + prefix_lengths[n] - i``, as in the concatenated sequence. Tokens after
the prefix must go through `DecodeAttention.decode` (T at a time, causal among them),
not `prefill`, which attends to the layer's own cache only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fdecode.cascade import cascade_decode
from fdecode.flax.decode_attention import DecodeAttention, apply_rope
from fdecode.cache.quant import is_quantized

__all__ = ["SharedPrefix", "cascade_decode_fn", "shared_prefix"]


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
  """N shared prefixes of one layer, in `fdecode.cascade_decode`'s layout.

  Attributes:
    k: ``[N, Hkv, Sp, D]`` keys, rotated to positions ``i - lengths[n]`` (see module doc).
    v: ``[N, Hkv, Sp, D]`` values.
    lengths: int32 ``[N]`` tokens of each prefix.
  """
  k: jax.Array
  v: jax.Array
  lengths: jax.Array


def shared_prefix(layer: DecodeAttention) -> SharedPrefix:
  """The layer's cache, prefilled with the N prefixes, as a `SharedPrefix` (a copy).

  Args:
    layer: a `DecodeAttention` whose contiguous float cache ``[N, Hkv, Sp, D]`` holds the
      N prefixes (after ``init_cache(batch=N, ...)`` and ``prefill``).

  Raises:
    ValueError: for a paged or 8-bit cache (prefill the prefixes into a contiguous float
      cache; `cascade_decode` itself reads paged / 8-bit prefixes).
  """
  if getattr(layer, "block_tables", None) is not None or is_quantized(layer.cached_key[...].dtype):
    raise ValueError(f"shared_prefix: the layer's cache must be contiguous and float; got "
                     f"cached_key.shape={tuple(layer.cached_key[...].shape)} dtype {layer.cached_key[...].dtype}, "
                     f"paged={layer.block_tables is not None}")
  k, v, lengths = layer.cached_key[...], layer.cached_value[...], layer.lengths[...].astype(jnp.int32)
  if layer.rope_theta is not None:  # RoPE rotations compose: rotate by -lengths[n]
    n, _, s, _ = k.shape
    shift = jnp.broadcast_to(-lengths[:, None], (n, s))
    k = apply_rope(k.transpose(0, 2, 1, 3), shift, theta=layer.rope_theta).transpose(0, 2, 1, 3)
  return SharedPrefix(k=k, v=v, lengths=lengths)


def cascade_decode_fn(prefix: SharedPrefix, *, prefix_ids, **options):
  """A `DecodeAttention` ``decode_fn`` attending over ``prefix`` then the layer's own cache.

  Args:
    prefix: the layer's `SharedPrefix`.
    prefix_ids: int ``[B]``: sequence b of the layer's batch shares prefix ``prefix_ids[b]``.
    **options: bound `fdecode.cascade_decode` options (``impl``, ``num_splits``, ...).

  Returns:
    ``fn(q [B, T, Hq, D], k_cache, v_cache, lengths [B], **kw) -> [B, T, Hq, D]``; ``kw``
    (the layer's scales, block table, softmax scale, soft cap, sinks) go to the suffix.
    Layers with a ``window`` or ``alibi`` raise ValueError (see `cascade_decode`).
  """
  def fn(q, k, v, lengths, **kw):
    return cascade_decode(q, prefix.k, prefix.v, prefix.lengths, k, v, lengths, prefix_ids=prefix_ids,
                          **options, **kw)
  return fn
