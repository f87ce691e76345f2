"""The Triton cache write: a ragged step's new tokens into their caches, in place, keys and
values in one launch (XLA launches a scatter per cache and a fusion for the rows' slots).

Grid ``(N, Hkv)``: one program writes packed row r's key and value of one kv head at the
row's (sequence, position), in the caches' own layout, viewed flat as ``[rows, D]`` (a
free reshape), one row a store (a power-of-two width, masked to D):

* contiguous ``HND [M, Hkv, S, D]``: row ``(seq * Hkv + h) * S + pos``;
  ``NHD [M, S, Hkv, D]``: ``(seq * S + pos) * Hkv + h``;
* paged ``HND [Hkv, P, page_size, D]``: ``(h * P + page) * page_size + slot``;
  ``NHD [P, page_size, Hkv, D]``: ``(page * page_size + slot) * Hkv + h``, with ``page``
  the sequence's table entry ``pos // page_size`` and ``slot = pos % page_size``.

A row with ``pos < 0`` (no live sequence owns it, or a position before the cache under
``jit``), contiguous ``pos >= S`` or a sequence outside ``[0, M)``, or, paged, whose table
entry is not a page of the pool writes nothing: the same rows `fdecode.ragged.write`'s XLA
scatter drops. The caches are the outputs' buffers (``input_output_aliases``): under
``jax.jit(..., donate_argnums=...)`` nothing is copied. Float values are cast to the
cache's dtype in the kernel; 8-bit values move as bytes (a new row and a cache of
different dtypes with either 8-bit are converted to the cache's dtype in XLA first, as
the scatter casts). ``interpret=True`` runs the same kernel interpreted.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from fdecode.kernels.triton.pallas_triton import plgpu

from fdecode.cache.slots import contiguous_slot, paged_slot
from fdecode.kernels.common import block as blk
from fdecode.kernels.triton.geometry import StepPart, row_position
from fdecode.kernels.triton.launch import pow2_at_least
from fdecode.kernels.triton.operands import Operand, flatten, take, whole


@dataclasses.dataclass(frozen=True)
class WritePlan:
  """The write's static geometry: ``layout`` "HND" / "NHD"; ``paged`` (then ``num_pages``,
  ``page_size`` and ``table_len``, the block table's n) or contiguous (``capacity`` S);
  ``hkv`` kv heads."""
  layout: str
  paged: bool
  hkv: int
  capacity: int
  page_size: int = 1
  num_pages: int = 0
  table_len: int = 1
  interpret: bool = False
  step: StepPart | None = None


class WriteOperands(NamedTuple):
  """The write's operands (`fdecode.kernels.triton.operands`), each whole: ``positions``,
  the rows' ``(seq, pos)`` int32 ``[N]`` or a step's ``(cu, kv_lens, num_seqs)``;
  ``table`` int32 ``[M * n]`` (paged) or None; ``news``: the new rows ``[N * Hkv, D]`` per
  cache; ``caches``: the caches, flat ``[rows, D]``, aliased to the outputs."""
  positions: tuple
  table: Operand | None
  news: tuple
  caches: tuple


def _kernel(*refs, plan: WritePlan, layout):
  # ins: `WriteOperands` (the aliased caches' inputs unused); outs: the caches, flat [rows, D].
  ins, outs = take(layout, refs)
  r = pl.program_id(0)
  h = pl.program_id(1)
  if plan.step is not None:  # the row's sequence and position, derived from the step
    seq, pos = row_position(*ins.positions, plan.step, r)
  else:
    seq_ref, pos_ref = ins.positions
    seq, pos = seq_ref[r], pos_ref[r]
  table_ref, news = ins.table, ins.news
  if plan.paged:  # the dropped-write rule: fdecode.cache.slots
    ps, n = plan.page_size, plan.table_len
    base = jnp.clip(seq, 0, table_ref.shape[0] // n - 1) * n
    page, slot, ok = paged_slot(pos, lambda j: table_ref[base + j], page_size=ps, table_len=n,
                                num_pages=plan.num_pages)
    row = ((page * ps + slot) * plan.hkv + h if plan.layout == "NHD"
           else (h * plan.num_pages + page) * ps + slot)
  else:
    m = outs[0].shape[0] // (plan.hkv * plan.capacity)
    s, ok = contiguous_slot(pos, capacity=plan.capacity)
    ok = ok & (seq >= 0) & (seq < m)
    seq = jnp.clip(seq, 0, m - 1)
    row = (seq * plan.capacity + s) * plan.hkv + h if plan.layout == "NHD" else (seq * plan.hkv + h) * plan.capacity + s
  row = jnp.where(ok, row, 0)
  for new_ref, out_ref in zip(news, outs):
    d = out_ref.shape[1]
    dp = pow2_at_least(d)
    live = ok & (lax.iota(jnp.int32, dp) < d)
    x = plgpu.load(new_ref.at[r * plan.hkv + h, pl.ds(0, dp)], mask=live, other=0)
    plgpu.store(out_ref.at[row, pl.ds(0, dp)], x.astype(out_ref.dtype), mask=live)


def write_rows(plan: WritePlan, caches, news, positions, tables=None):
  """Writes ``news`` (``[N, Hkv, D]`` each, one per cache) into ``caches`` (k, and v unless
  None: in ``plan.layout``, contiguous or paged) at each row's sequence and position ->
  the updated caches, same shapes and dtypes, in place. ``positions``: ``(seq, pos)``, int32
  ``[N]`` each (`fdecode.ragged.row_positions`'), or with ``plan.step`` the step's ``(cu,
  kv_lens, num_seqs)`` (int32 ``[M + 1]`` clipped non-decreasing, ``[M]``, ``[1]``), from
  which each program derives its row's (`fdecode.kernels.triton.geometry.row_position`);
  ``tables`` int32 ``[M, n]`` when paged."""
  byte = lambda x: jnp.dtype(x.dtype).itemsize == 1
  # 8-bit on either side: converted in XLA to the cache's dtype first (as the scatter
  # casts), so the kernel only moves bytes (Triton has no float8 conversion below sm_89).
  pairs = [(c, x.astype(c.dtype) if x.dtype != c.dtype and (byte(x) or byte(c)) else x)
           for c, x in zip(caches, news) if c is not None]
  n_rows = pairs[0][1].shape[0]
  as_bytes = lambda x: lax.bitcast_convert_type(x, jnp.uint8) if byte(x) else x
  flat = [as_bytes(c).reshape(-1, c.shape[-1]) for c, _ in pairs]
  rows = [as_bytes(x).reshape(n_rows * plan.hkv, x.shape[-1]) for _, x in pairs]
  positions = tuple(whole(x.astype(jnp.int32).reshape(-1)) for x in positions)
  table = whole(tables.astype(jnp.int32).reshape(-1)) if plan.paged else None
  operands, in_specs, layout = flatten(WriteOperands(positions, table, tuple(map(whole, rows)),
                                                     tuple(map(whole, flat))))
  first = len(operands) - len(flat)
  moved = sum(x.size * x.dtype.itemsize for x in rows)  # read once, written once
  out = pl.pallas_call(
      lambda *refs: _kernel(*refs, plan=plan, layout=layout),
      grid=(n_rows, plan.hkv),
      in_specs=in_specs,
      out_specs=[whole(c).spec for c in flat],
      out_shape=[blk.out_struct(c.shape, c.dtype, *operands) for c in flat],
      input_output_aliases={first + i: i for i in range(len(flat))},
      cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=2 * moved + 8 * n_rows),
      compiler_params=None if plan.interpret else plgpu.CompilerParams(num_warps=1, num_stages=1),
      interpret=plan.interpret,
      name="fdecode_write_triton",
  )(*operands)
  written, result = iter(out), []
  for c in caches:
    x = None if c is None else next(written)
    if x is not None and jnp.dtype(c.dtype).itemsize == 1:
      x = lax.bitcast_convert_type(x, c.dtype)
    result.append(None if x is None else x.reshape(c.shape))
  return tuple(result)


def write_plan(layout: str, paged: bool, cache_shape, *, page_size: int = 1, table_len: int = 1,
               interpret: bool = False, step_rows: tuple[int, int] | None = None) -> WritePlan:
  """The plan of writing into caches shaped like ``cache_shape`` (k's, in ``layout``).
  ``step_rows``: ``(N, M)``, the rows' positions derive from a ragged step's arrays."""
  hkv = cache_shape[2] if layout == "NHD" else (cache_shape[0] if paged else cache_shape[1])
  if paged:
    num_pages = cache_shape[0] if layout == "NHD" else cache_shape[1]
    capacity, geometry = table_len * page_size, dict(page_size=page_size, num_pages=num_pages, table_len=table_len)
  else:
    capacity, geometry = (cache_shape[1] if layout == "NHD" else cache_shape[2]), {}
  step = None if step_rows is None else StepPart(part="rows", rows=step_rows[0], seqs=step_rows[1],
                                                 units=step_rows[0], block=1, seq_len=capacity)
  return WritePlan(layout, paged, hkv, capacity, interpret=bool(interpret), step=step, **geometry)


def write_view(view, new_k, new_v, seq, pos, step, interpret: bool):
  """A ragged step's write into ``view``'s caches (`fdecode.cache.layout.CacheView`, int32
  tables) in one launch: ``(k, v)``. ``seq`` / ``pos`` int32 ``[N]``; ``step``: the step's
  ``(cu, kv_lens, num_seqs)`` they came from (the kernel derives each row's from them), or
  None (the kernel reads ``seq`` / ``pos``)."""
  tables = view.block_tables
  plan = write_plan(view.layout, view.paged, view.k.shape, page_size=view.page_size if view.paged else 1,
                    table_len=tables.shape[1] if view.paged else 1, interpret=interpret,
                    step_rows=None if step is None else (seq.shape[0], step[1].shape[0]))
  return write_rows(plan, (view.k, view.v), (new_k, new_v), (seq, pos) if step is None else step, tables)
