"""The Triton kernels as a `fdecode.kernels.backend.Backend`: compiled for the GPU lowered
for, or in Pallas' interpreter (``Target.interpret``: the same plan, on any host). It
refuses where this JAX has no Pallas Triton backend, head dims its dot cannot tile
(compiled), and the batch-invariant mode. `plan_view` is the plan of a canonical call and
the view its kernels read (also a ragged step's parts', `fdecode.kernels.triton.triton_step`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from fdecode.cache.layout import QUANT_ARRAYS
from fdecode.kernels.backend import Decode, States, Target, compute_dtype
from fdecode.kernels.triton.pallas_triton import MISSING, available
from fdecode.kernels.triton.plan import TritonPlan, make_plan
from fdecode.kernels.triton.split import run
from fdecode.kernels.triton.tiles import triton_unsupported

NO_INVARIANT_PLAN = "it has no batch-invariant plan (the XLA path runs the mode: fdecode.kernels.xla.invariant)"


@dataclasses.dataclass(frozen=True)
class TritonBackend:
  name: str = "triton"

  def available(self) -> bool:
    return available()

  def refuses(self, call: Decode, target: Target) -> str | None:
    if not available():
      return MISSING
    if call.options.cfg.batch_invariant:
      return NO_INVARIANT_PLAN
    if not target.interpret:
      return unsupported(call.operands.view, call.options.v_head_dim)
    return None

  def plan(self, call: Decode, target: Target) -> TritonPlan:
    return _plan_view(call, target)[0]

  def run(self, plan: TritonPlan, call: Decode, target: Target) -> States:
    del target  # the plan holds what the kernels need of it
    o, x = call.options, call.operands
    rv = _read_view(plan, x.view, x.source)
    runs = x.lists.get("index_runs")  # the kernel's lists: sorted, repeats kept (it drops the repeats itself)
    lists = {} if runs is None else dict(indices=runs, index_bounds=x.lists["index_bounds"])
    m = x.mod_arrays
    out, lse = run(plan, x.q, x.ends, rv.k, rv.v, softmax_scale=o.softmax_scale, mask=m["mask"], bias=m["bias"],
                   alibi=m["alibi"], sinks=x.sinks, sparse=o.sparse, source=x.source if plan.q_source else None,
                   **rv.kernel_arrays(), **lists)
    return States(out, lse, merged=True)


def _plan_view(call: Decode, target: Target):
  o, x = call.options, call.operands
  indices = x.lists.get("indices")
  return plan_view(x.q, x.view, compute=call.compute_dtype, mods=o.mods, v_head_dim=o.v_head_dim, cfg=o.cfg,
                   interpret=bool(target.interpret),
                   has_mask_or_bias=x.mod_arrays["mask"] is not None or x.mod_arrays["bias"] is not None,
                   has_sinks=x.sinks is not None, index_slots=None if o.sparse is None else indices.shape[-1],
                   sparse_fold=1 if o.sparse is None else o.sparse.fold,
                   source=x.source if o.sparse is None else None)


def plan_view(q, view, *, compute, mods, v_head_dim, cfg, interpret, has_mask_or_bias=False,
              has_sinks=False, index_slots=None, sparse_fold=1, source=None, balance=None, step=None):
  """The Triton kernels' plan of a canonical call (q ``[B, T, Hq, Dq]``, its cache ``view``)
  and the view they read (its read layout; a `RowSource`'s whole
  contiguous caches where the plan reads cache rows). ``balance`` None: ``cfg.balance``;
  ``step``: a ragged step's part (`fdecode.kernels.triton.make_plan`)."""
  rv = view.read(view.read_layout)
  p = make_plan(q.shape, rv.k, rv.v, compute_dtype=compute, out_dtype=q.dtype, kv_layout=rv.layout,
                block_tables=rv.block_tables, k_rope=rv.k_rope,
                **{n: getattr(rv, n) for n in QUANT_ARRAYS}, v_head_dim=v_head_dim, mods=mods,
                has_mask_or_bias=has_mask_or_bias, has_sinks=has_sinks, index_slots=index_slots,
                sparse_fold=sparse_fold, num_splits=cfg.num_splits, block_k=cfg.block_k,
                balance=cfg.balance if balance is None else balance, interpret=interpret, source=source,
                step=step)
  return p, _read_view(p, view, source)


def _read_view(p: TritonPlan, view, source):
  rv = view.read(view.read_layout)
  if p.cache_source:  # the whole contiguous caches the call's are gathers of, read at the source's rows
    rv = source.caches.read(rv.layout)
  return rv


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
__all__ = ["BACKEND", "NO_INVARIANT_PLAN", "TritonBackend", "compute_dtype", "plan_view", "supports", "unsupported"]
