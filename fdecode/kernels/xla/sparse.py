"""Sparse top-k attention in plain jnp (the CPU default for ``flash_decode(..., indices=)``).

Only the selected tokens are read: each pseudo-sequence's canonical index list
(`fdecode.kernels.common.sparse`) gathers its K token rows from the cache (contiguous: by position;
paged: through the block table), dequantizes them after the gather, and attends over
them with the rows' usual visibility rules applied to the gathered positions. The list
is cut into ``n`` chunks whose states `merge_states` combines.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fdecode.kernels.xla.dense import contiguous_states, Geometry, pad_tokens
from fdecode.kernels.common.modifiers import Modifiers
from fdecode.cache.quant import dequantize
from fdecode.kernels.common.sparse import Sparse


def _gather(x, idx, src, block_tables, page_size, fold=False, scale=False):
  """Token rows of a cache (or a canonical rank-4 scale: ``scale``) at canonical positions.

  Args:
    x: contiguous ``[B|1, Hkv|1, S|1, D]`` or paged ``[Hkv|1, P|1, ps|1, D]``.
    idx: int32 ``[B', Hi, K]`` positions in ``[0, S]`` (S: a dropped entry, clipped).
    src: int32 ``[B']`` the sequence each row reads (contiguous only); ``fold``: whether
      that is not simply row b' (folded per-token lists).

  Returns:
    ``[B', Hkv|1, K|1, D]``.
  """
  h = x.shape[1] if block_tables is None else x.shape[0]
  hs = jnp.arange(h)[None, :, None]
  if block_tables is None:
    if scale and x.shape[2] == 1:  # per head / per tensor: nothing varies along the tokens
      return x[src if x.shape[0] != 1 else jnp.zeros_like(src)][:, :h]
    rows = jnp.broadcast_to(jnp.clip(idx, 0, x.shape[2] - 1), (idx.shape[0], h, idx.shape[2]))
    if x.shape[0] == src.shape[0] and not fold:  # one list per cache row: per (row, head) a
      # row gather, vmapped (2x faster on XLA:CPU than one gather with three index arrays)
      return jax.vmap(jax.vmap(lambda xh, ih: xh[ih]))(x, rows)
    b = src[:, None, None] if x.shape[0] != 1 else 0  # != 1: a symbolic batch too
    return x[b, hs, rows]
  if scale and x.shape[1] == 1 and x.shape[2] == 1:  # a per-head / per-tensor scale of a pool
    return x.reshape(1, h, 1, x.shape[-1])
  col = jnp.clip(idx // page_size, 0, block_tables.shape[1] - 1)
  page = jnp.clip(jnp.take_along_axis(block_tables[:, None, :], col, axis=2), 0, None)
  page = jnp.minimum(page, x.shape[1] - 1) if x.shape[1] > 1 else jnp.zeros_like(page)
  slot = idx % page_size if x.shape[2] > 1 else jnp.zeros_like(idx)
  return x[hs, page, slot]


def sparse_partials(q_rows, cache, ends, mod_arrays, lists, *, sparse: Sparse, num_tokens: int,
                    softmax_scale: float, num_splits: int, mods: Modifiers = Modifiers(), v_head_dim=None):
  """Per-split partial states over the selected tokens.

  Args:
    q_rows: ``[B', Hkv, R, Dk]`` queries in the compute dtype (row r = t * G + g).
    cache, mod_arrays: as `fdecode.kernels.xla.xla_partials` (head-major; ``v`` None: MLA;
      no mask or bias with index lists).
    ends: int32 ``[B']`` each pseudo-sequence's end relative to the cache.
    indices, index_bounds: canonical lists ``[B', Hi, K]`` and their live slots
      (`fdecode.kernels.common.sparse.canonicalize`); ``sparse.fold``: row b' reads the contiguous cache
      of sequence ``b' // fold`` (paged tables are already one row per pseudo-sequence).
    num_splits: chunks of the K list.

  Returns:
    ``(o, lse)``: float32 ``[B', Hkv, n, R, Dv]`` and ``[B', Hkv, n, R]``.
  """
  # Positions already encode liveness (index_bounds unread); no mask or bias with indices.
  k, v, k_rope, block_tables = cache.k, cache.v, cache.k_rope, cache.block_tables
  k_scale, k_offset, v_scale, v_offset = cache.k_scale, cache.k_offset, cache.v_scale, cache.v_offset
  indices, alibi = lists["indices"], mod_arrays["alibi"]
  b, hkv, r, _ = q_rows.shape
  paged = block_tables is not None
  page_size = k.shape[2] if paged else None
  s = block_tables.shape[1] * page_size if paged else k.shape[2]
  src = jnp.arange(b, dtype=jnp.int32) // sparse.fold
  n = num_splits
  idx = pad_tokens(indices, -(-indices.shape[-1] // n) * n, axis=2)  # pads with 0 ...
  pad = jnp.arange(idx.shape[-1]) >= indices.shape[-1]
  idx = jnp.where(pad, s, idx)  # ... replaced by the sentinel: a dropped slot
  c = idx.shape[-1] // n
  dtype = q_rows.dtype
  gather = lambda x, scale=False: None if x is None else _gather(x, idx, src, block_tables, page_size,
                                                                   sparse.fold > 1, scale)

  def load(x, scale, offset):  # [B', Hkv, K, D] in the compute dtype, dequantized after the gather
    x = gather(x)
    x = jnp.broadcast_to(x, (b, hkv) + x.shape[2:])
    return x.astype(dtype) if scale is None else dequantize(x, gather(scale, True), gather(offset, True), dtype)

  keys = load(k, k_scale, k_offset)
  values = keys if v is None else load(v, v_scale, v_offset)  # MLA: one gather, k's first columns
  chunks = lambda x: x.reshape(b, hkv, n, c, x.shape[-1])
  kc = chunks(keys) if k_rope is None else (chunks(keys), chunks(load(k_rope, None, None)))
  geo = Geometry(ends, num_tokens, r // num_tokens, s, mods, None, None, alibi)
  pos = idx.reshape(b, idx.shape[1], n, 1, c)
  # Dropped slots (clipped gathers) meet probability 0 and are selected away only when
  # one holds inf / NaN (`contiguous_states`: always selecting costs a pass over V on CPU).
  return contiguous_states(q_rows, kc, chunks(values), geo, jnp.zeros((b,), jnp.int32), softmax_scale,
                            pos=pos, v_cols=v_head_dim if v is None else None)
