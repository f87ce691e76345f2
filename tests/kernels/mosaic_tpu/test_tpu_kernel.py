"""The Mosaic (TPU) kernel, proven from CPU.

* Lowering: `jax.export` for ``tpu`` under an abstract TPU mesh runs Pallas' Mosaic
  lowering with the chip's block-shape rules (last two block dims divisible by (8, 128)
  or whole, SMEM scalars...), across the feature matrix.
* Semantics: the TPU interpreter (simulated HBM / VMEM / SMEM, DMAs, semaphores, race
  detection, NaN-filled uninitialized memory) against the float32 reference. The shared
  ``impl`` fixture runs every kernel test of the suite this way too ("mosaic").
* VMEM: the footprint `fdecode.kernels.mosaic_tpu.plan.plan` computes (and sets ``vmem_limit_bytes`` from)
  does not grow with S.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import fdecode
from fdecode.kernels.mosaic_tpu.operands import Operand, by_name, flatten
from fdecode.kernels.mosaic_tpu.plan import dma_unit, plan as mosaic_plan
from fdecode.cache.quant import quantize
from helpers import TPU_INTERPRET, assert_close, make_problem, tol, tpu_interpret
from helpers.lowering import MODIFIER_CASES, TPU_CALL, lower_for_tpu, modifier_call


HEAD_DIMS = [(64, 64), (80, 80), (96, 96), (112, 112), (128, 128), (192, 192), (256, 256), (576, 512)]
QUANT = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
MiB = 1024 * 1024


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _abstract_problem(*, dk, dv, dtype, page_size=None, t=1, g=4, s=1000, tiles=1):
  b, hkv = 2, 2
  q = _sds((b, t, hkv * g, dk), jnp.float32 if dtype == jnp.float32 else jnp.bfloat16)
  opts = {}
  if page_size is None:
    k, v = _sds((b, hkv, s, dk), dtype), _sds((b, hkv, s, dv), dtype)
    scale = _sds((b, hkv, s, tiles), jnp.float32)
  else:
    pages = 2 * -(-s // page_size)
    k, v = _sds((hkv, pages, page_size, dk), dtype), _sds((hkv, pages, page_size, dv), dtype)
    opts["block_tables"] = _sds((b, -(-s // page_size)), jnp.int32)
    scale = _sds((hkv, pages, page_size, tiles), jnp.float32)
  if dtype in QUANT:
    opts.update(k_scale=scale, v_scale=scale)
  return (q, k, v, _sds((b,), jnp.int32)), opts


def _decode_fn(**static):
  return lambda q, k, v, n, opts: fdecode.flash_decode(q, k, v, n, **opts, **static)


# Contiguous bf16 at 80 / 96 / 112 / 192 is compiled by libtpu for v5e and v6e in the
# compile tier (tests/compile_tier: contiguous-bfloat16-d*), so it is not lowered here too.
_COMPILED = {(80, None), (96, None), (112, None), (192, None)}


@pytest.mark.parametrize("dk,dv,page_size", [(dk, dv, ps) for dk, dv in HEAD_DIMS for ps in (None, 16)
                                             if (dk, ps) not in _COMPILED])
def test_every_head_dim_lowers_for_tpu(dk, dv, page_size):
  dtype = jnp.bfloat16 if dk % 128 else jnp.int8  # both kinds over the head dims
  args, opts = _abstract_problem(dk=dk, dv=dv, dtype=dtype, page_size=page_size, t=2)
  assert TPU_CALL in lower_for_tpu(_decode_fn(impl="pallas"), *args, opts)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, *QUANT])
@pytest.mark.parametrize("page_size,g,t", [(None, 1, 1), (None, 16, 3), (1, 8, 1), (16, 2, 4)])
def test_feature_matrix_lowers_for_tpu(dtype, page_size, g, t):
  """S = 1000 is no block multiple; G 1..16; T up to 4; page size 1 and 16. Pages that
  split a 32-bit sublane (page size 1 below f32) take the XLA path on TPU: no kernel."""
  args, opts = _abstract_problem(dk=128, dv=128, dtype=dtype, page_size=page_size, g=g, t=t)
  text = lower_for_tpu(_decode_fn(impl="pallas", num_splits=2), *args, opts)
  splits_sublane = page_size is not None and page_size % dma_unit(args[1]) != 0
  assert (TPU_CALL in text) != splits_sublane


@pytest.mark.parametrize("chip", ["TPU v5 lite", "TPU v6 lite"])
@pytest.mark.parametrize("page_size", [None, 64])
def test_public_api_exports_the_tpu_kernel(chip, page_size):
  """impl=None dispatches by the lowering platform: exporting for TPU from a CPU host
  embeds the Mosaic kernel, not the CPU path."""
  args, opts = _abstract_problem(dk=128, dv=128, dtype=jnp.bfloat16, page_size=page_size)
  assert TPU_CALL in lower_for_tpu(_decode_fn(), *args, opts, chip=chip)


def test_tile_wise_scales_lower_for_tpu():
  args, opts = _abstract_problem(dk=512, dv=512, dtype=jnp.float8_e4m3fn, tiles=4, page_size=32)
  assert TPU_CALL in lower_for_tpu(_decode_fn(impl="pallas"), *args, opts)


@pytest.mark.parametrize("case", MODIFIER_CASES)
@pytest.mark.parametrize("page_size", [None, 16])
def test_score_modifiers_lower_for_tpu(case, page_size):
  args, opts = _abstract_problem(dk=128, dv=128, dtype=jnp.bfloat16, page_size=page_size, t=2, g=4)
  assert TPU_CALL in lower_for_tpu(*modifier_call(case, args, opts, page_size))


# -------------------------------------------------------------------------------------
# VMEM


@pytest.mark.parametrize("dk,dv", [(128, 128), (256, 256), (576, 512)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("page_size", [None, 1, 16])
def test_vmem_footprint_is_bounded_independently_of_s(dk, dv, dtype, page_size):
  plans = []
  for s in (128 * 1024, 1024 * 1024):
    args, opts = _abstract_problem(dk=dk, dv=dv, dtype=dtype, page_size=page_size, t=2, g=8, s=s)
    q, k, v, _ = args
    q_rows = _sds((2, 2, 16, dk), q.dtype)
    plans.append(mosaic_plan(q_rows, k, v, **opts))
  small, large = plans
  assert small == large  # nothing depends on S
  assert large.vmem_bytes < 16 * MiB, large
  assert large.vmem_bytes <= large.vmem_limit_bytes <= large.vmem_bytes + 5 * MiB
  per_step = large.block * (dk + dv) * jnp.dtype(dtype).itemsize
  assert per_step >= 64 * 1024 or page_size == 1, f"a step moves only {per_step} bytes"


def test_vmem_limit_reaches_the_kernel():
  args, opts = _abstract_problem(dk=128, dv=128, dtype=jnp.bfloat16, s=1024 * 1024)
  q, k, v, _ = args
  p = mosaic_plan(_sds((2, 2, 4, 128), q.dtype), k, v)
  text = lower_for_tpu(_decode_fn(impl="pallas"), *args, opts)
  assert str(p.vmem_limit_bytes) in text


# -------------------------------------------------------------------------------------
# Semantics under the TPU interpreter (beyond the shared impl-parametrized tests)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("page_size", [None, 3])
def test_8bit_caches_under_tpu_interpreter(dtype, page_size):
  """8-bit values with per-token scales and (int8) offsets, tail not a block multiple."""
  q, k, v = make_problem(11, b=3, t=2, hq=8, hkv=2, s=45, dk=64, dv=32, dtype=jnp.bfloat16)
  kq, ks = quantize(k, dtype)
  vq, vs = quantize(v, dtype)
  opts = dict(k_scale=ks, v_scale=vs)
  if dtype == jnp.int8:
    opts.update(k_offset=jnp.full_like(ks, 0.5), v_offset=jnp.full_like(vs, -0.25))
  if page_size is not None:  # the same cache as a pool of 15 pages of 3 tokens per head
    to_pool = lambda x: x.reshape(3, 2, 15, 3, x.shape[-1]).transpose(1, 0, 2, 3, 4).reshape(2, 45, 3, x.shape[-1])
    kq, vq = to_pool(kq), to_pool(vq)
    opts = {n: to_pool(a) for n, a in opts.items()}
    opts["block_tables"] = np.arange(45, dtype=np.int32).reshape(3, 15)
  lengths = jnp.array([45, 1, 33])
  ref = fdecode.flash_decode(q, kq, vq, lengths, impl="reference", **opts)
  out = fdecode.flash_decode(q, kq, vq, lengths, impl="pallas", interpret=TPU_INTERPRET,
                             block_k=32, num_splits=3, **opts)
  assert_close(out, ref, atol=tol(jnp.bfloat16)["atol"], rtol=tol(jnp.bfloat16)["rtol"])


def test_interpret_params_argument_equals_forced_mode():
  q, k, v = make_problem(12, b=2, t=None, hq=4, hkv=2, s=70, dk=32)
  lengths = jnp.array([70, 40])
  direct = fdecode.flash_decode(q, k, v, lengths, impl="pallas", interpret=TPU_INTERPRET, block_k=16)
  with tpu_interpret():
    forced = fdecode.flash_decode(q, k, v, lengths, impl="pallas", block_k=16)
  np.testing.assert_array_equal(np.asarray(direct), np.asarray(forced))


def _tpu_mesh(shape, names):
  return jax.sharding.AbstractMesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape),
                                   abstract_device=jax.sharding.AbstractDevice(
                                       device_kind="TPU v5 lite", num_cores=1, platform="tpu"))


def test_sharded_flash_decode_exports_the_tpu_kernel():
  """sharded_flash_decode on an AbstractMesh of TPU devices (heads x sequence) exports
  from this CPU host with the Mosaic kernel inside the shard_map."""
  mesh = _tpu_mesh((2, 4), ("h", "s"))
  f = lambda q, k, v, n: fdecode.sharded_flash_decode(q, k, v, n, mesh=mesh, head_axis="h", seq_axis="s")
  args = (_sds((2, 8, 128), jnp.bfloat16), _sds((2, 4, 4096, 128), jnp.bfloat16),
          _sds((2, 4, 4096, 128), jnp.bfloat16), _sds((2,), jnp.int32))
  with jax.sharding.use_abstract_mesh(mesh):
    exp = export.export(jax.jit(f), platforms=["tpu"])(*args)
  assert TPU_CALL in exp.mlir_module() and exp.nr_devices == 8


def test_flax_layer_exports_the_tpu_kernel():
  """A DecodeAttention decode step (fdecode's default dispatch) exported for TPU."""
  from flax import nnx
  import fdecode.flax as fflax
  layer = fflax.DecodeAttention(64, num_heads=4, num_kv_heads=2, head_dim=128, rngs=nnx.Rngs(0))
  layer.init_cache(2, 256, jnp.bfloat16)
  graphdef, state = nnx.split(layer)

  def step(state, x):
    model = nnx.merge(graphdef, state)
    return model.decode(x), nnx.state(model)

  args = (jax.tree.map(lambda a: _sds(a.shape, a.dtype), state), _sds((2, 1, 64), jnp.float32))
  text = lower_for_tpu(step, *args)
  assert TPU_CALL in text


@pytest.mark.parametrize("hkv,page_size,in_place", [(9, 16, True), (127, 128, False)])
def test_whole_head_axis_read_stays_within_vmem(hkv, page_size, in_place):
  """A token-major pool read by the whole head axis (here bfloat16 with an odd Hkv) takes
  whole pages a step. 9 heads of 16-token pages are read in place (the kernel's operand
  is the token-major pool); 127 heads of 128-token pages would count more than
  `MAX_HEAD_AXIS_VMEM_BYTES` of VMEM, so that call reads a head-major copy."""
  from fdecode.kernels.mosaic_tpu.plan import MAX_HEAD_AXIS_VMEM_BYTES  # pylint: disable=g-import-not-at-top
  pages = 17
  pool = _sds((pages, page_size, hkv, 128), jnp.bfloat16)
  tables = _sds((2, 8), jnp.int32)
  counted = mosaic_plan(_sds((2, hkv, 1, 128), jnp.bfloat16), _sds((hkv, pages, page_size, 128), jnp.bfloat16),
                        _sds((hkv, pages, page_size, 128), jnp.bfloat16), block_tables=tables, head_axis=True,
                        kv_heads_per_program=hkv).vmem_bytes
  assert (counted <= MAX_HEAD_AXIS_VMEM_BYTES) == in_place, counted
  fn = lambda q, k, v, n, t: fdecode.flash_decode(q, k, v, n, block_tables=t, kv_layout="NHD", impl="pallas")
  text = lower_for_tpu(fn, _sds((2, hkv, 128), jnp.bfloat16), pool, pool, _sds((2,), jnp.int32), tables)
  call = next(line for line in text.splitlines() if "tpu_custom_call" in line)
  assert (f"{pages}x{page_size}x{hkv}x128xbf16" in call) == in_place
  assert (f"{hkv}x{pages}x{page_size}x128xbf16" in call) == (not in_place)


class _Ops(NamedTuple):
  ends: Any
  q: Any
  k: Any
  v: Any
  scale: Any


def test_operands_flatten_in_field_order_and_come_back_by_name():
  """`operands.flatten` drops absent operands and keeps the field order (scalar-prefetched
  first); the kernel `by_name` wraps gets its input refs and DMA buffers under the
  operands' names, None where absent or not DMA'd."""
  spec, buf = object(), object()
  ops = flatten(_Ops(ends=Operand("e"), q=Operand("q", spec), k=Operand("k", spec, buf), v=None,
                     scale=Operand("s", spec)))
  assert ops.arrays == ("e", "q", "k", "s") and ops.num_scalar_prefetch == 1
  assert ops.in_specs == [spec] * 3 and ops.buffers == [buf]
  seen = {}
  kernel = by_name(functools.partial(
      lambda ins, bufs, o, lse, *rest, x: seen.update(ins=ins, bufs=bufs, out=(o, lse), rest=rest, x=x), x=7),
      ops.layout)
  kernel("E", "Q", "K", "S", "O", "L", "KBUF", "SEMS")
  assert seen["ins"] == _Ops(ends="E", q="Q", k="K", v=None, scale="S")
  assert seen["bufs"] == _Ops(ends=None, q=None, k="KBUF", v=None, scale=None)
  assert seen["out"] == ("O", "L") and seen["rest"] == ("SEMS",) and seen["x"] == 7
  with pytest.raises(ValueError, match="scalar-prefetched"):
    flatten(_Ops(ends=Operand("e"), q=Operand("q", spec), k=Operand("k"), v=None, scale=None))
