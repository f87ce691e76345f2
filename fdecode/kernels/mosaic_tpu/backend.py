"""The Mosaic (TPU) kernels as a `fdecode.kernels.backend.Backend`: compiled for the TPU
lowered for, or under the TPU interpreter (``Target.interpret``: its parameters). Its plan
(`fdecode.kernels.mosaic_tpu.plan.make_plan`) refuses what the chip's vectors or DMAs
cannot hold (float64, a float16 cache, pages that split a DMA unit); the route hands those
calls to the XLA path. Its batch-invariant plan: ``make_plan``'s ``split_size`` (fixed
splits at absolute positions, each row's sums as products, the splits folded left to
right by `fdecode.combine.fold_states`)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fdecode.combine import fold_states
from fdecode.kernels.backend import NO_INVARIANT_PLAN, Decode, States, Target
from fdecode.kernels.mosaic_tpu.kernel import mosaic_partials
from fdecode.kernels.mosaic_tpu.plan import CallPlan, make_plan
from fdecode.kernels.mosaic_tpu.sparse import mosaic_sparse_partials
from fdecode.kernels.mosaic_tpu.token_major import pool_view



@dataclasses.dataclass(frozen=True)
class MosaicTpuBackend:
  name: str = "mosaic_tpu"

  def available(self) -> bool:
    return True

  def refuses(self, call: Decode, target: Target) -> str | None:
    if call.options.cfg.batch_invariant and call.options.sparse is not None:
      return NO_INVARIANT_PLAN
    p = _plan(call, count_splits=False)
    return p.reason if p.backend == "xla" else None

  def plan(self, call: Decode, target: Target) -> CallPlan:
    del target  # the chip: `fdecode.kernels.common.chips.tpu_lowering`, set by the route's TPU branch
    return _plan(call, count_splits=True)

  def run(self, plan: CallPlan, call: Decode, target: Target) -> States:
    o, x = call.options, call.operands
    q_rows = call.q_rows()
    if plan.upcast_query:  # Mosaic has no float16 vectors: a float16 query over another cache computes in float32
      q_rows = q_rows.astype(jnp.float32)
    kw = dict(num_tokens=x.q.shape[1], softmax_scale=o.softmax_scale, interpret=target.interpret,
              num_splits=plan.num_splits, plan=plan.sizes)
    if plan.split_blocks:  # the batch-invariant mode: fixed splits, folded left to right
      kw["split_blocks"] = plan.split_blocks
    view = x.view
    rv = view.head_major() if plan.read is None else view  # token-major caches read in place, or head-major
    if plan.as_pool:  # a contiguous cache as the pool of whole pages
      rv = pool_view(rv)
    statics = dict(mods=o.mods, v_head_dim=o.v_head_dim)
    if plan.sparse:
      read = {} if plan.read is None else dict(head_axis=plan.read.axis)
      states = mosaic_sparse_partials(q_rows, x.ends, rv, x.mod_arrays, x.lists, sparse=o.sparse, **kw, **statics,
                                      **read)
    else:
      states = mosaic_partials(q_rows, x.ends, rv, x.mod_arrays, read=plan.read, **kw, **statics)
    if plan.split_blocks:
      o_, lse_ = fold_states(*states, axis=2)
      states = (o_[:, :, None], lse_[:, :, None])
    return States(*states, merged=False)


def _plan(call: Decode, *, count_splits: bool) -> CallPlan:
  o, x = call.options, call.operands
  return make_plan(call.q_rows_struct(), x.view, extra=_extra(call), num_tokens=x.q.shape[1],
                   num_splits=o.cfg.num_splits, block_k=o.cfg.block_k, count_splits=count_splits,
                   split_size=o.cfg.invariant_split)


def _extra(call: Decode) -> dict:
  """What the plan reads of the modifiers and index lists."""
  o, x = call.options, call.operands
  m = x.mod_arrays
  extra = dict(mods=o.mods, mask=m["mask"], bias=m["bias"], alibi=m["alibi"], v_head_dim=o.v_head_dim)
  if o.sparse is not None:
    extra.update(sparse=o.sparse, indices=x.lists["indices"], index_bounds=x.lists["index_bounds"])
  return extra


BACKEND = MosaicTpuBackend()
__all__ = ["BACKEND", "MosaicTpuBackend"]
