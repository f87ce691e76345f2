"""Sparse top-k attention (DeepSeek V3.2 / FlashMLA sparse): validation and the canonical
index lists every impl reads.

Legend as in `fdecode.config`; K selected positions per query.

``flash_decode(..., indices=...)`` restricts each query to the cache positions it names:

* ``indices`` int ``[B, K]`` (shared by the T new tokens and every head), ``[B, T, K]``
  (per new token; only with a ``[B, T, Hq, D]`` q) or ``[B, T, Hkv, K]`` (per token and
  kv head); with a single-token ``[B, Hq, D]`` q also ``[B, Hkv, K]``.
* Entries are positions in the sequence, the coordinates of ``lengths`` (with
  ``kv_offset`` the cache holds positions ``[kv_offset, kv_offset + S)``, so a
  sequence-parallel shard passes the global indices). ``-1`` (any negative value) means
  "none". Entries outside the cache, at or past a sequence's length, or hidden by
  causality or the window are masked, never read out of bounds.
* Duplicates are counted once: the selected set is what attends.
* A query whose selection leaves no visible key gives out 0 and lse -inf (K = 0 too).
* Concrete entries must fit in int32 (ValueError otherwise); traced wider integers are
  clipped into int32 (an entry past int32 stays outside the cache), never wrapped.

Canonical form (`canonicalize`): ``idx`` int32 ``[B', Hi, K]`` with ``Hi in {1, Hkv}``,
each row sorted ascending, holding cache-relative positions, every dropped entry
(none, out of the cache, duplicate) replaced by the sentinel S, and ``bounds`` int32
``[B', Hi, 2]``: the slots ``[lo, hi)`` of the row that some query may see (positions
from the first window start to the sequence's end; sorting makes them contiguous). Per
token index lists (a T axis) are *folded*: each (sequence, token) pair becomes its own
pseudo-sequence with one new token (``B' = B * T``), since its keys differ from its
neighbours'; shared lists keep the T tokens as rows of one pass (``B' = B``). The Triton
kernel reads the lists sorted once, repeats kept (``runs``): it counts the bounds and
selects a repeat's later slots away itself, so its program sorts once and counts nothing
in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fdecode.kernels.common.modifiers import Modifiers, window_start
from fdecode.validation import check_int32, to_int32


@dataclasses.dataclass(frozen=True)
class Sparse:
  """Static description of a sparse call (a jit static).

  Attributes:
    fold: pseudo-sequences per sequence (T when each token has its own list, else 1);
      pseudo-sequence b' reads the cache of sequence ``b' // fold``.
    heads: Hi, 1 (one list per pseudo-sequence) or Hkv (one per kv head).
  """
  fold: int = 1
  heads: int = 1


def validate(indices, q_shape, hkv: int, *, mods: Modifiers, has_mask: bool, has_bias: bool):
  """Checks ``indices`` against q (``[B, Hq, D]`` or ``[B, T, Hq, D]``); returns them as int32
  ``[B, T|1, Hkv|1, max(K, 1)]`` (K = 0 becomes one -1 entry). Raises ValueError naming the
  argument and the shapes, or concrete entries outside int32."""
  shape = tuple(np.shape(indices))
  single = len(q_shape) == 3
  b = q_shape[0]
  t = 1 if single else q_shape[1]
  forms = (f"[B, K] or [B, Hkv, K] = [{b}, K] or [{b}, {hkv}, K] for a single-token q" if single else
           f"[B, K], [B, T, K] or [B, T, Hkv, K] = [{b}, K], [{b}, {t}, K] or [{b}, {t}, {hkv}, K]")
  where = f"got indices.shape={shape}, q.shape={tuple(q_shape)}"
  ranks = (2, 3) if single else (2, 3, 4)
  if len(shape) not in ranks:
    raise ValueError(f"flash_decode: indices must be {forms}; {where}")
  if not jnp.issubdtype(jnp.result_type(indices), jnp.integer):
    raise ValueError(f"flash_decode: indices must be integer (cache positions, -1 = none), got "
                     f"indices.dtype={jnp.result_type(indices)}")
  check_int32("indices", indices)  # concrete int64 positions must not wrap into the cache
  x = to_int32(indices)
  if shape[-1] == 0:  # no selected position: one "none" entry, so every impl sees an empty row
    x = jnp.full(shape[:-1] + (1,), -1, jnp.int32)
  if len(shape) == 2:
    x = x[:, None, None, :]
  elif len(shape) == 3:
    x = x[:, None, :, :] if single else x[:, :, None, :]
  if x.shape[0] != b or x.shape[1] not in (1, t) or x.shape[2] not in (1, hkv):
    raise ValueError(f"flash_decode: indices must be {forms} (T and Hkv axes may be 1); {where}")
  if has_mask or has_bias:
    raise ValueError("flash_decode: indices cannot be combined with mask / bias (a selected "
                     "position set already restricts the keys; fold the mask into indices)")
  if x.shape[1] > 1 and not mods.causal and (mods.window is not None or mods.alibi):
    raise ValueError("flash_decode: per-token indices ([B, T, ...] with T > 1) with causal=False "
                     "cannot take window or alibi_slopes (each token is decoded as its own sequence)")
  return x


def canonicalize(idx, ends, kv_offset, seq_capacity: int, num_tokens: int, mods: Modifiers):
  """Canonical index lists of a call (see the module docstring).

  Args:
    idx: int32 ``[B, T|1, Hi, K]`` from `validate`.
    ends: int32 ``[B]``: each sequence's end relative to the cache's first token.
    kv_offset: int32 ``[B]`` or scalar: the cache's first position in the sequence.
    seq_capacity: S.
    num_tokens: T.
    mods: the call's modifiers (window).

  Returns:
    ``(sparse, idx [B', Hi, K], bounds [B', Hi, 2], ends' [B'], runs [B', Hi, K])``: with a
    per-token list (fold T) ``ends'`` is each token's own causal end ``ends - T + t + 1``
    (non-causal: ``ends``) and the call proceeds with one new token per pseudo-sequence.
    ``runs``: the lists sorted before the repeats are dropped (a repeated position in
    adjacent slots), for a kernel that selects repeats away itself (the Triton kernel: one
    sort, not two; XLA drops whichever form no lowered path reads).
  """
  _, tf, hi, _ = idx.shape
  return (Sparse(fold=tf, heads=hi),
          *_canonical_lists(idx, ends, kv_offset, seq_capacity=seq_capacity, num_tokens=num_tokens, mods=mods))


# One program (integer math only), not a dozen eager ops compiled one by one: `canonicalize`
# runs outside `flash_decode`'s jit.
@functools.partial(jax.jit, static_argnames=("seq_capacity", "num_tokens", "mods"))
def _canonical_lists(idx, ends, kv_offset, *, seq_capacity, num_tokens, mods):
  b, tf, hi, kk = idx.shape
  s = seq_capacity
  local = idx - jnp.reshape(jnp.asarray(kv_offset, jnp.int32), (-1, 1, 1, 1))
  local = jnp.where((idx >= 0) & (local >= 0) & (local < s), local, s)
  runs = jnp.sort(local.reshape(b * tf, hi, kk), axis=-1)
  # A repeated position counts once: drop every copy after the first, then re-sort.
  dup = jnp.concatenate([jnp.zeros_like(runs[..., :1], bool), runs[..., 1:] == runs[..., :-1]], -1)
  local = jnp.sort(jnp.where(dup, s, runs), axis=-1)
  if tf > 1:  # fold: each (sequence, token) pair is its own pseudo-sequence
    t = jnp.arange(tf, dtype=jnp.int32)
    row_end = ends[:, None] - tf + 1 + t[None, :] if mods.causal else jnp.repeat(ends[:, None], tf, 1)
    ends, num_tokens = row_end.reshape(-1), 1
  first = window_start(ends, num_tokens, s, mods)
  count = lambda limit: jnp.sum(local < limit[:, None, None], axis=-1, dtype=jnp.int32)
  hi_slot = count(jnp.clip(ends, 0, s))
  lo_slot = jnp.minimum(count(first), hi_slot)
  return local, jnp.stack([lo_slot, hi_slot], -1), ends, runs


def dense_mask(idx, seq_capacity: int):
  """Canonical ``idx [B', Hi, K]`` -> bool ``[B', Hi, S]``: the selected positions (for the
  reference)."""
  b, hi, _ = idx.shape
  rows = jnp.zeros((b, hi, seq_capacity + 1), bool)
  bi = jnp.arange(b)[:, None, None]
  hi_ = jnp.arange(hi)[None, :, None]
  return rows.at[bi, hi_, idx].set(True)[..., :seq_capacity]


def slot_range(bounds, split, num_splits: int, bk: int):
  """Blocks ``[first, last)`` of ``bk`` index slots that split ``split`` processes: the
  row's live slots ``bounds = (lo, hi)`` dealt out evenly (as `block.split_range` does
  for positions)."""
  lo_blk = bounds[0] // bk
  hi_blk = (bounds[1] + bk - 1) // bk
  per = (hi_blk - lo_blk + num_splits - 1) // num_splits
  first = lo_blk + split * per
  return first, jnp.minimum(first + per, hi_blk)


def pad_slots(idx, multiple: int, seq_capacity: int):
  """Pads the K axis of canonical ``idx`` to a multiple of ``multiple`` with the sentinel."""
  k = idx.shape[-1]
  kp = max(-(-k // multiple), 1) * multiple
  if kp == k:
    return idx
  return lax.pad(idx, jnp.int32(seq_capacity), [(0, 0, 0)] * (idx.ndim - 1) + [(0, kp - k, 0)])
