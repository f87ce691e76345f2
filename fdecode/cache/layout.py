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

`CacheView` is the layout resolved once: `fdecode.flash_decode` builds it from its
arguments and hands it, unchanged, to the dispatch and from there to each path's plan and
kernel. `head_major` is the one conversion (`CacheView.head_major`), a transpose inside
the same jit-compiled program, built at most once (dropped when no lowered branch uses
it). With one kv head (MQA, MLA latents) it is a free reshape, so every path reads such a
cache as head-major, in place, whatever its dtype or kind. Cache *writes*
(`fdecode.ragged`) go to the caller's layout in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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


# The arrays of a `CacheView`, its pytree children in this order.
_ARRAYS = ("k", "v", "k_rope", "k_scale", "v_scale", "k_offset", "v_offset", "block_tables")
QUANT_ARRAYS = ("k_scale", "v_scale", "k_offset", "v_offset")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class CacheView:
  """One KV cache, its layout resolved: what every path reads, built once by the API.

  A JAX pytree: the arrays are its children (arrays, tracers or `jax.ShapeDtypeStruct`
  s), ``layout`` and ``paged`` its static data.

  Attributes:
    k: the key cache as stored, ``layout``: ``"HND"`` ``[B, Hkv, S, Dk]`` / paged
      ``[Hkv, P, page_size, Dk]``, ``"NHD"`` ``[B, S, Hkv, Dk]`` / ``[P, page_size, Hkv, Dk]``.
    v: the value cache as stored (``Dv``), or None (MLA: ``k[..., :v_head_dim]``).
    k_rope: key-only columns ``Dr`` as stored, or None.
    k_scale, v_scale, k_offset, v_offset: 8-bit dequantization, head-major whatever the
      layout (the kernels read them so); canonical float32 rank 4 once `flash_decode` has
      validated them (`fdecode.cache.quant.validate_quant`), or None.
    block_tables: int ``[B, n]`` (paged), else None.
    layout: ``"HND"`` or ``"NHD"``.
    paged: a pool read through ``block_tables``.
  """
  k: Any
  v: Any = None
  k_rope: Any = None
  k_scale: Any = None
  v_scale: Any = None
  k_offset: Any = None
  v_offset: Any = None
  block_tables: Any = None
  layout: str = "HND"
  paged: bool = False

  @classmethod
  def of(cls, k, v, *, block_tables=None, k_rope=None, k_scale=None, v_scale=None, k_offset=None,
         v_offset=None, kv_layout="HND", caller: str = "flash_decode") -> CacheView:
    """The view of caches given in ``kv_layout`` (checked, with the caches' rank); scales
    and offsets are taken to the head-major layout here, their one conversion."""
    check_layout(kv_layout, caller)
    paged = block_tables is not None
    if kv_layout != "HND":
      for name, x in (("k", k), ("v", v), ("k_rope", k_rope)):
        if x is not None and np.ndim(x) != 4:
          raise ValueError(f"{caller}: with kv_layout={kv_layout!r}, {name} must be "
                           f"{shape_names(kv_layout, paged)}; got {name}.shape={tuple(np.shape(x))}")
    quant = (head_major(x, kv_layout, paged) for x in (k_scale, v_scale, k_offset, v_offset))
    return cls(k, v, k_rope, *quant, block_tables, kv_layout, paged)

  def tree_flatten(self):
    return tuple(getattr(self, n) for n in _ARRAYS), (self.layout, self.paged)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)

  def with_arrays(self, **arrays) -> CacheView:
    """The same cache with some arrays replaced by their canonical form (same layout)."""
    return dataclasses.replace(self, **arrays)

  @property
  def token_axis(self) -> int:
    """The axis of k that holds its tokens: S, or a pool's page_size."""
    return token_axis(self.layout)

  @property
  def kv_heads(self) -> int:
    """Hkv."""
    return self.k.shape[kv_head_axis(self.layout, self.paged)]

  @property
  def page_size(self) -> int | None:
    return self.k.shape[self.token_axis] if self.paged else None

  @property
  def num_pages(self) -> int | None:
    """P, the pool's pages (paged), else None."""
    return self.k.shape[self.token_axis - 1] if self.paged else None

  @property
  def capacity(self) -> int:
    """S: tokens per sequence (paged: ``n * page_size``)."""
    return capacity(self.k.shape, self.layout, self.block_tables)

  @property
  def read_layout(self) -> str:
    """How the XLA and Triton paths read this cache (`read_layout`)."""
    return read_layout(self.layout, self.kv_heads)

  def head_major_shapes(self):
    """(k, v, k_rope) head-major, as `jax.ShapeDtypeStruct` s (None stays None): for
    checks, without building an array."""
    shape_of = lambda x: None if x is None else jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
    return tuple(head_major(shape_of(x), self.layout, self.paged) for x in (self.k, self.v, self.k_rope))

  def head_major(self) -> CacheView:
    """The head-major view: this view if stored so, else its k, v and k_rope transposed
    (`head_major`), built once per view (a branch of `fdecode.route.lower` gets a view of
    its own operands, and builds its own)."""
    if self.layout == "HND":
      return self
    view = self.__dict__.get("head_major_view")
    if view is None:
      k, v, rope = (head_major(x, self.layout, self.paged) for x in (self.k, self.v, self.k_rope))
      view = dataclasses.replace(self, k=k, v=v, k_rope=rope, layout="HND")
      object.__setattr__(self, "head_major_view", view)
    return view

  def read(self, layout: str) -> CacheView:
    """The view a path reads in ``layout``: this one (token-major caches read in place) or
    the head-major view."""
    return self if layout == self.layout else self.head_major()

  def kernel_arrays(self) -> dict:
    """The keyword arrays the kernels take beside k and v: block_tables, k_rope, scales, offsets."""
    return {n: getattr(self, n) for n in _ARRAYS[2:]}
