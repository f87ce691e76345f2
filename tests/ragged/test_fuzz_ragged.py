"""Differential fuzzer for `fdecode.ragged_decode` (issue 32), beside tests/kernels/test_fuzz.py's
`flash_decode` fuzzer and with its profiles, float64 oracle and comparison.

Valid calls draw a serving step: up to M = 3 live sequences mixing decodes (1 new token),
prefill chunks (2 .. 70 rows, across the 64-row query blocks) and sequences with no new
token, padding rows, kv_lens from 0 to S, paged pools (shuffled pages, a forked prefix
page two sequences read, stale / out-of-pool ids past each length and in dead
sequences' rows) or contiguous caches, either layout, the fused write or not, and
inf / NaN / huge garbage in every slot no row sees: past the lengths, before a window,
unused pages, sequences with no new token, the slots the fused write is about to fill,
padding rows of q and of new_k / new_v. The oracle reads the caches as the write should
leave them (computed here, position by position) through each table and runs
`test_fuzz.oracle` per sequence; the returned caches must equal that bit for bit (the
write moves data: nothing else changes). Some calls put a NaN where a row sees it (a
cached key or value, or a new token's), which must come back NaN in exactly the rows
that see it (every column and the lse).

Invalid calls mutate a small valid call once and accept only a ValueError / TypeError
naming the argument (a static option traced under ``jit``: with ``static_argnames`` and its
name); a Python list for an array argument must give the array's result, and a static
option given as a numpy / concrete jax scalar must be taken, as the step of the Python
value it holds, bit for bit.

CI (``fdecode-ci``): a fixed seed, three compiled configurations (each example changes
only array values, so the step compiles once per configuration), impl="xla".
``FDECODE_FUZZ=long``: every configuration, random seeds, and the interpreted kernels
and the reference impl.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fdecode
from helpers import tpu_interpret
from helpers.fuzz import (BOOLS, FLOATS, GARBAGE, IMPLS, INTS, INVALID_PROFILE, LONG, PROFILE, Case, assert_matches,
                          oracle)

M, N, HQ, HKV, D, S = 3, 80, 4, 2, 16, 96
MODS = {"none": {}, "window+cap+sinks": dict(window=24, logits_soft_cap=5.0, softmax_scale=0.3,
                                            sinks=np.array([0.5, -1.0, 0.0, 2.0], np.float32))}
# (cache, layout, fused write, modifiers); CI runs the first three.
CONFIGS = [("paged4", "NHD", True, "window+cap+sinks"), ("contiguous", "HND", False, "none"),
           ("paged16", "HND", True, "none")]
if LONG:
  CONFIGS += [(c, lay, w, m) for c in ("paged4", "paged16", "contiguous") for lay in ("HND", "NHD")
              for w in (True, False) for m in MODS if (c, lay, w, m) not in CONFIGS]
Q_LENS = [0, 1, 1, 1, 2, 5, 17, 70]


def _call(impl, **kw):
  ctx = tpu_interpret() if impl == "mosaic" else contextlib.nullcontext()
  with ctx:
    return fdecode.ragged_decode(**kw, impl="pallas" if impl == "mosaic" else impl, return_lse=True)


def _slot(cfg, tables, i, pos):
  """Head-major physical index (minus the head axis) of sequence i's position ``pos``."""
  if cfg["paged"]:
    return (tables[i, pos // cfg["ps"]], pos % cfg["ps"])
  return (i, pos)


@st.composite
def ragged_cases(draw, nan_at_visible=False):
  """A valid step: the call's arguments (``args``), the caches the fused write must leave
  (``after``, head-major) and what the oracle needs."""
  rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
  cache, layout, fused, mods = draw(st.sampled_from(CONFIGS))
  paged, ps = cache != "contiguous", {"paged4": 4, "paged16": 16}.get(cache, 1)
  cfg = dict(paged=paged, ps=ps, layout=layout, fused=fused, mods=MODS[mods])
  ns = draw(st.integers(0, M))
  q_lens, left = [], N
  for _ in range(ns):
    q_lens.append(min(draw(st.sampled_from(Q_LENS)), left))
    left -= q_lens[-1]
  cached = [draw(st.sampled_from([0, 1, ps - 1, ps, int(rng.integers(0, S - q + 1))])) for q in q_lens]
  lens = np.array([min(q + c, S) for q, c in zip(q_lens, cached)] + list(rng.integers(0, S + 1, M - ns)), np.int32)
  cu = np.zeros(M + 1, np.int32)
  cu[1:ns + 1] = np.cumsum(q_lens)
  cu[ns + 1:] = cu[ns]
  window = cfg["mods"].get("window")

  # The caches, clean (head-major), and the tables.
  n = S // ps
  num_pages = M * n + 4
  shape = (HKV, num_pages, ps, D) if paged else (M, HKV, S, D)
  k, v = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
  tables = rng.permutation(num_pages)[:M * n].reshape(M, n).astype(np.int32) if paged else None
  if paged and ns >= 2 and min(lens[0] - q_lens[0], lens[1] - q_lens[1]) >= ps and draw(st.booleans()):
    tables[1, 0] = tables[0, 0]  # a forked prefix page both read, neither writes
  hm = lambda x: x.transpose(1, 0, 2, 3) if not paged else x  # head axis first: [Hkv, A, B, D]
  k, v = hm(k), hm(v)

  # Which physical slots some row sees, and which the fused write fills.
  seen = np.zeros(k.shape[1:3], bool)
  new = np.zeros(k.shape[1:3], bool)
  for i in range(ns):
    lo = lens[i] - q_lens[i]
    first = max(lo - window + 1, 0) if window and q_lens[i] else 0
    for pos in range(first if q_lens[i] else lens[i], lens[i]):
      seen[_slot(cfg, tables, i, pos)] = True
    for pos in range(lo, lens[i]):
      new[_slot(cfg, tables, i, pos)] = True
  new &= fused
  pour = lambda x, where: np.where(where[None, ..., None], rng.choice(GARBAGE, size=x.shape), x).astype(np.float32)
  k, v = pour(k, ~seen | new), pour(v, ~seen | new)

  q = rng.normal(size=(N, HQ, D)).astype(np.float32)
  q[cu[ns]:] = rng.choice(GARBAGE, size=q[cu[ns]:].shape)  # padding rows
  new_k = rng.normal(size=(N, HKV, D)).astype(np.float32)
  new_v = rng.normal(size=(N, HKV, D)).astype(np.float32)
  for x in (new_k, new_v):
    x[cu[ns]:] = rng.choice(GARBAGE, size=x[cu[ns]:].shape)  # padding rows write nothing
  after_k, after_v = k.copy(), v.copy()
  if fused:
    for i in range(ns):
      for r in range(cu[i], cu[i + 1]):
        idx = _slot(cfg, tables, i, lens[i] - q_lens[i] + r - cu[i])
        after_k[(slice(None),) + idx], after_v[(slice(None),) + idx] = new_k[r], new_v[r]
  nan = None
  if nan_at_visible:
    nan = _nan_at_visible(draw, rng, cfg, tables, lens, q_lens, cu, ns, dict(k=k, v=v, after_k=after_k,
                                                                              after_v=after_v, new_k=new_k, new_v=new_v))
  if paged:  # entries past a live length: stale, out of the pool or another's page; dead rows: anything
    for i in range(M):
      for j in range(-(-int(lens[i]) // ps) if i < ns else 0, n):
        tables[i, j] = [-1, 10 ** 6, tables[0, 0]][int(rng.integers(3))]
  to_layout = lambda x: x.transpose(1, 2, 0, 3) if layout == "NHD" else (x if paged else x.transpose(1, 0, 2, 3))
  args = dict(q=q, k=to_layout(k), v=to_layout(v), kv_lens=lens, block_tables=tables, cu_q_lens=cu,
              num_seqs=ns, kv_layout=layout, **cfg["mods"])
  if fused:
    args.update(new_k=new_k, new_v=new_v)
  return Step(args=args, after_k=after_k, after_v=after_v, cfg=cfg, q_lens=q_lens, ns=ns, nan=nan,
              config=(cache, layout, fused, mods))


class Step(dict):
  """A drawn step; prints compactly in hypothesis' reports."""

  def __repr__(self):
    a = self["args"]
    return (f"{self['config']}: num_seqs={self['ns']}, q_lens={self['q_lens']}, kv_lens={a['kv_lens'].tolist()}, "
            f"tables={None if a['block_tables'] is None else a['block_tables'][:, :4].tolist()}, nan={self['nan']}")


def _nan_at_visible(draw, rng, cfg, tables, lens, q_lens, cu, ns, arrays):
  """A NaN in a key or value some row sees (a cached slot, or a new token's row when the
  write is fused): returns what was hit, or None."""
  live = [i for i in range(ns) if q_lens[i]]
  if not live:
    return None
  i = live[int(rng.integers(len(live)))]
  window = cfg["mods"].get("window")
  first = max(lens[i] - q_lens[i] - window + 1, 0) if window else 0
  pos = int(rng.integers(first, lens[i]))
  which = draw(st.sampled_from(["k", "v"]))
  h, col = int(rng.integers(HKV)), int(rng.integers(D))
  lo = lens[i] - q_lens[i]
  if cfg["fused"] and pos >= lo:
    arrays[f"new_{which}"][cu[i] + pos - lo, h, col] = np.nan
  else:
    arrays[which][(h,) + _slot(cfg, tables, i, pos) + (col,)] = np.nan
  arrays[f"after_{which}"][(h,) + _slot(cfg, tables, i, pos) + (col,)] = np.nan
  return f"{which} of sequence {i} at position {pos}"


def expected(c):
  """float64 (out [N, Hq, D], lse [N, Hq]) per the documented semantics: each live
  sequence's rows through `test_fuzz.oracle` over its caches as the write leaves them;
  padding rows 0 / -inf."""
  a, cfg = c["args"], c["cfg"]
  out, lse = np.zeros((N, HQ, D)), np.full((N, HQ), -np.inf)
  for i in range(c["ns"]):
    t = c["q_lens"][i]
    if not t:
      continue
    if cfg["paged"]:
      ids = np.clip(a["block_tables"][i], 0, c["after_k"].shape[1] - 1)
      per_seq = lambda x: x[:, ids].reshape(HKV, S, D)[None]
    else:
      per_seq = lambda x: x[:, i][None]
    lo, hi = a["cu_q_lens"][i], a["cu_q_lens"][i + 1]
    kw = {n: x for n, x in cfg["mods"].items()}
    case = Case(q=a["q"][lo:hi][None], k=per_seq(c["after_k"]), v=per_seq(c["after_v"]),
                lengths=a["kv_lens"][i:i + 1], kw=kw, B=1, T=t, Hq=HQ, Hkv=HKV, S=S, single=False,
                offset=np.zeros(1, np.int64), paged=False)
    o, l = oracle(case)
    out[lo:hi], lse[lo:hi] = o[0], l[0]
  return out, lse


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("impl", IMPLS)
@settings(PROFILE)
@given(c=ragged_cases())
def test_valid_steps_match_float64_oracle(impl, c):
  _check(impl, c)


@pytest.mark.parametrize("impl", IMPLS)
@settings(settings(PROFILE, max_examples=max(PROFILE.max_examples // 2, 10)))
@given(c=ragged_cases(nan_at_visible=True))
def test_visible_nan_reaches_exactly_its_rows(impl, c):
  _check(impl, c)


def _check(impl, c):
  a = c["args"]
  note = repr(c)
  result = _call(impl, **{n: (jnp.asarray(x) if isinstance(x, np.ndarray) and n in ("q", "k", "v") else x)
                          for n, x in a.items()})
  out, lse = result[:2]
  ref_out, ref_lse = expected(c)
  assert_matches(out, ref_out, 1e-4, 1e-4, what=f"out [{impl}] {note}")
  assert_matches(lse, ref_lse, 1e-4, 1e-5, what=f"lse [{impl}] {note}")
  if c["cfg"]["fused"]:
    # Back to [Hkv, A, B, D] (A, B: pages and slots, or sequences and positions).
    back = lambda x: x.transpose(2, 0, 1, 3) if a["kv_layout"] == "NHD" else (
        x if c["cfg"]["paged"] else x.transpose(1, 0, 2, 3))
    for got, want, name in ((result[2], c["after_k"], "k"), (result[3], c["after_v"], "v")):
      bad = np.argwhere(_bits(back(np.asarray(got))) != _bits(want))
      assert not bad.size, f"{name}: the fused write changed slot {tuple(bad[0])} wrongly [{impl}] {note}"


# --- invalid calls -----------------------------------------------------------------------


def _base():
  """A small valid fused step: 2 sequences (3 new tokens of 5, 1 of 2), 2 padding rows,
  a pool of 6 pages of 4 tokens, Hq 4, Hkv 2, D 8."""
  rng = np.random.default_rng(0)
  return dict(q=rng.normal(size=(6, 4, 8)).astype(np.float32), k=rng.normal(size=(2, 6, 4, 8)).astype(np.float32),
              v=rng.normal(size=(2, 6, 4, 8)).astype(np.float32), kv_lens=np.array([5, 2], np.int32),
              block_tables=np.array([[0, 1], [2, 3]], np.int32), cu_q_lens=np.array([0, 3, 4, ], np.int32),
              num_seqs=2, kw=dict(new_k=np.zeros((6, 2, 8), np.float32), new_v=np.ones((6, 2, 8), np.float32)))


# ragged_decode's static options: (name, a valid value for `_base`, the scalar types to try).
STATIC_SCALARS = [("softmax_scale", 0.3, FLOATS), ("logits_soft_cap", 5.0, FLOATS), ("window", 3, INTS),
                  ("num_splits", 2, INTS), ("block_k", 8, INTS), ("causal", True, BOOLS)]


def _mutations():
  """(name, builder(draw, base), names the message may give, variant_ok: a variant the call
  may take, marked ``list`` or ``scalar`` in the base, which `_variant` applies)."""
  m = []

  def add(name, names, variant_ok=False):
    def deco(f):
      m.append((name, f, names, variant_ok))
      return f
    return deco

  def put(arg, *values):  # a mutation that sets one argument to one of ``values``
    def build(d, a):
      a[arg] = d(st.sampled_from(values)) if len(values) > 1 else values[0]
    return build

  table = lambda *rows, dtype=np.int32: np.array(rows, dtype)
  for name, arg, values, names in [
      ("q.ndim", "q", [np.zeros((1, 6, 4, 8), np.float32), np.zeros((6, 32), np.float32)], ("q",)),
      ("q.dtype", "q", [np.zeros((6, 4, 8), np.int32), np.zeros((6, 4, 8), np.complex64)], ("q",)),
      ("q object", "q", ["rows", object()], ("q",)),
      ("k.ndim", "k", [np.zeros((6, 4, 8), np.float32)], ("k",)),
      ("heads", "q", [np.zeros((6, 3, 8), np.float32)], ("Hq", "Hkv")),
      ("Dk", "q", [np.zeros((6, 4, 16), np.float32)], ("Dk", "q")),
      ("kv_lens.dtype", "kv_lens", [np.array([5.0, 2.0]), np.array([True, True])], ("kv_lens",)),
      ("kv_lens.shape", "kv_lens", [np.array([[5, 2]]), np.array([5, 2, 1]), np.array(5)], ("kv_lens", "cu_q_lens")),
      ("kv_lens range", "kv_lens", [np.array([-1, 2]), np.array([5, 9]), np.array([5, 2 ** 31 - 1])], ("kv_lens",)),
      ("kv_lens int64", "kv_lens", [np.array([2 ** 32 + 5, 2], np.int64)], ("kv_lens",)),
      ("q_len > kv_len", "kv_lens", [np.array([2, 2], np.int32), np.array([5, 0], np.int32)], ("kv_lens", "q_len")),
      ("cu_q_lens.dtype", "cu_q_lens", [np.array([0.0, 3.0, 4.0])], ("cu_q_lens",)),
      ("cu_q_lens.shape", "cu_q_lens", [np.array([0, 3]), np.array([[0, 3, 4]])], ("cu_q_lens",)),
      ("cu_q_lens values", "cu_q_lens", [np.array([1, 3, 4]), np.array([0, 3, 2]), np.array([0, 3, 9]),
                                         np.array([0, 3, 2 ** 32], np.int64)], ("cu_q_lens", "q_len")),
      ("num_seqs", "num_seqs", [3, -1, np.array([1, 1]), 1.5, np.array([[2]]), np.int64(2 ** 33)], ("num_seqs",)),
      ("block_tables.dtype", "block_tables", [table([0, 1], [2, 3], dtype=np.float32),
                                              table([0, 1], [2, 3], dtype=bool)], ("block_tables",)),
      ("block_tables.shape", "block_tables", [table([0, 1], [2, 3], [4, 5]), np.array([0, 1]),
                                              np.zeros((2, 2, 1), np.int32)], ("block_tables",)),
      ("block_tables range", "block_tables", [table([0, 1], [99, 3]), table([0, -1], [2, 3]),
                                              table([0, 1], [2 ** 32 + 2, 3], dtype=np.int64)], ("block_tables",)),
      ("block_tables aliased", "block_tables", [table([0, 0], [2, 3]), table([0, 1], [1, 3])], ("block_tables",)),
      ("kv_layout", "kv_layout", ["BSHD", "NHD", None], ("kv_layout",)),
  ]:
    m.append((name, put(arg, *values), names, False))

  @add("new_k / new_v", ("new_k", "new_v"))
  def _(d, a):
    case = d(st.sampled_from(["alone", "short", "int", "v None"]))
    if case == "alone":
      a["kw"].pop("new_v")
    elif case == "short":
      a["kw"]["new_k"] = a["kw"]["new_k"][:5]
    elif case == "int":
      a["kw"]["new_v"] = a["kw"]["new_v"].astype(np.int32)
    else:
      a["v"] = None
      a["kw"]["v_head_dim"] = 8

  @add("options", ("kv_offset", "lengths", "window", "softmax_scale", "logits_soft_cap", "impl", "num_splits",
                   "block_k", "mask", "bias", "sinks", "k_rope", "causal"))
  def _(d, a):
    a["kw"].update(d(st.sampled_from([
        dict(kv_offset=3), dict(lengths=[5, 2]), dict(window=0), dict(softmax_scale=float("nan")),
        dict(logits_soft_cap=-1.0), dict(impl="cuda"), dict(num_splits=0), dict(causal="yes"),
        dict(mask=np.ones((7, 8), bool)), dict(mask=np.ones((6, 8), np.int32)), dict(bias=np.ones((6, 9), np.float32)),
        dict(sinks=np.ones(3, np.float32)), dict(k_rope=np.ones((2, 6, 4, 4), np.float32)),
        # concrete jax scalars (and arrays) outside flash_decode's domain
        dict(window=jnp.int32(0)), dict(window=jnp.array([3, 4])), dict(softmax_scale=jnp.float32(np.nan)),
        dict(logits_soft_cap=jnp.float32(-1.0)), dict(num_splits=jnp.int32(0)), dict(block_k=jnp.float32(1.5)),
        dict(causal=jnp.int32(1))])))

  # A static option as a concrete jax / numpy scalar: the Python value it holds (never refused).
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

  for name in ("q", "kv_lens", "block_tables", "cu_q_lens", "new_k"):
    def _list(d, a, name=name):
      a["list"] = name
    m.append((f"list:{name}", _list, (name,), True))
  return m


MUTATIONS = _mutations()


def _variant(a):
  """The variant a mutation marked: an argument as a Python list (``list``), or a static
  option as a jax / numpy scalar (``scalar``)."""
  a = dict(a, kw=dict(a["kw"]))
  if "scalar" in a:
    name, kind = a["scalar"]
    a["kw"][name] = kind(a["kw"][name])
  elif a["list"] in a:
    a[a["list"]] = a[a["list"]].tolist()
  else:
    a["kw"][a["list"]] = a["kw"][a["list"]].tolist()
  return a


def _run_ragged(a):
  a = dict(a)
  kw = a.pop("kw")
  for mark in ("list", "scalar"):
    a.pop(mark, None)
  traced = a.pop("traced", None)
  layout = a.pop("kv_layout", "HND")
  if traced:  # the static option as an argument of a jit-ed function
    value = kw.pop(traced)
    return jax.jit(lambda x: fdecode.ragged_decode(**a, kv_layout=layout, return_lse=True, **kw, **{traced: x}))(value)
  return fdecode.ragged_decode(**a, kv_layout=layout, return_lse=True, **kw)


@settings(INVALID_PROFILE)
@given(data=st.data())
def test_invalid_steps_name_the_argument(data):
  name, build, names, variant_ok = data.draw(st.sampled_from(MUTATIONS), label="mutation")
  a = _base()
  build(data.draw, a)
  plain = a
  if variant_ok:
    a = _variant(a)
  try:
    result = _run_ragged(a)
  except (ValueError, TypeError) as e:
    msg = str(e)
    assert "scalar" not in a, f"{name}: a valid static as a {a['scalar'][1].__name__} refused: {msg}"
    if "traced" in a:  # the option, in the way to pass it static
      names = (f"static_argnames=('{a['traced']}',)",)
    assert any(n in msg for n in names), f"{name}: message does not name {names}: {type(e).__name__}: {msg}"
    assert msg.startswith("ragged_decode") and len(msg) < 1500, f"{name}: {msg[:300]}"
    return
  except Exception as e:  # noqa: BLE001 - anything else is the failure being looked for
    raise AssertionError(f"{name}: {type(e).__name__} instead of ValueError/TypeError: {e}") from e
  assert variant_ok, f"{name}: invalid call accepted"
  for x, y in zip(result, _run_ragged(plain)):  # a variant means the plain call: one program, bit for bit
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{name}: variant != plain call")
