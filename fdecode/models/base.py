"""The decoder-stack base: a small decoder-only transformer built from `DecodeAttention`.

Legend: B batch, L padded prompt length, V vocabulary, E model width, F MLP width,
Hq query heads, Hkv kv heads, D head dim, S cache capacity.

The model is a random-weight, Llama-shaped stack (token embedding, ``layers`` blocks of
RMSNorm -> `fdecode.flax.DecodeAttention` -> residual -> RMSNorm -> SwiGLU MLP ->
residual, final RMSNorm, separate unembedding). Weights come from a fixed seed; nothing
is downloaded. It exists to drive `DecodeAttention`'s cache the way a real model does
(prefill of right-padded prompts, then one token per sequence per step, each sequence
at its own position), so that attention implementations can be compared end to end;
Gemma 3 (`fdecode.models.gemma3`) subclasses it. The loops over it (greedy `generate`,
beams, the serving engine) are `fdecode.decoding`:

  model = Transformer(ModelConfig(), decode_fn=partial(fdecode.flash_decode, impl="xla"))
  model.init_cache(batch=4, max_len=1024)
  out = generate(model, prompts, prompt_lengths, steps=32)   # out.tokens int32 [B, N]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from fdecode.cache.meshes import is_explicit
from fdecode.flax import DecodeAttention
from fdecode.flax.invariant import Embed, Linear, RMSNorm


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes of `Transformer` (float32 throughout by default)."""

  vocab: int = 512         # V
  dim: int = 256           # E
  layers: int = 4
  num_heads: int = 8       # Hq
  num_kv_heads: int = 4    # Hkv
  head_dim: int = 32       # D
  mlp_dim: int = 512       # F
  rope_theta: float = 10000.0
  dtype: Any = jnp.float32


class MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``E -> F -> E``."""

  def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
    linear = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.gate = Linear(dim, hidden, **linear)
    self.up = Linear(dim, hidden, **linear)
    self.down = Linear(hidden, dim, **linear)

  def __call__(self, x):
    return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

  def __init__(self, cfg: ModelConfig, *, decode_fn, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.dim, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
    self.attn = DecodeAttention(cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                rope_theta=cfg.rope_theta, dtype=cfg.dtype,
                                param_dtype=cfg.dtype, decode_fn=decode_fn, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.dim, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
    self.mlp = MLP(cfg.dim, cfg.mlp_dim, dtype=cfg.dtype, rngs=rngs)

  def prefill(self, x, lengths):
    x = x + self.attn.prefill(self.attn_norm(x), lengths)
    return x + self.mlp(self.mlp_norm(x))

  def decode(self, x):
    x = x + self.attn.decode(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))

  def ragged(self, x, *step):
    x = x + self.attn.ragged(self.attn_norm(x), *step)
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """Decoder-only LM whose attention layers are `DecodeAttention` (head-major cache).

  ``decode_fn`` is handed to every `DecodeAttention` (its signature is
  `fdecode.flash_decode`'s); two models built from the same ``cfg`` and ``seed`` have
  identical weights whatever their ``decode_fn``.
  """

  def __init__(self, cfg: ModelConfig, *, decode_fn: Callable[..., jax.Array] | None = None,
               seed: int = 0):
    rngs = nnx.Rngs(seed)
    self.cfg = cfg
    self.embed = Embed(cfg.vocab, cfg.dim, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, decode_fn=decode_fn, rngs=rngs) for _ in range(cfg.layers)])
    self.norm = RMSNorm(cfg.dim, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
    self.unembed = Linear(cfg.dim, cfg.vocab, use_bias=False, dtype=cfg.dtype,
                              param_dtype=cfg.dtype, rngs=rngs)

  def init_cache(self, batch: int, max_len: int, *, cache_dtype=None, page_size=None) -> None:
    """Empty caches for every layer: ``[B, Hkv, S, D]``, or with ``page_size`` a page pool
    ``[Hkv, P, page_size, D]``; ``cache_dtype`` (default the model dtype) may be int8 / fp8
    (per-token scales). See `fdecode.flax.DecodeAttention.init_cache`."""
    for block in self.blocks:
      block.attn.init_cache(batch, max_len, cache_dtype or self.cfg.dtype, page_size=page_size)

  def place_cache(self, sharding) -> None:
    """Moves every layer's k and v cache onto ``sharding``, e.g.
    ``NamedSharding(mesh, P(None, "heads", "seq", None))`` (kv heads over "heads", tokens
    over "seq"), so that a sharded ``decode_fn`` finds them already in place."""
    for block in self.blocks:
      for name in block.attn.cache_arrays:
        var = getattr(block.attn, name)
        var.set_value(jax.device_put(var[...], sharding))  # `var[...] =` would keep the old sharding

  def place_state(self, cache_sharding) -> None:
    """Puts the whole model on ``cache_sharding``'s mesh for a sharded decode loop: the
    caches on ``cache_sharding`` (as `place_cache`), every other array (weights, lengths,
    block tables) replicated. A step that keeps them there (`pin_state`, inside the
    trace) then sees the same input shardings at every call and compiles once."""
    self.pin_state(cache_sharding, jax.device_put)

  def pin_state(self, cache_sharding, put=None) -> None:
    """Every state array := ``put(array, sharding)`` with the sharding `place_state`
    gives it; default ``put`` `pin` (inside a trace), so the compiler cannot hand back a
    state laid out otherwise than it came in (the next step would compile again)."""
    put = put or pin
    replicated = NamedSharding(cache_sharding.mesh, PartitionSpec())
    cache_names = set()
    for block in self.blocks:
      cache_names.update(block.attn.cache_arrays)
    def place(path, x):
      names = {getattr(k, "key", None) for k in path}
      return put(x, cache_sharding if names & cache_names else replicated)
    nnx.update(self, jax.tree_util.tree_map_with_path(place, nnx.state(self)))

  def cache_bytes(self) -> int:
    """Bytes of all layers' k and v caches."""
    return sum(getattr(b.attn, name)[...].nbytes for b in self.blocks for name in b.attn.cache_arrays)

  def _embed(self, tokens):
    return self.embed(tokens)

  def _logits(self, x):
    return self.unembed(self.norm(x)).astype(jnp.float32)

  def ragged(self, tokens, kv_lens, block_tables, cu_q_lens, num_seqs):
    """A serving step (`fdecode.decoding.serving`): tokens int ``[N]`` packed by sequence, the
    rest as `fdecode.ragged_decode` over every layer's page pool (``init_cache(...,
    page_size=...)``) -> float32 logits ``[M, V]`` at each sequence's last new token
    (meaningless for a sequence with none, or past ``num_seqs``)."""
    x = self._embed(tokens)
    for block in self.blocks:
      x = block.ragged(x, kv_lens, block_tables, cu_q_lens, num_seqs)
    last = jnp.clip(jnp.asarray(cu_q_lens)[1:] - 1, 0, x.shape[0] - 1)
    return self._logits(x[last])

  def prefill(self, tokens, lengths):
    """tokens int ``[B, L]`` right-padded, lengths int ``[B]`` in ``[1, L]`` ->
    float32 logits ``[B, V]`` at each prompt's last token."""
    x = self.embed(tokens)
    for block in self.blocks:
      x = block.prefill(x, lengths)
    last = x[jnp.arange(x.shape[0]), lengths - 1]  # [B, E]
    return self.unembed(self.norm(last)).astype(jnp.float32)

  def decode(self, tokens):
    """tokens int ``[B]``, one per sequence at its own position -> logits ``[B, V]``."""
    x = self.embed(tokens[:, None])
    for block in self.blocks:
      x = block.decode(x)
    return self.unembed(self.norm(x[:, 0])).astype(jnp.float32)



def pin(x, sharding):
  """``x`` kept on ``sharding`` inside a trace. On Explicit mesh axes the sharding is part
  of the type (reshard: a no-op when it already matches); on Auto axes a constraint."""
  keep = jax.sharding.reshard if is_explicit(sharding.mesh) else jax.lax.with_sharding_constraint
  return keep(x, sharding)
