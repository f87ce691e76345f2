"""How a call's query rows and head dims are tiled for Triton, whose tensors have
power-of-two sizes and whose dots need every dimension >= 16 (`MIN_DOT`).

Rows. A kv head's R = T * G query rows are the rows of its matmuls. A program holds
``block_r`` rows, a power of two >= 16: R rounded up to the next power of two while that
fits `ROW_BUDGET`, else the largest power of two that fits, in ``ceil(R / block_r)`` row
blocks (each re-reads the cache, from L2 after the first). Padding to a power of two
(48 -> 64, 80 -> 128) costs only matmul rows, which a memory-bound decode has to spare;
tiling into smaller blocks instead (48 = 32 + 16) would read the cache once per block.
The rows past R are *masked*: their queries load a real row (never out of bounds), they
see no key, and their stores are masked off, so nothing is padded in memory and no q
copy is made.

Columns. Each head dim (and scale tile) is cut into power-of-two pieces
(`fdecode.kernels.common.block.head_pieces`), each a dot of its own.
"""

from __future__ import annotations

from fdecode.kernels.common import block as blk
from fdecode.kernels.triton.launch import MIN_DOT, pow2_at_least

# Elements of q (and of the float32 accumulator) one program holds: with 4 warps about
# 64-128 registers a thread. Wider rows (MLA's 576 / 512) get fewer rows per program
# (sglang's Triton MLA decode: 16 heads a program); a float32 computation a quarter.
ROW_BUDGET = 16 * 1024
PIECE_COLS = 64                 # a piece costs at least this many columns (dot, masks, acc)
# Widest piece of a float32 computation (FMA dots hold a contraction row a thread).
F32_PIECE = 128


def row_tiling(rows: int, dq: int, dv: int, compute_bytes: int = 2) -> tuple[int, int]:
  """``(block_r, row_blocks)`` for R = ``rows`` query rows of widths ``dq`` / ``dv``: the
  rows rounded up to a power of two >= 16 while ``block_r * max(dq, dv)`` fits
  `ROW_BUDGET` (a quarter of it for a float32 computation), else the largest power of two
  that fits; ``ceil(R / block_r)`` blocks."""
  budget = ROW_BUDGET // (4 if compute_bytes == 4 else 1)
  per = max(MIN_DOT, 1 << ((budget // max(dq, dv, 1)).bit_length() - 1))
  block_r = min(max(MIN_DOT, pow2_at_least(rows)), per)
  return block_r, -(-max(rows, 1) // block_r)


def column_pieces(dk, dv, k_tiles, v_tiles, v_from_k, rope_dim, max_width=None):
  """(k, v, k_rope) power-of-two column pieces; MLA values (``v_from_k``) are k's leading pieces."""
  pieces = lambda d, tiles, **kw: blk.head_pieces(d, tiles, pow2=True, max_width=max_width, **kw)
  k_pieces = pieces(dk, k_tiles)
  v_pieces = pieces(dk, k_tiles, limit=dv) if v_from_k else pieces(dv, v_tiles)
  return k_pieces, v_pieces, pieces(rope_dim, 1) if rope_dim else ()


def triton_unsupported(dk: int, dv: int, k_tiles: int = 1, v_tiles: int = 1, *, v_from_k: bool = False,
                       rope_dim: int = 0) -> str | None:
  """Why the Triton kernel cannot take these head dims / scale tiles, or None.
  ``dk``: k's own columns (without ``rope_dim`` k_rope columns)."""
  pieces = column_pieces(dk, dv, k_tiles, v_tiles, v_from_k, rope_dim)
  for name, d, nt, ps in (("Dk", dk, k_tiles, pieces[0]), ("Dv", dv, k_tiles if v_from_k else v_tiles, pieces[1]),
                          ("k_rope's Dr", rope_dim, 1, pieces[2])):
    narrow = [p.width for p in ps if p.width < MIN_DOT]
    if narrow:
      return (f"{name}={d} with {nt} scale tile(s) has a column piece {narrow[0]} wide; "
              f"Triton's dot needs head dims and scale tiles that are multiples of {MIN_DOT}")
  return None
