"""The Hopper GQA rows kernel (`fdecode.kernels.mosaic_gpu.rows_decode`) under jax's Mosaic
GPU interpreter (CPU, race detection on), against the float32 reference.

What the interpreter runs and what it does not is as for the MLA kernel
(tests/test_mosaic_gpu.py): the body, its two warpgroups as threads, the TMA copies and
barriers (byte counts and phases checked), smem tiles as plain arrays, the PV wgmma, the
masks, the operand preparation and the NaN guard run; the Q K^T wgmma with a transposed
operand, ``pl.run_state``, register layouts (the scales' column layout included),
swizzles, ``setmaxnreg`` and ptxas are substituted or ignored (only a GPU proves them).

Tolerances: bfloat16's (`conftest.TOLERANCES`): the kernel rounds P (with ``v_scale``
folded in, for 8-bit caches) to bf16 for the PV wgmma; 8-bit tiles convert to bf16
exactly. Cost: each interpreted program (64 rows x one split of one sequence and kv head)
takes about 4 s (a fixed cost of the interpreter, whatever its blocks); the file runs 13
programs, about 60 s of CPU time.
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
from fdecode.kernels.common import chips
from fdecode.kernels.common.quant import quantize
from fdecode.kernels.mosaic_gpu import rows_plan, rows_unsupported

interpret_gpu = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: E402

INTERPRET = InterpretGPUParams(detect_races=True)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
  """A kernel that raised leaves the interpreter's shared state behind: reset it."""
  yield
  interpret_gpu.reset_gpu_interpret_mode_state()


def problem(seed, *, b, t, hq, hkv, s, d, dtype=jnp.bfloat16):
  """q bf16 [B, T, Hq, D]; k, v [B, Hkv, S, D] in ``dtype`` (8-bit: quantized per token,
  with float32 scales [B, Hkv, S, 1]); returns (q, k, v, k_scale, v_scale)."""
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, t, hq, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, hkv, s, d), jnp.float32)
  v = jax.random.normal(kv, (b, hkv, s, d), jnp.float32)
  if dtype == jnp.bfloat16:
    return q, k.astype(dtype), v.astype(dtype), None, None
  (k, ks), (v, vs) = quantize(k, dtype), quantize(v, dtype)
  return q, k, v, ks, vs


def reference(q, k, v, lengths, ks=None, vs=None):
  return fdecode.flash_decode(q, k, v, lengths, k_scale=ks, v_scale=vs, impl="reference", return_lse=True)


def run_kernel(q, k, v, lengths, ks=None, vs=None, num_splits=None):
  out, lse = mosaic_gpu.rows_decode(q, k, v, lengths, k_scale=ks, v_scale=vs, num_splits=num_splits,
                                    return_lse=True, interpret=INTERPRET)
  races = interpret_gpu.get_races()
  assert races is None or not races.races_found, "the Mosaic GPU interpreter detected a data race"
  return out, lse


def check(out, lse, want_out, want_lse):
  t = tol(jnp.bfloat16)
  assert_close(out, want_out, atol=t["atol"], rtol=t["rtol"])
  assert_close(lse, want_lse, atol=t["lse"], rtol=t["lse"], what="lse")


def with_garbage_past(x, lengths, value):
  """``x`` [B, Hkv, S, ...] with ``value`` in every slot at or past each sequence's length."""
  dead = jnp.arange(x.shape[2])[None, None, :, None] >= jnp.asarray(lengths)[:, None, None, None]
  return jnp.where(dead, jnp.asarray(value, jnp.float32).astype(x.dtype), x)


def test_bf16_lengths_around_the_block_with_garbage_tails():
  """bf16, D = 64, T = 2 causal tokens x G = 32 heads = 64 rows (one row block); S = 130
  (not a multiple of the 64-token block nor of 8: padded cache, overlapped last block);
  lengths 0, 1 (token 0 sees nothing), bk - 1 and bk + 1 (S: `test_8bit_per_token`); NaN
  keys and +inf values past every length are selected away (the reference reads the
  clean cache)."""
  q, k, v, _, _ = problem(0, b=4, t=2, hq=32, hkv=1, s=130, d=64)
  lengths = jnp.array([0, 1, 63, 65], jnp.int32)
  out, lse = run_kernel(q, with_garbage_past(k, lengths, jnp.nan), with_garbage_past(v, lengths, jnp.inf),
                        lengths, num_splits=1)
  check(out, lse, *reference(q, k, v, lengths))
  assert np.all(np.asarray(lse[0]) == -np.inf) and np.all(np.asarray(out[0], np.float32) == 0)
  assert np.all(np.asarray(lse[1, 0]) == -np.inf) and np.all(np.isfinite(np.asarray(lse[1, 1])))


