"""`fdecode.ragged_decode` under bad input (issue 32): float page tables, aliased pages
(one page written for two live sequences, or listed twice by one), a traced
``cu_q_lens[0] > 0`` that must not write over a cached token, and no sequence at all."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from helpers import assert_close, tol, tpu_interpret
from helpers.ragged import batch, per_sequence


def _step(**over):
  """A small paged step: 3 live sequences of q_len 5, 1, 2 (kv_lens 9, 3, 2), page size 4."""
  p = batch(12, [5, 1, 2], [9, 3, 2], max_seqs=3, hq=4, hkv=2, d=16, page_size=4)
  return dict(p, **over)


def _new(p, value=1.0):
  n = p["q"].shape[0]
  return dict(new_k=jnp.full((n, 2, 16), value, jnp.float32), new_v=jnp.full((n, 2, 16), -value, jnp.float32))


@pytest.mark.parametrize("bad", [2.7, np.nan, np.inf], ids=["2.7", "nan", "inf"])
def test_float_block_tables_are_rejected(bad):
  """A float table used to be truncated (2.7 read page 2; NaN page 0; inf raised
  OverflowError while the message was built); flash_decode already rejects one."""
  p = _step()
  tables = np.asarray(p["block_tables"]).astype(np.float32)
  tables[0, 0] = bad
  for t in (tables, tables.tolist()):
    with pytest.raises(ValueError, match=r"ragged_decode: block_tables must be integer, got block_tables.dtype=float"):
      fdecode.ragged_decode(**dict(p, block_tables=t))


def test_a_written_page_two_live_sequences_hold_is_rejected():
  """A forked prefix without copy-on-write: both sequences' tables name page 1, and both
  write their new token into it. Sequence 0 would attend to sequence 1's key."""
  p = batch(1, [1, 1], [3, 3], max_seqs=2, hq=4, hkv=2, d=16, page_size=4)
  shared = np.array([[1], [1]], np.int32)
  k_before = np.array(p["k"])
  with pytest.raises(ValueError, match=r"sequence 0 writes its new tokens into page 1 \(block_tables\[0, 0\]\), "
                                       r"which sequence 1 also holds \(block_tables\[1, 0\]\).*prepare_write"):
    fdecode.ragged_decode(**dict(p, block_tables=shared), **_new(p))
  np.testing.assert_array_equal(np.asarray(p["k"]), k_before)
  # Without the fused write nothing is written: two sequences may read one page.
  out = fdecode.ragged_decode(**dict(p, block_tables=shared))
  assert_close(out[:2], per_sequence(dict(p, block_tables=shared))[0], **_f32())


def test_a_page_listed_twice_for_live_tokens_is_rejected():
  """[[2, 2]] for 6 live tokens of page size 4: positions 0-3 and 4-5 would share slots."""
  p = batch(2, [2], [6], max_seqs=1, hq=4, hkv=2, d=16, page_size=4)
  twice = np.array([[2, 2]], np.int32)
  for extra in ({}, _new(p)):
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = block_tables\[0, 1\] = 2: sequence 0 "
                                         r"\(length 6\) lists page 2 twice"):
      fdecode.ragged_decode(**dict(p, block_tables=twice), **extra)
  # A column past the length is never read: it may repeat a page.
  fdecode.ragged_decode(**dict(p, kv_lens=np.array([4], np.int32), cu_q_lens=np.array([0, 2], np.int32),
                               block_tables=twice))


