"""The launch model's calibration, as data: the values `fdecode.kernels.triton.launch` counts
a program's registers and shared memory with, each one a boundary ptxas -v showed on the
compile tier's kernels for H100 (sm_90a) and A100 (sm_80).

The compile tier (tests/compile_tier) checks the table on every run:

* the spill boundaries (``thread_bytes`` ... ``row_state_width``): every fdecode kernel of
  every case, fixed and drawn, compiles without a spill (``test_compiles``);
* the residency fractions (``smem_measured``, ``regs_measured``): on `CALIBRATION_CASES`
  every compiled split kernel allocates at least those fractions of its plan's estimate
  (`check_calibration`, ``test_launch_model_calibration``); `measure_calibration`
  regenerates them from the same reports.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The launch model's measured constants (`LAUNCH`)."""
  thread_bytes: int            # tiles and row state one thread may hold
  f32_tile_factor: int         # times a float32 computation's key / value tiles count
  differing_rows_reserve: int  # bytes a thread keeps back where the rows see different slots
  fp8_decode_bytes: int        # what a float8 bit decode adds to a loaded element
  gathered_bytes: int          # what a row gathered on its own adds to a loaded element
  row_state_rows: int          # row blocks from this size ...
  row_state_width: int         # ... holding unequal pieces, one this wide, count their state twice
  smem_measured: float         # least fraction of the shared memory estimate the compiler allocates
  regs_measured: float         # least fraction of the register estimate ptxas allocates


LAUNCH = Calibration(
    # About 150 of a thread's 255 registers; the rest hold addresses, masks and the load
    # pipeline. Past it ptxas spills.
    thread_bytes=540,
    # A float32 computation's dot operands are held again in the dots' register layouts.
    f32_tile_factor=2,
    # Where rows may see different slots (T > 1 or a mask), their own bounds and the value
    # guard live through the loop: kept back in a balanced work item or a float32 computation.
    differing_rows_reserve=64,
    # Two more 32-bit words per element below sm_89 (integer decode of the float8 bits).
    fp8_decode_bytes=8,
    # A 64-bit address per element where rows are gathered one by one (pages smaller than a
    # dot tile, a float32 index list).
    gathered_bytes=8,
    # Blocks of 64+ rows whose pieces are unequal with one of 128 or more (D = 192: 128 + 64)
    # count their rows' q and accumulator twice.
    row_state_rows=64,
    row_state_width=128,
    # The upper residency estimate (`fdecode.kernels.triton.launch.Launch.residency`) counts
    # these fractions of the estimated shared memory and registers.
    smem_measured=0.75,
    regs_measured=0.4,
)


# The compile-tier cases the residency fractions are fitted on: the benchmark grid's variants
# (D = 128; bf16 contiguous, paged and balanced, int8 / float8 per-token scales), whose split
# counts they decide. Outside it the estimates are looser: head dims cut into pieces narrower
# than `fdecode.kernels.triton.tiles.PIECE_COLS` (D = 80-112) are counted at that width, and
# float32 rows gathered one by one at a 64-bit address each, so there the compiled kernel may
# take a smaller fraction of its estimate than the table counts.
CALIBRATION_CASES = ("bench-b1-s32k", "bench-b8-s32k", "bench-b64-s4k", "bench-b1-hkv1-s1m", "nhd-bf16-d128",
                     "paged16-bf16-d128", "balance-b37-paged16", "paged16-int8-token", "float8_e4m3fn-token")


class CalibrationSample(NamedTuple):
  """One compiled split kernel against its plan's estimate (`fdecode.kernels.triton.launch.Launch`)."""
  case: str
  smem_estimate: int
  regs_estimate: int
  smem: int
  regs: int


def measure_calibration(samples) -> dict[str, float]:
  """The residency fractions ``samples`` support: the least compiled / estimated shared
  memory and registers, rounded down to a multiple of 0.05 (what `LAUNCH` may count)."""
  floor = lambda x: math.floor(x * 20 + 1e-9) / 20
  samples = list(samples)
  return dict(smem_measured=floor(min(s.smem / s.smem_estimate for s in samples)),
              regs_measured=floor(min(s.regs / s.regs_estimate for s in samples)))


def check_calibration(samples, calibration: Calibration = LAUNCH) -> list[str]:
  """The samples the calibration's fractions miss (one line each; empty: it holds): a
  kernel that allocates less than ``smem_measured`` of its shared memory estimate or
  ``regs_measured`` of its register estimate could be more resident than the upper estimate."""
  problems = []
  for s in samples:
    if s.smem < calibration.smem_measured * s.smem_estimate:
      problems.append(f"{s.case}: {s.smem} B shared memory < {calibration.smem_measured} x {s.smem_estimate}")
    if s.regs < calibration.regs_measured * s.regs_estimate:
      problems.append(f"{s.case}: {s.regs} registers < {calibration.regs_measured} x {s.regs_estimate}")
  return problems
