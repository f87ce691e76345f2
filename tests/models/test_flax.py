"""fdecode.flax: attention_fn inside Flax's attention modules, and DecodeAttention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen
from flax import nnx

import fdecode
import fdecode.flax as fflax
from helpers import assert_close, assert_reordered, max_abs, randn, tol

F32 = tol(jnp.float32)


# --------------------------------------------------------------------------------------
# attention_fn


def _mha(attention_fn, *, num_kv_heads, seed=0):
  return nnx.MultiHeadAttention(
      num_heads=4, in_features=32, qkv_features=64, num_kv_heads=num_kv_heads,
      decode=True, attention_fn=attention_fn, rngs=nnx.Rngs(seed))


@nnx.jit
def _mha_step(model, x, mask):
  return model(x, mask=mask)


@pytest.mark.parametrize("num_kv_heads,num_splits", [(4, None), (2, 4), (1, 2)])
def test_nnx_mha_decode_matches_flax(num_kv_heads, num_splits):
  """MHA / GQA / MQA decode steps: fdecode.flax.attention_fn == Flax's default."""
  b, cache_len, steps = 2, 16, 5
  fn = functools.partial(fflax.attention_fn, num_splits=num_splits)
  ours, theirs = _mha(fn, num_kv_heads=num_kv_heads), _mha(nnx.dot_product_attention,
                                                          num_kv_heads=num_kv_heads)
  for m in (ours, theirs):
    m.init_cache((b, cache_len, 32))
  xs = np.random.default_rng(1).standard_normal((steps, b, 1, 32), np.float32)
  for i in range(steps):
    got, want = _mha_step(ours, xs[i], None), _mha_step(theirs, xs[i], None)
    assert_close(got, want, atol=F32["atol"], rtol=F32["rtol"], what=f"step {i}")
  # The cached keys are the same projection (32 products per entry) in two compiled programs.
  assert_reordered(ours.cached_key[...], theirs.cached_key[...], terms=32 + 1,
                   scale=max_abs(xs) * max_abs(ours.key.kernel[...]) + max_abs(ours.key.bias[...]), what="cached keys")


def test_nnx_mha_decode_with_padding_mask():
  """A user mask with holes (left-padded prompts) combined with Flax's cache mask."""
  b, cache_len, steps = 2, 8, 4
  ours, theirs = _mha(fflax.attention_fn, num_kv_heads=2), _mha(nnx.dot_product_attention,
                                                               num_kv_heads=2)
  for m in (ours, theirs):
    m.init_cache((b, cache_len, 32))
  # Sequence 0 hides positions 0 and 2; sequence 1 hides position 1.
  keep = np.ones((b, 1, 1, cache_len), bool)
  keep[0, ..., [0, 2]] = False
  keep[1, ..., 1] = False
  xs = np.random.default_rng(2).standard_normal((steps, b, 1, 32), np.float32)
  for i in range(steps):
    got = _mha_step(ours, xs[i], jnp.asarray(keep))
    want = _mha_step(theirs, xs[i], jnp.asarray(keep))
    if i == 0:  # sequence 0 sees no key at step 0: fdecode gives 0, Flax the mean.
      got, want = got[1:], want[1:]
    assert_close(got, want, atol=F32["atol"], rtol=F32["rtol"], what=f"step {i}")


def test_nnx_mha_full_sequence_falls_back():
  """Non-decode calls (prefill / training, causal) are Flax's own attention."""
  kw = dict(num_heads=4, in_features=32, qkv_features=64, num_kv_heads=2, decode=False)
  ours = nnx.MultiHeadAttention(**kw, attention_fn=fflax.attention_fn, rngs=nnx.Rngs(0))
  theirs = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  x = np.random.default_rng(3).standard_normal((2, 6, 32), np.float32)
  mask = nnx.make_causal_mask(jnp.ones((2, 6)))
  assert_close(_mha_step(ours, x, mask), _mha_step(theirs, x, mask), atol=1e-6, rtol=1e-6)


def test_linen_mha_decode_matches_flax():
  b, cache_len, steps = 2, 8, 4
  kw = dict(num_heads=4, qkv_features=32, decode=True)
  ours = linen.MultiHeadDotProductAttention(**kw, attention_fn=fflax.attention_fn)
  theirs = linen.MultiHeadDotProductAttention(**kw)
  x0 = jnp.zeros((b, cache_len, 16))
  variables = theirs.init(jax.random.key(0), x0)  # params + an empty cache
  params, cache_ours, cache_theirs = variables["params"], variables["cache"], variables["cache"]

  @functools.partial(jax.jit, static_argnums=0)
  def step(module, cache, x):
    return module.apply({"params": params, "cache": cache}, x, mutable=["cache"])

  xs = np.random.default_rng(4).standard_normal((steps, b, 1, 16), np.float32)
  for i in range(steps):
    got, cache_ours = step(ours, cache_ours, xs[i])
    want, cache_theirs = step(theirs, cache_theirs, xs[i])
    assert_close(got, want, atol=F32["atol"], rtol=F32["rtol"], what=f"step {i}")
    cache_ours, cache_theirs = cache_ours["cache"], cache_theirs["cache"]


