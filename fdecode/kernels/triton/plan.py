"""The Triton kernel's plan: every decision about a call, made once, before it runs.

`make_plan` returns a frozen `TritonPlan` for the GPU compiled for (`fdecode.kernels.common.chips.Gpu`): the
column pieces of each head dim, the query rows a program holds, the key block and warps
that fit the registers and shared memory (`fdecode.kernels.triton.launch`, calibrated on ptxas), the split
count (`fdecode.config.gpu_num_splits`) or the balanced schedule's work items, and
whether the split kernel writes the final output itself (one split) or partial states
that the combine kernel merges (`fdecode.kernels.triton.combine`). The kernels take the
plan as it is. ``interpret=True`` runs the *same* plan in Pallas' interpreter (the same
row tiles, pieces and block; a target GPU's plan, an H100's unless a mesh or a local GPU
names another), so the CPU tests exercise what the GPU runs. One difference: with
``num_splits=None`` the interpreter keeps the CPU's split count
(`fdecode.config.default_num_splits`): the count changes no tile shape, and a GPU's
wave of splits would multiply the interpreter's per-program copies.

Rows. A kv head's R = T * G query rows are the rows of its matmuls. Triton tensors have
power-of-two sizes, so a program holds ``block_r`` rows, a power of two >= 16: R rounded
up to the next power of two while that fits `ROW_BUDGET`, else the largest power of two
that fits, in ``ceil(R / block_r)`` row blocks (each re-reads the cache, from L2 after
the first). Padding to a power of two (48 -> 64, 80 -> 128) costs only matmul rows,
which a memory-bound decode has to spare; tiling into smaller blocks instead (48 = 32 +
16) would read the cache once per block. The rows past R are *masked*: their queries
load a real row (never out of bounds), they see no key, and their stores are masked off,
so nothing is padded in memory and no q copy is made.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from fdecode.kernels.common import chips
from fdecode import config as config_lib
from fdecode.cache.layout import kv_heads, token_axis
from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import Modifiers, window_tokens
from fdecode.kernels.triton.geometry import StepPart
from fdecode.kernels.triton.launch import (DIFFERING_ROWS_RESERVE, MIN_DOT, launch_plan, load_convert_bytes,
                                          pow2_at_least, row_state_factor)

# Elements of q (and of the float32 accumulator) one program holds: with 4 warps about
# 64-128 registers a thread. Wider rows (MLA's 576 / 512) get fewer rows per program
# (sglang's Triton MLA decode: 16 heads a program).
ROW_BUDGET = 16 * 1024
PIECE_COLS = 64                 # a piece costs at least this many columns (dot, masks, acc)
# Widest piece of a float32 computation (FMA dots hold a contraction row a thread).
F32_PIECE = 128
# float32 elements one combine program loads at once (splits x columns): 32 a thread.
COMBINE_ELEMENTS = 4096
# The balanced schedule's combine: work items a program merges per step of its loop (a
# sequence's run is a few items; `segment_combine_tiling`).
COMBINE_CHUNK = 4
# Work items of the balanced schedule past the batch, interpreted (compiled: one wave).
INTERPRET_EXTRA_ITEMS = 8


def row_tiling(rows: int, dq: int, dv: int, compute_bytes: int = 2) -> tuple[int, int]:
  """``(block_r, row_blocks)`` for R = ``rows`` query rows of widths ``dq`` / ``dv``: the
  rows rounded up to a power of two >= 16 while ``block_r * max(dq, dv)`` fits
  `ROW_BUDGET` (a quarter of it for a float32 computation: at half, 64 rows of D = 64
  spilled 192-216 B on H100), else the largest power of two that fits; ``ceil(R /
  block_r)`` blocks."""
  budget = ROW_BUDGET // (4 if compute_bytes == 4 else 1)
  per = max(MIN_DOT, 1 << ((budget // max(dq, dv, 1)).bit_length() - 1))
  block_r = min(max(MIN_DOT, pow2_at_least(rows)), per)
  return block_r, -(-max(rows, 1) // block_r)


def column_pieces(dk, dv, k_tiles, v_tiles, v_from_k, rope_dim, max_width=None):
  """(k, v, k_rope) power-of-two column pieces; MLA values (``v_from_k``) are k's leading pieces."""
  pieces = lambda d, tiles, **kw: blk.head_pieces(d, tiles, pow2=True, max_width=max_width, **kw)
  k_pieces = pieces(dk, k_tiles)
  v_pieces = pieces(dk, k_tiles, limit=dv) if v_from_k else pieces(dv, v_tiles)
  return k_pieces, v_pieces, pieces(rope_dim, 1) if rope_dim else ()


