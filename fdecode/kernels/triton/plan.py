"""The Triton kernel's plan: every decision about a call, made once, before it runs.

`make_plan` returns a frozen `TritonPlan` for the GPU compiled for (`fdecode.kernels.common.chips.Gpu`), built of
sub-plans: the query rows a program holds (`RowPlan`) and the column pieces of each head dim (`ColumnPlan`; both
tiled by `fdecode.kernels.triton.tiles`), how the cache is read (`CachePlan`, its `Read` mode), the dtypes and scales
(`DtypePlan`), the key block and warps that fit the registers and shared memory (`fdecode.kernels.triton.launch`),
how a sequence's blocks are dealt to programs (`WorkPlan`: the split rule's count, `_call_splits`, or the balanced
schedule's work items) and what a `RowSource`'s indices give (`SourcePlan`). The kernels take the plan as it is.

``interpret=True`` runs the *same* plan in Pallas' interpreter (the same row tiles, pieces and block; a target GPU's
plan, an H100's unless a mesh or a local GPU names another), so the CPU tests exercise what the GPU runs. One
difference: with ``num_splits=None`` the interpreter keeps the CPU's split count: the count changes no tile shape,
and a GPU's wave of splits would multiply the interpreter's per-program copies.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax.numpy as jnp

from fdecode import config as config_lib
from fdecode.cache.layout import kv_heads, token_axis
from fdecode.kernels.common import block as blk
from fdecode.kernels.common import chips
from fdecode.kernels.common.modifiers import Modifiers, window_tokens
from fdecode.kernels.triton.combine import COMBINE_CHUNK, CombinePlan, combine_width, segment_combine_tiling
from fdecode.kernels.triton.geometry import StepPart
from fdecode.kernels.triton.launch import MIN_DOT, Launch, launch_plan, load_convert_bytes, row_state_factor
from fdecode.kernels.triton.schedule import Schedule
from fdecode.kernels.backend import RowSource
from fdecode.kernels.triton.source import SourcePlan, source_plan
from fdecode.kernels.triton.tiles import F32_PIECE, PIECE_COLS, column_pieces, row_tiling, triton_unsupported
from fdecode.kernels.triton.tuned import LAUNCH
from fdecode.kernels import xla as xla_kernels

# Work items of the balanced schedule past the batch, interpreted (compiled: one wave).
INTERPRET_EXTRA_ITEMS = 8
# Programs per SM a GPU split count aims for: two keep an SM's loads in flight
# (benchmarks/RESULTS.md: the H100 / H200 device times per split count).
PROGRAMS_PER_SM = 2
# A ragged step's two split launches run as one (`fdecode.kernels.triton.split_states_merged`)
# on GPUs of at least this compute capability: below it (A100) ptxas holds the merged kernel
# at 128 registers and spills, where each part's own kernel compiles without.
MERGE_PARTS_CAPABILITY = (9, 0)


class Read(enum.Enum):
  """How a program reads its cache blocks (always in place; `fdecode.kernels.triton.kernel`).
  The token-major layouts (``NHD``) read the same ways: only their BlockSpecs differ."""
  CONTIGUOUS = "contiguous"      # [B, Hkv, S, D]: block j loaded from min(j * bk, S - bk)
  PAGED = "paged"                # a pool's rows gathered through the block table
  CACHE_ROWS = "cache_rows"      # a RowSource's whole contiguous caches, gathered at a sequence's row
  SPARSE = "sparse"              # the listed positions of a contiguous cache
  SPARSE_PAGED = "sparse_paged"  # the listed positions of a pool, through the block table

  @property
  def paged(self) -> bool:
    return self in (Read.PAGED, Read.SPARSE_PAGED)

  @property
  def sparse(self) -> bool:
    return self in (Read.SPARSE, Read.SPARSE_PAGED)


@dataclasses.dataclass(frozen=True)
class RowPlan:
  """A kv head's R = T * G query rows (``num_tokens`` T, ``group`` G, ``hq`` Hq), in
  ``row_blocks`` blocks of ``block_r`` (`row_tiling`)."""
  num_tokens: int
  group: int
  hq: int
  block_r: int
  row_blocks: int

  @property
  def num_rows(self) -> int:
    return self.num_tokens * self.group

  @property
  def padded(self) -> int:
    return self.block_r * self.row_blocks

  @property
  def kv_heads(self) -> int:
    return self.hq // self.group


@dataclasses.dataclass(frozen=True)
class ColumnPlan:
  """Power-of-two column pieces of k, v and k_rope (`column_pieces`); ``v_from_k``: MLA,
  the values are k's leading pieces."""
  k_pieces: tuple
  v_pieces: tuple
  r_pieces: tuple
  v_from_k: bool

  @property
  def dk(self) -> int:  # k's own columns, without k_rope's
    return self.k_pieces[-1].offset + self.k_pieces[-1].width

  @property
  def dv(self) -> int:
    return self.v_pieces[-1].offset + self.v_pieces[-1].width


