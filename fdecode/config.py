"""Tuning knobs for FlashDecode (`Config`) and the parallel units a split rule fills (each
backend's split rule lives in its plan module, `fdecode.kernels.<backend>.plan`).

Dimension legend used throughout fdecode:
  B batch, T new tokens per sequence, Hq query heads, Hkv kv heads, G = Hq // Hkv,
  S cache capacity (tokens), Dk key/query head dim, Dv value head dim,
  R = T * G query rows per kv head, P pages, page_size tokens per page.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from fdecode.validation import tuning_knob

DEFAULT_BLOCK_K = 128
# The batch-invariant mode's default split size: cache positions per split.
DEFAULT_SPLIT_SIZE = 1024
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
    batch_invariant: the batch-invariant mode (``flash_decode(batch_invariant=True)``):
      splits of ``split_size`` positions at absolute positions, merged in one order (each
      backend's invariant plan: `fdecode.kernels.xla.invariant`, the Triton and Mosaic
      ``make_plan(split_size=)``).
    split_size: positions per split in that mode (None: `DEFAULT_SPLIT_SIZE`; each backend
      rounds it up to its own unit: whole pages on the XLA path, whole key blocks in the
      Triton kernel).
  """

  num_splits: int | None = None
  block_k: int | None = None
  balance: bool = False
  batch_invariant: bool = False
  split_size: int | None = None

  @classmethod
  def from_args(cls, num_splits, block_k, batch_invariant=False, split_size=None) -> "Config":
    """``flash_decode``'s ``num_splits`` (an int, None or ``"balance"``), ``block_k``,
    ``batch_invariant`` and ``split_size``."""
    mode = dict(batch_invariant=batch_invariant, split_size=split_size)
    if isinstance(num_splits, str) and num_splits == "balance":
      return cls(block_k=block_k, balance=True, **mode)
    return cls(num_splits=num_splits, block_k=block_k, **mode)

  def __post_init__(self):
    for name in ("num_splits", "block_k", "split_size"):  # numpy / jax integers become plain ints
      object.__setattr__(self, name, tuning_knob(name, getattr(self, name)))

  @property
  def invariant_split(self) -> int | None:
    """The batch-invariant mode's positions per split (`DEFAULT_SPLIT_SIZE` unless
    ``split_size`` says), or None outside the mode."""
    if not self.batch_invariant:
      return None
    return DEFAULT_SPLIT_SIZE if self.split_size is None else self.split_size

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
