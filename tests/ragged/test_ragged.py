"""`fdecode.ragged_decode`: packed ragged new tokens (decodes beside prefill chunks) against
the float32 reference run per sequence and against JAX's own ``ref_ragged_paged_attention``;
both cache layouts, contiguous and paged, 8-bit, modifiers, garbage in dead slots, the
fused write, bad input and jit behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

import fdecode
from fdecode.cache import write_paged
from fdecode.cache.quant import dequantize, quantize
from helpers import assert_close, assert_reordered, impl_param, interpreted_once, max_abs, tol
from helpers.ragged import batch, check, head_major, per_sequence


MIXES = {"mixed": ([1, 7, 64, 1, 0, 30], [5, 40, 100, 128, 3, 30]),
         "long": ([300, 1, 2], [333, 17, 2])}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("cache", ["paged16", "paged1", "contiguous"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_matches_reference(impl, request, mix, cache, layout):
  interpreted_once(request, "the kernels see only flash_decode calls", mix="mixed", layout="NHD")
  if impl_param(request) != "xla" and cache == "paged1":
    pytest.skip("page size 1 is a flash_decode path the kernel suites cover")
  q_lens, kv_lens = MIXES[mix]
  p = batch(1, q_lens, kv_lens, max_seqs=8, paged=cache != "contiguous",
            page_size=1 if cache == "paged1" else 16, layout=layout)
  out, lse = fdecode.ragged_decode(**p, kv_layout=layout, impl=impl, return_lse=True)
  check(p, out, lse, per_sequence(p, layout))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_window_soft_cap_and_modifiers(dtype):
  p = batch(2, [1, 9, 70], [50, 9, 90], max_seqs=4, dtype=dtype)
  n = p["q"].shape[0]
  rng = np.random.default_rng(3)
  bias = jnp.asarray(rng.standard_normal((n, 4, p["block_tables"].shape[1] * 16)), jnp.float32)
  opts = dict(window=20, logits_soft_cap=7.0, alibi_slopes=jnp.array([0.1, 0.2, 0.3, 0.4]),
              sinks=jnp.array([0.5, -1.0, 0.0, 2.0]), softmax_scale=0.3)
  out, lse = fdecode.ragged_decode(**p, bias=bias, return_lse=True, **opts)
  expected = per_sequence(p, per_row=dict(bias=bias), **opts)
  live = int(p["cu_q_lens"][p["num_seqs"]])
  t = tol(dtype)
  assert_close(out[:live], expected[0], atol=t["atol"], rtol=t["rtol"])
  assert_close(lse[:live], expected[1], atol=t["lse"], rtol=t["lse"], what="lse")


def test_triton_reads_rows_in_place_per_sequence_grid():
  """The interpreted Triton kernels read each part's q rows and each prefill block's table
  row through their indices (`fdecode.kernels.backend.RowSource`), not gathers. A fixed
  split count turns the balanced schedule off, so this runs the per-sequence grid's reads
  with a per-row bias gathered per part (`test_matches_reference` runs the balanced one);
  rows before a sequence's own in a block (its first, partial block) read other sequences'
  rows, which must not reach it."""
  p = batch(6, [1, 9, 70, 2], [50, 9, 90, 2], max_seqs=5)
  n = p["q"].shape[0]
  bias = jnp.asarray(np.random.default_rng(4).standard_normal((n, p["block_tables"].shape[1] * 16)), jnp.float32)
  out, lse = fdecode.ragged_decode(**p, bias=bias, impl="pallas", interpret=True, return_lse=True, num_splits=2)
  check(p, out, lse, per_sequence(p, per_row=dict(bias=bias)))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("case", ["balanced", "per-sequence-grid", "int8-per-token"])
def test_triton_reads_contiguous_cache_rows_in_place(layout, case, monkeypatch):
  """A contiguous cache's prefill blocks go to one call of the interpreted Triton kernels,
  each block reading its sequence's cache row (and per-token scales) through the
  RowSource's cache rows, not a loop over the blocks: on the balanced schedule (the Triton
  step, `fdecode.kernels.triton.triton_step`: its decode part reads its sequences so too), and on
  the per-sequence grid (a fixed split count turns the schedule off: the two-part path,
  with a per-row bias gathered per part). Other
  sequences' rows hold NaN past their lengths and in the rows no sequence owns, which no
  block may reach."""
  import fdecode.ragged.parts as ragged_module
  import fdecode.kernels.triton.ragged_step as step_module
  calls = []

  def spy(module, name, q_source):
    real = getattr(module, name)

    def call(*args, **kwargs):
      q, source = q_source(*args, **kwargs)
      calls.append((q.shape[:2], source is not None and source.caches is not None))
      return real(*args, **kwargs)
    monkeypatch.setattr(module, name, call)

  spy(ragged_module, "run", lambda c, *a, **kw: (c.q4, c.source))  # the two-part path's calls
  spy(step_module, "plan_view", lambda q, *a, source=None, **kw: (q, source))  # the Triton step's parts
  p = batch(9, [1, 9, 70, 2, 65], [50, 9, 90, 2, 70], max_seqs=7, paged=False, layout=layout)
  ax = 2 if layout == "HND" else 1
  k = np.asarray(p["k"]).copy()
  for i, n in enumerate(p["kv_lens"]):  # dead slots of every row, and rows 5, 6 (no sequence): NaN
    k[(i,) + (slice(None),) * (ax - 1) + (slice(int(n), None),)] = np.nan
  p = dict(p, k=jnp.asarray(k))
  opts = {}
  if case == "per-sequence-grid":
    n_rows, s = p["q"].shape[0], k.shape[ax]
    opts["bias"] = jnp.asarray(np.random.default_rng(5).standard_normal((n_rows, s)), jnp.float32)
    opts["num_splits"] = 2
  if case == "int8-per-token":
    kq, ks = quantize(p["k"], jnp.int8)
    vq, vs = quantize(p["v"], jnp.int8)
    p = dict(p, k=kq, v=vq)
    opts.update(k_scale=ks, v_scale=vs)
  out, lse = fdecode.ragged_decode(**p, kv_layout=layout, impl="pallas", interpret=True, return_lse=True, **opts)
  real = dict(p, k=dequantize(p["k"], opts["k_scale"]), v=dequantize(p["v"], opts["v_scale"])) if "k_scale" in opts else p
  check(p, out, lse, per_sequence(real, layout, per_row={n: opts[n] for n in ("bias",) if n in opts}))
  prefill = [c for c in calls if c[0][1] == 64]  # (traced twice: on GPU, and under the CPU's skip-empty cond)
  assert prefill and all(source and shape[0] > 1 for shape, source in prefill), calls
  if case != "per-sequence-grid":  # the Triton step: its decode part too, one call of the M sequences
    assert [c for c in calls if c[0] == (7, 1)] == [((7, 1), True)], calls


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_8bit_cache(dtype):
  p = batch(4, [3, 1, 65], [3, 30, 80], max_seqs=3)
  kq, ks = quantize(p["k"], jnp.dtype(dtype))
  vq, vs = quantize(p["v"], jnp.dtype(dtype))
  p8 = dict(p, k=kq, v=vq)
  out, lse = fdecode.ragged_decode(**p8, k_scale=ks, v_scale=vs, return_lse=True)
  check(p8, out, lse, per_sequence(p8, k_scale=ks, v_scale=vs))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_one_sequence_slot_contiguous(impl, layout):
  """max_seqs = 1 on a contiguous cache: the prefill blocks' call has a batch of blocks, so
  each block reads (and, for the other paths, gathers) the one cache row; the one-call
  path once kept the cache at batch 1 and failed shape validation."""
  p = batch(11, [70], [90], max_seqs=1, paged=False, layout=layout)
  out, lse = fdecode.ragged_decode(**p, kv_layout=layout, impl=impl, return_lse=True)
  check(p, out, lse, per_sequence(p, layout))


@pytest.mark.parametrize("paged", [True, False], ids=["paged16", "contiguous"])
def test_scalar_scales(paged):
  """One scale per tensor, as scalars (a form flash_decode documents): the step's choice of
  path reads their tile count without an axis (it once indexed a scalar's shape)."""
  p = batch(10, [3, 1, 65], [3, 30, 80], max_seqs=3, paged=paged)
  kq, vq = (jnp.clip(jnp.round(p[n] / 0.05), -127, 127).astype(jnp.int8) for n in ("k", "v"))
  p8 = dict(p, k=kq, v=vq)
  out, lse = fdecode.ragged_decode(**p8, k_scale=0.05, v_scale=np.float32(0.05), return_lse=True)
  check(p8, out, lse, per_sequence(dict(p8, k=kq.astype(jnp.float32) * 0.05, v=vq.astype(jnp.float32) * 0.05)))


def test_mla_values_from_keys():
  p = batch(5, [2, 1, 66], [10, 20, 70], max_seqs=3, hq=8, hkv=1, d=48)
  out, lse = fdecode.ragged_decode(p["q"], p["k"], None, p["kv_lens"], p["block_tables"], p["cu_q_lens"],
                                   p["num_seqs"], v_head_dim=32, return_lse=True)
  expected = per_sequence(dict(p, v=p["k"][..., :32]))
  check(p, out, lse, expected)


@pytest.mark.parametrize("with_window", [False, True])
def test_against_jax_ragged_paged_attention_reference(with_window):
  """JAX's ``ref_ragged_paged_attention`` holds K and V interleaved in one token-major
  pool ``[P, page_size, 2 * Hkv, D]``: split it into our NHD pools."""
  p = batch(6, [1, 7, 64, 1, 30], [40, 7, 100, 128, 31], max_seqs=8, hq=8, hkv=2, d=64, layout="NHD")
  k, v = p["k"], p["v"]  # [P, ps, Hkv, D]
  kv_pages = jnp.stack([k, v], axis=3).reshape(k.shape[:2] + (2 * k.shape[2], k.shape[3]))
  opts = dict(sm_scale=0.125, soft_cap=30.0, sliding_window=24 if with_window else None)
  ns = p["num_seqs"]
  expected = rpa.ref_ragged_paged_attention(p["q"], kv_pages, jnp.asarray(p["kv_lens"]), jnp.asarray(p["block_tables"]),
                                            jnp.asarray(p["cu_q_lens"]), jnp.array([ns], jnp.int32), **opts)
  out = fdecode.ragged_decode(**dict(p, num_seqs=np.array([ns], np.int32)), kv_layout="NHD", softmax_scale=0.125,
                              logits_soft_cap=30.0, window=opts["sliding_window"])
  live = int(p["cu_q_lens"][ns])
  np.testing.assert_allclose(np.asarray(out[:live]), np.asarray(expected[:live]), atol=2e-5, rtol=2e-5)


def test_garbage_in_dead_slots_is_bit_identical(impl):
  """inf / NaN past every kv_len, in unused pages, in dead sequences' rows of the table and
  in the padding rows of q: the live rows' results do not change by a bit."""
  p = batch(7, [1, 7, 40], [20, 7, 45], max_seqs=5, hq=4, hkv=2)
  clean = fdecode.ragged_decode(**p, impl=impl, return_lse=True)
  k, v, tables = (np.array(p[n]) for n in ("k", "v", "block_tables"))
  ps = k.shape[2]
  live_slots = np.zeros(k.shape[1:3], bool)  # [P, ps]
  for i in range(p["num_seqs"]):
    for t in range(int(p["kv_lens"][i])):
      live_slots[tables[i, t // ps], t % ps] = True
  rng = np.random.default_rng(0)
  junk = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32), size=k.shape)
  k = np.where(live_slots[None, :, :, None], k, junk)
  v = np.where(live_slots[None, :, :, None], v, junk)
  q = np.array(p["q"])
  q[int(p["cu_q_lens"][p["num_seqs"]]):] = np.nan
  tables[p["num_seqs"]:] = -7  # dead sequences' rows
  dirty = fdecode.ragged_decode(**dict(p, q=q, k=k, v=v, block_tables=tables), impl=impl, return_lse=True)
  for a, b in zip(clean, dirty):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_visible_nan_reaches_only_its_rows():
  p = batch(8, [5, 3], [9, 12], max_seqs=2)
  k = np.array(p["k"])
  t = 6  # sequence 1's key at position 6: rows of sequence 1 at positions >= 6 see it
  k[:, p["block_tables"][1, t // 16], t % 16, 0] = np.nan
  out = np.asarray(fdecode.ragged_decode(**dict(p, k=k)))
  assert np.isfinite(out[:5]).all()  # sequence 0 never sees it
  assert np.isnan(out[5:8]).all(axis=(1, 2)).all()  # positions 9, 10, 11 of sequence 1


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fused_write_equals_write_then_attend(cache, layout):
  """The fused write puts each new token where `fdecode.cache` would (bit for bit: it only
  moves data), before the attention of the same step reads it. Comparing the jitted,
  donated fused call with an eager write-then-attend bit for bit compared two programs
  that XLA may fuse differently (322 of 3968 elements differed by <= 4.8e-7 on one AMD
  EPYC): the attention is checked bit for bit against a second call of the *same*
  compiled step over caches that already hold the tokens, and against the two-step
  eager call within float32 reordering (`assert_reordered`)."""
  paged = cache == "paged"
  p = batch(9, [1, 7, 20, 0], [30, 7, 21, 4], max_seqs=6, paged=paged, layout=layout)
  n, hkv, d = p["q"].shape[0], 2, p["q"].shape[2]
  rng = np.random.default_rng(1)
  new_k, new_v = (jnp.asarray(rng.standard_normal((n, hkv, d)), jnp.float32) for _ in range(2))
  step = jax.jit(lambda k, v, nk, nv: fdecode.ragged_decode(
      p["q"], k, v, p["kv_lens"], p["block_tables"], p["cu_q_lens"], p["num_seqs"], kv_layout=layout,
      new_k=nk, new_v=nv), donate_argnums=(0, 1))
  out, k2, v2 = step(jnp.array(p["k"]), jnp.array(p["v"]), new_k, new_v)
  # The same tokens written by fdecode.cache, sequence by sequence, then attention.
  k, v = (jnp.asarray(head_major(p[x], layout, paged)) for x in ("k", "v"))
  cu = p["cu_q_lens"]
  for i in range(p["num_seqs"]):
    lo, hi = int(cu[i]), int(cu[i + 1])
    if hi == lo:
      continue
    nk, nv = (x[lo:hi].transpose(1, 0, 2)[None] for x in (new_k, new_v))
    start = int(p["kv_lens"][i]) - (hi - lo)
    if paged:
      k, v = write_paged(k, v, p["block_tables"][i:i + 1], [start], nk, nv)
    else:
      k = k.at[i, :, start:start + hi - lo].set(nk[0])
      v = v.at[i, :, start:start + hi - lo].set(nv[0])
  np.testing.assert_array_equal(np.asarray(head_major(k2, layout, paged)), np.asarray(k))
  np.testing.assert_array_equal(np.asarray(head_major(v2, layout, paged)), np.asarray(v))
  # One compiled program, twice: over caches already holding the new tokens (writing them
  # again changes nothing), the step attends to exactly what the fused call attended to.
  again, _, _ = step(jnp.array(k2, copy=True), jnp.array(v2, copy=True), new_k, new_v)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
  expected = fdecode.ragged_decode(p["q"], k, v, p["kv_lens"], p["block_tables"], cu, p["num_seqs"])
  assert_reordered(out, expected, terms=int(max(p["kv_lens"])) + d, scale=max_abs(v))


def test_reordering_bound_takes_rounding_not_errors():
  """`assert_reordered` at the fused test's sizes (31 keys + Dk 32, |v| <= ~4.5) accepts
  what another CPU's fusion gave (322 of 3968 elements off by <= 4.8e-7) and rejects an
  error a wrong key would cause (1e-4), or a NaN in a new place."""
  rng = np.random.default_rng(0)
  want = rng.standard_normal((31, 4, 32)).astype(np.float32)
  got = want.copy()
  got.reshape(-1)[rng.choice(want.size, 322, replace=False)] += rng.uniform(-4.8e-7, 4.8e-7, 322).astype(np.float32)
  assert_reordered(got, want, terms=31 + 32, scale=4.5)
  for bad in (1e-4, np.nan):
    wrong = want.copy()
    wrong[3, 1, 7] += bad
    with pytest.raises(AssertionError):
      assert_reordered(wrong, want, terms=31 + 32, scale=4.5)


def test_pure_decodes_are_flash_decode():
  """A step of decodes only is flash_decode over the caches (in another program: within
  float32 reordering, `assert_reordered`)."""
  p = batch(10, [1] * 6, [5, 17, 33, 64, 1, 90], max_seqs=6, pad_rows=0)
  out = fdecode.ragged_decode(**p)
  expected = fdecode.flash_decode(p["q"], p["k"], p["v"], p["kv_lens"], block_tables=p["block_tables"])
  assert_reordered(out, expected, terms=int(max(p["kv_lens"])) + p["q"].shape[-1], scale=max_abs(p["v"]))


def test_one_compilation_serves_every_mix():
  p = batch(11, [1, 7, 64], [5, 40, 100], max_seqs=4, pad_rows=10)
  step = jax.jit(lambda q, k, v, lens, tables, cu, ns: fdecode.ragged_decode(q, k, v, lens, tables, cu, ns))
  args = [p[n] for n in ("q", "k", "v", "kv_lens", "block_tables", "cu_q_lens")]
  step(*args, np.int32(3))
  mixes = [([30, 30, 1, 1], [30, 90, 2, 64]), ([1, 1, 1, 1], [3, 4, 5, 6]), ([82], [82])]
  before = step._cache_size()
  for q_lens, kv_lens in mixes:
    cu = np.zeros(5, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    lens = np.zeros(4, np.int32)
    lens[:len(kv_lens)] = kv_lens
    out = step(args[0], *args[1:3], lens, args[4], cu, np.int32(len(q_lens)))
    exp = per_sequence(dict(p, kv_lens=lens, cu_q_lens=cu, num_seqs=len(q_lens)))
    assert_close(out[:int(cu[-1])], exp[0], **{k: v for k, v in tol(jnp.float32).items() if k != "lse"})
  assert step._cache_size() == before


BAD = {
    "decreasing cu_q_lens": (dict(cu_q_lens=[0, 5, 3, 8]), "non-decreasing"),
    "cu_q_lens[0] != 0": (dict(cu_q_lens=[1, 5, 6, 8]), r"cu_q_lens\[0\] must be 0"),
    "q_len > kv_len": (dict(kv_lens=[4, 1, 2]), "q_len = 5 new tokens but kv_lens"),
    "rows past N": (dict(cu_q_lens=[0, 5, 6, 99]), "but q has only N"),
    "num_seqs > max_seqs": (dict(num_seqs=4), r"num_seqs must lie in \[0, max_seqs=3\]"),
    "kv_len past capacity": (dict(kv_lens=[5, 1, 999]), r"kv_lens must lie in \[0, S="),
    "layout mismatch": (dict(kv_layout="NHD"), "does kv_layout match"),
    "bad layout": (dict(kv_layout="BSHD"), "kv_layout must be one of"),
    "cu_q_lens shape": (dict(cu_q_lens=[0, 5, 6]), r"cu_q_lens must be \[max_seqs \+ 1\]"),
    "page id out of pool": (dict(block_tables="bad"), r"block_tables\[1, 0\] = 999 is out of range"),
    "kv_offset": (dict(kv_offset=3), "kv_offset is not taken"),
    "new_k alone": (dict(new_k="ok"), "pass new_k and new_v together"),
    "new_k shape": (dict(new_k="short", new_v="short"), r"new_k must be \[N, Hkv, D\]"),
    "flash_decode option": (dict(window=0), "ragged_decode: window"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_clear_value_error(case):
  p = batch(12, [5, 1, 2], [9, 3, 2], max_seqs=3, hq=4, hkv=2, d=16)
  change, message = BAD[case]
  change = dict(change)
  if change.get("block_tables") == "bad":
    tables = np.array(p["block_tables"])
    tables[1, 0] = 999
    change["block_tables"] = tables
  n = p["q"].shape[0]
  for name in ("new_k", "new_v"):
    if name in change:
      change[name] = jnp.zeros((n - (change[name] == "short"), 2, 16), jnp.float32)
  layout = change.pop("kv_layout", "HND")
  kw = {n: change.pop(n) for n in list(change) if n not in p}
  cache_before = np.array(p["k"])
  with pytest.raises(ValueError, match=message):
    fdecode.ragged_decode(**dict(p, **change), kv_layout=layout, **kw)
  np.testing.assert_array_equal(np.asarray(p["k"]), cache_before)


def test_under_jit_bad_values_are_clipped_not_read_out_of_bounds():
  p = batch(13, [5, 1, 2], [9, 3, 2], max_seqs=3, d=16)
  n = p["q"].shape[0]
  new = jnp.ones((n, 2, 16), jnp.float32)
  step = jax.jit(lambda cu, lens, ns: fdecode.ragged_decode(
      p["q"], p["k"], p["v"], lens, p["block_tables"], cu, ns, new_k=new, new_v=new))
  for cu, lens, ns in (([0, 5, 3, 99], [9, 3, 2], 3), ([0, 5, 6, 8], [1, 999, -4], 7),
                       ([0, 5, 6, 8], [9, 3, 2], -2)):
    out, k, v = step(np.array(cu, np.int32), np.array(lens, np.int32), np.int32(ns))
    assert out.shape == p["q"].shape and k.shape == p["k"].shape
    assert not np.isnan(np.asarray(out)).any()


def test_unknown_keyword_is_a_type_error():
  p = batch(14, [1], [3], max_seqs=1)
  with pytest.raises(TypeError, match="unexpected keyword"):
    fdecode.ragged_decode(**p, lengths=[3])


def test_prefill_blocks_in_one_call_on_the_kernels(impl, request, monkeypatch):
  """With the Pallas kernels a paged step's prefill blocks go to one flash_decode call
  (ceil(N / 64) + min(max_seqs, N // 2) blocks, the unused ones of kv length 0); the XLA
  path loops over the real blocks. A sequence of 300 new tokens spans 5 blocks, the
  first partial; one of 2 new tokens has a 1-row block; dead slots hold NaN. (The Triton
  step, `fdecode.kernels.triton.triton_step`, makes the same call, canonical, for its launch.)"""
  import fdecode.ragged.parts as parts_module
  import fdecode.kernels.triton.ragged_step as step_module
  batches = []

  def spy(module, name, query):
    real = getattr(module, name)

    def call(*args, **kwargs):
      batches.append(query(*args).shape[:2])
      return real(*args, **kwargs)
    monkeypatch.setattr(module, name, call)

  spy(parts_module, "run", lambda c, *a: c.q4)  # the two-part path's calls
  spy(step_module, "plan_view", lambda q, *a: q)  # the Triton step's parts
  p = batch(8, [300, 1, 2, 70], [333, 17, 2, 90], max_seqs=6, pad_rows=5)
  k = np.asarray(p["k"]).copy()  # which pages no table names: NaN there (never read)
  k[:, np.setdiff1d(np.arange(k.shape[1]), p["block_tables"])] = np.nan
  p = dict(p, k=jnp.asarray(k))
  out, lse = fdecode.ragged_decode(**p, impl=impl, return_lse=True)
  check(p, out, lse, per_sequence(p))
  n = p["q"].shape[0]
  prefill = [shape for shape in batches if shape[1] == 64]
  assert prefill, batches
  want = -(-n // 64) + min(6, n // 2) if impl_param(request) != "xla" else 1
  assert {shape[0] for shape in prefill} == {want}, batches


@pytest.mark.parametrize("n_edges,n_x", [(9, 40), (65, 575), (1025, 2048)], ids=["small", "bench", "sorted"])
def test_row_search_has_no_loop(n_edges, n_x):
  """The row -> sequence search equals numpy's ``searchsorted(side="right")`` (repeated
  edges, values outside, both methods: all pairs below ~1M pairs, sort above), and its
  program holds no loop (jnp's default method is a scan, which XLA compiles to a while
  loop: a chain of dependent steps on GPU)."""
  from fdecode.ragged.parts import searchsorted as _searchsorted  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(n_edges)
  edges = np.sort(rng.integers(0, n_x, n_edges)).astype(np.int32)  # cu_q_lens-like: repeats
  x = np.arange(-2, n_x + 2, dtype=np.int32)
  got = jax.jit(_searchsorted)(jnp.asarray(edges), jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got), np.searchsorted(edges, x, side="right"))
  jaxpr = str(jax.make_jaxpr(_searchsorted)(jnp.asarray(edges), jnp.asarray(x)))
  assert "while" not in jaxpr and "scan" not in jaxpr  # jnp's default: a scan, an XLA while loop
