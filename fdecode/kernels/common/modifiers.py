"""Score modifiers (attention variants): validation and the canonical forms every impl reads.

Legend as in `fdecode.config` (R = T * G rows per kv head, row r = t * G + g).

For a query at cache position ``p`` (``p = lengths - T + t``, relative to the cache's
first token) and a key at position ``j``, the score is::

  s = softmax_scale * q . k
  s = cap * tanh(s / cap)                     if logits_soft_cap
  s = s + slope[h] * (j - p)                  if alibi_slopes (FlashAttention / vLLM)
  s = s + bias[b, t, h, j]                    if bias

and key ``j`` is visible iff ``j < lengths`` and::

  j <= p                                      if causal (T > 1 tokens see their past)
  j > p - window                              if window (Mistral / Gemma: the window
                                              counts the query's own position)
  mask[b, t, h, j]                            if mask

Invisible slots are *selected* away (never multiplied by 0). A row that sees no key
gives out 0 and lse -inf; ``sinks`` then add exp(sink[h]) to every row's softmax
denominator exactly once, after every merge (`fdecode.combine.apply_sinks`).

Canonical forms (what the impls read; none is ever materialized at ``[B, T, Hq, S]``
unless the caller gave that form):

* mask / bias: ``[Bm, Hm, Tm, Gm, S]`` with ``Bm in {1, B}``, ``Tm in {1, T}`` and
  ``(Hm, Gm)`` either ``(1, 1)`` (one row shared by the heads) or ``(Hkv, G)`` (per query
  head). A ``[B, S]`` or ``[B, T, S]`` mask is a free reshape; a per-head one is
  transposed once (its own size) for the XLA and Mosaic paths, while the Triton kernel
  undoes that transpose (`user_form`, which XLA folds away) and reads the caller's array
  in place.
* alibi slopes: float32 ``[Hkv, G]``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from fdecode.validation import static_bool, static_soft_cap, static_window


@dataclasses.dataclass(frozen=True)
class Modifiers:
  """Static description of the score modifiers of one call (hashable: a jit static).

  Attributes:
    causal: the T new tokens are causal among themselves.
    window: sliding-window size (keys ``(p - window, p]``), or None.
    soft_cap: logit soft cap, or None.
    alibi: ALiBi slopes are given.
    mask: ``(Tm, Gm)`` of the canonical mask, or None.
    bias: ``(Tm, Gm)`` of the canonical bias, or None.
  """
  causal: bool = True
  window: int | None = None
  soft_cap: float | None = None
  alibi: bool = False
  mask: tuple | None = None
  bias: tuple | None = None

  @property
  def plain(self) -> bool:
    return self == Modifiers(causal=self.causal)


def _canonical_rows(name, x, b, t, hq, hkv, s, want_bool):
  """A mask / bias in a documented form -> ``([Bm, Hm, Tm, Gm, S], (Tm, Gm))``."""
  shape = tuple(np.shape(x))
  forms = f"[B, S], [B, T, S] or [B, T, Hq, S] = [{b}, {s}], [{b}, {t}, {s}] or [{b}, {t}, {hq}, {s}]"
  if len(shape) not in (2, 3, 4):
    raise ValueError(f"flash_decode: {name} must be {forms} (leading size-1 axes broadcast); "
                     f"got {name}.shape={shape}")
  dtype = jnp.result_type(x)
  if want_bool and dtype != jnp.bool_:
    raise ValueError(f"flash_decode: mask must be boolean (True = may attend), got mask.dtype={dtype}")
  if not want_bool and not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"flash_decode: bias must be floating point, got bias.dtype={dtype}")
  full = {2: (b, s), 3: (b, t, s), 4: (b, t, hq, s)}[len(shape)]
  if any(d not in (1, f) for d, f in zip(shape[:-1], full[:-1])) or shape[-1] != s:
    raise ValueError(f"flash_decode: {name} must broadcast to [B, T, Hq, S] = [{b}, {t}, {hq}, {s}] "
                     f"from {forms} (leading axes may be 1; S is the cache capacity, a paged "
                     f"table's n * page_size); got {name}.shape={shape}")
  return canonical_form(jnp.asarray(x), hq, hkv)


def canonical_form(x, hq: int, hkv: int):
  """A mask / bias ``[Bm, S]``, ``[Bm, Tm, S]`` or ``[Bm, Tm, Hq|1, S]`` (checked, as
  `canonicalize` checks it) -> ``([Bm, Hm, Tm, Gm, S], (Tm, Gm))``: Hm, Gm 1 or Hkv, G."""
  shape, s = x.shape, x.shape[-1]
  x4 = x.reshape(shape[0], 1, 1, s) if len(shape) == 2 else (
      x.reshape(shape[0], shape[1], 1, s) if len(shape) == 3 else x)
  bm, tm, hm, _ = x4.shape
  g = hq // hkv
  if hm == 1:
    return x4.reshape(bm, 1, tm, 1, s), (tm, 1)
  # Per query head: [Bm, Tm, Hkv, G, S] -> [Bm, Hkv, Tm, G, S] (its own size).
  return x4.reshape(bm, tm, hkv, g, s).transpose(0, 2, 1, 3, 4), (tm, g)


def _per_head(name, x, hq):
  if x is None:
    return None
  shape = tuple(np.shape(x))
  if shape != (hq,):
    raise ValueError(f"flash_decode: {name} must be [Hq]=({hq},); got {name}.shape={shape}")
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"flash_decode: {name} must be floating point, got dtype {jnp.result_type(x)}")
  return jnp.asarray(x, jnp.float32)


def canonicalize(q4_shape, hkv: int, seq_capacity: int, *, causal=True, mask=None, bias=None,
                 alibi_slopes=None, sinks=None, window=None, logits_soft_cap=None):
  """Validates the modifiers of a `flash_decode` call.

  Args:
    q4_shape: ``(B, T, Hq, Dk)``.
    hkv: Hkv.
    seq_capacity: S (a paged table's ``n * page_size``).

  Returns:
    ``(mods, arrays, sinks)``: the static `Modifiers`; a dict ``mask`` / ``bias`` /
    ``alibi`` of canonical arrays (None when absent); sinks float32 ``[Hq]`` or None.
  """
  b, t, hq, _ = q4_shape
  causal = static_bool("causal", causal)
  window = static_window(window)
  soft_cap = static_soft_cap(logits_soft_cap)
  arrays = dict(mask=None, bias=None, alibi=None)
  forms = {}
  for name, x in (("mask", mask), ("bias", bias)):
    if x is not None:
      arrays[name], forms[name] = _canonical_rows(name, x, b, t, hq, hkv, seq_capacity, name == "mask")
  slopes = _per_head("alibi_slopes", alibi_slopes, hq)
  if slopes is not None:
    arrays["alibi"] = slopes.reshape(hkv, hq // hkv)
  mods = Modifiers(causal=causal, window=window, soft_cap=soft_cap, alibi=slopes is not None,
                   mask=forms.get("mask"), bias=forms.get("bias"))
  return mods, arrays, _per_head("sinks", sinks, hq)


def user_form(x):
  """Canonical ``[Bm, Hm, Tm, Gm, S]`` -> the documented ``[Bm, Tm, Hm * Gm, S]`` (for the
  reference, which broadcasts it plainly)."""
  bm, hm, tm, gm, s = x.shape
  return x.transpose(0, 2, 1, 3, 4).reshape(bm, tm, hm * gm, s)


def row_bounds(ends, num_tokens: int, group: int, seq_capacity: int, mods: Modifiers):
  """Per query row: ``(lo, hi, qpos)`` int32 ``[B, R]``: row r sees key positions
  ``lo <= j < hi`` (before the mask); qpos is its own position ``ends - T + t``."""
  t = jnp.repeat(jnp.arange(num_tokens, dtype=jnp.int32), group)  # [R]
  # Saturate a far-negative end (a sequence ending long before the cache) at int32's minimum.
  ends = jnp.maximum(ends.astype(jnp.int32), jnp.iinfo(jnp.int32).min + num_tokens)
  qpos = ends[:, None] - num_tokens + t[None, :]
  if mods.causal:
    hi = jnp.clip(qpos + 1, 0, seq_capacity)
  else:
    hi = jnp.broadcast_to(jnp.clip(ends, 0, seq_capacity)[:, None], qpos.shape).astype(jnp.int32)
  lo = jnp.zeros_like(hi) if mods.window is None else window_lo(qpos, mods.window, seq_capacity).astype(jnp.int32)
  return lo, hi, qpos


def window_lo(pos, window: int, seq_capacity: int):
  """``clip(pos - window + 1, 0, S)`` without int32 overflow for any int32 ``pos`` and a
  window up to ``2**31 - 1`` (``pos - min(pos, window - 1)`` is never negative)."""
  return jnp.minimum(pos - jnp.minimum(pos, window - 1), seq_capacity)


def window_start(ends, num_tokens: int, seq_capacity: int, mods: Modifiers):
  """int32 (like ``ends``): the first position any row of a sequence may see (0 without
  a window): the first token's window start ``ends - T + 1 - window``, clipped."""
  if mods.window is None:
    return jnp.zeros_like(ends)
  # The first token's position, saturating at int32's minimum (ends may be very negative).
  first = jnp.maximum(ends, jnp.iinfo(jnp.int32).min + num_tokens) - num_tokens
  return window_lo(first, mods.window, seq_capacity).astype(ends.dtype)


# A window view's length (the XLA path's read) is rounded up to this: fewer distinct shapes.
_WINDOW_ALIGN = 128


def window_tokens(seq_capacity: int, num_tokens: int, mods: Modifiers, page_size: int | None = None) -> int:
  """Tokens of the cache the XLA path reads per sequence: S, or with a window smaller
  than the cache the ``window + T - 1`` positions the rows may see (paged: whole pages)."""
  if mods.window is None:
    return seq_capacity
  span = mods.window + num_tokens - 1
  if page_size is None:
    w = -(-span // _WINDOW_ALIGN) * _WINDOW_ALIGN
  else:  # a span starting anywhere in a page
    w = (-(-(span - 1) // page_size) + 1) * page_size
  return seq_capacity if w >= seq_capacity else w
