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


def validate_args(q, k, v, lengths, block_tables, *, v_head_dim=None, k_rope=None) -> tuple[bool, int]:
  """Trace-time shape/dtype checks. Returns (True for the single-token q layout, Dv).

  ``v`` may be None (MLA): the values are then ``k[..., :v_head_dim]``, read from the
  key cache itself. ``k_rope`` (optional) holds extra key-only columns appended after
  k's own, so q's head dim is ``k.shape[-1] + k_rope.shape[-1]``.
  """
  v_shape = None if v is None else tuple(v.shape)
  shapes = f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={v_shape}"
  if k_rope is not None:
    shapes += f", k_rope.shape={tuple(np.shape(k_rope))}"
  paged = block_tables is not None
  layout = "[Hkv, P, page_size, {}]" if paged else "[B, Hkv, S, {}]"
  if q.ndim not in (3, 4):
    raise ValueError(f"flash_decode: q must be [B, Hq, Dk] or [B, T, Hq, Dk]; got {shapes}")
  if k.ndim != 4:
    raise ValueError(f"flash_decode: k must be {layout.format('Dk')}; got {shapes}")
  if v is not None and v.ndim != 4:
    raise ValueError(f"flash_decode: v must be {layout.format('Dv')}; got {shapes}")
  dv = _value_head_dim(k, v, v_head_dim, shapes)
  b, hq, dk = q.shape[0], q.shape[-2], q.shape[-1]
  kdk = k.shape[-1]
  if paged:
    bt_shape = tuple(np.shape(block_tables))
    if len(bt_shape) != 2 or bt_shape[0] != b:
      raise ValueError(f"flash_decode: block_tables must be [B, n] with B={b}; got "
                       f"block_tables.shape={bt_shape}, {shapes}")
    if not jnp.issubdtype(jnp.result_type(block_tables), jnp.integer):
      raise ValueError(f"flash_decode: block_tables must be integer, got dtype {jnp.result_type(block_tables)}")
    if v is not None and v.shape[:3] != k.shape[:3]:
      raise ValueError(f"flash_decode: paged k and v must have the same [Hkv, P, page_size]; got {shapes}")
    hkv = k.shape[0]
  else:
    if k.shape[0] != b or (v is not None and v.shape[0] != b):
      raise ValueError(f"flash_decode: batch of q, k and v must agree; got {shapes}")
    if v is not None and (v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]):
      raise ValueError(f"flash_decode: k and v must have the same [B, Hkv, S]; got {shapes}")
    hkv = k.shape[1]
  if k_rope is not None:
    rope_shape = tuple(np.shape(k_rope))
    if len(rope_shape) != 4 or rope_shape[:3] != tuple(k.shape[:3]) or rope_shape[3] < 1:
      lead = "[Hkv, P, page_size]" if paged else "[B, Hkv, S]"
      raise ValueError(f"flash_decode: k_rope must be {layout.format('Dr')} with the same {lead} as k "
                       f"(extra key-only columns); got {shapes}")
    if not jnp.issubdtype(jnp.result_type(k_rope), jnp.floating):
      raise ValueError(f"flash_decode: k_rope must be floating point, got k_rope.dtype={jnp.result_type(k_rope)}")
    kdk += rope_shape[3]
  if dk == 0 or dv == 0:
    raise ValueError(f"flash_decode: head dims Dk and Dv must be positive; got {shapes}")
  if kdk != dk:
    what = "k + k_rope" if k_rope is not None else "k"
    raise ValueError(f"flash_decode: head dim Dk of q ({dk}) and {what} ({kdk}) must agree; got {shapes}")
  if hkv == 0 or hq % hkv != 0:
    raise ValueError(f"flash_decode: Hq ({hq}) must be a multiple of Hkv ({hkv}); got {shapes}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"flash_decode: q must be floating point, got q.dtype={q.dtype}")
  lengths_shape = tuple(np.shape(lengths))
  if lengths_shape != (b,):
    raise ValueError(f"flash_decode: lengths must be [B]=({b},); got lengths.shape={lengths_shape}")
  if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
    raise ValueError(f"flash_decode: lengths must be integer, got dtype {jnp.result_type(lengths)}")
  return q.ndim == 3, dv


def _value_head_dim(k, v, v_head_dim, shapes) -> int:
  """Dv: v's head dim, or with ``v=None`` the static ``v_head_dim`` (k's first columns)."""
  if v_head_dim is not None:
    if (isinstance(v_head_dim, (bool, np.bool_)) or not isinstance(v_head_dim, numbers.Integral)
        or not 1 <= v_head_dim <= k.shape[-1]):
      raise ValueError(f"flash_decode: v_head_dim must be a static int in [1, k.shape[-1]={k.shape[-1]}] "
                       f"(the values are k's first v_head_dim columns); got v_head_dim={v_head_dim!r}, {shapes}")
    if v is not None and v.shape[-1] != v_head_dim:
      raise ValueError(f"flash_decode: v_head_dim={v_head_dim} disagrees with v's head dim; pass v=None to "
                       f"read the values from k (MLA), or drop v_head_dim; got {shapes}")
    return int(v_head_dim)
  if v is None:
    raise ValueError(f"flash_decode: v=None reads the values from the key cache (MLA): pass v_head_dim, "
                     f"the number of k's leading columns that are the values (e.g. 512 of 576); got {shapes}")
  return v.shape[-1]


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
