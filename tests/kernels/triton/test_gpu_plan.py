"""The GPU kernel's sizing, checked on CPU: the float8 bit decode used below sm_89, the
launch plan against each chip's limits, and the split rule's wave. The compile tier
(tests/compile_tier) proves the same plans with XLA:GPU and ptxas."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fdecode.kernels.common import chips
from fdecode.kernels.common.block import decode_fp8_bits
from fdecode.kernels.triton import (LAUNCH, PROGRAMS_PER_SM, CalibrationSample, check_calibration, gpu_busy,
                                    split_count, launch_plan, measure_calibration)


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
  assert gpu_busy(100, 132, 1) == pytest.approx(100 / 132)       # idle SMs
  assert gpu_busy(528, 132, 4) == 1.0                           # 4 a SM, one wave
  assert gpu_busy(528, 132, 3) == pytest.approx(528 / 396 / 2)  # 1.33 waves
  assert gpu_busy(400, 132, 1) == pytest.approx(400 / 132 / 4)  # 4 on the busiest SM


def test_gpu_splits_fill_every_sm_twice():
  """At least `PROGRAMS_PER_SM` programs a SM (or one a block); at most one split per
  block; a busy chip is not split; judged at every residency between, with the merge bytes."""
  sms, kv = chips.H100.sms, 2 ** 27
  pick = lambda residency, work, blocks, split_bytes=2 ** 17: split_count(
      sms, residency, work, blocks, cache_bytes=kv, split_bytes=split_bytes)
  for residency, work in [((3, 4), 8), ((1, 3), 64), ((2, 2), 1), ((3, 4), 512)]:
    splits = pick(residency, work, 8192)
    assert work * splits >= sms * min(residency[1], PROGRAMS_PER_SM)
  # B=1 Hkv=8 at 3 or 4 a SM: two programs a SM (the measured optimum on H100 / H200), not
  # the 198 splits of a full wave at the upper residency.
  assert pick((3, 4), 8, 8192) == 33
  assert pick((2, 2), 1, 10) == 10                                      # never more splits than blocks
  assert pick((1, 2), 8 * sms, 100) == 1                                # a full, even chip is not split
  assert pick((1, 1), 1000, 100) == 3         # 1000 programs: 7.6 on the mean SM, 8 on the busiest
  assert pick((3, 4), 8, 8192, split_bytes=2 ** 30) == 33               # dear merges: the fewest splits


def test_calibration_checks_and_regenerates_the_fractions():
  """The launch model's table (`fdecode.kernels.triton.LAUNCH`) against compiled samples:
  a kernel under a fraction of its estimate is named; the fractions are regenerated as
  the least ones, rounded down to 0.05."""
  fits = CalibrationSample("fits", smem_estimate=1000, regs_estimate=200, smem=800, regs=120)
  tight = CalibrationSample("tight", smem_estimate=1000, regs_estimate=200, smem=700, regs=60)
  assert check_calibration([fits]) == []
  assert [line.split(":")[0] for line in check_calibration([fits, tight])] == ["tight", "tight"]
  assert measure_calibration([fits, tight]) == dict(smem_measured=0.7, regs_measured=0.3)
  assert measure_calibration([fits])["smem_measured"] >= LAUNCH.smem_measured


def test_residency_counts_every_limit():
  h100 = chips.H100
  assert h100.resident_programs(threads=128, regs=255, smem=0) == 2      # registers
  assert h100.resident_programs(threads=128, regs=32, smem=100_000) == 2  # shared memory
  assert h100.resident_programs(threads=1024, regs=32, smem=0) == 2      # threads


# --- issue 31: any row count, and the interpreter runs the compiled plan -------------------

import dataclasses

import fdecode
from fdecode.kernels.triton import make_plan, row_tiling
from helpers import assert_close, make_problem, tol


@pytest.mark.parametrize("d", [64, 128, 256, 576])
def test_row_tiles_are_powers_of_two(d):
  """Every row count: blocks of a power of two >= 16 that cover the rows; one block
  (the next power of two) while it fits the register budget, never a block that pads a
  whole extra block of rows."""
  for rows in range(1, 600):
    block_r, blocks = row_tiling(rows, d, d)
    assert block_r >= 16 and block_r & (block_r - 1) == 0, (rows, block_r)
    assert block_r * blocks >= rows > block_r * (blocks - 1)
    if blocks == 1:
      assert block_r < 2 * max(rows, 16)


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("t,hq,hkv,paged,dtype", [
    (5, 14, 2, None, jnp.bfloat16), (1, 48, 1, None, jnp.bfloat16), (12, 8, 2, 16, jnp.float32),
    (5, 16, 2, None, jnp.int8), (3, 24, 2, 1, jnp.bfloat16), (64, 8, 2, 16, jnp.bfloat16)])
@pytest.mark.parametrize("gpu", list(chips.GPUS.values()), ids=list(chips.GPUS))
def test_interpreter_runs_the_compiled_plan(t, hq, hkv, paged, dtype, gpu):
  """`make_plan` with ``interpret=True`` is the compiled plan for the same GPU (rows,
  pieces, block, warps, float8 bit decode); only the flag differs when the splits are given."""
  b, s, d = 2, 1000, 128
  if paged:
    lead, tables = (hkv, b * -(-s // paged), paged), _sds((b, -(-s // paged)), jnp.int32)
  else:
    lead, tables = (b, hkv, s), None
  k = v = _sds(lead + (d,), dtype)
  scales = dict(k_scale=_sds(lead + (1,), jnp.float32), v_scale=_sds(lead + (1,), jnp.float32)) if dtype == jnp.int8 else {}
  plan = lambda interpret: make_plan((b, t, hq, d), k, v, compute_dtype=jnp.bfloat16 if dtype == jnp.int8 else dtype,
                                     out_dtype=jnp.bfloat16, block_tables=tables, num_splits=3,
                                     interpret=interpret, gpu=gpu, **scales)
  assert plan(True) == dataclasses.replace(plan(False), interpret=True)


ISSUE31 = {"t5-g7": (5, 14, 2, None), "t5-g8": (5, 16, 2, None), "t12-g4-paged16": (12, 8, 2, 16),
           "t9-g4-nhd": (9, 8, 2, "nhd"), "t3-g12": (3, 24, 2, None), "mqa48": (1, 48, 1, None),
           "mqa40-paged1": (1, 40, 1, 1), "t20-g8-two-row-blocks": (20, 8, 1, None)}


@pytest.mark.parametrize("name", list(ISSUE31))
@pytest.mark.parametrize("splits", [None, 4])
def test_issue31_row_counts_match_the_reference(name, splits):
  """The shapes that crashed the GPU (T x G rows of 35-160), interpreted with the H100
  plan the GPU compiles: bf16 against the float32 reference."""
  t, hq, hkv, form = ISSUE31[name]
  s, lengths = 70, jnp.array([70, 9], jnp.int32)
  q, k, v = make_problem(1, b=2, t=t, hq=hq, hkv=hkv, s=s, dk=64, dtype=jnp.bfloat16)
  want = fdecode.flash_decode(q, k, v, lengths, impl="reference", return_lse=True)
  kw = {}
  if isinstance(form, int):  # paged: sequence b's pages in order, then a garbage page
    n = -(-s // form)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, n * form - s), (0, 0)])
    pool = lambda x: jnp.concatenate([pad(x).reshape(2, hkv, n, form, 64).transpose(1, 0, 2, 3, 4).reshape(
        hkv, 2 * n, form, 64), jnp.full((hkv, 1, form, 64), jnp.nan, x.dtype)], axis=1)
    k, v = pool(k), pool(v)
    kw["block_tables"] = jnp.arange(2 * n, dtype=jnp.int32).reshape(2, n)
  elif form == "nhd":
    k, v, kw["kv_layout"] = k.swapaxes(1, 2), v.swapaxes(1, 2), "NHD"
  got = fdecode.flash_decode(q, k, v, lengths, impl="pallas", interpret=True, num_splits=splits,
                             return_lse=True, **kw)
  t_ = tol(jnp.bfloat16)
  assert_close(got[0], want[0], atol=t_["atol"], rtol=t_["rtol"])
  assert_close(got[1], want[1], atol=t_["lse"], rtol=t_["lse"], what="lse")


def test_issue31_int8_t5_g8_matches_the_reference():
  """int8 cache with per-token scales at T=5, G=8 (40 rows: one block of 64), interpreted with
  the H100 plan, one and three splits, against the reference on the same quantized cache."""
  from fdecode.cache.quant import quantize  # pylint: disable=g-import-not-at-top
  q, k, v = make_problem(3, b=2, t=5, hq=16, hkv=2, s=70, dk=64)
  (kq, ks), (vq, vs) = quantize(k, jnp.int8), quantize(v, jnp.int8)
  lengths = jnp.array([70, 33], jnp.int32)
  kw = dict(k_scale=ks, v_scale=vs, return_lse=True)
  want = fdecode.flash_decode(q, kq, vq, lengths, impl="reference", **kw)
  for splits in (None, 3):
    got = fdecode.flash_decode(q, kq, vq, lengths, impl="pallas", interpret=True, num_splits=splits, **kw)
    assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    assert_close(got[1], want[1], atol=2e-5, rtol=2e-5, what="lse")


def test_issue31_ragged_chunk40_g4_matches_per_sequence():
  """The ragged step that crashed the GPU: a 40-token prefill chunk at G=4 (160 rows) beside
  decodes, paged, interpreted with the H100 plan, against each sequence alone."""
  from helpers.ragged import batch, check, per_sequence  # pylint: disable=g-import-not-at-top
  p = batch(7, [1, 40, 1], [20, 40, 70], max_seqs=4, hq=8, hkv=2, d=64)
  out, lse = fdecode.ragged_decode(**p, impl="pallas", interpret=True, return_lse=True)
  check(p, out, lse, per_sequence(p))
