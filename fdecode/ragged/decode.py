"""`ragged_decode`: one attention call over a serving step's packed new tokens, with a
different number of new tokens per sequence (decodes of 1 beside prefill chunks), as
engines schedule them (vLLM / SGLang / tpu-inference; FlashAttention's ``cu_seqlens_q``,
FlashInfer's ``qo_indptr``, JAX's ``ragged_paged_attention``).

How the work is split (all inside one jit-compiled program; `fdecode.ragged.parts`):

* **Decode part.** Every live sequence's *last* new token: ``max_seqs`` single-token
  queries over the caches in place, as `flash_decode` decodes.
* **Prefill part.** The other new tokens, in query blocks of up to ``QUERY_BLOCK`` rows
  of one sequence (aligned to the sequence's last token), each a ``T = QUERY_BLOCK``
  query over that sequence's cache (its block-table row when paged, its cache row when
  contiguous), a static ``ceil(N / QUERY_BLOCK) + min(max_seqs, N // 2)`` of them: blocks
  past the real ones have kv length 0, and the kernels read nothing for them.

Where they run:

* **The Triton step** (GPU, and ``impl="pallas"`` interpreted; `fdecode.kernels.triton.triton_step`):
  both parts in *one* split launch, each part's work items on its own balanced schedule
  (a grid sized to fill the GPU deals out the real units' keys, however few they are),
  then *one* combine launch that stores the packed rows, padding rows included. Every
  program derives its unit's geometry from the step's ``cu_q_lens``, ``kv_lens`` and
  ``num_seqs`` (`fdecode.kernels.triton.geometry`) and reads q rows, table rows and a
  contiguous cache's rows in place, and a per-row mask / bias at each row's packed row:
  nothing else launches (on A100 the parts take a split launch each: ptxas spilled the
  merged kernel there). It takes every call but index lists (no balanced schedule), a
  fixed ``num_splits``, contiguous MLA latents whose decode part `flash_decode` would send
  to the Hopper MLA kernel (compiled for sm_90: bf16, G a multiple of 16), and head dims
  Triton cannot tile (the GPU's flash_decode runs XLA for those).
* **The two-part path** (every other case): a call per part, the rows gathered from
  both outputs. The step's arguments are checked and canonicalized once, as `flash_decode`
  checks its own (`fdecode.call.canonical_call`, as the decode part's call); the prefill
  calls are built from it (`fdecode.call.part`) and run as `flash_decode` runs its call.
  The decode part is one batched call (a step of pure decodes costs what `flash_decode`
  costs). On the XLA path (and for contiguous caches off
  the Triton kernels) a ``lax.while_loop`` runs only the real prefill blocks, ``sum_i
  ceil((q_len_i - 1) / QUERY_BLOCK)``: padding rows and dead sequences cost nothing, a
  step with no prefill runs no block, and no work scales with ``max_seqs * max(q_len)``.
  With the Pallas kernels (TPU, ``impl="mosaic_gpu"``, and the Triton fallbacks above) a
  paged step's blocks go to *one* call (``num_splits="balance"`` where
  the kernel takes it); off GPU a step with no prefill block skips that call
  (``lax.cond``; on GPU XLA would copy the predicate to the host and wait for the
  stream, so the call runs and finds no block). ``impl="mosaic_gpu"`` (opt-in) runs both
  parts on the Hopper rows kernel, its decode part's T = 1 rows padded to a 64-row tile;
  MLA caches are refused (the MLA kernel takes T = 1 only, so not the prefill blocks).
  Each part's query rows (and each prefill block's table row, or contiguous cache row)
  are gathers of the packed q (and of the block tables, or the caches); the Triton
  kernels read them in place through their indices (`fdecode.kernels.backend.RowSource`);
  every other path reads the gathers. (A program exported for several platforms at once,
  ``jax.export(..., platforms=[...])``, picks its branch at run time, so it computes the
  gathers wherever it runs: export one program per platform.)

The fused cache write (``new_k`` / ``new_v``) puts the new tokens in the caches in the
caller's layout, before the attention, in the same program (`fdecode.ragged.write`: one
Triton kernel for keys and values on GPU, a scatter per cache elsewhere): under
``jit(..., donate_argnums=...)`` it updates the donated caches in place. Padding rows
write nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Unpack, overload

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.typing import ArrayLike

from fdecode.cache.layout import CacheView, check_layout
from fdecode.call import decode_of
from fdecode.ragged.checks import CALLER, check_shapes, check_values
from fdecode.ragged.parts import Step, searchsorted, step_calls, two_parts, with_call
from fdecode.ragged.write import write_new_tokens
from fdecode import route
from fdecode.route import resolve_interpret
from fdecode.options import ARRAY_ARGS, RAGGED_OPTIONS, KvLayout, ScoreOptions, StaticOptions, static_options_of
from fdecode.validation import as_arrays, static_scalar, to_int32


class RaggedOptions(ScoreOptions, total=False):
  """`ragged_decode`'s keyword options: `flash_decode`'s that it forwards, and ``return_lse``."""
  return_lse: bool


@overload
def ragged_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, kv_lens: ArrayLike, block_tables: ArrayLike | None,
                  cu_q_lens: ArrayLike, num_seqs: ArrayLike, *, kv_layout: KvLayout = "HND", new_k: None = None,
                  new_v: None = None, return_lse: Literal[False] = False, **options: Unpack[ScoreOptions]) -> Array: ...


@overload
def ragged_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, kv_lens: ArrayLike, block_tables: ArrayLike | None,
                  cu_q_lens: ArrayLike, num_seqs: ArrayLike, *, kv_layout: KvLayout = "HND", new_k: None = None,
                  new_v: None = None, return_lse: Literal[True],
                  **options: Unpack[ScoreOptions]) -> tuple[Array, Array]: ...


@overload
def ragged_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, kv_lens: ArrayLike, block_tables: ArrayLike | None,
                  cu_q_lens: ArrayLike, num_seqs: ArrayLike, *, kv_layout: KvLayout = "HND", new_k: ArrayLike,
                  new_v: ArrayLike | None, return_lse: Literal[False] = False,
                  **options: Unpack[ScoreOptions]) -> tuple[Array, Array, Array]: ...


@overload
def ragged_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, kv_lens: ArrayLike, block_tables: ArrayLike | None,
                  cu_q_lens: ArrayLike, num_seqs: ArrayLike, *, kv_layout: KvLayout = "HND", new_k: ArrayLike,
                  new_v: ArrayLike | None, return_lse: Literal[True],
                  **options: Unpack[ScoreOptions]) -> tuple[Array, Array, Array, Array]: ...


@overload
def ragged_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, kv_lens: ArrayLike, block_tables: ArrayLike | None,
                  cu_q_lens: ArrayLike, num_seqs: ArrayLike, *, kv_layout: KvLayout = "HND",
                  new_k: ArrayLike | None = None, new_v: ArrayLike | None = None,
                  **options: Unpack[RaggedOptions]) -> Array | tuple[Array, ...]: ...


def ragged_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, kv_lens: ArrayLike, block_tables: ArrayLike | None,
                  cu_q_lens: ArrayLike, num_seqs: ArrayLike, *, kv_layout: KvLayout = "HND",
                  new_k: ArrayLike | None = None, new_v: ArrayLike | None = None,
                  **options: Unpack[RaggedOptions]) -> Array | tuple[Array, ...]:
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
  unknown = sorted(set(options) - set(RAGGED_OPTIONS))
  if "kv_offset" in unknown:
    raise ValueError(f"{CALLER}: kv_offset is not taken: kv_lens count each sequence's cached tokens")
  if unknown:
    raise TypeError(f"{CALLER}: unexpected keyword(s) {unknown}; it takes kv_layout, new_k, new_v "
                    f"and flash_decode's {list(RAGGED_OPTIONS)}")
  check_layout(kv_layout, CALLER)
  arrays = {n: options.pop(n) for n in ARRAY_ARGS if n in options}
  return_lse = options.pop("return_lse", False)
  return_lse = bool(False if return_lse is None else static_scalar("return_lse", return_lse, CALLER))
  # The static options key the compiled step: Python values, checked as flash_decode checks them.
  opts = static_options_of(CALLER, kv_layout=kv_layout, **options)
  (q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, new_k, new_v, *rest) = as_arrays(
      CALLER, q=q, k=k, v=v, kv_lens=kv_lens, block_tables=block_tables, cu_q_lens=cu_q_lens,
      num_seqs=num_seqs, new_k=new_k, new_v=new_v, **arrays)
  arrays = {n: x for n, x in zip(arrays, rest) if x is not None}
  paged = block_tables is not None
  n_rows, m = check_shapes(q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, new_k, new_v,
                           kv_layout, arrays)
  view = CacheView(k, v, block_tables=block_tables, layout=kv_layout, paged=paged)  # shapes checked above
  check_values(kv_lens, block_tables, cu_q_lens, num_seqs, n_rows, m, view.capacity, num_pages=view.num_pages,
               page_size=view.page_size, window=opts.window, writes=new_k is not None)
  if opts.impl == "pallas" and opts.interpret is None:
    # Resolved here, not at trace time: it keys the compiled step (as in flash_decode).
    opts = dataclasses.replace(opts, interpret=resolve_interpret("pallas", None))
  try:
    view = view.with_arrays(block_tables=None if not paged else to_int32(block_tables))
    out, lse, k_out, v_out = _ragged(q, view, to_int32(kv_lens), to_int32(cu_q_lens),
                                     to_int32(jnp.reshape(num_seqs, (-1,))[:1]), new_k, new_v, arrays,
                                     opts=opts)
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


@functools.partial(jax.jit, static_argnames=("opts",))
def _ragged(q, view, kv_lens, cu, num_seqs, new_k, new_v, arrays, *, opts: StaticOptions):
  """The jit-compiled step: clip, write, attend (the Triton step, or the two-part path).
  ``view``: the caches (`fdecode.cache.layout.CacheView`: k, v in the caller's layout,
  int32 block tables); ``opts``: the step's static options (they key the compilation)."""
  k, v = view.k, view.v
  n_rows, m = q.shape[0], kv_lens.shape[0]
  dv = opts.v_head_dim if v is None else v.shape[-1]
  hq = q.shape[1]
  if n_rows == 0 or m == 0:  # no row or no sequence: nothing to write or attend
    return jnp.zeros((n_rows, hq, dv), q.dtype), jnp.full((n_rows, hq), -jnp.inf, jnp.float32), k, v
  given = (cu, kv_lens, num_seqs)  # as given: the Triton kernels clip them as row_positions does
  geometry = row_positions(kv_lens, cu, num_seqs, n_rows, view.capacity)
  impl, interp = opts.impl, opts.interpret
  if new_k is not None:
    k, v = write_new_tokens(view, new_k, new_v, *geometry[3:], impl=impl, interpret=interp, step=given)
  # The caches in the caller's layout: flash_decode reads token-major ones in place (`fdecode.cache.layout`).
  caches = dict(k=k, v=v, **{n: arrays.get(n) for n in ("k_rope", "k_scale", "v_scale", "k_offset", "v_offset")})
  st = with_call(Step(q=q, caches=caches, view=view.with_arrays(k=k, v=v), geometry=geometry, given=given,
                      arrays=arrays, opts=opts, dv=dv))
  capacity = view.capacity
  step_args = lambda st: (*step_calls(st), st.given, st.block, capacity)
  # The batch-invariant mode runs the step as two decodes, each on its backend's invariant plan
  # (the Triton step's balanced schedule deals blocks by the step's load, so it is not invariant).
  step_takes = "indices" not in arrays and opts.num_splits in (None, "balance") and not opts.batch_invariant
  out, lse = route.lower_step(decode_of(st.call), step_takes=step_takes, step_args=step_args, two_parts=two_parts,
                              operand=st)
  return out, lse, k, v