def triton_unsupported(dk: int, dv: int, k_tiles: int = 1, v_tiles: int = 1, *, v_from_k: bool = False,
                       rope_dim: int = 0) -> str | None:
  """Why the Triton kernel cannot take these head dims / scale tiles, or None.
  ``dk``: k's own columns (without ``rope_dim`` k_rope columns)."""
  pieces = column_pieces(dk, dv, k_tiles, v_tiles, v_from_k, rope_dim)
  for name, d, nt, ps in (("Dk", dk, k_tiles, pieces[0]), ("Dv", dv, k_tiles if v_from_k else v_tiles, pieces[1]),
                          ("k_rope's Dr", rope_dim, 1, pieces[2])):
    narrow = [p.width for p in ps if p.width < MIN_DOT]
    if narrow:
      return (f"{name}={d} with {nt} scale tile(s) has a column piece {narrow[0]} wide; "
              f"Triton's dot needs head dims and scale tiles that are multiples of {MIN_DOT}")
  return None


class RowSource(NamedTuple):
  """Where a call's query rows and block-table rows are read from, for a caller whose
  q / block_tables are gathers of larger arrays (`fdecode.ragged`: a serving step's
  blocks of packed rows, each over its sequence's table row). The Triton kernels read
  them in place through the indices (no gather launch); every other path reads the
  gathered arrays the call was given, so the gathers run only there (XLA drops them
  where no lowered path reads them).

  ``q``: ``[N, Hq, Dq]`` packed rows; ``q_start``: int32 ``[B]``, the call's q row
  ``(b, t)`` is ``q[clip(q_start[b] + t, 0, N - 1)]``; ``tables``: int32 ``[M, n]`` and
  ``table_rows``: int32 ``[B]``, the call's table row b is ``tables[table_rows[b]]`` (both
  None: the call's own block tables, or none; table rows are clipped into ``[0, M)``).
  ``caches`` and ``cache_rows`` (a contiguous cache's call, of which k, v, k_rope and
  per-sequence scales are gathers): the whole contiguous caches, a
  `fdecode.cache.layout.CacheView` of ``M`` sequence rows (canonical scales, as the call's
  own view), and int32 ``[B]``: the call's sequence b is cache row ``cache_rows[b]``
  (clipped into ``[0, M)``); ``caches`` without ``cache_rows``: sequence b is cache row b
  (B = M: the call's caches are the whole ones, read as a source's for the balanced
  schedule). ``step``: ``(cu, kv_lens, num_seqs)`` of a ragged step (int32 ``[M + 1]``
  clipped non-decreasing, ``[M]``, ``[1]``), whose part (`make_plan`'s ``step``) the call
  is: each work unit's sequence, first q row, table / cache row and kv length are derived
  in the kernels from them (`fdecode.kernels.triton.geometry`), and ``q_start``,
  ``table_rows``, ``cache_rows`` and the call's ends are not read. ``mask`` / ``bias``
  (with ``step``): the step's per-row arrays as `fdecode.ragged_decode` takes them,
  ``[N|1, S]`` or ``[N|1, Hq, S]``, read by each program at its rows' packed rows (the
  call's own mask / bias are gathers, read only for their form)."""
  q: object
  q_start: object
  tables: object = None
  table_rows: object = None
  caches: object = None
  cache_rows: object = None
  step: object = None
  mask: object = None
  bias: object = None


