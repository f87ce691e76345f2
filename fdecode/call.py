"""A `flash_decode` call in the form the backends take (`Call`), built once and run.

`canonical_call` builds it from `flash_decode`'s arguments with every check; `part` builds
a ragged step's other part from the step's call (other query rows, per-row modifiers and
cache rows over the same caches and options: nothing is checked or canonicalized again);
`run` hands it to `fdecode.dispatch.decode` and puts the output in the caller's shape.
`fdecode.api` and `fdecode.ragged` both build and run their calls here.

Legend: B batch, T new tokens per sequence, Hq query heads, Hkv kv heads, S cache
capacity, Dk / Dv key / value head dims, K index slots.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from fdecode import config as config_lib
from fdecode import route
from fdecode.cache.layout import CacheView
from fdecode.cache.quant import validate_quant
from fdecode.cache.tables import check_concrete_page_ids
from fdecode.dispatch import decode, recording
from fdecode.kernels.backend import Decode, Operands, Options
from fdecode.kernels import mosaic_gpu
from fdecode.kernels.common import modifiers
from fdecode.kernels.common import sparse as sparse_lib
from fdecode.options import IMPLS, CallArrays, StaticOptions
from fdecode.validation import (as_arrays, check_concrete_lengths, check_kv_offset, describe, static_scale, to_int32,
                                validate_args)

class Call(NamedTuple):
  """A `flash_decode` call, validated and canonical (`canonical_call`): ``q4`` ``[B, T, Hq,
  Dk]``, the cache ``view`` (canonical scales, int32 tables), ``ends`` int32 ``[B]`` (each
  sequence's end relative to the cache's first token), the static ``mods`` and their
  canonical ``mod_arrays`` and ``sinks``, the static ``softmax_scale`` and ``cfg``, and the
  call's other options as `fdecode.dispatch.decode` takes them. ``source``: a
  `fdecode.kernels.backend.RowSource` of which ``q4`` (and the view's block tables, or a
  contiguous view's caches) are gathers (a `fdecode.ragged` part), or None."""
  q4: object
  view: CacheView
  ends: object
  kv_offset: object
  mods: modifiers.Modifiers
  mod_arrays: dict
  sinks: object
  softmax_scale: float
  cfg: config_lib.Config
  impl: object
  interpret: object
  dv: int
  v_head_dim: object
  single_token: bool
  indices: object
  source: object = None


def canonical_call(arrays: CallArrays, opts: StaticOptions) -> Call:
  """`flash_decode`'s arguments (but ``return_lse``): its ``arrays`` and its static ``opts``
  (checked as far as no shape is needed: `fdecode.options.split_call`), checked against each
  other (every `flash_decode` error) and put in the form the backends take: a `Call`."""
  o = opts
  impl, interpret, window, indices = o.impl, o.interpret, o.window, arrays.indices
  _check_invariant_mode(o.batch_invariant, o.split_size, impl, o.num_splits, indices)
  (q, k, v, lengths, block_tables, k_scale, v_scale, k_offset, v_offset, kv_offset, mask, bias,
   alibi_slopes, sinks, k_rope, indices) = as_arrays(**arrays._asdict())
  # The cache layout, resolved once: the view goes down to `decode` and each path as it is
  # (the Triton kernel reads token-major caches in place); the checks see head-major shapes.
  view = CacheView.of(k, v, block_tables=block_tables, k_rope=k_rope, k_scale=k_scale, v_scale=v_scale,
                      k_offset=k_offset, v_offset=v_offset, kv_layout=o.kv_layout)
  k, v, k_rope = view.head_major_shapes()
  k_scale, v_scale, k_offset, v_offset = view.k_scale, view.v_scale, view.k_offset, view.v_offset
  try:
    single_token, dv = validate_args(q, k, v, lengths, block_tables, v_head_dim=o.v_head_dim, k_rope=k_rope)
    k_scale, k_offset = validate_quant("k", k, k_scale, k_offset)
    if v is None and (v_scale is not None or v_offset is not None):
      raise ValueError("flash_decode: v_scale / v_offset given with v=None: the values are k's first "
                       "v_head_dim columns and use k_scale / k_offset")
    v_scale, v_offset = (None, None) if v is None else validate_quant("v", v, v_scale, v_offset)
  except ValueError as e:
    if view.layout == "HND":
      raise
    stored = zip(("k", "v", "k_rope"), (view.k, view.v, view.k_rope))
    given = ", ".join(f"{n}.shape={tuple(np.shape(x))}" for n, x in stored if x is not None)
    raise ValueError(f"{e} (cache shapes shown head-major; with kv_layout={view.layout!r} the caches "
                     f"given are {given})") from None
  if impl is not None and impl not in IMPLS:
    raise ValueError(f"flash_decode: impl must be one of {IMPLS} or None, got {describe(impl)}")
  _check_interpret(impl, interpret)
  if impl == "mosaic_gpu" and kv_offset is not None:
    raise ValueError("flash_decode: impl='mosaic_gpu' does not take kv_offset (the Hopper kernels read a "
                     "whole sequence's cache)")
  interpret = route.resolve_interpret(impl, interpret)
  cfg = config_lib.Config.from_args(o.num_splits, o.block_k, bool(o.batch_invariant), o.split_size).bounded(
      max(view.capacity, 0 if indices is None else np.shape(indices)[-1]))
  scale = static_scale(o.softmax_scale, q.shape[-1])
  check_concrete_lengths(lengths, None if kv_offset is not None else view.capacity)
  if kv_offset is not None:
    check_kv_offset(kv_offset, lengths, q.shape[0])
  if block_tables is not None:
    check_concrete_page_ids(block_tables, lengths, view.num_pages, view.page_size,
                             num_tokens=1 if single_token else q.shape[1], window=window)
  q4 = q.reshape(q.shape[0], 1, *q.shape[1:]) if single_token else q  # one reshape, not an expand_dims
  hkv = view.kv_heads
  mods, mod_arrays, sinks = modifiers.canonicalize(
      q4.shape, hkv, view.capacity, causal=o.causal, mask=mask, bias=bias,
      alibi_slopes=alibi_slopes, sinks=sinks, window=window, logits_soft_cap=o.logits_soft_cap)
  if indices is not None:
    indices = sparse_lib.validate(indices, q.shape, hkv, mods=mods, has_mask=mask is not None,
                                  has_bias=bias is not None)
  view = view.with_arrays(block_tables=None if block_tables is None else to_int32(block_tables),
                          k_scale=k_scale, v_scale=v_scale, k_offset=k_offset, v_offset=v_offset,
                          k_rope=None if view.k_rope is None else jnp.asarray(view.k_rope))
  ends = to_int32(lengths)
  if kv_offset is not None:
    kv_offset = to_int32(kv_offset)
    ends = ends - kv_offset
  return Call(q4=q4, view=view, ends=ends, kv_offset=kv_offset, mods=mods, mod_arrays=mod_arrays, sinks=sinks,
              softmax_scale=scale, cfg=cfg, impl=impl, interpret=interpret, dv=dv,
              v_head_dim=None if v is not None else dv, single_token=single_token, indices=indices)


def part(c: Call, q4, view: CacheView, lengths, *, source, rows=None, cfg=None) -> Call:
  """The call of another part of a ragged step whose call ``c`` is (its decode part,
  `fdecode.ragged.parts`): the same options, modifiers and caches, other rows. Nothing is
  checked again: the part's arrays are gathers of what ``c`` checked.

  Args:
    c: the step's canonical call (4-D q, no ``kv_offset``).
    q4: the part's query rows ``[B, T, Hq, Dk]``.
    view: the part's cache view: ``c.view`` with the part's block tables (int32 ``[B, n]``),
      or a contiguous cache's rows of ``c.view``'s (canonical) arrays.
    lengths: int32 ``[B]``.
    source: the part's `fdecode.kernels.backend.RowSource`.
    rows: the part's rows of the step's per-row ``mask`` / ``bias`` (``[B, T, S]`` or
      ``[B, T, Hq, S]``) and ``indices`` (``[B, T, K]`` or ``[B, T, Hkv, K]``), those the
      step has.
    cfg: the part's knobs, default ``c.cfg``.
  """
  rows = rows or {}
  mods, mod_arrays, indices = c.mods, dict(c.mod_arrays), c.indices
  forms = {}
  for name in ("mask", "bias"):
    if name in rows:
      mod_arrays[name], forms[name] = modifiers.canonical_form(rows[name], q4.shape[2], view.kv_heads)
  if forms:
    mods = dataclasses.replace(mods, **forms)
  if "indices" in rows:  # their canonical form (and which options they refuse) depends on the part's T
    indices = sparse_lib.validate(rows["indices"], q4.shape, view.kv_heads, mods=mods,
                                  has_mask=mods.mask is not None, has_bias=mods.bias is not None)
  return c._replace(q4=q4, view=view, ends=to_int32(lengths), mods=mods, mod_arrays=mod_arrays, indices=indices,
                    cfg=c.cfg if cfg is None else cfg, source=source)


def run(c: Call, return_lse: bool):
  """``c`` on its backend (`fdecode.dispatch.decode`): ``out`` shaped like the caller's q
  with last dim Dv (``[B, Hq, Dv]`` or ``[B, T, Hq, Dv]``), and with ``return_lse`` its
  float32 ``lse``."""
  q4, view, ends, mods = c.q4, c.view, c.ends, c.mods
  rows = q4.shape[:1] if c.single_token else q4.shape[:2]  # the caller's leading axes
  if q4.shape[0] == 0 or q4.shape[1] == 0:  # no sequence or no new token: nothing to attend
    out = jnp.zeros(rows + q4.shape[2:-1] + (c.dv,), q4.dtype)
    lse = jnp.full(rows + q4.shape[2:-1], -jnp.inf, jnp.float32)
  else:
    sparse, lists = None, {}
    if c.indices is not None:
      q4, ends, sparse, lists, view = _sparse_setup(q4, ends, c.indices, view, c.kv_offset, mods)
    run_decode = decode.__wrapped__ if recording() else decode  # `plan`: traced anew, not from jit's cache
    d = decode_of(c._replace(q4=q4, view=view, ends=ends, source=None if c.single_token else c.source), sparse, lists)
    out, lse = run_decode(d.operands, options=d.options)
    # Undo a sparse fold; a single-token q drops its token axis in the same reshape (an eager
    # ``out[:, 0]`` is a slice and a squeeze: two more programs outside jit).
    out, lse = out.reshape(*rows, *out.shape[2:]), lse.reshape(*rows, -1)
  return (out, lse) if return_lse else out


def decode_of(c: Call, sparse=None, lists=None) -> Decode:
  """``c`` as every backend takes it (`fdecode.kernels.backend.Decode`); ``sparse`` /
  ``lists``: its index lists set up (`_sparse_setup`; a sparse call reads no source)."""
  options = Options(c.impl, c.softmax_scale, c.cfg, c.interpret, c.mods, c.v_head_dim, sparse)
  source = None if sparse is not None else c.source
  return Decode(options, Operands(c.q4, c.view, c.ends, lists or {}, c.mod_arrays, c.sinks, source))


# The impls that take the batch-invariant mode: the XLA path (`fdecode.kernels.xla.invariant`, on
# every platform) and the Pallas kernels with an invariant plan (Triton's: compiled, or
# interpreted on any host); where a route's kernel has none, the XLA path runs the call.
INVARIANT_IMPLS = (None, "xla", "pallas")


def _check_invariant_mode(batch_invariant, split_size, impl, num_splits, indices):
  """``batch_invariant`` / ``split_size`` against the call's other options."""
  if not batch_invariant:
    if split_size is not None:
      raise ValueError(f"flash_decode: split_size={split_size} is the batch-invariant mode's split: pass "
                       "batch_invariant=True with it (num_splits sets the default path's splits)")
    return
  if impl not in INVARIANT_IMPLS:
    raise ValueError(f"flash_decode: batch_invariant=True runs with impl None, 'xla' or 'pallas' (the XLA "
                     f"path or the Triton kernels' invariant plan); got impl={describe(impl)}")
  if num_splits is not None:
    raise ValueError(f"flash_decode: batch_invariant=True fixes the split size, not a split count: pass "
                     f"split_size= instead of num_splits={describe(num_splits)}")
  if indices is not None:
    raise ValueError("flash_decode: batch_invariant=True does not take indices (sparse index lists) yet")


def _check_interpret(impl, interpret):
  """``interpret`` against ``impl``: None, a bool, a TPU ``InterpretParams`` (Mosaic TPU
  kernel, ``impl="pallas"``) or a Mosaic GPU ``InterpretGPUParams`` (``impl="mosaic_gpu"``,
  which takes no True)."""
  gpu_params = isinstance(interpret, mosaic_gpu.InterpretGPUParams)
  if not (interpret is None or gpu_params or isinstance(interpret, (bool, np.bool_, pltpu.InterpretParams))):
    raise ValueError("flash_decode: interpret must be None, a bool or a jax.experimental.pallas.tpu.InterpretParams "
                     f"(impl='pallas') / fdecode.kernels.mosaic_gpu.InterpretGPUParams (impl='mosaic_gpu'), "
                     f"got {describe(interpret)}")
  if isinstance(interpret, pltpu.InterpretParams) and impl != "pallas":
    raise ValueError(f"flash_decode: interpret=InterpretParams(...) runs the TPU Pallas kernel: "
                     f"pass impl='pallas' (got impl={describe(impl)})")
  if gpu_params and impl != "mosaic_gpu":
    raise ValueError(f"flash_decode: interpret=InterpretGPUParams(...) runs the Hopper kernels: "
                     f"pass impl='mosaic_gpu' (got impl={describe(impl)})")
  if impl == "mosaic_gpu" and not (interpret is None or gpu_params or (isinstance(interpret, (bool, np.bool_))
                                                                       and not interpret)):
    raise ValueError("flash_decode: impl='mosaic_gpu' takes interpret None / False (compiled for an sm_90 GPU) "
                     f"or a fdecode.kernels.mosaic_gpu.InterpretGPUParams (interpreted), got {describe(interpret)}")


def _sparse_setup(q4, ends, indices, view, kv_offset, mods):
  """Canonical index lists into the cache (`fdecode.kernels.common.sparse.canonicalize`): returns
  (q4, ends, sparse, lists: indices / index_bounds / index_runs, view). Per-token lists fold the T new tokens
  into the batch: q ``[B*T, 1, Hq, Dk]``, one end per token, a paged table repeated per token
  (contiguous caches are read at row ``b' // fold``)."""
  lists = {}
  sparse, lists["indices"], lists["index_bounds"], ends, lists["index_runs"] = sparse_lib.canonicalize(
      indices, ends, 0 if kv_offset is None else kv_offset, view.capacity, q4.shape[1], mods)
  if sparse.fold > 1:
    b, t = q4.shape[:2]
    q4 = q4.reshape(b * t, 1, *q4.shape[2:])
    if view.paged:
      view = view.with_arrays(block_tables=jnp.repeat(view.block_tables, t, axis=0))
      sparse = dataclasses.replace(sparse, fold=1)
  return q4, ends, sparse, lists, view
