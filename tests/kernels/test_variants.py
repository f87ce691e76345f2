"""Score modifiers (causal, mask, bias, ALiBi, window, soft cap, sinks) against the
float32 reference, alone and combined, on every impl (XLA, Triton and Mosaic kernels
interpreted), over shapes that break tiling; garbage outside a mask or window never
leaks; bad modifiers raise ValueError."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.cache import gather_pages
from fdecode.combine import apply_sinks, merge_states
from fdecode.kernels.common import block as blk
from fdecode.kernels.common.modifiers import Modifiers
from fdecode.cache.quant import dequantize, quantize
from fdecode.reference import reference_decode
from helpers import assert_attention_reordered, assert_close, make_problem, max_abs, tol
from helpers.paged import paged_problem, pour, with_garbage

B, T, HQ, HKV, S, D = 4, 3, 8, 2, 77, 32
# 0, 1, a block of 16 +- 1, S: with block_k=16 (Triton) the lengths straddle block ends.
LENGTHS = jnp.array([0, 1, 17, S])


def _problem(seed, dtype=jnp.float32, t=T, hq=HQ, hkv=HKV, s=S):
  return make_problem(seed, b=4, t=t, hq=hq, hkv=hkv, s=s, dk=D, dtype=dtype)


def _mods(name, seed=0, t=T, hq=HQ, s=S):
  """The keyword arguments of one modifier case, with random arrays."""
  r = np.random.default_rng(seed)
  boolean = lambda shape: jnp.asarray(r.random(shape) > 0.4)
  normal = lambda shape: jnp.asarray(r.normal(size=shape), jnp.float32)
  return {
      "non-causal": dict(causal=False),
      "window-7": dict(window=7),
      "window-1": dict(window=1),
      "window>S": dict(window=5 * s),
      "soft-cap": dict(logits_soft_cap=0.7),
      "mask[B,S]": dict(mask=boolean((4, s))),
      "mask[B,T,S]": dict(mask=boolean((4, t, s))),
      "mask[B,T,Hq,S]": dict(mask=boolean((4, t, hq, s))),
      "mask[1,1,Hq,S]": dict(mask=boolean((1, 1, hq, s))),
      "bias[B,S]": dict(bias=normal((4, s))),
      "bias[1,T,Hq,S]": dict(bias=normal((1, t, hq, s))),
      "alibi": dict(alibi_slopes=jnp.asarray(2.0 ** -np.arange(1, hq + 1), jnp.float32)),
      "sinks": dict(sinks=normal((hq,))),
      "all": dict(causal=True, window=20, logits_soft_cap=2.0, mask=boolean((4, s)),
                  bias=normal((1, t, hq, s)), alibi_slopes=normal((hq,)) ** 2 / 4, sinks=normal((hq,))),
  }[name]


def _check(out, lse, q, k, v, lengths, dtype, **mods):
  ref, ref_lse = reference_decode(q, k, v, lengths, **mods)
  t = tol(dtype)
  assert_close(out, ref, atol=t["atol"], rtol=t["rtol"])
  assert_close(lse, ref_lse, atol=t["lse"], rtol=t["lse"], what="lse")


CASES = ["non-causal", "window-7", "window-1", "window>S", "soft-cap", "mask[B,S]", "mask[B,T,S]",
         "mask[B,T,Hq,S]", "mask[1,1,Hq,S]", "bias[B,S]", "bias[1,T,Hq,S]", "alibi", "sinks", "all"]


# The kernels run every distinct code path: "all" (window, soft cap, [B, S] mask, per-head
# bias, ALiBi, sinks at once), each mask-row expansion form, non-causal and the window
# edge cases. The rest are covered by "all" for them, or are impl-independent (sinks join
# after the merge, outside the kernels): the XLA path alone runs those (suite time).
KERNEL_CASES = ("non-causal", "window-1", "window>S", "mask[B,T,S]", "mask[B,T,Hq,S]",
                "mask[1,1,Hq,S]", "all")


@pytest.mark.parametrize("case", CASES)
def test_each_modifier_matches_reference(impl, case):
  if case not in KERNEL_CASES and impl != "xla":
    pytest.skip("covered by 'all' for the kernels, or impl-independent (see KERNEL_CASES)")
  q, k, v = _problem(0)
  mods = _mods(case)
  out, lse = fdecode.flash_decode(q, k, v, LENGTHS, impl=impl, block_k=16, num_splits=3,
                                  return_lse=True, **mods)
  _check(out, lse, q, k, v, LENGTHS, jnp.float32, **mods)


def test_modifiers_change_the_result():
  """Each case really modifies the oracle's answer (so matching it means something)."""
  q, k, v = _problem(0)
  plain = reference_decode(q, k, v, LENGTHS)[0]
  for case in CASES:
    if case != "window>S":
      assert not np.allclose(reference_decode(q, k, v, LENGTHS, **_mods(case))[0][3], plain[3],
                             atol=1e-3), case


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_window_soft_cap_multi_token(impl, dtype):
  q, k, v = _problem(1, dtype, t=4, s=100)
  lengths = jnp.array([100, 33, 4, 0])
  mods = dict(window=24, logits_soft_cap=1.5)
  out, lse = fdecode.flash_decode(q, k, v, lengths, impl=impl, block_k=16, return_lse=True, **mods)
  _check(out, lse, q, k, v, lengths, dtype, **mods)


