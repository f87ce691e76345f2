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
(read through a `fdecode.kernels.triton.source.RowSource`, the packed ``q [N * Hq, Dq]`` and
tables ``[M * n]`` at the rows its indices name). Its operands arrive as
`fdecode.kernels.triton.split.SplitOperands` names them. Outputs: with
one split (``plan.work.final``) the kernel writes the finished output ``[B, T * Hq, Dv]`` in the
output dtype and the lse ``[B, T * Hq]`` (sinks applied), its stores masked to the real
rows; otherwise partial states
``[B, Hkv, R_p, n_splits, Dv]`` / ``[B, Hkv, R_p, n_splits]`` for the combine kernel.

How blocks are read (always in place: no per-call copy or transpose of the cache), by the
plan's `fdecode.kernels.triton.plan.Read` mode (`block_at`):

* contiguous ``[B, Hkv, S, D]`` (``CONTIGUOUS``): block j covers tokens ``[j*bk, (j+1)*bk)`` but is loaded
  from ``min(j*bk, S - bk)``; slots before ``j*bk`` are masked, so a tail needs no padding.
* paged ``[Hkv, P, page_size, D]`` (``PAGED``): the pool is viewed as ``[Hkv, P*page_size, D]`` (a free
  reshape) and a block *gathers* its ``bk`` token rows through the block table (ids
  clipped into the pool). A block spans several pages of any size, page size 1 included.
* a contiguous cache read through a `RowSource`'s cache rows (``CACHE_ROWS``; `fdecode.ragged`'s prefill
  blocks, each over its sequence's row of the whole caches): the caches are viewed flat
  (a free reshape) and a block gathers its ``bk`` rows at its sequence row and kv head
  (`cache_source_rows`), as from one page of S tokens.
* index lists (``SPARSE``, ``SPARSE_PAGED``): slot j of a block holds the key at the
  listed position, its row gathered (through the block table when paged).
* token-major caches (``NHD``): a program's block spec takes its kv head's rows at the
  cache's own strides; the body is the same.
* head dims in power-of-two column pieces (`fdecode.kernels.common.block.head_pieces`).
* 8-bit caches: each piece is dequantized right after its load with its tile's scale;
  below sm_89 a float8 cache arrives as bytes and is decoded with integer ops.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from fdecode.kernels.triton.pallas_triton import plgpu

from fdecode.combine import add_sink
from fdecode.kernels.common import block as blk
from fdecode.kernels.common.block import decode_fp8_bits
from fdecode.kernels.common.modifiers import window_start
from fdecode.kernels.common.sparse import slot_range
from fdecode.kernels.triton.geometry import unit_ends, unit_rows
from fdecode.kernels.triton.operands import take
from fdecode.kernels.triton.plan import Read, TritonPlan
from fdecode.kernels.triton.schedule import item_work, load_ends


class Program(NamedTuple):
  """Where one program works, derived from its grid indices (`program`): its sequence
  ``seq`` (balanced; None: grid axis 0), ``split`` of ``count``, the sequence's ``end``;
  ``q_base`` / ``q_first``: its q rows (`q_source_rows`); ``table_base``: its table row's
  first entry; ``cache_row`` / ``kv_head``: its row of a source's whole caches (`Read.CACHE_ROWS`)."""
  seq: object
  split: object
  count: object
  end: object
  q_base: object
  q_first: object
  table_base: object
  cache_row: object = None
  kv_head: object = None


