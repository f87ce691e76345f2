"""`ragged_decode`: one attention call over a serving step's packed new tokens, with a
different number of new tokens per sequence (decodes of 1 beside prefill chunks), as
engines schedule them (vLLM / SGLang / tpu-inference; FlashAttention's ``cu_seqlens_q``,
FlashInfer's ``qo_indptr``, JAX's ``ragged_paged_attention``).

How the work is split (all inside one jit-compiled program):

* **Decode part.** Every live sequence's *last* new token, as a batch of ``max_seqs``
  single-token queries over the caches in place: exactly `flash_decode`'s decode path,
  so a step of pure decodes costs what `flash_decode` costs (benchmarks/RESULTS.md).
* **Prefill part.** The other new tokens, in query blocks of up to ``QUERY_BLOCK`` rows
  of one sequence (aligned to the sequence's last token), each a ``T = QUERY_BLOCK``
  `flash_decode` call over that sequence's cache (its block-table row when paged, its
  cache row when contiguous). On the XLA path (and for contiguous caches off the Triton
  kernels) a ``lax.while_loop`` runs only the real blocks, ``sum_i ceil((q_len_i - 1) /
  QUERY_BLOCK)``: padding rows and dead sequences cost nothing, a step with no prefill runs
  no block, and no work scales with ``max_seqs * max(q_len)``. With the Pallas kernels
  (GPU, TPU, ``impl="pallas"``) a paged step's blocks go to *one* `flash_decode` call, and
  so do a contiguous step's on the Triton kernels (GPU, or interpreted), each block
  reading its sequence's cache row in place (a `RowSource`'s cache rows), a static
  ``ceil(N / QUERY_BLOCK) + min(max_seqs, N // 2)`` of them (one kernel launch): blocks
  past the real ones have kv length 0, and the kernels read nothing for them; off GPU a
  step with no prefill block skips that call (``lax.cond``; on GPU XLA would copy the
  predicate to the host and wait for the stream, so the call runs and finds no block).
  On GPU that call runs the
  balanced schedule (``num_splits="balance"``): a grid of work items sized to fill the
  GPU deals out the real blocks' keys, however few they are (before, its split count
  was sized for the static bound, so a step with 9 real blocks of 73 ran 72 programs). (Where
  `flash_decode` itself falls back to XLA on GPU or TPU, a head dim Triton cannot tile or
  a page size Mosaic cannot DMA, that XLA path reads every block of the bound.)
  ``impl="mosaic_gpu"`` (opt-in) runs both parts on the Hopper rows kernel, the prefill
  blocks of a paged step in one call like ``impl="pallas"`` (blocks of length 0 load
  nothing), its decode part's T = 1 rows padded to a 64-row tile; MLA caches are refused
  (the MLA kernel takes T = 1 only, so not the prefill blocks).

Each part's query rows (and each prefill block's table row, or contiguous cache row) are
gathers of the packed q (and of the block tables, or the caches); the Triton kernels read
them in place through their indices (`fdecode.kernels.triton.RowSource`), so on GPU no
gather is launched; every other path reads the gathers. (A program exported for several
platforms at once, ``jax.export(..., platforms=[...])``, picks its branch at run time, so
it computes the gathers wherever it runs, on a contiguous cache a copy of each block's
cache row: export one program per platform.)

The fused cache write (``new_k`` / ``new_v``) puts the new tokens in the caches in the
caller's layout, before the attention, in the same program (`fdecode.ragged.write`: one
Triton kernel for keys and values on GPU, a scatter per cache elsewhere): under
``jit(..., donate_argnums=...)`` it updates the donated caches in place. Padding rows
write nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from fdecode.api import flash_decode_with_source
from fdecode.cache.layout import CacheView, check_layout
from fdecode.dispatch import forced_tpu_interpret, triton_supports
from fdecode.kernels.triton import RowSource
from fdecode.ragged.checks import CALLER, PER_ROW, check_shapes, check_values
from fdecode.ragged.triton_step import triton_step
from fdecode.ragged.write import write_new_tokens
from fdecode.validation import as_arrays, to_int32

QUERY_BLOCK = 64  # rows of a prefill query block
# flash_decode's keywords ragged_decode forwards; the per-row ones are indexed by row.
_OPTIONS = ("k_scale", "v_scale", "k_offset", "v_offset", "softmax_scale", "num_splits", "block_k",
            "impl", "interpret", "return_lse", "causal", "mask", "bias", "alibi_slopes", "window",
            "logits_soft_cap", "sinks", "v_head_dim", "k_rope", "indices")
_PER_SEQ = ("k_scale", "v_scale", "k_offset", "v_offset", "k_rope")  # contiguous: a batch axis


def ragged_decode(q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, *, kv_layout="HND",
                  new_k=None, new_v=None, **options):
  """Attention of a packed, ragged batch of new tokens over their sequences' KV caches.

  Legend: N packed new tokens (rows), M = max_seqs, Hq / Hkv query / kv heads, S a
  sequence's cache capacity, Dk / Dv key / value head dims.

  Args:
    q: ``[N, Hq, Dk]``, every sequence's new tokens packed in order: sequence i owns rows
      ``cu_q_lens[i]:cu_q_lens[i + 1]``, its last ``q_len_i`` positions (of ``kv_lens[i]``
      tokens), causal among themselves. A decode is ``q_len = 1``, a prefill chunk any
      length. Rows from ``cu_q_lens[num_seqs]`` to N are padding: out 0 (lse -inf).
    k, v: the caches, in ``kv_layout``: ``"HND"`` contiguous ``[M, Hkv, S, D]`` / paged
      ``[Hkv, P, page_size, D]``; ``"NHD"`` contiguous ``[M, S, Hkv, D]`` / paged
      ``[P, page_size, Hkv, D]`` (`fdecode.cache.layout`). Float, or 8-bit with scales;
      ``v=None`` for MLA (with ``v_head_dim``), as in `flash_decode`.
    kv_lens: int ``[M]``: tokens of each sequence, its new ones included, in ``[0, S]``.
    block_tables: int ``[M, n]`` (paged; ``S = n * page_size``) or None (contiguous).
      A live sequence lists each page once for its live tokens; with the fused write, a
      page a sequence writes into is its own (no other live sequence holds it: copy a
      shared page first, `fdecode.cache.PageAllocator.prepare_write`).
    cu_q_lens: int ``[M + 1]``: 0, then non-decreasing row offsets.
    num_seqs: int scalar or ``[1]``: only sequences ``< num_seqs`` are live.
    kv_layout: ``"HND"`` or ``"NHD"``.
    new_k, new_v: optional ``[N, Hkv, Dk]`` / ``[N, Hkv, Dv]``: the new tokens' keys and
      values, written at their rows' positions before attending (fused write). Float for
      a float cache (cast to its dtype); for an 8-bit cache, already quantized with the
      cache's scales, in its dtype. ``new_v`` is None exactly when ``v`` is None.
    **options: `flash_decode`'s keywords (scales, offsets, ``softmax_scale``, splits,
      ``impl``, ``interpret``, ``return_lse``, every score modifier, sinks, MLA
      ``v_head_dim`` / ``k_rope``, sparse ``indices``). ``mask`` / ``bias`` are per row:
      ``[N|1, S]`` or ``[N|1, Hq, S]``; ``indices`` ``[N|1, K]`` or ``[N|1, Hkv, K]``.
      ``kv_offset`` is not taken (kv_lens count the cache's tokens).

  Returns:
    ``out`` ``[N, Hq, Dv]`` in q's dtype; ``(out, lse)`` with ``return_lse`` (lse float32
    ``[N, Hq]``). With ``new_k``: ``(out, k, v)`` (or ``(out, lse, k, v)``), the updated
    caches in their layout.

  Raises:
    ValueError: shapes that disagree with each other or with ``kv_layout``; concrete
      ``cu_q_lens`` that do not start at 0 or decrease, a ``q_len_i > kv_lens[i]`` for a
      live sequence, ``cu_q_lens[num_seqs] > N``, ``num_seqs`` outside ``[0, M]``,
      kv_lens outside ``[0, S]``, page ids out of the pool for a live token, a page listed
      twice among a live sequence's pages, a page one live sequence writes (fused write)
      while another holds it for its live tokens (naming both and the page); a
      non-integer ``block_tables``, ``kv_lens``, ``cu_q_lens`` or ``num_seqs``; and every
      `flash_decode` error (prefixed ``ragged_decode:``). Under ``jit`` values are clipped
      instead: nothing reads or writes outside the caches, and a row writes only at one of
      its own sequence's new positions ``[kv_len - q_len, kv_len)``, never over a cached
      token: rows before a (traced, nonzero) ``cu_q_lens[0]`` or from
      ``cu_q_lens[num_seqs]`` on belong to no sequence, write nothing and give out 0,
      lse -inf. Page aliasing is not checked under ``jit``: a write goes to the page the
      table names, which another sequence listing it then sees.
    TypeError: an unknown keyword, or an array argument that is not an array.
  """
  unknown = sorted(set(options) - set(_OPTIONS))
  if "kv_offset" in unknown:
    raise ValueError(f"{CALLER}: kv_offset is not taken: kv_lens count each sequence's cached tokens")
  if unknown:
    raise TypeError(f"{CALLER}: unexpected keyword(s) {unknown}; it takes kv_layout, new_k, new_v "
                    f"and flash_decode's {list(_OPTIONS)}")
  check_layout(kv_layout, CALLER)
  arrays = {n: options.pop(n) for n in ("k_scale", "v_scale", "k_offset", "v_offset", "mask", "bias",
                                        "alibi_slopes", "sinks", "k_rope", "indices") if n in options}
  (q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, new_k, new_v, *rest) = as_arrays(
      CALLER, q=q, k=k, v=v, kv_lens=kv_lens, block_tables=block_tables, cu_q_lens=cu_q_lens,
      num_seqs=num_seqs, new_k=new_k, new_v=new_v, **arrays)
  arrays = {n: x for n, x in zip(arrays, rest) if x is not None}
  paged = block_tables is not None
  n_rows, m = check_shapes(q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, new_k, new_v,
                           kv_layout, arrays)
  view = CacheView(k, v, block_tables=block_tables, layout=kv_layout, paged=paged)  # shapes checked above
  check_values(kv_lens, block_tables, cu_q_lens, num_seqs, n_rows, m, view.capacity, num_pages=view.num_pages,
               page_size=view.page_size, window=options.get("window"), writes=new_k is not None)
  return_lse = bool(options.pop("return_lse", False))
  if options.get("impl") == "pallas" and options.get("interpret") is None:
    # Resolved here, not at trace time: it keys the compiled step (as in flash_decode).
    options["interpret"] = forced_tpu_interpret()
  statics = tuple(sorted((n, _hashable(x)) for n, x in options.items()))
  try:
    view = view.with_arrays(block_tables=None if not paged else to_int32(block_tables))
    out, lse, k_out, v_out = _ragged(q, view, to_int32(kv_lens), to_int32(cu_q_lens),
                                     to_int32(jnp.reshape(num_seqs, (-1,))[:1]), new_k, new_v, arrays,
                                     statics=statics)
  except (ValueError, TypeError) as e:  # a flash_decode check: say whose call it was
    msg = str(e)
    if msg.startswith("flash_decode:"):
      raise type(e)(CALLER + msg[len("flash_decode"):]) from None
    if not msg.startswith(CALLER):  # e.g. the split / block options' own check
      raise type(e)(f"{CALLER}: {msg}") from None
    raise
  result = (out, lse) if return_lse else (out,)
  if new_k is not None:
    result += (k_out, v_out)
  return result[0] if len(result) == 1 else result


def _hashable(x):
  return tuple(x) if isinstance(x, list) else x


@functools.partial(jax.jit, static_argnames=("statics",))
def _ragged(q, view, kv_lens, cu, num_seqs, new_k, new_v, arrays, *, statics):
  """The jit-compiled step: clip, write, decode part, prefill blocks. ``view``: the caches
  (`fdecode.cache.layout.CacheView`: k, v in the caller's layout, int32 block tables)."""
  opts = dict(statics)
  k, v, tables, paged = view.k, view.v, view.block_tables, view.paged
  n_rows, m = q.shape[0], kv_lens.shape[0]
  dv = opts.get("v_head_dim") if v is None else v.shape[-1]
  hq = q.shape[1]
  if n_rows == 0 or m == 0:  # no row or no sequence: nothing to write or attend
    return jnp.zeros((n_rows, hq, dv), q.dtype), jnp.full((n_rows, hq), -jnp.inf, jnp.float32), k, v
  cu, lens, q_len, seq, pos = row_positions(kv_lens, cu, num_seqs, n_rows, view.capacity)

  if new_k is not None:
    k, v = write_new_tokens(view, new_k, new_v, seq, pos, impl=opts.get("impl"), interpret=opts.get("interpret"),
                            step=(cu, kv_lens, num_seqs))

  # The caches in the caller's layout: flash_decode reads token-major ones in place (`fdecode.cache.layout`).
  caches = dict(k=k, v=v, **{n: arrays.get(n) for n in ("k_rope", "k_scale", "v_scale", "k_offset", "v_offset")})
  call = functools.partial(flash_decode_with_source, return_lse=True, kv_layout=view.layout, **opts)
  shared = {n: arrays[n] for n in ("alibi_slopes", "sinks") if n in arrays}
  per_row = lambda idx, shape: {n: _rows(arrays[n], idx, shape) for n in PER_ROW if n in arrays}

  # Decode part: each live sequence's last new token, over the caches in place.
  has = q_len > 0
  last = jnp.clip(cu[1:] - 1, 0, n_rows - 1)

  # Prefill part: the other new tokens, in blocks of tb rows of one sequence.
  tb = min(QUERY_BLOCK, n_rows)
  nb = -(-jnp.maximum(q_len - 1, 0) // tb)  # blocks per sequence
  ends = jnp.cumsum(nb)

  def geometry(j):
    """Block(s) ``j`` (int32 scalar or ``[J]``): sequence, rows ``[..., tb]`` (clipped for
    the gather), kv length, each row's destination (``n_rows``: dropped, for rows
    before the sequence's own and for blocks past the real ones) and first row (unclipped)."""
    s = jnp.clip(_searchsorted(ends, j), 0, m - 1).astype(jnp.int32)
    jj = j - (ends[s] - nb[s])
    live = j < ends[-1]
    hi = cu[s + 1] - 1 - jj * tb  # rows [hi - tb, hi); those before cu[s] are not this sequence's
    blk = hi[..., None] - tb + jnp.arange(tb, dtype=jnp.int32)  # made here: not an operand of the cond
    dest = jnp.where(live[..., None] & (blk >= cu[s][..., None]), blk, n_rows)
    return s, jnp.clip(blk, 0, n_rows - 1), jnp.where(live, lens[s] - 1 - jj * tb, 0), dest, hi - tb

  def put(out, lse, dest, o, l):
    dest = dest.reshape(-1)
    return (out.at[dest].set(o.reshape(dest.shape[0], *o.shape[-2:]), mode="drop"),
            lse.at[dest].set(l.reshape(dest.shape[0], -1), mode="drop"))

  def looped():  # one flash_decode per real block, scattered to its rows: nothing runs for padding or decodes
    def block(j, carry):
      s, idx, length, dest, _ = geometry(j)
      seq_cache = _sequence_cache(caches, s, paged)
      o, l = call(q[idx][None], seq_cache["k"], seq_cache["v"], length[None],
                  block_tables=None if not paged else lax.dynamic_slice_in_dim(tables, s, 1, 0),
                  **_cache_opts(seq_cache), **shared, **per_row(idx, (1, tb)))
      return put(*carry, dest, o, l)
    empty = (jnp.zeros((n_rows, hq, dv), q.dtype), jnp.full((n_rows, hq), -jnp.inf, jnp.float32))
    return lax.fori_loop(0, ends[-1], block, empty)

  # Whether the GPU's Triton kernels take these head dims (else its flash_decode runs XLA).
  triton_tiles = triton_supports(view.with_arrays(**{n: arrays.get(n) for n in ("k_scale", "v_scale", "k_rope")}), dv)

  def batched():  # every block in one flash_decode call (one kernel launch)
    # At most ceil(N / tb) + min(M, N // 2) blocks: a block per tb rows, plus one partial
    # block per sequence with 2 or more new tokens. Blocks past the real ones have kv
    # length 0, which the Pallas kernels skip (no KV block is read). A contiguous cache
    # runs here only where the Triton kernels read it (the path choice below): each block's
    # cache row through the RowSource; the per-block gathers of the call's own arguments
    # are then dropped by XLA.
    # A step of decodes only has no block. On GPU the call runs anyway where the kernels
    # skip empty blocks (Triton's tiled shapes, the Hopper rows kernel): the work items and
    # combine programs find no block and load no key, and unused items store no partial
    # state. A conditional there would cost more: XLA:GPU's runs on the host,
    # copying its predicate from the GPU and waiting for the stream (ConditionalThunk),
    # once per call. Elsewhere (TPU: control flow on the chip; CPU, interpreted) a step
    # with no block skips the call (lax.cond).
    num_blocks = -(-n_rows // tb) + min(m, n_rows // 2)

    def run():
      s, idx, length, _, first = geometry(jnp.arange(num_blocks, dtype=jnp.int32))
      # num_splits "balance": the Triton kernel deals the real blocks' keys over a grid
      # that fills the GPU, whichever blocks are real (`fdecode.kernels.triton`).
      if paged:
        block_caches, source = caches, RowSource(q, first, tables, s)
      else:  # each block's rows of the caches (also at M = 1: the call's batch is the blocks')
        block_caches = _sequence_cache(caches, s, paged)
        source = RowSource(q, first, caches=CacheView.of(
            caches["k"], caches["v"], kv_layout=view.layout, caller=CALLER, **_cache_opts(caches)), cache_rows=s)
      return call(q[idx], block_caches["k"], block_caches["v"], length,
                  block_tables=tables[s] if paged else None, source=source,
                  num_splits=opts.get("num_splits") or "balance", **_cache_opts(block_caches), **shared,
                  **per_row(idx, idx.shape))
    none = lambda: (jnp.zeros((num_blocks, tb, hq, dv), q.dtype),
                    jnp.full((num_blocks, tb, hq), -jnp.inf, jnp.float32))
    skip_empty = lambda: lax.cond(ends[-1] > 0, run, none)
    # The GPU's XLA fallback (head dims the Triton kernel cannot tile) reads every block: it keeps the cond.
    gpu = run if opts.get("impl") == "mosaic_gpu" or triton_tiles else skip_empty
    o, l = lax.platform_dependent(cuda=gpu, rocm=gpu, default=skip_empty)
    j, t = _block_rows(cu, seq, ends - nb, tb, num_blocks)
    return o[j, t], l[j, t]

  def two_parts():  # the decode part's call, the prefill blocks', and the rows gathered from both
    dec_o, dec_l = call(q[last][:, None], caches["k"], caches["v"], jnp.where(has, lens, 0), block_tables=tables,
                        source=RowSource(q, last), **_cache_opts(caches), **shared, **per_row(last, (m, 1)))
    impl = opts.get("impl")
    if n_rows < 2:  # no sequence has a row before its last: no prefill block
      pre_o, pre_l = jnp.zeros((n_rows, hq, dv), q.dtype), jnp.full((n_rows, hq), -jnp.inf, jnp.float32)
    elif not paged:  # batched only where the Triton kernels read each block's cache row in place
      interp = opts.get("interpret")
      # Sparse calls read the call's own (gathered) caches; so do Mosaic (TPU) and XLA: they loop.
      if "indices" in arrays or isinstance(interp, pltpu.InterpretParams) or impl not in (None, "pallas"):
        pre_o, pre_l = looped()
      elif impl == "pallas" and interp:  # the Triton interpreter, on any host
        pre_o, pre_l = batched()
      else:  # impl="pallas" on CPU is the Triton interpreter; on GPU, Triton where it tiles these head dims
        gpu = batched if triton_tiles else looped
        cpu = batched if impl == "pallas" else looped
        pre_o, pre_l = lax.platform_dependent(cpu=cpu, cuda=gpu, rocm=gpu, default=looped)
    elif impl in ("xla", "reference"):
      pre_o, pre_l = looped()
    elif impl in ("pallas", "mosaic_gpu"):  # mosaic_gpu: "balance" splits as None
      pre_o, pre_l = batched()
    else:  # impl=None: the XLA path on CPU reads every block's whole table, so it loops
      pre_o, pre_l = lax.platform_dependent(cpu=looped, default=batched)
    return _gather_rows(cu, seq, pos, (dec_o[:, 0], dec_l[:, 0]), (pre_o, pre_l))

  def step(interp):  # Triton: one split launch for both parts, one combine into the packed rows
    num_blocks = -(-n_rows // tb) + min(m, n_rows // 2)
    s, idx, length, _, first = geometry(jnp.arange(num_blocks, dtype=jnp.int32))  # (shapes: not read)
    arrays3 = (cu, kv_lens, num_seqs)
    dec = dict(q=q[last][:, None], ends=jnp.where(has, lens, 0), **shared)
    pre = dict(q=q[idx], ends=length, **shared)
    if paged:
      dec.update(caches, block_tables=tables, source=RowSource(q, last, tables, step=arrays3))
      pre.update(caches, block_tables=tables[s], source=RowSource(q, first, tables, step=arrays3))
    else:  # each part's sequences read through the source's caches (the whole ones)
      whole = CacheView.of(caches["k"], caches["v"], kv_layout=view.layout, caller=CALLER, **_cache_opts(caches))
      dec.update(caches, source=RowSource(q, last, caches=whole, step=arrays3))
      pre.update(_sequence_cache(caches, s, paged), source=RowSource(q, first, caches=whole, step=arrays3))
    return triton_step(dec, pre, arrays3, block=tb, capacity=view.capacity, interpret=interp,
                       options=dict(opts, kv_layout=view.layout))

  impl, interp = opts.get("impl"), opts.get("interpret")
  # The Triton step takes every call but index lists, per-row masks / biases (no balanced
  # schedule), fixed split counts, and contiguous MLA latents (whose decode part goes to the
  # Hopper MLA kernel on an sm_90 GPU).
  if (impl not in (None, "pallas") or isinstance(interp, pltpu.InterpretParams) or {"indices", "mask", "bias"} & set(arrays)
      or opts.get("num_splits") not in (None, "balance") or (v is None and not paged)):
    out, lse = two_parts()
  elif impl == "pallas" and interp:  # the Triton interpreter, on any host
    out, lse = step(True)
  else:  # GPU: Triton where it tiles these head dims; impl="pallas" on CPU: the Triton interpreter
    gpu = (lambda: step(False)) if triton_tiles else two_parts
    cpu = (lambda: step(True)) if impl == "pallas" else two_parts
    out, lse = lax.platform_dependent(cpu=cpu, cuda=gpu, rocm=gpu, default=two_parts)
  return out, lse, k, v


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


def row_positions(kv_lens, cu_q_lens, num_seqs, n_rows: int, capacity: int):
  """The step's geometry, clipped so that nothing reads or writes outside the caches
  (under ``jit`` the values are not checked): returns ``(cu, lens, q_len, seq, pos)``:
  monotone ``cu_q_lens`` in ``[0, N]``, kv_lens in ``[0, S]`` (0 for
  dead sequences), new tokens per sequence, and per row its sequence and position
  (``pos`` -1 for rows no live sequence owns: before ``cu[0]`` (a traced
  ``cu_q_lens[0] > 0``) or from ``cu[num_seqs]`` on). A row's position is
  ``kv_len - q_len + (row - cu)``, one of its sequence's new tokens' own positions
  ``[kv_len - q_len, kv_len)``, so a fused write never lands on an older (cached) one.
  ``num_seqs`` int32 ``[1]``; M >= 1."""
  m = kv_lens.shape[0]
  ns = jnp.clip(num_seqs[0], 0, m)
  cu = _cummax(jnp.clip(cu_q_lens, 0, n_rows))
  live = jnp.arange(m) < ns
  lens = jnp.where(live, jnp.clip(kv_lens, 0, capacity), 0)
  q_len = jnp.where(live, cu[1:] - cu[:-1], 0)
  rows = jnp.arange(n_rows, dtype=jnp.int32)
  seq = jnp.clip(_searchsorted(cu[1:], rows), 0, max(m - 1, 0)).astype(jnp.int32)
  owned = (rows >= cu[0]) & (rows < cu[ns])
  pos = jnp.where(owned, lens[seq] - q_len[seq] + rows - cu[seq], -1)
  return cu, lens, q_len, seq, pos


def _cummax(x):
  """``lax.cummax(x)`` of a short int vector as one reduction over all pairs (``lax.cummax``
  is a reduce-window, which XLA:GPU splits into a few tiny kernels); past ~1M pairs, it."""
  if x.size * x.size > 1 << 20:
    return lax.cummax(x)
  i = jnp.arange(x.size)
  return jnp.max(jnp.where(i[None, :] <= i[:, None], x[None, :], jnp.iinfo(x.dtype).min), axis=1)


def _searchsorted(edges, x):
  """``jnp.searchsorted(edges, x, side="right")`` without a loop: its default method is a
  scan, compiled to a while loop of log2(len(edges)) dependent steps, a few tiny kernels
  and a predicate check each on GPU (the H100 compile of a bench_ragged step had one);
  comparing all pairs is one fusion, sorting past ~1M pairs."""
  method = "compare_all" if edges.size * x.size <= 1 << 20 else "sort"
  return jnp.searchsorted(edges, x, side="right", method=method)


def _cache_opts(caches):
  return {n: caches[n] for n in ("k_scale", "v_scale", "k_offset", "v_offset", "k_rope") if caches[n] is not None}


def _sequence_cache(caches, s, paged):
  """The cache arrays of sequence ``s`` (int32 scalar: sliced, batch 1) or of sequences
  ``s`` (``[J]``: gathered, batch J): a paged pool is shared (its table row selects); of a
  contiguous cache, k, v and k_rope are per sequence, and so are the scales / offsets that
  are not broadcast over sequences (leading axis 1 or no sequence axis)."""
  if paged:
    return caches
  per_seq = lambda n, x: n in ("k", "v", "k_rope") or (np.ndim(x) == 4 and x.shape[0] > 1)
  rows = (lambda x: lax.dynamic_slice_in_dim(x, s, 1, 0)) if np.ndim(s) == 0 else (lambda x: x[s])
  return {n: rows(x) if x is not None and per_seq(n, x) else x for n, x in caches.items()}


def _rows(x, idx, shape):
  """A per-row array ``[N|1, ...]`` at rows ``idx`` (shaped ``shape``) -> ``[*shape, ...]``."""
  if x.shape[0] == 1:
    return jnp.broadcast_to(x.reshape((1,) * len(shape) + x.shape[1:]), shape + x.shape[1:])
  return x[idx.reshape(-1)].reshape(shape + x.shape[1:])
