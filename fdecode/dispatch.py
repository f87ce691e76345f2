"""The one backend dispatch of `flash_decode`: by the platform being lowered for (XLA on
CPU, Triton on GPU, Mosaic on TPU, or the float32 reference), each path's split count,
and the merge of its per-split states. Arguments arrive validated and canonical
(`fdecode.api`)."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from fdecode.kernels.common import chips
from fdecode.kernels.common import modifiers
from fdecode.kernels.common import sparse as sparse_lib
from fdecode.cache.layout import head_major, read_layout
from fdecode.cache.paged import gather_pages, gather_scale
from fdecode.combine import apply_sinks, merge_states
from fdecode.kernels import mosaic_gpu
from fdecode.kernels.mosaic_tpu import sparse as mosaic_sparse
from fdecode.kernels.mosaic_tpu.kernel import mosaic_partials
from fdecode.kernels.mosaic_tpu.plan import make_plan as mosaic_make_plan
from fdecode.kernels.mosaic_tpu.token_major import contiguous_as_pool as mosaic_contiguous_as_pool
from fdecode.kernels import triton as triton_kernels
from fdecode.kernels.triton import make_plan as triton_plan, run as triton_run, triton_unsupported
from fdecode.kernels.common.modifiers import window_tokens
from fdecode.kernels.xla import plan as xla_plan
from fdecode.kernels.xla.dense import xla_partials
from fdecode.kernels.xla.sparse import sparse_partials
from fdecode.kernels.common.quant import dequantize, is_quantized
from fdecode.reference import reference_decode


# `fdecode.plan`: while a list is set, each path traced appends (platform, its plan); the
# platform is the `platform_dependent` branch being traced (None: every platform).
_PLANS = contextvars.ContextVar("fdecode_plans", default=None)
_BRANCH = contextvars.ContextVar("fdecode_branch", default=None)


@contextlib.contextmanager
def recording_plans():
  """Inside, each backend path traced appends ``(platform, plan)`` to the list it yields
  (`fdecode.plan`); a jitted `decode` must then be traced anew (`recording`)."""
  log = []
  token = _PLANS.set(log)
  try:
    yield log
  finally:
    _PLANS.reset(token)


def recording() -> bool:
  return _PLANS.get() is not None


def _note(plan):
  log = _PLANS.get()
  if log is not None:
    log.append((_BRANCH.get(), plan))


def _branch(platform, fn):
  """``fn`` traced as `platform_dependent`'s ``platform`` branch (for `recording_plans`)."""
  def run():
    token = _BRANCH.set(platform)
    try:
      return fn()
    finally:
      _BRANCH.reset(token)
  return run


def forced_tpu_interpret():
  """The InterpretParams of an enclosing ``pltpu.force_tpu_interpret_mode(...)``, else None:
  under it, ``impl="pallas"`` runs the TPU kernel interpreted, as the context promises."""
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
  flag = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
  return None if flag is None else flag.value


def compute_dtype(q_dtype, *cache_dtypes):
  """The dtype the matmuls read: q's dtype promoted with every float cache's dtype (an
  8-bit cache contributes nothing: it is dequantized to q's dtype; None entries are
  absent caches). A float32 query on a bfloat16 cache computes in float32; a bfloat16
  query on a float32 cache too."""
  dtypes = [q_dtype] + [d for d in cache_dtypes if d is not None and not is_quantized(d)]
  return jnp.result_type(*dtypes)


@functools.partial(jax.jit, static_argnames=("impl", "softmax_scale", "cfg", "interpret", "mods",
                                             "v_head_dim", "sparse", "kv_layout"))
