"""The plain-XLA path's plan (`fdecode.kernels.xla`): how many chunks of the token axis a
call splits into, and how it reads the cache. The one place these are decided; the
dispatch hands the plan to `xla_partials` / `sparse_partials` as it is."""

from __future__ import annotations

import dataclasses
import math

import jax

from fdecode import config as config_lib

# Split the cache only while batch * kv_heads leaves the machine idle: the Ascend
# IncreFlashAttention rule (split when B * Hkv < 0.4 * cores).
_SPLIT_OCCUPANCY = 0.4
# Cap the splits one (batch, kv head) pair may use: past this the merge costs more than
# it saves (Tenstorrent's `max_cores_per_head_batch` = 16).
MAX_SPLITS_PER_HEAD = 16
# About this many tokens per split (per loop step over paged / 8-bit caches).
CHUNK_TOKENS = 2048
# ... and in the chunk loops (pools, 8-bit and token-major caches) at most this many
# bytes of K per chunk, over all sequences: B=4 S=16384 Hkv=8 D=128 pages of 16 on a 2-core
# CPU, 2048-token chunks (32 MiB f32) 48.6 ms, 512-token ones (8 MiB) 30.0 (benchmarks/RESULTS.md).
CHUNK_BYTES = 8 << 20
# ... and at most this many over a contiguous token-major cache, whose chunks are
# transposed as they load: B=4 S=4096 Hkv=8 D=128 on a 2-core CPU, 2048-token chunks
# 25.3 ms f32 / 9.6-11.1 ms bf16 against 14.7 / 6.8 at 512 (benchmarks/RESULTS.md).
TOKEN_MAJOR_CHUNK_TOKENS = 512
# A contiguous float head-major read is one batched matmul while its scores (float32, every
# row of every sequence over every position) stay under `SCORE_BYTES`; past it (many new
# tokens over a long cache: T=256 over S=64k held 1.6 GiB) it loops over chunks of at most
# `CHUNK_SCORE_BYTES` of scores, merging each as it comes (benchmarks/bench_grad.py).
SCORE_BYTES = 64 << 20
CHUNK_SCORE_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class XlaPlan:
  """One XLA call, decided before it runs.

  Attributes:
    num_splits: chunks of the token axis (S seen, or the K index-list slots), each a
      partial state merged after.
    kv_layout: how the cache is read: ``"HND"`` head-major, ``"NHD"`` token-major in place.
    tokens: the tokens split: S seen by the rows (window-bounded), or K slots (sparse).
    loop: a contiguous float head-major read loops over its chunks, one at a time, their
      states merged as they come (one state out), rather than one batched matmul.
    split_size: the batch-invariant mode's positions per split (splits at absolute
      positions, `fdecode.kernels.xla.invariant`); None on the default path.
  """
  num_splits: int
  kv_layout: str
  tokens: int
  loop: bool = False
  split_size: int | None = None


def make_plan(*, batch: int, kv_heads: int, tokens: int, platform: str, paged: bool = False,
              quantized: bool = False, kv_layout: str = "HND", token_bytes: int = 0,
              sparse: bool = False, num_splits: int | None = None, rows: int = 1) -> XlaPlan:
  """The plan of one XLA call.

  ``tokens``: S the rows see (`fdecode.kernels.common.modifiers.window_tokens`), or with
  ``sparse`` the K index-list slots. ``kv_layout``: how the cache is read, as its view
  decided (`fdecode.cache.layout.CacheView.read_layout`). ``token_bytes``: K bytes of one
  position over all sequences. ``num_splits``: the caller's count (kept as given), None
  for the heuristic:

  * sparse: chunks of about `CHUNK_TOKENS` slots.
  * otherwise the parallelism heuristic (`split_count` on ``platform``'s cores),
    raised to chunks of about `CHUNK_TOKENS` tokens (one chunk's scores, or its
    gathered / dequantized pages, stay cache-sized: 0.50 of the floor at S=16384 on a
    2-core CPU vs 0.38 unsplit, benchmarks/RESULTS.md). A contiguous float head-major
    read is one batched matmul: the count rounds down to a divisor of S (a free reshape).
    The chunk loops (pools, 8-bit and token-major caches) also keep a chunk's K under
    `CHUNK_BYTES`, and a contiguous token-major read's chunks are smaller
    still (`TOKEN_MAJOR_CHUNK_TOKENS`: each is transposed as it loads).
  * ``rows`` (R = T * G per kv head) times the tokens past `SCORE_BYTES` of float32 scores:
    a contiguous read loops too, over chunks of at most `CHUNK_SCORE_BYTES` scores
    (``loop``), whatever ``num_splits`` asked.

  A symbolic ``batch`` (``jax.export`` with a shape-polymorphic B) is planned as batch 1:
  the plan is static and never depends on a symbolic value. Every batch size the exported
  program runs then gets batch 1's splits (its occupancy splits, and ``token_bytes`` taken
  per sequence, so a chunk holds `CHUNK_BYTES` of K per sequence rather than over all):
  the same results, possibly more merge work than that batch's own plan.
  """
  if jax.export.is_symbolic_dim(batch):
    batch, token_bytes = 1, per_sequence(token_bytes, batch)
  layout = kv_layout
  if sparse:
    return XlaPlan(num_splits or max(1, tokens // CHUNK_TOKENS), layout, tokens)
  s = tokens
  score_bytes = batch * kv_heads * rows * s * 4
  if not paged and layout == "HND" and not quantized and score_bytes > SCORE_BYTES:
    return XlaPlan(max(num_splits or 1, -(-score_bytes // CHUNK_SCORE_BYTES)), layout, tokens, loop=True)
  if num_splits:
    return XlaPlan(num_splits, layout, tokens)
  n = split_count(batch, kv_heads, max(s, 1), config_lib.num_parallel_units(platform))
  n = max(n, s // CHUNK_TOKENS)
  if not paged and layout == "HND" and not quantized:
    return XlaPlan(largest_divisor_at_most(s, n), layout, tokens)  # no loop: one batched matmul
  n = max(n, -(-s * token_bytes // CHUNK_BYTES))
  if not paged and layout == "NHD":
    n = max(n, s // TOKEN_MAJOR_CHUNK_TOKENS)
  return XlaPlan(max(n, 1), layout, tokens)


def per_sequence(total, batch):
  """``total`` (an int, or a symbolic multiple of the symbolic ``batch``) divided by ``batch``,
  as an int: a quantity over all sequences, per sequence. 0 when it is not a multiple."""
  each = total // batch
  return each if isinstance(each, int) else 0


def split_count(batch: int, kv_heads: int, num_blocks: int, num_units: int) -> int:
  """The XLA path's parallelism rule (`make_plan`), the CPU's split count, which the Triton
  interpreter keeps too (`fdecode.kernels.triton.plan`).

  One (batch, kv head) pair is one unit of work. With at least ``0.4 * num_units`` of
  them the machine is already busy and the cache is not split; otherwise each pair gets
  ``ceil(num_units / (batch * kv_heads))`` splits, at most `MAX_SPLITS_PER_HEAD` and at
  most one per block of the cache.
  """
  work = batch * kv_heads
  if work >= _SPLIT_OCCUPANCY * num_units:
    return 1
  splits = math.ceil(num_units / max(work, 1))
  return max(1, min(splits, MAX_SPLITS_PER_HEAD, num_blocks))


def largest_divisor_at_most(n: int, cap: int) -> int:
  """Largest d <= cap with n % d == 0 (1 for n == 0)."""
  for d in range(max(min(cap, n), 1), 0, -1):
    if n % d == 0:
      return d
  return 1
