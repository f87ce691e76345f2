"""What the two Hopper kernels share: the MLA kernel (`fdecode.kernels.mosaic_gpu.kernel`)
and the GQA rows kernel (`fdecode.kernels.mosaic_gpu.rows_kernel`).

`tma_ring` is their memory warpgroup's loop; `to_bf16` converts an 8-bit cache tile into
a wgmma operand exactly; `online_softmax` is one block's softmax update, with 8-bit
caches' per-token scales folded into the score and probability columns. `Ops` holds the few operations whose form
differs between a compiled Hopper kernel and jax 0.10.2's Mosaic GPU interpreter.

Interpreted, layouts mean nothing (casts are no-ops, iotas and loads are plain), its wgmma
takes no transposed smem operand (Q K^T is a dot of the two smem tiles) and it cannot run
``pl.run_state`` (the PV wgmma accumulates into a fresh accumulator added to ``alpha * O``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fdecode.combine import MASK_VALUE

_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Ops:
  """Compiled (``interpret=False``) or interpreted forms of the layout-bound operations."""
  interpret: bool

  def rows(self, x):
    """A ``[64]`` row vector in the layout of a wgmma accumulator's rows."""
    return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))

  def tile(self, x):
    return x if self.interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)

  def iota(self, shape, dim):
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

  def load_rows(self, ref):
    """A ``[64]`` float32 smem vector -> the accumulator's row layout."""
    if self.interpret:
      return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

  def load_cols(self, ref):
    """A ``[bk]`` float32 smem vector -> the layout of a wgmma accumulator's columns
    (broadcast along its rows with ``broadcast_in_dim(x, shape, [1])``)."""
    if self.interpret:
      return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)

  def qk(self, q_ref, k_ref):
    """float32 ``Q K^T`` ``[64, bk]`` of Q ``[64, D]`` and K ``[bk, D]`` in smem."""
    if self.interpret:  # its wgmma takes no transposed operand
      return lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)

    def scores(acc_ref):
      plgpu.wgmma(acc_ref, q_ref, k_ref.transpose((1, 0)))
      return acc_ref[...]
    return pl.run_scoped(scores, plgpu.ACC((q_ref.shape[0], k_ref.shape[0]), jnp.float32))

  def pv(self, acc, alpha, p_ref, v_ref):
    """``alpha[:, None] * acc + P V`` with P ``[64, bk]`` and V ``[bk, Dv]`` in smem."""
    scaled = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if self.interpret:
      def fresh(acc_ref):
        plgpu.wgmma(acc_ref, p_ref, v_ref)
        return acc_ref[...]
      return scaled + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))

    def accumulate(acc_ref):
      plgpu.wgmma(acc_ref, p_ref, v_ref)
    return pl.run_state(accumulate)(plgpu.ACC.init(scaled))


def tma_ring(steps, stages: int, copy_q, copy_block, free):
  """The memory warpgroup's loop over one split's ``steps`` blocks (traced int32): Q once
  (``copy_q()``, only if the split has a block), the first ``stages`` blocks into slots 0,
  1, ..., then block ``step`` into slot ``step % stages`` once the compute warpgroups
  released that slot's previous block (barrier ``free.at[slot]``). ``copy_block(step,
  slot)`` issues the TMA copies of one block, each onto its own "landed" barrier."""
  pl.when(steps > 0)(copy_q)
  for i in range(stages):
    pl.when(i < steps)(functools.partial(copy_block, i, i))

  @pl.loop(stages, steps)
  def _(step):
    slot = lax.rem(step, stages)
    plgpu.barrier_wait(free.at[slot])
    copy_block(step, slot)


def to_bf16(x):
  """A loaded cache tile as bf16, exactly: bf16 as is; int8 directly; float8_e4m3fn through
  float16 (Hopper converts e4m3 only to f16 in hardware; every e4m3 value, NaN included,
  is an f16 and a bf16)."""
  if x.dtype == jnp.float8_e4m3fn:
    x = x.astype(jnp.float16)
  return x.astype(jnp.bfloat16)


def online_softmax(s, visible, m, l, softmax_scale: float, k_scale=None, v_scale=None):
  """One block of the online softmax (exp2 domain) over scores ``s`` float32 [64, bk].

  ``visible`` bool [64, bk] (row r may see slot j); ``m``, ``l`` [64]: the running max and
  sum; ``k_scale`` / ``v_scale``: [bk] column vectors (8-bit caches) or None. The scales
  are never applied to a tile: k_scale multiplies column j of S before the select,
  v_scale column j of P after the row sum (l sums the unscaled probabilities), then a
  select again (a dead slot's scale is garbage: ``0 * inf`` would be NaN). Returns (P for
  the PV wgmma, alpha = the rescale of the running O, m, l)."""
  if k_scale is not None:
    s = s * lax.broadcast_in_dim(k_scale, s.shape, [1])
  s = jnp.where(visible, s * (softmax_scale * _LOG2E), MASK_VALUE)
  m_new = jnp.maximum(m, s.max(axis=1))
  alpha = jnp.exp2(m - m_new)
  p = jnp.where(visible, jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
  l = l * alpha + p.sum(axis=1)
  if v_scale is not None:
    p = jnp.where(visible, p * lax.broadcast_in_dim(v_scale, s.shape, [1]), 0.0)
  return p, alpha, m_new, l
