"""Host-side page allocator for paged KV caches (a free list, as in vLLM's block manager)."""

from __future__ import annotations

import operator

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
    sizes = dict(num_pages=num_pages, page_size=page_size, max_pages_per_seq=max_pages_per_seq)
    sizes = {name: _count(name, x, "__init__") for name, x in sizes.items()}
    if min(sizes.values()) < 1:
      raise ValueError(f"PageAllocator: sizes must be positive, got {num_pages=}, {page_size=}, "
                       f"{max_pages_per_seq=}")
    self.num_pages, self.page_size, self.max_pages_per_seq = (
        sizes["num_pages"], sizes["page_size"], sizes["max_pages_per_seq"])
    self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low ids first
    self._pages: dict[object, list[int]] = {}
    self._tokens: dict[object, int] = {}

  @property
  def num_free(self) -> int:
    return len(self._free)

  def pages(self, seq_id) -> list[int]:
    """The pool page ids of a sequence, in token order."""
    return list(self._pages[self._known(seq_id)])

  def allocate(self, seq_id, num_tokens: int) -> list[int]:
    """Registers a new sequence with room for ``num_tokens`` (int >= 0) tokens.

    Raises:
      ValueError: an unhashable or already allocated ``seq_id``, ``num_tokens`` not an
        int >= 0 or needing more than ``max_pages_per_seq`` pages.
      PoolExhaustedError: too few free pages. On any error nothing is registered.
    """
    _hashable(seq_id, "allocate")
    if seq_id in self._pages:
      raise ValueError(f"PageAllocator.allocate: sequence {seq_id!r} is already allocated")
    n, need = self._pages_needed(seq_id, num_tokens, have=0, method="allocate")
    self._pages[seq_id] = [self._free.pop() for _ in range(need)]
    self._tokens[seq_id] = n
    return list(self._pages[seq_id])

  def extend(self, seq_id, num_tokens: int) -> list[int]:
    """Grows a sequence to hold ``num_tokens`` (int >= 0) tokens in all; returns its pages.
    A count below what the sequence already holds changes nothing.

    Raises:
      KeyError: an unknown ``seq_id``.
      ValueError, PoolExhaustedError: as `allocate`; on any error nothing changes.
    """
    seq_id = self._known(seq_id)
    n, need = self._pages_needed(seq_id, num_tokens, have=len(self._pages[seq_id]), method="extend")
    self._pages[seq_id].extend(self._free.pop() for _ in range(need))
    self._tokens[seq_id] = max(self._tokens[seq_id], n)
    return list(self._pages[seq_id])

  def free(self, seq_id) -> None:
    """Returns a sequence's pages to the pool (KeyError for an unknown ``seq_id``)."""
    seq_id = self._known(seq_id)
    self._free.extend(reversed(self._pages.pop(seq_id)))
    del self._tokens[seq_id]

  def block_table(self, seq_ids) -> np.ndarray:
    """int32 ``[len(seq_ids), max_pages_per_seq]``, -1 past each sequence's pages.

    ``seq_ids``: a sequence (list, tuple) of known, distinct ids; row b is ``seq_ids[b]``.
    A repeated id is a ValueError (two rows writing the same pages); an unknown one a KeyError.
    """
    if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__len__"):
      raise ValueError(f"PageAllocator.block_table: seq_ids must be a list of sequence ids, got "
                       f"{seq_ids!r}")
    seq_ids = list(seq_ids)
    for sid in seq_ids:
      self._known(sid)
    if len(set(seq_ids)) != len(seq_ids):
      dup = next(sid for i, sid in enumerate(seq_ids) if sid in seq_ids[:i])
      raise ValueError(f"PageAllocator.block_table: sequence {dup!r} is listed twice in seq_ids; "
                       "two rows would write the same pages")
    table = np.full((len(seq_ids), self.max_pages_per_seq), -1, np.int32)
    for row, sid in enumerate(seq_ids):
      pages = self._pages[sid]
      table[row, :len(pages)] = pages
    return table

  def _pages_needed(self, seq_id, num_tokens, *, have: int, method: str) -> tuple[int, int]:
    """(num_tokens as an int, pages to add to a sequence holding ``have`` pages); every
    check happens here, before any change."""
    n = _count("num_tokens", num_tokens, method)
    if n < 0:
      raise ValueError(f"PageAllocator.{method}: num_tokens must be >= 0, got {num_tokens!r} for "
                       f"sequence {seq_id!r}")
    total = -(-n // self.page_size)
    if total > self.max_pages_per_seq:
      raise ValueError(f"PageAllocator.{method}: {n} tokens need more than max_pages_per_seq="
                       f"{self.max_pages_per_seq} pages of {self.page_size}")
    need = max(total - have, 0)
    if need > len(self._free):
      raise PoolExhaustedError(f"PageAllocator: sequence {seq_id!r} needs {need} more pages, "
                               f"{len(self._free)} of {self.num_pages} free")
    return n, need

  def _known(self, seq_id):
    _hashable(seq_id, "lookup")
    if seq_id not in self._pages:
      raise KeyError(f"PageAllocator: unknown sequence {seq_id!r}")
    return seq_id


def _count(name: str, x, method: str) -> int:
  """``x`` as a Python int (int, numpy / JAX integer scalar); bool, float or str: ValueError."""
  if isinstance(x, (bool, np.bool_)):
    raise ValueError(f"PageAllocator.{method}: {name} must be an int, got {x!r}")
  try:
    return operator.index(x)
  except TypeError:
    raise ValueError(f"PageAllocator.{method}: {name} must be an int, got {x!r} "
                     f"({type(x).__name__})") from None


def _hashable(seq_id, method: str) -> None:
  try:
    hash(seq_id)
  except TypeError:
    raise ValueError(f"PageAllocator.{method}: seq_id must be hashable (a str, int, tuple...), "
                     f"got {seq_id!r} ({type(seq_id).__name__})") from None
