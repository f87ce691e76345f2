"""The batch-invariant mode (``batch_invariant=True``): a sequence's output and lse are
bit-identical whatever else is in the batch, and whether its token was decoded alone, as a
row of a multi-token (prefill) call or in a ragged step. Compared with ``np.array_equal``,
in the manner of FlashInfer's batch-invariance test: rows of a batch against the same rows
computed in a smaller one."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas import tpu as pltpu

import fdecode
from fdecode.kernels.xla.invariant import SPLIT_SIZE

SPLIT = 16  # small splits: every case crosses several


def same(a, b):
  return np.array_equal(np.asarray(a), np.asarray(b))


def _cache(rng, b, hkv, s, d, dtype, dv=None):
  k = jnp.asarray(rng.standard_normal((b, hkv, s, d)), dtype)
  v = jnp.asarray(rng.standard_normal((b, hkv, s, dv or d)), dtype)
  return k, v


def _paged(k, v, page_size, rng):
  """Contiguous [B, Hkv, S, D] caches as a shuffled pool [Hkv, P, ps, D] and its table."""
  b, hkv, s, _ = k.shape
  n = s // page_size
  ids = rng.permutation(b * n + 3)[:b * n].reshape(b, n)
  pool = lambda x: jnp.zeros((hkv, b * n + 3, page_size, x.shape[-1]), x.dtype).at[:, ids.reshape(-1)].set(
      x.reshape(b, hkv, n, page_size, -1).transpose(1, 0, 2, 3, 4).reshape(hkv, b * n, page_size, -1))
  return pool(k), pool(v), jnp.asarray(ids, jnp.int32)


def _forms(rng, b, hkv, s, d, dtype, form):
  """(k, v, options) of one cache form holding the same logical cache."""
  k, v = _cache(rng, b, hkv, s, d, dtype)
  if form == "contiguous":
    return k, v, {}
  if form == "nhd":
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), dict(kv_layout="NHD")
  if form.startswith("paged"):
    pk, pv, tables = _paged(k, v, int(form[5:]), rng)
    return pk, pv, dict(block_tables=tables)
  if form == "int8":
    ks = jnp.asarray(rng.uniform(0.01, 0.03, (b, hkv, s, 1)), jnp.float32)
    qk = jnp.asarray(rng.integers(-127, 128, (b, hkv, s, d)), jnp.int8)
    qv = jnp.asarray(rng.integers(-127, 128, (b, hkv, s, d)), jnp.int8)
    return qk, qv, dict(k_scale=ks, v_scale=ks)
  if form == "mla":
    return k, None, dict(v_head_dim=d // 2)
  raise ValueError(form)


def _take(opts, rows):
  """The options of a sub-batch (per-sequence arrays sliced)."""
  out = {}
  for n, x in opts.items():
    if n in ("block_tables", "k_scale", "v_scale", "mask", "bias") and hasattr(x, "shape") and x.shape[0] > 1:
      x = x[rows]
    out[n] = x
  return out


FORMS = ["contiguous", "nhd", "paged1", "paged8", "int8", "mla"]
# The paths that run the mode: the XLA path, and the Pallas kernels' invariant plans in their
# interpreters running the compiled plans: Triton's (impl="pallas" on CPU: an H100's plan) and
# Mosaic's (a TPU InterpretParams: v5e's), key blocks of SPLIT so that a split is one block.
IMPLS = {"xla": dict(), "triton": dict(impl="pallas", block_k=SPLIT),
         "mosaic": dict(impl="pallas", interpret=pltpu.InterpretParams(), block_k=SPLIT)}
F32, BF16 = jnp.float32, jnp.bfloat16
# Every form in both dtypes on the XLA path. The interpreters (10-20 s a case, so the fewest that
# cover each kernel's reads), float32 and paged bfloat16: Triton contiguous, page size 1, 8-bit
# and MLA (a token-major cache is the contiguous read with another BlockSpec); Mosaic contiguous
# and a token-major pool read in place (its page size 1 took 53 s, a DMA a position).
INTERPRETED = {"triton": ["contiguous", "paged1", "int8", "mla"], "mosaic": ["contiguous", "nhd"]}
CASES = [pytest.param(i, f, d, id=f"{i}-{f}-{jnp.dtype(d).name}") for i, f, d in
         [("xla", f, d) for f in FORMS for d in (F32, BF16)]
         + [(i, f, F32) for i, forms in INTERPRETED.items() for f in forms]
         + [(i, "paged8", BF16) for i in INTERPRETED]]
# The modifiers the interpreters run: those that make a kernel's rows see different blocks or
# slots (the XLA path runs them all; the others are elementwise on the scores, as in the default
# plans the kernel tests check).
MODIFIERS = ["window", "softcap", "alibi", "sinks", "mask", "bias", "noncausal"]
KERNEL_MODIFIERS = {"window", "mask"}


def _decode_vs_prefill(impl, form, dtype, extra):
  """(rows of a T-token call, each token decoded alone) over the lengths the tests use."""
  rng = np.random.default_rng(0)
  b, hkv, g, d, s, t = 3, 2, 3, 32, 112, 7  # T * G = 21 rows: two of the interpreter's 16-row tiles
  k, v, opts = _forms(rng, b, hkv, s, d, dtype, form)
  q = jnp.asarray(rng.standard_normal((b, t, hkv * g, d)), dtype)
  # Rows at positions 27-33 (2s - 1, 2s, 2s + 1), 96-102 (length 97) and 105-111 (S - 1).
  lengths = jnp.array([2 * SPLIT + 2, 6 * SPLIT + t, s], jnp.int32)
  mode = dict(**IMPLS[impl], **extra, **opts)
  call = jax.jit(lambda q, k, v, n: fdecode.flash_decode(q, k, v, n, return_lse=True, **mode))  # one compile a shape
  out, lse = call(q, k, v, lengths)
  alone = [call(q[:, i], k, v, lengths - (t - 1 - i)) for i in range(t)]
  return (q, k, v, lengths, opts, mode), (out, lse), alone


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_the_comparison_sees_splits_laid_from_the_length(impl):
  """The control: outside the mode, with splits dealt over each call's own length, decoding
  a token alone gives other bits than its row of the prefill (so the tests below can fail).
  (Mosaic's default plan deals its splits by the same `block.split_range`: 5 of 7 rows differ,
  measured; its own control is test_mosaic_row_sums_hold_at_32_rows_of_128_positions.)"""
  _, (out, lse), alone = _decode_vs_prefill(impl, "contiguous", jnp.float32, dict(num_splits=2))
  assert sum(not same(o1, out[:, i]) for i, (o1, _) in enumerate(alone)) >= 3


@pytest.mark.parametrize("impl, form, dtype", CASES)
def test_prefill_rows_equal_decoding_each_token(impl, form, dtype):
  """Each row of a T-token call equals that token decoded alone (length = its position + 1),
  at lengths around split boundaries (s - 1, s, s + 1) and 97; and a sequence alone equals
  its rows in the batch."""
  (q, k, v, lengths, opts, mode), (out, lse), alone = _decode_vs_prefill(
      impl, form, dtype, dict(batch_invariant=True, split_size=SPLIT))
  t = q.shape[1]
  ref = fdecode.flash_decode(q, k, v, lengths, impl="reference", **opts)
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)
  for i, (o1, l1) in enumerate(alone):
    assert same(o1, out[:, i]) and same(l1, lse[:, i]), f"token {i}"
  for bi in (1,) if impl == "xla" else ():  # a sequence's place in the batch: test_randomized_batches too
    rows = slice(bi, bi + 1)
    o2, l2 = fdecode.flash_decode(q[rows], k if "block_tables" in opts else k[rows], v if v is None or "block_tables" in opts
                                  else v[rows], lengths[rows], return_lse=True, **_take(mode, rows))
    assert same(o2, out[rows]) and same(l2, lse[rows]), f"sequence {bi} alone"


def test_mosaic_row_sums_hold_at_32_rows_of_128_positions():
  """The Mosaic kernels hold all of a kv head's rows, T * G of them padded to 8: at 32 rows
  and key blocks of 128, XLA:CPU's sum along the last axis rounds a row otherwise than at 8
  (the interpreter's float32 decode and prefill differed in every row, measured), so the
  mode's row sums are products (`fdecode.kernels.common.block.row_sums`)."""
  rng = np.random.default_rng(6)
  b, hkv, g, d, s, t = 2, 2, 4, 64, 512, 8
  k, v = _cache(rng, b, hkv, s, d, jnp.float32)
  q = jnp.asarray(rng.standard_normal((b, t, hkv * g, d)), jnp.float32)
  n = jnp.array([300, 512], jnp.int32)
  mode = dict(IMPLS["mosaic"], batch_invariant=True, split_size=256, block_k=128)
  call = jax.jit(lambda q, n: fdecode.flash_decode(q, k, v, n, return_lse=True, **mode))
  out, lse = call(q, n)
  for i in range(t):
    o1, l1 = call(q[:, i], n - (t - 1 - i))
    assert same(o1, out[:, i]) and same(l1, lse[:, i]), f"token {i}"


MODS = {"window": dict(window=7), "softcap": dict(logits_soft_cap=5.0), "alibi": dict(alibi=True),
        "sinks": dict(sinks=True), "mask": dict(mask=True), "bias": dict(bias=True), "noncausal": dict(causal=False)}


@pytest.mark.parametrize("impl, mods", [pytest.param(i, MODS[m], id=f"{i}-{m}") for i in IMPLS for m in MODIFIERS
                                        if i == "xla" or m in KERNEL_MODIFIERS])
def test_modifiers_keep_rows_invariant(mods, impl):
  rng = np.random.default_rng(1)
  b, hkv, g, d, s, t = 3, 2, 2, 16, 64, 4
  k, v = _cache(rng, b, hkv, s, d, jnp.float32)
  q = jnp.asarray(rng.standard_normal((b, t, hkv * g, d)), jnp.float32)
  lengths = jnp.array([SPLIT + 1, 40, s], jnp.int32)
  opts = {}
  if "window" in mods:
    opts["window"] = mods["window"]
  if "logits_soft_cap" in mods:
    opts["logits_soft_cap"] = mods["logits_soft_cap"]
  if "alibi" in mods:
    opts["alibi_slopes"] = jnp.asarray(rng.uniform(0.01, 0.2, hkv * g), jnp.float32)
  if "sinks" in mods:
    opts["sinks"] = jnp.asarray(rng.standard_normal(hkv * g), jnp.float32)
  mask = jnp.asarray(rng.random((b, s)) < 0.7) if "mask" in mods else None
  bias = jnp.asarray(rng.standard_normal((b, s)), jnp.float32) if "bias" in mods else None
  causal = mods.get("causal", True)
  mode = dict(batch_invariant=True, split_size=SPLIT, causal=causal, **IMPLS[impl], **opts)
  extra = lambda rows: {n: x[rows] for n, x in (("mask", mask), ("bias", bias)) if x is not None}
  out, lse = fdecode.flash_decode(q, k, v, lengths, return_lse=True, **mode, **extra(slice(None)))
  decode = jax.jit(lambda q, n: fdecode.flash_decode(q, k, v, n, return_lse=True, **mode, **extra(slice(None))))
  ref = fdecode.flash_decode(q, k, v, lengths, impl="reference", causal=causal, **opts, **extra(slice(None)))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
  if causal:
    for i in range(t):
      o1, l1 = decode(q[:, i], lengths - (t - 1 - i))
      assert same(o1, out[:, i]) and same(l1, lse[:, i]), f"token {i}"
  rows = slice(1, 2)
  o2, l2 = fdecode.flash_decode(q[rows], k[rows], v[rows], lengths[rows], return_lse=True, **mode, **extra(rows))
  assert same(o2, out[rows]) and same(l2, lse[rows])


@pytest.mark.parametrize("impl", list(IMPLS))
def test_randomized_batches(impl):
  """A sequence's rows in random batches (its place, the others' lengths and contents, the
  batch's capacity: 5 to 13 splits, which one reduction over all splits would round by)
  equal it alone, run to run. (Capacities in whole key blocks: docs/semantics.md says why.)"""
  rng = np.random.default_rng(2)
  hkv, g, d = 2, 4, 32
  s_own = 80
  k0, v0 = _cache(rng, 1, hkv, s_own, d, jnp.float32)
  q0 = jnp.asarray(rng.standard_normal((1, 2, hkv * g, d)), jnp.float32)
  n0 = jnp.array([61], jnp.int32)
  mode = dict(batch_invariant=True, split_size=SPLIT, **IMPLS[impl])
  alone, alone_lse = fdecode.flash_decode(q0, k0, v0, n0, return_lse=True, **mode)
  trials = 4 if impl == "xla" else 2
  for trial in range(trials):
    b = int(rng.integers(2, 7))
    s = int(rng.choice([s_own, 96, 208]))
    at = int(rng.integers(0, b))
    k, v = _cache(rng, b, hkv, s, d, jnp.float32)
    k = k.at[at, :, :s_own].set(k0[0]).at[at, :, s_own:].set(jnp.nan)  # garbage past its capacity
    v = v.at[at, :, :s_own].set(v0[0]).at[at, :, s_own:].set(jnp.inf)
    q = jnp.asarray(rng.standard_normal((b, 2, hkv * g, d)), jnp.float32).at[at].set(q0[0])
    lengths = jnp.asarray(rng.integers(2, s + 1, b), jnp.int32).at[at].set(n0[0])
    out, lse = fdecode.flash_decode(q, k, v, lengths, return_lse=True, **mode)
    assert same(out[at], alone[0]) and same(lse[at], alone_lse[0]), f"trial {trial}: B={b} S={s} at {at}"


@pytest.mark.parametrize("impl", list(IMPLS))
def test_ragged_step_rows_equal_flash_decode(impl):
  """A ragged step's rows (a prefill chunk and decodes beside it) equal flash_decode of each
  sequence alone, decoded token by token."""
  rng = np.random.default_rng(3)
  hkv, g, d, ps = 2, 2, 16, 8
  m, cap = 3, 48
  n_pages = m * (cap // ps)
  kp = jnp.asarray(rng.standard_normal((hkv, n_pages, ps, d)), jnp.float32)
  vp = jnp.asarray(rng.standard_normal((hkv, n_pages, ps, d)), jnp.float32)
  tables = jnp.asarray(rng.permutation(n_pages).reshape(m, cap // ps), jnp.int32)
  q_lens = [5, 1, 1]
  kv_lens = jnp.array([SPLIT + 2, 33, 17], jnp.int32)
  cu = jnp.array(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  q = jnp.asarray(rng.standard_normal((sum(q_lens), hkv * g, d)), jnp.float32)
  mode = dict(batch_invariant=True, split_size=SPLIT, **IMPLS[impl])
  out, lse = fdecode.ragged_decode(q, kp, vp, kv_lens, tables, cu, jnp.array([m], jnp.int32), return_lse=True,
                                   **mode)
  decode = jax.jit(lambda q, n, table: fdecode.flash_decode(q, kp, vp, n, block_tables=table, return_lse=True,
                                                             **mode))
  row = 0
  for i, ql in enumerate(q_lens):
    for j in range(ql):
      o1, l1 = decode(q[row][None], kv_lens[i:i + 1] - (ql - 1 - j), tables[i:i + 1])
      assert same(o1[0], out[row]) and same(l1[0], lse[row]), f"sequence {i} row {j}"
      row += 1


def test_jit_and_grad():
  rng = np.random.default_rng(4)
  k, v = _cache(rng, 2, 2, 40, 16, jnp.float32)
  q = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
  n = jnp.array([40, 17], jnp.int32)
  f = lambda q, k, v: fdecode.flash_decode(q, k, v, n, batch_invariant=True, split_size=SPLIT)
  assert same(jax.jit(f)(q, k, v), f(q, k, v))
  g = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
  gr = jax.grad(lambda q, k, v: jnp.sum(fdecode.flash_decode(q, k, v, n, impl="reference") ** 2),
                argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, gr):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_plan_does_not_depend_on_the_batch(platform):
  """Under the mode, the plan's split size and count depend on the cache capacity only."""
  plans = []
  for b in (1, 8, 64):
    q = jax.ShapeDtypeStruct((b, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, 8, 32768, 128), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((b,), jnp.int32)
    (p,) = fdecode.plan(q, k, k, n, platform=platform, batch_invariant=True)
    plans.append(p)
  if platform == "gpu":  # the Triton kernel's invariant plan: the batch is its grid's first axis, nothing more
    assert all(dataclasses.replace(p.work, items=0, batch=0) == dataclasses.replace(plans[0].work, items=0, batch=0)
               and dataclasses.replace(p, work=plans[0].work) == plans[0] for p in plans), plans
    assert plans[0].work.split_blocks * plans[0].launch.block == SPLIT_SIZE
    assert plans[0].work.num_splits == 32768 // SPLIT_SIZE and plans[0].rows.row_blocks == 1
    return
  if platform == "tpu":  # the Mosaic kernels' invariant plan (nothing of it names B)
    assert all(p == plans[0] for p in plans), plans
    assert plans[0].backend == "mosaic" and plans[0].split_blocks * plans[0].sizes.block == SPLIT_SIZE
    assert plans[0].num_splits == 32768 // SPLIT_SIZE
    return
  assert all(p == plans[0] for p in plans), plans
  assert plans[0].split_size == SPLIT_SIZE and plans[0].num_splits == 32768 // SPLIT_SIZE


def test_paged_split_rounds_up_to_pages():
  q = jax.ShapeDtypeStruct((2, 8, 64), jnp.float32)
  k = jax.ShapeDtypeStruct((2, 40, 24, 64), jnp.float32)
  (p,) = fdecode.plan(q, k, k, jax.ShapeDtypeStruct((2,), jnp.int32), block_tables=jax.ShapeDtypeStruct((2, 10),
                      jnp.int32), batch_invariant=True, split_size=50, platform="cpu")
  assert p.split_size == 72 and p.num_splits == 4


@pytest.mark.parametrize("bad, match", [
    (dict(batch_invariant=True, impl="reference"), "impl None, 'xla' or 'pallas'"),
    (dict(batch_invariant=True, impl="mosaic_gpu"), "impl None, 'xla' or 'pallas'"),
    (dict(batch_invariant=True, num_splits=4), "split_size= instead of num_splits=4"),
    (dict(split_size=64), "pass batch_invariant=True"),
    (dict(batch_invariant=True, split_size=0), "split_size must be a positive int"),
    (dict(batch_invariant="yes"), "batch_invariant must be a bool"),
])
def test_bad_options(bad, match):
  q, k = jnp.zeros((1, 4, 8)), jnp.zeros((1, 2, 16, 8))
  with pytest.raises(ValueError, match=match):
    fdecode.flash_decode(q, k, k, jnp.array([3]), **bad)


def _served_logits(monkeypatch, cfg, batch, invariant):
  """Per-step logits of ``batch[0]`` (the rows it sampled from) served with the others by an
  `Engine`, requests arriving one step apart."""
  from fdecode.decoding import serving  # pylint: disable=g-import-not-at-top
  from fdecode.models.base import Transformer  # pylint: disable=g-import-not-at-top
  seen, sample = [], serving.sample

  def spy(logits, *rest):  # the step's logits [M, V], as the engine samples from them
    jax.debug.callback(lambda l: seen.append(np.asarray(l)), logits)
    return sample(logits, *rest)

  monkeypatch.setattr(serving, "sample", spy)
  serving._serve_step.clear_cache()  # traced anew with the spy (the compiled step closes over its sample)
  engine = serving.Engine(Transformer(cfg, seed=0), max_seqs=4, token_budget=24, max_len=48, page_size=8,
                          buckets=(1, 2, 4, 8, 16, 24), batch_invariant=invariant)
  ids = [engine.submit(serving.Request(p, 5, arrival=i)) for i, p in enumerate(batch)]
  rows = []
  while engine.waiting or engine.running:
    seen.clear()
    schedule, picked = engine._schedule, []
    engine._schedule = lambda: picked.extend(schedule()) or picked
    made = {live.rid: len(live.generated) for live in engine.running}
    engine.step()
    engine._schedule = schedule
    jax.effects_barrier()
    rows += [seen[0][i] for i, (live, _) in enumerate(picked)
             if live.rid == ids[0] and len(live.generated) > made.get(live.rid, 0)]
  monkeypatch.setattr(serving, "sample", sample)
  serving._serve_step.clear_cache()
  return rows, engine


# Wide enough that XLA:CPU's matmuls and sums round by the row count (dim 640: 2026-12-02).
WIDE = dict(vocab=97, dim=640, layers=2, num_heads=4, num_kv_heads=2, head_dim=160, mlp_dim=1024)


def test_engine_logits_do_not_depend_on_the_load_and_equal_a_prefill(monkeypatch):
  """``Engine(batch_invariant=True)``: a request's per-step logits served alone equal those
  served beside three others (arriving later, prefilled in the same steps), bit for bit;
  and a prefill of its prompt and generated tokens (the trainer's recomputation, under the
  mode) gives the same logits."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from fdecode.models.base import ModelConfig, Transformer  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig(**WIDE)
  rng = np.random.default_rng(5)
  prompt = rng.integers(0, cfg.vocab, 11).tolist()
  others = [rng.integers(0, cfg.vocab, n).tolist() for n in (3, 20, 7)]
  alone, engine = _served_logits(monkeypatch, cfg, [prompt], True)
  crowded, _ = _served_logits(monkeypatch, cfg, [prompt] + others, True)
  assert len(alone) == len(crowded) == 5
  for i, (a, b) in enumerate(zip(alone, crowded)):
    assert same(a, b), f"step {i}: {np.abs(a - b).max()}"
  layers = [m for _, m in nnx.iter_graph(engine.model) if hasattr(m, "batch_invariant")]
  assert len(layers) >= 8 and all(m.batch_invariant for m in layers)

  model = Transformer(cfg, seed=0)
  for _, m in nnx.iter_graph(model):
    if hasattr(m, "batch_invariant"):
      m.batch_invariant = True
  tokens = prompt + [int(np.argmax(r)) for r in alone]
  model.init_cache(1, 48)
  prefill = nnx.jit(lambda m, t, n: m.prefill(t, n))
  for j, served in enumerate(alone):
    n = len(prompt) + j
    t = np.zeros((1, 24), np.int32)
    t[0, :n] = tokens[:n]
    logits = np.asarray(prefill(model, jnp.asarray(t), jnp.asarray([n], jnp.int32)))[0]
    assert same(logits, served), f"position {n}: {np.abs(logits - served).max()}"


def test_engine_refuses_a_non_bool_mode():
  from fdecode.decoding.serving import Engine  # pylint: disable=g-import-not-at-top
  from fdecode.models.base import Transformer  # pylint: disable=g-import-not-at-top
  from helpers.serving import CFG  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="batch_invariant must be a bool"):
    Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=16, page_size=4, batch_invariant=1)


@pytest.mark.parametrize("layer", ["RMSNorm", "Linear", "Embed"])
def test_flax_layers_rows_do_not_depend_on_the_row_count(layer):
  """`fdecode.flax.invariant`'s layers in the mode: rows computed among 1..70 rows equal the
  same rows among 96, and match the default computation within float32 rounding."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import fdecode.flax as ff  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(6)
  e = 640
  module = {"RMSNorm": lambda: ff.RMSNorm(e, rngs=nnx.Rngs(0)), "Linear": lambda: ff.Linear(e, 320, rngs=nnx.Rngs(0)),
            "Embed": lambda: ff.Embed(97, e, rngs=nnx.Rngs(0))}[layer]()
  call = (lambda m, x: m.attend(x)) if layer == "Embed" else (lambda m, x: m(x))
  x = jnp.asarray(rng.standard_normal((96, e)), jnp.float32)
  default = np.asarray(call(module, x))
  module.batch_invariant = True
  f = nnx.jit(call)
  full = np.asarray(f(module, x))
  np.testing.assert_allclose(full, default, rtol=2e-5, atol=2e-5)
  for n in (1, 2, 5, 32, 33, 70):
    assert same(f(module, x[:n]), full[:n]), n
  assert same(f(module, x.reshape(8, 12, e)), full.reshape(8, 12, -1))


def test_corruption_a_row_sees_propagates_and_dead_slots_never_leak():
  """Under the mode too: a NaN key or an inf value a row sees makes that row NaN; garbage in
  slots no row sees changes no bit."""
  rng = np.random.default_rng(7)
  k, v = _cache(rng, 2, 2, 48, 16, jnp.float32)
  q = jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.float32)
  n = jnp.array([30, 48], jnp.int32)
  mode = dict(batch_invariant=True, split_size=SPLIT)
  clean, clean_lse = fdecode.flash_decode(q, k, v, n, return_lse=True, **mode)
  dead = fdecode.flash_decode(q, k.at[0, :, 30:].set(jnp.nan), v.at[0, :, 30:].set(jnp.inf), n, **mode)
  assert same(dead, clean)
  seen = fdecode.flash_decode(q, k.at[0, 1, 28].set(jnp.nan), v.at[1, 0, 5].set(jnp.inf), n, return_lse=True, **mode)
  out, lse = map(np.asarray, seen)
  assert np.isnan(out[0, 1:, 2:]).all() and np.isnan(lse[0, 1:, 2:]).all()  # kv head 1 (heads 2, 3) at positions >= 28
  assert not np.isnan(out[0, :, :2]).any()
  assert same(out[0, 0], clean[0, 0])  # the first token (position 27) does not see slot 28
  assert np.isnan(out[1, :, :2]).all() and same(out[1, :, 2:], clean[1, :, 2:])


def test_sharded_over_heads_gives_the_single_device_rows():
  """`sharded_flash_decode` under the mode, heads over 2 devices and heads x sequence over
  2 x 2: the head-parallel rows are the single-device rows bit for bit; the sequence-
  parallel ones are a merge of per-chunk splits (docs/semantics.md), equal within rounding."""
  rng = np.random.default_rng(8)
  q = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 4, 256, 32)), jnp.float32)
  n = jnp.array([200, 256], jnp.int32)
  mode = dict(batch_invariant=True, split_size=32)
  one = fdecode.flash_decode(q, k, k, n, **mode)
  mesh = jax.make_mesh((2, 2), ("h", "s"))
  heads = fdecode.sharded_flash_decode(q, k, k, n, mesh=mesh, head_axis="h", **mode)
  both = fdecode.sharded_flash_decode(q, k, k, n, mesh=mesh, head_axis="h", seq_axis="s", **mode)
  assert same(heads, one)
  np.testing.assert_allclose(np.asarray(both), np.asarray(one), atol=1e-6, rtol=1e-6)


def test_vmap_and_symbolic_batch_export_keep_the_bits():
  rng = np.random.default_rng(9)
  q = jnp.asarray(rng.standard_normal((3, 8, 32)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((3, 2, 96, 32)), jnp.float32)
  n = jnp.array([5, 96, 50], jnp.int32)
  f = lambda q, k, n: fdecode.flash_decode(q, k, k, n, batch_invariant=True, split_size=32)
  want = f(q, k, n)
  assert same(jax.vmap(lambda q, k, n: f(q[None], k[None], n[None])[0])(q, k, n), want)
  b = jax.export.symbolic_shape("b")[0]
  exp = jax.export.export(jax.jit(f))(jax.ShapeDtypeStruct((b, 8, 32), jnp.float32),
                                      jax.ShapeDtypeStruct((b, 2, 96, 32), jnp.float32),
                                      jax.ShapeDtypeStruct((b,), jnp.int32))
  assert same(exp.call(q, k, n), want) and same(exp.call(q[1:], k[1:], n[1:]), want[1:])