def test_shared_prefix_pages_read_and_private_pages_written_are_accepted():
  """Forked sequences share their full prefix pages (read only) and write their new tokens
  into private pages; a window's freed page (wholly before every query's window) may be
  another sequence's written page. Both are accepted and equal write-then-attend."""
  p = batch(3, [1, 2], [9, 10], max_seqs=2, hq=4, hkv=2, d=16, page_size=4, spare_pages=4)
  tables = np.array([[0, 1, 2], [0, 1, 3]], np.int32)  # pages 0, 1: the shared prefix
  out, k, v = fdecode.ragged_decode(**dict(p, block_tables=tables), **_new(p))
  expected = fdecode.ragged_decode(**dict(p, block_tables=tables, k=k, v=v))
  assert_close(out[:3], expected[:3], **_f32())
  windowed = np.array([[0, 1, 2], [4, 5, 0]], np.int32)  # sequence 1 freed page 0 (window 2)
  fdecode.ragged_decode(**dict(p, block_tables=windowed), window=2, **_new(p))
  with pytest.raises(ValueError, match="writes its new tokens into page 0"):
    fdecode.ragged_decode(**dict(p, block_tables=windowed), window=6, **_new(p))


def test_traced_cu_q_lens_offset_never_writes_over_a_cached_token():
  """Under jit a traced cu_q_lens[0] = 1 leaves row 0 to no sequence. It used to write its
  key into sequence 0's cache at position kv_len - q_len - 1, destroying a cached token.
  Now rows write only at their own sequence's new positions: every slot that changes is
  one of them, and row 0 gives out 0, lse -inf."""
  p = _step()
  n = p["q"].shape[0]
  new = dict(new_k=jnp.asarray(np.arange(n, dtype=np.float32)[:, None, None] + 1.0) * jnp.ones((n, 2, 16)),
             new_v=jnp.ones((n, 2, 16)))
  step = jax.jit(lambda cu: fdecode.ragged_decode(**dict(p, cu_q_lens=cu), **new, return_lse=True))
  cu = np.array([1, 5, 6, 8], np.int32)
  out, lse, k, _ = step(cu)
  tables, ps, lens = np.asarray(p["block_tables"]), 4, p["kv_lens"]
  own = set()  # (page, slot) of every new position a row of a live sequence owns
  for i in range(3):
    q_len = int(cu[i + 1] - cu[i])
    for pos in range(int(lens[i]) - q_len, int(lens[i])):
      own.add((int(tables[i, pos // ps]), pos % ps))
  before, after = np.asarray(p["k"]), np.asarray(k)
  changed = {(int(a), int(b)) for a, b in zip(*np.nonzero((before != after).any(axis=(0, 3))))}
  assert changed <= own, f"wrote outside the new tokens' positions: {sorted(changed - own)}"
  cached = (int(tables[0, 4 // ps]), 4 % ps)  # sequence 0's position 4 = 9 - 4 - 1: cached
  np.testing.assert_array_equal(after[:, cached[0], cached[1]], before[:, cached[0], cached[1]])
  np.testing.assert_array_equal(after[0, tables[0, 1], 1:4, 0], [2.0, 3.0, 4.0])  # rows 1-3: positions 5-7
  assert (np.asarray(out[0]) == 0).all() and np.isneginf(np.asarray(lse[0])).all()


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_no_sequence_at_all(paged, jit):
  """max_seqs = 0 (kv_lens [], cu_q_lens [0], num_seqs 0) used to end in JAX's internal
  "Slice size ... in gather op is out of range": now out 0, lse -inf, caches unchanged."""
  p = batch(4, [1], [5], max_seqs=1, hq=4, hkv=2, d=16, page_size=4, pad_rows=0, paged=paged)
  k = p["k"] if paged else p["k"][:0]
  v = p["v"] if paged else p["v"][:0]
  args = dict(q=p["q"], k=k, v=v, kv_lens=np.zeros(0, np.int32),
              block_tables=np.zeros((0, 2), np.int32) if paged else None, cu_q_lens=np.array([0], np.int32),
              num_seqs=0)
  call = lambda: fdecode.ragged_decode(**args, **_new(p), return_lse=True)
  out, lse, k2, v2 = jax.jit(call)() if jit else call()
  assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
  np.testing.assert_array_equal(np.asarray(k2), np.asarray(k))
  np.testing.assert_array_equal(np.asarray(v2), np.asarray(v))


def _f32():
  t = tol(jnp.float32)
  return dict(atol=t["atol"], rtol=t["rtol"])


@pytest.mark.parametrize("impl", ["xla", "pallas", "mosaic", "reference"])
def test_visible_nan_value_gives_whole_rows_on_every_impl(impl):
  """A NaN value a row sees: its decode row gave one NaN column and a finite lse while its
  prefill rows (and impl="reference") gave the whole row and a NaN lse. Now every row
  that sees it is NaN in every column and in its lse, on every impl; padding stays 0."""
  p = batch(8, [5, 1], [9, 12], max_seqs=2, d=32)
  v = np.array(p["v"])
  tables = p["block_tables"]
  v[0, tables[0, 0], 2, 7] = np.nan   # sequence 0, position 2: all 5 prefill rows see it
  v[1, tables[1, 0], 3, 0] = np.nan   # sequence 1, position 3: its decode row sees it
  ctx = tpu_interpret() if impl == "mosaic" else contextlib.nullcontext()
  with ctx:
    out, lse = fdecode.ragged_decode(**dict(p, v=jnp.asarray(v)), impl="pallas" if impl == "mosaic" else impl,
                                     return_lse=True)
  out, lse = np.asarray(out), np.asarray(lse)
  hq, g = out.shape[1], 2  # kv head 0 serves query heads 0, 1; kv head 1 heads 2, 3
  assert np.isnan(out[:5, :g]).all() and np.isnan(lse[:5, :g]).all()
  assert np.isnan(out[5, g:]).all() and np.isnan(lse[5, g:]).all()
  assert np.isfinite(out[:5, g:]).all() and np.isfinite(lse[:5, g:]).all()
  assert np.isfinite(out[5, :g]).all() and np.isfinite(lse[5, :g]).all()
  assert (out[6:] == 0).all() and np.isneginf(lse[6:]).all() and hq == 4


@pytest.mark.parametrize("m", [5, 1100], ids=["pairs", "cumsum"])
def test_row_positions_clip_traced_geometry(m):
  """`row_positions` on traced, unchecked geometry (cu_q_lens decreasing, negative, past
  N; kv_lens past S; num_seqs past M) against its docstring in numpy: each sequence keeps
  its clipped count where positive, counted on from the clipped cu[0] and capped at N
  (for short batches summed over all pairs, past ~1M pairs by ``lax.cumsum``), and each
  owned row's position one of its sequence's new ones."""
  from fdecode.ragged.decode import row_positions
  rng = np.random.default_rng(m)
  n, cap = 3 * m, 64
  fn = jax.jit(lambda kv, cu, ns: row_positions(kv, cu, ns, n, cap))
  for trial in range(3):
    cu_in = np.sort(rng.integers(-5, n + 5, m + 1)).astype(np.int32)
    swaps = rng.choice(m + 1, (m + 1) // 3)
    cu_in[swaps] = rng.integers(-5, n + 5, swaps.shape[0])  # non-monotone, out of range
    kv = rng.integers(-3, cap + 10, m).astype(np.int32)
    ns = np.array([rng.integers(0, m + 2)], np.int32)
    got = [np.asarray(x) for x in fn(kv, cu_in, ns)]
    clipped = np.clip(cu_in, 0, n)
    cu = np.minimum(clipped[0] + np.concatenate([[0], np.cumsum(np.maximum(np.diff(clipped), 0))]), n)
    live = np.arange(m) < min(int(ns[0]), m)
    lens = np.where(live, np.clip(kv, 0, cap), 0)
    q_len = np.where(live, np.diff(cu), 0)
    rows = np.arange(n)
    seq = np.clip(np.searchsorted(cu[1:], rows, side="right"), 0, m - 1)
    owned = (rows >= cu[0]) & (rows < cu[min(int(ns[0]), m)])
    pos = np.where(owned, lens[seq] - q_len[seq] + rows - cu[seq], -1)
    for name, g, want in zip(("cu", "lens", "q_len", "seq", "pos"), got, (cu, lens, q_len, seq, pos)):
      np.testing.assert_array_equal(g, want, f"trial {trial}: {name}")
