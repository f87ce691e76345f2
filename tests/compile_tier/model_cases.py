"""Model-level compile cases (tests/compile_tier/cases.py registers them): one decode step
of a Flax layer or model, its parameters and cache abstract (``b`` sequences, a cache of
``s`` tokens), so the chip compilers see fdecode as a model runs it."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def layer_step(target, layer_fn):
  """One decode step of a Flax layer / model, its parameters and cache abstract."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  built = {}

  def make():
    model, x = layer_fn()
    built["x"] = x
    return nnx.split(model)

  graphdef, state = abstract_split(make)
  x = built["x"]

  def step(state, x):
    model = nnx.merge(graphdef, state)
    return model.decode(x), nnx.state(model)

  sd = target.spec
  state = jax.tree.map(lambda a: sd(a.shape, a.dtype), state)
  return step, (state, sd(x.shape, x.dtype))


def abstract_split(make):
  """(graphdef, abstract state) of the model ``make`` builds, without allocating it."""
  out = {}

  def f():
    graphdef, state = make()
    out["graphdef"] = graphdef
    return state

  state = jax.eval_shape(f)
  return out["graphdef"], state


def flax_step(target, *, b, s):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import fdecode.flax as fflax  # pylint: disable=g-import-not-at-top

  def layer():
    m = fflax.DecodeAttention(512, num_heads=8, num_kv_heads=2, head_dim=128, rngs=nnx.Rngs(0))
    m.init_cache(b, s, jnp.bfloat16)
    return m, jax.ShapeDtypeStruct((b, 1, 512), jnp.float32)
  return layer_step(target, layer)


def flax_mla_step(target, *, b, s):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import fdecode.flax as fflax  # pylint: disable=g-import-not-at-top

  def layer():
    m = fflax.MLADecodeAttention(1024, 16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128, rngs=nnx.Rngs(0))
    m.init_cache(b, s, jnp.bfloat16)
    return m, jax.ShapeDtypeStruct((b, 1, 1024), jnp.float32)
  return layer_step(target, layer)


def gemma_step(target, *, b, s):
  """Gemma 3 270M's decode step, its first 6 of 18 layers: one period of the pattern (five
  sliding-window layers, then a global one); the other 12 repeat it, and compiling them
  took a fifth of a GPU target's time."""
  from fdecode.models.gemma3 import Gemma3, Gemma3Config  # pylint: disable=g-import-not-at-top

  def model():
    m = Gemma3(Gemma3Config(dtype=jnp.bfloat16, layers=6))
    m.init_cache(b, s, cache_dtype=jnp.bfloat16)
    return m, jax.ShapeDtypeStruct((b,), jnp.int32)
  return layer_step(target, model)


def flax_mha(target, *, b, s):
  """A Flax nnx.MultiHeadAttention decode step with fdecode.flax.attention_fn on its
  token-major cache [B, S, H, D]: the Pallas kernel on GPU and TPU (Triton in place)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fdecode.flax import attention_fn  # pylint: disable=g-import-not-at-top
  features = 1024

  def step(x):
    mha = nnx.MultiHeadAttention(num_heads=8, in_features=features, qkv_features=features, decode=True,
                                 attention_fn=attention_fn, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                 rngs=nnx.Rngs(0))
    mha.init_cache((b, s, features), dtype=jnp.bfloat16)
    return mha(x)
  return step, (target.spec((b, 1, features), jnp.bfloat16),)