@dataclasses.dataclass(frozen=True)
class CachePlan:
  """How the cache is read (`Read`), in ``kv_layout``; ``seq_len`` S tokens addressable
  per sequence. ``cache_rows``: a pool's rows ``P * page_size`` (``num_pages`` pages of
  ``page_size``, a table row of ``table_len`` entries), or a contiguous cache's S, padded to
  at least one block. ``cache_batch``: the M sequence rows of a `RowSource`'s whole caches
  (`Read.CACHE_ROWS`; 0 otherwise). ``sparse_fold``: q row b' reads cache row ``b' // fold``."""
  read: Read
  kv_layout: str
  seq_len: int
  cache_rows: int
  page_size: int
  num_pages: int
  table_len: int
  cache_batch: int
  sparse_fold: int


@dataclasses.dataclass(frozen=True)
class DtypePlan:
  """``compute_dtype`` of the dots, ``out_dtype``; ``quant``: per stream (k_scale, k_offset,
  v_scale, v_offset), None or its static dims; ``fp8_bits``: (k, v) float8 dtype name when
  passed as raw bytes (below sm_89), else None."""
  compute_dtype: str
  out_dtype: str
  quant: tuple
  fp8_bits: tuple


@dataclasses.dataclass(frozen=True)
class WorkPlan:
  """How each sequence's blocks are dealt to programs: ``num_splits`` splits, or
  ``balanced`` work items (``items`` programs on grid axis 0) over the ``batch`` B
  sequences (`fdecode.kernels.triton.schedule`). ``combine_tiling``: ``(rows, width,
  chunk)`` of a combine program (one row and ``width`` columns, all splits at once;
  balanced: `fdecode.kernels.triton.combine.segment_combine_tiling`). ``split_blocks``:
  the batch-invariant mode's key blocks per split (`fixed`)."""
  num_splits: int
  balanced: bool
  items: int
  batch: int
  combine_tiling: tuple
  split_blocks: int = 0

  @property
  def fixed(self) -> bool:
    """The batch-invariant mode's splits: ``split_blocks`` blocks each, at absolute
    positions (`fdecode.kernels.common.block.split_range` with ``split_blocks``); 0: the split rule's
    count, dealt over each sequence's live blocks."""
    return self.split_blocks > 0

  @property
  def final(self) -> bool:
    """One split: the split kernel writes the output itself, no combine."""
    return self.num_splits == 1 and not self.balanced


@dataclasses.dataclass(frozen=True)
class TritonPlan:
  """One call of the Triton kernels, decided (`make_plan`). Hashable: a static argument.

  ``gpu``: the target's name; ``interpret``: run in Pallas' interpreter. ``mods``: the
  score modifiers; ``has_sinks``: the call joins attention sinks. The sub-plans: `RowPlan`,
  `ColumnPlan`, `CachePlan`, `DtypePlan`, `fdecode.kernels.triton.launch.Launch` (``block``
  keys a loop step, ``warps``, ``stages``, and the model's shared memory and register
  estimates), `WorkPlan`, `SourcePlan`.
  """
  gpu: str
  interpret: bool
  rows: RowPlan
  columns: ColumnPlan
  cache: CachePlan
  dtypes: DtypePlan
  launch: Launch
  work: WorkPlan
  mods: Modifiers
  has_sinks: bool
  source: SourcePlan

  @property
  def balanced(self) -> bool:
    return self.work.balanced

  @property
  def q_source(self) -> bool:
    return self.source.q_source

  @property
  def cache_source(self) -> bool:
    """The caches read are a `RowSource`'s whole contiguous caches (`Read.CACHE_ROWS`)."""
    return self.cache.read is Read.CACHE_ROWS

  @property
  def schedule(self) -> Schedule | None:
    """The balanced schedule's static part (`fdecode.kernels.triton.schedule.Schedule`), or None."""
    if not self.work.balanced:
      return None
    return Schedule(items=self.work.items, batch=self.work.batch, block=self.launch.block,
                    num_tokens=self.rows.num_tokens, seq_len=self.cache.seq_len, mods=self.mods)

  @property
  def combine_plan(self) -> CombinePlan:
    rows, width, chunk = self.work.combine_tiling
    return CombinePlan(num_splits=self.work.items if self.work.balanced else self.work.num_splits, width=width,
                       num_tokens=self.rows.num_tokens, group=self.rows.group, hq=self.rows.hq, dv=self.columns.dv,
                       out_dtype=self.dtypes.out_dtype, interpret=self.interpret, schedule=self.schedule, rows=rows,
                       chunk=chunk, ordered=self.work.fixed)


