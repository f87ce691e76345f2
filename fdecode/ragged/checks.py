"""`fdecode.ragged_decode`'s argument checks: shapes and dtypes at trace time, values
(cu_q_lens, kv_lens, num_seqs, page tables) when they are concrete; traced values are
clipped by the step instead (`fdecode.ragged.row_positions`).

Legend: N packed new tokens (rows), M = max_seqs, S a sequence's cache capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fdecode.cache.layout import kv_heads, shape_names
from fdecode.cache.tables import check_concrete_page_ids, check_page_aliasing
from fdecode.cache.quant import is_quantized
from fdecode.validation import check_int32

CALLER = "ragged_decode"
PER_ROW = ("mask", "bias", "indices")  # flash_decode's keywords ragged_decode indexes by row


def check_shapes(q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, new_k, new_v, kv_layout, arrays):
  """Shape / dtype checks at trace time; returns (N, M)."""
  paged = block_tables is not None
  if q.ndim != 3:
    raise ValueError(f"{CALLER}: q must be [N, Hq, Dk] (packed new tokens); got q.shape={tuple(q.shape)}")
  for name, x in (("k", k), ("v", v)):
    if x is not None and x.ndim != 4:
      raise ValueError(f"{CALLER}: with kv_layout={kv_layout!r}, {name} must be "
                       f"{shape_names(kv_layout, paged)}; got {name}.shape={tuple(x.shape)}")
  n_rows, hq = q.shape[0], q.shape[1]
  kv_shape = f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, kv_layout={kv_layout!r}"
  hkv = kv_heads(k.shape, kv_layout, paged)
  if hkv == 0 or hq % hkv:
    raise ValueError(f"{CALLER}: Hq ({hq}) must be a multiple of the cache's Hkv ({hkv}) read from "
                     f"k as {shape_names(kv_layout, paged)}: does kv_layout match the cache? {kv_shape}")
  for name, x in (("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs),
                  ("block_tables", block_tables)):
    if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):  # a float table once read page int(x)
      raise ValueError(f"{CALLER}: {name} must be integer, got {name}.dtype={x.dtype}")
  if kv_lens.ndim != 1:
    raise ValueError(f"{CALLER}: kv_lens must be [max_seqs]; got kv_lens.shape={tuple(kv_lens.shape)}")
  m = kv_lens.shape[0]
  if cu_q_lens.shape != (m + 1,):
    raise ValueError(f"{CALLER}: cu_q_lens must be [max_seqs + 1]=({m + 1},) (kv_lens is [{m}]); got "
                     f"cu_q_lens.shape={tuple(cu_q_lens.shape)}")
  if num_seqs.shape not in ((), (1,)):
    raise ValueError(f"{CALLER}: num_seqs must be an int scalar or [1]; got num_seqs.shape={tuple(num_seqs.shape)}")
  if paged:
    if block_tables.ndim != 2 or block_tables.shape[0] != m:
      raise ValueError(f"{CALLER}: block_tables must be [max_seqs={m}, n]; got "
                       f"block_tables.shape={tuple(block_tables.shape)}")
  elif k.shape[0] != m:
    raise ValueError(f"{CALLER}: a contiguous cache has one row per sequence: k must be "
                     f"{shape_names(kv_layout, False)} with B = max_seqs = {m}; got {kv_shape}")
  for name in PER_ROW:
    x = arrays.get(name)
    if x is not None and (x.ndim < 2 or x.shape[0] not in (1, n_rows)):
      raise ValueError(f"{CALLER}: {name} is per row: its first axis must be N={n_rows} or 1; "
                       f"got {name}.shape={tuple(x.shape)}")
    if x is not None and x.ndim > 3:
      raise ValueError(f"{CALLER}: {name} must be [N|1, S] or [N|1, H, S] (indices: [N|1, K] or "
                       f"[N|1, Hkv, K]); got {name}.shape={tuple(x.shape)}")
  if v is None and new_v is not None:
    raise ValueError(f"{CALLER}: new_v given with v=None (MLA: the values are k's first columns; pass new_k only)")
  if v is not None and (new_k is None) != (new_v is None):
    raise ValueError(f"{CALLER}: pass new_k and new_v together (or neither); got "
                     f"new_k {'None' if new_k is None else 'given'}, new_v {'None' if new_v is None else 'given'}")
  if new_k is not None:
    if arrays.get("k_rope") is not None:
      raise ValueError(f"{CALLER}: the fused write does not write k_rope; write it with "
                       "fdecode.cache.write_paged / write_contiguous, then call without new_k")
    for name, new, cache in (("new_k", new_k, k), ("new_v", new_v, v)):
      if new is None:
        continue
      want = (n_rows, hkv, cache.shape[-1])
      if tuple(new.shape) != want:
        raise ValueError(f"{CALLER}: {name} must be [N, Hkv, D]={want} (one row per packed token; Hkv "
                         f"and D read from the cache as {shape_names(kv_layout, paged)}, kv_layout={kv_layout!r}); "
                         f"got {name}.shape={tuple(new.shape)}")
      if is_quantized(cache.dtype) and new.dtype != cache.dtype:
        raise TypeError(f"{CALLER}: {name} must be already quantized with the cache's scales, in the "
                        f"cache's dtype {cache.dtype}; got {name}.dtype={new.dtype}")
      if not is_quantized(cache.dtype) and not jnp.issubdtype(new.dtype, jnp.floating):
        raise TypeError(f"{CALLER}: {name} must be floating point for a {cache.dtype} cache; got "
                        f"{name}.dtype={new.dtype}")
  return n_rows, m


def check_values(kv_lens, block_tables, cu_q_lens, num_seqs, n_rows, m, cap, *, num_pages,
                 page_size, window, writes):
  """Concrete value checks (skipped for traced values, which are clipped instead);
  ``writes``: the call writes the new tokens (fused write)."""
  for name, x in (("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
    check_int32(name, x, CALLER)
  if any(isinstance(x, jax.core.Tracer) for x in (kv_lens, cu_q_lens, num_seqs)):
    return
  ns = int(np.asarray(num_seqs).reshape(-1)[0])
  if not 0 <= ns <= m:
    raise ValueError(f"{CALLER}: num_seqs must lie in [0, max_seqs={m}]; got {ns}")
  cu = np.asarray(cu_q_lens).astype(np.int64)
  lens = np.asarray(kv_lens).astype(np.int64)
  if cu[0] != 0:
    raise ValueError(f"{CALLER}: cu_q_lens[0] must be 0; got {int(cu[0])}")
  steps = np.diff(cu)
  if (steps[:ns] < 0).any():
    i = int(np.argmax(steps[:ns] < 0))
    raise ValueError(f"{CALLER}: cu_q_lens must be non-decreasing; cu_q_lens[{i + 1}] = {int(cu[i + 1])} "
                     f"< cu_q_lens[{i}] = {int(cu[i])}")
  if cu[ns] > n_rows:
    raise ValueError(f"{CALLER}: cu_q_lens[num_seqs={ns}] = {int(cu[ns])} rows, but q has only N={n_rows}")
  bad = np.nonzero((lens[:ns] < 0) | (lens[:ns] > cap))[0]
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"{CALLER}: kv_lens must lie in [0, S={cap}]; sequence {i} has kv_lens[{i}] = {int(lens[i])}")
  over = np.nonzero(steps[:ns] > lens[:ns])[0]
  if over.size:
    i = int(over[0])
    raise ValueError(f"{CALLER}: sequence {i} has q_len = {int(steps[i])} new tokens but kv_lens[{i}] = "
                     f"{int(lens[i])}: its new tokens are the last q_len of its kv_lens tokens")
  if block_tables is not None and not isinstance(block_tables, jax.core.Tracer):
    qmax = int(steps[:ns].max()) if ns else 1
    tables = np.asarray(block_tables)[:ns]
    check_concrete_page_ids(tables, lens[:ns], num_pages, page_size, num_tokens=max(qmax, 1), window=window,
                            caller=CALLER)
    check_page_aliasing(tables, lens[:ns], steps[:ns], page_size, window=window, writes=writes, caller=CALLER)
