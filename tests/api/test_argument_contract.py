"""The public API's argument contract (issue 48, items 6 and 10): static options are Python
values, or numpy / concrete jax scalars taken as the values they hold, in one domain for
every entry point; a traced one raises ValueError naming it and how to pass it static;
`fdecode.plan` refuses what `flash_decode` refuses; a refused `Engine` leaves the model as it
was, and `Engine.bucket` checks its argument."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fdecode
from fdecode.decoding.serving import Engine
from fdecode.models.base import Transformer
from fdecode.validation import describe
from helpers.serving import CFG

B, HQ, HKV, S, D = 2, 4, 2, 16, 8
RNG = np.random.default_rng(0)
Q = jnp.asarray(RNG.normal(size=(B, HQ, D)), jnp.float32)
K = jnp.asarray(RNG.normal(size=(B, HKV, S, D)), jnp.float32)
V = jnp.asarray(RNG.normal(size=(B, HKV, S, D)), jnp.float32)
LENGTHS = jnp.array([5, S], jnp.int32)
sds = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)

# A numpy scalar for every static option of flash_decode (each a valid value here).
NUMPY_STATICS = [("softmax_scale", np.float32(0.2)), ("window", np.int32(8)), ("num_splits", np.int64(2)),
                 ("causal", np.bool_(True)), ("logits_soft_cap", np.float32(3.0)), ("block_k", np.int32(16)),
                 ("v_head_dim", np.int64(D))]


# --- 1. plan: numpy scalar statics -------------------------------------------------------


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("name,value", NUMPY_STATICS, ids=[n for n, _ in NUMPY_STATICS])
def test_plan_takes_numpy_scalar_statics_as_their_values(name, value, platform):
  """plan traced every keyword with a shape and a dtype, numpy scalars included, and
  flash_decode then refused them as traced statics."""
  want = fdecode.plan(Q, K, V, LENGTHS, platform=platform, **{name: value.item()})
  assert fdecode.plan(Q, K, V, LENGTHS, platform=platform, **{name: value}) == want


# --- 2. plan: only None means the host ---------------------------------------------------


@pytest.mark.parametrize("platform", ["", 0, False, "cuda", "CPU", ["cpu"]])
def test_plan_refuses_platforms_other_than_none_cpu_gpu_tpu(platform):
  """``platform or jax.default_backend()`` took "", 0 and False for the host."""
  with pytest.raises(ValueError, match=r"plan: platform must be 'cpu', 'gpu', 'tpu' or None .*got "
                                       + re.escape(describe(platform))):
    fdecode.plan(Q, K, V, LENGTHS, platform=platform)
  assert fdecode.plan(Q, K, V, LENGTHS, platform=None) == fdecode.plan(Q, K, V, LENGTHS,
                                                                       platform=jax.default_backend())


# --- 3. plan: what the call refuses ------------------------------------------------------

POOL = jnp.asarray(RNG.normal(size=(HKV, 5, 4, D)), jnp.float32)
TABLES = np.array([[3, 1, 0, 2], [0, 4, 1, 2]], np.int32)
BAD_VALUES = {
    "lengths past S": (dict(lengths=np.array([3, S + 1], np.int32)), {}),
    "negative length": (dict(lengths=np.array([-1, 3], np.int32)), {}),
    "lengths past int32": (dict(lengths=np.array([3, 2 ** 31], np.int64)), {}),
    "page id out of the pool": (dict(k=POOL, v=POOL, lengths=np.array([5, 16], np.int32)),
                                dict(block_tables=np.array([[3, 1, 0, 2], [0, 4, 1, 5]], np.int32))),
    "negative page id": (dict(k=POOL, v=POOL, lengths=np.array([9, 2], np.int32)),
                         dict(block_tables=np.array([[3, 1, -1, 2], [0, 4, 1, 2]], np.int32))),
    "kv_offset past int32": (dict(lengths=np.array([3, 4], np.int32)),
                             dict(kv_offset=np.array([0, 2 ** 32], np.int64))),
    "lengths - kv_offset past int32": (dict(lengths=np.array([3, 2 ** 31 - 1], np.int32)),
                                       dict(kv_offset=np.array([0, -5], np.int32))),
}


@pytest.mark.parametrize("abstract", [False, True], ids=["arrays", "q-k-v-abstract"])
@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_plan_raises_what_the_call_raises(case, abstract):
  """plan traced every array, so lengths past S, page ids out of the pool and bad kv_offsets
  got a plan for a call flash_decode refuses. The concrete ones are now value-checked,
  with q, k, v concrete or `ShapeDtypeStruct`s."""
  over, kw = BAD_VALUES[case]
  a = dict(dict(q=Q, k=K, v=V, lengths=LENGTHS), **over)
  with pytest.raises(ValueError) as call:
    fdecode.flash_decode(**a, **kw)
  if abstract:
    a.update(q=sds(a["q"]), k=sds(a["k"]), v=sds(a["v"]))
  with pytest.raises(ValueError) as planned:
    fdecode.plan(**a, **kw, platform="cpu")
  assert str(planned.value) == str(call.value)


def test_plan_of_a_valid_paged_call_with_concrete_values():
  plans = fdecode.plan(Q, POOL, POOL, np.array([16, 2], np.int32), block_tables=TABLES, platform="cpu")
  assert plans == fdecode.plan(Q, POOL, POOL, sds(LENGTHS), block_tables=sds(TABLES), platform="cpu")


# --- 4. ragged_decode: concrete jax scalar statics ---------------------------------------


QR = jnp.asarray(RNG.normal(size=(4, HQ, D)), jnp.float32)


def _ragged(**kw):
  """A step of two sequences (3 new tokens of 5, 1 of 7) over contiguous caches."""
  return fdecode.ragged_decode(QR, K, V, np.array([5, 7], np.int32), None, np.array([0, 3, 4], np.int32), 2, **kw)


JAX_STATICS = [("softmax_scale", jnp.float32(0.2)), ("logits_soft_cap", jnp.float32(3.0)), ("window", jnp.int32(2)),
               ("num_splits", jnp.int32(2)), ("block_k", jnp.int32(16)), ("causal", jnp.bool_(False))]


@pytest.mark.parametrize("name,value", JAX_STATICS, ids=[n for n, _ in JAX_STATICS])
def test_ragged_takes_concrete_scalar_statics_as_their_values(name, value):
  """The statics key ragged_decode's jit: a jax scalar failed with "Non-hashable static
  arguments" where flash_decode takes it."""
  got = _ragged(**{name: value})
  want = _ragged(**{name: value.item()})
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("name,value,pattern", [
    ("window", jnp.int32(0), r"window must be a positive int.*got window=0"),
    ("window", jnp.array([2, 3]), r"window must be a static int.*got ArrayImpl of shape \(2,\)"),
    ("softmax_scale", jnp.float32(jnp.nan), r"softmax_scale must be finite"),
    ("logits_soft_cap", jnp.float32(-1.0), r"logits_soft_cap must be positive"),
    ("num_splits", jnp.int32(0), r"num_splits must be a positive int"),
    ("causal", jnp.int32(1), r"causal must be a bool, got 1"),
])
def test_ragged_checks_concrete_scalar_statics_in_flash_decodes_domain(name, value, pattern):
  with pytest.raises(ValueError, match="^ragged_decode: " + pattern):
    _ragged(**{name: value})


