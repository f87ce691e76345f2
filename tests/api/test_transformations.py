"""fdecode under JAX's transformations: derivatives of `flash_decode` on every cache form
and modifier against the float64 oracle (`helpers.grad.attention64`: plain autodiff of
plain jnp attention), forward and reverse mode, at odd shapes; garbage in dead slots in
the backward; jvp / vmap / scan / remat / export of the derivative; run-to-run bits.

Legend: B batch, T new tokens, Hq / Hkv heads, G = Hq // Hkv, S capacity, D head dim."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.cache.quant import quantize
from helpers import randn
from helpers.grad import assert_grads_close, attention64, x64
from helpers.paged import pour, with_garbage

IMPLS = ("default", "xla", "reference")
F32 = dict(atol=2e-5, rtol=2e-5)


def _impl(name):
  return None if name == "default" else name


def _weights(seed, out_shape, lse_shape):
  rng = np.random.default_rng(seed)
  return rng.standard_normal(out_shape), rng.standard_normal(lse_shape)


def _loss(out, lse, w, wl):
  """A scalar of out and the finite lse entries (a row with no key has lse -inf)."""
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return jnp.sum(out.astype(w.dtype) * w) + jnp.sum(lse.astype(wl.dtype) * wl)


def _check(fd, oracle, args, *, seed=0, tol=F32, tangents=True):
  """grad (and jvp) of ``fd(*args) -> (out, lse)`` against ``oracle(*args)`` in float64,
  each one jitted program (eager oracle ops would compile one program each)."""
  out, lse = jax.eval_shape(fd, *args)
  w, wl = _weights(seed, out.shape, lse.shape)
  argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating))
  got = jax.jit(jax.grad(lambda *a: _loss(*fd(*a), jnp.asarray(w, jnp.float32), jnp.asarray(wl, jnp.float32)),
                         argnums=argnums))(*args)
  with x64():
    args64 = [jnp.asarray(np.asarray(a, np.float64)) if i in argnums else a for i, a in enumerate(args)]
    want = jax.jit(jax.grad(lambda *a: _loss(*oracle(*a), jnp.asarray(w), jnp.asarray(wl)),
                            argnums=argnums))(*args64)
  assert_grads_close(got, want, **tol)
  if tangents:
    rng = np.random.default_rng(seed + 1)
    dirs = [rng.standard_normal(np.shape(args[i])) for i in argnums]
    along = lambda f, full: lambda *xs: f(*[xs[argnums.index(i)] if i in argnums else a for i, a in enumerate(full)])
    dout, dlse = jax.jit(lambda *d: jax.jvp(along(fd, args), tuple(args[i] for i in argnums), d)[1])(
        *(jnp.asarray(d, args[i].dtype) for d, i in zip(dirs, argnums)))
    with x64():
      eout, else_ = jax.jit(lambda *d: jax.jvp(along(oracle, args64), tuple(args64[i] for i in argnums), d)[1])(
          *(jnp.asarray(d) for d in dirs))
    finite = np.isfinite(np.asarray(else_))
    assert_grads_close((dout, jnp.where(finite, dlse, 0.0)), (eout, jnp.where(finite, else_, 0.0)), **tol,
                       what="jvp")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,hq,hkv,s,lengths", [
    (None, 4, 2, 64, [64, 1]),        # one token, full and length 1
    (None, 5, 1, 129, [0, 128]),      # G=5, length 0 and block-1
    (3, 7, 1, 65, [65, 3]),           # T=3, G=7, block+1
    (3, 6, 2, 40, [2, 40]),           # a row that sees nothing (length 2 < T)
])
def test_grad_contiguous_matches_oracle(impl, t, hq, hkv, s, lengths):
  b, d = 2, 16
  q = randn(1, (b, hq, d) if t is None else (b, t, hq, d))
  k, v = randn(2, (b, hkv, s, d)), randn(3, (b, hkv, s, d))
  lengths = jnp.asarray(lengths)
  fd = lambda q, k, v: fdecode.flash_decode(q, k, v, lengths, impl=_impl(impl), return_lse=True)
  oracle = lambda q, k, v: attention64(q, k, v, lengths, return_lse=True)
  _check(fd, oracle, (q, k, v))


MODS = {
    "bias": lambda r, b, t, hq, s: dict(bias=randn(r, (b, t, hq, s))),
    "alibi": lambda r, b, t, hq, s: dict(alibi_slopes=randn(r, (hq,)) * 0.1),
    "sinks": lambda r, b, t, hq, s: dict(sinks=randn(r, (hq,))),
    "window": lambda r, b, t, hq, s: dict(window=9),
    "soft_cap": lambda r, b, t, hq, s: dict(logits_soft_cap=2.0),
    "mask": lambda r, b, t, hq, s: dict(mask=jnp.asarray(np.random.default_rng(r).random((b, t, 1, s)) > 0.3)),
    "non_causal": lambda r, b, t, hq, s: dict(causal=False),
}
_ORACLE_NAMES = dict(bias="bias", alibi_slopes="alibi", sinks="sinks", window="window", logits_soft_cap="soft_cap",
                     mask="mask", causal="causal")
_FLOAT_MODS = ("bias", "alibi_slopes", "sinks")


@pytest.mark.parametrize("impl", ("default", "reference"))
@pytest.mark.parametrize("mod", sorted(MODS))
def test_grad_modifiers_match_oracle(impl, mod):
  """Every modifier, with its float arrays (bias, ALiBi slopes, sinks) differentiated too."""
  b, t, hq, hkv, s, d = 2, 3, 4, 2, 33, 16
  q, k, v = randn(1, (b, t, hq, d)), randn(2, (b, hkv, s, d)), randn(3, (b, hkv, s, d))
  lengths = jnp.asarray([33, 17])
  kw = MODS[mod](4, b, t, hq, s)
  floats = {n: x for n, x in kw.items() if n in _FLOAT_MODS}
  statics = {n: x for n, x in kw.items() if n not in _FLOAT_MODS}
  names = sorted(floats)

  def fd(q, k, v, *xs):
    return fdecode.flash_decode(q, k, v, lengths, impl=_impl(impl), return_lse=True, **statics,
                                **dict(zip(names, xs)))

  def oracle(q, k, v, *xs):
    kw64 = {_ORACLE_NAMES[n]: x for n, x in {**statics, **dict(zip(names, xs))}.items()}
    return attention64(q, k, v, lengths, return_lse=True, **kw64)

  _check(fd, oracle, (q, k, v, *(floats[n] for n in names)))


def _dense_pool(pool, tables):
  """A head-major pool ``[Hkv, P, ps, D]`` read through ``tables [B, n]`` -> ``[B, Hkv, n*ps, D]``."""
  hkv, _, ps, d = pool.shape
  b, n = tables.shape
  return pool[:, jnp.clip(tables, 0, pool.shape[1] - 1)].reshape(hkv, b, n * ps, d).transpose(1, 0, 2, 3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("page_size,layout", [(1, "HND"), (16, "HND"), (8, "NHD")])
def test_grad_paged_pool_lands_in_pages_read(impl, dtype, page_size, layout):
  """The pool's gradient lands in the pages read: a page shared by both sequences (a fork)
  accumulates both, a page no table entry a row sees names gets exactly 0 (16-bit pools
  included: the XLA path's integer-word reads are outside the derivative)."""
  b, t, hq, hkv, n, d = 2, 2, 6, 2, 3, 16
  num_pages = 8
  q = randn(1, (b, t, hq, d), dtype)
  k_pool, v_pool = randn(2, (hkv, num_pages, page_size, d), dtype), randn(3, (hkv, num_pages, page_size, d), dtype)
  tables = np.array([[5, 2, 7], [5, 0, 6]], np.int32)  # page 5 shared; 1, 3, 4 unread
  lengths = np.array([n * page_size, page_size + 1])
  tables = jnp.asarray(with_garbage(tables, lengths, page_size, num_pages))
  lengths = jnp.asarray(lengths)
  stored = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(1, 2, 0, 3))  # [P, ps, Hkv, D]
  head = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(2, 0, 1, 3))
  kp, vp = stored(k_pool), stored(v_pool)
  fd = lambda q, k, v: fdecode.flash_decode(q, k, v, lengths, block_tables=tables, kv_layout=layout,
                                            impl=_impl(impl), return_lse=True)
  oracle = lambda q, k, v: attention64(q, _dense_pool(head(k), tables), _dense_pool(head(v), tables), lengths,
                                       return_lse=True)
  tol = F32 if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
  _check(fd, oracle, (q, kp, vp), tol=tol, tangents=dtype == jnp.float32)
  dk, dv = jax.jit(jax.grad(lambda k, v: jnp.sum(fd(q, k, v)[0].astype(jnp.float32)), argnums=(0, 1)))(kp, vp)
  for g in (head(dk), head(dv)):
    g = np.asarray(g.astype(jnp.float32))
    assert np.all(g[:, [1, 3, 4]] == 0), "unread pages get a gradient"
    assert np.any(g[:, 5] != 0) and np.any(g[:, 2] != 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grad_token_major_contiguous(impl, dtype):
  b, t, hq, hkv, s, d = 2, 3, 4, 2, 48, 16
  q = randn(1, (b, t, hq, d), dtype)
  k, v = randn(2, (b, s, hkv, d), dtype), randn(3, (b, s, hkv, d), dtype)
  lengths = jnp.asarray([48, 20])
  fd = lambda q, k, v: fdecode.flash_decode(q, k, v, lengths, kv_layout="NHD", impl=_impl(impl), return_lse=True)
  oracle = lambda q, k, v: attention64(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), lengths, return_lse=True)
  tol = F32 if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
  _check(fd, oracle, (q, k, v), tol=tol, tangents=dtype == jnp.float32)


