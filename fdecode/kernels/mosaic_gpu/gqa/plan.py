"""Launch plan of the Hopper GQA rows kernel (`fdecode.kernels.mosaic_gpu.gqa.kernel`).

`rows_plan` decides every static choice of a launch (rows per program, tokens per block,
stages, splits, grid, registers, how the cache is read: contiguous or through a block
table) and returns a frozen `RowsPlan` the kernel takes as it is; `rows_unsupported`
says, as a sentence, why a call cannot run this kernel. The split rule and the checks
both Hopper kernels make are `fdecode.kernels.mosaic_gpu.plan`'s.

Legend: B batch, T new tokens per sequence, Hq query heads, Hkv kv heads, G = Hq / Hkv,
R = T * G query rows of one kv head (row r = t * G + g), S cache capacity, D head dim
(keys and values alike), bk tokens per block, P pages in a paged pool, page_size its
tokens per page, n table columns (S = n * page_size).

Paged pools (`fdecode.kernels.mosaic_gpu.gqa.paging`): a block is one TMA copy (page_size
a multiple of bk) or bk / page_size copies of a page each (page_size 8, 16, 32), onto one
barrier; a TMA tiled copy moves whole 8-row tiles, so other page sizes are refused.

Shared memory of one program (bk = 64, two stages), D = 256: bf16 caches: Q 64 x D
(32 KiB), K and V stages 2 x 2 x bk x D (128 KiB), P 64 x bk (8 KiB): 168 KiB. 8-bit
caches: Q (32 KiB), 8-bit K and V stages (64 KiB), one bf16 K and V tile the 8-bit tiles
are converted into (64 KiB), P (8 KiB), the per-token scales (1 KiB): 169 KiB. Both fit
the 227 KiB of an sm_90 block; D = 64 and 128 take a half and a quarter of the tiles.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fdecode.kernels.common import chips
from fdecode.kernels.mosaic_gpu import plan as shared
from fdecode.kernels.mosaic_gpu.plan import BF16_BYTES, BLOCK_ROWS, QUANT_DTYPES

HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class RowsPlan(shared.PlanBase):
  """Static launch of one GQA rows decode call (hashable: passed to the kernel as is).

  Attributes:
    batch, kv_heads, num_tokens, group, head_dim: B, Hkv, T, G, D.
    rows: R = T * G real query rows of one kv head.
    row_blocks: programs along the rows, `BLOCK_ROWS` (64) rows each, the last padded.
    seq_len: S.
    cache_rows: rows of the contiguous cache operands: S rounded up to a multiple of 8
      and to at least ``block`` (a TMA tiled copy needs whole 8-row tiles; another S is
      copied padded, per call). Paged: S (the pool is read in place, never copied).
    block: bk, tokens per pipeline step.
    stages: K / V tiles in flight (TMA ring depth).
    num_splits: programs along each sequence's blocks (partial states merged after).
    softmax_scale: multiplies q . k.
    quantized: the cache is 8-bit with per-token float32 scales (``cache_dtype``).
    cache_dtype: "bfloat16", "int8" or "float8_e4m3fn".
    page_size: 0 for a contiguous cache; else the pool's tokens per page (paged).
    pages: n, block table columns (paged; S = n * page_size).

  ``quantized`` and ``rows_padded`` (R_p) are `fdecode.kernels.mosaic_gpu.plan.PlanBase`'s.
  """
  batch: int
  kv_heads: int
  num_tokens: int
  group: int
  head_dim: int
  rows: int
  row_blocks: int
  seq_len: int
  cache_rows: int
  block: int
  stages: int
  num_splits: int
  softmax_scale: float
  cache_dtype: str = "bfloat16"
  page_size: int = 0
  pages: int = 0
  compute_registers: int = shared.COMPUTE_REGISTERS
  memory_registers: int = shared.MEMORY_REGISTERS

  @property
  def paged(self) -> bool:
    return self.page_size > 0

  @property
  def piece(self) -> int:
    """Tokens of one TMA copy of K or V: a block, or a page where pages are smaller."""
    return min(self.page_size, self.block) if self.paged else self.block

  @property
  def copies(self) -> int:
    """TMA copies that fill one K (or V) slot: the arrivals its barrier waits for."""
    return self.block // self.piece

  @property
  def scales_paged(self) -> bool:
    """8-bit paged pools: the per-token scales are read from the paged scale pool, a
    piece per copy, where one piece's scales are whole 128-byte units (page_size >= 32:
    a Mosaic GPU copy's bytes are shared by the warpgroup's 128 threads); smaller pages
    take their scales gathered per call (`paging.gathered_scales`), 4 bytes a
    token, beside the cache's 2 * D read in place."""
    return self.quantized and self.paged and self.piece * 4 % 128 == 0

  @property
  def scale_copies(self) -> int:
    return self.copies if self.scales_paged else 1

  @property
  def grid(self) -> tuple:
    """(row blocks, splits, B * Hkv): the row blocks of one (sequence, head, split) run
    side by side, so the second reads the tiles the first just pulled into L2."""
    return (self.row_blocks, self.num_splits, self.batch * self.kv_heads)

  @property
  def guarded(self) -> bool:
    """T > 1: a slot may be visible to one row of a program and not to another, so a
    non-finite value row is routed through its key (see the kernel's module docstring)."""
    return self.num_tokens > 1

  def smem_bytes(self) -> int:
    """Shared memory the kernel allocates (tiles, scales, barriers; approximate)."""
    d, bk = self.head_dim, self.block
    item = 1 if self.quantized else BF16_BYTES
    q = BLOCK_ROWS * d * BF16_BYTES
    kv = 2 * self.stages * bk * d * item
    extra = 2 * bk * d * BF16_BYTES + 2 * self.stages * bk * 4 if self.quantized else 0
    p = BLOCK_ROWS * bk * BF16_BYTES
    barriers = 8 * (5 * self.stages + 2)
    return q + kv + extra + p + barriers


