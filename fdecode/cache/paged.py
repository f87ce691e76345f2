"""Paged cache layout (that of jax.experimental.pallas.ops.tpu.paged_attention).

``k_pages: [Hkv, P, page_size, D]`` is a pool of P pages per kv head;
``block_tables: int32 [B, n]`` maps page j of sequence b to ``block_tables[b, j]``.
Token t of sequence b lives in page ``block_tables[b, t // page_size]``, slot
``t % page_size``; the sequence's capacity is ``S = n * page_size``. Entries past a
sequence's length are never needed; ids are clipped to ``[0, P)`` before any read.
"""

from __future__ import annotations

import jax.numpy as jnp


def gather_pages(pages, block_tables):
  """``[Hkv, P, ps, D]`` pages + ``[B, n]`` table -> contiguous ``[B, Hkv, n*ps, D]`` (a copy).

  Used by the reference and, a chunk of pages at a time, by the XLA path.
  """
  hkv, num_pages, ps, d = pages.shape
  b, n = block_tables.shape
  ids = jnp.clip(block_tables, 0, num_pages - 1)
  g = jnp.take(pages, ids, axis=1)  # [Hkv, B, n, ps, D]
  return g.transpose(1, 0, 2, 3, 4).reshape(b, hkv, n * ps, d)


def gather_scale(scale, block_tables, page_size):
  """Canonical paged scale ``[Hkv|1, P|1, ps|1, nt]`` -> ``[B|1, Hkv|1, n*ps|1, nt]``."""
  h, p, s, nt = scale.shape
  if p == 1:  # not per page: per head / per tensor / per slot
    if s == 1:
      return scale.reshape(1, h, 1, nt)
    n = block_tables.shape[1]
    return jnp.tile(scale, (1, n, 1, 1)).reshape(1, h, n * s, nt)
  if s == 1:
    scale = jnp.broadcast_to(scale, (h, p, page_size, nt))
  return gather_pages(scale, block_tables)