@pytest.mark.parametrize("impl", ("default", "reference"))
@pytest.mark.parametrize("qdtype", ["int8", "float8_e4m3fn"])
def test_grad_8bit_cache_q_and_scales(impl, qdtype):
  """8-bit caches are storage: no gradient for their values (int8: float0; fp8: 0), the
  right one for q and the float scales."""
  b, t, hq, hkv, s, d = 2, 1, 4, 2, 40, 16
  q = randn(1, (b, t, hq, d))
  k, k_scale = quantize(randn(2, (b, hkv, s, d)), qdtype)
  v, v_scale = quantize(randn(3, (b, hkv, s, d)), qdtype)
  lengths = jnp.asarray([40, 9])
  fd = lambda q, ks, vs: fdecode.flash_decode(q, k, v, lengths, k_scale=ks, v_scale=vs, impl=_impl(impl),
                                              return_lse=True)
  k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (k, v))  # exact
  deq = lambda x, sc: jnp.asarray(x, sc.dtype) * sc
  oracle = lambda q, ks, vs: attention64(q, deq(k64, ks), deq(v64, vs), lengths, return_lse=True)
  _check(fd, oracle, (q, k_scale, v_scale))
  gk = jax.grad(lambda k: jnp.sum(fdecode.flash_decode(q, k, v, lengths, k_scale=k_scale, v_scale=v_scale,
                                                       impl=_impl(impl))), allow_int=True)(k)
  if qdtype == "int8":
    assert gk.dtype == jax.dtypes.float0
  else:
    assert not np.any(np.asarray(gk.astype(jnp.float32)))


