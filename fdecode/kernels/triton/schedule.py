"""The balanced schedule of the Triton kernel (``flash_decode(num_splits="balance")``):
a fixed grid of work items dealt out over the sequences by their live blocks.

The kernels derive it themselves: each split-kernel program (one work item) and each
combine program (a tile of one sequence's rows) loads the whole ``ends [B]`` and computes what it needs
(`item_work`, `sequence_items`: a few reductions and a cumsum over B, in registers), so
the schedule costs no launch of its own. `balanced_schedule` is the same schedule in XLA
over every item at once: the reference the kernels' derivation is tested against.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from fdecode.kernels.triton.pallas_triton import plgpu

from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import Modifiers


@dataclasses.dataclass(frozen=True)
class Schedule:
  """What the schedule depends on besides ``ends``: ``items`` work items over ``batch``
  (B) sequences of T = ``num_tokens`` rows, ``block``-token blocks, S = ``seq_len``."""
  items: int
  batch: int
  block: int
  num_tokens: int
  seq_len: int
  mods: Modifiers

  @property
  def batch_padded(self) -> int:  # Triton vectors have power-of-two lengths
    return 1 << max(self.batch - 1, 0).bit_length()


def balanced_schedule(ends, items: int, bk: int, num_tokens: int, seq_len: int, mods: Modifiers):
  """The balanced schedule (``flash_decode(num_splits="balance")``): ``items`` work items
  dealt out over the sequences by their live blocks, from ``ends`` (int32 ``[B]``), so a
  batch whose rows are mostly empty (`ragged_decode`'s prefill blocks: a static bound of
  blocks, few of them real) still fills the GPU with even work.

  A sequence of ``n_b`` live blocks (`block.split_range`'s, window included) gets
  ``ceil(n_b / c)`` items, ``c = ceil(sum(n) / (items - live sequences))`` blocks each, so
  the items needed never exceed ``items``; the rest are empty (end 0: they read nothing).
  Items go to sequences in order: sequence b owns a contiguous run of them.

  Returns ``(item_seq, work, item_ends)``: int32 ``[items]`` each item's sequence (B for
  an empty item: its state is dropped by the merge), ``[items, 3]`` its split, that
  sequence's split count (`block.split_range`'s) and the row of q and of the block table
  it reads (its sequence, clipped into ``[0, B)``), and ``[items]`` its sequence's end.
  (XLA over every item at once; the kernels compute the same per program with
  `item_work` / `sequence_items`.)
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


def load_ends(ref, sched: Schedule):
  """In a kernel: the whole ``ends`` ref (int32 ``[B]``) as a ``[B_p]`` vector, 0 past B."""
  bp = sched.batch_padded
  return plgpu.load(ref.at[pl.ds(0, bp)], mask=lax.iota(jnp.int32, bp) < sched.batch, other=0)


def _splits(ends, sched: Schedule):
  """``ends`` int32 ``[B_p]`` (0 past B) -> items per sequence ``[B_p]``: `balanced_schedule`'s ``splits``."""
  first, last = blk.split_range(ends, 0, 1, sched.num_tokens, sched.seq_len, sched.block, sched.mods)
  real = lax.iota(jnp.int32, ends.shape[0]) < sched.batch
  blocks = jnp.where(real, last - first, 0)
  live = jnp.sum(jnp.where(blocks > 0, 1, 0))
  per_item = jnp.maximum(1, cdiv(jnp.sum(blocks), jnp.maximum(sched.items - live, 1)))
  return cdiv(blocks, per_item)


def cdiv(a, b):  # a >= 0, b >= 1
  return (a + b - 1) // b


def vector_at(x, i):
  """``x[i]`` of a vector at a traced scalar index (a masked sum: Triton has no gather of
  a register vector); 0 for an index past it."""
  return jnp.sum(jnp.where(lax.iota(jnp.int32, x.shape[0]) == i, x, 0))


def item_work(ends, item, sched: Schedule):
  """Work item ``item`` (int32 scalar) from ``ends`` (`load_ends`): ``(seq, split, count,
  end)``, `balanced_schedule`'s ``item_seq``, ``work`` and ``item_ends`` for it, with
  ``seq`` clipped into ``[0, B)`` (an empty item: split 0 of 1, end 0)."""
  splits = _splits(ends, sched)
  bounds = lax.cumsum(splits, axis=0)
  seq = jnp.sum(jnp.where(bounds <= item, 1, 0))
  used = item < jnp.sum(splits)
  seq = jnp.where(used, seq, 0)
  split = jnp.where(used, item - (vector_at(bounds, seq) - vector_at(splits, seq)), 0)
  count = jnp.where(used, jnp.maximum(vector_at(splits, seq), 1), 1)
  return seq, split, count, jnp.where(used, vector_at(ends, seq), 0)


def sequence_items(ends, seq, sched: Schedule):
  """Sequence ``seq``'s work items, ``[first, last)`` (int32 scalars; empty for a
  sequence with no live block), from ``ends`` (`load_ends`)."""
  splits = _splits(ends, sched)
  last = jnp.sum(jnp.where(lax.iota(jnp.int32, splits.shape[0]) <= seq, splits, 0))  # bounds[seq]
  return last - vector_at(splits, seq), last