@pytest.mark.parametrize("g", [1, 8])
def test_alibi_gqa(impl, g):
  q, k, v = _problem(2, t=2, hq=2 * g, hkv=2, s=50)
  lengths = jnp.array([50, 17, 2, 0])
  mods = dict(alibi_slopes=jnp.asarray(2.0 ** (-8 * np.arange(1, 2 * g + 1) / (2 * g)), jnp.float32),
              causal=False)
  out, lse = fdecode.flash_decode(q, k, v, lengths, impl=impl, block_k=16, num_splits=5,
                                  return_lse=True, **mods)
  _check(out, lse, q, k, v, lengths, jnp.float32, **mods)


# Per-query-head masks and biases over head geometries where the row of a query head is not
# its kv head's: MHA (G = 1, one row per kv head; per token, and one for every token), MQA
# (one kv head), T x G = 80 rows in two row blocks of the Triton kernel (D = 256), and forms
# broadcast over B or T. The Triton kernel reads the caller's [B|1, T|1, Hq, S] in place and
# gathers each row's (t, query head).
@pytest.mark.parametrize("t,hq,hkv,d,form", [(3, 4, 4, 32, "B,T"), (2, 4, 4, 32, "B,1"), (2, 6, 1, 32, "B,1"),
                                             (5, 16, 1, 256, "1,T"), (3, 14, 2, 32, "B,T")])
def test_per_head_mask_and_bias_every_head_geometry(impl, t, hq, hkv, d, form):
  s = 37
  q, k, v = make_problem(11, b=3, t=t, hq=hq, hkv=hkv, s=s, dk=d)
  lengths = jnp.array([s, 16, 1])
  r = np.random.default_rng(11)
  lead = {"B,T": (3, t), "B,1": (3, 1), "1,T": (1, t)}[form]
  mods = dict(mask=jnp.asarray(r.random(lead + (hq, s)) > 0.3),
              bias=jnp.asarray(r.normal(size=lead + (hq, s)), jnp.float32))
  out, lse = fdecode.flash_decode(q, k, v, lengths, impl=impl, block_k=16, num_splits=2, return_lse=True, **mods)
  _check(out, lse, q, k, v, lengths, jnp.float32, **mods)
  # A query head reading another head's (or token's) row would mostly see other keys.
  swapped = dict(mods, mask=jnp.roll(mods["mask"], 1, axis=-2))
  assert not np.allclose(reference_decode(q, k, v, lengths, **swapped)[0], reference_decode(q, k, v, lengths, **mods)[0],
                         atol=1e-2)


def test_mask_paged_int8(impl):
  """A per-token mask over a paged int8 cache with stale table entries (page size 8)."""
  ps, pages = 8, 6
  q, kp, vp, tables = paged_problem(3, b=4, t=2, hq=8, hkv=2, pages_per_seq=pages, page_size=ps, dk=D)
  lengths = jnp.array([pages * ps, 9, 1, 0])
  tables = with_garbage(tables, lengths, ps, kp.shape[1])
  kq, ks = quantize(kp, jnp.int8)
  vq, vs = quantize(vp, jnp.int8)
  mask = jnp.asarray(np.random.default_rng(3).random((4, 2, pages * ps)) > 0.5)
  out, lse = fdecode.flash_decode(q, kq, vq, lengths, block_tables=tables, k_scale=ks, v_scale=vs,
                                  mask=mask, window=30, impl=impl, block_k=16, return_lse=True)
  safe = jnp.asarray(np.clip(tables, 0, kp.shape[1] - 1))
  kf = gather_pages(dequantize(kq, ks), safe)
  vf = gather_pages(dequantize(vq, vs), safe)
  _check(out, lse, q, kf, vf, lengths, jnp.float32, mask=mask, window=30)


