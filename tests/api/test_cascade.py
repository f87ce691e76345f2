"""Shared-prefix (cascade) decode against flash_decode's reference over the concatenated
per-sequence cache: contiguous and paged, 8-bit, f32 / bf16, T = 1 and 3, one and several
prefixes shared unevenly, empty prefix / suffix, sinks once, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
import fdecode.flax
from fdecode.cache.quant import dequantize, quantize
from helpers import assert_close, tol

B, HQ, HKV, D, SP, S = 4, 8, 2, 32, 100, 24


def _problem(seed, *, n, t, dtype=jnp.float32, dv=D, hkv=HKV):
  """q, prefix caches [N, Hkv, SP, D], suffix caches [B, Hkv, S, D] (float32 values, cast)."""
  r = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.float32).astype(dtype)
  q = normal(B, HQ, D) if t is None else normal(B, t, HQ, D)
  return q, normal(n, hkv, SP, D), normal(n, hkv, SP, dv), normal(B, hkv, S, D), normal(B, hkv, S, dv)


def _case(n, t):
  """(prefix_lengths, prefix_ids, lengths): uneven sharing, a length-0 prefix for N=3,
  suffix lengths T (just the new tokens), S, and 0 (empty suffix) when T=1."""
  tt = 1 if t is None else t
  if n == 1:
    plens, ids = np.array([SP]), np.zeros(B, np.int32)
  else:
    plens, ids = np.array([SP, 0, 37]), np.array([2, 1, 2, 2], np.int32)
  lens = np.array([tt, 17, S, 0 if t is None else 5])
  return plens, ids, lens


def _poison(x, lens):
  """NaN in every slot past each row's length: dead slots must be selected away."""
  live = np.arange(x.shape[2])[None, :] < np.asarray(lens)[:, None]
  return jnp.where(jnp.asarray(live)[:, None, :, None], x, jnp.nan)


def _reference(q, pk, pv, plens, k, v, lens, ids, **mods):
  """flash_decode(impl="reference") over each sequence's prefix + suffix, materialized
  in float32 with numpy (``pv`` None: MLA, values are k's first columns)."""
  pk, k = np.asarray(pk, np.float32), np.asarray(k, np.float32)
  pv = None if pv is None else np.asarray(pv, np.float32)
  v = None if v is None else np.asarray(v, np.float32)
  total = np.asarray(plens)[ids] + np.asarray(lens)
  cap = int(total.max()) + 1
  full_k = np.zeros((len(ids), k.shape[1], cap, k.shape[3]), np.float32)
  full_v = None if v is None else np.zeros((len(ids), v.shape[1], cap, v.shape[3]), np.float32)
  for b, i in enumerate(ids):
    p, s = int(plens[i]), int(lens[b])
    full_k[b, :, :p], full_k[b, :, p:p + s] = pk[i, :, :p], k[b, :, :s]
    if v is not None:
      full_v[b, :, :p], full_v[b, :, p:p + s] = pv[i, :, :p], v[b, :, :s]
  q32 = jnp.asarray(q, jnp.float32)
  return fdecode.flash_decode(q32, jnp.asarray(full_k), None if v is None else jnp.asarray(full_v),
                              jnp.asarray(total), impl="reference", return_lse=True, **mods)


def _check(got, ref, dtype):
  (out, lse), (ref_out, ref_lse), t = got, ref, tol(dtype)
  assert out.dtype == jnp.dtype(dtype) and lse.dtype == jnp.float32
  assert_close(out, ref_out, atol=t["atol"], rtol=t["rtol"])
  assert_close(lse, ref_lse, atol=t["lse"], rtol=t["lse"], what="lse")


# Every dtype, T and N, in four calls (suite time): each pair of values meets once or more.
@pytest.mark.parametrize("dtype, t, n", [(jnp.float32, None, 3), (jnp.float32, 3, 1), (jnp.bfloat16, 3, 3),
                                         (jnp.bfloat16, None, 1)], ids=["f32-T1-N3", "f32-T3-N1", "bf16-T3-N3",
                                                                       "bf16-T1-N1"])
