"""Shared-prefix (cascade) decode: each shared prefix is read once for all its sequences.

Legend as in `fdecode.api` (B batch, T new tokens, Hq / Hkv heads, G = Hq // Hkv, Dk / Dv
head dims), plus N distinct prefixes of capacity Sp and R = B * T * G packed rows.

Many sequences that share a long prompt (a system prompt, few-shot examples, parallel
samples of one request) would each re-read that prompt's KV from memory on every step.
Cascade decode (FlashInfer's ``MultiLevelCascadeAttentionWrapper``, Hydragen) splits the
keys of sequence b into two disjoint parts and merges their states with `merge_states`:

* the prefix ``prefix_ids[b]``, shared: every sharing sequence's query rows of kv head h
  become rows of one matmul against the prefix (*row packing*), so the prefix is read
  once, not once per sequence;
* the sequence's own suffix (the T new tokens included), read as usual by `flash_decode`.

Row packing here is static-shaped and sort-free: q ``[B, T, Hq, Dk]`` is laid out as
one token of ``Hkv * R`` query heads (head ``h * R + r`` holds row r of kv head h) and
`flash_decode` runs over the N prefixes as a batch of N with that same packed query,
so every prefix sees every sequence's rows; each sequence then keeps the rows of its
own prefix (a gather by ``prefix_ids``). Each prefix is read once; the price is N times
the prefix's query rows of compute (``N * B * T * Hq`` rows in all), which is cheap for
the usual N of 1 to 4 (decode is bound by memory, not by these matmuls) but grows as
N * B: with many distinct prefixes, group the batch by prefix and call once per group.
"""

from __future__ import annotations

import functools
from typing import Literal, Unpack, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike

from fdecode.api import DecodeOptions, flash_decode
from fdecode.cache.tables import check_concrete_page_ids
from fdecode.combine import apply_sinks, merge_states
from fdecode.cache.quant import is_quantized, validate_quant
from fdecode.options import ARRAY_ARGS, static_options
from fdecode.validation import as_array, as_arrays

# Position-dependent options that row packing cannot express: a packed row would need its
# own sequence's positions inside the prefix call, which sees every row at once.
_UNSUPPORTED = ("window", "alibi_slopes", "mask", "bias", "indices", "kv_offset")
# Options that describe one cache's format: the suffix's come as given, the prefix's as
# ``prefix_<name>``.
_SUFFIX_ONLY = ("block_tables", "k_scale", "v_scale", "k_offset", "v_offset", "k_rope")


@overload
def cascade_decode(q: ArrayLike, prefix_k: ArrayLike, prefix_v: ArrayLike | None, prefix_lengths: ArrayLike,
                   k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *, prefix_ids: ArrayLike,
                   return_lse: Literal[False] = False, prefix_block_tables: ArrayLike | None = None,
                   prefix_k_scale: ArrayLike | None = None, prefix_v_scale: ArrayLike | None = None,
                   prefix_k_offset: ArrayLike | None = None, prefix_v_offset: ArrayLike | None = None,
                   prefix_k_rope: ArrayLike | None = None,
                   **flash_decode_options: Unpack[DecodeOptions]) -> Array: ...


@overload
def cascade_decode(q: ArrayLike, prefix_k: ArrayLike, prefix_v: ArrayLike | None, prefix_lengths: ArrayLike,
                   k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *, prefix_ids: ArrayLike,
                   return_lse: Literal[True], prefix_block_tables: ArrayLike | None = None,
                   prefix_k_scale: ArrayLike | None = None, prefix_v_scale: ArrayLike | None = None,
                   prefix_k_offset: ArrayLike | None = None, prefix_v_offset: ArrayLike | None = None,
                   prefix_k_rope: ArrayLike | None = None,
                   **flash_decode_options: Unpack[DecodeOptions]) -> tuple[Array, Array]: ...