def test_empty_rows_give_zero_or_the_sink(impl):
  """A row whose window / mask leaves no key: out 0 and lse -inf; with sinks, lse = sink."""
  q, k, v = _problem(4, t=2)
  lengths = jnp.array([S, 5, 0, 30])
  mask = jnp.ones((4, 2, S), bool).at[0].set(False).at[1, 0].set(False)  # seq 0 and (1, t=0): empty
  sinks = jnp.linspace(-1.0, 1.0, HQ)
  cases = (dict(mask=mask), dict(window=1, mask=mask, sinks=sinks))
  # The kernels' empty rows (0, -inf) are what the sinks then complete: one call covers both.
  for mods in (cases if impl == "xla" else cases[1:]):
    out, lse = fdecode.flash_decode(q, k, v, lengths, impl=impl, return_lse=True, **mods)
    assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    expect = -np.inf if "sinks" not in mods else np.broadcast_to(np.asarray(sinks), (2, HQ))
    np.testing.assert_allclose(np.asarray(lse[0]), expect, rtol=1e-6)
    _check(out, lse, q, k, v, lengths, jnp.float32, **mods)


def test_garbage_outside_mask_and_window_never_leaks(impl):
  """inf / NaN in every slot the mask or window hides (inside the lengths): the same
  result, bit for bit, as with a clean cache."""
  q, k, v = _problem(5, t=2)
  lengths = jnp.array([S, 40, 17, 0])
  mask = jnp.asarray(np.random.default_rng(5).random((4, S)) > 0.3)
  mods = dict(mask=mask, window=12)
  pos = jnp.arange(S)
  seen = jnp.zeros((4, S), bool)
  for t in range(2):  # the union over both query tokens of what they may see
    p = (lengths - 2 + t)[:, None]
    seen |= (pos <= p) & (pos > p - 12) & mask
  dead = ~seen[:, None, :, None]
  clean = fdecode.flash_decode(q, k, v, lengths, impl=impl, return_lse=True, **mods)
  dirty = fdecode.flash_decode(q, pour(k, dead, 1), pour(v, dead, 2), lengths, impl=impl,
                               return_lse=True, **mods)
  for x, y in zip(clean, dirty):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.isnan(np.asarray(x)).any()


