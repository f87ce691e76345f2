"""The balanced schedule as the Triton kernels derive it, program by program
(`fdecode.kernels.triton.schedule.item_work` / `sequence_items`, run in Pallas'
interpreter with the kernels' own padded load), against `balanced_schedule` (XLA over
every item at once)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from fdecode.kernels.common.modifiers import Modifiers
from fdecode.kernels.triton import Schedule, balanced_schedule, item_work, load_ends, sequence_items


@functools.partial(jax.jit, static_argnames=("sched",))
def _derived(ends, sched: Schedule):
  """Each item's ``(seq, split, count, end)`` and each sequence's ``[first, last)``, one
  program each, as the split and combine kernels compute them."""
  def items_kernel(ends_ref, out_ref):
    seq, split, count, end = item_work(load_ends(ends_ref, sched), pl.program_id(0), sched)
    for col, x in enumerate((seq, split, count, end)):
      out_ref[0, col] = x

  def sequences_kernel(ends_ref, out_ref):
    first, last = sequence_items(load_ends(ends_ref, sched), pl.program_id(0), sched)
    out_ref[0, 0], out_ref[0, 1] = first, last

  whole = pl.BlockSpec((sched.batch,), lambda i: (0,))
  call = lambda kernel, n, cols: pl.pallas_call(
      kernel, grid=(n,), in_specs=[whole], out_specs=pl.BlockSpec((1, cols), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((n, cols), jnp.int32), interpret=True)(ends)
  return call(items_kernel, sched.items, 4), call(sequences_kernel, sched.batch, 2)


def _check(ends, items, *, bk=16, t=1, s=1024, mods=Modifiers()):
  ends = np.asarray(ends, np.int32)
  b = ends.shape[0]
  sched = Schedule(items=items, batch=b, block=bk, num_tokens=t, seq_len=s, mods=mods)
  per_item, per_seq = (np.asarray(x) for x in _derived(jnp.asarray(ends), sched))
  seq, work, item_ends = (np.asarray(x) for x in balanced_schedule(jnp.asarray(ends), items, bk, t, s, mods))
  what = f"ends={ends.tolist()} items={items}"
  used = seq < b
  # A used item: its sequence, split, split count and end exactly; an empty one reads nothing.
  np.testing.assert_array_equal(per_item[used], np.stack([seq, work[:, 0], work[:, 1], item_ends], 1)[used], what)
  np.testing.assert_array_equal(per_item[~used, 1:], np.tile([0, 1, 0], ((~used).sum(), 1)), what)
  # A sequence's run of items is exactly the items the reference gives it.
  for i in range(b):
    np.testing.assert_array_equal(np.arange(*per_seq[i]), np.flatnonzero(seq == i), f"{what}: sequence {i}")


@pytest.mark.parametrize("b,items", [(1, 2), (5, 40), (20, 119), (37, 80)])
def test_kernel_schedule_is_balanced_schedule(b, items):
  """Random ends with many empty sequences, B not a power of two, items at and past B."""
  rng = np.random.default_rng(b * 1000 + items)
  for _ in range(3):
    _check(np.where(rng.random(b) < 0.6, 0, rng.integers(1, 1025, b)), items)


def test_kernel_schedule_edge_batches():
  """All empty; one giant sequence among empties (it takes every item); every sequence
  full (fewer items than needed at one block each); ends past the capacity or negative
  (clipped); a window and T > 1 (the blocks a sequence's rows may see start past 0)."""
  for ends in ([0] * 6, [0, 0, 1024, 0, 0, 0], [1024] * 6, [5000, -4, 40, 0, 1, 17]):
    _check(ends, 12)
  _check([3, 1024, 700, 17, 0, 64], 30, t=3, mods=Modifiers(window=100))
