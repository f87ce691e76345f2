"""The Hopper GQA rows kernel over paged pools (`fdecode.kernels.mosaic_gpu.rows_decode`
with ``block_tables``) under jax's Mosaic GPU interpreter (CPU, race detection on),
against the float32 reference over the same pool and table.

Pools ``[Hkv, P, page_size, D]`` with shuffled page ids and spare pages; page sizes 8
and 16 (a block is 8 or 4 TMA copies onto one barrier; 8-bit scales gathered per call),
32 (4 copies, paged scales), 64 (one copy a block) and 128 (one copy at an offset in
the page). Every slot no live token owns (spare pages, pages past a length, a page's
tail) holds garbage (NaN, +-huge, extreme 8-bit codes, NaN / inf scales) and table
entries past a sequence's length hold ids far outside the pool; neither may fault or
leak. What the interpreter runs and does not is as in tests/kernels/mosaic_gpu/test_mosaic_gpu_rows.py.

Cost: 5 interpreted calls, 32 programs, about 30 s of CPU (most of it one compilation
of the kernel body per call, `helpers.mosaic_gpu.compiled_once`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from helpers import assert_close, tol
from fdecode.kernels import mosaic_gpu
from fdecode.kernels.common import chips
from fdecode.cache.quant import quantize
from fdecode.kernels.mosaic_gpu import rows_plan, rows_unsupported
from fdecode.kernels.mosaic_gpu.gqa.paging import block_pieces  # the paged-copy rule itself, not a public name

from helpers.mosaic_gpu import INTERPRET, assert_no_races, interpreter  # noqa: F401  (interpreter: a fixture)

GARBAGE_IDS = (2**30, -7, 2**31 - 1, -(2**31))


def paged_problem(seed, *, b, t, hq, hkv, n, ps, d, dtype=jnp.bfloat16, spare=3):
  """q bf16 [B, T, Hq, D]; pools k, v [Hkv, P, ps, D] (P = B * n + spare) in ``dtype``
  (8-bit: quantized per token, scales f32 [Hkv, P, ps, 1]); a shuffled table [B, n]."""
  rng = np.random.default_rng(seed)
  num_pages = b * n + spare
  q = jnp.asarray(rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((hkv, num_pages, ps, d)), jnp.float32) for _ in range(2))
  tables = jnp.asarray(rng.permutation(num_pages)[:b * n].reshape(b, n), jnp.int32)
  if dtype == jnp.bfloat16:
    return q, k.astype(dtype), v.astype(dtype), None, None, tables
  (k, ks), (v, vs) = quantize(k, dtype), quantize(v, dtype)
  return q, k, v, ks, vs, tables


def live_slots(tables, lengths, num_pages, ps):
  """bool [P, ps]: the pool slots that hold a live token of some sequence."""
  live = np.zeros((num_pages, ps), bool)
  for row, length in zip(np.asarray(tables), np.asarray(lengths)):
    for tok in range(int(length)):
      live[row[tok // ps], tok % ps] = True
  return live


def with_garbage(x, tables, lengths, value):
  """Pool ``x`` [Hkv, P, ps, ...] with ``value`` in every slot no live token owns."""
  live = jnp.asarray(live_slots(tables, lengths, x.shape[1], x.shape[2]))[None, :, :, None]
  return jnp.where(live, x, jnp.asarray(value, jnp.float32).astype(x.dtype))


def garbage_tables(tables, lengths, ps):
  """The table with ids far outside any pool in every entry past each length."""
  tables = np.array(tables)
  for i, length in enumerate(np.asarray(lengths)):
    for j in range(-(-int(length) // ps), tables.shape[1]):
      tables[i, j] = GARBAGE_IDS[(i + j) % len(GARBAGE_IDS)]
  return jnp.asarray(tables)


def slot(tables, seq, tok, ps):
  """(page, slot) of token ``tok`` of sequence ``seq``."""
  return int(tables[seq, tok // ps]), tok % ps


def reference(q, k, v, lengths, tables, ks=None, vs=None):
  return fdecode.flash_decode(q, k, v, lengths, block_tables=tables, k_scale=ks, v_scale=vs, impl="reference",
                              return_lse=True)


def run_kernel(q, k, v, lengths, tables, ks=None, vs=None, *, num_splits):
  out, lse = mosaic_gpu.rows_decode(q, k, v, lengths, block_tables=tables, k_scale=ks, v_scale=vs,
                                    num_splits=num_splits, return_lse=True, interpret=INTERPRET)
  assert_no_races()
  return out, lse


def check(out, lse, want_out, want_lse, sees=None):
  """out / lse against the reference; rows where ``sees`` [B, T] holds (a NaN they see):
  NaN in every column of out and in lse instead."""
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  want_out, want_lse = np.asarray(want_out, np.float32), np.asarray(want_lse)
  sees = np.zeros(out.shape[:-2], bool) if sees is None else sees
  t = tol(jnp.bfloat16)
  assert_close(out[~sees], want_out[~sees], atol=t["atol"], rtol=t["rtol"])
  assert_close(lse[~sees], want_lse[~sees], atol=t["lse"], rtol=t["lse"], what="lse")
  assert np.all(np.isnan(out[sees])) and np.all(np.isnan(lse[sees]))


@pytest.mark.usefixtures("interpreter")
def test_bf16_page8_lengths_garbage_and_a_nan_reaching_only_its_rows():
  """bf16, page_size 8 (a block is 8 page copies onto one barrier), T = 4 causal tokens
  x G = 16, D = 64, n = 17 (S = 136: the last block runs past the table's end), 2 splits.
  Lengths 0, 1, bk - 1, bk + 1, full. NaN keys and -huge values in every slot no live
  token owns; garbage ids past each length. A NaN value at token 63 of the bk + 1
  sequence reaches its tokens 2 and 3 (which see it) only; tokens 0-2 of the length-1
  sequence see nothing (0, -inf)."""
  ps = 8
  q, k, v, _, _, tables = paged_problem(0, b=5, t=4, hq=16, hkv=1, n=17, ps=ps, d=64)
  lengths = jnp.array([0, 1, 63, 65, 136], jnp.int32)
  want_out, want_lse = reference(q, k, v, lengths, tables)
  k_bad = with_garbage(k, tables, lengths, jnp.nan)
  v_bad = with_garbage(v, tables, lengths, -3e38).at[(0, *slot(tables, 3, 63, ps), 5)].set(jnp.nan)
  out, lse = run_kernel(q, k_bad, v_bad, lengths, garbage_tables(tables, lengths, ps), num_splits=2)
  sees = np.zeros((5, 4), bool)
  sees[3, 2:] = True
  check(out, lse, want_out, want_lse, sees)
  assert np.all(np.asarray(lse[0]) == -np.inf) and np.all(np.asarray(lse[1, :3]) == -np.inf)


@pytest.mark.usefixtures("interpreter")
def test_e4m3_page16_two_kv_heads_gathered_scales():
  """float8_e4m3fn pools with per-token scales, page_size 16 (4 copies a block; the
  scales, 64 bytes a page, are gathered per call), Hkv = 2 (each head reads its own
  pages of the pool), T = 1 x G = 16, D = 128, lengths bk and bk + 36, 2 splits. Extreme
  codes and NaN k / inf v scales where no live token is; garbage ids past the lengths."""
  ps = 16
  q, k, v, ks, vs, tables = paged_problem(1, b=2, t=1, hq=32, hkv=2, n=8, ps=ps, d=128, dtype=jnp.float8_e4m3fn)
  lengths = jnp.array([64, 100], jnp.int32)
  want_out, want_lse = reference(q, k, v, lengths, tables, ks, vs)
  bad = [with_garbage(x, tables, lengths, g) for x, g in ((k, 448.0), (v, -448.0), (ks, jnp.nan), (vs, jnp.inf))]
  out, lse = run_kernel(q, bad[0], bad[1], lengths, garbage_tables(tables, lengths, ps), bad[2], bad[3],
                        num_splits=2)
  check(out, lse, want_out, want_lse)


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("ps, t, n, lengths, splits", [
    (128, 4, 2, (256, 129), 3),  # one copy a block at offset 0 or 64 of a page
    (32, 1, 5, (97,), 2),        # 2 copies a block, scales copied from the paged scale pool
])
def test_int8_paged_scales(ps, t, n, lengths, splits):
  """int8 pools whose per-token scales are read in place from the paged scale pool
  (page_size >= 32), G = 16, D = 64: extreme codes and NaN k / inf v scales where no
  live token is, garbage ids past the lengths (a full sequence has none)."""
  q, k, v, ks, vs, tables = paged_problem(2, b=len(lengths), t=t, hq=16, hkv=1, n=n, ps=ps, d=64, dtype=jnp.int8)
  lengths = jnp.array(lengths, jnp.int32)
  want_out, want_lse = reference(q, k, v, lengths, tables, ks, vs)
  bad = [with_garbage(x, tables, lengths, g) for x, g in ((k, 127), (v, -127), (ks, jnp.nan), (vs, jnp.inf))]
  out, lse = run_kernel(q, bad[0], bad[1], lengths, garbage_tables(tables, lengths, ps), bad[2], bad[3],
                        num_splits=splits)
  check(out, lse, want_out, want_lse)


@pytest.mark.usefixtures("interpreter")
def test_page64_traced_table_clipped_and_visible_corruption_makes_whole_rows_nan():
  """bf16, page_size 64 (one copy a block), T = 1 x G = 16, under jit (the table traced,
  so its ids are not checked: a live id out of the pool is clipped into it, as the
  reference clips). Sequence 0 (full, its second page id P + 5: page P - 1) sees no
  corruption; sequence 1 sees a NaN value, sequence 2 (length 1) an inf value: every
  column of their rows' out and their lse are NaN. Garbage where no live token is."""
  ps = 64
  q, k, v, _, _, tables = paged_problem(3, b=3, t=1, hq=16, hkv=1, n=3, ps=ps, d=64, spare=1)
  num_pages = k.shape[1]
  spare = (set(range(num_pages)) - set(np.asarray(tables).ravel().tolist())).pop()
  tables = jnp.where(tables == num_pages - 1, spare, tables)  # page P - 1 unused: the clipped id's
  lengths = jnp.array([192, 64, 1], jnp.int32)
  tables = tables.at[0, 1].set(num_pages + 5)
  clipped = jnp.clip(tables, 0, num_pages - 1)
  want_out, want_lse = reference(q, k, v, lengths, clipped)
  keep = with_garbage(jnp.ones_like(k, jnp.float32), clipped, lengths, 0.0) > 0
  k_bad = jnp.where(keep, k, jnp.nan)
  v_bad = jnp.where(keep, v, 3e38).at[(0, *slot(clipped, 1, 10, ps), 3)].set(jnp.nan)
  v_bad = v_bad.at[(0, *slot(clipped, 2, 0, ps), 40)].set(jnp.inf)
  run = jax.jit(lambda tables: mosaic_gpu.rows_decode(q, k_bad, v_bad, lengths, block_tables=tables, num_splits=2,
                                                      return_lse=True, interpret=INTERPRET))
  out, lse = run(garbage_tables(tables, lengths, ps))
  assert_no_races()
  check(out, lse, want_out, want_lse, np.array([[0], [1], [1]], bool))


@pytest.mark.parametrize("ps", [8, 16, 32])
def test_pieces_past_the_length_never_use_their_own_entry(ps):
  """A block's later copies past the length copy its first (live) page again, whatever
  the table holds there; the table is never read past its end (S = 17 pages is not
  whole blocks); live copies take their entry clipped into the pool."""
  plan = rows_plan(batch=1, kv_heads=1, num_tokens=1, group=16, head_dim=64, seq_len=17 * 8 * (ps // 8),
                   softmax_scale=1.0, page_size=ps, gpu=chips.H100)
  n, num_pages = plan.pages, 50
  table = np.arange(n) % 40 + 3
  table[n // 2] = 99  # live somewhere: clipped to 49
  for length in range(1, n * ps + 1, 7):
    garbage = np.where(np.arange(n) < -(-length // ps), table, -(2**31))
    cols = []
    entry = lambda col: cols.append(int(col)) or jnp.int32(garbage[min(int(col), n - 1)])
    for start in range(0, length, plan.block):
      pieces = block_pieces(plan, entry, jnp.int32(start), jnp.int32(length), num_pages)
      for i, (page, offset) in enumerate(pieces):
        tok = start + i * plan.piece
        want = min(table[tok // ps], num_pages - 1) if tok < length else min(table[start // ps], num_pages - 1)
        assert int(page) == want and int(offset) == 0, (ps, length, start, i)
  assert 0 <= min(cols) and max(cols) == n - 1, "a table read outside [0, n)"


@pytest.mark.parametrize("ps, match", [(1, "page_size=1 is not a multiple of 8"),
                                       (4, "page_size=4 is not a multiple of 8"),
                                       (12, "not a multiple of 8"),
                                       (24, "neither divides nor is a multiple"),
                                       (96, "neither divides nor is a multiple")])
def test_refuses_page_sizes_a_tma_copy_cannot_take(ps, match):
  q, pool = jnp.zeros((2, 8, 64), jnp.bfloat16), jnp.zeros((2, 6, ps, 64), jnp.bfloat16)
  assert match in rows_unsupported(q_shape=q.shape, q_dtype=q.dtype, k_shape=pool.shape, k_dtype=pool.dtype,
                                   v_shape=pool.shape, v_dtype=pool.dtype, scales=False, paged=True)
  with pytest.raises(ValueError, match=match):
    mosaic_gpu.rows_decode(q, pool, pool, jnp.array([1, 2], jnp.int32), block_tables=jnp.zeros((2, 3), jnp.int32))


def test_refuses_bad_tables_and_lengths():
  q, pool = jnp.zeros((2, 8, 64), jnp.bfloat16), jnp.zeros((2, 6, 16, 64), jnp.bfloat16)
  tables = jnp.array([[0, 1, 2], [3, 4, 5]], jnp.int32)
  with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = 6 is out of range \[0, P=6\)"):
    mosaic_gpu.rows_decode(q, pool, pool, jnp.array([1, 17], jnp.int32), block_tables=tables.at[1, 1].set(6))
  with pytest.raises(ValueError, match="lengths must lie in"):
    mosaic_gpu.rows_decode(q, pool, pool, jnp.array([1, 49], jnp.int32), block_tables=tables)
  with pytest.raises(ValueError, match="block_tables must be integer"):
    mosaic_gpu.rows_decode(q, pool, pool, jnp.array([1, 2], jnp.int32), block_tables=tables[:1])


def test_plan_copies_per_page_size():
  """Copies a block takes and where 8-bit scales come from, per page size."""
  want = {8: (8, False), 16: (4, False), 32: (2, True), 64: (1, True), 128: (1, True), 256: (1, True)}
  for ps, (copies, scales_paged) in want.items():
    plan = rows_plan(batch=2, kv_heads=8, num_tokens=4, group=16, head_dim=128, seq_len=1024, softmax_scale=1.0,
                     cache_dtype="int8", page_size=ps, gpu=chips.H100)
    assert (plan.copies, plan.scales_paged, plan.pages, plan.cache_rows) == (copies, scales_paged, 1024 // ps, 1024)
    assert plan.smem_bytes() <= chips.H100.smem_per_block
  with pytest.raises(ValueError, match="not a multiple of 8"):
    rows_plan(batch=1, kv_heads=1, num_tokens=1, group=64, head_dim=64, seq_len=64, softmax_scale=1.0, page_size=2)