def test_contiguous_matches_reference(dtype, t, n):
  q, pk, pv, k, v = _problem(0, n=n, t=t, dtype=dtype)
  plens, ids, lens = _case(n, t)
  pk, pv, k, v = _poison(pk, plens), _poison(pv, plens), _poison(k, lens), _poison(v, lens)
  got = fdecode.cascade_decode(q, pk, pv, plens, k, v, lens, prefix_ids=ids, return_lse=True,
                               impl="xla", num_splits=3)
  _check(got, _reference(q, pk, pv, plens, k, v, lens, ids), dtype)


def _paginate(x, page_size, seed):
  """Contiguous [R, Hkv, S, D] -> (shuffled pool [Hkv, P, page_size, D] with NaN spare
  pages and NaN past the capacity, table [R, n])."""
  r_, hkv, s, d = x.shape
  n = -(-s // page_size)
  x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, n * page_size - s), (0, 0)),
              constant_values=np.nan).astype(x.dtype)
  pages = x.reshape(r_, hkv, n, page_size, d).transpose(1, 0, 2, 3, 4).reshape(hkv, r_ * n, page_size, d)
  spare = jnp.full((hkv, 3, page_size, d), np.nan, jnp.float32).astype(x.dtype)
  perm = np.random.default_rng(seed).permutation(r_ * n + 3)  # pool slot perm[i] holds chunk i
  pool = jnp.concatenate([pages, spare], axis=1)[:, np.argsort(perm)]
  return pool, perm[: r_ * n].reshape(r_, n).astype(np.int32)


@pytest.mark.parametrize("page_size", [16, 1])
def test_paged_prefix_and_suffix(page_size):
  q, pk, pv, k, v = _problem(1, n=3, t=3)
  plens, ids, lens = _case(3, 3)  # 100, 0 and 37 tokens: 16 divides none of them
  (ppk, ptab), (ppv, _) = _paginate(pk, page_size, 0), _paginate(pv, page_size, 0)
  (sk, stab), (sv, _) = _paginate(k, page_size, 1), _paginate(v, page_size, 1)
  got = fdecode.cascade_decode(q, ppk, ppv, plens, sk, sv, lens, prefix_ids=ids, return_lse=True,
                               prefix_block_tables=ptab, block_tables=stab, impl="xla")
  _check(got, _reference(q, pk, pv, plens, k, v, lens, ids), jnp.float32)


def test_quantized_prefix_and_suffix():
  """An int8 prefix and an fp8 suffix, per-token scales, paged prefix."""
  q, pk, pv, k, v = _problem(2, n=3, t=3)
  plens, ids, lens = _case(3, 3)
  (pk8, pks), (pv8, pvs) = quantize(pk, jnp.int8), quantize(pv, jnp.int8)
  (k8, ks), (v8, vs) = quantize(k, jnp.float8_e4m3fn), quantize(v, jnp.float8_e4m3fn)
  (ppk, ptab), (ppv, _) = _paginate(pk8, 16, 0), _paginate(pv8, 16, 0)
  (pks_p, _), (pvs_p, _) = _paginate(pks, 16, 0), _paginate(pvs, 16, 0)
  got = fdecode.cascade_decode(q, ppk, ppv, plens, k8, v8, lens, prefix_ids=ids, return_lse=True,
                               prefix_block_tables=ptab, prefix_k_scale=pks_p, prefix_v_scale=pvs_p,
                               k_scale=ks, v_scale=vs, impl="xla")
  ref = _reference(q, dequantize(pk8, pks), dequantize(pv8, pvs), plens, dequantize(k8, ks),
                   dequantize(v8, vs), lens, ids)
  _check(got, ref, jnp.float32)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_pallas_interpret(paged):
  """The Triton kernel (Pallas interpreter) for both parts; T=3, three prefixes."""
  q, pk, pv, k, v = _problem(3, n=3, t=3)
  plens, ids, lens = _case(3, 3)
  kw = dict(impl="pallas", interpret=True, block_k=16)
  args = (pk, pv, plens, k, v, lens)
  if paged:
    (ppk, ptab), (ppv, _) = _paginate(pk, 16, 0), _paginate(pv, 16, 0)
    (sk, stab), (sv, _) = _paginate(k, 8, 1), _paginate(v, 8, 1)
    args, kw = (ppk, ppv, plens, sk, sv, lens), dict(kw, prefix_block_tables=ptab, block_tables=stab)
  got = fdecode.cascade_decode(q, *args, prefix_ids=ids, return_lse=True, **kw)
  _check(got, _reference(q, pk, pv, plens, k, v, lens, ids), jnp.float32)


