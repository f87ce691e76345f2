"""The Hopper kernels' split merge on a JAX without Pallas' Triton backend
(`fdecode.kernels.mosaic_gpu.ops.merge_split_major`, XLA) against the Triton combine kernel
it stands in for (interpreted): the same rows at the same query heads, dead splits and
padded rows included."""

import jax.numpy as jnp
import numpy as np
import pytest

from fdecode.kernels import triton as triton_kernels
from fdecode.kernels.mosaic_gpu import ops


@pytest.mark.parametrize("hkv,num_tokens,group,splits,dv", [(None, 1, 16, 3, 64), (2, 3, 5, 4, 32), (3, 2, 8, 1, 16)])
def test_merge_split_major_matches_the_triton_combine(hkv, num_tokens, group, splits, dv):
  rng = np.random.default_rng(hkv or 0)
  b, rows = 2, 64  # R_p: the rows padded to a 64-row tile (T * G <= 64)
  heads = () if hkv is None else (hkv,)
  o = jnp.asarray(rng.standard_normal((b, *heads, splits, rows, dv)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((b, *heads, splits, rows)), jnp.float32)
  lse = lse.at[0, ..., 0, :].set(-jnp.inf)  # a dead split
  if splits > 1:
    lse = lse.at[1, ..., :, 3].set(-jnp.inf)  # a row no split sees: out 0, lse -inf
  hq = (hkv or 1) * group
  kw = dict(num_tokens=num_tokens, group=group, hq=hq, out_dtype=jnp.bfloat16)
  got_o, got_lse = ops.merge_split_major(o, lse, **kw)
  want_o, want_lse = triton_kernels.combine_split_major(o, lse, interpret=True, **kw)
  assert got_o.shape == (b, num_tokens, hq, dv) and got_o.dtype == jnp.bfloat16
  # bf16 outputs: the two merges round in another order, at most an ulp apart (2**-7 below 2)
  np.testing.assert_allclose(np.asarray(got_o, np.float32),
                             np.asarray(want_o, np.float32).reshape(got_o.shape), atol=1e-2, rtol=1e-2)
  np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse).reshape(got_lse.shape), atol=1e-5)
