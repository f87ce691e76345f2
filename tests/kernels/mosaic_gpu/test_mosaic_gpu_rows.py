"""The Hopper GQA rows kernel (`fdecode.kernels.mosaic_gpu.rows_decode`) under jax's Mosaic
GPU interpreter (CPU, race detection on), against the float32 reference.

What the interpreter runs and what it does not is as for the MLA kernel
(tests/kernels/mosaic_gpu/test_mosaic_gpu.py): the body, its two warpgroups as threads, the TMA copies and
barriers (byte counts and phases checked), smem tiles as plain arrays, the PV wgmma, the
masks, the operand preparation and the NaN guard run; the Q K^T wgmma with a transposed
operand, ``pl.run_state``, register layouts (the scales' column layout included),
swizzles, ``setmaxnreg`` and ptxas are substituted or ignored (only a GPU proves them).

Tolerances: bfloat16's (`conftest.TOLERANCES`): the kernel rounds P (with ``v_scale``
folded in, for 8-bit caches) to bf16 for the PV wgmma; 8-bit tiles convert to bf16
exactly. Cost: the interpreter compiles the kernel body for each program (64 rows x
one split of one sequence and kv head) and warpgroup thread, about 2.5 s of CPU a
program whatever its blocks; `helpers.mosaic_gpu.compiled_once` compiles it once per
call, so a call costs about that once plus well under 1 s a program. The file runs 10
programs in 4 calls, each call's batch holding several cases: about 25 s of CPU in all.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.combine import merge_states
from fdecode.kernels import mosaic_gpu
from fdecode.kernels.common import chips
from fdecode.cache.quant import quantize
from fdecode.kernels.mosaic_gpu import rows_plan, rows_unsupported

from helpers import randn
from helpers.mosaic_gpu import INTERPRET, assert_no_races, check, interpreter, with_garbage_past  # noqa: F401  (interpreter: a fixture)

pytestmark = pytest.mark.usefixtures("interpreter")


def problem(seed, *, b, t, hq, hkv, s, d, dtype=jnp.bfloat16):
  """q bf16 [B, T, Hq, D]; k, v [B, Hkv, S, D] in ``dtype`` (8-bit: quantized per token,
  with float32 scales [B, Hkv, S, 1]); returns (q, k, v, k_scale, v_scale)."""
  rng = np.random.default_rng(seed)
  q = randn(rng, (b, t, hq, d), jnp.bfloat16)
  k = randn(rng, (b, hkv, s, d))
  v = randn(rng, (b, hkv, s, d))
  if dtype == jnp.bfloat16:
    return q, k.astype(dtype), v.astype(dtype), None, None
  (k, ks), (v, vs) = quantize(k, dtype), quantize(v, dtype)
  return q, k, v, ks, vs


def reference(q, k, v, lengths, ks=None, vs=None):
  return fdecode.flash_decode(q, k, v, lengths, k_scale=ks, v_scale=vs, impl="reference", return_lse=True)


def run_kernel(q, k, v, lengths, ks=None, vs=None, num_splits=None):
  out, lse = mosaic_gpu.rows_decode(q, k, v, lengths, k_scale=ks, v_scale=vs, num_splits=num_splits,
                                    return_lse=True, interpret=INTERPRET)
  assert_no_races()
  return out, lse


def nan_rows_and_reference(out, lse, sees, want_out, want_lse):
  """Rows where ``sees`` [B, T] holds: NaN in every column of out and in lse; the other
  rows: the reference."""
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  check(out[~sees], lse[~sees], np.asarray(want_out, np.float32)[~sees], np.asarray(want_lse)[~sees])
  assert np.all(np.isnan(out[sees])) and np.all(np.isnan(lse[sees]))


def test_bf16_lengths_garbage_tails_and_nan_reaching_only_its_rows():
  """bf16, D = 64, T = 4 causal tokens x G = 16 = 64 rows (token t sees keys < L - 3 + t),
  S = 130 (not a multiple of the 64-token block nor of 8: padded cache); NaN keys and
  +inf values past every length are selected away (the reference reads the clean cache).
  Lengths: 0 (no block: out 0, lse -inf); 1 with a NaN *key* at 0 (tokens 0-2 see
  nothing: 0 / -inf, from the positions; token 3 sees it: NaN); bk + 1 (two blocks) with
  a NaN *value* at 63 (tokens 2, 3 see it: NaN; tokens 0, 1 do not, though their rows
  share the PV wgmma's value tile: the guard, in place in the bf16 V slot)."""
  q, k, v, _, _ = problem(0, b=3, t=4, hq=16, hkv=1, s=130, d=64)
  lengths = jnp.array([0, 1, 65], jnp.int32)
  want_out, want_lse = reference(q, k, v, lengths)
  k_bad = with_garbage_past(k, lengths, jnp.nan).at[1, 0, 0, 3].set(jnp.nan)
  v_bad = with_garbage_past(v, lengths, jnp.inf).at[2, 0, 63, 5].set(jnp.nan)
  out, lse = run_kernel(q, k_bad, v_bad, lengths, num_splits=1)
  sees = np.array([[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1]], bool)  # [B, T]
  nan_rows_and_reference(out, lse, sees, want_out, want_lse)
  assert np.all(np.asarray(lse[0]) == -np.inf) and np.all(np.asarray(out[0], np.float32) == 0)
  assert np.all(np.asarray(lse[1, :3]) == -np.inf) and np.all(np.asarray(out[1, :3], np.float32) == 0)


def test_e4m3_two_row_blocks_garbage_and_nan_code():
  """float8_e4m3fn k / v with per-token scales, D = 128, S = 130, T = 5 causal tokens x
  G = 16 = 80 rows: two row blocks (the second 48 padding rows), length 120, one split.
  Garbage past the length (extreme codes, NaN k scales, inf v scales) is selected away;
  e4m3's NaN code in a *value* at 118 reaches tokens 3 and 4 (one in each row block)
  only: the guard in the conversion pass."""
  q, k, v, ks, vs = problem(1, b=1, t=5, hq=16, hkv=1, s=130, d=128, dtype=jnp.float8_e4m3fn)
  lengths = jnp.array([120], jnp.int32)
  want_out, want_lse = reference(q, k, v, lengths, ks, vs)
  k_bad, v_bad = with_garbage_past(k, lengths, 448.0), with_garbage_past(v, lengths, -448.0)
  v_bad = v_bad.at[0, 0, 118, 5].set(jnp.array(jnp.nan, jnp.float32).astype(v.dtype))
  ks_bad, vs_bad = with_garbage_past(ks, lengths, jnp.nan), with_garbage_past(vs, lengths, jnp.inf)
  out, lse = run_kernel(q, k_bad, v_bad, lengths, ks_bad, vs_bad, num_splits=1)
  nan_rows_and_reference(out, lse, np.array([[0, 0, 0, 1, 1]], bool), want_out, want_lse)


def test_int8_partials_are_per_split_states():
  """`rows_partials` returns float32 ``o [B, Hkv, n, R, D]``, ``lse [B, Hkv, n, R]``;
  int8 with per-token scales, D = 256 (the widest head dim), T = 1 x G = 64, S = 300,
  length 290 in 2 splits of 3 and 2 blocks (the 2-slot ring refills a slot; the last
  block is loaded overlapped from 240 and holds slots past the length: extreme codes,
  NaN k scales, inf v scales, selected away); the states merge to the reference."""
  q, k, v, ks, vs = problem(2, b=1, t=1, hq=64, hkv=1, s=300, d=256, dtype=jnp.int8)
  lengths = jnp.array([290], jnp.int32)
  plan = rows_plan(batch=1, kv_heads=1, num_tokens=1, group=64, head_dim=256, seq_len=300,
                   softmax_scale=1 / math.sqrt(256), cache_dtype="int8", num_splits=2)
  k_bad, v_bad = with_garbage_past(k, lengths, 127), with_garbage_past(v, lengths, -127)
  ks_bad, vs_bad = with_garbage_past(ks, lengths, jnp.nan), with_garbage_past(vs, lengths, jnp.inf)
  o, lse = mosaic_gpu.rows_partials(q.reshape(1, 1, 64, 256), lengths, k_bad, v_bad, ks_bad, vs_bad, plan=plan,
                                    interpret=INTERPRET)
  assert_no_races()
  assert o.shape == (1, 1, 2, 64, 256) and lse.shape == (1, 1, 2, 64)
  assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
  out, merged = merge_states(o, lse, axis=2)
  want_out, want_lse = reference(q, k, v, lengths, ks, vs)
  check(out.reshape(1, 1, 64, 256), merged.reshape(1, 1, 64), want_out, want_lse)


def test_single_token_corrupt_value_makes_the_whole_row_nan():
  """T = 1 (no guard: every row of a program sees the same slots), bf16, D = 64, G = 64,
  S = 130: a NaN value (sequence 1, slot 10, column 3) or a +inf value (sequence 2, slot
  20, column 40) that the rows see reaches their accumulators in one column; the epilogue
  makes every column of those rows' out and their lse NaN (docs/semantics.md "Corruption
  a query sees propagates"). Sequence 0 (length 100: two blocks; NaN keys and +inf values
  past it) sees neither: the reference."""
  q, k, v, _, _ = problem(4, b=3, t=1, hq=64, hkv=1, s=130, d=64)
  lengths = jnp.array([100, 64, 64], jnp.int32)
  want_out, want_lse = reference(q, k, v, lengths)
  v_bad = with_garbage_past(v, lengths, jnp.inf).at[1, 0, 10, 3].set(jnp.nan).at[2, 0, 20, 40].set(jnp.inf)
  out, lse = run_kernel(q, with_garbage_past(k, lengths, jnp.nan), v_bad, lengths, num_splits=1)
  nan_rows_and_reference(out, lse, np.array([[0], [1], [1]], bool), want_out, want_lse)


@pytest.mark.parametrize("kwargs, match", [
    (dict(q=(2, 8, 96)), "head dim"),
    (dict(q_dtype=jnp.float32), "bfloat16 q"),
    (dict(k=(2, 3, 64, 64)), "multiple of Hkv"),
    (dict(v=(2, 2, 64, 128)), "one shape"),
    (dict(k_dtype=jnp.float8_e5m2), "float8_e4m3fn cache"),
    (dict(k_dtype=jnp.int8), "needs k_scale and v_scale"),
    (dict(scales=True), "takes none"),
])
def test_refuses_what_it_cannot_take(kwargs, match):
  qs = kwargs.get("q", (2, 8, 64))
  ks = kwargs.get("k", (2, 2, 64, qs[-1]))
  kd = kwargs.get("k_dtype", jnp.bfloat16)
  q = jnp.zeros(qs, kwargs.get("q_dtype", jnp.bfloat16))
  k = jnp.zeros(ks, kd)
  v = jnp.zeros(kwargs.get("v", ks), kd)
  sc = jnp.ones((*ks[:3], 1), jnp.float32) if kwargs.get("scales") else None
  with pytest.raises(ValueError, match=match):
    mosaic_gpu.rows_decode(q, k, v, jnp.array([1, 2], jnp.int32), k_scale=sc, v_scale=sc)


def test_refuses_bad_lengths_and_scales():
  q, k = jnp.zeros((2, 8, 64), jnp.bfloat16), jnp.zeros((2, 2, 64, 64), jnp.int8)
  one = jnp.ones((2, 2, 64, 1), jnp.float32)
  with pytest.raises(ValueError, match="lengths must lie in"):
    mosaic_gpu.rows_decode(q, k, k, jnp.array([1, 65], jnp.int32), k_scale=one, v_scale=one)
  with pytest.raises(ValueError, match="one scale per token"):
    mosaic_gpu.rows_decode(q, k, k, jnp.array([1, 2], jnp.int32), k_scale=jnp.ones((2, 2, 64, 2)), v_scale=one)
  with pytest.raises(ValueError, match="both k_scale and v_scale"):
    mosaic_gpu.rows_decode(q, k, k, jnp.array([1, 2], jnp.int32), k_scale=one)
  assert "page_size=4 is not a multiple of 8" in rows_unsupported(
      q_shape=(2, 8, 64), q_dtype="bfloat16", k_shape=(2, 9, 4, 64), k_dtype="bfloat16", v_shape=(2, 9, 4, 64),
      v_dtype="bfloat16", scales=False, paged=True)


def test_plan_fits_shared_memory_at_every_head_dim():
  for d in (64, 128, 256):
    for dtype in ("bfloat16", "int8", "float8_e4m3fn"):
      plan = rows_plan(batch=8, kv_heads=8, num_tokens=4, group=16, head_dim=d, seq_len=8192,
                       softmax_scale=0.1, cache_dtype=dtype, gpu=chips.H100)
      assert plan.smem_bytes() <= chips.H100.smem_per_block, (d, dtype, plan.smem_bytes())
      assert plan.grid == (1, plan.num_splits, 64) and plan.guarded
  assert rows_plan(batch=1, kv_heads=1, num_tokens=5, group=16, head_dim=64, seq_len=777, softmax_scale=1.0,
                   gpu=chips.H100).row_blocks == 2
  with pytest.raises(ValueError, match="shared memory"):
    rows_plan(batch=1, kv_heads=1, num_tokens=1, group=64, head_dim=256, seq_len=64, softmax_scale=1.0,
              stages=3, gpu=chips.H100)