# --- 5. traced statics under jit ---------------------------------------------------------


def _cascade(**kw):
  q4 = jnp.broadcast_to(Q[:, None], (B, 2, HQ, D))
  return fdecode.cascade_decode(q4, K[:1], V[:1], jnp.array([7]), K, V, LENGTHS, prefix_ids=jnp.array([0, 0]), **kw)


def _sharded(**kw):
  return fdecode.sharded_flash_decode(Q, K, V, LENGTHS, mesh=jax.make_mesh((2,), ("s",)), seq_axis="s", **kw)


ENTRY_POINTS = {"flash_decode": lambda **kw: fdecode.flash_decode(Q, K, V, LENGTHS, **kw), "ragged_decode": _ragged,
                "cascade_decode": _cascade, "sharded_flash_decode": _sharded}
TRACED = ([("flash_decode", n, x.item()) for n, x in NUMPY_STATICS] + [
    ("flash_decode", "return_lse", True), ("flash_decode", "interpret", True),
    ("ragged_decode", "window", 4), ("ragged_decode", "softmax_scale", 0.2), ("ragged_decode", "causal", True),
    ("ragged_decode", "num_splits", 2), ("ragged_decode", "return_lse", True),
    ("cascade_decode", "causal", True), ("cascade_decode", "logits_soft_cap", 3.0),
    ("cascade_decode", "softmax_scale", 0.2), ("cascade_decode", "return_lse", True),
    ("sharded_flash_decode", "window", 4), ("sharded_flash_decode", "block_k", 16)])


