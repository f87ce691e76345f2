"""Flax layers with a batch-invariant mode (``batch_invariant = True``): `RMSNorm`, `Linear`
and `Embed`, drop-in subclasses of ``nnx.RMSNorm`` / ``nnx.Linear`` / ``nnx.Embed`` (the same
arguments and parameters; the default computation is theirs).

In the mode each row's bits depend on that row alone, whatever else is in the call: what
`fdecode.decoding.serving.Engine` ``(batch_invariant=True)`` needs besides attention
(`fdecode.flash_decode`'s mode). Measured on XLA:CPU (2026-12-02, a 2-core AVX2 CPU):

* a sum along the last axis changes its order with the number of rows (a row of 640
  features normalized alone and in a batch of 32 differed in its last bits): the norm's
  mean square is a fixed tree of elementwise adds instead (`invariant_sum`);
* a matmul's rounding changes with its row count: ``[N, 640] x [640, F]`` rows agreed for
  N from 2 to 32 and differed from N = 33 on (and at N = 1, a matrix-vector product).
  In the mode the rows go through the matmul in tiles of `ROW_TILE` (padded), one
  ``[ROW_TILE, K] x [K, F]`` product at a time (`tiled_matmul`): every row meets the same
  product whatever N is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

__all__ = ["Embed", "Linear", "RMSNorm", "ROW_TILE", "invariant_sum", "tiled_matmul"]

# Rows per matmul in the mode.
ROW_TILE = 32


def invariant_sum(x):
  """Sum of ``x`` over its last axis as a fixed tree of elementwise adds (halving, an odd
  tail added last): the same order for every row, whatever the other axes are."""
  tail = None
  while x.shape[-1] > 1:
    n = x.shape[-1]
    if n % 2:
      last = x[..., n - 1]
      tail = last if tail is None else tail + last
      x = x[..., :n - 1]
      n -= 1
    x = x[..., :n // 2] + x[..., n // 2:]
  total = x[..., 0]
  return total if tail is None else total + tail


class RMSNorm(nnx.RMSNorm):
  """``nnx.RMSNorm`` over the last axis (same arguments and parameters, ``scale``), plus
  ``batch_invariant`` (default False): True computes the mean square with `invariant_sum`
  in float32, so each row's bits depend on that row only (set by
  `fdecode.decoding.serving.Engine` ``(batch_invariant=True)``)."""

  def __init__(self, *args, batch_invariant: bool = False, **kwargs):
    super().__init__(*args, **kwargs)
    self.batch_invariant = batch_invariant

  def __call__(self, x, mask=None):
    if not getattr(self, "batch_invariant", False) or mask is not None or self.reduction_axes != -1:
      return super().__call__(x, mask)
    scale = self.scale[...] if self.scale else None
    x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
    xf = jnp.asarray(x, jnp.promote_types(jnp.result_type(x), jnp.float32))
    var = invariant_sum(lax.square(xf)) / jnp.asarray(xf.shape[-1], xf.dtype)
    mul = lax.rsqrt(var + self.epsilon)[..., None]
    with jax.numpy_dtype_promotion("standard"):  # Flax's own rule, under a caller's "strict" too
      if scale is not None:
        mul = mul * scale.astype(mul.dtype)
      out = self.dtype or jnp.result_type(*(a for a in (x, scale) if a is not None))
    return (xf * mul).astype(out)


def tiled_matmul(x, w, **dot):
  """``x [..., K] @ w [K, F]`` with the rows in tiles of `ROW_TILE` (the last padded with 0),
  one tile's product at a time: each row's result is the same whatever the row count.
  ``dot``: `jax.lax.dot_general`'s ``precision`` / ``preferred_element_type``."""
  lead, k = x.shape[:-1], x.shape[-1]
  # ``w`` materialized on its own: XLA would otherwise fold its producer (a transpose, a
  # convert) into a one-tile product (another kernel, another rounding: the tied output
  # projection's rows differed) but not into the tiles' loop.
  w = lax.optimization_barrier(w)
  rows = x.reshape(-1, k)
  n = rows.shape[0]
  tiles = max(-(-n // ROW_TILE), 1)
  rows = jnp.pad(rows, ((0, tiles * ROW_TILE - n), (0, 0)))
  one = lambda r: lax.dot_general(r, w, (((1,), (0,)), ((), ())), **dot)
  y = one(rows) if tiles == 1 else lax.map(one, rows.reshape(tiles, ROW_TILE, k)).reshape(tiles * ROW_TILE, -1)
  return y[:n].reshape(lead + (w.shape[-1],))


class Linear(nnx.Linear):
  """``nnx.Linear`` plus ``batch_invariant`` (default False): True runs the product as
  `tiled_matmul`."""

  def __init__(self, *args, batch_invariant: bool = False, **kwargs):
    super().__init__(*args, **kwargs)
    self.batch_invariant = batch_invariant

  def __call__(self, inputs, out_sharding=None):
    if not getattr(self, "batch_invariant", False) or out_sharding is not None:
      return super().__call__(inputs, out_sharding)
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    dot = dict(precision=self.precision)
    if self.preferred_element_type is not None:
      dot["preferred_element_type"] = self.preferred_element_type
    y = tiled_matmul(inputs, kernel, **dot)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class Embed(nnx.Embed):
  """``nnx.Embed`` plus ``batch_invariant`` (default False): True runs `attend` (the tied
  output projection) as `tiled_matmul`; the lookup is a gather either way."""

  def __init__(self, *args, batch_invariant: bool = False, **kwargs):
    super().__init__(*args, **kwargs)
    self.batch_invariant = batch_invariant

  def attend(self, query, out_sharding=None):
    if not getattr(self, "batch_invariant", False) or out_sharding is not None:
      return super().attend(query, out_sharding=out_sharding)
    query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
    return tiled_matmul(query, embedding.T)
