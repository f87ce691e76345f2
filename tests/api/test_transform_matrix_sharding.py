"""Issue 58, the rest of the transformation matrix: ``jax.vmap`` of `sharded_flash_decode`
(8 simulated CPU devices, see conftest.py), and ``jax.export`` for TPU from this CPU host with
no abstract mesh (the Mosaic kernel lowered for the default chip, TPU v5e)."""

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AxisType

import fdecode
from fdecode.kernels.common import chips
from helpers import make_problem
from helpers.lowering import TPU_CALL, TRITON_CALL

V, B, HQ, HKV, S, D = 2, 2, 8, 2, 32, 16  # V: the vmapped axis
LENGTHS = np.array([[32, 13], [5, 0]], np.int32)  # [V, B]: full, mid-chunk, short, empty
ROLES = dict(batch_axis="b", head_axis="h", seq_axis="s")


def _stacked(t):
  """q [V, B, (T,) Hq, D], k / v [V, B, Hkv, S, D]: one problem per vmapped slice."""
  qs, ks, vs = zip(*(make_problem(i, b=B, t=t, hq=HQ, hkv=HKV, s=S, dk=D) for i in range(V)))
  return jnp.stack(qs), jnp.stack(ks), jnp.stack(vs)


def _assert_vmap_is_per_slice(f, args, in_axes):
  """``jax.vmap(f, in_axes)`` equals ``f`` on each slice, bit for bit (out and lse)."""
  batched = jax.vmap(f, in_axes=in_axes)(*args)
  for i in range(V):
    one = f(*(x if ax is None else jnp.take(x, i, axis=ax) for x, ax in zip(args, in_axes)))
    for got, want, what in zip(batched, one, ("out", "lse")):
      np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want), err_msg=f"{what}, slice {i}")


@pytest.mark.parametrize("axis_types,t", [(None, 2), ((AxisType.Auto,) * 3, None)],
                         ids=["explicit-T2", "auto-T1"])
def test_vmap_stacked_leading_axis_every_role(axis_types, t):
  """A stacked leading axis on q, k, v and lengths, over a batch x heads x sequence mesh
  (the sequence axis merges its devices' states under vmap too)."""
  mesh = jax.make_mesh((2, 2, 2), ("b", "h", "s"), axis_types=axis_types)
  f = lambda q, k, v, n: fdecode.sharded_flash_decode(q, k, v, n, mesh=mesh, return_lse=True, **ROLES)
  _assert_vmap_is_per_slice(f, (*_stacked(t), jnp.asarray(LENGTHS)), (0, 0, 0, 0))


@pytest.mark.parametrize("role,in_axes", [
    ("batch_axis", (0, None, None, None)),  # several queries against one cache
    ("head_axis", (1, None, None, 0)),      # q's vmapped axis second, lengths batched
    ("seq_axis", (None, 2, 2, None)),       # several caches (axis 2) for one query
], ids=["batch-q-only", "head-q-axis1-lengths", "seq-kv-axis2"])
def test_vmap_one_role_several_in_axes(role, in_axes):
  mesh = jax.make_mesh((8,) if role == "seq_axis" else (2,), ("x",))
  q, k, v = _stacked(2)
  lengths = jnp.asarray(LENGTHS)
  args = (jnp.moveaxis(q, 0, 1) if in_axes[0] == 1 else q if in_axes[0] == 0 else q[0],
          jnp.moveaxis(k, 0, 2) if in_axes[1] == 2 else k[0],
          jnp.moveaxis(v, 0, 2) if in_axes[2] == 2 else v[0],
          lengths if in_axes[3] == 0 else lengths[0])
  f = lambda q, k, v, n: fdecode.sharded_flash_decode(q, k, v, n, mesh=mesh, return_lse=True, **{role: "x"})
  _assert_vmap_is_per_slice(f, args, in_axes)


def test_vmap_window_sinks_soft_cap():
  """With a window, the XLA path's skip of a chunk no query sees is a cond over all the
  operands: under vmap it takes every device's operands typed alike too."""
  mesh = jax.make_mesh((2, 4), ("h", "s"))
  f = lambda q, k, v, n: fdecode.sharded_flash_decode(
      q, k, v, n, mesh=mesh, head_axis="h", seq_axis="s", window=5, sinks=jnp.ones((HQ,)),
      logits_soft_cap=2.0, return_lse=True)
  _assert_vmap_is_per_slice(f, (*_stacked(2), jnp.asarray(LENGTHS)), (0, 0, 0, 0))


