"""What the two Hopper kernels share: the MLA kernel (`fdecode.kernels.mosaic_gpu.mla.kernel`)
and the GQA rows kernel (`fdecode.kernels.mosaic_gpu.gqa.kernel`).

In the kernels: `tma_ring` is their memory warpgroup's loop and `release_slot` a compute
warpgroup's release of a ring slot; `smem_transforms` the swizzled layout of their tiles;
`to_bf16` converts an 8-bit cache tile into a wgmma operand exactly; `live_rows` selects
a block's live slots; `online_softmax` is one block's softmax update, with 8-bit caches'
per-token scales folded into the score and probability columns; `initial_state`,
`nonfinite_rows` and `store_state` are the running state and the epilogue that writes a
split's normalized partial state. `Ops` holds the few operations whose form differs
between a compiled Hopper kernel and jax 0.10.2's Mosaic GPU interpreter.

Around them: `launch` is the one ``plgpu.kernel`` launch both families make, and `combine`
hands their split states to the Triton combine kernel (the second of a call's launches).

Interpreted, layouts mean nothing (casts are no-ops, iotas and loads are plain), its wgmma
takes no transposed smem operand (Q K^T is a dot of the two smem tiles) and it cannot run
``pl.run_state`` (the PV wgmma accumulates into a fresh accumulator added to ``alpha * O``).

JAX versions: both kernels use only APIs present in jax 0.10.2 (CI) and 0.11.2 (the GPU
machines) with the same meaning: ``plgpu.kernel(body, out_type=, scratch_types=, grid=,
grid_names=, num_threads=, thread_name=, compiler_params=, interpret=, kernel_name=)``,
``plgpu.SMEM`` with Tiling / Swizzle transforms, ``plgpu.Barrier``, ``copy_gmem_to_smem``,
``barrier_wait`` / ``_arrive``, ``wgmma``, ``ACC`` / ``ACC.init`` with ``pl.run_state``,
``set_max_registers``, ``commit_smem``, ``layout_cast`` / ``broadcasted_iota`` / ``load``
with ``Layout.WGMMA(.reduce(1))`` (the rows kernel also ``.reduce(0)``: the scales as
column vectors) and ``CompilerParams(approx_math, reduction_scratch_bytes,
lowering_semantics)``. Each kernel names its lowering semantics (`launch`), not left to
the default, which differs: 0.10.2 lowers Pallas kernels with ``Lane`` semantics, 0.11.2
with ``Warpgroup``. What else differs: 0.11.2 deprecates ``plgpu.transpose_ref``
(``ref.transpose`` is used: the same transform in both) and drops ``plgpu.transform_ref``
and ``kernel``'s ``out_shape`` / ``scratch_shapes`` aliases; it exports
``InterpretGPUParams`` as ``plgpu.InterpretGPUParams`` (0.10.2: only
``jax._src.pallas.mosaic_gpu.interpret.params``, which 0.11.2 keeps); its ``plgpu.kernel``
lowers through ``mpmd_map`` instead of ``core_map`` (the same ``mosaic_gpu_v2`` custom
call); its interpreter runs layout casts (no-ops) but still not ``pl.run_state``;
``copy_gmem_to_smem`` gains ``oob_mode`` / ``predicate`` (unused here).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fdecode.combine import MASK_VALUE, merge_states
from fdecode.kernels import triton as triton_kernels
from fdecode.kernels.common import block as blk
from fdecode.kernels.mosaic_gpu.plan import BLOCK_ROWS, TILE_COLS

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_F32_MAX = float(jnp.finfo(jnp.float32).max)


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
  the PV wgmma, alpha = the rescale of the running O, m, l).

  Not `fdecode.kernels.common.block.online_update`, which the Triton and Mosaic TPU
  kernels share: that one runs the PV product itself (a ``lax.dot_general`` into value
  pieces, with ``[R_p, 1]`` state), where here the caller issues it as a wgmma into an
  accumulator ref (`Ops.pv`, rescaled by ``alpha`` there), the state is one value per row
  of the warpgroup's 64-row tile, and the exponent is base 2 (the scale folded into
  ``softmax_scale * log2 e``). The masking rules are the same: select, never multiply."""
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


def release_slot(free, slot, step, stages: int, steps):
  """Releases ring slot ``slot`` (its barrier ``free.at[slot]``) after block ``step`` of
  ``steps``, only where the slot is written again: a barrier phase nobody waits for would
  be left behind (the interpreter rejects that)."""
  pl.when(step + stages < steps)(lambda: plgpu.barrier_arrive(free.at[slot]))


def smem_transforms(item_bytes: int):
  """The tiled, swizzled smem layout of a tile of ``item_bytes``-byte elements: 8-row
  tiles of `TILE_COLS` columns, swizzled over their row's bytes (bf16 128 B, 8-bit 64 B)."""
  return plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(TILE_COLS * item_bytes)


def contiguous_load_start(block, bk: int, cache_rows: int):
  """The first cache row block ``block`` loads from a contiguous cache of ``cache_rows``
  rows: its start, or ``cache_rows - bk`` for a last block past the end (an overlapped
  load: the slots before the block's start are selected away)."""
  return jnp.minimum(block * bk, cache_rows - bk)


def live_rows(ld, start, live_end, bk: int, ops: Ops):
  """bool ``[bk, TILE_COLS]``: slot j of a block loaded from ``ld`` is live (at or past
  the block's ``start``, before ``live_end``), broadcast along one column tile."""
  pos = ld + ops.iota((bk, TILE_COLS), 0)
  return (pos >= start) & (pos < live_end)


