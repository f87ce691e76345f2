"""A ragged serving step's combine on the Triton kernels (`fdecode.ragged_decode`): the
states of its two parts, each sequence's last row (T = 1) and the prefill blocks (T = tb
rows), each from a balanced split launch (`fdecode.kernels.triton.split_states`), merged by
*one* launch straight into the step's packed rows ``out [N, Hq, Dv]`` / ``lse [N, Hq]``,
padding rows included (out 0, lse -inf). Nothing runs after it: before, each part had its
own combine and XLA gathered the rows from both outputs (a select over ``[N, Hq, Dv]``).

Grid ``(M + NB + P, Hkv * tiles, Dv / width)``, three kinds of program on axis 0:

* ``u < M``: sequence u's last row, its run of the decode part's work items merged
  (`fdecode.kernels.triton.combine.merge_run`) and stored at packed row ``rows.last[u]``
  (N: the sequence has no row, nothing is stored);
* ``M <= M + j < M + NB``: prefill block j's rows, row t stored at packed row
  ``rows.first[j] + t`` where that is at or past ``rows.lo[j]`` (its sequence's first row;
  N for a block past the real ones);
* the last P: the padding rows (no live sequence's: outside ``[cu[0], cu[num_seqs])``) of a
  chunk of ``PAD_ENTRIES // G`` rows.

Every packed row is stored by exactly one program: a live sequence's last row by its
decode program, its other rows by the one block that holds them, the rest by a padding
program. Axis 1 is a kv head, a row tile and a column chunk, each part's own
(`CombinePlan.rows` / ``width``, `fdecode.kernels.triton.plan.segment_combine_tiling`); a
program past its part's share of the axis stores nothing.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fdecode.kernels.common import block as blk
from fdecode.kernels.triton.combine import CombinePlan, merge_run, with_sinks
from fdecode.kernels.triton.schedule import load_ends, sequence_items

# Query rows (times G heads) a padding program stores: 64 (row, head) entries.
PAD_ENTRIES = 64


class StepRows(NamedTuple):
  """Where a step's states go in its packed rows (N rows). ``last``: int32 ``[M]``, each
  sequence's last row (N: none); ``first``: int32 ``[NB]``, each prefill block's first row
  (its row t is packed row ``first + t``; rows before ``lo`` are another sequence's);
  ``lo``: int32 ``[NB]``, the block's sequence's first row (N: a block past the real
  ones); ``cu``: int32 ``[M + 1]``, the step's (clipped, non-decreasing) row offsets and
  ``num_seqs`` int32 ``[1]``: rows ``[cu[0], cu[clip(num_seqs, 0, M)])`` belong to live
  sequences, the others are padding."""
  last: object
  first: object
  lo: object
  cu: object
  num_seqs: object


@dataclasses.dataclass(frozen=True)
class _Geometry:
  decode: CombinePlan
  prefill: CombinePlan
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


def _part(g: _Geometry, plan: CombinePlan, k, refs, unit, dest, out_refs, sinks_ref):
  """One part's program: ``unit``'s run of work items merged for the rows and columns of
  axis-1 index ``k`` (read outside any branch: the interpreter needs it), its rows stored
  where ``dest(t, valid)`` (t int32 ``[rb]``, each row's token) puts them: ``(packed row,
  stored)``."""
  lse_ref, o_ref, ends_ref = refs
  out_ref, out_lse_ref = out_refs
  rb, w = plan.rows, plan.width
  h, tile, chunk = _ids(plan, k)

  @pl.when(h < g.hq // g.group)
  def _():
    row = tile * rb + lax.iota(jnp.int32, rb)
    col = chunk * w + lax.iota(jnp.int32, w)
    packed, valid = dest(row // g.group, row < plan.num_rows)
    first, last = sequence_items(load_ends(ends_ref, plan.schedule), unit, plan.schedule)
    out, lse = merge_run(lse_ref, o_ref, first, last, row, col, valid, plan.chunk)
    head = h * g.group + row % g.group
    out, lse = with_sinks(sinks_ref, head, out, lse[:, None])
    dst = jnp.where(valid, packed * g.hq + head, g.num_rows * g.hq)  # not stored: one past the end
    plgpu.store(out_ref.at[dst[:, None], col[None, :]], out.astype(out_ref.dtype), mask=valid[:, None])

    @pl.when(chunk == 0)
    def _():
      plgpu.store(out_lse_ref.at[dst], lse[:, 0], mask=valid)


def _padding(g: _Geometry, p, k, cu_ref, ns_ref, out_refs):
  """Padding program ``p``: out 0, lse -inf at the rows of its chunk that no live sequence
  owns, for kv head and column chunk ``k`` (`_ids` of the prefill part's widths)."""
  plan = g.prefill
  _, chunks = _layout(plan)
  h, chunk, w = k // chunks, k % chunks, plan.width
  m = cu_ref.shape[0] - 1
  lo, hi = cu_ref[0], cu_ref[jnp.clip(ns_ref[0], 0, m)]
  per = max(PAD_ENTRIES // g.group, 1)
  e = lax.iota(jnp.int32, per * g.group)
  row = p * per + e // g.group
  valid = (h < g.hq // g.group) & (row < g.num_rows) & ((row < lo) | (row >= hi))
  dst = jnp.where(valid, row * g.hq + h * g.group + e % g.group, g.num_rows * g.hq)
  col = chunk * w + lax.iota(jnp.int32, w)
  out_ref, out_lse_ref = out_refs
  plgpu.store(out_ref.at[dst[:, None], col[None, :]], jnp.zeros((e.shape[0], w), out_ref.dtype), mask=valid[:, None])
  plgpu.store(out_lse_ref.at[dst], jnp.full(e.shape, -jnp.inf, jnp.float32), mask=valid & (chunk == 0))


def _step_kernel(*refs, g: _Geometry):
  # decode: lse f32[n_d, R_d], o f32[n_d, R_d, Dv], ends int32[M]; prefill: the same [n_p, R_p(, Dv)],
  # ends int32[NB]; rows: last [M], first [NB], lo [NB], cu [M + 1], num_seqs [1]; [sinks f32[Hq]];
  # out [N * Hq, Dv], out_lse f32[N * Hq]
  refs = list(refs)
  decode, prefill, (last_ref, first_ref, lo_ref, cu_ref, ns_ref) = refs[0:3], refs[3:6], refs[6:11]
  sinks_ref = refs[11] if len(refs) == 14 else None
  out_refs = refs[-2:]
  m, nb = g.decode.schedule.batch, g.prefill.schedule.batch
  i, k = pl.program_id(0), pl.program_id(1)
  n = g.num_rows

  @pl.when(i < m)
  def _():
    row = last_ref[i]
    _part(g, g.decode, k, decode, i, lambda t, valid: (jnp.full_like(t, row), valid & (row < n)), out_refs,
          sinks_ref)

  @pl.when((i >= m) & (i < m + nb))
  def _():
    j = i - m
    first, lo = first_ref[j], lo_ref[j]
    dest = lambda t, valid: (first + t, valid & (first + t >= lo) & (first + t < n))
    _part(g, g.prefill, k, prefill, j, dest, out_refs, sinks_ref)

  @pl.when(i >= m + nb)
  def _():
    _padding(g, i - m - nb, k, cu_ref, ns_ref, out_refs)


def combine_step(decode: CombinePlan, prefill: CombinePlan, decode_states, prefill_states, rows: StepRows,
                 sinks=None, *, num_rows: int):
  """One launch: the step's packed ``(out [N, Hq, Dv] in the plans' out dtype, lse f32 [N,
  Hq])`` (N = ``num_rows``) from each part's balanced states, ``(o f32 [n, Hkv, R_p, 1, Dv],
  lse f32 [n, Hkv, R_p, 1], ends int32 [B])`` as `fdecode.kernels.triton.split_states` gave
  them and the ends the schedule was dealt from; ``rows``: where they go (`StepRows`);
  ``sinks`` f32 ``[Hq]`` or None. ``decode`` / ``prefill``: the parts' combine plans
  (balanced: a schedule each), T = 1 and T = tb."""
  hq, group, dv = decode.hq, decode.group, decode.dv
  hkv = hq // group
  g = _Geometry(decode=decode, prefill=prefill, num_rows=num_rows, hq=hq, group=group)
  operands, in_specs = [], []
  for plan, (o, lse, ends) in ((decode, decode_states), (prefill, prefill_states)):
    o, lse = o[:, :, :, 0], lse[:, :, :, 0]
    n, _, r_p = lse.shape
    head = lambda k, plan=plan: jnp.minimum(_ids(plan, k)[0], hkv - 1)
    operands += [lse, o, ends.astype(jnp.int32)]
    in_specs += [pl.BlockSpec((n, None, r_p), lambda i, k, c, head=head: (0, head(k), 0)),
                 pl.BlockSpec((n, None, r_p, dv), lambda i, k, c, head=head: (0, head(k), 0, 0)),
                 pl.BlockSpec(ends.shape, lambda i, k, c: (0,))]
  extra = [x.astype(jnp.int32) for x in rows] + ([] if sinks is None else [sinks.astype(jnp.float32)])
  operands += extra
  in_specs += [pl.BlockSpec(x.shape, lambda i, k, c: (0,)) for x in extra]
  pads = -(-num_rows // max(PAD_ENTRIES // group, 1))
  width = max(hkv * tiles * chunks for tiles, chunks in map(_layout, (decode, prefill)))
  grid = (decode.schedule.batch + prefill.schedule.batch + pads, width, 1)
  out, lse = pl.pallas_call(
      lambda *refs: _step_kernel(*refs, g=g),
      grid=grid,
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((num_rows * hq, dv), lambda i, k, c: (0, 0)),
                 pl.BlockSpec((num_rows * hq,), lambda i, k, c: (0,))],
      out_shape=[blk.out_struct((num_rows * hq, dv), jnp.dtype(decode.out_dtype), *operands),
                 blk.out_struct((num_rows * hq,), jnp.float32, *operands)],
      compiler_params=None if decode.interpret else plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=decode.interpret,
      name="fdecode_combine_triton",
  )(*operands)
  return out.reshape(num_rows, hq, dv), lse.reshape(num_rows, hq)
