"""The XLA path as a `fdecode.kernels.backend.Backend`: it takes every call, on every
platform. Its plan is `fdecode.kernels.xla.plan.XlaPlan`; token-major caches are read in
place, chunk by chunk (`xla_partials`); index lists read the K selected tokens
(`sparse_partials`); the batch-invariant mode runs `invariant_partials` (splits of a
fixed size at absolute positions, merged in one order)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fdecode.kernels.backend import Decode, States, TakesEveryCall, Target
from fdecode.kernels.common.modifiers import window_tokens
from fdecode.kernels.xla.dense import xla_partials
from fdecode.kernels.xla.invariant import invariant_partials, split_tokens
from fdecode.kernels.xla.plan import XlaPlan, make_plan
from fdecode.kernels.xla.sparse import sparse_partials


@dataclasses.dataclass(frozen=True)
class XlaBackend(TakesEveryCall):
  name: str = "xla"

  def plan(self, call: Decode, target: Target) -> XlaPlan:
    o, (q, view) = call.options, call.operands[:2]
    b, t = q.shape[:2]
    hkv = view.kv_heads
    if o.cfg.batch_invariant:
      split, tokens = split_tokens(o.cfg.split_size, view.page_size), view.capacity
      return XlaPlan(num_splits=max(-(-tokens // split), 1), kv_layout=view.read_layout, tokens=tokens, loop=True,
                     split_size=split)
    platform = target.platform or jax.default_backend()
    if o.sparse is not None:  # the K selected tokens, in chunks
      return make_plan(batch=b, kv_heads=hkv, tokens=call.operands.lists["indices"].shape[-1], platform=platform,
                       sparse=True, num_splits=o.cfg.num_splits)
    return make_plan(
        batch=b, kv_heads=hkv, tokens=window_tokens(view.capacity, t, o.mods, view.page_size), platform=platform,
        paged=view.paged, quantized=view.k_scale is not None or view.v_scale is not None,
        kv_layout=view.read_layout, num_splits=o.cfg.num_splits, rows=t * (q.shape[2] // hkv),
        token_bytes=b * hkv * view.k.shape[-1] * jnp.dtype(view.k.dtype).itemsize)  # K of one position, all sequences

  def run(self, plan: XlaPlan, call: Decode, target: Target) -> States:
    del target  # the plan holds the platform's choices
    o, x = call.options, call.operands
    q_rows, t = call.q_rows(), x.q.shape[1]
    common = dict(num_tokens=t, softmax_scale=o.softmax_scale, mods=o.mods, v_head_dim=o.v_head_dim)
    if o.cfg.batch_invariant:
      rv = x.view.read(x.view.read_layout)
      return _split(invariant_partials(q_rows, rv, x.ends, x.mod_arrays, split=plan.split_size, **common))
    if o.sparse is not None:
      return _split(sparse_partials(q_rows, x.view.head_major(), x.ends, x.mod_arrays, x.lists, sparse=o.sparse,
                                    num_splits=plan.num_splits, **common))
    return _split(xla_partials(q_rows, x.view.read(plan.kv_layout), x.ends, x.mod_arrays, num_splits=plan.num_splits,
                               loop=plan.loop, **common))


def _split(states) -> States:
  return States(*states, merged=False)


BACKEND = XlaBackend()
