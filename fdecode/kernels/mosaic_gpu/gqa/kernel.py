"""Hopper (sm_90) GQA decode kernel in Pallas' Mosaic GPU backend: TMA + wgmma over query
rows, for bf16 and 8-bit (int8 / float8_e4m3fn, per-token scales) caches, contiguous or
paged (a pool read in place through the block table: `fdecode.kernels.mosaic_gpu.gqa.paging`).

One program owns 64 query rows (``row r = t*G + g``: the T new tokens x G query heads of
one kv head of one sequence; one wgmma M tile) and one split (a contiguous range of
``bk``-token blocks) of that sequence, and runs two warpgroups:

* warpgroup 1 (memory, 40 registers): TMA copies of Q (64 x D) once and, per block, of K
  and V (bk x D each; 8-bit: also the bk per-token scales of each) into a ring of
  ``stages`` swizzled shared-memory slots, refilling a slot when warpgroup 0 released it;
  paged, a block is one copy or one per page, the table read here (`paging`);
* warpgroup 0 (compute): per block, prepares the K / V operands (below), S = Q K^T by
  wgmma, the scales and the mask, the online softmax in the exp2 domain, P (bf16) into
  shared memory, O = alpha * O + P V by wgmma; at the end one normalized partial state
  per row (`fdecode.combine.merge_states` merges the splits).

8-bit caches: the 8-bit K / V tiles are converted to bf16 (exact for int8 and e4m3) into
one bf16 K and one bf16 V tile, the wgmma operands; the per-token scales are never
applied to a tile: ``k_scale[j]`` multiplies column j of S, ``v_scale[j]`` column j of P
(after the row sum l, which needs the unscaled probabilities), each before the select.

Semantics (every fdecode kernel's, `fdecode.kernels.common.block`): row r sees key j iff
``j < clip(L - T + t + 1, 0, L)`` (causal over the new tokens, L = the length clipped to
``[0, S]``); padding rows see nothing. A row with no visible key (decided from the
positions) gives o = 0, lse = -inf. A dead slot (past L, or before a block's start in the
overlapped tail load) is selected away: its score to a finite mask value, its
probability to 0, its value row in shared memory to 0 before the PV wgmma.

The NaN / visibility rule (T > 1, ``RowsPlan.guarded``). The PV wgmma shares each value
row among the 64 rows of a program, and ``0 * NaN`` is NaN: a non-finite value at a slot
that one row sees and another does not would reach both. So, in the blocks that hold such
slots (those reaching past ``L - T``; for 8-bit caches in every block, the conversion
pass being there anyway), a value row holding an inf or NaN (after the bf16 conversion)
*poisons its key row* (the K operand's row becomes NaN, so column j of S is NaN for every
row) and is itself selected to 0. The score select then decides per row, like any
score: a row that sees slot j gets a NaN score and turns NaN (out and lse), a row that
does not sees the mask value and stays exact. NaN in a visible key, a visible scale or q
propagates through the scores or P directly. With T = 1 every real row sees the same
slots, and a non-finite visible value reaches its rows' accumulators through P V by itself
(in one column, or as ``0 * inf`` where P is 0).

Corruption a row sees propagates to the whole row (docs/semantics.md): in the epilogue a
row whose accumulator holds an inf or NaN gets ``l = NaN`` before the normalization, so
every column of its out and its lse are NaN (`fdecode.kernels.common.block.finalize`'s
rule), whatever path the value took. The T > 1 guard stays: it is what keeps a value that
one row sees out of the accumulator of a row that does not.

Interpreted (`jax._src.pallas.mosaic_gpu.interpret`, CPU), the body runs with the
substitutions of `fdecode.kernels.mosaic_gpu.ops.Ops` (as the MLA kernel); the API subset
of jax 0.10.2 and 0.11.2 it uses is in `fdecode.kernels.mosaic_gpu.ops`. Its lowering
semantics is ``Lane``, named (the MLA kernel's is ``Warpgroup``): under ``Warpgroup``,
jax 0.11.2's default, 0.10.2's lowering refuses a 2-bit register type in one of its
loops; whether 0.11.2 lowers and runs it either way is for a GPU run to say.
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
from fdecode.kernels.mosaic_gpu.gqa import paging
from fdecode.kernels.mosaic_gpu.gqa.plan import RowsPlan
from fdecode.kernels.mosaic_gpu.ops import Ops, online_softmax, tma_ring, to_bf16
from fdecode.kernels.mosaic_gpu.plan import BF16_BYTES, BLOCK_ROWS, TILE_COLS


def _bad_value_rows(v_tile):
  """float32 ``[bk]``: 1 where value row j of ``v_tile`` [bk, D] holds an inf or NaN
  (`fdecode.kernels.mosaic_gpu.ops.nonfinite_rows` over its column tiles), else 0."""
  d = v_tile.shape[1]
  bad = None
  for c in range(d // TILE_COLS):
    v = to_bf16(v_tile.at[:, pl.ds(c * TILE_COLS, TILE_COLS)][...]).astype(jnp.float32)
    row = mops.nonfinite_rows(v)
    bad = row if bad is None else jnp.maximum(bad, row)
  return bad


def _prepare_operands(k_src, v_src, k_dst, v_dst, ld, start, live_end, *, guard: bool, ops: Ops):
  """The K / V wgmma operands of one block loaded from ``ld``: ``k_dst`` / ``v_dst``
  [bk, D] bf16 get ``k_src`` / ``v_src`` as bf16 (8-bit: converted; bf16: in place, the
  same refs), value rows of dead slots (before ``start``, at / past ``live_end``)
  selected to 0; ``guard``: non-finite value rows selected to 0 and their key rows to
  NaN (the module docstring's rule)."""
  bk, d = k_src.shape
  keep = mops.live_rows(ld, start, live_end, bk, ops)
  poison = None
  if guard:
    poison = lax.broadcast_in_dim(_bad_value_rows(v_src), (bk, TILE_COLS), [0]) > 0.0
    keep = keep & ~poison
  for c in range(d // TILE_COLS):
    cols = pl.ds(c * TILE_COLS, TILE_COLS)
    if guard or k_dst is not k_src:
      kc = to_bf16(k_src.at[:, cols][...])
      if guard:
        kc = jnp.where(poison, jnp.array(jnp.nan, jnp.bfloat16), kc)
      k_dst.at[:, cols][...] = kc
    vc = to_bf16(v_src.at[:, cols][...])
    v_dst.at[:, cols][...] = jnp.where(keep, vc, jnp.zeros_like(vc))


def _row_limits(row_block, live_end, plan: RowsPlan, ops: Ops, bk: int):
  """int32 ``[64, bk]``: the key position row r of the program stops before (causal:
  ``L - T + t + 1`` clipped to ``[0, L]``; 0 for padding rows), broadcast along a block."""
  r = row_block * BLOCK_ROWS + ops.iota((BLOCK_ROWS, bk), 0)
  hi = jnp.clip(live_end - plan.num_tokens + r // plan.group + 1, 0, live_end)
  return jnp.where(r < plan.rows, hi, 0)


def _write_state(acc, m, l, seen, o_tile, lse_rows):
  """One split's normalized state of 64 rows (`fdecode.kernels.mosaic_gpu.ops.store_state`):
  ``o_tile`` [64, D], ``lse_rows`` [64]; a row that saw no key in the split (from the
  positions, ``seen``): 0, -inf. A row whose ``acc`` holds an inf or NaN (a non-finite
  value it sees, through P V) gets ``l = NaN`` first, so every column of its out and its
  lse are NaN."""
  l = jnp.where(mops.nonfinite_rows(acc) > 0.0, jnp.nan, l)
  mops.store_state(acc, m, l, seen == 0.0, o_tile, lse_rows)


def _kernel(*refs, plan: RowsPlan, ops: Ops):
  # ends_ref i32[B]; paged: tables_ref i32[B * n]; q_ref bf16[B*Hkv, R_p, D]; k_ref, v_ref
  # [B*Hkv, S_c, D] or pools [Hkv, P, page_size, D] (bf16 or 8-bit); 8-bit: ks_ref, vs_ref
  # f32 (`paging.copy_block`); o_ref f32[B*Hkv, n_splits, R_p, D]; lse_ref
  # f32[B*Hkv, n_splits, R_p]; smem: Q [64, D]; K, V [stages, bk, D]; 8-bit: bf16 K, V
  # operands [bk, D], scales f32[2, stages, bk]; P bf16[64, bk].
  ends_ref, *refs = refs
  tables_ref = refs.pop(0) if plan.paged else None
  q_ref, k_ref, v_ref, *refs = refs
  if plan.quantized:
    ks_ref, vs_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, kb_smem, vb_smem, sc_smem, p_smem, bars = refs
  else:
    (o_ref, lse_ref, q_smem, k_smem, v_smem, p_smem, bars), ks_ref, vs_ref, sc_smem = refs, None, None, None
  q_bar, k_full, v_full, s_full, free = bars
  bk, stages = plan.block, plan.stages
  row_block, split, bh = lax.axis_index("rows"), lax.axis_index("split"), lax.axis_index("bh")
  seq, head = bh // plan.kv_heads, lax.rem(bh, plan.kv_heads)
  live_end = jnp.clip(ends_ref[seq], 0, plan.seq_len)
  first, last = blk.split_range(live_end, split, plan.num_splits, plan.num_tokens, plan.seq_len, bk, Modifiers())
  steps = jnp.maximum(last - first, 0)
  load_start = functools.partial(paging.load_start, plan)
  copy_block = lambda step, slot: paging.copy_block(
      plan, (k_ref, v_ref, ks_ref, vs_ref), (k_smem, v_smem, sc_smem),
      (k_full, v_full, s_full if plan.quantized else None), tables_ref=tables_ref, seq=seq, head=head, bh=bh,
      block=first + step, live_end=live_end, slot=slot)

  @pl.when(lax.axis_index("wg") == 1)
  def _memory():
    plgpu.set_max_registers(plan.memory_registers, action="decrease")
    q_rows = q_ref.at[bh, pl.ds(row_block * BLOCK_ROWS, BLOCK_ROWS)]
    tma_ring(steps, stages, lambda: plgpu.copy_gmem_to_smem(q_rows, q_smem, q_bar.at[0]), copy_block, free)

  @pl.when(lax.axis_index("wg") == 0)
  def _compute():
    plgpu.set_max_registers(plan.compute_registers, action="increase")
    hi = _row_limits(row_block, live_end, plan, ops, bk)
    band = live_end - (plan.num_tokens - 1)  # slots at or past it: seen by some rows only

    @pl.when(steps > 0)
    def _():
      plgpu.barrier_wait(q_bar.at[0])

    def step_body(step, carry):
      acc, m, l, seen = carry
      slot = lax.rem(step, stages)
      start = (first + step) * bk
      ld = load_start(first + step)
      plgpu.barrier_wait(k_full.at[slot])
      plgpu.barrier_wait(v_full.at[slot])
      prepare = functools.partial(_prepare_operands, ld=ld, start=start, live_end=live_end,
                                  guard=plan.guarded, ops=ops)
      if plan.quantized:
        plgpu.barrier_wait(s_full.at[slot])
        plgpu.barrier_wait(s_full.at[stages + slot])
        prepare(k_smem.at[slot], v_smem.at[slot], kb_smem, vb_smem)
        k_op, v_op = kb_smem, vb_smem
      else:
        k_op, v_op = k_smem.at[slot], v_smem.at[slot]
        touched = (ld < start) | (ld + bk > live_end) | (ld + bk > band if plan.guarded else False)
        pl.when(touched)(functools.partial(prepare, k_op, v_op, k_op, v_op))
      plgpu.commit_smem()
      s = ops.qk(q_smem, k_op)
      pos = ld + ops.iota((BLOCK_ROWS, bk), 1)
      visible = (pos >= start) & (pos < hi)
      cols = (lambda i: ops.load_cols(sc_smem.at[i, slot])) if plan.quantized else (lambda i: None)
      p, alpha, m, l = online_softmax(s, visible, m, l, plan.softmax_scale, cols(0), cols(1))
      seen = jnp.maximum(seen, jnp.where(visible, 1.0, 0.0).max(axis=1))
      p_smem[...] = p.astype(p_smem.dtype)
      plgpu.commit_smem()
      acc = ops.pv(acc, alpha, p_smem, v_op)
      mops.release_slot(free, slot, step, stages, steps)
      return acc, m, l, seen

    init = (*mops.initial_state(plan.head_dim, ops), ops.rows(jnp.zeros((BLOCK_ROWS,), jnp.float32)))
    acc, m, l, seen = lax.fori_loop(0, steps, step_body, init)
    out_rows = pl.ds(row_block * BLOCK_ROWS, BLOCK_ROWS)
    _write_state(acc, m, l, seen, o_ref.at[bh, split, out_rows], lse_ref.at[bh, split, out_rows])


def _scratch(plan: RowsPlan):
  d, bk, st = plan.head_dim, plan.block, plan.stages
  tiled = mops.smem_transforms(BF16_BYTES)
  barriers = (plgpu.Barrier(num_barriers=1),                                  # Q landed
              plgpu.Barrier(num_arrivals=plan.copies, num_barriers=st),       # K slot landed
              plgpu.Barrier(num_arrivals=plan.copies, num_barriers=st),       # V slot landed
              plgpu.Barrier(num_arrivals=plan.scale_copies, num_barriers=2 * st),  # k / v scales landed
              plgpu.Barrier(num_arrivals=1, num_barriers=st))     # slot released
  q = plgpu.SMEM((BLOCK_ROWS, d), jnp.bfloat16, transforms=tiled)
  p = plgpu.SMEM((BLOCK_ROWS, bk), jnp.bfloat16, transforms=tiled)
  if not plan.quantized:
    kv = plgpu.SMEM((st, bk, d), jnp.bfloat16, transforms=tiled)
    return [q, kv, kv, p, barriers]
  tiled8 = mops.smem_transforms(1)
  kv8 = plgpu.SMEM((st, bk, d), jnp.dtype(plan.cache_dtype), transforms=tiled8)
  op = plgpu.SMEM((bk, d), jnp.bfloat16, transforms=tiled)
  return [q, kv8, kv8, op, op, plgpu.SMEM((2, st, bk), jnp.float32), p, barriers]


def rows_states(q_rows, ends, k, v, k_scale=None, v_scale=None, *, block_tables=None, plan: RowsPlan,
                interpret=None):
  """The kernel's own outputs, rows padded to ``plan.rows_padded``: float32 ``(o [B, Hkv,
  n_splits, R_p, D], lse [B, Hkv, n_splits, R_p])`` (`rows_partials` for the arguments)."""
  b, hkv, r, d = q_rows.shape
  if plan.paged:
    want = (plan.kv_heads, k.shape[1] if k.ndim == 4 else -1, plan.page_size, plan.head_dim)
    names = (f"pools [{plan.kv_heads}, P, {plan.page_size}, {plan.head_dim}] and block_tables "
             f"[{plan.batch}, {plan.pages}]")
    tables_ok = block_tables is not None and tuple(block_tables.shape) == (plan.batch, plan.pages)
  else:
    want, tables_ok = (plan.batch, plan.kv_heads, plan.seq_len, plan.head_dim), block_tables is None
    names = f"k, v {list(want)} and no block_tables"
  if (b, hkv, r, d) != (plan.batch, plan.kv_heads, plan.rows, plan.head_dim) or k.shape != want or \
      v.shape != want or not tables_ok:
    raise ValueError(f"rows_partials: the plan is for q_rows [{plan.batch}, {plan.kv_heads}, {plan.rows}, "
                     f"{plan.head_dim}], {names}; got {q_rows.shape=} {k.shape=} {v.shape=} "
                     f"block_tables.shape={None if block_tables is None else tuple(block_tables.shape)}")
  if plan.quantized != (k_scale is not None and v_scale is not None):
    raise ValueError(f"rows_partials: a {plan.cache_dtype} plan needs k_scale and v_scale "
                     f"{'(per token)' if plan.quantized else 'None'}")
  args = paging.operands(plan, q_rows, ends, k, v, k_scale, v_scale, block_tables)
  o, lse = mops.launch(
      _kernel, plan, args,
      out_type=(jax.ShapeDtypeStruct((b * hkv, plan.num_splits, plan.rows_padded, d), jnp.float32),
                jax.ShapeDtypeStruct((b * hkv, plan.num_splits, plan.rows_padded), jnp.float32)),
      scratch_types=_scratch(plan), grid_names=("rows", "split", "bh"), num_threads=2,
      # Lane lowering semantics, named: 0.10.2's default and the one this kernel lowers
      # with (under Warpgroup, jax 0.11.2's default, 0.10.2 refuses a 2-bit register type).
      semantics=plgpu.LoweringSemantics.Lane, name="fdecode_rows_mosaic_gpu", interpret=interpret)
  return (o.reshape(b, hkv, plan.num_splits, plan.rows_padded, d),
          lse.reshape(b, hkv, plan.num_splits, plan.rows_padded))


def rows_partials(q_rows, ends, k, v, k_scale=None, v_scale=None, *, block_tables=None, plan: RowsPlan,
                  interpret=None):
  """Per-split partial states of GQA decode from the Hopper rows kernel.

  Args:
    q_rows: bf16 ``[B, Hkv, R, D]`` queries, row r = t * G + g of kv head h being query
      head ``h * G + g`` of new token t.
    ends: int32 ``[B]``: each sequence's length (new tokens included) in the cache.
    k, v: ``[B, Hkv, S, D]`` contiguous caches, or with ``block_tables`` paged pools
      ``[Hkv, P, page_size, D]`` (`fdecode.flash_decode`'s layout), bf16 or (both) int8
      / float8_e4m3fn.
    k_scale, v_scale: float32 per-token scales (8-bit caches), else None: ``[B, Hkv, S,
      1]``, paged ``[Hkv, P, page_size, 1]`` (leading axes of size 1 broadcast).
    block_tables: int32 ``[B, n]`` (paged; entries past a sequence's length are never
      dereferenced, ids are clipped into the pool) or None.
    plan: `fdecode.kernels.mosaic_gpu.rows_plan` for these shapes.
    interpret: None / False: compiled for the GPU (sm_90a); an ``InterpretGPUParams``:
      jax's Mosaic GPU interpreter (CPU).

  Returns:
    ``(o, lse)``: float32 ``[B, Hkv, n_splits, R, D]`` and ``[B, Hkv, n_splits, R]``
    (natural-log LSE; a row with no visible key in a split: o = 0, lse = -inf), merged
    over axis 2 by `fdecode.combine.merge_states`.
  """
  o, lse = rows_states(q_rows, ends, k, v, k_scale, v_scale, block_tables=block_tables, plan=plan,
                       interpret=interpret)
  r = q_rows.shape[2]
  return o[:, :, :, :r], lse[:, :, :, :r]
