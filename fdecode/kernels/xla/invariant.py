"""The batch-invariant XLA path (``flash_decode(batch_invariant=True)``): a row's bits depend
only on its own query, its own sequence's cache and its own position.

Legend: B batch, T new tokens, Hkv kv heads, G = Hq // Hkv, R = T * G rows of a kv head,
C = the split size (cache positions per split), D head dims.

What makes a row's result independent of everything else in the call:

* **Splits at absolute positions.** Split i holds cache positions ``[i * C, (i + 1) * C)``
  whatever B, S, T or the other sequences are. A split a row sees nothing of gives the
  empty state (lse -inf), and merging an empty state is exact (`fdecode.combine.merge_by`:
  weight 0 selected away, ``x * 1 + 0``, ``/ 1``, ``+ log(1)``), so a cache of larger
  capacity, or a longer prefill whose later splits this row does not see, leaves its bits
  alone.
* **One merge order.** The splits are folded left to right, one at a time (``lax.scan``).
* **Products of one shape.** XLA:CPU's matmul picks its blocking, and so its summation
  order, from the whole product's shape: one query row's ``P V`` differed in its last bits
  between a T = 1 and a T = 5 call, and between batches of 1 and 8 (rows of 16 * G
  against T * G, 2026-12-02, a 2-core AVX2 CPU). Here every product is a batch of
  ``[G, D] x [D, C]`` (scores) and ``[G, C] x [C, D]`` (values) matmuls, one per
  (sequence, kv head, token): the split's keys are broadcast over the tokens, so the
  token is a batch axis of the product, never one of its rows. A token's G query heads
  are always its rows, in decode and prefill alike.
* **No sum over a split outside a product.** XLA:CPU's sum along the last axis changed
  its order with the number of rows (a row's softmax denominator differed between T = 1
  and T = 7), so the denominator comes out of the values' product, as a column of ones
  after the values. The row max is exact in any order.
* **No select that depends on other rows.** The default path zeroes a value row no row of
  the call sees (``live``): a prefill sees more slots than a decode. Here a value row is
  zeroed only when it holds an inf or NaN (then its scores are NaN for the rows that see
  it); a finite value a row does not see meets that row's probability of exactly 0.

The keys broadcast over a block of tokens at a time (`TOKEN_BLOCK_BYTES` of them): a
prefill loops over its token blocks, each over every split. Every cache form is read
split by split (contiguous and token-major rows sliced, pages gathered through the block
table, 8-bit rows dequantized after the load), so no copy of the whole cache is made.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fdecode.cache.layout import capacity, token_axis
from fdecode.config import DEFAULT_SPLIT_SIZE
from fdecode.cache.paged import gather_pages_head_major, gather_token_major_pages
from fdecode.combine import MASK_VALUE, finalize_state, merge_states
from fdecode.kernels.common.modifiers import Modifiers, row_bounds
from fdecode.kernels.xla.dense import _vary_together, load_pages, load_rows, pad_tokens

# The default split size: cache positions per split.
SPLIT_SIZE = DEFAULT_SPLIT_SIZE
# A token block's broadcast keys (all sequences, float32 words) stay under this many bytes.
TOKEN_BLOCK_BYTES = 8 << 20


def split_tokens(split_size: int | None, page_size: int | None) -> int:
  """Positions per split: ``split_size`` (default `SPLIT_SIZE`), rounded up to whole pages
  over a paged cache (a split gathers whole pages)."""
  c = SPLIT_SIZE if split_size is None else split_size
  if page_size:
    c = -(-c // page_size) * page_size
  return c


def _split_loader(cache, c: int, n: int, dtype):
  """``(load, arrays)``: ``load(i, x, scale, offset)`` gives split i of cache ``x`` as
  ``[B, Hkv, C, D]`` in ``dtype`` (``n`` splits of ``c`` positions: a pool through its
  table padded to ``n * c // page_size`` pages, a contiguous cache padded to ``n * c``
  positions), and ``arrays``: ``(k, v, k_rope, k_scale, k_offset, v_scale, v_offset)`` as
  ``load`` reads them."""
  k, v, k_rope, block_tables = cache.k, cache.v, cache.k_rope, cache.block_tables
  k_scale, k_offset, v_scale, v_offset = cache.k_scale, cache.k_offset, cache.v_scale, cache.v_offset
  tok = token_axis(cache.layout)
  if block_tables is not None:
    page_size = k.shape[tok]
    per = c // page_size
    tables = pad_tokens(block_tables, per * n, axis=1)
    gather = gather_token_major_pages if cache.layout == "NHD" else gather_pages_head_major
    paged_load = functools.partial(load_pages, tables=tables, pages=per, page_size=page_size, gather=gather,
                                   dtype=dtype)
    load = lambda *a: paged_load(*a).transpose(1, 0, 2, 3)  # split i -> [B, Hkv, C, D]
  else:
    k, v, k_rope = (None if x is None else pad_tokens(x, c * n, axis=tok) for x in (k, v, k_rope))
    k_scale, v_scale, k_offset, v_offset = (None if a is None else pad_tokens(a, c * n, broadcast_ok=True)
                                            for a in (k_scale, v_scale, k_offset, v_offset))
    load = functools.partial(load_rows, chunk=c, tok=tok, dtype=dtype)  # split i -> [B, Hkv, C, D]
  return load, (k, v, k_rope, k_scale, k_offset, v_scale, v_offset)


def invariant_partials(q_rows, cache, ends, mod_arrays, *, num_tokens: int, softmax_scale: float, split: int,
                       mods: Modifiers = Modifiers(), v_head_dim=None):
  """The merged state of every split, as `fdecode.kernels.xla.xla_partials` takes and returns
  its arguments (one split out): ``(o f32 [B, Hkv, 1, R, Dv], lse f32 [B, Hkv, 1, R])``.

  ``split``: positions per split (`split_tokens`; a multiple of the page size when paged).
  The window is applied by masking (every split is read: a window view would move the
  splits off absolute positions)."""
  mask, bias, alibi = mod_arrays["mask"], mod_arrays["bias"], mod_arrays["alibi"]
  b, hkv, r, dq = q_rows.shape
  t = num_tokens
  g = r // t
  s = capacity(cache.k.shape, cache.layout, cache.block_tables)
  c = split
  n = max(-(-s // c), 1)
  cd, block_tables = q_rows.dtype, cache.block_tables
  dv = v_head_dim if cache.v is None else cache.v.shape[-1]
  load, (k, v, k_rope, k_scale, k_offset, v_scale, v_offset) = _split_loader(cache, c, n, q_rows.dtype)

  # Per row (b, t, g): the positions it may see, lo <= j < hi, and its own position.
  lo, hi, qpos = (x.reshape(b, 1, t, g, 1) for x in row_bounds(ends.astype(jnp.int32), t, g, s, mods))
  pad = lambda x: None if x is None else pad_tokens(x, c * n, axis=4)
  mask, bias = pad(mask), pad(bias)  # canonical [Bm, Hm, Tm, Gm, S]: the scores' own axis order
  slopes = None if alibi is None else alibi.astype(jnp.float32).reshape(1, hkv, 1, g, 1)

  per_token = (1 if jax.export.is_symbolic_dim(b) else b) * hkv * c * max(dq, dv) * 4  # a symbolic B: per sequence
  tb = max(1, min(t, TOKEN_BLOCK_BYTES // per_token))
  nt = -(-t // tb)
  q5 = pad_tokens(q_rows.reshape(b, hkv, t, g, dq), nt * tb, axis=2)
  lo, hi, qpos = (pad_tokens(x, nt * tb, axis=2) for x in (lo, hi, qpos))  # padded rows see nothing

  def rows_of(x, j):  # a token block of a per-row operand (or one that broadcasts over tokens)
    if x is None or x.shape[2] == 1:
      return x
    x = pad_tokens(x, nt * tb, axis=2)
    return lax.dynamic_slice_in_dim(x, j * tb, tb, axis=2)

  def block(j):  # token block j over every split -> (o [B, Hkv, tb, G, Dv], lse [B, Hkv, tb, G])
    qb = lax.dynamic_slice_in_dim(q5, j * tb, tb, axis=2)
    lob, hib, qposb = (lax.dynamic_slice_in_dim(x, j * tb, tb, axis=2) for x in (lo, hi, qpos))
    maskb, biasb = rows_of(mask, j), rows_of(bias, j)
    bcast = lambda x: jnp.broadcast_to(x[:, :, None], (b, hkv, tb) + x.shape[2:])  # the token: a batch axis

    def one_split(state, i):
      kc = load(i, k, k_scale, k_offset)
      vc = kc if v is None else load(i, v, v_scale, v_offset)
      values = vc[..., :dv]
      sc = jnp.einsum("bhtgd,bhtcd->bhtgc", qb[..., :kc.shape[-1]], bcast(kc.astype(cd)),
                      preferred_element_type=jnp.float32)
      if k_rope is not None:
        kr = load(i, k_rope, None, None)
        sc = sc + jnp.einsum("bhtgd,bhtcd->bhtgc", qb[..., kc.shape[-1]:], bcast(kr.astype(cd)),
                             preferred_element_type=jnp.float32)
      sc = sc * softmax_scale
      pos = i * c + jnp.arange(c, dtype=jnp.int32)  # [C], absolute
      if mods.soft_cap is not None:
        sc = mods.soft_cap * jnp.tanh(sc / mods.soft_cap)
      if slopes is not None:
        sc = sc + slopes * (pos - qposb).astype(jnp.float32)
      visible = (pos >= lob) & (pos < hib)
      if maskb is not None:
        visible &= lax.dynamic_slice_in_dim(maskb, i * c, c, axis=4)
      if biasb is not None:
        sc = sc + lax.dynamic_slice_in_dim(biasb, i * c, c, axis=4).astype(jnp.float32)
      # A value row holding inf / NaN: NaN scores for the rows that see it, zeroed for the product.
      bad = ~jnp.all(jnp.isfinite(values), axis=-1)  # [B, Hkv, C]
      sc = jnp.where(bad[:, :, None, None, :], jnp.nan, sc)
      vc = jnp.where(bad[..., None], jnp.zeros((), vc.dtype), vc)
      sc = jnp.where(visible, sc, MASK_VALUE)
      m = jnp.max(sc, axis=-1)
      p = jnp.where(visible, jnp.exp(sc - m[..., None]), 0.0)
      # The row sums come out of the same product, as a column of ones after the values:
      # XLA:CPU's sum along the last axis changes order with the number of rows.
      vx = jnp.concatenate([vc[..., :dv].astype(cd), jnp.ones(vc.shape[:-1] + (1,), cd)], axis=-1)
      accx = jnp.einsum("bhtgc,bhtcd->bhtgd", p.astype(cd), bcast(vx), preferred_element_type=jnp.float32)
      o, lse = finalize_state(accx[..., :dv], m, accx[..., dv])
      merged = merge_states(jnp.stack([state[0], o]), jnp.stack([state[1], lse]))
      return merged, None

    empty = (jnp.zeros((b, hkv, tb, g, dv), jnp.float32), jnp.full((b, hkv, tb, g), -jnp.inf, jnp.float32))
    empty = _vary_together(empty, like=(qb, k, v, k_rope, ends, block_tables))  # inside shard_map: typed as the splits' states
    state, _ = lax.scan(one_split, empty, jnp.arange(n, dtype=jnp.int32))
    return state

  if nt == 1:
    o, lse = block(0)
  else:
    o, lse = lax.map(block, jnp.arange(nt, dtype=jnp.int32))  # [nt, B, Hkv, tb, G, ...]
    o = jnp.moveaxis(o, 0, 2).reshape(b, hkv, nt * tb, g, dv)
    lse = jnp.moveaxis(lse, 0, 2).reshape(b, hkv, nt * tb, g)
  o, lse = o[:, :, :t], lse[:, :, :t]
  return o.reshape(b, hkv, 1, r, dv), lse.reshape(b, hkv, 1, r)
