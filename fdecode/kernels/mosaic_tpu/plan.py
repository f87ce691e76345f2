"""The Mosaic (TPU) kernels' plan (`fdecode.kernels.mosaic_tpu`): `make_plan` decides one
call (read mode, fallback to XLA, block sizes, splits); `plan` sizes its blocks and VMEM;
`split_count` is the split rule.

The footprint (double-buffered blocks, scratch and in-flight block values) depends on
the block sizes only, never on S; `plan` sets ``vmem_limit_bytes`` from it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from fdecode import config as config_lib
from fdecode.cache.layout import CacheView
from fdecode.kernels.common.modifiers import Modifiers, window_tokens
from fdecode.kernels.mosaic_tpu.token_major import pool_view, token_major_read

_LANES = 128
# Default bytes of K + V one grid step moves: large enough to amortize the ~0.35 us
# per-step overhead (hundreds of KiB), small enough that double buffering stays far
# under the smallest scoped-VMEM default (16 MiB on v5e).
_STEP_BYTES = 512 * 1024
_MAX_STEP_TOKENS = 2048
_MAX_PAGES_PER_STEP = 64
# Tokens per step of a whole-head-axis read of up to 8 kv heads (`plan`): its relayout
# scratch is 4 KiB per token, head and 128 columns; more heads take proportionally fewer
# tokens (at least `_HEAD_AXIS_MIN_TOKENS`; a paged step still takes a whole page).
_HEAD_AXIS_STEP_TOKENS = 128
_HEAD_AXIS_MIN_TOKENS = 16
# Most VMEM a whole-head-axis plan may count (a paged step is whole pages, so many heads
# of large pages can need more); past it the dispatch reads a head-major copy. 48 MiB
# leaves headroom on the smallest TPU VMEM (64 MiB a TensorCore on v7x).
MAX_HEAD_AXIS_VMEM_BYTES = 48 * 1024 * 1024
_VREG_BYTES = 4096
# Headroom above the computed footprint for Mosaic's internal scratch.
_VMEM_HEADROOM = 4 * 1024 * 1024
# Split the cache only while the programs leave the TensorCores idle: the Ascend
# IncreFlashAttention rule (split when the work units are under 0.4 * cores).
_SPLIT_OCCUPANCY = 0.4
# Most splits one program's (sequence, kv heads) may use: past this the merge costs more
# than it saves (Tenstorrent's `max_cores_per_head_batch` = 16).
MAX_SPLITS_PER_PROGRAM = 16


def _sublanes(dtype) -> int:
  """Rows of one native VMEM tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit dtypes."""
  return 32 // jnp.dtype(dtype).itemsize


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _tile_bytes(shape, dtype) -> int:
  """VMEM bytes of an array of ``shape``, padded to (sublane, 128-lane) tiles."""
  *lead, rows, cols = (1,) * max(0, 2 - len(shape)) + tuple(shape)
  return (math.prod(lead) * _round_up(rows, _sublanes(dtype)) * _round_up(cols, _LANES)
          * jnp.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static sizes of one Mosaic kernel launch.

  Attributes:
    paged: paged (manual DMA) or contiguous (BlockSpec) kernel.
    block: tokens per grid / loop step (contiguous ``bk``; paged pages_per_step * page_size).
    pages_per_step: pages DMA'd per step (paged only).
    rows_p: query rows padded to the sublane tiling.
    vmem_bytes: footprint of the double-buffered blocks and scratch.
    vmem_limit_bytes: what the kernel asks Mosaic for.
  """
  paged: bool
  block: int
  pages_per_step: int
  rows_p: int
  vmem_bytes: int
  vmem_limit_bytes: int


