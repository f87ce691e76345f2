"""Argument checks of `flash_decode`: shapes and dtypes at trace time, values when concrete.

Every error is a ValueError (a TypeError for an argument of the wrong kind) naming the
argument, showing the received value or shape (never a whole array), and saying what is
allowed. Values are checked in the domain they are used in: static floats as float32
(with every float32 quantity the kernels derive from them), integers as int32.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, 2**-126
F32_MAX = float(np.finfo(np.float32).max)
# Largest soft cap: the kernels compute s * (1 / cap), and 1 / cap >= 2**-100 keeps that
# product normal for every |s| >= 2**-26, below float32's resolution of exp(s) near 1.
SOFT_CAP_MAX = 2.0 ** 100

# Largest tuning knobs: int32, and a block_k rounded up to a power of two must stay in int32.
TUNING_KNOB_MAX = {"num_splits": 2 ** 31 - 1, "block_k": 2 ** 30, "split_size": 2 ** 30}
# A traced softmax_scale has a way around the kernel: scale q instead.
_TRACED_ALTERNATIVE = {"softmax_scale": "; or fold a traced scale into q: flash_decode(q * scale, ..., "
                                        "softmax_scale=1.0)"}


def describe(x) -> str:
  """A received value for an error message: a scalar's repr (cut at 60 characters), or an
  array's / list's type, shape and dtype (never its contents)."""
  if isinstance(x, (list, tuple)):
    try:
      arr = np.asarray(x)
      if arr.dtype != object:
        return f"a {type(x).__name__} of shape {arr.shape} ({arr.dtype})"
    except (ValueError, TypeError):
      pass
    return f"a {type(x).__name__} of length {len(x)}"
  if hasattr(x, "shape") and hasattr(x, "dtype") and np.ndim(x) > 0:
    return f"{type(x).__name__} of shape {tuple(x.shape)} ({x.dtype})"
  if isinstance(x, jax.core.Tracer):
    return f"a traced {x.dtype} scalar"
  text = repr(x)
  return text if len(text) <= 60 else text[:57] + "..."


def short_repr(x) -> str:
  """``repr(x)`` cut at 60 characters (an array: `describe`), for keys such as sequence ids."""
  if hasattr(x, "shape") and hasattr(x, "dtype") and np.ndim(x) > 0:
    return describe(x)
  text = repr(x)
  return text if len(text) <= 60 else text[:57] + "..."


def as_array(name, x, caller: str = "flash_decode"):
  """An array argument as given (jax / numpy array or scalar, tracer, ShapeDtypeStruct,
  None), or a Python number, list or tuple converted with numpy. Raises TypeError naming
  ``name`` for a ragged list, a list of non-numbers, or any other object."""
  if x is None or (hasattr(x, "shape") and hasattr(x, "dtype")):
    return x
  if isinstance(x, (list, tuple, numbers.Number)):
    try:
      arr = np.asarray(x)
    except (ValueError, TypeError):
      arr = None
    if arr is None or arr.dtype.kind not in "biuf":
      raise TypeError(f"{caller}: {name} must be an array or a (nested) list of numbers of one "
                      f"rectangular shape; got {describe(x)}")
    return arr
  raise TypeError(f"{caller}: {name} must be an array (jax or numpy) or a list of numbers; got "
                  f"{type(x).__name__}")


def as_arrays(caller: str = "flash_decode", **named):
  """`as_array` over keyword arguments; returns their values in order."""
  return tuple(as_array(name, x, caller) for name, x in named.items())


def traced_static(name, x, caller: str | None = "flash_decode") -> ValueError:
  """The error for a static option given traced (an argument of a ``jax.jit``-ed function,
  say): it names the option and the two ways to pass it as a Python value."""
  prefix = f"{caller}: " if caller else ""
  return ValueError(f"{prefix}{name} is compiled into the kernel, so it must be a static Python value, not "
                    f"traced; got {describe(x)}. Mark it static, jax.jit(f, static_argnames=({name!r},)), or "
                    f"close over it, jax.jit(functools.partial(f, {name}=...)){_TRACED_ALTERNATIVE.get(name, '')}")


def static_scalar(name, x, caller: str | None = "flash_decode"):
  """A static option's value as the Python value it holds: a concrete zero-dimensional
  numpy or jax bool / int / float (``np.int32(8)``, ``jnp.float32(0.2)``) becomes a Python
  bool / int / float; anything else comes back as given, for the option's own check. A
  traced value raises `traced_static`."""
  if isinstance(x, jax.core.Tracer):
    raise traced_static(name, x, caller)
  if hasattr(x, "dtype") and not isinstance(x, jax.ShapeDtypeStruct) and np.ndim(x) == 0 and any(
      jnp.issubdtype(x.dtype, kind) for kind in (jnp.bool_, jnp.integer, jnp.floating)):
    return x.item()
  return x


def _static_real(name, x, caller) -> float:
  """A static real number (Python / numpy / concrete jax scalar, not bool), as a Python float."""
  x = static_scalar(name, x, caller)
  if isinstance(x, bool) or not isinstance(x, numbers.Real):
    raise ValueError(f"{caller}: {name} must be a real number (a static Python, numpy or jax scalar), "
                     f"got {describe(x)}")
  return float(x)


def static_float(name, x, *, low: float, high: float, caller: str = "flash_decode",
                 zero_ok: bool = False, signed: bool = False, hint: str = "") -> float:
  """A static float used as float32: its float32 value must be finite with magnitude in
  ``[low, high]`` (``zero_ok``: or 0; ``signed``: negative values too). Returns the float."""
  value = _static_real(name, x, caller)
  f32 = float(np.float32(value)) if abs(value) <= F32_MAX else math.inf
  magnitude = abs(f32) if signed else f32
  if not (math.isfinite(f32) and (low <= magnitude <= high or (zero_ok and f32 == 0))):
    if signed:
      allowed = f"finite and 0 or of magnitude in [{low:.8g}, {high:.8g}]" if zero_ok else (
          f"finite and of magnitude in [{low:.8g}, {high:.8g}]")
    else:
      allowed = f"positive, finite and in [{low:.8g}, {high:.8g}]"
    raise ValueError(f"{caller}: {name} must be {allowed} as a float32 (it is used as float32{hint}); "
                     f"got {name}={value!r}")
  return value


def static_int(name, x, *, low: int = 1, high: int = INT32_MAX, caller: str = "flash_decode",
               what: str = "", integral_floats: bool = False) -> int:
  """A static Python / numpy / concrete jax int (not bool; with ``integral_floats`` also a
  float such as 4.0) in ``[low, high]`` (int32 by default)."""
  x = static_scalar(name, x, caller)
  if isinstance(x, bool) or not isinstance(x, numbers.Real):
    raise ValueError(f"{caller}: {name} must be a static int{what} (a Python, numpy or jax integer), "
                     f"got {describe(x)}")
  if not isinstance(x, numbers.Integral) and not (integral_floats and float(x).is_integer()):
    raise ValueError(f"{caller}: {name} must be an integer{what}, got {name}={x!r}")
  if not low <= int(x) <= high:
    allowed = f"a positive int, at most {high}" if low == 1 else f"an int in [{low}, {high}]"
    notes = "; ".join(n for n in ("int32" if high == INT32_MAX else "", what.strip(" ()")) if n)
    raise ValueError(f"{caller}: {name} must be {allowed}{f' ({notes})' if notes else ''}; got {name}={int(x)}")
  return int(x)


def static_scale(softmax_scale, dk, caller: str = "flash_decode") -> float:
  """softmax_scale is static (a Python / numpy / concrete jax real number): it is baked into
  the kernel, which multiplies float32 scores by it: 0, or a normal float32 of either sign.
  None: ``1 / sqrt(dk)``."""
  if softmax_scale is None:
    return 1.0 / math.sqrt(dk)
  return static_float("softmax_scale", softmax_scale, low=F32_TINY, high=F32_MAX, zero_ok=True,
                      signed=True, caller=caller)


def static_soft_cap(cap, caller: str = "flash_decode"):
  """logits_soft_cap (None or a static float): the kernels compute ``cap * tanh(s * (1 / cap))``
  in float32, so cap and 1 / cap must be normal float32: cap in [2**-126, 2**100]."""
  if cap is None:
    return None
  return static_float("logits_soft_cap", cap, low=F32_TINY, high=SOFT_CAP_MAX, caller=caller,
                      hint=", and so is 1 / logits_soft_cap")


def static_window(window, caller: str = "flash_decode"):
  """window (None or a static int): compared with int32 positions, so in [1, 2**31 - 1]."""
  if window is None:
    return None
  return static_int("window", window, caller=caller, what=" (the sliding window, in tokens)",
                    integral_floats=True)


def static_bool(name, x, caller: str = "flash_decode") -> bool:
  """A static Python / numpy / concrete jax bool (``causal``)."""
  x = static_scalar(name, x, caller)
  if not isinstance(x, bool):
    raise ValueError(f"{caller}: {name} must be a bool, got {describe(x)}")
  return x


def tuning_knob(name, value, caller: str | None = None):
  """``num_splits`` / ``block_k`` (`fdecode.config.Config`): None or a positive static int, at
  most `TUNING_KNOB_MAX` (int32; a block_k is rounded up to a power of two)."""
  value = static_scalar(name, value, caller)
  if value is None:
    return None
  prefix = f"{caller}: " if caller else ""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    allowed = "a positive int, None or 'balance'" if name == "num_splits" else "a positive int or None"
    raise ValueError(f"{prefix}{name} must be {allowed}, got {describe(value)}")
  if not 1 <= value <= TUNING_KNOB_MAX[name]:
    why = "int32; a block is rounded up to a power of two" if name == "block_k" else "int32"
    raise ValueError(f"{prefix}{name} must be a positive int or None, at most {TUNING_KNOB_MAX[name]} "
                     f"({why}), got {name}={int(value)}")
  return int(value)


def static_num_splits(x, caller) -> int | str:
  """num_splits: ``"balance"``, or a tuning knob (`tuning_knob`)."""
  return x if isinstance(x, str) and x == "balance" else tuning_knob("num_splits", x, caller)


def static_v_head_dim(x, caller) -> int:
  """v_head_dim's shape-free check (its range, ``[1, k.shape[-1]]``, is `validate_args`')."""
  x = static_scalar("v_head_dim", x, caller)
  if isinstance(x, bool) or not isinstance(x, numbers.Integral):
    raise ValueError(f"{caller}: v_head_dim must be a static int (Dv: the values are k's first v_head_dim "
                     f"columns); got v_head_dim={describe(x)}")
  return int(x)


def check_int32(name, x, caller: str = "flash_decode", *, low: int = INT32_MIN, high: int = INT32_MAX) -> None:
  """Concrete integer values (not traced) must lie in ``[low, high]`` (int32 by default)
  before they are converted to int32, where wider values would wrap."""
  if x is None or isinstance(x, jax.core.Tracer) or isinstance(x, jax.ShapeDtypeStruct):
    return
  if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
    return
  dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
  if dtype.kind in "iu" and np.iinfo(dtype).min >= low and np.iinfo(dtype).max <= high:
    return  # every value of the dtype fits: no read of the values (no device sync)
  vals = np.asarray(x)
  if vals.dtype.kind not in "iu" or vals.size == 0:
    return
  bad = (vals < low) | (vals > high)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0]) if vals.ndim else ()
    at = f"{name}[{', '.join(map(str, where))}]" if where else name
    raise ValueError(f"{caller}: {name} must lie in [{low}, {high}] (int32); got {at} = {int(vals[where])}")


def to_int32(x):
  """``x`` as int32 without wrapping: integers wider than int32 (traced int64 under
  ``jax_enable_x64``) are clipped into the int32 range first."""
  if isinstance(x, (np.ndarray, np.generic, numbers.Integral)):  # before JAX converts (and wraps) it
    x = np.asarray(x)
    if x.dtype.kind in "iu":
      x = np.clip(x, INT32_MIN if x.dtype.kind == "i" else 0, INT32_MAX)
    return jnp.asarray(x.astype(np.int32) if x.dtype.kind in "iub" else x).astype(jnp.int32)
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.unsignedinteger) and jnp.iinfo(x.dtype).bits >= 32:
    x = jnp.minimum(x, INT32_MAX)
  elif jnp.issubdtype(x.dtype, jnp.signedinteger) and jnp.iinfo(x.dtype).bits > 32:
    x = jnp.clip(x, INT32_MIN, INT32_MAX)
  return x.astype(jnp.int32)


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
  _check_query_dtype(q.dtype)
  lengths_shape = tuple(np.shape(lengths))
  if lengths_shape != (b,):
    raise ValueError(f"flash_decode: lengths must be [B]=({b},); got lengths.shape={lengths_shape}")
  if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
    raise ValueError(f"flash_decode: lengths must be integer, got dtype {jnp.result_type(lengths)}")
  return q.ndim == 3, dv


def _check_query_dtype(dtype) -> None:
  """q's dtype: a float of 16 bits or more (float16, bfloat16, float32, float64), which the
  kernels compute in; a narrower float (8-bit, 4-bit) or any other kind raises ValueError
  (fdecode takes 8-bit floats as caches only)."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 2:
    return
  hint = ("; cast it, e.g. q.astype(jnp.bfloat16) (8-bit floats are taken as caches only: k / v with "
          "k_scale / v_scale)") if jnp.issubdtype(dtype, jnp.floating) else ""
  raise ValueError(f"flash_decode: q must be a floating dtype of 16 bits or more (float16, bfloat16, float32 "
                   f"or float64); got q.dtype={dtype}{hint}")