@pytest.mark.parametrize("impl", ("default", "reference"))
def test_grad_mla_latents_and_rope(impl):
  """MLA: v=None (the values are k's first v_head_dim columns) with k_rope columns."""
  b, t, hq, s, dc, dr = 2, 2, 5, 33, 24, 8
  q = randn(1, (b, t, hq, dc + dr))
  k, rope = randn(2, (b, 1, s, dc)), randn(3, (b, 1, s, dr))
  lengths = jnp.asarray([33, 4])
  fd = lambda q, k, rope: fdecode.flash_decode(q, k, None, lengths, v_head_dim=16, k_rope=rope, impl=_impl(impl),
                                               return_lse=True)
  oracle = lambda q, k, rope: attention64(q, jnp.concatenate([k, rope], -1), k[..., :16], lengths, return_lse=True)
  _check(fd, oracle, (q, k, rope))


@pytest.mark.parametrize("impl", ("default", "reference"))
def test_grad_sparse_indices(impl):
  b, t, hq, hkv, s, d, kk = 2, 1, 4, 2, 64, 16, 12
  q, k, v = randn(1, (b, t, hq, d)), randn(2, (b, hkv, s, d)), randn(3, (b, hkv, s, d))
  rng = np.random.default_rng(4)
  idx = np.stack([np.sort(rng.choice(60, kk, replace=False)) for _ in range(b)])[:, None, :].astype(np.int32)
  idx[1, 0, -2:] = -1  # unused slots
  lengths = jnp.asarray([64, 50])
  mask = np.zeros((b, 1, 1, s), bool)
  for i in range(b):
    mask[i, 0, 0, idx[i, 0][idx[i, 0] >= 0]] = True
  fd = lambda q, k, v: fdecode.flash_decode(q, k, v, lengths, indices=jnp.asarray(idx), impl=_impl(impl),
                                            return_lse=True)
  oracle = lambda q, k, v: attention64(q, k, v, lengths, mask=jnp.asarray(mask), return_lse=True)
  _check(fd, oracle, (q, k, v))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("form", ["contiguous", "paged", "window", "causal_rows"])
