"""The GPU backend (Pallas Triton): plan, then run.

`make_plan` (`fdecode.kernels.triton.plan`) decides a call: rows per program, pieces, block,
warps, splits or the balanced schedule, and whether one kernel finishes the output.
`run` takes that plan as it is and launches the split kernel
(`fdecode.kernels.triton.kernel`) and, with several splits, the combine kernel
(`fdecode.kernels.triton.combine`): at most two kernels a call, nothing around them but
free reshapes (a contiguous cache shorter than one block is padded). The balanced schedule
adds no launch: each of its work items (a split-kernel program) derives its sequence and
split from the whole ``ends [B]``, and each combine program its sequence's run of items
(`fdecode.kernels.triton.schedule`); the items read q and the block table in place
(a caller's gathers of them too: `fdecode.kernels.triton.plan.RowSource`).
``interpret=True`` runs the same plan in Pallas' interpreter.

A ragged step (`fdecode.ragged.triton_step`): `split_states_merged` runs its two parts'
balanced plans in one split launch (`merges_parts`), each program deriving its unit from
the step's offsets (`fdecode.kernels.triton.geometry`), and
`fdecode.kernels.triton.step.combine_step` merges both into the packed rows in one more;
`write_rows` (`fdecode.kernels.triton.write`) is its fused cache write, keys and values in
one launch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fdecode.cache.layout import token_axis
from fdecode.kernels.common import block as blk
from fdecode.kernels.common.block import decode_fp8_bits
from fdecode.kernels.common.modifiers import user_form
from fdecode.kernels.triton.combine import CombinePlan, combine, combine_split_major
from fdecode.kernels.triton.kernel import split_kernel
from fdecode.kernels.triton.launch import Launch, block_size, launch_plan
from fdecode.kernels.triton.plan import (RowSource, TritonPlan, combine_width, make_plan, merges_parts, row_tiling,
                                         triton_unsupported)
from fdecode.kernels.triton.schedule import Schedule, balanced_schedule, item_work, sequence_items
from fdecode.kernels.triton.write import WritePlan, write_plan, write_rows
from fdecode.kernels.common.sparse import Sparse, pad_slots

__all__ = ["CombinePlan", "Launch", "RowSource", "Schedule", "TritonPlan", "balanced_schedule", "block_size",
           "combine", "combine_split_major", "combine_width", "decode_fp8_bits", "item_work", "launch_plan",
           "make_plan", "merges_parts", "row_tiling", "run", "split_states", "split_states_merged", "sequence_items", "triton_unsupported", "WritePlan", "write_plan",
           "write_rows"]


def _cache_operands(p: TritonPlan, k, v, k_rope, quant_arrays):
  """The caches as the kernel reads them: a pool's (page, slot) axes merged into one row
  axis (a free reshape); a contiguous cache shorter than one block padded to it; float8
  passed as bytes where the plan decodes bits. Returns (caches, quant arrays, the cache's
  BlockSpec maker)."""
  ax = token_axis(p.kv_layout)
  k, v = (x if bits is None or x is None else lax.bitcast_convert_type(x, jnp.uint8)
          for x, bits in zip((k, v), p.fp8_bits))
  if p.cache_source:  # the whole contiguous caches, flat rows (`kernel.cache_source_rows`), and scales
    k, v, k_rope = (None if x is None else x.reshape(-1, x.shape[-1]) for x in (k, v, k_rope))
    quant_arrays = tuple(None if a is None else a.reshape(-1, a.shape[-1]) for a in quant_arrays)
    return (k, v, k_rope), quant_arrays, lambda d: pl.BlockSpec((k.shape[0], d), lambda i, h, j: (0, 0))
  if p.paged:
    lead = (p.cache_rows, k.shape[ax + 1]) if p.kv_layout == "NHD" else (k.shape[0], p.cache_rows)
    k, v, k_rope = (None if x is None else x.reshape(lead + (x.shape[-1],)) for x in (k, v, k_rope))
    if p.kv_layout == "NHD":
      return (k, v, k_rope), quant_arrays, lambda d: pl.BlockSpec((p.cache_rows, None, d), lambda i, h, j: (0, h, 0))
    return (k, v, k_rope), quant_arrays, lambda d: pl.BlockSpec((None, p.cache_rows, d), lambda i, h, j: (h, 0, 0))
  s = k.shape[ax]
  if s < p.cache_rows:  # a cache shorter than one block: pad it (cheap: < bk tokens)
    pad = lambda axis: [(0, p.cache_rows - s) if i == axis else (0, 0) for i in range(4)]
    k, v, k_rope = (None if x is None else jnp.pad(x, pad(ax)) for x in (k, v, k_rope))
    quant_arrays = tuple(a if a is None or a.shape[2] == 1 else jnp.pad(a, pad(2)) for a in quant_arrays)
  fold = p.sparse_fold
  if p.kv_layout == "NHD":
    spec = lambda d: pl.BlockSpec((None, p.cache_rows, None, d), lambda i, h, j: (i // fold, 0, h, 0))
  else:
    spec = lambda d: pl.BlockSpec((None, None, p.cache_rows, d), lambda i, h, j: (i // fold, h, 0, 0))
  return (k, v, k_rope), quant_arrays, spec


def _quant_spec(p: TritonPlan, x):
  """A canonical rank-4 scale / offset -> (operand, its BlockSpec)."""
  if p.cache_source:  # flat [d0 * d1 * d2, nt] (`_cache_operands`)
    return x, pl.BlockSpec(x.shape, lambda i, h, j: (0, 0))
  d0, d1, d2, nt = x.shape
  if p.paged:  # [Hkv|1, P|1, ps|1, nt] -> [Hkv|1, P|1 * ps|1, nt]
    return x.reshape(d0, d1 * d2, nt), pl.BlockSpec((None, d1 * d2, nt), lambda i, h, j: (h if d0 > 1 else 0, 0, 0))
  fold = p.sparse_fold
  return x, pl.BlockSpec((None, None, d2, nt), lambda i, h, j: (i // fold if d0 > 1 else 0, h if d1 > 1 else 0, 0, 0))


def _operands(p: TritonPlan, q, ends, k, v, *, block_tables, k_rope, quant_arrays, mask, bias, alibi, sinks,
              indices, source):
  """Every operand of the split kernel and its BlockSpec over grid ``(i, h, j)`` (h the kv
  head; the row block is folded in by `run`), in `fdecode.kernels.triton.kernel._take`'s order."""
  operands, specs = [], []
  add = lambda x, spec: (operands.append(x), specs.append(spec))
  whole = lambda x: add(x, pl.BlockSpec(x.shape, lambda i, h, j: (0,) * x.ndim))
  if p.step is not None:  # every unit's geometry, derived from the step's arrays
    for x in source.step:
      whole(x.astype(jnp.int32).reshape(-1))
  elif p.balanced:  # every item derives its work from all ends
    whole(ends.astype(jnp.int32))
  else:
    add(ends.astype(jnp.int32), pl.BlockSpec((1,), lambda i, h, j: (i,)))
  if p.step is not None and p.paged:  # the step's tables, read at each unit's sequence
    whole((block_tables if source.tables is None else source.tables).astype(jnp.int32).reshape(-1))
  elif p.table_source:  # a RowSource's tables, read at its table rows
    whole(source.tables.astype(jnp.int32).reshape(-1))
    whole(source.table_rows.astype(jnp.int32))
  elif p.paged and p.balanced:  # an item reads its sequence's table row in place
    whole(block_tables.astype(jnp.int32).reshape(-1))
  elif p.paged:
    add(block_tables.astype(jnp.int32), pl.BlockSpec((None, p.table_len), lambda i, h, j: (i, 0)))
  if p.cache_row_list:  # a RowSource's cache rows
    whole(source.cache_rows.astype(jnp.int32))
  if p.sparse:
    idx = pad_slots(indices, p.block, p.seq_len)
    per_head = lambda h: h if idx.shape[1] > 1 else 0
    add(idx, pl.BlockSpec((None, None, idx.shape[2]), lambda i, h, j: (i, per_head(h), 0)))
    # (index_bounds: counted by the kernel from the sorted list, `kernel._index_bounds`)
  tq = p.num_tokens * p.hq
  if p.q_source:  # the packed rows, read from the RowSource's first rows
    whole(source.q.reshape(-1, source.q.shape[-1]))
    if p.step is None:
      whole(source.q_start.astype(jnp.int32))
  elif p.balanced:
    whole(q.reshape(q.shape[0] * tq, q.shape[-1]))
  else:
    add(q.reshape(q.shape[0], tq, q.shape[-1]), pl.BlockSpec((None, tq, q.shape[-1]), lambda i, h, j: (i, 0, 0)))
  caches, quant_arrays, cache_spec = _cache_operands(p, k, v, k_rope, quant_arrays)
  for x in caches:  # MLA: no v operand, the values are read from k
    if x is not None:
      add(x, cache_spec(x.shape[-1]))
  for a in quant_arrays:
    if a is not None:
      add(*_quant_spec(p, a))
  if p.step is not None:  # a step's per-row arrays, whole: [Nm * Hm, S] (`kernel.step_mod_rows`)
    for x, form in zip((source.mask, source.bias), p.step_mods):
      if form is not None:
        whole(x.reshape(form[0] * form[1], x.shape[-1]))
    mask = bias = None
  for x in (mask, bias):  # read in place (a bool mask as it is)
    if x is not None:
      bm, hm, tm, gm, s = x.shape
      if hm * gm > 1:  # per query head: the caller's [Bm, Tm, Hq, S] (the canonical form's transpose undone,
        # which XLA folds away), its rows gathered by the program (`kernel.mod_rows`)
        add(user_form(x).reshape(bm, tm * p.hq, s), pl.BlockSpec((None, tm * p.hq, s), lambda i, h, j, bm=bm: (
            i if bm > 1 else 0, 0, 0)))
      else:  # one row per token, shared by the heads: [Bm, Tm, S]
        add(x.reshape(bm, tm, s), pl.BlockSpec((None, tm, s), lambda i, h, j, bm=bm: (i if bm > 1 else 0, 0, 0)))
  for x in (alibi, sinks if p.final else None):  # per query head, f32 [Hq]
    if x is not None:
      add(x.reshape(p.hq), pl.BlockSpec((p.hq,), lambda i, h, j: (0,)))
  return operands, specs, [x for x in caches if x is not None]


