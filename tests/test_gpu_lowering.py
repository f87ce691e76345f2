"""The Pallas kernel lowers for GPU (Triton), checked from CPU with cross-platform export.

No GPU is needed: `jax.export` runs Pallas' Triton lowering and embeds the Triton IR in
a custom call; we only skip the serialization-compatibility check for that call. This
catches kernel code that works in interpret mode but has no Triton lowering. It does not
compile the IR to PTX or run it (that needs a GPU: see benchmarks/RESULTS.md).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import export

from fdecode.kernels.pallas import pallas_partials
from fdecode.quant import canonical_scale

TRITON_CALL = "__gpu$xla.gpu.triton"


def _lower_for_cuda(fn, *args):
  exp = export.export(jax.jit(fn), platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
  return exp.mlir_module()


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("s,num_splits", [(256, 2), (300, 3)])  # 300: a tail block, not a split multiple
def test_contiguous_kernel_lowers_to_triton(dtype, s, num_splits):
  b, hkv, r, d = 2, 2, 4, 64
  fn = functools.partial(pallas_partials, num_tokens=1, softmax_scale=0.125, num_splits=num_splits,
                         block_k=64, interpret=False, backend="gpu")
  text = _lower_for_cuda(fn, _sds((b, hkv, r, d), dtype), _sds((b, hkv, s, d), dtype),
                         _sds((b, hkv, s, d), dtype), _sds((b,), jnp.int32))
  assert TRITON_CALL in text


def test_paged_int8_kernel_lowers_to_triton():
  b, hkv, r, d, pages, ps, n = 2, 2, 8, 64, 16, 16, 8
  scale = canonical_scale(jnp.ones((hkv, pages, ps, 1)), (hkv, pages, ps, d), "k_scale")

  def fn(q, kp, vp, lengths, tables, ks):
    return pallas_partials(q, kp, vp, lengths, num_tokens=2, softmax_scale=0.125, num_splits=2,
                           block_k=64, interpret=False, backend="gpu", block_tables=tables,
                           k_scale=ks, v_scale=ks)

  text = _lower_for_cuda(fn, _sds((b, hkv, r, d), jnp.bfloat16), _sds((hkv, pages, ps, d), jnp.int8),
                         _sds((hkv, pages, ps, d), jnp.int8), _sds((b,), jnp.int32),
                         _sds((b, n), jnp.int32), _sds(scale.shape, jnp.float32))
  assert TRITON_CALL in text


@pytest.mark.parametrize("dk,page_size", [(80, None), (64, 12)])
def test_non_power_of_two_tiles_get_a_clear_error(dk, page_size):
  """Triton needs power-of-two tiles: head dim 80 or page size 12 are refused up front
  with a message naming them (flash_decode's impl=None picks the XLA path for them)."""
  paged = page_size is not None
  kv = _sds((2, 8, page_size, dk), jnp.float32) if paged else _sds((2, 2, 256, dk), jnp.float32)
  extra = dict(block_tables=jnp.zeros((2, 4), jnp.int32)) if paged else {}
  fn = functools.partial(pallas_partials, num_tokens=1, softmax_scale=0.1, num_splits=2, block_k=64,
                         interpret=False, backend="gpu", **extra)
  with pytest.raises(ValueError, match=rf"power-of-two head dims and block size.*Dk={dk}"):
    _lower_for_cuda(fn, _sds((2, 2, 4, dk), jnp.float32), kv, kv, _sds((2,), jnp.int32))
