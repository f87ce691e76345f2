"""FlashDecode in plain jnp: the CPU default.

Contiguous float caches: the token axis is split into ``n`` equal chunks (a free
reshape of the head-major cache); one batched matmul gives every chunk's scores, another
its values, and the per-chunk states are merged with `merge_states`. Measured on a
2-core AVX2 CPU (benchmarks/RESULTS.md): keeping the batch dims (B, Hkv) leading and the
split axis on K lets XLA use its native mixed bf16 x bf16 -> f32 dot; a token-major
view or a flattened batch axis is 2-5x slower there.

Paged, 8-bit or token-major caches: a loop over the ``n`` chunks loads one chunk at a
time (gathering its pages through the block table, or slicing its rows; transposing a
token-major chunk's rows; dequantizing after the load), so neither the cache's
head-major copy nor its dequantized one is ever materialized whole. 16-bit and 8-bit
float caches are read as integer words (`_as_words`): XLA:CPU would otherwise widen the
whole cache to float32 before the loop.

Sliding windows: only the window is read. Each sequence's cache (or its block table) is
first sliced to the ``window + T - 1`` tokens its rows may see (`window_tokens`), and the
chunks run over that view.

XLA has no dynamic shapes: otherwise this path reads the full capacity S and masks; the
Pallas kernels are the ones that skip blocks past each sequence's length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fdecode.cache.layout import capacity, token_axis
from fdecode.cache.paged import gather_pages_head_major, gather_scale_head_major, gather_token_major_pages
from fdecode.combine import MASK_VALUE, finalize_state, merge_states
from fdecode.kernels.common.modifiers import Modifiers, row_bounds, window_start, window_tokens
from fdecode.cache.quant import dequantize


def _slice_seq(x, starts, size, axis):
  """Per sequence b, ``x[b]`` sliced to ``[starts[b], starts[b] + size)`` along ``axis``
  (x's leading axis is B or 1). One dynamic slice per sequence: XLA:CPU runs the
  equivalent gather (``vmap`` of the slice) 10x slower and compiles it for seconds; a
  symbolic batch (``jax.export``) takes that gather."""
  if jax.export.is_symbolic_dim(starts.shape[0]):
    shared = x.shape[0] == 1  # False for a symbolic leading axis: the batch's own
    one = lambda xb, start: lax.dynamic_slice_in_dim(xb, start, size, axis - 1)
    return jax.vmap(one, in_axes=(None if shared else 0, 0))(x[0] if shared else x, starts)
  def one(b):
    index = [b if x.shape[0] > 1 else 0] + [0] * (x.ndim - 1)
    index[axis] = starts[b]
    sizes = (1,) + x.shape[1:axis] + (size,) + x.shape[axis + 1:]
    return lax.dynamic_slice(x, index, sizes)
  return jnp.concatenate([one(b) for b in range(starts.shape[0])])


# From this many rows per kv head (T * G) on, the score product of several chunks runs
# with the chunk as a batch axis (q broadcast over chunks): XLA:CPU otherwise computes it
# chunk-major and transposes the scores, which cost 40% of a T=256 call (2-core VM,
# benchmarks/bench_grad.py). Below it the transposed form is the faster one (up to 1.8x at
# T * G = 4 and 16).
BATCHED_ROWS = 64


class Geometry:
  """Rows and modifiers of one call, applied to chunk scores ``[B, Hkv, n, R, C]`` viewed
  as ``[B, Hkv, n, T, G, C]``: a mask / bias keeps its canonical ``[Bm, Hm, Tm, Gm, S]``
  form and broadcasts there (never expanded to rows in memory)."""

  def __init__(self, ends, num_tokens, group, seq_capacity, mods, mask, bias, alibi):
    self.mods, self.t, self.g = mods, num_tokens, group
    self.lo, self.hi, self.qpos = row_bounds(ends, num_tokens, group, seq_capacity, mods)  # [B, R]
    self.mask, self.bias = mask, bias  # [Bm, Hm, Tm, Gm, S'] (S' a window view's length once sliced)
    self.alibi = None if alibi is None else jnp.tile(alibi, (1, num_tokens))  # [Hkv, R]

  def view(self, starts, size):
    """Slices the position-indexed operands to a per-sequence view (see `_slice_seq`)."""
    self.mask, self.bias = (None if x is None else _slice_seq(x, starts, size, axis=4)
                            for x in (self.mask, self.bias))

  def pad(self, total):
    self.mask, self.bias = (None if x is None else pad_tokens(x, total, axis=4)
                            for x in (self.mask, self.bias))

  def _chunk(self, x, first, n, c):
    """``[Bm, Hm, Tm, Gm, S']`` -> chunks ``[Bm, Hm, n, Tm, Gm, C]`` from view offset ``first``."""
    x = lax.dynamic_slice_in_dim(x, first, n * c, axis=4) if x.shape[4] != n * c else x
    return jnp.moveaxis(x.reshape(x.shape[:4] + (n, c)), 4, 2)

  def apply(self, scores, pos, first, heads_outer):
    """Modified scores and visibility for chunk scores ``[B, Hkv, n, R, C]`` (or heads
    first) at positions ``pos`` ``[B, 1, n, 1, C]`` of chunks starting at view offset
    ``first``."""
    swap = (lambda x: jnp.swapaxes(x, 0, 1)) if heads_outer else (lambda x: x)
    s = swap(scores)
    b, h, n, r, c = s.shape
    s = s.reshape(b, h, n, self.t, self.g, c)
    pos = pos[:, :, :, :, None]  # [B, 1, n, 1, 1, C]
    per_row = lambda x: x.reshape(b, 1, 1, self.t, self.g, 1)  # [B, R] -> by (t, g)
    if self.mods.soft_cap is not None:
      s = self.mods.soft_cap * jnp.tanh(s / self.mods.soft_cap)
    if self.alibi is not None:
      slopes = self.alibi.reshape(1, h, 1, self.t, self.g, 1)
      s = s + slopes * (pos - per_row(self.qpos)).astype(jnp.float32)
    if self.bias is not None:
      s = s + self._chunk(self.bias, first, n, c).astype(jnp.float32)
    valid = pos < per_row(self.hi)
    if self.mods.window is not None:
      valid &= pos >= per_row(self.lo)
    if self.mask is not None:
      valid &= self._chunk(self.mask, first, n, c)
    valid = jnp.broadcast_to(valid, valid.shape[:3] + (self.t, self.g, c))
    return swap(s.reshape(b, h, n, r, c)), swap(valid.reshape(valid.shape[:3] + (r, c)))


def _geometry_unflatten(static, arrays):
  geo = object.__new__(Geometry)
  geo.mods, geo.t, geo.g = static
  geo.lo, geo.hi, geo.qpos, geo.mask, geo.bias, geo.alibi = arrays
  return geo


# A pytree of its arrays, so that `_vary_together` types them with the other operands.
jax.tree_util.register_pytree_node(
    Geometry, lambda g: ((g.lo, g.hi, g.qpos, g.mask, g.bias, g.alibi), (g.mods, g.t, g.g)),
    _geometry_unflatten)


def _chunk_states(q_rows, kc, vc, geo, base, first, softmax_scale, heads_outer=False, select_dead=True,
                  pos=None, v_cols=None):
  """States of chunks: kc ``[B, Hkv, n, C, Dk]`` (or a tuple of column parts whose widths
  sum to Dk: k's own columns, then k_rope's), vc ``[B, Hkv, n, C, Dv]``, chunk i holding
  view offsets ``first + i*C``, i.e. cache positions ``base + first + i*C`` (base int32
  ``[B]``, the view's start) -> (o f32 ``[B, Hkv, n, R, Dv]``, lse ``[B, Hkv, n, R]``).

  Scores of slots a row may not see are selected away. ``select_dead``: value rows no
  row sees are selected to 0 too (they may hold inf / NaN); False skips that select
  (`contiguous_states` checks the result instead).

  ``heads_outer``: q_rows, kc, vc and the results have their two batch axes swapped
  (``[Hkv, B, ...]``, a paged pool's gather order, so the cache chunk is never transposed).
  ``pos``: int32 ``[B, 1|Hkv, n, 1, C]`` the slots' positions, when they are not
  ``base + first + offset`` (sparse index lists).
  ``v_cols``: the values are ``vc``'s first ``v_cols`` columns (MLA, ``vc`` the keys): the
  matmul runs over all of them and the result is sliced, so XLA:CPU never copies the
  strided column slice of the cache.
  """
  parts = kc if isinstance(kc, tuple) else (kc,)
  n, c = parts[0].shape[2], parts[0].shape[3]
  scores, col = None, 0
  for part in parts:  # the key's column parts: one matmul each, no concatenated copy
    w = part.shape[-1]
    qp = q_rows[..., col:col + w]
    if n > 1 and qp.shape[-2] >= BATCHED_ROWS:  # the chunk a batch axis of the product: no transposed scores
      qp = jnp.broadcast_to(qp[:, :, None], qp.shape[:2] + (n,) + qp.shape[2:])
      s = jnp.einsum("bhnrd,bhncd->bhnrc", qp, part.astype(q_rows.dtype), preferred_element_type=jnp.float32)
    else:
      s = jnp.einsum("bhrd,bhncd->bhnrc", qp, part.astype(q_rows.dtype), preferred_element_type=jnp.float32)
    scores, col = s if scores is None else scores + s, col + w
  scores = scores * softmax_scale
  if pos is None:
    offsets = first + jnp.arange(n * c, dtype=jnp.int32).reshape(1, 1, n, 1, c)
    pos = base[:, None, None, None, None] + offsets  # [B, 1, n, 1, C]
  scores, valid = geo.apply(scores, pos, first, heads_outer)
  bad = None
  if select_dead and (geo.t > 1 or geo.mask is not None):
    # Rows of a kv head may see different slots: a value row holding inf / NaN would reach
    # the rows that do not see it through the shared PV matmul (0 * NaN). It poisons its
    # scores instead (selected per row below) and is selected to 0 (`block.guard_values`).
    values = vc if v_cols is None else vc[..., :v_cols]
    bad = ~jnp.all(jnp.isfinite(values), axis=-1)[..., None, :]  # [B, Hkv, n, 1, C]
    scores = jnp.where(bad, jnp.nan, scores)
  scores = jnp.where(valid, scores, MASK_VALUE)
  m = jnp.max(scores, axis=-1)
  p = jnp.where(valid, jnp.exp(scores - m[..., None]), 0.0)
  l = jnp.sum(p, axis=-1)
  if select_dead:
    live = jnp.any(valid, axis=3, keepdims=True)  # [B, Hkv|1, n, 1, C]
    live = jnp.swapaxes(live if bad is None else live & ~bad, -1, -2)
    vc = jnp.where(live, vc, jnp.zeros((), vc.dtype))
  acc = jnp.einsum("bhnrc,bhncd->bhnrd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
  return finalize_state(acc if v_cols is None else acc[..., :v_cols], m, l)


def contiguous_states(q_rows, kc, vc, geo, base, softmax_scale, pos=None, v_cols=None):
  """`_chunk_states` of a contiguous cache (or of gathered sparse slots at ``pos``), paying
  for the dead-slot select only when a dead slot holds inf or NaN.

  Without the select, a dead value row meets probability exactly 0: a finite row adds an
  exact 0 to the same dot (bit-identical result), an inf / NaN row makes its chunk's o
  non-finite. So the select-free result is kept when every non-empty state is finite, and
  recomputed with the select otherwise (`lax.cond`: one branch runs). XLA:CPU does not fuse
  a select over all of V into the dot: always selecting made this path 2-5x slower at
  S = 16384 (benchmarks/RESULTS.md). A live inf / NaN also takes the second branch, which
  gives the same answer. What the cond closes over is typed varying together first
  (`_vary_together`), so that it survives ``vmap`` inside ``shard_map``.
  """
  q_rows, kc, vc, geo, base, pos = _vary_together((q_rows, kc, vc, geo, base, pos))
  kw = dict(pos=pos, v_cols=v_cols)
  o, lse = _chunk_states(q_rows, kc, vc, geo, base, 0, softmax_scale, select_dead=False, **kw)
  clean = jnp.all(jnp.isfinite(o) | jnp.isneginf(lse)[..., None])
  return lax.cond(clean, lambda: (o, lse),
                  lambda: _chunk_states(q_rows, kc, vc, geo, base, 0, softmax_scale, **kw))


def _as_words(x, i):
  """A cache as a chunk loop's step ``i`` reads it: a float cache narrower than 32 bits
  (bfloat16, float16, fp8) as unsigned words of its width (a bitcast), behind a barrier
  that ties it to ``i``; other caches unchanged. XLA:CPU widens any 16-bit float array a
  loop slices or gathers to float32 first, and hoists that conversion out of the loop: a
  float32 copy of the whole cache (or pool) on every call. Integer words are moved as
  they are, and the barrier keeps the bitcast in the step (fused into its gather), so
  only the chunk's rows are read. Measured on a 2-core CPU: a paged bf16 decode 48.8 ->
  6.5 ms (benchmarks/RESULTS.md, "Token-major and 16-bit caches on the XLA path")."""
  dtype = jnp.dtype(x.dtype)
  if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize not in (1, 2):
    return x
  x, _ = lax.optimization_barrier((x, i))
  return lax.bitcast_convert_type(x, jnp.uint8 if dtype.itemsize == 1 else jnp.uint16)


def load_pages(i, x, scale, offset, *, tables, pages, page_size, gather, dtype):
  """Chunk ``i`` of a pool ``x``: its ``pages`` table columns gathered (``gather``: head- or
  token-major pages -> ``[Hkv, B, C, D]``, the pool's order, no transpose), read as words
  (`_as_words`), dequantized to ``dtype`` after the load when ``scale`` is given."""
  ids = lax.dynamic_slice_in_dim(tables, i * pages, pages, axis=1)
  x = _from_words(gather(_as_words(x, i), ids), x.dtype)
  if scale is not None:
    sc = gather_scale_head_major(scale, ids, page_size)
    off = None if offset is None else gather_scale_head_major(offset, ids, page_size)
    x = dequantize(x, sc, off, dtype)
  return x


def load_rows(i, x, scale, offset, *, chunk, tok, dtype):
  """Chunk ``i`` of a contiguous cache ``x`` (padded to whole chunks) -> ``[B, Hkv, C, D]``:
  ``chunk`` rows sliced along the token axis ``tok`` (a token-major chunk's rows transposed),
  read as words, dequantized to ``dtype`` after the load when ``scale`` is given."""
  rows = lax.dynamic_slice_in_dim(_as_words(x, i), i * chunk, chunk, axis=tok)
  x = _from_words(rows if tok == 2 else rows.transpose(0, 2, 1, 3), x.dtype)
  if scale is not None:
    sl = lambda a: a if a.shape[2] == 1 else lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=2)
    x = dequantize(x, sl(scale), None if offset is None else sl(offset), dtype)
  return x


def _from_words(x, dtype):
  """Rows read through `_as_words` back in the cache's ``dtype``."""
  return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def pad_tokens(x, total, axis=2, broadcast_ok=False):
  """Zero-pads ``axis`` to ``total``; with ``broadcast_ok`` a size-1 axis (a scale that
  broadcasts over tokens) is left alone."""
  if x.shape[axis] == total or (broadcast_ok and x.shape[axis] == 1):
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, total - x.shape[axis])
  return jnp.pad(x, pad)


def xla_partials(q_rows, cache, ends, mod_arrays, *, num_tokens: int, softmax_scale: float, num_splits: int,
                 mods: Modifiers = Modifiers(), v_head_dim=None, loop=False):
  """Per-split partial states.

  Args:
    q_rows: ``[B, Hkv, R, Dk]`` queries in the compute dtype, the G heads (times T tokens)
      of a kv head as rows (r = t * G + g); cache blocks are cast to it after the load.
    cache: the cache (`fdecode.cache.layout.CacheView`, in the layout it is read in): its
      ``k``, ``v``, ``k_rope``, ``block_tables``, scales and offsets, as follows.
    k, v: contiguous ``[B, Hkv, S, D]`` or, with ``block_tables [B, n]``, paged
      ``[Hkv, P, page_size, D]``; float, or 8-bit with canonical rank-4 scales
      (`fdecode.cache.quant.canonical_scale`) and optional offsets. ``v`` None: the values are
      the loaded (dequantized) ``k[..., :v_head_dim]`` (MLA).
    k_rope: optional key-only columns laid out like k (float), after k's own.
    layout (``cache.layout``): of k, v and k_rope: ``"NHD"`` caches ``[B, S, Hkv, D]`` and
      pools ``[P, page_size, Hkv, D]`` are read in place (each chunk's rows are sliced or
      its pages gathered, then only those rows transposed). Scales and offsets are
      head-major either way.
    ends: int32 ``[B]``: each sequence's end relative to the cache's first token.
    num_tokens: T.
    softmax_scale: multiplies the scores (in float32).
    num_splits: ``n`` chunks (of the window view, with a window). A contiguous float
      cache that ``n`` does not divide is padded (a copy); the heuristic only picks divisors.
    mods, mod_arrays: `fdecode.kernels.common.modifiers.Modifiers` and their canonical
      arrays (``mask``, ``bias``, ``alibi``: each or None).

  Returns:
    ``(o, lse)``: float32 ``[B, Hkv, n, R, Dv]`` and ``[B, Hkv, n, R]``. With a window,
    when no row of any sequence sees a key of this cache (e.g. a sequence-parallel chunk
    wholly before every window or past every end), nothing is read: the states are empty.
  """
  b, hkv, r, _ = q_rows.shape
  s = capacity(cache.k.shape, cache.layout, cache.block_tables)
  arrays = dict(q_rows=q_rows, cache=cache, ends=ends.astype(jnp.int32), mod_arrays=mod_arrays)
  static = dict(num_tokens=num_tokens, softmax_scale=softmax_scale, num_splits=num_splits, mods=mods,
                v_head_dim=v_head_dim, loop=loop)
  if mods.window is None:  # the skip costs ~7% of a plain decode on CPU (benchmarks/RESULTS.md)
    return _partials(**arrays, **static)
  arrays = _vary_together(arrays)  # what the cond closes over
  ends = arrays["ends"]
  seen = jnp.any(window_start(ends, num_tokens, s, mods) < jnp.clip(ends, 0, s))
  dv = v_head_dim if cache.v is None else cache.v.shape[-1]
  # Empty states typed as the computed ones: varying as the operands do.
  empty = lambda: _vary_together((jnp.zeros((b, hkv, num_splits, r, dv), jnp.float32),
                                  jnp.full((b, hkv, num_splits, r), -jnp.inf, jnp.float32)), like=arrays)
  return lax.cond(seen, lambda: _partials(**arrays, **static), empty)


def _vary_together(tree, like=None):
  """The arrays of ``tree`` typed as varying over every mesh axis any array of it (or of
  ``like``) varies over, inside ``shard_map``; unchanged outside one. `lax.pcast` changes
  the type only: the program computes the same bits.

  For what a `lax.cond` closes over. Under ``vmap``, a cond whose predicate is batched
  becomes a select of its operands by the predicate, so each operand then varies over the
  predicate's axes too, and the branches, traced for the operands' old types, no longer
  type-check ("requires varying manual axes to match", "pvary is a invariant->variant
  collective"). A predicate computed from operands that all vary over the same axes changes
  no operand's type. And constants typed so can stand in for computed values.
  """
  typed = lambda x: jax.typeof(x).manual_axis_type.varying
  axes = frozenset().union(*(typed(x) for x in jax.tree.leaves((tree, like))))
  def vary(x):
    missing = tuple(sorted(axes - typed(x)))
    return lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(vary, tree) if axes else tree


def _partials(q_rows, cache, ends, mod_arrays, *, num_tokens, softmax_scale, num_splits, mods, v_head_dim, loop):
  """`xla_partials`, computed."""
  k, v, k_rope, block_tables = cache.k, cache.v, cache.k_rope, cache.block_tables
  k_scale, k_offset, v_scale, v_offset = cache.k_scale, cache.k_offset, cache.v_scale, cache.v_offset
  mask, bias, alibi = mod_arrays["mask"], mod_arrays["bias"], mod_arrays["alibi"]
  kv_layout = cache.layout
  maybe = lambda f, x: None if x is None else f(x)
  n = num_splits
  b, hkv, r, _ = q_rows.shape
  paged = block_tables is not None
  tok = token_axis(kv_layout)
  page_size = k.shape[tok] if paged else None
  s = capacity(k.shape, kv_layout, block_tables)
  gather = gather_token_major_pages if kv_layout == "NHD" else gather_pages_head_major
  geo = Geometry(ends, num_tokens, r // num_tokens, s, mods, mask, bias, alibi)
  base = jnp.zeros((b,), jnp.int32)
  w = window_tokens(s, num_tokens, mods, page_size)
  if w < s:  # read only each sequence's window
    first = window_start(ends, num_tokens, s, mods)
    if paged:
      pages = w // page_size
      page0 = jnp.clip(first // page_size, 0, block_tables.shape[1] - pages)
      block_tables = _slice_seq(block_tables, page0, pages, axis=1)
      base = page0 * page_size
    else:
      # One copy of each sequence's window: XLA:CPU materializes a dynamic slice (slicing
      # chunk by chunk inside the loop below measured 20x slower: the loop copies the
      # whole cache it closes over).
      base = jnp.clip(first, 0, s - w)
      k, v, k_rope = (maybe(lambda x: _slice_seq(x, base, w, axis=tok), x) for x in (k, v, k_rope))
      k_scale, v_scale, k_offset, v_offset = (
          a if a is None or a.shape[2] == 1 else _slice_seq(a, base, w, axis=2)
          for a in (k_scale, v_scale, k_offset, v_offset))
    geo.view(base, w)
    s = w

  quantized = k_scale is not None or v_scale is not None
  if not paged and not quantized and kv_layout == "HND" and not loop:
    chunk = max(-(-s // n), 1)
    k, v, k_rope = (maybe(lambda x: pad_tokens(x, chunk * n), x) for x in (k, v, k_rope))
    geo.pad(chunk * n)
    chunks = lambda x: x.reshape(b, hkv, n, chunk, x.shape[-1])
    kc = chunks(k)
    vc = kc if v is None else chunks(v)  # MLA: the values are k's first v_head_dim columns
    keys = kc if k_rope is None else (kc, chunks(k_rope))
    return contiguous_states(q_rows, keys, vc.astype(q_rows.dtype), geo, base, softmax_scale,
                              v_cols=v_head_dim if v is None else None)

  compute_dtype = q_rows.dtype
  if paged:
    pages_per_chunk = -(-block_tables.shape[1] // n)
    tables = pad_tokens(block_tables, pages_per_chunk * n, axis=1)
    chunk = pages_per_chunk * page_size

    load = functools.partial(load_pages, tables=tables, pages=pages_per_chunk, page_size=page_size, gather=gather,
                             dtype=compute_dtype)  # -> [Hkv, B, C, D]: the pool's order, no transpose
  else:
    chunk = max(-(-s // n), 1)
    k, v, k_rope = (maybe(lambda x: pad_tokens(x, chunk * n, axis=tok), x) for x in (k, v, k_rope))
    k_scale, v_scale, k_offset, v_offset = (
        None if a is None else pad_tokens(a, chunk * n, broadcast_ok=True)
        for a in (k_scale, v_scale, k_offset, v_offset))

    load = functools.partial(load_rows, chunk=chunk, tok=tok, dtype=compute_dtype)  # -> [B, Hkv, C, D]

  geo.pad(chunk * n)
  heads_outer = paged
  q_loop = q_rows.transpose(1, 0, 2, 3) if heads_outer else q_rows

  def one_chunk(i):
    kc = load(i, k, k_scale, k_offset)[:, :, None]
    # MLA: the values are the loaded (dequantized) key's first columns, not a second read.
    vc = kc if v is None else load(i, v, v_scale, v_offset)[:, :, None]
    keys = kc if k_rope is None else (kc, load(i, k_rope, None, None)[:, :, None])
    o, lse = _chunk_states(q_loop, keys, vc.astype(compute_dtype), geo, base, i * chunk,
                           softmax_scale, heads_outer, v_cols=v_head_dim if v is None else None)
    return o[:, :, 0], lse[:, :, 0]

  if loop:  # one chunk's scores at a time, merged as they come: the one state [B, Hkv, 1, R, ...]
    def merged(state, i):
      o, lse = one_chunk(i)
      return merge_states(jnp.stack([state[0], o]), jnp.stack([state[1], lse])), None
    b_, h_ = (hkv, b) if heads_outer else (b, hkv)
    dv = v_head_dim if v is None else v.shape[-1]
    empty = (jnp.zeros((b_, h_, r, dv), jnp.float32), jnp.full((b_, h_, r), -jnp.inf, jnp.float32))
    (o, lse), _ = lax.scan(merged, empty, jnp.arange(n, dtype=jnp.int32))
    o, lse = o[None], lse[None]
  else:
    o, lse = lax.map(one_chunk, jnp.arange(n, dtype=jnp.int32))  # [n, B, Hkv, R, ...] (or [n, Hkv, B, ...])
  if heads_outer:
    o, lse = o.swapaxes(1, 2), lse.swapaxes(1, 2)
  return jnp.moveaxis(o, 0, 2), jnp.moveaxis(lse, 0, 2)
