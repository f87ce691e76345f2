"""Differential fuzzer (issue 18): random valid `flash_decode` calls against a float64
oracle, random invalid calls against a ValueError / TypeError that names the argument.

Valid calls draw shapes (B, T, Hq / Hkv at G = 1, 2, 3, 4, S, Dk / Dv, page size incl. 1,
more splits than blocks, block_k), cache forms (contiguous; paged with shuffled tables,
stale / garbage table entries and garbage-filled unused pages; int8 / float8 with scales
per tensor, token, head, page or tile, with and without offsets; MLA ``v=None``;
``k_rope``), every modifier and their combinations (causal, mask, bias, ALiBi, window,
soft cap, sinks, kv_offset, sparse indices), lengths 0 .. S, float32 and bfloat16, and
inf / NaN / huge garbage in every dead slot. The oracle below is plain float64 numpy,
written from the documented semantics (`fdecode.kernels.common.modifiers`, `fdecode.cache.quant`,
`fdecode.kernels.common.sparse`), not from the library's reference. Some calls also put a NaN in a slot
that a query *does* see (a key, a value, a scale, q, a bias entry, an ALiBi slope): its
rows must come back NaN (every column, and the lse) on every impl and split count, never
"no data".

Invalid calls mutate a small valid call once (shape, dtype, range, non-finite or
float32-overflowing static, int64 beyond int32, a Python list, a static option traced
under ``jit``) and accept only a ValueError / TypeError whose message names the argument
(a traced static: and ``static_argnames`` with its name). Some mutations are variants a
call may take: a Python list for an array, a numpy / concrete jax scalar for a static
option; accepted, they must give the plain call's result.

tests/ragged/test_fuzz_ragged.py (`ragged_decode` steps) and tests/serving/test_fuzz_engine.py (the
serving `Engine`) use these profiles, this oracle and `assert_matches`, from
tests/helpers/fuzz.py.

Profiles (hypothesis settings profiles, applied per test so no other file is affected):
  * ``fdecode-ci`` (default): derandomized (fixed seed), bounded examples, impl="xla".
  * ``fdecode-long``: ``FDECODE_FUZZ=long python -m pytest tests/kernels/test_fuzz.py``: many more
    examples, random seeds, and also the interpreted kernels (Triton in Pallas'
    interpreter, Mosaic in the TPU interpreter) and the float32 reference impl.
    ``FDECODE_FUZZ_EXAMPLES=N`` overrides its example count.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers.fuzz import BOOLS, FLOATS, IMPLS, INTS, INVALID_PROFILE, PROFILE, call, check_valid, valid_cases


@pytest.mark.parametrize("impl", IMPLS)
@settings(PROFILE)
@given(c=valid_cases())
def test_valid_calls_match_float64_oracle(impl, c):
  check_valid(impl, c)


@pytest.mark.parametrize("impl", IMPLS)
@settings(settings(PROFILE, max_examples=max(PROFILE.max_examples // 2, 10)))
@given(c=valid_cases(nan_at_visible=True))
def test_visible_nan_propagates(impl, c):
  """A NaN some query sees (key, value, scale, q, bias, slope) comes back NaN in exactly
  the rows that see it, every column and the lse, never "no data" (0 / -inf)."""
  check_valid(impl, c)


# --- invalid calls -----------------------------------------------------------------------

B, HQ, HKV, S, D = 2, 4, 2, 16, 8


def _base(paged=False, t=None):
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, HQ, D) if t is None else (B, t, HQ, D)).astype(np.float32)
  if paged:
    k = rng.normal(size=(HKV, 5, 4, D)).astype(np.float32)
    v = rng.normal(size=(HKV, 5, 4, D)).astype(np.float32)
    kw = dict(block_tables=np.array([[3, 1], [0, 4]], np.int32))
    cap = 8
  else:
    k = rng.normal(size=(B, HKV, S, D)).astype(np.float32)
    v = rng.normal(size=(B, HKV, S, D)).astype(np.float32)
    kw, cap = {}, S
  return dict(q=q, k=k, v=v, lengths=np.array([3, cap], np.int32), kw=kw)


NONFINITE_STATICS = [float("nan"), float("inf"), -float("inf"), 1e39, -1e39, np.float64(1e39)]
INT_OVER = [2 ** 31, 2 ** 32 + 3, 2 ** 63 - 1, np.int64(2 ** 40)]
# Scalar types a static option may come as (tests/ragged/test_fuzz_ragged.py draws them too).
# flash_decode's static options: (name, a valid value for `_base`, the scalar types to try).
STATIC_SCALARS = [("softmax_scale", 0.3, FLOATS), ("logits_soft_cap", 5.0, FLOATS), ("window", 5, INTS),
                  ("num_splits", 2, INTS), ("block_k", 8, INTS), ("causal", True, BOOLS), ("v_head_dim", D, INTS)]


def _mutations():
  """(name, builder(draw, base), names the message may give, variant_ok: a variant the call
  may take, marked ``list`` or ``scalar`` in the base, which `_variant` applies)."""
  m = []

  def add(name, names, variant_ok=False):
    def deco(f):
      m.append((name, f, names, variant_ok))
      return f
    return deco

  @add("q.ndim", ("q",))
  def _(d, a):
    a["q"] = a["q"].reshape(B, -1) if d(st.booleans()) else a["q"][None]

  @add("q.dtype", ("q",))
  def _(d, a):
    a["q"] = a["q"].astype(d(st.sampled_from([np.int32, np.bool_, np.complex64])))

  @add("k.ndim", ("k",))
  def _(d, a):
    a["k"] = a["k"][0]

  @add("k.dtype", ("k", "k_scale"))
  def _(d, a):
    a["k"] = a["k"].astype(d(st.sampled_from([np.int32, np.int8, np.uint8, np.bool_, np.complex64])))

  @add("v.shape", ("v", "k"))
  def _(d, a):
    a["v"] = a["v"][:, :, : d(st.sampled_from([1, S - 1]))]

  @add("heads", ("q", "k", "Hq", "Hkv"))
  def _(d, a):
    a["q"] = a["q"][..., :3, :]

  @add("Dk", ("q", "k", "Dk"))
  def _(d, a):
    a["q"] = np.concatenate([a["q"], a["q"]], -1)

  @add("k batch", ("q", "k", "batch"))
  def _(d, a):
    a["k"], a["v"] = a["k"][:1], a["v"][:1]

  @add("lengths.shape", ("lengths",))
  def _(d, a):
    a["lengths"] = d(st.sampled_from([np.array([1, 2, 3]), np.array([[1, 2]]), np.array(3)]))

  @add("lengths.dtype", ("lengths",))
  def _(d, a):
    a["lengths"] = d(st.sampled_from([np.array([1.0, 2.0]), np.array([True, False]), np.array([1 + 0j, 2])]))

  @add("lengths range", ("lengths",))
  def _(d, a):
    a["lengths"] = np.array([d(st.sampled_from([-1, S + 1, -(2 ** 31)])), 3], np.int32)

  @add("lengths int64", ("lengths",))
  def _(d, a):
    a["lengths"] = np.array([d(st.sampled_from(INT_OVER[:3])), 3], np.int64)
    if d(st.booleans()):
      a["kw"]["kv_offset"] = 0  # no upper bound on lengths: only the int32 domain is left

  @add("k_scale missing", ("k_scale", "k"))
  def _(d, a):
    a["k"] = a["k"].astype(np.int8)

  @add("k_scale for float", ("k_scale", "v_scale"))
  def _(d, a):
    a["kw"][d(st.sampled_from(["k_scale", "v_scale", "k_offset"]))] = np.float32(0.5)

  @add("k_scale.shape", ("k_scale",))
  def _(d, a):
    a["k"] = a["k"].astype(np.int8)
    a["kw"]["k_scale"] = np.ones(d(st.sampled_from([(B, HKV, S, 3), (B, HKV, S), (3, HKV, S, 1),
                                                    (B, HKV, S, 0), (1, 1, 1, 1, 1)])), np.float32)

  @add("k_scale.dtype", ("k_scale",))
  def _(d, a):
    a["k"] = a["k"].astype(np.int8)
    a["kw"]["k_scale"] = d(st.sampled_from([np.ones((B, HKV, S, 1), np.complex64), "0.5",
                                            np.ones((B, HKV, S, 1), np.bool_)]))

  @add("k_scale non-finite static", ("k_scale",))
  def _(d, a):
    a["k"] = a["k"].astype(np.int8)
    a["kw"]["k_scale"] = d(st.sampled_from([1e39, -1e39]))

  @add("k_offset tiles", ("k_offset", "k_scale"))
  def _(d, a):
    a["k"] = a["k"].astype(np.int8)
    a["kw"].update(k_scale=np.ones((B, HKV, S, 2), np.float32), k_offset=np.ones((B, HKV, S, 1), np.float32))

  @add("block_tables.shape", ("block_tables",))
  def _(d, a):
    a.update(_base(paged=True))
    a["kw"]["block_tables"] = d(st.sampled_from([np.zeros((3, 2), np.int32), np.zeros((2,), np.int32),
                                                 np.zeros((2, 2, 1), np.int32)]))

  @add("block_tables.dtype", ("block_tables",))
  def _(d, a):
    a.update(_base(paged=True))
    a["kw"]["block_tables"] = a["kw"]["block_tables"].astype(d(st.sampled_from([np.float32, np.bool_])))

  @add("block_tables range", ("block_tables",))
  def _(d, a):
    a.update(_base(paged=True))
    a["kw"]["block_tables"] = np.array([[3, 1], [0, d(st.sampled_from([-1, 5, 2 ** 31 - 1]))]], np.int32)

  @add("block_tables int64", ("block_tables",))
  def _(d, a):
    a.update(_base(paged=True))
    a["kw"]["block_tables"] = np.array([[3, 1], [0, d(st.sampled_from([2 ** 32 + 4, 2 ** 32 - 1]))]], np.int64)

  @add("softmax_scale", ("softmax_scale",))
  def _(d, a):
    a["kw"]["softmax_scale"] = d(st.sampled_from(NONFINITE_STATICS + ["0.5", 1j, True, np.ones(2)]))

  @add("logits_soft_cap", ("logits_soft_cap",))
  def _(d, a):
    a["kw"]["logits_soft_cap"] = d(st.sampled_from(NONFINITE_STATICS + [0.0, -1.0, 1e-46, 3e38, "1", True]))

  @add("window", ("window",))
  def _(d, a):
    a["kw"]["window"] = d(st.sampled_from([0, -3, 1.5, True, float("nan"), "4"] + INT_OVER))

  @add("num_splits / block_k", ("num_splits", "block_k"))
  def _(d, a):
    a["kw"][d(st.sampled_from(["num_splits", "block_k"]))] = d(st.sampled_from([0, -1, 1.5, True, "2"]))

  @add("causal", ("causal",))
  def _(d, a):
    a["kw"]["causal"] = d(st.sampled_from([1, 0, "yes", np.array([True, False])]))

  @add("mask", ("mask",))
  def _(d, a):
    a["kw"]["mask"] = d(st.sampled_from([np.ones((B, S), np.int32), np.ones((B, S + 1), bool),
                                         np.ones((B, 1, 1, 1, S), bool), np.ones((S,), bool),
                                         np.ones((3, S), bool), np.ones((B, 1, 3, S), bool)]))

  @add("bias", ("bias",))
  def _(d, a):
    a["kw"]["bias"] = d(st.sampled_from([np.ones((B, S), np.int32), np.ones((B, S - 1), np.float32),
                                         np.ones((B, 3, S), np.float32), np.ones((B, S), bool)]))

  @add("alibi_slopes / sinks", ("alibi_slopes", "sinks"))
  def _(d, a):
    a["kw"][d(st.sampled_from(["alibi_slopes", "sinks"]))] = d(st.sampled_from(
        [np.ones(HQ + 1, np.float32), np.ones((1, HQ), np.float32), np.ones(HQ, np.int32),
         np.float32(1.0), np.ones(HKV, np.float32)]))

  @add("impl / interpret", ("impl", "interpret"))
  def _(d, a):
    a["kw"].update(d(st.sampled_from([dict(impl="cuda"), dict(impl="XLA"), dict(interpret="yes")])))

  @add("kv_offset", ("kv_offset",))
  def _(d, a):
    a["kw"]["kv_offset"] = d(st.sampled_from([1.5, np.array([1, 2, 3]), np.array([[0, 0]]),
                                              np.int64(2 ** 32), np.array([0, 2 ** 32 + 1], np.int64)]))

  @add("indices", ("indices",))
  def _(d, a):
    a["kw"]["indices"] = d(st.sampled_from([np.zeros((B, 3), np.float32), np.zeros((3, 3), np.int32),
                                            np.zeros((B, 1, 1, 1, 3), np.int32), np.zeros((B, 5, 3), np.int32),
                                            np.array([[2 ** 32 + 1], [2 ** 32 + 2]], np.int64)]))
    if d(st.booleans()):
      a["kw"]["mask"] = np.ones((B, S), bool)

  @add("k_rope", ("k_rope", "q", "k"))
  def _(d, a):
    a["kw"]["k_rope"] = d(st.sampled_from([np.ones((B, HKV, S - 1, 4), np.float32),
                                           np.ones((B, HKV, S, 4), np.int32), np.ones((B, HKV, S), np.float32)]))

  @add("v_head_dim", ("v_head_dim", "v"))
  def _(d, a):
    case = d(st.sampled_from(["none", "zero", "big", "float", "mismatch", "v_scale"]))
    if case == "mismatch":
      a["kw"]["v_head_dim"] = D - 1
      return
    a["v"] = None
    a["kw"].update({"none": {}, "zero": dict(v_head_dim=0), "big": dict(v_head_dim=D + 1),
                    "float": dict(v_head_dim=4.0), "v_scale": dict(v_head_dim=4, v_scale=0.5)}[case])

  # A static option as a numpy / concrete jax scalar: the Python value it holds (never refused).
  @add("static as a scalar", tuple(n for n, _, _ in STATIC_SCALARS), variant_ok=True)
  def _(d, a):
    name, value, kinds = d(st.sampled_from(STATIC_SCALARS))
    kind = d(st.sampled_from(kinds))
    a["kw"][name] = kind(value).item()
    a["scalar"] = (name, kind)

  # ... traced (an argument of a jit-ed function): named, with the way to pass it static.
  @add("static traced", ("static_argnames",))
  def _(d, a):
    name, value, _ = d(st.sampled_from(STATIC_SCALARS))
    a["kw"][name] = value
    a["traced"] = name

  # Python lists for array arguments: accepted (then the array call's result) or named.
  for name in ("q", "k", "v", "lengths", "mask", "bias", "alibi_slopes", "sinks", "block_tables",
               "indices", "k_rope", "kv_offset", "k_scale"):
    def _list(d, a, name=name):
      if name == "block_tables":
        a.update(_base(paged=True))
      extra = dict(mask=np.arange(S)[None].repeat(B, 0) % 3 > 0, bias=np.ones((B, S), np.float32),
                   alibi_slopes=np.linspace(0.1, 0.5, HQ).astype(np.float32),
                   sinks=np.zeros(HQ, np.float32), indices=np.array([[0, 2], [1, 5]], np.int32),
                   k_rope=np.ones((B, HKV, S, 2), np.float32), kv_offset=np.array([0, 0], np.int32),
                   k_scale=np.full((B, HKV, S, 1), 0.01, np.float32))
      if name == "k_rope":
        a["q"] = np.concatenate([a["q"], a["q"][..., :2]], -1)
      if name == "k_scale":
        a["k"] = (a["k"] * 30).astype(np.int8)
      if name in extra:
        a["kw"][name] = extra[name]
      a["list"] = name
    m.append((f"list:{name}", _list, (name,), True))
  return m


MUTATIONS = _mutations()


def _variant(a):
  """The variant a mutation marked: an argument as a Python list (``list``), or a static
  option as a numpy / jax scalar (``scalar``)."""
  a = dict(a, kw=dict(a["kw"]))
  if "scalar" in a:
    name, kind = a["scalar"]
    a["kw"][name] = kind(a["kw"][name])
    return a
  name = a["list"]
  if name in ("q", "k", "v", "lengths"):
    a[name] = a[name].tolist()
  else:
    a["kw"][name] = a["kw"][name].tolist()
  return a


def _run(impl, a):
  conv = lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) and x.dtype != np.int64 else x
  kw = {n: conv(x) for n, x in a["kw"].items()}
  args = [conv(a[n]) for n in ("q", "k", "v", "lengths")]
  traced = a.get("traced")
  if traced:  # the static option as an argument of a jit-ed function
    value = kw.pop(traced)
    return jax.jit(lambda x: call(impl, *args, return_lse=True, **kw, **{traced: x}))(value)
  return call(impl, *args, return_lse=True, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@settings(INVALID_PROFILE)
@given(data=st.data())
def test_invalid_calls_name_the_argument(impl, data):
  name, build, names, variant_ok = data.draw(st.sampled_from(MUTATIONS), label="mutation")
  a = _base(t=data.draw(st.sampled_from([None, 2]), label="T"))
  build(data.draw, a)
  if variant_ok:
    plain, a = a, _variant(a)
  try:
    result = _run(impl, a)
  except (ValueError, TypeError) as e:
    msg = str(e)
    assert "scalar" not in a, f"{name}: a valid static as a {a['scalar'][1].__name__} refused: {msg}"
    if "traced" in a:  # the option, in the way to pass it static
      names = (f"static_argnames=('{a['traced']}',)",)
    assert any(n in msg for n in names), f"{name}: message does not name {names}: {type(e).__name__}: {msg}"
    assert len(msg) < 1500, f"{name}: message prints a whole array ({len(msg)} chars): {msg[:300]}..."
    return
  except Exception as e:  # noqa: BLE001 - anything else is the failure being looked for
    raise AssertionError(f"{name}: {type(e).__name__} instead of ValueError/TypeError: {e}") from e
  if not variant_ok:
    out, lse = result
    raise AssertionError(f"{name}: invalid call accepted; out has NaN: {bool(jnp.isnan(out).any())}, "
                         f"kw={ {n: x for n, x in a['kw'].items() if not isinstance(x, np.ndarray)} }")
  want = _run(impl, plain)  # a variant the library accepts must mean the plain call
  for x, y in zip(result, want):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{name}: variant != plain call")