@pytest.mark.parametrize("hq,hkv,per_head,num_splits", [
    (4, 4, False, 1), (8, 2, False, 3), (6, 1, True, None), (6, 2, True, 4)])
def test_attention_fn_arbitrary_mask(hq, hkv, per_head, num_splits):
  """Direct call with GQA shapes and random masks with holes, per-head or shared."""
  b, length, d = 3, 24, 16
  rng = np.random.default_rng(5)
  q = rng.standard_normal((b, 1, hq, d), np.float32)
  k = rng.standard_normal((b, length, hkv, d), np.float32)
  v = rng.standard_normal((b, length, hkv, d), np.float32)
  mask = rng.random((b, hq if per_head else 1, 1, length)) < 0.4
  mask[..., 5] = True  # every row sees at least one key
  fn = jax.jit(functools.partial(fflax.attention_fn, num_splits=num_splits))
  got = fn(q, k, v, mask=mask)
  # Flax's default, with the kv heads repeated for the reference (plain MHA).
  want = jax.jit(nnx.dot_product_attention)(q, np.repeat(k, hq // hkv, axis=2),
                                            np.repeat(v, hq // hkv, axis=2), mask=mask)
  assert_close(got, want, atol=F32["atol"], rtol=F32["rtol"])


def test_attention_fn_takes_decode_path():
  """Decode-shaped calls run fdecode (a fully masked row gives 0, Flax gives the mean)."""
  q = jnp.ones((1, 1, 2, 8))
  k = jnp.ones((1, 4, 2, 8))
  v = jnp.arange(64, dtype=jnp.float32).reshape(1, 4, 2, 8)
  none = jnp.zeros((1, 1, 1, 4), bool)
  np.testing.assert_array_equal(fflax.attention_fn(q, k, v, mask=none), 0.0)
  assert float(jnp.abs(nnx.dot_product_attention(q, k, v, mask=none)).max()) > 0
  # Without a mask, or with a bias, it is Flax's attention.
  assert_close(fflax.attention_fn(q, k, v), nnx.dot_product_attention(q, k, v),
               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_token_major_matches_flash_decode(dtype):
  """attention_fn's decode step on the token-major cache == fdecode.flash_decode on the
  head-major copy with lengths (lse too), for a prefix mask."""
  from fdecode.flax.token_major import decode_token_major
  b, hq, hkv, s, d = 2, 8, 2, 40, 16
  lengths = jnp.array([40, 7], jnp.int32)
  rng = np.random.default_rng(6)
  q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
             for shape in ((b, hq, d), (b, s, hkv, d), (b, s, hkv, d)))
  mask = (np.arange(s)[None, :] < np.asarray(lengths)[:, None])[:, None, :]
  got, got_lse = jax.jit(functools.partial(decode_token_major, num_splits=4, return_lse=True))(q, k, v, mask)
  want, want_lse = fdecode.flash_decode(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                        lengths, return_lse=True, impl="reference")
  t = tol(dtype)
  assert_close(got, want, atol=t["atol"], rtol=t["rtol"])
  assert_close(got_lse, want_lse, atol=t["lse"], rtol=t["lse"], what="lse")


# --------------------------------------------------------------------------------------
# DecodeAttention vs a naive layer with the same weights


def _naive_rope(x, positions, theta=10000.0):
  """Complex-number RoPE on the (i, i + D/2) pairs; x [T, H, D], positions [T]."""
  half = x.shape[-1] // 2
  freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
  z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * positions[:, None, None] * freq)
  return np.concatenate([z.real, z.imag], axis=-1)


def _naive_layer(layer, tokens):
  """Causal self-attention of ONE unpadded sequence tokens [N, E], float64 numpy."""
  w = lambda lin: (np.asarray(lin.kernel[...], np.float64),
                   0.0 if lin.bias is None else np.asarray(lin.bias[...], np.float64))
  (wq, bq), (wk, bk), (wv, bv), (wo, bo) = map(w, (layer.q_proj, layer.k_proj, layer.v_proj,
                                                  layer.o_proj))
  n, hq, hkv, d = len(tokens), layer.num_heads, layer.num_kv_heads, layer.head_dim
  x = np.asarray(tokens, np.float64)
  pos = np.arange(n)
  q = _naive_rope((x @ wq + bq).reshape(n, hq, d), pos)
  k = _naive_rope((x @ wk + bk).reshape(n, hkv, d), pos)
  v = (x @ wv + bv).reshape(n, hkv, d)
  k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
  scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
  scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hts,shd->thd", p, v).reshape(n, hq * d) @ wo + bo


@nnx.jit
def _prefill(layer, x, lengths):
  return layer.prefill(x, lengths)


@nnx.jit
def _decode(layer, x):
  return layer.decode(x)


@pytest.mark.parametrize("hq,hkv,impl", [(4, 2, "xla"), (4, 1, "pallas"), (2, 2, "xla")])
def test_decode_attention_matches_naive(hq, hkv, impl):
  """Prefill of prompts of different lengths, then decode steps (T=1 and T=2)."""
  e, b, max_len = 24, 3, 24
  prompt_lens = np.array([5, 1, 8])
  layer = fflax.DecodeAttention(
      e, num_heads=hq, num_kv_heads=hkv, head_dim=8, use_bias=True,
      decode_fn=functools.partial(fdecode.flash_decode, impl=impl, num_splits=2),
      rngs=nnx.Rngs(0))
  layer.init_cache(b, max_len)
  new_tokens = [1, 1, 2, 1]
  total = int(prompt_lens.max()) + sum(new_tokens)
  seqs = np.random.default_rng(7).standard_normal((b, total, e), np.float32)
  # Sequence b is seqs[b, :prompt_lens[b] + generated]; padding slots get garbage.
  x = np.where(np.arange(8)[None, :, None] < prompt_lens[:, None, None], seqs[:, :8], 99.0)
  out = _prefill(layer, jnp.asarray(x, jnp.float32), jnp.asarray(prompt_lens, jnp.int32))
  for i in range(b):
    n = prompt_lens[i]
    assert_close(out[i, :n], _naive_layer(layer, seqs[i, :n]), atol=1e-4, rtol=1e-4,
                 what=f"prefill seq {i}")
    np.testing.assert_array_equal(out[i, n:], 0.0)
  pos = prompt_lens.copy()
  for step, t in enumerate(new_tokens):
    x = np.stack([seqs[i, pos[i]:pos[i] + t] for i in range(b)])
    out = _decode(layer, jnp.asarray(x, jnp.float32))
    pos += t
    np.testing.assert_array_equal(layer.lengths[...], pos)
    for i in range(b):
      want = _naive_layer(layer, seqs[i, :pos[i]])[-t:]
      assert_close(out[i], want, atol=1e-4, rtol=1e-4, what=f"step {step} seq {i}")


def test_decode_attention_errors():
  layer = fflax.DecodeAttention(16, num_heads=4, num_kv_heads=2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="call init_cache"):
    layer.decode(jnp.zeros((2, 1, 16)))
  layer.init_cache(2, 8)
  with pytest.raises(ValueError, match=r"x.shape=\(2, 1, 12\)"):
    layer.decode(jnp.zeros((2, 1, 12)))
  with pytest.raises(ValueError, match="L=9 > cache capacity S=8"):
    layer.prefill(jnp.zeros((2, 9, 16)), jnp.array([1, 2]))
  with pytest.raises(ValueError, match=r"lengths.shape=\(3,\)"):
    layer.prefill(jnp.zeros((2, 4, 16)), jnp.array([1, 2, 3]))
  with pytest.raises(ValueError, match="num_heads \\(4\\) must be a positive multiple"):
    fflax.DecodeAttention(16, num_heads=4, num_kv_heads=3, rngs=nnx.Rngs(0))


def _decode_steps(layer, prompts, prompt_lens, steps, seed=3):
  """Prefill then `steps` single-token decode steps; returns the stacked outputs."""
  _prefill(layer, prompts, prompt_lens)
  xs = randn(seed, (steps, prompts.shape[0], 1, prompts.shape[-1]))
  return jnp.stack([_decode(layer, x) for x in xs])


@pytest.mark.parametrize("cache_dtype,atol", [(jnp.int8, 0.03), (jnp.float8_e4m3fn, 0.1)])
def test_decode_attention_8bit_cache_close_to_float_cache(cache_dtype, atol):
  """An 8-bit cache (per-token scales, quantized on write, dequantized in the kernel)
  tracks the float cache within quantization error."""
  e, b, max_len = 32, 2, 40
  prompts = randn(0, (b, 16, e))
  lens = jnp.array([16, 7], jnp.int32)
  outs = {}
  for dtype in (jnp.float32, cache_dtype):
    layer = fflax.DecodeAttention(e, num_heads=4, num_kv_heads=2, head_dim=8, rngs=nnx.Rngs(1))
    layer.init_cache(b, max_len, dtype)
    outs[dtype] = _decode_steps(layer, prompts, lens, steps=4)
    assert layer.cached_key.dtype == dtype
  assert layer.key_scale is not None and layer.key_scale.shape == (b, 2, max_len, 1)
  err = float(jnp.max(jnp.abs(outs[cache_dtype] - outs[jnp.float32])))
  assert 0 < err < atol, err


def test_decode_attention_on_explicit_mesh():
  """A cache placed on a jax.make_mesh mesh (Explicit axes, the default) decodes through
  sharded_flash_decode and matches the single-device layer."""
  mesh = jax.make_mesh((2, 4), ("heads", "seq"))
  e, b, max_len = 32, 2, 32
  prompts = randn(4, (b, 8, e))
  lens = jnp.array([8, 3], jnp.int32)
  sharded_fn = functools.partial(fdecode.sharded_flash_decode, mesh=mesh, head_axis="heads", seq_axis="seq")
  results = []
  for decode_fn in (None, sharded_fn):
    layer = fflax.DecodeAttention(e, num_heads=4, num_kv_heads=2, head_dim=8, decode_fn=decode_fn,
                                  rngs=nnx.Rngs(2))
    layer.init_cache(b, max_len)
    if decode_fn is not None:
      spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "heads", "seq", None))
      layer.cached_key.set_value(jax.device_put(layer.cached_key[...], spec))
      layer.cached_value.set_value(jax.device_put(layer.cached_value[...], spec))
    results.append(_decode_steps(layer, prompts, lens, steps=3))
    if decode_fn is not None:
      assert layer.cached_key[...].sharding.spec == jax.sharding.PartitionSpec(None, "heads", "seq", None)
  assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size,dtype", [(4, jnp.float32), (1, jnp.float32), (8, jnp.int8)])