def row_positions(kv_lens, cu_q_lens, num_seqs, n_rows: int, capacity: int):
  """The step's geometry, clipped so that nothing reads or writes outside the caches
  (under ``jit`` the values are not checked): returns ``(cu, lens, q_len, seq, pos)``:
  monotone offsets in ``[0, N]`` (`monotone_offsets`), kv_lens in ``[0, S]`` (0 for
  dead sequences), new tokens per sequence, and per row its sequence and position
  (``pos`` -1 for rows no live sequence owns: before ``cu[0]`` (a traced
  ``cu_q_lens[0] > 0``) or from ``cu[num_seqs]`` on). A row's position is
  ``kv_len - q_len + (row - cu)``, one of its sequence's new tokens' own positions
  ``[kv_len - q_len, kv_len)``, so a fused write never lands on an older (cached) one.
  ``num_seqs`` int32 ``[1]``; M >= 1."""
  m = kv_lens.shape[0]
  ns = jnp.clip(num_seqs[0], 0, m)
  cu = monotone_offsets(cu_q_lens, n_rows)
  live = jnp.arange(m) < ns
  lens = jnp.where(live, jnp.clip(kv_lens, 0, capacity), 0)
  q_len = jnp.where(live, cu[1:] - cu[:-1], 0)
  rows = jnp.arange(n_rows, dtype=jnp.int32)
  seq = jnp.clip(searchsorted(cu[1:], rows), 0, max(m - 1, 0)).astype(jnp.int32)
  owned = (rows >= cu[0]) & (rows < cu[ns])
  pos = jnp.where(owned, lens[seq] - q_len[seq] + rows - cu[seq], -1)
  return cu, lens, q_len, seq, pos


def monotone_offsets(cu_q_lens, n_rows: int):
  """``cu_q_lens`` (int32 ``[M + 1]``, unchecked under ``jit``) made non-decreasing in
  ``[0, N]``: sequence i keeps its count ``clip(cu[i + 1], 0, N) - clip(cu[i], 0, N)``
  where that is positive (else 0), counted on from ``clip(cu[0], 0, N)`` and capped at N.
  Valid offsets come out as they are. (The same the Triton kernels derive in registers,
  `fdecode.kernels.triton.geometry.load_seqs`, as a running sum: Triton has one, and no
  running maximum.) The sum runs over all pairs (one fusion; XLA's
  cumulative sum is a reduce-window, a few tiny kernels on GPU), past ~1M pairs as it."""
  c = jnp.clip(cu_q_lens, 0, n_rows)
  count = jnp.concatenate([jnp.zeros((1,), c.dtype), jnp.maximum(c[1:] - c[:-1], 0)])
  if count.size * count.size > 1 << 20:
    total = lax.cumsum(count)
  else:
    i = jnp.arange(count.size)
    total = jnp.sum(jnp.where(i[None, :] <= i[:, None], count[None, :], 0), axis=1)
  return jnp.minimum(c[0] + total, n_rows).astype(c.dtype)
