"""Derivatives of every decode: one forward-mode rule at the dispatch, whose linear part
JAX transposes into the lean backward, so ``jvp``, ``grad``, ``vjp``, ``linearize`` and
their compositions (Hessian-vector products) all come from one place.

Legend: B batch, T new tokens, Hq / Hkv query / kv heads, G = Hq // Hkv, S cache
capacity, Dk / Dv key / value head dims, C positions per chunk.

The forward keeps its kernel (`fdecode.dispatch.decode`: XLA, Triton or Mosaic); only
the tangent runs as plain XLA, from the forward's saved output ``o`` and LSE
(FlashAttention-2's algebra). With ``P_j = exp(s_j - lse)`` the softmax weights
recomputed from the saved LSE,

  d lse = sum_j P_j ds_j  (+ P_sink d sink)
  d o   = sum_j P_j (dv_j + ds_j v_j) - o d lse

`attend_given_lse` computes ``(sum_j P_j v_j, sum_j P_j)`` chunk by chunk over the cache
with the LSE held fixed; its JVP is exactly ``(d o + o d lse, d lse)``, and JAX's
transpose of that JVP is the FlashAttention-2 backward (``dP = g v^T``, ``dS = P (dP -
D)``, ``dq = dS k``, ``dk = dS^T q``, ``dv = P^T g``). Each chunk's body is rematerialized
(``jax.checkpoint``): the backward recomputes a chunk's scores from q, the chunk and the
LSE, and never holds more than one chunk's ``[B, T, Hq, C]`` scores.

The rules the forward keeps, kept by the derivative:

* a slot no row of a (sequence, kv head) may see is *selected* away before any product
  (its key and value rows replaced by 0), so it gets a gradient of exactly 0 and changes
  no other gradient, whatever it holds (inf, NaN, a recycled page);
* a key or value row holding inf / NaN poisons the scores of the rows that see it (as
  the forward's `fdecode.kernels.common.block.guard_values`), so their gradients are NaN
  and the rows that do not see it never meet it;
* paged pools get their gradient through the transpose of the page gather: pages read by
  several sequences accumulate, unread pages get 0;
* 8-bit caches are storage: their values get no gradient (int8: float0; fp8: zeros);
  their float scales and offsets do, as do q, bias, ALiBi slopes, sinks and float caches.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fdecode.cache.paged import gather_pages, gather_scale
from fdecode.cache.quant import dequantize, is_quantized
from fdecode.kernels.common import modifiers
from fdecode.kernels.common import sparse as sparse_lib

__all__ = ["DenseCall", "attend_given_lse", "dense_call", "differentiable"]

# One chunk's scores ``[B, T, Hq, C]`` (float32) stay under this many bytes: the backward's
# working set is a few of them, whatever T and S are.
CHUNK_SCORE_BYTES = 4 << 20
_CHUNK_ALIGN = 128


class DenseCall(NamedTuple):
  """A decode in the float32 oracle's dense form: every cache form materialized to
  contiguous head-major float32 (what `fdecode.reference.reference_decode` and the
  derivative read).

  ``q`` ``[B, T, Hq, Dk]`` (as given), ``k`` f32 ``[B, Hkv, S, Dk]`` (k_rope's columns
  after k's own), ``v`` f32 ``[B, Hkv, S, Dv]``, ``ends`` int32 ``[B]``; ``mask`` bool /
  ``bias`` float ``[Bm, Tm, Hm, S]`` (the documented broadcasting form) or None; ``alibi``
  f32 ``[Hq]`` or None; ``sinks`` f32 ``[Hq]`` or None."""
  q: object
  k: object
  v: object
  ends: object
  mask: object
  bias: object
  alibi: object
  sinks: object


def _materialize(x, tables, scale=None, offset=None):
  """Float32 contiguous ``[B, Hkv, S, D]`` copy of a cache; 8-bit values are storage
  (no gradient), their scales and offsets are not."""
  if tables is not None:
    page_size = x.shape[2]
    x = gather_pages(x, tables)
    scale = None if scale is None else gather_scale(scale, tables, page_size)
    offset = None if offset is None else gather_scale(offset, tables, page_size)
  if is_quantized(x.dtype):
    x = lax.stop_gradient(x)
  if scale is None:
    return x.astype(jnp.float32)
  return dequantize(x, scale, offset)


def dense_call(q, view, ends, lists, mod_arrays, sinks, *, mods, v_head_dim, sparse) -> DenseCall:
  """`fdecode.dispatch.decode`'s canonical arguments -> the `DenseCall` (a differentiable
  function of them: the page gather, the head-major transpose and the dequantization)."""
  b, _, hq, _ = q.shape
  hm = view.head_major()
  tables = hm.block_tables
  kf = _materialize(hm.k, tables, hm.k_scale, hm.k_offset)
  vf = kf[..., :v_head_dim] if hm.v is None else _materialize(hm.v, tables, hm.v_scale, hm.v_offset)
  if hm.k_rope is not None:  # key-only columns after k's own
    kf = jnp.concatenate([kf, _materialize(hm.k_rope, tables)], axis=-1)
  mask = mod_arrays["mask"]
  if sparse is not None:  # the selected positions as a mask, each pseudo-sequence's cache row
    hkv = view.kv_heads
    src = jnp.arange(b) // sparse.fold
    kf, vf = kf[src], vf[src]
    sel = sparse_lib.dense_mask(lists["indices"], kf.shape[2])  # [B', Hi, S]
    mask = sel[:, :, None, None, :]  # canonical [B', Hi, 1, 1, S] ...
    if sel.shape[1] > 1:  # ... per kv head: the same list for its G query heads
      mask = jnp.broadcast_to(mask, (b, hkv, 1, hq // hkv, sel.shape[2]))
  user = lambda x: None if x is None else modifiers.user_form(x)
  alibi = mod_arrays["alibi"]
  return DenseCall(q, kf, vf, ends, user(mask), user(mod_arrays["bias"]),
                   None if alibi is None else alibi.reshape(-1), sinks)


def _chunk_size(b, t, hq, s):
  per_position = max(b * t * hq * 4, 1)
  c = max(_CHUNK_ALIGN, CHUNK_SCORE_BYTES // per_position // _CHUNK_ALIGN * _CHUNK_ALIGN)
  return s if c >= s else c


def _rows(x, b, t, hq, hkv):
  """A ``[Bm, Tm, Hm, C]`` mask / bias chunk -> ``[B|1, T|1, Hkv|1, G|1, C]``."""
  bm, tm, hm, c = x.shape
  return x.reshape(bm, tm, hkv, hq // hkv, c) if hm > 1 else x.reshape(bm, tm, 1, 1, c)


def attend_given_lse(d: DenseCall, lse, *, softmax_scale, causal, window, soft_cap):
  """``(sum_j P_j v_j, sum_j P_j + P_sink)`` with ``P_j = exp(s_j - lse)``: float32
  ``[B, T, Hq, Dv]`` and ``[B, T, Hq]``, ``lse`` f32 ``[B, T, Hq]`` held fixed (rows at
  -inf: no visible key). Chunks of `CHUNK_SCORE_BYTES` scores, each rematerialized in
  the backward; the score modifiers are the oracle's (`fdecode.kernels.common.modifiers`)."""
  b, t, hq, dk = d.q.shape
  hkv, s = d.k.shape[1], d.k.shape[2]
  g = hq // hkv
  dv = d.v.shape[-1]
  lse = jnp.where(lse == -jnp.inf, 0.0, lse).reshape(b, t, hkv, g)  # a row seeing nothing: P = 0 below
  qf = d.q.astype(jnp.float32).reshape(b, t, hkv, g, dk)
  ends = d.ends.astype(jnp.int32)
  qpos = (ends[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :])[:, :, None, None, None]  # [B, T, 1, 1, 1]
  hi = jnp.clip(ends, 0, s)[:, None, None, None, None]
  slopes = None if d.alibi is None else d.alibi.astype(jnp.float32).reshape(1, 1, hkv, g, 1)
  c = _chunk_size(b, t, hq, s)
  n = -(-s // c) if s else 1

  def chunk(carry, xs):
    acc, tot = carry
    first, kc, vc, mc, bc = xs  # kc [B, Hkv, C, Dk], mc / bc [Bm, Tm, Hm, C] or None
    pos = first + jnp.arange(kc.shape[2], dtype=jnp.int32)  # [C]
    visible = pos < hi
    if causal:
      visible &= pos <= qpos
    if window is not None:
      visible &= pos > qpos - window
    if mc is not None:
      visible &= _rows(mc, b, t, hq, hkv)
    visible = jnp.broadcast_to(visible, (b, t, hkv, g, kc.shape[2]))
    live = jnp.any(visible, axis=(1, 3))[..., None]  # [B, Hkv, C, 1]: some row sees the slot
    bad_k = ~jnp.all(jnp.isfinite(kc), axis=-1, keepdims=True)
    bad_v = ~jnp.all(jnp.isfinite(vc), axis=-1, keepdims=True)
    kc = jnp.where(live & ~bad_k, kc, 0.0)  # selected away: no product ever meets what a dead slot holds
    vc = jnp.where(live & ~bad_v, vc, 0.0)
    sc = jnp.einsum("btkgd,bkcd->btkgc", qf, kc, precision=lax.Precision.HIGHEST) * softmax_scale
    if soft_cap is not None:
      sc = soft_cap * jnp.tanh(sc / soft_cap)
    if slopes is not None:
      sc = sc + slopes * (pos - qpos).astype(jnp.float32)
    if bc is not None:
      sc = sc + _rows(bc, b, t, hq, hkv).astype(jnp.float32)
    bad = (bad_k | bad_v)[..., 0][:, None, :, None, :]  # [B, 1, Hkv, 1, C]
    sc = jnp.where(bad, jnp.nan, sc)  # a corrupt row poisons the rows that see it
    sc = jnp.where(visible, sc, -jnp.inf)  # exp of a dead slot is 0, and so is its derivative
    p = jnp.where(visible, jnp.exp(sc - lse[..., None]), 0.0)
    acc = acc + jnp.einsum("btkgc,bkcd->btkgd", p, vc, precision=lax.Precision.HIGHEST)
    return (acc, tot + jnp.sum(p, axis=-1)), None

  init = (jnp.zeros((b, t, hkv, g, dv), jnp.float32), jnp.zeros((b, t, hkv, g), jnp.float32))
  if n == 1:
    (acc, tot), _ = chunk(init, (jnp.int32(0), d.k, d.v, d.mask, d.bias))
  else:
    split = lambda x, axis: None if x is None else jnp.moveaxis(
        x.reshape(x.shape[:axis] + (n, c) + x.shape[axis + 1:]), axis, 0)
    kc = split(jnp.pad(d.k, ((0, 0), (0, 0), (0, n * c - s), (0, 0))), 2)
    vc = split(jnp.pad(d.v, ((0, 0), (0, 0), (0, n * c - s), (0, 0))), 2)
    mc = None if d.mask is None else split(jnp.pad(d.mask, ((0, 0),) * 3 + ((0, n * c - s),)), 3)
    bc = None if d.bias is None else split(jnp.pad(d.bias, ((0, 0),) * 3 + ((0, n * c - s),)), 3)
    firsts = jnp.arange(n, dtype=jnp.int32) * c
    (acc, tot), _ = lax.scan(jax.checkpoint(chunk, prevent_cse=False), init, (firsts, kc, vc, mc, bc))
  if d.sinks is not None:
    tot = tot + jnp.exp(d.sinks.astype(jnp.float32).reshape(1, 1, hkv, g) - lse)
  return acc.reshape(b, t, hq, dv), tot.reshape(b, t, hq)


class Statics(NamedTuple):
  """A decode's static options (hashable), as `fdecode.dispatch.decode` takes them."""
  impl: object
  softmax_scale: float
  cfg: object
  interpret: object
  mods: object
  v_head_dim: object
  sparse: object


def differentiable(forward, statics: Statics, args):
  """``forward(*args, **statics._asdict())`` -> ``(out, lse)``, with the derivative of
  this module (``args``: `fdecode.dispatch.decode`'s array arguments ``q, view, ends,
  lists, mod_arrays, sinks, source``)."""
  return _decode(forward, statics, args)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _decode(forward, statics, args):
  return forward(*args, **statics._asdict())


def _decode_jvp(forward, statics, primals, tangents):
  (args,), (dargs,) = primals, tangents
  out, lse = _decode(forward, statics, args)
  leaves, tree = jax.tree_util.tree_flatten(args)
  dleaves = jax.tree_util.tree_leaves(dargs, is_leaf=lambda x: isinstance(x, jax.custom_derivatives.SymbolicZero))
  moving = [i for i, dx in enumerate(dleaves)
            if not isinstance(dx, jax.custom_derivatives.SymbolicZero) and dx.dtype != jax.dtypes.float0]
  q, view, ends, lists, mod_arrays, sinks, _ = args
  mods = statics.mods

  def attend(*xs):  # the leaves with a tangent -> (sum P v, sum P), the others held
    full = list(leaves)
    for i, x in zip(moving, xs):
      full[i] = x
    q, view, ends, lists, mod_arrays, sinks, _ = jax.tree_util.tree_unflatten(tree, full)
    d = dense_call(q, view, ends, lists, mod_arrays, sinks, mods=mods, v_head_dim=statics.v_head_dim,
                   sparse=statics.sparse)
    return attend_given_lse(d, lse, softmax_scale=statics.softmax_scale, causal=mods.causal,
                            window=mods.window, soft_cap=mods.soft_cap)

  if not moving:
    return (out, lse), (jnp.zeros_like(out), jnp.zeros_like(lse))
  _, (dacc, dlse) = jax.jvp(attend, [leaves[i] for i in moving], [dleaves[i] for i in moving])
  o = out.astype(jnp.float32).reshape(dacc.shape)
  dout = dacc - o * dlse[..., None]
  return (out, lse), (dout.astype(out.dtype), dlse)


_decode.defjvp(_decode_jvp, symbolic_zeros=True)
