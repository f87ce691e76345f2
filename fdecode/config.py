"""Tuning knobs for FlashDecode and the split heuristic.

Dimension legend used throughout fdecode:
  B batch, T new tokens per sequence, Hq query heads, Hkv kv heads, G = Hq // Hkv,
  S cache capacity (tokens), Dk key/query head dim, Dv value head dim,
  R = T * G query rows per kv head, P pages, page_size tokens per page.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax

from fdecode.validation import tuning_knob

# Split the cache only while batch*kv_heads leaves the machine idle: the Ascend
# IncreFlashAttention rule (split when B*Hkv < 0.4 * cores).
_SPLIT_OCCUPANCY = 0.4
# Cap the splits one (batch, kv head) pair may use: past this the combine costs more
# than it saves (Tenstorrent's `max_cores_per_head_batch` = 16).
MAX_SPLITS_PER_HEAD = 16
DEFAULT_BLOCK_K = 128
# XLA path: about this many tokens per split (per loop step over paged / 8-bit caches).
XLA_CHUNK_TOKENS = 2048
# ... and in the chunk loops (pools, 8-bit and token-major caches) at most this many
# bytes of K per chunk, over all sequences: B=4 S=16384 Hkv=8 D=128 pages of 16 on a 2-core
# CPU, 2048-token chunks (32 MiB f32) 48.6 ms, 512-token ones (8 MiB) 30.0 (RESULTS.md).
XLA_CHUNK_BYTES = 8 << 20
# ... and at most this many over a contiguous token-major cache, whose chunks are
# transposed as they load: B=4 S=4096 Hkv=8 D=128 on a 2-core CPU, 2048-token chunks
# 25.3 ms f32 / 9.6-11.1 ms bf16 against 14.7 / 6.8 at 512 (benchmarks/RESULTS.md).
XLA_TOKEN_MAJOR_CHUNK_TOKENS = 512
# Parallel units assumed when lowering for a platform with no device here: an H100's
# 132 SMs; one TensorCore per TPU chip (v5e / v6e).
_DEFAULT_UNITS = {"gpu": 132, "tpu": 1}


@dataclasses.dataclass(frozen=True)
class Config:
  """Static tuning knobs; ``None`` means "pick by heuristic".

  Attributes:
    num_splits: number of chunks the cache's token axis is split into, each producing
      a partial output + LSE that `merge_states` combines. Any positive value gives
      the same result within float tolerance.
    block_k: tokens per block of the Pallas kernel's online-softmax loop.
    balance: the Triton kernel's balanced schedule (``flash_decode(num_splits="balance")``):
      a fixed grid of work items that deal out each sequence's live blocks
      (`fdecode.kernels.triton`); other paths pick their splits as for ``None``.
  """

  num_splits: int | None = None
  block_k: int | None = None
  balance: bool = False

  @classmethod
  def from_args(cls, num_splits, block_k) -> "Config":
    """``flash_decode``'s ``num_splits`` (an int, None or ``"balance"``) and ``block_k``."""
    if isinstance(num_splits, str) and num_splits == "balance":
      return cls(block_k=block_k, balance=True)
    return cls(num_splits=num_splits, block_k=block_k)

  def __post_init__(self):
    for name in ("num_splits", "block_k"):  # numpy / jax integers become plain ints
      object.__setattr__(self, name, tuning_knob(name, getattr(self, name)))

  def bounded(self, tokens: int) -> "Config":
    """These knobs lowered to what a call over ``tokens`` tokens (S, or K index slots) can
    use; any value gives the same result, one past every token only costs memory:
    num_splits at most ``tokens``, block_k at most ``tokens`` rounded up to ``16 * 2**k``."""
    tokens = max(tokens, 1)
    splits = None if self.num_splits is None else min(self.num_splits, tokens)
    block = None if self.block_k is None else min(self.block_k, 16 * 2 ** ((tokens - 1) // 16).bit_length())
    return dataclasses.replace(self, num_splits=splits, block_k=block)


def num_parallel_units(backend: str | None = None) -> int:
  """Cores the split heuristic tries to fill: SMs on GPU, cores on CPU/TPU."""
  backend = backend or jax.default_backend()
  if backend == "cpu":
    return os.cpu_count() or 1
  try:
    device = jax.devices(backend)[0]
  except RuntimeError:  # lowering for a platform this host lacks (jax.export)
    return _DEFAULT_UNITS.get(backend, 1)
  return int(getattr(device, "core_count", None) or _DEFAULT_UNITS.get(backend, 1))


def default_num_splits(batch: int, num_kv_heads: int, num_blocks: int, num_units: int) -> int:
  """The split heuristic.

  One (batch, kv head) pair is one unit of work. If there are at least
  ``0.4 * num_units`` of them the machine is already busy and the cache is not split.
  Otherwise each pair gets ``ceil(num_units / (batch * num_kv_heads))`` splits, at most
  `MAX_SPLITS_PER_HEAD` and at most one per block of the cache.
  """
  work = batch * num_kv_heads
  if work >= _SPLIT_OCCUPANCY * num_units:
    return 1
  splits = math.ceil(num_units / max(work, 1))
  return max(1, min(splits, MAX_SPLITS_PER_HEAD, num_blocks))


def gpu_busy(programs: int, sms: int, resident: int) -> float:
  """Fraction of a GPU's bandwidth that a launch of ``programs`` equal, memory-bound
  programs keeps busy, ``resident`` of them on an SM at once: the smaller of two tail
  losses. Balance: the busiest SM streams ``ceil(programs / SMs)`` programs against the
  mean ``programs / SMs`` (below one per SM, idle SMs). Waves: when an SM's share of the
  bandwidth needs all ``resident`` programs in flight, the last partial wave runs at
  ``waves / ceil(waves)``. `gpu_num_splits` chooses by it; benchmarks/compile_report.py
  predicts with it from the compiled kernel's residency."""
  per_sm = programs / sms
  balance = per_sm / math.ceil(per_sm)
  waves = programs / (sms * max(resident, 1))
  return min(balance, waves / math.ceil(waves) if waves >= 1 else 1.0)


# Programs per SM a GPU split count aims for: two keep an SM's loads in flight. Measured
# (benchmarks/RESULTS.md, 2026-11-25): B=1 S=32k Hq=32 Hkv=8 on an H100, device time,
# 8 / 16 / 32 / 198 splits (64 .. 1584 programs): 0.111 / 0.0728 / 0.0632 / 0.0706 ms;
# on an H200, 33 splits (2 a SM) 13% faster than the 198 that "a full wave at the upper
# residency" (4 a SM x 3 residency) gave, B=8 S=32k 3% faster, B=8 S=4k 6% slower.
PROGRAMS_PER_SM = 2


def gpu_num_splits(sms: int, residency: tuple[int, int], work: int, num_blocks: int,
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


def largest_divisor_at_most(n: int, cap: int) -> int:
  """Largest d <= cap with n % d == 0 (1 for n == 0)."""
  for d in range(max(min(cap, n), 1), 0, -1):
    if n % d == 0:
      return d
  return 1