def _value_head_dim(k, v, v_head_dim, shapes) -> int:
  """Dv: v's head dim, or with ``v=None`` the static ``v_head_dim`` (k's first columns)."""
  if v_head_dim is not None:
    if (isinstance(v_head_dim, (bool, np.bool_)) or not isinstance(v_head_dim, numbers.Integral)
        or not 1 <= v_head_dim <= k.shape[-1]):
      raise ValueError(f"flash_decode: v_head_dim must be a static int in [1, k.shape[-1]={k.shape[-1]}] "
                       f"(the values are k's first v_head_dim columns); got v_head_dim={describe(v_head_dim)}, {shapes}")
    if v is not None and v.shape[-1] != v_head_dim:
      raise ValueError(f"flash_decode: v_head_dim={v_head_dim} disagrees with v's head dim; pass v=None to "
                       f"read the values from k (MLA), or drop v_head_dim; got {shapes}")
    return int(v_head_dim)
  if v is None:
    raise ValueError(f"flash_decode: v=None reads the values from the key cache (MLA): pass v_head_dim, "
                     f"the number of k's leading columns that are the values (e.g. 512 of 576); got {shapes}")
  return v.shape[-1]


def check_concrete_lengths(lengths, capacity, caller: str = "flash_decode", name: str = "lengths") -> None:
  """Value check when lengths are concrete (not traced): in ``[0, capacity]``; capacity
  None: no upper bound but int32's."""
  if isinstance(lengths, jax.core.Tracer):
    return
  vals = np.asarray(lengths)
  upper = INT32_MAX if capacity is None else capacity
  bad = np.nonzero((vals < 0) | (vals > upper))[0]
  if bad.size:
    allowed = f"[0, S={capacity}]" if capacity is not None else f"[0, {INT32_MAX}] (int32)"
    raise ValueError(f"{caller}: {name} must lie in {allowed}; sequence {int(bad[0])} has length "
                     f"{int(vals[bad[0]])}")


