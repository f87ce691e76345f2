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


def test_gpu_busy_counts_both_tails():
  """The launch model the split count and the compile report share: SM balance and the
  last partial wave."""
  assert config.gpu_busy(100, 132, 1) == pytest.approx(100 / 132)       # idle SMs
  assert config.gpu_busy(528, 132, 4) == 1.0                           # 4 a SM, one wave
  assert config.gpu_busy(528, 132, 3) == pytest.approx(528 / 396 / 2)  # 1.33 waves
  assert config.gpu_busy(400, 132, 1) == pytest.approx(400 / 132 / 4)  # 4 on the busiest SM


def test_gpu_splits_fill_a_wave():
  """At least one full wave at the upper residency; at most one split per block; a busy
  chip is not split; judged at every residency between, with the merge bytes."""
  sms, kv = chips.H100.sms, 2 ** 27
  pick = lambda residency, work, blocks, split_bytes=2 ** 17: config.gpu_num_splits(
      sms, residency, work, blocks, cache_bytes=kv, split_bytes=split_bytes)
  for residency, work in [((3, 4), 8), ((1, 3), 64), ((2, 2), 1), ((3, 4), 512)]:
    splits = pick(residency, work, 8192)
    assert work * splits >= sms * residency[1]
    # B=1 Hkv=8 at 3 or 4 a SM: a multiple of both waves (1584 programs), not 528 (1.33
    # waves at 3) or 396 (0.75 of a wave at 4)
  assert pick((3, 4), 8, 8192) * 8 % (sms * 12) == 0
  assert all(config.gpu_busy(8 * pick((3, 4), 8, 8192), sms, r) == 1.0 for r in (3, 4))
  assert pick((2, 2), 1, 10) == 10                                      # never more splits than blocks
  assert pick((1, 2), 8 * sms, 100) == 1                                # a full, even chip is not split
  assert pick((1, 1), 1000, 100) == 3         # 1000 programs: 7.6 on the mean SM, 8 on the busiest
  assert pick((3, 4), 8, 8192, split_bytes=2 ** 30) == 66               # dear merges: the fewest splits


def test_residency_counts_every_limit():
  h100 = chips.H100
  assert h100.resident_programs(threads=128, regs=255, smem=0) == 2      # registers
  assert h100.resident_programs(threads=128, regs=32, smem=100_000) == 2  # shared memory
  assert h100.resident_programs(threads=1024, regs=32, smem=0) == 2      # threads
