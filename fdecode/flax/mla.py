"""`MLADecodeAttention`: DeepSeek-V2/V3 multi-head latent attention (MLA) owning a latent
cache, decoded with weight absorption through `fdecode.flash_decode`.

Legend (as in `fdecode.flax`, plus MLA's widths): B batch, T new tokens per sequence,
L prompt length, E model width, Hq query heads, S cache capacity, Dc latent width
(``kv_lora_rank``, 512 in DeepSeek), Dn per-head no-RoPE query/key width
(``qk_nope_head_dim``), Dr shared RoPE key width (``qk_rope_head_dim``), Dv per-head
value width, Rq query LoRA rank (optional).
"""

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
from fdecode.flax.decode_attention import apply_rope
from fdecode.flax.invariant import Linear, RMSNorm
from fdecode.cache.meshes import host_values, replicated
from fdecode.cache.quant import check_cache_dtype, is_quantized
from fdecode.validation import (check_cache_sizes, check_norm_eps, check_rope_theta,
                                static_int, static_scale)

__all__ = ["MLADecodeAttention"]


class MLADecodeAttention(nnx.Module):
  """DeepSeek-V2/V3 MLA with a latent cache of ``Dc + Dr`` values per token (not per head).

  Projections (DeepSeek-V2, section 2.1), per token x ``[E]``:

  * queries: ``x @ Wq`` (or with ``q_lora_rank``: ``RMSNorm(x @ Wdq) @ Wuq``) reshaped
    ``[Hq, Dn + Dr]`` = per head ``[q_nope (Dn), q_rope (Dr)]``; RoPE on ``q_rope``.
  * latent: ``x @ Wdkv_kr`` ``[Dc + Dr]`` split into ``c_kv = RMSNorm(first Dc)`` and
    ``k_rope = RoPE(last Dr)``, the one RoPE key all heads share.
  * per head h: ``k[h] = concat(c_kv @ w_uk[h], k_rope)``, ``v[h] = c_kv @ w_uv[h]``;
    ``out = concat_heads(softmax(q k^T * scale) v) @ Wo``, scale ``1/sqrt(Dn + Dr)``.

  RoPE is `apply_rope`'s rotate-half convention (HF DeepSeek checkpoints store the
  interleaved one: permute their rope columns when loading).

  Cache: only ``c_kv`` and ``k_rope`` are stored, written once per token, as one latent
  "kv head" shared by all Hq query heads. `decode` absorbs ``w_uk`` into the query and
  ``w_uv`` into the output, so attention runs on the latent cache directly::

    q_abs[h] = concat(q_nope[h] @ w_uk[h]^T, q_rope[h])          # [B, T, Hq, Dc + Dr]
    o_lat    = decode_fn(q_abs, cached_latent, None, lengths, v_head_dim=Dc,
                         k_rope=cached_rope, softmax_scale=scale)  # [B, T, Hq, Dc]
    out      = concat_heads(o_lat[h] @ w_uv[h]) @ Wo

  The values are the latent itself (``v=None``: the first Dc key columns, read once).
  `prefill` instead decompresses the prompt's K / V per head (the cheaper form when all
  L queries are new) and attends with `fdecode.flash_decode`.

  Attributes:
    q_proj: ``nnx.Linear`` ``E -> Hq*(Dn+Dr)``, or (``q_lora_rank``) ``q_a_proj``
      ``E -> Rq``, ``q_a_norm`` ``nnx.RMSNorm(Rq)``, ``q_b_proj`` ``Rq -> Hq*(Dn+Dr)``.
    kv_a_proj: ``nnx.Linear`` ``E -> Dc + Dr`` (DeepSeek's ``kv_a_proj_with_mqa``).
    kv_norm: ``nnx.RMSNorm(Dc)`` on the latent.
    w_uk, w_uv: ``nnx.Param`` ``[Hq, Dc, Dn]``, ``[Hq, Dc, Dv]`` (DeepSeek's ``kv_b_proj``
      split per head).
    o_proj: ``nnx.Linear`` ``Hq*Dv -> E``.
    cached_latent, cached_rope: ``nnx.Cache`` ``[B, 1, S, Dc]`` and ``[B, 1, S, Dr]``, or
      page pools ``[1, P, page_size, Dc|Dr]`` with ``block_tables`` int32 ``[B, n]``.
    latent_scale: ``nnx.Cache`` float32 ``[B, 1, S, nt]`` (paged ``[1, P, page_size, nt]``)
      for an 8-bit latent, else None.
    lengths: ``nnx.Cache`` int32 ``[B]``; overflowed: ``nnx.Cache`` bool ``[B]``.

  Errors and overflow follow `fdecode.flax.DecodeAttention`: a call that raises changes
  no state; an eager `decode` past S raises ValueError; under ``jit`` such a sequence is
  not written, its length stays, its output rows are NaN and ``overflowed`` is set.

  ``decode_fn`` (default `fdecode.flash_decode`) receives ``(q_abs [B, T, Hq, Dc+Dr],
  cached_latent, None, lengths [B], v_head_dim=Dc, k_rope=cached_rope,
  softmax_scale=..., [k_scale=latent_scale], [block_tables=...])`` and returns
  ``[B, T, Hq, Dc]``; bind knobs with ``functools.partial`` (``impl=``, ``num_splits=``).
  A multi-device wrapper must accept ``v=None`` and shard ``k_rope`` like the cache.

  Example::

    layer = MLADecodeAttention(64, 8, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16, rngs=nnx.Rngs(0))
    layer.init_cache(batch=2, max_len=128)
    y = layer.prefill(x_prompt, lengths)   # x_prompt [2, L, 64] right-padded, lengths [2]
    y1 = layer.decode(x_next)              # x_next [2, T, 64]
  """

  def __init__(self, in_features: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
               qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None,
               rope_theta: float = 10000.0, norm_eps: float = 1e-6, softmax_scale: float | None = None,
               use_bias: bool = False, dtype: Any = None, param_dtype: Any = jnp.float32,
               decode_fn: Callable[..., jax.Array] | None = None, rngs: nnx.Rngs):
    """Builds the projections.

    Args:
      in_features: E.
      num_heads: Hq.
      kv_lora_rank: Dc, the latent width (the cache's value width).
      qk_nope_head_dim: Dn; qk_rope_head_dim: Dr, even (RoPE); v_head_dim: Dv.
      q_lora_rank: Rq, a low-rank query path (DeepSeek-V2 full / V3); None: one ``q_proj``.
      rope_theta: RoPE base.
      norm_eps: epsilon of the RMSNorms.
      softmax_scale: scores multiplier; default ``1/sqrt(Dn + Dr)`` (V3's YaRN ``mscale``
        goes here).
      use_bias, dtype, param_dtype: as ``nnx.Linear``'s; ``dtype`` also applies to the
        per-head up-projections.
      decode_fn: attention over the latent cache in `decode` (see the class docstring).
      rngs: parameter initialization.

    Raises:
      ValueError: a width < 1, Dr odd, or a static float outside the float32 domain it is
        used in: ``softmax_scale`` as `fdecode.flash_decode` takes it, ``rope_theta`` >= 1,
        ``norm_eps`` positive (each checked again at every call, before anything is written).
    """
    dims = dict(in_features=in_features, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim)
    if q_lora_rank is not None:
      dims["q_lora_rank"] = q_lora_rank
    for name, value in dims.items():
      static_int(name, value, caller="MLADecodeAttention")
    if qk_rope_head_dim % 2:
      raise ValueError(f"MLADecodeAttention: qk_rope_head_dim must be even (RoPE), got {qk_rope_head_dim}")
    rope_theta = check_rope_theta(rope_theta, "MLADecodeAttention")
    norm_eps = check_norm_eps(norm_eps, "MLADecodeAttention")
    self.in_features, self.num_heads = in_features, num_heads
    self.kv_lora_rank, self.v_head_dim = kv_lora_rank, v_head_dim
    self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
    self.rope_theta, self.dtype = rope_theta, dtype
    self.softmax_scale = static_scale(softmax_scale, qk_nope_head_dim + qk_rope_head_dim, "MLADecodeAttention")
    self.decode_fn = flash_decode if decode_fn is None else decode_fn
    linear = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    norm = dict(epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    q_width = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
    if q_lora_rank is None:
      self.q_proj = Linear(in_features, q_width, **linear)
      self.q_a_proj = self.q_a_norm = self.q_b_proj = nnx.data(None)
    else:
      self.q_proj = nnx.data(None)
      self.q_a_proj = Linear(in_features, q_lora_rank, **linear)
      self.q_a_norm = RMSNorm(q_lora_rank, **norm)
      self.q_b_proj = Linear(q_lora_rank, q_width, **linear)
    self.kv_a_proj = Linear(in_features, kv_lora_rank + qk_rope_head_dim, **linear)
    self.kv_norm = RMSNorm(kv_lora_rank, **norm)
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=1, out_axis=2, batch_axis=0)
    self.w_uk = nnx.Param(init(rngs.params(), (num_heads, kv_lora_rank, qk_nope_head_dim), param_dtype))
    self.w_uv = nnx.Param(init(rngs.params(), (num_heads, kv_lora_rank, v_head_dim), param_dtype))
    self.o_proj = Linear(num_heads * v_head_dim, in_features, **linear)
    for name in ("cached_latent", "cached_rope", "latent_scale", "block_tables", "lengths", "overflowed"):
      setattr(self, name, nnx.data(None))

  def init_cache(self, batch: int, max_len: int, dtype: Any = jnp.float32, *,
                 page_size: int | None = None, rope_dtype: Any = None) -> None:
    """Allocates an empty latent cache, lengths 0.

    Contiguous: ``cached_latent`` ``[batch, 1, max_len, Dc]`` and ``cached_rope``
    ``[batch, 1, max_len, Dr]``. Paged (``page_size``): pools ``[1, P, page_size, Dc|Dr]``,
    ``P = batch * n``, ``block_tables`` int32 ``[batch, n = ceil(max_len / page_size)]``
    with column j of sequence b on page ``j * batch + b`` (as `DecodeAttention`).

    ``dtype`` int8 / float8_e4m3fn / float8_e5m2 quantizes the latent as it is written,
    with float32 ``latent_scale`` per 1x128 tile when 128 divides Dc (FlashMLA's layout),
    else one scale per token; ``k_rope`` stays float (``rope_dtype``, default bfloat16
    for an 8-bit latent, else ``dtype``).

    Raises:
      ValueError: ``batch``, ``max_len`` or ``page_size`` not a positive int (or a
        capacity or page count past int32), a ``dtype`` neither floating of 16 bits or
        more nor int8 / float8_e4m3fn / float8_e5m2, or a ``rope_dtype`` that is not
        floating of 16 bits or more (the RoPE columns are never quantized).
    """
    caller = "MLADecodeAttention.init_cache"
    check_cache_sizes(caller, batch, max_len, page_size)
    dtype = check_cache_dtype("dtype", dtype, caller)
    quantized = is_quantized(dtype)
    rope_dtype = (jnp.bfloat16 if quantized else dtype) if rope_dtype is None else rope_dtype
    rope_dtype = check_cache_dtype("rope_dtype", rope_dtype, caller, quantized_ok=False)
    if page_size is None:
      lead = (batch, 1, max_len)
      self.block_tables = None
    else:
      pages = -(-max_len // page_size)
      lead = (1, batch * pages, page_size)
      self.block_tables = nnx.Cache(jnp.arange(batch * pages, dtype=jnp.int32).reshape(pages, batch).T)
    dc = self.kv_lora_rank
    self.cached_latent = nnx.Cache(jnp.zeros(lead + (dc,), dtype))
    self.cached_rope = nnx.Cache(jnp.zeros(lead + (self.qk_rope_head_dim,), rope_dtype))
    tiles = dc // 128 if dc % 128 == 0 else 1
    self.latent_scale = nnx.Cache(jnp.ones(lead + (tiles,), jnp.float32)) if quantized else None
    self.lengths = nnx.Cache(jnp.zeros((batch,), jnp.int32))
    self.overflowed = nnx.Cache(jnp.zeros((batch,), jnp.bool_))

  def prefill(self, x: ArrayLike, lengths: ArrayLike) -> Array:
    """Writes a batch of right-padded prompts into the cache (replacing its contents).

    Args:
      x: ``[B, L, E]`` float, prompt b in ``x[b, :lengths[b]]``; ``1 <= L <= S``.
      lengths: int ``[B]`` in ``[0, L]`` (concrete values outside raise ValueError; under
        ``jit`` they are clipped).

    Returns:
      ``[B, L, E]`` causal self-attention outputs, 0 at padding. ``lengths`` becomes the
      prompt lengths and ``overflowed`` is cleared.
    """
    b, seq, _ = self._check_input("prefill", x)
    lengths = jnp.asarray(lengths)
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise ValueError(f"MLADecodeAttention.prefill: lengths must be int [B]=({b},); got "
                       f"lengths.shape={tuple(lengths.shape)} dtype={lengths.dtype}, x.shape={tuple(x.shape)}")
    capacity = self.capacity
    if seq > capacity:
      raise ValueError(f"MLADecodeAttention.prefill: x.shape={tuple(x.shape)} has L={seq} > "
                       f"cache capacity S={capacity}")
    values = host_values(lengths)
    if values is not None and ((values < 0) | (values > seq)).any():
      i = int(np.nonzero((values < 0) | (values > seq))[0][0])
      raise ValueError(f"MLADecodeAttention.prefill: lengths must lie in [0, L={seq}]; sequence {i} "
                       f"has length {int(values[i])}, x.shape={tuple(x.shape)}")
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, seq)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
    q_nope, q_rope = self._queries(x, positions)
    c_kv, k_rope = self._latent(x, positions)
    new_state = self._written(c_kv, k_rope, jnp.zeros((b,), jnp.int32))
    # Decompressed per-head K / V of the prompt, head-major [B, Hq, L, D]; with
    # kv_offset = lengths - L, query t sits at position t.
    k_nope = jnp.einsum("blc,hcn->bhln", c_kv, self._weight(self.w_uk, c_kv))
    k_pe = jnp.broadcast_to(k_rope[:, None], (b, self.num_heads, seq, self.qk_rope_head_dim))
    k = jnp.concatenate([k_nope, k_pe.astype(k_nope.dtype)], axis=-1)  # [B, Hq, L, Dn + Dr]
    v = jnp.einsum("blc,hcv->bhlv", c_kv, self._weight(self.w_uv, c_kv))  # [B, Hq, L, Dv]
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    out = flash_decode(q, k, v.astype(k.dtype), lengths, kv_offset=lengths - seq, softmax_scale=self.softmax_scale)
    out = jnp.where((positions < lengths[:, None])[..., None, None], out, 0)
    out = self.o_proj(out.reshape(b, seq, -1))
    self._commit(new_state, lengths=lengths, overflowed=jnp.zeros((b,), jnp.bool_))
    return out

  def decode(self, x: ArrayLike) -> Array:
    """Appends T tokens to every sequence at its own position; absorbed attention over
    the latent cache with ``decode_fn``.

    Args:
      x: ``[B, T, E]`` float, ``T >= 1``: token t of sequence b goes to position
        ``lengths[b] + t``, causal among the T.

    Returns:
      ``[B, T, E]``; ``lengths`` grows by T. Overflow (``lengths + T > S``): eager,
      ValueError and nothing changes; under ``jit``, NaN rows for that sequence, nothing
      written for it, ``overflowed[b]`` set.
    """
    b, t, _ = self._check_input("decode", x)
    s = self.capacity
    lengths = self.lengths[...]
    values = host_values(lengths)
    if values is not None and (values + t > s).any():
      i = int(np.nonzero(values + t > s)[0][0])
      raise ValueError(f"MLADecodeAttention.decode: sequence {i} holds {int(values[i])} tokens; {t} more "
                       f"exceed the cache capacity S={s}. Nothing was written; free, evict or re-prefill it first")
    fits = lengths + t <= s  # [B]
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    q_nope, q_rope = self._queries(x, positions)
    c_kv, k_rope = self._latent(x, positions)
    new_state = self._written(c_kv, k_rope, jnp.where(fits, lengths, s))  # at S: dropped
    lengths = jnp.where(fits, lengths + t, lengths)
    q_latent = jnp.einsum("bthn,hcn->bthc", q_nope, self._weight(self.w_uk, q_nope))  # absorb W_uk
    q_abs = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)  # [B, T, Hq, Dc + Dr]
    extra = {}
    if self.latent_scale is not None:
      extra["k_scale"] = new_state["latent_scale"]
    if self.block_tables is not None:
      extra["block_tables"] = self.block_tables[...]
    o_latent = self.decode_fn(q_abs, new_state["cached_latent"], None, lengths, v_head_dim=self.kv_lora_rank,
                              k_rope=new_state["cached_rope"], softmax_scale=self.softmax_scale, **extra)
    o_latent = replicated(o_latent)  # [B, T, Hq, Dc]
    o = jnp.einsum("bthc,hcv->bthv", o_latent, self._weight(self.w_uv, o_latent))  # absorb W_uv
    out = self.o_proj(o.reshape(b, t, -1))
    out = jnp.where(fits[:, None, None], out, jnp.nan)
    self._commit(new_state, lengths=lengths, overflowed=self.overflowed[...] | ~fits)
    return out

  @property
  def cache_arrays(self) -> tuple[str, ...]:
    """Names of the arrays laid out like the cache (latent, rope, and an 8-bit scale)."""
    return ("cached_latent", "cached_rope") + (("latent_scale",) if self.latent_scale is not None else ())

  @property
  def capacity(self) -> int:
    """S: tokens each sequence's cache can hold."""
    if self.block_tables is None:
      return self.cached_latent.shape[2]
    return self.block_tables.shape[1] * self.cached_latent.shape[2]

  def _weight(self, param, like):
    """A per-head up-projection in the computation dtype (``dtype``, else promoted)."""
    with jax.numpy_dtype_promotion("standard"):  # promoted as documented, whatever the caller's mode
      dtype = self.dtype if self.dtype is not None else jnp.result_type(like.dtype, param.dtype)
    return param[...].astype(dtype)

  def _queries(self, x, positions):
    """x ``[B, T, E]`` -> q_nope ``[B, T, Hq, Dn]``, rotated q_rope ``[B, T, Hq, Dr]``."""
    b, t, _ = x.shape
    if self.q_proj is not None:
      q = self.q_proj(x)
    else:
      with jax.numpy_dtype_promotion("standard"):  # Flax's RMSNorm's own float32 statistics (`_latent`)
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
    q = q.reshape(b, t, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
    q_nope, q_rope = q[..., :self.qk_nope_head_dim], q[..., self.qk_nope_head_dim:]
    return q_nope, apply_rope(q_rope, positions, theta=self.rope_theta)

  def _latent(self, x, positions):
    """x ``[B, T, E]`` -> c_kv ``[B, T, Dc]`` (normed), rotated k_rope ``[B, T, Dr]``."""
    kv = self.kv_a_proj(x)
    # Flax's RMSNorm promotes a 16-bit input with float32 itself (its statistics), which a
    # caller's jax_numpy_dtype_promotion="strict" would refuse: its own rule, kept.
    with jax.numpy_dtype_promotion("standard"):
      c_kv = self.kv_norm(kv[..., :self.kv_lora_rank])
    k_rope = apply_rope(kv[..., None, self.kv_lora_rank:], positions, theta=self.rope_theta)[:, :, 0]
    return c_kv, k_rope

  def _written(self, c_kv, k_rope, positions) -> dict:
    """The cache arrays with slots ``positions[b] + t`` holding the new tokens (one
    scatter per array; an 8-bit latent is quantized with its own per-token scales), by
    attribute name. Nothing is set yet."""
    if self.block_tables is None:
      write = write_contiguous
    else:
      write = functools.partial(write_paged, block_tables=self.block_tables[...])
    scales = {} if self.latent_scale is None else dict(k_scale=self.latent_scale[...])
    arrays = write(self.cached_latent[...], self.cached_rope[...], k_new=c_kv[:, None],
                   v_new=k_rope[:, None], positions=positions, **scales)  # new: [B, 1, T, D]
    return dict(zip(self.cache_arrays, arrays))

  def _commit(self, arrays: dict, **more) -> None:
    """Sets every state array at once, after all the step's work succeeded."""
    for name, value in {**arrays, **more}.items():
      getattr(self, name).set_value(value)

  def _check_input(self, method: str, x):
    caller = f"MLADecodeAttention.{method}"  # static options, again: they may have been reassigned
    static_scale(self.softmax_scale, 1, caller)
    check_rope_theta(self.rope_theta, caller)
    if self.cached_latent is None:
      raise ValueError(f"MLADecodeAttention.{method}: no cache; call init_cache(batch, max_len) first")
    batch = self.lengths.shape[0]
    if x.ndim != 3 or x.shape[-1] != self.in_features or x.shape[0] != batch:
      raise ValueError(f"MLADecodeAttention.{method}: x must be [B, T, E]=[{batch}, T, {self.in_features}]; "
                       f"got x.shape={tuple(x.shape)}, cached_latent.shape={tuple(self.cached_latent.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"MLADecodeAttention.{method}: x must be floating point, got x.dtype={x.dtype}")
    if x.shape[1] < 1:
      raise ValueError(f"MLADecodeAttention.{method}: x must hold at least one token; got x.shape={tuple(x.shape)}")
    return x.shape
