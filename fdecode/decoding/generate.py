"""Greedy generation over a decoder stack (`fdecode.models.base.Transformer`, Gemma 3).

Legend: B batch, L padded prompt length, V vocabulary, S cache capacity, N new tokens
(``steps``).

  model = Transformer(ModelConfig(), decode_fn=partial(fdecode.flash_decode, impl="xla"))
  model.init_cache(batch=4, max_len=1024)
  out = generate(model, prompts, prompt_lengths, steps=32)   # out.tokens int32 [B, N]

With a sharded ``decode_fn`` (`fdecode.sharded_flash_decode`) pass ``cache_sharding`` so
that the caches sit on the mesh while decoding. `Graph`, `split_model` and `model_state`
hand a model to a jitted step without copying its weights (also `fdecode.decoding.serving`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from fdecode.models.base import Transformer, pin

__all__ = ["Generation", "Graph", "check_prompt_ids", "generate", "model_state", "split_model"]


class Graph:
  """A model's structure (`flax.nnx.GraphDef`) as a static `jax.jit` argument, hashed once
  (jit hashes its static arguments on every call; a Gemma 3 graph takes ~10 ms).

  A jitted step over a model takes ``(graph, params, state, ...)`` from `split_model`,
  rebuilds the model with `merge`, and returns `model_state` of it: the weights go in
  and do not come out. A step that returned them (a `flax.nnx.jit` over the whole model
  does) would copy every weight on every call: for Gemma 3 270M in float32, 1.07 GB,
  ~89% of a batch-1 decode step on the project's 2-core CPU (benchmarks/RESULTS.md,
  "Serving buckets").
  """

  def __init__(self, graphdef):
    self.graphdef, self._hash = graphdef, hash(graphdef)

  def merge(self, params, state):
    return nnx.merge(self.graphdef, params, state)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return isinstance(other, Graph) and (self is other or self.graphdef == other.graphdef)


def split_model(model: nnx.Module):
  """``(Graph, params, state)``: the model's structure, its weights (``nnx.Param``) and the
  rest (caches, lengths, block tables), as a step function takes them (see `Graph`)."""
  graphdef, params, state = nnx.split(model, nnx.Param, ...)
  return Graph(graphdef), params, state


def model_state(model: nnx.Module):
  """What a step hands back: everything of ``model`` but its weights (``nnx.Param``)."""
  return nnx.state(model, nnx.Not(nnx.Param))


@functools.partial(jax.jit, static_argnums=0)
def _prefill_step(graph: Graph, params, state, tokens, lengths):
  model = graph.merge(params, state)
  logits = model.prefill(tokens, lengths)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, model_state(model)


@functools.partial(jax.jit, static_argnames=("graph", "cache_sharding"))
def _decode_step(graph: Graph, params, state, tokens, cache_sharding=None):
  model = graph.merge(params, state)
  logits = model.decode(tokens)
  tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if cache_sharding is not None:  # outputs laid out as the inputs were: no second compile
    model.pin_state(cache_sharding)
    tokens = pin(tokens, NamedSharding(cache_sharding.mesh, PartitionSpec()))
  return tokens, logits, model_state(model)


@dataclasses.dataclass
class Generation:
  """What `generate` returns.

  Attributes:
    tokens: int32 ``[B, N]`` greedy tokens; token 0 comes from the prefill.
    logits: float32 ``[B, N, V]`` the logits each token was the argmax of.
    prefill_s: seconds of the prefill call (includes its compilation on first use) and
      of placing the caches on ``cache_sharding``.
    step_s: seconds of each of the N - 1 decode steps (the first includes compilation).
  """

  tokens: np.ndarray
  logits: np.ndarray
  prefill_s: float
  step_s: list


def generate(model: Transformer, prompts, prompt_lengths, steps: int, *,
             cache_sharding=None, on_step: Callable[[int, int], None] | None = None) -> Generation:
  """Prefills right-padded prompts, then decodes greedily, every sequence at its own position.

  Args:
    model: a `Transformer` after ``init_cache(B, S)``; its cache is overwritten.
    prompts: int ``[B, L]``, row b's prompt in ``prompts[b, :prompt_lengths[b]]``, ids
      in ``[0, V)``; the padding after it may hold anything (it is replaced by 0).
    prompt_lengths: int ``[B]``, each in ``[1, L]``, with ``prompt_lengths + steps - 1 <= S``.
    steps: N >= 1 new tokens per sequence (1 from the prefill, N - 1 decode steps).
    cache_sharding: where the caches live while decoding (see `Transformer.place_cache`).
      The prefill runs where the caches are when called (one device after
      `Transformer.init_cache`); then they are placed on ``cache_sharding``, and every
      other array of the model (weights, lengths, block tables) replicated on its mesh
      (`Transformer.place_state`), and kept so through every decode step: the step
      compiles once, not again when its first call hands back another layout.
      Prefilling on the 8 simulated CPU devices instead, with XLA partitioning the
      prompt attention and the cache write, took 7x longer on a 2-core machine (11.6 s
      vs 1.6 s for 4 prompts of up to 1024 tokens).
    on_step: called as ``on_step(done, steps)`` after each token is ready.

  Returns:
    `Generation` (tokens, logits, timings). Each step waits for its result, so step
    times are per-step latencies.

  Raises:
    ValueError: for inconsistent shapes, non-integer prompts or lengths, a prompt id
      outside ``[0, V)`` (ids past ``prompt_lengths[b]`` are padding: ignored, fed as 0),
      or prompts that leave no room for ``steps``.
  """
  prompts, lengths = _check_generate_args(model, prompts, prompt_lengths, steps)
  t0 = time.perf_counter()
  graph, params, state = split_model(model)
  tok, logits, state = jax.block_until_ready(_prefill_step(graph, params, state, prompts, lengths))
  nnx.update(model, state)
  if cache_sharding is not None:  # the decode steps' inputs, laid out as their outputs will be
    model.place_state(cache_sharding)
    tok = jax.device_put(tok, NamedSharding(cache_sharding.mesh, PartitionSpec()))
    graph, params, state = split_model(model)
  prefill_s = time.perf_counter() - t0
  tokens, all_logits, step_s = [tok], [logits], []
  if on_step:
    on_step(1, steps)
  for i in range(1, steps):
    t0 = time.perf_counter()
    tok, logits, state = jax.block_until_ready(_decode_step(graph, params, state, tok, cache_sharding))
    nnx.update(model, state)
    step_s.append(time.perf_counter() - t0)
    tokens.append(tok)
    all_logits.append(logits)
    if on_step:
      on_step(i + 1, steps)
  return Generation(tokens=np.stack([np.asarray(t) for t in tokens], axis=1),
                    logits=np.stack([np.asarray(x) for x in all_logits], axis=1),
                    prefill_s=prefill_s, step_s=step_s)


def _int_scalar(fn: str, name: str, value, low: int) -> int:
  """``value`` as a Python int >= ``low`` (not a bool); ValueError naming ``name``."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{fn}: {name} must be an int >= {low}, got {value!r}")
  return int(value)


