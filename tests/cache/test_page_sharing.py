"""PageAllocator reference counts, forks and copy-on-write; copy_pages on device pools."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fdecode.cache import (PageAllocator, PoolExhaustedError, UnknownSequenceError, copy_pages,
                           write_paged)
from helpers import randn


def _snapshot(alloc):
  return copy.deepcopy((alloc._free, alloc._refs, alloc._pages, alloc._tokens))  # pylint: disable=protected-access


def _check(alloc, shadow, pool):
  """The invariants, from the public API (plus the free list), and the shadow contents:
  every live sequence reads back exactly the tokens written into it."""
  alloc.check_invariants()
  free = alloc._free  # pylint: disable=protected-access
  assert len(free) == len(set(free)) == alloc.num_free, "a page is free twice"
  held = {}
  for sid in shadow:
    for p in alloc.pages(sid):
      held[p] = held.get(p, 0) + 1
  assert not set(free) & set(held), "a page is both free and referenced"
  assert alloc.num_free + len(held) == alloc.num_pages
  for p in range(alloc.num_pages):
    assert alloc.ref_count(p) == held.get(p, 0), f"page {p}"
  assert sorted(alloc.seq_ids, key=str) == sorted(shadow, key=str)
  for sid, (tokens, written) in shadow.items():
    pages = alloc.pages(sid)
    assert alloc.num_tokens(sid) == tokens and len(pages) == -(-tokens // alloc.page_size)
    for pos, value in written.items():
      assert pool[pages[pos // alloc.page_size], pos % alloc.page_size] == value, (sid, pos)


def test_allocator_random_operations_keep_the_invariants():
  """Random allocate / extend / fork / write (COW) / free and failing calls on a small
  pool; a host array stands in for the device pool, so a write that leaked into a
  sharing sequence would read back wrong."""
  rng = np.random.default_rng(0)
  ps, num_pages, width = 4, 32, 6
  alloc = PageAllocator(num_pages, ps, width)
  pool = np.full((num_pages, ps), -1)
  shadow = {}  # sid -> (tokens, {position: value written})
  next_id, value = 0, 0
  for _ in range(1500):
    op = rng.choice(["allocate", "extend", "fork", "write", "free", "fail"],
                    p=[0.12, 0.08, 0.2, 0.35, 0.2, 0.05])
    sid = list(shadow)[rng.integers(len(shadow))] if shadow else None
    before = _snapshot(alloc)
    if op == "allocate" or sid is None:
      n = int(rng.integers(0, ps * width // 2 + 1))
      try:
        alloc.allocate(next_id, n)
        shadow[next_id] = (n, {})
      except PoolExhaustedError:
        assert -(-n // ps) > alloc.num_free and _snapshot(alloc) == before
      next_id += 1
    elif op == "extend":
      n = int(rng.integers(0, ps * width + 1))
      try:
        alloc.extend(sid, n)
        shadow[sid] = (max(n, shadow[sid][0]), shadow[sid][1])
      except PoolExhaustedError:
        assert _snapshot(alloc) == before
    elif op == "fork":
      child = next_id
      next_id += 1
      assert alloc.fork(sid, child) == alloc.pages(sid)
      shadow[child] = (shadow[sid][0], dict(shadow[sid][1]))
    elif op == "write":
      start = int(rng.integers(0, ps * width))
      count = int(rng.integers(0, min(2 * ps, ps * width - start) + 1))
      try:
        copies = alloc.prepare_write(sid, start, count)
      except PoolExhaustedError:
        assert _snapshot(alloc) == before
        continue
      if copies:
        src, dst = map(list, zip(*copies))
        pool[dst] = pool[src]
      pages = alloc.pages(sid)
      for pos in range(start, start + count):
        assert alloc.ref_count(pages[pos // ps]) == 1, "writing into a shared page"
        pool[pages[pos // ps], pos % ps] = value
        shadow[sid][1][pos] = value
        value += 1
      shadow[sid] = (max(shadow[sid][0], start + count), shadow[sid][1])
    elif op == "free":
      alloc.free(sid)
      del shadow[sid]
    else:  # failing calls change nothing
      for call, exc in ((lambda: alloc.fork("nope", "x"), UnknownSequenceError),
                        (lambda: alloc.fork(sid, sid), ValueError),
                        (lambda: alloc.prepare_write("nope", 0, 1), KeyError),
                        (lambda: alloc.free("nope"), ValueError),
                        (lambda: alloc.extend(sid, ps * width + 1), ValueError),
                        (lambda: alloc.allocate("big", ps * (alloc.num_free + 1)),
                         PoolExhaustedError if alloc.num_free < width else ValueError)):
        with pytest.raises(exc):
          call()
        assert _snapshot(alloc) == before
    _check(alloc, shadow, pool)
  for sid in list(shadow):
    alloc.free(sid)
    del shadow[sid]
    _check(alloc, shadow, pool)
  assert alloc.num_free == num_pages and alloc.seq_ids == []


def test_fork_shares_and_copy_on_write_copies_only_touched_shared_pages():
  alloc = PageAllocator(8, 4, 4)
  assert alloc.allocate("p", 10) == [0, 1, 2]
  assert alloc.fork("p", "c") == [0, 1, 2] and alloc.num_tokens("c") == 10
  assert [alloc.ref_count(p) for p in range(4)] == [2, 2, 2, 0] and alloc.num_free == 5
  assert alloc.prepare_write("c", 10, 3) == [(2, 3)]  # page 2 shared: copied; 12 fits in 3 pages
  assert alloc.pages("c") == [0, 1, 3, 4] and alloc.pages("p") == [0, 1, 2]
  assert alloc.prepare_write("p", 10, 1) == []  # page 2 is p's alone now
  assert alloc.prepare_write("c", 0, 8) == [(0, 5), (1, 6)]
  assert [alloc.ref_count(p) for p in range(8)] == [1, 1, 1, 1, 1, 1, 1, 0]
  alloc.free("p")
  assert alloc.num_free == 4 and alloc.ref_count(0) == 0
  alloc.fork("c", "d")
  alloc.free("c")  # d keeps the pages alive
  assert alloc.num_free == 4 and alloc.pages("d") == [5, 6, 3, 4]
  alloc.free("d")
  assert alloc.num_free == 8
  alloc.check_invariants()


def test_prepare_write_pool_exhausted_changes_nothing():
  alloc = PageAllocator(5, 4, 4)
  alloc.allocate("p", 8)
  alloc.fork("p", "c")
  alloc.allocate("x", 8)  # 1 free page left
  before = _snapshot(alloc)
  # Writing tokens 4..9 needs a copy of shared page 1 and a new page 2: two pages, one free.
  with pytest.raises(PoolExhaustedError, match=r"needs 2 more pages \(1 of them copies"):
    alloc.prepare_write("c", 4, 6)
  assert _snapshot(alloc) == before
  with pytest.raises(ValueError, match="more pages"):  # PoolExhaustedError is a ValueError too
    alloc.allocate("y", 8)
  assert _snapshot(alloc) == before
  assert alloc.prepare_write("c", 4, 1) == [(1, 4)]  # the copy alone fits
  alloc.check_invariants()


@pytest.mark.parametrize("call,exc,pattern", [
    (lambda a: a.fork("nope", "c"), ValueError, r"fork: unknown sequence 'nope'"),
    (lambda a: a.fork("nope", "c"), KeyError, r"unknown sequence 'nope'"),
    (lambda a: a.fork("a", "b"), ValueError, r"fork: sequence 'b' is already allocated"),
    (lambda a: a.fork("a", "a"), ValueError, r"'a' is already allocated"),
    (lambda a: a.fork("a", ["c"]), ValueError, r"seq_id must be hashable"),
    (lambda a: a.prepare_write("nope", 0, 1), UnknownSequenceError, r"unknown sequence 'nope'"),
    (lambda a: a.prepare_write("a", -1, 1), ValueError, r"start and num_tokens must be >= 0"),
    (lambda a: a.prepare_write("a", 0, 1.0), ValueError, r"num_tokens must be an int"),
    (lambda a: a.prepare_write("a", 15, 2), ValueError, r"17 tokens need more than max_pages_per_seq=4"),
    (lambda a: a.prepare_write("b", 0, 16), PoolExhaustedError, r"needs 4 more pages"),
    (lambda a: a.ref_count(6), ValueError, r"page must lie in \[0, 6\)"),
    (lambda a: a.num_tokens("nope"), KeyError, r"unknown sequence"),
])
def test_sharing_calls_that_fail_change_nothing(call, exc, pattern):
  alloc = PageAllocator(num_pages=6, page_size=4, max_pages_per_seq=4)
  alloc.allocate("a", 9)
  alloc.allocate("b", 0)
  before = _snapshot(alloc)
  with pytest.raises(exc, match=pattern):
    call(alloc)
  assert _snapshot(alloc) == before


def test_error_classes():
  assert issubclass(UnknownSequenceError, KeyError) and issubclass(UnknownSequenceError, ValueError)
  assert issubclass(PoolExhaustedError, RuntimeError) and issubclass(PoolExhaustedError, ValueError)
  with pytest.raises(UnknownSequenceError) as info:
    PageAllocator(2, 2, 2).free("x")
  assert str(info.value) == "PageAllocator.lookup: unknown sequence 'x'"  # not quoted like a KeyError


# --- copy_pages -------------------------------------------------------------------------------


def _pools(dtype=jnp.float32, hkv=2, pages=6, ps=4, d=8):
  k = randn(0, (hkv, pages, ps, d), dtype)
  v = randn(1, (hkv, pages, ps, d + 8), dtype)
  return k, v


def test_copy_pages_copies_whole_pages_reading_before_writing():
  k, v = _pools()
  k2, v2 = jax.jit(copy_pages, donate_argnums=(0, 1))(k.copy(), v.copy(), jnp.array([1, 4, 2, 0]),
                                                       jnp.array([4, 1, -1, 5]))
  want = np.arange(6)
  want[[4, 1, 5]] = [1, 4, 0]  # a swap 1 <-> 4 reads the old pages; dst -1 is skipped
  np.testing.assert_array_equal(k2, k[:, want])
  np.testing.assert_array_equal(v2, v[:, want])


def test_copy_pages_copies_per_token_scales_only():
  k, v = _pools()
  kq, vq = (x.astype(jnp.int8) for x in (k * 10, v * 10))
  k_scale = jax.random.uniform(jax.random.key(2), (2, 6, 4, 1))  # per token: rows copied
  v_scale = jnp.full((2, 1, 1, 1), 0.5)  # per head: unchanged
  out = copy_pages(kq, vq, [3], [5], k_scale=k_scale, v_scale=v_scale)
  assert len(out) == 4
  np.testing.assert_array_equal(out[0][:, 5], kq[:, 3])
  np.testing.assert_array_equal(out[1][:, 5], vq[:, 3])
  np.testing.assert_array_equal(out[2][:, 5], k_scale[:, 3])
  np.testing.assert_array_equal(out[2][:, :5], k_scale[:, :5])
  assert out[3] is v_scale


def test_copy_then_write_leaves_the_shared_page_intact():
  """A fork writes after copy-on-write; the parent's page still holds the old tokens."""
  alloc = PageAllocator(6, 4, 3)
  k, v = jnp.zeros((1, 6, 4, 2)), jnp.zeros((1, 6, 4, 2))
  alloc.allocate("p", 3)
  k, v = write_paged(k, v, alloc.block_table(["p"]), jnp.array([0]), jnp.ones((1, 1, 3, 2)),
                     jnp.ones((1, 1, 3, 2)))
  alloc.fork("p", "c")
  (src, dst), = alloc.prepare_write("c", 3, 1)
  k, v = copy_pages(k, v, [src], [dst])
  k, v = write_paged(k, v, alloc.block_table(["c"]), jnp.array([3]), jnp.full((1, 1, 1, 2), 7.0),
                     jnp.full((1, 1, 1, 2), 7.0))
  np.testing.assert_array_equal(k[0, src, :, 0], [1, 1, 1, 0])
  np.testing.assert_array_equal(k[0, dst, :, 0], [1, 1, 1, 7])


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(k=np.zeros((2, 6, 4))), r"k_pages and v_pages must be \[Hkv, P, page_size, D\]"),
    (dict(v=np.zeros((2, 5, 4, 16))), r"same \[Hkv, P, page_size\]; got k_pages.shape=\(2, 6, 4, 8\)"),
    (dict(src=[[1]], dst=[[2]]), r"src and dst must be int \[C\] of the same shape"),
    (dict(src=[1, 2], dst=[3]), r"src.shape=\(2,\), dst.shape=\(1,\)"),
    (dict(src=np.array([1.0]), dst=np.array([2])), r"src must be integer"),
    (dict(src=[6], dst=[2]), r"src ids must lie in \[0, P=6\)"),
    (dict(src=[1], dst=[6]), r"dst ids must lie in \[0, P=6\)"),
    (dict(src=[1, 2], dst=[3, 3]), r"dst ids must be distinct"),
    (dict(k_scale=jnp.ones((2, 6, 4, 1))), r"k_scale given but k_pages is not quantized"),
    (dict(int8=True), r"k_pages has dtype int8; pass k_scale"),
    (dict(int8=True, k_scale=jnp.ones((2, 6, 4, 3)), v_scale=1.0), r"k_scale must be a scalar or shaped"),
])
def test_copy_pages_rejects(kwargs, pattern):
  k, v = _pools()
  if kwargs.pop("int8", False):
    k, v = k.astype(jnp.int8), v.astype(jnp.int8)
  args = dict(k=k, v=v, src=[1], dst=[2])
  args.update(kwargs)
  scales = {name: args.pop(name) for name in ("k_scale", "v_scale") if name in args}
  with pytest.raises(ValueError, match=pattern):
    copy_pages(args["k"], args["v"], args["src"], args["dst"], **scales)
