"""The model front door rejects bad input with a readable error: token ids (`generate`,
`beam_search`, `sample_n`), sampling temperatures (checked in float32, where they are
used; tiny ones sample the argmax instead of token 0). GGUF, tokenizer and CLI checks:
tests/models/test_front_door_gguf.py."""

import jax
import numpy as np
import pytest

from fdecode.decoding.beam import beam_search, sample_n
from fdecode.cache import PageAllocator
from fdecode.decoding.generate import generate
from fdecode.models.base import ModelConfig, Transformer

TINY = ModelConfig(vocab=64, dim=32, layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
PROMPT = np.random.default_rng(0).integers(0, TINY.vocab, 10).astype(np.int32)


def _paged(k):
  model = Transformer(TINY, seed=3)
  model.init_cache(batch=k, max_len=32, page_size=4)
  return model


def _contiguous(b):
  model = Transformer(TINY, seed=3)
  model.init_cache(b, 32)
  return model


@pytest.mark.parametrize("bad, where", [(64, 3), (-1, 0), (2**32 + 3, 9)])
def test_beam_and_sampling_reject_out_of_vocabulary_prompt_ids(bad, where):
  """An id >= V gave NaN scores and tokens 0, 1, 2; a negative one wrapped; an int64 id
  past int32 wrapped to a valid one (2**32 + 3 -> 3)."""
  prompt = PROMPT.astype(np.int64)
  prompt[where] = bad
  alloc = PageAllocator(16, 4, 8)
  pattern = rf"prompt ids must lie in \[0, V=64\) .* got prompt\[{where}\] = {bad} \(1 id"
  with pytest.raises(ValueError, match=pattern):
    beam_search(_paged(2), prompt, beams=2, steps=3, allocator=alloc)
  with pytest.raises(ValueError, match=pattern):
    sample_n(_paged(2), prompt, 2, 3, jax.random.key(0), allocator=alloc)
  assert alloc.num_free == 16  # nothing allocated


def test_beam_prompt_padding_is_ignored():
  """Ids past prompt_length are padding: any value, the same result as zeros."""
  padded = np.concatenate([PROMPT[:6], [-5, 10**6, 64, 99]])
  a = beam_search(_paged(2), padded, 6, beams=2, steps=3)
  b = beam_search(_paged(2), np.concatenate([PROMPT[:6], np.zeros(4, np.int32)]), 6, beams=2, steps=3)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.scores, b.scores)


def test_generate_checks_prompt_ids_dtype_and_lengths():
  prompts = np.stack([PROMPT, PROMPT]).astype(np.int64)
  lengths = np.array([10, 4])
  bad = prompts.copy()
  bad[1, 2] = 64
  with pytest.raises(ValueError, match=r"prompts ids must lie in \[0, V=64\) .* prompts\[1, 2\] = 64"):
    generate(_contiguous(2), bad, lengths, 3)
  bad[1, 2] = -(2**40)
  with pytest.raises(ValueError, match=r"prompts\[1, 2\] = -1099511627776"):
    generate(_contiguous(2), bad, lengths, 3)
  with pytest.raises(ValueError, match="prompts must hold integer token ids; got dtype float32"):
    generate(_contiguous(2), prompts.astype(np.float32), lengths, 3)
  with pytest.raises(ValueError, match="prompt_lengths must be integers; got dtype float64"):
    generate(_contiguous(2), prompts, lengths * 1.0, 3)
  with pytest.raises(ValueError, match=r"steps must be an int >= 1, got 2.0"):
    generate(_contiguous(2), prompts, lengths, 2.0)
  with pytest.raises(ValueError, match=r"prompt_lengths\[1\]=0"):
    generate(_contiguous(2), prompts, np.array([10, 0]), 3)
  with pytest.raises(ValueError, match=r"<= S=32 .* prompt_lengths\[0\]=10, steps=30"):
    generate(_contiguous(2), prompts, lengths, 30)
  # Padding (past each length) may hold anything: the same tokens as zero padding.
  garbage = prompts.copy()
  garbage[1, 4:] = [-1, 2**40, 64, 7, 7, 7]
  zeros = prompts.copy()
  zeros[1, 4:] = 0
  np.testing.assert_array_equal(generate(_contiguous(2), garbage, lengths, 3).tokens,
                                generate(_contiguous(2), zeros, lengths, 3).tokens)


@pytest.mark.parametrize("temperature", [1e-38, 1e-50, 5e-45])
def test_tiny_temperature_samples_the_argmax(temperature):
  """1e-38 is subnormal in float32 (XLA flushes it to 0) and 1e-50 underflows: both used to
  give token 0 for every sample (0 / 0, then -inf everywhere); the T -> 0 limit is greedy."""
  greedy = generate(_contiguous(1), PROMPT[None], [10], 4).tokens[0]
  assert greedy[0] != 0  # so that "token 0" would be wrong
  out = sample_n(_paged(3), PROMPT, 3, 4, jax.random.key(1), temperature)
  np.testing.assert_array_equal(out.tokens, np.broadcast_to(greedy, (3, 4)))
  assert np.isfinite(out.scores).all()


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), 1e39, 10**400, True,
                                         "1.0", None, np.float64(3.5e38)])
def test_sampling_rejects_temperatures_not_usable_in_float32(temperature):
  alloc = PageAllocator(16, 4, 8)
  with pytest.raises(ValueError, match=r"temperature must be a real number > 0 and finite in float32 "
                                       r"\(at most 3\.403e\+38\).* got "):
    sample_n(_paged(2), PROMPT, 2, 3, jax.random.key(0), temperature, allocator=alloc)
  assert alloc.num_free == 16
