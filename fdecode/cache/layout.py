"""KV cache layouts: head-major ``"HND"`` (fdecode's own) and token-major ``"NHD"`` (Flax,
vLLM, JAX's ragged paged attention).

================  ======================  =========================
layout            contiguous              paged pool
================  ======================  =========================
``"HND"``         ``[B, Hkv, S, D]``      ``[Hkv, P, page_size, D]``
``"NHD"``         ``[B, S, Hkv, D]``      ``[P, page_size, Hkv, D]``
================  ======================  =========================

Scales, offsets and ``k_rope`` follow their cache's layout (scales with the last axis
replaced by ``n_tiles``; leading axes of size 1 broadcast).

How each path reads a token-major cache:

* Triton: in place, its block specs take a kv head's rows at the cache's own strides.
* XLA: in place, chunk by chunk: each chunk's rows are sliced (or its pages gathered),
  then only those rows transposed (`fdecode.kernels.xla.dense`).
* Mosaic: in place through its paged kernel (a contiguous cache viewed as a pool of
  whole pages; `fdecode.kernels.mosaic_tpu.token_major.token_major_read`): one kv
  head's ``[page_size, D]`` rows per DMA for float32; bfloat16 with an even Hkv and
  8-bit with Hkv a multiple of 4 as 32-bit words of 2 / 4 heads (a one-head window
  would split a packed sublane, which libtpu rejects), one program per word; every
  other 16- / 8-bit cache up to 128 kv heads (one head: MQA, MLA latents; odd counts;
  fp8 with ``k_rope``) as windows of the whole head axis, one program for all heads.
  Its sparse kernel DMAs each listed token's heads (the 1 / 2 / 4 of a 32-bit sublane,
  or the whole axis). More than 128 heads that do not fill words (or a whole-axis plan
  past its VMEM budget: many heads of large pages), and a contiguous S with no
  power-of-two factor of 8 or more (dense calls), read a head-major copy; float16
  caches take the XLA path (Mosaic has no float16 vectors).
* The float32 reference reads the head-major copy.

`head_major` is the one conversion, a transpose inside the same jit-compiled program
(dropped when no lowered branch uses it). With one kv head (MQA, MLA latents) it is a
free reshape, so every path reads such a cache as head-major, in place, whatever its
dtype or kind. Cache *writes* (`fdecode.ragged`) go to the
caller's layout in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fdecode.validation import describe

KV_LAYOUTS = ("HND", "NHD")


def check_layout(kv_layout, caller: str) -> str:
  if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
    raise ValueError(f"{caller}: kv_layout must be one of {KV_LAYOUTS}, got {describe(kv_layout)}")
  return kv_layout


def head_major(x, kv_layout: str, paged: bool):
  """A cache-shaped array (cache, rank-4 scale / offset, k_rope) in ``kv_layout`` -> the
  head-major layout; scalars and None pass through."""
  if x is None or kv_layout == "HND" or np.ndim(x) != 4:
    return x
  perm = (2, 0, 1, 3) if paged else (0, 2, 1, 3)
  shape = tuple(x.shape[i] for i in perm)
  if isinstance(x, jax.ShapeDtypeStruct):  # a shape-only view (for checks)
    return jax.ShapeDtypeStruct(shape, x.dtype)
  if x.shape[2] == 1:  # one kv head: the same bytes in the same order
    return jnp.reshape(x, shape)
  return jnp.asarray(x).transpose(perm)


def read_layout(kv_layout: str, kv_heads: int) -> str:
  """How the XLA and Triton paths read a cache stored in ``kv_layout``: as stored, except
  that one kv head (MQA, MLA latents) is read head-major, its head-major view being a free
  reshape (no tiled layouts on CPU / GPU: the same bytes in the same order)."""
  return "NHD" if kv_layout == "NHD" and kv_heads > 1 else "HND"


def token_axis(kv_layout: str) -> int:
  """The axis of a rank-4 cache that holds its tokens: S (contiguous) or page_size (a
  pool, whose page axis is the one before it)."""
  return 1 if kv_layout == "NHD" else 2


def capacity(k_shape, kv_layout: str, block_tables=None) -> int:
  """S: tokens per sequence of a cache of shape ``k_shape`` (with ``block_tables``
  ``[B, n]``: ``n * page_size``)."""
  tokens = k_shape[token_axis(kv_layout)]
  return tokens if block_tables is None else block_tables.shape[1] * tokens


def kv_head_axis(kv_layout: str, paged: bool) -> int:
  """The kv-head axis of a rank-4 cache-shaped array in ``kv_layout``."""
  if kv_layout == "NHD":
    return 2
  return 0 if paged else 1


def kv_heads(k_shape, kv_layout: str, paged: bool) -> int:
  """Hkv of a cache of shape ``k_shape`` (rank 4) in ``kv_layout``."""
  return k_shape[kv_head_axis(kv_layout, paged)]


def shape_names(kv_layout: str, paged: bool, d: str = "D") -> str:
  """The cache's documented shape, for messages."""
  if kv_layout == "NHD":
    return f"[P, page_size, Hkv, {d}]" if paged else f"[B, S, Hkv, {d}]"
  return f"[Hkv, P, page_size, {d}]" if paged else f"[B, Hkv, S, {d}]"
