"""flash_decode against the float32 reference over shapes that break tiling."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.reference import reference_decode
from helpers import assert_close, interpreted_pairwise, make_problem, tol

BLOCK = 16  # small block so that short caches have several blocks


def check(q, k, v, lengths, *, impl, **kw):
  out, lse = fdecode.flash_decode(q, k, v, lengths, impl=impl, return_lse=True, **kw)
  q4 = q if q.ndim == 4 else q[:, None]
  ref_out, ref_lse = reference_decode(q4, k, v, jnp.asarray(lengths), softmax_scale=kw.get("softmax_scale"))
  if q.ndim == 3:
    ref_out, ref_lse = ref_out[:, 0], ref_lse[:, 0]
  assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == q.dtype
  assert lse.shape == q.shape[:-1] and lse.dtype == jnp.float32
  t = tol(q.dtype)
  assert_close(out, ref_out, atol=t["atol"], rtol=t["rtol"], what="out")
  assert_close(lse, ref_lse, atol=t["lse"], rtol=t["lse"], what="lse")
  return out, lse


# lengths 0, 1, block-1, block+1, S (= 3 blocks + 5: not a block multiple)
S_TAIL = 3 * BLOCK + 5
LENGTHS = [0, 1, BLOCK - 1, BLOCK + 1, S_TAIL]


DTYPES, HEADS, NEW_TOKENS, SPLITS = [jnp.float32, jnp.bfloat16], [(4, 4), (8, 2), (6, 1)], [None, 3], [1, 3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", HEADS, ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("t", NEW_TOKENS, ids=["T1", "T3"])
@pytest.mark.parametrize("num_splits", SPLITS)
def test_matches_reference(request, impl, dtype, hq, hkv, t, num_splits):
  interpreted_pairwise(request, "the kernels' paths by dtype, head grouping, rows and splits", dtype=DTYPES,
                       **{"hq,hkv": HEADS}, t=NEW_TOKENS, num_splits=SPLITS)
  q, k, v = make_problem(0, b=len(LENGTHS), t=t, hq=hq, hkv=hkv, s=S_TAIL, dk=32, dtype=dtype)
  out, lse = check(q, k, v, jnp.array(LENGTHS), impl=impl, num_splits=num_splits, block_k=BLOCK)
  assert np.all(np.asarray(out)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dk,dv", [(64, 64), (80, 80), (128, 128), (256, 256), (128, 64), (64, 96)])
def test_head_dims(impl, dtype, dk, dv):
  q, k, v = make_problem(1, b=2, t=None, hq=4, hkv=2, s=40, dk=dk, dv=dv, dtype=dtype)
  check(q, k, v, jnp.array([40, 23]), impl=impl, block_k=BLOCK)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 5, 11])  # 4 blocks: 5 and 11 exceed them
def test_num_splits_any_value(impl, num_splits):
  q, k, v = make_problem(2, b=3, t=2, hq=4, hkv=2, s=4 * BLOCK - 3, dk=32)
  check(q, k, v, jnp.array([4 * BLOCK - 3, BLOCK + 2, 1]), impl=impl, num_splits=num_splits, block_k=BLOCK)


@pytest.mark.parametrize("s", [1, 5, BLOCK - 1, BLOCK, BLOCK + 1])
def test_cache_shorter_or_near_one_block(impl, s):
  q, k, v = make_problem(3, b=2, t=None, hq=2, hkv=1, s=s, dk=32)
  check(q, k, v, jnp.array([s, (s + 1) // 2]), impl=impl, block_k=BLOCK, num_splits=2)


def test_t_larger_than_length(impl):
  """T new tokens but fewer valid positions: the early queries see nothing -> 0 / -inf."""
  q, k, v = make_problem(4, b=2, t=4, hq=2, hkv=1, s=20, dk=32)
  out, lse = check(q, k, v, jnp.array([2, 20]), impl=impl, block_k=BLOCK)
  np.testing.assert_array_equal(np.asarray(out[0, :2]), 0.0)
  assert np.isneginf(np.asarray(lse[0, :2])).all() and np.isfinite(np.asarray(lse[0, 2:])).all()


class DefaultImplVariantsTest(chex.TestCase):
  """The default impl (``impl=None``), called as it is and under ``jax.jit`` (lengths traced)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_softmax_scale_and_default_impl(self):
    q, k, v = make_problem(5, b=2, t=None, hq=4, hkv=2, s=33, dk=32)
    lengths = jnp.array([33, 9])
    decode = self.variant(lambda q, k, v, n: fdecode.flash_decode(q, k, v, n, softmax_scale=0.3, return_lse=True))
    out, lse = decode(q, k, v, lengths)
    ref_out, ref_lse = reference_decode(q[:, None], k, v, lengths, softmax_scale=0.3)
    chex.assert_shape(out, q.shape[:-1] + (v.shape[-1],))
    chex.assert_shape(lse, q.shape[:-1])
    chex.assert_type((out, lse), (q.dtype, jnp.float32))
    t = tol(q.dtype)  # float32: one bound for out and lse
    chex.assert_trees_all_close((out, lse), (ref_out[:, 0], ref_lse[:, 0]), atol=t["atol"], rtol=t["rtol"])


def test_under_jit_with_traced_lengths(impl):
  q, k, v = make_problem(6, b=3, t=None, hq=4, hkv=1, s=50, dk=32)
  f = jax.jit(lambda q, k, v, n: fdecode.flash_decode(q, k, v, n, impl=impl, block_k=BLOCK, return_lse=True))
  lengths = jnp.array([50, 0, 17])
  out, lse = f(q, k, v, lengths)
  ref_out, ref_lse = reference_decode(q[:, None], k, v, lengths)
  assert_close(out, ref_out[:, 0], atol=3e-5, rtol=3e-5)
  assert_close(lse, ref_lse[:, 0], atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1)])
def test_matches_jax_dot_product_attention(impl, hq, hkv):
  """Cross-check against jax.nn.dot_product_attention given the cache token-major plus a mask."""
  b, s, d = 3, 45, 64
  q, k, v = make_problem(7, b=b, t=None, hq=hq, hkv=hkv, s=s, dk=d)
  lengths = jnp.array([45, 12, 1])
  out = fdecode.flash_decode(q, k, v, lengths, impl=impl, block_k=BLOCK)
  mask = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, S]
  expected = jax.nn.dot_product_attention(q[:, None], k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                          mask=mask)[:, 0]
  assert_close(out, expected, atol=3e-5, rtol=3e-5)


def test_no_nan_on_extreme_scores(impl):
  """Huge logits must not overflow the online softmax."""
  q, k, v = make_problem(8, b=2, t=None, hq=2, hkv=1, s=40, dk=32)
  q = q * 300.0
  out = fdecode.flash_decode(q, k, v, jnp.array([40, 3]), impl=impl, block_k=BLOCK, num_splits=3)
  assert np.isfinite(np.asarray(out)).all()
  ref, _ = reference_decode(q[:, None], k, v, jnp.array([40, 3]))
  assert_close(out, ref[:, 0], atol=1e-4, rtol=1e-4)
