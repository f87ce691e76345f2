"""What `fdecode.flash_decode`'s dispatch (`fdecode.dispatch`) asks of the Hopper kernels,
and the calls it hands them.

`takes_mla`: whether the default dispatch sends a call to the MLA kernel (sm_90 lowered
for, a call the kernel takes, the 8-bit path left to the opt-in); `decode_mla` runs it
there. `refusal`: what of a call neither kernel takes, whatever its shapes. `decode`:
``impl="mosaic_gpu"``, the opt-in: the MLA kernel (``v`` None) or the rows kernel (GQA),
or a ValueError naming why not (no fallback). Each plan made is handed to ``note`` (the
dispatch's plan record, `fdecode.plan`).

A call arrives canonical: q ``[B, T, Hq, Dk]``, ``view`` its cache (`fdecode.cache.layout.CacheView`),
``ends`` int32 ``[B]``.
"""

from __future__ import annotations

from fdecode.kernels.common import chips
from fdecode.cache.quant import per_token_scale
from fdecode.kernels.mosaic_gpu.gqa.api import rows_run
from fdecode.kernels.mosaic_gpu.gqa.plan import rows_plan, rows_unsupported
from fdecode.kernels.mosaic_gpu.mla.api import mla_run
from fdecode.kernels.mosaic_gpu.mla.plan import mla_plan, unsupported


def takes_mla(q, view, mods, sinks, sparse, v_head_dim, mask, bias, alibi, cfg) -> bool:
  """Whether the default dispatch sends the call to the Hopper MLA kernel: an sm_90 GPU
  lowered for, and a call it takes (bf16 MLA latents 576 / 512, one contiguous kv head,
  T = 1, G a multiple of 16, no scales, modifiers, sinks or index lists; the kernel's
  8-bit path is opt-in, ``default_dispatch``, until a GPU measures it). The kernel is
  faster than the Triton kernel there (`fdecode.kernels.mosaic_gpu` says by how much).

  ``view``: the cache as read (its read layout); ``sinks``, ``sparse``, ``mask``,
  ``bias``, ``alibi``: the call's, or None; ``mods``: its score modifiers; ``cfg``: its
  options (a balanced schedule stays on Triton)."""
  if chips.lowering_gpu().capability != (9, 0) or cfg.balance:
    return False
  extras = (sinks is not None or sparse is not None or mask is not None or bias is not None
            or alibi is not None or view.k_rope is not None or not mods.plain)
  return unsupported(
      q_shape=q.shape, q_dtype=q.dtype, k_shape=view.k.shape, k_dtype=view.k.dtype, v_is_none=view.v is None,
      v_head_dim=v_head_dim, k_scale_shape=None if view.k_scale is None else view.k_scale.shape,
      paged=view.paged, modifiers=extras, default_dispatch=True) is None


def decode_mla(q, k, ends, k_scale=None, *, softmax_scale, num_splits, interpret=None, note=None):
  """MLA decode on the Hopper kernel, its split states merged by the Triton combine kernel
  (`fdecode.kernels.mosaic_gpu.mla_run`): two kernels. ``k`` ``[B, 1, S, 576]``;
  ``k_scale``: an 8-bit cache's per-token scales (``impl="mosaic_gpu"`` only), canonical
  rank 4. Returns ``(out [B, T, G, 512], lse float32 [B, T, G])``."""
  b, t, g, _ = q.shape
  if k_scale is not None:
    k_scale = per_token_scale(k_scale, k.shape, "k_scale", "flash_decode")
  p = mla_plan(batch=b, num_tokens=t, group=g, seq_len=k.shape[2], softmax_scale=softmax_scale,
               cache_dtype=k.dtype, num_splits=num_splits)
  if note is not None:
    note(p)
  return mla_run(p, q, ends, k, k_scale, interpret=interpret)


def _decode_rows(q, view, ends, *, softmax_scale, num_splits, interpret, note):
  """GQA decode on the Hopper rows kernel over a head-major cache (contiguous, or a pool
  read in place through the block table), its split states merged by the Triton combine
  kernel (`fdecode.kernels.mosaic_gpu.rows_run`)."""
  b, t, hq, d = q.shape
  k, v = view.k, view.v
  hkv = view.kv_heads
  scales = [None if x is None else per_token_scale(x, c.shape, n, "flash_decode", broadcast=False)
            for n, x, c in (("k_scale", view.k_scale, k), ("v_scale", view.v_scale, v))]
  p = rows_plan(batch=b, kv_heads=hkv, num_tokens=t, group=hq // hkv, head_dim=d, seq_len=view.capacity,
                softmax_scale=softmax_scale, cache_dtype=k.dtype, num_splits=num_splits, page_size=view.page_size)
  if note is not None:
    note(p)
  return rows_run(p, q, ends, k, v, *scales, block_tables=view.block_tables, interpret=interpret)


def decode(q, view, ends, *, softmax_scale, cfg, interpret, mods, v_head_dim, sinks, sparse, mask, bias, alibi,
           note=None):
  """``impl="mosaic_gpu"``: the Hopper MLA kernel (``v`` None) or rows kernel (GQA) with
  their plans, compiled for the sm_90 GPU lowered for or run under the Mosaic GPU
  interpreter (``interpret``: an ``InterpretGPUParams``). A call the kernel does not take,
  or a compiled trace not for an sm_90 GPU, raises ValueError saying why.

  Returns ``(out [B, T, Hq, Dv] in q.dtype, lse float32 [B, T, Hq])``."""
  if not interpret:
    platform = chips.lowering_platform()
    gpu = chips.lowering_gpu() if platform == "gpu" else None
    if gpu is None or gpu.capability != (9, 0):
      target = platform if gpu is None else f"{gpu.name} (sm_{gpu.capability[0]}{gpu.capability[1]})"
      raise ValueError(f"flash_decode: impl='mosaic_gpu' compiles the Hopper kernels for an sm_90 GPU, but this "
                       f"trace lowers for {target}; pass interpret=fdecode.kernels.mosaic_gpu.InterpretGPUParams() "
                       "to run them under the Mosaic GPU interpreter (CPU)")
  rv = view.read(view.read_layout)  # one kv head (MLA, MQA) stored token-major is read head-major: the same bytes
  mla = rv.v is None
  reason = refusal(rv, q.shape[1], mods=mods, modifiers=(
      sinks is not None or sparse is not None or mask is not None or bias is not None or alibi is not None))
  if reason is None and mla:
    reason = unsupported(
        q_shape=q.shape, q_dtype=q.dtype, k_shape=rv.k.shape, k_dtype=rv.k.dtype, v_is_none=True,
        v_head_dim=v_head_dim, k_scale_shape=None if rv.k_scale is None else rv.k_scale.shape, paged=rv.paged)
  elif reason is None:
    reason = rows_unsupported(
        q_shape=q.shape, q_dtype=q.dtype, k_shape=rv.k.shape, k_dtype=rv.k.dtype, v_shape=rv.v.shape,
        v_dtype=rv.v.dtype, scales=rv.k_scale is not None or rv.v_scale is not None, paged=rv.paged)
  if reason:
    raise ValueError(f"flash_decode: impl='mosaic_gpu': the Hopper {'MLA' if mla else 'rows'} kernel cannot take "
                     f"this call: {reason}")
  if mla:
    return decode_mla(q, rv.k, ends, rv.k_scale, softmax_scale=softmax_scale, num_splits=cfg.num_splits,
                      interpret=interpret, note=note)
  return _decode_rows(q, rv, ends, softmax_scale=softmax_scale, num_splits=cfg.num_splits, interpret=interpret,
                      note=note)


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