def check_prompt_ids(fn: str, name: str, prompts, lengths, vocab: int) -> np.ndarray:
  """Host check of right-padded prompts: int ``[B, L]`` (or ``[L]``) ``prompts`` and int
  ``[B]`` (or a scalar) ``lengths`` in ``[0, L]`` (checked by the caller) -> int32
  prompts of the same shape with the padding (``t >= lengths[b]``) set to 0.

  Raises:
    ValueError: ``prompts`` is not an integer array, or an id a prompt uses lies outside
      ``[0, vocab)``: names ``name``, the first bad id, where it is, and how many are bad.
  """
  prompts = np.asarray(prompts)
  if not np.issubdtype(prompts.dtype, np.integer):
    raise ValueError(f"{fn}: {name} must hold integer token ids; got dtype {prompts.dtype}")
  used = np.arange(prompts.shape[-1]) < np.asarray(lengths)[..., None]  # [B, L] or [L]
  bad = used & ((prompts < 0) | (prompts >= vocab))  # in the ids' own integer dtype: no wrap
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{fn}: {name} ids must lie in [0, V={vocab}) (the model's vocabulary); got "
                     f"{name}{list(where)} = {int(prompts[where])} ({int(bad.sum())} id(s) out of range)")
  return np.where(used, prompts, 0).astype(np.int32)


def _check_generate_args(model: Transformer, prompts, prompt_lengths, steps):
  """`generate`'s checks -> (int32 ``[B, L]`` prompts, padding zeroed; int32 ``[B]`` lengths)."""
  if model.blocks[0].attn.cached_key is None:
    raise ValueError("generate: no cache; call model.init_cache(batch, max_len) first")
  steps = _int_scalar("generate", "steps", steps, 1)
  b, s = model.blocks[0].attn.lengths.shape[0], model.blocks[0].attn.capacity
  prompts, lens = np.asarray(prompts), np.asarray(prompt_lengths)
  if prompts.ndim != 2 or prompts.shape[0] != b or lens.shape != (b,):
    raise ValueError(f"generate: prompts must be [B, L] and prompt_lengths [B] with the cache's "
                     f"B={b}; got prompts.shape={tuple(prompts.shape)}, "
                     f"prompt_lengths.shape={tuple(lens.shape)}")
  if not np.issubdtype(lens.dtype, np.integer):
    raise ValueError(f"generate: prompt_lengths must be integers; got dtype {lens.dtype}")
  low, high = int(lens.argmin()), int(lens.argmax())
  if lens[low] < 1 or lens[high] > prompts.shape[1] or int(lens[high]) + steps - 1 > s:
    bad = low if lens[low] < 1 else high
    raise ValueError(f"generate: need prompt_lengths in [1, L={prompts.shape[1]}] and "
                     f"prompt_lengths + steps - 1 <= S={s} (the cache capacity); got "
                     f"prompt_lengths[{bad}]={int(lens[bad])}, steps={steps}")
  prompts = check_prompt_ids("generate", "prompts", prompts, lens, model.cfg.vocab)
  return jnp.asarray(prompts), jnp.asarray(lens, jnp.int32)
