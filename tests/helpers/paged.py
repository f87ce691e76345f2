"""Paged caches for the tests: shuffled page pools with garbage in unused table entries,
garbage poured into dead slots, page tables laid out for a sequence-sharded pool."""

import jax.numpy as jnp
import numpy as np

from helpers import randn


def paged_problem(seed, *, b, t, hq, hkv, pages_per_seq, page_size, dk, dtype=jnp.float32, spare=3):
  """A shuffled page pool with garbage in unused table entries; returns the contiguous view too."""
  num_pages = b * pages_per_seq + spare
  rng = np.random.default_rng(seed)
  q_shape = (b, hq, dk) if t is None else (b, t, hq, dk)
  q = randn(rng, q_shape, dtype)
  k_pages = randn(rng, (hkv, num_pages, page_size, dk), dtype)
  v_pages = randn(rng, (hkv, num_pages, page_size, dk), dtype)
  perm = rng.permutation(num_pages)
  tables = perm[: b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
  return q, k_pages, v_pages, tables


def with_garbage(tables, lengths, page_size, num_pages):
  """Entries past each sequence's pages: -1, a huge id, or a page of another sequence."""
  t = tables.copy()
  for i, n in enumerate(np.asarray(lengths)):
    used = -(-int(n) // page_size)
    for j in range(used, t.shape[1]):
      t[i, j] = [-1, 10 ** 6, tables[(i + 1) % len(t), 0]][j % 3]
  return t


GARBAGE = np.array([np.inf, -np.inf, np.nan, 3e38, -3e38], np.float32)


def pour(x, dead, seed):
  """``x`` with every slot where ``dead`` (broadcastable) holds random garbage."""
  rng = np.random.default_rng(seed)
  junk = rng.choice(GARBAGE, size=x.shape)
  if jnp.issubdtype(x.dtype, jnp.integer):  # int8 has no inf / NaN: any byte
    junk = rng.integers(-128, 128, size=x.shape)
  junk = jnp.asarray(junk).astype(x.dtype)
  return jnp.where(jnp.broadcast_to(dead, x.shape), junk, x)


def paged_shards(k, n_s, page_size, seed):
  """Contiguous [B, Hkv, S, D] -> a pool [Hkv, P, ps, D] and table [B, n] in which the pages
  of token range d (columns d*n/n_s...) sit, shuffled, in pool shard d."""
  b, hkv, s, d = k.shape
  n = s // page_size
  per = b * n // n_s  # pages per pool shard
  rng = np.random.default_rng(seed)
  table = np.zeros((b, n), np.int32)
  cols = n // n_s
  for shard in range(n_s):
    ids = shard * per + rng.permutation(per)
    table[:, shard * cols:(shard + 1) * cols] = ids.reshape(b, cols)
  return table
