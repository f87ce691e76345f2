"""Argument checks of `flash_decode`: shapes and dtypes at trace time, values when concrete.

Every error is a ValueError naming the argument and showing the shapes.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from fdecode.quant import canonical_scale, is_quantized


def static_scale(softmax_scale, dk) -> float:
  """softmax_scale is static (a Python / numpy real number): it is baked into the kernel."""
  if softmax_scale is None:
    return 1.0 / math.sqrt(dk)
  if isinstance(softmax_scale, jax.core.Tracer):
    raise ValueError("flash_decode: softmax_scale must be a static real number (it is compiled "
                     "into the kernel), got a traced value; mark it static or fold it into q")
  real = (isinstance(softmax_scale, numbers.Real) or hasattr(softmax_scale, "dtype") and (
      jnp.issubdtype(softmax_scale.dtype, jnp.floating) or jnp.issubdtype(softmax_scale.dtype, jnp.integer)))
  if isinstance(softmax_scale, (bool, np.bool_)) or not real or np.ndim(softmax_scale) != 0:
    raise ValueError(f"flash_decode: softmax_scale must be a real number, got {softmax_scale!r}")
  value = float(softmax_scale)
  if not math.isfinite(value):
    raise ValueError(f"flash_decode: softmax_scale must be finite, got {value}")
  return value


def validate_args(q, k, v, lengths, block_tables) -> bool:
  """Trace-time shape/dtype checks. Returns True for the single-token q layout."""
  shapes = f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
  paged = block_tables is not None
  layout = "[Hkv, P, page_size, {}]" if paged else "[B, Hkv, S, {}]"
  if q.ndim not in (3, 4):
    raise ValueError(f"flash_decode: q must be [B, Hq, Dk] or [B, T, Hq, Dk]; got {shapes}")
  if k.ndim != 4:
    raise ValueError(f"flash_decode: k must be {layout.format('Dk')}; got {shapes}")
  if v.ndim != 4:
    raise ValueError(f"flash_decode: v must be {layout.format('Dv')}; got {shapes}")
  b, hq, dk = q.shape[0], q.shape[-2], q.shape[-1]
  kdk = k.shape[-1]
  if paged:
    bt_shape = tuple(np.shape(block_tables))
    if len(bt_shape) != 2 or bt_shape[0] != b:
      raise ValueError(f"flash_decode: block_tables must be [B, n] with B={b}; got "
                       f"block_tables.shape={bt_shape}, {shapes}")
    if not jnp.issubdtype(jnp.result_type(block_tables), jnp.integer):
      raise ValueError(f"flash_decode: block_tables must be integer, got dtype {jnp.result_type(block_tables)}")
    if v.shape[:3] != k.shape[:3]:
      raise ValueError(f"flash_decode: paged k and v must have the same [Hkv, P, page_size]; got {shapes}")
    hkv = k.shape[0]
  else:
    if k.shape[0] != b or v.shape[0] != b:
      raise ValueError(f"flash_decode: batch of q, k and v must agree; got {shapes}")
    if v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
      raise ValueError(f"flash_decode: k and v must have the same [B, Hkv, S]; got {shapes}")
    hkv = k.shape[1]
  if dk == 0 or v.shape[-1] == 0:
    raise ValueError(f"flash_decode: head dims Dk and Dv must be positive; got {shapes}")
  if kdk != dk:
    raise ValueError(f"flash_decode: head dim Dk of q ({dk}) and k ({kdk}) must agree; got {shapes}")
  if hkv == 0 or hq % hkv != 0:
    raise ValueError(f"flash_decode: Hq ({hq}) must be a multiple of Hkv ({hkv}); got {shapes}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"flash_decode: q must be floating point, got q.dtype={q.dtype}")
  lengths_shape = tuple(np.shape(lengths))
  if lengths_shape != (b,):
    raise ValueError(f"flash_decode: lengths must be [B]=({b},); got lengths.shape={lengths_shape}")
  if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
    raise ValueError(f"flash_decode: lengths must be integer, got dtype {jnp.result_type(lengths)}")
  return q.ndim == 3


def validate_quant(name, cache, scale, offset):
  """Checks the cache dtype against its scale; returns canonical (scale, offset) or Nones."""
  if is_quantized(cache.dtype):
    if scale is None:
      raise ValueError(f"flash_decode: {name} has dtype {cache.dtype}: pass {name}_scale "
                       f"(a scalar, or shaped like {name}.shape={tuple(cache.shape)} with the last axis "
                       "replaced by n_tiles)")
    scale = canonical_scale(scale, cache.shape, f"{name}_scale")
    if offset is not None:
      offset = canonical_scale(offset, cache.shape, f"{name}_offset")
      if offset.shape[-1] != scale.shape[-1]:
        raise ValueError(f"flash_decode: {name}_offset must tile like {name}_scale; got "
                         f"{name}_offset.shape={tuple(offset.shape)}, {name}_scale.shape={tuple(scale.shape)}")
    return scale, offset
  if not jnp.issubdtype(cache.dtype, jnp.floating):
    raise ValueError(f"flash_decode: {name} must be floating point or int8/float8 with {name}_scale, "
                     f"got {name}.dtype={cache.dtype}")
  if scale is not None or offset is not None:
    raise ValueError(f"flash_decode: {name}_scale/{name}_offset given but {name} is not quantized "
                     f"({name}.dtype={cache.dtype})")
  return None, None


def check_concrete_page_ids(block_tables, lengths, num_pages, page_size, *, num_tokens=1,
                             window=None) -> None:
  """When table and lengths are concrete: every page a live token some query may see
  needs is in [0, P). With a window, pages wholly before every query's window are never
  read, so they may be freed (hold anything)."""
  if isinstance(block_tables, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
    return
  tables, lens = np.asarray(block_tables), np.asarray(lengths)
  cols = np.arange(tables.shape[1])[None, :]
  needed = cols < -(-lens[:, None] // page_size)
  if window is not None and isinstance(window, numbers.Integral) and window > 0:
    first = np.maximum(lens - num_tokens + 1 - window, 0)
    needed &= (cols + 1) * page_size > first[:, None]
  bad = needed & ((tables < 0) | (tables >= num_pages))
  if bad.any():
    seq, j = map(int, np.argwhere(bad)[0])
    raise ValueError(f"flash_decode: block_tables[{seq}, {j}] = {int(tables[seq, j])} is out of range "
                     f"[0, P={num_pages}) for a live token of sequence {seq} (length {int(lens[seq])})")


def check_concrete_lengths(lengths, capacity, caller: str = "flash_decode") -> None:
  """Value check when lengths are concrete (not traced); capacity None: no upper bound."""
  if isinstance(lengths, jax.core.Tracer):
    return
  vals = np.asarray(lengths)
  upper = np.inf if capacity is None else capacity
  bad = np.nonzero((vals < 0) | (vals > upper))[0]
  if bad.size:
    raise ValueError(f"{caller}: lengths must lie in [0, S={capacity}]; "
                     f"sequence {int(bad[0])} has length {int(vals[bad[0]])}")