def check_kv_offset(kv_offset, lengths, batch: int, caller: str = "flash_decode") -> None:
  """kv_offset: an int scalar or int ``[B]``; concrete values in int32, and so must be each
  sequence's end relative to the cache, ``lengths - kv_offset``."""
  shape = tuple(np.shape(kv_offset))
  if shape not in ((), (batch,)):
    raise ValueError(f"{caller}: kv_offset must be a scalar or [B]=({batch},); got kv_offset.shape={shape}")
  if not jnp.issubdtype(jnp.result_type(kv_offset), jnp.integer):
    raise ValueError(f"{caller}: kv_offset must be integer, got dtype {jnp.result_type(kv_offset)}")
  check_int32("kv_offset", kv_offset, caller)
  if isinstance(kv_offset, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
    return
  ends = np.asarray(lengths).astype(np.int64) - np.asarray(kv_offset).astype(np.int64)
  bad = np.nonzero((ends < INT32_MIN) | (ends > INT32_MAX))[0]
  if bad.size:
    i = int(bad[0])
    raise ValueError(f"{caller}: lengths - kv_offset must lie in [{INT32_MIN}, {INT32_MAX}] (int32, the "
                     f"sequence's end relative to the cache); sequence {i} has {int(ends[i])}")


def check_rope_theta(theta, caller: str) -> float:
  """RoPE base: frequencies ``theta ** (-2i / D)`` in float32 stay in ``(0, 1]`` for
  ``theta >= 1``, so angles of int32 positions stay finite."""
  return static_float("rope_theta", theta, low=1.0, high=F32_MAX, caller=caller)


def check_norm_eps(eps, caller: str) -> float:
  """RMSNorm epsilon: positive (0 divides a zero row by 0), a normal float32."""
  return static_float("norm_eps", eps, low=F32_TINY, high=F32_MAX, caller=caller)


def check_cache_sizes(caller: str, batch, max_len, page_size) -> None:
  """init_cache sizes: positive ints whose positions and page ids fit in int32."""
  for name, value in (("batch", batch), ("max_len", max_len), ("page_size", page_size)):
    if value is not None or name != "page_size":
      static_int(name, value, caller=caller)
  pages = 1 if page_size is None else -(-max_len // page_size)
  capacity = max_len if page_size is None else pages * page_size
  if capacity > INT32_MAX or batch * pages > INT32_MAX:
    raise ValueError(f"{caller}: the cache's capacity ({capacity} tokens) and page count ({batch * pages}) "
                     f"must fit in int32 (at most {INT32_MAX}); got batch={batch}, max_len={max_len}, "
                     f"page_size={page_size}")
