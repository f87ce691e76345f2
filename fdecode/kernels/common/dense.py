"""A decode in the float32 oracle's dense form (`DenseCall`): every cache form (paged,
token-major, 8-bit, MLA, index lists) materialized to contiguous head-major float32, a
differentiable function of the call's canonical operands (`dense_call`). What the
reference backend (`fdecode.kernels.common.reference`) and the derivative
(`fdecode.derivatives`) read."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from fdecode.cache.paged import gather_pages, gather_scale
from fdecode.cache.quant import dequantize, is_quantized
from fdecode.kernels.common import modifiers
from fdecode.kernels.common import sparse as sparse_lib

__all__ = ["DenseCall", "dense_call"]


class DenseCall(NamedTuple):
  """A decode in the float32 oracle's dense form: every cache form materialized to
  contiguous head-major float32 (what `fdecode.reference.reference_decode` and the
  derivative read).

  ``q`` ``[B, T, Hq, Dk]`` (as given), ``k`` f32 ``[B, Hkv, S, Dk]`` (k_rope's columns
  after k's own), ``v`` f32 ``[B, Hkv, S, Dv]``, ``ends`` int32 ``[B]``; ``mask`` bool /
  ``bias`` float ``[Bm, Tm, Hm, S]`` (the documented broadcasting form) or None; ``alibi``
  f32 ``[Hq]`` or None; ``sinks`` f32 ``[Hq]`` or None."""
  q: object
  k: object
  v: object
  ends: object
  mask: object
  bias: object
  alibi: object
  sinks: object


def _materialize(x, tables, scale=None, offset=None):
  """Float32 contiguous ``[B, Hkv, S, D]`` copy of a cache; 8-bit values are storage
  (no gradient), their scales and offsets are not."""
  if tables is not None:
    page_size = x.shape[2]
    x = gather_pages(x, tables)
    scale = None if scale is None else gather_scale(scale, tables, page_size)
    offset = None if offset is None else gather_scale(offset, tables, page_size)
  if is_quantized(x.dtype):
    x = lax.stop_gradient(x)
  if scale is None:
    return x.astype(jnp.float32)
  return dequantize(x, scale, offset)


def dense_call(q, view, ends, lists, mod_arrays, sinks, *, mods, v_head_dim, sparse) -> DenseCall:
  """`fdecode.dispatch.decode`'s canonical arguments -> the `DenseCall` (a differentiable
  function of them: the page gather, the head-major transpose and the dequantization)."""
  b, _, hq, _ = q.shape
  hm = view.head_major()
  tables = hm.block_tables
  kf = _materialize(hm.k, tables, hm.k_scale, hm.k_offset)
  vf = kf[..., :v_head_dim] if hm.v is None else _materialize(hm.v, tables, hm.v_scale, hm.v_offset)
  if hm.k_rope is not None:  # key-only columns after k's own
    kf = jnp.concatenate([kf, _materialize(hm.k_rope, tables)], axis=-1)
  mask = mod_arrays["mask"]
  if sparse is not None:  # the selected positions as a mask, each pseudo-sequence's cache row
    hkv = view.kv_heads
    src = jnp.arange(b) // sparse.fold
    kf, vf = kf[src], vf[src]
    sel = sparse_lib.dense_mask(lists["indices"], kf.shape[2])  # [B', Hi, S]
    mask = sel[:, :, None, None, :]  # canonical [B', Hi, 1, 1, S] ...
    if sel.shape[1] > 1:  # ... per kv head: the same list for its G query heads
      mask = jnp.broadcast_to(mask, (b, hkv, 1, hq // hkv, sel.shape[2]))
  user = lambda x: None if x is None else modifiers.user_form(x)
  alibi = mod_arrays["alibi"]
  return DenseCall(q, kf, vf, ends, user(mask), user(mod_arrays["bias"]),
                   None if alibi is None else alibi.reshape(-1), sinks)
