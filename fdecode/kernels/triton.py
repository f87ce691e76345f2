"""FlashDecode split-KV kernel for GPUs (Pallas Triton), also the interpret-mode kernel.

Grid ``(B, Hkv, n_splits)``. One program owns one kv head of one sequence and one
contiguous range of ``block_k``-token blocks; the R = T*G query rows of that kv head are
the rows of its matmuls (heads packed into the row dimension, as in Tenstorrent's
sdpa_decode), so every cache byte is read once. Inside a split the program runs an
online softmax over blocks (`fdecode.kernels.block`) and writes one normalized partial
state (o, lse) per row; `merge_states` combines the splits. The loop runs only over
blocks below the sequence's end: splits and blocks past it do no work and load nothing.

How blocks are read (always in place: no per-call copy or transpose of the cache):

* contiguous ``[B, Hkv, S, D]``: block j covers tokens ``[j*bk, (j+1)*bk)`` but is loaded
  from ``min(j*bk, S - bk)``; slots before ``j*bk`` are masked, so a tail needs no padding.
* paged ``[Hkv, P, page_size, D]``: the pool is viewed as ``[Hkv, P*page_size, D]`` (a free
  reshape) and a block *gathers* its ``bk`` token rows through the block table (ids
  clipped into the pool). A block spans several pages of any size, page size 1 included.
* head dims in power-of-two column pieces (`fdecode.kernels.block.head_pieces`), so every
  Triton tensor has power-of-two sizes for Dk, Dv in {64, 80, 96, 112, 128, 192, 256, 576}.
* 8-bit caches: each piece is dequantized right after its load with its tile's scale.

Compiled for GPU, Triton additionally needs: pieces at least 16 wide (``tl.dot``), so
head dims and 8-bit scale tiles must be multiples of 16; `triton_unsupported` names
the shapes it cannot take.

Sized to the target GPU (`fdecode.chips.lowering_gpu`), never to one chip's constants:
`launch_plan` (`fdecode.kernels.triton_plan`) picks the warps and the block so that the
loaded tiles fit the registers (no spills) and the pipelined loads fit the chip's shared
memory, and the split count
(`fdecode.config.gpu_num_splits`) launches at least one full wave of the chip's SMs and,
among such counts, the one whose tail (SM balance, last partial wave) and merge bytes
cost least. Below sm_89 (A100) Triton has no float8 conversions: an 8-bit float
cache is passed as its bytes and decoded with integer ops (`decode_fp8_bits`).
``num_splits="balance"`` replaces the per-sequence splits with work items dealt out by
the live lengths (`fdecode.kernels.triton_plan.balanced_schedule`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fdecode import chips
from fdecode import config as config_lib
from fdecode.combine import merge_segments
from fdecode.cache.layout import kv_heads, token_axis
from fdecode.kernels import block as blk
from fdecode.kernels.block import decode_fp8_bits  # noqa: F401 (its home is the shared block math)
from fdecode.kernels.triton_plan import (_MIN_DOT, _PIECE_COLS, _STAGES, Launch, balanced_schedule,  # noqa: F401
                                         block_size, launch_plan, rows_per_program)
from fdecode.kernels.xla import window_tokens
from fdecode.modifiers import Modifiers, window_start
from fdecode.sparse import Sparse, pad_slots, slot_range



@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static description of what the kernel reads."""
  paged: bool
  block: int                  # bk, tokens per block (a power of two)
  seq_len: int                # S, tokens addressable per sequence
  rows: int                   # contiguous: cache rows (>= block); paged: P * page_size
  page_size: int              # paged only
  num_pages: int              # paged only: P
  table_len: int              # paged only: n
  k_pieces: tuple
  v_pieces: tuple
  quant: tuple                # per stream (k_scale, k_offset, v_scale, v_offset): None or
                              # its (pages|1, page_size|1) (paged) / (S|1,) (contiguous) dims
  mods: Modifiers = Modifiers()
  v_from_k: bool = False      # MLA: the values are k's first columns (v_pieces index k)
  r_pieces: tuple = ()        # k_rope's pieces (key-only columns after k's own)
  sparse: bool = False        # blocks are index-list slots (`fdecode.sparse`), not positions
  fp8_bits: tuple = (None, None)  # (k, v): float8 dtype name when passed as raw bytes (pre-sm_89)
  balanced: bool = False      # a work item per program (`fdecode.kernels.triton_plan.balanced_schedule`): its split, of how many


