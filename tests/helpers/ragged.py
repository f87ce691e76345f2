"""Ragged steps (`fdecode.ragged_decode`): random packed batches, the per-sequence float32
reference oracle and its check, a spy on the Triton step's part calls."""

import jax.numpy as jnp
import numpy as np

import fdecode
from helpers import assert_close, tol


def batch(seed, q_lens, kv_lens, *, max_seqs, hq=4, hkv=2, d=32, page_size=16, pad_rows=3,
          paged=True, layout="HND", dtype=jnp.float32, spare_pages=3):
  """A ragged step: q [N, Hq, D], caches in ``layout``, tables, cu_q_lens; the first
  ``len(q_lens)`` sequences are live."""
  rng = np.random.default_rng(seed)
  ns = len(q_lens)
  cu = np.zeros(max_seqs + 1, np.int32)
  cu[1:ns + 1] = np.cumsum(q_lens)
  cu[ns + 1:] = cu[ns]
  lens = np.zeros(max_seqs, np.int32)
  lens[:ns] = kv_lens
  n = -(-max(max(kv_lens), 1) // page_size)
  num_pages = max_seqs * n + spare_pages
  tables = rng.permutation(num_pages)[:max_seqs * n].reshape(max_seqs, n).astype(np.int32)
  q = rng.standard_normal((int(cu[ns]) + pad_rows, hq, d)).astype(np.float32)
  k = rng.standard_normal((hkv, num_pages, page_size, d)).astype(np.float32)
  v = rng.standard_normal((hkv, num_pages, page_size, d)).astype(np.float32)
  if not paged:  # each sequence's pages laid out in a row
    k = np.stack([k[:, tables[b]].reshape(hkv, n * page_size, d) for b in range(max_seqs)])
    v = np.stack([v[:, tables[b]].reshape(hkv, n * page_size, d) for b in range(max_seqs)])
    tables = None
  if layout == "NHD":
    k, v = (x.transpose(1, 2, 0, 3) if paged else x.swapaxes(1, 2) for x in (k, v))
  cast = lambda x: jnp.asarray(x).astype(dtype)
  return dict(q=cast(q), k=cast(k), v=cast(v), kv_lens=lens, block_tables=tables, cu_q_lens=cu,
              num_seqs=ns)


def head_major(x, layout, paged):
  if layout == "HND":
    return x
  return x.transpose(2, 0, 1, 3) if paged else x.swapaxes(1, 2)


def per_sequence(p, layout="HND", per_row=None, **opts):
  """The oracle: each live sequence alone through the float32 reference, T = q_len.
  Rows and caches are sliced on the host (numpy): an eager slice of a jax array compiles
  one XLA program per shape. Returns numpy ``(out, lse)`` of the live rows."""
  paged = p["block_tables"] is not None
  k, v = (np.asarray(head_major(x, layout, paged)) for x in (p["k"], p["v"]))
  q, cu, outs, lses = np.asarray(p["q"]), p["cu_q_lens"], [], []
  per_row = {n: np.asarray(x) for n, x in (per_row or {}).items()}
  for i in range(p["num_seqs"]):
    lo, hi = int(cu[i]), int(cu[i + 1])
    if hi == lo:
      continue
    extra = {n: x[lo:hi][None] for n, x in per_row.items()}
    cache = dict(block_tables=np.asarray(p["block_tables"])[i:i + 1]) if paged else {}
    ki, vi = (k, v) if paged else (k[i:i + 1], v[i:i + 1])
    o, l = fdecode.flash_decode(q[lo:hi][None], ki, vi, np.asarray(p["kv_lens"])[i:i + 1], impl="reference",
                                return_lse=True, **cache, **extra, **opts)
    outs.append(np.asarray(o)[0])
    lses.append(np.asarray(l)[0])
  return np.concatenate(outs), np.concatenate(lses)


def check(p, out, lse, expected, dtype=jnp.float32):
  live = int(p["cu_q_lens"][p["num_seqs"]])
  t = tol(dtype)
  out, lse = np.asarray(out), np.asarray(lse)
  assert_close(out[:live], expected[0], atol=t["atol"], rtol=t["rtol"])
  assert_close(lse[:live], expected[1], atol=t["lse"], rtol=t["lse"], what="lse")
  np.testing.assert_array_equal(out[live:].astype(np.float32), 0)  # padding rows
  assert np.isneginf(lse[live:]).all()


def spy_step(monkeypatch):
  """Counts the Triton step's part calls (its plans: `fdecode.kernels.triton.ragged_step.plan_view`)."""
  import fdecode.kernels.triton.ragged_step as step_module
  calls = []
  real = step_module.plan_view
  monkeypatch.setattr(step_module, "plan_view", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
  return calls