@dataclasses.dataclass(frozen=True)
class TritonPlan:
  """One call of the Triton kernels, decided (`make_plan`). Hashable: a static argument.

  Rows: ``num_tokens`` T, ``group`` G, ``hq`` Hq; R = T * G rows per kv head, in
  ``row_blocks`` blocks of ``block_r`` (`row_tiling`). Cache: ``paged`` (pool rows
  ``cache_rows = P * page_size``) or contiguous (``cache_rows`` >= ``block``), in
  ``kv_layout``; ``seq_len`` S tokens addressable per sequence. ``quant``: per stream
  (k_scale, k_offset, v_scale, v_offset), None or its static dims. ``fp8_bits``: (k, v)
  float8 dtype name when passed as raw bytes (below sm_89). Launch: ``block`` keys a
  loop step, ``warps``, ``stages``; ``num_splits`` splits of each sequence's blocks, or
  ``balanced`` work items (``items`` programs on grid axis 0) over the ``batch`` B
  sequences (`schedule`). ``final``: one split, the
  split kernel writes the output itself; otherwise the combine kernel merges
  ``num_splits`` partial states, ``combine_tiling`` ``(rows, width, chunk)`` a program
  (one row and ``width`` columns, all splits at once; balanced: `segment_combine_tiling`).
  ``step``: the ragged step's part the call is (`fdecode.kernels.triton.geometry.StepPart`;
  the source's ``step`` arrays then give every unit's geometry); ``step_mods``: its
  source's per-row mask and bias forms, each None or ``(Nm, Hm)`` (rows: 1 or N; heads:
  1 or Hq). ``q_source`` /
  ``table_source``: q rows / table rows are read through a `RowSource`'s indices;
  ``cache_batch`` > 0: a contiguous cache's rows too (``M`` rows: ``cache_source``; read from
  the source's list with ``cache_row_list``, else sequence b's is row b), its
  blocks gathered like a pool's (one page of S tokens per sequence row and kv head), its
  scales' (and offsets') dims in ``quant`` as ``(d0, d1, d2)`` of canonical rank 4.
  """
  gpu: str
  interpret: bool
  num_tokens: int
  group: int
  hq: int
  block_r: int
  row_blocks: int
  paged: bool
  kv_layout: str
  seq_len: int
  cache_rows: int
  page_size: int
  num_pages: int
  table_len: int
  k_pieces: tuple
  v_pieces: tuple
  r_pieces: tuple
  quant: tuple
  fp8_bits: tuple
  v_from_k: bool
  sparse: bool
  mods: Modifiers
  compute_dtype: str
  out_dtype: str
  block: int
  warps: int
  stages: int
  num_splits: int
  balanced: bool
  items: int
  combine_tiling: tuple
  batch: int
  sparse_fold: int = 1
  has_sinks: bool = False
  q_source: bool = False
  table_source: bool = False
  cache_batch: int = 0
  cache_row_list: bool = False
  step: StepPart | None = None
  step_mods: tuple = (None, None)

  @property
  def cache_source(self) -> bool:
    return self.cache_batch > 0

  @property
  def num_rows(self) -> int:
    return self.num_tokens * self.group

  @property
  def rows_padded(self) -> int:
    return self.block_r * self.row_blocks

  @property
  def final(self) -> bool:
    return self.num_splits == 1 and not self.balanced

  @property
  def dv(self) -> int:
    p = self.v_pieces[-1]
    return p.offset + p.width

  @property
  def schedule(self):
    """The balanced schedule's static part (`fdecode.kernels.triton.schedule.Schedule`), or None."""
    if not self.balanced:
      return None
    from fdecode.kernels.triton.schedule import Schedule  # pylint: disable=g-import-not-at-top
    return Schedule(items=self.items, batch=self.batch, block=self.block, num_tokens=self.num_tokens,
                    seq_len=self.seq_len, mods=self.mods)

  @property
  def combine_plan(self):
    from fdecode.kernels.triton.combine import CombinePlan  # pylint: disable=g-import-not-at-top
    rows, width, chunk = self.combine_tiling
    return CombinePlan(num_splits=self.items if self.balanced else self.num_splits, width=width,
                       num_tokens=self.num_tokens, group=self.group, hq=self.hq, dv=self.dv,
                       out_dtype=self.out_dtype, interpret=self.interpret, schedule=self.schedule, rows=rows,
                       chunk=chunk)