# Placeholder of a row-blocked operand's BlockSpec while the others are built.
_ROWS = pl.BlockSpec((None,), lambda i, h, j: (0,))
# Widest piece of a float32 computation (FMA dots; see `fdecode.kernels.block.head_pieces`).
_F32_PIECE = 128


def _pieces(dk, dv, k_tiles, v_tiles, v_from_k, rope_dim, max_width=None):
  """(k, v, k_rope) column pieces; MLA values (``v_from_k``) are k's leading pieces."""
  pieces = lambda d, tiles, **kw: blk.head_pieces(d, tiles, pow2=True, max_width=max_width, **kw)
  k_pieces = pieces(dk, k_tiles)
  v_pieces = pieces(dk, k_tiles, limit=dv) if v_from_k else pieces(dv, v_tiles)
  return k_pieces, v_pieces, pieces(rope_dim, 1) if rope_dim else ()


def triton_unsupported(dk: int, dv: int, k_tiles: int = 1, v_tiles: int = 1, *, v_from_k: bool = False,
                       rope_dim: int = 0) -> str | None:
  """Why the compiled Triton kernel cannot take these head dims / scale tiles, or None.
  ``dk``: k's own columns (without ``rope_dim`` k_rope columns)."""
  pieces = _pieces(dk, dv, k_tiles, v_tiles, v_from_k, rope_dim)
  for name, d, nt, ps in (("Dk", dk, k_tiles, pieces[0]), ("Dv", dv, k_tiles if v_from_k else v_tiles, pieces[1]),
                          ("k_rope's Dr", rope_dim, 1, pieces[2])):
    narrow = [p.width for p in ps if p.width < _MIN_DOT]
    if narrow:
      return (f"{name}={d} with {nt} scale tile(s) has a column piece {narrow[0]} wide; "
              f"Triton's dot needs head dims and scale tiles that are multiples of {_MIN_DOT}")
  return None


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


