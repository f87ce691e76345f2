"""``impl="mosaic_gpu"``: the Hopper kernels through the main API (`fdecode.flash_decode`,
`fdecode.ragged_decode`), under jax's Mosaic GPU interpreter on CPU (race detection on):
the plans an H100 would run, against ``impl="reference"`` on the same inputs; and the
refusals (a modifier, a token-major cache, a compile not for an sm_90 GPU), each a
ValueError with its reason, never a silent fallback.

Cost: 6 interpreted calls (GQA contiguous, paged int8, MLA int8, ragged: decode part and
prefill blocks), about 17 s on 2 CPU cores (`helpers.mosaic_gpu.compiled_once`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from helpers import assert_close, tol
from fdecode.kernels import mosaic_gpu
from fdecode.kernels.common import chips
from fdecode.cache.quant import quantize
from fdecode.dispatch import recording_plans
from helpers.ragged import batch

from helpers.mosaic_gpu import INTERPRET, assert_no_races, interpreter  # noqa: F401  (interpreter: a fixture)

BF16 = tol(jnp.bfloat16)


def _gqa(seed, *, b=2, t=4, hq=16, hkv=1, d=64, s=80, paged=None, dtype=jnp.bfloat16):
  """q bf16 [B, T, Hq, D]; caches contiguous [B, Hkv, S, D] or (``paged`` = page size) pools
  [Hkv, P, ps, D] with a shuffled table; 8-bit ``dtype``: quantized per token."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
  if paged:
    n = s // paged
    shape, tables = (hkv, b * n + 2, paged, d), jnp.asarray(rng.permutation(b * n + 2)[:b * n].reshape(b, n), jnp.int32)
  else:
    shape, tables = (b, hkv, s, d), None
  k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
  if dtype == jnp.bfloat16:
    return q, k.astype(dtype), v.astype(dtype), dict(block_tables=tables)
  (k, ks), (v, vs) = quantize(k, dtype), quantize(v, dtype)
  return q, k, v, dict(block_tables=tables, k_scale=ks, v_scale=vs)


def _check(got, want):
  assert_close(got[0], want[0], atol=BF16["atol"], rtol=BF16["rtol"])
  assert_close(got[1], want[1], atol=BF16["lse"], rtol=BF16["lse"], what="lse")


@pytest.mark.parametrize("paged, dtype, lengths", [
    (None, jnp.bfloat16, [80, 37]),  # contiguous, S not a block multiple (cache padded per call)
    (16, jnp.int8, [70, 3]),  # paged pool read in place; 3 < T: the first rows see nothing
])
def test_gqa_rows_kernel(interpreter, paged, dtype, lengths):
  q, k, v, cache = _gqa(0, paged=paged, dtype=dtype)
  lengths = jnp.asarray(lengths, jnp.int32)
  plans = fdecode.plan(q, k, v, lengths, impl="mosaic_gpu", interpret=INTERPRET, **cache)
  assert [type(p) for p in plans] == [mosaic_gpu.RowsPlan]
  assert plans[0].paged == (paged is not None) and plans[0].cache_dtype == jnp.dtype(dtype).name
  got = fdecode.flash_decode(q, k, v, lengths, impl="mosaic_gpu", interpret=INTERPRET, return_lse=True, **cache)
  want = fdecode.flash_decode(q, k, v, lengths, impl="reference", return_lse=True, **cache)
  _check(got, want)
  assert_no_races()


def test_mla_int8(interpreter):
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((2, 16, 576)), jnp.bfloat16)
  k, ks = quantize(jnp.asarray(rng.standard_normal((2, 1, 96, 576)), jnp.float32), jnp.int8)
  lengths = jnp.asarray([96, 41], jnp.int32)
  args = dict(v_head_dim=512, k_scale=ks, return_lse=True)
  assert [type(p) for p in fdecode.plan(q, k, None, lengths, impl="mosaic_gpu", interpret=INTERPRET,
                                        **args)] == [mosaic_gpu.MlaPlan]
  got = fdecode.flash_decode(q, k, None, lengths, impl="mosaic_gpu", interpret=INTERPRET, **args)
  _check(got, fdecode.flash_decode(q, k, None, lengths, impl="reference", **args))
  assert_no_races()


