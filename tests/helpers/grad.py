"""The float64 oracle of the derivative tests: plain jnp attention in float64, written
without fdecode (no chunks, no saved LSE), whose ``jax.grad`` / ``jax.jvp`` are the
expected derivatives; and the comparison of gradient pytrees.

Legend: B batch, T new tokens, Hq / Hkv heads, S capacity, D head dim."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from helpers import host_f32


@contextlib.contextmanager
def x64():
  """float64 on for the oracle (restored after)."""
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", prev)


def attention64(q, k, v, lengths, *, scale=None, causal=True, mask=None, bias=None, alibi=None, window=None,
                soft_cap=None, sinks=None, return_lse=False):
  """q ``[B, T, Hq, Dk]`` (or ``[B, Hq, Dk]``), head-major contiguous k ``[B, Hkv, S, Dk]`` /
  v ``[B, Hkv, S, Dv]`` -> float64 out like q (last dim Dv), the documented semantics of
  `fdecode.flash_decode` (`fdecode.kernels.common.modifiers`). mask / bias broadcast to
  ``[B, T, Hq, S]``; alibi / sinks ``[Hq]``. Dead slots are selected twice (the
  double-``where``), so the oracle's own gradient is clean where its inputs are."""
  single = q.ndim == 3
  q = q[:, None] if single else q
  f = lambda x: None if x is None else jnp.asarray(x).astype(jnp.float64)
  q, k, v = f(q), f(k), f(v)
  b, t, hq, dk = q.shape
  hkv, s = k.shape[1], k.shape[2]
  g = hq // hkv
  scale = 1.0 / np.sqrt(dk) if scale is None else scale
  kk, vv = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
  sc = jnp.einsum("bthd,bhsd->bths", q, kk) * scale
  if soft_cap is not None:
    sc = soft_cap * jnp.tanh(sc / soft_cap)
  kpos = jnp.arange(s)[None, None, None, :]
  qpos = (jnp.asarray(lengths)[:, None] - t + jnp.arange(t)[None, :])[:, :, None, None]
  if alibi is not None:
    sc = sc + f(alibi)[None, None, :, None] * (kpos - qpos)
  if bias is not None:
    sc = sc + jnp.broadcast_to(f(bias), sc.shape)
  vis = kpos < jnp.clip(jnp.asarray(lengths), 0, s)[:, None, None, None]
  if causal:
    vis = vis & (kpos <= qpos)
  if window is not None:
    vis = vis & (kpos > qpos - window)
  if mask is not None:
    vis = vis & jnp.asarray(mask)
  vis = jnp.broadcast_to(vis, sc.shape)
  sc = jnp.where(vis, sc, -jnp.inf)
  cols = [sc] if sinks is None else [sc, jnp.broadcast_to(f(sinks)[None, None, :, None], (b, t, hq, 1))]
  full = jnp.concatenate(cols, axis=-1)
  m = jnp.max(full, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), jax.lax.stop_gradient(m), 0.0)
  e = jnp.where(jnp.concatenate([vis] + ([] if sinks is None else [jnp.ones((b, t, hq, 1), bool)]), -1),
                jnp.exp(full - m), 0.0)
  l = jnp.sum(e, axis=-1)
  p = e[..., :s] / jnp.where(l == 0, 1.0, l)[..., None]
  vv = jnp.where(jnp.any(vis, axis=1)[..., None], vv, 0.0)
  out = jnp.einsum("bths,bhsd->bthd", p, vv)
  lse = jnp.where(l == 0, -jnp.inf, m[..., 0] + jnp.log(jnp.where(l == 0, 1.0, l)))
  out = out[:, 0] if single else out
  lse = lse[:, 0] if single else lse
  return (out, lse) if return_lse else out


def assert_grads_close(actual, expected, *, atol, rtol, what="grad"):
  """Two gradient pytrees (arrays, float0 leaves skipped) agree within ``atol + rtol *
  max|expected|`` leaf by leaf; both are finite."""
  la, ta = jax.tree_util.tree_flatten(actual)
  le, te = jax.tree_util.tree_flatten(expected)
  assert ta == te, f"{what}: structure {ta} != {te}"
  for i, (a, e) in enumerate(zip(la, le)):
    if jnp.dtype(a.dtype) == jax.dtypes.float0:
      continue
    a, e = host_f32(a).astype(np.float64), np.asarray(e, np.float64)
    assert a.shape == e.shape, f"{what}[{i}]: shape {a.shape} != {e.shape}"
    assert np.isfinite(a).all(), f"{what}[{i}]: non-finite entries at {np.argwhere(~np.isfinite(a))[:5]}"
    bound = atol + rtol * np.abs(e).max()
    err = np.abs(a - e).max() if a.size else 0.0
    assert err <= bound, f"{what}[{i}]: max |error| {err:.3g} > {bound:.3g}"