def _kernel(*refs, plan: _Plan, softmax_scale, num_splits, num_rows, group, num_tokens, row_blocks):
  # refs: end i32[1] (lengths - kv_offset), [work i32[2] (balanced: this item's split of its
  #       sequence, of how many)], [table i32[n]], q [R_p, Dk], k, [v], [k_rope],
  #       [k_scale], [k_offset], [v_scale], [v_offset], [mask i8[M, S_p]], [bias [M, S_p]],
  #       [alibi f32[R_p]], o f32[R_p, Dv], lse f32[R_p]
  #       sparse: [indices i32[K_p], bounds i32[2]] after the table.
  refs = list(refs)
  mods = plan.mods
  end_ref = refs.pop(0)
  work_ref = refs.pop(0) if plan.balanced else None
  table_ref = refs.pop(0) if plan.paged else None
  idx_ref, bounds_ref = (refs.pop(0), refs.pop(0)) if plan.sparse else (None, None)
  q_ref, k_ref = refs.pop(0), refs.pop(0)
  v_ref = None if plan.v_from_k else refs.pop(0)
  rope_ref = refs.pop(0) if plan.r_pieces else None
  quant = [refs.pop(0) if dims is not None else None for dims in plan.quant]
  mask_ref = refs.pop(0) if mods.mask else None
  bias_ref = refs.pop(0) if mods.bias else None
  alibi_ref = refs.pop(0) if mods.alibi else None
  o_ref, lse_ref = refs
  rows_p = q_ref.shape[0]  # this program's rows: block pl.program_id(1) % row_blocks
  first_row = (pl.program_id(1) % row_blocks) * rows_p
  bk = plan.block
  dtype = q_ref.dtype  # the compute dtype (the wrapper casts q to it)
  end = end_ref[0]
  live_end = jnp.clip(end, 0, plan.seq_len)
  rows = blk.row_geometry(end, num_rows, rows_p, group, num_tokens, plan.seq_len, mods, first_row)
  first_visible = window_start(end, num_tokens, plan.seq_len, mods)
  dk_own = plan.k_pieces[-1].offset + plan.k_pieces[-1].width
  q_pieces = ([q_ref[:, pl.ds(p.offset, p.width)] for p in plan.k_pieces]
              + [q_ref[:, pl.ds(dk_own + p.offset, p.width)] for p in plan.r_pieces])
  slopes = None if alibi_ref is None else alibi_ref[...][:, None]
  if plan.sparse:
    first, last = slot_range((bounds_ref[0], bounds_ref[1]), pl.program_id(2), num_splits, bk)
  elif plan.balanced:
    first, last = blk.split_range(end, work_ref[0], work_ref[1], num_tokens, plan.seq_len, bk, mods)
  else:
    first, last = blk.split_range(end, pl.program_id(2), num_splits, num_tokens, plan.seq_len, bk, mods)

  def by_rows(ref, form, load_start):
    """A mask / bias block for the rows: ``[R_p | 1, bk]``, gathered by row."""
    cols = pl.ds(load_start, bk)
    if form == (1, 1):
      return ref[pl.ds(0, 1), cols]
    return ref[blk.row_source(rows_p, group, num_tokens, form, (rows_p,), first_row), cols]

  def quant_index(dims, start, page, slot):
    """Row index into a scale / offset ref for this block."""
    if dims is None:
      return None
    if plan.sparse and not plan.paged:  # per-token scales: the gathered rows
      return pl.ds(0, 1) if dims[0] == 1 else start
    if plan.paged:
      pages, slots = dims
      if pages == 1 and slots == 1:
        return pl.ds(0, 1)
      return (page if pages > 1 else 0) * slots + (slot if slots > 1 else 0)
    return pl.ds(0, 1) if dims[0] == 1 else pl.ds(start, bk)

  guard = blk.rows_may_differ(num_tokens, mods)

  def body(j, state):
    start = j * bk
    if plan.sparse:  # slot j holds the key at position idx[j]: gather its row
      pos = idx_ref[pl.ds(start, bk)]
      if plan.paged:
        page = jnp.clip(table_ref[jnp.clip(pos // plan.page_size, 0, plan.table_len - 1)],
                        0, plan.num_pages - 1)
        slot = pos % plan.page_size
        load_start, index = None, page * plan.page_size + slot
      else:
        page = slot = None
        load_start = index = jnp.clip(pos, 0, plan.rows - 1)
    elif plan.paged:
      pos = start + lax.iota(jnp.int32, bk)
      page = jnp.clip(table_ref[jnp.minimum(pos // plan.page_size, plan.table_len - 1)],
                      0, plan.num_pages - 1)
      slot = pos % plan.page_size
      load_start, index = start, page * plan.page_size + slot
    else:
      page = slot = None
      load_start = jnp.minimum(start, plan.rows - bk)
      index = pl.ds(load_start, bk)
    qi = [quant_index(d, load_start, page, slot) for d in plan.quant]
    k_bits, v_bits = plan.fp8_bits
    k_pieces = [_load_piece(k_ref, index, p, quant[0:2], qi[0:2], dtype, k_bits) for p in plan.k_pieces]
    if plan.v_from_k:  # MLA: a value piece is the loaded key piece itself (one read)
      loaded = dict(zip(plan.k_pieces, k_pieces))
      v_pieces = [loaded[p] if p in loaded else _load_piece(k_ref, index, p, quant[0:2], qi[0:2], dtype, k_bits)
                  for p in plan.v_pieces]
    else:
      v_pieces = [_load_piece(v_ref, index, p, quant[2:4], qi[2:4], dtype, v_bits) for p in plan.v_pieces]
    k_pieces += [_load_piece(rope_ref, index, p, (None, None), None, dtype) for p in plan.r_pieces]
    s = blk.block_scores(q_pieces, k_pieces, softmax_scale)
    if plan.sparse:
      s = blk.modify_scores(s, mods, rows, pos[None, :], slopes)
      visible, live = blk.sorted_slot_masks(rows, pos[None, :], live_end, first_visible, bk)
      return blk.online_update(state, s, visible, live, v_pieces, guard=guard)
    pos_row = load_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    bias = None if bias_ref is None else by_rows(bias_ref, mods.bias, load_start).astype(jnp.float32)
    s = blk.modify_scores(s, mods, rows, pos_row, slopes, bias)
    mask = None if mask_ref is None else by_rows(mask_ref, mods.mask, load_start) != 0
    visible, live = blk.block_masks(rows, load_start, start, live_end, bk,
                                    first_visible=first_visible, mask=mask)
    return blk.online_update(state, s, visible, live, v_pieces, guard=guard)

  state = lax.fori_loop(first, last, body, blk.init_state(rows_p, plan.v_pieces))
  o_pieces, lse = blk.finalize(state)
  for p, o in zip(plan.v_pieces, o_pieces):
    o_ref[:, pl.ds(p.offset, p.width)] = o
  lse_ref[...] = lse[:, 0]


def _quant_operand(x, paged, fold=1):
  """A canonical rank-4 scale / offset -> (operand, its BlockSpec, its static dims)."""
  d0, d1, d2, nt = x.shape
  if paged:  # [Hkv|1, P|1, ps|1, nt] -> [Hkv|1, P|1 * ps|1, nt]
    flat = x.reshape(d0, d1 * d2, nt)
    spec = pl.BlockSpec((None, d1 * d2, nt), lambda i, h, j: (h if d0 > 1 else 0, 0, 0))
    return flat, spec, (d1, d2)
  spec = pl.BlockSpec((None, None, d2, nt),
                      lambda i, h, j: (i // fold if d0 > 1 else 0, h if d1 > 1 else 0, 0, 0))
  return x, spec, (d2,)


def triton_partials(q_rows, ends, k, v, *, num_tokens: int, softmax_scale: float,
                    num_splits: int | None, block_k: int, interpret: bool, gpu: chips.Gpu | None = None,
                    block_tables=None, k_scale=None, v_scale=None, k_offset=None, v_offset=None,
                    mods: Modifiers = Modifiers(), mask=None, bias=None, alibi=None,
                    v_head_dim=None, k_rope=None, indices=None, index_bounds=None,
                    sparse: Sparse | None = None, kv_layout: str = "HND", balance: bool = False):
  """Per-split partial states from the Triton kernel (``interpret``: Pallas' interpreter).

  Args:
    q_rows: ``[B, Hkv, R, Dk]`` queries in the compute dtype, row r = t * G + g.
    ends: int32 ``[B]``: each sequence's end relative to the cache's first token.
    k, v: contiguous ``[B, Hkv, S, D]`` or, with ``block_tables`` int32 ``[B, n]``, paged
      ``[Hkv, P, page_size, D]``; float or 8-bit with canonical rank-4 scales / offsets.
      ``v`` None (MLA): the values are ``k[..., :v_head_dim]``, taken from the loaded key
      pieces (each cache byte is read once for both).
    k_rope: optional key-only columns laid out like k (float), after k's own.
    kv_layout: the layout of k, v and k_rope: ``"HND"`` (above) or ``"NHD"`` (token-major
      ``[B, S, Hkv, D]`` / ``[P, page_size, Hkv, D]``), read in place: a program's block
      spec takes its kv head's rows at the cache's own strides, so the kernel body is the
      same for both. Scales and offsets are head-major in either case (they are small).
    indices, index_bounds, sparse: a sparse call's canonical index lists ``[B', Hi, K]``,
      their live slots ``[B', Hi, 2]`` and `fdecode.sparse.Sparse` (row b' reads
      contiguous cache row ``b' // sparse.fold``); blocks are then ``block_k`` slots of
      the list, each slot's row gathered by position.
    num_tokens: T (rows are T groups of G).
    num_splits: splits of each sequence's blocks; None: compiled, at least one full wave
      of ``gpu`` with the least tail and merge cost (`fdecode.config.gpu_num_splits`); interpreted, `fdecode.config.default_num_splits`.
    balance: with ``num_splits`` None, a paged cache and no mask, bias or index list: the
      balanced schedule (`fdecode.kernels.triton_plan.balanced_schedule`): grid ``(B + one wave of items, Hkv * row
      blocks, 1)``, each program one work item, its states merged per sequence
      (`fdecode.combine.merge_segments`); the result has one split.
    block_k: tokens per block (rounded by `block_size`). Compiled, an upper bound:
      `launch_plan` takes the largest block that fits ``gpu``'s registers and shared memory.
    gpu: the `fdecode.chips.Gpu` compiled for (None: `fdecode.chips.lowering_gpu`).
    mods, mask, bias, alibi: the static `fdecode.modifiers.Modifiers` and their canonical
      arrays (mask / bias ``[Bm, Hm, Tm, Gm, S]``, alibi f32 ``[Hkv, G]``). A mask or bias
      block is gathered by row inside the kernel, never expanded in memory.

  Returns:
    ``(o, lse)``: float32 ``[B, Hkv, n_splits, R, Dv]`` and ``[B, Hkv, n_splits, R]``.

  Raises:
    ValueError: compiled (not ``interpret``) for shapes `triton_unsupported` names.
  """
  b, hkv, r, dq = q_rows.shape
  dk = k.shape[-1]
  v_from_k = v is None
  dv = v_head_dim if v_from_k else v.shape[-1]
  rope_dim = 0 if k_rope is None else k_rope.shape[-1]
  paged = block_tables is not None
  quant_arrays = (k_scale, k_offset, v_scale, v_offset)
  k_tiles = 1 if k_scale is None else k_scale.shape[-1]
  v_tiles = 1 if v_scale is None else v_scale.shape[-1]
  if not interpret:
    reason = triton_unsupported(dk, dv, k_tiles, v_tiles, v_from_k=v_from_k, rope_dim=rope_dim)
    if reason:
      raise ValueError(f"flash_decode: impl='pallas' on GPU cannot take this shape: {reason}. "
                       "Use impl='xla' (impl=None picks it for such shapes)")
  gpu = gpu or chips.lowering_gpu()
  fp8_bits = [None, None]
  if not interpret and not gpu.native_fp8:  # no float8 conversions below sm_89: pass the bytes
    for i, x in enumerate((k, v)):
      if x is not None and jnp.dtype(x.dtype).name.startswith("float8"):
        fp8_bits[i] = jnp.dtype(x.dtype).name
    k, v = (x if bits is None else lax.bitcast_convert_type(x, jnp.uint8) for x, bits in zip((k, v), fp8_bits))
  rows_p = r if interpret else -(-r // _MIN_DOT) * _MIN_DOT
  block_r = rows_per_program(rows_p, dq, dv)
  rows_p = -(-rows_p // block_r) * block_r
  row_blocks = rows_p // block_r
  compute_bytes = jnp.dtype(q_rows.dtype).itemsize
  k_pieces, v_pieces, r_pieces = _pieces(dk, dv, k_tiles, v_tiles, v_from_k, rope_dim,
                                         _F32_PIECE if compute_bytes == 4 and not interpret else None)
  if interpret:
    launch = Launch(block_size(block_k), 4, _STAGES, 0, 0)
  else:
    # A piece costs at least _PIECE_COLS columns (its own dot, masks and accumulator).
    cols = sum(max(p.width, _PIECE_COLS) for p in k_pieces + r_pieces + (() if v_from_k else v_pieces))
    raw_bytes = max(jnp.dtype(x.dtype).itemsize for x in (k, v, k_rope) if x is not None)
    quantized = k_scale is not None or v_scale is not None
    # A float cache cast up for a wider query (bf16 -> f32) holds both on the way to the
    # f32 FMA dots; a dequantized one its bytes and a float32 product; a bit decode two
    # more 32-bit words (its integer fields and the float built from them: at 4 bytes,
    # ptxas spilled 8 B of the A100 e4m3 tile-scale kernel).
    convert_bytes = (raw_bytes + 4 if quantized or raw_bytes != compute_bytes else 0) + (8 if any(fp8_bits) else 0)
    if paged and k.shape[token_axis(kv_layout)] < _MIN_DOT:
      # Pages smaller than a dot tile: the rows' addresses come through the table, not an
      # affine range, so a 64-bit pointer is held per loaded element (f32 page size 1
      # spilled 308 B at 255 registers without this).
      convert_bytes += 8
    launch = launch_plan(gpu, block_r=block_r, dq=dq, dv=dv, cols=cols, raw_bytes=raw_bytes,
                         compute_bytes=compute_bytes, block_k=block_k, convert_bytes=convert_bytes)
  bk = launch.block
  ax = token_axis(kv_layout)
  if paged:
    num_pages, page_size = k.shape[ax - 1], k.shape[ax]
    hkv_pool = kv_heads(k.shape, kv_layout, True)
    table_len = block_tables.shape[1]
    seq_len = table_len * page_size
    rows = num_pages * page_size
    # Free reshapes merging (page, slot) into one row axis: [Hkv, rows, D] or [rows, Hkv, D].
    lead = (rows, hkv_pool) if kv_layout == "NHD" else (hkv_pool, rows)
    flat = lambda x: None if x is None else x.reshape(lead + (x.shape[-1],))
    k, v, k_rope = flat(k), flat(v), flat(k_rope)
  else:
    num_pages = page_size = table_len = 0
    seq_len = k.shape[ax]
    if seq_len < bk:  # a cache shorter than one block: pad it (cheap: < bk tokens)
      pad = lambda axis: [(0, bk - seq_len) if i == axis else (0, 0) for i in range(4)]
      k, v, k_rope = (None if x is None else jnp.pad(x, pad(ax)) for x in (k, v, k_rope))
      quant_arrays = tuple(a if a is None or a.shape[2] == 1 else jnp.pad(a, pad(2)) for a in quant_arrays)
    rows = k.shape[ax]
  if rows_p != r:
    q_rows = jnp.pad(q_rows, [(0, 0), (0, 0), (0, rows_p - r), (0, 0)])
  num_blocks = pl.cdiv(max(seq_len, 1), bk)
  balanced = balance and num_splits is None and paged and sparse is None and mask is None and bias is None
  if balanced:  # a fixed grid of work items, each a run of one sequence's live blocks
    seqs = b
    extra = 8 if interpret else -(-gpu.sms * launch.residency(gpu)[1] // (hkv * row_blocks))
    item_seq, work, ends = balanced_schedule(ends.astype(jnp.int32), seqs + extra, bk, num_tokens, seq_len, mods)
    q_rows, block_tables = q_rows[jnp.minimum(item_seq, seqs - 1)], block_tables[jnp.minimum(item_seq, seqs - 1)]
    b, num_splits = seqs + extra, 1
  elif num_splits is None:
    slots = indices.shape[-1] if sparse is not None else window_tokens(seq_len, num_tokens, mods)
    blocks = max(pl.cdiv(slots, bk), 1)
    if interpret:
      num_splits = config_lib.default_num_splits(b, hkv, blocks, config_lib.num_parallel_units("cpu"))
    else:
      cols_bytes = sum(x.shape[-1] * jnp.dtype(x.dtype).itemsize for x in (k, v, k_rope) if x is not None)
      num_splits = config_lib.gpu_num_splits(
          gpu.sms, launch.residency(gpu), b * hkv * row_blocks, blocks,
          cache_bytes=b * hkv * slots * cols_bytes, split_bytes=2 * 4 * b * hkv * rows_p * (dv + 1))

  fold = 1 if sparse is None else sparse.fold  # contiguous cache row of q row i: i // fold
  operands = [ends.astype(jnp.int32)]
  in_specs = [pl.BlockSpec((1,), lambda i, h, j: (i,))]
  if balanced:
    operands.append(work)
    in_specs.append(pl.BlockSpec((None, 2), lambda i, h, j: (i, 0)))
  if paged:
    operands.append(block_tables.astype(jnp.int32))
    in_specs.append(pl.BlockSpec((None, table_len), lambda i, h, j: (i, 0)))
    if kv_layout == "NHD":
      cache_spec = lambda d: pl.BlockSpec((rows, None, d), lambda i, h, j: (0, h, 0))
    else:
      cache_spec = lambda d: pl.BlockSpec((None, rows, d), lambda i, h, j: (h, 0, 0))
  elif kv_layout == "NHD":
    cache_spec = lambda d: pl.BlockSpec((None, rows, None, d), lambda i, h, j: (i // fold, 0, h, 0))
  else:
    cache_spec = lambda d: pl.BlockSpec((None, None, rows, d), lambda i, h, j: (i // fold, h, 0, 0))
  if sparse is not None:
    idx = pad_slots(indices, bk, seq_len)
    per_head = lambda h: h if idx.shape[1] > 1 else 0
    operands += [idx, index_bounds.astype(jnp.int32)]
    in_specs += [pl.BlockSpec((None, None, idx.shape[2]), lambda i, h, j: (i, per_head(h), 0)),
                 pl.BlockSpec((None, None, 2), lambda i, h, j: (i, per_head(h), 0))]
  operands += [q_rows, k]
  in_specs += [_ROWS, cache_spec(dk)]
  for x in (v, k_rope):  # MLA: no v operand, the values are read from k
    if x is not None:
      operands.append(x)
      in_specs.append(cache_spec(x.shape[-1]))
  quant_dims = []
  for a in quant_arrays:
    if a is None:
      quant_dims.append(None)
      continue
    operand, spec, dims = _quant_operand(a, paged, fold)
    operands.append(operand)
    in_specs.append(spec)
    quant_dims.append(dims)
  s_p = rows if not paged else num_blocks * bk  # positions a block may load
  for x, as_dtype in ((mask, jnp.int8), (bias, None)):
    if x is None:
      continue
    bm, hm, tm, gm, s = x.shape
    x = x.reshape(bm, hm, tm * gm, s).astype(as_dtype or x.dtype)
    x = jnp.pad(x, [(0, 0), (0, 0), (0, 0), (0, s_p - s)])
    operands.append(x)
    in_specs.append(pl.BlockSpec((None, None, tm * gm, s_p), lambda i, h, j, bm=bm, hm=hm: (
        i if bm > 1 else 0, h if hm > 1 else 0, 0, 0)))
  if alibi is not None:  # [Hkv, G] -> per row r = t * G + g: [Hkv, R_p]
    slopes = jnp.pad(jnp.tile(alibi.astype(jnp.float32), (1, num_tokens)), [(0, 0), (0, rows_p - r)])
    operands.append(slopes)
    in_specs.append(_ROWS)
  plan = _Plan(paged=paged, block=bk, seq_len=seq_len, rows=rows, page_size=page_size,
               num_pages=num_pages, table_len=table_len,
               k_pieces=k_pieces, v_pieces=v_pieces, quant=tuple(quant_dims), mods=mods,
               v_from_k=v_from_k, r_pieces=r_pieces, sparse=sparse is not None, fp8_bits=tuple(fp8_bits),
               balanced=balanced)
  kernel = functools.partial(
      _kernel, plan=plan, softmax_scale=softmax_scale,
      num_splits=num_splits, num_rows=r, group=r // num_tokens,
      num_tokens=num_tokens, row_blocks=row_blocks)
  # Grid axis 1 is (kv head, row block): kv head = axis // row_blocks, block = axis % row_blocks.
  by_head = lambda spec: pl.BlockSpec(spec.block_shape, lambda i, hr, j, f=spec.index_map: f(i, hr // row_blocks, j))
  row_specs = iter([  # q [B, Hkv, R_p, Dq] and slopes [Hkv, R_p]: this program's rows
      pl.BlockSpec((None, None, block_r, dq), lambda i, hr, j: (i, hr // row_blocks, hr % row_blocks, 0)),
      pl.BlockSpec((None, block_r), lambda i, hr, j: (hr // row_blocks, hr % row_blocks))])
  in_specs = [next(row_specs) if spec is _ROWS else by_head(spec) for spec in in_specs]
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    compiler_params = pltriton.CompilerParams(num_warps=launch.warps, num_stages=launch.stages)
  out_map = lambda i, hr, j: (i, hr // row_blocks, j, hr % row_blocks)
  out_shape = [blk.out_struct((b, hkv, num_splits, rows_p, dv), jnp.float32, *operands),
               blk.out_struct((b, hkv, num_splits, rows_p), jnp.float32, *operands)]
  cost = blk.cost_estimate(b=b, hkv=hkv, rows=r, keys=seq_len if sparse is None else indices.shape[-1],
                           dk=dq, dv=dv, caches=[x for x in (k, v, k_rope) if x is not None],
                           operands=operands, outputs=out_shape, sparse=sparse is not None)
  o, lse = pl.pallas_call(
      kernel,
      grid=(b, hkv * row_blocks, num_splits),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, block_r, dv), lambda i, hr, j: out_map(i, hr, j) + (0,)),
          pl.BlockSpec((None, None, None, block_r), out_map),
      ],
      out_shape=out_shape,
      compiler_params=compiler_params,
      cost_estimate=cost,
      interpret=interpret,
      name="fdecode_split_kv_triton",
  )(*operands)
  o, lse = o[:, :, :, :r], lse[:, :, :, :r]
  if balanced:  # each sequence's items merged: one "split" per sequence
    o, lse = merge_segments(o[:, :, 0], lse[:, :, 0], item_seq, seqs)
    o, lse = o[:, :, None], lse[:, :, None]
  return o, lse
