"""The Mosaic kernel over a paged cache (head-major pools ``[Hkv, P, page_size, D]``, or
token-major ones ``[P, page_size, Hkv, D]`` read in place): the pools stay in HBM and
each step's pages are DMA'd into one slot of a two-slot VMEM buffer while the other slot
computes (`fdecode.kernels.mosaic_tpu.kernel` describes the kernels)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import window_start
from fdecode.kernels.mosaic_tpu.operands import Operand, by_name, flatten
from fdecode.kernels.mosaic_tpu.plan import Plan, per_token
from fdecode.kernels.mosaic_tpu.shared import (CACHES, QUANT, all_pieces, alibi_spec, block_kv, double_buffered,
                                               mod_arrays, modify, partials_shape, partials_specs, query_pieces,
                                               store_partials)
from fdecode.kernels.mosaic_tpu.token_major import TokenMajorRead, head_rows, pack_heads, unpack_head, words

# The operands DMA'd one block of positions a step (not page by page), per kv head.
_PER_STEP = ("mask", "bias")


class PagedOperands(NamedTuple):
  """The paged kernel's inputs (`Operand` each, None when absent), in the pallas_call's
  order. The caches, the per-token / per-page scales and the mask / bias stay in HBM
  (``pl.ANY``) and are DMA'd by the kernel (each with its two-slot VMEM buffer); the
  others arrive as one block per program ``(b, j, split)`` (kv heads ``j * heads ...``)."""
  ends: Any       # int32 [B]: each sequence's end relative to the cache; scalar-prefetched
  tables: Any     # int32 [B * n]: the block tables, flat; scalar-prefetched
  q: Any          # [B, Hkv, R_p, Dk]; block [heads, R_p, Dk]
  k: Any          # [Hkv, P, ps, Dk] or token-major [P, ps, Hkv, Dk] (as words: `token_major.words`)
  v: Any          # likewise with Dv; None for MLA
  k_rope: Any     # likewise with Dr
  k_scale: Any    # per token / page: [Hkv|1, P, ps, nt] in HBM; else resident [Hkv|1, 1, nt]
  k_offset: Any
  v_scale: Any
  v_offset: Any
  mask: Any       # int32 [Bm, Hm, M, positions] in HBM
  bias: Any       # [Bm, Hm, M, positions] in HBM
  alibi: Any      # float32 [Hkv, R_p, 1]; block [heads, R_p, 1]


class _Paging(NamedTuple):
  """How a program reads its pages (static).

  ``read``: kv heads per program (program j has heads ``j * heads ...``; q ``[heads, R_p,
  Dq]``) and how a token-major pool is read (`fdecode.kernels.mosaic_tpu.token_major`):
  head-major pools, one head. Token-major ones: 32-bit caches one head, each page window
  ``pool[page, :, h]``; ``words``: 2 heads for bfloat16 and 4 for 8-bit caches, whose
  pools are read as 32-bit words so a window ``words[page, :, j]`` holds heads
  ``heads * j`` (lowest bits) ... ``heads * j + heads - 1``, unpacked by `unpack_head`
  (``word_dtypes``: each cache's own dtype name); ``axis``: Hkv, each window
  ``pool[page, :, 0:Hkv]`` and each head taken from the loaded ``[block, Hkv, D]`` block.
  Scales stay head-major: a streamed one is DMA'd per head into ``[2, heads, block, nt]``.
  """
  read: TokenMajorRead
  token_major: bool
  word_dtypes: dict
  pages_per_step: int
  page_size: int
  num_pages: int
  table_len: int


def _copies(ins, bufs, sems, step, slot, *, b, j, live_pages, first_page, paging: _Paging):
  """(needed?, descriptor) for every DMA of ``step`` into buffer ``slot``: each live page of
  every streamed operand, then each per-step operand's block of positions, in field order;
  operand n (of the DMA'd ones) signals semaphore ``sems[n, slot]``."""
  heads, head_words, head_axis = paging.read
  block = paging.pages_per_step * paging.page_size
  dma_names = [name for name, buf in zip(bufs._fields, bufs) if buf is not None]
  for n, name in enumerate(dma_names):
    src, buf = getattr(ins, name), getattr(bufs, name)
    if name in _PER_STEP:
      bm, hm = src.shape[:2]
      for hh in range(heads):
        window = src.at[b if bm > 1 else 0, j * heads + hh if hm > 1 else 0, :, pl.ds(step * block, block)]
        yield True, pltpu.make_async_copy(window, buf.at[slot, hh], sems.at[n, slot])
      continue
    cache_rows = paging.token_major and name in CACHES  # caches token-major; scales head-major
    pool = words(src) if cache_rows and head_words else src
    for p in range(paging.pages_per_step):
      index = step * paging.pages_per_step + p
      page = jnp.clip(ins.tables[b * paging.table_len + jnp.minimum(index, paging.table_len - 1)],
                      0, paging.num_pages - 1)
      needed = (index < live_pages) & (index >= first_page)
      rows = pl.ds(p * paging.page_size, paging.page_size)
      if cache_rows and head_axis:  # [page_size, Hkv, D]: the whole head axis
        window = src.at[page, :, pl.ds(0, src.shape[2])]
      elif cache_rows:  # [page_size, D] rows of one kv head (or of its heads' words)
        window = pool.at[page, :, j if pool.shape[2] > 1 else 0]
      elif heads > 1 and src.shape[0] > 1:  # a head-major scale of several heads: a page of each
        for hh in range(heads):
          window = src.at[j * heads + hh, page]
          yield needed, pltpu.make_async_copy(window, buf.at[slot, hh, rows], sems.at[n, slot])
        continue
      else:
        window = src.at[j if src.shape[0] > 1 else 0, page]
      yield needed, pltpu.make_async_copy(window, buf.at[slot, rows], sems.at[n, slot])


def _head_operands(ins, bufs, slot, hh, paging: _Paging) -> dict:
  """Program head ``hh``'s view of each operand, by name (k ... alibi; None when absent):
  its rows of the loaded buffer ``slot`` of a DMA'd operand, or of a resident block."""
  heads, head_words, head_axis = paging.read

  def load(name):
    src, buf = getattr(ins, name), getattr(bufs, name)
    if buf is not None:
      x = buf[slot]
      if name in _PER_STEP or (name in QUANT and x.ndim == 3):  # per head: [heads, ...]
        return x[hh]
      if head_axis and name in CACHES:  # [block, Hkv, D]: this head's rows
        return head_rows(x, hh)
      return unpack_head(x, hh, heads, paging.word_dtypes[name]) if head_words and name in CACHES else x
    if src is None:
      return None
    # alibi [heads, R_p, 1] and resident scales of several heads [heads, 1, nt]: this head's
    return src[hh] if name == "alibi" or (heads > 1 and src.ndim == 3) else src[...]

  return {name: load(name) for name in CACHES + QUANT + _PER_STEP + ("alibi",)}


def _paged_kernel(ins, bufs, o_ref, lse_ref, sems, *, softmax_scale, num_splits, paging: _Paging, num_rows, group,
                  num_tokens, k_pieces, v_pieces, mods, split_blocks=0):
  # ins: `PagedOperands` of refs; bufs: the DMA'd operands' VMEM buffers, by the same names
  #   ([2, block, D|nt], [2, block, Hkv, D] for a whole-head-axis read, [2, heads, block, nt]
  #   for a scale of several heads, [2, heads, M, block] for mask / bias); o [heads, R_p, Dv],
  #   lse [heads, R_p, 1]; DMA semaphores [n_dma, 2].
  heads = paging.read.heads
  b, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows_p = ins.q.shape[1]
  block = paging.pages_per_step * paging.page_size
  seq_len = paging.table_len * paging.page_size
  end = ins.ends[b]
  live_end = jnp.clip(end, 0, seq_len)
  live_pages = (live_end + paging.page_size - 1) // paging.page_size  # int32 (pl.cdiv: int64 under x64)
  first_page = window_start(end, num_tokens, seq_len, mods) // paging.page_size
  first, last = blk.split_range(end, split, num_splits, num_tokens, seq_len, block, mods, split_blocks)
  copies = functools.partial(_copies, ins, bufs, sems, b=b, j=j, live_pages=live_pages, first_page=first_page,
                             paging=paging)

  def start(step, slot):
    for needed, copy in copies(step, slot):
      pl.when(needed)(copy.start)

  def wait(step, slot):
    for needed, copy in copies(step, slot):
      pl.when(needed)(copy.wait)

  dtype = ins.q.dtype
  q_pieces = [query_pieces(ins.q[hh], k_pieces, ins.k_rope is not None) for hh in range(heads)]
  rows = blk.row_geometry(end, num_rows, rows_p, group, num_tokens, seq_len, mods)

  def body(step, slot, states):
    new_states = []
    for hh, state in enumerate(states):
      x = _head_operands(ins, bufs, slot, hh, paging)
      kb, vb = block_kv(x["k"], x["v"], x["k_rope"], k_pieces, v_pieces, [x[name] for name in QUANT], dtype)
      kb, bad = blk.guard_values(kb, vb, blk.rows_may_differ(num_tokens, mods))
      s = blk.block_scores(q_pieces[hh], kb, softmax_scale)
      s, visible, live = modify(s, mods, rows, step * block, live_end, block, (x["mask"], x["bias"], x["alibi"]),
                                end=end, seq_len=seq_len, group=group, num_tokens=num_tokens)
      new_states.append(blk.online_update(state, s, visible, live, vb, bad, sums_by_dot=split_blocks > 0))
    return tuple(new_states)

  states = double_buffered(first, last, start, wait, body,
                           tuple(blk.init_state(rows_p, v_pieces) for _ in range(heads)))
  for hh, state in enumerate(states):
    o_pieces, lse = blk.finalize(state)
    store_partials(o_ref.at[hh], lse_ref.at[hh], v_pieces, o_pieces, lse)


def paged_call(q_rows, ends, tables, p: Plan, cache, modifier_arrays, *, num_rows, num_tokens, softmax_scale, num_splits,
               interpret, mods, v_head_dim, read: TokenMajorRead | None = None, split_blocks: int = 0):
  """The paged kernel's partials ``(o [B, Hkv, n_splits, R_p, Dv], lse [..., R_p, 1])`` over the
  operands `fdecode.kernels.mosaic_tpu.kernel.mosaic_partials` takes (``tables`` int32 ``[B,
  n]``; ``cache``: the pool's `fdecode.cache.layout.CacheView`; ``modifier_arrays``: the
  modifiers' mask / bias / alibi); ``read``: how token-major pools are read, None for
  head-major pools."""
  k, v, k_rope = cache.k, cache.v, cache.k_rope
  k_scale, k_offset, v_scale, v_offset = cache.k_scale, cache.k_offset, cache.v_scale, cache.v_offset
  mask, bias, alibi = (modifier_arrays[n] for n in ("mask", "bias", "alibi"))
  b, hkv, _, dq = q_rows.shape
  r = num_rows
  token_major = read is not None
  if token_major:
    num_pages, page_size = k.shape[:2]
    word_dtypes = {name: None if x is None else jnp.dtype(x.dtype).name for name, x in zip(CACHES, (k, v, k_rope))}
    if read.words and interpret:
      k, v, k_rope = (None if x is None else pack_heads(x) for x in (k, v, k_rope))
  else:
    _, num_pages, page_size, _ = k.shape
    read, word_dtypes = TokenMajorRead(1, False, False), {}
  heads = read.heads
  dv = v_head_dim if v is None else v.shape[-1]
  table_len = tables.shape[1]
  steps = pl.cdiv(table_len, p.pages_per_step)

  def cache(a):  # DMA'd page by page: a lone head's rows keep their axis; several heads' are words
    if a is None:
      return None
    shape = (2, p.block) + ((a.shape[2],) if read.axis else ()) + (a.shape[-1],)
    return Operand(a, pl.BlockSpec(memory_space=pl.ANY), pltpu.VMEM(shape, jnp.uint32 if read.words else a.dtype))

  def scale(a):
    if a is None:
      return None
    if per_token(a, paged=True):  # made [Hkv|1, P, ps, nt], DMA'd page by page (per head for several that differ)
      a = jnp.broadcast_to(a, (a.shape[0], num_pages, page_size, a.shape[-1]))
      per_head = (heads,) if heads > 1 and a.shape[0] > 1 else ()
      buffer = pltpu.VMEM((2,) + per_head + (p.block, a.shape[-1]), a.dtype)
      return Operand(a, pl.BlockSpec(memory_space=pl.ANY), buffer)
    d0, nt = a.shape[0], a.shape[-1]  # per head / per tensor: one resident [1, nt] block ([heads, 1, nt] for several)
    a = a.reshape(d0, 1, nt)
    if d0 > 1 and heads > 1:
      return Operand(a, pl.BlockSpec((heads, 1, nt), lambda i, h, *rest: (h, 0, 0)))
    return Operand(a, pl.BlockSpec((None, 1, nt), lambda i, h, s, e, t, d0=d0: (h if d0 > 1 else 0, 0, 0)))

  def per_step(x):  # whole rows in HBM; one block of positions DMA'd per step and head
    if x is None:
      return None
    return Operand(x, pl.BlockSpec(memory_space=pl.ANY), pltpu.VMEM((2, heads, x.shape[2], p.block), x.dtype))

  k_pieces, v_pieces = all_pieces(k, v, k_scale, v_scale, v_head_dim)
  k_scale, k_offset, v_scale, v_offset = scale(k_scale), scale(k_offset), scale(v_scale), scale(v_offset)
  mask, bias, alibi = mod_arrays(mask, bias, alibi, num_tokens=num_tokens, rows_p=p.rows_p, positions=steps * p.block)
  ops = flatten(PagedOperands(
      ends=Operand(ends), tables=Operand(tables.reshape(-1)),
      q=Operand(q_rows, pl.BlockSpec((None, heads, p.rows_p, dq), lambda i, h, s, e, t: (i, h, 0, 0))),
      k=cache(k), v=cache(v), k_rope=cache(k_rope), k_scale=k_scale, k_offset=k_offset, v_scale=v_scale,
      v_offset=v_offset, mask=per_step(mask), bias=per_step(bias),
      alibi=None if alibi is None else Operand(alibi, alibi_spec(p.rows_p, heads))))
  paging = _Paging(read, token_major, word_dtypes, p.pages_per_step, page_size, num_pages, table_len)
  kernel = by_name(functools.partial(
      _paged_kernel, softmax_scale=softmax_scale, num_splits=num_splits, paging=paging, num_rows=r,
      group=r // num_tokens, num_tokens=num_tokens, k_pieces=k_pieces, v_pieces=v_pieces, mods=mods,
      split_blocks=split_blocks), ops.layout)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=ops.num_scalar_prefetch,
      grid=(b, hkv // heads, num_splits),
      in_specs=ops.in_specs,
      out_specs=partials_specs(p.rows_p, dv, lambda i, h, s, e, t: (i, h, s, 0, 0), heads=heads),
      scratch_shapes=ops.buffers + [pltpu.SemaphoreType.DMA((max(len(ops.buffers), 1), 2))],
  )
  out_shape = partials_shape(b, hkv, num_splits, p.rows_p, dv, *ops.arrays)
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel"),
          vmem_limit_bytes=p.vmem_limit_bytes),
      cost_estimate=blk.cost_estimate(b=b, hkv=hkv, rows=r, keys=table_len * page_size, dk=dq, dv=dv,
                                      caches=[x for x in (k, v, k_rope) if x is not None],
                                      operands=ops.arrays, outputs=out_shape),
      interpret=interpret, name="fdecode_split_kv_mosaic_paged",
  )(*ops.arrays)
