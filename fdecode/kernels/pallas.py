"""FlashDecode split-KV Pallas kernel (contiguous or paged, float or 8-bit caches).

Grid ``(B, Hkv, n_splits)``. One program owns one kv head of one sequence and one
contiguous range of cache blocks; the R = T*G query rows of that kv head are the rows
of its matmuls (heads packed into the row dimension, as in Tenstorrent's sdpa_decode),
so every cache byte is read once. Inside a split the program runs an online softmax
over blocks and writes one normalized partial state (o, lse) per row; `merge_states`
combines the splits.

Blocks. Contiguous cache: ``block_k`` tokens; block j covers tokens
``[j*block_k, (j+1)*block_k)`` but is *loaded* from ``min(j*block_k, S - block_k)`` and
positions before ``j*block_k`` are masked, so a tail needs no padding of the cache.
Paged cache: one page per block, found through the block table (ids clipped to the pool,
so a stale or -1 entry can never cause an out-of-bounds read). The loop runs only over
blocks below the sequence's length: splits and blocks past it do no work and load
nothing. 8-bit blocks are dequantized right after the load (`fdecode.quant.dequantize`);
the cache is never dequantized in memory.

Everything backend-specific (row padding, compiler params) sits in `_backend_spec`;
the kernel body is shared by interpret mode (CPU tests), GPU (Triton) and TPU (Mosaic).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from fdecode.combine import MASK_VALUE, finalize_state
from fdecode.quant import dequantize



@dataclasses.dataclass(frozen=True)
class _BackendSpec:
  row_multiple: int  # pad the R query rows to a multiple of this (tensor-core M tile)
  compiler_params: Any
  pow2_blocks: bool = False  # every block dim must be a power of two (Triton)


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def gpu_lowerable(dk: int, dv: int, block: int) -> bool:
  """Whether the Triton lowering accepts these head dims and block (page) size: Triton
  tensors must have power-of-two sizes (checked by lowering from CPU, tests/test_gpu_lowering.py)."""
  return _is_pow2(dk) and _is_pow2(dv) and _is_pow2(block)


def _backend_spec(backend: str, interpret: bool) -> _BackendSpec:
  """The one place that knows what each Pallas backend needs."""
  if interpret:
    return _BackendSpec(row_multiple=1, compiler_params=None)
  if backend == "gpu":
    from jax.experimental.pallas import triton as plgpu
    return _BackendSpec(row_multiple=16, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
                        pow2_blocks=True)
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return _BackendSpec(row_multiple=8, compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel")))
  raise ValueError(f"impl='pallas' has no compiled lowering for backend {backend!r}; pass interpret=True")


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static description of the cache the kernel reads."""
  paged: bool
  block: int        # tokens per block (page_size when paged)
  rows: int         # k_ref rows (contiguous: >= block) or pool pages (paged)
  k_quant: tuple    # (has_scale, has_offset) for K
  v_quant: tuple    # (has_scale, has_offset) for V


def _load_scale(ref, layout, start, page):
  """Scale (or offset) rows for one block: [block|1, n_tiles]."""
  if layout.paged:  # ref: [P|1, ps|1, nt]
    return ref[page if ref.shape[0] > 1 else 0]
  if ref.shape[0] == 1:  # ref: [S|1, nt]
    return ref[...]
  return ref[pl.ds(start, layout.block), :]


