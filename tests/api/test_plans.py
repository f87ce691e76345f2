"""The XLA and Mosaic (TPU) plans (`fdecode.kernels.xla.plan`, `fdecode.kernels.mosaic_tpu.plan`):
each documented rule of a split count and of a read decision, checked on shapes only (no
kernel runs). Mosaic's parallel units off a TPU host are one TensorCore
(`fdecode.config.num_parallel_units`)."""

import itertools

import jax
import jax.numpy as jnp
import pytest
from helpers.lowering import lower_for_cuda

from fdecode import config as config_lib
from fdecode.cache.layout import CacheView, read_layout
from fdecode.kernels.common.modifiers import Modifiers
from fdecode.kernels.mosaic_tpu import plan as mosaic
from fdecode.kernels.mosaic_tpu.token_major import TokenMajorRead
from fdecode.kernels.xla import plan as xla
from fdecode.kernels.xla.plan import make_plan as xla_plan

CHUNK, CHUNK_BYTES, TM_CHUNK = xla.CHUNK_TOKENS, xla.CHUNK_BYTES, xla.TOKEN_MAJOR_CHUNK_TOKENS


def test_read_layout():
  assert [read_layout(lay, h) for lay in ("HND", "NHD") for h in (1, 2, 8)] == ["HND"] * 4 + ["NHD"] * 2


