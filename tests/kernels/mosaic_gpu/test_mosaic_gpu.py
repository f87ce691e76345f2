"""The Hopper MLA kernel (`fdecode.kernels.mosaic_gpu`) under jax's Mosaic GPU interpreter.

What the interpreter runs (jax 0.10.2, CPU): the kernel body as written, its three
warpgroups as threads, the TMA copies gmem -> smem and their barriers (with byte counts
and phases checked: a phase nobody waits for fails), the warpgroups' own barriers, the
swizzled smem tiles as plain arrays, the PV wgmma (smem A and B), loads and stores of
smem and of the outputs in gmem, the loop over a split's blocks, the split ranges and the
masks; uninitialized buffers hold NaN, so a read of memory nobody wrote shows. What it
does not run (substituted in `fdecode.kernels.mosaic_gpu.ops.Ops`, proven only by a
GPU run, `benchmarks/bench_mosaic_gpu.py`): the QK^T wgmma with a transposed smem operand
(a dot of the same smem tiles here), ``pl.run_state`` accumulation into ``alpha * O`` (a
fresh accumulator added to it here), register layouts, ``setmaxnreg``, asynchronous wgmma
and TMA timing, swizzle addressing, and ptxas.

Tolerances (`conftest.TOLERANCES`, bfloat16): the reference is float32 over the same
bf16 inputs; the kernel rounds the softmax weights to bf16 for the PV matmul (relative
error 2^-9 per weight) and accumulates in float32.

8-bit caches: the codes convert to bf16 exactly and the reference dequantizes the same
codes and scales in float32, so the tolerances are bf16's too (P, with the scale folded
in, is rounded to bf16).

Cost: the kernel body compiles once per call (`helpers.mosaic_gpu.compiled_once`),
about 2.5 s of CPU, and each program (one sequence x split x 64 rows) runs in well under
1 s more; the file runs 28 programs in 7 calls (about 42 s on one core; the three 8-bit
calls, 17 programs, about 17 s of it).
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.combine import merge_states
from fdecode.kernels import mosaic_gpu
from fdecode.cache.quant import quantize
from fdecode.kernels.mosaic_gpu import mla_plan, split_count, unsupported

from helpers import randn
from helpers.mosaic_gpu import INTERPRET, assert_no_races, check, interpreter, with_garbage_past  # noqa: F401  (interpreter: a fixture)

DK, DV = 576, 512
pytestmark = pytest.mark.usefixtures("interpreter")


def problem(seed, b, g, s):
  rng = np.random.default_rng(seed)
  q = randn(rng, (b, g, DK), jnp.bfloat16)
  k = randn(rng, (b, 1, s, DK), jnp.bfloat16)
  return q, k


def reference(q, k, lengths):
  return fdecode.flash_decode(q, k, None, lengths, v_head_dim=DV, impl="reference", return_lse=True)


def run_kernel(q, k, lengths, num_splits=None):
  out, lse = mosaic_gpu.mla_decode(q, k, lengths, num_splits=num_splits, return_lse=True, interpret=INTERPRET)
  assert_no_races()
  return out, lse


def test_lengths_around_the_block_with_garbage_tails():
  """G = 64; lengths 0, bk + 1 and S (S = 130: not a multiple of the 64-token block, nor
  of the TMA's 8 rows, so the cache is padded and its last block loaded overlapped); NaN
  past every length is selected away (the reference reads the clean cache)."""
  q, k = problem(0, 3, 64, 130)
  lengths = jnp.array([0, 65, 130], jnp.int32)
  out, lse = run_kernel(q, with_garbage_past(k, lengths, jnp.nan), lengths, num_splits=1)
  check(out, lse, *reference(q, k, lengths))
  assert np.all(np.asarray(lse[0]) == -np.inf) and np.all(np.asarray(out[0]) == 0)


def test_short_cache_and_inf_tail():
  """S = 63 < bk (padded to one block), G = 16, lengths 1 and bk - 1; +inf past them."""
  q, k = problem(1, 2, 16, 63)
  lengths = jnp.array([1, 63], jnp.int32)
  out, lse = run_kernel(q, with_garbage_past(k, lengths, jnp.inf), lengths, num_splits=1)
  check(out, lse, *reference(q, k, lengths))


def test_split_partials_merge_to_the_reference():
  """`mla_partials` returns per-split states: o f32 [B, 1, n, R, 512], lse f32
  [B, 1, n, R]; S = 300 in 2 splits (3 and 2 blocks: the 2-slot TMA ring refills a
  slot), merged by `merge_states` into the reference; and the kernel's own padded states
  (`mla_states`), merged by the Triton combine kernel as the GPU dispatch does
  (interpreted here), give the same."""
  from fdecode.kernels import triton as triton_kernels  # pylint: disable=g-import-not-at-top
  b, g, s = 1, 16, 300
  q, k = problem(2, b, g, s)
  lengths = jnp.array([s], jnp.int32)
  plan = mla_plan(batch=b, num_tokens=1, group=g, seq_len=s, softmax_scale=1 / math.sqrt(DK), num_splits=2)
  raw_o, raw_lse = mosaic_gpu.mla_states(q[:, None], lengths, k, plan=plan, interpret=INTERPRET)
  o, lse = raw_o[:, None, :, :g], raw_lse[:, None, :, :g]  # what mla_partials returns
  assert o.shape == (b, 1, 2, g, DV) and lse.shape == (b, 1, 2, g)
  assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
  out, merged_lse = merge_states(o, lse, axis=2)
  want = reference(q, k, lengths)
  check(out[:, 0], merged_lse[:, 0], *want)
  cp = triton_kernels.CombinePlan(num_splits=2, width=triton_kernels.combine_width(2, DV), num_tokens=1, group=g,
                                  hq=g, dv=DV, out_dtype="bfloat16", interpret=True, split_major=True)
  out2, lse2 = triton_kernels.combine(cp, raw_o, raw_lse)
  check(out2, lse2, *want)


def test_partials_at_rows_off_the_smem_tiles():
  """`mla_partials` takes any G (mla_decode: multiples of 16). G = 12 rows are not whole
  8-row tiles of the q tile's smem layout, so q is padded to the 64-row tile (a TMA slice
  of 12 rows would not lower); G = 16 is copied into the tile's first rows."""
  for g in (12, 16):
    q, k = problem(5, 1, g, 70)
    lengths = jnp.array([70], jnp.int32)
    plan = mla_plan(batch=1, num_tokens=1, group=g, seq_len=70, softmax_scale=1 / math.sqrt(DK), num_splits=1)
    assert plan.q_rows == (64 if g == 12 else g)
    o, lse = mosaic_gpu.mla_partials(q[:, None], lengths, k, plan=plan, interpret=INTERPRET)
    check(o[:, 0, 0], lse[:, 0, 0], *reference(q, k, lengths))


