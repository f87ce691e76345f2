"""Score modifiers through `sharded_flash_decode` (8 simulated CPU devices) and the Flax
layer, against the float32 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import fdecode
from fdecode.reference import reference_decode
from helpers import assert_close, make_problem
from helpers.paged import paged_shards

B, T, HQ, HKV, S, D = 2, 2, 8, 2, 64, 16
AUTO = lambda n: (AxisType.Auto,) * n


def _mods(seed, *, per_head, hq=HQ):
  r = np.random.default_rng(seed)
  mask_shape = (B, T, hq, S) if per_head else (B, S)
  return dict(mask=jnp.asarray(r.random(mask_shape) > 0.3),
              bias=jnp.asarray(r.normal(size=(1, T, hq, S) if per_head else (B, 1, S)), jnp.float32),
              alibi_slopes=jnp.asarray(2.0 ** -np.arange(1, hq + 1), jnp.float32),
              sinks=jnp.asarray(r.normal(size=hq), jnp.float32), logits_soft_cap=2.0)


def _check(out, lse, q, k, v, lengths, **mods):
  ref, ref_lse = reference_decode(q, k, v, lengths, **mods)
  assert_close(out, ref, atol=3e-5, rtol=3e-5)
  assert_close(lse, ref_lse, atol=3e-5, rtol=3e-5, what="lse")


@pytest.mark.parametrize("shape,names,roles,axis_types,per_head", [
    ((8,), ("s",), dict(seq_axis="s"), None, False),                       # Explicit axes
    ((8,), ("s",), dict(seq_axis="s"), None, True),
    ((2, 4), ("h", "s"), dict(head_axis="h", seq_axis="s"), AUTO(2), True),
    ((2, 2, 2), ("b", "h", "s"), dict(batch_axis="b", head_axis="h", seq_axis="s"), None, True),
], ids=["seq8-mask[B,S]", "seq8-per-head", "h2-s4-auto-per-head", "b-h-s-per-head"])
def test_modifiers_and_sinks_sharded(shape, names, roles, axis_types, per_head):
  """Sinks count once (not once per device or split), masks / biases split with the
  cache, heads and batch."""
  q, k, v = make_problem(0, b=B, t=T, hq=HQ, hkv=HKV, s=S, dk=D)
  lengths = jnp.array([S, 21])
  mods = _mods(1, per_head=per_head)
  mesh = jax.make_mesh(shape, names, axis_types=axis_types)
  out, lse = fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, impl="xla", num_splits=2,
                                          return_lse=True, **roles, **mods)
  _check(out, lse, q, k, v, lengths, **mods)


def test_window_devices_outside_it_contribute_nothing():
  """S = 64 on 8 devices (chunks of 8), window 10: most chunks lie wholly outside."""
  q, k, v = make_problem(2, b=3, t=T, hq=HQ, hkv=HKV, s=S, dk=D)
  lengths = jnp.array([S, 30, 3])
  mesh = jax.make_mesh((8,), ("s",))
  for impl, extra in (("xla", {}), ("pallas", dict(interpret=True))):
    out, lse = fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, seq_axis="s", window=10,
                                            impl=impl, return_lse=True, **extra)
    _check(out, lse, q, k, v, lengths, window=10)


def test_paged_mask_sharded_over_seq():
  page_size, n_s = 4, 4
  q, k, v = make_problem(3, b=B, t=T, hq=HQ, hkv=HKV, s=32, dk=D)
  table = paged_shards(k, n_s, page_size, seed=0)
  n = 32 // page_size
  to_pool = lambda x: x.reshape(B, HKV, n, page_size, D).transpose(1, 0, 2, 3, 4).reshape(HKV, B * n, page_size, D)
  inv = np.argsort(table.reshape(-1))
  kp, vp = to_pool(k)[:, inv], to_pool(v)[:, inv]
  lengths = jnp.array([32, 13])
  mask = jnp.asarray(np.random.default_rng(3).random((B, T, 32)) > 0.4)
  out, lse = fdecode.sharded_flash_decode(q, kp, vp, lengths, mesh=jax.make_mesh((4,), ("s",)),
                                          seq_axis="s", block_tables=table, mask=mask, window=9,
                                          sinks=jnp.ones((HQ,)), impl="xla", return_lse=True)
  _check(out, lse, q, k, v, lengths, mask=mask, window=9, sinks=jnp.ones((HQ,)))


def test_alibi_mqa_query_groups_split():
  """One kv head replicated on 4 devices, its 8 query heads split: slopes split with them."""
  q, k, v = make_problem(4, b=B, t=None, hq=8, hkv=1, s=S, dk=D)
  lengths = jnp.array([S, 9])
  mods = dict(alibi_slopes=jnp.asarray(2.0 ** -np.arange(1, 9), jnp.float32),
              sinks=jnp.linspace(-1.0, 1.0, 8), causal=False)
  out, lse = fdecode.sharded_flash_decode(q, k, v, lengths, mesh=jax.make_mesh((4, 2), ("h", "s")),
                                          head_axis="h", seq_axis="s", impl="xla", return_lse=True, **mods)
  ref, ref_lse = reference_decode(q[:, None], k, v, lengths, **mods)
  assert_close(out, ref[:, 0], atol=3e-5, rtol=3e-5)
  assert_close(lse, ref_lse[:, 0], atol=3e-5, rtol=3e-5)


def test_sharded_bad_mask_names_it():
  q, k, v = make_problem(5, b=B, t=T, hq=HQ, hkv=HKV, s=S, dk=D)
  with pytest.raises(ValueError, match=r"mask must broadcast.*mask.shape=\(2, 65\)"):
    fdecode.sharded_flash_decode(q, k, v, jnp.array([S, 3]), mesh=jax.make_mesh((8,), ("s",)),
                                 seq_axis="s", mask=jnp.ones((B, S + 1), bool))
