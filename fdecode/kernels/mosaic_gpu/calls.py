"""The Hopper kernels as `fdecode.kernels.backend.Backend` s.

`MLA_BACKEND` (``"mosaic_gpu_mla"``): the default GPU route's first, the MLA kernel where
`takes_mla` (sm_90 lowered for, a call the kernel takes, the 8-bit path left to the
opt-in). `BACKEND` (``"mosaic_gpu"``): ``impl="mosaic_gpu"``, the opt-in: the MLA kernel
(``v`` None) or the rows kernel (GQA), compiled for an sm_90 GPU or under the Mosaic GPU
interpreter (``Target.interpret``: an ``InterpretGPUParams``); what it refuses is the
call's ValueError (no fallback). Both merge their splits with the Triton combine kernel,
or with XLA on a JAX without Pallas' Triton backend. `refusal`: what of a call neither
kernel takes, whatever its shapes.

A call arrives canonical (`fdecode.kernels.backend.Decode`): q ``[B, T, Hq, Dk]``, its
cache view, ``ends`` int32 ``[B]``.
"""

from __future__ import annotations

import dataclasses

from fdecode.kernels.backend import NO_INVARIANT_PLAN, Decode, States, Target
from fdecode.kernels.common import chips
from fdecode.cache.quant import per_token_scale
from fdecode.kernels.mosaic_gpu.gqa.api import rows_run
from fdecode.kernels.mosaic_gpu.gqa.plan import RowsPlan, rows_plan, rows_unsupported
from fdecode.kernels.mosaic_gpu.mla.api import mla_run
from fdecode.kernels.mosaic_gpu.mla.plan import MlaPlan, mla_plan, unsupported


def _extras(call: Decode) -> bool:
  """Whether the call has sinks, index lists, a mask, bias or ALiBi."""
  m = call.operands.mod_arrays
  return (call.operands.sinks is not None or call.options.sparse is not None
          or any(m[n] is not None for n in ("mask", "bias", "alibi")))


def takes_mla(call: Decode) -> bool:
  """Whether the default dispatch sends the call to the Hopper MLA kernel: an sm_90 GPU
  lowered for, and a call it takes (bf16 MLA latents 576 / 512, one contiguous kv head,
  T = 1, G a multiple of 16, no scales, modifiers, sinks or index lists; the kernel's
  8-bit path is opt-in, ``default_dispatch``, until a GPU measures it). The kernel is
  faster than the Triton kernel there (`fdecode.kernels.mosaic_gpu` says by how much). A
  balanced schedule stays on Triton."""
  o, x = call.options, call.operands
  if chips.lowering_gpu().capability != (9, 0) or o.cfg.balance:
    return False
  view = x.view.read(x.view.read_layout)
  return unsupported(
      q_shape=x.q.shape, q_dtype=x.q.dtype, k_shape=view.k.shape, k_dtype=view.k.dtype, v_is_none=view.v is None,
      v_head_dim=o.v_head_dim, k_scale_shape=None if view.k_scale is None else view.k_scale.shape,
      paged=view.paged, modifiers=_extras(call) or view.k_rope is not None or not o.mods.plain,
      default_dispatch=True) is None


def _mla_plan(call: Decode) -> MlaPlan:
  o, x = call.options, call.operands
  b, t, g, _ = x.q.shape
  return mla_plan(batch=b, num_tokens=t, group=g, seq_len=x.view.capacity, softmax_scale=o.softmax_scale,
                  cache_dtype=x.view.k.dtype, num_splits=o.cfg.num_splits)


def _rows_plan(call: Decode) -> RowsPlan:
  o, x = call.options, call.operands
  b, t, hq, d = x.q.shape
  view = x.view
  return rows_plan(batch=b, kv_heads=view.kv_heads, num_tokens=t, group=hq // view.kv_heads, head_dim=d,
                   seq_len=view.capacity, softmax_scale=o.softmax_scale, cache_dtype=view.k.dtype,
                   num_splits=o.cfg.num_splits, page_size=view.page_size)


def _run(plan, call: Decode, interpret) -> States:
  """A Hopper plan run to the output, its split states merged by the Triton combine kernel
  (`fdecode.kernels.mosaic_gpu.mla_run` / ``rows_run``): two kernels (the merge in XLA on a
  JAX without Pallas' Triton backend)."""
  x = call.operands
  rv = x.view.read(x.view.read_layout)  # one kv head (MLA, MQA) stored token-major is read head-major: the same bytes
  if isinstance(plan, MlaPlan):  # k [B, 1, S, 576]; an 8-bit cache's per-token scales canonical rank 4
    k_scale = None if rv.k_scale is None else per_token_scale(rv.k_scale, rv.k.shape, "k_scale", "flash_decode")
    out, lse = mla_run(plan, x.q, x.ends, rv.k, k_scale, interpret=interpret)
  else:  # a head-major cache: contiguous, or a pool read in place through the block table
    scales = [None if s is None else per_token_scale(s, c.shape, n, "flash_decode", broadcast=False)
              for n, s, c in (("k_scale", rv.k_scale, rv.k), ("v_scale", rv.v_scale, rv.v))]
    out, lse = rows_run(plan, x.q, x.ends, rv.k, rv.v, *scales, block_tables=rv.block_tables, interpret=interpret)
  return States(out, lse, merged=True)


