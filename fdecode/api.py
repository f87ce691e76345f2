"""Public entry points: validate, canonicalize, dispatch (the only place that picks a backend)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from fdecode import config as config_lib
from fdecode.cache.paged import gather_pages, gather_scale
from fdecode import modifiers
from fdecode import sparse as sparse_lib
from fdecode.combine import apply_sinks, merge_states
from fdecode.kernels.mosaic_tpu import mosaic_partials, plan as mosaic_plan
from fdecode.kernels import mosaic_tpu_sparse as mosaic_sparse
from fdecode.kernels.mosaic_tpu_plan import dma_unit as mosaic_dma_unit
from fdecode.kernels.triton import triton_partials, triton_unsupported
from fdecode.kernels.xla import window_tokens, xla_partials
from fdecode.kernels.xla_sparse import sparse_partials
from fdecode.quant import dequantize, is_quantized
from fdecode.reference import reference_decode
from fdecode.validation import (as_arrays, check_concrete_lengths, check_concrete_page_ids,
                                check_kv_offset, describe, static_scale, to_int32, validate_args,
                                validate_quant)

IMPLS = ("pallas", "xla", "reference")


def flash_decode(q, k, v, lengths, *, block_tables=None, k_scale=None, v_scale=None,
                 softmax_scale=None, num_splits=None, block_k=None, impl=None,
                 interpret=None, return_lse=False, k_offset=None, v_offset=None, kv_offset=None,
                 causal=True, mask=None, bias=None, alibi_slopes=None, window=None,
                 logits_soft_cap=None, sinks=None, v_head_dim=None, k_rope=None, indices=None):
  """FlashDecode attention of new tokens over a KV cache.

  Legend: B batch, T new tokens per sequence, Hq query heads, Hkv kv heads
  (``Hq % Hkv == 0``: MHA, GQA and MQA), S cache capacity, Dk key head dim,
  Dv value head dim.

  Array arguments may be Python lists (converted with numpy). Integers are used as int32:
  concrete values outside int32 raise ValueError (under ``jit`` wider integers are
  clipped into int32, never wrapped); static floats are used as float32 and checked there.

  Args:
    q: ``[B, Hq, Dk]`` (one new token per sequence) or ``[B, T, Hq, Dk]`` (the last T
      positions of each sequence, causal among themselves: query t attends to key
      positions ``< lengths - T + t + 1``). Floating dtype.
    k: ``[B, Hkv, S, Dk]`` head-major contiguous key cache, or with ``block_tables`` a
      paged pool ``[Hkv, P, page_size, Dk]``. Float, or int8 / float8_e4m3fn /
      float8_e5m2 with ``k_scale``.
    v: ``[B, Hkv, S, Dv]`` or ``[Hkv, P, page_size, Dv]``; Dv may differ from Dk. Or
      ``None`` (MLA, FlashMLA's ``head_dim_v``): the values are ``k[..., :v_head_dim]``,
      the first columns of the same cache, read once for both (never a second copy).
    lengths: int ``[B]`` valid tokens per sequence, new ones included, each in ``[0, S]``.
      Concrete values outside that range raise ValueError; under ``jit`` they are
      clipped to ``[0, S]``.
    block_tables: int ``[B, n]``: page j of sequence b is ``k[:, block_tables[b, j]]``
      (token t in page ``block_tables[b, t // page_size]``, slot ``t % page_size``);
      capacity ``S = n * page_size``. Entries past a sequence's length are never read
      and may hold anything. Concrete ids out of ``[0, P)`` for a live token raise
      ValueError; under ``jit`` ids are clipped into the pool (never an out-of-bounds read).
    k_scale, v_scale: required for 8-bit caches: a scalar (per tensor) or float32 shaped
      like the cache with the last axis replaced by ``n_tiles`` dividing the head dim
      (1 = per token per head, D/128 = 1x128 tiles); leading axes of size 1 broadcast.
      Dequantization happens after the load, inside the kernel (see `fdecode.quant`).
    k_offset, v_offset: optional, shaped like the scales: real = (x + offset) * scale.
    kv_offset: int scalar or int ``[B]``, default 0: the position in the sequence of the
      cache's first token, for a cache that is a chunk of a longer sequence (sequence
      parallelism, chunked caches). ``lengths`` then count the whole sequence (they may
      exceed S) and query t sees the chunk's tokens at positions
      ``< lengths - T + t + 1``; a sequence that ends before the chunk sees none of it.
    softmax_scale: scores multiplier, default ``1/sqrt(Dk)``. Static: a Python or numpy
      real number, compiled into the kernel (a traced value raises ValueError); as a
      float32, 0 or of magnitude in ``[2**-126, float32 max]``.
    num_splits: chunks of the token axis processed in parallel, each yielding a partial
      state merged by `merge_states`. ``None``: compiled Triton fills one wave of the GPU's
      SMs (`fdecode.config.gpu_num_splits`); elsewhere `fdecode.config.default_num_splits`.
      Any positive value gives the same result within float tolerance.
    block_k: tokens per block of the Pallas kernels' inner loop. Triton: rounded up to a
      power of two, at least 16 (default 128); compiled, an upper bound: the block shrinks
      until its tiles fit the GPU's registers and shared memory. Mosaic: rounded up to the cache dtype's
      sublane tiling, whole pages when paged (default: about 512 KiB of K+V per step).
    impl: ``"pallas"``, ``"xla"``, ``"reference"`` or ``None``. ``None`` chooses by the
      platform being lowered for: XLA on CPU, the Triton kernel on GPU, the Mosaic
      kernel on TPU. On GPU it falls back to XLA only where Triton's ``tl.dot`` cannot
      tile: a head dim, or an 8-bit scale tile, that is not a multiple of 16 (then
      ``impl="pallas"`` raises ValueError when traced on a GPU host, and a cross-platform
      export from another host embeds the XLA path for CUDA). On TPU, ``None`` and
      ``"pallas"`` take the XLA path for a paged cache whose page size splits a 32-bit
      sublane (bf16 page size 1; 8-bit page sizes not a multiple of 4), which no Mosaic
      DMA can address; libtpu compiles the kernel for every other shape fdecode takes.
    interpret: with ``impl="pallas"``: ``None`` / ``False`` compile the kernel for the
      lowering platform (Triton on GPU, Mosaic on TPU; CPU has only the interpreter and
      runs the Triton kernel interpreted); ``True`` runs the Triton kernel in Pallas'
      interpreter anywhere; a ``jax.experimental.pallas.tpu.InterpretParams`` runs the
      Mosaic (TPU) kernel under the TPU-semantics interpreter (simulated VMEM / SMEM,
      DMAs, semaphores, optional race detection), mirroring ``pallas_call``'s own
      ``interpret=``. Under ``pltpu.force_tpu_interpret_mode(params)``, ``None`` means
      ``params``.
    return_lse: also return the log-sum-exp of the scores.
    v_head_dim: static int Dv, required with ``v=None`` (``1 <= Dv <= k.shape[-1]``; DeepSeek
      MLA: 512 of a 576-wide latent key). With ``v`` given it must equal its head dim.
    k_rope: optional key-only columns appended after k's own, ``[B, Hkv, S, Dr]`` or
      ``[Hkv, P, page_size, Dr]`` (paged), float, never quantized: the logical key is
      ``concat(k, k_rope)`` of width ``Dk = k.shape[-1] + Dr`` (q's head dim) and the
      values never include them. FlashMLA's FP8 cache is ``k`` float8_e4m3fn
      ``[..., 512]`` with ``k_scale [..., 4]`` (1x128 tiles) plus ``k_rope`` bfloat16
      ``[..., 64]``: 656 bytes per token (`fdecode.quant` documents the layout).
    indices: sparse top-k attention (DeepSeek V3.2): int ``[B, K]`` (shared by the T new
      tokens), ``[B, T, K]`` (per token) or ``[B, T, Hkv, K]`` (per token and kv head;
      with a single-token q: ``[B, K]`` or ``[B, Hkv, K]``): the sequence positions each
      query may attend to, -1 = none. Only those tokens are read (gathered per block,
      through the block table when paged). Positions outside the cache, at or past the
      length, or hidden by causality / the window are masked; duplicates count once.
      Not combinable with ``mask`` / ``bias``. ``K = 0`` selects nothing (out 0, lse -inf).
      Exact semantics: `fdecode.sparse`. On TPU
      the kernel DMAs each token's 32-bit sublane (2 rows of a 16-bit cache, 4 of an
      8-bit one: the finest row Mosaic addresses); a cache whose length (contiguous) or
      page size (paged) is not a multiple of that takes the XLA path instead (so does
      any paged cache on TPU with such pages, e.g. page size 1 of bf16).

  Score modifiers (all off by default; exact semantics in `fdecode.modifiers`). With
  ``p = lengths - T + t`` the position of query t and ``j`` a key position:
    causal: bool, default True: with T > 1, query t sees keys ``j <= p``; False lets
      every new token see all ``lengths`` keys (tree / cross attention). With T = 1 both
      are the same and either is accepted.
    mask: bool, True = may attend, ``[B, S]``, ``[B, T, S]`` or ``[B, T, Hq, S]``
      (leading axes may be 1), ANDed with lengths, causality and window. S is the cache
      capacity (a paged table's ``n * page_size``, logical positions). Read per block;
      never expanded to ``[B, T, Hq, S]``.
    bias: float, additive, same forms as ``mask`` (Ascend's ``pse``).
    alibi_slopes: float ``[Hq]``: adds ``slope * (j - p)`` (FlashAttention / vLLM),
      computed in the kernel.
    window: static int in ``[1, 2**31 - 1]``: sliding window, query p sees keys ``p - window < j <= p``
      (Mistral / Gemma: the window counts the query's own position). Blocks wholly
      outside the window are not read. (With ``causal=False`` the upper bound is the
      sequence end.)
    logits_soft_cap: static float in ``[2**-126, 2**100]``: ``s = cap * tanh(s / cap)``
      after ``softmax_scale``, before bias, ALiBi and masking (Gemma 2). The kernels
      compute ``s * (1 / cap)`` in float32; the bounds keep cap and 1 / cap normal and
      that product exact to float32's resolution (a larger cap is a no-op anyway).
    sinks: float ``[Hq]`` learned sink logits (gpt-oss): ``exp(sink)`` joins each row's
      softmax denominator, with no value, exactly once after every split is merged. The
      returned lse includes it (a row that sees no key gives out 0, lse = sink); to
      merge partial results yourself, compute them without sinks, merge, then call
      `fdecode.combine.apply_sinks` once.

  Dtypes: the matmuls read q's dtype promoted with every float cache's dtype (8-bit
  caches are dequantized to q's dtype); softmax and accumulation are float32. So a
  float32 query on a bfloat16 cache is never rounded to bfloat16, on any impl.

  Dead slots: a cache slot no query may see (past a length, the tail of a sequence's
  last page, table entries past its length, their 8-bit scales and offsets) never
  influences the result, whatever it holds (inf and NaN included): every impl selects
  it away rather than multiplying it by 0.

  Returns:
    ``out`` shaped like ``q`` with last dim Dv, dtype ``q.dtype``; with ``return_lse``
    also ``lse``: float32 natural-log ``[B, Hq]`` or ``[B, T, Hq]``. A query that sees
    no key (length 0) gives out 0 and lse -inf. B = 0 or T = 0 gives empty results.

  Raises:
    ValueError: at trace time, for inconsistent shapes or dtypes (the message names the
      argument and shows the shapes), a zero head dim, a bad option (a mask that is not
      boolean or does not broadcast, a window or soft cap out of its range, a scale that
      is not a finite float32, slopes or sinks not ``[Hq]``), concrete lengths / page ids
      / integers out of range (int32 included); with ``impl="pallas"`` compiled for GPU,
      for head dims the Triton kernel cannot tile (see ``impl``).
    TypeError: an array argument that is neither an array nor a rectangular list of
      numbers.
  """
  (q, k, v, lengths, block_tables, k_scale, v_scale, k_offset, v_offset, kv_offset, mask, bias,
   alibi_slopes, sinks, k_rope, indices) = as_arrays(
       q=q, k=k, v=v, lengths=lengths, block_tables=block_tables, k_scale=k_scale, v_scale=v_scale,
       k_offset=k_offset, v_offset=v_offset, kv_offset=kv_offset, mask=mask, bias=bias,
       alibi_slopes=alibi_slopes, sinks=sinks, k_rope=k_rope, indices=indices)
  single_token, dv = validate_args(q, k, v, lengths, block_tables, v_head_dim=v_head_dim, k_rope=k_rope)
  k_scale, k_offset = validate_quant("k", k, k_scale, k_offset)
  if v is None and (v_scale is not None or v_offset is not None):
    raise ValueError("flash_decode: v_scale / v_offset given with v=None: the values are k's first "
                     "v_head_dim columns and use k_scale / k_offset")
  v_scale, v_offset = (None, None) if v is None else validate_quant("v", v, v_scale, v_offset)
  if impl is not None and impl not in IMPLS:
    raise ValueError(f"flash_decode: impl must be one of {IMPLS} or None, got {describe(impl)}")
  if not (interpret is None or isinstance(interpret, (bool, np.bool_, pltpu.InterpretParams))):
    raise ValueError("flash_decode: interpret must be None, a bool or a "
                     f"jax.experimental.pallas.tpu.InterpretParams, got {describe(interpret)}")
  if isinstance(interpret, pltpu.InterpretParams) and impl != "pallas":
    raise ValueError(f"flash_decode: interpret=InterpretParams(...) runs the TPU Pallas kernel: "
                     f"pass impl='pallas' (got impl={describe(impl)})")
  if impl == "pallas" and interpret is None:
    interpret = _forced_tpu_interpret()
  if isinstance(interpret, np.bool_):
    interpret = bool(interpret)
  cfg = config_lib.Config(num_splits=num_splits, block_k=block_k).bounded(
      max(_seq_capacity(k, block_tables), 0 if indices is None else np.shape(indices)[-1]))
  scale = static_scale(softmax_scale, q.shape[-1])
  check_concrete_lengths(lengths, None if kv_offset is not None else _seq_capacity(k, block_tables))
  if kv_offset is not None:
    check_kv_offset(kv_offset, lengths, q.shape[0])
  if block_tables is not None:
    check_concrete_page_ids(block_tables, lengths, k.shape[1], k.shape[2],
                             num_tokens=1 if single_token else q.shape[1], window=window)
  q4 = q[:, None] if single_token else q
  hkv = k.shape[0] if block_tables is not None else k.shape[1]
  mods, mod_arrays, sinks = modifiers.canonicalize(
      q4.shape, hkv, _seq_capacity(k, block_tables), causal=causal, mask=mask, bias=bias,
      alibi_slopes=alibi_slopes, sinks=sinks, window=window, logits_soft_cap=logits_soft_cap)
  if indices is not None:
    indices = sparse_lib.validate(indices, q.shape, hkv, mods=mods, has_mask=mask is not None,
                                  has_bias=bias is not None)
  cache = dict(block_tables=None if block_tables is None else to_int32(block_tables),
               k_scale=k_scale, v_scale=v_scale, k_offset=k_offset, v_offset=v_offset,
               k_rope=None if k_rope is None else jnp.asarray(k_rope))
  # The kernels take each sequence's end relative to the cache's first token.
  ends = to_int32(lengths)
  if kv_offset is not None:
    kv_offset = to_int32(kv_offset)
    ends = ends - kv_offset
  if q4.shape[0] == 0 or q4.shape[1] == 0:  # no sequence or no new token: nothing to attend
    out = jnp.zeros(q4.shape[:-1] + (dv,), q.dtype)
    lse = jnp.full(q4.shape[:-1], -jnp.inf, jnp.float32)
  else:
    b, t = q4.shape[:2]
    sparse = None
    if indices is not None:
      q4, ends, sparse = _sparse_setup(q4, ends, indices, cache, kv_offset, _seq_capacity(k, block_tables), mods)
    out, lse = _decode(q4, k, v, ends, cache, mod_arrays, sinks, impl=impl, softmax_scale=scale,
                       cfg=cfg, interpret=interpret, mods=mods, v_head_dim=None if v is not None else dv,
                       sparse=sparse)
    out, lse = out.reshape(b, t, *out.shape[2:]), lse.reshape(b, t, -1)  # undo a sparse fold
  if single_token:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out


def _sparse_setup(q4, ends, indices, cache, kv_offset, seq_capacity, mods):
  """Canonical index lists into ``cache`` (`fdecode.sparse.canonicalize`); per-token lists
  fold the T new tokens into the batch: q ``[B*T, 1, Hq, Dk]``, one end per token, a paged
  table repeated per token (contiguous caches are read at row ``b' // fold``)."""
  sparse, cache["indices"], cache["index_bounds"], ends = sparse_lib.canonicalize(
      indices, ends, 0 if kv_offset is None else kv_offset, seq_capacity, q4.shape[1], mods)
  if sparse.fold > 1:
    b, t = q4.shape[:2]
    q4 = q4.reshape(b * t, 1, *q4.shape[2:])
    if cache["block_tables"] is not None:
      cache["block_tables"] = jnp.repeat(cache["block_tables"], t, axis=0)
      sparse = dataclasses.replace(sparse, fold=1)
  return q4, ends, sparse


def _forced_tpu_interpret():
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
                                             "v_head_dim", "sparse"))
def _decode(q, k, v, ends, cache, mod_arrays, sinks, *, impl, softmax_scale, cfg, interpret, mods,
            v_head_dim, sparse):
  """q ``[B, T, Hq, Dk]`` -> (out ``[B, T, Hq, Dv]`` in q.dtype, lse f32 ``[B, T, Hq]``).

  ``cache``: dict of block_tables, canonical scales / offsets and k_rope (None when absent).
  ``v`` None: the values are ``k[..., :v_head_dim]`` (MLA). ``sparse`` (`fdecode.sparse.Sparse`):
  ``cache`` holds canonical ``indices`` / ``index_bounds`` and q row b' reads cache row
  ``b' // sparse.fold``.
  ``mods`` / ``mod_arrays``: the score modifiers (`fdecode.modifiers.canonicalize`);
  ``sinks`` (f32 ``[Hq]`` or None) join the softmax once, after the merge.
  The one dispatch: by the platform being *lowered for* (`jax.lax.platform_dependent`),
  so exporting for TPU or CUDA from a CPU host embeds that platform's kernel.
  """
  b, t, hq, dk = q.shape
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
  # Rows of one kv head: r = t * G + g, in the compute dtype.
  rope = cache["k_rope"]
  cd = compute_dtype(q.dtype, k.dtype, None if v is None else v.dtype, None if rope is None else rope.dtype)
  q_rows = q.reshape(b, t, hkv, g, dk).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, dk).astype(cd)
  kw = dict(num_tokens=t, softmax_scale=softmax_scale, cfg=cfg, mods=mods, v_head_dim=v_head_dim,
            **cache, **mod_arrays)
  if sparse is not None:
    kw["sparse"] = sparse

  # Each path yields per-split states, merged in-branch (the branches' split counts differ).
  merged = lambda states: merge_states(*states, axis=2)  # [B, Hkv, R, Dv], [B, Hkv, R]
  xla = lambda platform: merged(_xla(q_rows, k, v, ends, platform=platform, **kw))
  triton = lambda platform, interp: merged(
      _triton(q_rows, k, v, ends, platform=platform, interpret=interp, **kw))
  mosaic = lambda interp: merged(_mosaic(q_rows, k, v, ends, interpret=interp, **kw))
  if impl == "xla":  # explicitly asked for, on whatever host traces it
    o, lse = xla(jax.default_backend())
  elif isinstance(interpret, pltpu.InterpretParams):
    o, lse = mosaic(interpret)
  elif impl == "pallas" and interpret:
    o, lse = triton("cpu", True)
  else:
    # platform_dependent traces every branch and lowers only the target's. A shape Triton
    # cannot tile gets the XLA path on GPU, except that impl="pallas" traced on a GPU host
    # raises (triton_partials names the shape) rather than silently not using Pallas.
    if triton_supports(k, v, cache, v_head_dim) or (impl == "pallas" and jax.default_backend() == "gpu"):
      gpu = lambda: triton("gpu", False)
    else:
      gpu = lambda: xla("gpu")
    if impl == "pallas":  # compiled for the lowering platform; CPU has only the interpreter
      cpu = lambda: triton("cpu", True)
    else:  # impl=None: XLA on CPU, Triton on GPU, Mosaic on TPU
      cpu = lambda: xla("cpu")
    o, lse = lax.platform_dependent(cpu=cpu, cuda=gpu, rocm=gpu, tpu=lambda: mosaic(False))
  dv = o.shape[-1]
  out = o.reshape(b, hkv, t, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, dv)
  lse = lse.reshape(b, hkv, t, g).transpose(0, 2, 1, 3).reshape(b, t, hq)
  if sinks is not None:  # once, after every split is merged
    out, lse = apply_sinks(out, lse, sinks)
  return out.astype(q.dtype), lse


def _seq_capacity(k, block_tables):
  return k.shape[2] if block_tables is None else block_tables.shape[1] * k.shape[2]


def _xla(q_rows, k, v, ends, *, num_tokens, softmax_scale, cfg, platform, mods, **cache):
  b, hkv = q_rows.shape[:2]
  tables = cache["block_tables"]
  if "sparse" in cache:  # the K selected tokens, in chunks of about XLA_CHUNK_TOKENS
    kk = cache["indices"].shape[-1]
    splits = cfg.num_splits or max(1, kk // config_lib.XLA_CHUNK_TOKENS)
    return sparse_partials(q_rows, k, v, ends, num_tokens=num_tokens, softmax_scale=softmax_scale,
                           num_splits=splits, mods=mods, **cache)
  s = window_tokens(_seq_capacity(k, tables), num_tokens, mods, None if tables is None else k.shape[2])
  splits = cfg.num_splits or _xla_default_splits(b, hkv, s, cache, platform)
  return xla_partials(q_rows, k, v, ends, num_tokens=num_tokens, softmax_scale=softmax_scale,
                      num_splits=splits, mods=mods, **cache)


def _triton(q_rows, k, v, ends, *, num_tokens, softmax_scale, cfg, platform, interpret, **cache):
  # The kernel sizes its block and splits to the GPU lowered for (`triton.launch_plan`).
  return triton_partials(q_rows, ends, k, v, num_tokens=num_tokens, softmax_scale=softmax_scale,
                         num_splits=cfg.num_splits, block_k=cfg.block_k or config_lib.DEFAULT_BLOCK_K,
                         interpret=interpret, **cache)


def _mosaic(q_rows, k, v, ends, *, num_tokens, softmax_scale, cfg, interpret, **cache):
  b, hkv = q_rows.shape[:2]
  unit = mosaic_dma_unit(k, v, cache["k_rope"])
  if ("sparse" in cache or cache["block_tables"] is not None) and k.shape[2] % unit:
    # Pages (or sparse rows) that split a 32-bit sublane: no DMA can address them.
    return _xla(q_rows, k, v, ends, num_tokens=num_tokens, softmax_scale=softmax_scale, cfg=cfg,
                platform="tpu", **cache)
  if "sparse" in cache:  # blocks of index-list slots, each token DMA'd on its own
    slots = cache["indices"].shape[-1]
    plan_args = {n: x for n, x in cache.items() if n not in ("sparse", "indices", "index_bounds")}
    p = mosaic_plan(q_rows, k, v, block_k=cfg.block_k, num_slots=slots,
                    slot_rows=unit, **plan_args)
    splits = cfg.num_splits or config_lib.default_num_splits(
        b, hkv, max(-(-slots // p.block), 1), config_lib.num_parallel_units("tpu"))
    return mosaic_sparse.mosaic_sparse_partials(q_rows, ends, k, v, num_tokens=num_tokens, softmax_scale=softmax_scale,
                                  num_splits=splits, plan=p, interpret=interpret, **cache)
  p = mosaic_plan(q_rows, k, v, block_k=cfg.block_k, **cache)
  seen = window_tokens(_seq_capacity(k, cache["block_tables"]), num_tokens, cache["mods"])
  num_blocks = max(-(-seen // p.block), 1)
  splits = cfg.num_splits or config_lib.default_num_splits(
      b, hkv, num_blocks, config_lib.num_parallel_units("tpu"))
  return mosaic_partials(q_rows, ends, k, v, num_tokens=num_tokens, softmax_scale=softmax_scale,
                         num_splits=splits, plan=p, interpret=interpret, **cache)


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


def _xla_default_splits(b, hkv, s, cache, backend):
  """The XLA path's split count: the parallelism heuristic, raised to chunks of about
  `config.XLA_CHUNK_TOKENS` tokens (one chunk's scores, or its gathered / dequantized
  pages, stay cache-sized: 0.50 of the floor at S=16384 on a 2-core CPU vs 0.38 unsplit,
  benchmarks/RESULTS.md). Contiguous float caches round down to a divisor of S so that
  the split stays a free reshape."""
  n = config_lib.default_num_splits(b, hkv, max(s, 1), config_lib.num_parallel_units(backend))
  n = max(n, s // config_lib.XLA_CHUNK_TOKENS)
  if cache["block_tables"] is None and cache["k_scale"] is None and cache["v_scale"] is None:
    return config_lib.largest_divisor_at_most(s, n)
  return max(n, 1)