def decode(q, k, v, ends, cache, mod_arrays, sinks, *, impl, softmax_scale, cfg, interpret, mods,
            v_head_dim, sparse, kv_layout="HND"):
  """q ``[B, T, Hq, Dk]`` -> (out ``[B, T, Hq, Dv]`` in q.dtype, lse f32 ``[B, T, Hq]``).

  ``k``, ``v`` and ``cache["k_rope"]`` are in ``kv_layout`` (`fdecode.cache.layout`): the
  every kernel reads token-major ones in place (`_triton`, `_xla`, `_mosaic`: its
  supported cases); the other Mosaic cases and the reference read head-major views (a
  transpose in this program, dropped when no lowered branch uses it).
  ``cache``: dict of block_tables, canonical (head-major) scales / offsets and k_rope (None when absent).
  ``v`` None: the values are ``k[..., :v_head_dim]`` (MLA). ``sparse`` (`fdecode.kernels.common.sparse.Sparse`):
  ``cache`` holds canonical ``indices`` / ``index_bounds`` and q row b' reads cache row
  ``b' // sparse.fold``.
  ``mods`` / ``mod_arrays``: the score modifiers (`fdecode.kernels.common.modifiers.canonicalize`);
  ``sinks`` (f32 ``[Hq]`` or None) join the softmax once, after the merge.
  The one dispatch: by the platform being *lowered for* (`jax.lax.platform_dependent`),
  so exporting for TPU or CUDA from a CPU host embeds that platform's kernel.
  """
  b, t, hq, dk = q.shape
  token_major = None
  if kv_layout == "NHD":
    paged = cache["block_tables"] is not None
    token_major = (k, v, cache["k_rope"])
    k, v, rope = (head_major(x, kv_layout, paged) for x in token_major)
    cache = dict(cache, k_rope=rope)
  hkv = k.shape[0] if cache["block_tables"] is not None else k.shape[1]
  g = hq // hkv
  if impl == "reference":
    tables = cache["block_tables"]
    kf = _materialize(k, tables, cache["k_scale"], cache["k_offset"])
    vf = kf[..., :v_head_dim] if v is None else _materialize(v, tables, cache["v_scale"], cache["v_offset"])
    if cache["k_rope"] is not None:  # key-only columns after k's own
      kf = jnp.concatenate([kf, _materialize(cache["k_rope"], tables)], axis=-1)
    mask = mod_arrays["mask"]
    if sparse is not None:  # the selected positions as a mask, each pseudo-sequence's cache row
      src = jnp.arange(b) // sparse.fold
      kf, vf = kf[src], vf[src]
      sel = sparse_lib.dense_mask(cache["indices"], kf.shape[2])  # [B', Hi, S]
      mask = sel[:, :, None, None, :]  # canonical [B', Hi, 1, 1, S] ...
      if sel.shape[1] > 1:  # ... per kv head: the same list for its G query heads
        mask = jnp.broadcast_to(mask, (b, hkv, 1, g, sel.shape[2]))
    user = lambda x: None if x is None else modifiers.user_form(x)
    alibi = mod_arrays["alibi"]
    out, lse = reference_decode(
        q, kf, vf, ends, softmax_scale=softmax_scale, causal=mods.causal,
        mask=user(mask), bias=user(mod_arrays["bias"]),
        alibi_slopes=None if alibi is None else alibi.reshape(-1), window=mods.window,
        logits_soft_cap=mods.soft_cap, sinks=sinks)
    return out.astype(q.dtype), lse
  rope = cache["k_rope"]
  cd = compute_dtype(q.dtype, k.dtype, None if v is None else v.dtype, None if rope is None else rope.dtype)
  kw = dict(num_tokens=t, softmax_scale=softmax_scale, cfg=cfg, mods=mods, v_head_dim=v_head_dim,
            **cache, **mod_arrays)
  if sparse is not None:
    kw["sparse"] = sparse

  def q_rows():  # rows of one kv head, r = t * G + g, in the compute dtype (XLA and Mosaic)
    return q.reshape(b, t, hkv, g, dk).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, dk).astype(cd)

  def finish(states):  # a path's per-split states -> the output (the branches' split counts differ)
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

  xla = lambda platform: finish(_xla(q_rows(), k, v, ends, platform=platform, token_major=token_major, **kw))
  # The Triton kernels finish the output themselves (split kernel, then combine).
  triton = lambda interp: _triton(q, k, v, ends, interpret=interp, token_major=token_major, compute=cd,
                                  sinks=sinks, **kw)
  mosaic = lambda interp: finish(_mosaic(q_rows(), k, v, ends, interpret=interp, token_major=token_major, **kw))
  if impl == "xla":  # explicitly asked for, on whatever host traces it
    return xla(jax.default_backend())
  if isinstance(interpret, pltpu.InterpretParams):
    return mosaic(interpret)
  if impl == "pallas" and interpret:
    return triton(True)
  # platform_dependent traces every branch and lowers only the target's. A shape Triton
  # cannot tile gets the XLA path on GPU, except that impl="pallas" traced on a GPU host
  # raises (the Triton plan names the shape) rather than silently not using Pallas.
  if triton_supports(k, v, cache, v_head_dim) or (impl == "pallas" and jax.default_backend() == "gpu"):
    gpu = lambda: triton(False)
  else:
    gpu = lambda: xla("gpu")
  if impl == "pallas":  # compiled for the lowering platform; CPU has only the interpreter
    cpu = lambda: triton(True)
  else:  # impl=None: XLA on CPU, Triton on GPU, Mosaic on TPU
    cpu = lambda: xla("cpu")
  gpu = _branch("gpu", gpu)
  return lax.platform_dependent(cpu=_branch("cpu", cpu), cuda=gpu, rocm=gpu, tpu=_branch("tpu", lambda: mosaic(False)))


