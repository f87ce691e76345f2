"""Cache geometries of the ragged step's fused write (`fdecode.ragged.write`): a step per named
case and a bit view for bit-for-bit comparisons."""

import jax.numpy as jnp
import numpy as np

from fdecode.cache.layout import CacheView


M, HKV, N = 4, 3, 13


CASES = {  # layout, paged, page size, cache dtype, new rows' dtype, head dim, MLA (no v)
    "hnd-paged16-bf16": ("HND", True, 16, jnp.bfloat16, jnp.float32, 16, False),
    "nhd-paged1-int8": ("NHD", True, 1, jnp.int8, jnp.int8, 16, False),
    "hnd-contiguous-fp8-mla24": ("HND", False, 0, jnp.float8_e4m3fn, jnp.float8_e4m3fn, 24, True),
    "nhd-contiguous-f32": ("NHD", False, 0, jnp.float32, jnp.bfloat16, 8, False),
    # Mixed dtypes with an 8-bit side: converted to the cache's dtype, as the scatter casts.
    "hnd-paged4-bf16-from-fp8": ("HND", True, 4, jnp.bfloat16, jnp.float8_e4m3fn, 16, False),
    "nhd-contiguous-int8-from-f32": ("NHD", False, 0, jnp.int8, jnp.float32, 16, False),
}


def write_step(name, seed=0):
  layout, paged, ps, dtype, new_dtype, d, mla = CASES[name]
  rng = np.random.default_rng(seed)
  s = 12
  if paged:
    n = -(-s // ps)
    pages = M * n + 2
    shape = (HKV, pages, ps, d) if layout == "HND" else (pages, ps, HKV, d)
    # Each sequence's own pages; one entry outside the pool on each side.
    tables = rng.permutation(pages)[:M * n].reshape(M, n).astype(np.int32)
    tables[1, -1], tables[2, 0] = -1, pages
  else:
    shape = (M, HKV, s, d) if layout == "HND" else (M, s, HKV, d)
    tables = None
  cache = lambda: jnp.asarray(rng.normal(size=shape) * 4).astype(dtype)
  k, v = cache(), None if mla else cache()
  new = lambda: jnp.asarray(rng.normal(size=(N, HKV, d)) * 4).astype(new_dtype)
  nk, nv = new(), None if mla else new()
  # Distinct (sequence, position) per row; -1: padding rows; s, s + 3: past a contiguous
  # cache, and sequence M outside it; (1, s - 1) and (2, 0): the table entries outside the
  # pool when paged.
  edge = [1 * s + s - 1, 2 * s]
  slots = rng.permutation(np.setdiff1d(np.arange(M * s), edge))[:N - 5]
  seq = np.concatenate([slots // s, [0 if paged else M, 1, 2, 1, 2]]).astype(np.int32)
  pos = np.concatenate([slots % s, [-1 if paged else 0, -1 if paged else s, -1 if paged else s + 3, s - 1, 0]])
  pos = pos.astype(np.int32)
  view = CacheView(k, v, block_tables=None if tables is None else jnp.asarray(tables), layout=layout, paged=paged)
  return view, nk, nv, jnp.asarray(seq), jnp.asarray(pos)


def bits(x):
  return np.asarray(x).view(np.uint8 if x.dtype.itemsize == 1 else np.uint16 if x.dtype.itemsize == 2 else np.uint32)
