"""The balanced schedule of the Triton kernel (``flash_decode(num_splits="balance")``):
a fixed grid of work items dealt out over the sequences by their live blocks."""

from __future__ import annotations

import jax.numpy as jnp

from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import Modifiers


def balanced_schedule(ends, items: int, bk: int, num_tokens: int, seq_len: int, mods: Modifiers):
  """The balanced schedule (``flash_decode(num_splits="balance")``): ``items`` work items
  dealt out over the sequences by their live blocks, computed in XLA from ``ends``
  (int32 ``[B]``), so a batch whose rows are mostly empty (`ragged_decode`'s prefill
  blocks: a static bound of blocks, few of them real) still fills the GPU with even work.

  A sequence of ``n_b`` live blocks (`block.split_range`'s, window included) gets
  ``ceil(n_b / c)`` items, ``c = ceil(sum(n) / (items - live sequences))`` blocks each, so
  the items needed never exceed ``items``; the rest are empty (end 0: they read nothing).

  Returns ``(item_seq, work, item_ends)``: int32 ``[items]`` each item's sequence (B for
  an empty item: its state is dropped by the merge), ``[items, 3]`` its split, that
  sequence's split count (`block.split_range`'s) and the row of q and of the block table
  it reads (its sequence, clipped into ``[0, B)``), and ``[items]`` its sequence's end.
  """
  b = ends.shape[0]
  first, last = blk.split_range(ends, 0, 1, num_tokens, seq_len, bk, mods)
  blocks = last - first  # [B]
  live = jnp.sum(blocks > 0)
  per_item = jnp.maximum(1, -(-jnp.sum(blocks) // jnp.maximum(items - live, 1)))
  splits = -(-blocks // per_item)  # [B], 0 for an empty sequence
  bounds = jnp.cumsum(splits)
  item = jnp.arange(items, dtype=jnp.int32)
  seq = jnp.minimum(jnp.sum(bounds[None, :] <= item[:, None], axis=1), b).astype(jnp.int32)
  used = item < bounds[-1]
  seq = jnp.where(used, seq, b)
  safe = jnp.minimum(seq, b - 1)
  work = jnp.stack([jnp.where(used, item - (bounds[safe] - splits[safe]), 0),
                    jnp.where(used, jnp.maximum(splits[safe], 1), 1), safe], axis=1).astype(jnp.int32)
  return seq, work, jnp.where(used, ends[safe], 0)