_QUANT = ("k_scale", "k_offset", "v_scale", "v_offset")


def seq_capacity(k, block_tables):
  return k.shape[2] if block_tables is None else block_tables.shape[1] * k.shape[2]


def _xla(q_rows, k, v, ends, *, num_tokens, softmax_scale, cfg, platform, mods, token_major=None, **cache):
  """The XLA path: its plan (`fdecode.kernels.xla.plan.make_plan`), then its kernel;
  token-major caches are read in place, chunk by chunk (`xla_partials`)."""
  b, hkv = q_rows.shape[:2]
  tables = cache["block_tables"]
  if "sparse" in cache:  # the K selected tokens, in chunks
    p = xla_plan.make_plan(batch=b, kv_heads=hkv, tokens=cache["indices"].shape[-1], platform=platform,
                           sparse=True, num_splits=cfg.num_splits)
    _note(p)
    return sparse_partials(q_rows, k, v, ends, num_tokens=num_tokens, softmax_scale=softmax_scale,
                           num_splits=p.num_splits, mods=mods, **cache)
  s = window_tokens(seq_capacity(k, tables), num_tokens, mods, None if tables is None else k.shape[2])
  p = xla_plan.make_plan(
      batch=b, kv_heads=hkv, tokens=s, platform=platform, paged=tables is not None,
      quantized=cache["k_scale"] is not None or cache["v_scale"] is not None,
      kv_layout="HND" if token_major is None else "NHD", num_splits=cfg.num_splits,
      token_bytes=b * hkv * k.shape[-1] * jnp.dtype(k.dtype).itemsize)  # K of one position, all sequences
  _note(p)
  k, v, cache = _as_read(k, v, cache, token_major, p.kv_layout)
  return xla_partials(q_rows, k, v, ends, num_tokens=num_tokens, softmax_scale=softmax_scale,
                      num_splits=p.num_splits, mods=mods, kv_layout=p.kv_layout, **cache)


def _triton(q, k, v, ends, *, num_tokens, softmax_scale, cfg, interpret, token_major, compute, sinks, mods,
            v_head_dim, sparse=None, mask=None, bias=None, alibi=None, **cache):
  """The Triton path: its plan (`fdecode.kernels.triton.plan`: sized to the GPU lowered
  for; interpreted, the same plan), then its kernels. Token-major caches are read in place."""
  del num_tokens  # q's shape carries it
  layout = read_layout("HND" if token_major is None else "NHD", k.shape[0] if cache["block_tables"] is not None
                       else k.shape[1])
  k, v, cache = _as_read(k, v, cache, token_major, layout)
  if not interpret and _hopper_mla_takes(q, k, v, cache, mods, sinks, sparse, v_head_dim, mask, bias, alibi, cfg):
    return _hopper_mla(q, k, ends, softmax_scale=softmax_scale, num_splits=cfg.num_splits)
  indices = cache.get("indices")
  p = triton_plan(q.shape, k, v, compute_dtype=compute, out_dtype=q.dtype, kv_layout=layout,
                  block_tables=cache["block_tables"], k_rope=cache["k_rope"],
                  **{n: cache[n] for n in _QUANT}, v_head_dim=v_head_dim, mods=mods,
                  has_mask_or_bias=mask is not None or bias is not None, has_sinks=sinks is not None,
                  index_slots=None if sparse is None else indices.shape[-1],
                  sparse_fold=1 if sparse is None else sparse.fold, num_splits=cfg.num_splits,
                  block_k=cfg.block_k, balance=cfg.balance, interpret=interpret)
  _note(p)
  return triton_run(p, q, ends, k, v, softmax_scale=softmax_scale, mask=mask, bias=bias, alibi=alibi,
                    sinks=sinks, sparse=sparse, **cache)


def _hopper_mla_takes(q, k, v, cache, mods, sinks, sparse, v_head_dim, mask, bias, alibi, cfg) -> bool:
  """Whether the call goes to the Hopper MLA kernel (`fdecode.kernels.mosaic_gpu`): an
  sm_90 GPU lowered for, and a call it takes (bf16 MLA latents 576 / 512, one contiguous kv
  head, T = 1, G a multiple of 16, no scales, modifiers, sinks or index lists). Measured
  on an H200 (benchmarks/RESULTS.md): 2-8x faster than the Triton kernel at G 16 and 128."""
  if chips.lowering_gpu().capability != (9, 0) or cfg.balance:
    return False
  extras = (sinks is not None or sparse is not None or mask is not None or bias is not None
            or alibi is not None or cache["k_rope"] is not None or not mods.plain)
  return mosaic_gpu.unsupported(
      q_shape=q.shape, q_dtype=q.dtype, k_shape=k.shape, k_dtype=k.dtype, v_is_none=v is None,
      v_head_dim=v_head_dim, paged=cache["block_tables"] is not None,
      quantized=cache["k_scale"] is not None, modifiers=extras) is None


