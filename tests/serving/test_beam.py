"""Beam search and parallel sampling over shared pages (fdecode.decoding.beam), on a tiny model.

Every beam / sample is checked against the same model run on it alone (a batch-1
contiguous cache, no sharing), so a copy-on-write that was missed or went to the wrong
page shows up as a wrong log-probability or a different sampled token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fdecode.decoding.beam import beam_search, sample_n
from fdecode.cache import PageAllocator, PoolExhaustedError
from fdecode.models.base import ModelConfig, Transformer

TINY = ModelConfig(vocab=64, dim=32, layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
SEED, PS = 3, 4
PROMPT = np.random.default_rng(0).integers(0, TINY.vocab, 10).astype(np.int32)  # 2.5 pages


def _paged(k, max_len=32, cache_dtype=None):
  model = Transformer(TINY, seed=SEED)
  model.init_cache(batch=k, max_len=max_len, page_size=PS, cache_dtype=cache_dtype)
  return model


@nnx.jit
def _prefill(model, tokens, lengths):
  return jax.nn.log_softmax(model.prefill(tokens, lengths), axis=-1)


@nnx.jit
def _decode(model, tokens):
  return jax.nn.log_softmax(model.decode(tokens), axis=-1)


def _alone(prompt, steps, *, tokens=None, key=None, temperature=1.0, cache_dtype=None):
  """One sequence on a fresh batch-1 contiguous cache: teacher-forces ``tokens`` (or
  samples with ``key`` as `sample_n` documents) -> (tokens [N], cumulative log-prob)."""
  model = Transformer(TINY, seed=SEED)
  model.init_cache(1, 32, cache_dtype=cache_dtype)
  logp = _prefill(model, jnp.asarray(prompt)[None], jnp.array([len(prompt)]))[0]
  out, total = [], 0.0
  for t in range(steps):
    if t:
      logp = _decode(model, jnp.array([out[-1]], jnp.int32))[0]
    if tokens is not None:
      tok = int(tokens[t])
    else:
      z = logp - logp.max()  # as sample_n documents
      tok = int(jax.random.categorical(jax.random.fold_in(key, t), jnp.where(z == 0, 0.0, z / temperature)))
    out.append(tok)
    total += float(logp[tok])
  return np.array(out), total


def _watch(alloc_pages):
  """on_step callback: checks the allocator's invariants, records distinct pages held."""
  def on_step(step, alloc, ids):
    alloc.check_invariants()
    held = {p for sid in ids for p in alloc.pages(sid)}
    assert len(held) == alloc.num_pages - alloc.num_free  # only the live beams hold pages
    for p in held:
      assert alloc.ref_count(p) == sum(p in alloc.pages(sid) for sid in ids)
    alloc_pages.append((step, len(held)))
  return on_step


