"""What a call's `fdecode.kernels.backend.RowSource` gives the Triton kernels (`SourcePlan`):
its query rows, block-table rows and cache rows, gathers of larger arrays, read in place.
"""

from __future__ import annotations

import dataclasses

from fdecode.kernels.backend import RowSource
from fdecode.kernels.triton.geometry import StepPart


@dataclasses.dataclass(frozen=True)
class SourcePlan:
  """What a `RowSource` gives: ``q_source``, q rows read through its indices;
  ``table_source``, table rows too; ``cache_row_list``, a contiguous cache's rows through
  its list (else sequence b's is row b); ``step``: the ragged step's part the call is
  (`fdecode.kernels.triton.geometry.StepPart`: the source's ``step`` arrays give every
  unit's geometry); ``step_mods``: its per-row mask and bias forms, each None or
  ``(Nm, Hm)`` (rows: 1 or N; heads: 1 or Hq)."""
  q_source: bool
  table_source: bool
  cache_row_list: bool
  step: StepPart | None
  step_mods: tuple


def source_plan(source: RowSource | None, step: StepPart | None) -> SourcePlan:
  """What ``source`` gives the kernels; a step's per-row mask / bias forms ``(Nm, Hm)``."""
  step_mods = (None, None) if step is None else tuple(
      None if x is None else (x.shape[0], x.shape[1] if x.ndim == 3 else 1) for x in (source.mask, source.bias))
  return SourcePlan(q_source=source is not None, table_source=source is not None and source.table_rows is not None,
                    cache_row_list=step is None and source is not None and source.cache_rows is not None,
                    step=step, step_mods=step_mods)
