"""FlashDecode split-KV kernels for TPUs (Pallas Mosaic).

The block math is `fdecode.kernels.common.block`, shared with the Triton kernel; what differs
is how blocks reach VMEM, the way Mosaic wants it:

* **Contiguous cache** ``[B, Hkv, S, D]``: grid ``(B, Hkv, n_splits, steps)`` with the
  kv-step axis "arbitrary" and the others "parallel". ``ends`` (each sequence's end
  relative to the cache) is scalar-prefetched into SMEM. K / V blocks of ``bk`` tokens
  arrive through BlockSpecs whose index_map clamps to the sequence's last live block, so
  a step past the end repeats the previous block index (Pallas issues no DMA) and
  `pl.when` skips its compute. m, l and acc live in float32 VMEM scratch.
* **Paged cache** ``[Hkv, P, page_size, D]``: grid ``(B, Hkv, n_splits)``; the pools
  stay in HBM (``memory_space=pl.ANY``) and each step DMAs ``pages_per_step`` pages (the
  block table is scalar-prefetched, ids clipped into the pool) into one slot of a
  two-slot VMEM buffer while the other slot computes, as JAX's TPU ``paged_attention``
  and ``ragged_paged_attention`` do. Only live pages are copied.
* **Token-major caches** (pools ``[P, page_size, Hkv, D]``; a contiguous ``[B, S, Hkv, D]``
  viewed as a pool of whole pages): the same paged kernel, each DMA one kv head's page
  rows (float32) or one row of 32-bit words holding two bfloat16 heads, both computed by
  one program (grid ``(B, Hkv/2, n_splits)``): a one-head bfloat16 window would split
  the packed sublane pair, which libtpu rejects; 8-bit as words of four heads. Other
  16- and 8-bit caches (one kv head: MQA, MLA latents; odd head counts; fp8 with
  k_rope) DMA the whole head axis, ``[page_size, Hkv, D]``, one program for all heads
  (`fdecode.kernels.mosaic_tpu.token_major.token_major_read`).
* **8-bit caches**: per-token scales / offsets travel with their block (BlockSpec or DMA);
  per-head / per-tensor ones are one small resident block. Dequantization happens after
  the load, per scale tile (`fdecode.kernels.common.block.head_pieces`).
* **Any head dim**: blocks span the full head dim (legal for Mosaic at any size);
  query rows are padded to the dtype's sublane tiling.

The VMEM footprint (double-buffered blocks plus scratch) is computed by `plan`, which
also sets ``vmem_limit_bytes``; it depends on the block sizes only, never on S.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import Modifiers, window_start

from fdecode.kernels.mosaic_tpu.plan import Plan, per_token as _per_token, plan  # noqa: F401 (re-exported)
from fdecode.kernels.mosaic_tpu.token_major import TokenMajorRead, head_rows, pack_heads, unpack_head, words as _words


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
  """Loaded blocks (k, v or None for MLA, k_rope or None) -> (key pieces, value pieces)."""
  kb = _dequant_pieces(kx, k_pieces, quant[0], quant[1], dtype)
  if vx is None:  # MLA: the values are the key block's first columns, read once
    vb = _dequant_pieces(kx, v_pieces, quant[0], quant[1], dtype, done=dict(zip(k_pieces, kb)))
  else:
    vb = _dequant_pieces(vx, v_pieces, quant[2], quant[3], dtype)
  return kb + ([] if rx is None else [rx.astype(dtype)]), vb


def query_pieces(q, k_pieces, rope):
  """q ``[R_p, Dq]`` split like the key pieces (and k_rope's columns after them)."""
  out = [q if len(k_pieces) == 1 and not rope else q[:, p.offset:p.offset + p.width] for p in k_pieces]
  if rope:
    dk = k_pieces[-1].offset + k_pieces[-1].width
    out.append(q[:, dk:])
  return out


# --------------------------------------------------------------------------------------
# Contiguous cache: BlockSpec pipeline over a kv-step grid axis.


def _contiguous_kernel(ends_ref, q_ref, k_ref, *refs, has_v, has_rope, has_quant, softmax_scale,
                       steps_per_split, num_splits, seq_len, num_rows, group, num_tokens, k_pieces,
                       v_pieces, mods):
  # refs: [v] (absent for MLA), [k_rope], [k_scale], [k_offset], [v_scale], [v_offset]
  #       ([bk|1, nt]), [mask i32[M, bk]], [bias [M, bk]], [alibi f32[R_p, 1]], o [R_p, Dv],
  #       lse [R_p, 1], scratch m [R_p, 1], l [R_p, 1], acc [R_p, w] per value piece.
  refs = list(refs)
  v_ref = refs.pop(0) if has_v else None
  rope_ref = refs.pop(0) if has_rope else None
  quant = [refs.pop(0) if present else None for present in has_quant]
  mod_refs = [refs.pop(0) if present else None for present in (mods.mask, mods.bias, mods.alibi)]
  o_ref, lse_ref, m_ref, l_ref, *acc_refs = refs
  b, split, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  rows_p, bk = q_ref.shape[0], k_ref.shape[0]
  end = ends_ref[b]
  live_end = jnp.clip(end, 0, seq_len)
  first, last = blk.split_range(end, split, num_splits, num_tokens, seq_len, bk, mods)
  start = (first + step) * bk

  @pl.when(step == 0)
  def _init():
    acc, m, l = blk.init_state(rows_p, v_pieces)
    m_ref[...], l_ref[...] = m, l
    for ref, a in zip(acc_refs, acc):
      ref[...] = a

  @pl.when(first + step < last)
  def _compute():
    dtype = q_ref.dtype
    q_pieces = query_pieces(q_ref[...], k_pieces, has_rope)
    load = lambda ref: None if ref is None else ref[...]
    kb, vb = block_kv(k_ref[...], load(v_ref), load(rope_ref), k_pieces, v_pieces,
                       [load(x) for x in quant], dtype)
    kb, bad = blk.guard_values(kb, vb, blk.rows_may_differ(num_tokens, mods))
    rows = blk.row_geometry(end, num_rows, rows_p, group, num_tokens, seq_len, mods)
    s = blk.block_scores(q_pieces, kb, softmax_scale)
    loaded = [None if ref is None else ref[...] for ref in mod_refs]
    s, visible, live = _modify(s, mods, rows, start, live_end, bk, loaded, end=end,
                               seq_len=seq_len, group=group, num_tokens=num_tokens)
    state = (tuple(ref[...] for ref in acc_refs), m_ref[...], l_ref[...])
    acc, m, l = blk.online_update(state, s, visible, live, vb, bad)
    m_ref[...], l_ref[...] = m, l
    for ref, a in zip(acc_refs, acc):
      ref[...] = a

  @pl.when(step == steps_per_split - 1)
  def _finish():
    o_pieces, lse = blk.finalize((tuple(ref[...] for ref in acc_refs), m_ref[...], l_ref[...]))
    store_partials(o_ref, lse_ref, v_pieces, o_pieces, lse)


def _modify(s, mods, rows, start, live_end, bk, loaded, *, end, seq_len, group, num_tokens):
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


def store_partials(o_ref, lse_ref, v_pieces, o_pieces, lse):
  if len(v_pieces) == 1:
    o_ref[...] = o_pieces[0]
  else:
    for p, o in zip(v_pieces, o_pieces):
      o_ref[:, p.offset:p.offset + p.width] = o
  lse_ref[...] = lse


def _contiguous_call(q_rows, ends, k, v, k_rope, quant, mod_arrays, p: Plan, *, num_rows, num_tokens,
                     softmax_scale, num_splits, interpret, mods, v_head_dim):
  b, hkv, _, dq = q_rows.shape
  r = num_rows
  seq_len = k.shape[2]
  dv = v_head_dim if v is None else v.shape[-1]
  bk = p.block
  num_blocks = pl.cdiv(max(seq_len, 1), bk)
  steps = pl.cdiv(num_blocks, num_splits)

  def kv_block(i, h, split, step, ends_ref):
    # This split's blocks (`block.split_range`); past its last, repeat it (no new DMA).
    first, last = blk.split_range(ends_ref[i], split, num_splits, num_tokens, seq_len, bk, mods)
    return jnp.clip(jnp.minimum(first + step, last - 1), 0, num_blocks - 1)

  def cache_spec(d):
    return pl.BlockSpec((None, None, bk, d), lambda i, h, s, t, e: (i, h, kv_block(i, h, s, t, e), 0))

  def quant_spec(a):
    d0, d1, d2, nt = a.shape
    tok = d2 > 1
    return pl.BlockSpec((None, None, bk if tok else 1, nt), lambda i, h, s, t, e: (
        i if d0 > 1 else 0, h if d1 > 1 else 0, kv_block(i, h, s, t, e) if tok else 0, 0))

  streams = [x for x in (k, v, k_rope) if x is not None]
  present = [a for a in quant if a is not None]
  mod_ops, mod_specs = mod_operands(mod_arrays, num_tokens, p.rows_p, num_blocks * bk)
  mod_specs = [spec((bk,), lambda i, h, s, t, e: (i, h, kv_block(i, h, s, t, e))) for spec in mod_specs]
  k_pieces, v_pieces = all_pieces(k, v, quant[0], quant[2], v_head_dim)
  kernel = functools.partial(
      _contiguous_kernel, has_v=v is not None, has_rope=k_rope is not None,
      has_quant=tuple(a is not None for a in quant),
      softmax_scale=softmax_scale, steps_per_split=steps, num_splits=num_splits, seq_len=seq_len,
      num_rows=r, group=r // num_tokens, num_tokens=num_tokens, k_pieces=k_pieces,
      v_pieces=v_pieces, mods=mods)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, hkv, num_splits, steps),
      in_specs=[pl.BlockSpec((None, None, p.rows_p, dq), lambda i, h, s, t, e: (i, h, 0, 0))]
      + [cache_spec(x.shape[-1]) for x in streams] + [quant_spec(a) for a in present] + mod_specs,
      out_specs=partials_specs(p.rows_p, dv, lambda i, h, s, t, e: (i, h, s, 0, 0)),
      scratch_shapes=[pltpu.VMEM((p.rows_p, 1), jnp.float32), pltpu.VMEM((p.rows_p, 1), jnp.float32)]
      + [pltpu.VMEM((p.rows_p, vp.width), jnp.float32) for vp in v_pieces],
  )
  operands = (ends, q_rows, *streams, *present, *mod_ops)
  out_shape = partials_shape(b, hkv, num_splits, p.rows_p, dv, *operands)
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=p.vmem_limit_bytes),
      cost_estimate=blk.cost_estimate(b=b, hkv=hkv, rows=r, keys=seq_len, dk=dq, dv=dv, caches=streams,
                                      operands=operands, outputs=out_shape),
      interpret=interpret, name="fdecode_split_kv_mosaic",
  )(*operands)


