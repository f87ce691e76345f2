"""FlashDecode split-KV kernels for TPUs (Pallas Mosaic): `mosaic_partials`, the entry.

The block math is `fdecode.kernels.common.block`, shared with the Triton kernel; what differs
is how blocks reach VMEM, the way Mosaic wants it:

* **Contiguous cache** ``[B, Hkv, S, D]`` (`fdecode.kernels.mosaic_tpu.contiguous`):
  grid ``(B, Hkv, n_splits, steps)`` with the kv-step axis "arbitrary" and the others
  "parallel". ``ends`` (each sequence's end relative to the cache) is scalar-prefetched
  into SMEM. K / V blocks of ``bk`` tokens arrive through BlockSpecs whose index_map
  clamps to the sequence's last live block, so a step past the end repeats the previous
  block index (Pallas issues no DMA) and `pl.when` skips its compute. m, l and acc live
  in float32 VMEM scratch.
* **Paged cache** ``[Hkv, P, page_size, D]`` (`fdecode.kernels.mosaic_tpu.paged`): grid
  ``(B, Hkv, n_splits)``; the pools stay in HBM (``memory_space=pl.ANY``) and each step
  DMAs ``pages_per_step`` pages (the block table is scalar-prefetched, ids clipped into
  the pool) into one slot of a two-slot VMEM buffer while the other slot computes, as
  JAX's TPU ``paged_attention`` and ``ragged_paged_attention`` do. Only live pages are
  copied.
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

Each kernel declares its operands once, as a NamedTuple (absent ones None) that
`fdecode.kernels.mosaic_tpu.operands.flatten` turns into the pallas_call's operands and
specs, and takes its refs by those names. The VMEM footprint (double-buffered blocks
plus scratch) is computed by `fdecode.kernels.mosaic_tpu.plan`, which also sets
``vmem_limit_bytes``; it depends on the block sizes only, never on S. Sparse index lists:
`fdecode.kernels.mosaic_tpu.sparse`.
"""

from __future__ import annotations

import jax.numpy as jnp

from fdecode.kernels.common.modifiers import Modifiers
from fdecode.kernels.mosaic_tpu.contiguous import contiguous_call
from fdecode.kernels.mosaic_tpu.paged import paged_call
from fdecode.kernels.mosaic_tpu.plan import Plan
from fdecode.kernels.mosaic_tpu.token_major import TokenMajorRead


def mosaic_partials(q_rows, ends, cache, modifier_arrays, *, num_tokens: int, softmax_scale: float, num_splits: int,
                    plan: Plan, interpret, mods: Modifiers = Modifiers(), v_head_dim=None,
                    read: TokenMajorRead | None = None, split_blocks: int = 0):
  """Per-split partial states from the Mosaic (TPU) kernels.

  Args:
    q_rows: ``[B, Hkv, R, Dk]`` queries in the compute dtype, row r = t * G + g.
    ends: int32 ``[B]``: each sequence's end relative to the cache's first token.
    cache: the cache (`fdecode.cache.layout.CacheView`): its arrays and layout, as follows.
    k, v: contiguous ``[B, Hkv, S, D]`` or, with ``block_tables`` int32 ``[B, n]``, paged
      ``[Hkv, P, page_size, D]``; float or 8-bit with canonical rank-4 scales / offsets.
      ``v`` None (MLA): no value stream; the values are the key block's first
      ``v_head_dim`` columns (each cache byte is DMA'd once).
    k_rope: optional key-only columns laid out like k (float): a second key stream.
    k_scale, k_offset, v_scale, v_offset: float32, canonical rank 4: contiguous
      ``[B|1, Hkv|1, S|1, nt]``, paged ``[Hkv|1, P|1, page_size|1, nt]`` (None: absent).
    mods, modifier_arrays: the score modifiers and their ``mask``, ``bias``, ``alibi``; mask ``[Bm, Hm, T, G, S]`` (Bm, Hm 1 or
      B, Hkv), bias likewise (read as float32, as the kernel adds it: a float64 bias under
      ``jax_enable_x64`` too), alibi slopes float32 ``[Hkv, G]``.
    layout (``cache.layout``) ``"NHD"``: k, v and k_rope are token-major pools ``[P, page_size, Hkv, D]``
      (a contiguous ``[B, S, Hkv, D]`` cache as `contiguous_as_pool` makes it), read in
      place by the paged kernel as ``read`` says (`token_major_read` of these caches;
      only where it allows).
    plan: the launch's sizes, `fdecode.kernels.mosaic_tpu.plan` of these operands (with
      ``kv_heads_per_program`` and ``head_axis`` from `token_major_read` for NHD).
    interpret: False (compile for TPU) or a ``pltpu.InterpretParams`` (TPU semantics on
      CPU: simulated HBM / VMEM / SMEM, DMAs and semaphores).
    split_blocks: the batch-invariant mode's blocks per split (`CallPlan.split_blocks`; 0:
      the split count's splits over each sequence's live blocks).

  Returns:
    ``(o, lse)``: float32 ``[B, Hkv, n_splits, R, Dv]`` and ``[B, Hkv, n_splits, R]``.
  """
  r = q_rows.shape[2]
  p = plan
  if p.rows_p != r:
    q_rows = jnp.pad(q_rows, [(0, 0), (0, 0), (0, p.rows_p - r), (0, 0)])
  bias = modifier_arrays["bias"]
  if bias is not None and jnp.dtype(bias.dtype).itemsize > 4:  # no 64-bit vectors in the kernel
    modifier_arrays = dict(modifier_arrays, bias=bias.astype(jnp.float32))
  kw = dict(num_rows=r, num_tokens=num_tokens, softmax_scale=softmax_scale, num_splits=num_splits,
            interpret=interpret, mods=mods, v_head_dim=v_head_dim, split_blocks=split_blocks)
  ends = ends.astype(jnp.int32)
  block_tables = cache.block_tables
  if cache.layout == "NHD":
    if block_tables is None or read is None:
      raise ValueError("mosaic_partials: a token-major cache is read as a pool, as token_major_read says: "
                       f"pass contiguous_as_pool(...)'s pool and tables and read=; got "
                       f"block_tables={'None' if block_tables is None else 'given'}, {read=}")
    o, lse = paged_call(q_rows, ends, block_tables.astype(jnp.int32), p, cache, modifier_arrays, read=read, **kw)
  elif block_tables is None:
    o, lse = contiguous_call(q_rows, ends, p, cache, modifier_arrays, **kw)
  else:
    o, lse = paged_call(q_rows, ends, block_tables.astype(jnp.int32), p, cache, modifier_arrays, **kw)
  return o[:, :, :, :r], lse[:, :, :, :r, 0]
