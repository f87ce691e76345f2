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

Cost: the kernel body compiles once per call (`mosaic_gpu_interpret.compiled_once`),
about 2.5 s of CPU, and each program (one sequence x split x 64 rows) runs in well under
1 s more; the file runs 11 programs in 4 calls (about 25 s of CPU).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from conftest import assert_close, tol
from fdecode.combine import merge_states
from fdecode.kernels import mosaic_gpu
from fdecode.kernels.mosaic_gpu.plan import mla_plan, split_count, unsupported

from mosaic_gpu_interpret import INTERPRET, assert_no_races, interpreter  # noqa: F401  (interpreter: a fixture)

DK, DV = 576, 512
pytestmark = pytest.mark.usefixtures("interpreter")


def problem(seed, b, g, s):
  kq, kk = jax.random.split(jax.random.key(seed))
  q = jax.random.normal(kq, (b, g, DK), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, 1, s, DK), jnp.float32).astype(jnp.bfloat16)
  return q, k


def reference(q, k, lengths):
  return fdecode.flash_decode(q, k, None, lengths, v_head_dim=DV, impl="reference", return_lse=True)


def run_kernel(q, k, lengths, num_splits=None):
  out, lse = mosaic_gpu.mla_decode(q, k, lengths, num_splits=num_splits, return_lse=True, interpret=INTERPRET)
  assert_no_races()
  return out, lse


def check(out, lse, want_out, want_lse):
  t = tol(jnp.bfloat16)
  assert_close(out, want_out, atol=t["atol"], rtol=t["rtol"])
  assert_close(lse, want_lse, atol=t["lse"], rtol=t["lse"], what="lse")


def with_garbage_past(k, lengths, value):
  """k with ``value`` (NaN, inf) in every slot at or past each sequence's length."""
  dead = jnp.arange(k.shape[2])[None, None, :, None] >= jnp.asarray(lengths)[:, None, None, None]
  return jnp.where(dead, value, k).astype(k.dtype)


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


def test_unsupported_names_paging_and_modifiers():
  args = dict(q_shape=(2, 16, DK), q_dtype="bfloat16", k_shape=(2, 1, 64, DK), k_dtype="bfloat16",
              v_is_none=True, v_head_dim=DV)
  assert unsupported(**args) is None
  assert "paged" in unsupported(**args, paged=True)
  assert "8-bit" in unsupported(**args, quantized=True)
  assert "modifiers" in unsupported(**args, modifiers=True)
  assert "v_head_dim=512" in unsupported(**dict(args, v_head_dim=128))


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
