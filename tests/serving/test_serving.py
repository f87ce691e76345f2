"""`fdecode.decoding.serving.Engine`: continuous batching over a tiny `fdecode.models.base.Transformer`.
Served greedy tokens equal generating each request alone; pages return to the pool;
a request that does not fit waits; malformed requests are rejected without disturbing
the batch; each step runs the smallest bucket that holds its tokens, and each bucket
compiles once; sampling is per-request deterministic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fdecode.decoding.generate import generate
from fdecode.models.base import ModelConfig, Transformer
from fdecode.decoding.serving import Engine, Request, StepLimitError, sample, token_buckets
from helpers import counting_compiles
from helpers.serving import CFG


def alone(prompt, n):
  """Greedy tokens of one request through `generate` (prefill + decode, contiguous cache)."""
  model = Transformer(CFG, seed=0)
  model.init_cache(1, len(prompt) + n)
  return generate(model, np.array([prompt]), np.array([len(prompt)]), n).tokens[0].tolist()


def prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, CFG.vocab, size=n).tolist() for n in lengths]


def test_served_greedy_tokens_equal_generation_alone():
  # Two buckets (a small one and the budget): steps of both sizes, two compilations instead of
  # the default ladder's six (the ladder itself: test_each_step_runs_its_smallest_bucket_compiled_once).
  engine = Engine(Transformer(CFG, seed=0), max_seqs=4, token_budget=24, max_len=64, page_size=8,
                  buckets=(8, 24))
  lengths = [3, 30, 1, 17, 9, 5]
  ps = prompts(0, lengths)
  news = [6, 4, 9, 5, 7, 3]
  ids = [engine.submit(Request(p, n, arrival=i)) for i, (p, n) in enumerate(zip(ps, news))]
  done = engine.run()
  assert sorted(done) == ids
  for rid, p, n in zip(ids, ps, news):
    assert done[rid].tokens == alone(p, n), rid
    assert done[rid].reason == "length"
  mixed = [s for s in engine.history if s.decodes and s.prefill_tokens]
  assert mixed, "no step mixed decodes with a prefill chunk"
  assert max(s.running for s in engine.history) == 4  # slots were full at some point
  assert engine.alloc.num_free == engine.alloc.num_pages  # every page back in the pool
  assert {s.rows for s in engine.history} == {8, 24}, [s.rows for s in engine.history]


def test_a_request_that_does_not_fit_waits():
  # 6 pages of 8 tokens: each request below needs 3, so only two run at once. One bucket:
  # waiting is the subject here (buckets: the test above and the one after the next).
  engine = Engine(Transformer(CFG, seed=0), max_seqs=4, token_budget=16, max_len=24, page_size=8, num_pages=6,
                  buckets=(16,))
  ps = prompts(1, [10, 12, 9])
  ids = [engine.submit(Request(p, 10)) for p in ps]
  engine.step()
  assert [live.rid for live in engine.running] == ids[:2] and len(engine.waiting) == 1
  done = engine.run()
  assert done[ids[2]].admitted > 0 and done[ids[2]].admitted >= min(done[ids[0]].finished, done[ids[1]].finished)
  for rid, p in zip(ids, ps):
    assert done[rid].tokens == alone(p, 10)
  assert engine.alloc.num_free == 6


@pytest.mark.parametrize("bad, message", [
    (Request([], 3), "non-empty"),
    (Request([1, 2], 0), "max_new_tokens must be an int >= 1"),
    (Request([1] * 30, 5), "exceed the engine's max_len=32"),
    (Request([1, 200], 3), r"prompt ids must lie in \[0, V=97\)"),
    (Request([1, 2], 3, temperature=float("nan")), "temperature must be a finite float"),
    (Request([1, 2], 3, top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (Request([1, 2], 3, top_k=-1), "top_k must be an int >= 0"),
])
def test_malformed_request_is_rejected_and_the_batch_runs_on(bad, message):
  engine = Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=32, page_size=8)
  good = prompts(2, [5])[0]
  rid = engine.submit(Request(good, 4))
  engine.step()
  with pytest.raises(ValueError, match=message):
    engine.submit(bad)
  done = engine.run()
  assert list(done) == [rid] and done[rid].tokens == alone(good, 4)


def test_each_step_runs_its_smallest_bucket_compiled_once():
  """A long run of many mixes: each step runs over the smallest bucket that holds its
  tokens (M = min(N, max_seqs) sequence rows), each bucket compiles on its first use
  and never again, and a second wave of requests compiles nothing."""
  cfg = ModelConfig(vocab=41, dim=24, layers=2, num_heads=4, num_kv_heads=2, head_dim=6, mlp_dim=40)  # unseen shapes
  engine = Engine(Transformer(cfg, seed=0), max_seqs=3, token_budget=12, max_len=40, page_size=4)
  assert engine.buckets == (1, 2, 4, 8, 12)
  rng = np.random.default_rng(3)
  with counting_compiles() as compiles:
    for wave in range(2):
      for i, n in enumerate([11, 2, 25, 1, 7, 3]):
        engine.submit(Request(rng.integers(0, 41, n).tolist(), 5, arrival=len(engine.history) + 2 * i))
      engine.run()
      if wave == 0:
        first_wave = len(compiles.names)
  steps = engine.history
  for s in steps:
    tokens = s.decodes + s.prefill_tokens
    assert s.rows == min(b for b in engine.buckets if b >= tokens) and s.seqs == min(s.rows, 3), s
  used = {s.rows for s in steps}
  first = {}
  for s in steps:
    first.setdefault(s.rows, s.step)
  assert [s.step for s in steps if s.new_bucket] == sorted(first.values())
  assert sum(s.sampled for s in steps) == 2 * 6 * 5  # every generated token, in the step that made it
  assert used == set(engine.buckets), used  # the run reached every bucket
  assert compiles.count("_serve_step") == len(used) == first_wave, compiles.names
  assert len({(s.decodes, s.prefill_tokens) for s in steps}) > len(used)  # more mixes than buckets


@pytest.mark.parametrize("buckets", [(), (4, 2, 8), (2, 2, 8), (2, 4), (2, 8, 16), (0, 8), (2.0, 8), (True, 8),
                                     "8", 8])
def test_bad_buckets_are_rejected(buckets):
  with pytest.raises(ValueError, match=r"buckets must be increasing ints >= 1 ending at token_budget=8"):
    Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=32, buckets=buckets)


def test_given_buckets_are_used():
  engine = Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=32, buckets=[3, np.int64(8)])
  assert engine.buckets == (3, 8) and engine.bucket(1) == (3, 2) and engine.bucket(4) == (8, 2)
  assert Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=32, buckets=(8,)).bucket(1) == (8, 2)
  with pytest.raises(ValueError, match=r"tokens must be an int in \[1, token_budget=8\]; got 9"):
    engine.bucket(9)
  assert token_buckets(1) == (1,) and token_buckets(12) == (1, 2, 4, 8, 12) and token_buckets(16)[-2:] == (8, 16)
  with pytest.raises(ValueError, match="token_budget must be an int >= 1"):
    token_buckets(0)


def test_sampling_is_deterministic_per_request_and_respects_top_k():
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 50)), jnp.float32)
  args = lambda t, k, p: (jnp.full(3, t, jnp.float32), jnp.full(3, k, jnp.int32), jnp.full(3, p, jnp.float32),
                          jnp.array([7, 7, 8]), jnp.array([0, 0, 0]))
  greedy = sample(logits, *args(0.0, 0, 1.0))
  np.testing.assert_array_equal(greedy, jnp.argmax(logits, -1))
  top1 = sample(logits, *args(5.0, 1, 1.0))  # top-k 1 is greedy at any temperature
  np.testing.assert_array_equal(top1, greedy)
  a = np.asarray(sample(logits, *args(2.0, 5, 0.9)))
  b = np.asarray(sample(logits, *args(2.0, 5, 0.9)))
  np.testing.assert_array_equal(a, b)
  top5 = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
  assert all(a[i] in top5[i] for i in range(3))


def test_sampled_requests_do_not_depend_on_their_batch():
  req = lambda p: Request(p, 6, temperature=0.8, top_p=0.9, seed=11)
  p = prompts(4, [7])[0]
  solo = Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=32, page_size=8)
  rid = solo.submit(req(p))
  ref = solo.run()[rid].tokens
  busy = Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=32, page_size=8)
  busy.submit(Request(prompts(5, [12])[0], 8))
  rid = busy.submit(req(p))
  assert busy.run()[rid].tokens == ref


@pytest.mark.parametrize("field, value, message", [
    ("temperature", True, "temperature must be a finite float"),
    ("top_k", True, "top_k must be an int >= 0"),
    ("top_p", True, r"top_p must lie in \(0, 1\]"),
    ("seed", False, "seed must be an int"),
    ("arrival", True, "arrival must be an int >= 0"),
    ("max_new_tokens", np.bool_(True), "max_new_tokens must be an int >= 1"),
])
def test_bools_are_not_numbers_in_a_request(field, value, message):
  """True passed as top_k 1, temperature 1.0, top_p 1.0 (while max_new_tokens rejected it)."""
  engine = Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=32, page_size=8)
  with pytest.raises(ValueError, match=message):
    engine.submit(Request([1, 2], **dict(dict(max_new_tokens=3), **{field: value})))
  assert not engine.waiting


@pytest.mark.parametrize("kw, message", [
    (dict(num_pages=True), r"num_pages must be an int in \[1, 8\]"),
    (dict(eos_id=10 ** 9), r"eos_id must be None or a token id, an int in \[0, V=97\); got 1000000000"),
    (dict(eos_id="x"), "eos_id must be None or a token id"),
    (dict(eos_id=True), "eos_id must be None or a token id"),
    (dict(eos_id=-1), "eos_id must be None or a token id"),
    (dict(max_seqs=True), "max_seqs must be an int"),
])
def test_engine_sizes_and_eos_id_are_checked(kw, message):
  """eos_id was never checked: 10**9 or 'x' silently disabled stopping; a pool of True pages was one page."""
  with pytest.raises(ValueError, match=message):
    Engine(Transformer(CFG, seed=0), **dict(dict(max_seqs=2, token_budget=8, max_len=32, page_size=8), **kw))


def test_a_later_arrival_submitted_first_does_not_hold_back_a_ready_one():
  """First come, first served means first *arrived*: a request submitted first with
  arrival 6 kept a ready one (arrival 0) waiting, both slots idle, for 6 steps."""
  engine = Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=32, page_size=8)
  ps = prompts(6, [4, 5])
  late = engine.submit(Request(ps[0], 3, arrival=6))
  ready = engine.submit(Request(ps[1], 3, arrival=0))
  done = engine.run()
  assert done[ready].admitted == 0 and done[late].admitted == 6
  assert done[ready].tokens == alone(ps[1], 3) and done[late].tokens == alone(ps[0], 3)


def test_run_with_max_steps_raises_and_the_engine_goes_on():
  """run(max_steps) returned a partial result ({}) with requests still waiting and no
  word of it, while its docstring said it steps until every request finished. Now it
  raises StepLimitError (the finished ones and the unfinished ids attached); the engine
  is intact and run() finishes the rest."""
  engine = Engine(Transformer(CFG, seed=0), max_seqs=2, token_budget=8, max_len=32, page_size=8)
  ps = prompts(7, [3, 6])
  first = engine.submit(Request(ps[0], 2))
  second = engine.submit(Request(ps[1], 2, arrival=9))
  with pytest.raises(StepLimitError, match=r"1 request\(s\) unfinished after max_steps=4 steps \(0 running, "
                                           r"1 waiting") as err:
    engine.run(max_steps=4)
  assert list(err.value.finished) == [first] and err.value.unfinished == [second]
  for bad in (0, True, 2.0):
    with pytest.raises(ValueError, match="max_steps must be None or an int >= 1"):
      engine.run(max_steps=bad)
  done = engine.run()
  assert sorted(done) == [first, second]
  assert done[first].tokens == alone(ps[0], 2) and done[second].tokens == alone(ps[1], 2)


def test_a_step_leaves_the_weights_in_place_and_writes_the_pool():
  """The step takes the weights as inputs only (no copy of them per step); the pool comes
  back written (donated: the old one is gone) and is the model's cache."""
  model = Transformer(CFG, seed=0)
  engine = Engine(model, max_seqs=2, token_budget=8, max_len=32, page_size=8)
  weights = jax.tree.leaves(nnx.state(model, nnx.Param))
  pool = model.blocks[0].attn.cached_key[...]
  engine.submit(Request(prompts(6, [5])[0], 2))
  engine.step()
  assert all(a is b for a, b in zip(weights, jax.tree.leaves(nnx.state(model, nnx.Param))))
  written = model.blocks[0].attn.cached_key[...]
  assert pool.is_deleted() and float(jnp.abs(written).sum()) > 0