class _Hopper:
  """What both Hopper backends share: Mosaic GPU is in every JAX fdecode supports, and their
  splits are merged by the Triton combine kernel, or by XLA on a JAX without Pallas' Triton
  backend (`fdecode.kernels.mosaic_gpu.ops.combine`)."""

  def available(self) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class MlaBackend(_Hopper):
  """The default GPU route's Hopper MLA kernel."""
  name: str = "mosaic_gpu_mla"

  def refuses(self, call: Decode, target: Target) -> str | None:
    del target  # the GPU lowered for: `chips.lowering_gpu`
    if call.options.cfg.batch_invariant:
      return NO_INVARIANT_PLAN
    if not takes_mla(call):
      return ("it takes bf16 MLA latents (576 / 512, one contiguous kv head, T = 1, G a multiple of 16, no "
              "modifiers) compiled for an sm_90 GPU")
    return None

  def plan(self, call: Decode, target: Target) -> MlaPlan:
    del target
    return _mla_plan(call)

  def run(self, plan: MlaPlan, call: Decode, target: Target) -> States:
    del target
    return _run(plan, call, None)


@dataclasses.dataclass(frozen=True)
class HopperBackend(_Hopper):
  """``impl="mosaic_gpu"``: the MLA kernel (``v`` None) or the rows kernel (GQA)."""
  name: str = "mosaic_gpu"

  def refuses(self, call: Decode, target: Target) -> str | None:
    o, x = call.options, call.operands
    if not target.interpret:
      platform = chips.lowering_platform()
      gpu = chips.lowering_gpu() if platform == "gpu" else None
      if gpu is None or gpu.capability != (9, 0):
        where = platform if gpu is None else f"{gpu.name} (sm_{gpu.capability[0]}{gpu.capability[1]})"
        return (f"it compiles the Hopper kernels for an sm_90 GPU, but this trace lowers for {where}; pass "
                "interpret=fdecode.kernels.mosaic_gpu.InterpretGPUParams() to run them under the Mosaic GPU "
                "interpreter (CPU)")
    rv = x.view.read(x.view.read_layout)
    mla = rv.v is None
    reason = refusal(rv, x.q.shape[1], mods=o.mods, modifiers=_extras(call))
    if reason is None and mla:
      reason = unsupported(
          q_shape=x.q.shape, q_dtype=x.q.dtype, k_shape=rv.k.shape, k_dtype=rv.k.dtype, v_is_none=True,
          v_head_dim=o.v_head_dim, k_scale_shape=None if rv.k_scale is None else rv.k_scale.shape, paged=rv.paged)
    elif reason is None:
      reason = rows_unsupported(
          q_shape=x.q.shape, q_dtype=x.q.dtype, k_shape=rv.k.shape, k_dtype=rv.k.dtype, v_shape=rv.v.shape,
          v_dtype=rv.v.dtype, scales=rv.k_scale is not None or rv.v_scale is not None, paged=rv.paged)
    return reason and f"the Hopper {'MLA' if mla else 'rows'} kernel cannot take this call: {reason}"

  def plan(self, call: Decode, target: Target):
    del target
    return _mla_plan(call) if call.operands.view.v is None else _rows_plan(call)

  def run(self, plan, call: Decode, target: Target) -> States:
    return _run(plan, call, target.interpret or None)


MLA_BACKEND = MlaBackend()
BACKEND = HopperBackend()


def refusal(view, num_tokens, *, mods, modifiers) -> str | None:
  """What of a call neither Hopper kernel takes, whatever its shapes, as a sentence, or
  None. ``view``: the cache as read; ``num_tokens``: T; ``mods``: the score modifiers;
  ``modifiers``: whether the call has sinks, index lists, a mask, bias or ALiBi."""
  if view.layout != "HND":
    return ("token-major caches (kv_layout='NHD') with more than one kv head are not read; "
            "pass head-major caches (kv_layout='HND')")
  if modifiers or not mods.plain:
    return "score modifiers (mask, bias, alibi, window, soft cap, sinks, indices) are not supported"
  if num_tokens > 1 and not mods.causal:
    return f"causal=False with T={num_tokens} new tokens is not supported (the kernels' new tokens are causal)"
  if view.k_rope is not None:
    return "k_rope (key-only columns stored apart) is not supported: store them as k's last columns"
  if view.k_offset is not None or view.v_offset is not None:
    return "k_offset / v_offset (asymmetric 8-bit) are not supported: the kernels take per-token scales only"
  return None