_SDS = jax.ShapeDtypeStruct
_TPU_ARGS = (_SDS((2, 8, 128), jnp.bfloat16), _SDS((2, 2, 1024, 128), jnp.bfloat16),
             _SDS((2, 2, 1024, 128), jnp.bfloat16), _SDS((2,), jnp.int32))


def _export_text(fn, platforms, mesh=None, args=_TPU_ARGS):
  """The exported module's text, less its source locations."""
  checks = [export.DisabledSafetyCheck.custom_call(TRITON_CALL)] if "cuda" in platforms else []
  with jax.sharding.use_abstract_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    text = export.export(jax.jit(fn), platforms=platforms, disabled_checks=checks)(*args).mlir_module()
  return re.sub(r" loc\(#loc\d*\)|^#loc.*$", "", text, flags=re.M)


def _tpu_mesh(shape, names, axis_type=AxisType.Explicit):
  """An abstract mesh of TPU v5e devices (`chips.DEFAULT_TPU`)."""
  return jax.sharding.AbstractMesh(shape, names, axis_types=(axis_type,) * len(shape),
                                   abstract_device=jax.sharding.AbstractDevice(
                                       device_kind=chips.DEFAULT_TPU.name, num_cores=1, platform="tpu"))


def test_tpu_export_from_cpu_host_lowers_for_the_default_chip():
  """No abstract mesh: the Mosaic kernel is embedded, lowered as for a TPU v5e (the module
  is the one exported under a v5e abstract mesh)."""
  fn = lambda q, k, v, n: fdecode.flash_decode(q, k, v, n)
  plain = _export_text(fn, ["tpu"])
  assert TPU_CALL in plain
  assert chips.DEFAULT_TPU.name == "TPU v5 lite"
  assert _export_text(fn, ["tpu"], _tpu_mesh((1,), ("x",), AxisType.Auto)) == plain


def test_multi_platform_export_from_cpu_host():
  fn = lambda q, k, v, n: fdecode.flash_decode(q, k, v, n)
  text = _export_text(fn, ["cpu", "cuda", "tpu"])
  assert TPU_CALL in text and TRITON_CALL in text


def test_tpu_export_over_a_cpu_mesh_shows_the_abstract_mesh_recipe():
  """sharded_flash_decode over the host's CPU devices: the mesh is in every array's type, so
  no TPU can stand in; the error says to export with a TPU AbstractMesh."""
  mesh = jax.make_mesh((2, 4), ("h", "s"))
  fn = lambda q, k, v, n: fdecode.sharded_flash_decode(q, k, v, n, mesh=mesh, head_axis="h", seq_axis="s")
  recipe = (r"fdecode: .*AbstractMesh\(\(2, 4\), \('h', 's'\), abstract_device=jax.sharding.AbstractDevice\("
            r"device_kind='TPU v5 lite'.*use_abstract_mesh")
  with pytest.raises(ValueError, match=recipe):
    _export_text(fn, ["tpu"])


def test_vmap_sharded_exports_the_tpu_kernel_with_batched_lengths():
  """On TPU the lengths are the Mosaic kernel's scalar-prefetched operands: vmapped, Pallas
  would loop over them with a carry typed invariant, which shard_map refuses; fdecode
  loops the call itself."""
  mesh = _tpu_mesh((2, 4), ("h", "s"))
  fn = jax.vmap(lambda q, k, v, n: fdecode.sharded_flash_decode(q, k, v, n, mesh=mesh, head_axis="h",
                                                                seq_axis="s"))
  args = tuple(_SDS((V,) + x.shape, x.dtype) for x in _TPU_ARGS)
  args = (args[0], _SDS((V, 2, 4, 1024, 128), jnp.bfloat16), _SDS((V, 2, 4, 1024, 128), jnp.bfloat16), args[3])
  assert TPU_CALL in _export_text(fn, ["tpu"], mesh, args)