def test_dead_slot_garbage_never_reaches_a_gradient(impl, form):
  """inf / NaN / huge values in slots no row sees: every gradient equals the one with
  zeros there, and the dead slots' own gradient is exactly 0."""
  b, t, hq, hkv, d = 2, 3, 4, 2, 16
  s, ps = 48, 8
  q = randn(1, (b, t, hq, d))
  lengths = np.array([30, 13])
  kw = {}
  if form == "paged":
    pool_k, pool_v = randn(2, (hkv, 12, ps, d)), randn(3, (hkv, 12, ps, d))
    tables = np.arange(12, dtype=np.int32).reshape(b, 6)
    pos = (np.arange(6)[:, None] * ps + np.arange(ps)[None, :])  # [n, ps]
    dead = np.zeros((hkv, 12, ps, 1), bool)
    for i in range(b):
      dead[:, tables[i]] = (pos >= lengths[i])[None, :, :, None]
    kw["block_tables"] = jnp.asarray(tables)
    k, v = pool_k, pool_v
  else:
    k, v = randn(2, (b, hkv, s, d)), randn(3, (b, hkv, s, d))
    p = np.arange(s)[None, :]
    if form == "window":
      kw["window"] = 5
      dead = (p >= lengths[:, None]) | (p <= lengths[:, None] - t - 5)  # before the first row's window
    else:
      dead = p >= lengths[:, None]
    dead = dead[:, None, :, None]
  lengths = jnp.asarray(lengths)
  clean_k, clean_v = jnp.where(dead, 0.0, k), jnp.where(dead, 0.0, v)
  dirty_k, dirty_v = pour(k, dead, 5), pour(v, dead, 6)
  extra = dict(bias=randn(7, (b, t, hq, s))) if form == "causal_rows" else {}
  if form == "causal_rows":  # the rows of the step see different slots; the future ones of row 0 are live
    extra["bias"] = jnp.where(jnp.arange(s) >= jnp.asarray(lengths)[:, None, None, None], jnp.nan, extra["bias"])

  def grads(k, v):
    f = lambda q, k, v, *bias: fdecode.flash_decode(q, k, v, lengths, impl=_impl(impl), return_lse=True,
                                                    **kw, **dict(zip(extra, bias)))
    loss = lambda *a: _loss(*f(*a), jnp.ones((b, t, hq, d)), jnp.ones((b, t, hq)))
    return jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(extra)))))(q, k, v, *extra.values())

  got, want = grads(dirty_k, dirty_v), grads(clean_k, clean_v)
  for g_dirty, g_clean in zip(got, want):
    gd = np.asarray(g_dirty)
    assert np.isfinite(gd).all()
    np.testing.assert_allclose(gd, np.asarray(g_clean), atol=1e-6, rtol=1e-6)
  for g in got[1:3]:
    assert np.all(np.asarray(jnp.where(dead, g, 0.0)) == 0)