def test_sinks_applied_once_and_modifiers_pass_through():
  q, pk, pv, k, v = _problem(4, n=3, t=3)
  plens, ids, lens = _case(3, 3)
  mods = dict(sinks=jnp.asarray(np.random.default_rng(0).normal(size=HQ) + 2, jnp.float32),
              logits_soft_cap=1.5, softmax_scale=0.3)
  got = fdecode.cascade_decode(q, pk, pv, plens, k, v, lens, prefix_ids=ids, return_lse=True, impl="xla", **mods)
  _check(got, _reference(q, pk, pv, plens, k, v, lens, ids, **mods), jnp.float32)


def test_non_causal_and_all_empty():
  """causal=False: every new token sees the whole suffix. A sequence whose prefix and
  suffix are both empty gives out 0 and lse -inf."""
  q, pk, pv, k, v = _problem(5, n=3, t=3)
  plens, ids = np.array([SP, 0, 37]), np.array([1, 0, 2, 1], np.int32)
  lens = np.array([0, 2, S, 9])
  got = fdecode.cascade_decode(q, pk, pv, plens, k, v, lens, prefix_ids=ids, return_lse=True,
                               impl="xla", causal=False)
  _check(got, _reference(q, pk, pv, plens, k, v, lens, ids, causal=False), jnp.float32)
  assert np.all(np.asarray(got[0][0]) == 0) and np.all(np.isneginf(np.asarray(got[1][0])))


def test_mla_values_from_keys():
  q, pk, _, k, _ = _problem(6, n=3, t=None)
  plens, ids, lens = _case(3, None)
  got = fdecode.cascade_decode(q, pk, None, plens, k, None, lens, prefix_ids=ids, return_lse=True,
                               v_head_dim=16, impl="xla")
  _check(got, _reference(q, pk, None, plens, k, None, lens, ids, v_head_dim=16), jnp.float32)


def test_under_jit_traced_ids_clip():
  q, pk, pv, k, v = _problem(7, n=3, t=3)
  plens, ids, lens = _case(3, 3)
  fn = jax.jit(lambda q, ids, pl, l: fdecode.cascade_decode(q, pk, pv, pl, k, v, l, prefix_ids=ids,
                                                            return_lse=True, impl="xla"))
  _check(fn(q, ids, plens, lens), _reference(q, pk, pv, plens, k, v, lens, ids), jnp.float32)
  clipped = fn(q, np.array([7, 1, -3, 2], np.int32), plens, lens)  # -> [2, 1, 0, 2]
  _check(clipped, _reference(q, pk, pv, plens, k, v, lens, np.array([2, 1, 0, 2])), jnp.float32)


def _call(**over):
  q, pk, pv, k, v = _problem(8, n=3, t=3)
  plens, ids, lens = _case(3, 3)
  args = dict(q=q, prefix_k=pk, prefix_v=pv, prefix_lengths=plens, k=k, v=v, lengths=lens)
  kw = dict(prefix_ids=ids, impl="xla")
  for name, x in over.items():
    (args if name in args else kw)[name] = x
  return fdecode.cascade_decode(*args.values(), **kw)


