"""FlashDecode split-KV kernel for GPUs (Pallas Triton), run as its `TritonPlan` says.

Grid ``(B, Hkv * row_blocks, n_splits)``. One program owns one kv head of one sequence,
one block of its query rows and one contiguous range of ``bk``-token blocks; the R = T*G
query rows of that kv head are the rows of its matmuls (heads packed into the row
dimension, as in Tenstorrent's sdpa_decode), so every cache byte is read once per row
block. Inside a split the program runs an online softmax over blocks
(`fdecode.kernels.common.block`). The loop runs only over blocks below the sequence's end:
splits and blocks past it do no work and load nothing.

Queries are read in place from ``q [B, T * Hq, Dq]`` (row r = t * G + g of kv head h is
q row ``t * Hq + h * G + g``), cast to the compute dtype in the kernel; rows past R load a
real row and see nothing. A balanced work item (axis 0) derives its sequence, split and
split count from the whole ``ends [B]`` (`fdecode.kernels.triton.schedule.item_work`) and
reads its sequence's rows of the whole ``q [B * T * Hq, Dq]`` and block table ``[B * n]``
(read through a `fdecode.kernels.triton.plan.RowSource`, the packed ``q [N * Hq, Dq]`` and
tables ``[M * n]`` at the rows its indices name). Outputs: with
one split (``plan.final``) the kernel writes the finished output ``[B, T * Hq, Dv]`` in the
output dtype and the lse ``[B, T * Hq]`` (sinks applied), its stores masked to the real
rows; otherwise partial states
``[B, Hkv, R_p, n_splits, Dv]`` / ``[B, Hkv, R_p, n_splits]`` for the combine kernel.

How blocks are read (always in place: no per-call copy or transpose of the cache):

* contiguous ``[B, Hkv, S, D]``: block j covers tokens ``[j*bk, (j+1)*bk)`` but is loaded
  from ``min(j*bk, S - bk)``; slots before ``j*bk`` are masked, so a tail needs no padding.
* paged ``[Hkv, P, page_size, D]``: the pool is viewed as ``[Hkv, P*page_size, D]`` (a free
  reshape) and a block *gathers* its ``bk`` token rows through the block table (ids
  clipped into the pool). A block spans several pages of any size, page size 1 included.
* a contiguous cache read through a `RowSource`'s cache rows (`fdecode.ragged`'s prefill
  blocks, each over its sequence's row of the whole caches): the caches are viewed flat
  (a free reshape) and a block gathers its ``bk`` rows at its sequence row and kv head
  (`cache_source_rows`), as from one page of S tokens.
* token-major caches (``NHD``): a program's block spec takes its kv head's rows at the
  cache's own strides; the body is the same.
* head dims in power-of-two column pieces (`fdecode.kernels.common.block.head_pieces`).
* 8-bit caches: each piece is dequantized right after its load with its tile's scale;
  below sm_89 a float8 cache arrives as bytes and is decoded with integer ops.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fdecode.combine import add_sink
from fdecode.kernels.common import block as blk
from fdecode.kernels.common.block import decode_fp8_bits
from fdecode.kernels.triton.geometry import unit_ends, unit_rows
from fdecode.kernels.triton.plan import TritonPlan
from fdecode.kernels.triton.schedule import item_work, load_ends
from fdecode.kernels.common.modifiers import window_start
from fdecode.kernels.common.sparse import slot_range


def _take(refs, plan: TritonPlan, ids):
  """The kernel's refs by name, in the operand order of `fdecode.kernels.triton.run`;
  ``ids``: the program's grid indices."""
  refs, mods = list(refs), plan.mods
  pop = lambda cond=True: refs.pop(0) if cond else None
  r = types.SimpleNamespace()
  step = plan.step
  r.step = None if step is None else (pop(), pop(), pop())  # cu, kv_lens, num_seqs
  r.end = pop(step is None)
  r.table, r.table_rows = pop(plan.paged), pop(plan.table_source and step is None)
  r.cache_rows = pop(plan.cache_row_list)
  r.idx = pop(plan.sparse)
  r.q, r.q_start = pop(), pop(plan.q_source and step is None)
  r.k, r.v, r.rope = pop(), pop(not plan.v_from_k), pop(bool(plan.r_pieces))
  r.quant = [pop(dims is not None) for dims in plan.quant]
  r.mask, r.bias, r.alibi = pop(bool(mods.mask)), pop(bool(mods.bias)), pop(bool(mods.alibi))
  r.sinks = pop(plan.final and plan.has_sinks)
  r.o, r.lse = refs
  if step is not None:  # this program's work item, from every unit's end, derived from the step
    r.seq, r.split, r.count, r.end_value = item_work(unit_ends(*r.step, step), ids[0], plan.schedule)
  elif plan.balanced:  # this program's work item, derived from every sequence's end (ends [B])
    r.seq, r.split, r.count, r.end_value = item_work(load_ends(r.end, plan.schedule), ids[0],
                                                     plan.schedule)
  else:
    r.seq, r.split, r.count, r.end_value = None, ids[2], plan.num_splits, r.end[0]
  # Balanced: q and the block table are whole arrays, flattened; through a RowSource q
  # (and the tables, with table rows) too. The program reads its sequence's rows
  # (`q_source_rows`, ``table_base``); otherwise its BlockSpecs select them.
  b = ids[0] if r.seq is None else r.seq
  r.batch_index = b
  r.q_base = 0 if r.seq is None else r.seq * (plan.num_tokens * plan.hq)
  if step is not None:  # the unit's sequence (its table / cache row) and first q row
    row, r.q_first, _ = unit_rows(*r.step, step, b)
  else:
    row, r.q_first = (None if r.cache_rows is None else r.cache_rows[b]), (r.q_start[b] if plan.q_source else None)
  if step is not None and plan.paged:
    r.table_base = row * plan.table_len
  elif plan.table_source:
    r.table_base = jnp.clip(r.table_rows[b], 0, r.table.shape[0] // plan.table_len - 1) * plan.table_len
  else:
    r.table_base = 0 if r.seq is None else r.seq * plan.table_len
  if plan.cache_source:  # this sequence's row of the whole contiguous caches, this program's kv head
    r.cache_row = jnp.clip(b if row is None else row, 0, plan.cache_batch - 1)
    r.kv_head = ids[1] // plan.row_blocks
  return r


def cache_source_rows(plan: TritonPlan, r, pos):
  """Rows of the flat whole contiguous caches (`fdecode.kernels.triton._cache_operands`:
  HND ``[M * Hkv * S, D]``, NHD ``[M * S * Hkv, D]``) holding this program's sequence's
  (``r.cache_row``) kv head (``r.kv_head``) at positions ``pos`` (int32, in ``[0, S)``)."""
  h, hkv, s = r.kv_head, plan.hq // plan.group, plan.seq_len
  if plan.kv_layout == "NHD":
    return (r.cache_row * s + pos) * hkv + h
  return (r.cache_row * hkv + h) * s + pos


def _cache_source_quant_index(plan: TritonPlan, dims, r, pos):
  """Row of a flat whole scale / offset ``[d0 * d1 * d2, nt]`` (canonical dims ``(d0, d1,
  d2)``: ``M|1, Hkv|1, S|1``) for positions ``pos`` of this program's sequence and kv head."""
  d0, d1, d2 = dims
  base = ((r.cache_row if d0 > 1 else 0) * d1 + (r.kv_head if d1 > 1 else 0)) * d2
  return base + pos if d2 > 1 else pl.ds(base, 1)


def q_source_rows(plan: TritonPlan, r, q_row):
  """Rows of the q operand holding the call's q rows ``q_row`` (``t * Hq + head``, int32):
  with a RowSource, row ``(b, t)`` is packed row ``q_start[b] + t`` (clipped into the
  packed rows) of ``q [N * Hq, Dq]``; else row ``q_base + q_row``."""
  if not plan.q_source:
    return r.q_base + q_row
  t, head = q_row // plan.hq, q_row % plan.hq
  packed = jnp.clip(r.q_first + t, 0, r.q.shape[0] // plan.hq - 1)
  return packed * plan.hq + head


def row_ids(plan: TritonPlan, h, first_row, shape):
  """For a program's rows (int32 iota of ``shape``, leading dim ``block_r``): ``(valid,
  head_col, q_row)``: the row is real (r < R); its query head ``h * G + g``; its row of
  ``q [T * Hq, Dq]``, ``t * Hq + h * G + g`` (a padding row: row 0 of the head's group)."""
  r = first_row + lax.broadcasted_iota(jnp.int32, shape, 0)
  valid = r < plan.num_rows
  head = h * plan.group + r % plan.group
  q_row = jnp.where(valid, (r // plan.group) * plan.hq + head, h * plan.group)
  return valid, jnp.where(valid, head, h * plan.group), q_row


def mod_rows(plan: TritonPlan, tm: int, per_head: bool, h, first_row):
  """int32 ``[R_p, 1]``: the row of a mask / bias operand (`fdecode.kernels.triton._operands`:
  ``[Tm, S]`` shared by the heads, or ``per_head`` the caller's ``[Tm * Hq, S]``) that each of
  the program's rows r = t * G + g of kv head ``h`` reads: ``t`` (0 when Tm = 1), times Hq
  plus its query head ``h * G + g`` when per head. A padding row (r >= R) reads a real row
  and is never stored."""
  r = first_row + lax.broadcasted_iota(jnp.int32, (plan.block_r, 1), 0)
  t = jnp.minimum(r // plan.group, plan.num_tokens - 1) if tm > 1 else jnp.zeros_like(r)
  return t * plan.hq + h * plan.group + r % plan.group if per_head else t


def step_mod_rows(plan: TritonPlan, form, r, h, first_row):
  """int32 ``[R_p, 1]``: for a ragged step's unit, the row of a per-row mask / bias
  operand (`fdecode.kernels.triton._operands`: the step's ``[Nm * Hm, S]``, ``form`` ``(Nm,
  Hm)``) that each of the program's rows r = t * G + g of kv head ``h`` reads: its packed
  row ``q_first + t`` (clipped into the array; 0 when Nm = 1), times Hm plus its query
  head when per head. Rows the unit's sequence does not own (a prefill block's rows
  before it) and padding rows read a real row and are never stored."""
  nm, hm = form
  rows = first_row + lax.broadcasted_iota(jnp.int32, (plan.block_r, 1), 0)
  t = jnp.minimum(rows // plan.group, plan.num_tokens - 1)
  packed = jnp.clip(r.q_first + t, 0, nm - 1) if nm > 1 else jnp.zeros_like(t)
  return packed * hm + (h * plan.group + rows % plan.group if hm > 1 else 0)


def _index_bounds(idx_ref, bk: int, first_visible, live_end):
  """``(lo, hi)``: the slots of a sorted index list ``[Kp]`` (`fdecode.kernels.common.sparse.canonicalize`'s
  ``runs``, padded: Kp a multiple of ``bk``) that some row may see, ``#(pos <
  first_visible)`` and ``#(pos < live_end)`` (repeats counted, as slots of this list: the
  positions they span are those of the bounds XLA counts on the deduplicated lists for the
  other paths), in ``bk``-slot steps: no XLA reduction launched before the kernel. Each
  program reads its whole list here (splits x K reads in all, against K for a count in
  XLA: a few KB, beside the K cache rows the lists select)."""
  def count(j, acc):
    pos = idx_ref[pl.ds(j * bk, bk)]
    return (acc[0] + jnp.sum((pos < first_visible).astype(jnp.int32)),
            acc[1] + jnp.sum((pos < live_end).astype(jnp.int32)))
  lo, hi = lax.fori_loop(0, idx_ref.shape[0] // bk, count, (jnp.int32(0), jnp.int32(0)))
  return jnp.minimum(lo, hi), hi


def _firsts(idx_ref, start, shape):
  """bool of ``shape`` (``[1, bk]`` for the scores, ``[bk, 1]`` for the value rows): slot
  ``start + j`` of a sorted index list holds its position's first slot (a repeat of the
  slot before it is selected away: a position counts once). Each layout is loaded and
  compared in place: a boolean made from loaded values cannot change layout (through
  shared memory, which holds no 1-bit elements; Triton refused the kernel that did)."""
  j = start + lax.broadcasted_iota(jnp.int32, shape, 0 if shape[1] == 1 else 1)
  return (j == 0) | (idx_ref[jnp.maximum(j - 1, 0)] != idx_ref[j])


def _cols(offset: int, width: int):
  return offset + lax.broadcasted_iota(jnp.int32, (1, width), 1)


def _load_piece(ref, index, piece, quant_refs, quant_index, dtype, fp8_bits=None):
  """Loads one column piece ``[bk, w]`` of a cache block and dequantizes it (``fp8_bits``:
  the ref holds the bytes of that float8 dtype)."""
  x = ref[index, pl.ds(piece.offset, piece.width)]
  if fp8_bits is not None:
    x = decode_fp8_bits(x, fp8_bits)
  scale_ref, offset_ref = quant_refs
  if scale_ref is None:
    return x.astype(dtype)
  col = pl.ds(piece.tile, 1)
  scale = scale_ref[quant_index[0], col]
  offset = None if offset_ref is None else offset_ref[quant_index[1], col]
  return blk.dequantize_piece(x, scale, offset, dtype)


def _quant_index(plan: TritonPlan, dims, start, page, slot, r=None):
  """Row index into a scale / offset ref for this block (a cache source's: ``slot`` holds
  the block's positions)."""
  if dims is None:
    return None
  if plan.cache_source:
    return _cache_source_quant_index(plan, dims, r, slot)
  if plan.sparse and not plan.paged:  # per-token scales: the gathered rows
    return pl.ds(0, 1) if dims[0] == 1 else start
  if plan.paged:
    pages, slots = dims
    if pages == 1 and slots == 1:
      return pl.ds(0, 1)
    return (page if pages > 1 else 0) * slots + (slot if slots > 1 else 0)
  return pl.ds(0, 1) if dims[0] == 1 else pl.ds(start, plan.block)


def _block_index(plan: TritonPlan, r, start, live_end):
  """Where block ``start`` is loaded from: ``(pos [bk] | None, load_start | None, index,
  page, slot)`` (sparse: the listed positions; paged: rows gathered through the table)."""
  bk = plan.block
  if plan.sparse:  # slot j holds the key at position idx[j]: gather its row
    pos = r.idx[pl.ds(start, bk)]
    if plan.paged:
      page = jnp.clip(r.table[r.table_base + jnp.clip(pos // plan.page_size, 0, plan.table_len - 1)], 0,
                      plan.num_pages - 1)
      slot = pos % plan.page_size
      return pos, None, page * plan.page_size + slot, page, slot
    index = jnp.clip(pos, 0, plan.cache_rows - 1)
    return pos, index, index, None, None
  if plan.cache_source:  # its sequence's cache row, gathered like a pool's single page
    slot = jnp.minimum(start + lax.iota(jnp.int32, bk), plan.seq_len - 1)
    return None, start, cache_source_rows(plan, r, slot), None, slot
  if plan.paged:
    pos = start + lax.iota(jnp.int32, bk)
    page = jnp.clip(r.table[r.table_base + jnp.minimum(pos // plan.page_size, plan.table_len - 1)], 0,
                    plan.num_pages - 1)
    slot = pos % plan.page_size
    return None, start, page * plan.page_size + slot, page, slot
  load_start = jnp.minimum(start, plan.cache_rows - bk)
  return None, load_start, pl.ds(load_start, bk), None, None


def _load_block(plan: TritonPlan, r, index, qi, dtype):
  """(k pieces + k_rope pieces, v pieces) of one block, dequantized to ``dtype``."""
  k_bits, v_bits = plan.fp8_bits
  k_pieces = [_load_piece(r.k, index, p, r.quant[0:2], qi[0:2], dtype, k_bits) for p in plan.k_pieces]
  if plan.v_from_k:  # MLA: a value piece is the loaded key piece itself (one read)
    loaded = dict(zip(plan.k_pieces, k_pieces))
    v_pieces = [loaded[p] if p in loaded else _load_piece(r.k, index, p, r.quant[0:2], qi[0:2], dtype, k_bits)
                for p in plan.v_pieces]
  else:
    v_pieces = [_load_piece(r.v, index, p, r.quant[2:4], qi[2:4], dtype, v_bits) for p in plan.v_pieces]
  k_pieces += [_load_piece(r.rope, index, p, (None, None), None, dtype) for p in plan.r_pieces]
  return k_pieces, v_pieces


def split_kernel(*refs, plan: TritonPlan, softmax_scale: float, ids=None):
  """One program: its rows' state over its split's blocks, stored final or partial.
  ``ids``: its grid indices (item or sequence, kv head * row blocks + row block, split);
  None: the launch's own (`fdecode.kernels.triton.split_states_merged` runs two plans in
  one grid, each program taking its plan's share)."""
  ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2)) if ids is None else ids
  r = _take(refs, plan, ids)
  mods, bk, rows_p = plan.mods, plan.block, plan.block_r
  h = ids[1] // plan.row_blocks
  first_row = (ids[1] % plan.row_blocks) * rows_p
  dtype = jnp.dtype(plan.compute_dtype)
  end = r.end_value
  live_end = jnp.clip(end, 0, plan.seq_len)
  rows = blk.row_geometry(end, plan.num_rows, rows_p, plan.group, plan.num_tokens, plan.seq_len, mods, first_row)
  first_visible = window_start(end, plan.num_tokens, plan.seq_len, mods)
  valid, head, q_row = row_ids(plan, h, first_row, (rows_p, 1))
  dk_own = plan.k_pieces[-1].offset + plan.k_pieces[-1].width
  q_src = q_source_rows(plan, r, q_row)
  q_pieces = ([r.q[q_src, _cols(p.offset, p.width)].astype(dtype) for p in plan.k_pieces]
              + [r.q[q_src, _cols(dk_own + p.offset, p.width)].astype(dtype) for p in plan.r_pieces])
  slopes = None if r.alibi is None else r.alibi[head].astype(jnp.float32)
  if plan.sparse:
    first, last = slot_range(_index_bounds(r.idx, bk, first_visible, live_end), ids[2], plan.num_splits, bk)
  else:
    first, last = blk.split_range(end, r.split, r.count, plan.num_tokens, plan.seq_len, bk, mods)

  def by_rows(ref, form, load_start, step_form):
    """A mask / bias block for the rows: ``[R_p | 1, bk]``, gathered by row (`mod_rows`; a
    step's at packed rows, `step_mod_rows`); columns past the array (a tail block's
    positions past S, never visible) read its last column."""
    cols = jnp.minimum(load_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1), ref.shape[-1] - 1)
    if step_form is not None and ref.shape[0] > 1:
      return ref[step_mod_rows(plan, step_form, r, h, first_row), cols]
    if ref.shape[0] == 1:  # one row for every program row (a per-head one of MHA is form (1, 1) too)
      return ref[jnp.zeros((1, 1), jnp.int32), cols]
    return ref[mod_rows(plan, form[0], ref.shape[0] == form[0] * plan.hq, h, first_row), cols]

  guard = blk.rows_may_differ(plan.num_tokens, mods)

  def body(j, state):
    start = j * bk
    pos, load_start, index, page, slot = _block_index(plan, r, start, live_end)
    qi = [_quant_index(plan, d, load_start, page, slot, r) for d in plan.quant]
    k_pieces, v_pieces = _load_block(plan, r, index, qi, dtype)
    s = blk.block_scores(q_pieces, k_pieces, softmax_scale)
    if plan.sparse:
      s = blk.modify_scores(s, mods, rows, pos[None, :], slopes)
      visible, live = blk.sorted_slot_masks(rows, pos[None, :], live_end, first_visible, bk)
      # A repeated position attends once: its first slot only.
      visible, live = visible & _firsts(r.idx, start, (1, bk)), live & _firsts(r.idx, start, (bk, 1))
      return blk.online_update(state, s, visible, live, v_pieces, guard=guard)
    pos_row = load_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    bias = None if r.bias is None else by_rows(r.bias, mods.bias, load_start, plan.step_mods[1]).astype(jnp.float32)
    s = blk.modify_scores(s, mods, rows, pos_row, slopes, bias)
    mask = None if r.mask is None else by_rows(r.mask, mods.mask, load_start, plan.step_mods[0]) != 0
    visible, live = blk.block_masks(rows, load_start, start, live_end, bk, first_visible=first_visible, mask=mask)
    return blk.online_update(state, s, visible, live, v_pieces, guard=guard)

  state = lax.fori_loop(first, last, body, blk.init_state(rows_p, plan.v_pieces))
  o_pieces, lse = blk.finalize(state)
  if plan.final:
    _store_final(plan, r, o_pieces, lse, valid, head, q_row, ids)
    return

  def store_partial():
    for p, o in zip(plan.v_pieces, o_pieces):
      r.o[:, pl.ds(p.offset, p.width)] = o
    r.lse[...] = lse[:, 0]

  if plan.balanced:  # an unused item (end 0) stores nothing: no sequence's combine reads it
    pl.when(end > 0)(store_partial)
  else:
    store_partial()


def _store_final(plan: TritonPlan, r, o_pieces, lse, valid, head, q_row, ids):
  """The finished rows: sinks joined, cast, stored at their ``[T * Hq]`` rows; padding
  rows are masked off (their address, one past the end, is never written)."""
  if r.sinks is not None:
    sink = r.sinks[head].astype(jnp.float32)
    merged = [add_sink(o, lse, sink) for o in o_pieces]
    o_pieces, lse = [m[0] for m in merged], (merged[0][1] if merged else lse)
  dst = jnp.where(valid, q_row, plan.num_tokens * plan.hq)
  out_dtype = jnp.dtype(plan.out_dtype)
  for p, o in zip(plan.v_pieces, o_pieces):
    plgpu.store(r.o.at[dst, _cols(p.offset, p.width)], o.astype(out_dtype), mask=valid)
  valid1, _, q_row1 = row_ids(plan, ids[1] // plan.row_blocks, (ids[1] % plan.row_blocks) * plan.block_r,
                              (plan.block_r,))
  plgpu.store(r.lse.at[jnp.where(valid1, q_row1, plan.num_tokens * plan.hq)], lse.reshape(plan.block_r),
              mask=valid1)