@pytest.mark.parametrize("impl", ("default", "reference"))
def test_nan_a_row_sees_reaches_its_gradient(impl):
  """A NaN key a row sees makes that row's gradients NaN; the other sequence stays clean."""
  b, hq, hkv, s, d = 2, 4, 2, 32, 16
  q, k, v = randn(1, (b, hq, d)), randn(2, (b, hkv, s, d)), randn(3, (b, hkv, s, d))
  k = k.at[0, 1, 3, 2].set(jnp.nan)
  lengths = jnp.asarray([32, 32])
  dq = jax.grad(lambda q: jnp.sum(fdecode.flash_decode(q, k, v, lengths, impl=_impl(impl))))(q)
  dq = np.asarray(dq)
  assert np.isnan(dq[0, 2:]).all() and np.isfinite(dq[0, :2]).all() and np.isfinite(dq[1]).all()


def test_grad_ragged_step_matches_per_sequence_oracle():
  """A packed step (decodes and prefill chunks over a paged pool): each row's gradient is
  the one of its sequence alone (the oracle at T = q_len over that sequence's pages)."""
  from helpers.ragged import batch  # pylint: disable=import-outside-toplevel
  q_lens, kv_lens = [1, 5, 3], [20, 30, 9]
  p = batch(0, q_lens, kv_lens, max_seqs=4, page_size=8)
  tables, cu = np.asarray(p["block_tables"]), np.asarray(p["cu_q_lens"])
  live = int(cu[len(q_lens)])

  def fd(q, k, v):
    out, lse = fdecode.ragged_decode(q, k, v, p["kv_lens"], p["block_tables"], p["cu_q_lens"], p["num_seqs"],
                                     return_lse=True)
    return out[:live], lse[:live]

  def oracle(q, k, v):
    outs, lses = [], []
    for i, (t, n) in enumerate(zip(q_lens, kv_lens)):
      dense = lambda x: _dense_pool(x, jnp.asarray(tables[i:i + 1]))
      o, l = attention64(q[None, cu[i]:cu[i] + t], dense(k), dense(v), jnp.asarray([n]), return_lse=True)
      outs.append(o[0]), lses.append(l[0])
    return jnp.concatenate(outs), jnp.concatenate(lses)

  _check(fd, oracle, (p["q"], p["k"], p["v"]), tangents=False)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_grad_sharded_matches_one_device(axis_type):
  """Heads over one mesh axis, the sequence over another (the collective combine)."""
  at = getattr(jax.sharding.AxisType, axis_type)
  mesh = jax.make_mesh((2, 2), ("h", "s"), axis_types=(at, at))
  b, hq, hkv, s, d = 2, 8, 4, 64, 16
  q, k, v = randn(1, (b, hq, d)), randn(2, (b, hkv, s, d)), randn(3, (b, hkv, s, d))
  lengths = jnp.asarray([64, 20])
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
  want = jax.jit(jax.grad(loss(lambda q, k, v: fdecode.flash_decode(q, k, v, lengths)), argnums=(0, 1, 2)))(q, k, v)
  with jax.set_mesh(mesh):
    sharded = lambda q, k, v: fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, head_axis="h", seq_axis="s")
    got = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
  for a, e in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=2e-6, rtol=2e-6)


