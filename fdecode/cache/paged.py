"""Paged cache layout (that of jax.experimental.pallas.ops.tpu.paged_attention).

``k_pages: [Hkv, P, page_size, D]`` is a pool of P pages per kv head;
``block_tables: int32 [B, n]`` maps page j of sequence b to ``block_tables[b, j]``.
Token t of sequence b lives in page ``block_tables[b, t // page_size]``, slot
``t % page_size``; the sequence's capacity is ``S = n * page_size``. Entries past a
sequence's length are never needed; ids are clipped to ``[0, P)`` before any read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_pages_head_major(pages, block_tables):
  """``[Hkv, P, ps, D]`` pages + ``[B, n]`` table -> ``[Hkv, B, n*ps, D]`` (a copy, in the
  pool's own head-outer order: no transpose)."""
  hkv, num_pages, ps, d = pages.shape
  b, n = block_tables.shape
  ids = jnp.clip(block_tables, 0, num_pages - 1)
  return jnp.take(pages, ids, axis=1).reshape(hkv, b, n * ps, d)


def gather_token_major_pages(pages, block_tables):
  """Token-major ``[P, ps, Hkv, D]`` pages + ``[B, n]`` table -> ``[Hkv, B, n*ps, D]``, as
  `gather_pages_head_major` gives: only the gathered rows are transposed, never the pool."""
  num_pages, ps, hkv, d = pages.shape
  b, n = block_tables.shape
  ids = jnp.clip(block_tables, 0, num_pages - 1)
  return jnp.take(pages, ids, axis=0).reshape(b, n * ps, hkv, d).transpose(2, 0, 1, 3)


def gather_pages(pages, block_tables):
  """``[Hkv, P, ps, D]`` pages + ``[B, n]`` table -> contiguous ``[B, Hkv, n*ps, D]`` (a copy)."""
  return _gather_pages(jnp.asarray(pages), jnp.asarray(block_tables))


@jax.jit  # one program, not three eager ops (tests and oracles call it outside jit)
def _gather_pages(pages, block_tables):
  return gather_pages_head_major(pages, block_tables).transpose(1, 0, 2, 3)


def gather_scale_head_major(scale, block_tables, page_size):
  """Canonical paged scale ``[Hkv|1, P|1, ps|1, nt]`` -> ``[Hkv|1, B|1, n*ps|1, nt]``."""
  h, p, s, nt = scale.shape
  if p == 1:  # not per page: per head / per tensor / per slot
    if s == 1:
      return scale.reshape(h, 1, 1, nt)
    n = block_tables.shape[1]
    return jnp.tile(scale, (1, n, 1, 1)).reshape(h, 1, n * s, nt)
  if s == 1:
    scale = jnp.broadcast_to(scale, (h, p, page_size, nt))
  return gather_pages_head_major(scale, block_tables)


def gather_scale(scale, block_tables, page_size):
  """Canonical paged scale ``[Hkv|1, P|1, ps|1, nt]`` -> ``[B|1, Hkv|1, n*ps|1, nt]``."""
  return gather_scale_head_major(scale, block_tables, page_size).transpose(1, 0, 2, 3)
