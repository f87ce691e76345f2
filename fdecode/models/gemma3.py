"""Gemma 3 (text) in Flax NNX on `fdecode.flax.DecodeAttention`, loaded from a GGUF file.

Legend: B batch, L padded prompt length, V vocabulary, E model width, F MLP width,
Hq query heads, Hkv kv heads, D head dim, S cache capacity.

The architecture follows llama.cpp's ``gemma3`` graph (``src/models/gemma3.cpp``), which
is what the GGUF file was made for:

* ``x = embed[tokens] * sqrt(E)`` (tied embeddings: the logits are ``norm(x) @ embed.T``);
* each block: ``x += post_attention_norm(attn(attn_norm(x)))`` then
  ``x += post_ffw_norm(down(gelu_tanh(gate(h)) * up(h)))`` with ``h = ffn_norm(x)``;
* attention: MQA/GQA, RMSNorm over D on q and k (QK-norm) before NEOX (rotate-half) RoPE,
  scores scaled by ``query_pre_attn_scalar ** -0.5`` (1/16 for the 270M model);
* layer ``i`` is global (full causal attention, RoPE base ``{arch}.rope.freq_base``, 1e6)
  when ``(i + 1) % 6 == 0``, else local: a sliding window of ``{arch}.attention.sliding_window``
  tokens (512, counting the query itself) with RoPE base 10000. The file carries neither
  the pattern nor the local base; llama.cpp hard-codes both (``set_swa_pattern(6)``,
  ``rope_freq_base_train_swa = 10000``), and so does `Gemma3Config`.
* RMSNorm is ``x / sqrt(mean(x^2) + eps) * w``: llama.cpp's converter already added
  Gemma's ``1 +`` to every norm weight (``convert_hf_to_gguf.py``, Gemma3Model) and its
  graph multiplies by the stored weight, so the file's weights load unchanged into
  ``nnx.RMSNorm.scale`` (DecodeAttention's q_norm / k_norm, ``scale`` too). Checked
  end to end against llama.cpp by ``benchmarks/validate_llama_cpp.py``.

Example::

  model, gguf_file = load_gemma3(path)              # float32 weights, dequantized
  model.init_cache(batch=2, max_len=256)
  out = fdecode.decoding.generate.generate(model, prompts, lengths, steps=32)
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fdecode.flax import DecodeAttention
from fdecode.flax.invariant import Embed, Linear, RMSNorm
from fdecode.models.base import Transformer
from fdecode.models.gguf import GGUFFile

__all__ = ["Gemma3", "Gemma3Config", "load_gemma3", "load_weights"]


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
  """Shapes and constants of `Gemma3` (defaults: Gemma 3 270M)."""

  vocab: int = 262144            # V
  dim: int = 640                 # E
  layers: int = 18
  num_heads: int = 4             # Hq
  num_kv_heads: int = 1          # Hkv
  head_dim: int = 256            # D
  mlp_dim: int = 2048            # F
  window: int = 512              # local layers' sliding window (tokens, query included)
  global_every: int = 6          # layer i is global iff (i + 1) % global_every == 0
  context: int = 32768           # context_length: the longest sequence the model is made for
  rope_local: float = 10000.0
  rope_global: float = 1e6
  norm_eps: float = 1e-6
  query_pre_attn_scalar: float = 256.0   # scores scale: query_pre_attn_scalar ** -0.5
  dtype: Any = jnp.float32       # parameters and computation

  def __post_init__(self):
    for name in ("vocab", "dim", "layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "window",
                 "global_every", "context"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Gemma3Config: {name} must be an int >= 1, got {value!r}")
    for name in ("rope_local", "rope_global", "norm_eps", "query_pre_attn_scalar"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or not 0 < value <= float(np.finfo(np.float32).max) \
          or np.float32(value) == 0:
        raise ValueError(f"Gemma3Config: {name} must be a number > 0, finite and nonzero in float32; "
                         f"got {value!r}")

  def is_global(self, layer: int) -> bool:
    return (layer + 1) % self.global_every == 0

  @classmethod
  def from_gguf(cls, f: GGUFFile, dtype: Any = jnp.float32) -> "Gemma3Config":
    """Reads the ``gemma3.*`` metadata (llama.cpp's defaults where the file is silent).

    Every value is checked in the domain it is used in: sizes are integers in
    ``[1, 2**31 - 1]``, RoPE bases and the RMS epsilon numbers > 0 that are finite and
    nonzero in float32.

    Raises:
      ValueError: not a ``gemma3`` file; a required key missing; a value of the wrong type
        or range (names the key and the value); ``block_count`` disagreeing with the
        file's ``blk.N.*`` tensors (a truncated or padded model); heads not a multiple of
        kv heads; key and value head dims differing; RoPE scaling (not implemented).
    """
    arch = f.require("general.architecture", str)
    if arch != "gemma3":
      raise ValueError(f"Gemma3Config.from_gguf: {f.path!r} holds a {arch!r} model, not 'gemma3'")
    key = lambda name: f"{arch}.{name}"
    heads = f.int_value(key("attention.head_count"))
    kv_heads = f.int_value(key("attention.head_count_kv"), heads)
    if heads % kv_heads:
      raise ValueError(f"Gemma3Config.from_gguf: {key('attention.head_count')}={heads} must be a "
                       f"multiple of {key('attention.head_count_kv')}={kv_heads} in {f.path!r}")
    dim = f.int_value(key("embedding_length"))
    head_dim = f.int_value(key("attention.key_length"), None)
    if head_dim is None:
      if dim % heads:
        raise ValueError(f"Gemma3Config.from_gguf: no {key('attention.key_length')}, and "
                         f"{key('embedding_length')}={dim} is not a multiple of the {heads} heads")
      head_dim = dim // heads
    if f.int_value(key("attention.value_length"), head_dim) != head_dim:
      raise ValueError(f"Gemma3Config.from_gguf: key_length {head_dim} != value_length "
                       f"{f.metadata[key('attention.value_length')]} is not supported")
    scaling = f.metadata.get(key("rope.scaling.type"), "none")
    if scaling not in ("none", None) and f.metadata.get(key("rope.scaling.factor"), 1.0) != 1.0:
      raise ValueError(f"Gemma3Config.from_gguf: RoPE scaling {scaling!r} (factor "
                       f"{f.metadata.get(key('rope.scaling.factor'))}) is not implemented")
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else f.tensor_shapes.get("token_embd.weight", (cls.vocab,))[0]
    return cls(vocab=vocab, dim=dim, layers=_block_count(f, key("block_count")), num_heads=heads,
               num_kv_heads=kv_heads, head_dim=head_dim, mlp_dim=f.int_value(key("feed_forward_length")),
               window=f.int_value(key("attention.sliding_window"), cls.window),
               global_every=f.int_value(key("attention.sliding_window_pattern"), cls.global_every),
               context=f.int_value(key("context_length"), cls.context),
               rope_local=f.float_value(key("rope.freq_base_swa"), cls.rope_local),
               rope_global=f.float_value(key("rope.freq_base"), cls.rope_global),
               norm_eps=f.float_value(key("attention.layer_norm_rms_epsilon"), cls.norm_eps),
               query_pre_attn_scalar=float(head_dim), dtype=dtype)


def _block_count(f: GGUFFile, key: str) -> int:
  """``{arch}.block_count``, checked against the blocks the file's ``blk.N.*`` tensors hold:
  the count must be exactly 0..N-1 (a smaller count would load a truncated model)."""
  count = f.int_value(key)
  blocks = sorted({int(part) for part in (n.split(".")[1] for n in f.tensor_shapes
                                          if n.startswith("blk.") and n.count(".") >= 2)
                   if part.isdigit()})
  if blocks != list(range(count)):
    extra = [b for b in blocks if b >= count]
    missing = sorted(set(range(count)) - set(blocks))
    detail = (f"tensors of blocks past it (blk.{extra[0]}.* ... blk.{extra[-1]}.*)" if extra else
              f"no tensors for blocks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    raise ValueError(f"Gemma3Config.from_gguf: metadata {key!r} = {count} disagrees with the "
                     f"tensors in {f.path!r}: {len(blocks)} blocks hold blk.N.* tensors, and it has "
                     f"{detail}; a truncated or corrupt file")
  return count


class GeGLU(nnx.Module):
  """``down(gelu_tanh(gate(x)) * up(x))``, ``E -> F -> E``."""

  def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
    linear = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.gate = Linear(dim, hidden, **linear)
    self.up = Linear(dim, hidden, **linear)
    self.down = Linear(hidden, dim, **linear)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.gate(x), approximate=True) * self.up(x))


class Gemma3Block(nnx.Module):
  """Sandwich-norm decoder block; local (sliding window) or global by its index."""

  def __init__(self, cfg: Gemma3Config, layer: int, *, decode_fn, rngs: nnx.Rngs):
    norm = lambda n: RMSNorm(n, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.dtype,
                                 rngs=rngs)
    is_global = cfg.is_global(layer)
    self.attn_norm, self.post_attn_norm = norm(cfg.dim), norm(cfg.dim)
    self.ffn_norm, self.post_ffn_norm = norm(cfg.dim), norm(cfg.dim)
    self.attn = DecodeAttention(
        cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        rope_theta=cfg.rope_global if is_global else cfg.rope_local,
        window=None if is_global else cfg.window, qk_norm=True, norm_eps=cfg.norm_eps,
        softmax_scale=cfg.query_pre_attn_scalar ** -0.5, dtype=cfg.dtype, param_dtype=cfg.dtype,
        decode_fn=decode_fn, rngs=rngs)
    self.mlp = GeGLU(cfg.dim, cfg.mlp_dim, dtype=cfg.dtype, rngs=rngs)

  def _mlp(self, x):
    return x + self.post_ffn_norm(self.mlp(self.ffn_norm(x)))

  def prefill(self, x, lengths):
    return self._mlp(x + self.post_attn_norm(self.attn.prefill(self.attn_norm(x), lengths)))

  def decode(self, x):
    return self._mlp(x + self.post_attn_norm(self.attn.decode(self.attn_norm(x))))

  def ragged(self, x, *step):
    return self._mlp(x + self.post_attn_norm(self.attn.ragged(self.attn_norm(x), *step)))


class Gemma3(Transformer):
  """Gemma 3 decoder with `DecodeAttention` layers (head-major caches, per-sequence lengths).

  It shares `fdecode.models.base.Transformer`'s cache plumbing (``init_cache``,
  ``place_cache``, ``place_state``, ``cache_bytes``), so `fdecode.decoding.generate.generate` drives it.
  ``decode_fn`` goes to every attention layer (see `set_decode_fn`).

  Attributes:
    embed: ``nnx.Embed`` ``[V, E]``, also the (tied) output projection.
    blocks: `Gemma3Block` list; ``blocks[i].attn`` is the `DecodeAttention` of layer i.
    norm: final RMSNorm.
  """

  def __init__(self, cfg: Gemma3Config, *, decode_fn: Callable[..., jax.Array] | None = None,
               seed: int = 0):  # pylint: disable=super-init-not-called
    rngs = nnx.Rngs(seed)
    self.cfg = cfg
    self.embed = Embed(cfg.vocab, cfg.dim, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
    self.blocks = nnx.List([Gemma3Block(cfg, i, decode_fn=decode_fn, rngs=rngs)
                            for i in range(cfg.layers)])
    self.norm = RMSNorm(cfg.dim, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.dtype,
                            rngs=rngs)

  def set_decode_fn(self, decode_fn: Callable[..., jax.Array] | None) -> None:
    """Attends with ``decode_fn`` from now on (None: `fdecode.flash_decode`), same weights."""
    import fdecode  # pylint: disable=import-outside-toplevel
    for block in self.blocks:
      block.attn.decode_fn = fdecode.flash_decode if decode_fn is None else decode_fn

  def _embed(self, tokens):
    return self.embed(tokens) * jnp.asarray(math.sqrt(self.cfg.dim), self.cfg.dtype)

  def _logits(self, x):
    return self.embed.attend(self.norm(x)).astype(jnp.float32)

  def prefill(self, tokens, lengths):
    """tokens int ``[B, L]`` right-padded, lengths int ``[B]`` in ``[1, L]`` -> float32
    logits ``[B, V]`` at each prompt's last token; the caches hold the prompts."""
    x = self._embed(tokens)
    for block in self.blocks:
      x = block.prefill(x, lengths)
    return self._logits(x[jnp.arange(x.shape[0]), lengths - 1])

  def decode(self, tokens):
    """tokens int ``[B]``, one per sequence at its own position -> float32 logits ``[B, V]``."""
    x = self._embed(tokens[:, None])
    for block in self.blocks:
      x = block.decode(x)
    return self._logits(x[:, 0])


