"""`flash_decode`, the public entry point: its call validated and canonicalized
(`fdecode.call`), then `fdecode.dispatch` (the only place that picks a backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Union, Unpack, overload

import jax
from jax import Array
from jax.typing import ArrayLike

from fdecode.call import canonical_call, run
from fdecode.dispatch import recording_plans
from fdecode.kernels.backend import Refused
from fdecode.kernels.common import chips
from fdecode.options import ARRAY_ARGS, DecodeOptions, Impl, Interpret, KvLayout, ScoreOptions, split_call
from fdecode.validation import describe, static_scalar

if TYPE_CHECKING:
  from fdecode.kernels.mosaic_gpu import MlaPlan, RowsPlan
  from fdecode.kernels.mosaic_tpu import CallPlan
  from fdecode.kernels.triton import TritonPlan
  from fdecode.kernels.xla import XlaPlan

# DecodeOptions, Impl, Interpret, KvLayout, ScoreOptions: the types of the public signatures
# (`fdecode.options`), imported from here by the entry points that forward to flash_decode.

Plan = Union["XlaPlan", "TritonPlan", "CallPlan", "MlaPlan", "RowsPlan"]


class Plans(tuple[Plan, ...]):
  """`plan`'s result: the plans in the order they run (a tuple), and ``refused``: each
  backend the route tried before the one chosen, as `fdecode.kernels.backend.Refused`
  ``(backend, reason)`` pairs, in the order tried."""
  refused: tuple

  def __new__(cls, plans, refused=()):
    out = super().__new__(cls, plans)
    out.refused = tuple(refused)
    return out


@overload
def flash_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *,
                 return_lse: Literal[False] = False, **options: Unpack[DecodeOptions]) -> Array: ...


@overload
def flash_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *,
                 return_lse: Literal[True], **options: Unpack[DecodeOptions]) -> tuple[Array, Array]: ...


@overload
def flash_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *,
                 return_lse: bool, **options: Unpack[DecodeOptions]) -> Array | tuple[Array, Array]: ...


def flash_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *,
                 block_tables: ArrayLike | None = None, k_scale: ArrayLike | None = None,
                 v_scale: ArrayLike | None = None, softmax_scale: float | None = None,
                 num_splits: int | Literal["balance"] | None = None, block_k: int | None = None,
                 impl: Impl | None = None, interpret: Interpret = None, return_lse: bool = False,
                 k_offset: ArrayLike | None = None, v_offset: ArrayLike | None = None,
                 kv_offset: ArrayLike | None = None, causal: bool = True, mask: ArrayLike | None = None,
                 bias: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None, window: int | None = None,
                 logits_soft_cap: float | None = None, sinks: ArrayLike | None = None,
                 v_head_dim: int | None = None, k_rope: ArrayLike | None = None, indices: ArrayLike | None = None,
                 kv_layout: KvLayout = "HND", batch_invariant: bool = False,
                 split_size: int | None = None) -> Array | tuple[Array, Array]:
  """FlashDecode attention of new tokens over a KV cache.

  Legend: B batch, T new tokens per sequence, Hq query heads, Hkv kv heads
  (``Hq % Hkv == 0``: MHA, GQA and MQA), S cache capacity, Dk key head dim,
  Dv value head dim.

  Array arguments may be Python lists (converted with numpy). Integers are used as int32:
  concrete values outside int32 raise ValueError (under ``jit`` wider integers are
  clipped into int32, never wrapped); static floats are used as float32 and checked there.

  Args:
    q: ``[B, Hq, Dk]`` (one new token per sequence) or ``[B, T, Hq, Dk]`` (the last T
      positions of each sequence, causal among themselves: query t attends to key
      positions ``< lengths - T + t + 1``). Floating dtype.
    k: ``[B, Hkv, S, Dk]`` head-major contiguous key cache, or with ``block_tables`` a
      paged pool ``[Hkv, P, page_size, Dk]``. Float, or int8 / float8_e4m3fn /
      float8_e5m2 with ``k_scale``.
    v: ``[B, Hkv, S, Dv]`` or ``[Hkv, P, page_size, Dv]``; Dv may differ from Dk. Or
      ``None`` (MLA, FlashMLA's ``head_dim_v``): the values are ``k[..., :v_head_dim]``,
      the first columns of the same cache, read once for both (never a second copy).
    lengths: int ``[B]`` valid tokens per sequence, new ones included, each in ``[0, S]``.
      Concrete values outside that range raise ValueError; under ``jit`` they are
      clipped to ``[0, S]``.
    block_tables: int ``[B, n]``: page j of sequence b is ``k[:, block_tables[b, j]]``
      (token t in page ``block_tables[b, t // page_size]``, slot ``t % page_size``);
      capacity ``S = n * page_size``. Entries past a sequence's length are never read
      and may hold anything. Concrete ids out of ``[0, P)`` for a live token raise
      ValueError; under ``jit`` ids are clipped into the pool (never an out-of-bounds read).
    k_scale, v_scale: required for 8-bit caches: a scalar (per tensor) or float32 shaped
      like the cache with the last axis replaced by ``n_tiles`` dividing the head dim
      (1 = per token per head, D/128 = 1x128 tiles); leading axes of size 1 broadcast.
      Dequantization happens after the load, inside the kernel (see `fdecode.cache.quant`).
    k_offset, v_offset: optional, shaped like the scales: real = (x + offset) * scale.
    kv_offset: int scalar or int ``[B]``, default 0: the position in the sequence of the
      cache's first token, for a cache that is a chunk of a longer sequence (sequence
      parallelism, chunked caches). ``lengths`` then count the whole sequence (they may
      exceed S) and query t sees the chunk's tokens at positions
      ``< lengths - T + t + 1``; a sequence that ends before the chunk sees none of it.
    softmax_scale: scores multiplier, default ``1/sqrt(Dk)``. Static: a Python, numpy or
      concrete jax real number, compiled into the kernel (a traced value raises ValueError); as a
      float32, 0 or of magnitude in ``[2**-126, float32 max]``.
    num_splits: chunks of the token axis processed in parallel, each yielding a partial
      state merged by `merge_states`. ``None``: compiled Triton gives every SM of the GPU two
      programs (`fdecode.kernels.triton.plan.split_count`); elsewhere the backend's plan decides
      (`fdecode.kernels.mosaic_tpu.plan.split_count`, `fdecode.kernels.xla.plan.make_plan`).
      Any positive value gives the same result within float tolerance. ``"balance"``:
      on a paged cache without mask, bias or index list, the Triton kernel runs a fixed
      grid of work items sized to fill the GPU, each a run of one sequence's live
      blocks, dealt out by the live lengths (then merged per sequence), for batches
      whose lengths differ widely, e.g. mostly empty rows (`ragged_decode`'s prefill
      blocks); otherwise, and on the other paths, splits are picked as for ``None``.
    block_k: tokens per block of the Pallas kernels' inner loop. Triton: rounded up to a
      power of two, at least 16 (default 128); compiled, an upper bound: the block shrinks
      until its tiles fit the GPU's registers and shared memory. Mosaic: rounded up to the cache dtype's
      sublane tiling, whole pages when paged (default: about 512 KiB of K+V per step).
    impl: ``"pallas"``, ``"mosaic_gpu"``, ``"xla"``, ``"reference"`` or ``None``. ``None`` chooses by the
      platform being lowered for: XLA on CPU, the Triton kernel on GPU, the Mosaic
      kernel on TPU. On GPU it falls back to XLA only where Triton's ``tl.dot`` cannot
      tile: a head dim, or an 8-bit scale tile, that is not a multiple of 16 (then
      ``impl="pallas"`` raises ValueError when traced on a GPU host). On TPU, a paged
      cache whose page size splits a 32-bit sublane takes the XLA path
      (``docs/semantics.md``, Backends). `fdecode.plan` shows what a call would run.
      ``"mosaic_gpu"`` (opt-in, to measure them: no GPU has timed them against Triton
      yet): the Hopper (sm_90) kernels of `fdecode.kernels.mosaic_gpu`, with no fallback:
      MLA (``v=None``, ``v_head_dim=512`` of 576 latent columns, one contiguous kv head,
      T = 1, G a multiple of 16; bf16, or int8 / float8_e4m3fn with per-token ``k_scale``)
      on the MLA kernel, every other call on the GQA rows kernel (bf16 q; head-major k, v
      of one shape, contiguous or a pool with page size 8, 16, 32 or a multiple of 64; D
      in 64 / 128 / 256; bf16, or both int8 / both float8_e4m3fn with per-token scales;
      T x G rows padded to 64-row tiles). Token-major (``kv_layout="NHD"``) caches are
      taken only with one kv head (the same bytes as head-major). Score modifiers, sinks,
      ``indices``, ``k_rope``, offsets, ``kv_offset`` and ``causal=False`` with T > 1
      are refused, as is any call the kernel does not take: ValueError with the kernel's
      reason (`fdecode.kernels.mosaic_gpu.unsupported` / ``rows_unsupported``).
      ``num_splits="balance"`` picks splits as ``None``; ``block_k`` is not used (64-token
      blocks).
    interpret: with ``impl="pallas"``: ``None`` / ``False`` compile the kernel for the
      lowering platform (Triton on GPU, Mosaic on TPU; CPU has only the interpreter and
      runs the Triton kernel interpreted); ``True`` runs the Triton kernel in Pallas'
      interpreter anywhere; a ``jax.experimental.pallas.tpu.InterpretParams`` runs the
      Mosaic (TPU) kernel under the TPU-semantics interpreter (simulated VMEM / SMEM,
      DMAs, semaphores, optional race detection), mirroring ``pallas_call``'s own
      ``interpret=``. Under ``pltpu.force_tpu_interpret_mode(params)``, ``None`` means
      ``params``. With ``impl="mosaic_gpu"``: ``None`` / ``False`` compile the kernels for
      the sm_90 GPU lowered for (ValueError when the trace is for another platform or
      GPU; a CUDA export from a host without a GPU names its target with ``jax.set_mesh``
      of a GPU abstract mesh, `fdecode.kernels.common.chips.lowering_platform`); a
      ``fdecode.kernels.mosaic_gpu.InterpretGPUParams`` runs the same kernels and
      plans (an H100's) under jax's Mosaic GPU interpreter, on CPU.
    return_lse: also return the log-sum-exp of the scores.
    v_head_dim: static int Dv, required with ``v=None`` (``1 <= Dv <= k.shape[-1]``; DeepSeek
      MLA: 512 of a 576-wide latent key). With ``v`` given it must equal its head dim.
    k_rope: optional key-only columns appended after k's own, ``[B, Hkv, S, Dr]`` or
      ``[Hkv, P, page_size, Dr]`` (paged), float, never quantized: the logical key is
      ``concat(k, k_rope)`` of width ``Dk = k.shape[-1] + Dr`` (q's head dim) and the
      values never include them. FlashMLA's FP8 cache is ``k`` float8_e4m3fn
      ``[..., 512]`` with ``k_scale [..., 4]`` (1x128 tiles) plus ``k_rope`` bfloat16
      ``[..., 64]``: 656 bytes per token (`fdecode.cache.quant` documents the layout).
    indices: sparse top-k attention (DeepSeek V3.2): int ``[B, K]`` (shared by the T new
      tokens), ``[B, T, K]`` (per token) or ``[B, T, Hkv, K]`` (per token and kv head;
      with a single-token q: ``[B, K]`` or ``[B, Hkv, K]``): the sequence positions each
      query may attend to, -1 = none. Only those tokens are read (gathered per block,
      through the block table when paged). Positions outside the cache, at or past the
      length, or hidden by causality / the window are masked; duplicates count once.
      Not combinable with ``mask`` / ``bias``. ``K = 0`` selects nothing (out 0, lse -inf).
      Exact semantics: `fdecode.kernels.common.sparse`; on TPU: ``docs/semantics.md``.

  Score modifiers (all off by default; exact semantics in `fdecode.kernels.common.modifiers`). With
  ``p = lengths - T + t`` the position of query t and ``j`` a key position:
    causal: bool, default True: with T > 1, query t sees keys ``j <= p``; False lets
      every new token see all ``lengths`` keys (tree / cross attention). With T = 1 both
      are the same and either is accepted.
    mask: bool, True = may attend, ``[B, S]``, ``[B, T, S]`` or ``[B, T, Hq, S]``
      (leading axes may be 1), ANDed with lengths, causality and window. S is the cache
      capacity (a paged table's ``n * page_size``, logical positions). Read per block;
      never expanded to ``[B, T, Hq, S]``.
    bias: float, additive, same forms as ``mask`` (Ascend's ``pse``).
    alibi_slopes: float ``[Hq]``: adds ``slope * (j - p)`` (FlashAttention / vLLM),
      computed in the kernel.
    window: static int in ``[1, 2**31 - 1]``: sliding window, query p sees keys ``p - window < j <= p``
      (Mistral / Gemma: the window counts the query's own position). Blocks wholly
      outside the window are not read. (With ``causal=False`` the upper bound is the
      sequence end.)
    logits_soft_cap: static float in ``[2**-126, 2**100]``: ``s = cap * tanh(s / cap)``
      after ``softmax_scale``, before bias, ALiBi and masking (Gemma 2). The kernels
      compute ``s * (1 / cap)`` in float32; the bounds keep cap and 1 / cap normal and
      that product exact to float32's resolution (a larger cap is a no-op anyway).
    sinks: float ``[Hq]`` learned sink logits (gpt-oss): ``exp(sink)`` joins each row's
      softmax denominator, with no value, exactly once after every split is merged. The
      returned lse includes it (a row that sees no key gives out 0, lse = sink; +inf:
      out 0, lse +inf; -inf: no sink); to
      merge partial results yourself, compute them without sinks, merge, then call
      `fdecode.combine.apply_sinks` once.

  Dtypes, dead slots, NaN propagation and layouts, in full: ``docs/semantics.md``. In
  short: softmax and accumulation are float32; a slot no query may see never influences
  any output, whatever it holds; a NaN a query sees gives NaN in its whole row and lse.

  Layout:
    kv_layout: ``"HND"`` (default, head-major, the shapes above) or ``"NHD"``
      (token-major: contiguous ``[B, S, Hkv, D]``, paged ``[P, page_size, Hkv, D]``;
      scales, offsets and k_rope follow it). Read in place where the kernel can
      (``docs/semantics.md``, Layouts).

  Reproducibility:
    batch_invariant: static bool, default False. True: a sequence's output and lse are
      bit-identical whatever else is in the batch (its size, this sequence's place in it,
      the other sequences' lengths, masks and capacity), run to run, and whether its token
      was decoded alone, as one row of a multi-token (prefill) call or in `ragged_decode`.
      The cache is split every ``split_size`` positions from position 0, the splits are
      merged left to right, and every product and row sum has one shape whatever B and
      T. Runs on the route's kernels where they have an invariant plan (GPU: Triton; TPU:
      Mosaic; interpreted with ``impl="pallas"``), else on the XLA path
      (`fdecode.kernels.xla.invariant`); impl None, ``"xla"`` or ``"pallas"`` (other
      impls, ``num_splits`` and ``indices`` raise ValueError). Guarantees, exceptions and
      cost: ``docs/semantics.md`` (Reproducibility).
    split_size: static int >= 1, cache positions per split in that mode (default 1024;
      rounded up to whole pages on the XLA path, to whole key blocks in the kernels). Only
      with ``batch_invariant=True``.

  Returns:
    ``out`` shaped like ``q`` with last dim Dv, dtype ``q.dtype``; with ``return_lse``
    also ``lse``: float32 natural-log ``[B, Hq]`` or ``[B, T, Hq]``. A query that sees
    no key (length 0) gives out 0 and lse -inf. B = 0 or T = 0 gives empty results.

  Raises:
    ValueError: at trace time, for inconsistent shapes or dtypes (the message names the
      argument and shows the shapes), a zero head dim, a bad option (a mask that is not
      boolean or does not broadcast, a window or soft cap out of its range, a scale that
      is not a finite float32, slopes or sinks not ``[Hq]``), concrete lengths / page ids
      / integers out of range (int32 included); with ``impl="pallas"`` compiled for GPU,
      for head dims the Triton kernel cannot tile; with ``impl="mosaic_gpu"``, for a call
      its kernels do not take or a trace not for an sm_90 GPU (see ``impl``); a static
      option (`fdecode.options.STATIC_ARGS`: softmax_scale, num_splits, block_k, causal,
      window, logits_soft_cap, v_head_dim, interpret, batch_invariant, split_size,
      return_lse) given traced: under ``jit`` pass it with ``static_argnames`` or close
      over it with ``functools.partial``.
    TypeError: an array argument that is neither an array nor a rectangular list of
      numbers.
  """
  options = dict(locals())
  return_lse = static_scalar("return_lse", options.pop("return_lse"))
  return run(canonical_call(*split_call(**options)), return_lse)


PLATFORMS = ("cpu", "gpu", "tpu")


def plan(q: ArrayLike | jax.ShapeDtypeStruct, k: ArrayLike | jax.ShapeDtypeStruct,
         v: ArrayLike | jax.ShapeDtypeStruct | None, lengths: ArrayLike | jax.ShapeDtypeStruct, *,
         platform: Literal["cpu", "gpu", "tpu"] | None = None, **kwargs: object) -> Plans:
  """The frozen plans a `flash_decode` call with these arguments hands its kernels when
  lowered for ``platform`` (``"cpu"``, ``"gpu"`` or ``"tpu"``; None: `jax.default_backend()`),
  in the order they run: an `fdecode.kernels.xla.plan.XlaPlan`, an
  `fdecode.kernels.triton.plan.TritonPlan` (a GPU's: `fdecode.kernels.common.chips.lowering_gpu`),
  an `fdecode.kernels.mosaic_tpu.plan.CallPlan` (a call it refuses: the XlaPlan, its
  reason in ``refused``), or the Hopper MLA / rows kernel's plan (`fdecode.kernels.mosaic_gpu.MlaPlan` /
  ``RowsPlan``: sm_90, or ``impl="mosaic_gpu"``), as a `Plans` tuple whose ``refused``
  names each backend tried before the chosen one and why it did not take the call (the
  route: `fdecode.route.ROUTES`). ``q``, ``k``, ``v``, ``lengths`` and the
  array keyword arguments (`fdecode.options.ARRAY_ARGS`): arrays or `jax.ShapeDtypeStruct`s
  (or lists); every other keyword argument as `flash_decode` takes it. Nothing runs or
  compiles: the call is traced. Empty for ``impl="reference"`` and for a call with no
  sequence or no new token.

  Raises:
    ValueError / TypeError: what `flash_decode` raises for these arguments, value checks
      of the concrete ones (lengths, page ids, kv_offset) included; a ``platform`` that is
      not None or one of ``"cpu"``, ``"gpu"``, ``"tpu"``.
  """
  if platform is None:
    platform = jax.default_backend()
  elif not (isinstance(platform, str) and platform in PLATFORMS):
    raise ValueError(f"plan: platform must be 'cpu', 'gpu', 'tpu' or None (the host's, jax.default_backend()), "
                     f"got {describe(platform)}")
  named = dict(q=q, k=k, v=v, lengths=lengths, **kwargs)
  # The arrays are traced (the plan depends on their shapes and dtypes only); the rest goes in
  # as given: statics as flash_decode takes them (numpy scalars included), lists to be converted.
  traced = {n: x for n, x in named.items() if n in ARRAY_ARGS and hasattr(x, "shape") and hasattr(x, "dtype")}
  given = {n: x for n, x in named.items() if n not in traced}
  _check_values(traced, given)
  with recording_plans() as log, chips.tracing_for(platform):
    jax.eval_shape(lambda traced: flash_decode(**traced, **given), traced)
  mine = [p for where, p in log if where in (None, platform)]
  return Plans([p for p in mine if not isinstance(p, Refused)], [p for p in mine if isinstance(p, Refused)])


def _check_values(traced, given) -> None:
  """`canonical_call` (every `flash_decode` check, no backend) with the concrete arrays among
  ``traced`` as values, so the value checks a call makes (lengths in range, page ids of
  live tokens in the pool, kv_offset) raise here as they would there. Inside `jax.eval_shape`:
  nothing runs."""
  concrete = {n: x for n, x in traced.items() if not isinstance(x, (jax.ShapeDtypeStruct, jax.core.Tracer))}
  if not concrete:
    return
  abstract = {n: x for n, x in traced.items() if n not in concrete}
  options = {n: x for n, x in given.items() if n != "return_lse"}

  def check(abstract):
    canonical_call(*split_call(**abstract, **concrete, **options))

  jax.eval_shape(check, abstract)