def _default_step_tokens(token_bytes: int) -> int:
  tokens = 1 << max(_STEP_BYTES // token_bytes, 1).bit_length() - 1
  return max(_LANES, min(tokens, _MAX_STEP_TOKENS))


def dma_unit(k, v=None, k_rope=None) -> int:
  """Cache rows of one 32-bit sublane (1 for 32-bit caches, 2 for 16-bit, 4 for 8-bit):
  the finest row offset and size a Mosaic DMA addresses in a tiled HBM or VMEM array
  (libtpu rejects a lone 16-bit row). A paged kernel's pages and a sparse kernel's
  per-token copies come in these units."""
  return max(4 // jnp.dtype(x.dtype).itemsize for x in (k, v, k_rope) if x is not None)


def per_token(scale, paged: bool) -> bool:
  """Whether a canonical scale / offset varies along the tokens (then it is streamed with
  its block): contiguous ``[B|1, Hkv|1, S|1, nt]``, paged ``[Hkv|1, P|1, ps|1, nt]``."""
  return scale.shape[2] > 1 or (paged and scale.shape[1] > 1)


def plan(q_rows, k, v, *, block_tables=None, k_scale=None, v_scale=None, k_offset=None,
         v_offset=None, block_k: int | None = None, mods: Modifiers = Modifiers(), mask=None,
         bias=None, alibi=None, v_head_dim=None, k_rope=None, num_slots: int | None = None,
         slot_rows: int = 1, kv_heads_per_program: int = 1, head_axis: bool = False) -> Plan:
  """Block sizes and VMEM footprint for these operands (arrays or ShapeDtypeStructs).

  ``block_k``: tokens per step; ``None`` picks about `_STEP_BYTES` of K + V per step.
  It is rounded up to the cache dtype's sublane tiling (paged: to whole pages). ``v``
  None (MLA): no value stream, the values are the key block's first ``v_head_dim``
  columns; ``k_rope``: a second key stream. ``num_slots``: a sparse call's index-list
  length K (`fdecode.kernels.mosaic_tpu.sparse`): blocks are slots of the list, each
  ``slot_rows`` cache rows wide in VMEM (its DMA unit). ``kv_heads_per_program``: kv
  heads one program computes (a token-major pool's head words, or its whole head axis):
  the streamed blocks are that many heads wide, and the query, output, scratch and
  in-flight values are per head. ``head_axis``: the program reads a token-major pool's
  whole head axis (`fdecode.kernels.mosaic_tpu.token_major.token_major_read`): each
  buffered token takes the 32-bit sublanes its Hkv packed rows fill, and each head is
  relaid out of the loaded block through vector registers: counted as one (4 KiB) per
  token, head, stream and 128 columns, an upper bound of what libtpu allocated on v5e
  for 1024 / 2048-token steps (bf16 Hkv 1, 3, 5; int8 Hkv 2, 6: 5.9-7.7 KiB a token and
  head for K + V of 128 columns, against 8 counted), so such a step is
  `_HEAD_AXIS_STEP_TOKENS` (fewer for more than 8 heads).
  """
  r, dq = q_rows.shape[-2:]
  dk = k.shape[-1]
  dv = v_head_dim if v is None else v.shape[-1]
  paged = block_tables is not None
  rows_p = _round_up(r, _sublanes(q_rows.dtype))
  # Streams besides K: (width, dtype) of V (absent for MLA) and k_rope.
  extra = [(x.shape[-1], x.dtype) for x in (v, k_rope) if x is not None]
  token_bytes = dk * jnp.dtype(k.dtype).itemsize + sum(w * jnp.dtype(d).itemsize for w, d in extra)
  if head_axis:
    per_head = _HEAD_AXIS_STEP_TOKENS * 8 // max(k.shape[0], 8)
    default = max(1 << per_head.bit_length() - 1, _HEAD_AXIS_MIN_TOKENS)
  else:
    default = _default_step_tokens(token_bytes)
  tokens = block_k or default
  quant = [a for a in (k_scale, k_offset, v_scale, v_offset) if a is not None]
  if paged and num_slots is None:
    page_size, table_len = k.shape[2], block_tables.shape[1]
    pages = max(1, min(-(-tokens // page_size), _MAX_PAGES_PER_STEP, table_len))
    block = pages * page_size
  else:
    pages = 0
    seq_len = k.shape[2] if num_slots is None else num_slots
    align = max([_sublanes(k.dtype)] + [_sublanes(d) for _, d in extra])
    if num_slots is not None:
      tokens = max(tokens // slot_rows, align)
    block = seq_len if seq_len <= tokens else _round_up(tokens, align)
  # Streams (K, V, k_rope and per-token scales): two buffers each, blocks of `rows` rows.
  rows = block * (slot_rows if num_slots is not None else 1)
  heads = kv_heads_per_program
  caches = [(dk, k.dtype)] + extra
  if head_axis:  # every head's rows in the 32-bit sublanes they fill; one head relaid out at a time
    hkv = k.shape[0]
    cache_streams = rows * sum(-(-hkv * jnp.dtype(d).itemsize // 4) * 4 * _round_up(w, _LANES) for w, d in caches)
    relayout = rows * hkv * sum(-(-w // _LANES) for w, _ in caches) * _VREG_BYTES
  else:
    cache_streams = heads * sum(_tile_bytes((rows, w), d) for w, d in caches)
    relayout = 0
  # Per head: scales and offsets, mask / bias blocks (below).
  streams = sum(_tile_bytes((rows if per_token(a, paged) else 1, a.shape[-1]), jnp.float32)
                for a in quant)
  io = (_tile_bytes((rows_p, dq), q_rows.dtype) + _tile_bytes((rows_p, dv), jnp.float32)
        + _tile_bytes((rows_p, 1), jnp.float32))
  scratch = _tile_bytes((rows_p, dv), jnp.float32) + 2 * _tile_bytes((rows_p, 1), jnp.float32)
  # In-flight block values (scores / probabilities, a dequantized block) held in VMEM.
  work = 2 * _tile_bytes((rows_p, rows), jnp.float32) + _tile_bytes((rows, max(dq, dv)), jnp.float32)
  for x, dtype in ((mask, jnp.int32), (bias, None)):  # [M, block] blocks, expanded by rows
    if x is not None:
      m = x.shape[2] * x.shape[3]
      streams += _tile_bytes((m, block), dtype or x.dtype)
      work += _tile_bytes((rows_p, m), jnp.float32) + _tile_bytes((rows_p, block), jnp.float32)
  if alibi is not None:
    io += _tile_bytes((rows_p, 1), jnp.float32)
  vmem = 2 * cache_streams + heads * (2 * streams + 2 * io + scratch + work) + relayout
  limit = _round_up(vmem + _VMEM_HEADROOM, 1024 * 1024)
  return Plan(paged=paged and num_slots is None, block=block, pages_per_step=pages, rows_p=rows_p,
              vmem_bytes=vmem, vmem_limit_bytes=limit)


@dataclasses.dataclass(frozen=True)
class CallPlan:
  """One Mosaic (TPU) call, decided before it runs (`make_plan`); the dispatch runs it as it is.

  Attributes:
    backend: ``"mosaic"``, or ``"xla"``: the call takes the XLA path on TPU (a float16
      cache: Mosaic has no float16 vectors; a float64 query or cache, under
      ``jax_enable_x64``: nor 64-bit ones; or pages / sparse rows that split a 32-bit
      sublane: no DMA can address them).
    sparse: index lists: the sparse kernel (`fdecode.kernels.mosaic_tpu.sparse`).
    read: how token-major caches are read in place
      (`fdecode.kernels.mosaic_tpu.token_major.TokenMajorRead`), or None: head-major.
    as_pool: a contiguous token-major cache read as a pool of whole pages
      (`fdecode.kernels.mosaic_tpu.token_major.contiguous_as_pool`).
    sizes: block sizes and VMEM (`plan`); None for ``backend="xla"``.
    num_splits: chunks of the token axis (0 for ``backend="xla"``: its own plan decides).
    upcast_query: a float16 query computes in float32 (over a cache that is not float16).
    reason: why the kernels do not take the call (``backend="xla"``), else None.
    split_blocks: the batch-invariant mode's blocks (``sizes.block`` positions) per split,
      laid at absolute positions (`fdecode.kernels.common.block.split_range` with ``split_blocks``); 0:
      the split rule's count, dealt over each sequence's live blocks.
  """
  backend: str
  sparse: bool = False
  read: object = None
  as_pool: bool = False
  sizes: Plan | None = None
  num_splits: int = 0
  upcast_query: bool = False
  reason: str | None = None
  split_blocks: int = 0


def _struct(x):
  return None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)


def make_plan(q_rows, view: CacheView, *, extra: dict, num_tokens: int, num_splits: int | None = None,
              block_k: int | None = None, count_splits: bool = True, split_size: int | None = None) -> CallPlan:
  """The plan of one Mosaic call (arrays or ShapeDtypeStructs): the read mode, the fallback
  to XLA, the block sizes and the split count, each decided here only.

  ``q_rows`` ``[B, Hkv, R, Dk]``; ``view``: the cache (`fdecode.cache.layout.CacheView`),
  token-major ones read in place where `token_major_read` says, else its head-major view.
  ``extra``: the dispatch's other canonical operands (mods, mask / bias / alibi,
  v_head_dim; sparse, indices, index_bounds for index lists).
  ``num_splits`` None: `split_count` over the blocks the rows see, on one program per
  (sequence, kv heads of a program). ``count_splits`` False: the plan without its split
  count (``num_splits`` 0), all a refusal needs: nothing of it depends on B (a symbolic B
  under ``jax.export`` is never compared). ``split_size``: the batch-invariant mode: splits
  of that many positions rounded up to whole blocks (the block depends on the cache's
  widths and dtypes, never on T or B), ``ceil(capacity / split)`` of them."""
  b, hkv = q_rows.shape[:2]
  if any(x is not None and jnp.dtype(x.dtype).itemsize > 4 for x in (q_rows, view.k, view.v, view.k_rope)):
    return CallPlan("xla", reason="64-bit operands (jax_enable_x64): a TPU has no 64-bit vectors")
  paged, sparse = view.paged, "sparse" in extra
  how = None if view.layout == "HND" else token_major_read(
      view.k, view.v, view.k_rope, view.k_scale, view.v_scale, paged=paged, sparse=sparse)
  float16_cache = any(x is not None and x.dtype == jnp.float16 for x in (view.k, view.v, view.k_rope))
  upcast = q_rows.dtype == jnp.float16 and not float16_cache
  qs = jax.ShapeDtypeStruct(q_rows.shape, jnp.float32 if upcast else q_rows.dtype)
  mods_etc = {n: x for n, x in extra.items() if n not in ("sparse", "indices", "index_bounds")}
  slots = extra["indices"].shape[-1] if sparse else None
  as_pool, p = False, None
  if how is not None:  # token-major caches read in place
    read = view
    if sparse and not paged:  # `plan` sizes pools: a contiguous [B, S, Hkv, D] as B pages of S tokens
      read = dataclasses.replace(view, paged=True)
    elif not paged:  # by the paged kernel: a contiguous cache as the pool of whole pages
      as_pool = True
      read = jax.eval_shape(pool_view, jax.tree.map(_struct, view))
    k, v, rope = read.head_major_shapes()  # the head-major pool `plan` sizes
    args = dict(mods_etc, **dict(read.kernel_arrays(), k_rope=rope))
    if sparse:  # each listed token's heads DMA'd
      unit = 1 if how.axis else dma_unit(view.k, view.v, view.k_rope)
      p = plan(qs, k, v, block_k=block_k, num_slots=slots, slot_rows=unit, head_axis=how.axis, **args)
    else:
      p = plan(qs, k, v, block_k=block_k, kv_heads_per_program=how.heads, head_axis=how.axis, **args)
    if how.axis and p.vmem_bytes > MAX_HEAD_AXIS_VMEM_BYTES:
      how, p, as_pool = None, None, False  # (many heads of large pages) a head-major copy instead
  if how is None:
    k, v, rope = view.head_major_shapes()
    args = dict(mods_etc, **dict(view.kernel_arrays(), k_rope=rope))
    unit = dma_unit(k, v, rope)
    if float16_cache:
      return CallPlan("xla", reason="a float16 cache: Mosaic has no float16 vectors")
    if (sparse or paged) and k.shape[2] % unit:
      return CallPlan("xla", reason=f"pages of {k.shape[2]} tokens split the {unit}-row unit a DMA addresses")
    if sparse:  # blocks of index-list slots, each token DMA'd on its own
      p = plan(qs, k, v, block_k=block_k, num_slots=slots, slot_rows=unit, head_axis=False, **args)
    else:
      p = plan(qs, k, v, block_k=block_k, **args)
  if not count_splits:
    return CallPlan("mosaic", sparse=sparse, read=how, as_pool=as_pool, sizes=p, upcast_query=upcast)
  if split_size is not None:
    split_blocks = max(-(-split_size // p.block), 1)
    splits = max(-(-view.capacity // (split_blocks * p.block)), 1)
    return CallPlan("mosaic", sparse=sparse, read=how, as_pool=as_pool, sizes=p, num_splits=splits,
                    upcast_query=upcast, split_blocks=split_blocks)
  if sparse:
    seen, programs = slots, hkv
  else:
    seen, programs = window_tokens(view.capacity, num_tokens, extra["mods"]), hkv // (1 if how is None else how.heads)
  splits = num_splits or split_count(b, programs, max(-(-seen // p.block), 1), config_lib.num_parallel_units("tpu"))
  return CallPlan("mosaic", sparse=sparse, read=how, as_pool=as_pool, sizes=p, num_splits=splits,
                  upcast_query=upcast)


def split_count(batch: int, programs: int, num_blocks: int, num_units: int) -> int:
  """The Mosaic kernels' split rule: chunks of the token axis for a grid of ``batch``
  sequences x ``programs`` (kv heads, or kv-head groups, of a sequence) on ``num_units``
  TensorCores (`fdecode.config.num_parallel_units`: 1 on v5e / v6e, 2 on a v4 / v5p
  megacore, whose grid axes stay "parallel").

  One (sequence, program) pair is one unit of work. With at least ``0.4 * num_units`` of
  them the chip is already busy and the cache is not split; otherwise each pair gets
  ``ceil(num_units / (batch * programs))`` splits, at most `MAX_SPLITS_PER_PROGRAM` and
  at most one per block.
  """
  work = batch * programs
  if work >= _SPLIT_OCCUPANCY * num_units:
    return 1
  splits = math.ceil(num_units / max(work, 1))
  return max(1, min(splits, MAX_SPLITS_PER_PROGRAM, num_blocks))
