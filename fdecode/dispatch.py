"""The one backend dispatch of `flash_decode`: by the platform being lowered for (XLA on
CPU, Triton on GPU, Mosaic on TPU, or the float32 reference), each path's split count,
and the merge of its per-split states. Arguments arrive validated and canonical
(`fdecode.call`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fdecode.cache.layout import QUANT_ARRAYS
from fdecode.combine import apply_sinks, merge_states
from fdecode.kernels import mosaic_gpu
from fdecode.kernels import mosaic_tpu
from fdecode.kernels import triton as triton_kernels
from fdecode.kernels.triton import make_plan as triton_plan, run as triton_run, triton_unsupported
from fdecode.kernels.common.modifiers import window_tokens
from fdecode.kernels import xla as xla_kernels
from fdecode.cache.quant import is_quantized
from fdecode.reference import reference_decode
from fdecode import derivatives
from fdecode import route


# `fdecode.plan`: while a list is set, each path traced appends (platform, its plan); the
# platform is the `fdecode.route.lower` branch being traced (None: every platform).
_PLANS = contextvars.ContextVar("fdecode_plans", default=None)


@contextlib.contextmanager
def recording_plans():
  """Inside, each backend path traced appends ``(platform, plan)`` to the list it yields
  (`fdecode.plan`); a jitted `decode` must then be traced anew (`recording`)."""
  log = []
  token = _PLANS.set(log)
  try:
    with route.every_branch():  # every platform's branch traced now, its plans noted
      yield log
  finally:
    _PLANS.reset(token)


def recording() -> bool:
  return _PLANS.get() is not None


def _note(plan):
  log = _PLANS.get()
  if log is not None:
    log.append((route.branch_platform(), plan))


def compute_dtype(q_dtype, *cache_dtypes):
  """The dtype the matmuls read: q's dtype promoted with every float cache's dtype (an
  8-bit cache contributes nothing: it is dequantized to q's dtype; None entries are
  absent caches). A float32 query on a bfloat16 cache computes in float32; a bfloat16
  query on a float32 cache too."""
  dtypes = [q_dtype] + [d for d in cache_dtypes if d is not None and not is_quantized(d)]
  with jax.numpy_dtype_promotion("standard"):  # fdecode's own documented rule, under a caller's "strict" too
    return jnp.result_type(*dtypes)


@functools.partial(jax.jit, static_argnames=("impl", "softmax_scale", "cfg", "interpret", "mods",
                                             "v_head_dim", "sparse"))
def decode(q, view, ends, lists, mod_arrays, sinks, *, impl, softmax_scale, cfg, interpret, mods,
           v_head_dim, sparse, source=None):
  """q ``[B, T, Hq, Dk]`` -> (out ``[B, T, Hq, Dv]`` in q.dtype, lse f32 ``[B, T, Hq]``).

  ``view``: the cache (`fdecode.cache.layout.CacheView`: arrays as stored, canonical
  head-major scales / offsets, int32 block tables), handed to each path as it is: every
  kernel reads token-major caches in place (`_triton`, `_xla`, `_mosaic`: its supported
  cases); the other Mosaic cases and the reference read its head-major view (a transpose
  in this program, dropped when no lowered branch uses it).
  ``v`` None: the values are ``k[..., :v_head_dim]`` (MLA). ``sparse`` (`fdecode.kernels.common.sparse.Sparse`):
  ``lists`` holds canonical ``indices`` / ``index_bounds`` and ``index_runs`` (the Triton
  kernel's: sorted, repeats kept) (else empty) and q row b' reads cache row ``b' // sparse.fold``.
  ``mods`` / ``mod_arrays``: the score modifiers (`fdecode.kernels.common.modifiers.canonicalize`);
  ``sinks`` (f32 ``[Hq]`` or None) join the softmax once, after the merge.
  ``source``: a `fdecode.kernels.triton.RowSource` of which q (and the view's block tables,
  or a contiguous view's caches) are gathers: the Triton kernels read through it, every
  other path reads q and the view.
  The one dispatch: its path per platform *lowered for* (`fdecode.route.decode_path`, run
  by `fdecode.route.lower`), so exporting for TPU or CUDA from a CPU host embeds that
  platform's kernel. Differentiable in every float argument, forward and reverse mode
  (`fdecode.derivatives`: the forward runs this kernel, the tangent plain XLA).
  """
  statics = derivatives.Statics(impl, softmax_scale, cfg, interpret, mods, v_head_dim, sparse)
  return derivatives.differentiable(_forward, statics, (q, view, ends, lists, mod_arrays, sinks, source))


def _forward(q, view, ends, lists, mod_arrays, sinks, source, *, impl, softmax_scale, cfg, interpret, mods,
             v_head_dim, sparse):
  """`decode`'s forward: its kernel, by the platform lowered for."""
  b, t, hq, dk = q.shape
  hkv = view.kv_heads
  g = hq // hkv
  if impl == "reference":
    d = derivatives.dense_call(q, view, ends, lists, mod_arrays, sinks, mods=mods, v_head_dim=v_head_dim,
                               sparse=sparse)
    out, lse = reference_decode(
        d.q, d.k, d.v, d.ends, softmax_scale=softmax_scale, causal=mods.causal, mask=d.mask, bias=d.bias,
        alibi_slopes=d.alibi, window=mods.window, logits_soft_cap=mods.soft_cap, sinks=d.sinks)
    return out.astype(q.dtype), lse
  if impl == "mosaic_gpu":  # opt-in: the Hopper kernels, or a ValueError naming why not (no fallback)
    return _mosaic_gpu(q, view, ends, softmax_scale=softmax_scale, cfg=cfg, interpret=interpret, mods=mods,
                       v_head_dim=v_head_dim, sinks=sinks, sparse=sparse, **mod_arrays)
  cd = compute_dtype(q.dtype, *(None if x is None else x.dtype for x in (view.k, view.v, view.k_rope)))
  lists = dict(lists)
  runs = lists.pop("index_runs", None)  # the Triton kernel's lists: it drops the repeats itself
  statics = dict(num_tokens=t, softmax_scale=softmax_scale, cfg=cfg, mods=mods, v_head_dim=v_head_dim)
  if sparse is not None:
    statics["sparse"] = sparse

  def q_rows(q):  # rows of one kv head, r = t * G + g, in the compute dtype (XLA and Mosaic)
    return q.reshape(b, t, hkv, g, dk).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, dk).astype(cd)

  def finish(states, sinks):  # a path's per-split states -> the output (the branches' split counts differ)
    if states[1].shape[2] == 1:  # one split: its state is the merge (merge_states of one part is exact)
      o, lse = states[0][:, :, 0], states[1][:, :, 0]
    else:
      o, lse = merge_states(*states, axis=2)  # [B, Hkv, R, Dv], [B, Hkv, R]
    dv = o.shape[-1]
    out = o.reshape(b, hkv, t, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dv)
    lse = lse.reshape(b, hkv, t, g).transpose(0, 2, 1, 3).reshape(b, t, hq)
    if sinks is not None:  # once, after every split is merged
      out, lse = apply_sinks(out, lse, sinks)
    return out.astype(q.dtype), lse

  def branch(path):  # a path's branch: it reads the call's arrays only through its operands
    def run(platform, q, view, ends, lists, runs, mod_arrays, sinks, source):
      kw = dict(statics, **lists, **mod_arrays)
      if path is route.Path.XLA:
        return finish(_xla(q_rows(q), view, ends, platform=platform or jax.default_backend(), **kw), sinks)
      if path in (route.Path.TRITON, route.Path.TRITON_INTERPRET):  # the kernels finish the output themselves
        return _triton(q, view, ends, interpret=path is route.Path.TRITON_INTERPRET, compute=cd, sinks=sinks,
                       source=source, **(kw if runs is None else dict(kw, indices=runs)))
      if path in (route.Path.MOSAIC_TPU, route.Path.MOSAIC_TPU_INTERPRET):
        return finish(_mosaic(q_rows(q), view, ends, interpret=interpret if path is route.Path.MOSAIC_TPU_INTERPRET
                              else False, **kw), sinks)
      # The default dispatch's Hopper MLA path.
      return mosaic_gpu.decode_mla(q, view.read(view.read_layout).k, ends, softmax_scale=softmax_scale,
                                   num_splits=cfg.num_splits, note=_note)
    return run

  if cfg.batch_invariant:  # one path on every platform (`fdecode.kernels.xla.invariant`)
    return finish(_invariant(q_rows(q), view, ends, **statics, **mod_arrays), sinks)
  branches = {path: branch(path) for path in (route.Path.XLA, route.Path.TRITON, route.Path.TRITON_INTERPRET,
                                              route.Path.MOSAIC_TPU, route.Path.MOSAIC_TPU_INTERPRET,
                                              route.Path.MOSAIC_GPU)}
  triton_takes = triton_supports(view, v_head_dim)
  hopper_takes = lambda: mosaic_gpu.takes_mla(q, view.read(view.read_layout), mods, sinks, sparse, v_head_dim,
                                              mod_arrays["mask"], mod_arrays["bias"], mod_arrays["alibi"], cfg)
  return route.lower(lambda platform: route.decode_path(impl, interpret, platform, triton_takes=triton_takes,
                                                        hopper_takes=hopper_takes),
                     branches, q, view, ends, lists, runs, mod_arrays, sinks, source)


def _xla(q_rows, view, ends, *, num_tokens, softmax_scale, cfg, platform, mods, **extra):
  """The XLA path: its plan (`fdecode.kernels.xla.plan.make_plan`), then its kernel;
  token-major caches are read in place, chunk by chunk (`xla_partials`)."""
  b, hkv = q_rows.shape[:2]
  if "sparse" in extra:  # the K selected tokens, in chunks
    p = xla_kernels.make_plan(batch=b, kv_heads=hkv, tokens=extra["indices"].shape[-1], platform=platform,
                           sparse=True, num_splits=cfg.num_splits)
    _note(p)
    hm = view.head_major()
    return xla_kernels.sparse_partials(q_rows, hm.k, hm.v, ends, num_tokens=num_tokens, softmax_scale=softmax_scale,
                           num_splits=p.num_splits, mods=mods, **hm.kernel_arrays(), **extra)
  s = window_tokens(view.capacity, num_tokens, mods, view.page_size)
  p = xla_kernels.make_plan(
      batch=b, kv_heads=hkv, tokens=s, platform=platform, paged=view.paged,
      quantized=view.k_scale is not None or view.v_scale is not None,
      kv_layout=view.read_layout, num_splits=cfg.num_splits, rows=q_rows.shape[2],
      token_bytes=b * hkv * view.k.shape[-1] * jnp.dtype(view.k.dtype).itemsize)  # K of one position, all sequences
  _note(p)
  rv = view.read(p.kv_layout)
  return xla_kernels.xla_partials(q_rows, rv.k, rv.v, ends, num_tokens=num_tokens, softmax_scale=softmax_scale,
                      num_splits=p.num_splits, mods=mods, kv_layout=p.kv_layout, loop=p.loop, **rv.kernel_arrays(),
                      **extra)


def _invariant(q_rows, view, ends, *, num_tokens, softmax_scale, cfg, mods, v_head_dim, **mod_arrays):
  """The batch-invariant XLA path: splits of a fixed size at absolute positions, one state
  out (`fdecode.kernels.xla.invariant`)."""
  split = xla_kernels.split_tokens(cfg.split_size, view.page_size)
  tokens = view.capacity
  _note(xla_kernels.XlaPlan(num_splits=max(-(-tokens // split), 1), kv_layout=view.read_layout, tokens=tokens,
                            loop=True, split_size=split))
  rv = view.read(view.read_layout)
  return xla_kernels.invariant_partials(q_rows, rv.k, rv.v, ends, num_tokens=num_tokens, softmax_scale=softmax_scale,
                                        split=split, mods=mods, kv_layout=rv.layout, v_head_dim=v_head_dim,
                                        **rv.kernel_arrays(), **mod_arrays)


def _triton(q, view, ends, *, num_tokens, softmax_scale, cfg, interpret, compute, sinks, mods,
            v_head_dim, sparse=None, mask=None, bias=None, alibi=None, source=None, **lists):
  """The Triton path: its plan (`fdecode.kernels.triton.plan`: sized to the GPU lowered
  for; interpreted, the same plan), then its kernels. Token-major caches are read in place,
  and q / table rows through ``source`` (not with index lists)."""
  del num_tokens  # q's shape carries it
  indices = lists.get("indices")
  p, rv = triton_plan_view(q, view, compute=compute, mods=mods, v_head_dim=v_head_dim, cfg=cfg, interpret=interpret,
                           has_mask_or_bias=mask is not None or bias is not None, has_sinks=sinks is not None,
                           index_slots=None if sparse is None else indices.shape[-1],
                           sparse_fold=1 if sparse is None else sparse.fold, source=source if sparse is None else None)
  return triton_run(p, q, ends, rv.k, rv.v, softmax_scale=softmax_scale, mask=mask, bias=bias, alibi=alibi,
                    sinks=sinks, sparse=sparse, source=source if p.q_source else None, **rv.kernel_arrays(),
                    **lists)


def triton_plan_view(q, view, *, compute, mods, v_head_dim, cfg, interpret, has_mask_or_bias=False,
                     has_sinks=False, index_slots=None, sparse_fold=1, source=None, balance=None, step=None):
  """The Triton kernels' plan of a canonical call (q ``[B, T, Hq, Dq]``, its cache ``view``)
  and the view they read (its read layout; a `RowSource`'s whole contiguous caches where the
  plan reads cache rows). ``balance`` None: ``cfg.balance``; ``step``: a ragged step's part
  (`fdecode.kernels.triton.make_plan`)."""
  rv = view.read(view.read_layout)
  p = triton_plan(q.shape, rv.k, rv.v, compute_dtype=compute, out_dtype=q.dtype, kv_layout=rv.layout,
                  block_tables=rv.block_tables, k_rope=rv.k_rope,
                  **{n: getattr(rv, n) for n in QUANT_ARRAYS}, v_head_dim=v_head_dim, mods=mods,
                  has_mask_or_bias=has_mask_or_bias, has_sinks=has_sinks, index_slots=index_slots,
                  sparse_fold=sparse_fold, num_splits=cfg.num_splits, block_k=cfg.block_k,
                  balance=cfg.balance if balance is None else balance, interpret=interpret, source=source,
                  step=step)
  _note(p)
  if p.cache_source:  # the whole contiguous caches the call's are gathers of, read at the source's rows
    rv = source.caches.read(rv.layout)
  return p, rv


def _mosaic_gpu(q, view, ends, **call):
  """``impl="mosaic_gpu"`` (`fdecode.kernels.mosaic_gpu.decode`), its plans recorded."""
  return mosaic_gpu.decode(q, view, ends, note=_note, **call)


def _mosaic(q_rows, view, ends, *, num_tokens, softmax_scale, cfg, interpret, **extra):
  """The Mosaic path: its plan (`fdecode.kernels.mosaic_tpu.plan.make_plan`), then its kernel."""
  p = mosaic_tpu.make_plan(q_rows, view, extra=extra, num_tokens=num_tokens, num_splits=cfg.num_splits,
                       block_k=cfg.block_k)
  _note(p)
  if p.backend == "xla":
    return _xla(q_rows, view, ends, num_tokens=num_tokens, softmax_scale=softmax_scale, cfg=cfg,
                platform="tpu", **extra)
  if p.upcast_query:  # Mosaic has no float16 vectors: a float16 query over another cache computes in float32
    q_rows = q_rows.astype(jnp.float32)
  kw = dict(num_tokens=num_tokens, softmax_scale=softmax_scale, interpret=interpret, num_splits=p.num_splits,
            plan=p.sizes)
  layout = {}
  rv = view.head_major() if p.read is None else view  # token-major caches read in place, or head-major
  k, v, arrays = rv.k, rv.v, rv.kernel_arrays()
  if p.read is not None:
    layout = dict(kv_layout="NHD", head_axis=p.read.axis) if p.sparse else dict(kv_layout="NHD", read=p.read)
    if p.as_pool:  # a contiguous cache as the pool of whole pages
      k, v, rope, quant, tables = mosaic_tpu.contiguous_as_pool(k, v, rv.k_rope, tuple(arrays[n] for n in _QUANT))
      arrays = dict(arrays, k_rope=rope, block_tables=tables, **dict(zip(_QUANT, quant)))
  if p.sparse:
    return mosaic_tpu.mosaic_sparse_partials(q_rows, ends, k, v, **kw, **layout, **arrays, **extra)
  return mosaic_tpu.mosaic_partials(q_rows, ends, k, v, **kw, **layout, **arrays, **extra)


# The order `contiguous_as_pool` takes and returns the quantization arrays in.
_QUANT = ("k_scale", "k_offset", "v_scale", "v_offset")


def triton_supports(view, v_head_dim=None) -> bool:
  """Whether the compiled Triton kernel takes these shapes (see `triton_unsupported`). Scales
  canonical or as given (a scalar: one tile)."""
  tiles = lambda sc: 1 if sc is None or np.ndim(sc) == 0 else np.shape(sc)[-1]
  rope, v = view.k_rope, view.v
  return triton_unsupported(view.k.shape[-1], v_head_dim if v is None else v.shape[-1], tiles(view.k_scale),
                            tiles(view.v_scale), v_from_k=v is None,
                            rope_dim=0 if rope is None else rope.shape[-1]) is None
