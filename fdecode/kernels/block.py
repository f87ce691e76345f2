"""Block math every FlashDecode kernel shares: head-dim pieces, dequantization of a
loaded piece, scores, the dead-slot select and the online-softmax update.

The Triton (GPU) and Mosaic (TPU) kernels differ only in how a block of the cache
reaches the core; once loaded, a block goes through the functions here. Legend as in
`fdecode.config`; in a kernel, R_p is the padded query-row count and ``bk`` the tokens of
one block.

Pieces. A kernel may not be able to load a whole head dim at once: Triton tensors must
have power-of-two sizes (Dk = 80, 96, 112, 192, 576 are not), and a tile-wise 8-bit scale
(`fdecode.quant`) covers only ``D / n_tiles`` columns. So a head dim is read as static
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

import jax
import jax.numpy as jnp
from jax import lax

from fdecode.combine import MASK_VALUE, finalize_state
from fdecode.quant import dequantize


@dataclasses.dataclass(frozen=True)
class Piece:
  """Columns ``[offset, offset + width)`` of a head dim, inside scale tile ``tile``."""
  offset: int
  width: int
  tile: int


def _pow2_parts(width: int) -> list[int]:
  """Power-of-two widths summing to ``width``, largest first (80 -> [64, 16])."""
  return [1 << b for b in range(width.bit_length() - 1, -1, -1) if width >> b & 1]


def head_pieces(d: int, n_tiles: int = 1, *, pow2: bool) -> tuple[Piece, ...]:
  """Static pieces of a head dim of ``d`` columns with ``n_tiles`` scale tiles.

  ``pow2``: split each tile into power-of-two widths (Triton); otherwise one piece per
  tile (Mosaic, whose blocks may span the full head dim).
  """
  tile_w = d // n_tiles
  pieces = []
  for t in range(n_tiles):
    offset = t * tile_w
    for w in (_pow2_parts(tile_w) if pow2 else [tile_w]):
      pieces.append(Piece(offset, w, t))
      offset += w
  return tuple(pieces)


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


def init_state(rows: int, v_pieces):
  """Empty online-softmax state: (acc pieces f32 ``[rows, w]``, m ``[rows, 1]``, l ``[rows, 1]``)."""
  acc = tuple(jnp.zeros((rows, p.width), jnp.float32) for p in v_pieces)
  return acc, jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32)


def online_update(state, s, visible, live, v_pieces):
  """One block of the online softmax.

  Args:
    state: ``(acc, m, l)`` as from `init_state`.
    s: float32 scores ``[R_p, bk]`` (may hold NaN/inf at dead slots).
    visible: bool ``[R_p, bk]``: row r may see slot j (causal limit and liveness).
    live: bool ``[bk, 1]``: slot j holds a live token of the sequence (some row may see
      it). Dead value rows are selected to 0 before the PV matmul.
    v_pieces: value pieces ``[bk, w]`` in the compute dtype.

  Returns:
    the updated state.
  """
  acc, m, l = state
  s = jnp.where(visible, s, MASK_VALUE)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
  l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
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
  for a in acc:
    o, lse = finalize_state(a, m[:, 0], l[:, 0])
    out.append(o)
  if lse is None:  # Dv = 0 never reaches a kernel; keep the contract anyway
    _, lse = finalize_state(jnp.zeros_like(m), m[:, 0], l[:, 0])
  return tuple(out), lse[:, None]


def row_limits(end, num_rows: int, rows_p: int, group: int, num_tokens: int, seq_len: int):
  """int32 ``[R_p, 1]``: row r (query token ``r // group``) sees cache positions below
  its limit ``end - T + t + 1`` clipped to ``[0, S]``; padding rows see nothing."""
  rows = lax.broadcasted_iota(jnp.int32, (rows_p, 1), 0)
  limit = jnp.clip(end - num_tokens + 1 + rows // group, 0, seq_len)
  return jnp.where(rows < num_rows, limit, 0)


def block_masks(row_limit, load_start, start, live_end, bk: int):
  """Masks of a block loaded from position ``load_start`` whose own tokens begin at
  ``start`` (earlier loaded slots belong to the previous block).

  Returns ``(visible [R_p, bk], live [bk, 1])``: ``live`` = ``start <= pos < live_end``.
  """
  pos_row = load_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  visible = (pos_row >= start) & (pos_row < row_limit)
  pos_col = load_start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
  live = (pos_col >= start) & (pos_col < live_end)
  return visible, live


def out_struct(shape, dtype, *inputs):
  """A pallas_call output type that varies over every mesh axis any of ``inputs`` varies
  over, so kernels run inside ``jax.shard_map(..., check_vma=True)``."""
  mats = [jax.typeof(x).manual_axis_type for x in inputs]
  varying = frozenset().union(*(m.varying for m in mats))
  if not varying:
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))