def _cache_geometry(k, block_tables, kv_layout):
  """(seq_len, cache_rows, page_size, num_pages, table_len) of a cache in ``kv_layout``."""
  ax = token_axis(kv_layout)
  if block_tables is not None:
    num_pages, page_size = k.shape[ax - 1], k.shape[ax]
    table_len = block_tables.shape[1]
    return table_len * page_size, num_pages * page_size, page_size, num_pages, table_len
  return k.shape[ax], k.shape[ax], 0, 0, 0


def make_plan(q_shape, k, v, *, compute_dtype, out_dtype, kv_layout="HND", block_tables=None, k_rope=None,
         k_scale=None, v_scale=None, k_offset=None, v_offset=None, v_head_dim=None, mods=Modifiers(),
         has_mask_or_bias=False, has_sinks=False, index_slots=None, sparse_fold=1, num_splits=None, block_k=None,
         balance=False, interpret=False, gpu: chips.Gpu | None = None,
         source: RowSource | None = None, step: StepPart | None = None) -> TritonPlan:
  """The plan of one call (arguments canonical, `fdecode.dispatch`; arrays or
  `jax.ShapeDtypeStruct` s: only shapes and dtypes are read).

  ``q_shape``: ``[B, T, Hq, Dq]``; ``k`` / ``v`` / ``k_rope`` in ``kv_layout``, ``v`` None for
  MLA (values are ``k[..., :v_head_dim]``); scales canonical rank 4; ``index_slots``: K of a
  sparse call's index lists (None: dense), ``sparse_fold`` its `fdecode.kernels.common.sparse.Sparse` fold. ``num_splits`` None: compiled, the least
  predicted time among counts that fill a wave of ``gpu`` (`fdecode.config.gpu_num_splits`);
  interpreted, `fdecode.config.default_num_splits` (see the module doc). ``balance`` with
  ``num_splits`` None on a paged cache (or a contiguous one read through a source's cache
  rows) with no index list, and no mask or bias but a ragged step's per-row ones: the
  balanced schedule.
  ``block_k`` None: `fdecode.config.DEFAULT_BLOCK_K`.
  ``gpu``: the target (None: `fdecode.kernels.common.chips.lowering_gpu`). ``source``: a
  `RowSource` the kernels read q (and table rows or cache rows, if it has them) through; not
  with index lists. With cache rows, the balanced schedule also runs on a contiguous cache.

  Raises ValueError, compiled, for shapes `triton_unsupported` names. The interpreter
  runs them with pieces narrower than a dot tile (no compiled plan exists to mirror).
  ``step``: a ragged step's part (with a source holding the step's arrays, on the balanced
  schedule)."""
  gpu = gpu or chips.lowering_gpu()
  b, t, hq, dq = q_shape
  paged = block_tables is not None
  hkv = kv_heads(k.shape, kv_layout, paged)
  dk = k.shape[-1]
  v_from_k = v is None
  dv = v_head_dim if v_from_k else v.shape[-1]
  rope_dim = 0 if k_rope is None else k_rope.shape[-1]
  k_tiles = 1 if k_scale is None else k_scale.shape[-1]
  v_tiles = 1 if v_scale is None else v_scale.shape[-1]
  reason = triton_unsupported(dk, dv, k_tiles, v_tiles, v_from_k=v_from_k, rope_dim=rope_dim)
  if reason and not interpret:
    raise ValueError(f"flash_decode: impl='pallas' on GPU cannot take this shape: {reason}. "
                     "Use impl='xla' (impl=None picks it for such shapes)")
  fp8_bits = tuple(jnp.dtype(x.dtype).name if x is not None and not gpu.native_fp8
                   and jnp.dtype(x.dtype).name.startswith("float8") else None for x in (k, v))
  rows = t * (hq // hkv)
  compute_bytes = jnp.dtype(compute_dtype).itemsize
  block_r, row_blocks = row_tiling(rows, dq, dv, compute_bytes)
  k_pieces, v_pieces, r_pieces = column_pieces(dk, dv, k_tiles, v_tiles, v_from_k, rope_dim,
                                               F32_PIECE if compute_bytes == 4 else None)
  cols = sum(max(p.width, PIECE_COLS) for p in k_pieces + r_pieces + (() if v_from_k else v_pieces))
  caches = [x for x in (k, v, k_rope) if x is not None]
  raw_bytes = max(jnp.dtype(x.dtype).itemsize for x in caches)
  seq_len, cache_rows, page_size, num_pages, table_len = _cache_geometry(k, block_tables, kv_layout)
  convert = load_convert_bytes(raw_bytes, compute_bytes, k_scale is not None or v_scale is not None, fp8_bits,
                               (paged and page_size < MIN_DOT) or (index_slots is not None and compute_bytes == 4))
  cache_batch = 0 if source is None or source.caches is None else source.caches.k.shape[0]
  # A mask / bias is read per sequence of the call's batch, which a work item of the
  # balanced schedule does not own as a grid index; a step's per-row ones are read at the
  # unit's packed rows (`step_mods`).
  step_mods = (None, None) if step is None else tuple(
      None if x is None else (x.shape[0], x.shape[1] if x.ndim == 3 else 1) for x in (source.mask, source.bias))
  balanced = (balance and num_splits is None and (paged or cache_batch > 0) and index_slots is None
              and (not has_mask_or_bias or step is not None))
  launch = launch_plan(gpu, block_r=block_r, dq=dq, dv=dv, cols=cols, raw_bytes=raw_bytes,
                       compute_bytes=compute_bytes, block_k=block_k or config_lib.DEFAULT_BLOCK_K, convert_bytes=convert,
                       row_state=row_state_factor(block_r, k_pieces + v_pieces),
                       reserve=(DIFFERING_ROWS_RESERVE if blk.rows_may_differ(t, mods) and (balanced or compute_bytes == 4)
                                else 0))
  bk = launch.block
  if not paged:
    cache_rows = max(cache_rows, bk)  # a cache shorter than one block is padded to it
  items = b
  if balanced:
    extra = INTERPRET_EXTRA_ITEMS if interpret else -(-gpu.sms * launch.residency(gpu)[1] // (hkv * row_blocks))
    items, num_splits = b + extra, 1
  elif num_splits is None:
    slots = index_slots if index_slots is not None else window_tokens(seq_len, t, mods)
    blocks = max(-(-slots // bk), 1)
    if interpret:
      num_splits = config_lib.default_num_splits(b, hkv, blocks, config_lib.num_parallel_units("cpu"))
    else:
      cols_bytes = sum(x.shape[-1] * jnp.dtype(x.dtype).itemsize for x in caches)
      num_splits = config_lib.gpu_num_splits(
          gpu.sms, launch.residency(gpu), b * hkv * row_blocks, blocks,
          cache_bytes=b * hkv * slots * cols_bytes, split_bytes=2 * 4 * b * hkv * block_r * row_blocks * (dv + 1))
  quant = tuple(None if a is None else ((a.shape[1], a.shape[2]) if paged else (a.shape[2],))
                for a in (k_scale, k_offset, v_scale, v_offset))
  if cache_batch:  # the whole caches' scales, read flat at (cache row, kv head, position)
    quant = tuple(None if a is None else tuple(a.shape[:3]) for a in (source.caches.k_scale, source.caches.k_offset,
                                                                      source.caches.v_scale, source.caches.v_offset))
  return TritonPlan(
      gpu=gpu.name, interpret=bool(interpret), num_tokens=t, group=hq // hkv, hq=hq, block_r=block_r,
      row_blocks=row_blocks, paged=paged, kv_layout=kv_layout, seq_len=seq_len, cache_rows=cache_rows,
      page_size=page_size, num_pages=num_pages, table_len=table_len, k_pieces=k_pieces, v_pieces=v_pieces,
      r_pieces=r_pieces, quant=quant, fp8_bits=fp8_bits, v_from_k=v_from_k, sparse=index_slots is not None,
      mods=mods, compute_dtype=jnp.dtype(compute_dtype).name, out_dtype=jnp.dtype(out_dtype).name, block=bk,
      warps=launch.warps, stages=launch.stages, num_splits=int(num_splits), balanced=balanced, items=items, batch=b,
      combine_tiling=(segment_combine_tiling(b, hkv, t * (hq // hkv), dv, items, gpu.sms) if balanced
                      else (1, combine_width(int(num_splits), dv), COMBINE_CHUNK)),
      sparse_fold=sparse_fold, has_sinks=bool(has_sinks), q_source=source is not None,
      table_source=source is not None and source.table_rows is not None, cache_batch=cache_batch,
      cache_row_list=step is None and source is not None and source.cache_rows is not None, step=step,
      step_mods=step_mods)


# A ragged step's two split launches run as one (`fdecode.kernels.triton.split_states_merged`)
# on GPUs of at least this compute capability. On A100 (sm_80) ptxas held the merged kernel
# at 128 registers and spilled 4-16 B at M = 64, 128 and 256 sequences (compile report, 2048
# rows, Llama-3-8B heads), where each part's own kernel needs none (the prefill part's 176
# registers); on H100 the merged kernel compiled without a spill at every size measured.
MERGE_PARTS_CAPABILITY = (9, 0)


def merges_parts(gpu: chips.Gpu | None = None) -> bool:
  """Whether a ragged step's parts share one split launch on ``gpu`` (None:
  `fdecode.kernels.common.chips.lowering_gpu`, the GPU the plans are made for; an
  H100's when interpreted unless told otherwise): `MERGE_PARTS_CAPABILITY`."""
  return (gpu or chips.lowering_gpu()).capability >= MERGE_PARTS_CAPABILITY


def segment_combine_tiling(batch: int, hkv: int, num_rows: int, dv: int, items: int,
                           sms: int) -> tuple[int, int, int]:
  """``(rows, width, chunk)`` of a balanced-schedule combine program: a tile of ``rows``
  query rows (of the R = ``num_rows`` of a kv head) by ``width`` columns, merging
  ``chunk`` of its sequence's work items a loop step, within ``COMBINE_ELEMENTS``.
  ``chunk``: the average run, ``items / batch`` (at least ``COMBINE_CHUNK``; longer runs
  take more steps); ``rows``: the most the budget leaves, halved (then ``width``, down to
  16) while the grid, ``batch * hkv * ceil(R / rows) * Dv / width`` programs, has fewer
  than 4 a SM. (Before: one row a program, all items padded to a power of two at once:
  ragged_decode's prefill combine at bench_ragged's shape was 73 x 512 x 8 = 299,008
  programs.)"""
  width = dv & -dv  # the largest power of two dividing Dv
  while width > 1 and COMBINE_CHUNK * width > COMBINE_ELEMENTS:
    width //= 2
  chunk = min(max(COMBINE_CHUNK, pow2_at_least(-(-items // max(batch, 1)))), COMBINE_ELEMENTS // width)
  rows = max(1, min(pow2_at_least(num_rows), COMBINE_ELEMENTS // (chunk * width)))
  programs = lambda r, w: batch * hkv * -(-num_rows // r) * (dv // w)
  while rows > 1 and programs(rows, width) < 4 * sms:
    rows //= 2
  while rows == 1 and width > 16 and programs(rows, width) < 4 * sms:
    width //= 2
  return rows, width, min(pow2_at_least(items), COMBINE_ELEMENTS // (rows * width))


def combine_width(num_splits: int, dv: int) -> int:
  """Columns of one combine program: the largest power of two dividing Dv with
  ``pow2(splits) * width <= COMBINE_ELEMENTS`` (at least 1)."""
  width = dv & -dv  # largest power of two dividing Dv
  while width > 1 and pow2_at_least(num_splits) * width > COMBINE_ELEMENTS:
    width //= 2
  return width
