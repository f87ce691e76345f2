"""Greedy generation (fdecode.decoding.generate) and the generation demo, on tiny models."""

import functools

import jax
import numpy as np
import pytest

import fdecode
from fdecode.cli import synthetic as demo
from fdecode.decoding.generate import Generation, generate
from fdecode.models.base import ModelConfig, Transformer

TINY = ModelConfig(vocab=64, dim=32, layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)


def _run(decode_fn, prompts, lengths, steps, s=32):
  model = Transformer(TINY, decode_fn=decode_fn, seed=3)
  model.init_cache(prompts.shape[0], s)
  return generate(model, prompts, lengths, steps)


def test_flash_decode_generates_the_reference_tokens():
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, TINY.vocab, (3, 12), dtype=np.int32)
  lengths = np.array([12, 5, 1], np.int32)  # each sequence decodes at its own position
  steps = 10
  out = _run(fdecode.flash_decode, prompts, lengths, steps)
  ref = _run(functools.partial(fdecode.flash_decode, impl="reference"), prompts, lengths, steps)
  assert out.tokens.shape == (3, steps) and out.logits.shape == (3, steps, TINY.vocab)
  np.testing.assert_allclose(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert len(out.step_s) == steps - 1


def test_compare_reports_the_first_divergence():
  tokens = np.zeros((2, 4), np.int32)
  logits = np.zeros((2, 4, 8), np.float32)
  logits[..., 0] = 1.0  # argmax 0 with margin 1
  ref = Generation(tokens=tokens, logits=logits, prefill_s=0.0, step_s=[])
  ok, msg = demo._compare(Generation(tokens.copy(), logits.copy(), 0.0, []), ref)
  assert ok, msg
  bad = tokens.copy()
  bad[1, 2:] = 5
  ok, msg = demo._compare(Generation(bad, logits.copy(), 0.0, []), ref)
  assert not ok and "first divergence at step 2 of sequence 1" in msg, msg


@pytest.mark.parametrize("cache", ["contiguous", "paged", "int8"])
def test_demo_main_runs_sharded(capsys, cache):
  rc = demo.main(["--context", "64", "--batch", "2", "--steps", "4", "--layers", "1",
                  "--dim", "32", "--heads", "4", "--kv-heads", "2", "--vocab", "64", "--cache", cache])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "FALLBACK" not in out, out
  assert f"cache: {cache} k+v" in out, out
  last = out.strip().splitlines()[-1]
  assert last.startswith("OK: generated 2x4 tokens (mesh heads=2 x seq=4"), out


def test_steps_leave_the_weights_in_place():
  """generate's steps take the weights as inputs only: afterwards the model holds the very
  same weight arrays (a step that handed them back, as an nnx.jit over the whole model
  does, copied every weight on every call: ~89% of a Gemma 3 270M batch-1 decode step on CPU)."""
  from flax import nnx
  model = Transformer(TINY, seed=3)
  model.init_cache(2, 32)
  before = jax.tree.leaves(nnx.state(model, nnx.Param))  # the arrays themselves
  cache = model.blocks[0].attn.cached_key[...]
  generate(model, np.ones((2, 4), np.int32), np.array([4, 2], np.int32), 3)
  after = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert len(after) == len(before) > 0 and all(a is b for a, b in zip(before, after))
  assert model.blocks[0].attn.cached_key[...] is not cache  # the caches did come back, written
