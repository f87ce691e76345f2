"""Random ragged steps with traced, unchecked geometry (offsets decreasing, negative and past N,
kv lengths past S, ``num_seqs`` past M) for the Triton step's derived geometry."""

import numpy as np


M, N, HQ, HKV, D, PS, PAGES_PER_SEQ = 5, 24, 4, 2, 16, 4, 6
S = PS * PAGES_PER_SEQ


def step(seed, paged, layout, hq=HQ, hkv=HKV):
  rng = np.random.default_rng(seed)
  cu = np.sort(rng.integers(-3, N + 4, M + 1)).astype(np.int32)
  swaps = rng.choice(M + 1, 2, replace=False)
  cu[swaps] = rng.integers(-3, N + 4, 2)  # non-monotone, out of range
  kv = rng.integers(-2, S + 6, M).astype(np.int32)
  ns = np.array([rng.integers(0, M + 2)], np.int32)
  pool = M * PAGES_PER_SEQ + 2
  tables = rng.permutation(pool)[:M * PAGES_PER_SEQ].reshape(M, PAGES_PER_SEQ).astype(np.int32)
  shape = (hkv, pool, PS, D) if paged else (M, hkv, S, D)
  k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
  if layout == "NHD":
    k, v = (x.transpose(1, 2, 0, 3) if paged else x.swapaxes(1, 2) for x in (k, v))
  q = rng.standard_normal((N, hq, D)).astype(np.float32)
  new_k, new_v = (rng.standard_normal((N, hkv, D)).astype(np.float32) for _ in range(2))
  return dict(q=q, k=k, v=v, kv_lens=kv, block_tables=tables if paged else None, cu_q_lens=cu, num_seqs=ns), \
      (new_k, new_v)
