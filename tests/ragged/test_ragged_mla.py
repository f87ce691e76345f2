"""`ragged_decode` over MLA latents (``v=None``: values are the keys' first ``v_head_dim``
columns) on the Triton step (`fdecode.kernels.triton.triton_step`, interpreted), contiguous and
paged, float and 8-bit, against the float32 reference per sequence; and which contiguous
steps keep the two-part path on a GPU: the ones whose decode part `flash_decode` sends to
the Hopper MLA kernel (`fdecode.route.step_path`)."""

import jax.numpy as jnp
import numpy as np
import pytest

import fdecode
from fdecode.kernels.common import chips
from fdecode.cache.quant import quantize
from fdecode.call import canonical_call
from fdecode.options import split_call
from helpers.ragged import batch, check, per_sequence, spy_step


@pytest.mark.parametrize("cache", ["paged16", "contiguous"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_latents_on_the_triton_step(cache, dtype, monkeypatch):
  """(Contiguous latents took the two-part path everywhere before; the interpreter never
  runs the Hopper kernel, so they now take the step here, as on any GPU but sm_90 at bf16
  and G a multiple of 16.)"""
  calls = spy_step(monkeypatch)
  p = batch(5, [2, 1, 66, 1], [10, 20, 70, 33], max_seqs=5, hq=8, hkv=1, d=48, paged=cache != "contiguous")
  opts = {}
  if dtype == "float8_e4m3fn":
    kq, ks = quantize(p["k"], jnp.float8_e4m3fn)
    p, opts = dict(p, k=kq), dict(k_scale=ks)
    real = dict(p, k=kq.astype(jnp.float32) * ks)
  else:
    p = dict(p, q=p["q"].astype(dtype), k=p["k"].astype(dtype))
    real = dict(p, q=p["q"].astype(jnp.float32), k=p["k"].astype(jnp.float32))
  out, lse = fdecode.ragged_decode(p["q"], p["k"], None, p["kv_lens"], p["block_tables"], p["cu_q_lens"],
                                   p["num_seqs"], v_head_dim=32, impl="pallas", interpret=True, return_lse=True,
                                   **opts)
  assert calls, "the Triton step did not run"
  check(p, out, lse, per_sequence(dict(real, v=real["k"][..., :32])),
        dtype=jnp.float32 if dtype == "float32" else jnp.bfloat16)


@pytest.mark.parametrize("gpu,dtype,g,paged,expected", [
    ("h100", "bfloat16", 16, False, True),   # the Hopper MLA kernel takes the decode part
    ("h100", "bfloat16", 8, False, False),   # G not a multiple of 16
    ("h100", "float8_e4m3fn", 16, False, False),  # 8-bit latents: opt-in only
    ("h100", "bfloat16", 16, True, False),   # paged: the kernel reads one contiguous head
    ("a100", "bfloat16", 16, False, False),  # not sm_90
])
def test_hopper_keeps_only_the_decode_parts_it_takes(gpu, dtype, g, paged, expected, monkeypatch):
  from fdecode import route  # pylint: disable=g-import-not-at-top
  from fdecode.call import decode_of  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(chips, "lowering_gpu", lambda: chips.GPUS[gpu])
  m, s = 4, 256
  k = jnp.zeros((1, m * s // 16, 16, 576) if paged else (m, 1, s, 576), dtype)
  call = dict(q=jnp.zeros((m, 1, g, 576), jnp.bfloat16), k=k, v=None, lengths=jnp.full((m,), 7, jnp.int32),
              block_tables=jnp.zeros((m, s // 16), jnp.int32) if paged else None,
              **({} if dtype == "bfloat16" else dict(k_scale=0.5)))
  # The Triton step leaves the decode part to the Hopper MLA kernel: the step runs as two decodes.
  step = route.step_path(decode_of(canonical_call(*split_call(**call, v_head_dim=512))), "gpu", step_takes=True)
  assert (step is None) is expected, step
