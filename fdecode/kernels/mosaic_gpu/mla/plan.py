"""Launch plan of the Hopper MLA decode kernel (`fdecode.kernels.mosaic_gpu.mla.kernel`).

One function, `mla_plan`, decides every static choice of a launch (rows per program,
tokens per block, pipeline stages, splits, grid, warpgroup registers) and returns a frozen
`MlaPlan` that the kernel takes as it is; `unsupported` says, as a sentence, why a call
cannot run this kernel (the plan raises ValueError with that sentence). The split rule
and the checks both Hopper kernels make are `fdecode.kernels.mosaic_gpu.plan`'s.

Legend: B batch, T new tokens per sequence, G query heads (one latent kv head), R = T*G
query rows (row r = t*G + g), S cache capacity, Dk = 576 latent + RoPE columns, Dv = 512.

Shared memory of one program (bk = 64; 227 KiB = 232448 B is what an sm_90 block may take):

* bf16 cache: Q 64 x 576 (72 KiB), two K stages of bk x 576 (144 KiB), one P tile 64 x bk
  (8 KiB), row scales and barriers: about 225 KiB. That is FlashMLA's budget too, and why
  the block is 64 tokens, the pipeline two stages deep and P single-buffered.
* 8-bit cache (int8 / float8_e4m3fn, one float32 scale per token): Q (72 KiB), two 8-bit
  K stages (72 KiB), one bf16 tile bk x 576 the 8-bit stage is converted into, the wgmma
  operand of both Q K^T and P V (72 KiB), P (8 KiB), the per-token scales of both stages
  (512 B), row scales (768 B) and barriers: 230752 B by `MlaPlan.smem_bytes`, 231520 B
  as Mosaic GPU's lowering lays it out (alignment; bf16: 230472 B), 928 B under the
  limit, which the lowering checks. There is
  room for one converted tile only, so a block's conversion cannot overlap the previous
  block's matmuls (both compute warpgroups read the tile until their P V is done): the
  two compute warpgroups convert it together, each the columns it owns (warpgroup 0 the
  value columns 0..255 of its output half; warpgroup 1 the columns 256..575, its own
  value half and the RoPE columns, since warpgroup 0 also runs the softmax), and the
  8-bit stage is released as soon as both converted it, so the TMA refills it during the
  matmuls. The memory warpgroup (40 registers, 48 at most beside two 232-register
  compute warpgroups) cannot hold a 64 x 64 tile's conversion, and would serialize the
  same way.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fdecode.kernels.common import chips
from fdecode.kernels.mosaic_gpu import plan as shared
from fdecode.kernels.mosaic_gpu.plan import BF16_BYTES, BLOCK_ROWS, QUANT_DTYPES

DK = 576          # latent (512) + RoPE (64) columns of a key
DV = 512          # values: the first 512 columns of the same row
HALF_DV = DV // 2  # output columns of one compute warpgroup (each owns a 64-row wgmma M tile)


@dataclasses.dataclass(frozen=True)
class MlaPlan(shared.PlanBase):
  """Static launch of one MLA decode call (hashable: passed to the kernel as is).

  Attributes:
    batch: B.
    num_tokens: T, 1 (one new token per sequence; `unsupported` says why).
    group: G query heads.
    rows: R = T * G real query rows.
    row_blocks: programs along the rows, each `BLOCK_ROWS` rows (the last padded).
    seq_len: S, the cache rows a sequence addresses.
    cache_rows: rows of the cache operand: S rounded up to a multiple of 8 and to at
      least ``block`` (a TMA tiled copy needs the global row count to be a multiple of
      the shared-memory tile's 8 rows; a cache of another S is copied padded, per call).
    block: bk, tokens per pipeline step (one TMA copy of ``bk x 576``).
    stages: K tiles in flight (TMA ring depth).
    num_splits: programs along each sequence's blocks (partial states merged after).
    softmax_scale: multiplies q . k.
    cache_dtype: "bfloat16", or an 8-bit "int8" / "float8_e4m3fn" cache with one float32
      scale per token (``quantized``).
    compute_registers / memory_registers: per-thread registers of the two compute
      warpgroups and of the TMA warpgroup (``setmaxnreg``).

  ``quantized`` and ``rows_padded`` (R_p) are `fdecode.kernels.mosaic_gpu.plan.PlanBase`'s.
  """
  batch: int
  num_tokens: int
  group: int
  rows: int
  row_blocks: int
  seq_len: int
  cache_rows: int
  block: int
  stages: int
  num_splits: int
  softmax_scale: float
  cache_dtype: str = "bfloat16"
  compute_registers: int = shared.COMPUTE_REGISTERS
  memory_registers: int = shared.MEMORY_REGISTERS

  @property
  def grid(self) -> tuple:
    """(row blocks, splits, B): the row blocks of one (sequence, split) run side by side,
    so the second reads the K tiles the first just pulled into L2."""
    return (self.row_blocks, self.num_splits, self.batch)

  @property
  def q_rows(self) -> int:
    """Rows of the q operand: R where one program's tile takes them all in whole 8-row
    tiles of its smem layout (the TMA copies them into its first R rows; the rest of the
    tile is never written, and its rows' states are stored but never merged), else padded
    to ``rows_padded``."""
    return self.rows if self.row_blocks == 1 and self.rows % 8 == 0 else self.rows_padded

  @property
  def num_blocks(self) -> int:
    """Blocks addressable in one sequence: ceil(S / bk) (at least 1)."""
    return max(1, -(-self.seq_len // self.block))

  def smem_bytes(self) -> int:
    """Shared memory the kernel allocates (tiles, scales, barriers; approximate)."""
    q = BLOCK_ROWS * DK * BF16_BYTES
    p = BLOCK_ROWS * self.block * BF16_BYTES
    scales = 3 * BLOCK_ROWS * 4
    barriers = 8 * (2 * self.stages + 5)  # Q, K landed / released, P written / read, m / l, flags
    if not self.quantized:
      return q + self.stages * self.block * DK * BF16_BYTES + p + scales + barriers
    k8 = self.stages * self.block * DK
    converted = self.block * DK * BF16_BYTES
    token_scales = self.stages * self.block * 4
    barriers += 8 * (self.stages + 1)  # scales landed, warpgroup 1's columns converted
    return q + k8 + converted + p + token_scales + scales + barriers


def unsupported(*, q_shape, q_dtype, k_shape, k_dtype, v_is_none: bool, v_head_dim, k_scale_shape=None,
                paged: bool = False, modifiers: bool = False, default_dispatch: bool = False) -> str | None:
  """Why these arguments cannot take the Hopper MLA kernel, or None.

  It takes: q bf16 ``[B, G, 576]`` (or ``[B, 1, G, 576]``), one contiguous latent kv head
  ``k`` ``[B, 1, S, 576]``, ``v=None`` with ``v_head_dim=512``, G a multiple of 16; k
  bf16 without scales, or int8 / float8_e4m3fn with one float32 scale per token
  (``k_scale_shape`` ``[B, 1, S, 1]`` or broadcastable, last axis 1); no paging, score
  modifiers, sinks or index lists. ``default_dispatch``: the question is fdecode's
  default dispatch's, which does not route 8-bit caches here (built and interpreted,
  opt-in through `mla_decode`, not yet measured on a GPU).
  """
  if paged:
    return "paged caches are not supported yet (contiguous [B, 1, S, 576] only)"
  if modifiers:
    return "score modifiers (mask, bias, alibi, window, soft cap, sinks, indices) are not supported"
  if not v_is_none or v_head_dim != DV:
    return f"needs v=None and v_head_dim={DV} (MLA values are the latent's first {DV} columns)"
  if len(k_shape) != 4 or k_shape[1] != 1 or k_shape[3] != DK:
    return f"needs k of shape [B, 1, S, {DK}] (one latent kv head), got k.shape={tuple(k_shape)}"
  if len(q_shape) not in (3, 4) or q_shape[-1] != DK:
    return f"needs q of shape [B, G, {DK}] or [B, T, G, {DK}], got q.shape={tuple(q_shape)}"
  reason = shared.q_unsupported(q_dtype) or _cache_unsupported(k_dtype, k_scale_shape, default_dispatch)
  if reason:
    return reason
  g = q_shape[-2]
  if g % 16 or g <= 0:
    return f"needs G (query heads) a positive multiple of 16, got G={g}"
  t = 1 if len(q_shape) == 3 else q_shape[1]
  if t != 1:
    return (f"one new token per sequence only (T=1), got T={t}: with causal rows a value one row sees "
            "and another does not would need the per-row NaN guard of the other kernels")
  return None


def _cache_unsupported(k_dtype, k_scale_shape, default_dispatch: bool) -> str | None:
  """`unsupported`'s sentence on the cache's dtype and scales, or None."""
  if str(k_dtype) == "bfloat16":
    if k_scale_shape is not None:
      return "k_scale is for 8-bit caches; a bfloat16 cache takes none"
    return None
  if str(k_dtype) not in QUANT_DTYPES:
    return f"needs a bfloat16, int8 or float8_e4m3fn cache k, got k {k_dtype}"
  if k_scale_shape is None:
    return f"a {k_dtype} cache needs k_scale (float32, one scale per token: [B, 1, S, 1])"
  if len(k_scale_shape) and k_scale_shape[-1] != 1:
    return (f"needs one k_scale per token (last axis 1, [B, 1, S, 1]), got k_scale.shape={tuple(k_scale_shape)} "
            "(FlashMLA's 1x128 tiles, [..., 4] with k_rope, take the Triton kernel)")
  if default_dispatch:
    return ("8-bit MLA caches take the Hopper kernel only when asked for: fdecode.kernels.mosaic_gpu.mla_decode "
            "or flash_decode(..., impl='mosaic_gpu') (opt-in: not yet measured on a GPU)")
  return None


def mla_plan(*, batch: int, num_tokens: int, group: int, seq_len: int, softmax_scale: float,
             cache_dtype="bfloat16", num_splits: int | None = None, block_k: int = 64, stages: int = 2,
             gpu: chips.Gpu | None = None) -> MlaPlan:
  """The launch of one MLA decode call (see `MlaPlan`).

  Args:
    batch, num_tokens, group, seq_len: B, T, G, S.
    softmax_scale: static float.
    cache_dtype: k's dtype: bfloat16, or int8 / float8_e4m3fn (per-token scales).
    num_splits: None: `fdecode.kernels.mosaic_gpu.plan.split_count` for ``gpu`` (blocks
      past a sequence's length are never loaded, so splits are dealt from the capacity S
      and idle programs exit).
    block_k: tokens per step, a multiple of 64 (wgmma's K and the swizzle); 64 fits the
      shared memory with two stages.
    stages: K tiles in flight, >= 2.
    gpu: the target (None: `fdecode.kernels.common.chips.lowering_gpu`).

  Raises:
    ValueError: a block or stage count that does not fit or does not tile.
  """
  gpu = gpu or chips.lowering_gpu()
  cache_dtype = str(jnp.dtype(cache_dtype))
  if cache_dtype != "bfloat16" and cache_dtype not in QUANT_DTYPES:
    raise ValueError(f"mla_plan: cache_dtype must be bfloat16 or one of {QUANT_DTYPES}, got {cache_dtype}")
  shared.check_pipeline("mla_plan", block_k, stages)
  if num_tokens != 1:
    raise ValueError(f"mla_plan: num_tokens must be 1 (T=1 decode), got num_tokens={num_tokens}")
  rows = num_tokens * group
  row_blocks = shared.row_blocks(rows)
  num_splits = shared.splits("mla_plan", gpu, programs=batch * row_blocks, seq_len=seq_len, block_k=block_k,
                             num_splits=num_splits)
  plan = MlaPlan(batch=batch, num_tokens=num_tokens, group=group, rows=rows, row_blocks=row_blocks,
                 seq_len=seq_len, cache_rows=shared.contiguous_cache_rows(seq_len, block_k), block=block_k,
                 stages=stages, num_splits=num_splits, softmax_scale=float(softmax_scale), cache_dtype=cache_dtype)
  shared.check_smem("mla_plan", cache_dtype, plan, gpu)
  return plan
