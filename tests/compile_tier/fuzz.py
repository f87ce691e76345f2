"""Randomized compile cases (issue 31): shapes drawn by hypothesis, each named by its own
parameters, so a failing name *is* the case (`build` rebuilds it anywhere: paste it into
`FOUND` to keep it as a fixed case).

A name is ``fuzz:kind=decode,t=5,g=7,hkv=2,d=128,dtype=bfloat16,...``; kinds:
* ``decode``: flash_decode, T 1..64, G 1..16 (3 / 5 / 6 / 7 / 12 included), Hkv 1..16,
  every head dim fdecode tiles on GPU, float32 / bfloat16 / int8 / float8 caches with
  each scale granularity (and offsets), contiguous or paged (page size 1..128), HND / NHD;
* ``mla``: 576 / 512 latents, G up to 128, bf16 or FlashMLA's fp8 layout, T 1..4;
* ``ragged``: ragged_decode over a paged pool (page size 1..64) or a contiguous cache
  (``ps=0``), N packed rows of decodes and chunks (1..1024 rows), the fused write or not;
  GQA heads of D = 128 or bf16 MLA latents (``mla=1``: one 576 / 512 head), and a per-row
  mask or bias (``mods``).
"""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
from hypothesis import given, settings
from hypothesis import strategies as st

import fdecode

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8,
          "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}
HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256)
# Shapes the randomized leg once found broken, kept as fixed cases: D=192 bf16 at 64 rows
# spilled on A100 (the register model's `row_state_factor` since); float32 at T = 1 over
# pages of 16 spilled 284 B on H100, and 768 rows of D = 64 564 B on both chips (the
# float32 row budget, `tuned.LAUNCH.f32_tile_factor` and the differing rows' reserve since).
FOUND: list[str] = ["fuzz:kind=decode,t=3,g=12,hkv=3,d=192,dtype=bfloat16,paged=64,layout=HND,s=4096,b=1",
                    "fuzz:kind=decode,t=1,g=2,hkv=1,d=128,dtype=float32,paged=16,layout=HND,s=100,b=5",
                    "fuzz:kind=decode,t=64,g=12,hkv=1,d=64,dtype=float32,paged=0,layout=HND,s=4096,b=1"]


# CI: a fixed seed and ``FDECODE_COMPILE_FUZZ_EXAMPLES`` draws (default 9); ``FDECODE_COMPILE_FUZZ=long``:
# random seeds, 60 shapes. Compiled for H100, A100 and TPU v5e (of ``FDECODE_COMPILE_TARGETS``).
LONG = os.environ.get("FDECODE_COMPILE_FUZZ") == "long"
EXAMPLES = int(os.environ.get("FDECODE_COMPILE_FUZZ_EXAMPLES", 60 if LONG else 9))
TARGETS = [t for t in os.environ.get("FDECODE_COMPILE_TARGETS", "h100,a100,v5e,v6e").split(",")
           if t in ("h100", "a100", "v5e")]


