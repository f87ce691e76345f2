"""The Triton combine kernel: a split call's partial states -> the finished output.

Grid ``(B, Hkv * R, Dv / width)``: one program merges one query row's ``n_splits``
states over ``width`` of its columns (`fdecode.combine.merge_by`, the same math as
`fdecode.combine.merge_states`), joins the sink, casts, and stores the row at its place
in ``out [B, T * Hq, Dv]`` (and its lse in ``[B, T * Hq]``). The balanced schedule's
states are merged by sequence runs (`_segment_kernel`): grid ``(B, Hkv * ceil(R / rows),
Dv / width)``, a program a tile of ``rows`` query rows, looping over its sequence's run of
work items ``chunk`` at a time (`segment_combine_tiling`):
each chunk merged by `merge_by`, then merged into the running state by `merge_by` again.
That equals one merge of the run (up to rounding) for the states a split kernel gives
(lse finite, -inf or NaN); only `merge_by`'s convention for several +inf parts (each
weight 1) would depend on how they fall into chunks. With a split kernel, a call
launches two kernels and XLA adds nothing around them. It merges the Triton split
kernel's states and the Hopper kernels' (`fdecode.kernels.mosaic_gpu`: MLA and GQA rows),
laid out as `CombinePlan` says.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from fdecode.kernels.triton.pallas_triton import plgpu

from fdecode.combine import F32_ONE, F32_ZERO, add_sink, merge_by
from fdecode.kernels.common import block as blk
from fdecode.kernels.triton.launch import pow2_at_least
from fdecode.kernels.triton.operands import Operand, flatten, take
from fdecode.kernels.triton.schedule import Schedule, load_ends, sequence_items

# float32 elements one combine program loads at once (splits x columns): 32 a thread.
COMBINE_ELEMENTS = 4096
# The balanced schedule's combine: work items a program merges per step of its loop (a
# sequence's run is a few items; `segment_combine_tiling`).
COMBINE_CHUNK = 4


@dataclasses.dataclass(frozen=True)
class CombinePlan:
  """What the combine kernel merges: ``num_splits`` states of R = ``num_tokens * group``
  rows per kv head (``hq`` query heads), ``dv`` columns, ``width`` a program, into
  ``out_dtype``. ``split_major``: states laid out ``[B, Hkv, n_splits, R_p, Dv]`` (the
  Hopper kernels'; ``[B, n_splits, R_p, Dv]`` for one kv head, MLA's), else ``[B, Hkv,
  R_p, n_splits, Dv]`` (the Triton split kernel's); lse likewise without Dv.
  ``schedule``: the balanced schedule's states, ``[n_splits, Hkv, R_p, 1, Dv]``
  (``n_splits`` work items), each sequence merging its own run of items, which its
  program derives from the sequences' ends (`fdecode.kernels.triton.schedule`), in tiles
  of ``rows`` query rows, ``chunk`` items a loop step (`segment_combine_tiling`; ``width``
  columns). ``ordered``: the batch-invariant mode's merge, the splits folded into the
  running state one at a time, left to right (`_fold`): a split no row of it sees (lse
  -inf, before or after the others) changes no bit, so the count of splits (the cache's
  capacity) does not enter a row's result, where one reduction over all of them would
  round by it."""
  num_splits: int
  width: int
  num_tokens: int
  group: int
  hq: int
  dv: int
  out_dtype: str
  interpret: bool = False
  split_major: bool = False
  schedule: Schedule | None = None
  rows: int = 1
  chunk: int = COMBINE_CHUNK
  ordered: bool = False

  @property
  def num_rows(self) -> int:
    return self.num_tokens * self.group


def combine_width(num_splits: int, dv: int) -> int:
  """Columns of one combine program: the largest power of two dividing Dv with
  ``pow2(splits) * width <= COMBINE_ELEMENTS`` (at least 1)."""
  width = dv & -dv  # largest power of two dividing Dv
  while width > 1 and pow2_at_least(num_splits) * width > COMBINE_ELEMENTS:
    width //= 2
  return width


def segment_combine_tiling(batch: int, hkv: int, num_rows: int, dv: int, items: int,
                           sms: int) -> tuple[int, int, int]:
  """``(rows, width, chunk)`` of a balanced-schedule combine program: a tile of ``rows``
  query rows (of the R = ``num_rows`` of a kv head) by ``width`` columns, merging
  ``chunk`` of its sequence's work items a loop step, within ``COMBINE_ELEMENTS``.
  ``chunk``: the average run, ``items / batch`` (at least ``COMBINE_CHUNK``; longer runs
  take more steps); ``rows``: the most the budget leaves, halved (then ``width``, down to
  16) while the grid, ``batch * hkv * ceil(R / rows) * Dv / width`` programs, has fewer
  than 4 a SM."""
  width = dv & -dv  # the largest power of two dividing Dv
  while width > 1 and COMBINE_CHUNK * width > COMBINE_ELEMENTS:
    width //= 2
  chunk = min(max(COMBINE_CHUNK, pow2_at_least(-(-items // max(batch, 1)))), COMBINE_ELEMENTS // width)
  rows = max(1, min(pow2_at_least(num_rows), COMBINE_ELEMENTS // (chunk * width)))
  programs = lambda r, w: batch * hkv * -(-num_rows // r) * (dv // w)
  while rows > 1 and programs(rows, width) < 4 * sms:
    rows //= 2
  while rows == 1 and width > 16 and programs(rows, width) < 4 * sms:
    width //= 2
  return rows, width, min(pow2_at_least(items), COMBINE_ELEMENTS // (rows * width))


class CombineOperands(NamedTuple):
  """A combine launch's operands (`fdecode.kernels.triton.operands`): the states ``lse``
  and ``o``, the balanced schedule's ``ends`` int32 ``[B]`` (None: states by split),
  ``sinks`` f32 ``[Hq]`` or None."""
  lse: Operand
  o: Operand
  ends: Operand | None
  sinks: Operand | None


def _reductions(back):
  """`merge_by`'s reductions over axis 0 of a tile of parts, and ``back`` (merged -> parts)
  (Triton has no boolean reduction: any is a max over 0 / 1)."""
  return (lambda x: jnp.max(x, axis=0), lambda o, w: (jnp.sum(o, axis=0), jnp.sum(w, axis=0)),
          lambda x: jnp.max(jnp.where(x, F32_ONE, F32_ZERO), axis=0) > 0, back)


def _kernel(*refs, plan: CombinePlan, layout):
  # ins.lse f32[n_splits], ins.o f32[n_splits, Dv] (this row's partial states),
  # ins.sinks f32[Hq] or None; out [T * Hq, Dv], out_lse f32[T * Hq]
  ins, (out_ref, out_lse_ref) = take(layout, refs)
  lse_ref, o_ref, sinks_ref = ins.lse, ins.o, ins.sinks
  n, w = plan.num_splits, plan.width
  sp = pow2_at_least(n)
  row = pl.program_id(1) % plan.num_rows
  h = pl.program_id(1) // plan.num_rows
  c = pl.program_id(2) * w
  if plan.ordered:
    out, out_lse = _fold(lse_ref, o_ref, n, c, w)
  else:
    live = lax.iota(jnp.int32, sp) < n
    lse = plgpu.load(lse_ref.at[pl.ds(0, sp)], mask=live, other=-jnp.inf)
    o = plgpu.load(o_ref.at[pl.ds(0, sp), pl.ds(c, w)], mask=live[:, None], other=0.0)
    out, out_lse = merge_by(o, lse, *_reductions(lambda x: x))
  out, out_lse = out.reshape(1, w), out_lse.reshape(1, 1)
  head = h * plan.group + row % plan.group
  if sinks_ref is not None:
    out, out_lse = add_sink(out, out_lse, sinks_ref[pl.ds(head, 1)].reshape(1, 1).astype(jnp.float32))
  dst = (row // plan.group) * plan.hq + head
  out_ref[pl.ds(dst, 1), pl.ds(c, w)] = out.astype(out_ref.dtype)

  @pl.when(pl.program_id(2) == 0)
  def _():
    out_lse_ref[pl.ds(dst, 1)] = out_lse.reshape(1)


def _fold(lse_ref, o_ref, n: int, c, w: int):
  """One row's ``n`` split states (``lse_ref`` f32 ``[n]``, ``o_ref`` f32 ``[n, Dv]``, columns
  ``[c, c + w)``) merged left to right, a pair at a time -> ``(out f32 [w], lse f32 [])``."""
  merge = lambda o, lse: merge_by(o, lse, *_reductions(lambda x: x))
  pair = lax.iota(jnp.int32, 2) == 0

  def step(i, state):
    lse = lse_ref[pl.ds(i, 1)]  # [1]
    o = o_ref[pl.ds(i, 1), pl.ds(c, w)]  # [1, w]
    return merge(jnp.where(pair[:, None], state[0][None], o), jnp.where(pair, state[1], lse))

  empty = (jnp.zeros((w,), jnp.float32), jnp.array(-jnp.inf, jnp.float32))
  return lax.fori_loop(0, n, step, empty)


def merge_run(lse_ref, o_ref, first, last, row, col, valid, chunk: int):
  """In a kernel: the merged state of work items ``[first, last)`` (int32 scalars) of one kv
  head's states (``lse_ref`` f32 ``[n, R_p]``, ``o_ref`` f32 ``[n, R_p, Dv]``) at rows ``row``
  (int32 ``[rb]``, ``valid`` where real) and columns ``col`` (``[w]``), ``chunk`` items a loop
  step -> ``(out f32 [rb, w], lse f32 [rb])`` (0 / -inf for an empty run)."""
  rb, w = row.shape[0], col.shape[0]
  merge = lambda o, lse: merge_by(o, lse, *_reductions(lambda x: x[None]))

  def step(i, state):
    item = first + i * chunk + lax.iota(jnp.int32, chunk)  # [c]
    live = (item < last)[:, None] & valid[None, :]  # [c, rb]
    lse = plgpu.load(lse_ref.at[item[:, None], row[None, :]], mask=live, other=-jnp.inf)
    o = plgpu.load(o_ref.at[item[:, None, None], row[None, :, None], col[None, None, :]], mask=live[:, :, None],
                   other=0.0)
    o, lse = merge(o, lse)  # this chunk's items: [rb, w], [rb]
    pair = lax.broadcasted_iota(jnp.int32, (2, rb), 0) == 0
    return merge(jnp.where(pair[:, :, None], state[0][None], o[None]), jnp.where(pair, state[1][None], lse[None]))

  empty = (jnp.zeros((rb, w), jnp.float32), jnp.full((rb,), -jnp.inf, jnp.float32))
  return lax.fori_loop(0, (last - first + chunk - 1) // chunk, step, empty)


def with_sinks(sinks_ref, head, out, out_lse):
  """``(out [rb, w], lse [rb, 1])`` with each row's sink joined (``head`` int32 ``[rb]``, its
  query head; ``sinks_ref`` f32 ``[Hq]`` or None)."""
  if sinks_ref is None:
    return out, out_lse
  return add_sink(out, out_lse, plgpu.load(sinks_ref.at[head])[:, None].astype(jnp.float32))


def _segment_kernel(*refs, plan: CombinePlan, layout):
  # ins.lse f32[n, R_p], ins.o f32[n, R_p, Dv] (this kv head's states of every work item),
  # ins.ends int32[B], ins.sinks f32[Hq] or None; out [T * Hq, Dv], out_lse f32[T * Hq]
  ins, (out_ref, out_lse_ref) = take(layout, refs)
  lse_ref, o_ref, ends_ref, sinks_ref = ins.lse, ins.o, ins.ends, ins.sinks
  rb, w = plan.rows, plan.width
  tiles = -(-plan.num_rows // rb)
  h = pl.program_id(1) // tiles
  row = (pl.program_id(1) % tiles) * rb + lax.iota(jnp.int32, rb)  # [rb]
  col = pl.program_id(2) * w + lax.iota(jnp.int32, w)  # [w]
  valid = row < plan.num_rows
  first, last = sequence_items(load_ends(ends_ref, plan.schedule), pl.program_id(0), plan.schedule)
  out, out_lse = merge_run(lse_ref, o_ref, first, last, row, col, valid, plan.chunk)
  head = h * plan.group + row % plan.group
  out, out_lse = with_sinks(sinks_ref, head, out, out_lse[:, None])
  dst = jnp.where(valid, (row // plan.group) * plan.hq + head, plan.num_tokens * plan.hq)  # padding: one past the end
  plgpu.store(out_ref.at[dst[:, None], col[None, :]], out.astype(out_ref.dtype), mask=valid[:, None])

  @pl.when(pl.program_id(2) == 0)
  def _():
    plgpu.store(out_lse_ref.at[dst], out_lse[:, 0], mask=valid)


def _launch(plan: CombinePlan, kernel, grid, b: int, lse: Operand, o: Operand, ends: Operand | None, sinks):
  """One combine launch over ``grid`` of the states ``lse`` / ``o`` (and ``ends``, balanced;
  ``sinks`` f32 ``[Hq]`` or None): the finished ``(out [B, T * Hq, Dv], lse [B, T * Hq])``,
  batch ``b`` on grid axis 0."""
  sinks = None if sinks is None else Operand(sinks.astype(jnp.float32),
                                             pl.BlockSpec((plan.hq,), lambda i, hr, c: (0,)))
  operands, in_specs, layout = flatten(CombineOperands(lse, o, ends, sinks))
  tq, dv = plan.num_tokens * plan.hq, plan.dv
  return pl.pallas_call(
      lambda *refs: kernel(*refs, plan=plan, layout=layout),
      grid=grid,
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, tq, dv), lambda i, hr, c: (i, 0, 0)),
                 pl.BlockSpec((None, tq), lambda i, hr, c: (i, 0))],
      out_shape=[blk.out_struct((b, tq, dv), jnp.dtype(plan.out_dtype), *operands),
                 blk.out_struct((b, tq), jnp.float32, *operands)],
      compiler_params=None if plan.interpret else plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=plan.interpret,
      name="fdecode_combine_triton",
  )(*operands)


def _combine_segments(plan: CombinePlan, o, lse, sinks, ends):
  """The balanced schedule's states ``o [n, Hkv, R_p, 1, Dv]`` / ``lse [n, Hkv, R_p, 1]``
  -> ``(out [B, T * Hq, Dv], lse [B, T * Hq])``, each sequence its run of items."""
  b, hkv, n, dv = plan.schedule.batch, o.shape[1], plan.num_splits, plan.dv
  o, lse = o[:, :, :, 0], lse[:, :, :, 0]
  tiles = -(-plan.num_rows // plan.rows)
  r_p = o.shape[2]
  return _launch(plan, _segment_kernel, (b, hkv * tiles, dv // plan.width), b,
                 Operand(lse, pl.BlockSpec((n, None, r_p), lambda i, hr, c: (0, hr // tiles, 0))),
                 Operand(o, pl.BlockSpec((n, None, r_p, dv), lambda i, hr, c: (0, hr // tiles, 0, 0))),
                 Operand(ends.astype(jnp.int32), pl.BlockSpec((b,), lambda i, hr, c: (0,))), sinks)


def combine(plan: CombinePlan, o, lse, sinks=None, *, ends=None):
  """Partial states ``o`` / ``lse`` (float32, laid out as ``plan`` says) -> ``(out
  [B, T * Hq, Dv] in plan.out_dtype, lse f32 [B, T * Hq])``; ``sinks``: f32 ``[Hq]`` or None.
  ``ends`` (with ``plan.schedule``): int32 ``[B]``, the sequences' ends the schedule was
  dealt from."""
  if plan.schedule is not None:
    return _combine_segments(plan, o, lse, sinks, ends)
  b = o.shape[0]
  if plan.split_major and o.ndim == 4:  # [B, n, R_p, Dv]: one kv head (a free reshape)
    o, lse = o[:, None], lse[:, None]
  hkv = o.shape[1]
  dv, w, rows, n = plan.dv, plan.width, plan.num_rows, plan.num_splits
  if plan.split_major:  # [B, Hkv, n, R_p(, Dv)]
    lse_spec = pl.BlockSpec((None, None, n, None), lambda i, hr, c: (i, hr // rows, 0, hr % rows))
    o_spec = pl.BlockSpec((None, None, n, None, dv), lambda i, hr, c: (i, hr // rows, 0, hr % rows, 0))
  else:  # [B, Hkv, R_p, n(, Dv)]
    lse_spec = pl.BlockSpec((None, None, None, n), lambda i, hr, c: (i, hr // rows, hr % rows, 0))
    o_spec = pl.BlockSpec((None, None, None, n, dv), lambda i, hr, c: (i, hr // rows, hr % rows, 0, 0))
  return _launch(plan, _kernel, (b, hkv * rows, dv // w), b, Operand(lse, lse_spec), Operand(o, o_spec), None, sinks)


def combine_split_major(o, lse, *, num_tokens: int, group: int, hq: int, out_dtype, interpret: bool):
  """Another kernel's split-major partial states (the Hopper kernels': ``o [B, Hkv, n, R_p,
  Dv]``, or ``[B, n, R_p, Dv]`` for one kv head, float32; lse likewise without Dv) -> the
  finished ``(out [B, T * Hq, Dv] in out_dtype, lse f32 [B, T * Hq])``, in q's head order,
  by one combine launch."""
  n, dv = o.shape[-3], o.shape[-1]
  plan = CombinePlan(num_splits=n, width=combine_width(n, dv), num_tokens=num_tokens, group=group, hq=hq, dv=dv,
                     out_dtype=jnp.dtype(out_dtype).name, interpret=bool(interpret), split_major=True)
  return combine(plan, o, lse)
