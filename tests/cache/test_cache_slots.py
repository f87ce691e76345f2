"""The dropped-write rule (`fdecode.cache.slots`), written once and applied by every cache
write: `write_paged` / `write_contiguous`, the ragged step's scatter and its Triton write
kernel (interpreted). A token is written only where its caller named a slot: padding
(negative positions), positions past a contiguous cache, positions past the sequence's
table row and table entries outside the pool write nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.cache.layout import CacheView
from fdecode.cache.slots import contiguous_slot, paged_slot
from fdecode.ragged.write import write_new_tokens


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_slot_is_the_rule_at_every_position(page_size):
  num_pages, table_len = 5, 3
  tables = np.array([[2, -1, 4], [5, 0, 7]], np.int32)  # -1 and 5, 7: no page of the pool
  for row in range(2):
    pos = np.arange(-2, table_len * page_size + page_size + 2, dtype=np.int32)
    page, slot, ok = jax.jit(lambda p: paged_slot(p, lambda j: jnp.asarray(tables)[row, j], page_size=page_size,
                                                  table_len=table_len, num_pages=num_pages))(pos)
    for p, pg, sl, k in zip(pos, np.asarray(page), np.asarray(slot), np.asarray(ok)):
      j = p // page_size
      named = tables[row, j] if 0 <= p and j < table_len else -1
      assert bool(k) == (0 <= named < num_pages), (row, p)
      assert 0 <= pg < num_pages and 0 <= sl < page_size
      if k:
        assert (pg, sl) == (named, p % page_size)


def test_contiguous_slot_is_the_rule_at_every_position():
  pos = np.arange(-3, 12, dtype=np.int32)
  slot, ok = contiguous_slot(jnp.asarray(pos), capacity=8)
  np.testing.assert_array_equal(np.asarray(ok), (pos >= 0) & (pos < 8))
  np.testing.assert_array_equal(np.asarray(slot)[np.asarray(ok)], pos[(pos >= 0) & (pos < 8)])
  assert (np.asarray(slot) >= 0).all() and (np.asarray(slot) < 8).all()


def _paged_step(layout):
  """A paged step whose rows name: a slot (row 0), a position past the sequence's table row
  (row 1: it would clip onto the row's last page), padding (row 2)."""
  ps, hkv, d, pages = 4, 2, 8, 6
  rng = np.random.default_rng(0)
  shape = (hkv, pages, ps, d) if layout == "HND" else (pages, ps, hkv, d)
  k = jnp.asarray(rng.normal(size=shape), jnp.float32)
  v = jnp.asarray(rng.normal(size=shape), jnp.float32)
  tables = jnp.asarray([[3, 1], [0, 5]], jnp.int32)  # 2 pages a sequence: positions 0..7
  view = CacheView(k, v, block_tables=tables, layout=layout, paged=True)
  new = jnp.asarray(rng.normal(size=(3, hkv, d)) + 100, jnp.float32)
  seq = jnp.asarray([0, 1, 1], jnp.int32)
  pos = jnp.asarray([5, 2 * ps + 1, -1], jnp.int32)
  return view, new, seq, pos


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("impl,interpret", [("xla", None), ("pallas", True)])
def test_a_step_past_the_table_writes_nothing(layout, impl, interpret):
  """Traced positions past a sequence's table row are dropped by the XLA scatter and the
  Triton write kernel alike (not clipped onto the row's last page)."""
  view, new, seq, pos = _paged_step(layout)
  k, v = jax.jit(lambda p: write_new_tokens(view, new, new, seq, p, impl=impl, interpret=interpret))(pos)
  for before, after in ((view.k, k), (view.v, v)):
    changed = np.argwhere(np.asarray(before) != np.asarray(after))
    # Only row 0's slot: page 1 (its table entry 1), slot 1.
    page_axis, slot_axis = (1, 2) if layout == "HND" else (0, 1)
    assert changed.size, "row 0's slot was written"
    assert set(map(tuple, changed[:, [page_axis, slot_axis]])) == {(1, 1)}


def test_write_paged_drops_a_position_past_the_table():
  rng = np.random.default_rng(1)
  k = jnp.asarray(rng.normal(size=(2, 6, 4, 8)), jnp.float32)
  tables = jnp.asarray([[3, 1], [0, 5]], jnp.int32)
  new = jnp.asarray(rng.normal(size=(2, 2, 1, 8)) + 100, jnp.float32)
  k2, _ = jax.jit(fdecode.cache.write_paged)(k, k, tables, jnp.asarray([8, 6], jnp.int32), new, new)
  changed = {tuple(i) for i in np.argwhere(np.asarray(k) != np.asarray(k2))[:, 1:3]}
  assert changed == {(5, 2)}  # sequence 1, position 6: page 5, slot 2; sequence 0's 8 is past its table
