"""`ragged_decode`'s per-row masks and biases on the Triton step (`fdecode.kernels.triton.triton_step`,
interpreted): every form ragged_decode documents (``[N|1, S]`` and ``[N|1, Hq, S]``), paged
and contiguous, both layouts, against the float32 reference run per sequence. Each program
reads its rows' entries at their packed rows (`fdecode.kernels.triton.kernel.step_mod_rows`):
the prefill blocks' rows before their sequence's own and padding rows read other rows,
which must not reach an output. Slots a mask hides hold NaN in the cache and must not
either."""

import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from helpers import assert_close, pairwise_only, tol
from helpers.ragged import batch, check, per_sequence, spy_step

FORMS = {"mask-rows": ("mask", True, False), "mask-rows-heads": ("mask", True, True),
         "mask-one-heads": ("mask", False, True), "bias-rows": ("bias", True, False),
         "bias-rows-heads": ("bias", True, True), "bias-one": ("bias", False, False)}


def _per_row(name, per_row, per_head, n_rows, hq, s, seed):
  rng = np.random.default_rng(seed)
  shape = (n_rows if per_row else 1,) + ((hq,) if per_head else ()) + (s,)
  if name == "mask":
    return jnp.asarray(rng.random(shape) > 0.3)
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


CACHES, LAYOUTS = ["paged16", "contiguous"], ["HND", "NHD"]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_step_reads_per_row_modifiers(request, form, cache, layout, monkeypatch):
  pairwise_only(request, "each form with each cache and each layout", form=list(FORMS), cache=CACHES,
                layout=LAYOUTS)
  calls = spy_step(monkeypatch)
  name, per_row, per_head = FORMS[form]
  p = batch(6, [1, 9, 70, 2, 65], [50, 9, 90, 2, 70], max_seqs=6, paged=cache != "contiguous", layout=layout)
  n_rows, hq = p["q"].shape[:2]
  s = p["block_tables"].shape[1] * 16 if cache != "contiguous" else p["k"].shape[2 if layout == "HND" else 1]
  x = _per_row(name, per_row, per_head, n_rows, hq, s, seed=len(form))
  out, lse = fdecode.ragged_decode(**p, kv_layout=layout, impl="pallas", interpret=True, return_lse=True,
                                   **{name: x})
  assert calls, "the Triton step did not run"
  rows = x if per_row else jnp.broadcast_to(x, (n_rows,) + x.shape[1:])
  check(p, out, lse, per_sequence(p, layout, per_row={name: rows}))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_hidden_nan_slots_do_not_reach_any_row(dtype, monkeypatch):
  """A per-head mask hides whole columns (the same positions for every row of a head) whose
  keys and values are NaN: no row may see them, so every output stays finite and equals
  the reference's; one head hides nothing there and keeps its NaN (NaN in, NaN out)."""
  calls = spy_step(monkeypatch)
  p = batch(7, [1, 30, 3], [40, 80, 60], max_seqs=4, dtype=dtype)
  n_rows, hq = p["q"].shape[:2]
  s = p["block_tables"].shape[1] * 16
  mask = np.random.default_rng(2).random((n_rows, hq, s)) > 0.2
  hidden = [5, 17, 33]  # positions every live sequence holds
  mask[:, :2, hidden] = False  # heads 0 and 1 (kv head 0) never see them
  k, v = np.asarray(p["k"], np.float32).copy(), np.asarray(p["v"], np.float32).copy()
  for i in range(p["num_seqs"]):  # NaN at those positions of every sequence's pages
    for pos in hidden:
      k[:, p["block_tables"][i, pos // 16], pos % 16] = np.nan
      v[:, p["block_tables"][i, pos // 16], pos % 16] = np.nan
  p = dict(p, k=jnp.asarray(k).astype(dtype), v=jnp.asarray(v).astype(dtype))
  out, lse = fdecode.ragged_decode(**p, mask=jnp.asarray(mask), impl="pallas", interpret=True, return_lse=True)
  assert calls, "the Triton step did not run"
  live = int(p["cu_q_lens"][p["num_seqs"]])
  seen = np.asarray(out[:live], np.float32)
  assert np.isfinite(seen[:, :2]).all(), "a hidden NaN slot reached a row"
  assert np.isnan(seen[:, 2:]).any(axis=(1, 2)).all(), "a visible NaN slot did not reach its rows"
  expected = per_sequence(p, per_row=dict(mask=jnp.asarray(mask)))
  t = tol(dtype)
  assert_close(out[:live, :2], expected[0][:, :2], atol=t["atol"], rtol=t["rtol"])
  assert_close(lse[:live, :2], expected[1][:, :2], atol=t["lse"], rtol=t["lse"], what="lse")
