"""Jit-compatible writes of new tokens into a KV cache.

Both functions are pure (they return the updated arrays) and use a single scatter, so
under ``jax.jit(..., donate_argnums=...)`` XLA updates the donated cache in place: no copy
of the whole cache per step. Tokens whose slot falls outside the cache (a position past
S, or a page id outside the pool) are dropped, never written elsewhere.

Quantized caches: pass the cache's scale. A scale with a token axis (per token or per
tile: ``[..., S or page_size, n_tiles]``) gets each new token's own scale, written beside
it; a scale without one (per tensor / per head) is fixed and new tokens are quantized
with it (values clipped to the dtype's range).
"""

from __future__ import annotations

import jax.numpy as jnp

from fdecode.meshes import explicit_sharding, replicated
from fdecode.quant import _QMAX, canonical_scale, is_quantized, quantize


def _quantize_new(new, scale, dtype, per_token):
  """new f32 ``[B, Hkv, T, D]`` -> (values, new tokens' scales ``[B, Hkv, T, nt]`` or None).

  ``per_token``: each new token gets its own scale; else ``scale`` (broadcastable to
  ``[B, Hkv, 1, nt]``) is fixed."""
  d = new.shape[-1]
  nt = scale.shape[-1]
  if per_token:
    return quantize(new, dtype, tile=d // nt)
  qmax = _QMAX[jnp.dtype(dtype)]
  y = (new.reshape(*new.shape[:-1], nt, d // nt) / scale[..., None]).reshape(new.shape)
  if jnp.dtype(dtype) == jnp.int8:
    y = jnp.round(y)
  return jnp.clip(y, -qmax, qmax).astype(dtype), None


def _scatter(cache, index, values):
  """``cache.at[index].set(values, mode="drop")`` keeping the cache's sharding. On a mesh
  with Explicit axes (the `jax.make_mesh` default) JAX cannot infer a scatter's output
  sharding, so it is stated: the cache keeps its own layout and stays in place."""
  sharding = explicit_sharding(cache)
  kwargs = dict(out_sharding=sharding) if sharding is not None else {}
  return cache.at[index].set(values.astype(cache.dtype), mode="drop", **kwargs)


def _as_tokens(new):
  """``[B, Hkv, D]`` (one token) or ``[B, Hkv, T, D]`` -> ``[B, Hkv, T, D]``."""
  return new[:, :, None] if new.ndim == 3 else new


def write_contiguous(k, v, k_new, v_new, positions, *, k_scale=None, v_scale=None):
  """Writes T new tokens per sequence into a contiguous head-major cache.

  Args:
    k, v: ``[B, Hkv, S, Dk]``, ``[B, Hkv, S, Dv]`` caches (float or 8-bit).
    k_new, v_new: ``[B, Hkv, T, D]`` (or ``[B, Hkv, D]`` for T = 1) float new tokens.
    positions: int ``[B]``: slot of each sequence's first new token (its current length).
    k_scale, v_scale: the cache's scales, required for 8-bit caches.

  Returns:
    ``(k, v)``, or ``(k, v, k_scale, v_scale)`` when scales were passed.
  """
  b, _, s, _ = k.shape
  k_new, v_new = _as_tokens(k_new), _as_tokens(v_new)
  t = k_new.shape[2]
  slots = jnp.asarray(positions, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
  slots = jnp.where((slots >= 0) & (slots < s), slots, s)  # s: out of range -> dropped
  bi = jnp.arange(b)[:, None]

  def put(cache, new, scale, name):
    new_t = new.transpose(0, 2, 1, 3)  # [B, T, Hkv, D]: k[bi, :, slots] indexes as [B, T, Hkv, D]
    if not is_quantized(cache.dtype):
      return _scatter(cache, (bi, slice(None), slots), new_t), scale
    if scale is None:
      raise ValueError(f"write_contiguous: {name} has dtype {cache.dtype}; pass {name}_scale")
    sc = canonical_scale(scale, cache.shape, f"{name}_scale")
    values, token_scale = _quantize_new(new.astype(jnp.float32), sc, cache.dtype, sc.shape[2] > 1)
    cache = _scatter(cache, (bi, slice(None), slots), values.transpose(0, 2, 1, 3))
    if token_scale is not None:
      full = jnp.broadcast_to(sc, cache.shape[:3] + sc.shape[-1:])
      sc = _scatter(full, (bi, slice(None), slots), token_scale.transpose(0, 2, 1, 3))
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
    block_tables: int ``[B, n]``.
    positions: int ``[B]``: position of each sequence's first new token.
    k_new, v_new: ``[B, Hkv, T, D]`` or ``[B, Hkv, D]``.
    k_scale, v_scale: the pools' scales (``[Hkv|1, P|1, ps|1, nt]`` or scalar), required
      for 8-bit pools.

  Returns:
    ``(k_pages, v_pages)``, or ``(k_pages, v_pages, k_scale, v_scale)`` when scales were passed.
  """
  _, num_pages, ps, _ = k_pages.shape
  k_new, v_new = _as_tokens(k_new), _as_tokens(v_new)
  t = k_new.shape[2]
  # Small index arrays: replicated, so the page lookup's sharding is unambiguous.
  tables = replicated(jnp.asarray(block_tables, jnp.int32))
  pos = replicated(jnp.asarray(positions, jnp.int32))[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
  j = pos // ps
  in_table = (pos >= 0) & (j < tables.shape[1])
  page = jnp.take_along_axis(tables, jnp.clip(j, 0, tables.shape[1] - 1), axis=1)
  page = jnp.where(in_table & (page >= 0) & (page < num_pages), page, num_pages)  # invalid -> dropped
  slot = pos % ps

  def put(pool, new, scale, name):
    new_h = new.transpose(1, 0, 2, 3)  # [Hkv, B, T, D]: pool[:, page, slot] indexes as that
    if not is_quantized(pool.dtype):
      return _scatter(pool, (slice(None), page, slot), new_h), scale
    if scale is None:
      raise ValueError(f"write_paged: {name}_pages has dtype {pool.dtype}; pass {name}_scale")
    sc = canonical_scale(scale, pool.shape, f"{name}_scale")  # [Hkv|1, P|1, ps|1, nt]
    per_token = sc.shape[2] > 1
    if sc.shape[1] > 1 and not per_token:
      raise ValueError(f"write_paged: {name}_scale must be per tensor, per head or per token; got "
                       f"{name}_scale.shape={tuple(sc.shape)} (per page)")
    # Fixed scale [Hkv|1, 1, 1, nt] -> [1, Hkv|1, 1, nt] to broadcast over [B, Hkv, T, nt].
    values, token_scale = _quantize_new(new.astype(jnp.float32), sc.transpose(1, 0, 2, 3),
                                        pool.dtype, per_token)
    pool = _scatter(pool, (slice(None), page, slot), values.transpose(1, 0, 2, 3))
    if per_token:
      full = jnp.broadcast_to(sc, pool.shape[:3] + sc.shape[-1:])
      sc = _scatter(full, (slice(None), page, slot), token_scale.transpose(1, 0, 2, 3))
    return pool, (sc if jnp.ndim(scale) else scale)

  k_pages, k_scale_out = put(k_pages, k_new, k_scale, "k")
  v_pages, v_scale_out = put(v_pages, v_new, v_scale, "v")
  if k_scale is None and v_scale is None:
    return k_pages, v_pages
  return k_pages, v_pages, k_scale_out, v_scale_out
