"""Sparse top-k attention (``indices=``): the numpy index mask the oracle applies, and random
index lists."""

import numpy as np


def index_mask(indices, q_shape, hkv, s, kv_offset=0):
  """bool ``[B, T, Hq, S]``: cache slot j (sequence position ``kv_offset + j``) is selected."""
  idx = np.asarray(indices)
  single = len(q_shape) == 3
  b, hq = q_shape[0], q_shape[-2]
  t = 1 if single else q_shape[1]
  if idx.ndim == 2:
    idx = idx[:, None, None]
  elif idx.ndim == 3:
    idx = idx[:, None] if single else idx[:, :, None]
  g = hq // hkv
  pos = kv_offset + np.arange(s)
  sel = (idx[..., None] == pos) & (idx[..., None] >= 0)       # [B, T|1, Hi, K, S]
  sel = sel.any(axis=3)                                       # [B, T|1, Hi, S]
  sel = np.repeat(sel, g, axis=2) if sel.shape[2] > 1 else sel
  return np.broadcast_to(sel, (b, t, hq, s))


def random_indices(seed, shape, s, *, dup=True):
  """Positions in [-1, S + 3): -1 (none), out of the cache, and (``dup``) repeats."""
  r = np.random.default_rng(seed)
  idx = r.integers(-1, s + 3, size=shape)
  if dup:
    idx[..., 1] = idx[..., 0]
  return idx.astype(np.int32)
