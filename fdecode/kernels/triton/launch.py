"""The Triton kernel's launch on a GPU: the key block and warps whose tiles fit a thread's
registers and whose pipelined loads fit the chip's shared memory (`launch_plan`), and the
programs an SM may hold at them (`Launch.residency`), calibrated on ptxas -v for H100 and
A100 (benchmarks/RESULTS.md, compile report). `fdecode.kernels.triton.plan.make_plan`
asks it; nothing else decides a launch.
"""

from __future__ import annotations

import dataclasses
import math

from fdecode.kernels.common import chips

# tl.dot needs every dimension >= 16: row blocks, key blocks and pieces reach it.
MIN_DOT = 16
# Bytes of tiles and row state one thread may hold: about 150 of its 255 registers (the
# rest hold addresses, masks and the load pipeline). Calibrated on ptxas -v for H100 and
# A100 (benchmarks/RESULTS.md, compile report): past it ptxas spills.
THREAD_BYTES = 540
STAGES = 2                      # Triton software-pipeline stages (one block in flight)
WARPS = (4, 8)
# A float32 computation's key / value tiles count this many times (their dot operands are
# held again in the dots' register layouts). Calibrated on ptxas -v (randomized compile
# leg, 2026-11-27): at 1x, 9 of 95 drawn float32 decodes spilled 72-568 B on H100 (T = 1,
# G = 2, D = 128 pages of 16 among them).
F32_TILE_FACTOR = 2
# Bytes a thread keeps back where the rows may see different slots (T > 1 or a mask: the
# rows' own bounds and the value guard live through the loop) in a balanced work item
# (its schedule's item too) or a float32 computation. Calibrated on ptxas -v (compile
# report, 2026-11-27): bf16 MLA (576 / 512, 16 rows) at bk = 64 on 8 warps models 520
# bytes; balanced at T = 4 ptxas spilled 28 B on H100 and 16 B on A100 at 255 registers
# (ragged steps: 16-48 B), where per sequence (or T = 1) it compiled without; at bk = 32
# (360 bytes) 188-217 registers. Float32, 64 rows of D = 64 at T = 9-64: 512 bytes
# modelled, 8-24 B spilled on H100; none at bk = 32.
DIFFERING_ROWS_RESERVE = 64
# Shared memory the compiler really allocates came to about 0.8 of `Launch.smem`
# (measured): the upper residency estimate counts 0.75 of it.
SMEM_MEASURED = 0.75
# Registers ptxas allocates came to 0.41-0.94 of `Launch.regs` over the compile report's
# grid (H100 and A100): the upper residency estimate counts this fraction.
REGS_MEASURED = 0.4


def pow2_at_least(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def block_size(block_k: int) -> int:
  """The kernel's ``bk`` cap: ``block_k`` rounded up to a power of two, at least 16."""
  return max(MIN_DOT, pow2_at_least(block_k))


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
    shared memory, and at `REGS_MEASURED` of those registers and `SMEM_MEASURED` of
    that memory. Registers are ptxas' choice, so splits are judged at every residency between."""
    threads = 32 * self.warps
    hi = max(1, gpu.resident_programs(threads=threads, regs=int(self.regs * REGS_MEASURED),
                                      smem=int(self.smem * SMEM_MEASURED)))
    lo = max(1, gpu.resident_programs(threads=threads, regs=self.regs, smem=self.smem))
    return min(lo, hi), hi


def launch_plan(gpu: chips.Gpu, *, block_r: int, dq: int, dv: int, cols: int, raw_bytes: int,
                compute_bytes: int, block_k: int, convert_bytes: int = 0, row_state: int = 1,
                reserve: int = 0) -> Launch:
  """Warps and block for ``gpu``: the largest power-of-two ``bk <= block_size(block_k)``
  whose tiles fit `THREAD_BYTES` a thread and whose pipelined loads fit the chip's shared
  memory per block, on 4 warps if that keeps ``bk >= 64`` (or the cap), else on 8.

  ``cols``: cache columns one block loads (k's, v's unless MLA, k_rope's); ``raw_bytes``:
  their bytes in memory; ``compute_bytes``: after the cast / dequantization;
  ``convert_bytes``: what a loaded element holds on the way there (its raw bytes for a
  cast or a dequantization, plus 4 for the int32 of a float8 bit decode; 0 when loads feed
  the dots as they are); ``row_state``: how many times the rows' q and accumulator count
  (`row_state_factor`); ``reserve``: bytes a thread keeps back from `THREAD_BYTES`
  (`DIFFERING_ROWS_RESERVE`).
  """
  cap = block_size(block_k)

  def fits(bk, warps):
    tile_bytes = (compute_bytes + convert_bytes) * (F32_TILE_FACTOR if compute_bytes == 4 else 1)
    tiles = (bk * cols * tile_bytes + row_state * block_r * (dq * compute_bytes + dv * 4)
             + 2 * block_r * bk * 4)
    smem = bk * cols * (raw_bytes * (STAGES - 1) + compute_bytes) + block_r * bk * compute_bytes
    per_thread = tiles / (32 * warps)
    ok = per_thread <= THREAD_BYTES - reserve and smem <= gpu.smem_per_block
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
  # `fdecode.kernels.triton.plan.F32_PIECE` wide (16 warps would cap it at 128 registers and spill).
  return fits(MIN_DOT, WARPS[-1])[1]


def row_state_factor(block_r: int, pieces) -> int:
  """2 where a block of 64+ rows holds pieces of unequal widths with one of 128 or more
  (D = 192: 128 + 64), else 1. Found by the randomized compile leg (2026-11-26): A100, D=192
  bf16, 64 rows, T > 1: the register model allowed bk = 32 and ptxas spilled 32-52 bytes at
  255 registers (bk = 16: 212 registers); counting those rows' state twice gives bk = 16.
  D = 112 / 96 / 80 (pieces of 64 and less) compiled without spills as they were."""
  widths = {p.width for p in pieces}
  return 2 if block_r >= 64 and len(widths) > 1 and max(widths) >= 128 else 1


def load_convert_bytes(raw_bytes, compute_bytes, quantized, fp8_bits, gathered):
  """What a loaded element holds on its way to the dots (`launch_plan`'s ``convert_bytes``).
  A float cache cast up (bf16 -> f32) holds both; a dequantized one its bytes and a float32
  product; a bit decode two more 32-bit words (at 4 bytes ptxas spilled 8 B of the A100
  e4m3 tile-scale kernel); rows gathered one by one (pages smaller than a dot tile, or a
  float32 index list) a 64-bit address per element (f32 page size 1 spilled 308 B at 255
  registers without it; f32 index lists on H100 8 B at bk = 64 on 8 warps, none at bk = 32;
  bf16 and 8-bit index lists compile without spills as they are)."""
  b = (raw_bytes + 4 if quantized or raw_bytes != compute_bytes else 0) + (8 if any(fp8_bits) else 0)
  return b + (8 if gathered else 0)
