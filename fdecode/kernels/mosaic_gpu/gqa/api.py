"""`rows_decode`: the opt-in entry point of the Hopper GQA rows kernel (not in the default
dispatch: `fdecode.flash_decode` keeps the Triton kernel on GPU until a GPU measures this
path faster). A call is three launches: q's rows laid out and padded (one XLA fusion), the
rows kernel, and the Triton combine kernel, which merges the splits and writes each row
at its query head's place. More where an operand is prepared per call: a contiguous cache
whose S is not a multiple of 8 or is under 64 is copied padded; an 8-bit pool's scales at
page size 8 or 16 are gathered through the table, and per-head or per-tensor scales of a
pool are broadcast to one per token. Paged pools are read in place through the block table (no
per-call copy of the cache: `fdecode.kernels.mosaic_gpu.gqa.paging`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fdecode.cache.tables import check_concrete_page_ids
from fdecode.cache.quant import per_token_scale
from fdecode.kernels.mosaic_gpu import ops
from fdecode.kernels.mosaic_gpu.gqa.kernel import rows_states
from fdecode.kernels.mosaic_gpu.gqa.plan import RowsPlan, rows_plan, rows_unsupported
from fdecode.validation import as_array, check_concrete_lengths, static_scale, to_int32

_CALLER = "rows_decode"


def _check_tables(block_tables, b, lengths, k_shape, num_tokens):
  """int32 ``[B, n]`` block tables (concrete ids a live token needs checked in the pool)."""
  shape = np.shape(block_tables)
  if len(shape) != 2 or shape[0] != b or not jnp.issubdtype(block_tables.dtype, jnp.integer):
    raise ValueError(f"{_CALLER}: block_tables must be integer [B, n] with B={b}, got shape {shape}, "
                     f"dtype {block_tables.dtype}")
  _, num_pages, page_size, _ = k_shape
  check_concrete_lengths(lengths, shape[1] * page_size, _CALLER)
  check_concrete_page_ids(block_tables, lengths, num_pages, page_size, num_tokens=num_tokens, caller=_CALLER)
  return to_int32(block_tables)


def rows_decode(q, k, v, lengths, *, block_tables=None, k_scale=None, v_scale=None, softmax_scale=None,
                num_splits=None, return_lse=False, interpret=None):
  """GQA decode of T new tokens over a contiguous or paged cache on Hopper (TMA + wgmma,
  Mosaic GPU).

  The same result as ``flash_decode(q, k, v, lengths, block_tables=, k_scale=, v_scale=)`` (within
  bfloat16 tolerance). Each program of the kernel takes 64 query rows (T new tokens x G
  query heads of one kv head), so the tensor cores pay where ``T * G >= 64``. Legend:
  B batch, T new tokens, Hq query heads, Hkv kv heads, G = Hq / Hkv, S cache capacity, D
  head dim, P pages in a pool, n table columns.

  Args:
    q: bf16 ``[B, Hq, D]`` (T = 1) or ``[B, T, Hq, D]``: the last T positions of each
      sequence, causal among themselves (token t sees keys ``< lengths - T + t + 1``).
    k, v: ``[B, Hkv, S, D]`` head-major contiguous caches, or with ``block_tables``
      paged pools ``[Hkv, P, page_size, D]`` (page_size 8, 16, 32 or a multiple of 64:
      `rows_unsupported`), read in place; D in 64 / 128 / 256, Hkv dividing Hq: bf16, or
      both int8 or both float8_e4m3fn with scales.
    lengths: int ``[B]`` valid tokens per sequence, new ones included, in ``[0, S]``
      (paged: S = n * page_size; concrete values outside raise ValueError; traced ones
      are clipped).
    block_tables: int ``[B, n]`` or None: token t of sequence b is in page
      ``block_tables[b, t // page_size]``, slot ``t % page_size`` (`fdecode.flash_decode`).
      Entries past a sequence's length are never dereferenced and may hold anything;
      concrete ids out of ``[0, P)`` for a live token raise ValueError, traced ones are
      clipped into the pool.
    k_scale, v_scale: for 8-bit caches, float32 per-token scales ``[B, Hkv, S, 1]``,
      paged ``[Hkv, P, page_size, 1]`` (or broadcastable: per head ``[1, Hkv, 1, 1]``,
      paged ``[Hkv, 1, 1, 1]``; a scalar per tensor); the real key is ``k * k_scale`` (`fdecode.cache.quant`).
      None for bf16.
    softmax_scale: static float, default ``1 / sqrt(D)``.
    num_splits: None (fill the GPU's SMs) or a positive int.
    return_lse: also return the natural-log LSE, float32 ``[B, (T,) Hq]``.
    interpret: None / False: compiled for the GPU; a Mosaic GPU ``InterpretGPUParams``:
      the kernel on CPU under jax's Mosaic GPU interpreter.

  Returns:
    out ``[B, (T,) Hq, D]`` bf16 (and lse): a row with no visible key gives 0 (lse
    -inf). A NaN key, value or scale, a NaN or +inf score, or an inf value that a row
    sees makes every column of that row's out and its lse NaN (docs/semantics.md
    "Corruption a query sees propagates"), and only that row's; slots a row does not
    see never reach it, whatever they hold.

  Raises:
    ValueError: what the kernel does not take (`rows_unsupported` names why), scales
      or tables of the wrong shape, concrete lengths outside ``[0, S]`` or concrete
      page ids a live token needs outside ``[0, P)``.
  """
  q, k, v, lengths = (as_array(n, x, _CALLER) for n, x in (("q", q), ("k", k), ("v", v), ("lengths", lengths)))
  scales = k_scale is not None or v_scale is not None
  paged = block_tables is not None
  reason = rows_unsupported(q_shape=q.shape, q_dtype=q.dtype, k_shape=k.shape, k_dtype=k.dtype, v_shape=v.shape,
                            v_dtype=v.dtype, scales=scales, paged=paged)
  if reason:
    raise ValueError(f"{_CALLER}: {reason}")
  if scales and (k_scale is None or v_scale is None):
    raise ValueError(f"{_CALLER}: an 8-bit cache needs both k_scale and v_scale, got only "
                     f"{'k_scale' if v_scale is None else 'v_scale'}")
  single = q.ndim == 3
  q4 = q[:, None] if single else q
  b, t, hq, d = q4.shape
  if np.shape(lengths) != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{_CALLER}: lengths must be integer [B] with B={b}, got shape {np.shape(lengths)}, "
                     f"dtype {lengths.dtype}")
  if paged:
    block_tables = _check_tables(as_array("block_tables", block_tables, _CALLER), b, lengths, k.shape, t)
    hkv, s, page_size = k.shape[0], block_tables.shape[1] * k.shape[2], k.shape[2]
  else:
    _, hkv, s, _ = k.shape
    page_size = None
    check_concrete_lengths(lengths, s, _CALLER)
  if scales:
    # rank 4, size-1 axes kept: `fdecode.kernels.mosaic_gpu.gqa.paging.operands` broadcasts or gathers them
    k_scale = per_token_scale(k_scale, k.shape, "k_scale", _CALLER, broadcast=False)
    v_scale = per_token_scale(v_scale, v.shape, "v_scale", _CALLER, broadcast=False)
  g = hq // hkv
  plan = rows_plan(batch=b, kv_heads=hkv, num_tokens=t, group=g, head_dim=d, seq_len=s,
                   softmax_scale=static_scale(softmax_scale, d, _CALLER), cache_dtype=k.dtype,
                   num_splits=num_splits, page_size=page_size)
  out, lse = rows_run(plan, q4, to_int32(lengths), k, v, k_scale, v_scale, block_tables=block_tables,
                      interpret=interpret)
  return ops.outputs(out, lse, single=single, return_lse=return_lse)


def rows_run(plan: RowsPlan, q, ends, k, v, k_scale=None, v_scale=None, *, block_tables=None, interpret=None):
  """Run ``plan``: q's rows laid out, the Hopper rows kernel, its split states merged by the
  Triton combine kernel (interpreted where the rows kernel is), which writes each row at
  its query head's place. `rows_decode` and ``flash_decode(impl="mosaic_gpu")`` both run this.

  Args:
    plan: `rows_plan` for these shapes.
    q: bf16 ``[B, T, Hq, D]``.
    ends: int32 ``[B]`` lengths, in ``[0, S]``.
    k, v, block_tables: `rows_decode`'s (tables int32).
    k_scale, v_scale: per-token scales, rank 4 (`rows_decode`'s after
      ``per_token_scale(..., broadcast=False)``), or None for bf16.
    interpret: as `rows_decode`'s.

  Returns:
    ``(out [B, T, Hq, D] in q.dtype, lse float32 [B, T, Hq])``.
  """
  b, t, hq, d = q.shape
  hkv, g = plan.kv_heads, plan.group
  # rows r = t * G + g of kv head h: query head h * G + g of token t
  q_rows = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
  o, lse = rows_states(q_rows, ends, k, v, k_scale, v_scale, block_tables=block_tables, plan=plan,
                       interpret=interpret)
  # [B, Hkv, n_splits, R_p(, D)] -> out [B, T, Hq, D] in q's head order
  return ops.combine(o, lse, batch=b, num_tokens=t, group=g, hq=hq, out_dtype=q.dtype, interpret=interpret)