def make_plan(q_shape, k, v, *, compute_dtype, out_dtype, kv_layout="HND", block_tables=None, k_rope=None,
              k_scale=None, v_scale=None, k_offset=None, v_offset=None, v_head_dim=None, mods=Modifiers(),
              has_mask_or_bias=False, has_sinks=False, index_slots=None, sparse_fold=1, num_splits=None, block_k=None,
              balance=False, interpret=False, gpu: chips.Gpu | None = None,
              source: RowSource | None = None, step: StepPart | None = None,
              split_size: int | None = None) -> TritonPlan:
  """The plan of one call (arguments canonical, `fdecode.dispatch`; arrays or `jax.ShapeDtypeStruct` s: only
  shapes and dtypes are read).

  ``q_shape``: ``[B, T, Hq, Dq]``; ``k`` / ``v`` / ``k_rope`` in ``kv_layout``, ``v`` None for MLA (values are
  ``k[..., :v_head_dim]``); scales canonical rank 4; ``index_slots``: K of a sparse call's index lists (None:
  dense), ``sparse_fold`` its `fdecode.kernels.common.sparse.Sparse` fold. ``num_splits`` None: `_call_splits`;
  with ``balance``, the balanced schedule where it applies (`_balanced`). ``block_k`` None:
  `fdecode.config.DEFAULT_BLOCK_K`. ``gpu``: the target (None: `fdecode.kernels.common.chips.lowering_gpu`).
  ``source``: a `RowSource` the kernels read q (and table rows or cache rows, if it has them) through; not with
  index lists. ``step``: a ragged step's part (with a source holding the step's arrays, on the balanced schedule).
  ``split_size``: the batch-invariant mode (`_invariant_work`): splits of that many positions (rounded up to
  whole key blocks) at absolute positions, one row tile and key block whatever T, no balanced schedule.

  Raises ValueError, compiled, for shapes `triton_unsupported` names. The interpreter runs them with pieces
  narrower than a dot tile (no compiled plan exists to mirror)."""
  gpu = gpu or chips.lowering_gpu()
  b, t, hq, dq = q_shape
  paged, compute_bytes = block_tables is not None, jnp.dtype(compute_dtype).itemsize
  columns = _columns(k, v, k_rope, k_scale, v_scale, v_head_dim, compute_bytes, interpret)
  dtypes = _dtypes(gpu, k, v, (k_scale, k_offset, v_scale, v_offset), compute_dtype, out_dtype, paged, source)
  invariant = split_size is not None
  if invariant and (index_slots is not None or step is not None or num_splits is not None):
    raise ValueError("make_plan: split_size (the batch-invariant mode) takes no index lists, ragged step or "
                     f"split count; got index_slots={index_slots}, step={step}, num_splits={num_splits}")
  rows = _rows(t, hq, kv_heads(k.shape, kv_layout, paged), dq, columns.dv, compute_bytes, invariant)
  seq_len, cache_rows, page_size, num_pages, table_len = _cache_geometry(k, block_tables, kv_layout)
  cache_batch = 0 if source is None or source.caches is None else source.caches.k.shape[0]
  balanced = not invariant and _balanced(balance, num_splits, paged or cache_batch > 0, index_slots,
                                         has_mask_or_bias, step)
  caches = [x for x in (k, v, k_rope) if x is not None]
  launch = _launch(gpu, rows, columns, dtypes, caches, dq=dq, block_k=block_k,
                   quantized=k_scale is not None or v_scale is not None,
                   gathered=(paged and page_size < MIN_DOT) or (index_slots is not None and compute_bytes == 4),
                   differing_rows=invariant or (blk.rows_may_differ(t, mods) and (balanced or compute_bytes == 4)))
  if not paged:
    cache_rows = max(cache_rows, launch.block)  # a cache shorter than one block is padded to it
  cache = CachePlan(read=_read(paged, index_slots is not None, cache_batch), kv_layout=kv_layout, seq_len=seq_len,
                    cache_rows=cache_rows, page_size=page_size, num_pages=num_pages, table_len=table_len,
                    cache_batch=cache_batch, sparse_fold=sparse_fold)
  slots = index_slots if index_slots is not None else window_tokens(seq_len, t, mods)
  if invariant:
    work = _invariant_work(launch, rows, columns.dv, b=b, seq_len=seq_len, split_size=split_size)
  else:
    work = _work(gpu, launch, rows, columns.dv, b=b, balanced=balanced, num_splits=num_splits, interpret=interpret,
                 default_splits=lambda: _call_splits(gpu, launch, rows, columns.dv, caches, b=b, slots=slots,
                                                     interpret=interpret))
  return TritonPlan(gpu=gpu.name, interpret=bool(interpret), rows=rows, columns=columns, cache=cache, dtypes=dtypes,
                    launch=launch, work=work, mods=mods, has_sinks=bool(has_sinks), source=source_plan(source, step))


