"""The ragged step's fused cache write (`fdecode.ragged.write`): the Triton write kernel
(interpreted here; compiled in the compile tier, run on a GPU by test_gpu_compiled.py)
writes bit for bit what XLA's scatter writes, in every cache geometry: both layouts,
contiguous and paged (page size 1 too), float values cast to a bfloat16 cache, 8-bit
values moved as bytes (and converted first where only one side is 8-bit), MLA latents (no v, a head dim that is not a power of two), and the
rows that must write nothing: padding (pos -1), a position past a contiguous cache, a
table entry outside the pool."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.cache.layout import CacheView
from fdecode.ragged.write import write_new_tokens
from test_ragged import batch

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


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_writes_what_the_scatter_writes(name):
  view, nk, nv, seq, pos = write_step(name)
  want = jax.jit(lambda: write_new_tokens(view, nk, nv, seq, pos, impl="xla"))()
  got = jax.jit(lambda: write_new_tokens(view, nk, nv, seq, pos, impl="pallas", interpret=True))()
  for before, w, g in zip((view.k, view.v), want, got):
    if before is None:
      assert w is None and g is None
      continue
    assert g.shape == before.shape and g.dtype == before.dtype
    np.testing.assert_array_equal(bits(g), bits(w))
    # The scatter wrote something (the comparison is not of two untouched caches).
    assert (bits(w) != bits(before)).any()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("paged", [True, False])
def test_ragged_step_writes_the_same_caches_on_the_kernel_path(layout, paged):
  """`ragged_decode`'s fused write with the Triton kernels (impl="pallas", interpreted) and
  on the XLA path: the same caches, bit for bit, and the same attention within rounding."""
  p = batch(21, [1, 7, 20, 0], [30, 7, 21, 4], max_seqs=6, paged=paged, layout=layout)
  n, d = p["q"].shape[0], p["q"].shape[2]
  rng = np.random.default_rng(3)
  new_k, new_v = (jnp.asarray(rng.standard_normal((n, 2, d)), jnp.float32) for _ in range(2))
  run = lambda impl: fdecode.ragged_decode(**p, kv_layout=layout, new_k=new_k, new_v=new_v, impl=impl,
                                           return_lse=True)
  out, lse, k, v = run("pallas")
  out_x, lse_x, k_x, v_x = run("xla")
  np.testing.assert_array_equal(np.asarray(k), np.asarray(k_x))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(v_x))
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_x), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_x), atol=2e-5, rtol=2e-5)
