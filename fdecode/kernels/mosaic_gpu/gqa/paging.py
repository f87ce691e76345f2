"""How the Hopper GQA rows kernel (`fdecode.kernels.mosaic_gpu.gqa.kernel`) reads the
cache of one block: its TMA copies from a contiguous cache or from a paged pool through
the block table, and the scale operands the API hands it.

Legend: B batch, Hkv kv heads, S capacity (paged: n * page_size), D head dim, P pages in
the pool, n table columns, bk tokens per block, piece = min(page_size, bk).

Paged pools (`fdecode.flash_decode`'s layout): k and v ``[Hkv, P, page_size, D]``,
token t of sequence b in page ``block_tables[b, t // page_size]``, slot
``t % page_size``; read in place (no per-call copy of the cache). A block of bk tokens
is filled by ``bk / piece`` TMA copies onto its slot's one barrier (whose arrivals are
the copies, its bytes their sum): one copy at (page, offset) where a page holds whole
blocks, one copy of a whole page each where pages are smaller. The memory warpgroup
reads the table entries (scalar loads from GMEM, as the lengths). A piece wholly past
the sequence's length is never dereferenced through its own entry (which may hold
anything, even past the table's end): it copies the block's first page again, a live
page, into slots the compute warpgroup selects away; every id read is also clipped
into ``[0, P)`` (a traced table may hold anything; concrete ones are checked by the API).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fdecode.cache.paged import gather_scale_head_major
from fdecode.kernels.mosaic_gpu.gqa.plan import RowsPlan
from fdecode.kernels.mosaic_gpu.ops import contiguous_load_start


def load_start(plan: RowsPlan, block):
  """The first cache row a block's copies load: its start, or for the last block of a
  contiguous cache shorter than a whole number of blocks, ``cache_rows - bk`` (an
  overlapped load: the slots before the block's start are selected away)."""
  if plan.paged:
    return block * plan.block
  return contiguous_load_start(block, plan.block, plan.cache_rows)


def block_pieces(plan: RowsPlan, entry, start, live_end, num_pages: int):
  """[(page, offset)] of the block at token ``start`` (live: ``start < live_end``) of one
  sequence: one per copy. ``entry(col)``: the sequence's table entry at column ``col``
  (int32 scalar). Piece 0 is live (the block is); a later piece at or past ``live_end``
  takes piece 0's page: its own entry (garbage, or past the table's end where the last
  block runs past S) is never used as a page id. Every id is clipped into ``[0, P)``."""
  ps, n = plan.page_size, plan.pages
  first = entry(start // ps)
  pieces = []
  for i in range(plan.copies):
    token = start + i * plan.piece
    page = first
    if i:
      page = jnp.where(token < live_end, entry(jnp.minimum(token // ps, n - 1)), first)
    offset = token % ps if ps > plan.block else 0
    pieces.append((jnp.clip(page, 0, num_pages - 1), offset))
  return pieces


def copy_block(plan: RowsPlan, sources, slots, barriers, *, tables_ref, seq, head, bh, block, live_end, slot):
  """Issues the TMA copies of one block into ring slot ``slot``.

  ``sources``: (k_ref, v_ref, ks_ref, vs_ref): contiguous ``[B * Hkv, S_c, D]`` or pools
  ``[Hkv, P, page_size, D]``; scales (8-bit, else None) float32 ``[B * Hkv, S_c]``,
  pools ``[Hkv, P, page_size]`` (`RowsPlan.scales_paged`) or gathered ``[B * Hkv, S_b]``.
  ``slots``: (k_smem, v_smem ``[stages, bk, D]``, sc_smem f32 ``[2, stages, bk]`` or None);
  ``barriers``: (k_full, v_full ``[stages]``, s_full ``[2 * stages]`` or None), each
  expecting `RowsPlan.copies` (scales: `RowsPlan.scale_copies`) arrivals."""
  k_ref, v_ref, ks_ref, vs_ref = sources
  k_smem, v_smem, sc_smem = slots
  k_full, v_full, s_full = barriers
  stages, bk = plan.stages, plan.block
  scale_rows = pl.ds(block * bk, bk)
  if not plan.paged:
    rows = scale_rows = pl.ds(load_start(plan, block), bk)
    plgpu.copy_gmem_to_smem(k_ref.at[bh, rows], k_smem.at[slot], k_full.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[bh, rows], v_smem.at[slot], v_full.at[slot])
  else:
    piece = plan.piece
    dst = (lambda ref, i: ref.at[slot]) if plan.copies == 1 else (
        lambda ref, i: ref.at[slot, pl.ds(i * piece, piece)])
    entry = lambda col: tables_ref[seq * plan.pages + col]  # the table, flat [B * n]
    pieces = block_pieces(plan, entry, block * bk, live_end, k_ref.shape[1])
    for i, (page, offset) in enumerate(pieces):
      src = pl.ds(offset, piece)
      plgpu.copy_gmem_to_smem(k_ref.at[head, page, src], dst(k_smem, i), k_full.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[head, page, src], dst(v_smem, i), v_full.at[slot])
      if plan.scales_paged:
        for j, s_ref in enumerate((ks_ref, vs_ref)):
          plgpu.copy_gmem_to_smem(s_ref.at[head, page, src], sc_smem.at[j, slot, pl.ds(i * piece, piece)],
                                  s_full.at[j * stages + slot])
  if plan.quantized and not plan.scales_paged:
    for j, s_ref in enumerate((ks_ref, vs_ref)):
      plgpu.copy_gmem_to_smem(s_ref.at[bh, scale_rows], sc_smem.at[j, slot], s_full.at[j * stages + slot])


def pool_scales(scale, pool_shape):
  """A canonical paged per-token scale ``[Hkv|1, P|1, page_size|1, 1]`` -> float32
  ``[Hkv, P, page_size]``, read by the kernel in place (a broadcast form, per head or
  per tensor, is materialized at the pool's size)."""
  return jnp.broadcast_to(scale.astype(jnp.float32), (*pool_shape[:3], 1))[..., 0]


def gathered_scales(scale, block_tables, plan: RowsPlan):
  """Pages too small for a paged scale copy (`RowsPlan.scales_paged` False): a
  canonical paged per-token scale gathered through the table (ids clipped into the
  pool, `fdecode.cache.paged`) into float32 ``[B * Hkv, S_b]``, S rounded up to whole
  blocks: the kernel copies a block's scales at once. 4 bytes a token per call."""
  b, hkv, s = plan.batch, plan.kv_heads, plan.seq_len
  g = gather_scale_head_major(scale.astype(jnp.float32), block_tables, plan.page_size)
  g = jnp.broadcast_to(g, (hkv, b, s, 1))[..., 0].transpose(1, 0, 2).reshape(b * hkv, s)
  return jnp.pad(g, [(0, 0), (0, -(-s // plan.block) * plan.block - s)])


def operands(plan: RowsPlan, q_rows, ends, k, v, k_scale, v_scale, block_tables):
  """The kernel's inputs, in order: ends int32 ``[B]``; paged: the table int32 ``[B * n]``;
  q's rows padded to ``[B * Hkv, R_p, D]``; k and v (contiguous: ``[B * Hkv, S_c, D]``,
  padded where ``cache_rows > S``, a copy; paged: the pools as they are); 8-bit: the
  scales (`copy_block`)."""
  b, hkv, r, _ = q_rows.shape
  flat = lambda x, pad: jnp.pad(x.reshape(b * hkv, *x.shape[2:]), pad + [(0, 0)] * (x.ndim - 3))
  q = flat(q_rows, [(0, 0), (0, plan.rows_padded - r)])
  if not plan.paged:
    pad_s = [(0, 0), (0, plan.cache_rows - plan.seq_len)]  # S < bk or S % 8 != 0: a padded copy (RowsPlan)
    args = [ends.astype(jnp.int32), q, flat(k, pad_s), flat(v, pad_s)]
    if plan.quantized:
      args += [flat(jnp.broadcast_to(s.astype(jnp.float32), (*k.shape[:3], 1)), pad_s)[..., 0]
               for s in (k_scale, v_scale)]
    return args
  tables = block_tables.astype(jnp.int32)
  args = [ends.astype(jnp.int32), tables.reshape(-1), q, k, v]
  if plan.quantized:
    scales = (pool_scales(s, k.shape) if plan.scales_paged else gathered_scales(s, tables, plan)
              for s in (k_scale, v_scale))
    args += list(scales)
  return args
