"""Value checks of concrete block tables (skipped for traced ones, which are clipped
instead): page ids in the pool, and pages not aliased where a write would make two
positions (or two sequences) one.

Legend: B sequences (table rows), n table columns, P pages in the pool.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np


def needed_pages(lengths, n: int, page_size: int, *, num_tokens=1, window=None) -> np.ndarray:
  """bool ``[B, n]``: the table entries a live token needs: the pages of positions
  ``[0, lengths)``, less those wholly before every query's window (a window's old pages
  are never read, so they may be freed and hold anything). ``num_tokens``: new tokens
  per sequence (int, or int ``[B]``), the queries the window is counted from."""
  lens = np.asarray(lengths).astype(np.int64)
  cols = np.arange(n)[None, :]
  needed = cols < -(-lens[:, None] // page_size)
  if window is not None and isinstance(window, numbers.Integral) and window > 0:
    first = np.maximum(lens - np.asarray(num_tokens, np.int64) + 1 - window, 0)
    needed &= (cols + 1) * page_size > first[:, None]
  return needed


def check_concrete_page_ids(block_tables, lengths, num_pages, page_size, *, num_tokens=1,
                            window=None, caller: str = "flash_decode", name: str = "block_tables") -> None:
  """When table and lengths are concrete: every page a live token some query may see
  needs (`needed_pages`) is in [0, P)."""
  if isinstance(block_tables, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
    return
  tables = np.asarray(block_tables)
  needed = needed_pages(lengths, tables.shape[1], page_size, num_tokens=num_tokens, window=window)
  bad = needed & ((tables < 0) | (tables >= num_pages))
  if bad.any():
    seq, j = map(int, np.argwhere(bad)[0])
    raise ValueError(f"{caller}: {name}[{seq}, {j}] = {int(tables[seq, j])} is out of range "
                     f"[0, P={num_pages}) for a live token of sequence {seq} (length "
                     f"{int(np.asarray(lengths)[seq])})")


def check_page_aliasing(block_tables, lengths, new_tokens, page_size, *, window=None, writes: bool,
                        caller: str, name: str = "block_tables") -> None:
  """Concrete tables of live sequences (``[B, n]``, ids already in the pool where needed):

  * no sequence lists one page twice among the pages it needs (`needed_pages`): two of
    its positions would be one slot;
  * with ``writes`` (a fused write of the new tokens), no page a sequence writes (those
    of its positions ``[lengths - new_tokens, lengths)``) is needed by another: the
    write would change the other's tokens (a forked prefix's shared page: copy it first,
    `fdecode.cache.PageAllocator.prepare_write` and `fdecode.cache.copy_pages`).

  ``lengths`` / ``new_tokens``: int ``[B]``. Raises ValueError naming the sequences, the
  table entries and the page.
  """
  tables = np.asarray(block_tables).astype(np.int64)
  lens = np.asarray(lengths).astype(np.int64)
  q_lens = np.asarray(new_tokens).astype(np.int64)
  b, n = tables.shape
  needed = needed_pages(lens, n, page_size, num_tokens=np.maximum(q_lens, 1), window=window)
  rows, cols = np.nonzero(needed)
  ids = tables[rows, cols]
  order = np.lexsort((cols, ids, rows))  # by row, then page, then column
  rows, cols, ids = rows[order], cols[order], ids[order]
  twice = np.nonzero((rows[1:] == rows[:-1]) & (ids[1:] == ids[:-1]))[0]
  if twice.size:
    k = int(twice[0])
    i, page = int(rows[k]), int(ids[k])
    raise ValueError(f"{caller}: {name}[{i}, {int(cols[k])}] = {name}[{i}, {int(cols[k + 1])}] = {page}: "
                     f"sequence {i} (length {int(lens[i])}) lists page {page} twice for its live tokens; "
                     f"a page holds one run of page_size={page_size} positions")
  if not writes or not rows.size:
    return
  cols_all = np.arange(n)[None, :]
  written = ((cols_all + 1) * page_size > (lens - q_lens)[:, None]) & (cols_all * page_size < lens[:, None])
  written &= (q_lens > 0)[:, None]
  held = np.unique(np.stack([rows, ids], axis=1), axis=0)[:, 1]  # each (sequence, page) once
  pages, holders = np.unique(held, return_counts=True)
  shared = pages[holders > 1]  # pages two or more live sequences need
  wi, wj = np.nonzero(written)
  hit = np.nonzero(np.isin(tables[wi, wj], shared))[0]
  if hit.size:
    i, j = int(wi[hit[0]]), int(wj[hit[0]])
    page = int(tables[i, j])
    s, c = map(int, np.argwhere(needed & (tables == page) & (np.arange(b) != i)[:, None])[0])
    raise ValueError(f"{caller}: sequence {i} writes its new tokens into page {page} ({name}[{i}, {j}]), "
                     f"which sequence {s} also holds ({name}[{s}, {c}]) for its live tokens: the write "
                     f"would change sequence {s}'s tokens. Give the writer a private copy first "
                     "(PageAllocator.prepare_write, then fdecode.cache.copy_pages)")
