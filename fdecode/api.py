"""Public entry points: validate, canonicalize, dispatch (the only place that picks a backend)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fdecode import config as config_lib
from fdecode.combine import merge_states
from fdecode.kernels.pallas import pallas_partials
from fdecode.kernels.xla import xla_partials
from fdecode.reference import query_limits, reference_decode

IMPLS = ("pallas", "xla", "reference")


def flash_decode(q, k, v, lengths, *, block_tables=None, k_scale=None, v_scale=None,
                 softmax_scale=None, num_splits=None, block_k=None, impl=None,
                 interpret=None, return_lse=False):
  """FlashDecode attention of new tokens over a KV cache.

  Legend: B batch, T new tokens per sequence, Hq query heads, Hkv kv heads
  (``Hq % Hkv == 0``: MHA, GQA and MQA), S cache capacity, Dk key head dim,
  Dv value head dim.

  Args:
    q: ``[B, Hq, Dk]`` (one new token per sequence) or ``[B, T, Hq, Dk]`` (the last T
      positions of each sequence, causal among themselves: query t attends to key
      positions ``< lengths - T + t + 1``). Floating dtype.
    k: ``[B, Hkv, S, Dk]`` head-major contiguous key cache, floating dtype.
    v: ``[B, Hkv, S, Dv]`` value cache; Dv may differ from Dk.
    lengths: int ``[B]`` valid tokens per sequence, new ones included, each in ``[0, S]``.
      Concrete values outside that range raise ValueError; under ``jit`` they are
      clipped to ``[0, S]``.
    block_tables, k_scale, v_scale: paged / quantized caches (not implemented yet).
    softmax_scale: scores multiplier, default ``1/sqrt(Dk)``.
    num_splits: chunks of the token axis processed in parallel, each yielding a partial
      state merged by `merge_states`. ``None``: `fdecode.config.default_num_splits`.
      Any positive value gives the same result within float tolerance.
    block_k: tokens per block of the Pallas kernel's inner loop (default 128).
    impl: ``"pallas"``, ``"xla"``, ``"reference"`` or ``None`` (XLA path on CPU,
      Pallas elsewhere).
    interpret: run the Pallas kernel in interpret mode; ``None`` = True on CPU.
    return_lse: also return the log-sum-exp of the scores.

  Returns:
    ``out`` shaped like ``q`` with last dim Dv, dtype ``q.dtype``; with ``return_lse``
    also ``lse``: float32 natural-log ``[B, Hq]`` or ``[B, T, Hq]``. A query that sees
    no key (length 0) gives out 0 and lse -inf.

  Raises:
    ValueError: at trace time, for inconsistent shapes or dtypes (the message names the
      argument and shows the shapes), or concrete lengths out of range.
    NotImplementedError: for ``block_tables``, ``k_scale`` or ``v_scale``.
  """
  for name, value in (("block_tables", block_tables), ("k_scale", k_scale), ("v_scale", v_scale)):
    if value is not None:
      raise NotImplementedError(
          f"flash_decode: {name} (paged / quantized caches) is not implemented yet; "
          "pass a contiguous floating-point cache")
  single_token = _validate(q, k, v, lengths)
  if impl is not None and impl not in IMPLS:
    raise ValueError(f"flash_decode: impl must be one of {IMPLS} or None, got {impl!r}")
  cfg = config_lib.Config(num_splits=num_splits, block_k=block_k)
  _check_concrete_lengths(lengths, k.shape[2])
  backend = jax.default_backend()
  if impl is None:
    impl = "xla" if backend == "cpu" else "pallas"
  if interpret is None:
    interpret = backend == "cpu"
  dk = q.shape[-1]
  scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(dk)
  q4 = q[:, None] if single_token else q
  out, lse = _decode(q4, k, v, jnp.asarray(lengths).astype(jnp.int32), impl=impl,
                     softmax_scale=scale, cfg=cfg, interpret=bool(interpret), backend=backend)
  if single_token:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("impl", "softmax_scale", "cfg", "interpret", "backend"))
def _decode(q, k, v, lengths, *, impl, softmax_scale, cfg, interpret, backend):
  """q ``[B, T, Hq, Dk]`` -> (out ``[B, T, Hq, Dv]`` in q.dtype, lse f32 ``[B, T, Hq]``)."""
  b, t, hq, dk = q.shape
  _, hkv, s, _ = k.shape
  g = hq // hkv
  if impl == "reference":
    out, lse = reference_decode(q, k, v, lengths, softmax_scale=softmax_scale)
    return out.astype(q.dtype), lse
  # Rows of one kv head: r = t * G + g.
  q_rows = q.reshape(b, t, hkv, g, dk).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, dk)
  if impl == "xla":
    splits = cfg.num_splits or config_lib.largest_divisor_at_most(
        s, config_lib.default_num_splits(b, hkv, max(s, 1), config_lib.num_parallel_units(backend)))
    row_limits = jnp.repeat(query_limits(lengths, t, s), g, axis=1)  # [B, R]
    o, lse = xla_partials(q_rows, k, v, row_limits, softmax_scale=softmax_scale, num_splits=splits)
  else:
    block_k = cfg.block_k or config_lib.DEFAULT_BLOCK_K
    num_blocks = max(-(-s // block_k), 1)
    splits = cfg.num_splits or config_lib.default_num_splits(
        b, hkv, num_blocks, config_lib.num_parallel_units(backend))
    o, lse = pallas_partials(q_rows, k, v, lengths, num_tokens=t, softmax_scale=softmax_scale,
                             num_splits=splits, block_k=block_k, interpret=interpret,
                             backend=backend)
  o, lse = merge_states(o, lse, axis=2)  # [B, Hkv, R, Dv], [B, Hkv, R]
  dv = o.shape[-1]
  out = o.reshape(b, hkv, t, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dv)
  lse = lse.reshape(b, hkv, t, g).transpose(0, 2, 1, 3).reshape(b, t, hq)
  return out.astype(q.dtype), lse


def _validate(q, k, v, lengths) -> bool:
  """Trace-time shape/dtype checks. Returns True for the single-token q layout."""
  shapes = f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}"
  if q.ndim not in (3, 4):
    raise ValueError(f"flash_decode: q must be [B, Hq, Dk] or [B, T, Hq, Dk]; got {shapes}")
  if k.ndim != 4:
    raise ValueError(f"flash_decode: k must be [B, Hkv, S, Dk]; got {shapes}")
  if v.ndim != 4:
    raise ValueError(f"flash_decode: v must be [B, Hkv, S, Dv]; got {shapes}")
  b, hq, dk = q.shape[0], q.shape[-2], q.shape[-1]
  kb, hkv, s, kdk = k.shape
  if kb != b or v.shape[0] != b:
    raise ValueError(f"flash_decode: batch of q, k and v must agree; got {shapes}")
  if kdk != dk:
    raise ValueError(f"flash_decode: head dim Dk of q ({dk}) and k ({kdk}) must agree; got {shapes}")
  if v.shape[1] != hkv or v.shape[2] != s:
    raise ValueError(f"flash_decode: k and v must have the same [B, Hkv, S]; got {shapes}")
  if hkv == 0 or hq % hkv != 0:
    raise ValueError(f"flash_decode: Hq ({hq}) must be a multiple of Hkv ({hkv}); got {shapes}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"flash_decode: {name} must be floating point, got {name}.dtype={x.dtype} "
                       "(8-bit caches need k_scale/v_scale, not implemented yet)")
  lengths_shape = tuple(np.shape(lengths))
  if lengths_shape != (b,):
    raise ValueError(f"flash_decode: lengths must be [B]=({b},); got lengths.shape={lengths_shape}")
  if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
    raise ValueError(f"flash_decode: lengths must be integer, got dtype {jnp.result_type(lengths)}")
  return q.ndim == 3


def _check_concrete_lengths(lengths, capacity: int) -> None:
  """Value check when lengths are concrete (not traced)."""
  if isinstance(lengths, jax.core.Tracer):
    return
  vals = np.asarray(lengths)
  bad = np.nonzero((vals < 0) | (vals > capacity))[0]
  if bad.size:
    raise ValueError(f"flash_decode: lengths must lie in [0, S={capacity}]; "
                     f"sequence {int(bad[0])} has length {int(vals[bad[0]])}")
