"""Property test of `fdecode.decoding.serving.Engine` (issue 32): random arrivals, prompt lengths,
max_new_tokens, EOS and pool sizes; every request's greedy tokens must be those of
generating it alone (`fdecode.decoding.generate.generate`, one sequence per row, contiguous cache,
no engine), cut at its EOS or max_new_tokens, and the scheduling must keep its promises
(first come, first served by arrival; at most max_seqs running; every page back).

The two are different compiled programs, so a greedy token may differ only where the
reference's top two logits are within float32 noise of each other (checked: then the
rest of that request is not compared). Shapes are fixed, so the step and the reference
compile once each. Profiles as tests/kernels/test_fuzz.py (CI: a fixed seed, a few examples).

Refused calls: an Engine built with one bad argument (buckets, num_pages, a size, eos_id)
raises ValueError naming it and leaves the model exactly as it was (its nnx state, leaf
for leaf); ``bucket`` takes an int in ``[1, token_budget]`` and names ``tokens`` otherwise.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from fdecode.decoding.generate import generate
from fdecode.models.base import Transformer
from fdecode.decoding.serving import Engine, Request
from helpers.fuzz import PROFILE
from helpers.serving import CFG

MAX_SEQS, BUDGET, MAX_LEN, PAGE = 3, 8, 24, 4
MAX_PROMPT, MAX_NEW, MAX_REQUESTS = 14, 8, 6
POOL = MAX_SEQS * -(-MAX_LEN // PAGE)
TIE = 1e-4  # a top-2 logit margin below this is a tie either program may break either way
_MODELS = {}


def _model(kind):
  """One model per role (same weights), kept across examples: the shapes never change,
  so each program compiles once."""
  if kind not in _MODELS:
    _MODELS[kind] = Transformer(CFG, seed=0)
  return _MODELS[kind]


@st.composite
def workloads(draw):
  n = draw(st.integers(1, MAX_REQUESTS))
  reqs = [dict(prompt_len=draw(st.integers(1, MAX_PROMPT)), new=draw(st.integers(1, MAX_NEW)),
               arrival=draw(st.sampled_from([0, 0, 1, 2, 5, 9]))) for _ in range(n)]
  rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
  for r in reqs:
    r["prompt"] = rng.integers(0, CFG.vocab, r["prompt_len"]).tolist()
  need = max(-(-(r["prompt_len"] + r["new"]) // PAGE) for r in reqs)
  pool = draw(st.sampled_from([need, min(need + 2, POOL), POOL]))
  eos = draw(st.sampled_from(["none", "a generated token", "a generated token"]))
  return dict(requests=reqs, num_pages=pool, eos=eos, pick=draw(st.integers(0, 10 ** 6)))


def _alone(reqs):
  """(tokens [R, MAX_NEW], logits [R, MAX_NEW, V]) of each request generated alone."""
  model = _model("reference")
  prompts = np.zeros((MAX_REQUESTS, MAX_PROMPT), np.int32)
  lengths = np.ones(MAX_REQUESTS, np.int32)
  for i, r in enumerate(reqs):
    prompts[i, :r["prompt_len"]], lengths[i] = r["prompt"], r["prompt_len"]
  model.init_cache(MAX_REQUESTS, MAX_PROMPT + MAX_NEW)
  gen = generate(model, prompts, lengths, MAX_NEW)
  return gen.tokens, gen.logits


@settings(settings(PROFILE, max_examples=max(PROFILE.max_examples // 5, 6)))
@given(w=workloads())
def test_served_requests_equal_generation_alone(w):
  reqs = w["requests"]
  tokens, logits = _alone(reqs)
  eos_id = None
  if w["eos"] != "none":  # a token some request generates, so that EOS does stop one
    i = w["pick"] % len(reqs)
    eos_id = int(tokens[i, (w["pick"] // 7) % reqs[i]["new"]])
  engine = Engine(_model("engine"), max_seqs=MAX_SEQS, token_budget=BUDGET, max_len=MAX_LEN, page_size=PAGE,
                  num_pages=w["num_pages"], eos_id=eos_id)
  ids = [engine.submit(Request(r["prompt"], r["new"], arrival=r["arrival"])) for r in reqs]
  done = engine.run()
  assert sorted(done) == ids
  for i, (rid, r) in enumerate(zip(ids, reqs)):
    want = tokens[i, :r["new"]].tolist()
    if eos_id in want:
      want = want[:want.index(eos_id) + 1]
    got = done[rid].tokens
    differ = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if differ is not None:  # only a tie of the reference's top two logits may be broken otherwise
      top2 = np.sort(logits[i, differ])[-2:]
      assert top2[1] - top2[0] < TIE, (f"request {i} ({r}): token {differ} is {got[differ]}, alone "
                                       f"{want[differ]} (margin {top2[1] - top2[0]:.3g}); {got} vs {want}")
      continue
    assert got == want, f"request {i} ({r}, eos {eos_id}): {got} vs {want}"
    assert done[rid].reason == ("eos" if eos_id is not None and want[-1] == eos_id else "length")
  _check_schedule(engine, done, ids, reqs, w["num_pages"])


def _check_schedule(engine, done, ids, reqs, num_pages):
  """First come, first served by (arrival, submission); the slots and the pool bound."""
  order = sorted(range(len(reqs)), key=lambda i: (reqs[i]["arrival"], i))
  admitted = [done[ids[i]].admitted for i in order]
  assert admitted == sorted(admitted), f"admitted out of arrival order: {list(zip(order, admitted))}"
  for rid, r in zip(ids, reqs):
    assert done[rid].admitted >= r["arrival"]
  assert all(s.running <= MAX_SEQS and s.pages_in_use <= num_pages for s in engine.history)
  assert engine.alloc.num_free == num_pages and not engine.running and not engine.waiting


# --- refused calls -----------------------------------------------------------------------

SIZES = dict(max_seqs=MAX_SEQS, token_budget=BUDGET, max_len=MAX_LEN, page_size=PAGE)
# (argument, bad values): each makes the constructor raise ValueError naming the argument.
BAD_ARGS = [
    ("buckets", [(), (4, 2, BUDGET), (2, 2, BUDGET), (2, 4), (2, BUDGET, 2 * BUDGET), (0, BUDGET), (2.0, BUDGET),
                 (True, BUDGET), str(BUDGET), BUDGET, [None]]),
    ("num_pages", [0, -1, POOL + 1, True, 2.0, "4", np.int64(POOL + 5), np.bool_(True)]),
    ("max_seqs", [0, True, 2.5]),
    ("token_budget", [MAX_SEQS - 1, np.float32(BUDGET), None]),
    ("page_size", [0, -PAGE, "4"]),
    ("max_len", [0, False]),
    ("eos_id", [-1, 10 ** 9, "x", True]),
    ("max_seqs", [dict(max_seqs=2 ** 16, token_budget=2 ** 16, max_len=2 ** 20, page_size=1)]),  # pool past int32
]
BUCKET_TOKENS = [True, np.bool_(False), 2.5, 3.0, np.float32(2), 0, -1, BUDGET + 1, "3", None, [1], 1, np.int32(3),
                 np.int64(BUDGET)]


def _snapshot(model):
  """The model's whole nnx state: its tree structure and every leaf's value."""
  leaves, tree = jax.tree.flatten(nnx.state(model))
  return tree, [np.asarray(x) for x in leaves]


@settings(settings(PROFILE, max_examples=max(PROFILE.max_examples // 2, 10)))
@given(bad=st.sampled_from(BAD_ARGS).flatmap(lambda b: st.tuples(st.just(b[0]), st.sampled_from(b[1]))),
       tokens=st.sampled_from(BUCKET_TOKENS))
def test_a_refused_engine_leaves_the_model_and_bucket_names_tokens(bad, tokens):
  model = _model("refused")
  model.init_cache(1, PAGE)  # a cache of its own, which a refused engine must keep
  before = _snapshot(model)
  name, value = bad
  kw = dict(SIZES, **(value if isinstance(value, dict) else {name: value}))
  with pytest.raises(ValueError, match=f"Engine: .*{name}"):
    Engine(model, **kw)
  tree, leaves = _snapshot(model)
  assert tree == before[0], f"{bad}: the refused engine changed the model's state"
  for x, y in zip(leaves, before[1]):
    np.testing.assert_array_equal(x, y, err_msg=f"{bad}: the refused engine changed the model's state")

  engine = Engine(model, **SIZES)
  valid = isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool) and 1 <= tokens <= BUDGET
  if valid:
    n_rows, m = engine.bucket(tokens)
    assert (n_rows, m) == engine.bucket(int(tokens)) and n_rows in engine.buckets and n_rows >= tokens
    return
  kind = ValueError if isinstance(tokens, (int, float, np.number, np.bool_)) else TypeError
  with pytest.raises(kind, match=r"Engine.bucket: tokens must be an int in \[1, token_budget=8\]"):
    engine.bucket(tokens)
