"""The split launch of a `fdecode.kernels.triton.plan.TritonPlan`, and `run`: the plan as it is.

`run` launches the split kernel (`fdecode.kernels.triton.kernel.split_kernel`) and, with
several splits, the combine kernel (`fdecode.kernels.triton.combine`): at most two kernels
a call, nothing around them but free reshapes (a contiguous cache shorter than one block is
padded). The balanced schedule adds no launch: each of its work items (a split-kernel
program) derives its sequence and split from the whole ``ends [B]``, and each combine
program its sequence's run of items (`fdecode.kernels.triton.schedule`); the items read q
and the block table in place (a caller's gathers of them too: `RowSource`).

The split kernel's operands are `SplitOperands`, built once here by name
(`split_operands`) and taken by the same names in the kernel
(`fdecode.kernels.triton.operands`). A ragged step runs its two parts' balanced plans in
one launch (`split_states_merged`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from fdecode.kernels.triton.pallas_triton import plgpu

from fdecode.cache.layout import token_axis
from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import user_form
from fdecode.kernels.common.sparse import pad_slots
from fdecode.kernels.triton.combine import combine
from fdecode.kernels.triton.kernel import split_kernel
from fdecode.kernels.triton.operands import Operand, flatten, whole
from fdecode.kernels.triton.plan import Read, TritonPlan
from fdecode.kernels.backend import RowSource


class SplitOperands(NamedTuple):
  """The split kernel's operands over grid ``(i, h, j)`` (i the sequence or work item, h the
  kv head, j the split), in launch order; None where the plan reads none.

  ``step``: a ragged step's ``(cu, kv_lens, num_seqs)``, whole (every unit's geometry), or
  ``ends`` int32 ``[B]`` (whole where balanced); ``table``: block-table rows, whole where a
  program finds its own row (balanced, step, `RowSource`), with ``table_rows`` a source's
  rows; ``cache_rows``: a source's cache rows; ``idx``: index lists ``[B, Hi, Kp]``; ``q``:
  ``[B, T * Hq, Dq]`` (whole and flat where balanced or through a source, then with
  ``q_start``); the caches ``k``, ``v`` (None for MLA), ``rope`` and their scales / offsets;
  ``mask`` / ``bias`` (the call's, read in place, or a step's per-row ones); ``alibi`` and
  ``sinks`` f32 ``[Hq]`` (sinks only where the split kernel finishes the output)."""
  step: tuple | None
  ends: Operand | None
  table: Operand | None
  table_rows: Operand | None
  cache_rows: Operand | None
  idx: Operand | None
  q: Operand
  q_start: Operand | None
  k: Operand
  v: Operand | None
  rope: Operand | None
  k_scale: Operand | None
  k_offset: Operand | None
  v_scale: Operand | None
  v_offset: Operand | None
  mask: Operand | None
  bias: Operand | None
  alibi: Operand | None
  sinks: Operand | None


def _cache_operands(p: TritonPlan, k, v, k_rope, quant_arrays):
  """The caches as the kernel reads them: a pool's (page, slot) axes merged into one row
  axis (a free reshape); a contiguous cache shorter than one block padded to it; float8
  passed as bytes where the plan decodes bits; a source's whole caches viewed flat. Returns
  (caches, quant arrays, the cache's BlockSpec maker)."""
  cache = p.cache
  ax = token_axis(cache.kv_layout)
  k, v = (x if bits is None or x is None else lax.bitcast_convert_type(x, jnp.uint8)
          for x, bits in zip((k, v), p.dtypes.fp8_bits))
  if cache.read is Read.CACHE_ROWS:  # flat rows (`kernel.cache_source_rows`), and scales
    k, v, k_rope = (None if x is None else x.reshape(-1, x.shape[-1]) for x in (k, v, k_rope))
    quant_arrays = tuple(None if a is None else a.reshape(-1, a.shape[-1]) for a in quant_arrays)
    return (k, v, k_rope), quant_arrays, lambda d: pl.BlockSpec((k.shape[0], d), lambda i, h, j: (0, 0))
  rows = cache.cache_rows
  if cache.read.paged:
    lead = (rows, k.shape[ax + 1]) if cache.kv_layout == "NHD" else (k.shape[0], rows)
    k, v, k_rope = (None if x is None else x.reshape(lead + (x.shape[-1],)) for x in (k, v, k_rope))
    if cache.kv_layout == "NHD":
      return (k, v, k_rope), quant_arrays, lambda d: pl.BlockSpec((rows, None, d), lambda i, h, j: (0, h, 0))
    return (k, v, k_rope), quant_arrays, lambda d: pl.BlockSpec((None, rows, d), lambda i, h, j: (h, 0, 0))
  s = k.shape[ax]
  if s < rows:  # a cache shorter than one block: pad it (cheap: < bk tokens)
    pad = lambda axis: [(0, rows - s) if i == axis else (0, 0) for i in range(4)]
    k, v, k_rope = (None if x is None else jnp.pad(x, pad(ax)) for x in (k, v, k_rope))
    quant_arrays = tuple(a if a is None or a.shape[2] == 1 else jnp.pad(a, pad(2)) for a in quant_arrays)
  fold = cache.sparse_fold
  if cache.kv_layout == "NHD":
    spec = lambda d: pl.BlockSpec((None, rows, None, d), lambda i, h, j: (i // fold, 0, h, 0))
  else:
    spec = lambda d: pl.BlockSpec((None, None, rows, d), lambda i, h, j: (i // fold, h, 0, 0))
  return (k, v, k_rope), quant_arrays, spec


def _quant_operand(p: TritonPlan, x) -> Operand | None:
  """A canonical rank-4 scale / offset (None: absent) as the kernel reads it."""
  if x is None:
    return None
  if p.cache.read is Read.CACHE_ROWS:  # flat [d0 * d1 * d2, nt] (`_cache_operands`)
    return Operand(x, pl.BlockSpec(x.shape, lambda i, h, j: (0, 0)))
  d0, d1, d2, nt = x.shape
  if p.cache.read.paged:  # [Hkv|1, P|1, ps|1, nt] -> [Hkv|1, P|1 * ps|1, nt]
    return Operand(x.reshape(d0, d1 * d2, nt),
                   pl.BlockSpec((None, d1 * d2, nt), lambda i, h, j: (h if d0 > 1 else 0, 0, 0)))
  fold = p.cache.sparse_fold
  return Operand(x, pl.BlockSpec((None, None, d2, nt), lambda i, h, j: (i // fold if d0 > 1 else 0,
                                                                          h if d1 > 1 else 0, 0, 0)))


def _int_whole(x) -> Operand:
  return whole(x.astype(jnp.int32).reshape(-1))


def _tables(p: TritonPlan, block_tables, source):
  """``(table, table_rows)``: the block-table operand and a source's table rows."""
  if p.source.step is not None and p.cache.read.paged:  # the step's tables, read at each unit's sequence
    return _int_whole(block_tables if source.tables is None else source.tables), None
  if p.source.table_source:  # a RowSource's tables, read at its table rows
    return _int_whole(source.tables), whole(source.table_rows.astype(jnp.int32))
  if p.cache.read.paged and p.work.balanced:  # an item reads its sequence's table row in place
    return _int_whole(block_tables), None
  if p.cache.read.paged:
    return Operand(block_tables.astype(jnp.int32),
                   pl.BlockSpec((None, p.cache.table_len), lambda i, h, j: (i, 0))), None
  return None, None


def _q(p: TritonPlan, q, source):
  """``(q, q_start)``: the packed rows read from a RowSource's first rows, or the call's own."""
  tq = p.rows.num_tokens * p.rows.hq
  if p.source.q_source:
    packed = whole(source.q.reshape(-1, source.q.shape[-1]))
    return packed, None if p.source.step is not None else whole(source.q_start.astype(jnp.int32))
  if p.work.balanced:
    return whole(q.reshape(q.shape[0] * tq, q.shape[-1])), None
  return Operand(q.reshape(q.shape[0], tq, q.shape[-1]),
                 pl.BlockSpec((None, tq, q.shape[-1]), lambda i, h, j: (i, 0, 0))), None


def _modifier(p: TritonPlan, x) -> Operand | None:
  """A call's canonical mask / bias ``[Bm, Hm, Tm, Gm, S]``, read in place (a bool mask as it is)."""
  if x is None:
    return None
  bm, hm, tm, gm, s = x.shape
  if hm * gm > 1:  # per query head: the caller's [Bm, Tm, Hq, S] (the canonical form's transpose undone,
    # which XLA folds away), its rows gathered by the program (`kernel.mod_rows`)
    rows = tm * p.rows.hq
    return Operand(user_form(x).reshape(bm, rows, s),
                   pl.BlockSpec((None, rows, s), lambda i, h, j: (i if bm > 1 else 0, 0, 0)))
  # one row per token, shared by the heads: [Bm, Tm, S]
  return Operand(x.reshape(bm, tm, s), pl.BlockSpec((None, tm, s), lambda i, h, j: (i if bm > 1 else 0, 0, 0)))


def split_operands(p: TritonPlan, q, ends, k, v, *, block_tables, k_rope, quant_arrays, mask, bias, alibi, sinks,
                   indices, source) -> tuple[SplitOperands, list]:
  """Every operand of the split kernel and its BlockSpec over grid ``(i, h, j)`` (h the kv
  head; the row block is folded in by `_split_call`), and the caches as read (for the cost)."""
  step = p.source.step
  if step is not None:  # every unit's geometry, derived from the step's arrays
    step_arrays, ends = tuple(_int_whole(x) for x in source.step), None
  elif p.work.balanced:  # every item derives its work from all ends
    step_arrays, ends = None, whole(ends.astype(jnp.int32))
  else:
    step_arrays, ends = None, Operand(ends.astype(jnp.int32), pl.BlockSpec((1,), lambda i, h, j: (i,)))
  table, table_rows = _tables(p, block_tables, source)
  cache_rows = whole(source.cache_rows.astype(jnp.int32)) if p.source.cache_row_list else None
  idx = None
  if p.cache.read.sparse:  # (index_bounds: counted by the kernel from the sorted list, `kernel._index_bounds`)
    lists = pad_slots(indices, p.launch.block, p.cache.seq_len)
    list_head = lambda h: h if lists.shape[1] > 1 else 0
    idx = Operand(lists, pl.BlockSpec((None, None, lists.shape[2]), lambda i, h, j: (i, list_head(h), 0)))
  q, q_start = _q(p, q, source)
  caches, quant_arrays, cache_spec = _cache_operands(p, k, v, k_rope, quant_arrays)
  k, v, rope = (None if x is None else Operand(x, cache_spec(x.shape[-1])) for x in caches)  # MLA: no v
  k_scale, k_offset, v_scale, v_offset = (_quant_operand(p, a) for a in quant_arrays)
  if step is not None:  # a step's per-row arrays, whole: [Nm * Hm, S] (`kernel.step_mod_rows`)
    mask, bias = (None if form is None else whole(x.reshape(form[0] * form[1], x.shape[-1]))
                  for x, form in zip((source.mask, source.bias), p.source.step_mods))
  else:
    mask, bias = _modifier(p, mask), _modifier(p, bias)
  by_head = lambda x: None if x is None else Operand(x.reshape(p.rows.hq), pl.BlockSpec((p.rows.hq,),
                                                                                        lambda i, h, j: (0,)))
  alibi, sinks = by_head(alibi), by_head(sinks if p.work.final else None)  # f32 [Hq]
  operands = SplitOperands(step_arrays, ends, table, table_rows, cache_rows, idx, q, q_start, k, v, rope, k_scale,
                           k_offset, v_scale, v_offset, mask, bias, alibi, sinks)
  return operands, [x for x in caches if x is not None]


class _SplitCall(NamedTuple):
  """One plan's split launch, unlaunched: operands, their BlockSpecs and the outputs' (over
  grid ``(n, Hkv * row_blocks, n_splits)``), the output types, the cost and the inputs'
  layout (`fdecode.kernels.triton.operands.take`)."""
  operands: list
  in_specs: list
  out_specs: list
  out_shape: list
  cost: pl.CostEstimate
  layout: object


class Arrays(NamedTuple):
  """The split kernel's operands besides q, ends and the caches, by name (each or None): the
  cache view's ``block_tables``, canonical scales / offsets and ``k_rope``; the modifiers'
  canonical ``mask``, ``bias`` and ``alibi``; ``sinks``; ``indices`` (sorted index lists,
  repeats kept: `fdecode.kernels.common.sparse.canonicalize`'s ``runs``; the kernel counts
  each list's live slots itself); ``source``: the `RowSource` of a plan made with it (q is
  then its gather, read only for its shape; so is block_tables where the source has table
  rows)."""
  block_tables: object = None
  k_scale: object = None
  v_scale: object = None
  k_offset: object = None
  v_offset: object = None
  k_rope: object = None
  mask: object = None
  bias: object = None
  alibi: object = None
  sinks: object = None
  indices: object = None
  source: RowSource | None = None


def _split_call(p: TritonPlan, q, ends, k, v, a: Arrays) -> _SplitCall:
  b, t, hq, _ = q.shape
  named, caches = split_operands(
      p, q, ends, k, v, block_tables=a.block_tables, k_rope=a.k_rope,
      quant_arrays=(a.k_scale, a.k_offset, a.v_scale, a.v_offset), mask=a.mask, bias=a.bias, alibi=a.alibi,
      sinks=a.sinks, indices=a.indices, source=a.source)
  operands, specs, layout = flatten(named)
  n, hkv, rb, dv = p.work.items, hq // p.rows.group, p.rows.row_blocks, p.columns.dv
  specs = [pl.BlockSpec(s.block_shape, lambda i, hr, j, f=s.index_map: f(i, hr // rb, j)) for s in specs]
  if p.work.final:
    out_specs = [pl.BlockSpec((None, t * hq, dv), lambda i, hr, j: (i, 0, 0)),
                 pl.BlockSpec((None, t * hq), lambda i, hr, j: (i, 0))]
    out_shape = [blk.out_struct((n, t * hq, dv), jnp.dtype(p.dtypes.out_dtype), *operands),
                 blk.out_struct((n, t * hq), jnp.float32, *operands)]
  else:
    rows = lambda i, hr, j: (i, hr // rb, hr % rb, j)
    out_specs = [pl.BlockSpec((None, None, p.rows.block_r, None, dv), lambda i, hr, j: rows(i, hr, j) + (0,)),
                 pl.BlockSpec((None, None, p.rows.block_r, None), rows)]
    out_shape = [blk.out_struct((n, hkv, p.rows.padded, p.work.num_splits, dv), jnp.float32, *operands),
                 blk.out_struct((n, hkv, p.rows.padded, p.work.num_splits), jnp.float32, *operands)]
  sparse = p.cache.read.sparse
  keys = p.cache.seq_len if not sparse else a.indices.shape[-1]
  cost = blk.cost_estimate(b=n, hkv=hkv, rows=p.rows.num_rows, keys=keys, dk=q.shape[-1], dv=dv, caches=caches,
                           operands=operands, outputs=out_shape, sparse=sparse)
  return _SplitCall(operands, specs, out_specs, out_shape, cost, layout)


def split_states(p: TritonPlan, q, ends, k, v, arrays: Arrays, *, softmax_scale: float):
  """The split kernel of plan ``p`` (one launch), its outputs as they are: with one split
  (``p.work.final``) the finished ``(out [B, T * Hq, Dv] in the plan's out dtype, lse f32
  [B, T * Hq])``, else the partial states ``(o f32 [n, Hkv, R_p, n_splits, Dv], lse f32
  [n, Hkv, R_p, n_splits])`` (n = B, or the balanced schedule's work items) for a combine.
  Arguments as `run` takes them."""
  c = _split_call(p, q, ends, k, v, arrays)
  compiler_params = None if p.interpret else plgpu.CompilerParams(num_warps=p.launch.warps,
                                                                  num_stages=p.launch.stages)
  return pl.pallas_call(
      functools.partial(split_kernel, plan=p, softmax_scale=softmax_scale, layout=c.layout),
      grid=(p.work.items, (q.shape[2] // p.rows.group) * p.rows.row_blocks, p.work.num_splits), in_specs=c.in_specs,
      out_specs=c.out_specs, out_shape=c.out_shape, compiler_params=compiler_params, cost_estimate=c.cost,
      interpret=p.interpret, name="fdecode_split_kv_triton",
  )(*c.operands)


def split_states_merged(parts):
  """Balanced plans' split kernels in *one* launch: ``parts``, a list of ``(p, q, ends, k,
  v, arrays, softmax_scale)`` (arguments as `split_states` takes them) ->
  each part's partial states, in order. The grid is one axis: each part's programs, its
  work items by its ``Hkv * row_blocks``, one after the other; each program runs its
  part's plan (`fdecode.kernels.triton.kernel.split_kernel` with that part's ids), so no
  program idles. The launch takes the most warps any part's plan asks (a plan's tiles fit
  more warps' registers, not fewer)."""
  plans = [part[0] for part in parts]
  if not all(p.work.balanced for p in plans) or len({p.interpret for p in plans}) != 1:
    raise ValueError(f"split_states_merged takes balanced plans, all interpreted or none: {plans}")
  calls = [_split_call(p, q, ends, k, v, arrays) for p, q, ends, k, v, arrays, _ in parts]
  widths = [(q.shape[2] // p.rows.group) * p.rows.row_blocks for p, q, *_ in parts]
  sizes = [p.work.items * w for p, w in zip(plans, widths)]
  starts = [sum(sizes[:i]) for i in range(len(plans))]
  operands, in_specs, out_specs, out_shape = [], [], [], []
  for c, start, size, width in zip(calls, starts, sizes, widths):
    def remap(f, start=start, size=size, width=width):
      local = lambda i: jnp.clip(i - start, 0, size - 1)
      return lambda i, zero, j: f(local(i) // width, local(i) % width, j)
    operands += c.operands
    in_specs += [pl.BlockSpec(s.block_shape, remap(s.index_map)) for s in c.in_specs]
    out_specs += [pl.BlockSpec(s.block_shape, remap(s.index_map)) for s in c.out_specs]
    out_shape += c.out_shape
  counts = [len(c.operands) for c in calls]
  scales = [scale for *_, scale in parts]

  def kernel(*refs):
    i = pl.program_id(0)  # read outside the branches (the interpreter)
    ins, outs = refs[:len(operands)], refs[len(operands):]
    for n, (p, c, start, size, width, scale) in enumerate(zip(plans, calls, starts, sizes, widths, scales)):
      own = ins[sum(counts[:n]):sum(counts[:n + 1])] + outs[2 * n:2 * n + 2]
      local = i - start
      pl.when((local >= 0) & (local < size))(functools.partial(
          split_kernel, *own, plan=p, softmax_scale=scale, layout=c.layout, ids=(local // width, local % width, 0)))

  cost = pl.CostEstimate(**{f: sum(getattr(c.cost, f) for c in calls)
                            for f in ("flops", "transcendentals", "bytes_accessed")})
  compiler_params = None if plans[0].interpret else plgpu.CompilerParams(
      num_warps=max(p.launch.warps for p in plans), num_stages=max(p.launch.stages for p in plans))
  out = pl.pallas_call(
      kernel, grid=(sum(sizes), 1, 1), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, compiler_params=compiler_params, cost_estimate=cost, interpret=plans[0].interpret,
      name="fdecode_split_kv_triton",
  )(*operands)
  return [tuple(out[2 * n:2 * n + 2]) for n in range(len(plans))]


def run(p: TritonPlan, q, ends, k, v, arrays: Arrays, *, softmax_scale: float):
  """Runs plan ``p``: q ``[B, T, Hq, Dq]`` (any float dtype: cast in the kernel), ``ends``
  int32 ``[B]`` (each sequence's end relative to the cache's first token), the caches and
  the other operands (`Arrays`) -> ``(out [B, T, Hq, Dv] in the plan's out dtype, lse f32
  [B, T, Hq])``. A sparse call's fold (q row b' reads cache row ``b' // fold``) is the
  plan's."""
  b, t, hq, _ = q.shape
  dv = p.columns.dv
  sinks = arrays.sinks
  o, lse = split_states(p, q, ends, k, v, arrays, softmax_scale=softmax_scale)
  if p.work.final:
    return o.reshape(b, t, hq, dv), lse.reshape(b, t, hq)
  # Balanced: the combine merges each sequence's run of items, derived from the same ends.
  out, out_lse = combine(p.combine_plan, o, lse, sinks, ends=ends if p.work.balanced else None)
  return out.reshape(b, t, hq, dv), out_lse.reshape(b, t, hq)