@overload
def cascade_decode(q: ArrayLike, prefix_k: ArrayLike, prefix_v: ArrayLike | None, prefix_lengths: ArrayLike,
                   k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *, prefix_ids: ArrayLike,
                   return_lse: bool, prefix_block_tables: ArrayLike | None = None,
                   prefix_k_scale: ArrayLike | None = None, prefix_v_scale: ArrayLike | None = None,
                   prefix_k_offset: ArrayLike | None = None, prefix_v_offset: ArrayLike | None = None,
                   prefix_k_rope: ArrayLike | None = None,
                   **flash_decode_options: Unpack[DecodeOptions]) -> Array | tuple[Array, Array]: ...


def cascade_decode(q: ArrayLike, prefix_k: ArrayLike, prefix_v: ArrayLike | None, prefix_lengths: ArrayLike,
                   k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *, prefix_ids: ArrayLike,
                   return_lse: bool = False, prefix_block_tables: ArrayLike | None = None,
                   prefix_k_scale: ArrayLike | None = None, prefix_v_scale: ArrayLike | None = None,
                   prefix_k_offset: ArrayLike | None = None, prefix_v_offset: ArrayLike | None = None,
                   prefix_k_rope: ArrayLike | None = None,
                   **flash_decode_options: Unpack[DecodeOptions]) -> Array | tuple[Array, Array]:
  """Decode attention over a shared prefix followed by each sequence's own suffix.

  Sequence b is ``prefix[prefix_ids[b], :, :prefix_lengths[prefix_ids[b]]]`` followed by
  ``suffix[b, :, :lengths[b]]``: suffix token j sits at sequence position
  ``prefix_lengths[prefix_ids[b]] + j``. The T new tokens are the last T of the suffix,
  so each of them sees the whole prefix, and (``causal=True``) the suffix up to itself.
  The result equals `flash_decode` over the concatenated cache, within float tolerance.

  Args:
    q: ``[B, Hq, Dk]`` or ``[B, T, Hq, Dk]`` floating, as in `flash_decode`.
    prefix_k: ``[N, Hkv, Sp, Dk]`` the N distinct prefixes' keys, or with
      ``prefix_block_tables`` a paged pool ``[Hkv, P, page_size, Dk]``. Float, or int8 /
      float8 with ``prefix_k_scale``.
    prefix_v: ``[N, Hkv, Sp, Dv]`` or ``[Hkv, P, page_size, Dv]``; ``None`` with ``v=None``
      (MLA: the values are ``prefix_k[..., :v_head_dim]``).
    prefix_lengths: int ``[N]`` valid tokens of each prefix, in ``[0, Sp]`` (0: no prefix).
    k, v: each sequence's suffix cache ``[B, Hkv, S, Dk]`` / ``[B, Hkv, S, Dv]`` (or paged
      pools with ``block_tables``), formats as in `flash_decode`; same Hkv, Dk and Dv as
      the prefix. ``v=None`` for MLA (then ``prefix_v=None`` too).
    lengths: int ``[B]`` valid suffix tokens, the T new ones included. With T > 1 and
      ``causal=True`` concrete lengths below T raise ValueError (the new tokens live in
      the suffix); under ``jit`` such a sequence's new tokens still see the whole prefix.
      With T = 1 a length of 0 is an empty suffix: the token sees the prefix only.
    prefix_ids: int ``[B]``, keyword-only: sequence b shares prefix ``prefix_ids[b]``, in
      ``[0, N)``. Concrete ids out of range raise ValueError; under ``jit`` they are
      clipped into range.
    return_lse: also return the natural-log LSE over prefix and suffix (sinks included).
    prefix_block_tables: int ``[N, n]``: the prefixes' page tables when ``prefix_k`` /
      ``prefix_v`` are paged pools (the suffix's own table is ``block_tables``).
    prefix_k_scale, prefix_v_scale, prefix_k_offset, prefix_v_offset: the prefix cache's
      8-bit scales / offsets, shaped as `flash_decode`'s ``k_scale`` etc. for ``prefix_k``.
    prefix_k_rope: the prefix's key-only columns when the suffix has ``k_rope`` (MLA).
    **flash_decode_options: passed to both parts: ``softmax_scale``, ``impl``,
      ``interpret``, ``num_splits``, ``block_k``, ``logits_soft_cap``, ``v_head_dim``;
      to the suffix only: ``block_tables``, ``k_scale``, ``v_scale``, ``k_offset``,
      ``v_offset``, ``k_rope``, ``causal`` (default True; False lets every new token see
      the whole suffix, as in `flash_decode`). ``sinks`` (float ``[Hq]``) are applied
      once, after prefix and suffix are merged.

  Row packing cannot express position-dependent modifiers, so ``window``,
  ``alibi_slopes``, ``mask``, ``bias``, ``indices`` and ``kv_offset`` raise ValueError.

  Returns:
    ``out`` shaped like ``q`` with last dim Dv, dtype ``q.dtype``; with ``return_lse``
    also lse float32 ``[B, Hq]`` or ``[B, T, Hq]``. A query that sees no key (empty
    prefix and empty suffix) gives out 0 and lse -inf (or the sink).

  Raises:
    ValueError: an unsupported option; prefix_ids not ``[B]`` or prefix_lengths not ``[N]``
      (or not integer); prefix and suffix caches whose Hkv or head dims differ; concrete
      prefix_ids, prefix_lengths or lengths out of range; and whatever `flash_decode`
      raises for either part.
  """
  opts = dict(flash_decode_options)
  bad = [name for name in _UNSUPPORTED if opts.get(name) is not None]
  if bad:
    raise ValueError(f"cascade_decode: {', '.join(bad)} not supported: these depend on each query's "
                     f"position, which row packing over the shared prefix cannot express; use "
                     f"flash_decode over the full cache")
  for name in ("return_lse", "v", "lengths"):
    if name in opts:
      raise ValueError(f"cascade_decode: unexpected option {name!r}")
  # Python values, checked as flash_decode checks them (``causal`` is read here too).
  opts = static_options("cascade_decode", return_lse=return_lse, **opts)
  return_lse = opts.pop("return_lse")
  sinks = opts.pop("sinks", None)
  (q, prefix_k, prefix_v, prefix_lengths, k, v, lengths, prefix_ids, prefix_block_tables, prefix_k_scale,
   prefix_v_scale, prefix_k_offset, prefix_v_offset, prefix_k_rope, sinks) = as_arrays(
       "cascade_decode", q=q, prefix_k=prefix_k, prefix_v=prefix_v, prefix_lengths=prefix_lengths, k=k, v=v,
       lengths=lengths, prefix_ids=prefix_ids, prefix_block_tables=prefix_block_tables,
       prefix_k_scale=prefix_k_scale, prefix_v_scale=prefix_v_scale, prefix_k_offset=prefix_k_offset,
       prefix_v_offset=prefix_v_offset, prefix_k_rope=prefix_k_rope, sinks=sinks)
  opts = {name: as_array(name, x, "cascade_decode") if name in ARRAY_ARGS else x for name, x in opts.items()}
  for name, x in (("q", q), ("prefix_k", prefix_k), ("k", k)):
    if x is None:
      raise TypeError(f"cascade_decode: {name} must be an array, got None")
  n = _validate(q, prefix_k, prefix_v, prefix_lengths, k, v, lengths, prefix_ids,
                prefix_block_tables, prefix_k_rope, opts)
  _validate_formats(prefix_k, prefix_v, k, v, prefix_block_tables, prefix_lengths, prefix_k_rope,
                    dict(k_scale=prefix_k_scale, v_scale=prefix_v_scale, k_offset=prefix_k_offset,
                         v_offset=prefix_v_offset), opts)
  single_token = q.ndim == 3
  q4 = q[:, None] if single_token else q
  b, t, hq = q4.shape[:3]
  hkv = prefix_k.shape[0] if prefix_block_tables is not None else prefix_k.shape[1]
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    if sinks.shape != (hq,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
      raise ValueError(f"cascade_decode: sinks must be float [Hq]=({hq},); got sinks.shape="
                       f"{tuple(sinks.shape)}, dtype {sinks.dtype}")
  if prefix_ids is not None and not isinstance(prefix_ids, jax.core.Tracer):
    ids = np.asarray(prefix_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= n):
      i = int(np.argmax((ids < 0) | (ids >= n)))
      raise ValueError(f"cascade_decode: prefix_ids must lie in [0, N={n}); sequence {i} has "
                       f"prefix_ids[{i}] = {int(ids[i])}")
  if t > 1 and opts.get("causal", True) and not isinstance(lengths, jax.core.Tracer):
    short = np.nonzero(np.asarray(lengths) < t)[0]
    if short.size:
      raise ValueError(f"cascade_decode: with T={t} causal new tokens every suffix holds them: lengths "
                       f"must be >= T; sequence {int(short[0])} has length {int(np.asarray(lengths)[short[0]])}")

  # The suffix: each sequence's own cache, causal among the T new tokens, no sinks yet.
  suffix_out, suffix_lse = flash_decode(q4, k, v, lengths, return_lse=True, **opts)
  if b == 0 or t == 0:
    out, lse = suffix_out, suffix_lse
    if sinks is not None:
      out, lse = apply_sinks(out, lse, sinks)
  else:
    # The prefix: the packed query against each of the N prefixes, as a batch of N.
    prefix_opts = {name: x for name, x in opts.items() if name not in _SUFFIX_ONLY + ("causal",)}
    prefix_out, prefix_lse = flash_decode(
        _pack_rows(q4, hkv=hkv, n=n), prefix_k, prefix_v, prefix_lengths, return_lse=True,
        block_tables=prefix_block_tables, k_scale=prefix_k_scale, v_scale=prefix_v_scale,
        k_offset=prefix_k_offset, v_offset=prefix_v_offset, k_rope=prefix_k_rope, **prefix_opts)
    out, lse = _merge(prefix_out, prefix_lse, suffix_out, suffix_lse, jnp.asarray(prefix_ids), sinks,
                      hkv=hkv)
  if single_token:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out


@functools.partial(jax.jit, static_argnames=("hkv", "n"))
def _pack_rows(q4, *, hkv, n):
  """q ``[B, T, Hq, Dk]`` -> ``[N, Hkv * R, Dk]``: one token of ``Hkv * R`` heads, head
  ``h * R + r`` holding row ``r = (b * T + t) * G + g`` of kv head h, the same for each of
  the N prefixes (`flash_decode` groups heads ``h * R .. h * R + R - 1`` on kv head h)."""
  b, t, hq, dk = q4.shape
  packed = q4.reshape(b, t, hkv, hq // hkv, dk).transpose(2, 0, 1, 3, 4).reshape(1, hkv * b * t * (hq // hkv), dk)
  return jnp.broadcast_to(packed, (n,) + packed.shape[1:])


@functools.partial(jax.jit, static_argnames=("hkv",))
def _merge(prefix_out, prefix_lse, suffix_out, suffix_lse, prefix_ids, sinks, *, hkv):
  """Each sequence's rows of its own prefix, merged with its suffix state, then sinks.

  Args:
    prefix_out, prefix_lse: ``[N, Hkv * R, Dv]`` / f32 ``[N, Hkv * R]``, packed rows.
    suffix_out, suffix_lse: ``[B, T, Hq, Dv]`` / f32 ``[B, T, Hq]``.
    prefix_ids: int ``[B]``, clipped into ``[0, N)``.
    sinks: float ``[Hq]`` or None.

  Returns:
    ``(out, lse)``: ``[B, T, Hq, Dv]`` in suffix_out's dtype, f32 ``[B, T, Hq]``.
  """
  b, t, hq, dv = suffix_out.shape
  n, g = prefix_out.shape[0], hq // hkv
  ids, seq = jnp.clip(prefix_ids.astype(jnp.int32), 0, n - 1), jnp.arange(b)
  # [N, Hkv, B, T, G, .] -> sequence b's rows of prefix ids[b]: [B, Hkv, T, G, .] -> [B, T, Hq, .]
  o = prefix_out.reshape(n, hkv, b, t, g, dv)[ids, :, seq].transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dv)
  lse = prefix_lse.reshape(n, hkv, b, t, g)[ids, :, seq].transpose(0, 2, 1, 3).reshape(b, t, hq)
  # Disjoint key sets: merge in float32, round once to the output dtype.
  out, lse = merge_states(jnp.stack([o.astype(jnp.float32), suffix_out.astype(jnp.float32)]),
                          jnp.stack([lse, suffix_lse]), axis=0)
  if sinks is not None:  # once, after the merge
    out, lse = apply_sinks(out, lse, sinks)
  return out.astype(suffix_out.dtype), lse


def _validate(q, prefix_k, prefix_v, prefix_lengths, k, v, lengths, prefix_ids, prefix_block_tables,
              prefix_k_rope, opts) -> int:
  """Cascade-specific shape checks (each part's own checks are `flash_decode`'s). Returns N."""
  name = lambda x: None if x is None else tuple(np.shape(x))
  shapes = (f"q.shape={name(q)}, prefix_k.shape={name(prefix_k)}, prefix_v.shape={name(prefix_v)}, "
            f"k.shape={name(k)}, v.shape={name(v)}")
  if q.ndim not in (3, 4):
    raise ValueError(f"cascade_decode: q must be [B, Hq, Dk] or [B, T, Hq, Dk]; got {shapes}")
  b = q.shape[0]
  if prefix_k.ndim != 4 or (prefix_v is not None and prefix_v.ndim != 4) or k.ndim != 4 or (
      v is not None and v.ndim != 4):
    raise ValueError(f"cascade_decode: caches must be rank 4 ([N or B, Hkv, S, D] or paged "
                     f"[Hkv, P, page_size, D]); got {shapes}")
  if (prefix_v is None) != (v is None):
    raise ValueError(f"cascade_decode: prefix_v and v must both be given or both be None (MLA); got {shapes}")
  if prefix_block_tables is not None:
    if len(name(prefix_block_tables)) != 2:
      raise ValueError(f"cascade_decode: prefix_block_tables must be [N, n]; got "
                       f"prefix_block_tables.shape={name(prefix_block_tables)}")
    n, prefix_hkv = np.shape(prefix_block_tables)[0], prefix_k.shape[0]
  else:
    n, prefix_hkv = prefix_k.shape[0], prefix_k.shape[1]
  if name(prefix_lengths) != (n,):
    raise ValueError(f"cascade_decode: prefix_lengths must be [N]=({n},) (one per prefix); got "
                     f"prefix_lengths.shape={name(prefix_lengths)}, {shapes}")
  if name(prefix_ids) != (b,):
    raise ValueError(f"cascade_decode: prefix_ids must be [B]=({b},) (one per sequence); got "
                     f"prefix_ids.shape={name(prefix_ids)}, {shapes}")
  for arg, x in (("prefix_lengths", prefix_lengths), ("prefix_ids", prefix_ids)):
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f"cascade_decode: {arg} must be integer, got dtype {jnp.result_type(x)}")
  if n == 0 and b > 0:
    raise ValueError(f"cascade_decode: no prefix (N=0) for B={b} sequences; got {shapes}")
  suffix_hkv = k.shape[0] if opts.get("block_tables") is not None else k.shape[1]
  if prefix_hkv != suffix_hkv:
    raise ValueError(f"cascade_decode: prefix and suffix caches must have the same Hkv; got "
                     f"{prefix_hkv} and {suffix_hkv} ({shapes})")
  rope = opts.get("k_rope")
  if (prefix_k_rope is None) != (rope is None):
    raise ValueError(f"cascade_decode: prefix_k_rope and k_rope must both be given or both be None; got "
                     f"prefix_k_rope.shape={name(prefix_k_rope)}, k_rope.shape={name(rope)}")
  prefix_dk = prefix_k.shape[-1] + (0 if prefix_k_rope is None else np.shape(prefix_k_rope)[-1])
  suffix_dk = k.shape[-1] + (0 if rope is None else np.shape(rope)[-1])
  if prefix_dk != suffix_dk or (v is not None and prefix_v.shape[-1] != v.shape[-1]):
    raise ValueError(f"cascade_decode: prefix and suffix caches must have the same head dims Dk and Dv; "
                     f"got {shapes}")
  if isinstance(prefix_lengths, jax.core.Tracer):
    return n
  capacity = (np.shape(prefix_block_tables)[1] * prefix_k.shape[2] if prefix_block_tables is not None
              else prefix_k.shape[2])
  lens = np.asarray(prefix_lengths)
  bad = np.nonzero((lens < 0) | (lens > capacity))[0]
  if bad.size:
    raise ValueError(f"cascade_decode: prefix_lengths must lie in [0, Sp={capacity}]; prefix "
                     f"{int(bad[0])} has length {int(lens[bad[0]])}")
  return n