@pytest.mark.parametrize("dtype, t, g, length, num_splits", [(jnp.int8, 5, 16, 120, 1),
                                                              (jnp.float8_e4m3fn, 1, 64, 130, 2)])
def test_8bit_per_token(dtype, t, g, length, num_splits):
  """8-bit k / v with per-token scales, D = 128, S = 130; garbage past the length
  (extreme codes, NaN k scales, inf v scales). int8: T = 5 causal tokens x G = 16 = 80
  rows, two row blocks (the second 48 padding rows), length 120, one split. e4m3: T = 1
  x G = 64, length S in two splits (2 + 1 blocks: the 2-slot ring refills a slot),
  merged by `merge_states`."""
  q, k, v, ks, vs = problem(1, b=1, t=t, hq=g, hkv=1, s=130, d=128, dtype=dtype)
  lengths = jnp.array([length], jnp.int32)
  want = reference(q, k, v, lengths, ks, vs)
  big = 127 if dtype == jnp.int8 else 448.0
  k_bad, v_bad = with_garbage_past(k, lengths, big), with_garbage_past(v, lengths, -big)
  ks_bad, vs_bad = with_garbage_past(ks, lengths, jnp.nan), with_garbage_past(vs, lengths, jnp.inf)
  out, lse = run_kernel(q, k_bad, v_bad, lengths, ks_bad, vs_bad, num_splits=num_splits)
  check(out, lse, *want)


def test_partials_are_per_split_states():
  """`rows_partials` returns float32 ``o [B, Hkv, n, R, D]``, ``lse [B, Hkv, n, R]``;
  D = 256 (the widest head dim), T = 1 x G = 64, S = 192, length 60 in 2 splits: the
  second holds no block (lse -inf, o 0), and the states merge to the reference."""
  q, k, v, _, _ = problem(2, b=1, t=1, hq=64, hkv=1, s=192, d=256)
  lengths = jnp.array([60], jnp.int32)
  plan = rows_plan(batch=1, kv_heads=1, num_tokens=1, group=64, head_dim=256, seq_len=192,
                   softmax_scale=1 / math.sqrt(256), num_splits=2)
  q_rows = q.reshape(1, 1, 64, 256)
  o, lse = mosaic_gpu.rows_partials(q_rows, lengths, k, v, plan=plan, interpret=INTERPRET)
  assert o.shape == (1, 1, 2, 64, 256) and lse.shape == (1, 1, 2, 64)
  assert o.dtype == jnp.float32 and lse.dtype == jnp.float32
  assert np.all(np.asarray(lse[:, :, 1]) == -np.inf) and np.all(np.asarray(o[:, :, 1]) == 0)
  out, merged = merge_states(o, lse, axis=2)
  want_out, want_lse = reference(q, k, v, lengths)
  check(out.reshape(1, 1, 64, 256), merged.reshape(1, 1, 64), want_out, want_lse)


@pytest.mark.parametrize("dtype, b", [(jnp.bfloat16, 2), (jnp.float8_e4m3fn, 1)])
def test_nan_reaches_only_the_rows_that_see_it(dtype, b):
  """T = 4 tokens x G = 16, length 60: token t sees keys < 57 + t. Sequence 0 holds a
  NaN *value* at 58 (tokens 2, 3 see it; 0, 1 do not, though their rows share the PV
  wgmma's value tile), sequence 1 (bf16) a NaN *key* at 57 (tokens 1-3 see it). The rows
  that see the NaN are NaN (out and lse); the others are the clean reference. bf16 runs
  the guard in place in the K / V slot, e4m3 (its NaN code) in the conversion pass."""
  q, k, v, ks, vs = problem(3, b=b, t=4, hq=16, hkv=1, s=64, d=64, dtype=dtype)
  lengths = jnp.full((b,), 60, jnp.int32)
  want_out, want_lse = reference(q, k, v, lengths, ks, vs)
  nan = jnp.array(jnp.nan, jnp.float32).astype(k.dtype)
  k_bad, v_bad = k.at[1:, 0, 57, 3].set(nan), v.at[0, 0, 58, 5].set(nan)
  out, lse = run_kernel(q, k_bad, v_bad, lengths, ks, vs, num_splits=1)
  sees = np.array([[False, False, True, True], [False, True, True, True]])[:b]  # [B, T]
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  check(out[~sees], lse[~sees], np.asarray(want_out, np.float32)[~sees], np.asarray(want_lse)[~sees])
  assert np.all(np.isnan(out[sees])) and np.all(np.isnan(lse[sees]))


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
  assert "paged" in rows_unsupported(q_shape=(2, 8, 64), q_dtype="bfloat16", k_shape=(2, 2, 64, 64),
                                     k_dtype="bfloat16", v_shape=(2, 2, 64, 64), v_dtype="bfloat16",
                                     scales=False, paged=True)


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
