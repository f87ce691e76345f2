"""FlashDecode split-KV Pallas kernel.

Grid ``(B, Hkv, n_splits)``. One program owns one kv head of one sequence and one
contiguous range of cache blocks; the R = T*G query rows of that kv head are the rows
of its matmuls (heads packed into the row dimension, as in Tenstorrent's sdpa_decode),
so every cache byte is read once. Inside a split the program runs an online softmax
over blocks of ``block_k`` tokens and writes one normalized partial state
(o, lse) per row; `merge_states` combines the splits.

Tails need no padding of the cache: block j covers tokens ``[j*block_k, (j+1)*block_k)``
but is *loaded* from ``min(j*block_k, S - block_k)``, and positions before
``j*block_k`` (already seen by block j-1) are masked. The loop runs only over blocks
below the sequence's length, so splits and blocks past it do no work and load nothing.

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

from fdecode.combine import finalize_state

MASK_VALUE = -1e30


@dataclasses.dataclass(frozen=True)
class _BackendSpec:
  row_multiple: int  # pad the R query rows to a multiple of this (tensor-core M tile)
  compiler_params: Any


def _backend_spec(backend: str, interpret: bool) -> _BackendSpec:
  """The one place that knows what each Pallas backend needs."""
  if interpret:
    return _BackendSpec(row_multiple=1, compiler_params=None)
  if backend == "gpu":
    from jax.experimental.pallas import triton as plgpu
    return _BackendSpec(row_multiple=16, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2))
  if backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return _BackendSpec(row_multiple=8, compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel")))
  raise ValueError(f"impl='pallas' has no compiled lowering for backend {backend!r}; pass interpret=True")


def _split_kernel(lengths_ref,  # i32[1]: this sequence's length
                  q_ref,        # [Rp, Dk]
                  k_ref,        # [S, Dk]
                  v_ref,        # [S, Dv]
                  o_ref,        # f32[Rp, Dv]
                  lse_ref,      # f32[Rp]
                  *, softmax_scale, block_k, blocks_per_split, num_rows, group, num_tokens, seq_len):
  # seq_len: the cache capacity S; k_ref may hold more rows (padded up to one block).
  split = pl.program_id(2)
  rows_p, _ = q_ref.shape
  dv = v_ref.shape[-1]
  length = jnp.clip(lengths_ref[0], 0, seq_len)
  q = q_ref[...]

  # Row r is query token t = r // G: it sees positions < length - T + t + 1.
  rows = lax.broadcasted_iota(jnp.int32, (rows_p, 1), 0)
  row_limit = jnp.clip(length - num_tokens + 1 + rows // group, 0, seq_len)
  row_limit = jnp.where(rows < num_rows, row_limit, 0)  # [Rp, 1]

  first = split * blocks_per_split
  last = jnp.minimum(first + blocks_per_split, pl.cdiv(length, block_k))

  def body(j, carry):
    acc, m, l = carry
    start = j * block_k
    load_start = jnp.minimum(start, k_ref.shape[0] - block_k)
    kb = k_ref[pl.ds(load_start, block_k), :]
    vb = v_ref[pl.ds(load_start, block_k), :]
    s = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * softmax_scale  # [Rp, block_k]
    pos = load_start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    valid = (pos >= start) & (pos < row_limit)
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
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


def pallas_partials(q_rows, k, v, lengths, *, num_tokens: int, softmax_scale: float,
                    num_splits: int, block_k: int, interpret: bool, backend: str):
  """Per-split partial states from the Pallas kernel.

  Args:
    q_rows: ``[B, Hkv, R, Dk]`` queries, row r = t * G + g.
    k: ``[B, Hkv, S, Dk]``; v: ``[B, Hkv, S, Dv]``.
    lengths: int32 ``[B]``.
    num_tokens: T (rows are T groups of G).

  Returns:
    ``(o, lse)``: float32 ``[B, Hkv, n, R, Dv]`` and ``[B, Hkv, n, R]``.
  """
  b, hkv, r, dk = q_rows.shape
  s, dv = k.shape[2], v.shape[-1]
  spec = _backend_spec(backend, interpret)
  if s < block_k:  # a cache shorter than one block: pad it (cheap: < block_k tokens)
    pad = [(0, 0), (0, 0), (0, block_k - s), (0, 0)]
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  rows_p = -(-r // spec.row_multiple) * spec.row_multiple
  if rows_p != r:
    q_rows = jnp.pad(q_rows, [(0, 0), (0, 0), (0, rows_p - r), (0, 0)])
  num_blocks = pl.cdiv(max(s, 1), block_k)
  blocks_per_split = pl.cdiv(num_blocks, num_splits)
  kernel = functools.partial(
      _split_kernel, softmax_scale=softmax_scale, block_k=block_k,
      blocks_per_split=blocks_per_split, num_rows=r, group=r // num_tokens,
      num_tokens=num_tokens, seq_len=s)
  o, lse = pl.pallas_call(
      kernel,
      grid=(b, hkv, num_splits),
      in_specs=[
          pl.BlockSpec((1,), lambda i, h, j: (i,)),
          pl.BlockSpec((None, None, rows_p, dk), lambda i, h, j: (i, h, 0, 0)),
          pl.BlockSpec((None, None, k.shape[2], dk), lambda i, h, j: (i, h, 0, 0)),
          pl.BlockSpec((None, None, k.shape[2], dv), lambda i, h, j: (i, h, 0, 0)),
      ],
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
  )(lengths.astype(jnp.int32), q_rows, k, v)
  return o[:, :, :, :r], lse[:, :, :, :r]
