"""A ragged serving step's combine on the Triton kernels (`fdecode.ragged_decode`): the
states of its two parts, each sequence's last row (T = 1) and the prefill blocks (T = tb
rows), both from one split launch (`fdecode.kernels.triton.split_states_merged`), merged
by *one* launch straight into the step's packed rows ``out [N, Hq, Dv]`` / ``lse [N,
Hq]``, padding rows included (out 0, lse -inf). Nothing runs after it: no per-part
combine, no XLA gather of the rows from two outputs. Each program derives its unit's rows
and its part's schedule from the step's arrays (`fdecode.kernels.triton.geometry`).

Grid ``(M + NB + P, width, 1)``, three kinds of program on axis 0:

* ``u < M``: sequence u's last row, its run of the decode part's work items merged
  (`fdecode.kernels.triton.combine.merge_run`) and stored at that row (nothing where the
  sequence has no row);
* ``M <= M + j < M + NB``: prefill block j's rows, each stored where it is its sequence's
  (a block's first rows may be the previous sequence's; a block past the real ones
  stores nothing);
* the last P: the padding rows (no live sequence's: outside ``[cu[0], cu[num_seqs])``) of a
  chunk of ``PAD_ENTRIES // G`` rows.

Every packed row is stored by exactly one program: a live sequence's last row by its
decode program, its other rows by the one block that holds them, the rest by a padding
program. Axis 1 is a kv head, a row tile and a column chunk, each part's own
(`CombinePlan.rows` / ``width``, `fdecode.kernels.triton.combine.segment_combine_tiling`); a
program past its part's share of the axis stores nothing.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from fdecode.kernels.triton.pallas_triton import plgpu

from fdecode.kernels.common import block as blk
from fdecode.kernels.triton.combine import CombinePlan, merge_run, with_sinks
from fdecode.kernels.triton.geometry import StepPart, load_seqs, owned_rows, unit_ends, unit_rows
from fdecode.kernels.triton.launch import pow2_at_least
from fdecode.kernels.triton.operands import Operand, flatten, take, whole
from fdecode.kernels.triton.plan import TritonPlan
from fdecode.kernels.triton.schedule import sequence_items

# Query rows (times G heads) a padding program stores: 64 (row, head) entries.
PAD_ENTRIES = 64
# float32 states a program merges a loop step: a quarter of the two-launch combine's
# (`fdecode.kernels.triton.combine.COMBINE_ELEMENTS`): the step's combine holds two parts'
# merges and the padding stores in one kernel, on 4 warps (`STEP_WARPS`), within the
# registers ptxas gives it without a spill.
STEP_ELEMENTS = 1024
STEP_WARPS = 4


class StepOperands(NamedTuple):
  """The step combine's operands (`fdecode.kernels.triton.operands`): each part's states
  ``(lse f32 [n, Hkv, R_p], o f32 [n, Hkv, R_p, Dv])``, the step's ``(cu, kv_lens,
  num_seqs)`` and ``sinks`` f32 ``[Hq]`` or None."""
  decode: tuple
  prefill: tuple
  step: tuple
  sinks: Operand | None


@dataclasses.dataclass(frozen=True)
class _Geometry:
  decode: CombinePlan
  prefill: CombinePlan
  parts: tuple  # (decode, prefill) `StepPart` s
  num_rows: int
  hq: int
  group: int


def _layout(plan: CombinePlan) -> tuple[int, int]:
  """A part's (row tiles, column chunks) of one kv head: grid axis 1 is kv head major,
  then tile, then chunk (`_ids`)."""
  return -(-plan.num_rows // plan.rows), plan.dv // plan.width


def _ids(plan: CombinePlan, k):
  """Grid axis 1's index ``k`` -> this part's ``(kv head, row tile, column chunk)``."""
  tiles, chunks = _layout(plan)
  return k // (tiles * chunks), (k // chunks) % tiles, k % chunks


def _part(g: _Geometry, plan: CombinePlan, part: StepPart, k, states, step, unit, out_refs, sinks_ref):
  """One part's program: ``unit``'s run of work items merged for the rows and columns of
  axis-1 index ``k`` (read outside any branch: the interpreter needs it), row t stored at
  packed row ``first + t`` where that is at or past ``lo`` and before N
  (`fdecode.kernels.triton.geometry.unit_rows`)."""
  lse_ref, o_ref = states
  out_ref, out_lse_ref = out_refs
  rb, w = plan.rows, plan.width
  h, tile, chunk = _ids(plan, k)

  @pl.when(h < g.hq // g.group)
  def _():
    row = tile * rb + lax.iota(jnp.int32, rb)
    col = chunk * w + lax.iota(jnp.int32, w)
    _, first_row, lo = unit_rows(*step, part, unit)
    packed = first_row + row // g.group
    valid = (row < plan.num_rows) & (packed >= lo) & (packed < g.num_rows)
    first, last = sequence_items(unit_ends(*step, part), unit, plan.schedule)
    out, lse = merge_run(lse_ref, o_ref, first, last, row, col, valid, plan.chunk)
    head = h * g.group + row % g.group
    out, lse = with_sinks(sinks_ref, head, out, lse[:, None])
    dst = jnp.where(valid, packed * g.hq + head, g.num_rows * g.hq)  # not stored: one past the end
    plgpu.store(out_ref.at[dst[:, None], col[None, :]], out.astype(out_ref.dtype), mask=valid[:, None])

    @pl.when(chunk == 0)
    def _():
      plgpu.store(out_lse_ref.at[dst], lse[:, 0], mask=valid)


def _padding(g: _Geometry, p, k, step, out_refs):
  """Padding program ``p``: out 0, lse -inf at the rows of its chunk that no live sequence
  owns, for kv head and column chunk ``k`` (`_ids` of the prefill part's widths)."""
  plan = g.prefill
  _, chunks = _layout(plan)
  h, chunk, w = k // chunks, k % chunks, plan.width
  cu_ref, _, ns_ref = step
  lo, hi = owned_rows(cu_ref, ns_ref, g.parts[0], load_seqs(*step, g.parts[0]))
  per = max(PAD_ENTRIES // g.group, 1)
  e = lax.iota(jnp.int32, pow2_at_least(per * g.group))  # Triton tensors: a power of two (G = 5: 60 of 64)
  row = p * per + e // g.group
  valid = (e < per * g.group) & (h < g.hq // g.group) & (row < g.num_rows) & ((row < lo) | (row >= hi))
  dst = jnp.where(valid, row * g.hq + h * g.group + e % g.group, g.num_rows * g.hq)
  col = chunk * w + lax.iota(jnp.int32, w)
  out_ref, out_lse_ref = out_refs
  plgpu.store(out_ref.at[dst[:, None], col[None, :]], jnp.zeros((e.shape[0], w), out_ref.dtype), mask=valid[:, None])
  plgpu.store(out_lse_ref.at[dst], jnp.full(e.shape, -jnp.inf, jnp.float32), mask=valid & (chunk == 0))


def _step_kernel(*refs, g: _Geometry, layout):
  # ins.decode: lse f32[n_d, R_d], o f32[n_d, R_d, Dv]; ins.prefill: the same [n_p, R_p(, Dv)]; ins.step:
  # cu int32[M + 1], kv_lens int32[M], num_seqs int32[1]; ins.sinks f32[Hq] or None; out [N * Hq, Dv],
  # out_lse f32[N * Hq]
  ins, out_refs = take(layout, refs)
  decode, prefill, step, sinks_ref = ins
  m, nb = g.decode.schedule.batch, g.prefill.schedule.batch
  i, k = pl.program_id(0), pl.program_id(1)

  @pl.when(i < m)
  def _():
    _part(g, g.decode, g.parts[0], k, decode, step, i, out_refs, sinks_ref)

  @pl.when((i >= m) & (i < m + nb))
  def _():
    _part(g, g.prefill, g.parts[1], k, prefill, step, i - m, out_refs, sinks_ref)

  @pl.when(i >= m + nb)
  def _():
    _padding(g, i - m - nb, k, step, out_refs)


def combine_step(decode: TritonPlan, prefill: TritonPlan, decode_states, prefill_states, step, sinks=None):
  """One launch: the step's packed ``(out [N, Hq, Dv] in the plans' out dtype, lse f32 [N,
  Hq])`` from each part's states, ``(o f32 [n, Hkv, R_p, 1, Dv], lse f32 [n, Hkv, R_p,
  1])`` as `fdecode.kernels.triton.split.split_states_merged` gave them for the parts' plans
  ``decode`` / ``prefill`` (balanced, their `StepPart` s in ``plan.source.step``); ``step``:
  ``(cu, kv_lens, num_seqs)``, the step's arrays the units derive from; ``sinks`` f32
  ``[Hq]`` or None."""
  parts = (decode.source.step, prefill.source.step)
  # Each part's tiling, its loop step at most STEP_ELEMENTS (items x rows x columns).
  fit = lambda p: dataclasses.replace(p, chunk=max(1, min(p.chunk, STEP_ELEMENTS // (p.rows * p.width))))
  decode, prefill = fit(decode.combine_plan), fit(prefill.combine_plan)
  hq, group, dv, num_rows = decode.hq, decode.group, decode.dv, parts[0].rows
  hkv = hq // group
  g = _Geometry(decode=decode, prefill=prefill, parts=parts, num_rows=num_rows, hq=hq, group=group)
  states = []
  for plan, (o, lse) in ((decode, decode_states), (prefill, prefill_states)):
    o, lse = o[:, :, :, 0], lse[:, :, :, 0]
    n, _, r_p = lse.shape
    head = lambda k, plan=plan: jnp.minimum(_ids(plan, k)[0], hkv - 1)
    states.append((Operand(lse, pl.BlockSpec((n, None, r_p), lambda i, k, c, head=head: (0, head(k), 0))),
                   Operand(o, pl.BlockSpec((n, None, r_p, dv), lambda i, k, c, head=head: (0, head(k), 0, 0)))))
  step_arrays = tuple(whole(x.astype(jnp.int32).reshape(-1)) for x in step)
  operands, in_specs, layout = flatten(StepOperands(*states, step_arrays,
                                                    None if sinks is None else whole(sinks.astype(jnp.float32))))
  pads = -(-num_rows // max(PAD_ENTRIES // group, 1))
  width = max(hkv * tiles * chunks for tiles, chunks in map(_layout, (decode, prefill)))
  grid = (decode.schedule.batch + prefill.schedule.batch + pads, width, 1)
  out, lse = pl.pallas_call(
      lambda *refs: _step_kernel(*refs, g=g, layout=layout),
      grid=grid,
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((num_rows * hq, dv), lambda i, k, c: (0, 0)),
                 pl.BlockSpec((num_rows * hq,), lambda i, k, c: (0,))],
      out_shape=[blk.out_struct((num_rows * hq, dv), jnp.dtype(decode.out_dtype), *operands),
                 blk.out_struct((num_rows * hq,), jnp.float32, *operands)],
      compiler_params=None if decode.interpret else plgpu.CompilerParams(num_warps=STEP_WARPS, num_stages=1),
      interpret=decode.interpret,
      name="fdecode_combine_triton",
  )(*operands)
  return out.reshape(num_rows, hq, dv), lse.reshape(num_rows, hq)
