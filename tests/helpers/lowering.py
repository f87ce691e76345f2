"""Cross-platform lowering from CPU with `jax.export`: the Triton kernel for CUDA and the Mosaic
kernel for TPU (its custom-call names, to look for in the module), and the score-modifier
calls both lowering suites export."""

import jax
import jax.numpy as jnp
from jax import export

import fdecode


TRITON_CALL = "__gpu$xla.gpu.triton"


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def lower_for_cuda(fn, *args):
  exp = export.export(jax.jit(fn), platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
  return exp.mlir_module()


TPU_CALL = "tpu_custom_call"


def lower_for_tpu(fn, *args, chip="TPU v5 lite"):
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
      device_kind=chip, num_cores=1, platform="tpu"))
  with jax.sharding.use_abstract_mesh(mesh):
    return export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


MODIFIER_CASES = ["window+softcap+alibi+sinks", "mask[B,T,S]", "mask+bias per head"]


def modifier_call(case, args, opts, page_size):
  """(fn, *operands) of a ``flash_decode(impl="pallas")`` call with the score modifiers of
  ``case`` (issue 9) on an abstract problem (T=2); shared with the CUDA lowering tests."""
  q, k = args[:2]
  b, t, hq = q.shape[:3]
  s = k.shape[2] if page_size is None else opts["block_tables"].shape[1] * page_size
  f32 = jnp.float32
  static, arrays = {
      "window+softcap+alibi+sinks": (dict(window=100, logits_soft_cap=30.0),
                                     dict(alibi_slopes=_sds((hq,), f32), sinks=_sds((hq,), f32))),
      "mask[B,T,S]": (dict(causal=False), dict(mask=_sds((b, t, s), jnp.bool_))),
      "mask+bias per head": ({}, dict(mask=_sds((1, t, hq, s), jnp.bool_), bias=_sds((b, 1, hq, s), q.dtype))),
  }[case]
  fn = lambda q, k, v, n, opts, arrays: fdecode.flash_decode(q, k, v, n, **opts, **arrays, **static,
                                                             impl="pallas", num_splits=2)
  return (fn, *args, opts, arrays)
