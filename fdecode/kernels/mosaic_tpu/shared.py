"""What the Mosaic kernels (contiguous, paged, sparse) share: the column pieces of a loaded
block and their dequantization, the score modifiers of a block, the DMA loop over two
buffer slots, the modifier operands and the partial outputs."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import window_start

# The cache streams, then the quantization arrays, as the kernels' operands name them.
CACHES = ("k", "v", "k_rope")
QUANT = ("k_scale", "k_offset", "v_scale", "v_offset")


def _pieces(d, scale, limit=None):
  return blk.head_pieces(d, 1 if scale is None else scale.shape[-1], pow2=False, limit=limit)


def all_pieces(k, v, k_scale, v_scale, v_head_dim):
  """(k pieces, v pieces): MLA values (``v`` None) are k's leading pieces."""
  k_pieces = _pieces(k.shape[-1], k_scale)
  v_pieces = _pieces(k.shape[-1], k_scale, limit=v_head_dim) if v is None else _pieces(v.shape[-1], v_scale)
  return k_pieces, v_pieces


def _dequant_pieces(x, pieces, scale, offset, dtype, done=None):
  """A loaded block ``[bk, D]`` -> its pieces, dequantized with ``scale`` ``[bk|1, nt]``.
  ``done``: pieces already dequantized from this same block (MLA values reuse the keys')."""
  out = []
  for p in pieces:
    if done and p in done:
      out.append(done[p])
      continue
    xp = x if p.offset == 0 and p.width == x.shape[1] else x[:, p.offset:p.offset + p.width]
    col = lambda a: None if a is None else a[:, p.tile:p.tile + 1]
    out.append(blk.dequantize_piece(xp, col(scale), col(offset), dtype))
  return out


def block_kv(kx, vx, rx, k_pieces, v_pieces, quant, dtype):
  """Loaded blocks (k, v or None for MLA, k_rope or None) and their loaded quantization
  arrays ``quant`` (k_scale, k_offset, v_scale, v_offset; each None when absent) ->
  (key pieces, value pieces)."""
  k_scale, k_offset, v_scale, v_offset = quant
  kb = _dequant_pieces(kx, k_pieces, k_scale, k_offset, dtype)
  if vx is None:  # MLA: the values are the key block's first columns, read once
    vb = _dequant_pieces(kx, v_pieces, k_scale, k_offset, dtype, done=dict(zip(k_pieces, kb)))
  else:
    vb = _dequant_pieces(vx, v_pieces, v_scale, v_offset, dtype)
  return kb + ([] if rx is None else [rx.astype(dtype)]), vb


def query_pieces(q, k_pieces, rope):
  """q ``[R_p, Dq]`` split like the key pieces (and k_rope's columns after them)."""
  out = [q if len(k_pieces) == 1 and not rope else q[:, p.offset:p.offset + p.width] for p in k_pieces]
  if rope:
    dk = k_pieces[-1].offset + k_pieces[-1].width
    out.append(q[:, dk:])
  return out


def modify(s, mods, rows, start, live_end, bk, loaded, *, end, seq_len, group, num_tokens):
  """Score modifiers and masks of a block of ``bk`` tokens from ``start``. ``loaded``:
  the block's (mask i32 ``[M, bk]``, bias ``[M, bk]``, slopes f32 ``[R_p, 1]``), each
  None when absent; mask / bias rows are expanded by `block.expand_rows` (no gathers
  on TPU). Returns (scores, visible, live) for `block.online_update`."""
  mask, bias, slopes = loaded
  rows_p = s.shape[0]
  expand = lambda x, form, **kw: blk.expand_rows(x.astype(jnp.float32), rows_p, group, num_tokens, form, **kw)
  pos_row = start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  bias = None if bias is None else expand(bias, mods.bias)
  s = blk.modify_scores(s, mods, rows, pos_row, slopes, bias)
  mask = None if mask is None else expand(mask, mods.mask, finite=True) > 0.5
  visible, live = blk.block_masks(rows, start, start, live_end, bk, mask=mask,
                                  first_visible=window_start(end, num_tokens, seq_len, mods))
  return s, visible, live


def double_buffered(first, last, start, wait, body, init):
  """The Mosaic kernels' DMA loop over steps ``[first, last)`` with two buffer slots:
  ``start(step, slot)`` / ``wait(step, slot)`` issue and await a step's copies,
  ``body(step, slot, carry) -> carry`` computes on the loaded slot while the next step's
  copies fly into the other one. Returns the final carry (``init`` when no step runs)."""

  @pl.when(first < last)
  def _first_fetch():
    start(first, 0)

  def step_fn(step, carry):
    slot = (step - first) % 2

    @pl.when(step + 1 < last)
    def _prefetch():
      start(step + 1, 1 - slot)

    wait(step, slot)
    return body(step, slot, carry)

  return lax.fori_loop(first, last, step_fn, init)


class ModArrays(NamedTuple):
  """The modifiers' kernel operands (`mod_arrays`), None when absent."""
  mask: object   # int32 [Bm, Hm, M, positions]
  bias: object   # [Bm, Hm, M, positions], float16 widened to float32
  alibi: object  # float32 [Hkv, R_p, 1]


def mod_arrays(mask, bias, alibi, *, num_tokens, rows_p, positions) -> ModArrays:
  """The modifiers as kernel operands: mask ``[Bm, Hm, T, G, S]`` -> int32 ``[Bm, Hm, M,
  positions]`` (zero-padded: no partial block), bias likewise in its dtype, alibi
  ``[Hkv, G]`` -> float32 slopes per query row ``[Hkv, R_p, 1]``."""
  out = []
  for x, dtype in ((mask, jnp.int32), (bias, None)):
    if x is None:
      out.append(None)
      continue
    bm, hm, tm, gm, s = x.shape
    # (A float16 bias is widened: Mosaic has no float16 vectors.)
    x = x.reshape(bm, hm, tm * gm, s).astype(dtype or (jnp.float32 if x.dtype == jnp.float16 else x.dtype))
    out.append(jnp.pad(x, [(0, 0), (0, 0), (0, 0), (0, positions - s)]))
  if alibi is not None:
    hkv, g = alibi.shape
    rows = jnp.tile(alibi.astype(jnp.float32), (1, num_tokens))
    alibi = jnp.pad(rows, [(0, 0), (0, rows_p - g * num_tokens)])[:, :, None]
  return ModArrays(*out, alibi)


def alibi_spec(rows_p, heads=None):
  """The slopes ``[Hkv, R_p, 1]`` of a program's kv head (with ``heads``: of its that many
  kv heads, a leading block axis)."""
  return pl.BlockSpec((heads, rows_p, 1), lambda i, h, *rest: (h, 0, 0))


def store_partials(o_ref, lse_ref, v_pieces, o_pieces, lse):
  if len(v_pieces) == 1:
    o_ref[...] = o_pieces[0]
  else:
    for p, o in zip(v_pieces, o_pieces):
      o_ref[:, p.offset:p.offset + p.width] = o
  lse_ref[...] = lse


def partials_specs(rows_p, dv, index_map, heads=None):
  """o and lse blocks of one (sequence, kv head, split); with ``heads``, of that many
  kv heads (a leading block axis)."""
  return [pl.BlockSpec((None, heads, None, rows_p, dv), index_map),
          pl.BlockSpec((None, heads, None, rows_p, 1), index_map)]


def partials_shape(b, hkv, n, rows_p, dv, *inputs):
  return [blk.out_struct((b, hkv, n, rows_p, dv), jnp.float32, *inputs),
          blk.out_struct((b, hkv, n, rows_p, 1), jnp.float32, *inputs)]