def test_window_pages_before_the_window_may_be_freed():
  """Pages wholly before every row's window are never read: a table may name freed
  pages (-1, out of the pool) there, as engines free pages that slid out of the window."""
  ps, pages = 4, 12
  q, kp, vp, tables = paged_problem(6, b=2, t=None, hq=4, hkv=2, pages_per_seq=pages, page_size=ps, dk=D)
  lengths = np.array([pages * ps, 30])
  window = 9
  freed = tables.copy()
  for i, n in enumerate(lengths):
    freed[i, : (int(n) - window) // ps] = [-1, 10 ** 6][i]
  out = fdecode.flash_decode(q, kp, vp, lengths, block_tables=freed, window=window, impl="xla")
  ref = fdecode.flash_decode(q, kp, vp, lengths, block_tables=tables, window=window, impl="reference")
  assert_close(out, ref, atol=3e-5, rtol=3e-5)
  bad = freed.copy()
  bad[0, 9] = -1  # a page inside the window is still checked
  with pytest.raises(ValueError, match=r"block_tables\[0, 9\]"):
    fdecode.flash_decode(q, kp, vp, lengths, block_tables=bad, window=window)


def test_split_ranges_cover_only_the_window():
  """The kernels' block ranges: the visible blocks, dealt evenly over the splits."""
  mods = Modifiers(window=100)
  for end in (0, 1, 99, 100, 101, 5000):
    ranges = [tuple(map(int, blk.split_range(jnp.int32(end), j, 4, 2, 8192, 64, mods))) for j in range(4)]
    blocks = [b for first, last in ranges for b in range(first, last)]
    lo = max(end - 2 + 1 - 100, 0) // 64
    assert blocks == list(range(lo, -(-end // 64))), (end, ranges)


def test_apply_sinks_is_a_merge_with_a_valueless_key():
  """The sink state merges like any part: applying it once after a merge equals the
  reference; merging two sink-carrying states would count it twice (documented)."""
  q, k, v = _problem(7, t=1)
  lengths = jnp.array([S, 40, 3, 0])
  sinks = jnp.linspace(-2.0, 2.0, HQ)
  halves = [fdecode.flash_decode(q, k, v, lengths, kv_offset=0, return_lse=True, impl="xla",
                                 mask=jnp.broadcast_to(jnp.arange(S) < 40, (4, S)) ^ flip)
            for flip in (False, True)]
  o, lse = merge_states(jnp.stack([h[0] for h in halves]), jnp.stack([h[1] for h in halves]))
  o, lse = apply_sinks(o, lse, sinks)
  ref, ref_lse = reference_decode(q, k, v, lengths, sinks=sinks)
  assert_close(o, ref, atol=3e-5, rtol=3e-5)
  assert_close(lse, ref_lse, atol=3e-5, rtol=3e-5)


def test_non_causal_single_token_is_accepted_and_equal():
  """causal is static: the two calls are two compiled programs, equal within float32
  reordering (one token sees the same keys either way)."""
  q, k, v = make_problem(8, b=2, t=None, hq=4, hkv=2, s=40, dk=D)
  lengths = jnp.array([40, 7])
  assert_attention_reordered(fdecode.flash_decode(q, k, v, lengths, causal=False, return_lse=True),
                             fdecode.flash_decode(q, k, v, lengths, return_lse=True), keys=40, dk=D,
                             values=max_abs(v))


def test_per_layer_windows_under_one_jit():
  """Gemma 3: local (window) and global layers in one jitted step, each its own kernel."""
  q, k, v = _problem(9)
  step = jax.jit(lambda q, k, v, n: [fdecode.flash_decode(q, k, v, n, window=w) for w in (16, None)])
  local, glob = step(q, k, v, LENGTHS)
  assert_close(local, reference_decode(q, k, v, LENGTHS, window=16)[0], atol=3e-5, rtol=3e-5)
  assert_close(glob, reference_decode(q, k, v, LENGTHS)[0], atol=3e-5, rtol=3e-5)


BAD = [
    (dict(mask=jnp.ones((4, S), jnp.int32)), r"mask must be boolean.*int32"),
    (dict(mask=jnp.ones((4, S + 1), bool)), r"mask must broadcast.*mask.shape=\(4, 78\)"),
    (dict(mask=jnp.ones((2, S), bool)), r"mask must broadcast.*mask.shape=\(2, 77\)"),
    (dict(mask=jnp.ones((S,), bool)), r"mask must be \[B, S\].*mask.shape=\(77,\)"),
    (dict(bias=jnp.ones((4, T, 3, S))), r"bias must broadcast.*bias.shape=\(4, 3, 3, 77\)"),
    (dict(bias=jnp.ones((4, S), bool)), r"bias must be floating point"),
    (dict(window=0), r"window must be a positive int, at most 2147483647 \(int32; the sliding window, "
                     r"in tokens\); got window=0"),
    (dict(window=2.5), r"window must be an integer"),
    (dict(window=jnp.int32(0)), r"window must be a positive int.*got window=0"),  # a jax scalar: the same domain
    (dict(logits_soft_cap=0.0), r"logits_soft_cap must be positive"),
    (dict(logits_soft_cap=-1.0), r"logits_soft_cap must be positive"),
    (dict(alibi_slopes=jnp.ones((HQ + 1,))), r"alibi_slopes must be \[Hq\]=\(8,\).*\(9,\)"),
    (dict(sinks=jnp.ones((2, HQ))), r"sinks must be \[Hq\]=\(8,\).*\(2, 8\)"),
    (dict(sinks=jnp.ones((HQ,), jnp.int32)), r"sinks must be floating point"),
    (dict(causal=None), r"causal must be a bool"),
]


@pytest.mark.parametrize("bad,match", BAD, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_modifiers_raise(bad, match):
  q, k, v = _problem(0)
  with pytest.raises(ValueError, match=match):
    fdecode.flash_decode(q, k, v, LENGTHS, **bad)
  with pytest.raises(ValueError, match=match):  # at trace time, under jit too
    jax.jit(lambda q, k, v: fdecode.flash_decode(q, k, v, LENGTHS, **bad)).lower(q, k, v)
