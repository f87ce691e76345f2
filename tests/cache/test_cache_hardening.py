"""Bad calls to the cache writes and to PageAllocator: a clear ValueError, nothing changed."""

import copy
import re

import jax.numpy as jnp
import numpy as np
import pytest

from fdecode.cache import PageAllocator, PoolExhaustedError, write_contiguous, write_paged

B, HKV, S, D, PS, P = 2, 2, 8, 4, 4, 6


def _contiguous(**over):
  a = dict(k=jnp.zeros((B, HKV, S, D)), v=jnp.zeros((B, HKV, S, D)),
           k_new=jnp.ones((B, HKV, 1, D)), v_new=jnp.ones((B, HKV, 1, D)),
           positions=jnp.array([0, 3], jnp.int32))
  a.update(over)
  return a


def _paged(**over):
  a = dict(k_pages=jnp.zeros((HKV, P, PS, D)), v_pages=jnp.zeros((HKV, P, PS, D)),
           block_tables=jnp.array([[0, 1], [2, 3]], jnp.int32), positions=jnp.array([0, 3], jnp.int32),
           k_new=jnp.ones((B, HKV, 1, D)), v_new=jnp.ones((B, HKV, 1, D)))
  a.update(over)
  return a


def _call(fn, args):
  """Calls ``fn``, expecting a ValueError; checks no input array changed; returns the message."""
  before = {n: np.asarray(x) for n, x in args.items() if x is not None and not isinstance(x, list)}
  with pytest.raises(ValueError) as err:
    fn(**args)
  for n, x in before.items():
    np.testing.assert_array_equal(np.asarray(args[n]), x, err_msg=f"{n} changed")
  return str(err.value)


I8 = jnp.zeros((B, HKV, S, D), jnp.int8)


@pytest.mark.parametrize("over,pattern", [
    (dict(k_new=jnp.ones((1, HKV, 1, D))), r"k_new must be \[B, Hkv, T, D\].*B=2.*k_new.shape=\(1, 2, 1, 4\)"),
    (dict(v_new=jnp.ones((B, 1, 1, D))), r"v_new must be .*Hkv=2.*v_new.shape=\(2, 1, 1, 4\)"),
    (dict(k_new=jnp.ones((B, HKV, D)), v_new=jnp.ones((B, HKV, 2, D))), r"v_new must be .*same T"),
    (dict(v_new=jnp.ones((B, HKV, 2, D))), r"v_new must be .*same T.*v_new.shape=\(2, 2, 2, 4\)"),
    (dict(k_new=jnp.ones((B, HKV, 1, D + 1))), r"k_new must be .*D=4"),
    (dict(k_new=jnp.ones((B, HKV, 1, D), jnp.int32)), r"k_new must be floating point, got k_new.dtype=int32"),
    (dict(positions=jnp.array([0], jnp.int32)), r"positions must be \[B\]=\(2,\); got .*positions.shape=\(1,\)"),
    (dict(positions=jnp.array([[0, 3]], jnp.int32)), r"positions.shape=\(1, 2\)"),
    (dict(positions=jnp.array([0.0, 3.0])), r"positions must be integer, got dtype float32"),
    (dict(v=jnp.zeros((B, HKV, S + 1, D))), r"k and v must have the same \[B, Hkv, S\]"),
    (dict(k=jnp.zeros((B, HKV, S))), r"k must be \[B, Hkv, S, Dk\]"),
    (dict(k=jnp.zeros((B, HKV, S, D), jnp.int32)), r"k must be floating point or int8/float8"),
    (dict(k=I8), r"k has dtype int8; pass k_scale"),
    (dict(k=I8, k_scale=jnp.ones((B, HKV, S, 3))), r"write_contiguous: k_scale must be a scalar or shaped"),
    (dict(v_scale=jnp.ones(())), r"v_scale given but v is not quantized"),
])
def test_write_contiguous_rejects(over, pattern):
  msg = _call(write_contiguous, _contiguous(**over))
  assert msg.startswith("write_contiguous: ")
  assert re.search(pattern, msg), msg


@pytest.mark.parametrize("over,pattern", [
    # The issue's case: a [1, n] table for a batch of 2 would write sequence 1 into sequence 0's pages.
    (dict(block_tables=jnp.array([[0, 1]], jnp.int32)),
     r"k_new must be .*B=1.*k_new.shape=\(2, 2, 1, 4\).*block_tables.shape=\(1, 2\)"),
    (dict(block_tables=jnp.array([[0.0, 1.0], [2.0, 3.0]])), r"block_tables must be integer, got dtype float32"),
    (dict(block_tables=jnp.array([0, 1], jnp.int32)), r"block_tables must be \[B, n\] with n >= 1"),
    (dict(block_tables=jnp.zeros((B, 0), jnp.int32)), r"block_tables must be \[B, n\] with n >= 1"),
    (dict(k_new=jnp.ones((1, HKV, 1, D)), v_new=jnp.ones((1, HKV, 1, D))), r"k_new must be .*B=2"),
    (dict(positions=jnp.array([1, 2, 3], jnp.int32)), r"positions must be \[B\]=\(2,\)"),
    (dict(positions=np.array([1.5, 2.0])), r"positions must be integer, got dtype float64"),
    (dict(v_pages=jnp.zeros((HKV, P + 1, PS, D))), r"k_pages and v_pages must have the same \[Hkv, P, page_size\]"),
    (dict(k_pages=jnp.zeros((HKV, P, PS, D), jnp.int8), k_scale=jnp.ones((HKV, P, 1, 1))),
     r"k_scale must be per tensor, per head or per token.*\(per page\)"),
    (dict(v_pages=jnp.zeros((HKV, P, PS, D), jnp.int8)), r"v_pages has dtype int8; pass v_scale"),
])
def test_write_paged_rejects(over, pattern):
  msg = _call(write_paged, _paged(**over))
  assert msg.startswith("write_paged: ")
  assert re.search(pattern, msg), msg


