"""The Mosaic kernel over a contiguous cache ``[B, Hkv, S, D]``: a BlockSpec pipeline over a
kv-step grid axis (`fdecode.kernels.mosaic_tpu.kernel` describes the kernels)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fdecode.kernels.common import block as blk
from fdecode.kernels.mosaic_tpu.operands import Operand, by_name, flatten
from fdecode.kernels.mosaic_tpu.plan import Plan
from fdecode.kernels.mosaic_tpu.shared import (all_pieces, alibi_spec, block_kv, mod_arrays, modify, partials_shape,
                                               partials_specs, query_pieces, store_partials)


class ContiguousOperands(NamedTuple):
  """The contiguous kernel's inputs (`Operand` each, None when absent), in the pallas_call's
  order. Each but ``ends`` arrives as one block per grid step ``(b, h, split, step)``."""
  ends: Any       # int32 [B]: each sequence's end relative to the cache; scalar-prefetched
  q: Any          # [B, Hkv, R_p, Dk]; block [R_p, Dk]
  k: Any          # [B, Hkv, S, Dk]; block [bk, Dk]
  v: Any          # [B, Hkv, S, Dv]; None for MLA
  k_rope: Any     # [B, Hkv, S, Dr]
  k_scale: Any    # [B|1, Hkv|1, S|1, nt]; block [bk|1, nt]
  k_offset: Any
  v_scale: Any
  v_offset: Any
  mask: Any       # int32 [Bm, Hm, M, positions]; block [M, bk]
  bias: Any       # [Bm, Hm, M, positions]; block [M, bk]
  alibi: Any      # float32 [Hkv, R_p, 1]; block [R_p, 1]


def _contiguous_kernel(ins, bufs, o_ref, lse_ref, m_ref, l_ref, *acc_refs, softmax_scale, steps_per_split,
                       num_splits, seq_len, num_rows, group, num_tokens, k_pieces, v_pieces, mods, split_blocks):
  # ins: `ContiguousOperands` of refs; bufs: none (no DMA of its own). o [R_p, Dv], lse [R_p, 1];
  # scratch m [R_p, 1], l [R_p, 1], acc [R_p, w] per value piece.
  del bufs
  b, split, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  rows_p, bk = ins.q.shape[0], ins.k.shape[0]
  end = ins.ends[b]
  live_end = jnp.clip(end, 0, seq_len)
  first, last = blk.split_range(end, split, num_splits, num_tokens, seq_len, bk, mods, split_blocks)
  start = (first + step) * bk

  @pl.when(step == 0)
  def _init():
    acc, m, l = blk.init_state(rows_p, v_pieces)
    m_ref[...], l_ref[...] = m, l
    for ref, a in zip(acc_refs, acc):
      ref[...] = a

  @pl.when(first + step < last)
  def _compute():
    dtype = ins.q.dtype
    q_pieces = query_pieces(ins.q[...], k_pieces, ins.k_rope is not None)
    load = lambda ref: None if ref is None else ref[...]
    kb, vb = block_kv(ins.k[...], load(ins.v), load(ins.k_rope), k_pieces, v_pieces,
                      [load(ins.k_scale), load(ins.k_offset), load(ins.v_scale), load(ins.v_offset)], dtype)
    kb, bad = blk.guard_values(kb, vb, blk.rows_may_differ(num_tokens, mods))
    rows = blk.row_geometry(end, num_rows, rows_p, group, num_tokens, seq_len, mods)
    s = blk.block_scores(q_pieces, kb, softmax_scale)
    loaded = [load(ins.mask), load(ins.bias), load(ins.alibi)]
    s, visible, live = modify(s, mods, rows, start, live_end, bk, loaded, end=end,
                              seq_len=seq_len, group=group, num_tokens=num_tokens)
    state = (tuple(ref[...] for ref in acc_refs), m_ref[...], l_ref[...])
    acc, m, l = blk.online_update(state, s, visible, live, vb, bad, sums_by_dot=split_blocks > 0)
    m_ref[...], l_ref[...] = m, l
    for ref, a in zip(acc_refs, acc):
      ref[...] = a

  @pl.when(step == steps_per_split - 1)
  def _finish():
    o_pieces, lse = blk.finalize((tuple(ref[...] for ref in acc_refs), m_ref[...], l_ref[...]))
    store_partials(o_ref, lse_ref, v_pieces, o_pieces, lse)


def contiguous_call(q_rows, ends, p: Plan, cache, modifier_arrays, *, num_rows, num_tokens, softmax_scale, num_splits,
                    interpret, mods, v_head_dim, split_blocks: int = 0):
  """The contiguous kernel's partials ``(o [B, Hkv, n_splits, R_p, Dv], lse [..., R_p, 1])`` over
  the operands `fdecode.kernels.mosaic_tpu.kernel.mosaic_partials` takes (``cache``: its
  `fdecode.cache.layout.CacheView`, ``modifier_arrays`` the modifiers' mask / bias / alibi)."""
  k, v, k_rope = cache.k, cache.v, cache.k_rope
  k_scale, k_offset, v_scale, v_offset = cache.k_scale, cache.k_offset, cache.v_scale, cache.v_offset
  mask, bias, alibi = (modifier_arrays[n] for n in ("mask", "bias", "alibi"))
  b, hkv, _, dq = q_rows.shape
  r = num_rows
  seq_len = k.shape[2]
  dv = v_head_dim if v is None else v.shape[-1]
  bk = p.block
  num_blocks = pl.cdiv(max(seq_len, 1), bk)
  steps = split_blocks or pl.cdiv(num_blocks, num_splits)

  def kv_block(i, h, split, step, ends_ref):
    # This split's blocks (`block.split_range`); past its last, repeat it (no new DMA).
    first, last = blk.split_range(ends_ref[i], split, num_splits, num_tokens, seq_len, bk, mods, split_blocks)
    return jnp.clip(jnp.minimum(first + step, last - 1), 0, num_blocks - 1)

  def cache(x):
    return None if x is None else Operand(x, pl.BlockSpec(
        (None, None, bk, x.shape[-1]), lambda i, h, s, t, e: (i, h, kv_block(i, h, s, t, e), 0)))

  def scale(a):  # per token: a block of bk rows; else its one row
    if a is None:
      return None
    d0, d1, d2, nt = a.shape
    tok = d2 > 1
    return Operand(a, pl.BlockSpec((None, None, bk if tok else 1, nt), lambda i, h, s, t, e: (
        i if d0 > 1 else 0, h if d1 > 1 else 0, kv_block(i, h, s, t, e) if tok else 0, 0)))

  def rows_of_positions(x):  # a mask / bias [Bm, Hm, M, positions]: this block's positions
    if x is None:
      return None
    bm, hm = x.shape[:2]
    return Operand(x, pl.BlockSpec((None, None, x.shape[2], bk), lambda i, h, *rest: (
        i if bm > 1 else 0, h if hm > 1 else 0, 0, kv_block(i, h, *rest))))

  mask, bias, alibi = mod_arrays(mask, bias, alibi, num_tokens=num_tokens, rows_p=p.rows_p, positions=num_blocks * bk)
  ops = flatten(ContiguousOperands(
      ends=Operand(ends),
      q=Operand(q_rows, pl.BlockSpec((None, None, p.rows_p, dq), lambda i, h, s, t, e: (i, h, 0, 0))),
      k=cache(k), v=cache(v), k_rope=cache(k_rope), k_scale=scale(k_scale), k_offset=scale(k_offset),
      v_scale=scale(v_scale), v_offset=scale(v_offset), mask=rows_of_positions(mask), bias=rows_of_positions(bias),
      alibi=None if alibi is None else Operand(alibi, alibi_spec(p.rows_p))))
  k_pieces, v_pieces = all_pieces(k, v, k_scale, v_scale, v_head_dim)
  kernel = by_name(functools.partial(
      _contiguous_kernel, softmax_scale=softmax_scale, steps_per_split=steps, num_splits=num_splits,
      seq_len=seq_len, num_rows=r, group=r // num_tokens, num_tokens=num_tokens, k_pieces=k_pieces,
      v_pieces=v_pieces, mods=mods, split_blocks=split_blocks), ops.layout)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=ops.num_scalar_prefetch,
      grid=(b, hkv, num_splits, steps),
      in_specs=ops.in_specs,
      out_specs=partials_specs(p.rows_p, dv, lambda i, h, s, t, e: (i, h, s, 0, 0)),
      scratch_shapes=[pltpu.VMEM((p.rows_p, 1), jnp.float32), pltpu.VMEM((p.rows_p, 1), jnp.float32)]
      + [pltpu.VMEM((p.rows_p, vp.width), jnp.float32) for vp in v_pieces],
  )
  out_shape = partials_shape(b, hkv, num_splits, p.rows_p, dv, *ops.arrays)
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=p.vmem_limit_bytes),
      cost_estimate=blk.cost_estimate(b=b, hkv=hkv, rows=r, keys=seq_len, dk=dq, dv=dv,
                                      caches=[x for x in (k, v, k_rope) if x is not None],
                                      operands=ops.arrays, outputs=out_shape),
      interpret=interpret, name="fdecode_split_kv_mosaic",
  )(*ops.arrays)