def test_corruption_a_row_sees_makes_its_whole_row_nan():
  """Sequence 0 (length 10) sees a NaN key at position 5: every row NaN. Sequences 2 and
  3 (length 10) see a +inf at position 3 in a *value* column (the latent row's column 300,
  in warpgroup 1's half of the output, or column 7, in warpgroup 0's) whose q column is
  negative for every row: the score is -inf, p = 0, and ``0 * inf`` is NaN in that one
  column of one half's accumulator; the two-way epilogue exchange makes every column of
  the row (both halves) and its lse NaN. Sequence 1 (length 5; the same NaN and infs at
  5-7, past its length) is the clean reference."""
  q, k = problem(4, 4, 16, 64)
  q = q.at[2:, :, 300].set(-jnp.abs(q[2:, :, 300]) - 0.5).at[2:, :, 7].set(-jnp.abs(q[2:, :, 7]) - 0.5)
  clean = k
  k = k.at[0, :, 5, 7].set(jnp.nan).at[2, :, 3, 300].set(jnp.inf).at[3, :, 3, 7].set(jnp.inf)
  k = k.at[1, :, 5, 7].set(jnp.nan).at[1, :, 6, 300].set(jnp.inf).at[1, :, 7, 7].set(jnp.inf)
  lengths = jnp.array([10, 5, 10, 10], jnp.int32)
  out, lse = run_kernel(q, k, lengths, num_splits=1)
  bad = np.array([0, 2, 3])
  assert np.all(np.isnan(np.asarray(out[bad], np.float32))) and np.all(np.isnan(np.asarray(lse[bad])))
  want_out, want_lse = reference(q[1:2], clean[1:2], lengths[1:2])
  check(out[1:2], lse[1:2], want_out, want_lse)


def quantized_problem(seed, b, g, s, dtype):
  """q bf16 [B, G, 576]; the latent cache quantized per token: k ``dtype`` [B, 1, S, 576],
  k_scale float32 [B, 1, S, 1] (`fdecode.cache.quant.quantize`)."""
  q, k = problem(seed, b, g, s)
  k, k_scale = quantize(k.astype(jnp.float32), dtype)
  return q, k, k_scale


def reference_8bit(q, k, k_scale, lengths):
  return fdecode.flash_decode(q, k, None, lengths, v_head_dim=DV, k_scale=k_scale, impl="reference",
                              return_lse=True)