def _tensor_map(cfg: Gemma3Config) -> dict[str, tuple[tuple[int, ...], Callable[[Gemma3], Any], bool]]:
  """GGUF tensor name -> (numpy shape, the `Gemma3` variable it fills, transpose?)."""
  e, f, d = cfg.dim, cfg.mlp_dim, cfg.head_dim
  hq, hkv = cfg.num_heads * d, cfg.num_kv_heads * d
  out = {"token_embd.weight": ((cfg.vocab, e), lambda m: m.embed.embedding, False),
         "output_norm.weight": ((e,), lambda m: m.norm.scale, False)}
  for i in range(cfg.layers):
    blk = lambda m, i=i: m.blocks[i]
    layer = {
        "attn_norm": ((e,), lambda m, b=blk: b(m).attn_norm.scale, False),
        "attn_q": ((hq, e), lambda m, b=blk: b(m).attn.q_proj.kernel, True),
        "attn_k": ((hkv, e), lambda m, b=blk: b(m).attn.k_proj.kernel, True),
        "attn_v": ((hkv, e), lambda m, b=blk: b(m).attn.v_proj.kernel, True),
        "attn_output": ((e, hq), lambda m, b=blk: b(m).attn.o_proj.kernel, True),
        "attn_q_norm": ((d,), lambda m, b=blk: b(m).attn.q_norm.scale, False),
        "attn_k_norm": ((d,), lambda m, b=blk: b(m).attn.k_norm.scale, False),
        "post_attention_norm": ((e,), lambda m, b=blk: b(m).post_attn_norm.scale, False),
        "ffn_norm": ((e,), lambda m, b=blk: b(m).ffn_norm.scale, False),
        "ffn_gate": ((f, e), lambda m, b=blk: b(m).mlp.gate.kernel, True),
        "ffn_up": ((f, e), lambda m, b=blk: b(m).mlp.up.kernel, True),
        "ffn_down": ((e, f), lambda m, b=blk: b(m).mlp.down.kernel, True),
        "post_ffw_norm": ((e,), lambda m, b=blk: b(m).post_ffn_norm.scale, False),
    }
    out.update({f"blk.{i}.{name}.weight": spec for name, spec in layer.items()})
  return out