def rows_unsupported(*, q_shape, q_dtype, k_shape, k_dtype, v_shape, v_dtype, scales: bool,
                     paged: bool = False, modifiers: bool = False) -> str | None:
  """Why these arguments cannot take the Hopper rows kernel, or None.

  It takes: q bf16 ``[B, Hq, D]`` or ``[B, T, Hq, D]``; head-major k and v of one shape,
  contiguous ``[B, Hkv, S, D]`` or (``paged``) a pool ``[Hkv, P, page_size, D]`` with
  page_size a multiple of 8 that divides the 64-token block or is a multiple of it, with
  Hkv dividing Hq and D in 64 / 128 / 256; both bf16 (no scales), or both int8 or both
  float8_e4m3fn with per-token scales; no score modifiers (mask, bias, alibi, window,
  soft cap, sinks, indices) or offsets.
  """
  if modifiers:
    return "score modifiers (mask, bias, alibi, window, soft cap, sinks, indices, offsets) are not supported"
  if len(q_shape) not in (3, 4):
    return f"needs q of shape [B, Hq, D] or [B, T, Hq, D], got q.shape={tuple(q_shape)}"
  layout = "a paged pool [Hkv, P, page_size, D]" if paged else "[B, Hkv, S, D] (head-major, contiguous)"
  if len(k_shape) != 4 or tuple(v_shape) != tuple(k_shape):
    return f"needs k and v of one shape {layout}, got k.shape={tuple(k_shape)}, v.shape={tuple(v_shape)}"
  b, hkv, _, d = (q_shape[0], *k_shape[0:1], *k_shape[2:]) if paged else k_shape
  if paged and (reason := page_size_unsupported(k_shape[2])):
    return reason
  if q_shape[0] != b or q_shape[-1] != d or q_shape[-2] % hkv:
    return (f"needs q [B, (T,) Hq, D] with B={b}, D={d} and Hq a multiple of Hkv={hkv}, "
            f"got q.shape={tuple(q_shape)}")
  if d not in HEAD_DIMS:
    return f"needs a head dim D in {HEAD_DIMS}, got D={d}"
  if reason := shared.q_unsupported(q_dtype):
    return reason
  if str(k_dtype) != str(v_dtype):
    return f"needs k and v of one dtype, got k {k_dtype}, v {v_dtype}"
  if str(k_dtype) == "bfloat16":
    if scales:
      return "k_scale / v_scale are for 8-bit caches; a bfloat16 cache takes none"
  elif str(k_dtype) in QUANT_DTYPES:
    if not scales:
      return f"a {k_dtype} cache needs k_scale and v_scale (per token, [B, Hkv, S, 1] float32)"
  else:
    return f"needs a bfloat16, int8 or float8_e4m3fn cache, got {k_dtype}"
  return None


