"""The log-sum-exp (LSE) math of FlashDecode, written once.

A *state* is a pair (o, lse): o is a softmax-normalized partial output over some subset
of the keys and lse = log(sum(exp(scores))) over that subset (natural log). An empty
subset is (0, -inf). Merging states over disjoint subsets gives exactly the state of
their union. The kernels' split combine, the cross-device collective and the tests all
call this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

# Finite "minus infinity" for masked scores inside kernels, so that max / exp never see
# inf - inf. A visible score at or below it counts as no key (scores are never that small
# short of corruption); see `finalize_state`.
MASK_VALUE = -1e30
# The 0 / 1 weights and flags of a select, float32 even under jax_enable_x64 (a Python
# float there would be float64, a dtype the TPU kernels have no vectors of).
F32_ZERO, F32_ONE = np.float32(0.0), np.float32(1.0)


def merge_states(o: Array, lse: Array, axis: int = 0) -> tuple[Array, Array]:
  """Merges partial attention states stacked along ``axis``.

  Args:
    o: ``[..., n, ..., D]`` partial outputs, each normalized over its own part. The
      trailing axis is the value head dim; ``o.shape[:-1] == lse.shape``.
    lse: ``[..., n, ...]`` float log-sum-exp of each part (natural log); ``-inf``
      marks an empty part, which contributes nothing.
    axis: the axis of ``lse`` (and of ``o``) holding the ``n`` parts.

  Returns:
    ``(o, lse)`` with ``axis`` removed: o in ``o.dtype``, lse in float32. If every part
    is empty the result is o = 0, lse = -inf (never NaN). A NaN in a non-empty part's
    lse or o propagates (o NaN, and lse NaN for a NaN lse). Parts at lse = +inf take all
    the weight (the limit), and the merged lse is +inf.
  """
  if o.shape[:-1] != lse.shape:
    raise ValueError(f"merge_states: o.shape[:-1] must equal lse.shape, got {o.shape=} {lse.shape=}")
  if not -lse.ndim <= axis < lse.ndim:
    raise ValueError(f"merge_states: axis={axis} out of range for {lse.shape=}")
  axis = axis % lse.ndim
  reduce = lambda fn, x: fn(x, axis=axis)
  back = lambda x: jnp.expand_dims(x, axis)
  return merge_by(o, lse, lambda x: reduce(jnp.max, x), lambda o, w: (reduce(jnp.sum, o), reduce(jnp.sum, w)),
                lambda x: reduce(jnp.any, x), back)


def merge_segments(o: jnp.ndarray, lse: jnp.ndarray, segments: jnp.ndarray, num_segments: int):
  """`merge_states` of the parts that share a segment id: parts ``[n, ...]`` ->
  ``[num_segments, ...]``, the same semantics (empty segment: o = 0, lse = -inf; NaN
  propagates; +inf takes all the weight). ``segments``: int ``[n]``; a part whose id is
  outside ``[0, num_segments)`` is dropped (whatever it holds). The Triton combine
  kernel merges the balanced schedule's work items the same way, in one launch
  (`fdecode.kernels.triton.combine`, ``segmented``)."""
  if o.shape[:-1] != lse.shape or segments.shape != lse.shape[:1]:
    raise ValueError(f"merge_segments: need o [n, ..., D], lse [n, ...], segments [n]; got "
                     f"{o.shape=} {lse.shape=} {segments.shape=}")
  live = (segments >= 0) & (segments < num_segments)
  seg = jnp.where(live, segments, num_segments)  # out of range: dropped by every reduction
  lse = jnp.where(live.reshape((-1,) + (1,) * (lse.ndim - 1)), lse.astype(jnp.float32), -jnp.inf)
  kw = dict(segment_ids=seg, num_segments=num_segments)
  def sums(o, w):  # one scatter for both (each scatter's zeroed buffer is a copy on GPU)
    both = jax.ops.segment_sum(jnp.concatenate([o, w[..., None]], axis=-1), **kw)
    return both[..., :-1], both[..., -1]
  return merge_by(o, lse, lambda x: jax.ops.segment_max(x, **kw), sums,
                lambda x: jax.ops.segment_max(x.astype(jnp.int32), **kw) > 0,
                lambda x: x[jnp.minimum(seg, num_segments - 1)])


def merge_by(o, lse, reduce_max, reduce_sums, reduce_any, back):
  """The merge, over whatever grouping the reductions (parts -> merged; ``reduce_sums``:
  of the weighted outputs and of the weights) and ``back`` (merged -> parts) define."""
  lse = lse.astype(jnp.float32)
  lse_max = reduce_max(lse)
  # A part at lse = +inf (a sink of +inf) takes all the weight: its limit.
  top_inf = lse_max == jnp.inf
  # All parts empty: use 0 as the reference so that exp(-inf - 0) = 0 (no NaN).
  ref = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
  w = jnp.where(back(top_inf), jnp.where(lse == jnp.inf, F32_ONE, F32_ZERO), jnp.exp(lse - back(ref)))  # per part
  # An empty part (lse -inf) is selected away, never multiplied by its 0 weight (its o
  # may be anything). A non-empty part's o always enters, so a NaN it holds propagates
  # even where its weight underflows to 0, as the slot's 0 * NaN would in one softmax.
  nonempty = (lse != -jnp.inf)[..., None]
  weighted = jnp.where(nonempty, w[..., None] * o.astype(jnp.float32), 0.0)
  acc, total = reduce_sums(weighted, w)
  out = acc / jnp.where(total > 0, total, 1.0)[..., None]
  out_lse = jnp.where(total > 0, ref + jnp.log(total), -jnp.inf)
  out_lse = jnp.where(top_inf, jnp.inf, out_lse)
  # A NaN lse is not "empty": it propagates to the merged o and lse.
  nan = reduce_any(jnp.isnan(lse))
  out = jnp.where(nan[..., None], jnp.nan, out)
  out_lse = jnp.where(nan, jnp.nan, out_lse)
  return out.astype(o.dtype), out_lse


def fold_states(o: Array, lse: Array, axis: int = 0) -> tuple[Array, Array]:
  """`merge_states` of the parts along ``axis``, folded left to right, a pair at a time (the
  batch-invariant mode's merge): a part with lse -inf anywhere in the order changes no bit
  of the result (its weight is selected away, the other's is exactly 1), so the count of
  empty parts never enters it. Arguments and results as `merge_states`'. A loop of n steps
  (compiled for v5e after the Mosaic kernel: 12 launches at S = 32k; unrolled, XLA:TPU did
  not fuse the merges: 429)."""
  o, lse = jnp.moveaxis(o, axis, 0), jnp.moveaxis(lse, axis % lse.ndim, 0)

  def step(state, part):
    return merge_states(jnp.stack([state[0], part[0]]), jnp.stack([state[1], part[1]])), None

  empty = (jnp.zeros(o.shape[1:], o.dtype), jnp.full(lse.shape[1:], -jnp.inf, jnp.float32))
  state, _ = lax.scan(step, empty, (o, lse.astype(jnp.float32)))
  return state


def finalize_state(acc: jnp.ndarray, m: jnp.ndarray, l: jnp.ndarray):
  """Online-softmax accumulators -> state.

  Args:
    acc: ``[..., D]`` float32 unnormalized sum of exp(s - m) * v.
    m: ``[...]`` float32 running max of the scores (finite, possibly a mask value).
    l: ``[...]`` float32 sum of exp(s - m) over the visible keys: 0 exactly when no key
      was visible (the largest visible score contributes exp(0) = 1), NaN when a visible
      score was NaN (or a value row `fdecode.kernels.common.block.guard_values` poisoned).

  Returns:
    ``(o, lse)``: o = acc / l, lse = m + log(l); a part with no visible key (l == 0)
    gives o = 0, lse = -inf. A NaN l is not "empty": it gives o = NaN, lse = NaN, so a
    NaN the query sees propagates through every merge. A row whose ``acc`` holds an inf
    or NaN (a visible corrupt value that reached the PV sum unguarded, e.g. a single
    token's row) is treated the same: every column of its o and its lse are NaN, as
    when the value had poisoned its score; so the rule "a corrupt value a row sees makes
    its whole row and lse NaN" holds on every path (the float32 reference poisons the
    score itself). See `corrupt_rows` for a state split into column pieces.
  """
  return _finalize(acc, m, jnp.where(corrupt_rows(acc), jnp.nan, l))


def corrupt_rows(*acc_pieces):
  """bool ``[...]``: rows of the float32 accumulators ``[..., w]`` (the column pieces of
  one state, together) holding an inf or NaN. Written as a float max of
  ``abs(x) <= max`` (False for both), which every kernel lowers (Triton, Mosaic)."""
  bad = None
  for a in acc_pieces:
    b = jnp.max(jnp.where(jnp.abs(a) <= jnp.finfo(jnp.float32).max, F32_ZERO, F32_ONE), axis=-1)
    bad = b if bad is None else jnp.maximum(bad, b)
  return bad > 0


def _finalize(acc, m, l):
  empty = l == 0
  o = acc / jnp.where(empty, 1.0, l)[..., None]
  lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
  return o, lse


def combine_across(o: Array, lse: Array, axis_name: str | tuple[str, ...]) -> tuple[Array, Array]:
  """Merges the states held by the devices along mesh axis ``axis_name``.

  Call inside ``jax.shard_map`` (or any context where ``axis_name`` is bound), where
  each device holds the state of a disjoint part of the keys, e.g. one chunk of a cache
  whose token axis is split over ``axis_name``. Each device's (o, lse) is all-gathered
  along the axis and the stack is merged by `merge_states`: the LSE math is not
  repeated here. Only the states cross devices (``n * (o.size + lse.size)`` values
  received per device), never keys or values.

  The merge runs in the same order (device 0, 1, ...) on every device, so the result
  is bitwise identical on all of them and from run to run (deterministic), and it is
  invariant along ``axis_name`` (an ``out_specs`` may leave that axis out).

  Args:
    o: ``[..., Dv]`` this device's partial output, normalized over its keys.
    lse: ``[...]`` (``o.shape[:-1]``) float natural-log LSE of its keys; ``-inf`` for a
      device whose part is empty.
    axis_name: a mesh axis name, or a tuple of names (their devices in mesh order).

  Returns:
    ``(o, lse)`` merged over every device of the axis: o ``[..., Dv]`` in ``o.dtype``,
    lse float32 ``[...]``; o = 0, lse = -inf where every part is empty.
  """
  if o.shape[:-1] != lse.shape:
    raise ValueError(f"combine_across: o.shape[:-1] must equal lse.shape, got {o.shape=} {lse.shape=}")
  o_all = _gather_invariant(o, axis_name)  # [n, ..., Dv]
  lse_all = _gather_invariant(lse.astype(jnp.float32), axis_name)  # [n, ...]
  return merge_states(o_all, lse_all, axis=0)


def _gather_invariant(x: Array, axis_name: str | tuple[str, ...]) -> Array:
  """``x`` of every device of ``axis_name``, stacked ``[n, ...]`` in mesh order and typed
  invariant along the axis (identical on every device, which it is), so that shard_map's
  default ``check_vma=True`` takes an ``out_specs`` without the axis: ``jax.lax.all_gather``
  types it varying. ``jax.lax.all_gather_invariant`` where this JAX exports it (0.11).
  0.10.2 has it only privately, and no public formulation costs the same: a ``pmax`` of
  each device's bits in its own slot of zeros is exact but took 6 -> 11 launches on an H100
  sharded decode (the compile tier). Waits for a jax>=0.11 floor (the compile tier pins
  0.10.2)."""
  all_gather_invariant = getattr(jax.lax, "all_gather_invariant", None)
  if all_gather_invariant is None:
    from jax._src.lax.parallel import all_gather_invariant  # pylint: disable=g-import-not-at-top
  return all_gather_invariant(x, axis_name)


def add_sink(o: jnp.ndarray, lse: jnp.ndarray, sink: jnp.ndarray):
  """`merge_states` of a state with a sink's (0, sink), elementwise: ``o`` ``[..., Dv]``,
  ``lse`` and ``sink`` float32 ``[..., 1]`` (broadcasting) -> ``(o', lse' [..., 1])``, the
  same arithmetic as merging the two stacked parts (the kernels call it on their tiles)."""
  m = jnp.maximum(lse, sink)
  top_inf = m == jnp.inf
  ref = jnp.where(jnp.isfinite(m), m, 0.0)
  weight = lambda x: jnp.where(top_inf, jnp.where(x == jnp.inf, F32_ONE, F32_ZERO), jnp.exp(x - ref))
  w_state, w_sink = weight(lse), weight(sink)
  acc = jnp.where(lse != -jnp.inf, w_state * o.astype(jnp.float32), 0.0)
  total = w_state + w_sink
  out = acc / jnp.where(total > 0, total, 1.0)
  out_lse = jnp.where(total > 0, ref + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
  out_lse = jnp.where(top_inf, jnp.inf, out_lse)
  nan = jnp.isnan(lse) | jnp.isnan(sink)
  return jnp.where(nan, jnp.nan, out).astype(o.dtype), jnp.where(nan, jnp.nan, out_lse)


def apply_sinks(o: Array, lse: Array, sinks: Array) -> tuple[Array, Array]:
  """Adds attention sinks to a *merged* state: one extra logit per head with no value.

  A sink is the state (0, sink) of a virtual key whose value is 0, so this is
  `merge_states` of the two (`add_sink`): ``o' = o * exp(lse - lse')`` with
  ``lse' = logaddexp(lse, sink)``. Apply it exactly once, after every split and device
  has been merged (gpt-oss; FlashAttention 3 / FlashInfer ``sinks``): states that already
  include a sink must not be merged with each other (the sink would count twice). A row
  that saw no key gives o = 0 and lse = sink.

  Args:
    o: ``[..., H, Dv]`` merged output; lse: ``[..., H]`` its float32 LSE.
    sinks: float ``[H]`` sink logits (natural-log scale, like the scores).

  Returns:
    ``(o, lse)``: o in ``o.dtype``, lse float32 including the sink.
  """
  sink = jnp.broadcast_to(sinks.astype(jnp.float32), lse.shape)
  out, out_lse = add_sink(o, lse.astype(jnp.float32)[..., None], sink[..., None])
  return out, out_lse[..., 0]
