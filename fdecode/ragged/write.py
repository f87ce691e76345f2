"""The ragged step's fused cache write: each packed row's new key and value written at its
(sequence, position), in the caches' own layout, before the step attends (`fdecode.ragged`).

Two ways, one result (the same slots written, the same rows dropped):

* **XLA**: a scatter per cache (``mode="drop"``), the rows' slots computed by a fusion
  beside them. Used on CPU and TPU, with ``impl="xla"`` / ``"reference"``, and for caches
  typed on Explicit mesh axes (the scatter states their sharding).
* **Triton** (`fdecode.kernels.triton.write_rows`): keys and values in one kernel that
  derives each row's slot itself: one launch where XLA launches three. Used on GPU, and
  interpreted where the step's attention runs the Triton interpreter (``impl="pallas"``
  on CPU), so the CPU tier runs the kernel the GPU runs.

Under ``jax.jit(..., donate_argnums=...)`` both update the donated caches in place.
A row with ``pos < 0`` (padding, or a position before the cache under ``jit``) writes
nothing; paged, neither does one whose table entry is not a page of the pool.
"""

from __future__ import annotations

import jax.numpy as jnp

from fdecode.cache.meshes import explicit_sharding
from fdecode.cache.slots import contiguous_slot, paged_slot
from fdecode.cache.write import scatter_keeping_sharding
from fdecode import route


def write_new_tokens(view, new_k, new_v, seq, pos, *, impl=None, interpret=None, step=None):
  """``view``'s caches (`fdecode.cache.layout.CacheView`, int32 tables) with row r's
  ``new_k[r]`` / ``new_v[r]`` (``[N, Hkv, Dk]`` / ``[N, Hkv, Dv]``, ``new_v`` None for MLA)
  at sequence ``seq[r]``, position ``pos[r]`` (int32 ``[N]``, `fdecode.ragged.row_positions`)
  -> ``(k, v)``. ``impl`` / ``interpret``: the step's, which choose the way (module doc).
  ``step``: the step's ``(cu, kv_lens, num_seqs)`` that ``seq`` and ``pos`` came from; the
  Triton kernel derives each row's from them (no launch computes ``seq`` / ``pos``)."""
  if explicit_sharding(view.k) is not None:  # the scatter states the caches' sharding
    return _scatter(view, new_k, new_v, seq, pos)
  return route.lower_write(impl, interpret, scatter=_scatter, operands=(view, new_k, new_v, seq, pos, step))


def _scatter(view, new_k, new_v, seq, pos, step=None):
  """Scatters the new rows into the caches at (sequence, position) in their own layout;
  padding rows (pos -1) and positions without a page are dropped (`fdecode.cache.slots`).
  ``step``: unread (the rows' ``seq`` and ``pos`` are given)."""
  del step
  k, v, tables, kv_layout = view.k, view.v, view.block_tables, view.layout
  if view.paged:
    ps, num_pages = view.page_size, view.num_pages
    page, slot, ok = paged_slot(pos, lambda j: tables[seq, j], page_size=ps, table_len=tables.shape[1],
                                num_pages=num_pages)
    page = jnp.where(ok, page, num_pages)  # out of the pool: the scatter drops it
    if kv_layout == "NHD":  # pool[page, slot]: [N, Hkv, D]
      index = (page, slot)
      put = lambda cache, new: scatter_keeping_sharding(cache, index, new)
    else:  # pool[:, page, slot]: [Hkv, N, D]
      index = (slice(None), page, slot)
      put = lambda cache, new: scatter_keeping_sharding(cache, index, new.swapaxes(0, 1))
  else:
    slot, ok = contiguous_slot(pos, capacity=view.capacity)
    p = jnp.where(ok, slot, view.capacity)  # out of range: the scatter drops it
    if kv_layout == "NHD":  # cache[seq, pos]: [N, Hkv, D]
      index = (seq, p)
    else:  # cache[seq, :, pos]: advanced indices split by a slice -> [N, Hkv, D]
      index = (seq, slice(None), p)
    put = lambda cache, new: scatter_keeping_sharding(cache, index, new)
  k = put(k, new_k)
  if new_v is not None:
    v = put(v, new_v)
  return k, v
