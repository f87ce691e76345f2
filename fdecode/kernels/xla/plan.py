"""The plain-XLA path's plan (`fdecode.kernels.xla`): how many chunks of the token axis a
call splits into, and how it reads the cache. The one place these are decided; the
dispatch hands the plan to `xla_partials` / `sparse_partials` as it is."""

from __future__ import annotations

import dataclasses

from fdecode import config as config_lib


@dataclasses.dataclass(frozen=True)
class XlaPlan:
  """One XLA call, decided before it runs.

  Attributes:
    num_splits: chunks of the token axis (S seen, or the K index-list slots), each a
      partial state merged after.
    kv_layout: how the cache is read: ``"HND"`` head-major, ``"NHD"`` token-major in place.
    tokens: the tokens split: S seen by the rows (window-bounded), or K slots (sparse).
  """
  num_splits: int
  kv_layout: str
  tokens: int


def make_plan(*, batch: int, kv_heads: int, tokens: int, platform: str, paged: bool = False,
              quantized: bool = False, kv_layout: str = "HND", token_bytes: int = 0,
              sparse: bool = False, num_splits: int | None = None) -> XlaPlan:
  """The plan of one XLA call.

  ``tokens``: S the rows see (`fdecode.kernels.common.modifiers.window_tokens`), or with
  ``sparse`` the K index-list slots. ``kv_layout``: how the cache is read, as its view
  decided (`fdecode.cache.layout.CacheView.read_layout`). ``token_bytes``: K bytes of one position over all sequences. ``num_splits``: the
  caller's count (kept as given), None for the heuristic:

  * sparse: chunks of about `config.XLA_CHUNK_TOKENS` slots.
  * otherwise the parallelism heuristic (`config.default_num_splits` for ``platform``),
    raised to chunks of about `config.XLA_CHUNK_TOKENS` tokens (one chunk's scores, or its
    gathered / dequantized pages, stay cache-sized: 0.50 of the floor at S=16384 on a
    2-core CPU vs 0.38 unsplit, benchmarks/RESULTS.md). A contiguous float head-major
    read is one batched matmul: the count rounds down to a divisor of S (a free reshape).
    The chunk loops (pools, 8-bit and token-major caches) also keep a chunk's K under
    `config.XLA_CHUNK_BYTES`, and a contiguous token-major read's chunks are smaller
    still (`config.XLA_TOKEN_MAJOR_CHUNK_TOKENS`: each is transposed as it loads).
  """
  layout = kv_layout
  if sparse:
    return XlaPlan(num_splits or max(1, tokens // config_lib.XLA_CHUNK_TOKENS), layout, tokens)
  if num_splits:
    return XlaPlan(num_splits, layout, tokens)
  s = tokens
  n = config_lib.default_num_splits(batch, kv_heads, max(s, 1), config_lib.num_parallel_units(platform))
  n = max(n, s // config_lib.XLA_CHUNK_TOKENS)
  if not paged and layout == "HND" and not quantized:
    return XlaPlan(config_lib.largest_divisor_at_most(s, n), layout, tokens)  # no loop: one batched matmul
  n = max(n, -(-s * token_bytes // config_lib.XLA_CHUNK_BYTES))
  if not paged and layout == "NHD":
    n = max(n, s // config_lib.XLA_TOKEN_MAJOR_CHUNK_TOKENS)
  return XlaPlan(max(n, 1), layout, tokens)
