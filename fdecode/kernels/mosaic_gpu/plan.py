"""What the plans of the two Hopper kernels share (`fdecode.kernels.mosaic_gpu.mla.plan`,
`fdecode.kernels.mosaic_gpu.gqa.plan`): the program's shape, the split rule and the
checks of a launch both families make.

A program owns `BLOCK_ROWS` query rows (one wgmma M tile) of one sequence (and kv head)
and one split: a contiguous range of ``bk``-token blocks, ``bk`` a multiple of 64
(wgmma's K for P V and the 128-byte swizzle of a bf16 row), pipelined ``stages`` deep
through a TMA ring. Its shared memory holds one program per SM, so `split_count` deals
each sequence's blocks into splits until programs x splits fill the GPU's SMs.

Legend: B batch, R query rows of one kv head, S cache capacity, bk tokens per block.
"""

from __future__ import annotations

import math
import numbers

from fdecode.kernels.common import chips

BLOCK_ROWS = 64   # query rows of one program: one wgmma M tile
TILE_COLS = 64    # columns of one swizzled smem tile (a 128-byte swizzle of bf16, 64 B of 8-bit)
QUANT_DTYPES = ("int8", "float8_e4m3fn")  # 8-bit caches the Hopper kernels convert exactly to bf16
COMPUTE_REGISTERS = 232  # per-thread registers of a compute warpgroup (``setmaxnreg``)
MEMORY_REGISTERS = 40    # ... and of the TMA warpgroup
BF16_BYTES = 2


class PlanBase:
  """What both plans derive alike from their fields ``cache_dtype`` and ``row_blocks`` (a
  base without fields: each plan's fields stay its own, in its own order)."""

  @property
  def quantized(self) -> bool:
    """The cache is 8-bit (int8 / float8_e4m3fn) with per-token float32 scales."""
    return self.cache_dtype != "bfloat16"

  @property
  def rows_padded(self) -> int:
    """R_p: the query rows the programs own, ``row_blocks * BLOCK_ROWS``."""
    return self.row_blocks * BLOCK_ROWS


def split_count(gpu: chips.Gpu, programs: int, blocks: int, overhead_blocks: float = 2.0) -> int:
  """Splits of each sequence's ``blocks`` so that ``programs`` x splits fill ``gpu``'s
  SMs (one program per SM: the shared memory holds one) with the least modeled time:
  ``waves * (blocks per split + overhead)``, the overhead being the Q load, the output
  writes and the merge of one more split, in blocks. Ties go to fewer splits."""
  best, best_cost = 1, math.inf
  for n in range(1, max(1, blocks) + 1):
    waves = -(-programs * n // gpu.sms)
    cost = waves * (-(-blocks // n) + overhead_blocks)
    if cost < best_cost - 1e-9:
      best, best_cost = n, cost
  return best


def check_pipeline(caller: str, block_k: int, stages: int) -> None:
  """ValueError unless ``block_k`` is a positive multiple of 64 and ``stages`` >= 2."""
  if block_k % 64 or block_k <= 0:
    raise ValueError(f"{caller}: block_k must be a positive multiple of 64, got block_k={block_k}")
  if stages < 2:
    raise ValueError(f"{caller}: stages must be >= 2, got stages={stages}")


def row_blocks(rows: int) -> int:
  """Programs along R query rows: ceil(R / `BLOCK_ROWS`) (the last padded)."""
  return -(-rows // BLOCK_ROWS)


def splits(caller: str, gpu: chips.Gpu, *, programs: int, seq_len: int, block_k: int, num_splits) -> int:
  """The splits of each sequence's ceil(S / bk) blocks (at least 1): ``num_splits`` None:
  `split_count` for ``programs`` programs per split on ``gpu``; else a positive int,
  clipped to the blocks (ValueError otherwise)."""
  blocks = max(1, -(-seq_len // block_k))
  if num_splits is None:
    num_splits = split_count(gpu, programs, blocks)
  if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1:
    raise ValueError(f"{caller}: num_splits must be a positive int or None, got {num_splits!r}")
  return min(int(num_splits), blocks)


def contiguous_cache_rows(seq_len: int, block_k: int) -> int:
  """Rows of a contiguous cache operand: S rounded up to a multiple of 8 and to at least
  ``block_k`` (a TMA tiled copy needs whole 8-row tiles and a block's rows in the
  operand; a cache of another S is copied padded, per call)."""
  return max(-(-seq_len // 8) * 8, block_k)


def check_smem(caller: str, what: str, plan, gpu: chips.Gpu) -> None:
  """ValueError where ``plan.smem_bytes()`` exceeds what ``gpu`` gives a block; ``what``
  names the cache the plan is for."""
  if plan.smem_bytes() > gpu.smem_per_block:
    raise ValueError(f"{caller}: {what} with block_k={plan.block} and stages={plan.stages} needs "
                     f"{plan.smem_bytes()} B of shared memory; {gpu.name} gives a block {gpu.smem_per_block} B")


def q_unsupported(q_dtype) -> str | None:
  """Why a query of ``q_dtype`` cannot be a wgmma operand, or None."""
  if str(q_dtype) != "bfloat16":
    return f"needs bfloat16 q (a wgmma operand), got q {q_dtype}"
  return None