def test_grad_cascade_matches_the_concatenated_cache():
  """A shared prefix read once: its gradient is the sum over the sequences that share it."""
  b, hq, hkv, sp, ss, d = 2, 4, 2, 24, 16, 16
  q = randn(1, (b, hq, d))
  pk, pv = randn(2, (1, hkv, sp, d)), randn(3, (1, hkv, sp, d))
  sk, sv = randn(4, (b, hkv, ss, d)), randn(5, (b, hkv, ss, d))
  plen, slen = 20, np.array([16, 5])

  def fd(q, pk, pv, sk, sv):
    return fdecode.cascade_decode(q, pk, pv, jnp.asarray([plen]), sk, sv, jnp.asarray(slen),
                                  prefix_ids=jnp.asarray([0, 0]), return_lse=True)

  def oracle(q, pk, pv, sk, sv):
    cat = lambda p, x: jnp.concatenate([jnp.broadcast_to(p[:, :, :plen], (b,) + p.shape[1:2] + (plen, d)), x], 2)
    return attention64(q, cat(pk, sk), cat(pv, sv), jnp.asarray(plen + slen), return_lse=True)

  _check(fd, oracle, (q, pk, pv, sk, sv), tangents=False)


def test_grad_flax_attention_fn_matches_dot_product_attention():
  """`nnx.MultiHeadAttention` with fdecode's ``attention_fn`` (no decode: a padded batch
  of prompts) trains like the same module with Flax's own attention."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import fdecode.flax  # pylint: disable=import-outside-toplevel
  x = randn(1, (2, 5, 32))

  def grads(attention_fn):
    mha = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32, decode=False,
                                 attention_fn=attention_fn, rngs=nnx.Rngs(0))
    return nnx.grad(lambda m, x: jnp.sum(m(x) ** 2))(mha, x)

  got, want = grads(fdecode.flax.attention_fn), grads(nnx.dot_product_attention)
  for a, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=1e-5, rtol=1e-5)


def _small():
  b, t, hq, hkv, s, d = 2, 2, 4, 2, 40, 16
  return (randn(1, (b, t, hq, d)), randn(2, (b, hkv, s, d)), randn(3, (b, hkv, s, d))), jnp.asarray([40, 11])


def test_transformations_compose():
  """vmap of grad over several in_axes, grad inside scan, remat, a Hessian-vector
  product, export with its VJP, and run-to-run bits."""
  (q, k, v), lengths = _small()
  f = lambda q, k, v: jnp.sum(fdecode.flash_decode(q, k, v, lengths) ** 2)
  g = jax.jit(jax.grad(f, argnums=(0, 1, 2)))
  base = g(q, k, v)
  again = g(q, k, v)
  for a, e in zip(again, base):
    assert np.array_equal(np.asarray(a), np.asarray(e))  # run to run, bit for bit
  # vmap of grad over a stacked q (in_axes 0) and over a stacked cache (in_axes 1)
  # (vmap batches the matmuls anew: float32 reassociation, a few ulp of the values)
  qs = jnp.stack([q, 2 * q])
  vg = jax.vmap(g, in_axes=(0, None, None))(qs, k, v)
  np.testing.assert_allclose(np.asarray(vg[0][1]), np.asarray(g(2 * q, k, v)[0]), atol=1e-5, rtol=1e-5)
  ks = jnp.stack([k, -k], axis=1)
  vk = jax.vmap(g, in_axes=(None, 1, None), out_axes=1)(q, ks, v)
  np.testing.assert_allclose(np.asarray(vk[1][:, 1]), np.asarray(g(q, -k, v)[1]), atol=1e-5, rtol=1e-5)
  # remat and scan (a stacked cache per layer)
  rg = jax.jit(jax.grad(jax.checkpoint(f), argnums=0))(q, k, v)
  np.testing.assert_allclose(np.asarray(rg), np.asarray(base[0]), atol=1e-6, rtol=1e-6)
  layers = jnp.stack([k, k * 0.5])

  def scanned(q):
    def body(x, kl):
      return x + fdecode.flash_decode(x, kl, v, lengths), None
    return jnp.sum(jax.lax.scan(body, q, layers)[0])
  sg = jax.jit(jax.grad(scanned))(q)
  with x64():
    def scanned64(q):
      x = q
      for kl in (np.asarray(k, np.float64), np.asarray(k, np.float64) * 0.5):
        x = x + attention64(x, kl, np.asarray(v, np.float64), lengths)
      return jnp.sum(x)
    sg64 = jax.jit(jax.grad(scanned64))(jnp.asarray(np.asarray(q, np.float64)))
  np.testing.assert_allclose(np.asarray(sg), np.asarray(sg64), atol=2e-5, rtol=2e-5)
  # Hessian-vector product (forward over reverse) against the oracle's
  tq = randn(9, q.shape)
  hvp = jax.jit(lambda q: jax.jvp(jax.grad(lambda q: f(q, k, v)), (q,), (tq,))[1])(q)
  with x64():
    k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (k, v))
    f64 = lambda q: jnp.sum(attention64(q, k64, v64, lengths) ** 2)
    q64, t64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, tq))
    hvp64 = jax.jit(lambda q: jax.jvp(jax.grad(f64), (q,), (t64,))[1])(q64)
  np.testing.assert_allclose(np.asarray(hvp), np.asarray(hvp64), atol=5e-5, rtol=5e-5)
  # export with its VJP
  exp = jax.export.export(jax.jit(lambda q, k, v: fdecode.flash_decode(q, k, v, lengths)), platforms=["cpu"])(
      q, k, v)
  eg = jax.grad(lambda q: jnp.sum(exp.call(q, k, v) ** 2))(q)  # through exp.vjp(), the exported VJP
  np.testing.assert_allclose(np.asarray(eg), np.asarray(base[0]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("interpret", ["triton", "mosaic_tpu"])
def test_grad_through_the_interpreted_kernels(interpret):
  """The forward runs the interpreted kernel; the derivative is the same XLA tangent."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  (q, k, v), lengths = _small()
  flag = True if interpret == "triton" else pltpu.InterpretParams()
  fd = lambda q, k, v: fdecode.flash_decode(q, k, v, lengths, impl="pallas", interpret=flag, return_lse=True)
  _check(fd, lambda q, k, v: attention64(q, k, v, lengths, return_lse=True), (q, k, v), tangents=False)