def mod_operands(mod_arrays, num_tokens, rows_p, positions):
  """Kernel operands of the modifiers and a BlockSpec maker for each.

  mask -> int32 ``[Bm, Hm, M, positions]`` (zero-padded: no partial block), bias likewise
  in its dtype, alibi -> f32 ``[Hkv, R_p, 1]`` per row. Each spec maker takes the block's
  token dims (``(bk,)``, or ``()`` for a whole-sequence HBM operand) and a token-block
  index map ``(i, h, ...) -> (i, h, block)`` and returns the operand's BlockSpec.
  """
  ops, specs = [], []
  for name, dtype in (("mask", jnp.int32), ("bias", None)):
    x = mod_arrays[name]
    if x is None:
      continue
    bm, hm, tm, gm, s = x.shape
    # (A float16 bias is widened: Mosaic has no float16 vectors.)
    x = x.reshape(bm, hm, tm * gm, s).astype(dtype or (jnp.float32 if x.dtype == jnp.float16 else x.dtype))
    ops.append(jnp.pad(x, [(0, 0), (0, 0), (0, 0), (0, positions - s)]))

    def spec(tokens, index, bm=bm, hm=hm, m=tm * gm):
      def index_map(i, h, *rest):
        _, _, blk_index = index(i, h, *rest)
        return (i if bm > 1 else 0, h if hm > 1 else 0, 0, blk_index)
      return pl.BlockSpec((None, None, m) + tokens, index_map)
    specs.append(spec)
  if mod_arrays["alibi"] is not None:
    hkv, g = mod_arrays["alibi"].shape
    rows = jnp.tile(mod_arrays["alibi"].astype(jnp.float32), (1, num_tokens))
    ops.append(jnp.pad(rows, [(0, 0), (0, rows_p - g * num_tokens)])[:, :, None])
    specs.append(lambda tokens, index: pl.BlockSpec(
        (None, rows_p, 1), lambda i, h, *rest: (h, 0, 0)))
  return ops, specs