def _hopper_mla(q, k, ends, *, softmax_scale, num_splits):
  """MLA decode on the Hopper kernel, its split states merged by the Triton combine kernel
  (read in the Hopper kernel's layout): two kernels."""
  b, t, g, dk = q.shape
  p = mosaic_gpu.mla_plan(batch=b, num_tokens=t, group=g, seq_len=k.shape[2], softmax_scale=softmax_scale,
                          num_splits=num_splits)
  _note(p)
  o, lse = mosaic_gpu.mla_states(q.reshape(b, 1, t * g, dk), ends, k, plan=p)
  dv = o.shape[-1]
  cp = triton_kernels.CombinePlan(num_splits=p.num_splits, width=triton_kernels.combine_width(p.num_splits, dv),
                                  num_tokens=t, group=g, hq=g, dv=dv, out_dtype=q.dtype.name, split_major=True)
  out, out_lse = triton_kernels.combine(cp, o, lse)
  return out.reshape(b, t, g, dv), out_lse.reshape(b, t, g)


def _as_read(k, v, cache, token_major, layout):
  """The caches as a path reads them (``layout``, `fdecode.cache.layout.read_layout`):
  token-major ones as stored (``token_major``: k, v, k_rope), else the head-major views."""
  if layout == "HND":
    return k, v, cache
  k, v, rope = token_major
  return k, v, dict(cache, k_rope=rope)


def _mosaic(q_rows, k, v, ends, *, num_tokens, softmax_scale, cfg, interpret, token_major=None, **cache):
  """The Mosaic path: its plan (`fdecode.kernels.mosaic_tpu.plan.make_plan`), then its kernel."""
  p = mosaic_make_plan(q_rows, k, v, cache=cache, token_major=token_major, num_tokens=num_tokens,
                       num_splits=cfg.num_splits, block_k=cfg.block_k)
  _note(p)
  if p.backend == "xla":
    return _xla(q_rows, k, v, ends, num_tokens=num_tokens, softmax_scale=softmax_scale, cfg=cfg,
                platform="tpu", token_major=token_major, **cache)
  if p.upcast_query:  # Mosaic has no float16 vectors: a float16 query over another cache computes in float32
    q_rows = q_rows.astype(jnp.float32)
  kw = dict(num_tokens=num_tokens, softmax_scale=softmax_scale, interpret=interpret, num_splits=p.num_splits,
            plan=p.sizes)
  layout = {}
  if p.read is not None:  # token-major caches read in place
    k, v, rope = token_major
    cache = dict(cache, k_rope=rope)
    layout = dict(kv_layout="NHD", head_axis=p.read.axis) if p.sparse else dict(kv_layout="NHD", read=p.read)
    if p.as_pool:  # a contiguous cache as the pool of whole pages
      k, v, rope, quant, tables = mosaic_contiguous_as_pool(k, v, rope, tuple(cache[n] for n in _QUANT))
      cache = dict(cache, k_rope=rope, block_tables=tables, **dict(zip(_QUANT, quant)))
  if p.sparse:
    return mosaic_sparse.mosaic_sparse_partials(q_rows, ends, k, v, **kw, **layout, **cache)
  return mosaic_partials(q_rows, ends, k, v, **kw, **layout, **cache)


def triton_supports(k, v, cache, v_head_dim=None) -> bool:
  """Whether the compiled Triton kernel takes these shapes (see `triton_unsupported`)."""
  tiles = lambda sc: 1 if sc is None else sc.shape[-1]
  rope = cache["k_rope"]
  return triton_unsupported(k.shape[-1], v_head_dim if v is None else v.shape[-1], tiles(cache["k_scale"]),
                            tiles(cache["v_scale"]), v_from_k=v is None,
                            rope_dim=0 if rope is None else rope.shape[-1]) is None


def _materialize(x, tables, scale=None, offset=None):
  """Float32 contiguous ``[B, Hkv, S, D]`` copy of a cache (the reference's input)."""
  if tables is not None:
    page_size = x.shape[2]
    x = gather_pages(x, tables)
    scale = None if scale is None else gather_scale(scale, tables, page_size)
    offset = None if offset is None else gather_scale(offset, tables, page_size)
  if scale is None:
    return x.astype(jnp.float32)
  return dequantize(x, scale, offset)