GRID = list(itertools.product([1, 4], [1, 3, 8], [0, 1, 100, 2048, 5000, 40000], [False, True], [False, True],
                              ["HND", "NHD"], [0, 4096, 1 << 20]))


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_xla_splits_follow_the_documented_rule(platform):
  units = config_lib.num_parallel_units(platform)
  for b, hkv, s, paged, quantized, layout, token_bytes in GRID:
    p = xla_plan(batch=b, kv_heads=hkv, tokens=s, platform=platform, paged=paged, quantized=quantized,
                 kv_layout=read_layout(layout, hkv), token_bytes=token_bytes)
    case = (b, hkv, s, paged, quantized, layout, token_bytes, p)
    assert p.kv_layout == read_layout(layout, hkv) and p.tokens == s, case
    heuristic = max(xla.split_count(b, hkv, max(s, 1), units), s // CHUNK)
    if not paged and not quantized and p.kv_layout == "HND":  # one batched matmul: a divisor of S
      assert p.num_splits == xla.largest_divisor_at_most(s, heuristic), case
      assert s % p.num_splits == 0 or s == 0, case
    else:  # the chunk loops: about CHUNK tokens and at most CHUNK_BYTES of K a chunk
      floor = max(heuristic, -(-s * token_bytes // CHUNK_BYTES))
      if not paged and p.kv_layout == "NHD":
        floor = max(floor, s // TM_CHUNK)
      assert p.num_splits == max(floor, 1), case
    given = xla_plan(batch=b, kv_heads=hkv, tokens=s, platform=platform, paged=paged, quantized=quantized,
                     kv_layout=read_layout(layout, hkv), token_bytes=token_bytes, num_splits=7)
    assert given.num_splits == 7, case


@pytest.mark.parametrize("slots", [0, 1, 2047, 2048, 5000, 65536])
def test_xla_sparse_chunks(slots):
  p = xla_plan(batch=2, kv_heads=4, tokens=slots, platform="cpu", sparse=True)
  assert p.num_splits == max(1, slots // CHUNK)
  assert xla_plan(batch=2, kv_heads=4, tokens=slots, platform="cpu", sparse=True, num_splits=3).num_splits == 3


def sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def mosaic_call(*, b=2, hkv=2, s=256, page_size=None, dtype="bfloat16", layout="HND", q_dtype=None, slots=None,
                num_splits=None, window=None, d=128, g=2):
  """make_plan's arguments as the dispatch builds them: the cache's view, the other operands."""
  paged = page_size is not None
  if paged:
    pages = b * s // page_size
    hm = (hkv, pages, page_size, d)
    tm = (pages, page_size, hkv, d)
    tables = sds((b, s // page_size), "int32")
  else:
    hm, tm, tables = (b, hkv, s, d), (b, s, hkv, d), None
  k = sds(hm if layout == "HND" else tm, dtype)
  view = CacheView(k, k, block_tables=tables, layout=layout, paged=paged)
  extra = dict(mods=Modifiers(window=window), mask=None, bias=None, alibi=None, v_head_dim=None)
  if slots is not None:
    extra.update(sparse=object(), indices=sds((b, hkv, slots), "int32"), index_bounds=None)
  q_rows = sds((b, hkv, g, d), q_dtype or ("float32" if dtype == "int8" else dtype))
  return mosaic.make_plan(q_rows, view, extra=extra, num_tokens=1, num_splits=num_splits)


def test_mosaic_falls_back_to_xla():
  assert mosaic_call(dtype="float16").backend == "xla"  # no float16 vectors
  assert mosaic_call(dtype="bfloat16", page_size=1).backend == "xla"  # a page splits a 32-bit sublane
  assert mosaic_call(dtype="bfloat16", page_size=2).backend == "mosaic"
  assert mosaic_call(dtype="bfloat16", s=255).backend == "mosaic"  # contiguous: BlockSpec, any S


def test_mosaic_read_modes():
  hm = mosaic_call(layout="HND", page_size=16)
  assert hm.read is None and not hm.as_pool and hm.sizes.paged
  words = mosaic_call(layout="NHD", hkv=2, page_size=16)  # bfloat16, even Hkv: words of 2 heads
  assert words.read == TokenMajorRead(2, True, False)
  axis = mosaic_call(layout="NHD", hkv=3, page_size=16)  # odd Hkv: the whole head axis
  assert axis.read == TokenMajorRead(3, False, True)
  pool = mosaic_call(layout="NHD", hkv=2, s=96)  # contiguous, S with a power-of-two factor >= 8
  assert pool.as_pool and pool.sizes.paged and pool.read is not None
  assert mosaic_call(layout="NHD", hkv=2, s=100).read is None  # no such factor: a head-major copy
  big = mosaic_call(layout="NHD", hkv=3, page_size=4096, s=8192, d=512)  # a head-axis step past its VMEM
  assert big.read is None and big.backend == "mosaic"
  sparse = mosaic_call(layout="NHD", hkv=3, page_size=16, slots=64)
  assert sparse.sparse and sparse.read == TokenMajorRead(1, False, True)


def test_mosaic_splits_and_query_dtype():
  assert mosaic_call(num_splits=5).num_splits == 5
  assert mosaic_call(slots=64, num_splits=5).num_splits == 5
  units = config_lib.num_parallel_units("tpu")
  for b, hkv, s in itertools.product([1, 4], [1, 2, 8], [64, 4096]):
    p = mosaic_call(b=b, hkv=hkv, s=s, page_size=16, layout="NHD", dtype="float32")
    blocks = -(-s // p.sizes.block)
    assert p.num_splits == mosaic.split_count(b, hkv // p.read.heads, blocks, units)
  assert mosaic_call(dtype="bfloat16", q_dtype="float16").upcast_query
  assert not mosaic_call(dtype="bfloat16").upcast_query
  assert mosaic_call(dtype="float16", q_dtype="float16").backend == "xla"


def test_public_plan_is_the_plan_a_call_runs(monkeypatch):
  """`fdecode.plan` returns the plan the kernel entry then receives (an odd shape: a fresh trace)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import fdecode  # pylint: disable=g-import-not-at-top
  from fdecode.kernels.xla import backend  # pylint: disable=g-import-not-at-top
  seen, real = [], backend.xla_partials
  monkeypatch.setattr(backend, "xla_partials",
                      lambda q, cache, *a, **kw: seen.append((kw["num_splits"], cache.layout)) or real(q, cache, *a, **kw))
  rng = np.random.default_rng(0)
  q = rng.standard_normal((1, 1, 4, 24), np.float32)
  k = rng.standard_normal((1, 3000, 2, 24), np.float32)  # token-major, 2 kv heads
  lengths = np.array([2999], np.int32)
  out = fdecode.flash_decode(q, k, k, lengths, kv_layout="NHD")  # traces the host's (cpu) branch only
  traced = list(seen)
  seen.clear()  # exported for CUDA (D=24: the GPU's XLA path): the gpu branch, traced as it is lowered
  lower_for_cuda(lambda q: fdecode.flash_decode(q, k, k, lengths, kv_layout="NHD"), q)
  exported = list(seen)
  (cpu,) = fdecode.plan(q, k, k, lengths, kv_layout="NHD", platform="cpu")
  (gpu,) = fdecode.plan(q, k, k, lengths, kv_layout="NHD", platform="gpu")
  assert traced == [(cpu.num_splits, cpu.kv_layout)], (traced, cpu)
  assert exported == [(gpu.num_splits, gpu.kv_layout)], (exported, cpu, gpu)
  assert gpu.num_splits != cpu.num_splits  # each branch traced its own platform's plan
  assert gpu.num_splits != cpu.num_splits  # the two branches' plans differ: the gpu one was traced
  assert cpu.kv_layout == "NHD"
  assert np.isfinite(np.asarray(out)).all()
  (tpu,) = fdecode.plan(q, k, k, lengths, kv_layout="NHD", platform="tpu")
  assert isinstance(tpu, mosaic.CallPlan) and tpu.backend == "mosaic" and tpu.read is not None
  assert fdecode.plan(q, k, k, lengths, kv_layout="NHD", num_splits=5)[0].num_splits == 5
  assert fdecode.plan(q, k, k, lengths, impl="reference", kv_layout="NHD") == ()
  with pytest.raises(ValueError, match="platform must be"):
    fdecode.plan(q, k, k, lengths, platform="metal")
