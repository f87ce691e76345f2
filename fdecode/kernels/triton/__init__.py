"""The GPU backend (Pallas Triton): plan, then run; `BACKEND` is it as a
`fdecode.kernels.backend.Backend` (`backend`).

`make_plan` (`plan`) decides a call; `run` (`split`) launches its split kernel (`kernel`)
and, with several splits, the combine kernel (`combine`). A ragged step runs both parts in
one split launch (`triton_step`, `ragged_step`: `split_states_merged`), merges them with `combine_step` (`step`) and
writes its cache with `write_rows` (`write`). The launch model is `launch`, calibrated by
`tuned`; `operands` declares each kernel's operands once, by name.
"""

from fdecode.kernels.triton.combine import CombinePlan, combine, combine_split_major, combine_width
from fdecode.kernels.triton.geometry import StepPart
from fdecode.kernels.triton.launch import Launch, block_size, launch_plan
from fdecode.kernels.triton.ragged_step import triton_step
from fdecode.kernels.triton.plan import (PROGRAMS_PER_SM, TritonPlan, gpu_busy, make_plan, merges_parts,
                                         split_count)
from fdecode.kernels.triton.schedule import Schedule, balanced_schedule, item_work, load_ends, sequence_items
from fdecode.kernels.triton.split import run, split_states, split_states_merged
from fdecode.kernels.triton.step import combine_step
from fdecode.kernels.triton.tiles import row_tiling, triton_unsupported
from fdecode.kernels.triton.tuned import (CALIBRATION_CASES, LAUNCH, CalibrationSample, check_calibration,
                                          measure_calibration)
from fdecode.kernels.triton.write import WritePlan, write_plan, write_rows, write_view
from fdecode.kernels.triton.backend import BACKEND, supports, unsupported
from fdecode.kernels.triton.view import plan_view
from fdecode.kernels.triton.pallas_triton import MISSING as PALLAS_TRITON_MISSING
from fdecode.kernels.triton.pallas_triton import available as pallas_triton_available

__all__ = ["BACKEND", "CALIBRATION_CASES", "CalibrationSample", "CombinePlan", "LAUNCH", "Launch", "PALLAS_TRITON_MISSING",
           "PROGRAMS_PER_SM", "Schedule", "StepPart", "TritonPlan", "WritePlan", "balanced_schedule", "block_size", "check_calibration",
           "combine", "combine_split_major", "combine_step", "combine_width", "gpu_busy",
           "item_work", "launch_plan", "load_ends", "make_plan", "measure_calibration", "merges_parts",
           "pallas_triton_available", "plan_view", "supports", "unsupported", "row_tiling",
           "run", "sequence_items", "split_count", "split_states", "split_states_merged", "triton_step", "triton_unsupported", "write_plan",
           "write_rows", "write_view"]
