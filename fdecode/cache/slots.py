"""Where a new token is written, or that it is dropped: the rule every cache write applies
(`fdecode.cache.write`, the ragged step's scatter and its Triton write kernel), written once.

A token at position ``pos`` of its sequence is written only where the caller asked for it:
``pos >= 0`` (a negative position is padding), inside the cache (contiguous: ``pos <
capacity``; paged: its table entry ``pos // page_size`` exists in the sequence's table
row), and, paged, to a page of the pool (``0 <= page < num_pages``: a table entry of -1 or
past the pool names none). Every other token is dropped, never clipped onto a slot it did
not name. The functions are plain jnp over int32 scalars or arrays, so XLA and the Pallas
kernels apply the same rule.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp


def paged_slot(pos, lookup: Callable, *, page_size: int, table_len: int, num_pages: int):
  """``(page, slot, ok)`` of position ``pos`` in a paged pool. ``lookup(j)``: the sequence's
  table entry ``j`` (``j`` already clipped into ``[0, table_len)``, so the read stays in
  bounds whatever ``pos`` is). ``page`` and ``slot`` are in range even where not ``ok``
  (clipped: a kernel may address them, a masked store writes nothing)."""
  j = pos // page_size
  page = lookup(jnp.clip(j, 0, table_len - 1))
  ok = (pos >= 0) & (j < table_len) & (page >= 0) & (page < num_pages)
  return jnp.clip(page, 0, num_pages - 1), jnp.maximum(pos, 0) % page_size, ok


def contiguous_slot(pos, *, capacity: int):
  """``(slot, ok)`` of position ``pos`` in a contiguous cache of ``capacity`` tokens; the
  slot is clipped into range even where not ``ok``."""
  ok = (pos >= 0) & (pos < capacity)
  return jnp.clip(pos, 0, capacity - 1), ok
