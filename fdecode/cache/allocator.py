"""Host-side page allocator for paged KV caches (a free list, as in vLLM's block manager)."""

from __future__ import annotations

import numpy as np


class PoolExhaustedError(RuntimeError):
  """Raised when the page pool has too few free pages for a request."""


class PageAllocator:
  """Hands out pages of a pool of ``num_pages`` pages of ``page_size`` tokens.

  No page is ever owned by two live sequences; freed pages return to the pool. The block
  table it builds (`block_table`) is what `fdecode.flash_decode(..., block_tables=...)`
  and `fdecode.cache.write_paged` take; unused entries hold -1 (never read).

  Args:
    num_pages: P, pages in the pool.
    page_size: tokens per page.
    max_pages_per_seq: n, the block table's width (a sequence's capacity is n*page_size).
  """

  def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int):
    if num_pages < 1 or page_size < 1 or max_pages_per_seq < 1:
      raise ValueError(f"PageAllocator: sizes must be positive, got {num_pages=}, {page_size=}, "
                       f"{max_pages_per_seq=}")
    self.num_pages, self.page_size, self.max_pages_per_seq = num_pages, page_size, max_pages_per_seq
    self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
    self._pages: dict[object, list[int]] = {}
    self._tokens: dict[object, int] = {}

  @property
  def num_free(self) -> int:
    return len(self._free)

  def pages(self, seq_id) -> list[int]:
    return list(self._pages[self._known(seq_id)])

  def allocate(self, seq_id, num_tokens: int) -> list[int]:
    """Registers a new sequence with room for ``num_tokens`` tokens."""
    if seq_id in self._pages:
      raise ValueError(f"PageAllocator: sequence {seq_id!r} is already allocated")
    self._pages[seq_id], self._tokens[seq_id] = [], 0
    try:
      return self.extend(seq_id, num_tokens)
    except (PoolExhaustedError, ValueError):
      del self._pages[seq_id], self._tokens[seq_id]
      raise

  def extend(self, seq_id, num_tokens: int) -> list[int]:
    """Grows a sequence to hold ``num_tokens`` tokens in all; returns its pages."""
    seq_id = self._known(seq_id)
    need = -(-num_tokens // self.page_size) - len(self._pages[seq_id])
    if -(-num_tokens // self.page_size) > self.max_pages_per_seq:
      raise ValueError(f"PageAllocator: {num_tokens} tokens need more than max_pages_per_seq="
                       f"{self.max_pages_per_seq} pages of {self.page_size}")
    if need > len(self._free):
      raise PoolExhaustedError(f"PageAllocator: sequence {seq_id!r} needs {need} more pages, "
                               f"{len(self._free)} of {self.num_pages} free")
    for _ in range(max(need, 0)):
      self._pages[seq_id].append(self._free.pop())
    self._tokens[seq_id] = max(self._tokens[seq_id], num_tokens)
    return list(self._pages[seq_id])

  def free(self, seq_id) -> None:
    """Returns a sequence's pages to the pool."""
    seq_id = self._known(seq_id)
    self._free.extend(reversed(self._pages.pop(seq_id)))
    del self._tokens[seq_id]

  def block_table(self, seq_ids) -> np.ndarray:
    """int32 ``[len(seq_ids), max_pages_per_seq]``, -1 past each sequence's pages."""
    table = np.full((len(seq_ids), self.max_pages_per_seq), -1, np.int32)
    for row, sid in enumerate(seq_ids):
      pages = self._pages[self._known(sid)]
      table[row, :len(pages)] = pages
    return table

  def _known(self, seq_id):
    if seq_id not in self._pages:
      raise KeyError(f"PageAllocator: unknown sequence {seq_id!r}")
    return seq_id
