"""The Triton kernels as a `fdecode.kernels.backend.Backend`: compiled for the GPU lowered
for, or in Pallas' interpreter (``Target.interpret``: the same plan, on any host). It
refuses where this JAX has no Pallas Triton backend, head dims its dot cannot tile
(compiled). Its batch-invariant plan: `fdecode.kernels.triton.plan.make_plan`'s
``split_size``. A ragged step asks it for the step whole
(``ragged_step``: `fdecode.kernels.triton.triton_step`) and for its cache write (``write``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from fdecode.kernels.backend import Decode, States, Target, compute_dtype
from fdecode.kernels.triton.pallas_triton import MISSING, available
from fdecode.kernels.triton.plan import TritonPlan
from fdecode.kernels.triton.ragged_step import triton_step
from fdecode.kernels.triton.split import Arrays, run
from fdecode.kernels.triton.write import write_view
from fdecode.kernels.triton.tiles import triton_unsupported
from fdecode.kernels.triton.view import plan_view, read_view



@dataclasses.dataclass(frozen=True)
class TritonBackend:
  name: str = "triton"

  def available(self) -> bool:
    return available()

  def refuses(self, call: Decode, target: Target) -> str | None:
    if not available():
      return MISSING
    if not target.interpret:
      return unsupported(call.operands.view, call.options.v_head_dim)
    return None

  def plan(self, call: Decode, target: Target) -> TritonPlan:
    return _plan_view(call, target)[0]

  def run(self, plan: TritonPlan, call: Decode, target: Target) -> States:
    del target  # the plan holds what the kernels need of it
    o, x = call.options, call.operands
    rv = read_view(plan, x.view, x.source)
    m = x.mod_arrays
    arrays = Arrays(**rv.kernel_arrays(), mask=m["mask"], bias=m["bias"], alibi=m["alibi"], sinks=x.sinks,
                    indices=x.lists.get("index_runs"),  # sorted, repeats kept: the kernel drops the repeats itself
                    source=x.source if plan.q_source else None)
    out, lse = run(plan, x.q, x.ends, rv.k, rv.v, arrays, softmax_scale=o.softmax_scale)
    return States(out, lse, merged=True)

  # What a ragged step asks of the backend whose kernels run it whole (`fdecode.route.lower_step`,
  # `lower_write`): the step in one split launch and one combine, and the fused cache write.
  def ragged_step(self, decode: Decode, prefill: Decode, step, *, block: int, capacity: int, interpret: bool):
    return triton_step(decode, prefill, step, block=block, capacity=capacity, interpret=interpret)

  def write(self, view, new_k, new_v, seq, pos, step, interpret: bool):
    return write_view(view, new_k, new_v, seq, pos, step, interpret)


def _plan_view(call: Decode, target: Target):
  o, x = call.options, call.operands
  indices = x.lists.get("indices")
  return plan_view(x.q, x.view, compute=call.compute_dtype, mods=o.mods, v_head_dim=o.v_head_dim, cfg=o.cfg,
                   interpret=bool(target.interpret),
                   has_mask_or_bias=x.mod_arrays["mask"] is not None or x.mod_arrays["bias"] is not None,
                   has_sinks=x.sinks is not None, index_slots=None if o.sparse is None else indices.shape[-1],
                   sparse_fold=1 if o.sparse is None else o.sparse.fold,
                   source=x.source if o.sparse is None else None)


def unsupported(view, v_head_dim=None) -> str | None:
  """Why the compiled Triton kernel does not take these shapes (`triton_unsupported`), or
  None. Scales canonical or as given (a scalar: one tile)."""
  tiles = lambda sc: 1 if sc is None or np.ndim(sc) == 0 else np.shape(sc)[-1]
  rope, v = view.k_rope, view.v
  return triton_unsupported(view.k.shape[-1], v_head_dim if v is None else v.shape[-1], tiles(view.k_scale),
                            tiles(view.v_scale), v_from_k=v is None, rope_dim=0 if rope is None else rope.shape[-1])


def supports(view, v_head_dim=None) -> bool:
  """Whether the compiled Triton kernel takes these shapes (`unsupported`)."""
  return unsupported(view, v_head_dim) is None


BACKEND = TritonBackend()
__all__ = ["BACKEND", "TritonBackend", "compute_dtype", "plan_view", "supports", "unsupported"]