def test_many_rows_over_a_long_cache_stream_in_the_forward_and_the_backward():
  """T=256 over S=64k (B=1, Hq=8, Hkv=2, D=64, f32): the XLA forward loops over chunks of
  scores (`fdecode.kernels.xla.plan.SCORE_BYTES`), and the whole grad program's temporaries
  stay under a quarter of one [B, Hq, T, S] float32 score matrix (compiled, not run)."""
  b, t, hq, hkv, s, d = 1, 256, 8, 2, 65536, 64
  q, k = jax.ShapeDtypeStruct((b, t, hq, d), jnp.float32), jax.ShapeDtypeStruct((b, hkv, s, d), jnp.float32)
  lengths = jnp.full((b,), s, jnp.int32)
  loss = lambda q, k, v: jnp.sum(fdecode.flash_decode(q, k, v, lengths))
  temp = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).compile().memory_analysis().temp_size_in_bytes
  assert temp <= b * hq * t * s * 4 // 4, f"{temp / 2**20:.0f} MiB"
  plan, = fdecode.plan(randn(0, (1, 1, hq, d)), randn(0, (b, hkv, 8, d)), randn(0, (b, hkv, 8, d)), lengths[:1] * 0 + 8,
                       platform="cpu")
  assert not plan.loop  # a decode keeps its one batched matmul


def test_looped_forward_matches_the_reference():
  """A contiguous call past `SCORE_BYTES` of scores loops over chunks, merged as they come."""
  b, t, hq, hkv, s, d = 1, 128, 8, 2, 20000, 16
  q, k, v = randn(1, (b, t, hq, d)), randn(2, (b, hkv, s, d)), randn(3, (b, hkv, s, d))
  lengths = jnp.asarray([19990])
  plan, = fdecode.plan(q, k, v, lengths, platform="cpu")
  assert plan.loop and plan.num_splits > 1
  out, lse = jax.jit(lambda q, k, v: fdecode.flash_decode(q, k, v, lengths, return_lse=True))(q, k, v)
  ref, ref_lse = fdecode.flash_decode(q, k, v, lengths, impl="reference", return_lse=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=3e-5, rtol=3e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=3e-5, rtol=3e-5)