@pytest.mark.parametrize("over, match", [
    (dict(prefix_ids=np.array([0, 1, 3, 0])), r"prefix_ids must lie in \[0, N=3\).*prefix_ids\[2\] = 3"),
    (dict(prefix_ids=np.array([0, 1, 2])), r"prefix_ids must be \[B\]=\(4,\).*prefix_ids.shape=\(3,\)"),
    (dict(prefix_ids=np.zeros(4, np.float32)), r"prefix_ids must be integer"),
    (dict(prefix_lengths=np.array([1, 2])), r"prefix_lengths must be \[N\]=\(3,\).*\(2,\)"),
    (dict(prefix_lengths=np.array([1, 2, SP + 1])), r"prefix_lengths must lie in \[0, Sp=100\]"),
    (dict(prefix_k=jnp.zeros((3, 1, SP, D)), prefix_v=jnp.zeros((3, 1, SP, D))), r"same Hkv; got 1 and 2"),
    (dict(prefix_k=jnp.zeros((3, HKV, SP, 16))), r"same head dims.*prefix_k.shape=\(3, 2, 100, 16\)"),
    (dict(prefix_v=jnp.zeros((3, HKV, SP, 16))), r"same head dims"),
    (dict(prefix_v=None), r"prefix_v and v must both be given or both be None"),
    (dict(lengths=np.array([2, 17, S, 5])), r"lengths must be >= T; sequence 0 has length 2"),
    (dict(window=8), r"window not supported"),
    (dict(alibi_slopes=jnp.ones(HQ), kv_offset=3), r"alibi_slopes, kv_offset not supported"),
    (dict(mask=jnp.ones((B, S), bool)), r"mask not supported"),
    (dict(sinks=jnp.ones(3)), r"sinks must be float \[Hq\]=\(8,\)"),
])
def test_errors(over, match):
  with pytest.raises(ValueError, match=match):
    _call(**over)


def test_flax_layer_with_shared_prefix_matches_full_sequences():
  """DecodeAttention over a `shared_prefix` (RoPE keys rotated back by the prefix length)
  gives what the same layer gives over each full sequence (prefix + own tokens)."""
  from flax import nnx
  from fdecode.flax.prefix import cascade_decode_fn, shared_prefix
  e, t_own = 32, 3
  layer = fdecode.flax.DecodeAttention(e, num_heads=4, num_kv_heads=2, head_dim=16, sinks=True,
                                       rngs=nnx.Rngs(0))
  layer.sinks.set_value(jnp.linspace(-1.0, 1.0, 4))
  r = np.random.default_rng(0)
  plens, ids = np.array([9, 0, 5]), np.array([2, 0, 2, 1], np.int32)
  x_pre = jnp.asarray(r.normal(size=(3, 9, e)), jnp.float32)
  x_own = jnp.asarray(r.normal(size=(B, t_own, e)), jnp.float32)
  x_next = jnp.asarray(r.normal(size=(B, 1, e)), jnp.float32)
  # Reference: each full sequence (its prefix, then its own tokens) in the layer's own cache.
  full = np.zeros((B, 9 + t_own, e), np.float32)
  for b, i in enumerate(ids):
    full[b, :plens[i]], full[b, plens[i]:plens[i] + t_own] = x_pre[i, :plens[i]], x_own[b]
  layer.init_cache(batch=B, max_len=32)
  layer.prefill(jnp.asarray(full), jnp.asarray(plens[ids] + t_own))
  ref = layer.decode(x_next)
  # Cascade: the prefixes prefilled once, each sequence's own tokens decoded over them.
  layer.init_cache(batch=3, max_len=16)
  layer.prefill(x_pre, jnp.asarray(plens))
  prefix = shared_prefix(layer)
  layer.init_cache(batch=B, max_len=16)
  layer.decode_fn = cascade_decode_fn(prefix, prefix_ids=ids, impl="xla")
  layer.decode(x_own)
  assert_close(layer.decode(x_next), ref, atol=1e-4, rtol=1e-4)