def _shared_bound(k, length):
  """Pages K sequences of ``length`` tokens hold at most when they share the prompt's
  full pages, and the bound without sharing."""
  full = len(PROMPT) // PS
  own = -(-length // PS)
  return full + k * (own - full), k * own


@pytest.mark.parametrize("cache_dtype", [None, jnp.int8])
def test_beam_search_scores_equal_single_sequence_runs(cache_dtype):
  beams, steps = 4, 9
  seen = []
  out = beam_search(_paged(beams, cache_dtype=cache_dtype), PROMPT, beams=beams, steps=steps,
                    on_step=_watch(seen))
  assert out.tokens.shape == (beams, steps) and out.scores.shape == (beams,)
  assert [s for s, _ in seen] == list(range(steps))  # (c): invariants checked at every step
  assert len({tuple(t) for t in out.tokens}) == beams
  assert (np.diff(out.scores) <= 0).all()
  for row, score in zip(out.tokens, out.scores):  # (b)
    _, alone = _alone(PROMPT, steps, tokens=row, cache_dtype=cache_dtype)
    np.testing.assert_allclose(score, alone, atol=2e-4, rtol=1e-5)
  shared, unshared = _shared_bound(beams, len(PROMPT) + steps - 1)  # (a)
  assert out.pages_used[-1] == seen[-1][1] <= shared < unshared
  for sid in out.seq_ids:
    out.allocator.free(sid)
  out.allocator.check_invariants()
  assert out.allocator.num_free == out.allocator.num_pages


def test_samples_equal_their_own_single_runs():
  n, steps, temperature = 4, 8, 1.5  # n = 4: the beam tests' compiled shapes
  keys = jax.random.split(jax.random.key(7), n)
  seen = []
  out = sample_n(_paged(n), PROMPT, n, steps, keys, temperature, on_step=_watch(seen))
  assert [s for s, _ in seen] == list(range(steps))
  for i in range(n):  # (b): sample i alone, with its own key
    tokens, score = _alone(PROMPT, steps, key=keys[i], temperature=temperature)
    np.testing.assert_array_equal(out.tokens[i], tokens)
    np.testing.assert_allclose(out.scores[i], score, atol=2e-4, rtol=1e-5)
  assert len({tuple(t) for t in out.tokens}) == n  # distinct keys: distinct samples here
  shared, unshared = _shared_bound(n, len(PROMPT) + steps - 1)
  assert max(out.pages_used) <= shared < unshared
  # One key is split into n, the same as passing the n keys.
  again = sample_n(_paged(n), PROMPT, n, steps, jax.random.key(7), temperature)
  np.testing.assert_array_equal(again.tokens, out.tokens)


def test_pool_exhausted_mid_search_frees_what_it_took():
  alloc = PageAllocator(num_pages=6, page_size=PS, max_pages_per_seq=8)  # too small for 4 beams
  alloc.allocate("other", 5)
  with pytest.raises(PoolExhaustedError):
    beam_search(_paged(4), PROMPT, beams=4, steps=8, allocator=alloc)
  assert alloc.seq_ids == ["other"] and alloc.num_free == 4
  alloc.check_invariants()


def _bad_calls():
  model4, contiguous = _paged(4), Transformer(TINY, seed=SEED)
  contiguous.init_cache(4, 32)
  key = jax.random.key(0)
  return [
      (lambda a: beam_search(model4, PROMPT, beams=0, steps=4, allocator=a), r"beams must be an int >= 1"),
      (lambda a: beam_search(model4, PROMPT, beams=4, steps=0, allocator=a), r"steps must be an int >= 1"),
      (lambda a: beam_search(model4, PROMPT, beams=4, steps=24, allocator=a),
       r"prompt_length \+ steps - 1 <= S .* capacity S=32"),
      (lambda a: beam_search(model4, PROMPT, beams=2, steps=4, allocator=a), r"batch B=4; it must be"),
      (lambda a: beam_search(contiguous, PROMPT, beams=4, steps=4), r"needs a paged cache"),
      (lambda a: beam_search(Transformer(TINY), PROMPT, beams=4, steps=4), r"needs a paged cache"),
      (lambda a: beam_search(model4, PROMPT[None], beams=4, steps=4, allocator=a),
       r"prompt must be int \[L\]"),
      (lambda a: beam_search(model4, PROMPT * 1.0, beams=4, steps=4, allocator=a), r"prompt must be int"),
      (lambda a: beam_search(model4, PROMPT, 11, beams=4, steps=4, allocator=a),
       r"prompt_length must be an int in \[1, L=10\], got 11"),
      (lambda a: beam_search(model4, PROMPT, 0, beams=4, steps=4, allocator=a), r"prompt_length"),
      (lambda a: beam_search(_paged(65, max_len=12), PROMPT, beams=65, steps=1), r"exceeds the vocabulary"),
      (lambda a: beam_search(model4, PROMPT, beams=4, steps=4, allocator=PageAllocator(64, 8, 4)),
       r"allocator must be a PageAllocator with page_size=4"),
      (lambda a: sample_n(model4, PROMPT, 4, 4, key, 0.0, allocator=a), r"temperature must be"),
      (lambda a: sample_n(model4, PROMPT, 4, 4, key, float("nan"), allocator=a), r"temperature must be"),
      (lambda a: sample_n(model4, PROMPT, 4, 4, jax.random.split(key, 3), allocator=a),
       r"key must be one PRNG key or n=4 keys"),
      (lambda a: sample_n(model4, PROMPT, 4, 4, "key", allocator=a), r"key must be a PRNG key"),
      (lambda a: sample_n(model4, PROMPT, -1, 4, key, allocator=a), r"n must be an int >= 1"),
  ]


def test_bad_input_raises_value_error_and_takes_no_page():
  alloc = PageAllocator(32, PS, 8)
  alloc.allocate("other", 3)
  for call, pattern in _bad_calls():
    with pytest.raises(ValueError, match=pattern):
      call(alloc)
    assert alloc.seq_ids == ["other"] and alloc.num_free == 31