@functools.cache
def drawn_names() -> list[str]:
  """The leg's shapes: hypothesis draws (derandomized unless long), named by `name_of`: two
  thirds flash_decode calls, a sixth each MLA and ragged_decode steps; `FOUND` first.
  Drawn once a process (random seeds differ from draw to draw)."""
  names = []
  for kind, share in (("decode", 4), ("mla", 1), ("ragged", 1)):
    @settings(max_examples=max(1, EXAMPLES * share // 6), derandomize=not LONG, database=None, deadline=None)
    @given(spec=specs(kind))
    def collect(spec):
      names.append(name_of(spec))
    collect()
  return list(dict.fromkeys(FOUND + names))


def name_of(spec: dict) -> str:
  return "fuzz:" + ",".join(f"{k}={v}" for k, v in spec.items())


def parse(name: str) -> dict:
  spec = {}
  for item in name[len("fuzz:"):].split(","):
    k, v = item.split("=")
    spec[k] = int(v) if v.lstrip("-").isdigit() else v
  return spec


KINDS = ("decode", "mla", "ragged")


@st.composite
def specs(draw, kind="decode"):
  """One random case's parameters of ``kind`` (a dict; `name_of` names it)."""
  if kind == "mla":
    return dict(kind=kind, g=draw(st.sampled_from([1, 5, 16, 24, 40, 64, 100, 128])), t=draw(st.integers(1, 4)),
                dtype=draw(st.sampled_from(["bfloat16", "float8_e4m3fn"])), paged=draw(st.sampled_from([0, 16, 64])),
                s=draw(st.sampled_from([129, 1000, 4096])))
  if kind == "ragged":
    spec = dict(kind=kind, m=draw(st.sampled_from([1, 3, 8, 16])), n=draw(st.integers(1, 1024)),
                g=draw(st.sampled_from([1, 3, 4, 7, 8, 12])), hkv=draw(st.sampled_from([1, 2, 8])),
                layout=draw(st.sampled_from(["HND", "NHD"])), ps=draw(st.sampled_from([0, 1, 16, 16, 64])),
                write=draw(st.integers(0, 1)), mla=draw(st.sampled_from([0, 0, 0, 1])),
                mods=draw(st.sampled_from(["none", "none", "mask", "bias"])))
    if spec["mla"]:  # one latent head, G query heads on it
      spec.update(hkv=1, g=draw(st.sampled_from([8, 16, 24, 64, 128])))
    return spec
  dtype = draw(st.sampled_from(list(DTYPES)))
  spec = dict(kind=kind, t=draw(st.sampled_from([1, 1, 2, 3, 5, 9, 12, 16, 33, 64])),
              g=draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 12, 16])),
              hkv=draw(st.sampled_from([1, 2, 3, 4, 8, 16])), d=draw(st.sampled_from(HEAD_DIMS)), dtype=dtype,
              paged=draw(st.sampled_from([0, 0, 1, 2, 16, 64, 128])), layout=draw(st.sampled_from(["HND", "NHD"])),
              s=draw(st.sampled_from([100, 1000, 4096])), b=draw(st.sampled_from([1, 2, 5])))
  if dtype in ("int8", "float8_e4m3fn", "float8_e5m2"):
    spec["gran"] = draw(st.sampled_from(["tensor", "token", "tiles"]))
    spec["offsets"] = draw(st.integers(0, 1)) if spec["gran"] != "tensor" else 0
  return spec


def build(name: str):
  """The case ``build(target) -> (fn, args)`` of a fuzz name."""
  spec = parse(name)
  kind = spec.pop("kind")
  return functools.partial({"decode": _decode, "mla": _mla, "ragged": _ragged}[kind], **spec)


def _decode(target, *, t, g, hkv, d, dtype, paged, layout, s, b, gran="token", offsets=0):
  from cases import _contiguous  # pylint: disable=g-import-not-at-top (cases imports this module)
  return _contiguous(target, dk=d, dtype=DTYPES[dtype], g=g, t=t, s=s, b=b, hkv=hkv, paged=paged or None,
                     kv_layout=layout, quant=(gran, bool(offsets)))


def _mla(target, *, g, t, dtype, paged, s):
  sd = target.spec
  b = 2
  n = -(-s // (paged or 1))
  lead = (1, b * n + 3, paged) if paged else (b, 1, s)
  opts = {"block_tables": sd((b, n), jnp.int32)} if paged else {}
  if dtype == "float8_e4m3fn":
    k = sd(lead + (512,), jnp.float8_e4m3fn)
    opts.update(k_scale=sd(lead + (4,), jnp.float32), k_rope=sd(lead + (64,), jnp.bfloat16))
  else:
    k = sd(lead + (576,), jnp.bfloat16)
  fn = lambda q, k, n, opts: fdecode.flash_decode(q, k, None, n, v_head_dim=512, **opts)
  return fn, (sd((b, t, g, 576), jnp.bfloat16), k, sd((b,), jnp.int32), opts)


def _ragged(target, *, m, n, g, hkv, layout, ps, write, mla=0, mods="none", d=128, s=2048):
  sd = target.spec
  d, dv = (576, 512) if mla else (d, d)
  pages = m * (s // max(ps, 1)) + 3
  cache = ((hkv, pages, ps, d) if layout == "HND" else (pages, ps, hkv, d)) if ps else (
      (m, hkv, s, d) if layout == "HND" else (m, s, hkv, d))
  args = [sd((n, hkv * g, d), jnp.bfloat16), sd(cache, jnp.bfloat16), None if mla else sd(cache, jnp.bfloat16),
          sd((m,), jnp.int32), sd((m, s // ps), jnp.int32) if ps else None, sd((m + 1,), jnp.int32),
          sd((1,), jnp.int32)]
  new = sd((n, hkv, d), jnp.bfloat16)
  extra = dict(new_k=new, new_v=None if mla else new) if write else {}
  if mods != "none":
    extra[mods] = sd((n, s), jnp.bool_) if mods == "mask" else sd((n, hkv * g, s), jnp.float32)
  opts = dict(kv_layout=layout, **({"v_head_dim": dv} if mla else {}))
  fn = lambda q, k, v, lens, t, cu, ns, extra: fdecode.ragged_decode(q, k, v, lens, t, cu, ns, **extra, **opts)
  return fn, tuple(args) + (extra,)
