"""Where a call's query rows, block-table rows and cache rows are read from when they are
gathers of larger arrays (`RowSource`): the Triton kernels read them in place, as the
plan's `SourcePlan` says.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from fdecode.kernels.triton.geometry import StepPart


class RowSource(NamedTuple):
  """Where a call's query rows and block-table rows are read from, for a caller whose
  q / block_tables are gathers of larger arrays (`fdecode.ragged`: a serving step's
  blocks of packed rows, each over its sequence's table row). The Triton kernels read
  them in place through the indices (no gather launch); every other path reads the
  gathered arrays the call was given, so the gathers run only there (XLA drops them
  where no lowered path reads them).

  ``q``: ``[N, Hq, Dq]`` packed rows; ``q_start``: int32 ``[B]``, the call's q row
  ``(b, t)`` is ``q[clip(q_start[b] + t, 0, N - 1)]``; ``tables``: int32 ``[M, n]`` and
  ``table_rows``: int32 ``[B]``, the call's table row b is ``tables[table_rows[b]]`` (both
  None: the call's own block tables, or none; table rows are clipped into ``[0, M)``).
  ``caches`` and ``cache_rows`` (a contiguous cache's call, of which k, v, k_rope and
  per-sequence scales are gathers): the whole contiguous caches, a
  `fdecode.cache.layout.CacheView` of ``M`` sequence rows (canonical scales, as the call's
  own view), and int32 ``[B]``: the call's sequence b is cache row ``cache_rows[b]``
  (clipped into ``[0, M)``); ``caches`` without ``cache_rows``: sequence b is cache row b
  (B = M: the call's caches are the whole ones, read as a source's for the balanced
  schedule). ``step``: ``(cu, kv_lens, num_seqs)`` of a ragged step (int32 ``[M + 1]``
  clipped non-decreasing, ``[M]``, ``[1]``), whose part (`make_plan`'s ``step``) the call
  is: each work unit's sequence, first q row, table / cache row and kv length are derived
  in the kernels from them (`fdecode.kernels.triton.geometry`), and ``q_start``,
  ``table_rows``, ``cache_rows`` and the call's ends are not read. ``mask`` / ``bias``
  (with ``step``): the step's per-row arrays as `fdecode.ragged_decode` takes them,
  ``[N|1, S]`` or ``[N|1, Hq, S]``, read by each program at its rows' packed rows (the
  call's own mask / bias are gathers, read only for their form)."""
  q: object
  q_start: object
  tables: object = None
  table_rows: object = None
  caches: object = None
  cache_rows: object = None
  step: object = None
  mask: object = None
  bias: object = None


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