def load_weights(model: Gemma3, f: GGUFFile) -> None:
  """Fills every parameter of ``model`` from GGUF file ``f`` (dequantized to float32,
  then cast to ``model.cfg.dtype``; linear weights ``[out, in]`` transposed to
  ``nnx.Linear``'s ``[in, out]``).

  Raises:
    ValueError: a tensor missing, of the wrong shape or of an unsupported type
      (`GGUFFile.tensor`), tensors of blocks past ``model.cfg.layers``, or an
      ``output.weight`` (untied head: not Gemma 3).
  """
  if "output.weight" in f.tensor_types:
    raise ValueError(f"load_weights: {f.path!r} has an untied output.weight; Gemma 3 ties "
                     "the output projection to token_embd.weight")
  past = sorted(n for n in f.tensor_types if n.startswith("blk.") and n.split(".")[1].isdigit()
                and int(n.split(".")[1]) >= model.cfg.layers)
  if past:  # a config with fewer layers than the file: it would load a truncated model
    raise ValueError(f"load_weights: {f.path!r} has {len(past)} tensors of blocks past the model's "
                     f"{model.cfg.layers} layers (e.g. {past[0]!r})")
  for name, (shape, var, transpose) in _tensor_map(model.cfg).items():
    w = f.tensor(name, shape)
    var(model).set_value(jnp.asarray(w.T if transpose else w, model.cfg.dtype))
  left = [p for p in jax.tree.leaves(nnx.state(model, nnx.Param)) if not isinstance(p, jax.Array)]
  if left:  # a parameter the map does not cover: a bug here, not in the file
    raise AssertionError(f"load_weights: {len(left)} parameters were not loaded")


def load_gemma3(path: str | os.PathLike, *, dtype: Any = jnp.float32,
                decode_fn: Callable[..., jax.Array] | None = None) -> tuple[Gemma3, GGUFFile]:
  """Builds `Gemma3` from a GGUF file: config from its metadata, weights dequantized.

  Args:
    path: a ``gemma3`` GGUF file (e.g. `fdecode.models.weights.gemma3_270m_path()`).
    dtype: parameter and compute dtype (float32, or bfloat16 to halve the memory).
    decode_fn: attention over the cache (`DecodeAttention`'s ``decode_fn``).

  Returns:
    ``(model, gguf_file)``; ``gguf_file.metadata`` also feeds `GGUFTokenizer`.

  Raises:
    FileNotFoundError / ValueError: see `GGUFFile`, `Gemma3Config.from_gguf`, `load_weights`.
  """
  f = GGUFFile(path)
  cfg = Gemma3Config.from_gguf(f, dtype=dtype)
  # Abstract parameters first (no random init of a V x E embedding), then the file's.
  model = nnx.eval_shape(lambda: Gemma3(cfg, decode_fn=decode_fn))
  load_weights(model, f)
  return model, f