def page_size_unsupported(page_size: int, block_k: int = 64) -> str | None:
  """Why a pool of ``page_size`` tokens per page cannot be read by ``block_k``-token
  blocks, or None."""
  if page_size < 8 or page_size % 8:
    return (f"page_size={page_size} is not a multiple of 8: a TMA tiled copy moves whole 8-row tiles "
            f"(use page_size 8, 16, 32 or a multiple of {block_k})")
  if block_k % page_size and page_size % block_k:
    return (f"page_size={page_size} neither divides nor is a multiple of the {block_k}-token block "
            f"(a block would straddle pages): use 8, 16, 32 or a multiple of {block_k}")
  return None


def rows_plan(*, batch: int, kv_heads: int, num_tokens: int, group: int, head_dim: int, seq_len: int,
              softmax_scale: float, cache_dtype="bfloat16", num_splits: int | None = None,
              block_k: int = 64, stages: int = 2, page_size: int | None = None,
              gpu: chips.Gpu | None = None) -> RowsPlan:
  """The launch of one GQA rows decode call (see `RowsPlan`).

  Args:
    batch, kv_heads, num_tokens, group, head_dim, seq_len: B, Hkv, T, G, D, S.
    softmax_scale: static float.
    cache_dtype: the k / v dtype (bfloat16, int8, float8_e4m3fn).
    num_splits: None: `fdecode.kernels.mosaic_gpu.plan.split_count` for ``gpu``; or a
      positive int (at most the blocks of S).
    block_k: tokens per step, a multiple of 64 (wgmma's K for P V and the swizzle).
    stages: tiles in flight, >= 2.
    page_size: None for a contiguous cache; a paged pool's tokens per page (`seq_len`
      then ``n * page_size``, n the table's columns; see `page_size_unsupported`).
    gpu: the target (None: `fdecode.kernels.common.chips.lowering_gpu`).

  Raises:
    ValueError: a block, stage, split count or page size that does not fit or does not tile.
  """
  gpu = gpu or chips.lowering_gpu()
  cache_dtype = str(jnp.dtype(cache_dtype))
  shared.check_pipeline("rows_plan", block_k, stages)
  if head_dim not in HEAD_DIMS:
    raise ValueError(f"rows_plan: head_dim must be one of {HEAD_DIMS}, got head_dim={head_dim}")
  if page_size is not None:
    if reason := page_size_unsupported(page_size, block_k):
      raise ValueError(f"rows_plan: {reason}")
    if seq_len % page_size:
      raise ValueError(f"rows_plan: a paged seq_len is n * page_size, got seq_len={seq_len}, page_size={page_size}")
  rows = num_tokens * group
  row_blocks = shared.row_blocks(rows)
  num_splits = shared.splits("rows_plan", gpu, programs=batch * kv_heads * row_blocks, seq_len=seq_len,
                             block_k=block_k, num_splits=num_splits)
  plan = RowsPlan(batch=batch, kv_heads=kv_heads, num_tokens=num_tokens, group=group, head_dim=head_dim,
                  rows=rows, row_blocks=row_blocks, seq_len=seq_len,
                  cache_rows=seq_len if page_size else shared.contiguous_cache_rows(seq_len, block_k),
                  block=block_k, stages=stages, num_splits=num_splits, softmax_scale=float(softmax_scale),
                  cache_dtype=cache_dtype, page_size=page_size or 0, pages=seq_len // page_size if page_size else 0)
  shared.check_smem("rows_plan", f"D={head_dim} {cache_dtype}", plan, gpu)
  return plan
