"""Sparse top-k attention on TPUs (Pallas Mosaic): only the selected tokens are DMA'd.

Grid ``(B', Hkv, n_splits)``, one program per pseudo-sequence and kv head (legend and
canonical index lists in `fdecode.kernels.common.sparse`). The caches (contiguous ``[B, Hkv, S, D]`` or
paged ``[Hkv, P, page_size, D]``) stay in HBM (``memory_space=pl.ANY``). A step covers
``bk`` slots of the program's sorted index list. Each live slot's token is copied by its
own DMA (contiguous: ``k[b // fold, h, pos]``; paged: through the block table) into one
slot of a two-slot VMEM buffer while the other slot computes, as the paged kernel does
with pages (`fdecode.kernels.mosaic_tpu`). Mosaic addresses tiled HBM and VMEM rows in
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

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fdecode.kernels.common import block as blk
from fdecode.kernels.mosaic_tpu.kernel import (all_pieces, block_kv, double_buffered, mod_operands,
                                               partials_shape, partials_specs, query_pieces, store_partials)
from fdecode.kernels.mosaic_tpu.plan import Plan, dma_unit, per_token
from fdecode.kernels.mosaic_tpu.token_major import head_rows
from fdecode.kernels.common.modifiers import Modifiers, window_start
from fdecode.kernels.common.sparse import Sparse, pad_slots, slot_range


def _sparse_kernel(ends_ref, tables_ref, bounds_ref, idx_ref, pos_ref, q_ref, *refs, kinds, paged, fold,
                   heads, softmax_scale, num_splits, bk, unit, seq_len, page_size, num_pages, table_len,
                   num_rows, group, num_tokens, k_pieces, v_pieces, mods, token_major=False, head_axis=False):
  # kinds: for (k, v, k_rope, k_scale, k_offset, v_scale, v_offset, alibi): "stream" (an
  #   HBM ref, DMA'd token by token), "resident" (a VMEM block) or None (absent).
  # refs: the present operands; o [R_p, Dv], lse [R_p, 1]; a VMEM buffer [2, bk * unit, D|nt]
  #   per streamed operand ([2, bk, Hkv, D] for a token-major cache read by `head_axis`);
  #   DMA semaphores [n_streams, 2].
  n_present = sum(kind is not None for kind in kinds)
  present = iter(refs[:n_present])
  srcs = [None if kind is None else next(present) for kind in kinds]
  o_ref, lse_ref, *bufs, sems = refs[n_present:]
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows_p = q_ref.shape[0]
  end = ends_ref[b]
  live_end = jnp.clip(end, 0, seq_len)
  row = (b * heads + (h if heads > 1 else 0)) * 2
  lo, hi = bounds_ref[row], bounds_ref[row + 1]
  first, last = slot_range((lo, hi), split, num_splits, bk)
  streams = [i for i, kind in enumerate(kinds) if kind == "stream"]

  def copy(n, i, pos, slot, j):
    """The DMA of the ``unit`` rows holding position ``pos`` of stream ``i`` into buffer
    rows ``[j * unit, (j + 1) * unit)`` (token-major: see the module docstring)."""
    src = srcs[i]
    aligned = lambda x: x if unit == 1 else pl.multiple_of(x, unit)
    dst = bufs[n].at[slot, pl.ds(aligned(j * unit), unit)]
    seq = b // fold if src.shape[0] > 1 else 0
    if paged:
      page = jnp.clip(tables_ref[b * table_len + jnp.clip(pos // page_size, 0, table_len - 1)],
                      0, num_pages - 1)
      row = pos % page_size
    else:
      row = jnp.clip(pos, 0, seq_len - 1)
    if token_major and i < 3:  # the token's row of heads [Hkv, D]
      token = src.at[page, row] if paged else src.at[seq, row]
      if head_axis:
        return pltpu.make_async_copy(token, bufs[n].at[slot, j], sems.at[n, slot])
      return pltpu.make_async_copy(token.at[pl.ds(aligned(h - h % unit), unit)], dst, sems.at[n, slot])
    head = h if src.shape[1 if not paged else 0] > 1 else 0
    if token_major:  # a head-major float32 scale: the token's row, beside head h's cache row
      row_src = (src.at[head, page if src.shape[1] > 1 else 0, pl.ds(row, 1)] if paged
                 else src.at[seq, head, pl.ds(row, 1)])
      at = j if head_axis else j * unit + h % unit
      return pltpu.make_async_copy(row_src, bufs[n].at[slot, pl.ds(at, 1)], sems.at[n, slot])
    if paged:
      row_src = src.at[head, page if src.shape[1] > 1 else 0, pl.ds(aligned(row - row % unit), unit)]
    else:
      row_src = src.at[seq, head, pl.ds(aligned(row - row % unit), unit)]
    return pltpu.make_async_copy(row_src, dst, sems.at[n, slot])

  def each_live_slot(step, slot, action):
    """Runs ``action`` on the DMA of every stream for each live slot of ``step``."""
    def one(j, carry):
      n_slot = step * bk + j

      @pl.when((n_slot >= lo) & (n_slot < hi))
      def _():
        pos = idx_ref[h if heads > 1 else 0, n_slot]
        for n, i in enumerate(streams):
          action(copy(n, i, pos, slot, j))
      return carry
    lax.fori_loop(0, bk, one, 0)

  start = lambda step, slot: each_live_slot(step, slot, lambda c: c.start())
  wait = lambda step, slot: each_live_slot(step, slot, lambda c: c.wait())
  dtype = q_ref.dtype
  q_pieces = query_pieces(q_ref[...], k_pieces, kinds[2] is not None)
  rows = blk.row_geometry(end, num_rows, rows_p, group, num_tokens, seq_len, mods)
  first_visible = window_start(end, num_tokens, seq_len, mods)
  slopes = None if srcs[7] is None else srcs[7][...]

  def body(step, slot, state):
    buf_of = dict(zip(streams, bufs))
    kx, vx, rx, ks, ko, vs, vo = (buf_of[i][slot] if i in buf_of else None if src is None else src[...]
                                  for i, src in enumerate(srcs[:7]))
    if head_axis:  # [bk, Hkv, D] -> head h's rows
      kx, vx, rx = (None if x is None else head_rows(x, h) for x in (kx, vx, rx))
    kb, vb = block_kv(kx, vx, rx, k_pieces, v_pieces, (ks, ko, vs, vo), dtype)
    kb, bad = blk.guard_values(kb, vb, blk.rows_may_differ(num_tokens, mods))
    s = blk.block_scores(q_pieces, kb, softmax_scale)
    pos_row = pos_ref[pl.ds(step, 1), :]  # [1, bk * unit] the buffer rows' positions
    if token_major and unit > 1 and not head_axis:  # row u of a slot's unit is head h - h % unit + u
      lane = lax.broadcasted_iota(jnp.int32, pos_row.shape, 1)
      pos_row = jnp.where(lane % unit == h % unit, pos_row, seq_len)
    s = blk.modify_scores(s, mods, rows, pos_row, slopes)
    visible, live = blk.sparse_block_masks(rows, pos_row, live_end, first_visible)
    return blk.online_update(state, s, visible, live, vb, bad)

  state = double_buffered(first, last, start, wait, body, blk.init_state(rows_p, v_pieces))
  o_pieces, lse = blk.finalize(state)
  store_partials(o_ref, lse_ref, v_pieces, o_pieces, lse)


def mosaic_sparse_partials(q_rows, ends, k, v, *, indices, index_bounds, sparse: Sparse, num_tokens: int,
                           softmax_scale: float, num_splits: int, plan: Plan, interpret,
                           block_tables=None, k_scale=None, v_scale=None, k_offset=None, v_offset=None,
                           mods: Modifiers = Modifiers(), alibi=None, v_head_dim=None, k_rope=None,
                           mask=None, bias=None, kv_layout="HND", head_axis=False):
  """Per-split partial states over the selected tokens (arguments as
  `fdecode.kernels.mosaic_tpu.mosaic_partials`, plus the canonical ``indices`` ``[B', Hi, K]``,
  ``index_bounds`` ``[B', Hi, 2]`` and ``sparse``; ``plan.block`` slots per step).
  ``kv_layout="NHD"``: k, v and k_rope are token-major (contiguous ``[B, S, Hkv, D]``,
  paged ``[P, page_size, Hkv, D]``), read in place; ``head_axis`` as
  `fdecode.kernels.mosaic_tpu.token_major.sparse_token_major_read` says.

  Returns:
    ``(o, lse)``: float32 ``[B', Hkv, n_splits, R, Dv]`` and ``[B', Hkv, n_splits, R]``.
  """
  del mask, bias  # not combinable with indices (`fdecode.kernels.common.sparse.validate`)
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
  lanes = jnp.arange(unit, dtype=idx.dtype)
  unit_pos = jnp.where((idx[..., None] % unit == lanes) | token_major, idx[..., None], seq_len)
  per_head = lambda h: h if heads > 1 else 0
  kinds, present, in_specs, bufs = [], [], [], []
  for i, a in enumerate((k, v, k_rope, k_scale, k_offset, v_scale, v_offset)):
    if a is None:
      kinds.append(None)
      continue
    if i < 3 or per_token(a, paged=paged):
      if i >= 3 and paged:  # a per-token / per-page scale, made [Hkv|1, P, ps, nt]
        a = jnp.broadcast_to(a, (a.shape[0], num_pages, page_size, a.shape[-1]))
      kinds.append("stream")
      in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
      rows = (bk, a.shape[2]) if head_axis and i < 3 else (bk * unit,)
      bufs.append(pltpu.VMEM((2,) + rows + (a.shape[-1],), a.dtype))
    else:  # per sequence / head / tensor: one resident [1, nt] block
      kinds.append("resident")
      d0, d1 = a.shape[:2]
      if paged:  # [Hkv|1, 1, 1, nt]
        spec = pl.BlockSpec((None, None, 1, a.shape[-1]), lambda i, h, s, *_, d0=d0: (
            h if d0 > 1 else 0, 0, 0, 0))
      else:  # [B|1, Hkv|1, 1, nt]
        spec = pl.BlockSpec((None, None, 1, a.shape[-1]), lambda i, h, s, *_, d0=d0, d1=d1: (
            i // sparse.fold if d0 > 1 else 0, h if d1 > 1 else 0, 0, 0))
      in_specs.append(spec)
    present.append(a)
  mod_ops, mod_specs = mod_operands(dict(mask=None, bias=None, alibi=alibi), num_tokens, plan.rows_p, 0)
  kinds.append("resident" if alibi is not None else None)
  present += mod_ops
  in_specs += [spec((), None) for spec in mod_specs]
  k_pieces, v_pieces = all_pieces(k, v, k_scale, v_scale, v_head_dim)
  kernel = functools.partial(
      _sparse_kernel, kinds=tuple(kinds), paged=paged, fold=sparse.fold, heads=heads,
      softmax_scale=softmax_scale, num_splits=num_splits, bk=bk, unit=unit, seq_len=seq_len, page_size=page_size,
      num_pages=num_pages, table_len=table_len, num_rows=r, group=r // num_tokens,
      num_tokens=num_tokens, k_pieces=k_pieces, v_pieces=v_pieces, mods=mods, token_major=token_major,
      head_axis=head_axis)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(b, hkv, num_splits),
      # The sequence's lists, every head's (an SMEM block takes no partial second-minor dim).
      in_specs=[pl.BlockSpec((None, heads, k_p), lambda i, h, s, *_: (i, 0, 0), memory_space=pltpu.SMEM),
                pl.BlockSpec((None, None, k_p // bk, bk * unit), lambda i, h, s, *_: (i, per_head(h), 0, 0)),
                pl.BlockSpec((None, None, plan.rows_p, dq), lambda i, h, s, *_: (i, h, 0, 0))] + in_specs,
      out_specs=partials_specs(plan.rows_p, dv, lambda i, h, s, *_: (i, h, s, 0, 0)),
      scratch_shapes=bufs + [pltpu.SemaphoreType.DMA((max(len(bufs), 1), 2))],
  )
  operands = (ends.astype(jnp.int32), tables, index_bounds.astype(jnp.int32).reshape(-1), idx,
              unit_pos.reshape(b, heads, k_p // bk, bk * unit), q_rows, *present)
  out_shape = partials_shape(b, hkv, num_splits, plan.rows_p, dv, *operands)
  o, lse = pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel"),
          vmem_limit_bytes=plan.vmem_limit_bytes),
      cost_estimate=blk.cost_estimate(  # each listed token moves its whole DMA unit
          b=b, hkv=hkv, rows=r, keys=k_p * unit, dk=dq, dv=dv, sparse=True,
          caches=[x for x in (k, v, k_rope) if x is not None], operands=operands, outputs=out_shape),
      interpret=interpret, name="fdecode_sparse_mosaic",
  )(*operands)
  return o[:, :, :, :r], lse[:, :, :, :r, 0]
