"""Sparse top-k attention on TPUs (Pallas Mosaic): only the selected tokens are DMA'd.

Grid ``(B', Hkv, n_splits)``, one program per pseudo-sequence and kv head (legend and
canonical index lists in `fdecode.kernels.common.sparse`). The caches (contiguous ``[B, Hkv, S, D]`` or
paged ``[Hkv, P, page_size, D]``) stay in HBM (``memory_space=pl.ANY``). A step covers
``bk`` slots of the program's sorted index list. Each live slot's token is copied by its
own DMA (contiguous: ``k[b // fold, h, pos]``; paged: through the block table) into one
slot of a two-slot VMEM buffer while the other slot computes, as the paged kernel does
with pages (`fdecode.kernels.mosaic_tpu.paged`). Mosaic addresses tiled HBM and VMEM rows in
32-bit sublanes, so a DMA moves the ``unit`` rows holding the token (`dma_unit`: 1 for
32-bit caches, 2 for 16-bit, 4 for 8-bit; libtpu rejects a lone 16-bit row); a buffer
block is ``bk * unit`` rows, and the row of a unit that is not the listed token gets
position S (past every row's end), so it is selected away like any dead slot.

The lists reach the kernel twice: in SMEM (the sequence's ``[Hi, K_p]``; DMA addresses)
and in VMEM as ``[K_p / bk, bk * unit]`` (one row per step: the buffer rows' positions,
for the masks). Slots outside the row's live range are not copied; whatever their
buffer rows hold is selected away (their position is past every row's end, or before
the window), as in every other kernel.

Token-major caches (``kv_layout="NHD"``: contiguous ``[B, S, Hkv, D]``, paged
``[P, page_size, Hkv, D]``) are read in place: a listed token's DMA moves the row of
its heads that the packed sublanes need
(`fdecode.kernels.mosaic_tpu.token_major.sparse_token_major_read`): ``unit`` heads from
``h - h % unit`` (buffer row ``h % unit`` of the slot's unit is head h's, the others
get position S), or the whole head axis into a ``[bk, Hkv, D]`` buffer (``head_axis``),
whose head h is taken after the load. Per-token scales stay head-major (float32): one
row a token, DMA'd beside its cache row.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import Modifiers, window_start
from fdecode.kernels.common.sparse import Sparse, pad_slots, slot_range
from fdecode.kernels.mosaic_tpu.operands import Operand, by_name, flatten
from fdecode.kernels.mosaic_tpu.plan import Plan, dma_unit, per_token
from fdecode.kernels.mosaic_tpu.shared import (CACHES, QUANT, all_pieces, alibi_spec, block_kv, double_buffered,
                                               mod_arrays, partials_shape, partials_specs, query_pieces,
                                               store_partials)
from fdecode.kernels.mosaic_tpu.token_major import head_rows


class SparseOperands(NamedTuple):
  """The sparse kernel's inputs (`Operand` each, None when absent), in the pallas_call's
  order. The caches and per-token scales stay in HBM (``pl.ANY``) and are DMA'd token by
  token (each with its two-slot VMEM buffer); the others arrive as one block per program
  ``(b, h, split)``."""
  ends: Any       # int32 [B']: each pseudo-sequence's end relative to the cache; scalar-prefetched
  tables: Any     # int32 [B' * n]: the block tables, flat ([1] zeros for a contiguous cache); scalar-prefetched
  bounds: Any     # int32 [B' * Hi * 2]: each list's live slots [lo, hi); scalar-prefetched
  idx: Any        # int32 [B', Hi, K_p]: the lists (DMA addresses); block: the sequence's [Hi, K_p] in SMEM
  pos: Any        # int32 [B', Hi, K_p / bk, bk * unit]: the buffer rows' positions; block [K_p / bk, bk * unit]
  q: Any          # [B', Hkv, R_p, Dk]; block [R_p, Dk]
  k: Any          # [B, Hkv, S, Dk] or paged [Hkv, P, ps, Dk]; token-major [B, S, Hkv, Dk] / [P, ps, Hkv, Dk]
  v: Any          # likewise with Dv; None for MLA
  k_rope: Any     # likewise with Dr
  k_scale: Any    # per token: [B|1, Hkv|1, S, nt] / [Hkv|1, P, ps, nt] in HBM; else resident, block [1, nt]
  k_offset: Any
  v_scale: Any
  v_offset: Any
  alibi: Any      # float32 [Hkv, R_p, 1]; block [R_p, 1]


class _Slots(NamedTuple):
  """How the sparse kernel reads its listed tokens (static; the module docstring)."""
  paged: bool
  fold: int         # pseudo-sequences per cache row: the cache row of b is b // fold
  heads: int        # Hi: lists per sequence (1: one list shared by every kv head)
  bk: int           # slots per step
  unit: int         # cache rows per DMA (`dma_unit`; 1 for a whole-head-axis read)
  seq_len: int
  page_size: int
  num_pages: int
  table_len: int
  token_major: bool
  head_axis: bool   # a token-major cache read by the whole head axis


def _token_copy(ins, bufs, sems, n, name, pos, slot, j, *, b, h, slots: _Slots):
  """The DMA of the ``unit`` rows holding position ``pos`` of DMA'd operand ``name`` (the
  n-th) into buffer rows ``[j * unit, (j + 1) * unit)`` (token-major: see the module
  docstring)."""
  unit, paged, token_major = slots.unit, slots.paged, slots.token_major
  src, buf = getattr(ins, name), getattr(bufs, name)
  aligned = lambda x: x if unit == 1 else pl.multiple_of(x, unit)
  dst = buf.at[slot, pl.ds(aligned(j * unit), unit)]
  seq = b // slots.fold if src.shape[0] > 1 else 0
  if paged:
    page = jnp.clip(ins.tables[b * slots.table_len + jnp.clip(pos // slots.page_size, 0, slots.table_len - 1)],
                    0, slots.num_pages - 1)
    row = pos % slots.page_size
  else:
    row = jnp.clip(pos, 0, slots.seq_len - 1)
  if token_major and name in CACHES:  # the token's row of heads [Hkv, D]
    token = src.at[page, row] if paged else src.at[seq, row]
    if slots.head_axis:
      return pltpu.make_async_copy(token, buf.at[slot, j], sems.at[n, slot])
    return pltpu.make_async_copy(token.at[pl.ds(aligned(h - h % unit), unit)], dst, sems.at[n, slot])
  head = h if src.shape[1 if not paged else 0] > 1 else 0
  if token_major:  # a head-major float32 scale: the token's row, beside head h's cache row
    row_src = (src.at[head, page if src.shape[1] > 1 else 0, pl.ds(row, 1)] if paged
               else src.at[seq, head, pl.ds(row, 1)])
    at = j if slots.head_axis else j * unit + h % unit
    return pltpu.make_async_copy(row_src, buf.at[slot, pl.ds(at, 1)], sems.at[n, slot])
  if paged:
    row_src = src.at[head, page if src.shape[1] > 1 else 0, pl.ds(aligned(row - row % unit), unit)]
  else:
    row_src = src.at[seq, head, pl.ds(aligned(row - row % unit), unit)]
  return pltpu.make_async_copy(row_src, dst, sems.at[n, slot])


def _sparse_kernel(ins, bufs, o_ref, lse_ref, sems, *, slots: _Slots, softmax_scale, num_splits, num_rows, group,
                   num_tokens, k_pieces, v_pieces, mods):
  # ins: `SparseOperands` of refs; bufs: the DMA'd operands' VMEM buffers, by the same names
  #   ([2, bk * unit, D|nt]; [2, bk, Hkv, D] for a token-major cache read by `head_axis`);
  #   o [R_p, Dv], lse [R_p, 1]; DMA semaphores [n_streams, 2].
  heads, bk, unit, seq_len = slots.heads, slots.bk, slots.unit, slots.seq_len
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows_p = ins.q.shape[0]
  end = ins.ends[b]
  live_end = jnp.clip(end, 0, seq_len)
  row = (b * heads + (h if heads > 1 else 0)) * 2
  lo, hi = ins.bounds[row], ins.bounds[row + 1]
  first, last = slot_range((lo, hi), split, num_splits, bk)
  streams = [name for name, buf in zip(bufs._fields, bufs) if buf is not None]

  def each_live_slot(step, slot, action):
    """Runs ``action`` on the DMA of every stream for each live slot of ``step``."""
    def one(j, carry):
      n_slot = step * bk + j

      @pl.when((n_slot >= lo) & (n_slot < hi))
      def _():
        pos = ins.idx[h if heads > 1 else 0, n_slot]
        for n, name in enumerate(streams):
          action(_token_copy(ins, bufs, sems, n, name, pos, slot, j, b=b, h=h, slots=slots))
      return carry
    lax.fori_loop(0, bk, one, 0)

  start = lambda step, slot: each_live_slot(step, slot, lambda c: c.start())
  wait = lambda step, slot: each_live_slot(step, slot, lambda c: c.wait())
  dtype = ins.q.dtype
  q_pieces = query_pieces(ins.q[...], k_pieces, ins.k_rope is not None)
  rows = blk.row_geometry(end, num_rows, rows_p, group, num_tokens, seq_len, mods)
  first_visible = window_start(end, num_tokens, seq_len, mods)
  slopes = None if ins.alibi is None else ins.alibi[...]

  def body(step, slot, state):
    def load(name):  # this slot's buffer of a DMA'd operand, or the resident block
      src, buf = getattr(ins, name), getattr(bufs, name)
      return buf[slot] if buf is not None else None if src is None else src[...]
    loaded = {name: load(name) for name in CACHES + QUANT}
    kx, vx, rx = (loaded[name] for name in CACHES)
    if slots.head_axis:  # [bk, Hkv, D] -> head h's rows
      kx, vx, rx = (None if x is None else head_rows(x, h) for x in (kx, vx, rx))
    kb, vb = block_kv(kx, vx, rx, k_pieces, v_pieces, [loaded[name] for name in QUANT], dtype)
    kb, bad = blk.guard_values(kb, vb, blk.rows_may_differ(num_tokens, mods))
    s = blk.block_scores(q_pieces, kb, softmax_scale)
    pos_row = ins.pos[pl.ds(step, 1), :]  # [1, bk * unit] the buffer rows' positions
    if slots.token_major and unit > 1 and not slots.head_axis:  # row u of a slot's unit is head h - h % unit + u
      lane = lax.broadcasted_iota(jnp.int32, pos_row.shape, 1)
      pos_row = jnp.where(lane % unit == h % unit, pos_row, seq_len)
    s = blk.modify_scores(s, mods, rows, pos_row, slopes)
    visible, live = blk.sparse_block_masks(rows, pos_row, live_end, first_visible)
    return blk.online_update(state, s, visible, live, vb, bad)

  state = double_buffered(first, last, start, wait, body, blk.init_state(rows_p, v_pieces))
  o_pieces, lse = blk.finalize(state)
  store_partials(o_ref, lse_ref, v_pieces, o_pieces, lse)


def _cache_operand(a, slots: _Slots):
  """A cache (None when absent), DMA'd token by token: a buffer of ``bk * unit`` rows a
  slot (``[bk, Hkv, D]`` for a whole-head-axis read)."""
  if a is None:
    return None
  rows = (slots.bk, a.shape[2]) if slots.head_axis else (slots.bk * slots.unit,)
  return Operand(a, pl.BlockSpec(memory_space=pl.ANY), pltpu.VMEM((2,) + rows + (a.shape[-1],), a.dtype))


def _scale_operand(a, slots: _Slots):
  """A scale / offset (None when absent): per token, DMA'd token by token beside its cache
  rows; else one resident ``[1, nt]`` block."""
  if a is None:
    return None
  if per_token(a, paged=slots.paged):
    if slots.paged:  # a per-token / per-page scale, made [Hkv|1, P, ps, nt]
      a = jnp.broadcast_to(a, (a.shape[0], slots.num_pages, slots.page_size, a.shape[-1]))
    return Operand(a, pl.BlockSpec(memory_space=pl.ANY), pltpu.VMEM((2, slots.bk * slots.unit, a.shape[-1]), a.dtype))
  d0, d1 = a.shape[:2]  # per sequence / head / tensor
  if slots.paged:  # [Hkv|1, 1, 1, nt]
    return Operand(a, pl.BlockSpec((None, None, 1, a.shape[-1]), lambda i, h, s, *_, d0=d0: (
        h if d0 > 1 else 0, 0, 0, 0)))
  return Operand(a, pl.BlockSpec((None, None, 1, a.shape[-1]), lambda i, h, s, *_, d0=d0, d1=d1, fold=slots.fold: (
      i // fold if d0 > 1 else 0, h if d1 > 1 else 0, 0, 0)))  # [B|1, Hkv|1, 1, nt]


def mosaic_sparse_partials(q_rows, ends, cache, modifier_arrays, lists, *, sparse: Sparse, num_tokens: int,
                           softmax_scale: float, num_splits: int, plan: Plan, interpret,
                           mods: Modifiers = Modifiers(), v_head_dim=None, head_axis=False):
  """Per-split partial states over the selected tokens (arguments as
  `fdecode.kernels.mosaic_tpu.mosaic_partials`, plus ``lists``: the canonical ``indices``
  ``[B', Hi, K]`` and ``index_bounds`` ``[B', Hi, 2]``, and ``sparse``; ``plan.block`` slots
  per step). ``cache.layout`` ``"NHD"``: k, v and k_rope are token-major (contiguous ``[B, S, Hkv, D]``,
  paged ``[P, page_size, Hkv, D]``), read in place; ``head_axis`` as
  `fdecode.kernels.mosaic_tpu.token_major.sparse_token_major_read` says.

  Returns:
    ``(o, lse)``: float32 ``[B', Hkv, n_splits, R, Dv]`` and ``[B', Hkv, n_splits, R]``.
  """
  # No mask or bias: not combinable with indices (`fdecode.kernels.common.sparse.validate`).
  k, v, k_rope, block_tables = cache.k, cache.v, cache.k_rope, cache.block_tables
  k_scale, k_offset, v_scale, v_offset = cache.k_scale, cache.k_offset, cache.v_scale, cache.v_offset
  indices, index_bounds, alibi, kv_layout = lists["indices"], lists["index_bounds"], modifier_arrays["alibi"], cache.layout
  b, hkv, r, dq = q_rows.shape
  paged = block_tables is not None
  bk = plan.block
  token_major = kv_layout == "NHD"
  if paged:
    num_pages, page_size = k.shape[:2] if token_major else k.shape[1:3]
    table_len = block_tables.shape[1]
    seq_len = table_len * page_size
    tables = block_tables.astype(jnp.int32).reshape(-1)
  else:
    num_pages = page_size = table_len = 0
    seq_len = k.shape[1 if token_major else 2]
    tables = jnp.zeros((1,), jnp.int32)
  dv = v_head_dim if v is None else v.shape[-1]
  if plan.rows_p != r:
    q_rows = jnp.pad(q_rows, [(0, 0), (0, 0), (0, plan.rows_p - r), (0, 0)])
  idx = pad_slots(indices, bk, seq_len)
  heads, k_p = idx.shape[1], idx.shape[2]
  unit = 1 if head_axis else dma_unit(k, v, k_rope)
  # Row u of a slot's unit holds position pos if pos % unit == u, else nothing (S);
  # token-major: every row holds pos, the kernel keeps head h's (`_sparse_kernel`).
  lanes = jnp.arange(unit, dtype=idx.dtype).reshape((1,) * idx.ndim + (unit,))  # idx's rank + 1
  unit_pos = jnp.where((idx[..., None] % unit == lanes) | token_major, idx[..., None], seq_len)
  per_head = lambda h: h if heads > 1 else 0
  slots = _Slots(paged=paged, fold=sparse.fold, heads=heads, bk=bk, unit=unit, seq_len=seq_len, page_size=page_size,
                 num_pages=num_pages, table_len=table_len, token_major=token_major, head_axis=head_axis)
  k_pieces, v_pieces = all_pieces(k, v, k_scale, v_scale, v_head_dim)
  scale = lambda a: _scale_operand(a, slots)
  k_scale, k_offset, v_scale, v_offset = scale(k_scale), scale(k_offset), scale(v_scale), scale(v_offset)
  alibi = mod_arrays(None, None, alibi, num_tokens=num_tokens, rows_p=plan.rows_p, positions=0).alibi
  cache = lambda a: _cache_operand(a, slots)
  ops = flatten(SparseOperands(
      ends=Operand(ends.astype(jnp.int32)), tables=Operand(tables),
      bounds=Operand(index_bounds.astype(jnp.int32).reshape(-1)),
      # The sequence's lists, every head's (an SMEM block takes no partial second-minor dim).
      idx=Operand(idx, pl.BlockSpec((None, heads, k_p), lambda i, h, s, *_: (i, 0, 0), memory_space=pltpu.SMEM)),
      pos=Operand(unit_pos.reshape(b, heads, k_p // bk, bk * unit),
                  pl.BlockSpec((None, None, k_p // bk, bk * unit), lambda i, h, s, *_: (i, per_head(h), 0, 0))),
      q=Operand(q_rows, pl.BlockSpec((None, None, plan.rows_p, dq), lambda i, h, s, *_: (i, h, 0, 0))),
      k=cache(k), v=cache(v), k_rope=cache(k_rope), k_scale=k_scale, k_offset=k_offset, v_scale=v_scale,
      v_offset=v_offset, alibi=None if alibi is None else Operand(alibi, alibi_spec(plan.rows_p))))
  kernel = by_name(functools.partial(
      _sparse_kernel, slots=slots, softmax_scale=softmax_scale, num_splits=num_splits, num_rows=r,
      group=r // num_tokens, num_tokens=num_tokens, k_pieces=k_pieces, v_pieces=v_pieces, mods=mods), ops.layout)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=ops.num_scalar_prefetch,
      grid=(b, hkv, num_splits),
      in_specs=ops.in_specs,
      out_specs=partials_specs(plan.rows_p, dv, lambda i, h, s, *_: (i, h, s, 0, 0)),
      scratch_shapes=ops.buffers + [pltpu.SemaphoreType.DMA((max(len(ops.buffers), 1), 2))],
  )
  out_shape = partials_shape(b, hkv, num_splits, plan.rows_p, dv, *ops.arrays)
  o, lse = pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel"),
          vmem_limit_bytes=plan.vmem_limit_bytes),
      cost_estimate=blk.cost_estimate(  # each listed token moves its whole DMA unit
          b=b, hkv=hkv, rows=r, keys=k_p * unit, dk=dq, dv=dv, sparse=True,
          caches=[x for x in (k, v, k_rope) if x is not None], operands=ops.arrays, outputs=out_shape),
      interpret=interpret, name="fdecode_sparse_mosaic",
  )(*ops.arrays)
  return o[:, :, :, :r], lse[:, :, :, :r, 0]