def run_8bit(q, k, k_scale, lengths, num_splits):
  out, lse = mosaic_gpu.mla_decode(q, k, lengths, k_scale=k_scale, num_splits=num_splits, return_lse=True,
                                   interpret=INTERPRET)
  assert_no_races()
  return out, lse


@pytest.mark.parametrize("dtype, g, s, lengths, splits", [
    # S = 130: neither a multiple of the 64-token block nor of the TMA's 8 rows (padded);
    # lengths 0, 1, bk - 1, S; two splits (the one of length 1 has nothing in its second).
    (jnp.int8, 16, 130, (0, 1, 63, 130), 2),
    # G = 32, S = 300: lengths bk + 1 and 290 (the last block loaded overlapped from 236)
    # in three splits; the 2-slot TMA ring refills the 8-bit slots.
    (jnp.float8_e4m3fn, 32, 300, (65, 290), 3),
])
def test_8bit_latents_match_the_reference_with_garbage_past_lengths(dtype, g, s, lengths, splits):
  """int8 / float8_e4m3fn latent caches with one float32 scale per token (FlashMLA's 576
  columns, values the first 512, all 8-bit) against the float32 reference over the same
  codes and scales. Past every length: the largest code (e4m3: the NaN code) and NaN k
  scales (e4m3: +inf), which the conversion's dead-row select, the score select and the
  probability select keep out (the reference reads the clean cache)."""
  q, k, ks = quantized_problem(5, len(lengths), g, s, dtype)
  lengths = jnp.array(lengths, jnp.int32)
  code, bad_scale = (127, jnp.nan) if dtype == jnp.int8 else (jnp.nan, jnp.inf)
  out, lse = run_8bit(q, with_garbage_past(k, lengths, code), with_garbage_past(ks, lengths, bad_scale), lengths,
                      splits)
  check(out, lse, *reference_8bit(q, k, ks, lengths))
  empty = np.asarray(lengths) == 0
  assert np.all(np.asarray(lse)[empty] == -np.inf) and np.all(np.asarray(out, np.float32)[empty] == 0)


def test_8bit_corruption_a_row_sees_makes_its_whole_row_nan():
  """e4m3, G = 16, S = 64, lengths 10: sequence 0 sees e4m3's NaN code in its last visible
  slot (9), in latent column 300 (a key column and warpgroup 1's value half, converted by
  warpgroup 1), sequence 1 a NaN scale in slot 9: every column of their out and their
  lse is NaN (a select that stopped a slot early would hide them). Sequence 2 (length 5)
  holds both past its length (slots 5 and 7): the reference.

  In MLA an 8-bit value is also a key column, so a NaN code reaches the scores (and the
  whole row) before the epilogue's row rule; e4m3 has no inf code, and a NaN or inf
  scale reaches S or P in every column."""
  q, k, ks = quantized_problem(6, 3, 16, 64, jnp.float8_e4m3fn)
  nan8 = jnp.array(jnp.nan, jnp.float32).astype(k.dtype)
  k_bad = k.at[0, 0, 9, 300].set(nan8).at[2, 0, 5, 300].set(nan8)
  ks_bad = ks.at[1, 0, 9].set(jnp.nan).at[2, 0, 7].set(jnp.nan)
  lengths = jnp.array([10, 10, 5], jnp.int32)
  out, lse = run_8bit(q, k_bad, ks_bad, lengths, 1)
  assert np.all(np.isnan(np.asarray(out[:2], np.float32))) and np.all(np.isnan(np.asarray(lse[:2])))
  check(out[2:], lse[2:], *reference_8bit(q[2:], k[2:], ks[2:], lengths[2:]))


def test_8bit_refuses_what_it_cannot_take():
  q = jnp.zeros((2, 16, DK), jnp.bfloat16)
  k8, one = jnp.zeros((2, 1, 64, DK), jnp.int8), jnp.ones((2, 1, 64, 1), jnp.float32)
  n = jnp.array([1, 2], jnp.int32)
  with pytest.raises(ValueError, match="needs k_scale"):
    mosaic_gpu.mla_decode(q, k8, n)
  with pytest.raises(ValueError, match="takes none"):
    mosaic_gpu.mla_decode(q, k8.astype(jnp.bfloat16), n, k_scale=one)
  with pytest.raises(ValueError, match="one k_scale per token"):
    mosaic_gpu.mla_decode(q, k8, n, k_scale=jnp.ones((2, 1, 64, 4), jnp.float32))
  with pytest.raises(ValueError, match="float8_e4m3fn cache"):
    mosaic_gpu.mla_decode(q, k8.astype(jnp.float8_e5m2), n, k_scale=one)
  with pytest.raises(ValueError, match="k_scale must be a scalar or shaped like the cache"):
    mosaic_gpu.mla_decode(q, k8, n, k_scale=jnp.ones((2, 1, 32, 1), jnp.float32))


