"""`DecodeAttention`: a GQA + RoPE attention layer owning a head-major cache with
per-sequence lengths (legend in `fdecode.flax`)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import ArrayLike
import numpy as np
from flax import nnx

from fdecode.api import flash_decode
from fdecode.cache.write import write_contiguous, write_paged
from fdecode.cache.meshes import host_values, replicated
from fdecode.flax.invariant import Linear, RMSNorm
from fdecode.cache.quant import check_cache_dtype, is_quantized
from fdecode.ragged import ragged_decode, row_positions
from fdecode.validation import (check_cache_sizes, check_norm_eps, check_rope_theta, static_bool, static_int,
                                static_scale, static_soft_cap, static_window, to_int32)

__all__ = ["DecodeAttention", "alibi_slopes", "apply_rope"]


def apply_rope(x: ArrayLike, positions: ArrayLike, *, theta: float = 10000.0) -> Array:
  """Rotary position embedding, rotate-half convention (GPT-NeoX / Llama).

  Args:
    x: ``[B, T, H, D]`` float, D even.
    positions: int ``[B, T]`` absolute position of each token.
    theta: base of the frequencies ``theta ** (-2i / D)``.

  Returns:
    ``[B, T, H, D]`` in ``x.dtype``; the pair ``(x[..., i], x[..., i + D/2])`` is rotated
    by ``positions * theta ** (-2i / D)``, computed in float32.
  """
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"apply_rope: head dim must be even, got x.shape={tuple(x.shape)}")
  if positions.shape != x.shape[:2]:
    raise ValueError(f"apply_rope: positions must be [B, T]={tuple(x.shape[:2])}; got "
                     f"positions.shape={tuple(positions.shape)}, x.shape={tuple(x.shape)}")
  half = d // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / d)
  angle = positions.astype(jnp.float32)[..., None, None] * freq.reshape(1, 1, 1, half)  # [B, T, 1, D/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def alibi_slopes(num_heads: int) -> Array:
  """The standard ALiBi slopes (Press et al.; BLOOM / MPT / vLLM), float32 ``[Hq]``:
  ``2 ** (-8 (i + 1) / n)`` for the largest power of two ``n <= Hq``, then every other
  slope of ``2n`` heads for the rest.

  Raises:
    ValueError: ``num_heads`` not an int >= 1.
  """
  num_heads = static_int("num_heads", num_heads, caller="alibi_slopes", what=" (Hq, the query heads)")
  closest = 1 << (num_heads.bit_length() - 1)
  geometric = lambda n: [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
  slopes = geometric(closest) + geometric(2 * closest)[0::2][:num_heads - closest]
  return jnp.asarray(slopes, jnp.float32)


class DecodeAttention(nnx.Module):
  """Self-attention with GQA, RoPE and a head-major KV cache for batched decoding.

  Each of the B sequences in the cache has its own length (continuous batching: they
  sit at different positions). `prefill` writes right-padded prompts; `decode` appends
  T tokens to every sequence at its own position and attends with ``decode_fn``
  (`fdecode.flash_decode` by default) straight on the cache, no copy or transpose.

  Layout: ``q = x @ Wq`` reshaped ``[B, T, Hq, D]`` (heads outer, D inner), likewise k
  and v with Hkv heads; RoPE (`apply_rope`) on q and k at each token's absolute
  position; ``out = concat_heads(attention) @ Wo``. The cache holds rotated keys.

  Attributes:
    q_proj, k_proj, v_proj, o_proj: ``nnx.Linear`` ``E -> Hq*D``, ``E -> Hkv*D`` (twice),
      ``Hq*D -> E``.
    cached_key, cached_value: ``nnx.Cache`` ``[B, Hkv, S, D]`` head-major, or a page
      pool ``[Hkv, P, page_size, D]`` with ``block_tables`` ``[B, n]``, after `init_cache`.
    lengths: ``nnx.Cache`` int32 ``[B]``: valid tokens of each sequence.
    overflowed: ``nnx.Cache`` bool ``[B]``: True for a sequence that a jitted `decode`
      step could not fit (``lengths + T > S``) since the last `prefill` / `init_cache`.

  Errors and overflow: a call that raises leaves every array of the layer (caches,
  scales, block table, lengths, overflowed) exactly as it was. An eager `decode` that
  would take a sequence past S raises ValueError. Under ``jit`` (lengths traced) it
  cannot raise, so such a sequence is skipped: none of its T tokens is written, its
  length stays, its output rows are NaN and its ``overflowed`` flag is set (sticky until
  the next `prefill`); the other sequences step normally. A serving engine reads
  ``layer.overflowed`` (or checks the rows for NaN) and frees or evicts those sequences.

  Sharding: ``decode_fn`` is the extension point. It receives
  ``(q [B, T, Hq, D], k_cache, v_cache, lengths [B], **scales)`` (``k_scale``/``v_scale``
  for 8-bit caches) and returns ``[B, T, Hq, D]``,
  i.e. `fdecode.flash_decode`'s signature; bind knobs with ``functools.partial``
  (``impl=``, ``num_splits=``), or pass a multi-device wrapper such as
  ``partial(fdecode.sharding.sharded_flash_decode, mesh=mesh, head_axis="model")``
  after placing the cache with ``jax.device_put`` on a matching sharding. Cache writes
  keep the cache's sharding (Explicit or Auto meshes); the projections are replicated
  (not tensor-parallel), so on an Explicit mesh the attention output ``[B, T, Hq, D]``
  is gathered before ``o_proj``.

  Example::

    layer = DecodeAttention(64, num_heads=8, num_kv_heads=2, head_dim=16, rngs=nnx.Rngs(0))
    layer.init_cache(batch=2, max_len=128)
    y = layer.prefill(x_prompt, lengths)   # x_prompt [2, L, 64] right-padded, lengths [2]
    y1 = layer.decode(x_next)              # x_next [2, 1, 64]: one token per sequence
  """

  def __init__(self, in_features: int, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, *, rope_theta: float = 10000.0,
               use_bias: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
               decode_fn: Callable[..., jax.Array] | None = None, window: int | None = None,
               logits_soft_cap: float | None = None, sinks: bool = False, alibi: bool = False,
               qk_norm: bool = False, norm_eps: float = 1e-6, softmax_scale: float | None = None,
               batch_invariant: bool = False, rngs: nnx.Rngs):
    """Builds the projections.

    Args:
      in_features: E, the model width (input and output features).
      num_heads: Hq.
      num_kv_heads: Hkv, dividing Hq (Hq: MHA, 1: MQA); default Hq.
      head_dim: D, even (RoPE); default ``E // Hq``.
      rope_theta: RoPE base (per layer: Gemma 3's local and global layers differ).
      use_bias: biases on the four projections.
      dtype, param_dtype: computation and parameter dtypes of the projections.
      decode_fn: attention over the cache in `decode`; default `fdecode.flash_decode`.
      window: sliding window of this layer (`fdecode.flash_decode`'s ``window``); a
        Gemma-3-like model alternates local (windowed) and global (None) layers.
      logits_soft_cap: `fdecode.flash_decode`'s ``logits_soft_cap`` (Gemma 2).
      sinks: learn one sink logit per query head (``self.sinks``, ``nnx.Param`` f32
        ``[Hq]``, zeros at init; gpt-oss).
      alibi: add ALiBi biases with the standard slopes (`alibi_slopes`); use with
        ``rope_theta=None`` for ALiBi-only models (BLOOM, MPT).
      qk_norm: RMSNorm over D on q and k before RoPE (``q_norm`` / ``k_norm``; Gemma 3).
      norm_eps: epsilon of the QK norms.
      softmax_scale: scores multiplier; default ``1/sqrt(D)``.
      batch_invariant: attend in `fdecode.flash_decode`'s batch-invariant mode (in
        `decode`, `prefill` and `ragged`): a sequence's attention bits do not depend on the
        rest of the batch, nor on whether its tokens are decoded or prefilled. The
        `fdecode.decoding.serving.Engine` sets it on every layer with its own
        ``batch_invariant``.
      rngs: parameter initialization.

    Raises:
      ValueError: a size not a positive int, Hq not a multiple of Hkv, D odd, or a static
        option outside the domain it is used in (checked again at every call, before
        anything is written): ``window`` an int32 >= 1; ``logits_soft_cap`` and
        ``softmax_scale`` as `fdecode.flash_decode` takes them (float32, with
        ``1 / logits_soft_cap`` normal); ``rope_theta`` a float32 >= 1; ``norm_eps`` (with
        ``qk_norm``) a positive normal float32.
    """
    caller = "DecodeAttention"
    in_features = static_int("in_features", in_features, caller=caller)
    num_heads = static_int("num_heads", num_heads, caller=caller)
    num_kv_heads = num_heads if num_kv_heads is None else static_int("num_kv_heads", num_kv_heads, caller=caller)
    head_dim = in_features // num_heads if head_dim is None else static_int("head_dim", head_dim, caller=caller)
    if num_heads % num_kv_heads:
      raise ValueError(f"DecodeAttention: num_heads ({num_heads}) must be a positive "
                       f"multiple of num_kv_heads ({num_kv_heads})")
    if head_dim < 2 or head_dim % 2:
      raise ValueError(f"DecodeAttention: head_dim must be even and >= 2 (RoPE), got {head_dim}")
    # The same checks flash_decode makes (float32 / int32 domains), at construction time.
    window, logits_soft_cap = static_window(window, caller), static_soft_cap(logits_soft_cap, caller)
    if softmax_scale is not None:
      softmax_scale = static_scale(softmax_scale, head_dim, caller)
    rope_theta = None if rope_theta is None else check_rope_theta(rope_theta, caller)
    if qk_norm:
      norm_eps = check_norm_eps(norm_eps, caller)
    self.in_features = in_features
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.rope_theta = rope_theta
    self.decode_fn = flash_decode if decode_fn is None else decode_fn
    self.batch_invariant = static_bool("batch_invariant", batch_invariant, caller)
    linear = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = Linear(in_features, num_heads * head_dim, **linear)
    self.k_proj = Linear(in_features, num_kv_heads * head_dim, **linear)
    self.v_proj = Linear(in_features, num_kv_heads * head_dim, **linear)
    self.o_proj = Linear(num_heads * head_dim, in_features, **linear)
    self.window, self.logits_soft_cap, self.softmax_scale = window, logits_soft_cap, softmax_scale
    self.sinks = nnx.Param(jnp.zeros((num_heads,), jnp.float32)) if sinks else nnx.data(None)
    self.alibi_slopes = nnx.data(alibi_slopes(num_heads) if alibi else None)
    norm = dict(epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_norm = RMSNorm(head_dim, **norm) if qk_norm else nnx.data(None)
    self.k_norm = RMSNorm(head_dim, **norm) if qk_norm else nnx.data(None)
    self.cached_key: nnx.Cache | None = nnx.data(None)
    self.cached_value: nnx.Cache | None = nnx.data(None)
    self.key_scale: nnx.Cache | None = nnx.data(None)
    self.value_scale: nnx.Cache | None = nnx.data(None)
    self.block_tables: nnx.Cache | None = nnx.data(None)
    self.lengths: nnx.Cache | None = nnx.data(None)
    self.overflowed: nnx.Cache | None = nnx.data(None)

  def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32, *,
                 page_size: int | None = None) -> None:
    """Allocates an empty cache, lengths 0.

    Contiguous (default): k/v ``[batch, Hkv, max_len, D]`` in ``dtype``.
    Paged (``page_size``): a pool ``[Hkv, P, page_size, D]`` with
    ``P = batch * ceil(max_len / page_size)`` and ``block_tables`` int32
    ``[batch, n = ceil(max_len / page_size)]`` giving column j of sequence b the page
    ``j * batch + b`` (so a pool split in contiguous page ranges over a sequence-parallel
    mesh axis holds exactly the token ranges of that axis); replace it (``layer.block_tables.set_value(...)``) with a
    table from `fdecode.cache.PageAllocator` to share one pool between requests.
    ``dtype`` int8, float8_e4m3fn or float8_e5m2 makes an 8-bit cache with one float32
    scale per token per head (``key_scale``/``value_scale``, the cache's shape with last
    axis 1): new tokens are quantized as they are written, dequantized inside the kernel.

    Raises:
      ValueError: ``batch``, ``max_len`` or ``page_size`` not a positive int (or a
        capacity or page count past int32), or a ``dtype`` neither floating of 16 bits
        or more nor int8 / float8_e4m3fn / float8_e5m2.
    """
    check_cache_sizes("DecodeAttention.init_cache", batch, max_len, page_size)
    dtype = check_cache_dtype("dtype", dtype, "DecodeAttention.init_cache")
    if page_size is None:
      shape = (batch, self.num_kv_heads, max_len, self.head_dim)
      self.block_tables = None
    else:
      pages = -(-max_len // page_size)
      shape = (self.num_kv_heads, batch * pages, page_size, self.head_dim)
      # Column-major ids (page of sequence b, column j = j * batch + b): pool shard d of
      # any n_s dividing `pages` then holds exactly the columns of token range d, as
      # sharded_flash_decode's seq_axis needs.
      self.block_tables = nnx.Cache(jnp.arange(batch * pages, dtype=jnp.int32).reshape(pages, batch).T)
    self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
    if is_quantized(dtype):
      self.key_scale = nnx.Cache(jnp.ones(shape[:3] + (1,), jnp.float32))
      self.value_scale = nnx.Cache(jnp.ones(shape[:3] + (1,), jnp.float32))
    else:
      self.key_scale = self.value_scale = None
    self.lengths = nnx.Cache(jnp.zeros((batch,), jnp.int32))
    self.overflowed = nnx.Cache(jnp.zeros((batch,), jnp.bool_))

  def prefill(self, x: ArrayLike, lengths: ArrayLike) -> Array:
    """Writes a batch of right-padded prompts into the cache (replacing its contents).

    Args:
      x: ``[B, L, E]`` float; row b holds its prompt in ``x[b, :lengths[b]]``, the rest
        is padding. ``1 <= L <= S``.
      lengths: int ``[B]`` prompt lengths, in ``[0, L]``. Concrete values outside raise
        ValueError; under ``jit`` they are clipped to ``[0, L]``.

    Returns:
      ``[B, L, E]``: causal self-attention outputs at the prompt positions, 0 at padding.
      ``lengths`` becomes the prompt lengths and ``overflowed`` is cleared.
    """
    b, seq, _ = self._check_input("prefill", x)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise ValueError(f"DecodeAttention.prefill: lengths must be int [B]=({b},); got "
                       f"lengths.shape={tuple(lengths.shape)} dtype={lengths.dtype}, "
                       f"x.shape={tuple(x.shape)}")
    capacity = self._capacity()
    if seq > capacity:
      raise ValueError(f"DecodeAttention.prefill: x.shape={tuple(x.shape)} has L={seq} > "
                       f"cache capacity S={capacity}")
    values = host_values(lengths)
    if values is not None and ((values < 0) | (values > seq)).any():
      i = int(np.nonzero((values < 0) | (values > seq))[0][0])
      raise ValueError(f"DecodeAttention.prefill: lengths must lie in [0, L={seq}] (L <= S={capacity}); "
                       f"sequence {i} has length {int(values[i])}, x.shape={tuple(x.shape)}")
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, seq)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
    q, k, v = self._qkv(x, positions)
    new_state = self._written(k, v, jnp.zeros((b,), jnp.int32))
    mods = self._modifiers()
    if set(mods) <= {"softmax_scale"}:  # plain causal attention: XLA's fused prefill
      # JAX's attention promotes a 16-bit q with float32 itself (its logits dtype), which a
      # caller's jax_numpy_dtype_promotion="strict" would refuse: its own rule, kept.
      with jax.numpy_dtype_promotion("standard"):
        out = jax.nn.dot_product_attention(q, k, v.astype(q.dtype), is_causal=True,
                                           scale=mods.get("softmax_scale"), key_value_seq_lengths=lengths)
    else:
      # The prompt's own keys as a head-major cache; with kv_offset = lengths - L, query t
      # sits at position t (flash_decode places T new tokens at the sequence's end).
      out = flash_decode(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3).astype(q.dtype), lengths,
                         kv_offset=lengths - seq, **mods)
    out = jnp.where((positions < lengths[:, None])[..., None, None], out, 0)
    out = self.o_proj(out.reshape(b, seq, -1))
    self._commit(new_state, lengths=lengths, overflowed=jnp.zeros((b,), jnp.bool_))
    return out

  def decode(self, x: ArrayLike) -> Array:
    """Appends T tokens to every sequence at its own position and attends over the cache.

    Args:
      x: ``[B, T, E]`` float, ``T >= 1``: token t of sequence b goes to position
        ``lengths[b] + t`` (``lengths`` as before the call), causal among the T.

    Returns:
      ``[B, T, E]``; ``lengths`` grows by T. A sequence with ``lengths + T > S``: eager,
      ValueError and nothing changes; under ``jit``, that sequence is not written, its
      length stays, its rows of the result are NaN and ``overflowed[b]`` is set (see the
      class docstring).
    """
    b, t, _ = self._check_input("decode", x)
    s = self._capacity()
    lengths = self.lengths[...]
    values = host_values(lengths)
    if values is not None and (values + t > s).any():
      i = int(np.nonzero(values + t > s)[0][0])
      raise ValueError(f"DecodeAttention.decode: sequence {i} holds {int(values[i])} tokens; {t} more "
                       f"exceed the cache capacity S={s}. Nothing was written; free, evict or "
                       "re-prefill it first")
    fits = lengths + t <= s  # [B]
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    q, k, v = self._qkv(x, positions)
    # A sequence that does not fit writes at S: every one of its slots is dropped.
    new_state = self._written(k, v, jnp.where(fits, lengths, s))
    lengths = jnp.where(fits, lengths + t, lengths)
    extra = {}
    if self.key_scale is not None:
      extra.update(k_scale=new_state["key_scale"], v_scale=new_state["value_scale"])
    if self.block_tables is not None:
      extra.update(block_tables=self.block_tables[...])
    out = self.decode_fn(q, new_state["cached_key"], new_state["cached_value"], lengths, **extra,
                         **self._modifiers())
    # Projections are replicated (not tensor-parallel): gather the small attention output
    # on Explicit meshes, where o_proj's contraction over sharded heads is ambiguous.
    out = self.o_proj(replicated(out).reshape(b, t, -1))
    out = jnp.where(fits[:, None, None], out, jnp.nan)
    self._commit(new_state, lengths=lengths, overflowed=self.overflowed[...] | ~fits)
    return out

  def ragged(self, x: ArrayLike, kv_lens: ArrayLike, block_tables: ArrayLike, cu_q_lens: ArrayLike,
             num_seqs: ArrayLike) -> Array:
    """A serving step over a shared page pool (`fdecode.decoding.serving`): packed new tokens of
    several sequences, any number each, written into the pool and attended with
    `fdecode.ragged_decode` (the write fused into the call).

    Args:
      x: ``[N, E]`` float, the step's new tokens packed by sequence (see
        `fdecode.ragged_decode`: sequence i owns rows ``cu_q_lens[i]:cu_q_lens[i + 1]``,
        the last of its ``kv_lens[i]`` positions); rows past ``cu_q_lens[num_seqs]`` are
        padding.
      kv_lens, block_tables, cu_q_lens, num_seqs: as `fdecode.ragged_decode`; the table's
        page ids index this layer's pool (every layer of a model shares the ids).

    Returns:
      ``[N, E]``; padding rows are 0 before ``o_proj``. The pool holds the new tokens.
      ``lengths`` / ``block_tables`` of the layer are not used: the engine owns them.

    Raises:
      ValueError: a layer without a paged float cache (``init_cache(page_size=...)``;
        8-bit caches need their scales written, which the fused write does not do).
    """
    self._check_attributes("ragged")
    if self.cached_key is None or self.block_tables is None or self.key_scale is not None:
      raise ValueError("DecodeAttention.ragged: needs a paged float cache: init_cache(batch, max_len, "
                       "dtype=<float>, page_size=...)")
    if x.ndim != 2 or x.shape[-1] != self.in_features:
      raise ValueError(f"DecodeAttention.ragged: x must be [N, E=({self.in_features})]; got x.shape={tuple(x.shape)}")
    n = x.shape[0]
    capacity = block_tables.shape[1] * self.cached_key.shape[2]
    *_, pos = row_positions(to_int32(kv_lens), to_int32(cu_q_lens), to_int32(jnp.reshape(num_seqs, (-1,))[:1]),
                            n, capacity)
    q, k, v = self._qkv(x[None], jnp.maximum(pos, 0)[None])
    out, k_pool, v_pool = ragged_decode(q[0], self.cached_key[...], self.cached_value[...], kv_lens, block_tables,
                                        cu_q_lens, num_seqs, new_k=k[0], new_v=v[0],
                                        **self._modifiers())
    self._commit(dict(cached_key=k_pool, cached_value=v_pool))
    return self.o_proj(out.reshape(n, -1))

  def _modifiers(self) -> dict:
    """The layer's score modifiers as `fdecode.flash_decode` keywords (only those set, so
    a custom ``decode_fn`` without them keeps working for a plain layer)."""
    mods = dict(window=self.window, logits_soft_cap=self.logits_soft_cap, softmax_scale=self.softmax_scale,
                sinks=None if self.sinks is None else self.sinks[...], alibi_slopes=self.alibi_slopes,
                batch_invariant=getattr(self, "batch_invariant", False) or None)
    return {name: x for name, x in mods.items() if x is not None}

  def _written(self, k, v, positions) -> dict:
    """k, v ``[B, T, Hkv, D]`` -> the cache arrays with slots ``positions[b] + t`` written
    (`write_contiguous` / `write_paged`: one scatter per array, quantizing for 8-bit
    caches, keeping the cache's sharding), by attribute name. Nothing is set yet."""
    k_new, v_new = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]: only the new tokens
    if self.block_tables is None:
      write = write_contiguous
    else:
      write = functools.partial(write_paged, block_tables=self.block_tables[...])
    scales = {}
    if self.key_scale is not None:
      scales = dict(k_scale=self.key_scale[...], v_scale=self.value_scale[...])
    arrays = write(self.cached_key[...], self.cached_value[...], k_new=k_new, v_new=v_new,
                   positions=positions, **scales)
    return dict(zip(self.cache_arrays, arrays))

  def _commit(self, arrays: dict, **more) -> None:
    """Sets every state array at once, after all the step's work succeeded."""
    for name, value in {**arrays, **more}.items():
      getattr(self, name).set_value(value)  # set_value, not [...] =: keeps the new sharding

  @property
  def cache_arrays(self) -> tuple[str, ...]:
    """Names of the cache's arrays laid out like the cache (k, v, and 8-bit scales)."""
    names = ("cached_key", "cached_value")
    return names + (("key_scale", "value_scale") if self.key_scale is not None else ())

  @property
  def capacity(self) -> int:
    """S: tokens each sequence's cache can hold."""
    return self._capacity()

  def _capacity(self) -> int:
    if self.block_tables is None:
      return self.cached_key.shape[2]
    return self.block_tables.shape[1] * self.cached_key.shape[2]

  def _check_attributes(self, method: str) -> None:
    """The static options, checked again at use (an attribute may have been reassigned
    since construction), before anything is computed or written."""
    caller = f"DecodeAttention.{method}"
    static_window(self.window, caller)
    static_soft_cap(self.logits_soft_cap, caller)
    if self.softmax_scale is not None:
      static_scale(self.softmax_scale, self.head_dim, caller)
    if self.rope_theta is not None:
      check_rope_theta(self.rope_theta, caller)

  def _check_input(self, method: str, x):
    self._check_attributes(method)
    if self.cached_key is None:
      raise ValueError(f"DecodeAttention.{method}: no cache; call init_cache(batch, max_len) first")
    batch = self.lengths.shape[0]
    if x.ndim != 3 or x.shape[-1] != self.in_features or x.shape[0] != batch:
      raise ValueError(f"DecodeAttention.{method}: x must be [B, T, E]=[{batch}, T, "
                       f"{self.in_features}]; got x.shape={tuple(x.shape)}, "
                       f"cache shape {tuple(self.cached_key.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"DecodeAttention.{method}: x must be floating point, got x.dtype={x.dtype}")
    if x.shape[1] < 1:
      raise ValueError(f"DecodeAttention.{method}: x must hold at least one token; got "
                       f"x.shape={tuple(x.shape)}")
    return x.shape

  def _qkv(self, x, positions):
    """x ``[B, T, E]`` -> rotated q ``[B, T, Hq, D]``, rotated k and v ``[B, T, Hkv, D]``."""
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      # Flax's RMSNorm promotes a 16-bit input with float32 itself (its statistics), which a
      # caller's jax_numpy_dtype_promotion="strict" would refuse: its own rule, kept.
      with jax.numpy_dtype_promotion("standard"):
        q, k = self.q_norm(q), self.k_norm(k)
    if self.rope_theta is not None:
      q = apply_rope(q, positions, theta=self.rope_theta)
      k = apply_rope(k, positions, theta=self.rope_theta)
    return q, k, v
