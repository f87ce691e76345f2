"""The GPU kernel's sizing, checked on CPU: the float8 bit decode used below sm_89, the
launch plan against each chip's limits, and the split rule's wave. The compile tier
(tests/compile_tier) proves the same plans with XLA:GPU and ptxas."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fdecode import chips, config
from fdecode.kernels.triton import decode_fp8_bits, launch_plan


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_bit_decode_matches_every_byte(dtype):
  """All 256 bytes: the integer decode equals ml_dtypes' conversion, NaN / inf included."""
  raw = np.arange(256, dtype=np.uint8)
  expected = raw.view(np.dtype(getattr(ml_dtypes, jnp.dtype(dtype).name))).astype(np.float32)
  got = np.asarray(jax.jit(decode_fp8_bits, static_argnums=1)(jnp.asarray(raw), jnp.dtype(dtype).name))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
  fin = ~np.isnan(expected)
  np.testing.assert_array_equal(got[fin], expected[fin])  # exact, subnormals and signs included
  assert np.signbit(got[fin]).tolist() == np.signbit(expected[fin]).tolist()


@pytest.mark.parametrize("gpu", list(chips.GPUS.values()), ids=list(chips.GPUS))
@pytest.mark.parametrize("d,raw,compute,cols", [
    (128, 2, 2, 256), (256, 2, 2, 512), (128, 4, 4, 256), (256, 4, 4, 512),
    (576, 2, 2, 576), (576, 1, 2, 576), (80, 2, 2, 256)])
def test_launch_plan_fits_the_chip(gpu, d, raw, compute, cols):
  """The estimated shared memory fits the chip's per-block limit, the estimated registers
  a thread's 255, and the block stays a power of two >= 16."""
  plan = launch_plan(gpu, block_r=16, dq=d, dv=min(d, 512), cols=cols, raw_bytes=raw,
                     compute_bytes=compute, block_k=128)
  assert plan.smem <= gpu.smem_per_block
  assert plan.block >= 16 and plan.block & (plan.block - 1) == 0
  assert plan.warps in (4, 8)
  assert plan.regs <= 255


def test_gpu_splits_fill_a_wave():
  """B=8, Hkv=8 and B=1, Hkv=1 at long S: programs >= one wave; capped by blocks."""
  h100 = chips.H100
  wave = h100.sms * 2
  assert 64 * config.gpu_num_splits(wave, 64, 256) >= wave
  assert config.gpu_num_splits(wave, 1, 8192) == wave
  assert config.gpu_num_splits(wave, 1, 10) == 10       # never more splits than blocks
  assert config.gpu_num_splits(wave, 1000, 100) == 1    # a busy chip is not split


def test_residency_counts_every_limit():
  h100 = chips.H100
  assert h100.resident_programs(threads=128, regs=255, smem=0) == 2      # registers
  assert h100.resident_programs(threads=128, regs=32, smem=100_000) == 2  # shared memory
  assert h100.resident_programs(threads=1024, regs=32, smem=0) == 2      # threads
