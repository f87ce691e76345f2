"""A ragged step's two parts (`fdecode.ragged.decode` describes them): their geometry in
XLA, the two-part path that runs them as canonical calls (`fdecode.call`; every backend
but the Triton step), and the calls the Triton step (`fdecode.kernels.triton.triton_step`) is made of.

`Step` holds what both read: the packed rows, the caches, the clipped geometry
(`fdecode.ragged.row_positions`), the options, and the step's arguments checked and
canonicalized once (`with_call`): each part's call is built from it
(`fdecode.call.part`), never checked or canonicalized again.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from fdecode.cache.layout import QUANT_ARRAYS, CacheView
from fdecode.call import Call, canonical_call, decode_of, part, run
from fdecode.kernels.backend import RowSource
from fdecode.options import CallArrays, StaticOptions
from fdecode.ragged.checks import PER_ROW
from fdecode import route

QUERY_BLOCK = 64  # rows of a prefill query block


class Step(NamedTuple):
  """One traced step. ``q`` ``[N, Hq, Dk]``; ``caches``: dict of k, v, k_rope, scales and
  offsets in ``view``'s layout (``view``: the caches' `CacheView`, its int32 block tables
  when paged); ``geometry``: `fdecode.ragged.row_positions`' ``(cu, lens, q_len, seq,
  pos)``; ``given``: the step's ``(cu_q_lens, kv_lens, num_seqs)`` as given (int32); ``arrays``:
  the per-call option arrays (modifiers, sinks); ``opts``: the static options (the caches'
  layout ``view.layout`` among them); ``dv``: Dv;
  ``call``: the step's `fdecode.call.Call` (`with_call`)."""
  q: object
  caches: dict
  view: CacheView
  geometry: tuple
  given: tuple
  arrays: dict
  opts: StaticOptions
  dv: int
  call: Call | None = None

  @property
  def block(self) -> int:  # rows of a prefill block
    return min(QUERY_BLOCK, self.q.shape[0])

  @property
  def num_blocks(self) -> int:
    """The prefill blocks' static bound: a block per ``block`` rows, plus one partial block
    per sequence with 2 or more new tokens."""
    n, m = self.q.shape[0], self.given[1].shape[0]
    return -(-n // self.block) + min(m, n // 2)


def searchsorted(edges, x):
  """``jnp.searchsorted(edges, x, side="right")`` without a loop: its default method is a
  scan, compiled to a while loop of log2(len(edges)) dependent steps, a few tiny kernels
  and a predicate check each on GPU (the H100 compile of a bench_ragged step had one);
  comparing all pairs is one fusion, sorting past ~1M pairs."""
  method = "compare_all" if edges.size * x.size <= 1 << 20 else "sort"
  return jnp.searchsorted(edges, x, side="right", method=method)


def _blocks(st: Step):
  """Prefill blocks per sequence ``[M]`` and their running total (each sequence's last block + 1)."""
  nb = -(-jnp.maximum(st.geometry[2] - 1, 0) // st.block)
  return nb, jnp.cumsum(nb)


def block_geometry(st: Step, j):
  """Block(s) ``j`` (int32 scalar or ``[J]``): sequence, rows ``[..., tb]`` (clipped for
  the gather), kv length, each row's destination (``N``: dropped, for rows before the
  sequence's own and for blocks past the real ones) and first row (unclipped). Blocks
  count back from the row before each sequence's last."""
  cu, lens = st.geometry[0], st.geometry[1]
  n_rows, m, tb = st.q.shape[0], lens.shape[0], st.block
  nb, ends = _blocks(st)
  s = jnp.clip(searchsorted(ends, j), 0, m - 1).astype(jnp.int32)
  jj = j - (ends[s] - nb[s])
  live = j < ends[-1]
  hi = cu[s + 1] - 1 - jj * tb  # rows [hi - tb, hi); those before cu[s] are not this sequence's
  blk = hi[..., None] - tb + jnp.arange(tb, dtype=jnp.int32)  # made here: not an operand of the cond
  dest = jnp.where(live[..., None] & (blk >= cu[s][..., None]), blk, n_rows)
  return s, jnp.clip(blk, 0, n_rows - 1), jnp.where(live, lens[s] - 1 - jj * tb, 0), dest, hi - tb


def with_call(st: Step) -> Step:
  """``st`` with its ``call``: the step's arguments checked and canonicalized once
  (`fdecode.call.canonical_call`: every `flash_decode` check, the cache view with its
  canonical scales, the static options, the modifiers, the knobs, impl and interpret), as
  its decode part's call: each live sequence's last row (T = 1) over the whole caches.
  The prefill blocks' calls are built from it (`fdecode.call.part`)."""
  last, lengths = _last_rows(st)
  arrays = CallArrays(st.q[last][:, None], st.caches["k"], st.caches["v"], lengths,
                      block_tables=st.view.block_tables, **_cache_opts(st.caches), **_shared(st),
                      **_per_row(st, last, (last.shape[0], 1)))
  return st._replace(call=canonical_call(arrays, st.opts))


def _shared(st: Step):
  return {n: st.arrays[n] for n in ("alibi_slopes", "sinks") if n in st.arrays}


def _per_row(st: Step, idx, shape):
  return {n: _rows(st.arrays[n], idx, shape) for n in PER_ROW if n in st.arrays}


def _last_rows(st: Step):
  """Each sequence's last row, clipped into the packed rows ``[M]``, and its kv length for
  the decode part (0 for a sequence with no row)."""
  cu, lens, q_len = st.geometry[:3]
  return jnp.clip(cu[1:] - 1, 0, st.q.shape[0] - 1), jnp.where(q_len > 0, lens, 0)


def _looped(st: Step):
  """One flash_decode per real block, scattered to its rows: nothing runs for padding or
  decodes. The loop's bound is static (`Step.num_blocks`, the most blocks the rows can
  hold) and each step past the real blocks skips its call (``lax.cond``), so the loop is
  a scan that reverse-mode differentiation can transpose."""
  q = st.q
  n_rows, hq = q.shape[:2]

  def block(j, carry):
    s, idx, length, dest, _ = block_geometry(st, j)
    o, l = run(part(st.call, q[idx][None], _cache_rows(st.call.view, s), length[None], source=None,
                    rows=_per_row(st, idx, (1, st.block))), return_lse=True)
    dest = dest.reshape(-1)
    out, lse = carry
    return (out.at[dest].set(o.reshape(dest.shape[0], *o.shape[-2:]), mode="drop"),
            lse.at[dest].set(l.reshape(dest.shape[0], -1), mode="drop"))

  real = _blocks(st)[1][-1]
  empty = (jnp.zeros((n_rows, hq, st.dv), q.dtype), jnp.full((n_rows, hq), -jnp.inf, jnp.float32))
  return lax.fori_loop(0, st.num_blocks, lambda j, c: lax.cond(j < real, block, lambda j, c: c, j, c), empty)


def _batched(st: Step):
  """Every block in one flash_decode call (one kernel launch), its rows gathered back.

  Blocks past the real ones have kv length 0, which the Pallas kernels skip (no KV block is
  read). A contiguous cache runs here only where the Triton kernels read it: each block's
  cache row through the RowSource; the per-block gathers of the call's own arguments are
  then dropped by XLA. A step of decodes only has no block. On GPU the call runs anyway
  where the kernels skip empty blocks (Triton's tiled shapes, the Hopper rows kernel): a
  conditional there would cost more (XLA:GPU's runs on the host, copying its predicate
  and waiting for the stream, once per call). Elsewhere (TPU: control flow on the chip;
  CPU, interpreted) a step with no block skips the call (lax.cond)."""
  q = st.q
  tb, num_blocks, hq = st.block, st.num_blocks, q.shape[1]

  def blocks(st):
    # num_splits None becomes "balance": the Triton kernel deals the real blocks' keys over a
    # grid that fills the GPU, whichever blocks are real (`fdecode.kernels.triton`).
    cfg = st.call.cfg
    return run(_prefill_call(st, cfg=dataclasses.replace(cfg, balance=True) if cfg.num_splits is None else cfg)[0],
               return_lse=True)
  none = lambda: (jnp.zeros((num_blocks, tb, hq, st.dv), q.dtype), jnp.full((num_blocks, tb, hq), -jnp.inf,
                                                                          jnp.float32))
  o, l = route.lower_blocks_call(decode_of(st.call), run=blocks, operand=st,
                                 skip_when_empty=lambda st: lax.cond(_blocks(st)[1][-1] > 0, lambda: blocks(st), none))
  nb, ends = _blocks(st)
  j, t = _block_rows(st.geometry[0], st.geometry[3], ends - nb, tb, num_blocks)
  return o[j, t], l[j, t]


def two_parts(st: Step):
  """The step's ``(out [N, Hq, Dv], lse [N, Hq])``: the decode part's call, the prefill
  blocks' (looped or batched, as the backend reads them), the rows gathered from both."""
  q, arrays = st.q, st.arrays
  n_rows, hq = q.shape[:2]
  dec_o, dec_l = run(_decode_call(st)[0], return_lse=True)
  if n_rows < 2:  # no sequence has a row before its last: no prefill block
    pre_o, pre_l = jnp.zeros((n_rows, hq, st.dv), q.dtype), jnp.full((n_rows, hq), -jnp.inf, jnp.float32)
  else:  # one batched call where the part's backend reads each block's rows in place, else a loop
    pre_o, pre_l = route.lower_prefill(decode_of(st.call), sparse="indices" in arrays, looped=_looped,
                                       batched=_batched, operand=st)
  cu, _, _, seq, pos = st.geometry
  return _gather_rows(cu, seq, pos, (dec_o[:, 0], dec_l[:, 0]), (pre_o, pre_l))


def _decode_call(st: Step, step=None):
  """The decode part's call (the step's: each sequence's last row, its q a gather the
  Triton kernels read in place through the source) and the rows ``[M]``. ``step``: the
  step's arrays, for the Triton step (a contiguous cache then read through the whole
  caches, so that the part takes the balanced schedule)."""
  view = st.call.view
  last, _ = _last_rows(st)
  whole = view if step is not None and not view.paged else None
  return st.call._replace(source=RowSource(st.q, last, caches=whole, step=step)), last


def _prefill_call(st: Step, step=None, cfg=None):
  """Every prefill block in one call (`fdecode.call.part` of the step's call: q, tables and
  a contiguous cache's rows gathers the Triton kernels read in place through the source)
  and the rows ``[NB, tb]``. ``step``: the step's arrays, for the Triton step (its kernels
  then derive the source's rows themselves); ``cfg``: the call's knobs (default the step's)."""
  q, view = st.q, st.call.view
  s, idx, lengths, _, first = block_geometry(st, jnp.arange(st.num_blocks, dtype=jnp.int32))
  if view.paged:
    source = RowSource(q, first, view.block_tables, s, step=step)
  else:  # each block's rows of the caches (also at M = 1: the call's batch is the blocks')
    source = RowSource(q, first, caches=view, cache_rows=s, step=step)
  return part(st.call, q[idx], _cache_rows(view, s), lengths, source=source, rows=_per_row(st, idx, idx.shape),
              cfg=cfg), idx


def step_calls(st: Step):
  """The two parts' calls as a backend's whole step takes them (`fdecode.route.lower_step`:
  the Triton step, `fdecode.kernels.triton.triton_step`):
  `fdecode.kernels.backend.Decode` s (q, ``ends`` and the sources' index arrays for their shapes
  only), the rows read through a `RowSource` whose ``step`` holds the arrays every unit's
  geometry derives from (the caches in place: a pool through the whole table, a
  contiguous cache through the whole caches) and whose ``mask`` / ``bias`` are the step's
  per-row ones (the calls' own are their gathers, for their form only)."""
  rows = {n: st.arrays[n] for n in ("mask", "bias") if n in st.arrays}  # read at the packed rows
  return tuple(decode_of(c._replace(source=c.source._replace(**rows)))
               for c, _ in (_decode_call(st, st.given), _prefill_call(st, st.given)))


def _block_rows(cu, seq, first_block, tb: int, num_blocks: int):
  """Each row's prefill block and row in it, ``(j, t)`` int32 ``[N]``: row r of sequence s
  (not its last) is row t of the sequence's block jj, counted back from its last row.
  ``first_block``: ``[M]`` each sequence's first block. Clipped for the gather (the last
  rows and padding rows read some block's row, selected away by `_gather_rows`)."""
  rows = jnp.arange(seq.shape[0], dtype=jnp.int32)
  jj = (cu[seq + 1] - 2 - rows) // tb
  j = jnp.clip(first_block[seq] + jj, 0, num_blocks - 1)
  return j, jnp.clip(rows - (cu[seq + 1] - 1 - (jj + 1) * tb), 0, tb - 1)


def _gather_rows(cu, seq, pos, decode, prefill):
  """The step's ``(out [N, Hq, Dv], lse [N, Hq])``, each row from its source (gathered, not
  scattered into a zeroed output): its sequence's decode state (``decode``: ``[M, ...]``)
  at its last row, its prefill block's row (``prefill``: ``[N, ...]``, row-aligned) at
  the others, none at padding rows (``pos`` -1: out 0, lse -inf)."""
  rows = jnp.arange(seq.shape[0], dtype=jnp.int32)
  last_row = (pos >= 0) & (rows == cu[seq + 1] - 1)
  prefill_row = (pos >= 0) & ~last_row
  pick = lambda sel, x: sel.reshape(sel.shape + (1,) * (x.ndim - 1))
  return tuple(jnp.where(pick(last_row, d), d[seq], jnp.where(pick(prefill_row, p), p, empty))
               for d, p, empty in zip(decode, prefill, (0, -jnp.inf)))


def _cache_opts(caches):
  return {n: caches[n] for n in ("k_scale", "v_scale", "k_offset", "v_offset", "k_rope") if caches[n] is not None}


def _cache_rows(view: CacheView, s) -> CacheView:
  """The view of sequence ``s`` (int32 scalar: sliced, batch 1) or of sequences ``s``
  (``[J]``: gathered, batch J) of the step's canonical ``view``: a paged pool is shared
  (its table rows select); of a contiguous cache, k, v and k_rope are per sequence, and so
  are the scales / offsets that are not broadcast over sequences (canonical rank 4,
  leading axis > 1)."""
  rows = (lambda x: lax.dynamic_slice_in_dim(x, s, 1, 0)) if np.ndim(s) == 0 else (lambda x: x[s])
  if view.paged:
    return view.with_arrays(block_tables=rows(view.block_tables))
  per_seq = lambda n, x: n in ("k", "v", "k_rope") or x.shape[0] > 1
  arrays = {n: getattr(view, n) for n in ("k", "v", "k_rope") + QUANT_ARRAYS}
  return view.with_arrays(**{n: rows(x) for n, x in arrays.items() if x is not None and per_seq(n, x)})


def _rows(x, idx, shape):
  """A per-row array ``[N|1, ...]`` at rows ``idx`` (shaped ``shape``) -> ``[*shape, ...]``."""
  if x.shape[0] == 1:
    return jnp.broadcast_to(x.reshape((1,) * len(shape) + x.shape[1:]), shape + x.shape[1:])
  return x[idx.reshape(-1)].reshape(shape + x.shape[1:])
