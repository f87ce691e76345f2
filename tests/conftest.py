"""Shared test helpers: random decode problems, dtype-keyed tolerances, comparisons."""

import os

# Eight simulated CPU devices for the multi-device tests; set before JAX initializes.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import contextlib
import gc

# tests/compile_tier runs in its own environment with the chip compilers (scripts/compile_tier).
collect_ignore = [] if os.environ.get("FDECODE_COMPILE_TIER") else ["compile_tier"]

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # the race detector's state
from jax.experimental.pallas import tpu as pltpu

# Tolerances keyed by the dtype of q/k/v. bfloat16 keeps 8 mantissa bits and the
# kernels feed softmax weights to the PV matmul in the cache dtype.
TOLERANCES = {
    jnp.float32: dict(atol=3e-5, rtol=3e-5, lse=3e-5),
    jnp.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2, lse=2e-3),
}


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
  """Drops JAX's compilation caches after each test module. XLA:CPU maps every compiled
  program's code into memory (about 3 mappings each, measured); a pytest worker that keeps
  the programs of hundreds of modules passed Linux's ``vm.max_map_count`` (65530) and
  segfaulted inside the compiler (CI, test_variants, after test_ragged and test_serving
  alone had taken one process to 15k mappings). ``jax.clear_caches`` unmaps them."""
  yield
  jax.clear_caches()
  gc.collect()


def tol(dtype):
  return TOLERANCES[jnp.dtype(dtype).type]


def make_problem(seed, *, b=2, t=1, hq=4, hkv=2, s=64, dk=64, dv=None, dtype=jnp.float32):
  """q [B, T, Hq, Dk] (or [B, Hq, Dk] if t is None), k [B, Hkv, S, Dk], v [B, Hkv, S, Dv]."""
  dv = dk if dv is None else dv
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q_shape = (b, hq, dk) if t is None else (b, t, hq, dk)
  q = jax.random.normal(kq, q_shape, jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, hkv, s, dk), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, hkv, s, dv), jnp.float32).astype(dtype)
  return q, k, v


def assert_close(actual, expected, *, atol, rtol, what="output"):
  """FlashMLA-style: inf/NaN positions must agree first, then the finite values."""
  a = np.asarray(jnp.asarray(actual, jnp.float32))
  e = np.asarray(jnp.asarray(expected, jnp.float32))
  assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
  assert not np.isnan(a).any(), f"{what}: NaN in result"
  np.testing.assert_array_equal(np.isinf(a), np.isinf(e), err_msg=f"{what}: inf positions differ")
  np.testing.assert_array_equal(np.sign(a[np.isinf(a)]), np.sign(e[np.isinf(e)]),
                                err_msg=f"{what}: inf signs differ")
  fin = np.isfinite(e)
  np.testing.assert_allclose(a[fin], e[fin], atol=atol, rtol=rtol, err_msg=what)


# The TPU kernel's interpreter: simulated HBM / VMEM / SMEM, DMAs and semaphores, race
# detection, and NaN in every uninitialized buffer (so a read of unwritten memory shows).
TPU_INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


@contextlib.contextmanager
def tpu_interpret():
  """Runs ``impl="pallas"`` calls as the TPU (Mosaic) kernel under `TPU_INTERPRET`, and
  fails if the interpreter saw a data race."""
  try:
    with pltpu.force_tpu_interpret_mode(TPU_INTERPRET):
      yield
  except BaseException:
    pltpu.reset_tpu_interpret_mode_state()
    raise
  races = interpret_pallas_call.races
  assert races is None or not races.races_found, "TPU interpreter detected a data race"


@pytest.fixture(params=["xla", "pallas", "mosaic"])
def impl(request):
  """The impl a test runs: the XLA path, the Triton kernel (Pallas interpreter) or the
  Mosaic TPU kernel (TPU interpreter, ``impl="pallas"`` under `tpu_interpret`)."""
  if request.param != "mosaic":
    yield request.param
    return
  with tpu_interpret():
    yield "pallas"


def impl_param(request) -> str:
  """Which kernel the ``impl`` fixture runs in this test: "xla", "pallas" (Triton,
  interpreted) or "mosaic" (TPU interpreter)."""
  return request.node.callspec.params["impl"]


def interpreted_once(request, reason: str, **only) -> None:
  """Skips an interpreted-kernel run ("pallas" / "mosaic") of a case whose code path the
  kernel already runs in the case named by ``only`` (parameter -> value); the XLA path
  runs every case. Keeps the suite's interpreter time to the distinct kernel paths."""
  params = request.node.callspec.params
  if params["impl"] != "xla" and any(params[name] != value for name, value in only.items()):
    pytest.skip(f"interpreted kernels run this path once ({reason})")
