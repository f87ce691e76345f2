"""FlashDecode in plain jnp: the CPU default.

Contiguous float caches: the token axis is split into ``n`` equal chunks (a free
reshape of the head-major cache); one batched matmul gives every chunk's scores, another
its values, and the per-chunk states are merged with `merge_states`. Measured on a
2-core AVX2 CPU (benchmarks/RESULTS.md): keeping the batch dims (B, Hkv) leading and the
split axis on K lets XLA use its native mixed bf16 x bf16 -> f32 dot; token-major
layouts or a flattened batch axis are 2-5x slower.

Paged or 8-bit caches: a loop over the ``n`` chunks loads one chunk at a time (gathering
its pages through the block table, dequantizing after the load), so neither the
contiguous cache nor its dequantized copy is ever materialized whole.

XLA has no dynamic shapes: this path reads the full capacity S and masks; the Pallas
kernel is the one that skips blocks past each sequence's length.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from fdecode.cache.paged import gather_pages_head_major, gather_scale_head_major
from fdecode.combine import MASK_VALUE, finalize_state
from fdecode.quant import dequantize



def _chunk_states(q_rows, kc, vc, row_limits, live_ends, first_pos, softmax_scale, heads_outer=False):
  """States of chunks: kc ``[B, Hkv, n, C, Dk]``, vc ``[B, Hkv, n, C, Dv]``, chunk i starting
  at token ``first_pos + i*C`` -> (o f32 ``[B, Hkv, n, R, Dv]``, lse ``[B, Hkv, n, R]``).

  Scores of slots a row may not see are selected away. ``live_ends`` ``[B]``: value rows at
  or past it are dead and selected to 0 too (they may hold inf / NaN); ``None`` skips that
  select (`_contiguous_states` checks the result instead).

  ``heads_outer``: q_rows, kc, vc and the results have their two batch axes swapped
  (``[Hkv, B, ...]``, a paged pool's gather order, so the cache chunk is never transposed).
  """
  n, c = kc.shape[2], kc.shape[3]
  scores = jnp.einsum("bhrd,bhncd->bhnrc", q_rows, kc.astype(q_rows.dtype),
                      preferred_element_type=jnp.float32) * softmax_scale
  pos = first_pos + jnp.arange(n * c, dtype=jnp.int32).reshape(1, 1, n, 1, c)
  limits = row_limits[None, :, None, :, None] if heads_outer else row_limits[:, None, None, :, None]
  valid = pos < limits  # [B, 1, n, R, C] (or [1, B, n, R, C])
  scores = jnp.where(valid, scores, MASK_VALUE)
  m = jnp.max(scores, axis=-1)
  p = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
  l = jnp.sum(p, axis=-1)
  if live_ends is not None:
    ends = live_ends[None, :, None, None, None] if heads_outer else live_ends[:, None, None, None, None]
    live = jnp.swapaxes(pos, -1, -2) < ends  # [B, 1, n, C, 1] (or [1, B, ...])
    vc = jnp.where(live, vc, jnp.zeros((), vc.dtype))
  acc = jnp.einsum("bhnrc,bhncd->bhnrd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
  return finalize_state(acc, m, l)


def _contiguous_states(q_rows, kc, vc, row_limits, live_ends, softmax_scale):
  """`_chunk_states` of a contiguous cache, paying for the dead-slot select only when a
  dead slot holds inf or NaN.

  Without the select, a dead value row meets probability exactly 0: a finite row adds an
  exact 0 to the same dot (bit-identical result), an inf / NaN row makes its chunk's o
  non-finite. So the select-free result is kept when every non-empty state is finite, and
  recomputed with the select otherwise (`lax.cond`: one branch runs). XLA:CPU does not fuse
  a select over all of V into the dot: always selecting made this path 2-5x slower at
  S = 16384 (benchmarks/RESULTS.md). A live inf / NaN also takes the second branch, which
  gives the same answer.
  """
  o, lse = _chunk_states(q_rows, kc, vc, row_limits, None, 0, softmax_scale)
  clean = jnp.all(jnp.isfinite(o) | jnp.isneginf(lse)[..., None])
  return lax.cond(clean, lambda: (o, lse),
                  lambda: _chunk_states(q_rows, kc, vc, row_limits, live_ends, 0, softmax_scale))


def _pad_tokens(x, total, axis=2, broadcast_ok=False):
  """Zero-pads ``axis`` to ``total``; with ``broadcast_ok`` a size-1 axis (a scale that
  broadcasts over tokens) is left alone."""
  if x.shape[axis] == total or (broadcast_ok and x.shape[axis] == 1):
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, total - x.shape[axis])
  return jnp.pad(x, pad)


def xla_partials(q_rows, k, v, row_limits, *, softmax_scale: float, num_splits: int, live_ends,
                 block_tables=None, k_scale=None, v_scale=None, k_offset=None, v_offset=None):
  """Per-split partial states.

  Args:
    q_rows: ``[B, Hkv, R, Dk]`` queries in the compute dtype, the G heads (times T tokens)
      of a kv head as rows; cache blocks are cast to it after the load.
    k, v: contiguous ``[B, Hkv, S, D]`` or, with ``block_tables [B, n]``, paged
      ``[Hkv, P, page_size, D]``; float, or 8-bit with canonical rank-4 scales
      (`fdecode.quant.canonical_scale`) and optional offsets.
    row_limits: int32 ``[B, R]``: row r attends to key positions ``< row_limits[b, r]``.
    live_ends: int32 ``[B]``: slots at or past it are dead (never read as values).
    softmax_scale: multiplies the scores (in float32).
    num_splits: ``n`` chunks. A contiguous float cache that ``n`` does not divide is
      padded (a copy); the heuristic only picks divisors.

  Returns:
    ``(o, lse)``: float32 ``[B, Hkv, n, R, Dv]`` and ``[B, Hkv, n, R]``.
  """
  n = num_splits
  quantized = k_scale is not None or v_scale is not None
  if block_tables is None and not quantized:
    b, hkv, s, dk = k.shape
    chunk = max(-(-s // n), 1)
    k, v = _pad_tokens(k, chunk * n), _pad_tokens(v, chunk * n)
    kc = k.reshape(b, hkv, n, chunk, dk)
    vc = v.reshape(b, hkv, n, chunk, v.shape[-1])
    return _contiguous_states(q_rows, kc, vc.astype(q_rows.dtype), row_limits, live_ends, softmax_scale)

  compute_dtype = q_rows.dtype
  if block_tables is not None:
    page_size = k.shape[2]
    pages_per_chunk = -(-block_tables.shape[1] // n)
    tables = _pad_tokens(block_tables, pages_per_chunk * n, axis=1)
    chunk = pages_per_chunk * page_size

    def load(i, x, scale, offset):  # -> [Hkv, B, C, D]: the pool's order, no transpose
      ids = lax.dynamic_slice_in_dim(tables, i * pages_per_chunk, pages_per_chunk, axis=1)
      x = gather_pages_head_major(x, ids)
      if scale is not None:
        sc = gather_scale_head_major(scale, ids, page_size)
        off = None if offset is None else gather_scale_head_major(offset, ids, page_size)
        x = dequantize(x, sc, off, compute_dtype)
      return x
  else:
    s = k.shape[2]
    chunk = max(-(-s // n), 1)
    k, v = _pad_tokens(k, chunk * n), _pad_tokens(v, chunk * n)
    k_scale, v_scale, k_offset, v_offset = (
        None if a is None else _pad_tokens(a, chunk * n, broadcast_ok=True)
        for a in (k_scale, v_scale, k_offset, v_offset))

    def load(i, x, scale, offset):
      x = lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=2)
      if scale is not None:
        sl = lambda a: a if a.shape[2] == 1 else lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=2)
        x = dequantize(x, sl(scale), None if offset is None else sl(offset), compute_dtype)
      return x

  heads_outer = block_tables is not None
  q_loop = q_rows.transpose(1, 0, 2, 3) if heads_outer else q_rows

  def one_chunk(i):
    kc = load(i, k, k_scale, k_offset)[:, :, None]
    vc = load(i, v, v_scale, v_offset)[:, :, None]
    o, lse = _chunk_states(q_loop, kc, vc.astype(compute_dtype), row_limits, live_ends, i * chunk,
                           softmax_scale, heads_outer)
    return o[:, :, 0], lse[:, :, 0]

  o, lse = lax.map(one_chunk, jnp.arange(n, dtype=jnp.int32))  # [n, B, Hkv, R, ...] (or [n, Hkv, B, ...])
  if heads_outer:
    o, lse = o.swapaxes(1, 2), lse.swapaxes(1, 2)
  return jnp.moveaxis(o, 0, 2), jnp.moveaxis(lse, 0, 2)