def _split_kernel(*refs, layout: _Layout, softmax_scale, blocks_per_split, num_rows, group,
                  num_tokens, seq_len):
  # refs: end i32[1] (lengths - kv_offset), [table i32[n]], q [Rp, Dk], k, v, [k_scale], [k_offset],
  #       [v_scale], [v_offset], o f32[Rp, Dv], lse f32[Rp]
  refs = list(refs)
  lengths_ref = refs.pop(0)
  table_ref = refs.pop(0) if layout.paged else None
  q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  kq = [refs.pop(0) if present else None for present in layout.k_quant[:2]]
  vq = [refs.pop(0) if present else None for present in layout.v_quant[:2]]
  o_ref, lse_ref = refs
  split = pl.program_id(2)
  rows_p = q_ref.shape[0]
  dv = v_ref.shape[-1]
  bk = layout.block
  # The sequence's end relative to this cache (may exceed S when the cache is a chunk of
  # a longer sequence, or be negative when the sequence ends before the chunk).
  end = lengths_ref[0]
  q = q_ref[...]
  compute_dtype = q.dtype

  # Row r is query token t = r // G: it sees positions < length - T + t + 1.
  rows = lax.broadcasted_iota(jnp.int32, (rows_p, 1), 0)
  row_limit = jnp.clip(end - num_tokens + 1 + rows // group, 0, seq_len)
  row_limit = jnp.where(rows < num_rows, row_limit, 0)  # [Rp, 1]

  first = split * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, pl.cdiv(jnp.clip(end, 0, seq_len), bk))

  def load(ref, quant, start, page):
    if layout.paged:
      x = ref[page]  # [ps, D]
    else:
      x = ref[pl.ds(start, bk), :]
    scale_ref, offset_ref = quant
    if scale_ref is None:
      return x
    offset = None if offset_ref is None else _load_scale(offset_ref, layout, start, page)
    return dequantize(x, _load_scale(scale_ref, layout, start, page), offset, compute_dtype)

  def body(j, carry):
    acc, m, l = carry
    start = j * bk
    if layout.paged:
      page = jnp.clip(table_ref[j], 0, layout.rows - 1)
      load_start = start
    else:
      page = None
      load_start = jnp.minimum(start, layout.rows - bk)
    kb = load(k_ref, kq, load_start, page)
    vb = load(v_ref, vq, load_start, page)
    s = lax.dot_general(q, kb.astype(compute_dtype), (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32)
    s = s * softmax_scale  # [Rp, bk]
    pos = load_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    valid = (pos >= start) & (pos < row_limit)
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    vb = vb.astype(compute_dtype)
    pv = lax.dot_general(p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return alpha * acc + pv, m_new, l_new

  init = (jnp.zeros((rows_p, dv), jnp.float32),
          jnp.full((rows_p, 1), MASK_VALUE, jnp.float32),
          jnp.zeros((rows_p, 1), jnp.float32))
  acc, m, l = lax.fori_loop(first, last, body, init)
  o, lse = finalize_state(acc, m[:, 0], l[:, 0])
  o_ref[...] = o
  lse_ref[...] = lse


def _scale_spec(scale, paged):
  """BlockSpec for a canonical rank-4 scale; axes of size 1 broadcast (index 0)."""
  d0, d1, d2, nt = scale.shape
  if paged:  # [Hkv|1, P|1, ps|1, nt]: the whole pool of this kv head
    return pl.BlockSpec((None, d1, d2, nt), lambda i, h, j: (h if d0 > 1 else 0, 0, 0, 0))
  return pl.BlockSpec((None, None, d2, nt),
                      lambda i, h, j: (i if d0 > 1 else 0, h if d1 > 1 else 0, 0, 0))


def pallas_partials(q_rows, k, v, lengths, *, num_tokens: int, softmax_scale: float,
                    num_splits: int, block_k: int, interpret: bool, backend: str,
                    block_tables=None, k_scale=None, v_scale=None, k_offset=None, v_offset=None):
  """Per-split partial states from the Pallas kernel.

  Args:
    q_rows: ``[B, Hkv, R, Dk]`` queries, row r = t * G + g.
    k, v: contiguous ``[B, Hkv, S, D]`` or, with ``block_tables`` int32 ``[B, n]``, paged
      ``[Hkv, P, page_size, D]``; float or 8-bit with canonical rank-4 scales/offsets.
    lengths: int32 ``[B]``.
    num_tokens: T (rows are T groups of G).
    block_k: tokens per block (contiguous only; a paged block is one page).

  Returns:
    ``(o, lse)``: float32 ``[B, Hkv, n, R, Dv]`` and ``[B, Hkv, n, R]``.
  """
  b, hkv, r, dk = q_rows.shape
  dv = v.shape[-1]
  spec = _backend_spec(backend, interpret)
  paged = block_tables is not None
  if paged:
    block = k.shape[2]
    seq_len = block_tables.shape[1] * block
    rows = k.shape[1]
  else:
    seq_len = k.shape[2]
    block = block_k
    if seq_len < block:  # a cache shorter than one block: pad it (cheap: < block_k tokens)
      pad = [(0, 0), (0, 0), (0, block - seq_len), (0, 0)]
      k, v = jnp.pad(k, pad), jnp.pad(v, pad)
      k_scale, v_scale, k_offset, v_offset = (
          a if a is None or a.shape[2] == 1 else jnp.pad(a, pad)
          for a in (k_scale, v_scale, k_offset, v_offset))
    rows = k.shape[2]
  if spec.pow2_blocks and not gpu_lowerable(dk, dv, block):
    raise ValueError(
        f"flash_decode: impl='pallas' on GPU needs power-of-two head dims and block size "
        f"(Triton); got Dk={dk}, Dv={dv}, {'page_size' if paged else 'block_k'}={block}. "
        "Use impl='xla' (impl=None picks it for such shapes) or pad the head dims")
  rows_p = -(-r // spec.row_multiple) * spec.row_multiple
  if rows_p != r:
    q_rows = jnp.pad(q_rows, [(0, 0), (0, 0), (0, rows_p - r), (0, 0)])
  num_blocks = pl.cdiv(max(seq_len, 1), block)
  layout = _Layout(paged=paged, block=block, rows=rows,
                   k_quant=(k_scale is not None, k_offset is not None),
                   v_quant=(v_scale is not None, v_offset is not None))
  kernel = functools.partial(
      _split_kernel, layout=layout, softmax_scale=softmax_scale,
      blocks_per_split=pl.cdiv(num_blocks, num_splits), num_rows=r, group=r // num_tokens,
      num_tokens=num_tokens, seq_len=seq_len)

  if paged:
    cache_spec = lambda d: pl.BlockSpec((None,) + k.shape[1:3] + (d,), lambda i, h, j: (h, 0, 0, 0))
  else:
    cache_spec = lambda d: pl.BlockSpec((None, None, rows, d), lambda i, h, j: (i, h, 0, 0))
  operands = [lengths.astype(jnp.int32)]
  in_specs = [pl.BlockSpec((1,), lambda i, h, j: (i,))]
  if paged:
    operands.append(block_tables.astype(jnp.int32))
    in_specs.append(pl.BlockSpec((None, block_tables.shape[1]), lambda i, h, j: (i, 0)))
  operands += [q_rows, k, v]
  in_specs += [pl.BlockSpec((None, None, rows_p, dk), lambda i, h, j: (i, h, 0, 0)),
               cache_spec(dk), cache_spec(dv)]
  for extra in (k_scale, k_offset, v_scale, v_offset):
    if extra is not None:
      operands.append(extra)
      in_specs.append(_scale_spec(extra, paged))

  o, lse = pl.pallas_call(
      kernel,
      grid=(b, hkv, num_splits),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rows_p, dv), lambda i, h, j: (i, h, j, 0, 0)),
          pl.BlockSpec((None, None, None, rows_p), lambda i, h, j: (i, h, j, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((b, hkv, num_splits, rows_p, dv), jnp.float32),
          jax.ShapeDtypeStruct((b, hkv, num_splits, rows_p), jnp.float32),
      ],
      compiler_params=spec.compiler_params,
      interpret=interpret,
      name="fdecode_split_kv",
  )(*operands)
  return o[:, :, :, :r], lse[:, :, :, :r]
