"""The ragged step's geometry derived inside the Triton kernels
(`fdecode.kernels.triton.geometry`: each program's sequence, rows, kv length and its part's
schedule, and each written row's position, from the step's raw ``cu_q_lens``, ``kv_lens``
and ``num_seqs``) against XLA's (`fdecode.ragged.row_positions` and the block geometry of
`fdecode.ragged.decode`), on traced, unchecked geometry: offsets decreasing, negative and
past N, kv lengths past S or below the new tokens, ``num_seqs`` past M. The interpreted
Triton step and the XLA step must agree on every output row (values, -inf / 0 for rows no
live sequence owns) and write the same cache slots bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.ragged import row_positions
from helpers.step_geometry import HKV, HQ, N, S, step


@pytest.mark.parametrize("paged,layout,hq,hkv", [(True, "HND", 4, 2), (True, "NHD", 4, 2), (False, "HND", 4, 2),
                                                 (True, "NHD", 6, 2), (False, "NHD", 5, 1)],
                         ids=["paged-HND", "paged-NHD", "contiguous-HND", "paged-NHD-g3", "contiguous-NHD-g5"])
@pytest.mark.parametrize("seed", range(2))
def test_kernels_derive_the_geometry_xla_computes(seed, paged, layout, hq, hkv):
  """(G = 3 and 5 too: the combine's row tiles and padding entries are powers of two, G not.)
  Each geometry draws its own garbage offsets (the seed is per geometry)."""
  _compare(seed + 10 * (hq + 7 * hkv) + 100 * paged + (layout == "NHD"), paged, layout, hq, hkv)


@pytest.mark.parametrize("paged,layout", [(True, "HND"), (False, "NHD")], ids=["paged-HND", "contiguous-NHD"])
@pytest.mark.parametrize("seed", range(3))
def test_kernels_read_per_row_modifiers_at_the_derived_rows(seed, paged, layout):
  """A per-row, per-head mask and a per-row bias (`ragged_decode`'s ``[N, Hq, S]`` /
  ``[N, S]``), read by each Triton program at its rows' packed rows (derived from the same
  garbage offsets); XLA's step gathers them per part."""
  rng = np.random.default_rng(100 + seed)
  mods = dict(mask=jnp.asarray(rng.random((N, HQ, S)) > 0.25),
              bias=jnp.asarray(rng.standard_normal((N, S)), jnp.float32))
  _compare(seed, paged, layout, HQ, HKV, mods)


def _compare(seed, paged, layout, hq, hkv, mods=None):
  p, (nk, nv) = step(seed, paged, layout, hq, hkv)
  run = lambda impl, **kw: jax.jit(lambda p, nk, nv, mods: fdecode.ragged_decode(
      **p, kv_layout=layout, new_k=nk, new_v=nv, return_lse=True, impl=impl, **mods, **kw))(p, nk, nv, mods or {})
  want = run("xla")
  got = run("pallas", interpret=True)
  out_x, lse_x, *caches_x = want
  out_t, lse_t, *caches_t = got
  np.testing.assert_allclose(np.asarray(out_t), np.asarray(out_x), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(lse_t), np.asarray(lse_x), atol=2e-5, rtol=2e-5)
  for x, t in zip(caches_x, caches_t):
    np.testing.assert_array_equal(np.asarray(t), np.asarray(x))
  # The draw is not vacuous: some rows are owned (and attend), some are not.
  cu, *_, pos = row_positions(jnp.asarray(p["kv_lens"]), jnp.asarray(p["cu_q_lens"]), jnp.asarray(p["num_seqs"]),
                              N, S)
  owned = np.asarray(pos) >= 0
  if owned.any():
    assert np.isfinite(np.asarray(lse_x)[owned]).any() or (np.asarray(p["kv_lens"]) <= 0).any()
  assert (np.asarray(lse_x)[~owned] == -np.inf).all() and (np.asarray(out_x)[~owned] == 0).all()
