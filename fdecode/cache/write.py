"""Jit-compatible writes of new tokens into a KV cache, and whole-page copies within a
paged pool (`copy_pages`, the device half of copy-on-write).

All three are pure (they return the updated arrays) and use a single scatter, so
under ``jax.jit(..., donate_argnums=...)`` XLA updates the donated cache in place: no copy
of the whole cache per step. Tokens whose slot falls outside the cache (a position past
S, or a page id outside the pool) are dropped, never written elsewhere.

Shapes and dtypes are checked before anything is computed: new tokens must match the
cache's B and Hkv exactly (a batch-1 or head-1 ``k_new`` is never broadcast), positions
and block tables must be integer ``[B]`` and ``[B, n]``; any mismatch is a ValueError
naming the argument, with the shapes.

Quantized caches: pass the cache's scale. A scale with a token axis (per token or per
tile: ``[..., S or page_size, n_tiles]``) gets each new token's own scale, written beside
it; a scale without one (per tensor / per head) is fixed and new tokens are quantized
with it (values clipped to the dtype's range).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fdecode.cache.meshes import explicit_sharding, host_values, replicated
from fdecode.cache.quant import QMAX, canonical_scale, is_quantized, quantize
from fdecode.cache.slots import contiguous_slot, paged_slot
from fdecode.validation import as_array, check_int32, to_int32


def _quantize_new(new, scale, dtype, per_token):
  """new f32 ``[B, Hkv, T, D]`` -> (values, new tokens' scales ``[B, Hkv, T, nt]`` or None).

  ``per_token``: each new token gets its own scale; else ``scale`` (broadcastable to
  ``[B, Hkv, 1, nt]``) is fixed."""
  d = new.shape[-1]
  nt = scale.shape[-1]
  if per_token:
    return quantize(new, dtype, tile=d // nt)
  qmax = QMAX[jnp.dtype(dtype)]
  y = (new.reshape(*new.shape[:-1], nt, d // nt) / scale[..., None]).reshape(new.shape)
  if jnp.dtype(dtype) == jnp.int8:
    y = jnp.round(y)
  return jnp.clip(y, -qmax, qmax).astype(dtype), None


def scatter_keeping_sharding(cache, index, values):
  """``cache.at[index].set(values, mode="drop")`` keeping the cache's sharding. On a mesh
  with Explicit axes (the `jax.make_mesh` default) JAX cannot infer a scatter's output
  sharding, so it is stated: the cache keeps its own layout and stays in place."""
  sharding = explicit_sharding(cache)
  kwargs = dict(out_sharding=sharding) if sharding is not None else {}
  return cache.at[index].set(values.astype(cache.dtype), mode="drop", **kwargs)


def _as_tokens(new):
  """``[B, Hkv, D]`` (one token) or ``[B, Hkv, T, D]`` -> ``[B, Hkv, T, D]``."""
  return new[:, :, None] if new.ndim == 3 else new


def _shape(x) -> tuple:
  return tuple(np.shape(x))


def _dtype(x):
  """The array's own dtype (a numpy float64 stays float64 in messages), else JAX's."""
  return jnp.dtype(x.dtype) if hasattr(x, "dtype") else jnp.result_type(x)


def _check_write(fn, k, v, k_new, v_new, positions, k_scale, v_scale, block_tables=None):
  """Every shape / dtype check of a cache write, before anything is computed.

  ``k``, ``v`` are the caches (``[B, Hkv, S, D]``, or pools ``[Hkv, P, page_size, D]``
  when ``block_tables`` is given). Raises ValueError naming the argument, with the shapes.
  """
  paged = block_tables is not None
  cache = "k_pages" if paged else "k"
  vcache = "v_pages" if paged else "v"
  layout = "[Hkv, P, page_size, {}]" if paged else "[B, Hkv, S, {}]"
  shapes = (f"{cache}.shape={_shape(k)}, {vcache}.shape={_shape(v)}, k_new.shape={_shape(k_new)}, "
            f"v_new.shape={_shape(v_new)}, positions.shape={_shape(positions)}")
  if paged:
    shapes += f", block_tables.shape={_shape(block_tables)}"
  if k.ndim != 4:
    raise ValueError(f"{fn}: {cache} must be {layout.format('Dk')}; got {shapes}")
  if v.ndim != 4:
    raise ValueError(f"{fn}: {vcache} must be {layout.format('Dv')}; got {shapes}")
  if k.shape[:3] != v.shape[:3]:
    axes = "[Hkv, P, page_size]" if paged else "[B, Hkv, S]"
    raise ValueError(f"{fn}: {cache} and {vcache} must have the same {axes}; got {shapes}")
  for name, cache_arr, scale in ((cache, k, k_scale), (vcache, v, v_scale)):
    dtype = jnp.dtype(cache_arr.dtype)
    scale_name = name[0] + "_scale"
    if is_quantized(dtype):
      if scale is None:
        raise ValueError(f"{fn}: {name} has dtype {dtype}; pass {scale_name}")
      sc_shape = canonical_scale(scale, cache_arr.shape, scale_name, caller=fn).shape
      if paged and sc_shape[1] > 1 and sc_shape[2] == 1:
        raise ValueError(f"{fn}: {scale_name} must be per tensor, per head or per token; got "
                         f"{scale_name}.shape={_shape(scale)} (per page)")
    elif not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"{fn}: {name} must be floating point or int8/float8 with {scale_name}, "
                       f"got {name}.dtype={dtype}")
    elif scale is not None:
      raise ValueError(f"{fn}: {scale_name} given but {name} is not quantized ({name}.dtype={dtype})")
  if paged:
    if len(_shape(block_tables)) != 2 or _shape(block_tables)[1] < 1:
      raise ValueError(f"{fn}: block_tables must be [B, n] with n >= 1; got {shapes}")
    if not jnp.issubdtype(_dtype(block_tables), jnp.integer):
      raise ValueError(f"{fn}: block_tables must be integer, got dtype {_dtype(block_tables)}")
    b, hkv = _shape(block_tables)[0], k.shape[0]
  else:
    b, hkv = k.shape[0], k.shape[1]
  k_shape = _shape(k_new)
  t = k_shape[2] if len(k_shape) == 4 else 1
  for name, new, d in (("k_new", k_new, k.shape[-1]), ("v_new", v_new, v.shape[-1])):
    new_shape = _shape(new)
    want = (b, hkv, t, d) if len(new_shape) == 4 else (b, hkv, d) if t == 1 else None
    if new_shape != want:
      raise ValueError(f"{fn}: {name} must be [B, Hkv, T, D] or [B, Hkv, D] with B={b}, Hkv={hkv}, "
                       f"D={d} (k_new and v_new with the same T); got {shapes}")
    if not jnp.issubdtype(_dtype(new), jnp.floating):
      raise ValueError(f"{fn}: {name} must be floating point, got {name}.dtype={_dtype(new)}")
  if _shape(positions) != (b,):
    raise ValueError(f"{fn}: positions must be [B]=({b},); got {shapes}")
  if not jnp.issubdtype(_dtype(positions), jnp.integer):
    raise ValueError(f"{fn}: positions must be integer, got dtype {_dtype(positions)}")
  check_int32("positions", positions, fn)  # concrete: before the int32 cast, which would wrap


def write_contiguous(k, v, k_new, v_new, positions, *, k_scale=None, v_scale=None):
  """Writes T new tokens per sequence into a contiguous head-major cache.

  Args:
    k, v: ``[B, Hkv, S, Dk]``, ``[B, Hkv, S, Dv]`` caches (float or 8-bit).
    k_new, v_new: ``[B, Hkv, T, D]`` (or ``[B, Hkv, D]`` for T = 1) float new tokens.
    positions: int ``[B]``: slot of each sequence's first new token (its current length).
    k_scale, v_scale: the cache's scales, required for 8-bit caches.

  Returns:
    ``(k, v)``, or ``(k, v, k_scale, v_scale)`` when scales were passed.

  Raises:
    ValueError: for any shape or dtype mismatch (names the argument, shows the shapes),
      a missing scale for an 8-bit cache, or a scale for a float cache.
  """
  positions = as_array("positions", positions, "write_contiguous")
  _check_write("write_contiguous", k, v, k_new, v_new, positions, k_scale, v_scale)
  b, _, s, _ = k.shape
  k_new, v_new = _as_tokens(k_new), _as_tokens(v_new)
  t = k_new.shape[2]
  slots = to_int32(positions)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
  slot, ok = contiguous_slot(slots, capacity=s)
  slots = jnp.where(ok, slot, s)  # s: out of range, the scatter drops it
  bi = jnp.arange(b)[:, None]

  def put(cache, new, scale, name):
    new_t = new.transpose(0, 2, 1, 3)  # [B, T, Hkv, D]: k[bi, :, slots] indexes as [B, T, Hkv, D]
    if not is_quantized(cache.dtype):
      return scatter_keeping_sharding(cache, (bi, slice(None), slots), new_t), scale
    sc = canonical_scale(scale, cache.shape, f"{name}_scale")
    values, token_scale = _quantize_new(new.astype(jnp.float32), sc, cache.dtype, sc.shape[2] > 1)
    cache = scatter_keeping_sharding(cache, (bi, slice(None), slots), values.transpose(0, 2, 1, 3))
    if token_scale is not None:
      full = jnp.broadcast_to(sc, cache.shape[:3] + sc.shape[-1:])
      sc = scatter_keeping_sharding(full, (bi, slice(None), slots), token_scale.transpose(0, 2, 1, 3))
    return cache, (sc if scale is not None and jnp.ndim(scale) else scale)

  k, k_scale_out = put(k, k_new, k_scale, "k")
  v, v_scale_out = put(v, v_new, v_scale, "v")
  if k_scale is None and v_scale is None:
    return k, v
  return k, v, k_scale_out, v_scale_out


def write_paged(k_pages, v_pages, block_tables, positions, k_new, v_new, *, k_scale=None, v_scale=None):
  """Writes T new tokens per sequence into a paged cache.

  Token ``p = positions[b] + t`` goes to page ``block_tables[b, p // page_size]``, slot
  ``p % page_size``. The pages must already be allocated in the table (see
  `fdecode.cache.PageAllocator`); tokens with no valid page are dropped.

  Args:
    k_pages, v_pages: ``[Hkv, P, page_size, D]`` pools (float or 8-bit).
    block_tables: int ``[B, n]``, n >= 1.
    positions: int ``[B]``: position of each sequence's first new token.
    k_new, v_new: ``[B, Hkv, T, D]`` or ``[B, Hkv, D]`` float.
    k_scale, v_scale: the pools' scales (``[Hkv|1, P|1, ps|1, nt]`` or scalar), required
      for 8-bit pools.

  Returns:
    ``(k_pages, v_pages)``, or ``(k_pages, v_pages, k_scale, v_scale)`` when scales were passed.

  Raises:
    ValueError: as `write_contiguous`; also for a table that is not integer ``[B, n]``
      (B is the table's row count) or a per-page scale.
  """
  block_tables = as_array("block_tables", block_tables, "write_paged")
  positions = as_array("positions", positions, "write_paged")
  _check_write("write_paged", k_pages, v_pages, k_new, v_new, positions, k_scale, v_scale,
               block_tables=block_tables)
  _, num_pages, ps, _ = k_pages.shape
  k_new, v_new = _as_tokens(k_new), _as_tokens(v_new)
  t = k_new.shape[2]
  # Small index arrays: replicated, so the page lookup's sharding is unambiguous.
  tables = replicated(to_int32(block_tables))  # saturating: an id past int32 is outside the pool
  pos = replicated(to_int32(positions))[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
  page, slot, ok = paged_slot(pos, lambda j: jnp.take_along_axis(tables, j, axis=1), page_size=ps,
                              table_len=tables.shape[1], num_pages=num_pages)
  page = jnp.where(ok, page, num_pages)  # out of the pool: the scatter drops it

  def put(pool, new, scale, name):
    new_h = new.transpose(1, 0, 2, 3)  # [Hkv, B, T, D]: pool[:, page, slot] indexes as that
    if not is_quantized(pool.dtype):
      return scatter_keeping_sharding(pool, (slice(None), page, slot), new_h), scale
    sc = canonical_scale(scale, pool.shape, f"{name}_scale")  # [Hkv|1, P|1, ps|1, nt]
    per_token = sc.shape[2] > 1
    # Fixed scale [Hkv|1, 1, 1, nt] -> [1, Hkv|1, 1, nt] to broadcast over [B, Hkv, T, nt].
    values, token_scale = _quantize_new(new.astype(jnp.float32), sc.transpose(1, 0, 2, 3),
                                        pool.dtype, per_token)
    pool = scatter_keeping_sharding(pool, (slice(None), page, slot), values.transpose(1, 0, 2, 3))
    if per_token:
      full = jnp.broadcast_to(sc, pool.shape[:3] + sc.shape[-1:])
      sc = scatter_keeping_sharding(full, (slice(None), page, slot), token_scale.transpose(1, 0, 2, 3))
    return pool, (sc if jnp.ndim(scale) else scale)

  k_pages, k_scale_out = put(k_pages, k_new, k_scale, "k")
  v_pages, v_scale_out = put(v_pages, v_new, v_scale, "v")
  if k_scale is None and v_scale is None:
    return k_pages, v_pages
  return k_pages, v_pages, k_scale_out, v_scale_out


def copy_pages(k_pages, v_pages, src, dst, *, k_scale=None, v_scale=None):
  """Copies whole pages (every kv head, every slot) ``src[i] -> dst[i]`` within the pools.

  The device half of copy-on-write: `fdecode.cache.PageAllocator.prepare_write` returns
  the ``(src, dst)`` pairs to copy before a shared page is written. All copies read the
  pools as they were before the call (one gather, one scatter per array), so under
  ``jax.jit(copy_pages, donate_argnums=(0, 1))`` XLA updates the pools in place. Pairs
  whose ``dst`` lies outside ``[0, P)`` (e.g. -1 padding, which keeps the jitted shape
  fixed) are dropped.

  Args:
    k_pages, v_pages: ``[Hkv, P, page_size, Dk]``, ``[Hkv, P, page_size, Dv]`` pools
      (float or 8-bit).
    src, dst: int ``[C]`` page ids (lists accepted); ``dst`` ids should be distinct.
    k_scale, v_scale: the pools' scales ``[Hkv|1, P|1, page_size|1, n_tiles]`` (or
      scalar), required for 8-bit pools. A scale with a page axis > 1 (per token) has its
      page rows copied too; one without (per tensor / per head) is returned unchanged.

  Returns:
    ``(k_pages, v_pages)``, or ``(k_pages, v_pages, k_scale, v_scale)`` when scales were
    passed.

  Raises:
    ValueError: pools not rank 4 or differing in ``[Hkv, P, page_size]``; ``src`` /
      ``dst`` not integer ``[C]`` of the same shape; concrete ids outside ``[0, P)``
      (``dst`` may be negative for padding) or repeated ``dst`` ids; a missing scale for
      an 8-bit pool, a scale for a float pool, or a scale not shaped for its pool.
  """
  fn = "copy_pages"
  src, dst = as_array("src", src, fn), as_array("dst", dst, fn)
  shapes = (f"k_pages.shape={_shape(k_pages)}, v_pages.shape={_shape(v_pages)}, "
            f"src.shape={_shape(src)}, dst.shape={_shape(dst)}")
  if np.ndim(k_pages) != 4 or np.ndim(v_pages) != 4 or _shape(k_pages)[:3] != _shape(v_pages)[:3]:
    raise ValueError(f"{fn}: k_pages and v_pages must be [Hkv, P, page_size, D] with the same "
                     f"[Hkv, P, page_size]; got {shapes}")
  if len(_shape(src)) != 1 or _shape(src) != _shape(dst):
    raise ValueError(f"{fn}: src and dst must be int [C] of the same shape; got {shapes}")
  for name, ids in (("src", src), ("dst", dst)):
    if not jnp.issubdtype(_dtype(ids), jnp.integer):
      raise ValueError(f"{fn}: {name} must be integer, got {name}.dtype={_dtype(ids)}")
  num_pages = k_pages.shape[1]
  _check_copy_ids(fn, src, dst, num_pages)
  scales = {}
  for name, pool, scale in (("k_pages", k_pages, k_scale), ("v_pages", v_pages, v_scale)):
    scale_name = name[0] + "_scale"
    if is_quantized(pool.dtype) and scale is None:
      raise ValueError(f"{fn}: {name} has dtype {jnp.dtype(pool.dtype)}; pass {scale_name}")
    if not is_quantized(pool.dtype) and scale is not None:
      raise ValueError(f"{fn}: {scale_name} given but {name} is not quantized "
                       f"({name}.dtype={jnp.dtype(pool.dtype)})")
    if scale is not None:
      scales[scale_name] = canonical_scale(scale, pool.shape, scale_name, caller=fn)
  dst = to_int32(dst)  # saturating, never wrapping: a negative id stays negative (skipped)
  dst = jnp.where((dst >= 0) & (dst < num_pages), dst, num_pages)  # invalid -> dropped
  src = jnp.clip(to_int32(src), 0, num_pages - 1)

  def copy(arr):
    return scatter_keeping_sharding(arr, (slice(None), dst), arr[:, src])

  k_pages, v_pages = copy(k_pages), copy(v_pages)
  if k_scale is None and v_scale is None:
    return k_pages, v_pages
  out = []
  for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
    sc = scales.get(name)
    out.append(copy(sc) if sc is not None and sc.shape[1] > 1 else scale)
  return (k_pages, v_pages, *out)


def _check_copy_ids(fn, src, dst, num_pages) -> None:
  """Value checks of `copy_pages`' ids when they are concrete (skipped under ``jit``)."""
  src_v, dst_v = host_values(src), host_values(dst)
  if src_v is None or dst_v is None:
    return
  bad = np.nonzero((src_v < 0) | (src_v >= num_pages))[0]
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"{fn}: src ids must lie in [0, P={num_pages}); got src[{i}] = {int(src_v[i])}")
  bad = np.nonzero(dst_v >= num_pages)[0]
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"{fn}: dst ids must lie in [0, P={num_pages}) (negative: skipped); got "
                     f"dst[{i}] = {int(dst_v[i])}")
  valid = np.nonzero(dst_v >= 0)[0]
  ids, counts = np.unique(dst_v[valid], return_counts=True)
  if (counts > 1).any():
    page = int(ids[counts > 1][0])
    where = [int(i) for i in valid[dst_v[valid] == page][:2]]
    raise ValueError(f"{fn}: dst ids must be distinct (two copies into one page); got "
                     f"dst[{where[0]}] = dst[{where[1]}] = {page}")