def partials_specs(rows_p, dv, index_map, heads=None):
  """o and lse blocks of one (sequence, kv head, split); with ``heads``, of that many
  kv heads (a leading block axis)."""
  return [pl.BlockSpec((None, heads, None, rows_p, dv), index_map),
          pl.BlockSpec((None, heads, None, rows_p, 1), index_map)]


def partials_shape(b, hkv, n, rows_p, dv, *inputs):
  return [blk.out_struct((b, hkv, n, rows_p, dv), jnp.float32, *inputs),
          blk.out_struct((b, hkv, n, rows_p, 1), jnp.float32, *inputs)]


# --------------------------------------------------------------------------------------
# Paged cache: pools in HBM, pages DMA'd into a two-slot VMEM buffer.


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


_ALIBI = 9  # the slopes' place in `_paged_kernel`'s operands (per head: [heads, R_p, 1])


def _paged_kernel(ends_ref, tables_ref, q_ref, *refs, kinds, softmax_scale, num_splits, heads,
                  token_major, pages_per_step, page_size, num_pages, table_len, num_rows, group,
                  num_tokens, k_pieces, v_pieces, mods, head_words=False, head_axis=False,
                  word_dtypes=(None, None, None)):
  # kinds: for (k, v, k_rope, k_scale, k_offset, v_scale, v_offset, mask, bias, alibi): "stream"
  #   (an HBM ref, DMA'd page by page), "step" (an HBM ref [Bm, Hm, M, positions], DMA'd
  #   one block of positions per step and kv head), "resident" (a VMEM block) or None (absent).
  # heads: kv heads per program (program j has heads j*heads ... ; q [heads, R_p, Dq]).
  #   Head-major pools: 1. Token-major pools (`token_major`): 1 for 32-bit caches, each
  #   page window `pool[page, :, h]`; `head_words`: 2 for bfloat16 and 4 for 8-bit caches,
  #   whose pools are read as 32-bit words (`_words`) so a window `words[page, :, j]`
  #   holds heads heads*j (lowest bits) ... heads*j + heads-1, unpacked by `unpack_head`
  #   (word_dtypes: each cache's own dtype name); `head_axis`: Hkv, each window
  #   `pool[page, :, 0:Hkv]` and each head taken from the loaded [block, Hkv, D] block.
  #   Scales stay head-major: a streamed one is DMA'd per head into [2, heads, block, nt].
  # refs: the present operands in that order; o [heads, R_p, Dv], lse [heads, R_p, 1]; a
  #   VMEM buffer [2, block, D|nt] (stream) or [2, heads, M, block] (step) per DMA'd
  #   operand; DMA semaphores [n_dma, 2].
  n_present = sum(kind is not None for kind in kinds)
  present = iter(refs[:n_present])
  srcs = [None if kind is None else next(present) for kind in kinds]
  o_ref, lse_ref, *bufs, sems = refs[n_present:]
  b, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows_p = q_ref.shape[1]
  block = pages_per_step * page_size
  seq_len = table_len * page_size
  end = ends_ref[b]
  live_end = jnp.clip(end, 0, seq_len)
  live_pages = pl.cdiv(live_end, page_size)
  first_page = window_start(end, num_tokens, seq_len, mods) // page_size
  first, last = blk.split_range(end, split, num_splits, num_tokens, seq_len, block, mods)
  dma_ids = [i for i, kind in enumerate(kinds) if kind in ("stream", "step")]

  def copies(step, slot):
    """(needed?, descriptor) for every DMA of ``step``: each live page of every
    streamed operand, then each per-step operand's block of positions."""
    for n, i in enumerate(dma_ids):
      src = srcs[i]
      if kinds[i] == "step":
        bm, hm = src.shape[:2]
        for hh in range(heads):
          window = src.at[b if bm > 1 else 0, j * heads + hh if hm > 1 else 0, :, pl.ds(step * block, block)]
          yield True, pltpu.make_async_copy(window, bufs[n].at[slot, hh], sems.at[n, slot])
        continue
      cache_rows = token_major and i < 3  # k, v, k_rope token-major; scales head-major
      words = _words(src) if cache_rows and head_words else src
      for p in range(pages_per_step):
        index = step * pages_per_step + p
        page = jnp.clip(tables_ref[b * table_len + jnp.minimum(index, table_len - 1)], 0, num_pages - 1)
        needed = (index < live_pages) & (index >= first_page)
        rows = pl.ds(p * page_size, page_size)
        if cache_rows and head_axis:  # [page_size, Hkv, D]: the whole head axis
          window = src.at[page, :, pl.ds(0, src.shape[2])]
        elif cache_rows:  # [page_size, D] rows of one kv head (or of its heads' words)
          window = words.at[page, :, j if words.shape[2] > 1 else 0]
        elif heads > 1 and src.shape[0] > 1:  # a head-major scale of several heads: a page of each
          for hh in range(heads):
            window = src.at[j * heads + hh, page]
            yield needed, pltpu.make_async_copy(window, bufs[n].at[slot, hh, rows], sems.at[n, slot])
          continue
        else:
          window = src.at[j if src.shape[0] > 1 else 0, page]
        yield needed, pltpu.make_async_copy(window, bufs[n].at[slot, rows], sems.at[n, slot])

  def start(step, slot):
    for needed, copy in copies(step, slot):
      pl.when(needed)(copy.start)

  def wait(step, slot):
    for needed, copy in copies(step, slot):
      pl.when(needed)(copy.wait)

  dtype = q_ref.dtype
  q_pieces = [query_pieces(q_ref[hh], k_pieces, kinds[2] is not None) for hh in range(heads)]
  rows = blk.row_geometry(end, num_rows, rows_p, group, num_tokens, seq_len, mods)

  def body(step, slot, states):
    buf_of = dict(zip(dma_ids, bufs))
    new_states = []
    for hh, state in enumerate(states):
      def operand(i, src):
        if i in buf_of:
          x = buf_of[i][slot]
          if kinds[i] == "step" or (i >= 3 and x.ndim == 3):  # per head: [heads, ...]
            return x[hh]
          if head_axis and i < 3:  # [block, Hkv, D]: this head's rows
            return head_rows(x, hh)
          return unpack_head(x, hh, heads, word_dtypes[i]) if head_words and i < 3 else x
        if src is None:
          return None
        # alibi [heads, R_p, 1] and resident scales of several heads [heads, 1, nt]: this head's
        return src[hh] if i == _ALIBI or (heads > 1 and src.ndim == 3) else src[...]
      kx, vx, rx, ks, ko, vs, vo, mask, bias, slopes = (operand(i, src) for i, src in enumerate(srcs))
      kb, vb = block_kv(kx, vx, rx, k_pieces, v_pieces, (ks, ko, vs, vo), dtype)
      kb, bad = blk.guard_values(kb, vb, blk.rows_may_differ(num_tokens, mods))
      s = blk.block_scores(q_pieces[hh], kb, softmax_scale)
      s, visible, live = _modify(s, mods, rows, step * block, live_end, block, (mask, bias, slopes),
                                 end=end, seq_len=seq_len, group=group, num_tokens=num_tokens)
      new_states.append(blk.online_update(state, s, visible, live, vb, bad))
    return tuple(new_states)

  states = double_buffered(first, last, start, wait, body,
                           tuple(blk.init_state(rows_p, v_pieces) for _ in range(heads)))
  for hh, state in enumerate(states):
    o_pieces, lse = blk.finalize(state)
    store_partials(o_ref.at[hh], lse_ref.at[hh], v_pieces, o_pieces, lse)