@pytest.mark.parametrize("entry,name,value", TRACED, ids=[f"{e}-{n}" for e, n, _ in TRACED])
def test_a_traced_static_names_itself_and_the_fix(entry, name, value):
  """``jax.jit(fdecode.flash_decode)(q, k, v, lengths, window=16)`` said "got a traced int32
  scalar" with no hint (a traced causal: JAX's ConcretizationTypeError; in ragged_decode
  "Non-hashable static arguments"). The fix the message names works."""
  fn = ENTRY_POINTS[entry]
  impl = dict(impl="pallas") if name == "interpret" else {}
  caller = "flash_decode" if entry == "sharded_flash_decode" else entry  # its errors are flash_decode's
  with pytest.raises(ValueError, match=rf"^{caller}: {name} is compiled into the kernel.*"
                                       rf"static_argnames=\('{name}',\).*functools\.partial\(f, {name}=\.\.\.\)"):
    jax.jit(lambda x: fn(**impl, **{name: x}))(value)
  if name != "interpret":  # the interpreted kernel is not what is tested here
    fixed = jax.jit(functools.partial(fn, **{name: value}))()
    same = functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-6)
    jax.tree.map(same, fixed, fn(**{name: value}))


def test_flash_decode_under_jit_with_a_static_window():
  """The issue's own call, and its fix."""
  with pytest.raises(ValueError, match=r"window is compiled into the kernel.*static_argnames=\('window',\)"):
    jax.jit(fdecode.flash_decode)(Q, K, V, LENGTHS, window=16)
  out = jax.jit(fdecode.flash_decode, static_argnames=("window",))(Q, K, V, LENGTHS, window=16)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(fdecode.flash_decode(Q, K, V, LENGTHS, window=16)))
  out = jax.jit(functools.partial(fdecode.flash_decode, window=16))(Q, K, V, LENGTHS)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(fdecode.flash_decode(Q, K, V, LENGTHS, window=16)))


# --- 6, 7. Engine: a refused construction changes nothing; bucket's argument -------------


def snapshot(model):
  """The model's whole nnx state: its tree structure and every leaf's value."""
  leaves, tree = jax.tree.flatten(nnx.state(model))
  return tree, [np.asarray(x) for x in leaves]


def assert_same_state(before, after):
  assert before[0] == after[0], "the model's state changed structure"
  for x, y in zip(before[1], after[1]):
    np.testing.assert_array_equal(x, y)


SIZES = dict(max_seqs=2, token_budget=8, max_len=32, page_size=8)
BAD_ENGINES = [
    (dict(buckets=(4, 2, 8)), r"buckets must be increasing ints"),
    (dict(buckets="8"), r"buckets must be increasing ints"),
    (dict(buckets=(2, 4)), r"buckets must be increasing ints >= 1 ending at token_budget=8"),
    (dict(num_pages=0), r"num_pages must be an int in \[1, 8\]"),
    (dict(num_pages=9), r"num_pages must be an int in \[1, 8\]"),
    (dict(num_pages=True), r"num_pages must be an int in \[1, 8\]"),
    (dict(num_pages=2.0), r"num_pages must be an int in \[1, 8\]"),
    (dict(max_seqs=2 ** 20, token_budget=2 ** 20, max_len=2 ** 20, page_size=1), r"Engine: the page pool's page count"),
]


@pytest.fixture(scope="module")
def transformer():
  return Transformer(CFG, seed=0)


@pytest.fixture
def model(transformer):
  """The model with a contiguous cache of its own, which a refused Engine must keep."""
  transformer.init_cache(1, 8)
  return transformer


@pytest.mark.parametrize("kw,pattern", BAD_ENGINES, ids=[next(iter(kw)) + str(i) for i, (kw, _) in
                                                         enumerate(BAD_ENGINES)])
def test_a_refused_engine_leaves_the_model_as_it_was(model, kw, pattern):
  """Bad buckets or num_pages raised only after ``model.init_cache`` had replaced the
  model's caches by the engine's pool."""
  before = snapshot(model)
  with pytest.raises(ValueError, match=pattern):
    Engine(model, **dict(SIZES, **kw))
  assert_same_state(before, snapshot(model))


@pytest.mark.parametrize("tokens,error", [(True, ValueError), (np.bool_(True), ValueError), (2.5, ValueError),
                                          (3.0, ValueError), (0, ValueError), (9, ValueError), (-1, ValueError),
                                          ("3", TypeError), (None, TypeError), ([3], TypeError)])
def test_bucket_takes_an_int_in_one_to_the_budget(model, tokens, error):
  """bucket(True) and bucket(2.5) answered; bucket("3") and bucket(None) raised a bare
  comparison TypeError."""
  engine = Engine(model, **SIZES)
  with pytest.raises(error, match=r"Engine.bucket: tokens must be an int in \[1, token_budget=8\]; got "
                                  + re.escape(describe(tokens))):
    engine.bucket(tokens)
  assert engine.bucket(np.int64(3)) == engine.bucket(3) == (4, 2)