def initial_state(cols: int, ops: Ops):
  """The running state before a split's first block: the accumulator float32 ``[64,
  cols]`` 0, the row max ``m`` at the finite mask value and the row sum ``l`` 0 ``[64]``."""
  return (ops.tile(jnp.zeros((BLOCK_ROWS, cols), jnp.float32)),
          ops.rows(jnp.full((BLOCK_ROWS,), MASK_VALUE, jnp.float32)), ops.rows(jnp.zeros((BLOCK_ROWS,), jnp.float32)))


def nonfinite_rows(x):
  """float32 ``[rows]``: 1 where row r of tile ``x`` holds an inf or NaN, else 0 (``abs(x)
  <= max`` is False for both: `fdecode.combine.corrupt_rows` as a row max)."""
  return jnp.where(jnp.abs(x) <= _F32_MAX, 0.0, 1.0).max(axis=1)


def store_state(acc, m, l, empty, o_tile, lse_rows=None):
  """One split's normalized partial state of 64 rows: ``o_tile`` ``[64, Dv]`` = acc / l
  and (unless None) ``lse_rows`` ``[64]`` its natural-log LSE from the exp2-domain ``m``
  and ``l``. ``empty`` (the row saw no key in the split, from the positions): o 0, lse
  -inf. A corrupt row's ``l`` is NaN already (the caller's `nonfinite_rows`): every
  column of its out and its lse are NaN."""
  o_tile[...] = acc / lax.broadcast_in_dim(jnp.where(empty, 1.0, l), acc.shape, [0])
  if lse_rows is not None:
    lse_rows[...] = jnp.where(empty, -jnp.inf, m * _LN2 + jnp.log(jnp.where(empty, 1.0, l)))


def interpreted(interpret) -> bool:
  """Whether an entry point's ``interpret`` asks for jax's Mosaic GPU interpreter (an
  ``InterpretGPUParams``) rather than the compiled kernel (None / False)."""
  return interpret is not None and interpret is not False


def launch(body, plan, args, *, out_type, scratch_types, grid_names, num_threads: int, semantics, name: str,
           interpret):
  """Runs ``body(*refs, plan=plan, ops=Ops(...))`` once over ``plan.grid`` (named
  ``grid_names``) with ``num_threads`` warpgroups (axis ``"wg"``) on operands ``args``;
  returns its outputs typed varying as the operands vary (inside ``shard_map``).

  Row reductions of wgmma tiles stay inside a warp: no cross-warp reduction scratch (its
  default 2 KiB would not fit next to the tiles). ``semantics``: the kernel's Mosaic GPU
  lowering semantics, named (the default differs between jax versions)."""
  on = interpreted(interpret)
  kernel = plgpu.kernel(
      functools.partial(body, plan=plan, ops=Ops(on)),
      out_type=out_type,
      scratch_types=scratch_types,
      grid=plan.grid,
      grid_names=grid_names,
      num_threads=num_threads,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                           lowering_semantics=semantics),
      interpret=interpret if on else None,
      kernel_name=name,
  )
  outs = kernel(*args)
  return tuple(blk.vary_like(x, *args) for x in outs)


def combine(o, lse, *, batch: int, num_tokens: int, group: int, hq: int, out_dtype, interpret):
  """A Hopper kernel's split states (float32 ``o [B, (Hkv,) n_splits, R_p, Dv]``, lse
  likewise without Dv) merged by the Triton combine kernel (interpreted where the Hopper
  kernel is), which writes row r = t * G + g of kv head h at query head ``h * G + g`` of
  token t: ``(out [B, T, Hq, Dv] in out_dtype, lse float32 [B, T, Hq])``. On a JAX without
  Pallas' Triton backend, by XLA (`merge_split_major`)."""
  if not triton_kernels.pallas_triton_available():
    return merge_split_major(o, lse, num_tokens=num_tokens, group=group, hq=hq, out_dtype=out_dtype)
  out, out_lse = triton_kernels.combine_split_major(o, lse, num_tokens=num_tokens, group=group, hq=hq,
                                                    out_dtype=out_dtype, interpret=interpreted(interpret))
  return out.reshape(batch, num_tokens, hq, o.shape[-1]), out_lse.reshape(batch, num_tokens, hq)


def merge_split_major(o, lse, *, num_tokens: int, group: int, hq: int, out_dtype):
  """`combine`'s merge in XLA (`fdecode.combine.merge_states` over the split axis), for a JAX
  without Pallas' Triton backend: ``o [B, (Hkv,) n_splits, R_p, Dv]`` float32, lse likewise
  without Dv -> ``(out [B, T, Hq, Dv] in out_dtype, lse float32 [B, T, Hq])``, row
  r = t * G + g of kv head h at query head ``h * G + g`` of token t (the padded rows
  ``R_p > T * G`` dropped)."""
  if o.ndim == 4:  # one kv head
    o, lse = o[:, None], lse[:, None]
  b, hkv, _, _, dv = o.shape
  out, out_lse = merge_states(o, lse, axis=2)  # [B, Hkv, R_p, Dv], [B, Hkv, R_p]
  rows = num_tokens * group
  out = out[:, :, :rows].reshape(b, hkv, num_tokens, group, dv).transpose(0, 2, 1, 3, 4)
  out_lse = out_lse[:, :, :rows].reshape(b, hkv, num_tokens, group).transpose(0, 2, 1, 3)
  return out.reshape(b, num_tokens, hq, dv).astype(out_dtype), out_lse.reshape(b, num_tokens, hq)


def outputs(out, lse, *, single: bool, return_lse: bool):
  """An entry point's return: ``out [B, T, Hq, Dv]`` and ``lse [B, T, Hq]`` without the T
  axis where q came without it (``single``), lse only where asked for."""
  if single:
    out, lse = out[:, 0], lse[:, 0]
  return (out, lse) if return_lse else out
