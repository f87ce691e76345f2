"""The README's support matrix, as `fdecode.plan` decides it: which path a call takes on
each platform, and the documented fallbacks where backends differ. Nothing runs."""

import jax
import jax.numpy as jnp
import pytest

import fdecode

B, HQ, HKV, S = 2, 8, 2, 1024


def kinds(platform, *, d=128, dtype=jnp.bfloat16, page_size=None, **options):
  q = jax.ShapeDtypeStruct((B, HQ, d), dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.bfloat16)
  if page_size is None:
    k = jax.ShapeDtypeStruct((B, HKV, S, d), dtype)
  else:
    k = jax.ShapeDtypeStruct((HKV, B * S // page_size, page_size, d), dtype)
    options["block_tables"] = jax.ShapeDtypeStruct((B, S // page_size), jnp.int32)
  lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
  return [type(p).__name__ for p in fdecode.plan(q, k, k, lengths, platform=platform, **options)]


@pytest.mark.parametrize("platform,path", [("cpu", "XlaPlan"), ("gpu", "TritonPlan"), ("tpu", "CallPlan")])
def test_default_path_per_platform(platform, path):
  assert kinds(platform) == [path]
  assert kinds(platform, page_size=16) == [path]


def test_gpu_takes_xla_where_triton_cannot_tile():
  assert kinds("gpu", d=72) == ["XlaPlan"]   # a head dim not a multiple of 16
  assert kinds("gpu", d=80) == ["TritonPlan"]


def test_gpu_bf16_mla_goes_to_the_hopper_kernel_on_sm90():
  q = jax.ShapeDtypeStruct((B, 16, 576), jnp.bfloat16)
  latent = jax.ShapeDtypeStruct((B, 1, S, 576), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
  assert [type(p).__name__ for p in fdecode.plan(q, latent, None, lengths, v_head_dim=512, platform="gpu")] == [
      "MlaPlan"]


@pytest.mark.parametrize("case", [dict(dtype=jnp.float16), dict(page_size=1), dict(page_size=2, dtype=jnp.int8)])
def test_tpu_fallbacks_to_xla(case):
  if case.get("dtype") == jnp.int8:
    case = dict(case, k_scale=1.0, v_scale=1.0)
  q_kinds = kinds("tpu", **case)
  assert q_kinds[-1] == "XlaPlan", q_kinds   # the Mosaic plan names the fallback, then the XLA plan runs
