"""The Pallas kernel compiled for GPU (``impl="pallas", interpret=False``) against the
float32 reference. Skipped unless ``jax.default_backend() == "gpu"``; `scripts/gpu_check`
runs it on a CUDA machine.

Covers what the CPU suite can only run in interpret mode: head dims Dk=Dv in
{64, 80, 96, 112, 128, 192, 256} and Dk=576/Dv=512 (MLA), contiguous and paged caches
(page sizes 1, 12, 16, 64), bf16 and f32, int8 and float8_e4m3fn caches, T in {1, 3},
GQA ratios 1, 4, 8, lengths 0, 1, block-1, block+1 and a capacity that is not a block
multiple, more splits than blocks, and dead slots (past a length) holding inf/NaN.

Tolerances: the f32 ones are looser than the CPU suite's because Triton's f32 dots may
run in TF32 (10-bit mantissa); bf16 keeps the CPU suite's.
"""

import jax
import pytest

if jax.default_backend() != "gpu":
  pytest.skip(f"needs a GPU: jax.default_backend() is {jax.default_backend()!r} "
              "(run scripts/gpu_check on a CUDA machine)", allow_module_level=True)

import jax.numpy as jnp
import numpy as np

import fdecode
from fdecode.cache.quant import dequantize, quantize
from fdecode.reference import reference_decode
from helpers import assert_close, make_problem, tol

GPU_TOLERANCES = {
    jnp.float32: dict(atol=5e-3, rtol=5e-3, lse=5e-3),  # TF32 dots
    jnp.bfloat16: tol(jnp.bfloat16),
    # 8-bit cache, bf16 queries: the kernel may round the dequantized block to bf16
    # before the dot; the reference keeps it in f32 (Dk=576: lse off by ~5e-3).
    "8bit": dict(atol=2.5e-2, rtol=2.5e-2, lse=1e-2),
}

BLOCK = 32                         # block_k passed explicitly, so "block-1" means something
S_TAIL = 3 * BLOCK + 5             # capacity that is not a block multiple
LENGTHS = [0, 1, BLOCK - 1, BLOCK + 1, S_TAIL]
DIMS = [(64, 64), (80, 80), (96, 96), (112, 112), (128, 128), (192, 192), (256, 256), (576, 512)]
DIM_IDS = [f"dk{dk}" if dk == dv else f"dk{dk}dv{dv}" for dk, dv in DIMS]
GQA = [(4, 4), (8, 2), (8, 1)]     # (Hq, Hkv): ratios 1, 4, 8
PAGE_SIZES = [1, 12, 16, 64]
SPARE_PAGES = 3                    # pool pages no sequence owns: they hold `garbage`


def gpu_tol(dtype):
  return GPU_TOLERANCES[dtype if dtype == "8bit" else jnp.dtype(dtype).type]


def garbage(dtype):
  """What unowned pool pages hold: NaN for floats (fp8 included), -128 for int8."""
  return jnp.nan if jnp.issubdtype(dtype, jnp.floating) else -128


def to_pool(x, live, num_pages):
  """Contiguous ``[B, Hkv, n*page_size, D]`` -> pool ``[Hkv, P, page_size, D]``: page
  ``live[b, j]`` holds tokens ``[j*page_size, (j+1)*page_size)`` of sequence b, every
  other page holds `garbage`. Works for scales too (last axis n_tiles)."""
  b, hkv, s, d = x.shape
  n = live.shape[1]
  ps = s // n
  chunks = x.reshape(b, hkv, n, ps, d).transpose(1, 0, 2, 3, 4).reshape(hkv, b * n, ps, d)
  pool = jnp.full((hkv, num_pages, ps, d), garbage(x.dtype), x.dtype)
  return pool.at[:, live.reshape(-1)].set(chunks)


