"""A ragged serving step's geometry, derived by each Triton program from the step's own
offsets (`fdecode.ragged_decode` on the Triton kernels): which sequence a work unit reads,
its first packed row, its kv length, and every unit's kv length for the balanced schedule.
No XLA fusion computes them between the kernels (a launch each): each program computes
what it needs in registers from ``cu [M + 1]`` (the step's clipped,
non-decreasing row offsets, `fdecode.ragged.row_positions`' ``cu``), ``kv_lens [M]`` and
``num_seqs [1]``, a few vector reductions over the M sequences (and, for the prefill
blocks' lengths, over blocks x sequences in chunks).

The units are a `StepPart`'s: the decode part's M sequences (unit b: sequence b's last
row, T = 1) or the prefill part's NB blocks (unit j: ``block`` rows of one sequence,
counted back from the row before its last; `fdecode.ragged.decode` describes both). The
XLA form of the same geometry is `fdecode.ragged.decode`'s (``row_positions`` and its
block geometry), which the tests compare the kernels' results against through the
step's outputs.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from fdecode.kernels.triton.pallas_triton import plgpu

from fdecode.kernels.triton.launch import pow2_at_least
from fdecode.kernels.triton.schedule import cdiv, vector_at

# Elements of the blocks x sequences comparison one loop step holds (prefill lengths).
PAIR_ELEMENTS = 4096


@dataclasses.dataclass(frozen=True)
class StepPart:
  """One part of a ragged step whose units the kernels derive (hashable: in the plan).
  ``part``: ``"decode"`` (units: the M sequences, T = 1) or ``"prefill"`` (units: NB =
  ``units`` blocks of ``block`` rows); ``rows`` N packed rows; ``seqs`` M; ``seq_len`` S
  (kv lengths are clipped to it)."""
  part: str
  rows: int
  seqs: int
  units: int
  block: int
  seq_len: int

  @property
  def seqs_padded(self) -> int:
    return pow2_at_least(self.seqs)

  @property
  def units_padded(self) -> int:
    return pow2_at_least(self.units)


class Seqs(NamedTuple):
  """The step's sequences in registers, int32 ``[size]``: each one's first row and the
  offset after its rows (``cu[i]``, ``cu[i + 1]`` clipped; past M: N), its rows (0 for a
  dead sequence, past ``num_seqs``, and past M) and kv length (clipped into ``[0, S]``, 0
  for a dead sequence); ``after``: the scalar offset after the last of them (the next
  chunk's ``before``)."""
  first: object
  end: object
  q_len: object
  kv: object
  after: object


def _load(ref, start, size: int, limit: int):
  """``ref[start : start + size]`` as a vector, 0 at indices ``>= limit`` (a gather at
  clipped indices: never a slice past the ref)."""
  i = start + lax.iota(jnp.int32, size)
  return plgpu.load(ref.at[jnp.minimum(i, ref.shape[0] - 1)], mask=i < limit, other=0), i


def first_row(cu_ref, part: StepPart):
  """The step's first owned row, ``clip(cu[0], 0, N)`` (`fdecode.ragged.row_positions`)."""
  return jnp.clip(cu_ref[0], 0, part.rows)


def load_seqs(cu_ref, lens_ref, ns_ref, part: StepPart, start=0, size: int | None = None, before=None) -> Seqs:
  """Sequences ``[start, start + size)`` (default: all, ``[0, M_p)``) from the step's
  refs, ``cu_q_lens`` int32 ``[M + 1]`` (as the caller gave them: clipped here as
  `fdecode.ragged.row_positions` clips them, each sequence's count ``clip(cu[i + 1], 0,
  N) - clip(cu[i], 0, N)`` floored at 0, counted on from ``clip(cu[0], 0, N)``, the
  offsets capped at N), ``kv_lens`` int32 ``[M]``, ``num_seqs`` int32 ``[1]``. ``before``:
  the offset the chunk starts at (``Seqs.after`` of the chunk before; default its first
  row, for ``start`` 0)."""
  size = part.seqs_padded if size is None else size
  m, n = part.seqs, part.rows
  lo, i = _load(cu_ref, start, size, m)
  hi, _ = _load(cu_ref, start + 1, size, m + 1)
  kv, _ = _load(lens_ref, start, size, m)
  count = jnp.where(i < m, jnp.maximum(jnp.clip(hi, 0, n) - jnp.clip(lo, 0, n), 0), 0)
  before = first_row(cu_ref, part) if before is None else before
  ends = before + jnp.cumsum(count)
  first, end = jnp.minimum(ends - count, n), jnp.minimum(ends, n)
  live = (i < m) & (i < jnp.clip(ns_ref[0], 0, m))
  return Seqs(first, jnp.where(i < m, end, n), jnp.where(live, end - first, 0),
              jnp.where(live, jnp.clip(kv, 0, part.seq_len), 0), before + jnp.sum(count))


def owned_rows(cu_ref, ns_ref, part: StepPart, seqs: Seqs):
  """``(lo, hi)``: the rows live sequences own, ``[cu[0], cu[num_seqs])`` of the clipped
  offsets (``seqs``: all of them, `load_seqs`' default)."""
  ns = jnp.clip(ns_ref[0], 0, part.seqs)
  lo = first_row(cu_ref, part)
  return lo, lo + jnp.sum(jnp.where(lax.iota(jnp.int32, seqs.q_len.shape[0]) < ns, seqs.q_len, 0))


def _blocks(q_len, part: StepPart):
  """Prefill blocks per sequence: its rows but the last, ``block`` a block."""
  return cdiv(jnp.maximum(q_len - 1, 0), part.block)


def unit_ends(cu_ref, lens_ref, ns_ref, part: StepPart):
  """Every unit's kv length (its last row's end), int32 ``[B_p]`` (0 past the units and
  for units with no row): `fdecode.kernels.triton.schedule`'s ``ends`` for this part."""
  if part.part == "decode":
    s = load_seqs(cu_ref, lens_ref, ns_ref, part)
    return jnp.where(s.q_len > 0, s.kv, 0)
  bp, mp = part.units_padded, part.seqs_padded
  chunk = min(mp, max(1, pow2_at_least(PAIR_ELEMENTS // bp + 1) // 2))
  j = lax.iota(jnp.int32, bp)[:, None]

  def step(c, carry):  # sequences [c * chunk, (c + 1) * chunk): their blocks' lengths
    ends, blocks_before, rows_before = carry
    s = load_seqs(cu_ref, lens_ref, ns_ref, part, c * chunk, chunk, rows_before)
    nb = _blocks(s.q_len, part)
    last = blocks_before + jnp.cumsum(nb)  # each sequence's blocks: [last - nb, last)
    first = (last - nb)[None, :]
    mine = (j >= first) & (j < last[None, :])
    length = s.kv[None, :] - 1 - (j - first) * part.block
    return ends + jnp.sum(jnp.where(mine, length, 0), axis=1), blocks_before + jnp.sum(nb), s.after

  zero = (jnp.zeros((bp,), jnp.int32), jnp.int32(0), first_row(cu_ref, part))
  return lax.fori_loop(0, mp // chunk, step, zero)[0]


def unit_rows(cu_ref, lens_ref, ns_ref, part: StepPart, b):
  """Unit ``b`` (int32 scalar): ``(seq, first, lo)``, the sequence it reads (clipped into
  ``[0, M)``), the packed row of its row 0 (unclipped: a block's rows before ``lo`` are
  another sequence's), and the first row it may store (N: none; the decode part's unit
  stores its one row, its sequence's last, where the sequence has a row)."""
  s = load_seqs(cu_ref, lens_ref, ns_ref, part)
  n = part.rows
  end = s.first + s.q_len  # each sequence's rows end
  if part.part == "decode":
    last = vector_at(end, b) - 1
    return b, last, jnp.where(vector_at(s.q_len, b) > 0, last, n)
  nb = _blocks(s.q_len, part)
  ends = jnp.cumsum(nb)
  seq = jnp.minimum(jnp.sum(jnp.where(ends <= b, 1, 0)), part.seqs - 1)
  jj = b - (vector_at(ends, seq) - vector_at(nb, seq))
  hi = vector_at(end, seq) - 1 - jj * part.block  # rows [hi - block, hi)
  live = b < jnp.sum(nb)
  return seq, hi - part.block, jnp.where(live, vector_at(s.first, seq), n)


def row_position(cu_ref, lens_ref, ns_ref, part: StepPart, r):
  """Packed row ``r``'s ``(sequence, position)`` (int32 scalars): `fdecode.ragged.row_positions`'
  ``seq`` and ``pos`` for it (position -1 for a row no live sequence owns)."""
  s = load_seqs(cu_ref, lens_ref, ns_ref, part)
  seq = jnp.minimum(jnp.sum(jnp.where(s.end <= r, 1, 0)), part.seqs - 1)
  lo, hi = owned_rows(cu_ref, ns_ref, part, s)
  pos = vector_at(s.kv, seq) - vector_at(s.q_len, seq) + r - vector_at(s.first, seq)
  return seq, jnp.where((r >= lo) & (r < hi), pos, -1)
