"""Flax integration: a drop-in ``attention_fn`` and a decode-ready GQA attention layer.

Legend: B batch, T new tokens per sequence, L Flax cache length (keys visible to the
query), E model width, Hq query heads, Hkv kv heads, G = Hq // Hkv, S cache capacity of
`DecodeAttention`, Dk / Dv head dims.

Two entry points, for two cache layouts:

* `attention_fn` plugs into ``flax.nnx.MultiHeadAttention(attention_fn=...)`` and
  ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)``. Flax owns the cache
  there, token-major ``[B, L, Hkv, D]``, with one shared ``cache_index`` for the whole
  batch and a boolean ``[B, 1, 1, L]`` mask. Decode steps run a split-KV FlashDecode
  pass that reads that token-major cache in place (no per-step transpose of the cache)
  and honours the mask exactly, so masks with holes (left padding, packed prompts) are
  correct too. Everything else (prefill, training, dropout, bias, sown weights) goes to
  Flax's own ``dot_product_attention`` unchanged.
* `DecodeAttention` owns its cache, head-major ``[B, Hkv, S, D]`` with per-sequence
  lengths (continuous batching), and attends with `fdecode.flash_decode` directly, so it
  gets the Pallas kernel on GPU/TPU.

Import as ``import fdecode.flax`` (this module is not re-exported by ``fdecode``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen
from flax import nnx

from fdecode import config as config_lib
from fdecode.api import flash_decode
from fdecode.cache.write import write_contiguous, write_paged
from fdecode.combine import MASK_VALUE, finalize_state, merge_states
from fdecode.meshes import host_values, replicated
from fdecode.quant import is_quantized

__all__ = ["DecodeAttention", "apply_rope", "attention_fn", "token_major_decode"]



# --------------------------------------------------------------------------------------
# attention_fn: Flax's token-major cache


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, *, num_splits=None, **kwargs):
  """Drop-in ``attention_fn`` for Flax attention modules, FlashDecode on decode steps.

  Same signature and result as ``flax.nnx.dot_product_attention``. A call is a decode
  step, and runs `token_major_decode`, when all of these hold (each is static, so the
  choice is made at trace time): the query length is 1, a ``mask`` is given whose query
  axis is 1 and whose head axis is 1 or Hq, there is no ``bias``, no active dropout
  (``dropout_rate == 0`` or ``deterministic``), no ``module`` to sow weights into and no
  ``is_causal``. Flax's decode mode always passes such a mask (its cache-index mask).
  Any other call goes to ``flax.nnx.dot_product_attention`` (or the linen one when
  ``module`` is a linen module) with every argument unchanged.

  Args:
    query: ``[batch..., 1, Hq, Dk]`` on decode steps (``[batch..., T, Hq, Dk]`` otherwise).
    key: ``[batch..., L, Hkv, Dk]`` token-major, Flax's whole cache on decode steps.
    value: ``[batch..., L, Hkv, Dv]``.
    bias: optional additive bias; forces the Flax path.
    mask: bool (or 0/1 float, as Flax's ``combine_masks`` makes) broadcastable to
      ``[batch..., Hq, 1, L]``; False hides a key. Any pattern is exact, not only prefixes.
    broadcast_dropout, dropout_rng, dropout_rate, deterministic, precision, module:
      as in Flax; only used on the Flax path (``precision`` is ignored on decode steps,
      which accumulate in float32).
    dtype: result dtype; ``None``: the promoted dtype of query, key and value.
    num_splits: chunks of the L axis on decode steps (merged with
      `fdecode.merge_states`); ``None``: the split heuristic. Bind it with
      ``functools.partial(attention_fn, num_splits=4)``.
    **kwargs: passed to Flax's ``dot_product_attention`` (``is_causal``,
      ``promote_dtype``, ...).

  Returns:
    ``[batch..., T, Hq, Dv]``. On decode steps a query whose mask hides every key gives
    0 (Flax gives the mean of all values there); Flax's decode mode never does that.
  """
  if not _is_decode_step(query, key, value, bias, mask, dropout_rate, deterministic,
                         module, kwargs):
    if isinstance(module, linen.Module):
      return linen.dot_product_attention(
          query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
          dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
          dtype=dtype, precision=precision, module=module, **kwargs)
    return nnx.dot_product_attention(
        query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
        dtype=dtype, precision=precision, module=module, **kwargs)
  out_dtype = dtype if dtype is not None else jnp.result_type(query, key, value)
  *batch, _, hq, dk = query.shape
  length, hkv = key.shape[-3], key.shape[-2]
  b = math.prod(batch)
  q = query.reshape(b, hq, dk)
  k = key.reshape(b, length, hkv, dk)
  v = value.reshape(b, length, hkv, value.shape[-1])
  hm = mask.shape[-3]
  m = jnp.broadcast_to(mask, (*batch, hm, 1, length)).reshape(b, hm, length).astype(jnp.bool_)
  out = token_major_decode(q, k, v, m, num_splits=num_splits)
  return out.reshape(*batch, 1, hq, out.shape[-1]).astype(out_dtype)


def _is_decode_step(query, key, value, bias, mask, dropout_rate, deterministic, module,
                    kwargs) -> bool:
  """Static test: can `attention_fn` take the FlashDecode path for this call?"""
  if mask is None or bias is not None or module is not None or kwargs.get("is_causal"):
    return False
  if dropout_rate > 0.0 and not deterministic:
    return False
  if query.ndim < 4 or key.ndim != query.ndim or value.ndim != query.ndim:
    return False  # no batch axis: leave it to Flax
  hq, hkv, length = query.shape[-2], key.shape[-2], key.shape[-3]
  if query.shape[-3] != 1 or hkv == 0 or hq % hkv or length == 0:
    return False
  if query.shape[:-3] != key.shape[:-3] or key.shape[:-1] != value.shape[:-1]:
    return False
  if mask.ndim != query.ndim or mask.shape[-2:] not in ((1, length), (1, 1)):
    return False
  return mask.shape[-3] in (1, hq)


def token_major_decode(q, k, v, mask, *, softmax_scale=None, num_splits=None,
                       return_lse=False):
  """FlashDecode of one new token per sequence over a token-major cache, any mask.

  The L axis is split into ``n`` chunks (a free reshape); each chunk gives a partial
  state (`fdecode.combine.finalize_state`), merged with `fdecode.merge_states`. The
  scores and the value sum are written as broadcast-multiply-reduce over the
  contiguous head dim rather than as einsums: XLA lowers a dot whose batch dims
  (B, Hkv) are not leading by first transposing the whole cache. Measured on a 2-core
  CPU, B=4 S=4096 Hkv=8 G=4 D=128 (benchmarks/bench_flax.py): float32 27 ms per step
  vs 15 ms for `fdecode.flash_decode` on a head-major cache and 100 ms for transposing
  then calling it; bfloat16 is slower here (89 ms; transposing 52 ms), a known gap.

  Args:
    q: ``[B, Hq, Dk]`` float, the new token of each sequence.
    k: ``[B, L, Hkv, Dk]`` float, token-major keys (Flax's cache layout).
    v: ``[B, L, Hkv, Dv]`` float.
    mask: bool ``[B, 1, L]`` (same for all heads) or ``[B, Hq, L]``: True = visible.
    softmax_scale: scores multiplier, default ``1/sqrt(Dk)``.
    num_splits: chunks of L, dividing L; ``None``: `fdecode.config.default_num_splits`
      but at least 2, rounded down to a divisor of L.
    return_lse: also return the float32 natural-log LSE ``[B, Hq]``.

  Returns:
    ``out`` ``[B, Hq, Dv]`` in ``q.dtype`` (and ``lse``); a fully masked row gives 0
    (and -inf).

  Raises:
    ValueError: for inconsistent shapes (names the argument, shows the shapes).
  """
  shapes = (f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}, v.shape={tuple(v.shape)}, "
            f"mask.shape={tuple(mask.shape)}")
  if q.ndim != 3 or k.ndim != 4 or v.ndim != 4 or mask.ndim != 3:
    raise ValueError("token_major_decode: want q [B, Hq, Dk], k [B, L, Hkv, Dk], "
                     f"v [B, L, Hkv, Dv], mask [B, 1|Hq, L]; got {shapes}")
  b, hq, dk = q.shape
  _, length, hkv, _ = k.shape
  dv = v.shape[-1]
  if k.shape[0] != b or k.shape[3] != dk or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"token_major_decode: q, k, v disagree on B, L, Hkv or Dk; got {shapes}")
  if hkv == 0 or hq % hkv:
    raise ValueError(f"token_major_decode: Hq ({hq}) must be a multiple of Hkv ({hkv}); "
                     f"got {shapes}")
  if mask.shape[0] != b or mask.shape[1] not in (1, hq) or mask.shape[2] != length:
    raise ValueError(f"token_major_decode: mask must be [B, 1, L] or [B, Hq, L]; got {shapes}")
  g = hq // hkv
  scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(dk)
  if num_splits is None:
    # At least 2: with a single chunk XLA:CPU fuses the final normalization into the
    # value reduction and the step is ~6x slower (benchmarks/bench_flax.py).
    heuristic = config_lib.default_num_splits(b, hkv, length, config_lib.num_parallel_units())
    num_splits = config_lib.largest_divisor_at_most(length, max(heuristic, 2))
  n = num_splits
  if length % n:
    raise ValueError(f"token_major_decode: num_splits={n} must divide L={length}; got {shapes}")
  c = length // n
  kc = k.reshape(b, n, c, hkv, 1, dk)
  vc = v.reshape(b, n, c, hkv, 1, dv)
  # [B, n, C, Hkv|1, G|1]: the mask in the scores' layout (tiny next to the cache).
  if mask.shape[1] == 1:
    valid = mask.reshape(b, n, c, 1, 1)
  else:
    valid = mask.reshape(b, hkv, g, n, c).transpose(0, 3, 4, 1, 2)
  qf = q.reshape(b, 1, 1, hkv, g, dk).astype(jnp.float32) * scale
  scores = jnp.sum(qf * kc, axis=-1)  # [B, n, C, Hkv, G] float32
  scores = jnp.where(valid, scores, MASK_VALUE)
  mx = jnp.max(scores, axis=2)  # [B, n, Hkv, G]
  p = jnp.where(valid, jnp.exp(scores - mx[:, :, None]), 0.0)
  l = jnp.sum(p, axis=2)
  acc = jnp.sum(p[..., None] * vc, axis=2)  # [B, n, Hkv, G, Dv] float32
  o, lse = merge_states(*finalize_state(acc, mx, l), axis=1)  # [B, Hkv, G, Dv], [B, Hkv, G]
  out = o.reshape(b, hq, dv).astype(q.dtype)
  return (out, lse.reshape(b, hq)) if return_lse else out


# --------------------------------------------------------------------------------------
# DecodeAttention: a head-major cache with per-sequence lengths


def apply_rope(x, positions, *, theta: float = 10000.0):
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
  angle = positions.astype(jnp.float32)[..., None, None] * freq  # [B, T, 1, D/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


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
               decode_fn: Callable[..., jax.Array] | None = None, rngs: nnx.Rngs):
    """Builds the projections.

    Args:
      in_features: E, the model width (input and output features).
      num_heads: Hq.
      num_kv_heads: Hkv, dividing Hq (Hq: MHA, 1: MQA); default Hq.
      head_dim: D, even (RoPE); default ``E // Hq``.
      rope_theta: RoPE base.
      use_bias: biases on the four projections.
      dtype, param_dtype: computation and parameter dtypes of the projections.
      decode_fn: attention over the cache in `decode`; default `fdecode.flash_decode`.
      rngs: parameter initialization.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = in_features // num_heads if head_dim is None else head_dim
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
      raise ValueError(f"DecodeAttention: num_heads ({num_heads}) must be a positive "
                       f"multiple of num_kv_heads ({num_kv_heads})")
    if head_dim < 2 or head_dim % 2:
      raise ValueError(f"DecodeAttention: head_dim must be even and >= 2 (RoPE), got {head_dim}")
    self.in_features = in_features
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.rope_theta = rope_theta
    self.decode_fn = flash_decode if decode_fn is None else decode_fn
    linear = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = nnx.Linear(in_features, num_heads * head_dim, **linear)
    self.k_proj = nnx.Linear(in_features, num_kv_heads * head_dim, **linear)
    self.v_proj = nnx.Linear(in_features, num_kv_heads * head_dim, **linear)
    self.o_proj = nnx.Linear(num_heads * head_dim, in_features, **linear)
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
      ValueError: ``batch``, ``max_len`` or ``page_size`` not a positive int, or a
        ``dtype`` neither floating nor 8-bit.
    """
    for name, value in (("batch", batch), ("max_len", max_len), ("page_size", page_size)):
      if value is None and name == "page_size":
        continue
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"DecodeAttention.init_cache: {name} must be a positive int, got {value!r}")
    if not (is_quantized(dtype) or jnp.issubdtype(dtype, jnp.floating)):
      raise ValueError(f"DecodeAttention.init_cache: dtype must be floating point, int8, "
                       f"float8_e4m3fn or float8_e5m2, got {jnp.dtype(dtype)}")
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

  def prefill(self, x, lengths):
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
    out = jax.nn.dot_product_attention(q, k, v.astype(q.dtype), is_causal=True,
                                       key_value_seq_lengths=lengths)
    out = jnp.where((positions < lengths[:, None])[..., None, None], out, 0)
    out = self.o_proj(out.reshape(b, seq, -1))
    self._commit(new_state, lengths=lengths, overflowed=jnp.zeros((b,), jnp.bool_))
    return out

  def decode(self, x):
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
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
    q, k, v = self._qkv(x, positions)
    # A sequence that does not fit writes at S: every one of its slots is dropped.
    new_state = self._written(k, v, jnp.where(fits, lengths, s))
    lengths = jnp.where(fits, lengths + t, lengths)
    extra = {}
    if self.key_scale is not None:
      extra.update(k_scale=new_state["key_scale"], v_scale=new_state["value_scale"])
    if self.block_tables is not None:
      extra.update(block_tables=self.block_tables[...])
    out = self.decode_fn(q, new_state["cached_key"], new_state["cached_value"], lengths, **extra)
    # Projections are replicated (not tensor-parallel): gather the small attention output
    # on Explicit meshes, where o_proj's contraction over sharded heads is ambiguous.
    out = self.o_proj(replicated(out).reshape(b, t, -1))
    out = jnp.where(fits[:, None, None], out, jnp.nan)
    self._commit(new_state, lengths=lengths, overflowed=self.overflowed[...] | ~fits)
    return out

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

  def _check_input(self, method: str, x):
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
    q = apply_rope(q, positions, theta=self.rope_theta)
    k = apply_rope(k, positions, theta=self.rope_theta)
    return q, k, v
