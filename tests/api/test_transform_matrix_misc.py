"""Issue 58, the rest of the transformation matrix: ``jax.export`` with a symbolic batch on
the XLA path; the library clean under ``jax_numpy_dtype_promotion="strict"`` and
``jax_numpy_rank_promotion="raise"``; fp8 and integer queries refused by name; and x64 on
the interpreted kernels, deterministically (``jax.enable_x64`` is thread-local: the TPU
interpreter's callbacks run on other threads, where a float64 operand came back float32)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export
from jax.experimental.pallas import tpu as pltpu

import fdecode
import fdecode.flax
from fdecode.kernels import xla as xla_kernels
from helpers import assert_close, host_f32, make_problem, randn, tol

B, HQ, HKV, S, D = 2, 4, 2, 32, 16
LENGTHS = np.array([S, 5], np.int32)
TABLES = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)  # pages of 8: each sequence's S = 32 slots


# --- jax.export with a symbolic batch ------------------------------------------------


def _specs(b, *arrays):
  """ShapeDtypeStructs of ``arrays`` with a leading batch ``b`` (arrays without one: as they are)."""
  return [jax.ShapeDtypeStruct((b, *x.shape[1:]) if batched else x.shape, x.dtype) for x, batched in arrays]


@pytest.mark.parametrize("impl,case", [("xla", "contiguous"), ("xla", "paged, T=3, window"),
                                       ("xla", "sparse, T=2"), (None, "contiguous")])
def test_export_with_a_symbolic_batch_serves_every_batch_size(impl, case):
  """Exported once with ``b`` symbolic, the program runs for B = 1, 3, 8 and equals the
  jitted call on each (the plan is batch 1's: `fdecode.kernels.xla.plan.make_plan`)."""
  rng = np.random.default_rng(0)
  paged, t = case.startswith("paged"), {"paged": 3, "sparse": 2}.get(case.split(",")[0])
  pool = randn(rng, (HKV, 16, 4, D))  # paged: one pool shared by every batch size

  def args(n):
    q = randn(rng, (n, HQ, D) if t is None else (n, t, HQ, D))
    lengths = jnp.asarray(rng.integers(t or 0, S + 1, n).astype(np.int32))
    if paged:
      return q, pool, pool, lengths, jnp.asarray(rng.integers(0, 16, (n, S // 4)).astype(np.int32))
    caches = randn(rng, (n, HKV, S, D)), randn(rng, (n, HKV, S, D))
    if case.startswith("sparse"):  # per-token index lists (folded into the batch)
      return q, *caches, lengths, jnp.asarray(rng.integers(0, S, (n, t, 8)).astype(np.int32))
    return q, *caches, lengths

  run = functools.partial(fdecode.flash_decode, impl=impl)
  if paged:
    f = jax.jit(lambda q, k, v, n, bt: run(q, k, v, n, block_tables=bt, window=12))
  elif case.startswith("sparse"):
    f = jax.jit(lambda q, k, v, n, idx: run(q, k, v, n, indices=idx))
  else:
    f = jax.jit(run)
  b, = export.symbolic_shape("b")
  batched = (True, not paged, not paged, True, True)
  exported = export.export(f)(*_specs(b, *zip(args(1), batched)))
  for n in (1, 3, 8):
    a = args(n)
    np.testing.assert_allclose(np.asarray(exported.call(*a)), np.asarray(f(*a)), atol=1e-6, rtol=1e-6,
                               err_msg=f"B={n}")


def test_xla_plan_of_a_symbolic_batch_is_batch_ones():
  b, = export.symbolic_shape("b")
  for kw in (dict(), dict(paged=True), dict(kv_layout="NHD")):
    tokens = dict(tokens=16384, kv_heads=2, platform="cpu", **kw)
    assert (xla_kernels.make_plan(batch=b, token_bytes=b * 2 * 128 * 4, **tokens)
            == xla_kernels.make_plan(batch=1, token_bytes=2 * 128 * 4, **tokens)), kw


# --- jax_numpy_dtype_promotion="strict" --------------------------------------------


def _both(fn):
  """``fn()`` under strict dtype promotion, and as it is: the two must agree bit for bit."""
  with jax.numpy_dtype_promotion("strict"):
    strict = jax.block_until_ready(fn())
  for got, want in zip(jax.tree.leaves(strict), jax.tree.leaves(fn())):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(host_f32(got), host_f32(want))


def _strict(fn):
  """``fn()`` under strict dtype promotion; its float results finite (or -inf LSEs)."""
  with jax.numpy_dtype_promotion("strict"):
    out = jax.block_until_ready(fn())
  for x in jax.tree.leaves(out):
    assert not np.isnan(host_f32(x)).any()
  return out


MIXES = [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16), (jnp.float16, jnp.float32)]


@pytest.mark.parametrize("impl,q_dtype,cache_dtype", [("xla", *m) for m in MIXES] + [
    ("reference", *MIXES[0]), (None, *MIXES[1])])
def test_flash_decode_under_strict_dtype_promotion(impl, q_dtype, cache_dtype):
  """The documented mixes (a 16-bit q on a float32 cache and back) compute in the
  promoted dtype under strict promotion too, with every modifier and the LSE (the XLA
  path every mix; the reference and the default route one each)."""
  q, k, v = make_problem(0, b=B, t=3, hq=HQ, hkv=HKV, s=S, dk=D)
  q, k, v = q.astype(q_dtype), k.astype(cache_dtype), v.astype(cache_dtype)
  mods = dict(window=8, logits_soft_cap=20.0, sinks=jnp.ones(HQ), alibi_slopes=jnp.full(HQ, 0.1, cache_dtype),
              bias=randn(1, (B, S), cache_dtype), mask=jnp.ones((B, S), bool), return_lse=True)
  _both(lambda: fdecode.flash_decode(q, k, v, LENGTHS, impl=impl, **mods))


@pytest.mark.parametrize("kernel", ["triton", "mosaic_tpu"])
def test_interpreted_kernels_under_strict_dtype_promotion(kernel):
  """The interpreted kernels, a bf16 q on a float32 cache, with a mask (the Triton kernel's
  mask test) over a paged cache."""
  interpret = True if kernel == "triton" else pltpu.InterpretParams()
  q = randn(0, (B, 2, HQ, D), jnp.bfloat16)
  pool = randn(1, (HKV, 8, 8, D))
  mask = jnp.asarray(np.arange(S)[None] % 3 != 1).repeat(B, 0)
  _strict(lambda: fdecode.flash_decode(q, pool, pool, LENGTHS, block_tables=TABLES, impl="pallas",
                                       interpret=interpret, mask=mask))


def test_merge_states_and_apply_rope_under_strict_dtype_promotion():
  o, lse = randn(0, (3, B, HQ, D), jnp.bfloat16), randn(1, (3, B, HQ))
  _both(lambda: fdecode.merge_states(o, lse))
  o32, lse16 = o.astype(jnp.float32), lse.astype(jnp.bfloat16)
  _both(lambda: fdecode.merge_states(o32, lse16, axis=0))
  x, pos = randn(2, (B, 3, HQ, D), jnp.bfloat16), jnp.full((B, 3), 7, jnp.int32)
  _both(lambda: fdecode.flax.apply_rope(x, pos))


def test_cascade_and_ragged_decode_under_strict_dtype_promotion():
  """cascade_decode and ragged_decode (its fused write too): a bf16 q on float32 caches."""
  rng = np.random.default_rng(0)
  q = randn(rng, (B, HQ, D), jnp.bfloat16)
  prefix, k = randn(rng, (1, HKV, S, D)), randn(rng, (B, HKV, S, D))
  _strict(lambda: fdecode.cascade_decode(q, prefix, prefix, jnp.array([S], jnp.int32), k, k, LENGTHS,
                                         prefix_ids=jnp.array([0, 0], jnp.int32), impl="xla", sinks=jnp.ones(HQ),
                                         return_lse=True))
  pool, rows, new = randn(rng, (HKV, 8, 8, D)), randn(rng, (5, HQ, D), jnp.bfloat16), randn(rng, (5, HKV, D),
                                                                                            jnp.bfloat16)
  _strict(lambda: fdecode.ragged_decode(rows, pool, pool, LENGTHS, TABLES, jnp.array([0, 2, 5], jnp.int32),
                                        jnp.array(2, jnp.int32), impl="xla", new_k=new, new_v=new))


def _decode_layer(kind, dtype):
  """A Flax layer in ``dtype`` over float32 parameters, prefilled (a plain GQA layer's
  prefill is JAX's own attention) and stepped by two tokens: its decode output, all of it
  one jitted program."""
  def run():
    rngs = nnx.Rngs(0)
    if kind == "gqa":  # QK-norm: Flax's RMSNorm on 16-bit input
      layer = fdecode.flax.DecodeAttention(32, num_heads=HQ, num_kv_heads=HKV, head_dim=8, dtype=dtype,
                                           rngs=rngs, qk_norm=True)
    else:  # both of MLA's RMSNorms and its up-projections
      layer = fdecode.flax.MLADecodeAttention(32, num_heads=HQ, kv_lora_rank=16, qk_nope_head_dim=8,
                                              qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=16, dtype=dtype,
                                              rngs=rngs)
    layer.init_cache(batch=B, max_len=16, dtype=dtype)
    layer.prefill(randn(1, (B, 3, 32), dtype), jnp.array([3, 2], jnp.int32))
    return layer.decode(randn(2, (B, 2, 32), dtype))
  return jax.jit(run)()


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_flax_layers_under_strict_dtype_promotion(kind):
  """Prefill and decode in bfloat16 over float32 parameters: Flax's RMSNorm and JAX's
  attention promote to float32 themselves, which fdecode's layers keep under strict."""
  assert _strict(lambda: _decode_layer(kind, jnp.bfloat16)).dtype == jnp.bfloat16


def test_nnx_attention_fn_under_strict_dtype_promotion():
  def step():
    m = nnx.MultiHeadAttention(num_heads=HQ, in_features=32, qkv_features=32, decode=True, dtype=jnp.bfloat16,
                               attention_fn=fdecode.flax.attention_fn, rngs=nnx.Rngs(0))
    m.init_cache((B, 8, 32), dtype=jnp.bfloat16)
    x = randn(0, (B, 1, 32), jnp.bfloat16)
    m(x)
    return m(x)
  assert _strict(jax.jit(step)).dtype == jnp.bfloat16


# --- jax_numpy_rank_promotion="raise" -----------------------------------------------


def _ranks_explicit(fn):
  """``fn()`` with implicit rank promotion an error; returns its result."""
  with jax.numpy_rank_promotion("raise"):
    return jax.block_until_ready(fn())


def test_apply_rope_and_the_layers_under_rank_promotion_raise():
  x, pos = randn(0, (B, 3, HQ, D)), jnp.asarray(np.arange(3 * B).reshape(B, 3).astype(np.int32))
  got = _ranks_explicit(lambda: fdecode.flax.apply_rope(x, pos))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(fdecode.flax.apply_rope(x, pos)))
  for kind in ("gqa", "mla"):
    _ranks_explicit(lambda: _decode_layer(kind, jnp.float32))


@pytest.mark.parametrize("impl,interpret,case", [
    ("xla", None, "modifiers"), ("xla", None, "paged"), ("xla", None, "sparse"), ("reference", None, "modifiers"),
    ("pallas", True, "modifiers"), ("pallas", "mosaic_tpu", "sparse")])
def test_flash_decode_under_rank_promotion_raise(impl, interpret, case):
  """Every modifier, a paged cache and sparse index lists (the Mosaic kernel's slot units):
  the XLA path each, the reference and the interpreted kernels one each."""
  interpret = pltpu.InterpretParams() if interpret == "mosaic_tpu" else interpret
  q, k, v = make_problem(0, b=B, t=2, hq=HQ, hkv=HKV, s=S, dk=D)
  run = functools.partial(fdecode.flash_decode, impl=impl, interpret=interpret)
  if case == "modifiers":
    _ranks_explicit(lambda: run(q, k, v, LENGTHS, window=8, logits_soft_cap=20.0, sinks=jnp.ones(HQ),
                                alibi_slopes=jnp.full(HQ, 0.1), bias=randn(1, (B, S)), return_lse=True))
  elif case == "paged":
    pool = randn(2, (HKV, 8, 8, D))
    _ranks_explicit(lambda: run(q[:, 0], pool, pool, LENGTHS, block_tables=TABLES))
  else:
    _ranks_explicit(lambda: run(q[:, 0], k, v, LENGTHS, indices=jnp.array([[0, 3, 5, 7]] * B, jnp.int32)))


def _close(out, ref, dtype):
  t = tol(dtype)
  assert_close(out, ref, atol=t["atol"], rtol=t["rtol"])


# --- the query's dtype ------------------------------------------------------------


QUERY_DTYPE = re.escape("q must be a floating dtype of 16 bits or more (float16, bfloat16, float32 or float64); "
                        "got q.dtype=")


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8, jnp.int32, jnp.bool_])
def test_fp8_and_integer_queries_are_refused_by_name(dtype):
  """Each entry point names q, its dtype and the allowed ones (not JAX's TypePromotionError)."""
  q, k, v = make_problem(0, b=B, hq=HQ, hkv=HKV, s=S, dk=D, t=None)
  q = jnp.zeros(q.shape, dtype)
  name = jnp.dtype(dtype).name
  with pytest.raises(ValueError, match=f"^flash_decode: {QUERY_DTYPE}{name}"):
    fdecode.flash_decode(q, k, v, LENGTHS)
  with pytest.raises(ValueError, match=f"^flash_decode: {QUERY_DTYPE}{name}"):
    jax.jit(functools.partial(fdecode.flash_decode, impl="xla")).lower(q, k, v, LENGTHS)
  with pytest.raises(ValueError, match=f"{QUERY_DTYPE}{name}"):
    fdecode.cascade_decode(q, k[:1], v[:1], jnp.array([4], jnp.int32), k, v, LENGTHS,
                           prefix_ids=jnp.array([0, 0], jnp.int32))
  with pytest.raises(ValueError, match=f"^ragged_decode: {QUERY_DTYPE}{name}"):
    fdecode.ragged_decode(jnp.zeros((3, HQ, D), dtype), k, v, LENGTHS, None, jnp.array([0, 1, 3], jnp.int32),
                          jnp.array(2, jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
def test_every_16_bit_or_wider_float_query_is_taken(dtype):
  q, k, v = make_problem(0, b=B, hq=HQ, hkv=HKV, s=S, dk=D, t=None)
  with jax.enable_x64(dtype == jnp.float64):
    out = fdecode.flash_decode(jnp.asarray(np.asarray(q), dtype), k, v, LENGTHS, impl="xla")
    ref = fdecode.flash_decode(q, k, v, LENGTHS, impl="reference")
  assert out.dtype == dtype
  _close(out, ref, jnp.float32 if dtype in (jnp.float32, jnp.float64) else jnp.bfloat16)


# --- x64 on the interpreted kernels -------------------------------------------------


X64_CASES = {
    "float32, a float64 bias": lambda q, k, v: ((q, k, v, LENGTHS), dict(bias=np.zeros((B, S)),  # numpy's float64
                                                                          mask=np.ones((B, S), bool))),
    "float64 q and cache": lambda q, k, v: ((np.asarray(q, np.float64), np.asarray(k, np.float64),
                                              np.asarray(v, np.float64), LENGTHS), {}),
    "paged": lambda q, k, v: ((q, randn(2, (HKV, 8, 8, D)), randn(3, (HKV, 8, 8, D)), LENGTHS),
                              dict(block_tables=TABLES)),
    "sparse": lambda q, k, v: ((q, k, v, LENGTHS), dict(indices=np.array([[0, 3, 5, 7]] * B, np.int32))),
}


@pytest.mark.parametrize("kernel", ["mosaic_tpu", "triton"])
@pytest.mark.parametrize("case", list(X64_CASES))
def test_interpreted_kernels_under_thread_local_x64(kernel, case):
  """Under ``jax.enable_x64(True)`` (thread-local) the interpreted kernels run and match the
  reference: no float64 operand reaches the TPU kernel (a float64 query or cache takes the
  XLA path, a bias is read as float32) and every in-kernel index stays int32."""
  interpret = pltpu.InterpretParams() if kernel == "mosaic_tpu" else True
  q, k, v = make_problem(0, b=B, hq=HQ, hkv=HKV, s=S, dk=D, t=None)
  with jax.enable_x64(True):
    args, kw = X64_CASES[case](q, k, v)
    out = fdecode.flash_decode(*args, impl="pallas", interpret=interpret, **kw)
    ref = fdecode.flash_decode(*args, impl="reference", **kw)
  assert out.dtype == ref.dtype
  _close(out, ref, jnp.float32)


def test_no_float64_inside_the_kernels_under_x64():
  """float32 inputs under x64: nothing is computed in float64 (the kernels' selects of two
  Python floats were: float64 vectors, which Mosaic has none of)."""
  q, k, v = make_problem(0, b=B, t=2, hq=HQ, hkv=HKV, s=S, dk=D)
  mods = dict(mask=jnp.ones((B, S), bool), sinks=jnp.ones(HQ), return_lse=True, num_splits=2)
  for interpret in (pltpu.InterpretParams(), True):
    with jax.enable_x64(True):
      jaxpr = jax.make_jaxpr(lambda q, k, v: fdecode.flash_decode(q, k, v, LENGTHS, impl="pallas",
                                                                 interpret=interpret, **mods))(q, k, v)
    # Values computed in float64 (a weak Python scalar operand, converted in the op, is fine).
    computed = [line for line in str(jaxpr).splitlines() if " = " in line and "f64" in line.split(" = ")[0]]
    assert not computed, computed[:5]
