"""How the Mosaic paged kernel (`fdecode.kernels.mosaic_tpu`) reads token-major caches
``[P, page_size, Hkv, D]`` in place, one DMA window per page:

* float32: one kv head's rows, ``pool[page, :, h]``.
* bfloat16 / 8-bit: TPU tiles pack 2 / 4 rows of the head axis into one 32-bit sublane,
  and libtpu rejects a window that splits one. The pool is viewed as 32-bit words
  (`words`), each holding 2 / 4 heads; one program computes them all and unpacks each
  head with 32-bit vector ops (`unpack_head`).
* One kv head (MQA, MLA latents) of a packed dtype: ``[page_size, 1, D]`` windows, the
  head axis kept (`lone_packed_head`).
* A contiguous ``[B, S, Hkv, D]`` cache is read as a pool of whole pages
  (`contiguous_as_pool`).

`token_major_heads` decides which caches qualify; the others read a head-major copy.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from fdecode.kernels import block as blk


def words(pool):
  """A 16- or 8-bit token-major pool ``[P, ps, Hkv, D]`` as 32-bit words
  ``[P, ps, Hkv / heads, D]`` (word ``[p, t, j, d]`` packs heads ``heads * j``, in its
  lowest bits, to ``heads * j + heads - 1``): a free view of the ref in the kernel. A DMA
  window of one head splits the packed sublane, which libtpu rejects; a window of one
  word row is whole (JAX's ragged paged attention reads its pools so). An array that is
  already words (`pack_heads`, for the interpreter) passes through."""
  return pool if pool.dtype == jnp.uint32 else pool.bitcast(jnp.uint32)


def pack_heads(pool):
  """`words` computed in XLA: the interpreter cannot index a bitcast ref, so under
  interpretation the kernel gets this copy (same words)."""
  width = 8 * jnp.dtype(pool.dtype).itemsize
  heads = 32 // width
  bits = lax.bitcast_convert_type(pool, jnp.dtype(f"uint{width}")).astype(jnp.uint32)
  p, ps, hkv, d = pool.shape
  bits = bits.reshape(p, ps, hkv // heads, heads, d)
  words = bits[:, :, :, 0]
  for hh in range(1, heads):
    words = words | (bits[:, :, :, hh] << (width * hh))
  return words


def unpack_head(words, hh, heads, dtype_name):
  """Head ``hh`` of a block of head words (`words`; ``heads`` per word) of a cache of
  ``dtype_name``, with 32-bit vector ops only: bfloat16 -> bfloat16; int8 -> its int32
  values; float8 -> its float32 values (`block.decode_fp8_bits`). The 8-bit results
  are exact, and dequantized like loaded bytes (`block.dequantize_piece`)."""
  if heads == 2:
    bits = words << 16 if hh == 0 else words & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)
  if dtype_name == "int8":  # the byte to the top, then an arithmetic shift sign-extends it
    return lax.bitcast_convert_type(words << (24 - 8 * hh), jnp.int32) >> 24
  byte = lax.bitcast_convert_type((words >> (8 * hh)) & jnp.uint32(0xFF), jnp.int32)
  return blk.decode_fp8_bits(byte, dtype_name)


def lone_packed_head(pool) -> bool:
  """Whether a token-major pool ``[P, page_size, Hkv, D]`` has one kv head of a packed
  dtype (16- or 8-bit). Its HBM tiles hold one head row each (the head axis padded to
  the dtype's packing), and libtpu cannot squeeze a tiled axis of size 1 out of a DMA
  window: the kernel DMAs ``[page_size, 1, D]`` windows into ``[block, 1, D]`` buffers
  and flattens the loaded block (a relayout in vector registers, `plan`'s
  ``lone_packed_head``)."""
  return pool.shape[2] == 1 and jnp.dtype(pool.dtype).itemsize < 4


def token_major_heads(k, v=None, k_rope=None, k_scale=None, v_scale=None, *, paged=True, sparse=False):
  """Kv heads per program of the paged kernel reading these token-major caches in place
  (`_paged_kernel`), or None when it cannot.

  * One kv head (MQA, MLA latents), any dtype but float16, with scales, MLA and
    ``k_rope``: 1 (each DMA keeps the head axis, ``pool[page, :, 0:1]``).
  * float32: 1; bfloat16 with an even Hkv: 2 (head-pair words); 8-bit (int8 / float8)
    with Hkv a multiple of 4: 4 (words of four heads, their scales DMA'd per head). No
    MLA or k_rope with several kv heads.
  * Otherwise None (a head-major copy): 8-bit caches with an Hkv of 2 or 6, bfloat16 with
    an odd Hkv > 1, MLA / k_rope with several kv heads, sparse index lists, and a
    contiguous cache (``paged`` False) with no `contiguous_page_size`. float16 never
    reaches the kernel (the dispatch gives it the XLA path)."""
  if sparse or (not paged and contiguous_page_size(k.shape[1]) is None):
    return None
  caches = [x for x in (k, v, k_rope) if x is not None]
  if any(jnp.dtype(x.dtype) == jnp.float16 for x in caches):
    return None
  hkv = k.shape[2]
  if hkv == 1:
    return 1
  if v is None or k_rope is not None:
    return None
  dtypes = {jnp.dtype(k.dtype), jnp.dtype(v.dtype)}
  if all(d.itemsize == 1 for d in dtypes):  # 8-bit (scales are head-major, DMA'd per head)
    return 4 if hkv % 4 == 0 else None
  if k_scale is not None or v_scale is not None:
    return None
  if dtypes == {jnp.dtype(jnp.float32)}:
    return 1
  if dtypes == {jnp.dtype(jnp.bfloat16)} and hkv % 2 == 0:
    return 2
  return None


def contiguous_page_size(seq_len: int) -> int | None:
  """Page size that views a contiguous token-major cache ``[B, S, Hkv, D]`` as a pool
  ``[B*S/ps, ps, Hkv, D]`` (a free reshape) for `_paged_call`: the largest power of two
  dividing S, at most 256; None below 8 (per-row DMAs)."""
  ps = min(seq_len & -seq_len, 256) if seq_len else 0
  return ps if ps >= 8 else None


def contiguous_as_pool(k, v, k_rope, quant):
  """A contiguous token-major cache ``[B, S, Hkv, D]`` as the pool of whole pages the
  paged kernel reads in place (`contiguous_page_size` pages, a free reshape; sequence b
  owns pages ``b * S / ps ...``): returns ``(k, v, k_rope, quant, block_tables)``, the
  canonical contiguous scales / offsets ``quant`` ``[B|1, Hkv|1, S|1, nt]`` remade as a
  pool's ``[Hkv|1, P|1, ps|1, nt]`` (per-token ones are copied: ``nt`` floats a token and
  head, 1/32 of an int8 D=128 cache's bytes)."""
  b, seq_len = k.shape[:2]
  ps = contiguous_page_size(seq_len)
  n = seq_len // ps
  as_pool = lambda x: None if x is None else x.reshape((b * n, ps) + x.shape[2:])

  def scale(a):
    if a is None or (a.shape[0] == 1 and a.shape[2] == 1):  # per tensor / per head
      return a
    d1, nt = a.shape[1], a.shape[3]
    if a.shape[2] == 1:  # per sequence: per page
      return jnp.broadcast_to(a, (b, d1, n, nt)).transpose(1, 0, 2, 3).reshape(d1, b * n, 1, nt)
    return jnp.broadcast_to(a, (b, d1, seq_len, nt)).transpose(1, 0, 2, 3).reshape(d1, b * n, ps, nt)

  tables = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
  return as_pool(k), as_pool(v), as_pool(k_rope), tuple(scale(a) for a in quant), tables