def _balanced(balance, num_splits, pages_or_rows: bool, index_slots, has_mask_or_bias, step) -> bool:
  """The balanced schedule where asked for (``balance``, ``num_splits`` None) and its work
  items can find their rows: a pool, or a source's cache rows; no index list; no mask or
  bias, which is read per sequence of the call's batch that a work item does not own as a
  grid index (a step's per-row ones are read at the unit's packed rows)."""
  return (balance and num_splits is None and pages_or_rows and index_slots is None
          and (not has_mask_or_bias or step is not None))


def _columns(k, v, k_rope, k_scale, v_scale, v_head_dim, compute_bytes: int, interpret) -> ColumnPlan:
  """Head dims in power-of-two pieces, a float32 computation's at most `F32_PIECE` wide.
  Raises ValueError, compiled, for pieces narrower than a dot tile (`triton_unsupported`)."""
  dk, v_from_k = k.shape[-1], v is None
  dv = v_head_dim if v_from_k else v.shape[-1]
  rope_dim = 0 if k_rope is None else k_rope.shape[-1]
  k_tiles = 1 if k_scale is None else k_scale.shape[-1]
  v_tiles = 1 if v_scale is None else v_scale.shape[-1]
  reason = triton_unsupported(dk, dv, k_tiles, v_tiles, v_from_k=v_from_k, rope_dim=rope_dim)
  if reason and not interpret:
    raise ValueError(f"flash_decode: impl='pallas' on GPU cannot take this shape: {reason}. "
                     "Use impl='xla' (impl=None picks it for such shapes)")
  pieces = column_pieces(dk, dv, k_tiles, v_tiles, v_from_k, rope_dim, F32_PIECE if compute_bytes == 4 else None)
  return ColumnPlan(*pieces, v_from_k=v_from_k)


def _dtypes(gpu: chips.Gpu, k, v, quant_arrays, compute_dtype, out_dtype, paged, source) -> DtypePlan:
  """float8 caches as bytes where ``gpu`` converts no float8; each scale's / offset's static
  dims (a source's whole caches': ``(d0, d1, d2)`` of canonical rank 4, read flat at
  (cache row, kv head, position))."""
  fp8_bits = tuple(jnp.dtype(x.dtype).name if x is not None and not gpu.native_fp8
                   and jnp.dtype(x.dtype).name.startswith("float8") else None for x in (k, v))
  quant = tuple(None if a is None else ((a.shape[1], a.shape[2]) if paged else (a.shape[2],)) for a in quant_arrays)
  if source is not None and source.caches is not None:
    c = source.caches
    quant = tuple(None if a is None else tuple(a.shape[:3]) for a in (c.k_scale, c.k_offset, c.v_scale, c.v_offset))
  return DtypePlan(compute_dtype=jnp.dtype(compute_dtype).name, out_dtype=jnp.dtype(out_dtype).name, quant=quant,
                   fp8_bits=fp8_bits)


