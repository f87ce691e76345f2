"""fdecode.flax.MLADecodeAttention against a naive numpy (float64) MLA (per-head K/V decompressed,
plain causal softmax over the whole history; no fdecode)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fdecode
import fdecode.flax as fflax
from helpers import assert_close

E, HQ, DN, DR, DC, DV = 64, 8, 16, 8, 32, 16
# One batch / capacity / prompt width everywhere: flash_decode compiles once per shape.
B, S, L = 3, 16, 6
ATOL = RTOL = 2e-4  # float32, several matmuls deep
EPS = 1e-6


def _layer(seed=0, **kw):
  layer = fflax.MLADecodeAttention(E, HQ, kv_lora_rank=DC, qk_nope_head_dim=DN, qk_rope_head_dim=DR,
                                   v_head_dim=DV, rngs=nnx.Rngs(seed), **kw)
  # Non-trivial norm scales, so a skipped or misplaced norm shows.
  rng = np.random.default_rng(seed + 100)
  layer.kv_norm.scale.set_value(jnp.asarray(rng.uniform(0.5, 1.5, DC), jnp.float32))
  if layer.q_a_norm is not None:
    layer.q_a_norm.scale.set_value(jnp.asarray(rng.uniform(0.5, 1.5, layer.q_a_norm.scale.shape), jnp.float32))
  return layer


# --------------------------------------------------------------------------------------
# The naive oracle: numpy float64, one sequence at a time.


def _np(x):
  return np.asarray(x[...], np.float64)


def _rms(x, scale):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * scale


def _rope(x, pos, theta=10000.0):
  """x [N, ..., D] rotate-half at positions pos [N]."""
  half = x.shape[-1] // 2
  freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
  ang = pos.reshape((-1,) + (1,) * (x.ndim - 1)) * freq
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def naive_latent(layer, xs):
  """xs [N, E] (positions 0..N-1) -> c_kv [N, Dc], k_rope [N, Dr]."""
  kv = xs @ _np(layer.kv_a_proj.kernel)
  return _rms(kv[:, :DC], _np(layer.kv_norm.scale)), _rope(kv[:, DC:], np.arange(len(xs)))


def naive_mla(layer, xs):
  """xs [N, E] float, one whole sequence at positions 0..N-1 -> outputs [N, E] (float64)."""
  xs = np.asarray(xs, np.float64)
  n = len(xs)
  pos = np.arange(n)
  if layer.q_proj is not None:
    q = xs @ _np(layer.q_proj.kernel)
  else:
    q = _rms(xs @ _np(layer.q_a_proj.kernel), _np(layer.q_a_norm.scale)) @ _np(layer.q_b_proj.kernel)
  q = q.reshape(n, HQ, DN + DR)
  q = np.concatenate([q[..., :DN], _rope(q[..., DN:], pos)], -1)  # [N, Hq, Dn + Dr]
  c_kv, k_rope = naive_latent(layer, xs)
  k_nope = np.einsum("nc,hcd->nhd", c_kv, _np(layer.w_uk))  # [N, Hq, Dn]
  k = np.concatenate([k_nope, np.broadcast_to(k_rope[:, None], (n, HQ, DR))], -1)
  v = np.einsum("nc,hcd->nhd", c_kv, _np(layer.w_uv))  # [N, Hq, Dv]
  s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(DN + DR)
  s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  o = np.einsum("hqk,khd->qhd", p, v).reshape(n, HQ * DV)
  return o @ _np(layer.o_proj.kernel)


# --------------------------------------------------------------------------------------


def _prompts(seed=1):
  return np.random.default_rng(seed).standard_normal((B, L, E)).astype(np.float32)


def _run_and_check(layer, *, prompt_lens=(5, 1, 0), steps=(1, 2, 1, 2), seed=1, check=True):
  """Prefill + decode steps; each output checked against naive_mla on the full history.
  Returns the list of outputs."""
  b = len(prompt_lens)
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((b, L, E)).astype(np.float32)
  hist = [x[i, :n] for i, n in enumerate(prompt_lens)]
  outs = [layer.prefill(jnp.asarray(x), jnp.asarray(prompt_lens, jnp.int32))]
  if check:
    for i, n in enumerate(prompt_lens):
      if n:
        assert_close(outs[0][i, :n], naive_mla(layer, hist[i]), atol=ATOL, rtol=RTOL, what=f"prefill seq {i}")
      np.testing.assert_array_equal(np.asarray(outs[0][i, n:]), 0)
  for step, t in enumerate(steps):
    xt = rng.standard_normal((b, t, E)).astype(np.float32)
    outs.append(layer.decode(jnp.asarray(xt)))
    for i in range(b):
      hist[i] = np.concatenate([hist[i], xt[i]])
      if check:
        assert_close(outs[-1][i], naive_mla(layer, hist[i])[-t:], atol=ATOL, rtol=RTOL,
                     what=f"decode step {step} (T={t}) seq {i}")
  np.testing.assert_array_equal(np.asarray(layer.lengths[...]), [len(h) for h in hist])
  return outs


@pytest.mark.parametrize("page_size", [None, 4])
def test_matches_naive_mla(page_size):
  layer = _layer()
  layer.init_cache(batch=B, max_len=S, page_size=page_size)
  _run_and_check(layer, steps=(1, 2, 1, 2) if page_size is None else (2, 2))


def test_q_lora_matches_naive():
  layer = _layer(seed=3, q_lora_rank=24)
  layer.init_cache(batch=B, max_len=S)
  _run_and_check(layer, steps=(2, 1))


def test_cache_holds_only_the_latent():
  """Dc + Dr values per token, one latent head for all Hq query heads, written once."""
  layer = _layer()
  layer.init_cache(batch=B, max_len=S)
  assert layer.cached_latent.shape == (B, 1, S, DC)
  assert layer.cached_rope.shape == (B, 1, S, DR)
  per_token = sum(np.prod(getattr(layer, n).shape) for n in layer.cache_arrays) / (B * S)
  assert per_token == DC + DR
  x = _prompts()
  layer.prefill(jnp.asarray(x), jnp.asarray([L, 2, 4], jnp.int32))
  for i, n in enumerate((L, 2, 4)):
    c_kv, k_rope = naive_latent(layer, x[i, :n])
    assert_close(layer.cached_latent[...][i, 0, :n], c_kv, atol=1e-5, rtol=1e-5, what="latent")
    assert_close(layer.cached_rope[...][i, 0, :n], k_rope, atol=1e-5, rtol=1e-5, what="rope key")
  # Padding slots (past a length) may hold anything; slots past L were never written.
  np.testing.assert_array_equal(np.asarray(layer.cached_latent[...][:, 0, L:]), 0)


def test_pallas_interpret_decode():
  """The Triton kernel, interpreted, on the absorbed query: same as the XLA path."""
  fd = functools.partial(fdecode.flash_decode, impl="pallas", interpret=True)
  ours, xla = _layer(decode_fn=fd), _layer()
  x = _prompts(5)
  xt = np.random.default_rng(6).standard_normal((B, 2, E)).astype(np.float32)
  outs = []
  for layer in (ours, xla):
    layer.init_cache(batch=B, max_len=S)
    layer.prefill(jnp.asarray(x), jnp.asarray([5, 3, 0], jnp.int32))
    outs.append(layer.decode(jnp.asarray(xt)))
  assert_close(outs[0], outs[1], atol=ATOL, rtol=RTOL, what="pallas vs xla")
  want = naive_mla(xla, np.concatenate([x[1, :3], xt[1]]))[-2:]
  assert_close(outs[0][1], want, atol=ATOL, rtol=RTOL, what="pallas vs naive")


def test_jit_decode_and_overflow():
  """Under nnx.jit: same results as eager; a sequence past S gets NaN rows, no write."""
  layer, ref = _layer(), _layer()
  step = nnx.jit(lambda m, x: m.decode(x))
  for m in (layer, ref):
    m.init_cache(batch=B, max_len=S)
    m.prefill(jnp.asarray(_prompts(2)), jnp.asarray([3, 1, 6], jnp.int32))
  xt = jnp.asarray(np.random.default_rng(3).standard_normal((B, 2, E)), jnp.float32)
  assert_close(step(layer, xt), ref.decode(xt), atol=1e-5, rtol=1e-5, what="jit decode")
  layer.lengths.set_value(jnp.asarray([S - 1, 5, 8], jnp.int32))  # seq 0: 2 more do not fit
  before = np.asarray(layer.cached_latent[...])
  out = np.asarray(step(layer, xt))
  assert np.isnan(out[0]).all() and np.isfinite(out[1:]).all()
  np.testing.assert_array_equal(np.asarray(layer.lengths[...]), [S - 1, 7, 10])
  np.testing.assert_array_equal(np.asarray(layer.overflowed[...]), [True, False, False])
  np.testing.assert_array_equal(np.asarray(layer.cached_latent[...])[0], before[0])


def test_fp8_latent_cache():
  """float8_e4m3fn latent (per-token scales), float32 k_rope: close to the float cache."""
  q8, f32 = _layer(), _layer()
  q8.init_cache(batch=B, max_len=S, dtype=jnp.float8_e4m3fn, rope_dtype=jnp.float32)
  f32.init_cache(batch=B, max_len=S)
  assert q8.latent_scale.shape == (B, 1, S, 1) and q8.cached_rope.dtype == jnp.float32
  got = _run_and_check(q8, steps=(2, 2), check=False)
  want = _run_and_check(f32, steps=(2, 2), check=False)
  for i, (a, w) in enumerate(zip(got[1:], want[1:])):
    err = float(jnp.max(jnp.abs(a - w)))
    assert err < 0.08 * float(jnp.max(jnp.abs(w))), f"step {i}: fp8 error {err}"


def test_errors_leave_state_unchanged():
  with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
    fflax.MLADecodeAttention(E, HQ, kv_lora_rank=DC, qk_nope_head_dim=DN, qk_rope_head_dim=7,
                             v_head_dim=DV, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="kv_lora_rank must be a positive int"):
    fflax.MLADecodeAttention(E, HQ, kv_lora_rank=0, qk_nope_head_dim=DN, qk_rope_head_dim=DR,
                             v_head_dim=DV, rngs=nnx.Rngs(0))
  layer = _layer()
  with pytest.raises(ValueError, match="no cache"):
    layer.decode(jnp.zeros((B, 1, E)))
  with pytest.raises(ValueError, match="max_len must be a positive int"):
    layer.init_cache(batch=2, max_len=0)
  layer.init_cache(batch=B, max_len=S)
  layer.prefill(jnp.asarray(_prompts()), jnp.asarray([L, 2, 0], jnp.int32))
  layer.lengths.set_value(jnp.asarray([S - 1, 2, 0], jnp.int32))  # seq 0 one token from full
  state = {n: np.asarray(getattr(layer, n)[...]) for n in layer.cache_arrays + ("lengths", "overflowed")}
  bad = [
      (lambda: layer.decode(jnp.zeros((B, 1, E + 1))), r"x must be \[B, T, E\]=\[3, T, 64\]; got x.shape=\(3, 1, 65\)"),
      (lambda: layer.decode(jnp.zeros((2, 1, E))), r"x.shape=\(2, 1, 64\)"),
      (lambda: layer.decode(jnp.zeros((B, 0, E))), "at least one token"),
      (lambda: layer.decode(jnp.zeros((B, 1, E), jnp.int32)), "floating point"),
      (lambda: layer.decode(jnp.zeros((B, 2, E))), "sequence 0 holds 15 tokens; 2 more exceed"),
      (lambda: layer.prefill(jnp.zeros((B, L, E)), jnp.asarray([3], jnp.int32)), r"lengths must be int \[B\]"),
      (lambda: layer.prefill(jnp.zeros((B, L, E)), jnp.asarray([7, 1, 1], jnp.int32)),
       r"lengths must lie in \[0, L=6\]"),
      (lambda: layer.prefill(jnp.zeros((B, S + 1, E)), jnp.asarray([1, 1, 1], jnp.int32)),
       "L=17 > cache capacity S=16"),
  ]
  for call, msg in bad:
    with pytest.raises(ValueError, match=msg):
      call()
    for n, v in state.items():
      np.testing.assert_array_equal(np.asarray(getattr(layer, n)[...]), v, err_msg=f"{n} changed ({msg})")