def test_ragged_decode_and_prefill(interpreter):
  """One decode and a 70-token prefill chunk (two prefill blocks of the one batched call)
  over a paged pool: both parts on the rows kernel."""
  p = batch(2, [1, 70], [40, 100], max_seqs=2, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
  with recording_plans() as log:  # this step's first trace: the plans of both parts
    got = fdecode.ragged_decode(**p, impl="mosaic_gpu", interpret=INTERPRET, return_lse=True)
  # the decode part (2 sequences, T = 1) and the 4 batched prefill blocks (T = 64), one call
  # each (recording traces the prefill call once per platform, for GPU without a
  # conditional and under one elsewhere: the same plan)
  assert list(dict.fromkeys((type(pl), pl.batch, pl.num_tokens, pl.paged) for _, pl in log)) == [
      (mosaic_gpu.RowsPlan, 2, 1, True), (mosaic_gpu.RowsPlan, 4, 64, True)], log
  assert [platform for platform, _ in log[1:]] == ["cpu", "gpu", "tpu"], log
  assert all(pl == log[1][1] for _, pl in log[1:]), log
  want = fdecode.ragged_decode(**p, impl="reference", return_lse=True)
  _check(got, want)
  live = int(p["cu_q_lens"][p["num_seqs"]])
  assert np.isneginf(np.asarray(got[1][live:])).all()  # padding rows
  assert_no_races()


def test_refuses_modifiers_and_layouts():
  q, k, v, _ = _gqa(3, s=64)
  lengths = jnp.asarray([64, 5], jnp.int32)
  run = lambda q, k, v, **kw: fdecode.flash_decode(q, k, v, lengths, impl="mosaic_gpu", interpret=INTERPRET, **kw)
  with pytest.raises(ValueError, match=r"flash_decode: impl='mosaic_gpu': the Hopper rows kernel cannot take "
                                       r"this call: score modifiers .* are not supported"):
    run(q, k, v, window=8)
  with pytest.raises(ValueError, match="causal=False with T=4"):
    run(q, k, v, causal=False)
  q2, k2, v2, _ = _gqa(3, hq=16, hkv=2, s=64)
  with pytest.raises(ValueError, match=r"token-major caches \(kv_layout='NHD'\) with more than one kv head"):
    run(q2, k2.swapaxes(1, 2), v2.swapaxes(1, 2), kv_layout="NHD")
  with pytest.raises(ValueError, match="needs bfloat16 q"):
    run(q.astype(jnp.float32), k, v)
  with pytest.raises(ValueError, match="does not take kv_offset"):
    run(q, k, v, kv_offset=0)
  p = batch(2, [1, 3], [40, 20], max_seqs=2, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"^ragged_decode: impl='mosaic_gpu': .*score modifiers"):
    fdecode.ragged_decode(**p, impl="mosaic_gpu", interpret=INTERPRET, logits_soft_cap=30.0)


def test_refuses_compiling_off_sm90(monkeypatch):
  q, k, v, _ = _gqa(4, s=64)
  lengths = jnp.asarray([64, 5], jnp.int32)
  with pytest.raises(ValueError, match=r"compiles the Hopper kernels for an sm_90 GPU, but this trace lowers for "
                                       r"cpu; pass interpret=fdecode.kernels.mosaic_gpu.InterpretGPUParams\(\)"):
    fdecode.flash_decode(q, k, v, lengths, impl="mosaic_gpu")
  monkeypatch.setattr(chips, "lowering_platform", lambda: "gpu")
  monkeypatch.setattr(chips, "lowering_gpu", lambda: chips.A100)
  with pytest.raises(ValueError, match=r"but this trace lowers for NVIDIA A100-SXM4-80GB \(sm_80\)"):
    fdecode.flash_decode(q, k, v, lengths, impl="mosaic_gpu", interpret=False)


def test_plan_for_a_gpu_from_any_host():
  """`fdecode.plan(platform="gpu", impl="mosaic_gpu")` gives the plan an H100 runs on this
  CPU host too (the refusal reads the platform asked about, not the host's), and
  ``platform="cpu"`` is refused as a compile there would be."""
  q, k, v, _ = _gqa(5, s=64)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  plans = fdecode.plan(q, k, v, lengths, platform="gpu", impl="mosaic_gpu")
  assert [type(p) for p in plans] == [mosaic_gpu.RowsPlan]
  with pytest.raises(ValueError, match=r"but this trace lowers for cpu"):
    fdecode.plan(q, k, v, lengths, platform="cpu", impl="mosaic_gpu")
  direct = mosaic_gpu.rows_plan(batch=2, kv_heads=1, num_tokens=4, group=16, head_dim=64, seq_len=64,
                                softmax_scale=0.125, cache_dtype=jnp.bfloat16, num_splits=np.int64(1))
  assert direct.num_splits == 1 and type(direct.num_splits) is int  # a numpy integer taken as an int


def test_interpret_must_match_impl():
  q, k, v, _ = _gqa(5, s=64)
  lengths = jnp.asarray([64, 5], jnp.int32)
  with pytest.raises(ValueError, match=r"impl='mosaic_gpu' takes interpret None / False .* got True"):
    fdecode.flash_decode(q, k, v, lengths, impl="mosaic_gpu", interpret=True)
  with pytest.raises(ValueError, match=r"InterpretGPUParams\(\.\.\.\) runs the Hopper kernels: pass impl='mosaic_gpu'"):
    fdecode.flash_decode(q, k, v, lengths, impl="pallas", interpret=INTERPRET)