def _paged_call(q_rows, ends, k, v, k_rope, tables, quant, mod_arrays, p: Plan, *, num_rows, num_tokens,
                softmax_scale, num_splits, interpret, mods, v_head_dim, read: TokenMajorRead | None = None):
  b, hkv, _, dq = q_rows.shape
  r = num_rows
  token_major = read is not None
  if token_major:
    num_pages, page_size = k.shape[:2]
    heads, head_words, head_axis = read
    word_dtypes = tuple(None if x is None else jnp.dtype(x.dtype).name for x in (k, v, k_rope))
    if head_words and interpret:
      k, v, k_rope = (None if x is None else pack_heads(x) for x in (k, v, k_rope))
  else:
    _, num_pages, page_size, _ = k.shape
    heads, head_words, head_axis, word_dtypes = 1, False, False, (None, None, None)
  dv = v_head_dim if v is None else v.shape[-1]
  table_len = tables.shape[1]
  steps = pl.cdiv(table_len, p.pages_per_step)
  k_scale, k_offset, v_scale, v_offset = quant
  kinds, present, in_specs, bufs = [], [], [], []
  for i, a in enumerate((k, v, k_rope, k_scale, k_offset, v_scale, v_offset)):
    if a is None:
      kinds.append(None)
      continue
    if i < 3 or _per_token(a, paged=True):
      if i >= 3:  # a per-token / per-page scale, made [Hkv|1, P, ps, nt]
        a = jnp.broadcast_to(a, (a.shape[0], num_pages, page_size, a.shape[-1]))
      kinds.append("stream")
      in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
      if i < 3:  # cache rows: a lone head's keep its axis; several heads' are words
        shape = (2, p.block) + ((a.shape[2],) if head_axis else ()) + (a.shape[-1],)
        bufs.append(pltpu.VMEM(shape, jnp.uint32 if head_words else a.dtype))
      else:  # a scale: per head when a program computes several heads that differ
        per_head = (heads,) if heads > 1 and a.shape[0] > 1 else ()
        bufs.append(pltpu.VMEM((2,) + per_head + (p.block, a.shape[-1]), a.dtype))
    else:  # per head / per tensor: one resident [1, nt] block ([heads, 1, nt] for several heads)
      d0, nt = a.shape[0], a.shape[-1]
      a = a.reshape(d0, 1, nt)
      kinds.append("resident")
      if d0 > 1 and heads > 1:
        in_specs.append(pl.BlockSpec((heads, 1, nt), lambda i, h, *rest: (h, 0, 0)))
      else:
        in_specs.append(pl.BlockSpec((None, 1, nt), lambda i, h, s, e, t, d0=d0: (h if d0 > 1 else 0, 0, 0)))
    present.append(a)
  mod_ops, _ = mod_operands(mod_arrays, num_tokens, p.rows_p, steps * p.block)
  mod_ops = iter(mod_ops)
  for name in ("mask", "bias", "alibi"):
    if mod_arrays[name] is None:
      kinds.append(None)
      continue
    a = next(mod_ops)
    present.append(a)
    if name == "alibi":  # [Hkv, R_p, 1]: this program's heads
      kinds.append("resident")
      in_specs.append(pl.BlockSpec((heads, p.rows_p, 1), lambda i, h, *rest: (h, 0, 0)))
    else:  # whole rows in HBM; one block of positions DMA'd per step and head
      kinds.append("step")
      in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
      bufs.append(pltpu.VMEM((2, heads, a.shape[2], p.block), a.dtype))
  k_pieces, v_pieces = all_pieces(k, v, k_scale, v_scale, v_head_dim)
  kernel = functools.partial(
      _paged_kernel, kinds=tuple(kinds), softmax_scale=softmax_scale, num_splits=num_splits,
      heads=heads, token_major=token_major, pages_per_step=p.pages_per_step, page_size=page_size,
      num_pages=num_pages, table_len=table_len, num_rows=r, group=r // num_tokens,
      num_tokens=num_tokens, k_pieces=k_pieces, v_pieces=v_pieces, mods=mods, head_words=head_words,
      head_axis=head_axis, word_dtypes=word_dtypes)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, hkv // heads, num_splits),
      in_specs=[pl.BlockSpec((None, heads, p.rows_p, dq), lambda i, h, s, e, t: (i, h, 0, 0))] + in_specs,
      out_specs=partials_specs(p.rows_p, dv, lambda i, h, s, e, t: (i, h, s, 0, 0), heads=heads),
      scratch_shapes=bufs + [pltpu.SemaphoreType.DMA((max(len(bufs), 1), 2))],
  )
  operands = (ends, tables.reshape(-1), q_rows, *present)
  out_shape = partials_shape(b, hkv, num_splits, p.rows_p, dv, *operands)
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel"),
          vmem_limit_bytes=p.vmem_limit_bytes),
      cost_estimate=blk.cost_estimate(b=b, hkv=hkv, rows=r, keys=table_len * page_size, dk=dq, dv=dv,
                                      caches=[x for x in (k, v, k_rope) if x is not None],
                                      operands=operands, outputs=out_shape),
      interpret=interpret, name="fdecode_split_kv_mosaic_paged",
  )(*operands)