def paged_setup(seed, page_size, *, n=None, lengths=None):
  """A shuffled paged layout: (capacity, lengths, block_tables, pool) where ``pool(x)``
  turns a contiguous ``[B, Hkv, capacity, D]`` array into its pool.

  Default lengths: 0, 1, page-1, page+1, full, and one ending inside a page. Table
  entries past each length hold garbage: -1, an id far past the pool, or a spare page.
  """
  n = n or max(3, -(-100 // page_size))
  capacity = n * page_size
  if lengths is None:
    lengths = [0, 1, max(page_size - 1, 0), page_size + 1, capacity, capacity - page_size // 2 - 1]
  b = len(lengths)
  num_pages = b * n + SPARE_PAGES
  perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
  live = perm[: b * n].reshape(b, n)
  tables = live.copy()
  for i, length in enumerate(lengths):
    for j in range(-(-length // page_size), n):
      tables[i, j] = [-1, 10 ** 6, perm[b * n]][j % 3]
  return capacity, lengths, tables, lambda x: to_pool(x, live, num_pages)


def compiled(q, k, v, lengths, **kw):
  return fdecode.flash_decode(q, k, v, jnp.asarray(lengths, jnp.int32), impl="pallas",
                              interpret=False, return_lse=True, **kw)


def reference(q, k, v, lengths):
  q4 = q if q.ndim == 4 else q[:, None]
  out, lse = reference_decode(q4, k, v, jnp.asarray(lengths, jnp.int32))
  return (out, lse) if q.ndim == 4 else (out[:, 0], lse[:, 0])


def check(got, want, dtype):
  (out, lse), (ref_out, ref_lse) = got, want
  t = gpu_tol(dtype)
  assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
  assert_close(out, ref_out, atol=t["atol"], rtol=t["rtol"], what="out")
  assert_close(lse, ref_lse, atol=t["lse"], rtol=t["lse"], what="lse")


@pytest.mark.parametrize("dk,dv", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("t", [None, 3], ids=["T1", "T3"])
@pytest.mark.parametrize("hq,hkv", GQA, ids=["mha", "gqa4", "gqa8"])
def test_contiguous(dk, dv, dtype, t, hq, hkv):
  q, k, v = make_problem(0, b=len(LENGTHS), t=t, hq=hq, hkv=hkv, s=S_TAIL, dk=dk, dv=dv, dtype=dtype)
  got = compiled(q, k, v, LENGTHS, block_k=BLOCK, num_splits=3)
  check(got, reference(q, k, v, LENGTHS), dtype)
  assert np.all(np.asarray(got[0][0]) == 0) and np.all(np.isneginf(np.asarray(got[1][0])))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dk,dv", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("t", [None, 3], ids=["T1", "T3"])
def test_paged(page_size, dk, dv, dtype, t):
  capacity, lengths, tables, pool = paged_setup(1, page_size)
  q, k, v = make_problem(1, b=len(lengths), t=t, hq=8, hkv=2, s=capacity, dk=dk, dv=dv, dtype=dtype)
  got = compiled(q, pool(k), pool(v), lengths, block_tables=tables, num_splits=3)
  check(got, reference(q, k, v, lengths), dtype)


@pytest.mark.parametrize("qdtype", [jnp.int8, jnp.float8_e4m3fn], ids=["int8", "fp8e4m3"])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("dk,dv", DIMS, ids=DIM_IDS)
@pytest.mark.parametrize("t", [None, 3], ids=["T1", "T3"])
def test_quantized(qdtype, layout, dk, dv, t):
  """8-bit cache, per-token scales, bf16 queries: against the reference on the dequantized cache."""
  if layout == "contiguous":
    capacity, lengths = S_TAIL, LENGTHS
  else:
    capacity, lengths, tables, pool = paged_setup(2, 16)
  q, k, v = make_problem(2, b=len(lengths), t=t, hq=8, hkv=2, s=capacity, dk=dk, dv=dv, dtype=jnp.bfloat16)
  kq, ks = quantize(k, qdtype)
  vq, vs = quantize(v, qdtype)
  if layout == "contiguous":
    got = compiled(q, kq, vq, lengths, k_scale=ks, v_scale=vs, block_k=BLOCK, num_splits=2)
  else:
    got = compiled(q, pool(kq), pool(vq), lengths, block_tables=tables, num_splits=2,
                   k_scale=pool(ks), v_scale=pool(vs))
  check(got, reference(q, dequantize(kq, ks), dequantize(vq, vs), lengths), "8bit")


@pytest.mark.parametrize("num_splits", [1, 5, 64])  # 4 contiguous blocks / 7 pages: 5 and 64 exceed them
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("dk,dv", [(64, 64), (80, 80), (576, 512)], ids=["dk64", "dk80", "dk576dv512"])
def test_more_splits_than_blocks(num_splits, layout, dk, dv):
  if layout == "contiguous":
    capacity, lengths = S_TAIL, LENGTHS
  else:
    capacity, lengths, tables, pool = paged_setup(3, 16)
  q, k, v = make_problem(3, b=len(lengths), t=2, hq=8, hkv=2, s=capacity, dk=dk, dv=dv, dtype=jnp.bfloat16)
  if layout == "contiguous":
    got = compiled(q, k, v, lengths, block_k=BLOCK, num_splits=num_splits)
  else:
    got = compiled(q, pool(k), pool(v), lengths, block_tables=tables, num_splits=num_splits)
  check(got, reference(q, k, v, lengths), jnp.bfloat16)


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
@pytest.mark.parametrize("dk,dv", DIMS, ids=DIM_IDS)
def test_default_block_and_splits(layout, dk, dv):
  """No block_k / num_splits: the defaults the GPU path picks, Llama-like heads, a longer cache."""
  lengths = [1000, 1, 517, 0]
  q, k, v = make_problem(4, b=4, t=None, hq=32, hkv=8, s=1008, dk=dk, dv=dv, dtype=jnp.bfloat16)
  if layout == "contiguous":
    got = compiled(q, k, v, lengths)
  else:
    _, _, tables, pool = paged_setup(4, 16, n=1008 // 16, lengths=lengths)
    got = compiled(q, pool(k), pool(v), lengths, block_tables=tables)
  check(got, reference(q, k, v, lengths), jnp.bfloat16)


def poison(x, lengths, value):
  """``x`` ``[B, Hkv, S, D]`` with the slots at positions >= lengths[b] set to ``value``."""
  dead = jnp.arange(x.shape[2])[None, None, :, None] >= jnp.asarray(lengths)[:, None, None, None]
  return jnp.where(dead, jnp.asarray(value, x.dtype), x)


def dead_slot_cache(kind, k, v, lengths, value):
  """(k, v, scales) of one cache kind; ``value`` None: clean, else the dead slots hold it.
  int8 carries the poison in its per-token scales; fp8 (no inf) in its values, as NaN."""
  if kind in ("bf16", "f32"):
    return (k, v, {}) if value is None else (poison(k, lengths, value), poison(v, lengths, value), {})
  (kq, ks), (vq, vs) = (quantize(x, jnp.int8 if kind == "int8" else jnp.float8_e4m3fn) for x in (k, v))
  if value is not None and kind == "int8":
    ks, vs = poison(ks, lengths, value), poison(vs, lengths, value)
  elif value is not None:
    kq, vq = poison(kq, lengths, value), poison(vq, lengths, value)
  return kq, vq, dict(k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("layout", ["contiguous", "paged12", "paged16"])
@pytest.mark.parametrize("kind", ["bf16", "f32", "int8", "fp8"])
def test_dead_slots_with_inf_nan_do_not_change_the_output(value, layout, kind):
  """Slots past each length (the rest of the last block or page; recycled pages) hold
  inf/NaN: the kernel must select them away, never multiply them by 0 (0 * inf = NaN),
  so the output is bitwise the one with clean slots."""
  dtype = jnp.float32 if kind == "f32" else jnp.bfloat16
  if layout == "contiguous":
    capacity, lengths = S_TAIL, [S_TAIL, 1, BLOCK - 1, BLOCK + 1, S_TAIL - 5, 0]
  else:
    capacity, lengths, tables, pool = paged_setup(5, int(layout[5:]))
  q, k, v = make_problem(5, b=len(lengths), t=3, hq=8, hkv=2, s=capacity, dk=128, dtype=dtype)
  results = {}
  for name, fill in (("clean", None), ("poisoned", value)):
    kk, vv, scales = dead_slot_cache(kind, k, v, lengths, fill)
    if layout == "contiguous":
      results[name] = compiled(q, kk, vv, lengths, block_k=BLOCK, num_splits=3, **scales)
    else:
      results[name] = compiled(q, pool(kk), pool(vv), lengths, block_tables=tables, num_splits=3,
                               **{key: pool(s) for key, s in scales.items()})
  kk, vv, scales = dead_slot_cache(kind, k, v, lengths, None)
  if scales:
    kk, vv = dequantize(kk, scales["k_scale"]), dequantize(vv, scales["v_scale"])
  check(results["poisoned"], reference(q, kk, vv, lengths), "8bit" if scales else dtype)
  for got, clean in zip(results["poisoned"], results["clean"]):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(clean, np.float32))


@pytest.mark.parametrize("case", ["window+softcap+alibi+sinks", "mask[B,T,S]+non-causal",
                                  "mask+bias per head"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_score_modifiers(case, dtype):
  """Issue 9's modifiers on the compiled kernel, T = 3, GQA 4, against the reference."""
  b, t, hq, hkv, dk = 5, 3, 8, 2, 128
  q, k, v = make_problem(11, b=b, t=t, hq=hq, hkv=hkv, s=S_TAIL, dk=dk, dtype=dtype)
  lengths = jnp.array(LENGTHS)
  r = np.random.default_rng(11)
  mods = {
      "window+softcap+alibi+sinks": dict(
          window=BLOCK + 3, logits_soft_cap=20.0, sinks=jnp.asarray(r.normal(size=hq), jnp.float32),
          alibi_slopes=jnp.asarray(2.0 ** -np.arange(1, hq + 1), jnp.float32)),
      "mask[B,T,S]+non-causal": dict(causal=False, mask=jnp.asarray(r.random((b, t, S_TAIL)) > 0.3)),
      "mask+bias per head": dict(mask=jnp.asarray(r.random((1, t, hq, S_TAIL)) > 0.3),
                                 bias=jnp.asarray(r.normal(size=(b, 1, hq, S_TAIL)), jnp.float32)),
  }[case]
  out, lse = fdecode.flash_decode(q, k, v, lengths, impl="pallas", interpret=False, block_k=BLOCK,
                                  num_splits=3, return_lse=True, **mods)
  ref, ref_lse = reference_decode(q, k, v, lengths, **mods)
  tl = gpu_tol(dtype)
  assert_close(out, ref, atol=tl["atol"], rtol=tl["rtol"])
  assert_close(lse, ref_lse, atol=tl["lse"], rtol=tl["lse"], what="lse")


# Issue 31: row counts R = T * G that are not powers of two (48, 80, 96, 35, ...): the
# shapes that crashed the Triton lowering, each contiguous, paged and token-major.
ROW_SHAPES = {"t5-g7": (5, 14, 2), "t5-g8": (5, 16, 2), "t12-g4": (12, 8, 2), "t9-g4": (9, 8, 2),
              "t3-g12": (3, 24, 2), "mqa40": (1, 40, 1), "mqa48": (1, 48, 1), "t1-g3": (1, 6, 2),
              "t7-g5-r35": (7, 10, 2), "t20-g8-r160": (20, 8, 1)}


@pytest.mark.parametrize("shape", list(ROW_SHAPES))
@pytest.mark.parametrize("form", ["contiguous", "paged16", "nhd-paged16", "int8"])
@pytest.mark.parametrize("splits", [None, 3])
def test_any_row_count(shape, form, splits):
  t, hq, hkv = ROW_SHAPES[shape]
  dtype = jnp.bfloat16
  q, k, v = make_problem(3, b=len(LENGTHS), t=t, hq=hq, hkv=hkv, s=S_TAIL, dk=128, dtype=dtype)
  lengths = [max(n, t) for n in LENGTHS]
  kw, kr, vr = {}, k, v
  if form == "int8":
    (k, kw["k_scale"]), (v, kw["v_scale"]) = quantize(k, jnp.int8), quantize(v, jnp.int8)
    kr, vr = dequantize(k, kw["k_scale"]), dequantize(v, kw["v_scale"])
  elif form != "contiguous":
    cap, _, tables, pool = paged_setup(5, 16, n=-(-S_TAIL // 16), lengths=lengths)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, cap - S_TAIL), (0, 0)])
    k, v = pool(pad(k)), pool(pad(v))
    kw["block_tables"] = jnp.asarray(tables)
    if form.startswith("nhd"):
      k, v = k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3)
      kw["kv_layout"] = "NHD"
  got = compiled(q, k, v, lengths, num_splits=splits, **kw)
  check(got, reference(q, kr, vr, lengths), "8bit" if form == "int8" else dtype)


@pytest.mark.parametrize("form", ["[B,K]", "[B,T,K]", "[B,T,Hkv,K]"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_sparse_index_lists(form, dtype):
  """Sparse index lists on the compiled Triton kernel, which counts each sorted list's
  live slots itself (`kernel._index_bounds`): lengths 0, 1, block±1 and past a block
  multiple, -1 and out-of-cache entries, duplicates, a window; 3 splits
  (tests/kernels/test_sparse.py, here compiled)."""
  from helpers.sparse import index_mask, random_indices  # pylint: disable=g-import-not-at-top
  q, k, v = make_problem(0, b=5, t=3, hq=8, hkv=2, s=S_TAIL, dk=128, dtype=dtype)
  shape = {"[B,K]": (5, 70), "[B,T,K]": (5, 3, 70), "[B,T,Hkv,K]": (5, 3, 2, 70)}[form]
  idx = random_indices(1, shape, S_TAIL)
  lengths = jnp.array(LENGTHS)
  out, lse = fdecode.flash_decode(q, k, v, lengths, indices=idx, impl="pallas", return_lse=True, block_k=BLOCK,
                                  num_splits=3, window=40)
  mask = index_mask(idx, q.shape, 2, S_TAIL)
  with jax.default_matmul_precision("highest"):
    ref, ref_lse = reference_decode(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lengths,
                                    mask=jnp.asarray(mask), window=40)
  tl = gpu_tol(dtype)
  assert_close(out, ref, atol=tl["atol"], rtol=tl["rtol"])
  assert_close(lse, ref_lse, atol=tl["lse"], rtol=tl["lse"], what="lse")


RAGGED_MIXES = {"mixed": ([1, 7, 64, 1, 0, 30], [5, 40, 100, 128, 3, 30]),
                "chunk40": ([40, 1, 1], [40, 90, 7]),
                "long": ([300, 1, 2], [333, 17, 2]),
                "decodes": ([1, 1, 1, 1, 1], [1, 17, 64, 65, 333])}


@pytest.mark.parametrize("mix", list(RAGGED_MIXES))
@pytest.mark.parametrize("cache", ["paged16", "contiguous"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_ragged_decode(mix, cache, layout, dtype):
  """Issue 19: ragged_decode on the compiled kernels (the Triton step: one split launch for
  the decode part and the prefill blocks, one combine into the packed rows) against each
  sequence alone through the float32 reference; padding rows give 0 and lse -inf."""
  from helpers.ragged import batch, per_sequence  # pylint: disable=g-import-not-at-top
  q_lens, kv_lens = RAGGED_MIXES[mix]
  p = batch(1, q_lens, kv_lens, max_seqs=8, d=128, paged=cache != "contiguous", layout=layout, dtype=dtype)
  out, lse = fdecode.ragged_decode(**p, kv_layout=layout, impl="pallas", return_lse=True)
  live = int(p["cu_q_lens"][p["num_seqs"]])
  ref, ref_lse = per_sequence(dict(p, q=p["q"].astype(jnp.float32), k=p["k"].astype(jnp.float32),
                                   v=p["v"].astype(jnp.float32)), layout)
  tl = gpu_tol(dtype)
  assert_close(out[:live], ref, atol=tl["atol"], rtol=tl["rtol"])
  assert_close(lse[:live], ref_lse, atol=tl["lse"], rtol=tl["lse"], what="lse")
  np.testing.assert_array_equal(np.asarray(out[live:], np.float32), 0)
  assert np.isneginf(np.asarray(lse[live:])).all()


@pytest.mark.parametrize("cache,layout", [("paged16", "HND"), ("contiguous", "NHD")])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_ragged_per_row_modifiers(cache, layout, dtype):
  """The compiled Triton step with a per-row, per-head mask and a per-row bias
  (`ragged_decode`'s ``[N, Hq, S]`` / ``[N, S]``), each program reading them at its rows'
  packed rows (tests/ragged/test_ragged_modifiers.py, here compiled)."""
  from helpers.ragged import batch, per_sequence  # pylint: disable=g-import-not-at-top
  q_lens, kv_lens = RAGGED_MIXES["mixed"]
  p = batch(1, q_lens, kv_lens, max_seqs=8, d=128, paged=cache != "contiguous", layout=layout, dtype=dtype)
  n_rows, hq = p["q"].shape[:2]
  s = p["block_tables"].shape[1] * 16 if cache != "contiguous" else p["k"].shape[2 if layout == "HND" else 1]
  rng = np.random.default_rng(8)
  mods = dict(mask=jnp.asarray(rng.random((n_rows, hq, s)) > 0.25),
              bias=jnp.asarray(rng.standard_normal((n_rows, s)), jnp.float32))
  out, lse = fdecode.ragged_decode(**p, kv_layout=layout, impl="pallas", return_lse=True, **mods)
  live = int(p["cu_q_lens"][p["num_seqs"]])
  ref, ref_lse = per_sequence(dict(p, q=p["q"].astype(jnp.float32), k=p["k"].astype(jnp.float32),
                                   v=p["v"].astype(jnp.float32)), layout, per_row=mods)
  tl = gpu_tol(dtype)
  assert_close(out[:live], ref, atol=tl["atol"], rtol=tl["rtol"])
  assert_close(lse[:live], ref_lse, atol=tl["lse"], rtol=tl["lse"], what="lse")
  np.testing.assert_array_equal(np.asarray(out[live:], np.float32), 0)


@pytest.mark.parametrize("paged,layout", [(True, "HND"), (True, "NHD"), (False, "HND")])
@pytest.mark.parametrize("seed", range(3))
def test_step_geometry_compiled(seed, paged, layout):
  """The compiled Triton step's in-kernel geometry (`fdecode.kernels.triton.geometry`) on
  traced, unchecked offsets and lengths equals XLA's (tests/kernels/triton/test_step_geometry.py, here
  compiled): outputs within float32 tolerance, the fused write's slots bit for bit."""
  from helpers.step_geometry import step  # pylint: disable=g-import-not-at-top
  p, (nk, nv) = step(seed, paged, layout)
  run = lambda impl: jax.jit(lambda p, nk, nv: fdecode.ragged_decode(
      **p, kv_layout=layout, new_k=nk, new_v=nv, return_lse=True, impl=impl))(p, nk, nv)
  with jax.default_matmul_precision("highest"):
    (out_x, lse_x, *caches_x), (out_t, lse_t, *caches_t) = run("xla"), run("pallas")
  np.testing.assert_allclose(np.asarray(out_t), np.asarray(out_x), atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(lse_t), np.asarray(lse_x), atol=1e-4, rtol=1e-4)
  for x, t in zip(caches_x, caches_t):
    np.testing.assert_array_equal(np.asarray(t), np.asarray(x))


@pytest.mark.parametrize("name", ["hnd-paged16-bf16", "nhd-paged1-int8", "hnd-contiguous-fp8-mla24",
                                  "nhd-contiguous-f32"])
def test_write_kernel_equals_the_scatter(name):
  """The compiled Triton cache write (`fdecode.ragged.write`, impl=None on GPU) writes bit
  for bit what XLA's scatter writes, in each geometry of tests/ragged/test_ragged_write.py
  (float values cast into bfloat16, 8-bit bytes, MLA latents of D = 24, page size 1, and
  the rows that write nothing)."""
  from fdecode.ragged.write import write_new_tokens  # pylint: disable=g-import-not-at-top
  from helpers.ragged_write import bits, write_step  # pylint: disable=g-import-not-at-top
  view, nk, nv, seq, pos = write_step(name)
  want = jax.jit(lambda: write_new_tokens(view, nk, nv, seq, pos, impl="xla"))()
  kernel = jax.jit(lambda: write_new_tokens(view, nk, nv, seq, pos))
  assert "fdecode_write_triton" in kernel.lower().as_text()  # the kernel, not XLA's scatter
  got = kernel()
  for w, g in zip(want, got):
    if w is not None:
      np.testing.assert_array_equal(bits(g), bits(w))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_ragged_fused_write(layout):
  """The fused write on the GPU (the Triton write kernel, `fdecode.ragged.write`): equals
  writing the rows first (the same ragged call on caches that already hold them), the
  returned caches hold exactly those rows, bit for bit what XLA's scatter writes."""
  from helpers.ragged import batch  # pylint: disable=g-import-not-at-top
  p = batch(2, [1, 9, 70, 1], [5, 9, 90, 40], max_seqs=6, d=128, layout=layout, dtype=jnp.bfloat16)
  n, hkv = p["q"].shape[0], 2
  rng = np.random.default_rng(7)
  new_k, new_v = (jnp.asarray(rng.standard_normal((n, hkv, 128)), jnp.bfloat16) for _ in range(2))
  step = jax.jit(lambda p, nk, nv: fdecode.ragged_decode(**p, kv_layout=layout, impl="pallas", new_k=nk, new_v=nv))
  out, k2, v2 = step(p, new_k, new_v)
  again = fdecode.ragged_decode(**dict(p, k=k2, v=v2), kv_layout=layout, impl="pallas")
  assert_close(out, again, atol=1e-3, rtol=1e-3)
  _, kx, vx = jax.jit(lambda p, nk, nv: fdecode.ragged_decode(**p, kv_layout=layout, impl="xla", new_k=nk,
                                                               new_v=nv))(p, new_k, new_v)
  np.testing.assert_array_equal(np.asarray(k2, np.float32), np.asarray(kx, np.float32))
  np.testing.assert_array_equal(np.asarray(v2, np.float32), np.asarray(vx, np.float32))
  for new, old in ((k2, p["k"]), (v2, p["v"])):  # one row per live new token and kv head, no other
    assert int(np.asarray((new != old).any(axis=-1)).sum()) == int(p["cu_q_lens"][p["num_seqs"]]) * hkv
