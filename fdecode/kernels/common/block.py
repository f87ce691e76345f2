"""Block math every FlashDecode kernel shares: head-dim pieces, dequantization of a
loaded piece, scores, the dead-slot select and the online-softmax update.

The Triton (GPU) and Mosaic (TPU) kernels differ only in how a block of the cache
reaches the core; once loaded, a block goes through the functions here. Legend as in
`fdecode.config`; in a kernel, R_p is the padded query-row count and ``bk`` the tokens of
one block.

Pieces. A kernel may not be able to load a whole head dim at once: Triton tensors must
have power-of-two sizes (Dk = 80, 96, 112, 192, 576 are not), and a tile-wise 8-bit scale
(`fdecode.cache.quant`) covers only ``D / n_tiles`` columns. So a head dim is read as static
column *pieces* ``(offset, width)``: each lies inside one scale tile, and on Triton each
width is a power of two (80 = 64 + 16, 576 = 512 + 64). Scores sum the pieces' dot
products; the output keeps one accumulator per value piece. Every byte of the cache is
still read exactly once and nothing is padded in memory.

Dead slots. A slot a query may not see (past the sequence's end, before a block's start
in an overlapped tail load, a recycled page's stale tail, memory past the cache) may hold
anything, inf and NaN included. Its score is *selected* to `MASK_VALUE` and its
probability to 0, and its value row is *selected* to 0 before the PV matmul: ``0 * inf``
would be NaN, so nothing is ever multiplied away.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fdecode.combine import F32_ONE, F32_ZERO, MASK_VALUE, corrupt_rows, finalize_state
from fdecode.kernels.common.modifiers import Modifiers, window_lo, window_start
from fdecode.cache.quant import dequantize


@dataclasses.dataclass(frozen=True)
class Piece:
  """Columns ``[offset, offset + width)`` of a head dim, inside scale tile ``tile``."""
  offset: int
  width: int
  tile: int


def _pow2_parts(width: int) -> list[int]:
  """Power-of-two widths summing to ``width``, largest first (80 -> [64, 16])."""
  return [1 << b for b in range(width.bit_length() - 1, -1, -1) if width >> b & 1]


def head_pieces(d: int, n_tiles: int = 1, *, pow2: bool, limit: int | None = None,
                max_width: int | None = None) -> tuple[Piece, ...]:
  """Static pieces of a head dim of ``d`` columns with ``n_tiles`` scale tiles.

  ``pow2``: split each tile into power-of-two widths (Triton); otherwise one piece per
  tile (Mosaic, whose blocks may span the full head dim). ``limit``: only the first
  ``limit`` columns (MLA values: k's leading columns); tiles wholly inside give the same
  pieces as without it, so a kernel can reuse those loaded key pieces as values.
  ``max_width`` (a power of two, with ``pow2``): no piece wider (Triton's float32 dots
  run on FMAs and hold a whole contraction row a thread: 512 wide ones spill).
  """
  tile_w = d // n_tiles
  limit = d if limit is None else limit
  pieces = []
  for t in range(-(-limit // tile_w)):
    offset = t * tile_w
    width = min(tile_w, limit - offset)
    for part in (_pow2_parts(width) if pow2 else [width]):
      for w in ([max_width] * (part // max_width) if max_width and part > max_width else [part]):
        pieces.append(Piece(offset, w, t))
        offset += w
  return tuple(pieces)


def decode_fp8_bits(b, dtype_name: str):
  """float8 bytes (uint8 ``x``, or int32 holding them) -> float32 values, with integer
  ops only (GPUs below sm_89 have no float8 conversions; the Mosaic kernel unpacks bytes
  from 32-bit words). e4m3fn: no inf, ``S.1111.111`` is NaN; e5m2:
  IEEE-like (exponent 31: inf / NaN). Subnormals are built exactly from the mantissa;
  the specials are selected, so nothing depends on denormal flushing."""
  e4m3 = dtype_name == "float8_e4m3fn"
  man_bits, bias = (3, 7) if e4m3 else (2, 15)
  b = b.astype(jnp.int32)
  mag = b & 0x7F
  sign = jnp.where((b & 0x80) != 0, -1.0, 1.0)
  exp = mag >> man_bits
  man = mag & ((1 << man_bits) - 1)
  normal = lax.bitcast_convert_type((mag << (23 - man_bits)) + ((127 - bias) << 23), jnp.float32)
  sub = man.astype(jnp.float32) * (2.0 ** (1 - bias - man_bits))
  x = jnp.where(exp == 0, sub, normal)
  if e4m3:
    x = jnp.where(mag == 0x7F, jnp.nan, x)
  else:
    x = jnp.where(exp == 31, jnp.where(man == 0, jnp.inf, jnp.nan), x)
  return sign * x


def dequantize_piece(x, scale, offset, dtype):
  """A loaded piece ``[bk, w]`` of an 8-bit cache and its tile's scale (and offset) column
  ``[bk|1, 1]`` -> ``[bk, w]`` in ``dtype``; a float piece is only cast."""
  if scale is None:
    return x.astype(dtype)
  return dequantize(x, scale, offset, dtype)


def _precision(dtype):
  """float32 matmuls at full precision (GPUs would otherwise use TF32)."""
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def block_scores(q_pieces, k_pieces, softmax_scale: float):
  """``q_pieces`` ``[R_p, w]`` and ``k_pieces`` ``[bk, w]`` (same pieces, compute dtype)
  -> float32 scores ``[R_p, bk]``."""
  s = None
  for q, k in zip(q_pieces, k_pieces):
    part = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_precision(q.dtype),
                           preferred_element_type=jnp.float32)
    s = part if s is None else s + part
  return s * softmax_scale


def rows_may_differ(num_tokens: int, mods: Modifiers) -> bool:
  """Static: whether the rows of one kv head may see different slots (several new tokens
  under causality or a window, or a mask with per-token / per-head entries). Only then
  can a slot be visible to one row and not to another, which `guard_values` handles."""
  return num_tokens > 1 or bool(mods.mask)


def corrupt_value_rows(v_pieces):
  """bool ``[bk, 1]``: value row j holds an inf or NaN (``abs(x) <= max`` is False for
  both; no NaN-ignoring max involved)."""
  bad = None
  for v in v_pieces:
    b = jnp.max(jnp.where(jnp.abs(v.astype(jnp.float32)) <= jnp.finfo(jnp.float32).max, F32_ZERO, F32_ONE),
                axis=1, keepdims=True)
    bad = b if bad is None else jnp.maximum(bad, b)
  return bad > 0


def guard_values(k_pieces, v_pieces, enabled: bool):
  """Per-row selection of corrupt values through the keys, before the scores (static
  ``enabled``, see `rows_may_differ`; otherwise ``(k_pieces, None)``).

  The PV matmul shares a value row among all rows of a kv head, and ``0 * NaN`` is NaN,
  so a NaN (or inf) value that one row sees would reach a row that does not. Instead,
  such a value row poisons its key (the score is NaN for every row, then selected per
  row like any score: only rows that see the slot turn NaN) and is itself selected to 0
  (`online_update`'s ``bad``). Returns ``(k_pieces, bad bool [bk, 1])``. The Mosaic
  kernels use this form; Triton's poisons the scores in `online_update` (``guard``),
  which keeps the value block's registers out of the QK matmul."""
  if not enabled:
    return k_pieces, None
  bad = corrupt_value_rows(v_pieces)
  first = k_pieces[0]
  return [jnp.where(bad, jnp.array(jnp.nan, first.dtype), first), *k_pieces[1:]], bad


def init_state(rows: int, v_pieces):
  """Empty online-softmax state: (acc pieces f32 ``[rows, w]``, m ``[rows, 1]``, l ``[rows, 1]``)."""
  acc = tuple(jnp.zeros((rows, p.width), jnp.float32) for p in v_pieces)
  return acc, jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32)


def row_sums(p, by_dot: bool = False):
  """float32 ``[R_p, 1]``: each row's sum of ``p`` ``[R_p, bk]``. ``by_dot``: as a product
  with a column of ones (the batch-invariant mode in the Mosaic kernels, whose row tile is
  every row of the call): XLA:CPU's sum along the last axis rounds by the row count (rows
  of 32 x 128 and more, measured in the TPU interpreter's arithmetic, 2026-12-02), a
  product's rows do not."""
  if not by_dot:
    return jnp.sum(p, axis=1, keepdims=True)
  ones = jnp.ones((p.shape[1], 128), jnp.float32)
  return lax.dot_general(p, ones, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)[:, :1]


def online_update(state, s, visible, live, v_pieces, bad=None, guard: bool = False, sums_by_dot: bool = False):
  """One block of the online softmax.

  Args:
    state: ``(acc, m, l)`` as from `init_state`.
    s: float32 scores ``[R_p, bk]`` (may hold NaN/inf at dead slots).
    visible: bool ``[R_p, bk]``: row r may see slot j (causal limit and liveness).
    live: bool ``[bk, 1]``: slot j holds a live token of the sequence (some row may see
      it). Dead value rows are selected to 0 before the PV matmul.
    v_pieces: value pieces ``[bk, w]`` in the compute dtype.
    bad: bool ``[bk, 1]`` or None: value rows holding inf / NaN whose keys
      `guard_values` poisoned; they are selected to 0 too.
    guard: static; find those rows here instead and poison their scores (the
      `guard_values` semantics, with the transpose of ``bad`` a reshape).
    sums_by_dot: static; the row sums as a product (`row_sums`).

  Returns:
    the updated state.
  """
  acc, m, l = state
  if guard:
    bad = corrupt_value_rows(v_pieces)
    s = jnp.where(bad.reshape(1, bad.shape[0]), jnp.nan, s)
  if bad is not None:
    live = live & ~bad
  s = jnp.where(visible, s, MASK_VALUE)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
  l_new = alpha * l + row_sums(p, sums_by_dot)
  new_acc = []
  for a, v in zip(acc, v_pieces):
    v = jnp.where(live, v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=_precision(v.dtype), preferred_element_type=jnp.float32)
    new_acc.append(alpha * a + pv)
  return tuple(new_acc), m_new, l_new


def finalize(state):
  """State -> (o pieces f32 ``[R_p, w]``, lse f32 ``[R_p, 1]``); empty rows 0 / -inf."""
  acc, m, l = state
  out = []
  lse = None
  if acc:  # a corrupt value in any column piece poisons the whole row (`finalize_state`)
    l = jnp.where(corrupt_rows(*acc)[:, None], jnp.nan, l)
  for a in acc:
    o, lse = finalize_state(a, m[:, 0], l[:, 0])
    out.append(o)
  if lse is None:  # Dv = 0 never reaches a kernel; keep the contract anyway
    _, lse = finalize_state(jnp.zeros_like(m), m[:, 0], l[:, 0])
  return tuple(out), lse[:, None]


class Rows(NamedTuple):
  """Per query row of a kernel program, int32 ``[R_p, 1]``: row r sees key positions
  ``lo <= j < hi`` (lo None: no window), and sits at position ``qpos``."""
  lo: Any
  hi: Any
  qpos: Any


def row_geometry(end, num_rows: int, rows_p: int, group: int, num_tokens: int, seq_len: int,
                 mods: Modifiers, first_row=0) -> Rows:
  """Row r (query token ``t = r // group`` at position ``end - T + t``): its visible range
  under causality and the window (`fdecode.kernels.common.modifiers`); padding rows see nothing. A
  program holding rows ``[first_row, first_row + rows_p)`` gets theirs."""
  rows = first_row + lax.broadcasted_iota(jnp.int32, (rows_p, 1), 0)
  # Overflow-free int32 (as `fdecode.kernels.common.modifiers.row_bounds`): a far-negative end saturates.
  end = jnp.maximum(end, jnp.iinfo(jnp.int32).min + num_tokens)
  qpos = end - num_tokens + rows // group
  hi = jnp.clip(qpos + 1, 0, seq_len) if mods.causal else jnp.broadcast_to(jnp.clip(end, 0, seq_len), qpos.shape)
  hi = jnp.where(rows < num_rows, hi, 0)
  lo = None if mods.window is None else window_lo(qpos, mods.window, seq_len)
  return Rows(lo, hi, qpos)


def _cdiv(a, b: int):
  return (a + b - 1) // b


def split_range(end, split, num_splits: int, num_tokens: int, seq_len: int, bk: int, mods: Modifiers,
                split_blocks: int = 0):
  """Blocks ``[first, last)`` of ``bk`` tokens that split ``split`` of ``num_splits``
  processes: the blocks any row may see (from the window's first block to the
  sequence's end) are dealt out evenly, so no split reads a block outside the window or
  past the end, and a short or windowed sequence still uses every split.

  ``split_blocks`` > 0 (static): the batch-invariant mode's layout instead. Split ``split``
  holds the ``split_blocks`` blocks from absolute block ``split * split_blocks``, whatever
  the sequence's end, the call's T or the batch, and runs those of them some row may see.
  A block no row of a program sees leaves its state's bits as they were (`online_update`:
  every score selected away, ``alpha`` exactly 1, ``p`` exactly 0), so a row's state is the
  same whether the call's other rows made the program run more blocks or fewer."""
  live_end = jnp.clip(end, 0, seq_len)
  hi = _cdiv(live_end, bk)
  lo = jnp.minimum(window_start(end, num_tokens, seq_len, mods) // bk, hi)
  if split_blocks:
    first = jnp.maximum(split * split_blocks, lo)
    return first, jnp.maximum(first, jnp.minimum((split + 1) * split_blocks, hi))
  per = _cdiv(hi - lo, num_splits)
  first = lo + split * per
  return first, jnp.minimum(first + per, hi)


def row_source(rows_p: int, group: int, num_tokens: int, form, shape, first_row=0):
  """int32 iota of ``shape`` (leading dim R_p): for each row r = t * G + g (from
  ``first_row``), the row of a canonical mask / bias block ``[Tm * Gm, bk]`` it reads
  (form = (Tm, Gm))."""
  tm, gm = form
  rows = first_row + lax.broadcasted_iota(jnp.int32, shape, 0)
  t = jnp.minimum(rows // group, num_tokens - 1)
  return (t if tm > 1 else 0) * gm + (rows % group if gm > 1 else 0)


def expand_rows(block, rows_p: int, group: int, num_tokens: int, form, *, finite: bool = False):
  """A canonical mask / bias block float32 ``[Tm * Gm, bk]`` -> ``[R_p | 1, bk]`` by rows,
  as a one-hot matmul (exact in float32; for kernels without gathers).

  The matmul multiplies every other source row by 0, so an inf / NaN entry (a bias at a
  slot its row may not see can hold anything) would reach every row. Non-finite entries
  go through the matmul as codes instead (NaN 1, +inf 2, -inf 3; finite 0) and are
  selected back per row: each row gets exactly its own entries. ``finite``: the block
  is known finite (a mask as 0 / 1), skip that."""
  m = block.shape[0]
  if m == 1:
    return block
  src = row_source(rows_p, group, num_tokens, form, (rows_p, m))
  one_hot = jnp.where(src == lax.broadcasted_iota(jnp.int32, (rows_p, m), 1), 1.0, 0.0)
  pick = lambda x: lax.dot_general(one_hot, x, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)
  if finite:
    return pick(block)
  ok = jnp.abs(block) <= jnp.finfo(jnp.float32).max  # False for inf and NaN
  code = pick(jnp.where(ok, 0.0, jnp.where(block > 0, 2.0, jnp.where(block < 0, 3.0, 1.0))))
  out = pick(jnp.where(ok, block, 0.0))
  return jnp.where(code == 0.0, out, jnp.where(code == 2.0, jnp.inf, jnp.where(code == 3.0, -jnp.inf, jnp.nan)))


def modify_scores(s, mods: Modifiers, rows: Rows, pos_row, slopes=None, bias=None):
  """Soft cap, ALiBi and additive bias on float32 scores ``[R_p, bk]`` (`fdecode.kernels.common.modifiers`).

  pos_row: int32 ``[1, bk]`` key positions; slopes: float32 ``[R_p, 1]``; bias: float32
  ``[R_p | 1, bk]``.
  """
  if mods.soft_cap is not None:
    s = mods.soft_cap * jnp.tanh(s * (1.0 / mods.soft_cap))
  if slopes is not None:
    s = s + slopes * (pos_row - rows.qpos).astype(jnp.float32)
  if bias is not None:
    s = s + bias
  return s


def column_any(visible):
  """bool ``[R_p, bk]`` -> ``[bk, 1]``: some row sees slot j (a transpose, then a
  lane reduction)."""
  return jnp.max(jnp.where(visible, F32_ONE, F32_ZERO).T, axis=1, keepdims=True) > 0


def block_masks(rows: Rows, load_start, start, live_end, bk: int, *, first_visible=0, mask=None):
  """Masks of a block loaded from position ``load_start`` whose own tokens begin at
  ``start`` (earlier loaded slots belong to the previous block).

  Args:
    rows: `row_geometry`.
    live_end: the sequence's end in the cache (clipped to S).
    first_visible: the first position any row may see (`fdecode.kernels.common.modifiers.window_start`).
    mask: bool ``[R_p | 1, bk]`` the caller's mask for this block, or None.

  Returns ``(visible [R_p, bk], live [bk, 1])``: ``live`` = some row sees slot j (without
  a mask: ``max(start, first_visible) <= pos < live_end``).
  """
  pos_row = load_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  visible = (pos_row >= start) & (pos_row < rows.hi)
  if rows.lo is not None:
    visible &= pos_row >= rows.lo
  if mask is not None:
    visible &= mask
    return visible, column_any(visible)
  pos_col = load_start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
  live = (pos_col >= jnp.maximum(start, first_visible)) & (pos_col < live_end)
  return visible, live


def sparse_block_masks(rows: Rows, pos_row, live_end, first_visible, pos_col=None):
  """Masks of a block of sparse index slots (`fdecode.kernels.common.sparse`): slot j holds the key at
  position ``pos[j]`` (a dropped slot holds S, past every row's end).

  Args:
    rows: `row_geometry`.
    pos_row: int32 ``[1, bk]`` the slots' positions; ``pos_col``: the same ``[bk, 1]``,
      or None to derive liveness from the rows' visibility (kernels without a cheap
      transpose of an int vector).
    live_end, first_visible: as `block_masks`.

  Returns ``(visible [R_p, bk], live [bk, 1])``.
  """
  visible = pos_row < rows.hi
  if rows.lo is not None:
    visible &= pos_row >= rows.lo
  if pos_col is None:
    return visible, column_any(visible)
  return visible, (pos_col >= first_visible) & (pos_col < live_end)


def sorted_slot_masks(rows: Rows, pos_row, live_end, first_visible, bk: int):
  """`sparse_block_masks` for a block of *sorted* slots (canonical lists are), built
  from counts: row r sees slots ``[#(pos < lo_r), #(pos < hi_r))`` and the live slots are
  ``[#(pos < first_visible), #(pos < live_end))``. The masks are then iota comparisons,
  which Triton rebuilds in any layout; a boolean made from loaded positions would have
  to change layout through shared memory, which takes no 1-bit elements."""
  count = lambda bound: jnp.sum((pos_row < bound).astype(jnp.int32), axis=1, keepdims=True)
  lanes = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  visible = lanes < count(rows.hi)
  if rows.lo is not None:
    visible &= lanes >= count(rows.lo)
  slots = lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
  live = (slots >= count(first_visible)[0, 0]) & (slots < count(live_end)[0, 0])
  return visible, live


def out_struct(shape, dtype, *inputs):
  """A pallas_call output type that varies over every mesh axis any of ``inputs`` varies
  over, so kernels run inside ``jax.shard_map(..., check_vma=True)``."""
  mats = [jax.typeof(x).manual_axis_type for x in inputs]
  varying = frozenset().union(*(m.varying for m in mats))
  if not varying:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))


def vary_like(x, *inputs):
  """``x`` typed as varying over every mesh axis any of ``inputs`` varies over (inside
  ``jax.shard_map(..., check_vma=True)``): for a kernel whose outputs come back typed
  invariant whatever its operands (Mosaic GPU's ``plgpu.kernel`` in jax 0.10), so the
  ops after it (the Triton combine's `out_struct`) see what truly varies."""
  varying = frozenset().union(*(jax.typeof(i).manual_axis_type.varying for i in inputs))
  missing = tuple(sorted(varying - jax.typeof(x).manual_axis_type.varying))
  return lax.pcast(x, missing, to="varying") if missing else x


def cost_estimate(*, b: int, hkv: int, rows: int, keys: int, dk: int, dv: int, caches, operands,
                  outputs, sparse: bool = False):
  """What one decode ``pallas_call`` costs, for XLA's scheduler (``pl.CostEstimate``).

  Args:
    b, hkv: the grid's sequences and kv heads.
    rows: query rows per (sequence, kv head).
    keys: keys each row scores: the addressable tokens (capacity), or the slots of a
      sparse list.
    dk, dv: scored and accumulated head dims.
    caches: the K / V / k_rope operands (streamed once per (sequence, kv head); sparse:
      ``keys`` rows of each). A paged pool's unused pages are not read.
    operands: every operand; those not in ``caches`` (queries, tables, scales,
      modifiers) count whole, once.
    outputs: the output types, written once.
  """
  nbytes = lambda x: int(x.size) * jnp.dtype(x.dtype).itemsize
  itemsize = lambda x: jnp.dtype(x.dtype).itemsize
  if sparse:
    cache_bytes = sum(b * hkv * keys * x.shape[-1] * itemsize(x) for x in caches)
  else:
    cache_bytes = sum(min(int(x.size), b * hkv * keys * x.shape[-1]) * itemsize(x) for x in caches)
  small = sum(nbytes(x) for x in operands if not any(x is c for c in caches))
  total = cache_bytes + small + sum(nbytes(x) for x in outputs)
  return pl.CostEstimate(flops=2 * b * hkv * rows * keys * (dk + dv), transcendentals=b * hkv * rows * keys,
                         bytes_accessed=int(total))