def mosaic_partials(q_rows, ends, k, v, *, num_tokens: int, softmax_scale: float,
                    num_splits: int, plan: Plan, interpret,
                    block_tables=None, k_scale=None, v_scale=None, k_offset=None, v_offset=None,
                    mods: Modifiers = Modifiers(), mask=None, bias=None, alibi=None,
                    v_head_dim=None, k_rope=None, kv_layout="HND", read: TokenMajorRead | None = None):
  """Per-split partial states from the Mosaic (TPU) kernels.

  Args:
    q_rows: ``[B, Hkv, R, Dk]`` queries in the compute dtype, row r = t * G + g.
    ends: int32 ``[B]``: each sequence's end relative to the cache's first token.
    k, v: contiguous ``[B, Hkv, S, D]`` or, with ``block_tables`` int32 ``[B, n]``, paged
      ``[Hkv, P, page_size, D]``; float or 8-bit with canonical rank-4 scales / offsets.
      ``v`` None (MLA): no value stream; the values are the key block's first
      ``v_head_dim`` columns (each cache byte is DMA'd once).
    k_rope: optional key-only columns laid out like k (float): a second key stream.
    kv_layout: ``"NHD"``: k, v and k_rope are token-major pools ``[P, page_size, Hkv, D]``
      (a contiguous ``[B, S, Hkv, D]`` cache as `contiguous_as_pool` makes it), read in
      place by the paged kernel as ``read`` says (`token_major_read` of these caches;
      only where it allows).
    plan: the launch's sizes, `fdecode.kernels.mosaic_tpu.plan` of these operands (with
      ``kv_heads_per_program`` and ``head_axis`` from `token_major_read` for NHD).
    interpret: False (compile for TPU) or a ``pltpu.InterpretParams`` (TPU semantics on
      CPU: simulated HBM / VMEM / SMEM, DMAs and semaphores).

  Returns:
    ``(o, lse)``: float32 ``[B, Hkv, n_splits, R, Dv]`` and ``[B, Hkv, n_splits, R]``.
  """
  r = q_rows.shape[2]
  quant = (k_scale, k_offset, v_scale, v_offset)
  p = plan
  if p.rows_p != r:
    q_rows = jnp.pad(q_rows, [(0, 0), (0, 0), (0, p.rows_p - r), (0, 0)])
  kw = dict(num_rows=r, num_tokens=num_tokens, softmax_scale=softmax_scale,
            num_splits=num_splits, interpret=interpret, mods=mods, v_head_dim=v_head_dim)
  mod_arrays = dict(mask=mask, bias=bias, alibi=alibi)
  ends = ends.astype(jnp.int32)
  if kv_layout == "NHD":
    if block_tables is None or read is None:
      raise ValueError("mosaic_partials: a token-major cache is read as a pool, as token_major_read says: "
                       f"pass contiguous_as_pool(...)'s pool and tables and read=; got "
                       f"block_tables={'None' if block_tables is None else 'given'}, {read=}")
    o, lse = _paged_call(q_rows, ends, k, v, k_rope, block_tables.astype(jnp.int32), quant, mod_arrays,
                         p, read=read, **kw)
  elif block_tables is None:
    o, lse = _contiguous_call(q_rows, ends, k, v, k_rope, quant, mod_arrays, p, **kw)
  else:
    o, lse = _paged_call(q_rows, ends, k, v, k_rope, block_tables.astype(jnp.int32), quant, mod_arrays,
                         p, **kw)
  return o[:, :, :, :r], lse[:, :, :, :r, 0]
