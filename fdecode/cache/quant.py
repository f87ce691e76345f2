"""8-bit KV caches: the scale layout, `quantize`, and the one `dequantize` every path uses.

Byte layout. A quantized cache stores ``values`` in int8, float8_e4m3fn or float8_e5m2 with
exactly the shape of the float cache (``[B, Hkv, S, D]`` contiguous or
``[Hkv, P, page_size, D]`` paged), one byte per element, row-major. Beside it lives a
float32 ``scale`` (and optionally an ``offset``, for asymmetric int8) with **one rule for
every granularity**: either a scalar (per tensor), or an array shaped like the cache with
its last axis replaced by ``n_tiles``, where ``n_tiles`` divides the head dim D. Tile ``i``
of a row covers elements ``[i*D/n_tiles, (i+1)*D/n_tiles)``:

  * ``n_tiles = 1``: one scale per token per head (``[B, Hkv, S, 1]``);
  * ``n_tiles = D / 128``: FlashMLA's 1x128 tiles;
  * leading axes of size 1 broadcast, e.g. ``[1, Hkv, 1, 1]`` per head.

The real value is ``(values + offset) * scale`` (Ascend's antiquant; offset 0 if absent).

MLA's FP8 cache (FlashMLA's layout; DeepSeek V3: Dc = 512 latent dims, Dr = 64 RoPE dims)
is three arrays laid out like one latent kv head, ``[B, 1, S, .]`` or paged
``[1, P, page_size, .]``, passed as ``flash_decode(q, k, None, lengths, v_head_dim=512,
k_scale=..., k_rope=...)``. Per token, 656 bytes:

  =========  ==============  =====  =====================================================
  bytes      array           dtype  holds
  =========  ==============  =====  =====================================================
  0..511     ``k[..., :]``   e4m3   the 512 latent values, also the values' 512 columns
  512..527   ``k_scale``     f32    4 scales, one per 1x128 tile of the latent (``[..., 4]``)
  528..655   ``k_rope``      bf16   the 64 RoPE dims, key-only, never quantized
  =========  ==============  =====  =====================================================

FlashMLA packs the three into one 656-byte row of a single buffer; here they are three
arrays (each row-major with the same leading axes) read per block, so the kernels never
dequantize the cache in memory and the RoPE part keeps its precision.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fdecode.validation import F32_MAX, describe

QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.float8_e5m2): 57344.0}


def is_quantized(dtype) -> bool:
  return jnp.dtype(dtype) in QUANT_DTYPES


def canonical_scale(scale, cache_shape, name: str, caller: str = "flash_decode"):
  """Validates a scale/offset against its cache and returns it as float32 of rank 4.

  A scalar becomes ``[1, 1, 1, 1]``; an array must have the cache's rank, each leading
  axis equal to the cache's or 1, and a last axis ``n_tiles`` dividing the head dim.
  ``caller`` starts the ValueError's message.
  """
  scale = jnp.asarray(scale, jnp.float32)
  d = cache_shape[-1]
  if scale.ndim == 0:
    return scale.reshape(1, 1, 1, 1)
  ok = scale.ndim == len(cache_shape) and all(s in (1, c) for s, c in zip(scale.shape[:-1], cache_shape[:-1]))
  if not ok or scale.shape[-1] < 1 or d % scale.shape[-1]:
    raise ValueError(
        f"{caller}: {name} must be a scalar or shaped like the cache with its last axis replaced by "
        f"n_tiles dividing the head dim (leading axes may be 1); got {name}.shape={tuple(scale.shape)} "
        f"for cache shape {tuple(cache_shape)}")
  return scale


def per_token_scale(scale, cache_shape, name: str, caller: str, *, broadcast: bool = True):
  """A scale `canonical_scale` takes, with one tile per row (per token, per head or per
  tensor: last axis 1), broadcast to float32 ``[*cache_shape[:3], 1]`` (one scale per
  token of each head; ``broadcast=False``: rank 4, leading axes of size 1 left for the
  caller to broadcast); ValueError for tiles (a last axis > 1)."""
  scale = canonical_scale(scale, cache_shape, name, caller)
  if scale.shape[-1] != 1:
    raise ValueError(f"{caller}: {name} must have one scale per token (last axis 1), got "
                     f"{name}.shape={tuple(scale.shape)}")
  return jnp.broadcast_to(scale, (*cache_shape[:3], 1)) if broadcast else scale


def dequantize(values, scale, offset=None, dtype=jnp.float32):
  """``(values + offset) * scale`` with tile-wise scales.

  Args:
    values: ``[..., D]`` int8 / fp8 (or float) cache rows.
    scale: float32 broadcastable to ``[..., n_tiles]``.
    offset: like ``scale`` or None.
  Returns:
    ``[..., D]`` in ``dtype``.
  """
  d = values.shape[-1]
  nt = scale.shape[-1]
  if nt == 1:  # one tile: plain broadcasting (no rank-raising reshape inside kernels)
    x = values.astype(jnp.float32)
    if offset is not None:
      x = x + offset
    return (x * scale).astype(dtype)
  x = values.astype(jnp.float32).reshape(*values.shape[:-1], nt, d // nt)
  if offset is not None:
    x = x + offset[..., None]
  x = x * scale[..., None]
  return x.reshape(values.shape).astype(dtype)


def quantize(x, dtype, *, tile=None, per_tensor=False):
  """Quantizes a float cache (or new cache rows) symmetrically.

  Args:
    x: ``[..., D]`` float array.
    dtype: int8, float8_e4m3fn or float8_e5m2.
    tile: elements per scale along the head dim (must divide D); ``None`` = one scale per
      row (per token per head). ``tile=128`` gives FlashMLA's 1x128 tiles.
    per_tensor: one scalar scale for the whole array (overrides ``tile``).

  Returns:
    ``(values, scale)``: values in ``dtype`` shaped like x; scale float32, a scalar if
    ``per_tensor`` else ``[..., D // tile]``. ``dequantize(values, scale)`` ~= x.
  """
  dtype = jnp.dtype(dtype)
  if dtype not in QUANT_DTYPES:
    raise ValueError(f"quantize: dtype must be one of {[str(d) for d in QUANT_DTYPES]}, got {dtype}")
  x = jnp.asarray(x, jnp.float32)
  d = x.shape[-1]
  qmax = QMAX[dtype]
  if per_tensor:
    amax = jnp.max(jnp.abs(x))
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    y = x / scale
  else:
    tile = d if tile is None else tile
    if d % tile:
      raise ValueError(f"quantize: tile={tile} must divide the head dim D={d} (x.shape={x.shape})")
    xt = x.reshape(*x.shape[:-1], d // tile, tile)
    amax = jnp.max(jnp.abs(xt), axis=-1)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    y = (xt / scale[..., None]).reshape(x.shape)
  if dtype == jnp.int8:
    y = jnp.round(y)
  return jnp.clip(y, -qmax, qmax).astype(dtype), scale


# The checks of a cache against its format (the entry points call them).

def _real_data(name, x, caller):
  """A scale / offset (data, used as float32): a real dtype (not bool or complex), and, when
  given as host data (Python / numpy), finite values within float32's range: 1e39 would
  become inf. Non-finite values are kept (corrupt data propagates, it is not rejected)."""
  dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else None
  if dtype is None or dtype.kind not in "iuf":
    raise TypeError(f"{caller}: {name} must be a real number or a float / int array (used as "
                    f"float32); got {describe(x)}")
  if isinstance(x, (np.ndarray, np.generic)):
    vals = np.asarray(x, np.float64)
    big = np.isfinite(vals) & (np.abs(vals) > F32_MAX)
    if big.any():
      raise ValueError(f"{caller}: {name} must be within float32's range (|x| <= {F32_MAX:.8g}; it is "
                       f"used as float32); got {name} = {vals[big].flat[0]!r}"
                       + (f" at index {tuple(int(i) for i in np.argwhere(big)[0])}" if vals.ndim else ""))
  return x


def validate_quant(name, cache, scale, offset, caller: str = "flash_decode", *, cache_name=None):
  """Checks the cache dtype against its scale; returns canonical (scale, offset) or Nones.

  ``name`` is the cache's argument name (``k``, ``prefix_k``...): its scale and offset are
  ``{name}_scale`` / ``{name}_offset``. ``cache_name`` (default ``name``) names the cache
  itself in messages."""
  cache_name = name if cache_name is None else cache_name
  scale_name, offset_name = f"{name}_scale", f"{name}_offset"
  if is_quantized(cache.dtype):
    if scale is None:
      raise ValueError(f"{caller}: {cache_name} has dtype {cache.dtype}: pass {scale_name} "
                       f"(a scalar, or shaped like {cache_name}.shape={tuple(cache.shape)} with the last axis "
                       "replaced by n_tiles)")
    scale = canonical_scale(_real_data(scale_name, scale, caller), cache.shape, scale_name, caller)
    if offset is not None:
      offset = canonical_scale(_real_data(offset_name, offset, caller), cache.shape, offset_name, caller)
      if offset.shape[-1] != scale.shape[-1]:
        raise ValueError(f"{caller}: {offset_name} must tile like {scale_name}; got "
                         f"{offset_name}.shape={tuple(offset.shape)}, {scale_name}.shape={tuple(scale.shape)}")
    return scale, offset
  if not jnp.issubdtype(cache.dtype, jnp.floating) or jnp.dtype(cache.dtype).itemsize < 2:
    raise ValueError(f"{caller}: {cache_name} must be floating point or int8/float8 with {scale_name} (a "
                     f"float of 16 bits or more, or int8 / float8_e4m3fn / float8_e5m2), got "
                     f"{cache_name}.dtype={cache.dtype}")
  if scale is not None or offset is not None:
    raise ValueError(f"{caller}: {scale_name}/{offset_name} given but {cache_name} is not quantized "
                     f"({cache_name}.dtype={cache.dtype})")
  return None, None


def check_cache_dtype(name, dtype, caller: str, *, quantized_ok: bool = True):
  """A cache dtype: floating of 16 bits or more, or (``quantized_ok``) int8 / float8_e4m3fn /
  float8_e5m2. Returns the ``jnp.dtype``."""
  allowed = "a floating dtype of 16 bits or more" + (", int8, float8_e4m3fn or float8_e5m2" if quantized_ok else
                                                    " (this array is never quantized)")
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    raise ValueError(f"{caller}: {name} must be {allowed}; got {describe(dtype)}") from None
  if (quantized_ok and is_quantized(dt)) or (jnp.issubdtype(dt, jnp.floating) and dt.itemsize >= 2):
    return dt
  raise ValueError(f"{caller}: {name} must be {allowed}; got {name}={dt}")
