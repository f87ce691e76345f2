"""ragged_decode compile cases (tests/compile_tier/cases.py registers them): one serving
step over a paged pool or a contiguous cache of ``S`` tokens a sequence, with and without
the fused write of its new keys and values."""

from __future__ import annotations

import jax.numpy as jnp

import fdecode

S = 4096  # tokens a sequence may hold (cases.py's S)


def ragged(target, layout, write, paged=True, m=16, n_rows=256, hkv=2, hq=8, row_mods=None, **opts):
  """ragged_decode over a paged pool (or ``paged=False`` a contiguous cache of M rows): N
  packed rows of M sequences (decodes beside prefill chunks; default 256 of 16), the fused
  write of their keys and values into the caches, donated as the Engine's step donates
  them (updated in place, no copy); ``row_mods``: ``"mask"`` (bool ``[N, S]``) or
  ``"bias"`` (float32 ``[N, Hq, S]``), the last argument; ``opts``: ragged_decode's."""
  sd = target.spec
  d, ps = 128, 16
  pages = m * (S // ps) + 3
  pool = (hkv, pages, ps, d) if layout == "HND" else (pages, ps, hkv, d)
  if not paged:
    pool = (m, hkv, S, d) if layout == "HND" else (m, S, hkv, d)
  args = (sd((n_rows, hq, d), jnp.bfloat16), sd(pool, jnp.bfloat16), sd(pool, jnp.bfloat16), sd((m,), jnp.int32),
          sd((m, S // ps), jnp.int32) if paged else None, sd((m + 1,), jnp.int32), sd((1,), jnp.int32))
  new = sd((n_rows, hkv, d), jnp.bfloat16)
  args += (new, new) if write else ()
  extra = {"mask": ((n_rows, S), jnp.bool_), "bias": ((n_rows, hq, S), jnp.float32)}.get(row_mods)
  args += (sd(*extra),) if extra else ()

  def fn(q, k, v, lens, t, cu, ns, *rest):
    new_kv = dict(new_k=rest[0], new_v=rest[1]) if write else {}
    mods = {row_mods: rest[-1]} if extra else {}
    return fdecode.ragged_decode(q, k, v, lens, t, cu, ns, kv_layout=layout, **new_kv, **mods, **opts)
  return (fn, args, (1, 2)) if write else (fn, args)


def ragged_mla(target, dtype=jnp.float8_e4m3fn, g=16, paged=True, write=True):
  """ragged_decode over MLA latents (one latent head, D = 576, v = None): 64 rows of 8
  sequences over a paged pool (``paged``) or a contiguous cache; ``write``: the fused write
  of the new latents (already quantized for an 8-bit cache), donated. 8-bit latents take
  one scale (0.5)."""
  sd = target.spec
  m, n_rows, ps = 8, 64, 16
  cache = sd((1, m * (S // ps) + 3, ps, 576) if paged else (m, 1, S, 576), dtype)
  tables = sd((m, S // ps), jnp.int32) if paged else None
  args = (sd((n_rows, g, 576), jnp.bfloat16), cache, sd((m,), jnp.int32), tables, sd((m + 1,), jnp.int32),
          sd((1,), jnp.int32))
  opts = dict(v_head_dim=512, **({} if dtype == jnp.bfloat16 else dict(k_scale=0.5)))
  if not write:
    return (lambda q, k, lens, t, cu, ns: fdecode.ragged_decode(q, k, None, lens, t, cu, ns, **opts)), args
  fn = lambda q, k, lens, t, cu, ns, nk: fdecode.ragged_decode(q, k, None, lens, t, cu, ns, new_k=nk, **opts)
  return fn, args + (sd((n_rows, 1, 576), dtype),), (1,)


def ragged_mla_write(target):
  """ragged_decode over float8 MLA latents in a paged pool (one latent head, D = 576,
  v = None), with the fused write of the new latents (already quantized), donated."""
  return ragged_mla(target)
