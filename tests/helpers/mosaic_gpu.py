"""Test support for jax's Mosaic GPU interpreter (tests/kernels/mosaic_gpu/test_mosaic_gpu*.py): its
params, a per-test fixture that compiles each interpreted kernel thread once
(`fdecode.devtools.interpret.compiled_once`) and resets the interpreter's state, the race
check, and the bf16 comparison and dead-slot garbage the tests share.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

interpret_gpu = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # noqa: E402

from fdecode.devtools.interpret import compiled_once  # noqa: E402
from helpers import assert_close, tol  # noqa: E402

INTERPRET = InterpretGPUParams(detect_races=True)


@pytest.fixture
def interpreter():
  """Compiles each kernel thread once (`compiled_once`); after the test, resets the
  interpreter's shared state (a kernel that raised leaves it behind)."""
  with compiled_once():
    yield
  interpret_gpu.reset_gpu_interpret_mode_state()


def assert_no_races():
  races = interpret_gpu.get_races()
  assert races is None or not races.races_found, "the Mosaic GPU interpreter detected a data race"


def check(out, lse, want_out, want_lse):
  """A bf16 kernel's (out, lse) against the reference's, at bf16's tolerances."""
  t = tol(jnp.bfloat16)
  assert_close(out, want_out, atol=t["atol"], rtol=t["rtol"])
  assert_close(lse, want_lse, atol=t["lse"], rtol=t["lse"], what="lse")


def with_garbage_past(x, lengths, value):
  """``x`` [B, Hkv, S, ...] with ``value`` (NaN, inf) in every slot at or past each sequence's length."""
  dead = jnp.arange(x.shape[2])[None, None, :, None] >= jnp.asarray(lengths)[:, None, None, None]
  return jnp.where(dead, jnp.asarray(value, jnp.float32).astype(x.dtype), x)