def _rows(t: int, hq: int, hkv: int, dq: int, dv: int, compute_bytes: int, invariant: bool = False) -> RowPlan:
  """The row tiles (`row_tiling`). Batch-invariant: one token's tile whatever T (T tokens'
  rows packed into as many of them as they fill), so a row's products have one shape."""
  g = hq // hkv
  block_r, row_blocks = row_tiling(g if invariant else t * g, dq, dv, compute_bytes)
  if invariant:
    row_blocks = -(-max(t * g, 1) // block_r)
  return RowPlan(num_tokens=t, group=g, hq=hq, block_r=block_r, row_blocks=row_blocks)


def _cache_geometry(k, block_tables, kv_layout):
  """(seq_len, cache_rows, page_size, num_pages, table_len) of a cache in ``kv_layout``."""
  ax = token_axis(kv_layout)
  if block_tables is not None:
    num_pages, page_size = k.shape[ax - 1], k.shape[ax]
    table_len = block_tables.shape[1]
    return table_len * page_size, num_pages * page_size, page_size, num_pages, table_len
  return k.shape[ax], k.shape[ax], 0, 0, 0


def _read(paged: bool, sparse: bool, cache_batch: int) -> Read:
  """The `Read` mode: listed positions, a source's cache rows, a pool or a contiguous cache."""
  if cache_batch and (paged or sparse):
    raise ValueError("make_plan: a RowSource's caches are contiguous and not read with index lists")
  if sparse:
    return Read.SPARSE_PAGED if paged else Read.SPARSE
  if cache_batch:
    return Read.CACHE_ROWS
  return Read.PAGED if paged else Read.CONTIGUOUS


def _launch(gpu, rows: RowPlan, columns: ColumnPlan, dtypes: DtypePlan, caches, *, dq, block_k, quantized, gathered,
            differing_rows: bool) -> Launch:
  """The launch model's block and warps (`fdecode.kernels.triton.launch.launch_plan`): the
  columns a block loads (each piece at least `PIECE_COLS`), their bytes before and after
  the conversion, and a reserve where the rows may see different slots."""
  compute_bytes = jnp.dtype(dtypes.compute_dtype).itemsize
  cols = sum(max(p.width, PIECE_COLS) for p in columns.k_pieces + columns.r_pieces
             + (() if columns.v_from_k else columns.v_pieces))
  raw_bytes = max(jnp.dtype(x.dtype).itemsize for x in caches)
  convert = load_convert_bytes(raw_bytes, compute_bytes, quantized, dtypes.fp8_bits, gathered)
  return launch_plan(gpu, block_r=rows.block_r, dq=dq, dv=columns.dv, cols=cols, raw_bytes=raw_bytes,
                     compute_bytes=compute_bytes, block_k=block_k or config_lib.DEFAULT_BLOCK_K, convert_bytes=convert,
                     row_state=row_state_factor(rows.block_r, columns.k_pieces + columns.v_pieces),
                     reserve=LAUNCH.differing_rows_reserve if differing_rows else 0)


def _work(gpu, launch: Launch, rows: RowPlan, dv: int, *, b, balanced, num_splits, interpret,
          default_splits) -> WorkPlan:
  """Balanced: B work items and one wave more (`INTERPRET_EXTRA_ITEMS` interpreted), one
  split each; else the given split count or ``default_splits()``'s. The combine's tiling to match."""
  hkv, items = rows.kv_heads, b
  if balanced:
    extra = INTERPRET_EXTRA_ITEMS if interpret else -(-gpu.sms * launch.residency(gpu)[1] // (hkv * rows.row_blocks))
    items, num_splits = b + extra, 1
  elif num_splits is None:
    num_splits = default_splits()
  tiling = (segment_combine_tiling(b, hkv, rows.num_rows, dv, items, gpu.sms) if balanced
            else (1, combine_width(int(num_splits), dv), COMBINE_CHUNK))
  return WorkPlan(num_splits=int(num_splits), balanced=balanced, items=items, batch=b, combine_tiling=tiling)


def _invariant_work(launch: Launch, rows: RowPlan, dv: int, *, b: int, seq_len: int, split_size: int) -> WorkPlan:
  """The batch-invariant mode's splits: ``split_size`` positions rounded up to whole key
  blocks, laid at absolute positions over the ``seq_len`` addressable ones (the count
  depends on the cache's capacity only: not on B, T, the ends or the GPU)."""
  split_blocks = max(-(-split_size // launch.block), 1)
  num_splits = max(-(-seq_len // (split_blocks * launch.block)), 1)
  return WorkPlan(num_splits=num_splits, balanced=False, items=b, batch=b,
                  combine_tiling=(1, combine_width(num_splits, dv), COMBINE_CHUNK), split_blocks=split_blocks)


def _call_splits(gpu: chips.Gpu, launch: Launch, rows: RowPlan, dv: int, caches, *, b: int, slots: int,
                 interpret: bool) -> int:
  """The split rule of a call of ``slots`` tokens (S, its window's, or K listed), ``num_splits``
  None: compiled, `split_count` (the least predicted time among counts that fill a wave of
  ``gpu``); interpreted, `fdecode.kernels.xla.plan.split_count` for the host's cores (the
  module doc says why)."""
  hkv = rows.kv_heads
  blocks = max(-(-slots // launch.block), 1)
  if interpret:
    return xla_kernels.split_count(b, hkv, blocks, config_lib.num_parallel_units("cpu"))
  cols_bytes = sum(x.shape[-1] * jnp.dtype(x.dtype).itemsize for x in caches)
  return split_count(gpu.sms, launch.residency(gpu), b * hkv * rows.row_blocks, blocks,
                     cache_bytes=b * hkv * slots * cols_bytes,
                     split_bytes=2 * 4 * b * hkv * rows.block_r * rows.row_blocks * (dv + 1))


def gpu_busy(programs: int, sms: int, resident: int) -> float:
  """Fraction of a GPU's bandwidth that a launch of ``programs`` equal, memory-bound
  programs keeps busy, ``resident`` of them on an SM at once: the smaller of two tail
  losses. Balance: the busiest SM streams ``ceil(programs / SMs)`` programs against the
  mean ``programs / SMs`` (below one per SM, idle SMs). Waves: when an SM's share of the
  bandwidth needs all ``resident`` programs in flight, the last partial wave runs at
  ``waves / ceil(waves)``. `split_count` chooses by it; benchmarks/compile_report.py
  predicts with it from the compiled kernel's residency."""
  per_sm = programs / sms
  balance = per_sm / math.ceil(per_sm)
  waves = programs / (sms * max(resident, 1))
  return min(balance, waves / math.ceil(waves) if waves >= 1 else 1.0)


def split_count(sms: int, residency: tuple[int, int], work: int, num_blocks: int,
                   cache_bytes: float, split_bytes: float) -> int:
  """GPU split count: the one with the least predicted time, ``(cache_bytes + splits *
  split_bytes) / gpu_busy``, among those that give every SM `PROGRAMS_PER_SM` programs.

  ``residency``: programs per SM at once, ``(lower, upper)`` estimate (ptxas chooses the
  registers after this choice; `fdecode.kernels.triton.launch.Launch.residency`); every
  candidate is judged at the worst of them. ``work``: programs per split (batch x kv
  heads x row blocks). ``cache_bytes``: the bytes the launch streams; ``split_bytes``:
  what one more split adds (its partial outputs and LSEs, written, then read by the merge).
  Candidates: from the fewest splits with ``work * splits >= SMs x min(upper,
  PROGRAMS_PER_SM)`` to four times that, and at most one split per block. No fixed cap: a
  long sequence on few heads (B=1, S=1M) gets the splits it needs."""
  lo, hi = residency
  first = max(1, min(-(-sms * min(hi, PROGRAMS_PER_SM) // max(work, 1)), num_blocks))
  candidates = range(first, max(first, min(num_blocks, 4 * first)) + 1)

  def time(splits):
    busy = min(gpu_busy(work * splits, sms, r) for r in range(lo, hi + 1))
    return (cache_bytes + splits * split_bytes) / busy

  return min(candidates, key=time)


def merges_parts(gpu: chips.Gpu | None = None) -> bool:
  """Whether a ragged step's parts share one split launch on ``gpu`` (None:
  `fdecode.kernels.common.chips.lowering_gpu`, the GPU the plans are made for; an
  H100's when interpreted unless told otherwise): `MERGE_PARTS_CAPABILITY`."""
  return (gpu or chips.lowering_gpu()).capability >= MERGE_PARTS_CAPABILITY
