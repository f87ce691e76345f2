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
from fdecode.ragged.write import write_new_tokens
from helpers.ragged import batch
from helpers.ragged_write import CASES, bits, write_step


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