def test_writes_still_accept_good_calls():
  """Lists of ints, [B, Hkv, D] tokens and numpy int64 positions are valid."""
  k, v = write_contiguous(**_contiguous(k_new=jnp.ones((B, HKV, D)), v_new=jnp.ones((B, HKV, D)),
                                        positions=[0, 3]))
  np.testing.assert_array_equal(k[1, :, 3], 1.0)
  kp, _ = write_paged(**_paged(positions=np.array([5, 0]), block_tables=[[0, 1], [2, 3]]))
  np.testing.assert_array_equal(kp[:, 1, 1], 1.0)  # sequence 0, token 5: page 1, slot 1
  np.testing.assert_array_equal(kp[:, 2, 0], 1.0)


# --- PageAllocator ----------------------------------------------------------------------------


def _snapshot(alloc):
  return copy.deepcopy((alloc._free, alloc._pages, alloc._tokens, alloc.num_pages,  # pylint: disable=protected-access
                        alloc.page_size, alloc.max_pages_per_seq))


@pytest.mark.parametrize("call,exc,pattern", [
    (lambda a: a.allocate("c", -5), ValueError, r"allocate: num_tokens must be >= 0, got -5"),
    (lambda a: a.allocate("c", 4.0), ValueError, r"num_tokens must be an int, got 4.0"),
    (lambda a: a.allocate("c", "4"), ValueError, r"num_tokens must be an int"),
    (lambda a: a.allocate("c", None), ValueError, r"num_tokens must be an int"),
    (lambda a: a.allocate("c", True), ValueError, r"num_tokens must be an int"),
    (lambda a: a.allocate(["c"], 4), ValueError, r"seq_id must be hashable"),
    (lambda a: a.allocate("a", 4), ValueError, r"'a' is already allocated"),
    (lambda a: a.allocate("c", 17), ValueError, r"17 tokens need more than max_pages_per_seq=4"),
    (lambda a: a.allocate("c", 16), PoolExhaustedError, r"needs 4 more pages, 3 of 6 free"),
    (lambda a: a.extend("a", -1), ValueError, r"extend: num_tokens must be >= 0"),
    (lambda a: a.extend("a", 2.5), ValueError, r"num_tokens must be an int"),
    (lambda a: a.extend("a", 100), ValueError, r"need more than max_pages_per_seq"),
    (lambda a: a.extend("b", 16), PoolExhaustedError, r"needs 4 more pages"),
    (lambda a: a.extend("nope", 4), KeyError, r"unknown sequence 'nope'"),
    (lambda a: a.extend({}, 4), ValueError, r"seq_id must be hashable"),
    (lambda a: a.free("nope"), KeyError, r"unknown sequence"),
    (lambda a: a.free([1]), ValueError, r"seq_id must be hashable"),
    (lambda a: a.pages("nope"), KeyError, r"unknown sequence"),
    (lambda a: a.block_table("a"), ValueError, r"seq_ids must be a list of sequence ids, got 'a'"),
    (lambda a: a.block_table(["a", "a"]), ValueError, r"'a' is listed twice"),
    (lambda a: a.block_table(["a", "nope"]), KeyError, r"unknown sequence 'nope'"),
    (lambda a: a.block_table(3), ValueError, r"seq_ids must be a list"),
])
def test_allocator_failed_call_changes_nothing(call, exc, pattern):
  alloc = PageAllocator(num_pages=6, page_size=4, max_pages_per_seq=4)
  alloc.allocate("a", 9)  # 3 pages
  alloc.allocate("b", 0)  # registered, no pages yet
  before = _snapshot(alloc)
  with pytest.raises(exc, match=pattern):
    call(alloc)
  assert _snapshot(alloc) == before
  assert "c" not in alloc._pages  # pylint: disable=protected-access
  np.testing.assert_array_equal(alloc.block_table(["a", "b"]), [[0, 1, 2, -1], [-1] * 4])


@pytest.mark.parametrize("args,pattern", [
    ((0, 4, 4), "sizes must be positive"),
    ((4, -1, 4), "sizes must be positive"),
    ((4.0, 4, 4), "num_pages must be an int"),
    ((4, "4", 4), "page_size must be an int"),
    ((4, 4, None), "max_pages_per_seq must be an int"),
])
def test_allocator_constructor_rejects(args, pattern):
  with pytest.raises(ValueError, match=pattern):
    PageAllocator(*args)


def test_allocator_accepts_numpy_and_jax_ints():
  alloc = PageAllocator(np.int64(4), 4, 2)
  assert alloc.allocate("a", np.int32(5)) == [0, 1]
  assert alloc.extend("a", jnp.int32(3)) == [0, 1]  # fewer tokens than held: nothing changes
  assert alloc.allocate("b", 0) == [] and alloc.num_free == 2
