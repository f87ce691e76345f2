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
with the LSE held fixed; its JVP is exactly ``(d o + o d lse, d lse)``. That JVP runs as
one `linear_call` (a primitive linear in the tangents) whose transpose is
`attend_transpose`, the FlashAttention-2 backward written out (``dP = g v^T + g_lse``,
``dS = P dP``, ``dq = dS k``, ``dk = dS^T q``, ``dv = P^T g``): it recomputes each chunk's
scores from q, the chunk and the LSE, never holds more than one chunk's scores, and lays
every product out for XLA:CPU (JAX's own transpose of the JVP made two of them read a
transposed copy of the cache: 2x slower, benchmarks/RESULTS.md). Forward mode and the
derivatives of the derivative (Hessian-vector products) differentiate
`attend_given_lse` itself.

The rules the forward keeps, kept by the derivative:

* a slot no row of a (sequence, kv head) may see is *selected* away before any product
  over slots, so it gets a gradient of exactly 0 and changes no other gradient, whatever
  it holds (inf, NaN, a recycled page). Where a product is finite no such slot added
  anything but an exact 0, so the backward checks the small result and redoes the
  product with the select only when it is not (`_exact`, as the forward's
  `fdecode.kernels.xla.dense.contiguous_states`);
* a key or value row holding inf / NaN a row sees makes that row's output, LSE and
  gradients NaN (the forward's `fdecode.kernels.common.block.guard_values`), and the
  rows that do not see it never meet it;
* paged pools get their gradient through the transpose of the page gather: pages read by
  several sequences accumulate, unread pages get 0;
* 8-bit caches are storage: their values get no gradient (int8: float0; fp8: zeros);
  their float scales and offsets do, as do q, bias, ALiBi slopes, sinks and float caches.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching, mlir

from fdecode.kernels.backend import Operands, Options
from fdecode.kernels.common.dense import DenseCall, dense_call

__all__ = ["DenseCall", "attend_given_lse", "dense_call", "differentiable"]

# One chunk's scores ``[B, T, Hq, C]`` (float32) stay under this many bytes: the backward's
# working set is a few of them, whatever T and S are.
CHUNK_SCORE_BYTES = 4 << 20
_CHUNK_ALIGN = 128


def _chunking(b, t, hq, s):
  """(positions per chunk C, chunk count n) with ``n * C >= S``; C divides S when a
  split of S into n equal chunks exists (no padded copy of the cache)."""
  per_position = max(b * t * hq * 4, 1)
  c = max(_CHUNK_ALIGN, CHUNK_SCORE_BYTES // per_position // _CHUNK_ALIGN * _CHUNK_ALIGN)
  if c >= s:
    return max(s, 1), 1
  n = -(-s // c)
  return (s // n, n) if s % n == 0 else (c, n)


def _cols(x, b, t, hq, hkv):
  """A ``[Bm, Tm, Hm, C]`` mask / bias chunk -> ``[B|1, Hkv|1, C, T|1, G|1]``."""
  bm, tm, hm, c = x.shape
  x = x.reshape(bm, tm, hkv, hq // hkv, c) if hm > 1 else x.reshape(bm, tm, 1, 1, c)
  return x.transpose(0, 2, 4, 1, 3)


def _uncols(x, shape):
  """`_cols`' inverse for a cotangent ``[B, Hkv, C, T, G]``: summed over the axes the
  ``[Bm, Tm, Hm, C]`` operand broadcasts, back in its layout."""
  bm, tm, hm, c = shape
  b, hkv, _, t, g = x.shape
  x = jnp.sum(x, axis=tuple(i for i, keep in ((0, bm > 1), (1, hm > 1), (3, tm > 1), (4, hm > 1)) if not keep),
              keepdims=True)
  return x.transpose(0, 3, 1, 4, 2).reshape(bm, tm, hm, c)


class _Rows(NamedTuple):
  """A call's query side in the derivative's layout: scores are ``[B, Hkv, C, T, G]``
  (the rows minor, the layout in which XLA:CPU runs every product of the backward
  without a transposed copy of the cache)."""
  q: object       # f32 [B, Hkv, T, G, Dk]
  lse: object     # f32 [B, Hkv, 1, T, G]; a row seeing nothing: 0 (its P is 0 anyway)
  qpos: object    # int32 [B, 1, 1, T, 1]
  hi: object      # int32 [B, 1, 1, 1, 1]: the sequence's end, clipped to S
  slopes: object  # f32 [1, Hkv, 1, 1, G] or None


def _rows_of(d: DenseCall, lse) -> _Rows:
  b, t, hq, dk = d.q.shape
  hkv, s = d.k.shape[1], d.k.shape[2]
  g = hq // hkv
  lse = jnp.where(lse == -jnp.inf, 0.0, lse).reshape(b, t, hkv, g).transpose(0, 2, 1, 3)[:, :, None]
  ends = d.ends.astype(jnp.int32)
  qpos = (ends[:, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :])[:, None, None, :, None]
  slopes = None if d.alibi is None else d.alibi.astype(jnp.float32).reshape(1, hkv, 1, 1, g)
  return _Rows(d.q.astype(jnp.float32).reshape(b, t, hkv, g, dk).transpose(0, 2, 1, 3, 4), lse.astype(jnp.float32),
               qpos, jnp.clip(ends, 0, s)[:, None, None, None, None], slopes)


class _Sight(NamedTuple):
  """Which rows see which slots of one chunk."""
  visible: object  # bool [B|1, Hkv|1, C, T|1, G|1]
  live: object     # bool [B|1, Hkv|1, C, 1]: some row of the (sequence, kv head) sees the slot
  uniform: bool    # every row of a kv head sees the same slots
  pos: object      # int32 [C, 1, 1]


def _sight(rows: _Rows, first, c, mc, *, shape, causal, window) -> _Sight:
  b, t, hq, hkv = shape
  pos = (first + jnp.arange(c, dtype=jnp.int32))[:, None, None]
  visible = pos < rows.hi
  if causal:
    visible &= pos <= rows.qpos
  if window is not None:
    visible &= pos > rows.qpos - window
  if mc is not None:
    visible &= _cols(mc, b, t, hq, hkv)
  return _Sight(visible, jnp.any(visible, axis=(3, 4))[..., None], visible.shape[3] == 1 and visible.shape[4] == 1,
                pos)


class _Chunk(NamedTuple):
  """One chunk's softmax weights and what the derivative needs of them."""
  p: object        # f32 [B, Hkv, C, T, G]: exp(s - lse) where visible, else 0
  capped: object   # f32 tanh(scores / soft_cap) (soft cap only), else None
  dist: object     # f32 [B, 1, C, T, 1] key position - query position (ALiBi only), else None


def _chunk(rows: _Rows, sight: _Sight, kc, bc, *, shape, softmax_scale, soft_cap, poison=None) -> _Chunk:
  """The softmax weights, from the saved LSE, of keys ``kc`` (as given: a key row no row
  sees only ever meets a select here). ``poison``: bool ``[B, Hkv, C, 1, 1]`` corrupt
  rows, whose scores are NaN for the rows that see them (as the forward's
  `fdecode.kernels.common.block.guard_values`)."""
  b, t, hq, hkv = shape
  sc = jnp.einsum("bkcd,bktgd->bkctg", kc, rows.q, precision=lax.Precision.HIGHEST) * softmax_scale
  capped = None
  if soft_cap is not None:
    capped = jnp.tanh(sc / soft_cap)
    sc = soft_cap * capped
  dist = None
  if rows.slopes is not None:
    dist = (sight.pos - rows.qpos).astype(jnp.float32)
    sc = sc + rows.slopes * dist
  if bc is not None:
    sc = sc + _cols(bc, b, t, hq, hkv).astype(jnp.float32)
  if poison is not None:
    sc = jnp.where(poison, jnp.nan, sc)
  sc = jnp.where(sight.visible, sc, -jnp.inf)  # exp of a dead slot is 0, and so is its derivative
  return _Chunk(jnp.where(sight.visible, jnp.exp(sc - rows.lse), 0.0), capped, dist)


def _finite_rows(x):
  return jnp.all(jnp.isfinite(x), axis=-1, keepdims=True)


def _computed(x):
  """``x``, as a buffer of its own: the root of a reduction, which XLA:CPU does not fuse
  into its consumers (``optimization_barrier`` does not survive its compile)."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return jnp.sum(jnp.stack([x, jnp.zeros_like(x)]), axis=0)


def _exact(fast, exact):
  """``fast``, a product over slots of a dS that is 0 wherever a row does not see the
  slot, when it is finite (every unseen slot then added exactly 0); else ``exact()``, the
  product with the slots it must not meet selected away (garbage in them, or a
  NaN a row does see: that row stays NaN). The check reads the small result, not the
  cache."""
  return lax.cond(jnp.all(jnp.isfinite(fast)), lambda: fast, exact)


def _chunks(d: DenseCall):
  """(C, n, the chunk of keys ``i``: ``(first, k, v, mask, bias)``); the cache padded to
  ``n * C`` only when C does not divide S."""
  b, t, hq, _ = d.q.shape
  s = d.k.shape[2]
  c, n = _chunking(b, t, hq, s)
  pad = n * c - s
  padded = lambda x, axis: None if x is None or not pad else jnp.pad(
      x, [(0, pad if i == axis else 0) for i in range(x.ndim)])
  k, v = (d.k, d.v) if not pad else (padded(d.k, 2), padded(d.v, 2))
  mask = d.mask if not pad or d.mask is None else padded(d.mask, 3)
  bias = d.bias if not pad or d.bias is None else padded(d.bias, 3)

  def at(i):
    first = i * c
    cut = lambda x, axis: None if x is None else lax.dynamic_slice_in_dim(x, first, c, axis)
    return first, cut(k, 2), cut(v, 2), cut(mask, 3), cut(bias, 3)
  return c, n, at


def attend_given_lse(d: DenseCall, lse, *, softmax_scale, causal, window, soft_cap):
  """``(sum_j P_j v_j, sum_j P_j + P_sink)`` with ``P_j = exp(s_j - lse)``: float32
  ``[B, T, Hq, Dv]`` and ``[B, T, Hq]``, ``lse`` f32 ``[B, T, Hq]`` held fixed (rows at
  -inf: no visible key). Chunks of `CHUNK_SCORE_BYTES` scores; the score modifiers are
  the oracle's (`fdecode.kernels.common.modifiers`). Its JVP is the derivative's forward
  mode; `attend_transpose` is the transpose of that JVP (reverse mode)."""
  b, t, hq, _ = d.q.shape
  hkv = d.k.shape[1]
  g = hq // hkv
  rows = _rows_of(d, lse)
  c, n, at = _chunks(d)
  shape = (b, t, hq, hkv)
  opts = dict(shape=shape, softmax_scale=softmax_scale, soft_cap=soft_cap)

  def body(i, carry):
    acc, tot = carry
    first, kc, vc, mc, bc = at(i)
    sight = _sight(rows, first, c, mc, shape=shape, causal=causal, window=window)
    if sight.uniform:  # the rows that see a corrupt row meet it in the products themselves
      ch = _chunk(rows, sight, kc, bc, **opts)
      keep_v = sight.live
    else:  # a corrupt row poisons the rows that see it, and never meets the others
      keep_k, keep_v = sight.live & _finite_rows(kc), sight.live & _finite_rows(vc)
      ch = _chunk(rows, sight, jnp.where(keep_k, kc, 0.0), bc, **opts,
                  poison=(sight.live & ~(keep_k & keep_v))[..., None])
    acc = acc + jnp.einsum("bkctg,bkcd->bktgd", ch.p, jnp.where(keep_v, vc, 0.0), precision=lax.Precision.HIGHEST)
    return acc, tot + jnp.sum(ch.p, axis=2)

  init = (jnp.zeros((b, hkv, t, g, d.v.shape[-1]), jnp.float32), jnp.zeros((b, hkv, t, g), jnp.float32))
  acc, tot = body(0, init) if n == 1 else lax.fori_loop(0, n, body, init)
  if d.sinks is not None:
    tot = tot + jnp.exp(d.sinks.astype(jnp.float32).reshape(1, hkv, 1, g) - rows.lse[:, :, 0])
  return acc.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, -1), tot.transpose(0, 2, 1, 3).reshape(b, t, hq)


class Floats(NamedTuple):
  """The float operands of a `DenseCall` (the derivative's linear inputs; None: absent)."""
  q: object
  k: object
  v: object
  bias: object
  alibi: object
  sinks: object


def floats_of(d: DenseCall) -> Floats:
  return Floats(d.q, d.k, d.v, d.bias, d.alibi, d.sinks)


def attend_transpose(d: DenseCall, lse, cts, *, softmax_scale, causal, window, soft_cap, need: Floats) -> Floats:
  """The transpose of `attend_given_lse`'s JVP: the cotangents ``cts = (g_acc [B, T, Hq,
  Dv], g_tot [B, T, Hq])`` -> those of the `Floats` marked in ``need`` (None for the
  others), FlashAttention-2's backward from the saved LSE, chunk by chunk:

    dP = g_acc v^T + g_tot,  dS = P dP,  dq = dS k,  dk = dS^T q,  dv = P^T g_acc.

  Each chunk's scores are recomputed (`_chunk`) and never held past it; dk and dv land in
  place in the chunk's rows. A slot no row sees gets exactly 0; a NaN a row sees reaches
  that row's gradients (through its NaN LSE and scores) and no other row's."""
  g_acc, g_tot = cts
  b, t, hq, dk = d.q.shape
  hkv, s = d.k.shape[1], d.k.shape[2]
  g = hq // hkv
  rows = _rows_of(d, lse)
  c, n, at = _chunks(d)
  shape = (b, t, hq, hkv)
  ga = g_acc.astype(jnp.float32).reshape(b, t, hkv, g, -1).transpose(0, 2, 1, 3, 4)  # [B, Hkv, T, G, Dv]
  gt = g_tot.astype(jnp.float32).reshape(b, t, hkv, g).transpose(0, 2, 1, 3)  # [B, Hkv, T, G]
  hi = lax.Precision.HIGHEST
  # A non-finite q or cotangent row already makes its rows' dS / P NaN wherever they see a
  # slot; zeroed as an operand it keeps 0 * inf out of the slots nobody sees.
  q_finite = jnp.where(jnp.isfinite(rows.q), rows.q, 0.0)
  ga_finite = jnp.where(jnp.isfinite(ga), ga, 0.0)
  # The row-sized operands computed once: XLA:CPU otherwise fuses the LSE's own selects and
  # transposes into the per-score exp, once per slot (measured 4x its cost at T=16).
  rows, ga, gt, q_finite, ga_finite = jax.tree_util.tree_map(_computed, (rows, ga, gt, q_finite, ga_finite))

  def dq_product(ds, kc):  # dq = dS^T k: XLA:CPU transposes one operand, so the smaller one
    if t * g < dk:  # dS [C, T*G] transposed
      return jnp.einsum("bkctg,bkcd->bktgd", ds, kc, precision=hi)
    return jnp.moveaxis(jnp.einsum("bkcd,bkctg->bkdtg", kc, ds, precision=hi), 2, -1)  # k: dq^T = k^T dS

  def body(i, carry):
    dq, dk_all, dv_all, dbias, dalibi = carry
    first, kc, vc, mc, bc = at(i)
    sight = _sight(rows, first, c, mc, shape=shape, causal=causal, window=window)
    ch = _chunk(rows, sight, kc, bc, shape=shape, softmax_scale=softmax_scale, soft_cap=soft_cap)
    dp = jnp.einsum("bkcd,bktgd->bkctg", vc, ga, precision=hi) + gt[:, :, None]
    ds = jnp.where(sight.visible, ch.p * dp, 0.0)  # d scores (after the modifiers)
    if need.bias is not None:
      dbias = lax.dynamic_update_slice_in_dim(dbias, _uncols(ds, bc.shape).astype(dbias.dtype), first, 3)
    if need.alibi is not None:
      dalibi = dalibi + jnp.sum(ds * ch.dist, axis=(0, 2, 3))
    if ch.capped is not None:
      ds = ds * (1.0 - ch.capped * ch.capped)
    ds = ds * softmax_scale
    if need.q is not None:  # the one product over slots: a key row it must not meet is selected away
      keep_k = lambda: sight.live if sight.uniform else sight.live & _finite_rows(kc)
      dq = dq + _exact(dq_product(ds, kc), lambda: dq_product(ds, jnp.where(keep_k(), kc, 0.0)))
    if need.k is not None:  # a dead slot's dS is 0: its dk is 0 unless q is not finite
      dkc = jnp.einsum("bkctg,bktgd->bkcd", ds, q_finite, precision=hi)
      dk_all = dkc if n == 1 else lax.dynamic_update_slice_in_dim(dk_all, dkc, first, 2)
    if need.v is not None:  # a dead slot's P is 0: its dv is 0 unless the cotangent is not finite
      dvc = jnp.einsum("bkctg,bktgd->bkcd", ch.p, ga_finite, precision=hi)
      dv_all = dvc if n == 1 else lax.dynamic_update_slice_in_dim(dv_all, dvc, first, 2)
    return dq, dk_all, dv_all, dbias, dalibi

  zeros = lambda shape, dtype=jnp.float32: jnp.zeros(shape, dtype)
  none = jnp.zeros((), jnp.float32)
  init = (zeros((b, hkv, t, g, dk)) if need.q is not None else none,
          zeros((b, hkv, n * c, dk)) if need.k is not None and n > 1 else none,
          zeros((b, hkv, n * c, d.v.shape[-1])) if need.v is not None and n > 1 else none,
          zeros(d.bias.shape[:3] + (n * c,), d.bias.dtype) if need.bias is not None else none,
          zeros((hkv, g)) if need.alibi is not None else none)
  dq, dk_all, dv_all, dbias, dalibi = body(0, init) if n == 1 else lax.fori_loop(0, n, body, init)
  out = dict(q=None, k=None, v=None, bias=None, alibi=None, sinks=None)
  if need.q is not None:
    out["q"] = dq.transpose(0, 2, 1, 3, 4).reshape(d.q.shape).astype(d.q.dtype)
  if need.k is not None:
    out["k"] = dk_all[:, :, :s].astype(d.k.dtype)
  if need.v is not None:
    out["v"] = dv_all[:, :, :s].astype(d.v.dtype)
  if need.bias is not None:
    out["bias"] = dbias[..., :s]
  if need.alibi is not None:
    out["alibi"] = dalibi.reshape(d.alibi.shape).astype(d.alibi.dtype)
  if need.sinks is not None:
    w = jnp.exp(d.sinks.astype(jnp.float32).reshape(1, hkv, 1, g) - rows.lse[:, :, 0])  # [B, Hkv, T, G]
    out["sinks"] = jnp.sum(gt * w, axis=(0, 2)).reshape(d.sinks.shape).astype(d.sinks.dtype)
  return Floats(**out)


def differentiable(forward, options: Options, operands: Operands):
  """``forward(operands, options)`` -> ``(out, lse)``, with the derivative of this module
  (`fdecode.kernels.backend.Operands` / ``Options``: `fdecode.dispatch.decode`'s)."""
  return _decode(forward, options, operands)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _decode(forward, statics, args):
  return forward(args, statics)


def _decode_jvp(forward, statics, primals, tangents):
  (args,), (dargs,) = primals, tangents
  out, lse = _decode(forward, statics, args)
  leaves, tree = jax.tree_util.tree_flatten(args)
  dleaves = jax.tree_util.tree_leaves(dargs, is_leaf=lambda x: isinstance(x, jax.custom_derivatives.SymbolicZero))
  moving = [i for i, dx in enumerate(dleaves)
            if not isinstance(dx, jax.custom_derivatives.SymbolicZero) and dx.dtype != jax.dtypes.float0]
  if not moving:
    return (out, lse), (jnp.zeros_like(out), jnp.zeros_like(lse))

  def dense(*xs):  # the leaves with a tangent -> the call's float operands, the others held
    full = list(leaves)
    for i, x in zip(moving, xs):
      full[i] = x
    q, view, ends, lists, mod_arrays, sinks, _ = jax.tree_util.tree_unflatten(tree, full)
    d = dense_call(q, view, ends, lists, mod_arrays, sinks, mods=statics.mods, v_head_dim=statics.v_head_dim,
                   sparse=statics.sparse)
    return floats_of(d), d

  floats, dfloats, d = jax.jvp(dense, [leaves[i] for i in moving], [dleaves[i] for i in moving], has_aux=True)
  mods = statics.mods
  opts = dict(softmax_scale=statics.softmax_scale, causal=mods.causal, window=mods.window, soft_cap=mods.soft_cap)
  fixed = (d._replace(**{f: None for f in Floats._fields}), lse)
  dacc, dlse = _attend_linear(fixed, floats, dfloats, opts)
  o = out.astype(jnp.float32).reshape(dacc.shape)
  dout = dacc - o * dlse[..., None]
  return (out, lse), (dout.astype(out.dtype), dlse)


_decode.defjvp(_decode_jvp, symbolic_zeros=True)


def _attend_linear(fixed, floats: Floats, dfloats: Floats, opts):
  """``jvp(attend_given_lse)`` at ``floats`` along ``dfloats`` as a `linear_call` whose
  transpose is `attend_transpose` (JAX's own transpose of the JVP lays the cache out
  transposed for two of its products: measured 2x slower on XLA:CPU). ``fixed``: the
  `DenseCall`'s other fields (Floats' None) and the LSE."""
  def whole(res):
    (d, lse), fl = res
    return d._replace(**fl._asdict()), lse

  def tangent(res, lin):
    d, lse = whole(res)
    attend = lambda fl: attend_given_lse(d._replace(**fl._asdict()), lse, **opts)
    return jax.jvp(attend, (res[1],), (lin,))[1]

  def transpose(res, cts, need):
    d, lse = whole(res)
    return attend_transpose(d, lse, cts, **opts, need=need)

  return linear_call(tangent, transpose, (fixed, floats), dfloats)


class _LinearCall:
  """`linear_call`'s parameters: ``fn(res, lin)`` linear in ``lin``, and its transpose
  ``transpose(res, cts, need)`` (``need``: the ``lin`` pytree, None where that cotangent
  is not wanted), on flat lists of leaves; ``jaxpr`` is ``fn``'s, traced for its result
  types (which carry shard_map's varying axes)."""

  def __init__(self, fn, transpose, res_tree, lin_tree, jaxpr, out_tree):
    self.fn, self.transpose, self.res_tree, self.lin_tree = fn, transpose, res_tree, lin_tree
    self.jaxpr, self.out_tree = jaxpr, out_tree

  def split(self, args):
    n = self.res_tree.num_leaves
    return list(args[:n]), list(args[n:])

  def call(self, res, lin):  # flat -> flat
    out = self.fn(jax.tree_util.tree_unflatten(self.res_tree, res), jax.tree_util.tree_unflatten(self.lin_tree, lin))
    return jax.tree_util.tree_leaves(out)


def linear_call(fn, transpose, res, lin):
  """``fn(res, lin)``, a function linear in ``lin``, as one primitive whose transpose is
  ``transpose(res, cts, need) -> lin's cotangents`` (computed only where ``need`` is not
  None). Unlike ``jax.custom_derivatives.linear_call`` it differentiates in ``res`` too
  (forward mode of ``fn``: Hessian-vector products) and batches (``vmap``)."""
  res_leaves, res_tree = jax.tree_util.tree_flatten(res)
  lin_leaves, lin_tree = jax.tree_util.tree_flatten(lin)
  return _bind_linear(fn, transpose, res_tree, lin_tree, res_leaves, lin_leaves)


def _bind_linear(fn, transpose, res_tree, lin_tree, res_leaves, lin_leaves):
  out_tree = []

  def flat(*xs):
    r = jax.tree_util.tree_unflatten(res_tree, xs[:len(res_leaves)])
    out = fn(r, jax.tree_util.tree_unflatten(lin_tree, xs[len(res_leaves):]))
    leaves, tree = jax.tree_util.tree_flatten(out)
    out_tree.append(tree)
    return leaves

  jaxpr = jax.make_jaxpr(flat)(*res_leaves, *lin_leaves)
  if any(isinstance(c, jax.core.Tracer) for c in jaxpr.consts):
    raise AssertionError("fdecode.derivatives.linear_call: fn closes over a traced value; pass it in res")
  params = _LinearCall(fn, transpose, res_tree, lin_tree, jaxpr, out_tree[0])
  out = _linear_p.bind(*res_leaves, *lin_leaves, call=params)
  return jax.tree_util.tree_unflatten(out_tree[0], out)


def _linear_abstract_eval(*avals, call):
  del avals
  return call.jaxpr.out_avals


def _linear_impl(*args, call):
  return jax.extend.core.jaxpr_as_fun(call.jaxpr)(*args)


def _linear_transpose(cts, *args, call):
  res, lin = call.split(args)
  if any(ad.is_undefined_primal(x) for x in res):
    raise AssertionError("fdecode.derivatives.linear_call: transposed in a residual")
  need_leaves = [ad.is_undefined_primal(x) for x in lin]
  if not any(need_leaves):
    return [None] * len(args)
  lin_avals = [x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in lin]
  cts = [ad.instantiate_zeros(ct) for ct in cts]
  need = jax.tree_util.tree_unflatten(call.lin_tree, [True if n else None for n in need_leaves])
  wanted = [i for i, n in enumerate(need_leaves) if n]

  def t_fn(r, c):  # the wanted cotangents, each typed as its linear input (shard_map's psum of a pvary)
    out = jax.tree_util.tree_leaves(call.transpose(r, call.out_tree.unflatten(c), need))
    return [_like(x, lin_avals[i]) for x, i in zip(out, wanted)]

  def t_transpose(r, lin_wanted, need_back):  # the transposed call's transpose: fn, the others zero
    del need_back
    full = [jnp.zeros(a.shape, a.dtype) for a in lin_avals]
    for i, x in zip(wanted, lin_wanted):
      full[i] = x
    return call.out_tree.flatten_up_to(call.fn(r, jax.tree_util.tree_unflatten(call.lin_tree, full)))

  outs = _bind_linear(t_fn, t_transpose, call.res_tree, jax.tree_util.tree_structure(list(cts)), res, list(cts))
  full = [None] * len(lin)
  for i, x in zip(wanted, outs):
    full[i] = x
  return [None] * len(res) + full


def _like(x, aval):
  """``x`` cast to ``aval``'s dtype, summed over the shard_map axes it varies over that
  ``aval`` does not (the transpose of the implicit ``pvary`` of an invariant input)."""
  varying = lambda a: a.manual_axis_type.varying if hasattr(a, "manual_axis_type") else frozenset()
  extra = tuple(sorted(varying(jax.typeof(x)) - varying(aval)))
  if extra:
    x = lax.psum(x, extra)
  return x.astype(aval.dtype)


def _linear_jvp(primals, tangents, *, call):
  """Linear in ``lin``; in ``res``, the forward mode of ``fn`` (plain JAX)."""
  out = _linear_p.bind(*primals, call=call)
  res, lin = call.split(primals)
  dres, dlin = call.split(tangents)
  parts = []
  if any(not isinstance(t, ad.Zero) for t in dlin):
    parts.append(_linear_p.bind(*res, *[ad.instantiate_zeros(t) for t in dlin], call=call))
  moving = [i for i, t in enumerate(dres) if not isinstance(t, ad.Zero)]
  if moving:
    def along(*xs):
      full = list(res)
      for i, x in zip(moving, xs):
        full[i] = x
      return call.call(full, list(lin))
    parts.append(jax.jvp(along, [res[i] for i in moving], [dres[i] for i in moving])[1])
  if not parts:
    return out, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
  return out, parts[0] if len(parts) == 1 else [a + b for a, b in zip(*parts)]


def _linear_batch(args, dims, *, call):
  """``vmap``: ``fn`` and ``transpose`` vmapped, every linear input batched (so the
  transpose's cotangents come back batched, and JAX sums those of an unbatched input)."""
  n = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  res, lin = call.split(list(args))
  rdims, ldims = call.split(list(dims))
  lin = [jnp.broadcast_to(x, (n,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
         for x, d in zip(lin, ldims)]
  res_tree, lin_tree = call.res_tree, call.lin_tree
  unflat_r = lambda r: jax.tree_util.tree_unflatten(res_tree, r)
  rdims_tree = unflat_r(rdims) if res_tree.num_leaves else None

  def fn(r, l):
    return jax.vmap(call.fn, in_axes=(rdims_tree, 0))(r, l)

  def transpose(r, c, need):
    return jax.vmap(lambda r, c: call.transpose(r, c, need), in_axes=(rdims_tree, 0))(r, c)

  out = _bind_linear(fn, transpose, res_tree, lin_tree, res, lin)
  out = jax.tree_util.tree_leaves(out)
  return out, [0] * len(out)


_linear_p = jax.extend.core.Primitive("fdecode_linear")
_linear_p.multiple_results = True
_linear_p.def_abstract_eval(_linear_abstract_eval)
_linear_p.def_impl(_linear_impl)
ad.primitive_jvps[_linear_p] = _linear_jvp
ad.primitive_transposes[_linear_p] = _linear_transpose
if hasattr(batching, "primitive_batchers"):
  batching.primitive_batchers[_linear_p] = _linear_batch
mlir.register_lowering(_linear_p, mlir.lower_fun(_linear_impl, multiple_results=True))
