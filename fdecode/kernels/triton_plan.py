"""How the Triton kernel (`fdecode.kernels.triton`) is sized and scheduled for the GPU it
is compiled for (`fdecode.chips.Gpu`): query rows per program, the key block and warps
that fit the registers and shared memory (`launch_plan`, calibrated on ptxas), and the
balanced schedule's work items (`balanced_schedule`, ``flash_decode(num_splits="balance")``).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from fdecode import chips
from fdecode.kernels import block as blk
from fdecode.modifiers import Modifiers

# tl.dot needs every dimension >= 16; rows are padded to it, pieces must reach it.
_MIN_DOT = 16
# Elements of q (and of the float32 accumulator) one program holds: with 4 warps about
# 64-128 registers a thread. Wider rows (MLA's 576 / 512) get fewer rows per program
# (sglang's Triton MLA decode: 16 heads a program); the cache block is then read once
# per row block (from L2 after the first).
_ROW_BUDGET = 16 * 1024


def rows_per_program(rows: int, dq: int, dv: int) -> int:
  """Query rows one Triton program holds: all ``rows`` when ``rows * max(Dq, Dv)`` fits
  `_ROW_BUDGET`, else the largest power of two (>= 16) that does."""
  per = max(_MIN_DOT, 1 << ((_ROW_BUDGET // max(dq, dv)).bit_length() - 1))
  return rows if rows <= per else per


def block_size(block_k: int) -> int:
  """The kernel's ``bk``: ``block_k`` rounded up to a power of two, at least 16."""
  return max(_MIN_DOT, 1 << max(block_k - 1, 0).bit_length())


# Bytes of tiles and row state one thread may hold: about 150 of its 255 registers (the
# rest hold addresses, masks and the load pipeline). Calibrated on ptxas -v for H100 and
# A100 (benchmarks/RESULTS.md, compile report): past it ptxas spills.
_THREAD_BYTES = 540
_PIECE_COLS = 64
_STAGES = 2                     # Triton software-pipeline stages (one block in flight)
_WARPS = (4, 8)
# Shared memory the compiler really allocates came to about 0.8 of `Launch.smem`
# (measured): the upper residency estimate counts 0.75 of it.
_SMEM_MEASURED = 0.75
# Registers ptxas allocates came to 0.41-0.94 of `Launch.regs` over the compile report's
# grid (H100 and A100): the upper residency estimate counts this fraction.
_REGS_MEASURED = 0.4


@dataclasses.dataclass(frozen=True)
class Launch:
  """How one program runs on the target GPU."""
  block: int                  # bk
  warps: int
  stages: int
  smem: int                   # upper estimate of its shared memory (bytes)
  regs: int                   # estimate of its registers per thread

  def residency(self, gpu: chips.Gpu) -> tuple[int, int]:
    """Programs an SM may hold at once, (lower, upper): at the estimated registers and
    shared memory, and at `_REGS_MEASURED` of those registers and `_SMEM_MEASURED` of
    that memory. Registers are ptxas' choice (H100, B=64 S=4k: 3 resident by the
    estimate, 4 compiled), so the split count is judged at every residency between."""
    threads = 32 * self.warps
    hi = max(1, gpu.resident_programs(threads=threads, regs=int(self.regs * _REGS_MEASURED),
                                      smem=int(self.smem * _SMEM_MEASURED)))
    lo = max(1, gpu.resident_programs(threads=threads, regs=self.regs, smem=self.smem))
    return min(lo, hi), hi


def launch_plan(gpu: chips.Gpu, *, block_r: int, dq: int, dv: int, cols: int, raw_bytes: int,
                compute_bytes: int, block_k: int, convert_bytes: int = 0) -> Launch:
  """Warps and block for ``gpu``: the largest power-of-two ``bk <= block_size(block_k)``
  whose tiles fit `_THREAD_BYTES` a thread and whose pipelined loads fit the chip's shared
  memory per block, on 4 warps if that keeps ``bk >= 64`` (or the cap), else on 8.

  ``cols``: cache columns one block loads (k's, v's unless MLA, k_rope's); ``raw_bytes``:
  their bytes in memory; ``compute_bytes``: after the cast / dequantization;
  ``convert_bytes``: what a loaded element holds on the way there (its raw bytes for a
  cast or a dequantization, plus 4 for the int32 of a float8 bit decode; 0 when loads feed
  the dots as they are).
  """
  cap = block_size(block_k)

  def fits(bk, warps):
    tiles = bk * cols * (compute_bytes + convert_bytes) + block_r * (dq * compute_bytes + dv * 4) + 2 * block_r * bk * 4
    smem = bk * cols * (raw_bytes * (_STAGES - 1) + compute_bytes) + block_r * bk * compute_bytes
    per_thread = tiles / (32 * warps)
    ok = per_thread <= _THREAD_BYTES and smem <= gpu.smem_per_block
    return ok, Launch(bk, warps, _STAGES, smem, math.ceil(per_thread / 4) + 64)

  best = None
  for warps in _WARPS:
    bk = cap
    while bk >= _MIN_DOT:
      ok, launch = fits(bk, warps)
      if ok:
        if warps == _WARPS[-1] or bk >= min(cap, 64):
          return launch
        best = best or launch
        break
      bk //= 2
  if best is not None:
    return best
  # Nothing fits (float32 MLA: q and acc alone take ~70 registers a thread): the smallest
  # tiles on 8 warps, which ptxas takes without spills once float32 pieces are at most
  # _F32_PIECE wide (16 warps would cap it at 128 registers and spill).
  return fits(_MIN_DOT, _WARPS[-1])[1]


def balanced_schedule(ends, items: int, bk: int, num_tokens: int, seq_len: int, mods: Modifiers):
  """The balanced schedule (``flash_decode(num_splits="balance")``): ``items`` work items
  dealt out over the sequences by their live blocks, computed in XLA from ``ends``
  (int32 ``[B]``), so a batch whose rows are mostly empty (`ragged_decode`'s prefill
  blocks: a static bound of blocks, few of them real) still fills the GPU with even work.

  A sequence of ``n_b`` live blocks (`block.split_range`'s, window included) gets
  ``ceil(n_b / c)`` items, ``c = ceil(sum(n) / (items - live sequences))`` blocks each, so
  the items needed never exceed ``items``; the rest are empty (end 0: they read nothing).

  Returns ``(item_seq, work, item_ends)``: int32 ``[items]`` each item's sequence (B for
  an empty item: its state is dropped by the merge), ``[items, 2]`` its split and that
  sequence's split count (`block.split_range`'s), and ``[items]`` its sequence's end.
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
                    jnp.where(used, jnp.maximum(splits[safe], 1), 1)], axis=1).astype(jnp.int32)
  return seq, work, jnp.where(used, ends[safe], 0)
