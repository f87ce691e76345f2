"""Hopper (sm_90) MLA decode kernel in Pallas' Mosaic GPU backend: TMA + wgmma.

FlashMLA's shape of work. One program owns 64 query rows (``row r = t*G + g``, one wgmma
M tile) of one sequence and one contiguous range of ``bk``-token blocks (a split), and
runs three warpgroups:

* warpgroup 2 (memory, 40 registers): TMA copies of Q (64 x 576; below 64 query rows, the
  R rows into the tile's first R: the other rows' scores, never merged, are whatever the
  tile held, and stay in their own rows of every matmul) once and of each K block
  (bk x 576, the latent row: keys *and* values) into a ring of ``stages`` swizzled shared
  memory tiles, refilling a slot when both compute warpgroups released it;
* warpgroup 0 (scores): S = Q K^T by wgmma (K = 576), the mask, the online softmax in the
  exp2 domain, P (bf16) and the per-row rescale ``alpha`` into shared memory for both,
  then O[:, :256] = alpha * O + P V[:, :256] by wgmma;
* warpgroup 1: waits for P, then O[:, 256:] = alpha * O + P V[:, 256:] by wgmma.

The 512 value columns are the first 512 of the same K tile (one read of each cache byte),
and the two output halves keep each compute warpgroup's accumulator at 64 x 256 float32
(128 registers a thread). Each program writes one normalized partial state per row;
`fdecode.combine.merge_states` merges the splits.

8-bit caches (int8 / float8_e4m3fn, one float32 scale per token; built and interpreted,
opt-in, not yet measured on a GPU): the TMA brings 8-bit stages and each block's bk
scales; both compute warpgroups convert the stage into one bf16 tile (exactly: e4m3
through f16), each its own columns (`fdecode.kernels.mosaic_gpu.mla.plan`'s budget), dead
slots' rows selected to 0 there; warpgroup 1 hands its columns to warpgroup 0 through a
barrier, and both release the 8-bit stage. The scale is never applied to the tile: it
multiplies column j of S before the mask and column j of P after the row sum
(`fdecode.kernels.mosaic_gpu.ops.online_softmax`; one scale, values being the keys' rows).
A code the row sees that is NaN, or a NaN / inf scale, reaches S or P in every column. A
finite scale so large that code * scale overflows float32 (beyond ~7e35 for e4m3) is
outside the corruption rule: the reference's dequantized inf is never formed here.

Semantics (the per-split states of every fdecode kernel, `fdecode.combine`): a row with no
visible key gives o = 0, lse = -inf (decided from the positions: l == 0); dead slots
(past the sequence's end, before a block's start in the overlapped tail load) are
selected away: their scores to a finite mask value, their probabilities to 0, and their
value rows in shared memory to 0 before the PV wgmma (``0 * NaN`` would be NaN).
Corruption a row sees propagates to the whole row (docs/semantics.md): a NaN key or value,
or a NaN / +inf score, makes its scores, m and l NaN; an inf value at a score of -inf
(p = 0: ``0 * inf``) or a value overflow reaches only some columns of one warpgroup's
accumulator, so the epilogue exchanges per-row flags both ways (`_finish`): a row whose
accumulator holds an inf or NaN in either half gets ``l = NaN``, and every column of its
out and its lse are NaN, as `fdecode.kernels.common.block.finalize` does. Blocks at or
past the end are never loaded. The last block of a cache whose S is not a multiple of bk
is loaded from ``S - bk`` (TMA reads whole tiles) and its slots before the block's start
are dead.

Interpreted (`jax._src.pallas.mosaic_gpu.interpret`, CPU), the same body runs with two
substitutions that jax 0.10.2's interpreter needs (`fdecode.kernels.mosaic_gpu.ops.Ops`):
layout casts are no-ops, Q K^T is a dot of the two smem tiles (its wgmma takes no
transposed operand), and the PV wgmma accumulates into a fresh accumulator added to
``alpha * O`` instead of into ``alpha * O`` itself (``pl.run_state``, which that
interpreter cannot run).

Lowering semantics ``Warpgroup`` (`fdecode.kernels.mosaic_gpu.ops` on jax versions),
named: jax 0.11.2's default and the semantics the kernel's GPU measurements ran under;
it lowers with it on jax 0.10.2 too (compile tier), whose default is ``Lane``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import Modifiers
from fdecode.kernels.mosaic_gpu import ops as mops
from fdecode.kernels.mosaic_gpu.mla.plan import DK, DV, HALF_DV, MlaPlan
from fdecode.kernels.mosaic_gpu.ops import Ops, online_softmax, tma_ring, to_bf16
from fdecode.kernels.mosaic_gpu.plan import BF16_BYTES, BLOCK_ROWS, TILE_COLS


def _select_dead_values(k_tile, ld, start, live_end, ops):
  """Value rows of one K stage ``k_tile`` [bk, 576] loaded from ``ld`` that lie before the
  block's ``start`` or at / past ``live_end`` become 0 in place (a select, never a product)."""
  keep = mops.live_rows(ld, start, live_end, k_tile.shape[0], ops)
  for c in range(DV // TILE_COLS):
    tile = k_tile.at[:, pl.ds(c * TILE_COLS, TILE_COLS)]
    v = tile[...]
    tile[...] = jnp.where(keep, v, jnp.zeros_like(v))


def _convert_columns(half, k8_tile, kb_tile, ld, start, live_end, ops):
  """Warpgroup ``half``'s share of one 8-bit K stage ``k8_tile`` [bk, 576] (loaded from
  ``ld``) converted exactly into the bf16 wgmma operand ``kb_tile`` [bk, 576]: warpgroup 0
  the columns 0..255, warpgroup 1 the columns 256..575 (`fdecode.kernels.mosaic_gpu.mla.plan`
  says why); the rows of dead slots (before ``start``, at / past ``live_end``) become 0 (a
  select, never a product: a garbage code may be NaN)."""
  keep = mops.live_rows(ld, start, live_end, k8_tile.shape[0], ops)
  split = HALF_DV // TILE_COLS
  for c in (range(split) if half == 0 else range(split, DK // TILE_COLS)):
    cols = pl.ds(c * TILE_COLS, TILE_COLS)
    x = to_bf16(k8_tile.at[:, cols][...])
    kb_tile.at[:, cols][...] = jnp.where(keep, x, jnp.zeros_like(x))


def _quantized_operand(half, k8_tile, kb_tile, scales, scales_full, converted, ld, start, live_end, ops):
  """Warpgroup ``half``'s part of one 8-bit block: its columns converted
  (`_convert_columns`), then warpgroup 1 hands them to warpgroup 0 (barrier
  ``converted``), and warpgroup 0 takes the block's per-token scales ``scales`` f32[bk]
  (landed on ``scales_full``) as a column vector, which it returns (warpgroup 1: None)."""
  _convert_columns(half, k8_tile, kb_tile, ld, start, live_end, ops)
  plgpu.commit_smem()
  if half == 1:
    plgpu.barrier_arrive(converted)
    return None
  plgpu.barrier_wait(scales_full)
  k_scale = ops.load_cols(scales)
  plgpu.barrier_wait(converted)
  return k_scale


def _hand_over_p(half, step, p, alpha, p_smem, rows_smem, p_full, p_free, ops):
  """P and its row rescale ``alpha`` from warpgroup 0 (writes them into ``p_smem`` and
  row 0 of ``rows_smem`` once warpgroup 1 read the previous ones, barrier ``p_free``) to
  warpgroup 1 (waits on ``p_full``); returns alpha."""
  if half == 0:
    @pl.when(step > 0)
    def _():
      plgpu.barrier_wait(p_free)

    p_smem[...] = p.astype(p_smem.dtype)
    rows_smem.at[0][...] = alpha
    plgpu.commit_smem()
    plgpu.barrier_arrive(p_full)
    return alpha
  plgpu.barrier_wait(p_full)
  return ops.load_rows(rows_smem.at[0])


def _finish(half, acc, m, l, rows_smem, flags, done, o_tile, lse_rows, ops):
  """Warpgroup ``half``'s epilogue, a two-way exchange through ``rows_smem``: warpgroup 1
  hands its per-row corruption flag (its half of the accumulator non-finite) to 0 (row 0,
  barrier ``flags``); warpgroup 0 sets ``l = NaN`` in the rows either half flags and hands
  ``m`` and that ``l`` to 1 (rows 1, 2, barrier ``done``); each normalizes its half of the
  output into ``o_tile``; warpgroup 0 writes the lse (-inf for rows that saw no key: out
  0; NaN for a corrupt row, with every column of its out: `fdecode.kernels.mosaic_gpu.ops.store_state`).
  Warpgroup 1 arrives before it waits, so neither waits on the other in a cycle."""
  bad = mops.nonfinite_rows(acc)
  if half == 1:
    rows_smem.at[0][...] = bad  # row 0 (alpha) is free: warpgroup 1 read the last one
    plgpu.commit_smem()
    plgpu.barrier_arrive(flags)
    plgpu.barrier_wait(done)
    m, l = ops.load_rows(rows_smem.at[1]), ops.load_rows(rows_smem.at[2])
  else:
    plgpu.barrier_wait(flags)
    bad = jnp.maximum(bad, ops.load_rows(rows_smem.at[0]))
    l = jnp.where(bad > 0.0, jnp.nan, l)
    rows_smem.at[1][...] = m
    rows_smem.at[2][...] = l
    plgpu.commit_smem()
    plgpu.barrier_arrive(done)
  empty = l == 0.0  # False for NaN: a corrupt row is not empty
  mops.store_state(acc, m, l, empty, o_tile, lse_rows if half == 0 else None)


def _kernel(ends_ref, q_ref, k_ref, *refs, plan: MlaPlan, ops: Ops):
  # ends_ref i32[B]; q_ref bf16[B, plan.q_rows, 576]; k_ref [B, S_c, 576] (bf16 or 8-bit);
  # 8-bit: ks_ref f32[B, S_c]; o_ref f32[B, n_splits, R_p, 512]; lse_ref f32[B, n_splits, R_p];
  # q_smem [64, 576]; k_smem [stages, bk, 576]; 8-bit: kb_smem bf16[bk, 576] (the wgmma
  # operand), sc_smem f32[stages, bk]; p_smem bf16[64, bk]; rows_smem f32[3, 64]: P's row
  # rescale alpha (then warpgroup 1's corrupt-row flags, 1 -> 0), the final m and l (0 -> 1).
  if plan.quantized:
    ks_ref, o_ref, lse_ref, q_smem, k_smem, kb_smem, sc_smem, p_smem, rows_smem, barriers = refs
    *barriers, s_full, converted = barriers
  else:
    o_ref, lse_ref, q_smem, k_smem, p_smem, rows_smem, barriers = refs
  q_bar, k_full, k_free, p_full, p_free, done, flags = barriers
  bk, stages = plan.block, plan.stages
  row_block, split, b, wg = (lax.axis_index(n) for n in ("rows", "split", "batch", "wg"))
  end = ends_ref[b]
  live_end = jnp.clip(end, 0, plan.seq_len)
  first, last = blk.split_range(end, split, plan.num_splits, plan.num_tokens, plan.seq_len, bk, Modifiers())
  steps = jnp.maximum(last - first, 0)
  load_start = lambda j: mops.contiguous_load_start(j, bk, plan.cache_rows)

  def copy_block(step, slot):
    rows = pl.ds(load_start(first + step), bk)
    plgpu.copy_gmem_to_smem(k_ref.at[b, rows], k_smem.at[slot], k_full.at[slot])
    if plan.quantized:
      plgpu.copy_gmem_to_smem(ks_ref.at[b, rows], sc_smem.at[slot], s_full.at[slot])

  @pl.when(wg == 2)
  def _memory():
    plgpu.set_max_registers(plan.memory_registers, action="decrease")
    n = min(plan.q_rows, BLOCK_ROWS)  # fewer rows than a tile: the first n (`MlaPlan.q_rows`)
    q_rows = q_ref.at[b, pl.ds(row_block * BLOCK_ROWS, n)]
    q_tile = q_smem if n == BLOCK_ROWS else q_smem.at[pl.ds(0, n)]
    tma_ring(steps, stages, lambda: plgpu.copy_gmem_to_smem(q_rows, q_tile, q_bar.at[0]), copy_block, k_free)

  def release(step, slot):
    mops.release_slot(k_free, slot, step, stages, steps)

  def operands(half, step, slot, ld, start):
    """The K operand of a block (V: its first 512 columns) and, 8-bit, warpgroup 0's
    per-token scales: bf16, the stage itself; 8-bit, the bf16 tile both warpgroups
    converted their columns into, the 8-bit stage then released to the TMA."""
    if not plan.quantized:
      return k_smem.at[slot], None
    k_scale = _quantized_operand(half, k_smem.at[slot], kb_smem, sc_smem.at[slot], s_full.at[slot], converted.at[0],
                                 ld, start, live_end, ops)
    release(step, slot)
    return kb_smem, k_scale

  def compute(half):
    plgpu.set_max_registers(plan.compute_registers, action="increase")
    scores = half == 0

    @pl.when(jnp.logical_and(scores, steps > 0))
    def _():
      plgpu.barrier_wait(q_bar.at[0])

    def step_body(step, carry):
      acc, m, l = carry
      slot = lax.rem(step, stages)
      start = (first + step) * bk
      ld = load_start(first + step)
      plgpu.barrier_wait(k_full.at[slot])
      k_op, k_scale = operands(half, step, slot, ld, start)
      if scores:
        s = ops.qk(q_smem, k_op)
        # T = 1: every row sees the same keys (padding rows too; their outputs are
        # dropped), so the mask is a function of the column alone. MLA's values are the
        # keys' rows: one per-token scale serves S and P.
        pos = ld + ops.iota((BLOCK_ROWS, bk), 1)
        visible = (pos >= start) & (pos < live_end)
        p, alpha, m, l = online_softmax(s, visible, m, l, plan.softmax_scale, k_scale, k_scale)
        if not plan.quantized:  # 8-bit: selected in the conversion
          pl.when((ld < start) | (ld + bk > live_end))(
              functools.partial(_select_dead_values, k_smem.at[slot], ld, start, live_end, ops))
      else:
        p = alpha = None
      alpha = _hand_over_p(half, step, p, alpha, p_smem, rows_smem, p_full.at[0], p_free.at[0], ops)
      acc = ops.pv(acc, alpha, p_smem, k_op.at[:, pl.ds(half * HALF_DV, HALF_DV)])
      if not scores:
        pl.when(step + 1 < steps)(lambda: plgpu.barrier_arrive(p_free.at[0]))
      if not plan.quantized:
        release(step, slot)
      return acc, m, l

    acc, m, l = lax.fori_loop(0, steps, step_body, mops.initial_state(HALF_DV, ops))
    out_rows = pl.ds(row_block * BLOCK_ROWS, BLOCK_ROWS)
    _finish(half, acc, m, l, rows_smem, flags.at[0], done.at[0],
            o_ref.at[b, split, out_rows, pl.ds(half * HALF_DV, HALF_DV)], lse_ref.at[b, split, out_rows], ops)

  pl.when(wg == 0)(functools.partial(compute, 0))
  pl.when(wg == 1)(functools.partial(compute, 1))


def _scratch(plan: MlaPlan):
  """The shared memory of one program (`fdecode.kernels.mosaic_gpu.mla.plan` budgets it)."""
  tiled = mops.smem_transforms(BF16_BYTES)
  barriers = (plgpu.Barrier(num_barriers=1),                                      # Q landed
              plgpu.Barrier(num_barriers=plan.stages),                            # K slot landed
              plgpu.Barrier(num_arrivals=2, num_barriers=plan.stages),            # K slot released
              plgpu.Barrier(num_arrivals=1, num_barriers=1),                      # P written
              plgpu.Barrier(num_arrivals=1, num_barriers=1),                      # P read (warpgroup 1)
              plgpu.Barrier(num_arrivals=1, num_barriers=1),                      # final m, l written
              plgpu.Barrier(num_arrivals=1, num_barriers=1))                      # warpgroup 1's row flags written
  q = plgpu.SMEM((BLOCK_ROWS, DK), jnp.bfloat16, transforms=tiled)
  p = plgpu.SMEM((BLOCK_ROWS, plan.block), jnp.bfloat16, transforms=tiled)
  rows = plgpu.SMEM((3, BLOCK_ROWS), jnp.float32)
  if not plan.quantized:
    return [q, plgpu.SMEM((plan.stages, plan.block, DK), jnp.bfloat16, transforms=tiled), p, rows, barriers]
  tiled8 = mops.smem_transforms(1)  # 64 B rows
  barriers += (plgpu.Barrier(num_barriers=plan.stages),                           # a slot's scales landed
               plgpu.Barrier(num_arrivals=1, num_barriers=1))                     # warpgroup 1's columns converted
  return [q, plgpu.SMEM((plan.stages, plan.block, DK), jnp.dtype(plan.cache_dtype), transforms=tiled8),
          plgpu.SMEM((plan.block, DK), jnp.bfloat16, transforms=tiled),
          plgpu.SMEM((plan.stages, plan.block), jnp.float32), p, rows, barriers]


def mla_states(q_rows, ends, k, k_scale=None, *, plan: MlaPlan, interpret=None):
  """The kernel's own outputs, rows padded to ``plan.rows_padded``: float32 ``(o [B,
  n_splits, R_p, 512], lse [B, n_splits, R_p])`` (`mla_partials` for the arguments; the
  dispatch hands these to the Triton combine kernel as they are)."""
  b, hkv, r, dq = q_rows.shape
  if hkv != 1 or dq != DK or k.shape[1] != 1 or k.shape[3] != DK:
    raise ValueError(f"mla_partials: need q_rows [B, 1, R, {DK}] and k [B, 1, S, {DK}], got "
                     f"{q_rows.shape=} {k.shape=}")
  if (b, r, k.shape[2]) != (plan.batch, plan.rows, plan.seq_len) or str(k.dtype) != plan.cache_dtype:
    raise ValueError(f"mla_partials: the plan is for B={plan.batch} R={plan.rows} S={plan.seq_len} and a "
                     f"{plan.cache_dtype} cache, got {q_rows.shape=} {k.shape=} {k.dtype=}")
  if plan.quantized != (k_scale is not None) or (k_scale is not None and k_scale.shape != (*k.shape[:3], 1)):
    raise ValueError(f"mla_partials: a {plan.cache_dtype} plan needs k_scale "
                     f"{f'[B, 1, S, 1] = {(*k.shape[:3], 1)}' if plan.quantized else 'None'}, got "
                     f"{None if k_scale is None else k_scale.shape}")
  q = jnp.pad(q_rows[:, 0], [(0, 0), (0, plan.q_rows - r), (0, 0)])  # a copy only past one tile
  pad_s = [(0, 0), (0, plan.cache_rows - plan.seq_len)]  # S < bk or S % 8 != 0: a padded copy (see MlaPlan)
  args = [q, jnp.pad(k[:, 0], pad_s + [(0, 0)])]
  if plan.quantized:
    args.append(jnp.pad(k_scale[:, 0, :, 0].astype(jnp.float32), pad_s))
  return mops.launch(
      _kernel, plan, [ends.astype(jnp.int32), *args],
      out_type=(jax.ShapeDtypeStruct((b, plan.num_splits, plan.rows_padded, DV), jnp.float32),
                jax.ShapeDtypeStruct((b, plan.num_splits, plan.rows_padded), jnp.float32)),
      scratch_types=_scratch(plan), grid_names=("rows", "split", "batch"), num_threads=3,
      semantics=plgpu.LoweringSemantics.Warpgroup, name="fdecode_mla_mosaic_gpu", interpret=interpret)


def mla_partials(q_rows, ends, k, k_scale=None, *, plan: MlaPlan, interpret=None):
  """Per-split partial states of MLA decode from the Hopper kernel.

  Args:
    q_rows: bf16 ``[B, 1, R, 576]`` queries, row r = t * G + g (one latent kv head).
    ends: int32 ``[B]``: each sequence's length (new tokens included) in the cache.
    k: ``[B, 1, S, 576]`` latent cache, bf16 or int8 / float8_e4m3fn; the values are its
      first 512 columns.
    k_scale: float32 ``[B, 1, S, 1]``, 8-bit caches only: the real latent row is
      ``k * k_scale`` (keys and values alike), else None.
    plan: `fdecode.kernels.mosaic_gpu.mla_plan` for these shapes.
    interpret: None / False: compiled for the GPU (sm_90a); an ``InterpretGPUParams``:
      jax's Mosaic GPU interpreter (CPU), with the substitutions of
      `fdecode.kernels.mosaic_gpu.ops.Ops`.

  Returns:
    ``(o, lse)``: float32 ``[B, 1, n_splits, R, 512]`` and ``[B, 1, n_splits, R]``
    (natural-log LSE; a row with no visible key: o = 0, lse = -inf), merged over axis 2
    by `fdecode.combine.merge_states`.
  """
  o, lse = mla_states(q_rows, ends, k, k_scale, plan=plan, interpret=interpret)
  r = q_rows.shape[2]
  return o[:, None, :, :r], lse[:, None, :, :r]
