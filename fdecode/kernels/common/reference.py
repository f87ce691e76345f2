"""The float32 reference (`fdecode.reference.reference_decode`, the oracle) as a
`fdecode.kernels.backend.Backend`: ``impl="reference"``, every platform. It reads the
call's dense form (`fdecode.kernels.common.dense.dense_call`) and has no plan."""

from __future__ import annotations

import dataclasses

from fdecode.kernels.backend import Decode, States, TakesEveryCall, Target
from fdecode.kernels.common.dense import dense_call
from fdecode.reference import reference_decode


@dataclasses.dataclass(frozen=True)
class ReferenceBackend(TakesEveryCall):
  name: str = "reference"

  def plan(self, call: Decode, target: Target) -> None:
    del call, target  # nothing to plan (`fdecode.plan` lists none)

  def run(self, plan, call: Decode, target: Target) -> States:
    del plan, target
    o, x = call.options, call.operands
    d = dense_call(*x[:6], mods=o.mods, v_head_dim=o.v_head_dim, sparse=o.sparse)
    out, lse = reference_decode(
        d.q, d.k, d.v, d.ends, softmax_scale=o.softmax_scale, causal=o.mods.causal, mask=d.mask, bias=d.bias,
        alibi_slopes=d.alibi, window=o.mods.window, logits_soft_cap=o.mods.soft_cap, sinks=d.sinks)
    return States(out.astype(x.q.dtype), lse, merged=True)


BACKEND = ReferenceBackend()
