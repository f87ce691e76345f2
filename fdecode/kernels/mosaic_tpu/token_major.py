"""How the Mosaic paged kernel (`fdecode.kernels.mosaic_tpu.paged`) reads token-major caches
``[P, page_size, Hkv, D]`` in place, one DMA window per page:

* float32: one kv head's rows, ``pool[page, :, h]``.
* bfloat16 / 8-bit: TPU tiles pack 2 / 4 rows of the head axis into one 32-bit sublane,
  and libtpu rejects a window that splits one. The pool is viewed as 32-bit words
  (`words`), each holding 2 / 4 heads; one program computes them all and unpacks each
  head with 32-bit vector ops (`unpack_head`).
* Other packed caches (one kv head: MQA, MLA latents; an odd Hkv; MLA / k_rope with
  several heads): ``[page_size, Hkv, D]`` windows, the whole head axis, one program for
  all heads.
* A contiguous ``[B, S, Hkv, D]`` cache is read as a pool of whole pages
  (`contiguous_as_pool`).

`token_major_read` decides how (or whether) a cache is read so; the others read a
head-major copy. The sparse kernel reads a listed token's heads, ``pool[page, slot,
h0:h0 + w]`` (`sparse_token_major_read`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from fdecode.cache.layout import CacheView
from fdecode.kernels.common import block as blk


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


def head_rows(block, h):
  """Head ``h`` of a loaded whole-head-axis block ``[bk, Hkv, D]`` -> ``[bk, D]``: one kv
  head's is a reshape; a static ``h`` a slice; a traced one (the sparse kernel's program
  head) a select over the static heads."""
  if block.shape[1] == 1:
    return block.reshape(block.shape[0], block.shape[2])
  if isinstance(h, int):
    return block[:, h, :]
  out = block[:, 0, :]
  for hh in range(1, block.shape[1]):
    out = jnp.where(h == hh, block[:, hh, :], out)
  return out


class TokenMajorRead(NamedTuple):
  """How the paged kernel reads a token-major pool (`token_major_read`)."""
  heads: int      # kv heads one program computes
  words: bool     # the pool as 32-bit words of `heads` heads (`words`), one word row a DMA
  axis: bool      # each DMA keeps the whole head axis, ``pool[page, :, 0:Hkv]``


# Most kv heads read by the whole head axis. The paged kernel unrolls each head, with its
# own online-softmax state, in one program; the sparse kernel selects its head from the
# loaded rows. libtpu compiled 71 and 127 bfloat16 heads (16-token steps) and 30 int8
# ones on v5e; a plan past `fdecode.kernels.mosaic_tpu.plan.MAX_HEAD_AXIS_VMEM_BYTES` (many heads of
# large pages: a step is whole pages) reads a head-major copy instead.
MAX_AXIS_HEADS = 128


def token_major_read(k, v=None, k_rope=None, k_scale=None, v_scale=None, *, paged=True,
                     sparse=False) -> TokenMajorRead | None:
  """How the paged kernel reads these token-major caches in place (`fdecode.kernels.mosaic_tpu.paged`), or
  None when it cannot (then a head-major copy).

  * float32 (k, v and k_rope): one head a program, windows ``pool[page, :, h]``.
  * bfloat16 with an even Hkv (k, v or MLA's none, k_rope), or 8-bit with Hkv a
    multiple of 4 (without MLA or k_rope): words of 2 / 4 heads (8-bit scales DMA'd per
    head).
  * Any other 16- or 8-bit cache (one kv head: MQA, MLA latents; 8-bit with Hkv not a
    multiple of 4; bfloat16 with an odd Hkv; 8-bit MLA or k_rope), up to
    `MAX_AXIS_HEADS` heads: one program for all heads, each DMA ``[page_size, Hkv, D]``
    (the whole head axis: TPU tiles pack several head rows in one 32-bit sublane and
    libtpu rejects a window that splits one, or squeezes a tiled axis of size 1), each
    head taken from the loaded block in vector registers (`plan`'s ``head_axis``).
  * None: float16 (the dispatch gives it the XLA path), more than `MAX_AXIS_HEADS`
    heads that are not words, and a contiguous cache (``paged`` False) with no
    `contiguous_page_size`.

  With ``sparse`` (index lists: `sparse_token_major_read`) the answer is for the sparse
  kernel."""
  dtypes = {jnp.dtype(x.dtype) for x in (k, v, k_rope) if x is not None}
  if jnp.dtype(jnp.float16) in dtypes:
    return None
  hkv = k.shape[2]
  if sparse:
    return sparse_token_major_read(hkv, dtypes)
  if not paged and contiguous_page_size(k.shape[1]) is None:
    return None
  if dtypes == {jnp.dtype(jnp.float32)}:
    return TokenMajorRead(1, False, False)
  if dtypes == {jnp.dtype(jnp.bfloat16)} and hkv % 2 == 0 and k_scale is None and v_scale is None:
    return TokenMajorRead(2, True, False)  # (also MLA latents and k_rope of bfloat16)
  if v is not None and k_rope is None and all(d.itemsize == 1 for d in dtypes) and hkv % 4 == 0:
    return TokenMajorRead(4, True, False)
  if hkv <= MAX_AXIS_HEADS:
    return TokenMajorRead(hkv, False, True)
  return None


def sparse_token_major_read(hkv, dtypes) -> TokenMajorRead | None:
  """How the sparse kernel (`fdecode.kernels.mosaic_tpu.sparse`) reads token-major caches
  (pooled or contiguous, both in place) of ``hkv`` heads and these dtypes: one kv head a
  program, one DMA per listed token, of the rows of its heads
  ``pool[page, slot, h0:h0 + w]``:

  * ``axis`` False: w = `dma_unit` heads from ``h0 = h - h % unit`` (one for 32-bit
    caches, the 2 / 4 heads of one packed 32-bit sublane for 16- / 8-bit ones) when Hkv
    is a multiple of it; the other heads' rows arrive beside head h's and are selected
    away by position, as the head-major kernel's unit neighbours are.
  * ``axis`` True: w = Hkv, the whole head axis, when Hkv is not (one kv head: MQA,
    MLA latents; an odd packed count), up to `MAX_AXIS_HEADS`; head h is taken from
    the loaded ``[bk, Hkv, D]`` block. Each program then moves every head's row of a
    listed token (Hkv times its own bytes, for Hkv > 1), where a head-major copy would
    move the whole cache twice.
  * None: more heads than that (a head-major copy)."""
  unit = max(4 // d.itemsize for d in dtypes)
  if hkv % unit == 0:
    return TokenMajorRead(1, False, False)
  return TokenMajorRead(1, False, True) if hkv <= MAX_AXIS_HEADS else None


def contiguous_page_size(seq_len: int) -> int | None:
  """Page size that views a contiguous token-major cache ``[B, S, Hkv, D]`` as a pool
  ``[B*S/ps, ps, Hkv, D]`` (a free reshape) for the paged kernel: the largest power of two
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
    if a is None:
      return None
    if a.shape[0] == 1 and a.shape[2] == 1:  # per tensor / per head: [1, Hkv|1, 1, nt] -> [Hkv|1, 1, 1, nt]
      return a.transpose(1, 0, 2, 3)
    d1, nt = a.shape[1], a.shape[3]
    if a.shape[2] == 1:  # per sequence: per page
      return jnp.broadcast_to(a, (b, d1, n, nt)).transpose(1, 0, 2, 3).reshape(d1, b * n, 1, nt)
    return jnp.broadcast_to(a, (b, d1, seq_len, nt)).transpose(1, 0, 2, 3).reshape(d1, b * n, ps, nt)

  tables = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
  return as_pool(k), as_pool(v), as_pool(k_rope), tuple(scale(a) for a in quant), tables


def pool_view(view: CacheView) -> CacheView:
  """A contiguous token-major view as the pool view the paged kernel reads
  (`contiguous_as_pool` of its caches, scales and offsets, with the pool's tables)."""
  names = ("k_scale", "k_offset", "v_scale", "v_offset")
  k, v, rope, quant, tables = contiguous_as_pool(view.k, view.v, view.k_rope, tuple(getattr(view, n) for n in names))
  return CacheView(k, v, rope, block_tables=tables, layout=view.layout, paged=True, **dict(zip(names, quant)))