def _validate_formats(prefix_k, prefix_v, k, v, prefix_block_tables, prefix_lengths, prefix_k_rope,
                      prefix_quant, opts) -> None:
  """The prefix cache's own format checks, under the prefix's argument names (the prefix
  call sees a packed query, so its own messages would name the suffix's arguments and
  show internal shapes), and the suffix's scales named as the suffix's."""
  name = lambda x: None if x is None else tuple(np.shape(x))
  shapes = f"prefix_k.shape={name(prefix_k)}, prefix_v.shape={name(prefix_v)}"
  paged = prefix_block_tables is not None
  lead = "[Hkv, P, page_size]" if paged else "[N, Hkv, Sp]"
  if prefix_v is not None and prefix_v.shape[:3] != prefix_k.shape[:3]:
    raise ValueError(f"cascade_decode: prefix_k and prefix_v must have the same {lead}; got {shapes}")
  if v is None and prefix_k.shape[-1] != k.shape[-1]:
    raise ValueError(f"cascade_decode: with v=None (MLA) prefix_k and k must have the same head dim (the "
                     f"latent, whose first v_head_dim columns are the values); got {shapes}, k.shape={name(k)}")
  if prefix_k_rope is not None:
    rope = name(prefix_k_rope)
    if len(rope) != 4 or rope[:3] != tuple(prefix_k.shape[:3]):
      raise ValueError(f"cascade_decode: prefix_k_rope must be {lead[:-1]}, Dr] like prefix_k; got "
                       f"prefix_k_rope.shape={rope}, {shapes}")
    if not jnp.issubdtype(jnp.result_type(prefix_k_rope), jnp.floating):
      raise ValueError(f"cascade_decode: prefix_k_rope must be floating point, got dtype "
                       f"{jnp.result_type(prefix_k_rope)}")
  for cache_name, cache in (("k", k), ("v", v)):
    given = [f"{cache_name}_{kind}" for kind in ("scale", "offset") if opts.get(f"{cache_name}_{kind}") is not None]
    if cache is not None and given and not is_quantized(cache.dtype):
      raise ValueError(f"cascade_decode: {' / '.join(given)} given but the suffix cache {cache_name} is not "
                       f"quantized ({cache_name}.dtype={cache.dtype}); the prefix cache's are "
                       f"{' / '.join('prefix_' + g for g in given)}")
  validate_quant("prefix_k", prefix_k, prefix_quant["k_scale"], prefix_quant["k_offset"], "cascade_decode")
  if prefix_v is not None:
    validate_quant("prefix_v", prefix_v, prefix_quant["v_scale"], prefix_quant["v_offset"], "cascade_decode")
  elif prefix_quant["v_scale"] is not None or prefix_quant["v_offset"] is not None:
    raise ValueError("cascade_decode: prefix_v_scale / prefix_v_offset given with prefix_v=None: the values "
                     "are prefix_k's first v_head_dim columns and use prefix_k_scale / prefix_k_offset")
  if paged:
    if not jnp.issubdtype(jnp.result_type(prefix_block_tables), jnp.integer):
      raise ValueError(f"cascade_decode: prefix_block_tables must be integer, got dtype "
                       f"{jnp.result_type(prefix_block_tables)}")
    check_concrete_page_ids(prefix_block_tables, prefix_lengths, prefix_k.shape[1], prefix_k.shape[2],
                            caller="cascade_decode", name="prefix_block_tables")