def program(plan: TritonPlan, refs, ids) -> Program:
  """This program's `Program` from its refs (`fdecode.kernels.triton.split.SplitOperands`)
  and ``ids``, its grid indices."""
  step, rows, cache = plan.source.step, plan.rows, plan.cache
  if step is not None:  # this program's work item, from every unit's end, derived from the step
    seq, split, count, end = item_work(unit_ends(*refs.step, step), ids[0], plan.schedule)
  elif plan.work.balanced:  # this program's work item, derived from every sequence's end (ends [B])
    seq, split, count, end = item_work(load_ends(refs.ends, plan.schedule), ids[0], plan.schedule)
  else:
    seq, split, count, end = None, ids[2], plan.work.num_splits, refs.ends[0]
  # Balanced: q and the block table are whole arrays, flattened; through a RowSource q
  # (and the tables, with table rows) too. The program reads its sequence's rows
  # (`q_source_rows`, ``table_base``); otherwise its BlockSpecs select them.
  b = ids[0] if seq is None else seq
  q_base = 0 if seq is None else seq * (rows.num_tokens * rows.hq)
  if step is not None:  # the unit's sequence (its table / cache row) and first q row
    row, q_first, _ = unit_rows(*refs.step, step, b)
  else:
    row = None if refs.cache_rows is None else refs.cache_rows[b]
    q_first = refs.q_start[b] if plan.source.q_source else None
  if step is not None and cache.read.paged:
    table_base = row * cache.table_len
  elif plan.source.table_source:
    table_base = jnp.clip(refs.table_rows[b], 0, refs.table.shape[0] // cache.table_len - 1) * cache.table_len
  else:
    table_base = 0 if seq is None else seq * cache.table_len
  at = Program(seq, split, count, end, q_base, q_first, table_base)
  if cache.read is Read.CACHE_ROWS:  # this sequence's row of the whole contiguous caches, this program's kv head
    at = at._replace(cache_row=jnp.clip(b if row is None else row, 0, cache.cache_batch - 1),
                     kv_head=ids[1] // rows.row_blocks)
  return at


def cache_source_rows(plan: TritonPlan, at: Program, pos):
  """Rows of the flat whole contiguous caches (`fdecode.kernels.triton.split`: HND ``[M *
  Hkv * S, D]``, NHD ``[M * S * Hkv, D]``) holding this program's sequence's
  (``at.cache_row``) kv head (``at.kv_head``) at positions ``pos`` (int32, in ``[0, S)``)."""
  h, hkv, s = at.kv_head, plan.rows.kv_heads, plan.cache.seq_len
  if plan.cache.kv_layout == "NHD":
    return (at.cache_row * s + pos) * hkv + h
  return (at.cache_row * hkv + h) * s + pos


def _cache_source_quant_index(dims, at: Program, pos):
  """Row of a flat whole scale / offset ``[d0 * d1 * d2, nt]`` (canonical dims ``(d0, d1,
  d2)``: ``M|1, Hkv|1, S|1``) for positions ``pos`` of this program's sequence and kv head."""
  d0, d1, d2 = dims
  base = ((at.cache_row if d0 > 1 else 0) * d1 + (at.kv_head if d1 > 1 else 0)) * d2
  return base + pos if d2 > 1 else pl.ds(base, 1)


def q_source_rows(plan: TritonPlan, q_ref, at: Program, q_row):
  """Rows of the q operand holding the call's q rows ``q_row`` (``t * Hq + head``, int32):
  with a RowSource, row ``(b, t)`` is packed row ``q_start[b] + t`` (clipped into the
  packed rows) of ``q [N * Hq, Dq]``; else row ``q_base + q_row``."""
  if not plan.source.q_source:
    return at.q_base + q_row
  hq = plan.rows.hq
  t, head = q_row // hq, q_row % hq
  packed = jnp.clip(at.q_first + t, 0, q_ref.shape[0] // hq - 1)
  return packed * hq + head


def row_ids(plan: TritonPlan, h, first_row, shape):
  """For a program's rows (int32 iota of ``shape``, leading dim ``block_r``): ``(valid,
  head_col, q_row)``: the row is real (r < R); its query head ``h * G + g``; its row of
  ``q [T * Hq, Dq]``, ``t * Hq + h * G + g`` (a padding row: row 0 of the head's group)."""
  rows = plan.rows
  r = first_row + lax.broadcasted_iota(jnp.int32, shape, 0)
  valid = r < rows.num_rows
  head = h * rows.group + r % rows.group
  q_row = jnp.where(valid, (r // rows.group) * rows.hq + head, h * rows.group)
  return valid, jnp.where(valid, head, h * rows.group), q_row


def mod_rows(plan: TritonPlan, tm: int, per_head: bool, h, first_row):
  """int32 ``[R_p, 1]``: the row of a mask / bias operand (`fdecode.kernels.triton.split`:
  ``[Tm, S]`` shared by the heads, or ``per_head`` the caller's ``[Tm * Hq, S]``) that each of
  the program's rows r = t * G + g of kv head ``h`` reads: ``t`` (0 when Tm = 1), times Hq
  plus its query head ``h * G + g`` when per head. A padding row (r >= R) reads a real row
  and is never stored."""
  rows = plan.rows
  r = first_row + lax.broadcasted_iota(jnp.int32, (rows.block_r, 1), 0)
  t = jnp.minimum(r // rows.group, rows.num_tokens - 1) if tm > 1 else jnp.zeros_like(r)
  return t * rows.hq + h * rows.group + r % rows.group if per_head else t


def step_mod_rows(plan: TritonPlan, form, at: Program, h, first_row):
  """int32 ``[R_p, 1]``: for a ragged step's unit, the row of a per-row mask / bias
  operand (`fdecode.kernels.triton.split`: the step's ``[Nm * Hm, S]``, ``form`` ``(Nm,
  Hm)``) that each of the program's rows r = t * G + g of kv head ``h`` reads: its packed
  row ``q_first + t`` (clipped into the array; 0 when Nm = 1), times Hm plus its query
  head when per head. Rows the unit's sequence does not own (a prefill block's rows
  before it) and padding rows read a real row and are never stored."""
  nm, hm = form
  p = plan.rows
  rows = first_row + lax.broadcasted_iota(jnp.int32, (p.block_r, 1), 0)
  t = jnp.minimum(rows // p.group, p.num_tokens - 1)
  packed = jnp.clip(at.q_first + t, 0, nm - 1) if nm > 1 else jnp.zeros_like(t)
  return packed * hm + (h * p.group + rows % p.group if hm > 1 else 0)


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
    return (acc[0] + jnp.sum(pos < first_visible, dtype=jnp.int32),
            acc[1] + jnp.sum(pos < live_end, dtype=jnp.int32))  # int32 under x64 too
  lo, hi = lax.fori_loop(0, idx_ref.shape[0] // bk, count, (jnp.int32(0), jnp.int32(0)))
  return jnp.minimum(lo, hi), hi


def _firsts(idx_ref, start, shape):
  """bool of ``shape`` (``[1, bk]`` for the scores, ``[bk, 1]`` for the value rows): slot
  ``start + j`` of a sorted index list holds its position's first slot (a repeat of the
  slot before it is selected away: a position counts once). Each layout is loaded and
  compared in place: a boolean made from loaded values cannot change layout (it would go
  through shared memory, which holds no 1-bit elements)."""
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


class BlockAt(NamedTuple):
  """Where a block's ``bk`` rows are (`block_at`): ``index`` into the cache ref (a slice or
  gathered rows); ``load_start``, the position of its first row (the masks' origin; a
  listed block's clipped positions); ``pos``, a listed block's positions; ``page`` /
  ``slot``, each row's page and slot (a pool's; a source's cache rows: the slots)."""
  index: object
  load_start: object = None
  pos: object = None
  page: object = None
  slot: object = None


def block_at(plan: TritonPlan, refs, at: Program, start) -> BlockAt:
  """Where block ``start`` (its first slot) is loaded from, by the plan's `Read` mode."""
  bk, cache = plan.launch.block, plan.cache
  match cache.read:
    case Read.SPARSE_PAGED:  # slot j holds the key at position idx[j]: its row through the table
      pos = refs.idx[pl.ds(start, bk)]
      page = jnp.clip(refs.table[at.table_base + jnp.clip(pos // cache.page_size, 0, cache.table_len - 1)], 0,
                      cache.num_pages - 1)
      slot = pos % cache.page_size
      return BlockAt(page * cache.page_size + slot, pos=pos, page=page, slot=slot)
    case Read.SPARSE:  # slot j holds the key at position idx[j]: gather its row
      pos = refs.idx[pl.ds(start, bk)]
      index = jnp.clip(pos, 0, cache.cache_rows - 1)
      return BlockAt(index, load_start=index, pos=pos)
    case Read.CACHE_ROWS:  # its sequence's cache row, gathered like a pool's single page
      slot = jnp.minimum(start + lax.iota(jnp.int32, bk), cache.seq_len - 1)
      return BlockAt(cache_source_rows(plan, at, slot), load_start=start, slot=slot)
    case Read.PAGED:
      pos = start + lax.iota(jnp.int32, bk)
      page = jnp.clip(refs.table[at.table_base + jnp.minimum(pos // cache.page_size, cache.table_len - 1)], 0,
                      cache.num_pages - 1)
      slot = pos % cache.page_size
      return BlockAt(page * cache.page_size + slot, load_start=start, page=page, slot=slot)
    case Read.CONTIGUOUS:
      load_start = jnp.minimum(start, cache.cache_rows - bk)
      return BlockAt(pl.ds(load_start, bk), load_start=load_start)


def _quant_index(plan: TritonPlan, dims, block: BlockAt, at: Program):
  """Row index into a scale / offset ref (static ``dims``, None: no such ref) for ``block``."""
  if dims is None:
    return None
  match plan.cache.read:
    case Read.CACHE_ROWS:
      return _cache_source_quant_index(dims, at, block.slot)
    case Read.SPARSE:  # per-token scales: the gathered rows
      return pl.ds(0, 1) if dims[0] == 1 else block.load_start
    case Read.PAGED | Read.SPARSE_PAGED:
      pages, slots = dims
      if pages == 1 and slots == 1:
        return pl.ds(0, 1)
      return (block.page if pages > 1 else 0) * slots + (block.slot if slots > 1 else 0)
    case Read.CONTIGUOUS:
      return pl.ds(0, 1) if dims[0] == 1 else pl.ds(block.load_start, plan.launch.block)


def _load_block(plan: TritonPlan, refs, index, qi, dtype):
  """(k pieces + k_rope pieces, v pieces) of one block, dequantized to ``dtype``."""
  columns = plan.columns
  k_bits, v_bits = plan.dtypes.fp8_bits
  k_quant, v_quant = (refs.k_scale, refs.k_offset), (refs.v_scale, refs.v_offset)
  k_pieces = [_load_piece(refs.k, index, p, k_quant, qi[0:2], dtype, k_bits) for p in columns.k_pieces]
  if columns.v_from_k:  # MLA: a value piece is the loaded key piece itself (one read)
    loaded = dict(zip(columns.k_pieces, k_pieces))
    v_pieces = [loaded[p] if p in loaded else _load_piece(refs.k, index, p, k_quant, qi[0:2], dtype, k_bits)
                for p in columns.v_pieces]
  else:
    v_pieces = [_load_piece(refs.v, index, p, v_quant, qi[2:4], dtype, v_bits) for p in columns.v_pieces]
  k_pieces += [_load_piece(refs.rope, index, p, (None, None), None, dtype) for p in columns.r_pieces]
  return k_pieces, v_pieces


def split_kernel(*refs, plan: TritonPlan, softmax_scale: float, layout, ids=None):
  """One program: its rows' state over its split's blocks, stored final or partial.
  ``layout``: how its input refs make a `fdecode.kernels.triton.split.SplitOperands`
  (`fdecode.kernels.triton.operands.take`); ``ids``: its grid indices (item or sequence,
  kv head * row blocks + row block, split); None: the launch's own
  (`fdecode.kernels.triton.split_states_merged` runs two plans in one grid, each program
  taking its plan's share)."""
  ids = (pl.program_id(0), pl.program_id(1), pl.program_id(2)) if ids is None else ids
  refs, (o_ref, lse_ref) = take(layout, refs)
  at = program(plan, refs, ids)
  mods, bk, rp = plan.mods, plan.launch.block, plan.rows
  rows_p, seq_len = rp.block_r, plan.cache.seq_len
  h = ids[1] // rp.row_blocks
  first_row = (ids[1] % rp.row_blocks) * rows_p
  dtype = jnp.dtype(plan.dtypes.compute_dtype)
  end = at.end
  live_end = jnp.clip(end, 0, seq_len)
  rows = blk.row_geometry(end, rp.num_rows, rows_p, rp.group, rp.num_tokens, seq_len, mods, first_row)
  first_visible = window_start(end, rp.num_tokens, seq_len, mods)
  valid, head, q_row = row_ids(plan, h, first_row, (rows_p, 1))
  dk = plan.columns.dk
  q_src = q_source_rows(plan, refs.q, at, q_row)
  q_pieces = ([refs.q[q_src, _cols(p.offset, p.width)].astype(dtype) for p in plan.columns.k_pieces]
              + [refs.q[q_src, _cols(dk + p.offset, p.width)].astype(dtype) for p in plan.columns.r_pieces])
  slopes = None if refs.alibi is None else refs.alibi[head].astype(jnp.float32)
  if plan.cache.read.sparse:
    first, last = slot_range(_index_bounds(refs.idx, bk, first_visible, live_end), ids[2], plan.work.num_splits, bk)
  else:
    first, last = blk.split_range(end, at.split, at.count, rp.num_tokens, seq_len, bk, mods, plan.work.split_blocks)

  def by_rows(ref, form, load_start, step_form):
    """A mask / bias block for the rows: ``[R_p | 1, bk]``, gathered by row (`mod_rows`; a
    step's at packed rows, `step_mod_rows`); columns past the array (a tail block's
    positions past S, never visible) read its last column."""
    cols = jnp.minimum(load_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1), ref.shape[-1] - 1)
    if step_form is not None and ref.shape[0] > 1:
      return ref[step_mod_rows(plan, step_form, at, h, first_row), cols]
    if ref.shape[0] == 1:  # one row for every program row (a per-head one of MHA is form (1, 1) too)
      return ref[jnp.zeros((1, 1), jnp.int32), cols]
    return ref[mod_rows(plan, form[0], ref.shape[0] == form[0] * rp.hq, h, first_row), cols]

  guard = blk.rows_may_differ(rp.num_tokens, mods)
  step_mask, step_bias = plan.source.step_mods

  def body(j, state):
    start = j * bk
    block = block_at(plan, refs, at, start)
    qi = [_quant_index(plan, d, block, at) for d in plan.dtypes.quant]
    k_pieces, v_pieces = _load_block(plan, refs, block.index, qi, dtype)
    s = blk.block_scores(q_pieces, k_pieces, softmax_scale)
    if plan.cache.read.sparse:
      pos = block.pos
      s = blk.modify_scores(s, mods, rows, pos[None, :], slopes)
      visible, live = blk.sorted_slot_masks(rows, pos[None, :], live_end, first_visible, bk)
      # A repeated position attends once: its first slot only.
      visible, live = visible & _firsts(refs.idx, start, (1, bk)), live & _firsts(refs.idx, start, (bk, 1))
      return blk.online_update(state, s, visible, live, v_pieces, guard=guard)
    load_start = block.load_start
    pos_row = load_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    bias = None if refs.bias is None else by_rows(refs.bias, mods.bias, load_start, step_bias).astype(jnp.float32)
    s = blk.modify_scores(s, mods, rows, pos_row, slopes, bias)
    mask = None if refs.mask is None else by_rows(refs.mask, mods.mask, load_start, step_mask)
    mask = None if mask is None else mask != mask.dtype.type(0)  # its own dtype's 0: strict promotion too
    visible, live = blk.block_masks(rows, load_start, start, live_end, bk, first_visible=first_visible, mask=mask)
    return blk.online_update(state, s, visible, live, v_pieces, guard=guard)

  state = lax.fori_loop(first, last, body, blk.init_state(rows_p, plan.columns.v_pieces))
  o_pieces, lse = blk.finalize(state)
  if plan.work.final:
    _store_final(plan, refs.sinks, (o_ref, lse_ref), o_pieces, lse, valid, head, q_row, ids)
    return

  def store_partial():
    for p, o in zip(plan.columns.v_pieces, o_pieces):
      o_ref[:, pl.ds(p.offset, p.width)] = o
    lse_ref[...] = lse[:, 0]

  if plan.work.balanced:  # an unused item (end 0) stores nothing: no sequence's combine reads it
    pl.when(end > 0)(store_partial)
  else:
    store_partial()


def _store_final(plan: TritonPlan, sinks_ref, out_refs, o_pieces, lse, valid, head, q_row, ids):
  """The finished rows: sinks joined, cast, stored at their ``[T * Hq]`` rows; padding
  rows are masked off (their address, one past the end, is never written)."""
  o_ref, lse_ref = out_refs
  rp = plan.rows
  if sinks_ref is not None:
    sink = sinks_ref[head].astype(jnp.float32)
    merged = [add_sink(o, lse, sink) for o in o_pieces]
    o_pieces, lse = [m[0] for m in merged], (merged[0][1] if merged else lse)
  dst = jnp.where(valid, q_row, rp.num_tokens * rp.hq)
  out_dtype = jnp.dtype(plan.dtypes.out_dtype)
  for p, o in zip(plan.columns.v_pieces, o_pieces):
    plgpu.store(o_ref.at[dst, _cols(p.offset, p.width)], o.astype(out_dtype), mask=valid)
  valid1, _, q_row1 = row_ids(plan, ids[1] // rp.row_blocks, (ids[1] % rp.row_blocks) * rp.block_r, (rp.block_r,))
  plgpu.store(lse_ref.at[jnp.where(valid1, q_row1, rp.num_tokens * rp.hq)], lse.reshape(rp.block_r), mask=valid1)
