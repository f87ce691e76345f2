"""The Triton kernel lowers for GPU, checked from CPU with cross-platform export.

No GPU is needed: `jax.export` runs Pallas' Triton lowering (which rejects tensors
whose sizes are not powers of two) and embeds the Triton IR in a custom call; we only
skip the serialization-compatibility check for that call. It does not compile the IR to
PTX or run it (scripts/gpu_check does, on a GPU).
"""

import jax
import jax.numpy as jnp
import pytest

import fdecode
from fdecode.kernels.triton import make_plan
from helpers.lowering import MODIFIER_CASES, TRITON_CALL, lower_for_cuda, modifier_call


HEAD_DIMS = [(64, 64), (80, 80), (96, 96), (112, 112), (128, 128), (192, 192), (256, 256), (576, 512)]


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _problem(*, dk, dv, dtype, page_size=None, t=1, g=4, s=300, tiles=1):
  """Abstract operands of a flash_decode call: contiguous, or paged with ``page_size``."""
  b, hkv = 2, 2
  q_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
  q = _sds((b, t, hkv * g, dk), q_dtype)
  opts = {}
  if page_size is None:
    k, v = _sds((b, hkv, s, dk), dtype), _sds((b, hkv, s, dv), dtype)
    scale = lambda d: _sds((b, hkv, s, tiles), jnp.float32)
  else:
    pages, n = 64, -(-s // page_size)
    k, v = _sds((hkv, pages, page_size, dk), dtype), _sds((hkv, pages, page_size, dv), dtype)
    opts["block_tables"] = _sds((b, n), jnp.int32)
    scale = lambda d: _sds((hkv, pages, page_size, tiles), jnp.float32)
  if dtype in (jnp.int8, jnp.float8_e4m3fn):
    opts.update(k_scale=scale(dk), v_scale=scale(dv))
  return (q, k, v, _sds((b,), jnp.int32)), opts


def _decode_fn(**static):
  return lambda q, k, v, n, opts: fdecode.flash_decode(q, k, v, n, **opts, **static)


@pytest.mark.parametrize("dk,dv", HEAD_DIMS)
@pytest.mark.parametrize("dtype,page_size", [(jnp.bfloat16, 16), (jnp.int8, None), (jnp.int8, 16)])
def test_every_head_dim_lowers_to_triton(dk, dv, dtype, page_size):
  """Contiguous bf16 at every head dim is compiled by ptxas for H100 and A100 in the
  compile tier (tests/compile_tier: contiguous-bfloat16-d*, same 16-row tiles), so it is
  not lowered here too."""
  args, opts = _problem(dk=dk, dv=dv, dtype=dtype, page_size=page_size, t=2)
  text = lower_for_cuda(_decode_fn(impl="pallas", num_splits=3), *args, opts)
  assert TRITON_CALL in text


@pytest.mark.parametrize("page_size", [1, 12, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn])
def test_any_page_size_lowers_to_triton(page_size, dtype):
  args, opts = _problem(dk=128, dv=128, dtype=dtype, page_size=page_size, g=8)
  assert TRITON_CALL in lower_for_cuda(_decode_fn(impl="pallas"), *args, opts)


@pytest.mark.parametrize("case", MODIFIER_CASES)
@pytest.mark.parametrize("page_size", [None, 16])
def test_score_modifiers_lower_to_triton(case, page_size):
  args, opts = _problem(dk=128, dv=128, dtype=jnp.bfloat16, page_size=page_size, t=2, g=4)
  assert TRITON_CALL in lower_for_cuda(*modifier_call(case, args, opts, page_size))


def test_tile_wise_scales_lower_to_triton():
  """FlashMLA-style 1x128 tiles over a 512 head dim: a piece per tile."""
  args, opts = _problem(dk=512, dv=512, dtype=jnp.float8_e4m3fn, tiles=4)
  assert TRITON_CALL in lower_for_cuda(_decode_fn(impl="pallas"), *args, opts)


def test_default_impl_picks_triton_for_cuda():
  """impl=None dispatches by the lowering platform: exporting for CUDA from a CPU host
  embeds the Triton kernel (not the CPU path), also for head dim 80."""
  args, opts = _problem(dk=80, dv=80, dtype=jnp.bfloat16)
  assert TRITON_CALL in lower_for_cuda(_decode_fn(), *args, opts)


@pytest.mark.parametrize("dk,tiles", [(40, 1), (128, 16)])  # pieces of 8 columns
def test_untileable_shapes(dk, tiles):
  """Triton's dot needs pieces >= 16 wide: the compiled kernel names the shape, and a
  CUDA export from this host lowers the XLA path instead (no Triton call)."""
  dtype = jnp.int8 if tiles > 1 else jnp.bfloat16
  args, opts = _problem(dk=dk, dv=dk, dtype=dtype, tiles=tiles)
  q, k, v, n = args
  with pytest.raises(ValueError, match=rf"Dk={dk} with {tiles} scale tile\(s\).*multiples of 16"):
    make_plan(q.shape, k, v, compute_dtype=q.dtype, out_dtype=q.dtype, interpret=False, **opts)
  for impl in (None, "pallas"):
    assert TRITON_CALL not in lower_for_cuda(_decode_fn(impl=impl), *args, opts)
