"""`mla_decode`: the direct entry point of the Hopper MLA kernel. `fdecode.flash_decode`'s
default dispatch takes its bf16 path on sm_90 (measured on an H200); its 8-bit path
(int8 / float8_e4m3fn latents with per-token scales) is built, interpreted and lowered but
not yet measured on a GPU, so it is opt-in: through `mla_decode` or
``flash_decode(..., impl="mosaic_gpu")`` (the default dispatch keeps the Triton kernel for
8-bit MLA)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fdecode.cache.quant import per_token_scale
from fdecode.kernels.mosaic_gpu import ops
from fdecode.kernels.mosaic_gpu.mla.kernel import mla_states
from fdecode.kernels.mosaic_gpu.mla.plan import DK, DV, MlaPlan, mla_plan, unsupported
from fdecode.validation import as_array, check_concrete_lengths, static_scale, to_int32

_CALLER = "mla_decode"


def mla_decode(q, k, lengths, *, k_scale=None, softmax_scale=None, num_splits=None, return_lse=False,
               interpret=None):
  """DeepSeek MLA decode over one latent kv head on Hopper (TMA + wgmma, Mosaic GPU).

  The same result as ``flash_decode(q, k, None, lengths, v_head_dim=512, k_scale=k_scale)``
  (within bfloat16 tolerance): the values are the first 512 columns of each cache row,
  read once for both. Legend: B batch, G query heads, S cache capacity.

  Args:
    q: bf16 ``[B, G, 576]`` or ``[B, 1, G, 576]``: one new token per sequence (T > 1 is
      refused, `fdecode.kernels.mosaic_gpu.unsupported` says why); G a multiple of 16.
    k: ``[B, 1, S, 576]`` contiguous latent cache (512 latent + 64 RoPE columns): bf16,
      or 8-bit int8 / float8_e4m3fn with ``k_scale`` (opt-in: unmeasured on a GPU).
    lengths: int ``[B]`` valid tokens per sequence, new ones included, in ``[0, S]``
      (concrete values outside raise ValueError; traced ones are clipped).
    k_scale: 8-bit caches only: float32 per-token scales ``[B, 1, S, 1]`` (or broadcastable:
      ``[1, 1, 1, 1]`` or a scalar per tensor); the real latent row, keys and values
      alike, is ``k * k_scale`` (`fdecode.cache.quant`; the scale flash_decode
      takes with ``v=None``). None for bf16. FlashMLA's 1x128 tiles are not taken.
    softmax_scale: static float, default ``1 / sqrt(576)``.
    num_splits: None (fill the GPU's SMs, `fdecode.kernels.mosaic_gpu.plan.split_count`)
      or a positive int.
    return_lse: also return the natural-log LSE, float32 ``[B, (1,) G]``.
    interpret: None / False: compiled for the GPU; a Mosaic GPU ``InterpretGPUParams``:
      the kernel on CPU under jax's Mosaic GPU interpreter.

  Returns:
    out ``[B, (1,) G, 512]`` in q.dtype (and lse): a row with no visible key gives 0
    (lse -inf). A NaN key, value or scale, a NaN or +inf score, or an inf value that a
    sequence sees makes every column of its rows' out and their lse NaN
    (docs/semantics.md "Corruption a query sees propagates"); slots at or past its
    length never reach the output, whatever they hold.

  Raises:
    ValueError: shapes or dtypes the kernel does not take (`unsupported` names why), a
      k_scale of another shape, or concrete lengths outside ``[0, S]``.
  """
  q, k, lengths = (as_array(n, x, _CALLER) for n, x in (("q", q), ("k", k), ("lengths", lengths)))
  if k_scale is not None:
    k_scale = as_array("k_scale", k_scale, _CALLER)
  reason = unsupported(q_shape=q.shape, q_dtype=q.dtype, k_shape=k.shape, k_dtype=k.dtype,
                       v_is_none=True, v_head_dim=DV, k_scale_shape=None if k_scale is None else k_scale.shape)
  if reason:
    raise ValueError(f"{_CALLER}: {reason}")
  single = q.ndim == 3
  q4 = q[:, None] if single else q
  b, t, g, _ = q4.shape
  if k.shape[0] != b or np.shape(lengths) != (b,):
    raise ValueError(f"{_CALLER}: need k [B, 1, S, {DK}] and lengths [B] with B={b} (q.shape={q.shape}); "
                     f"got k.shape={k.shape}, lengths.shape={np.shape(lengths)}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{_CALLER}: lengths must be integer, got dtype {lengths.dtype}")
  s = k.shape[2]
  check_concrete_lengths(lengths, s, _CALLER)
  if k_scale is not None:
    k_scale = per_token_scale(k_scale, k.shape, "k_scale", _CALLER)
  scale = static_scale(softmax_scale, DK, _CALLER)
  plan = mla_plan(batch=b, num_tokens=t, group=g, seq_len=s, softmax_scale=scale, cache_dtype=k.dtype,
                  num_splits=num_splits)
  out, lse = mla_run(plan, q4, to_int32(lengths), k, k_scale, interpret=interpret)
  return ops.outputs(out, lse, single=single, return_lse=return_lse)


def mla_run(plan: MlaPlan, q, ends, k, k_scale=None, *, interpret=None):
  """Run ``plan``: the Hopper MLA kernel, its split states merged by the Triton combine
  kernel (read in the Hopper kernel's layout, interpreted where the kernel is): two
  launches, nothing around them. `mla_decode` and the sm_90 dispatch both run this.

  Args:
    plan: `mla_plan` for these shapes.
    q: bf16 ``[B, T, G, 576]``.
    ends: int32 ``[B]`` lengths, in ``[0, S]``.
    k, k_scale: the latent cache and its per-token scales (`mla_decode`'s, scales
      already ``[B, 1, S, 1]``), or None for bf16.
    interpret: as `mla_decode`'s.

  Returns:
    ``(out [B, T, G, 512] in q.dtype, lse float32 [B, T, G])``.
  """
  b, t, g, _ = q.shape
  o, lse = mla_states(q.reshape(b, 1, t * g, DK), ends, k, k_scale, plan=plan, interpret=interpret)
  return ops.combine(o, lse, batch=b, num_tokens=t, group=g, hq=g, out_dtype=q.dtype, interpret=interpret)
