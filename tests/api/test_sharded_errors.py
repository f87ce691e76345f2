"""sharded_flash_decode makes every check flash_decode makes, with the same message, plus
its own for mesh roles (8 simulated CPU devices, see conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from helpers import randn

B, HQ, HKV, S, D = 2, 4, 2, 16, 8
PS, NP = 4, 8  # paged: page size, pool pages; tables [B, 4]
TABLE = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)
I8 = jnp.zeros((B, HKV, S, D), jnp.int8)


def _args(paged=False, **over):
  if paged:
    a = dict(q=jnp.zeros((B, HQ, D)), k=jnp.zeros((HKV, NP, PS, D)), v=jnp.zeros((HKV, NP, PS, D)),
             lengths=jnp.array([3, 16], jnp.int32), block_tables=TABLE)
  else:
    a = dict(q=jnp.zeros((B, HQ, D)), k=jnp.zeros((B, HKV, S, D)), v=jnp.zeros((B, HKV, S, D)),
             lengths=jnp.array([3, 4], jnp.int32))
  a.update(over)
  return a


def _message(fn, args, **kw):
  with pytest.raises((ValueError, TypeError)) as err:
    fn(**args, **kw)
  return str(err.value)


# (arguments, roles): roles on a (2, 2) mesh ("a", "b"). kv_offset excludes seq_axis.
BAD = {
    "q-rank": (dict(q=jnp.zeros((B, D))), dict(seq_axis="a")),
    "k-rank": (dict(k=jnp.zeros((B, S, D))), dict(seq_axis="a")),
    "v-length": (dict(v=jnp.zeros((B, HKV, S + 4, D))), dict(seq_axis="a")),
    "hq-not-multiple": (dict(q=jnp.zeros((B, 3, D))), dict(head_axis="a")),
    "dk-mismatch": (dict(q=jnp.zeros((B, HQ, 16))), dict(seq_axis="a")),
    "batch-mismatch": (dict(k=jnp.zeros((4, HKV, S, D)), v=jnp.zeros((4, HKV, S, D))), dict(batch_axis="a")),
    "q-int": (dict(q=jnp.zeros((B, HQ, D), jnp.int32)), dict(seq_axis="a")),
    "lengths-shape": (dict(lengths=jnp.array([1, 2, 3, 4])), dict(batch_axis="a")),
    "lengths-float": (dict(lengths=jnp.array([1.0, 2.0])), dict(seq_axis="a")),
    "lengths-past-S": (dict(lengths=jnp.array([3, S + 1])), dict(seq_axis="a")),
    "lengths-negative": (dict(lengths=jnp.array([-1, 2])), dict(batch_axis="a")),
    "lengths-past-S-numpy": (dict(lengths=np.array([3, S + 5], np.int32)), dict(head_axis="a")),
    "k-int8-no-scale": (dict(k=I8), dict(seq_axis="a")),
    "v-int32": (dict(v=jnp.zeros((B, HKV, S, D), jnp.int32)), dict(seq_axis="a")),
    "k-scale-shape": (dict(k=I8, k_scale=jnp.ones((B, HKV, S, 3))), dict(seq_axis="a")),
    "scale-for-float": (dict(v_scale=jnp.ones((B, HKV, S, 1))), dict(seq_axis="a")),
    "impl": (dict(impl="cuda"), dict(seq_axis="a")),
    "num-splits": (dict(num_splits=0), dict(seq_axis="a")),
    "block-k": (dict(block_k=-4), dict(head_axis="a")),
    "kv-offset-shape": (dict(kv_offset=jnp.array([0, 0, 0])), dict(batch_axis="a")),
    "kv-offset-float": (dict(kv_offset=jnp.array([0.0, 1.0])), dict(head_axis="a")),
    "kv-offset-float-scalar": (dict(kv_offset=2.0), dict(batch_axis="a")),
    "paged-table-shape": (dict(paged=True, block_tables=TABLE[:1]), dict(seq_axis="a")),
    "paged-table-float": (dict(paged=True, block_tables=TABLE.astype(np.float32)), dict(seq_axis="a")),
    "paged-kv-mismatch": (dict(paged=True, v=jnp.zeros((HKV, NP, PS + 1, D))), dict(head_axis="a")),
    "paged-id-past-pool": (dict(paged=True, block_tables=np.where(TABLE == 5, NP, TABLE)), dict(head_axis="a")),
    "paged-id-negative": (dict(paged=True, block_tables=np.where(TABLE == 7, -1, TABLE)), dict(batch_axis="a")),
    "paged-id-past-pool-seq": (dict(paged=True, block_tables=np.where(TABLE == 5, 99, TABLE)), dict(seq_axis="a")),
    "paged-lengths-past-S": (dict(paged=True, lengths=jnp.array([3, 17])), dict(seq_axis="a")),
    # Issue 18: integers in int32, static floats in float32, lists as arrays.
    "indices-past-int32": (dict(indices=np.array([[2 ** 32 + 3], [1]], np.int64)), dict(seq_axis="a")),
    "kv-offset-past-int32": (dict(kv_offset=np.array([2 ** 31, 0], np.int64)), dict(batch_axis="a")),
    "window-past-int32": (dict(window=2 ** 31), dict(seq_axis="a")),
    "soft-cap-past-float32": (dict(logits_soft_cap=1e39), dict(head_axis="a")),
    "scale-past-float32": (dict(softmax_scale=1e39), dict(seq_axis="a")),
    "mask-ragged-list": (dict(mask=[[True] * S, [True]]), dict(seq_axis="a")),
}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 2), ("a", "b"))


@pytest.mark.parametrize("case", list(BAD))
def test_same_error_as_flash_decode(case, mesh):
  over, roles = BAD[case]
  args = _args(**over)
  want = _message(fdecode.flash_decode, args)
  got = _message(fdecode.sharded_flash_decode, args, mesh=mesh, **roles)
  assert got == want


@pytest.mark.parametrize("kw,pattern", [
    (dict(head_axis=3), r"head_axis must be a mesh axis name \(str\) or a tuple of names, got 3"),
    (dict(seq_axis=("a", 0)), r"seq_axis must be a mesh axis name .*got \('a', 0\)"),
    (dict(batch_axis=1.5), r"batch_axis must be a mesh axis name"),
    (dict(seq_axis="a", kv_offset=4), r"kv_offset cannot be combined with seq_axis='a'"),
    (dict(seq_axis="a", kv_offset=jnp.array([0, 16])), r"kv_offset cannot be combined with seq_axis"),
    (dict(mesh="mesh"), r"mesh must be a jax.sharding.Mesh .*got str"),
])
def test_sharded_only_errors(kw, pattern, mesh):
  kw = dict(dict(mesh=mesh), **kw)
  with pytest.raises(ValueError, match=pattern):
    fdecode.sharded_flash_decode(**_args(), **kw)


def test_kv_offset_per_sequence_with_batch_axis(mesh):
  """kv_offset [B] is split with the batch, and lengths past S are valid with it (they count
  the whole sequence), as in flash_decode."""
  q, k, v = (randn(i, x.shape) for i, x in enumerate(
      (jnp.zeros((B, HQ, D)), jnp.zeros((B, HKV, S, D)), jnp.zeros((B, HKV, S, D)))))
  lengths, offset = jnp.array([20, 5], jnp.int32), jnp.array([8, 0], jnp.int32)
  want = fdecode.flash_decode(q, k, v, lengths, kv_offset=offset, impl="xla")
  got = fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, batch_axis="a", head_axis="b",
                                     kv_offset=offset, impl="xla")
  np.testing.assert_allclose(got, want, atol=3e-5, rtol=3e-5)
