"""MLA decode (DeepSeek V2/V3, FlashMLA's ``head_dim_v``): ``flash_decode(q, k, None, lengths,
v_head_dim=Dv)`` reads the values from the key cache's first Dv columns.

The oracle is `reference_decode` on a materialized float32 key cache and a *separate*
value copy ``k[..., :Dv]``, so the single-read path is checked against the plain
definition. Every kernel runs through the shared ``impl`` fixture (XLA, Triton
interpreted, Mosaic under the TPU interpreter).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import fdecode
from fdecode.cache.paged import gather_pages
from fdecode.cache.quant import dequantize, quantize
from fdecode.reference import reference_decode
from helpers import assert_close, interpreted_once, randn, tol
from helpers.lowering import TPU_CALL, TRITON_CALL, lower_for_cuda, lower_for_tpu

BLOCK = 16
S = 3 * BLOCK + 5
LENGTHS = [0, 1, BLOCK - 1, BLOCK + 1, S]


def mla_problem(seed, *, b, t, hq, s, dc, dr, dtype):
  """q ``[B, T, Hq, Dc + Dr]`` (T None: ``[B, Hq, ...]``) and one latent kv head ``[B, 1, S, Dc + Dr]``."""
  rng = np.random.default_rng(seed)
  q_shape = (b, hq, dc + dr) if t is None else (b, t, hq, dc + dr)
  q = randn(rng, q_shape, dtype)
  k = randn(rng, (b, 1, s, dc + dr), dtype)
  return q, k


def oracle(q, k_full, lengths, dv, **kw):
  """float32 reference with an explicit value copy (k_full ``[B, 1, S, Dk]`` float32)."""
  q4 = q if q.ndim == 4 else q[:, None]
  out, lse = reference_decode(q4, k_full, k_full[..., :dv], jnp.asarray(lengths), **kw)
  return (out, lse) if q.ndim == 4 else (out[:, 0], lse[:, 0])


def check(out, lse, ref, dtype):
  t = tol(dtype)
  assert_close(out, ref[0], atol=t["atol"], rtol=t["rtol"], what="out")
  assert_close(lse, ref[1], atol=t["lse"], rtol=t["lse"], what="lse")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t,hq", [(None, 16), (2, 8)], ids=["T1-G16", "T2-G8"])
def test_mla_matches_reference(request, impl, dtype, t, hq):
  """Dk = 48 + 16 key columns, Dv = 48 of them: lengths 0, 1, block±1 and S."""
  interpreted_once(request, "bf16: test_deepseek_shape", dtype=jnp.float32)
  q, k = mla_problem(0, b=len(LENGTHS), t=t, hq=hq, s=S, dc=48, dr=16, dtype=dtype)
  out, lse = fdecode.flash_decode(q, k, None, jnp.array(LENGTHS), v_head_dim=48, impl=impl,
                                  block_k=BLOCK, num_splits=3, return_lse=True)
  assert out.shape == q.shape[:-1] + (48,) and out.dtype == q.dtype
  check(out, lse, oracle(q, k.astype(jnp.float32), LENGTHS, 48), dtype)
  assert np.all(np.asarray(out[0]) == 0) and np.isneginf(np.asarray(lse[0])).all()


def test_deepseek_shape(impl):
  """DeepSeek V3: Dk = 576 (512 latent + 64 RoPE), Dv = 512, bf16, G = 16 rows, T = 2."""
  q, k = mla_problem(1, b=2, t=2, hq=16, s=40, dc=512, dr=64, dtype=jnp.bfloat16)
  lengths = [40, 17]
  out, lse = fdecode.flash_decode(q, k, None, jnp.array(lengths), v_head_dim=512, impl=impl,
                                  block_k=BLOCK, return_lse=True)
  check(out, lse, oracle(q, k.astype(jnp.float32), lengths, 512), jnp.bfloat16)


def test_128_query_heads():
  """G = 128 query heads on the one latent head (DeepSeek's Hq), every impl but the slow
  interpreters' full matrix: XLA and the Triton kernel (rows in several row blocks)."""
  q, k = mla_problem(2, b=1, t=None, hq=128, s=24, dc=64, dr=32, dtype=jnp.float32)
  ref = oracle(q, k, [21], 64)
  for kw in (dict(impl="xla"), dict(impl="pallas", interpret=True)):
    out, lse = fdecode.flash_decode(q, k, None, jnp.array([21]), v_head_dim=64, return_lse=True,
                                    block_k=BLOCK, **kw)
    check(out, lse, ref, jnp.float32)


@pytest.mark.parametrize("page_size", [1, 16])
def test_paged(request, impl, page_size):
  """A paged latent pool ``[1, P, page_size, Dk]`` with shuffled, stale table entries."""
  interpreted_once(request, "the TPU kernel's page-size-1 DMAs: test_sparse's paged case", page_size=16)
  b, s, dc, dr = 3, 37 if page_size > 1 else 19, 32, 16
  q, k = mla_problem(3, b=b, t=2, hq=8, s=s, dc=dc, dr=dr, dtype=jnp.float32)
  n = -(-s // page_size)
  rng = np.random.default_rng(0)
  pages = b * n + 3
  tables = rng.permutation(pages)[: b * n].reshape(b, n).astype(np.int32)
  pool = randn(9, (1, pages, page_size, dc + dr))
  lengths = np.array([s, 9, 0])
  tables[1, -(-9 // page_size):] = -1  # past the length: never read
  out, lse = fdecode.flash_decode(q, pool, None, lengths, v_head_dim=dc, block_tables=tables,
                                  impl=impl, block_k=BLOCK, num_splits=2, return_lse=True)
  full = gather_pages(pool, jnp.asarray(np.maximum(tables, 0)))
  check(out, lse, oracle(q, full, lengths, dc), jnp.float32)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_fp8_latent_with_bf16_rope(request, impl, paged):
  """FlashMLA's FP8 cache: the latent part float8_e4m3fn with one f32 scale per 1x128 tile
  (here 1x32 tiles of a 64-wide latent), the RoPE tail bf16 through ``k_rope``."""
  interpreted_once(request, "the paged case reads the same pieces", paged=True)
  b, s, dc, dr = 2, 33, 64, 32
  q, k = mla_problem(4, b=b, t=None, hq=16, s=s, dc=dc, dr=dr, dtype=jnp.bfloat16)
  latent, scale = quantize(k[..., :dc], jnp.float8_e4m3fn, tile=32)  # scale [B, 1, S, 2]
  rope = k[..., dc:]
  lengths = [33, 20]
  kw = dict(v_head_dim=dc, k_scale=scale, k_rope=rope)
  if paged:  # page size 8: 5 pages per sequence, sequence b in pages [5b, 5b + 5)
    ps, n = 8, 5
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, n * ps - s), (0, 0)])
    to_pool = lambda x: pad(x).reshape(b, 1, n, ps, -1).transpose(1, 0, 2, 3, 4).reshape(1, b * n, ps, -1)
    latent, kw["k_scale"], kw["k_rope"] = to_pool(latent), to_pool(scale), to_pool(rope)
    kw["block_tables"] = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
  out, lse = fdecode.flash_decode(q, latent, None, jnp.array(lengths), impl=impl, block_k=BLOCK,
                                  return_lse=True, **kw)
  full = jnp.concatenate([dequantize(quantize(k[..., :dc], jnp.float8_e4m3fn, tile=32)[0], scale),
                          rope.astype(jnp.float32)], axis=-1)
  check(out, lse, oracle(q, full, lengths, dc), jnp.bfloat16)


def test_dead_slots_never_leak(impl):
  """inf / NaN past a length, in the very columns that are both key and value, change nothing."""
  q, k = mla_problem(5, b=2, t=2, hq=8, s=S, dc=32, dr=16, dtype=jnp.float32)
  lengths = jnp.array([BLOCK + 1, 5])
  pos = jnp.arange(S)[None, None, :, None]
  poisoned = jnp.where(pos >= lengths[:, None, None, None], jnp.where(pos % 2 == 0, jnp.nan, jnp.inf), k)
  run = lambda kk: fdecode.flash_decode(q, kk, None, lengths, v_head_dim=32, impl=impl, block_k=BLOCK,
                                        num_splits=2, return_lse=True)
  (clean, clean_lse), (dirty, dirty_lse) = run(k), run(poisoned)
  np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
  np.testing.assert_array_equal(np.asarray(dirty_lse), np.asarray(clean_lse))


def test_value_columns_are_the_keys():
  """v=None equals passing the copy k[..., :Dv] explicitly (a test that the values really
  are the keys' leading columns, not some other slice)."""
  q, k = mla_problem(6, b=2, t=None, hq=8, s=30, dc=32, dr=16, dtype=jnp.float32)
  lengths = jnp.array([30, 11])
  one = fdecode.flash_decode(q, k, None, lengths, v_head_dim=32, impl="xla")
  two = fdecode.flash_decode(q, k, k[..., :32], lengths, impl="xla")
  np.testing.assert_allclose(np.asarray(one), np.asarray(two), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("call, message", [
    (lambda q, k: fdecode.flash_decode(q, k, None, [8]), "v_head_dim"),
    (lambda q, k: fdecode.flash_decode(q, k, None, [8], v_head_dim=49), "v_head_dim"),
    (lambda q, k: fdecode.flash_decode(q, k, None, [8], v_head_dim=0), "v_head_dim"),
    (lambda q, k: fdecode.flash_decode(q, k, k[..., :32], [8], v_head_dim=16), "v_head_dim"),
    (lambda q, k: fdecode.flash_decode(q, k, None, [8], v_head_dim=32, v_scale=1.0), "v_scale"),
    (lambda q, k: fdecode.flash_decode(q, k, None, [8], v_head_dim=32, k_rope=k[..., :8]), "k_rope"),
    (lambda q, k: fdecode.flash_decode(q, k[..., :40], None, [8], v_head_dim=32,
                                       k_rope=k[:, :, :4, 40:]), "k_rope"),
])
def test_bad_mla_arguments(call, message):
  q, k = mla_problem(7, b=1, t=None, hq=4, s=8, dc=32, dr=16, dtype=jnp.float32)
  with pytest.raises(ValueError, match=message):
    call(q, k)


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("fp8", [False, True])
def test_deepseek_mla_lowers_for_tpu_and_cuda(page_size, fp8):
  """Dk = 576 / Dv = 512, G = 128 rows, bf16 or FlashMLA's fp8 latent + bf16 RoPE."""
  b, s, hq = 2, 1000, 128
  sds = jax.ShapeDtypeStruct
  q = sds((b, hq, 576), jnp.bfloat16)
  opts = {}
  if page_size is None:
    lay = lambda d: (b, 1, s, d)
  else:
    n = -(-s // page_size)
    lay = lambda d: (1, b * n, page_size, d)
    opts["block_tables"] = sds((b, n), jnp.int32)
  if fp8:
    k = sds(lay(512), jnp.float8_e4m3fn)
    opts.update(k_scale=sds(lay(4), jnp.float32), k_rope=sds(lay(64), jnp.bfloat16))
  else:
    k = sds(lay(576), jnp.bfloat16)
  fn = lambda q, k, n, opts: fdecode.flash_decode(q, k, None, n, v_head_dim=512, impl="pallas", **opts)
  args = (q, k, sds((b,), jnp.int32), opts)
  assert TPU_CALL in lower_for_tpu(fn, *args)
  assert TRITON_CALL in lower_for_cuda(fn, *args)


@pytest.mark.parametrize("shape,names,roles,axis_types", [
    ((8,), ("s",), dict(seq_axis="s"), None),                                   # Explicit axes
    ((2, 4), ("h", "s"), dict(head_axis="h", seq_axis="s"), (AxisType.Auto,) * 2),
], ids=["seq8", "qheads2-seq4-auto"])
def test_sharded(shape, names, roles, axis_types):
  """DeepSeek's serving problem: one latent head, so the sequence axis and the query heads
  are the only ways to spread it. fp8 latent + bf16 RoPE columns split with the cache."""
  b, s, dc, dr, hq = 2, 64, 32, 16, 8
  q, k = mla_problem(8, b=b, t=2, hq=hq, s=s, dc=dc, dr=dr, dtype=jnp.float32)
  latent, scale = quantize(k[..., :dc], jnp.float8_e4m3fn, tile=16)
  rope = k[..., dc:]
  full = jnp.concatenate([dequantize(latent, scale), rope], axis=-1)
  lengths = jnp.array([s, 21])
  mesh = jax.make_mesh(shape, names, axis_types=axis_types)
  for impl, extra in (("xla", {}), ("pallas", dict(interpret=True))):
    out, lse = fdecode.sharded_flash_decode(q, latent, None, lengths, mesh=mesh, v_head_dim=dc, k_scale=scale,
                                            k_rope=rope, impl=impl, return_lse=True, **roles, **extra)
    check(out, lse, oracle(q, full, lengths, dc), jnp.float32)
