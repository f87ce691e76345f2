"""The Triton kernel's launch on a GPU: the key block and warps whose tiles fit a thread's
registers and whose pipelined loads fit the chip's shared memory (`launch_plan`), and the
programs an SM may hold at them (`Launch.residency`), counted with the calibration of
`fdecode.kernels.triton.tuned`. `fdecode.kernels.triton.plan.make_plan` asks it; nothing
else decides a launch.
"""

from __future__ import annotations

import dataclasses
import math

from fdecode.kernels.common import chips
from fdecode.kernels.triton.tuned import LAUNCH

# tl.dot needs every dimension >= 16: row blocks, key blocks and pieces reach it.
MIN_DOT = 16
STAGES = 2                      # Triton software-pipeline stages (one block in flight)
WARPS = (4, 8)


def pow2_at_least(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def block_size(block_k: int) -> int:
  """The kernel's ``bk`` cap: ``block_k`` rounded up to a power of two, at least 16."""
  return max(MIN_DOT, pow2_at_least(block_k))


@dataclasses.dataclass(frozen=True)
class Launch:
  """How one program runs on the target GPU, and what the model expects it to take."""
  block: int                  # bk
  warps: int
  stages: int
  smem: int                   # upper estimate of its shared memory (bytes)
  regs: int                   # estimate of its registers per thread

  def residency(self, gpu: chips.Gpu) -> tuple[int, int]:
    """Programs an SM may hold at once, (lower, upper): at the estimated registers and
    shared memory, and at the calibrated fractions of them (`LAUNCH`'s ``regs_measured``
    and ``smem_measured``). Registers are ptxas' choice, so splits are judged at every
    residency between."""
    threads = 32 * self.warps
    hi = max(1, gpu.resident_programs(threads=threads, regs=int(self.regs * LAUNCH.regs_measured),
                                      smem=int(self.smem * LAUNCH.smem_measured)))
    lo = max(1, gpu.resident_programs(threads=threads, regs=self.regs, smem=self.smem))
    return min(lo, hi), hi


def launch_plan(gpu: chips.Gpu, *, block_r: int, dq: int, dv: int, cols: int, raw_bytes: int,
                compute_bytes: int, block_k: int, convert_bytes: int = 0, row_state: int = 1,
                reserve: int = 0) -> Launch:
  """Warps and block for ``gpu``: the largest power-of-two ``bk <= block_size(block_k)``
  whose tiles fit `LAUNCH`'s ``thread_bytes`` a thread and whose pipelined loads fit the
  chip's shared memory per block, on 4 warps if that keeps ``bk >= 64`` (or the cap), else on 8.

  ``cols``: cache columns one block loads (k's, v's unless MLA, k_rope's); ``raw_bytes``:
  their bytes in memory; ``compute_bytes``: after the cast / dequantization;
  ``convert_bytes``: what a loaded element holds on the way there (`load_convert_bytes`;
  0 when loads feed the dots as they are); ``row_state``: how many times the rows' q and
  accumulator count (`row_state_factor`); ``reserve``: bytes a thread keeps back from
  ``thread_bytes`` (`LAUNCH`'s ``differing_rows_reserve``).
  """
  cap = block_size(block_k)

  def fits(bk, warps):
    tile_bytes = (compute_bytes + convert_bytes) * (LAUNCH.f32_tile_factor if compute_bytes == 4 else 1)
    tiles = (bk * cols * tile_bytes + row_state * block_r * (dq * compute_bytes + dv * 4)
             + 2 * block_r * bk * 4)
    smem = bk * cols * (raw_bytes * (STAGES - 1) + compute_bytes) + block_r * bk * compute_bytes
    per_thread = tiles / (32 * warps)
    ok = per_thread <= LAUNCH.thread_bytes - reserve and smem <= gpu.smem_per_block
    return ok, Launch(bk, warps, STAGES, smem, math.ceil(per_thread / 4) + 64)

  best = None
  for warps in WARPS:
    bk = cap
    while bk >= MIN_DOT:
      ok, launch = fits(bk, warps)
      if ok:
        if warps == WARPS[-1] or bk >= min(cap, 64):
          return launch
        best = best or launch
        break
      bk //= 2
  if best is not None:
    return best
  # Nothing fits (float32 MLA: q and acc alone take ~70 registers a thread): the smallest
  # tiles on 8 warps, which ptxas takes without spills once float32 pieces are at most
  # `fdecode.kernels.triton.tiles.F32_PIECE` wide (16 warps would cap it at 128 registers and spill).
  return fits(MIN_DOT, WARPS[-1])[1]


def row_state_factor(block_r: int, pieces) -> int:
  """2 where a block of `LAUNCH`'s ``row_state_rows`` or more rows holds pieces of unequal
  widths with one of ``row_state_width`` or more (D = 192: 128 + 64), else 1: such rows'
  q and accumulator count twice."""
  widths = {p.width for p in pieces}
  return 2 if block_r >= LAUNCH.row_state_rows and len(widths) > 1 and max(widths) >= LAUNCH.row_state_width else 1


def load_convert_bytes(raw_bytes, compute_bytes, quantized, fp8_bits, gathered):
  """What a loaded element holds on its way to the dots (`launch_plan`'s ``convert_bytes``):
  a float cache cast up (bf16 -> f32) holds both; a dequantized one its bytes and a float32
  product; a float8 bit decode `LAUNCH`'s ``fp8_decode_bytes`` more; rows gathered one by one
  (pages smaller than a dot tile, or a float32 index list) ``gathered_bytes`` more."""
  b = (raw_bytes + 4 if quantized or raw_bytes != compute_bytes else 0) + (LAUNCH.fp8_decode_bytes if any(fp8_bits)
                                                                            else 0)
  return b + (LAUNCH.gathered_bytes if gathered else 0)