@pytest.mark.parametrize("kwargs, match", [
    (dict(q=(2, 8, DK)), "multiple of 16"),
    (dict(q=(2, 2, 16, DK)), "T=1"),
    (dict(q_dtype=jnp.float32), "bfloat16"),
    (dict(k=(2, 2, 64, DK)), "one latent kv head"),
    (dict(k=(2, 1, 64, 512)), "one latent kv head"),
])
def test_refuses_what_it_cannot_take(kwargs, match):
  q = jnp.zeros(kwargs.get("q", (2, 16, DK)), kwargs.get("q_dtype", jnp.bfloat16))
  k = jnp.zeros(kwargs.get("k", (2, 1, 64, DK)), jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    mosaic_gpu.mla_decode(q, k, jnp.array([1, 2], jnp.int32))


def test_refuses_concrete_lengths_out_of_range():
  q, k = jnp.zeros((2, 16, DK), jnp.bfloat16), jnp.zeros((2, 1, 64, DK), jnp.bfloat16)
  with pytest.raises(ValueError, match="lengths must lie in"):
    mosaic_gpu.mla_decode(q, k, jnp.array([1, 65], jnp.int32))


def test_unsupported_names_paging_modifiers_and_the_caches_it_takes():
  args = dict(q_shape=(2, 16, DK), q_dtype="bfloat16", k_shape=(2, 1, 64, DK), k_dtype="bfloat16",
              v_is_none=True, v_head_dim=DV)
  assert unsupported(**args) is None
  assert "paged" in unsupported(**args, paged=True)
  assert "modifiers" in unsupported(**args, modifiers=True)
  assert "v_head_dim=512" in unsupported(**dict(args, v_head_dim=128))
  assert "takes none" in unsupported(**args, k_scale_shape=(2, 1, 64, 1))
  for dtype in ("int8", "float8_e4m3fn"):
    q8 = dict(args, k_dtype=dtype)
    assert unsupported(**q8, k_scale_shape=(2, 1, 64, 1)) is None
    assert unsupported(**q8, k_scale_shape=(1, 1, 1, 1)) is None
    assert "needs k_scale" in unsupported(**q8)
    assert "one k_scale per token" in unsupported(**q8, k_scale_shape=(2, 1, 64, 4))
    # fdecode.flash_decode's default dispatch keeps 8-bit MLA on Triton (unmeasured here).
    assert "opt-in" in unsupported(**q8, k_scale_shape=(2, 1, 64, 1), default_dispatch=True)
  assert unsupported(**args, default_dispatch=True) is None
  assert "float8_e4m3fn cache" in unsupported(**dict(args, k_dtype="float8_e5m2"), k_scale_shape=(2, 1, 64, 1))


def test_plan_fits_shared_memory_and_fills_the_gpu():
  from fdecode.kernels.common import chips
  plan = mla_plan(batch=64, num_tokens=1, group=128, seq_len=4096, softmax_scale=0.1, gpu=chips.H100)
  assert plan.grid == (2, plan.num_splits, 64) and plan.smem_bytes() <= chips.H100.smem_per_block
  # Few sequences: splits until the programs fill the SMs (8 x 1 row block -> >= 132 / 8).
  assert split_count(chips.H100, 8, 512) * 8 >= chips.H100.sms * 0.9
  assert split_count(chips.H100, 256, 64) == 1  # already two waves of programs
  assert mla_plan(batch=1, num_tokens=1, group=16, seq_len=777, softmax_scale=1.0, gpu=chips.H100).cache_rows == 784
  with pytest.raises(ValueError, match="multiple of 64"):
    mla_plan(batch=1, num_tokens=1, group=16, seq_len=64, softmax_scale=1.0, block_k=32, gpu=chips.H100)
  with pytest.raises(ValueError, match="shared memory"):
    mla_plan(batch=1, num_tokens=1, group=16, seq_len=64, softmax_scale=1.0, stages=3, gpu=chips.H100)
  for dtype in ("int8", "float8_e4m3fn"):  # Q, two 8-bit stages, one bf16 tile, P, scales: 225 KiB
    plan = mla_plan(batch=64, num_tokens=1, group=128, seq_len=4096, softmax_scale=0.1, cache_dtype=dtype,
                    gpu=chips.H100)
    assert plan.quantized and plan.smem_bytes() <= chips.H100.smem_per_block
    with pytest.raises(ValueError, match="shared memory"):
      mla_plan(batch=1, num_tokens=1, group=16, seq_len=64, softmax_scale=1.0, cache_dtype=dtype, stages=3,
               gpu=chips.H100)