class _SplitCall(NamedTuple):
  """One plan's split launch, unlaunched: operands, their BlockSpecs and the outputs' (over
  grid ``(n, Hkv * row_blocks, n_splits)``), the output types and the cost."""
  operands: list
  in_specs: list
  out_specs: list
  out_shape: list
  cost: pl.CostEstimate


def _split_call(p: TritonPlan, q, ends, k, v, *, block_tables=None, k_scale=None, v_scale=None, k_offset=None,
                v_offset=None, mask=None, bias=None, alibi=None, sinks=None, k_rope=None, indices=None,
                index_bounds=None, source: RowSource | None = None, **unused) -> _SplitCall:
  del unused, index_bounds  # softmax_scale, sparse: the kernel's; the bounds it counts itself
  b, t, hq, _ = q.shape
  operands, specs, caches = _operands(
      p, q, ends, k, v, block_tables=block_tables, k_rope=k_rope,
      quant_arrays=(k_scale, k_offset, v_scale, v_offset), mask=mask, bias=bias, alibi=alibi, sinks=sinks,
      indices=indices, source=source)
  n, hkv, rb, dv = p.items, hq // p.group, p.row_blocks, p.dv
  specs = [pl.BlockSpec(s.block_shape, lambda i, hr, j, f=s.index_map: f(i, hr // rb, j)) for s in specs]
  if p.final:
    out_specs = [pl.BlockSpec((None, t * hq, dv), lambda i, hr, j: (i, 0, 0)),
                 pl.BlockSpec((None, t * hq), lambda i, hr, j: (i, 0))]
    out_shape = [blk.out_struct((n, t * hq, dv), jnp.dtype(p.out_dtype), *operands),
                 blk.out_struct((n, t * hq), jnp.float32, *operands)]
  else:
    rows = lambda i, hr, j: (i, hr // rb, hr % rb, j)
    out_specs = [pl.BlockSpec((None, None, p.block_r, None, dv), lambda i, hr, j: rows(i, hr, j) + (0,)),
                 pl.BlockSpec((None, None, p.block_r, None), rows)]
    out_shape = [blk.out_struct((n, hkv, p.rows_padded, p.num_splits, dv), jnp.float32, *operands),
                 blk.out_struct((n, hkv, p.rows_padded, p.num_splits), jnp.float32, *operands)]
  keys = p.seq_len if not p.sparse else indices.shape[-1]
  cost = blk.cost_estimate(b=n, hkv=hkv, rows=p.num_rows, keys=keys, dk=q.shape[-1], dv=dv, caches=caches,
                           operands=operands, outputs=out_shape, sparse=p.sparse)
  return _SplitCall(operands, specs, out_specs, out_shape, cost)


def split_states(p: TritonPlan, q, ends, k, v, *, softmax_scale: float, **arrays):
  """The split kernel of plan ``p`` (one launch), its outputs as they are: with one split
  (``p.final``) the finished ``(out [B, T * Hq, Dv] in p.out_dtype, lse f32 [B, T * Hq])``,
  else the partial states ``(o f32 [n, Hkv, R_p, n_splits, Dv], lse f32 [n, Hkv, R_p,
  n_splits])`` (n = B, or the balanced schedule's work items) for a combine. Arguments as
  `run` takes them."""
  c = _split_call(p, q, ends, k, v, **arrays)
  compiler_params = None if p.interpret else plgpu.CompilerParams(num_warps=p.warps, num_stages=p.stages)
  return pl.pallas_call(
      functools.partial(split_kernel, plan=p, softmax_scale=softmax_scale),
      grid=(p.items, (q.shape[2] // p.group) * p.row_blocks, p.num_splits), in_specs=c.in_specs,
      out_specs=c.out_specs, out_shape=c.out_shape, compiler_params=compiler_params, cost_estimate=c.cost,
      interpret=p.interpret, name="fdecode_split_kv_triton",
  )(*c.operands)


def split_states_merged(parts):
  """Balanced plans' split kernels in *one* launch: ``parts``, a list of ``(p, q, ends, k,
  v, arrays)`` (arguments as `split_states` takes them, ``softmax_scale`` in ``arrays``) ->
  each part's partial states, in order. The grid is one axis: each part's programs, its
  work items by its ``Hkv * row_blocks``, one after the other; each program runs its
  part's plan (`fdecode.kernels.triton.kernel.split_kernel` with that part's ids), so no
  program idles. The launch takes the most warps any part's plan asks (a plan's tiles fit
  more warps' registers, not fewer)."""
  plans = [part[0] for part in parts]
  if not all(p.balanced for p in plans) or len({p.interpret for p in plans}) != 1:
    raise ValueError(f"split_states_merged takes balanced plans, all interpreted or none: {plans}")
  calls = [_split_call(p, q, ends, k, v, **arrays) for p, q, ends, k, v, arrays in parts]
  widths = [(q.shape[2] // p.group) * p.row_blocks for p, q, *_ in parts]
  sizes = [p.items * w for p, w in zip(plans, widths)]
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
  scales = [arrays["softmax_scale"] for *_, arrays in parts]

  def kernel(*refs):
    i = pl.program_id(0)  # read outside the branches (the interpreter)
    ins, outs = refs[:len(operands)], refs[len(operands):]
    for n, (p, start, size, width, scale) in enumerate(zip(plans, starts, sizes, widths, scales)):
      own = ins[sum(counts[:n]):sum(counts[:n + 1])] + outs[2 * n:2 * n + 2]
      local = i - start
      pl.when((local >= 0) & (local < size))(functools.partial(
          split_kernel, *own, plan=p, softmax_scale=scale, ids=(local // width, local % width, 0)))

  cost = pl.CostEstimate(**{f: sum(getattr(c.cost, f) for c in calls)
                            for f in ("flops", "transcendentals", "bytes_accessed")})
  compiler_params = None if plans[0].interpret else plgpu.CompilerParams(
      num_warps=max(p.warps for p in plans), num_stages=max(p.stages for p in plans))
  out = pl.pallas_call(
      kernel, grid=(sum(sizes), 1, 1), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, compiler_params=compiler_params, cost_estimate=cost, interpret=plans[0].interpret,
      name="fdecode_split_kv_triton",
  )(*operands)
  return [tuple(out[2 * n:2 * n + 2]) for n in range(len(plans))]


def run(p: TritonPlan, q, ends, k, v, *, sinks=None, **arrays):
  """Runs plan ``p``: q ``[B, T, Hq, Dq]`` (any float dtype: cast in the kernel), ``ends``
  int32 ``[B]`` (each sequence's end relative to the cache's first token), the caches and
  their canonical scales / modifier arrays (`fdecode.dispatch`: ``softmax_scale``,
  ``block_tables``, ``k_scale``, ``v_scale``, ``k_offset``, ``v_offset``, ``mask``, ``bias``,
  ``alibi``, ``sinks``, ``k_rope``, ``indices`` (sorted index lists, repeats kept:
  `fdecode.kernels.common.sparse.canonicalize`'s ``runs``), ``index_bounds`` (not read: the
  kernel counts its own from the lists)) -> ``(out [B, T, Hq, Dv] in p.out_dtype, lse f32
  [B, T, Hq])``. ``sparse``: a sparse call's fold (q row b' reads
  cache row ``b' // fold``). ``source``: the `RowSource` of a plan made with it (q is then
  its gather, read only for its shape; so is block_tables where the source has table rows)."""
  b, t, hq, _ = q.shape
  o, lse = split_states(p, q, ends, k, v, sinks=sinks, **arrays)
  if p.final:
    return o.reshape(b, t, hq, p.dv), lse.reshape(b, t, hq)
  # Balanced: the combine merges each sequence's run of items, derived from the same ends.
  out, out_lse = combine(p.combine_plan, o, lse, sinks, ends=ends if p.balanced else None)
  return out.reshape(b, t, hq, p.dv), out_lse.reshape(b, t, hq)
