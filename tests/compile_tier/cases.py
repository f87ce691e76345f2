"""Every path fdecode ships, as compile cases for `fdecode.devtools.compile_check`.

A case is ``build(target) -> (fn, args)`` with abstract args on the target's mesh (or
``(fn, args, donate_argnums)``). The
same cases compile for every chip of the tier (TPU v5e / v6e with libtpu, H100 / A100
with XLA:GPU + ptxas). Names are stable: test ids and the report use them.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import fdecode
from fdecode.kernels.common import chips

import fuzz  # tests/compile_tier/fuzz.py: this folder is on sys.path (compile_check, pytest)
import model_cases  # tests/compile_tier/model_cases.py: Flax layers and Gemma 3, a step each
import ragged_cases  # tests/compile_tier/ragged_cases.py: ragged_decode steps

class _Cases(dict):
  """name -> build; a ``fuzz:...`` name (tests/compile_tier/fuzz.py) builds its own case."""

  def __missing__(self, name):
    if name.startswith("fuzz:"):
      return fuzz.build(name)
    raise KeyError(name)


CASES = _Cases()
# The chips the compile tier compiles for (scripts/compile_tier: FDECODE_COMPILE_TARGETS=h100,v5e limits them).
TARGETS = os.environ.get("FDECODE_COMPILE_TARGETS", "h100,a100,v5e,v6e").split(",")
B, HKV, S = 2, 2, 4096


def case(name):
  def register(fn):
    CASES[name] = fn
    return fn
  return register


def _contiguous(target, *, dk, dv=None, dtype=jnp.bfloat16, g=4, t=1, s=S, b=B, hkv=HKV,
                quant=None, paged=None, kv_layout="HND", q_dtype=None, **static):
  """flash_decode over a contiguous or paged (``paged`` = page size) cache.

  ``quant``: None, or (scale granularity, with offsets): "tensor" | "token" | "tiles"."""
  dv = dk if dv is None else dv
  sd = target.spec
  is8 = dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
  q_dtype = q_dtype or (jnp.float32 if dtype == jnp.float32 else jnp.bfloat16)
  q = sd((b, t, hkv * g, dk), q_dtype)
  opts = {}
  if paged:
    n = -(-s // paged)
    pages = b * n + 3
    lead = (hkv, pages, paged) if kv_layout == "HND" else (pages, paged, hkv)
    opts["block_tables"] = sd((b, n), jnp.int32)
  else:
    lead = (b, hkv, s) if kv_layout == "HND" else (b, s, hkv)
  if kv_layout != "HND":
    static = dict(static, kv_layout=kv_layout)
  k, v = sd(lead + (dk,), dtype), sd(lead + (dv,), dtype)
  if is8:
    gran, offsets = quant or ("token", False)
    scale = {"tensor": lambda d: sd((), jnp.float32),
             "token": lambda d: sd(lead + (1,), jnp.float32),
             "tiles": lambda d: sd(lead + (d // 64,), jnp.float32)}[gran]
    opts.update(k_scale=scale(dk), v_scale=scale(dv))
    if offsets:
      opts.update(k_offset=scale(dk), v_offset=scale(dv))
  n = sd((b,), jnp.int32)
  fn = lambda q, k, v, n, opts: fdecode.flash_decode(q, k, v, n, **opts, **static)
  return fn, (q, k, v, n, opts)


# Head dims x float dtypes.
for _dt in (jnp.float32, jnp.bfloat16):
  for _d in (64, 80, 96, 112, 128, 192, 256):
    CASES[f"contiguous-{jnp.dtype(_dt).name}-d{_d}"] = functools.partial(_contiguous, dk=_d, dtype=_dt)
CASES["contiguous-bf16-dk192-dv128"] = functools.partial(_contiguous, dk=192, dv=128)
# 8-bit caches, every scale granularity.
for _dt, _q in ((jnp.int8, ("tensor", False)), (jnp.int8, ("token", True)), (jnp.int8, ("tiles", False)),
                (jnp.float8_e4m3fn, ("token", False)), (jnp.float8_e4m3fn, ("tiles", False)),
                (jnp.float8_e5m2, ("tensor", False))):
  _name = f"{jnp.dtype(_dt).name}-{_q[0]}" + ("-offsets" if _q[1] else "")
  CASES[_name] = functools.partial(_contiguous, dk=128, dtype=_dt, quant=_q)
# float16: Mosaic has no float16 vectors (libtpu: "Invalid vector type for load"), so on
# TPU a float16 cache takes the XLA path (TPU_XLA) and a float16 query over an 8-bit
# cache computes in float32 in the kernel.
CASES["float16-d128"] = functools.partial(_contiguous, dk=128, dtype=jnp.float16, q_dtype=jnp.float16)
CASES["int8-token-q-float16"] = functools.partial(_contiguous, dk=128, dtype=jnp.int8, q_dtype=jnp.float16)


@case("modifier-bias-float16")  # a float16 bias is widened for the Mosaic kernel
def _bias_float16(target):
  fn, (q, k, v, n, opts) = _modifier(target, which="bias")
  return fn, (q, k, v, n, dict(opts, bias=target.spec(opts["bias"].shape, jnp.float16)))
CASES["float8_e4m3fn-d256-tiles"] = functools.partial(_contiguous, dk=256, dtype=jnp.float8_e4m3fn,
                                                       quant=("tiles", False))
# Paged caches.
for _ps in (1, 16, 64, 128):
  CASES[f"paged{_ps}-bf16-d128"] = functools.partial(_contiguous, dk=128, paged=_ps)
CASES["paged1-f32-d128"] = functools.partial(_contiguous, dk=128, dtype=jnp.float32, paged=1)
CASES["paged2-bf16-d128"] = functools.partial(_contiguous, dk=128, paged=2)
CASES["paged16-f32-d256"] = functools.partial(_contiguous, dk=256, dtype=jnp.float32, paged=16)
# The balanced schedule (ragged_decode's prefill call), B not a power of two: two launches,
# the kernels derive the schedule themselves.
CASES["balance-b37-paged16"] = functools.partial(_contiguous, dk=128, paged=16, b=37, num_splits="balance")
CASES["paged16-int8-token"] = functools.partial(_contiguous, dk=128, dtype=jnp.int8, paged=16)
CASES["paged64-float8_e4m3fn-tiles"] = functools.partial(_contiguous, dk=128, dtype=jnp.float8_e4m3fn,
                                                          paged=64, quant=("tiles", False))
# New tokens per call.
CASES["t4-f32-d128"] = functools.partial(_contiguous, dk=128, dtype=jnp.float32, t=4)
CASES["t8-bf16-d128-g8"] = functools.partial(_contiguous, dk=128, t=8, g=8)
CASES["t8-bf16-d256-g8-paged16"] = functools.partial(_contiguous, dk=256, t=8, g=8, paged=16)
# Issue 31: row counts T * G that are not powers of two (the Triton lowering crashed on the
# 48, 80, 96, ... rows they padded to): speculative decoding, MQA with many heads, 8-bit,
# paged and token-major.
for _t, _g, _hkv in ((5, 7, 2), (5, 8, 2), (12, 4, 2), (9, 4, 2), (3, 12, 2), (1, 40, 1), (1, 48, 1)):
  CASES[f"rows-t{_t}-g{_g}-hkv{_hkv}"] = functools.partial(_contiguous, dk=128, t=_t, g=_g, hkv=_hkv)
CASES["rows-t5-g8-int8"] = functools.partial(_contiguous, dk=128, t=5, g=8, dtype=jnp.int8)
CASES["rows-t5-g8-paged16"] = functools.partial(_contiguous, dk=128, t=5, g=8, paged=16)
CASES["rows-t5-g8-nhd-paged16"] = functools.partial(_contiguous, dk=128, t=5, g=8, paged=16, kv_layout="NHD")
CASES["rows-t5-g7-nhd"] = functools.partial(_contiguous, dk=128, t=5, g=7, kv_layout="NHD")
CASES["rows-mqa40-d256"] = functools.partial(_contiguous, dk=256, t=1, g=40, hkv=1)
# Token-major caches: the Triton kernel reads them in place (no cache-sized copy).
CASES["nhd-bf16-d128"] = functools.partial(_contiguous, dk=128, kv_layout="NHD")
CASES["nhd-paged16-int8-token"] = functools.partial(_contiguous, dk=128, dtype=jnp.int8, paged=16,
                                                    kv_layout="NHD")
CASES["nhd-paged1-f32-d128-t4"] = functools.partial(_contiguous, dk=128, dtype=jnp.float32, paged=1, t=4,
                                                    kv_layout="NHD")


def _modifier(target, which, paged=None, s=S, kv_layout="HND"):
  sd = target.spec
  b, t, hq = B, 2, HKV * 4
  arrays = {"mask": dict(mask=sd((b, t, hq, s), jnp.bool_)),
            "bias": dict(bias=sd((b, 1, hq, s), jnp.float32)),
            "alibi": dict(alibi_slopes=sd((hq,), jnp.float32)),
            "sinks": dict(sinks=sd((hq,), jnp.float32))}.get(which, {})
  static = {"window": dict(window=256), "soft_cap": dict(logits_soft_cap=30.0),
            "non_causal": dict(causal=False)}.get(which, {})
  fn, (q, k, v, n, opts) = _contiguous(target, dk=128, t=t, paged=paged, s=s, kv_layout=kv_layout, **static)
  return fn, (q, k, v, n, dict(opts, **arrays))


for _m in ("mask", "bias", "alibi", "window", "soft_cap", "sinks", "non_causal"):
  CASES[f"modifier-{_m}"] = functools.partial(_modifier, which=_m)
CASES["modifier-window-paged16"] = functools.partial(_modifier, which="window", paged=16)
CASES["modifier-mask-paged16"] = functools.partial(_modifier, which="mask", paged=16)
# ... on token-major caches (the Mosaic kernel reads bf16 head pairs: per-head mask DMAs, slopes).
CASES["nhd-modifier-mask-paged16"] = functools.partial(_modifier, which="mask", paged=16, kv_layout="NHD")
CASES["nhd-modifier-alibi"] = functools.partial(_modifier, which="alibi", kv_layout="NHD")
# A cache shorter than one block and no lane multiple: the mask's column union transposes
# a tile narrower than 128 lanes (`block.column_any`).
CASES["modifier-mask-s100"] = functools.partial(_modifier, which="mask", s=100)


def _mla(target, *, g, dtype=jnp.bfloat16, paged=None, t=1, kv_layout="HND"):
  """DeepSeek MLA: a 576-wide latent key, values its first 512 columns; fp8: FlashMLA's
  layout (e4m3 latent with 1x128 tile scales, bf16 RoPE columns); int8: the whole latent
  row 8-bit with one scale per token."""
  sd = target.spec
  if kv_layout == "NHD":
    lead = (S // 16 * B + 3, 16, 1) if paged else (B, S, 1)
  else:
    lead = (1, S // 16 * B + 3, 16) if paged else (B, 1, S)
  q = sd((B, t, g, 576), jnp.bfloat16)
  opts = {}
  if paged:
    opts["block_tables"] = sd((B, S // 16), jnp.int32)
  if dtype == jnp.float8_e4m3fn:
    k = sd(lead + (512,), dtype)
    opts.update(k_scale=sd(lead + (4,), jnp.float32), k_rope=sd(lead + (64,), jnp.bfloat16))
  elif dtype == jnp.int8:  # all 576 columns 8-bit, one scale per token (the Hopper kernel's opt-in form)
    k = sd(lead + (576,), dtype)
    opts.update(k_scale=sd(lead + (1,), jnp.float32))
  else:
    k = sd(lead + (576,), dtype)
  fn = lambda q, k, n, opts: fdecode.flash_decode(q, k, None, n, v_head_dim=512, kv_layout=kv_layout, **opts)
  return fn, (q, k, sd((B,), jnp.int32), opts)


CASES["mla-bf16-g16"] = functools.partial(_mla, g=16)
CASES["mla-bf16-g128"] = functools.partial(_mla, g=128)
CASES["mla-fp8-g128"] = functools.partial(_mla, g=128, dtype=jnp.float8_e4m3fn)
CASES["mla-fp8-g16-paged16"] = functools.partial(_mla, g=16, dtype=jnp.float8_e4m3fn, paged=True)
CASES["mla-bf16-g128-t2"] = functools.partial(_mla, g=128, t=2)
# The default dispatch keeps 8-bit MLA on Triton on sm_90 too (the Hopper kernel's 8-bit
# path is opt-in until a GPU measures it: test_8bit_mla_stays_on_triton_on_sm90).
CASES["mla-int8-token-g128"] = functools.partial(_mla, g=128, dtype=jnp.int8)


@case("mla-bf16-g128-mosaic-gpu")
def _mla_mosaic_gpu(target):
  """The Hopper MLA kernel (opt-in: `fdecode.kernels.mosaic_gpu.mla_decode`), G=128, one
  token: Pallas lowers it to a Mosaic GPU custom call (its PTX and ptxas run when the
  program loads on a GPU, so this proves the lowering, not the registers)."""
  from fdecode.kernels import mosaic_gpu  # pylint: disable=g-import-not-at-top
  sd = target.spec
  fn = lambda q, k, n: mosaic_gpu.mla_decode(q, k, n)
  return fn, (sd((B, 128, 576), jnp.bfloat16), sd((B, 1, S, 576), jnp.bfloat16), sd((B,), jnp.int32))


def _mla_mosaic_gpu_8bit(target, *, dtype):
  """The Hopper MLA kernel's 8-bit path (opt-in: `fdecode.kernels.mosaic_gpu.mla_decode`
  with ``k_scale``), G=128: an int8 / e4m3 latent cache [B, 1, S, 576] with one float32
  scale per token, converted to a bf16 wgmma operand in shared memory; a Mosaic GPU
  custom call, proven lowered (not assembled) as the bf16 case."""
  from fdecode.kernels import mosaic_gpu  # pylint: disable=g-import-not-at-top
  sd = target.spec
  fn = lambda q, k, n, ks: mosaic_gpu.mla_decode(q, k, n, k_scale=ks)
  return fn, (sd((B, 128, 576), jnp.bfloat16), sd((B, 1, S, 576), dtype), sd((B,), jnp.int32),
              sd((B, 1, S, 1), jnp.float32))


CASES["mla-int8-g128-mosaic-gpu"] = functools.partial(_mla_mosaic_gpu_8bit, dtype=jnp.int8)
CASES["mla-fp8-g128-mosaic-gpu"] = functools.partial(_mla_mosaic_gpu_8bit, dtype=jnp.float8_e4m3fn)


def _rows_mosaic_gpu(target, *, dtype, d=128, t=4, g=16):
  """The Hopper GQA rows kernel (opt-in: `fdecode.kernels.mosaic_gpu.rows_decode`): T = 4
  causal tokens x G = 16 query heads = 64 rows per kv head, Hkv = 8, D = 128; bf16, or
  8-bit with per-token scales (converted to bf16 wgmma operands in shared memory). A
  Mosaic GPU custom call, proven lowered (not assembled) as the MLA case."""
  from fdecode.kernels import mosaic_gpu  # pylint: disable=g-import-not-at-top
  sd = target.spec
  hkv = 8
  cache = sd((B, hkv, S, d), dtype)
  args = [sd((B, t, hkv * g, d), jnp.bfloat16), cache, cache, sd((B,), jnp.int32)]
  if dtype == jnp.bfloat16:
    return (lambda q, k, v, n: mosaic_gpu.rows_decode(q, k, v, n)), tuple(args)
  scale = sd((B, hkv, S, 1), jnp.float32)
  fn = lambda q, k, v, n, ks, vs: mosaic_gpu.rows_decode(q, k, v, n, k_scale=ks, v_scale=vs)
  return fn, (*args, scale, scale)


CASES["rows-bf16-t4-g16-mosaic-gpu"] = functools.partial(_rows_mosaic_gpu, dtype=jnp.bfloat16)
CASES["rows-int8-t4-g16-mosaic-gpu"] = functools.partial(_rows_mosaic_gpu, dtype=jnp.int8)
CASES["rows-fp8-t4-g16-d256-mosaic-gpu"] = functools.partial(_rows_mosaic_gpu, dtype=jnp.float8_e4m3fn, d=256)


def _rows_paged_mosaic_gpu(target, *, dtype, page_size, d=128, t=4, g=16):
  """The Hopper GQA rows kernel over a paged pool ``[Hkv, P, page_size, D]`` read in place
  through a ``[B, S / page_size]`` table (`fdecode.kernels.mosaic_gpu.gqa.paging`): pages
  smaller than the 64-token block are one TMA copy each into a slice of the swizzled slot,
  all onto the slot's one barrier; 8-bit with page_size >= 32 copies the per-token scales
  from the paged scale pool likewise."""
  from fdecode.kernels import mosaic_gpu  # pylint: disable=g-import-not-at-top
  sd = target.spec
  hkv, n = 8, S // page_size
  pool = sd((hkv, B * n, page_size, d), dtype)
  args = [sd((B, t, hkv * g, d), jnp.bfloat16), pool, pool, sd((B,), jnp.int32), sd((B, n), jnp.int32)]
  if dtype == jnp.bfloat16:
    return (lambda q, k, v, n, bt: mosaic_gpu.rows_decode(q, k, v, n, block_tables=bt)), tuple(args)
  scale = sd((hkv, B * n, page_size, 1), jnp.float32)
  fn = lambda q, k, v, n, bt, ks, vs: mosaic_gpu.rows_decode(q, k, v, n, block_tables=bt, k_scale=ks, v_scale=vs)
  return fn, (*args, scale, scale)


CASES["rows-bf16-t4-g16-paged16-mosaic-gpu"] = functools.partial(_rows_paged_mosaic_gpu, dtype=jnp.bfloat16,
                                                                 page_size=16)
CASES["rows-int8-t4-g16-paged32-mosaic-gpu"] = functools.partial(_rows_paged_mosaic_gpu, dtype=jnp.int8,
                                                                 page_size=32)
# One kv head, token-major (MQA as Gemma 3 270M holds it, MLA latents): the head-major
# view is a free reshape on CPU / GPU; Mosaic DMAs [page_size, 1, D] windows in place.
CASES["nhd-mla-fp8-g16-paged16"] = functools.partial(_mla, g=16, dtype=jnp.float8_e4m3fn, paged=True,
                                                     kv_layout="NHD")
CASES["nhd-mla-bf16-g16"] = functools.partial(_mla, g=16, kv_layout="NHD")
CASES["nhd-mqa-bf16-d256"] = functools.partial(_contiguous, dk=256, hkv=1, kv_layout="NHD")
CASES["nhd-mqa-int8-paged16"] = functools.partial(_contiguous, dk=128, hkv=1, g=8, dtype=jnp.int8, paged=16,
                                                  kv_layout="NHD")
# An odd Hkv in bfloat16: Mosaic reads the whole head axis.
CASES["nhd-hkv3-bf16-paged16"] = functools.partial(_contiguous, dk=128, hkv=3, g=4, paged=16, kv_layout="NHD")
# ... and 9 (more than the 8 it once stopped at; 16-token steps).
CASES["nhd-hkv9-bf16-paged16"] = functools.partial(_contiguous, dk=128, hkv=9, g=2, paged=16, kv_layout="NHD")
# 8-bit token-major caches of 4k kv heads: Mosaic reads words of four heads in place.
CASES["nhd-hkv8-int8-token"] = functools.partial(_contiguous, dk=128, hkv=8, dtype=jnp.int8, kv_layout="NHD")
CASES["nhd-hkv8-e4m3-tiles-paged16"] = functools.partial(_contiguous, dk=128, hkv=8, dtype=jnp.float8_e4m3fn,
                                                         paged=16, quant=("tiles", False), kv_layout="NHD")


def _sparse(target, *, form, paged=None, dk=128, kk=512, **kw):
  fn, (q, k, v, n, opts) = _contiguous(target, dk=dk, t=2 if form != "shared1" else 1, paged=paged, **kw)
  sd = target.spec
  shape = {"shared": (B, kk), "per_token": (B, 2, kk), "per_head": (B, 2, HKV, kk), "shared1": (B, kk)}[form]
  if form == "shared1":
    q = sd((B, q.shape[2], q.shape[3]), q.dtype)
  return fn, (q, k, v, n, dict(opts, indices=sd(shape, jnp.int32)))


for _f in ("shared1", "shared", "per_token", "per_head"):
  CASES[f"sparse-{_f}"] = functools.partial(_sparse, form=_f)
CASES["sparse-shared-paged16"] = functools.partial(_sparse, form="shared", paged=16)
CASES["sparse-mla"] = lambda target: _sparse_mla(target)
# 8-bit caches DMA 4-row units on TPU, f32 single rows; streamed per-token scales.
CASES["sparse-f32"] = functools.partial(_sparse, form="shared", dtype=jnp.float32)
CASES["sparse-int8-token"] = functools.partial(_sparse, form="shared", dtype=jnp.int8)
CASES["sparse-e4m3-tiles-paged16"] = functools.partial(_sparse, form="per_token", paged=16,
                                                       dtype=jnp.float8_e4m3fn, quant=("tiles", False))


def _sparse_mla(target, **kw):
  fn, (q, k, n, opts) = _mla(target, g=16, **kw)
  return fn, (q, k, n, dict(opts, indices=target.spec((B, 512), jnp.int32)))


# ... on token-major caches, read in place: Mosaic DMAs a listed token's packed heads
# (bf16 pairs; 8-bit Hkv = 2: the whole head axis) or, for one kv head, its whole row.
CASES["nhd-sparse-shared"] = functools.partial(_sparse, form="shared", kv_layout="NHD")
CASES["nhd-sparse-per-head-paged16"] = functools.partial(_sparse, form="per_head", paged=16, kv_layout="NHD")
CASES["nhd-sparse-int8-token"] = functools.partial(_sparse, form="shared", dtype=jnp.int8, kv_layout="NHD")
CASES["nhd-sparse-mla-paged16"] = functools.partial(_sparse_mla, paged=True, kv_layout="NHD")
CASES["nhd-sparse-mla-fp8"] = functools.partial(_sparse_mla, dtype=jnp.float8_e4m3fn, kv_layout="NHD")


@case("cascade")
def _cascade(target):
  sd = target.spec
  hq, d = 8, 128
  q = sd((B, hq, d), jnp.bfloat16)
  pk, pv = sd((1, HKV, S, d), jnp.bfloat16), sd((1, HKV, S, d), jnp.bfloat16)
  k, v = sd((B, HKV, 512, d), jnp.bfloat16), sd((B, HKV, 512, d), jnp.bfloat16)
  args = (q, pk, pv, sd((1,), jnp.int32), k, v, sd((B,), jnp.int32), sd((B,), jnp.int32))
  fn = lambda q, pk, pv, pl, k, v, n, ids: fdecode.cascade_decode(q, pk, pv, pl, k, v, n, prefix_ids=ids)
  return fn, args


@case("xla-gather-select")
def _xla_gather_select(target):
  """Plain XLA: a select over a gather by clipped indices (the ragged step's output
  assembly, in small). One loop fusion, once the GPU target config gives XLA's cost model
  a clock (without it every constant broadcast was a launch: 7)."""
  sd = target.spec
  fn = lambda i, x, y: (jnp.where((i > 0)[:, None, None], x[jnp.clip(i, 0, 255)], 0)
                        + y[jnp.clip(i, 0, 15)][:, None, None].astype(x.dtype))
  return fn, (sd((256,), jnp.int32), sd((256, 8, 128), jnp.bfloat16), sd((16,), jnp.int32))


PLAIN_XLA = {"xla-gather-select"}  # no fdecode kernel: a check of the compile itself


CASES["ragged-paged16-write"] = functools.partial(ragged_cases.ragged, layout="HND", write=True)
# A 40-token prefill chunk beside a decode at G = 4 (prefill rows 4 * 41, not a power of two).
CASES["ragged-chunk40-g4"] = fuzz.build("fuzz:kind=ragged,m=2,n=41,g=4,hkv=2,layout=HND,ps=16,write=1")
CASES["ragged-nhd-paged16"] = functools.partial(ragged_cases.ragged, layout="NHD", write=False)
# Contiguous caches: every prefill block reads its sequence's cache row in place (one call).
CASES["ragged-contiguous-write"] = functools.partial(ragged_cases.ragged, layout="HND", write=True, paged=False)
CASES["ragged-nhd-contiguous"] = functools.partial(ragged_cases.ragged, layout="NHD", write=False, paged=False)
# The fused write of 8-bit MLA latents (D = 576, not a power of two; float8 moved as bytes).
CASES["ragged-mla-fp8-write"] = ragged_cases.ragged_mla_write
# A serving step at scale: 256 sequences, 2048 rows, Llama-3-8B heads: every program derives
# its unit's geometry from 256 sequences (the prefill blocks' lengths over 288 blocks).
# Qwen2.5-7B's heads, G = 7 (28 / 4): no power of two anywhere a Triton tensor holds G rows.
CASES["ragged-g7-write"] = functools.partial(ragged_cases.ragged, layout="NHD", write=True, hkv=4, hq=28)
CASES["ragged-m256-write"] = functools.partial(ragged_cases.ragged, layout="HND", write=True, m=256, n_rows=2048,
                                               hkv=8, hq=32)
# bf16 MLA latents on the Triton step (paged; contiguous at G = 8, which the Hopper MLA
# kernel does not take), and contiguous at G = 16, whose decode part goes to the Hopper MLA
# kernel on sm_90 (the two-part path there). A balanced work item whose rows differ keeps
# registers back (`tuned.LAUNCH.differing_rows_reserve`): at bk = 64 these spilled 16-48 B.
CASES["ragged-mla-bf16-paged16"] = functools.partial(ragged_cases.ragged_mla, dtype=jnp.bfloat16, write=False)
CASES["ragged-mla-bf16-contiguous-g8"] = functools.partial(ragged_cases.ragged_mla, dtype=jnp.bfloat16, g=8,
                                                           paged=False, write=False)
CASES["ragged-mla-bf16-contiguous-g16"] = functools.partial(ragged_cases.ragged_mla, dtype=jnp.bfloat16,
                                                            paged=False, write=False)
# Per-row modifiers, read in place by each program at its rows' packed rows: a bool mask a
# row ([N, S]) and a float32 bias a row and query head ([N, Hq, S], 32 MB).
CASES["ragged-mask-write"] = functools.partial(ragged_cases.ragged, layout="HND", write=True, row_mods="mask")
CASES["ragged-bias-heads"] = functools.partial(ragged_cases.ragged, layout="NHD", write=False, row_mods="bias")
# Opt-in: both parts on the Hopper rows kernel (decode part T = 1, prefill blocks T = 64).
CASES["ragged-paged16-mosaic-gpu"] = functools.partial(ragged_cases.ragged, layout="HND", write=False,
                                                      impl="mosaic_gpu")


def _sharded(target, n_dev, head, seq, pod=None):
  axes = ("h", "s")
  if pod is not None:  # a named multi-host slice of the target's generation
    from fdecode.devtools.compile_check import Target  # pylint: disable=g-import-not-at-top
    target = Target(pod).load()
  mesh = target.mesh(n_dev, axes)
  sd = lambda shape, dtype, spec=P(): target.spec(shape, dtype, mesh, spec)
  hq, s = 16, 8192
  q = sd((B, hq, 128), jnp.bfloat16, P(None, "h"))
  k = sd((B, 8, s, 128), jnp.bfloat16, P(None, "h", "s"))
  v = sd((B, 8, s, 128), jnp.bfloat16, P(None, "h", "s"))
  fn = lambda q, k, v, n: fdecode.sharded_flash_decode(q, k, v, n, mesh=mesh, head_axis="h", seq_axis="s")
  return fn, (q, k, v, sd((B,), jnp.int32))


CASES["sharded-4dev"] = functools.partial(_sharded, n_dev=4, head=2, seq=2)


@case("sharded-mla-mosaic-gpu")
def _sharded_mla_mosaic_gpu(target):
  """MLA (bf16, G = 128) over 2 devices' shares of the sequence on sm_90: the default
  dispatch's Hopper MLA kernel inside ``shard_map(check_vma=True)``, its outputs typed
  varying over the mesh axis (before, an untyped Mosaic GPU output was refused)."""
  mesh = target.mesh(2, ("s",))
  sd = lambda shape, dtype, spec=P(): target.spec(shape, dtype, mesh, spec)
  q = sd((B, 128, 576), jnp.bfloat16)
  k = sd((B, 1, S, 576), jnp.bfloat16, P(None, None, "s"))
  fn = lambda q, k, n: fdecode.sharded_flash_decode(q, k, None, n, mesh=mesh, seq_axis="s", v_head_dim=512)
  return fn, (q, k, sd((B,), jnp.int32))
TPU_ONLY = {"sharded-pod-v5e-4x4"}  # a 16-chip, 4-host slice (TPU topology only)
# Mosaic GPU (Hopper: TMA, wgmma, setmaxnreg) cases: sm_90 targets only.
SM90_ONLY = {"mla-bf16-g128-mosaic-gpu", "mla-int8-g128-mosaic-gpu", "mla-fp8-g128-mosaic-gpu",
             "rows-bf16-t4-g16-mosaic-gpu", "rows-int8-t4-g16-mosaic-gpu", "rows-fp8-t4-g16-d256-mosaic-gpu",
             "rows-bf16-t4-g16-paged16-mosaic-gpu", "rows-int8-t4-g16-paged32-mosaic-gpu",
             "ragged-paged16-mosaic-gpu", "sharded-mla-mosaic-gpu"}
# Cases whose documented TPU path is XLA, not a kernel: bf16 pages of one token split a
# 32-bit sublane, which no Mosaic DMA addresses (`fdecode.kernels.mosaic_tpu.plan.dma_unit`);
# float16 caches, which Mosaic cannot load.
TPU_XLA = {"paged1-bf16-d128", "float16-d128"}
CASES["sharded-pod-v5e-4x4"] = functools.partial(_sharded, n_dev=16, head=4, seq=4, pod="v5e:4x4")


CASES["flax-decode-attention"] = functools.partial(model_cases.flax_step, b=B, s=S)
CASES["flax-mla"] = functools.partial(model_cases.flax_mla_step, b=B, s=S)
CASES["gemma3-270m-decode"] = functools.partial(model_cases.gemma_step, b=B, s=S)


# The ragged steps v6e compiles. On TPU a step runs the decode kernels
# (`fdecode_split_kv_mosaic`, `_paged`) at its parts' row shapes, under the same plans on every
# generation (`fdecode.kernels.mosaic_tpu.plan` does not depend on the chip), and v6e compiles
# those kernels in every decode case. v5e compiles every ragged step; v6e one per kernel and
# cache form: the contiguous kernel with the fused write, MLA latents, a token-major cache read
# by the paged kernel. The other nine took 119 s of v6e's 247 s (2026-11-28, a 2-core VM).
V6E_RAGGED = {"ragged-contiguous-write", "ragged-mla-bf16-contiguous-g8", "ragged-nhd-contiguous"}


# Paged cases v6e leaves to v5e: the same plans (chip-independent, as above) over page
# sizes, schedules, row shapes and modifiers that v6e compiles contiguous or at another page
# size. The paged kernel issues each step's page DMAs one by one (unrolled), so these are
# the tier's slowest TPU compiles: 83 s of v6e's 207 s (2026-11-28, a 2-core VM). v6e still
# compiles the paged kernel at page sizes 1 (the XLA path), 16, 64 and 128, with per-token
# 8-bit scales token-major, fp8 tile scales, MLA latents, words of two and four kv heads and
# whole head axes (`names_for("v6e")`).
V6E_SKIP = {"paged2-bf16-d128", "paged1-f32-d128", "paged16-int8-token", "nhd-paged1-f32-d128-t4",
            "nhd-hkv8-e4m3-tiles-paged16", "rows-t5-g8-paged16", "rows-t5-g8-nhd-paged16", "balance-b37-paged16",
            "modifier-window-paged16", "modifier-mask-paged16", "nhd-modifier-mask-paged16", "mla-fp8-g16-paged16"}


def names_for(target_name: str) -> list[str]:
  """The cases a target compiles: all of them (the pod slice on TPU only, `GPU_ONLY` on GPUs
  only, the Mosaic GPU kernels on sm_90 only; on v6e the ragged steps of `V6E_RAGGED` and none of `V6E_SKIP`)."""
  is_gpu = target_name in chips.GPUS
  sm90 = is_gpu and chips.GPUS[target_name].capability == (9, 0)
  v6e_drops = lambda n: n in V6E_SKIP or (n.startswith("ragged-") and n not in V6E_RAGGED)
  return [n for n in CASES if not (is_gpu and n in TPU_ONLY) and (is_gpu or n not in GPU_ONLY)
          and (sm90 or n not in SM90_ONLY)
          and not (target_name == "v6e" and v6e_drops(n))]


# The benchmark grid (benchmarks/bench_gpu.py, benchmarks/compile_report.py): Hq=32,
# Hkv=8, D=128 bf16, lengths = S; and FlashDecoding's long-context case, one kv head.
BENCH = {"bench-b1-s32k": (1, 8, 32, 32768), "bench-b8-s32k": (8, 8, 32, 32768),
         "bench-b64-s4k": (64, 8, 32, 4096), "bench-b1-hkv1-s1m": (1, 1, 8, 1 << 20)}


def _bench(target, b, hkv, hq, s, paged=None, **static):
  return _contiguous(target, dk=128, b=b, hkv=hkv, g=hq // hkv, s=s, paged=paged, **static)


for _n, (_b, _hkv, _hq, _s) in BENCH.items():
  CASES[_n] = functools.partial(_bench, b=_b, hkv=_hkv, hq=_hq, s=_s)


CASES["flax-mha-attention-fn"] = functools.partial(model_cases.flax_mha, b=B, s=S)


def _grad(target, **kw):
  """`jax.grad` of a decode with respect to q, k and v: the forward kernel, then the
  chunked backward of `fdecode.derivatives` (plain XLA), compiled for the chip."""
  fn, (q, k, v, n, opts) = _contiguous(target, **kw)
  loss = lambda q, k, v, n, opts: jnp.sum(fn(q, k, v, n, opts).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2)), (q, k, v, n, opts)


# The backward, compiled deviceless: a bf16 cache at T = 1 and a paged one at T = 4
# (pool gradients through the page gather's transpose).
CASES["grad-contiguous-bf16-d128"] = functools.partial(_grad, dk=128)
CASES["grad-paged16-bf16-t4"] = functools.partial(_grad, dk=128, paged=16, t=4)
# The batch-invariant mode's plans (each kernel family's `make_plan(split_size=)`): a paged
# bf16 cache at T = 4 (GPU: Triton; TPU: the Mosaic paged kernel, its row sums as products).
CASES["invariant-paged16-bf16-t4"] = functools.partial(_contiguous, dk=128, paged=16, t=4, batch_invariant=True)
# The benchmark's heads at B = 1 / 8 / 64, S = 32k: the same kernel and splits at every B
# (test_gpu_invariant_plans_do_not_depend_on_the_batch). B = 8 and 64 on GPUs only: the TPU
# plan names no B (tests/api/test_batch_invariant.py), and B = 1 compiles its contiguous kernel.
INVARIANT_BENCH = {f"invariant-b{b}-s32k": b for b in (1, 8, 64)}
for _n, _b in INVARIANT_BENCH.items():
  CASES[_n] = functools.partial(_bench, b=_b, hkv=8, hq=32, s=32768, batch_invariant=True)
GPU_ONLY = {"invariant-b8-s32k", "invariant-b64-s32k"}