def test_decode_attention_paged_cache_matches_contiguous(page_size, dtype):
  """The same layer over a paged pool (shuffled block table) and a contiguous cache."""
  e, b, max_len = 32, 2, 24
  prompts = randn(5, (b, 10, e))
  lens = jnp.array([10, 4], jnp.int32)
  outs = []
  for paged in (False, True):
    layer = fflax.DecodeAttention(e, num_heads=4, num_kv_heads=2, head_dim=8, rngs=nnx.Rngs(3))
    layer.init_cache(b, max_len, dtype, page_size=page_size if paged else None)
    if paged:
      n = layer.block_tables.shape[1]
      assert layer.cached_key.shape == (2, b * n, page_size, 8)
      perm = np.random.default_rng(0).permutation(b * n).reshape(b, n).astype(np.int32)
      layer.block_tables.set_value(jnp.asarray(perm))
    outs.append(_decode_steps(layer, prompts, lens, steps=3))
  assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared-mask", "per-head-mask"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_decode_token_major_any_mask(impl, per_head):
  """attention_fn's decode step (flash_decode on the token-major cache, by the XLA path
  and the interpreted Triton kernel, both reading it in place) == the float32 reference
  on a head-major copy, for any mask, with inf / NaN in the hidden slots."""
  from fdecode.flax.token_major import decode_token_major
  b, hq, hkv, length, d = 3, 8, 2, 40, 16
  rng = np.random.default_rng(6)
  q = rng.standard_normal((b, hq, d), np.float32)
  k = rng.standard_normal((b, length, hkv, d), np.float32)
  v = rng.standard_normal((b, length, hkv, d), np.float32)
  mask = rng.random((b, hq if per_head else 1, length)) < 0.5
  mask[0] = False  # a row that sees nothing: 0 on both
  hidden = ~mask.any(axis=1)  # [B, L] slots no head sees
  k[hidden], v[hidden] = np.nan, np.inf
  ref_mask = jnp.asarray(mask)[:, None] if per_head else jnp.asarray(mask)[:, 0]
  clean = lambda x: np.nan_to_num(x, nan=0.0, posinf=0.0).transpose(0, 2, 1, 3)  # hidden slots only
  ref = fdecode.flash_decode(q, clean(k), clean(v), jnp.full((b,), length, jnp.int32), mask=ref_mask,
                             impl="reference")
  run = lambda: decode_token_major(q, k, v, mask, impl=impl, interpret=True if impl == "pallas" else None,
                                   block_k=16)
  got = run()
  assert_close(got, ref, atol=F32["atol"], rtol=F32["rtol"])
  np.testing.assert_array_equal(np.asarray(got[0]), 0.0)
  # A visible NaN reaches exactly the rows that see it.
  rows_seeing = mask[1, :, 3] if per_head else np.ones(hq, bool)
  mask[1, :, 3] |= not per_head
  k[1, 3, :, 0] = np.nan
  got = run()
  np.testing.assert_array_equal(np.isnan(np.asarray(got[1])).any(-1), rows_seeing)
  assert np.isfinite(np.asarray(got[2])).all()
