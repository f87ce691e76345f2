"""Host-side page allocator for paged KV caches: a free list with reference counts and
copy-on-write (as in vLLM's block manager), so that beams and parallel samples share the
pages of their common prefix."""

from __future__ import annotations

import operator

import numpy as np

from fdecode.validation import describe, short_repr


class PoolExhaustedError(RuntimeError, ValueError):
  """Raised when the page pool has too few free pages for a request; the failed call
  changed nothing (no page taken, none leaked)."""


class UnknownSequenceError(KeyError, ValueError):
  """Raised for a sequence id the allocator does not hold (a KeyError, and a ValueError
  for callers that expect one)."""

  def __str__(self):  # KeyError's own str() would quote the message
    return str(self.args[0]) if self.args else ""


class PageAllocator:
  """Hands out pages of a pool of ``num_pages`` pages of ``page_size`` tokens.

  Every page has a reference count: the number of live sequences whose page list holds
  it. `allocate` / `extend` take free pages (count 1); `fork` lets a new sequence share
  all of its parent's pages (each count + 1); `free` drops a sequence's references, and a
  page returns to the free list only when its count reaches 0. Before writing into a
  sequence, call `prepare_write`: it gives the sequence a private copy of every shared
  page the write touches (copy-on-write) and returns the ``(src, dst)`` page copies to
  perform on the device pool first (`fdecode.cache.copy_pages`).

  The block table it builds (`block_table`) is what `fdecode.flash_decode(...,
  block_tables=...)` and `fdecode.cache.write_paged` take; unused entries hold -1 (never
  read). A call that raises changes nothing.

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
    self._refs = [0] * self.num_pages  # live sequences holding each page
    self._pages: dict[object, list[int]] = {}
    self._tokens: dict[object, int] = {}

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def seq_ids(self) -> list:
    """The live sequences' ids, in allocation order."""
    return list(self._pages)

  def pages(self, seq_id) -> list[int]:
    """The pool page ids of a sequence, in token order."""
    return list(self._pages[self._known(seq_id)])

  def num_tokens(self, seq_id) -> int:
    """Tokens a sequence holds room for (what `allocate` / `extend` / `prepare_write` asked)."""
    return self._tokens[self._known(seq_id)]

  def ref_count(self, page: int) -> int:
    """How many live sequences hold pool page ``page`` (0: free)."""
    page = _count("page", page, "ref_count")
    if not 0 <= page < self.num_pages:
      raise ValueError(f"PageAllocator.ref_count: page must lie in [0, {self.num_pages}), got {page}")
    return self._refs[page]

  def allocate(self, seq_id, num_tokens: int) -> list[int]:
    """Registers a new sequence with room for ``num_tokens`` (int >= 0) tokens.

    Raises:
      ValueError: an unhashable or already allocated ``seq_id``, ``num_tokens`` not an
        int >= 0 or needing more than ``max_pages_per_seq`` pages.
      PoolExhaustedError: too few free pages. On any error nothing is registered.
    """
    self._new_id(seq_id, "allocate")
    n, need = self._pages_needed(seq_id, num_tokens, have=0, method="allocate")
    self._pages[seq_id] = self._take(need)
    self._tokens[seq_id] = n
    return list(self._pages[seq_id])

  def extend(self, seq_id, num_tokens: int) -> list[int]:
    """Grows a sequence to hold ``num_tokens`` (int >= 0) tokens in all; returns its pages.
    A count below what the sequence already holds changes nothing. New pages are private
    (count 1); pages already held stay shared (write through `prepare_write`).

    Raises:
      UnknownSequenceError: an unknown ``seq_id`` (a KeyError and a ValueError).
      ValueError, PoolExhaustedError: as `allocate`; on any error nothing changes.
    """
    seq_id = self._known(seq_id)
    n, need = self._pages_needed(seq_id, num_tokens, have=len(self._pages[seq_id]), method="extend")
    self._pages[seq_id].extend(self._take(need))
    self._tokens[seq_id] = max(self._tokens[seq_id], n)
    return list(self._pages[seq_id])

  def fork(self, parent, child) -> list[int]:
    """Registers ``child`` sharing all of ``parent``'s pages (each count + 1) and its token
    count; returns the child's pages. Takes no free page: the first write into a shared
    page (`prepare_write`) copies it.

    Raises:
      UnknownSequenceError: an unknown ``parent`` (a ValueError too).
      ValueError: an unhashable or already allocated ``child``. Nothing changes.
    """
    parent = self._known(parent, "fork")
    self._new_id(child, "fork")
    pages = list(self._pages[parent])
    for page in pages:
      self._refs[page] += 1
    self._pages[child] = pages
    self._tokens[child] = self._tokens[parent]
    return list(pages)

  def prepare_write(self, seq_id, start: int, num_tokens: int) -> list[tuple[int, int]]:
    """Makes tokens ``[start, start + num_tokens)`` of a sequence writable.

    Extends the sequence to hold ``start + num_tokens`` tokens (as `extend`), and replaces
    every page the write touches that another live sequence also holds (count > 1) by a
    fresh private page (the shared page's count - 1). The caller must copy each returned
    ``(src, dst)`` page on the device pool (`fdecode.cache.copy_pages`) BEFORE writing.

    Returns:
      ``[(src_page, dst_page), ...]`` in token order; empty when nothing was shared.

    Raises:
      UnknownSequenceError: an unknown ``seq_id``.
      ValueError: ``start`` / ``num_tokens`` not ints >= 0, or an end past the capacity.
      PoolExhaustedError: too few free pages for the new and the copied pages together.
        On any error nothing changes.
    """
    seq_id = self._known(seq_id, "prepare_write")
    start = _count("start", start, "prepare_write")
    count = _count("num_tokens", num_tokens, "prepare_write")
    if start < 0 or count < 0:
      raise ValueError(f"PageAllocator.prepare_write: start and num_tokens must be >= 0, got "
                       f"{start=}, num_tokens={count} for sequence {short_repr(seq_id)}")
    pages = self._pages[seq_id]
    end = start + count
    first, stop = start // self.page_size, min(-(-end // self.page_size), len(pages))
    shared = [j for j in range(first, stop) if count and self._refs[pages[j]] > 1]
    n, need = self._pages_needed(seq_id, end, have=len(pages), method="prepare_write",
                                 extra=len(shared))
    copies = []
    for j, dst in zip(shared, self._take(len(shared))):
      src, pages[j] = pages[j], dst
      self._refs[src] -= 1  # was > 1: never reaches 0 here
      copies.append((src, dst))
    pages.extend(self._take(need))
    self._tokens[seq_id] = max(self._tokens[seq_id], n)
    return copies

  def free(self, seq_id) -> None:
    """Drops a sequence's references; pages no other sequence holds return to the pool.

    Raises:
      UnknownSequenceError: an unknown ``seq_id`` (a KeyError and a ValueError).
    """
    seq_id = self._known(seq_id)
    for page in reversed(self._pages.pop(seq_id)):  # reversed: pop() reuses low ids first
      self._refs[page] -= 1
      if not self._refs[page]:
        self._free.append(page)
    del self._tokens[seq_id]

  def block_table(self, seq_ids) -> np.ndarray:
    """int32 ``[len(seq_ids), max_pages_per_seq]``, -1 past each sequence's pages.

    ``seq_ids``: a sequence (list, tuple) of known, distinct ids; row b is ``seq_ids[b]``.
    A repeated id is a ValueError (two rows writing the same pages); an unknown one an
    `UnknownSequenceError`. Forked sequences share page ids until `prepare_write`.
    """
    if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__len__"):
      raise ValueError(f"PageAllocator.block_table: seq_ids must be a list of sequence ids, got "
                       f"{describe(seq_ids)}")
    seq_ids = list(seq_ids)
    for sid in seq_ids:
      self._known(sid)
    if len(set(seq_ids)) != len(seq_ids):
      dup = next(sid for i, sid in enumerate(seq_ids) if sid in seq_ids[:i])
      raise ValueError(f"PageAllocator.block_table: sequence {short_repr(dup)} is listed twice in seq_ids; "
                       "two rows would write the same pages")
    table = np.full((len(seq_ids), self.max_pages_per_seq), -1, np.int32)
    for row, sid in enumerate(seq_ids):
      pages = self._pages[sid]
      table[row, :len(pages)] = pages
    return table

  def check_invariants(self) -> None:
    """Verifies the bookkeeping (for tests and debugging); RuntimeError on a violation:
    every page is free or referenced, never both; each page's count equals the number of
    live sequences holding it; no page is free twice; free + referenced == num_pages."""
    counts = [0] * self.num_pages
    for sid, pages in self._pages.items():
      if len(set(pages)) != len(pages):
        raise RuntimeError(f"PageAllocator: sequence {sid!r} holds a page twice: {pages}")
      for page in pages:
        counts[page] += 1
    if counts != self._refs:
      bad = next(p for p in range(self.num_pages) if counts[p] != self._refs[p])
      raise RuntimeError(f"PageAllocator: page {bad} has count {self._refs[bad]} but {counts[bad]} "
                         "live sequences hold it")
    free = set(self._free)
    if len(free) != len(self._free):
      raise RuntimeError(f"PageAllocator: a page is in the free list twice: {sorted(self._free)}")
    held = {p for p in range(self.num_pages) if counts[p]}
    if free & held or len(free) + len(held) != self.num_pages:
      raise RuntimeError(f"PageAllocator: free pages {sorted(free)} and held pages {sorted(held)} "
                         f"must partition the {self.num_pages} pages")

  def _take(self, n: int) -> list[int]:
    """``n`` free pages, count 1 (the caller checked there are enough)."""
    pages = [self._free.pop() for _ in range(n)]
    for page in pages:
      self._refs[page] = 1
    return pages

  def _pages_needed(self, seq_id, num_tokens, *, have: int, method: str,
                    extra: int = 0) -> tuple[int, int]:
    """(num_tokens as an int, pages to add to a sequence holding ``have`` pages); every
    check happens here, before any change. ``extra``: more pages taken by the same call."""
    n = _count("num_tokens", num_tokens, method)
    if n < 0:
      raise ValueError(f"PageAllocator.{method}: num_tokens must be >= 0, got {describe(num_tokens)} for "
                       f"sequence {short_repr(seq_id)}")
    total = -(-n // self.page_size)
    if total > self.max_pages_per_seq:
      raise ValueError(f"PageAllocator.{method}: {n} tokens need more than max_pages_per_seq="
                       f"{self.max_pages_per_seq} pages of {self.page_size}")
    need = max(total - have, 0)
    if need + extra > len(self._free):
      copies = f" ({extra} of them copies of shared pages)" if extra else ""
      raise PoolExhaustedError(f"PageAllocator: sequence {short_repr(seq_id)} needs {need + extra} more pages"
                               f"{copies}, {len(self._free)} of {self.num_pages} free")
    return n, need

  def _known(self, seq_id, method: str = "lookup"):
    _hashable(seq_id, method)
    if seq_id not in self._pages:
      raise UnknownSequenceError(f"PageAllocator.{method}: unknown sequence {short_repr(seq_id)}")
    return seq_id

  def _new_id(self, seq_id, method: str) -> None:
    _hashable(seq_id, method)
    if seq_id in self._pages:
      raise ValueError(f"PageAllocator.{method}: sequence {short_repr(seq_id)} is already allocated")


def _count(name: str, x, method: str) -> int:
  """``x`` as a Python int (int, numpy / JAX integer scalar); bool, float or str: ValueError."""
  if isinstance(x, (bool, np.bool_)):
    raise ValueError(f"PageAllocator.{method}: {name} must be an int, got {describe(x)}")
  try:
    return operator.index(x)
  except TypeError:
    raise ValueError(f"PageAllocator.{method}: {name} must be an int, got {describe(x)} "
                     f"({type(x).__name__})") from None


def _hashable(seq_id, method: str) -> None:
  try:
    hash(seq_id)
  except TypeError:
    raise ValueError(f"PageAllocator.{method}: seq_id must be hashable (a str, int, tuple...), "
                     f"got {short_repr(seq_id)} ({type(seq_id).__name__})") from None
