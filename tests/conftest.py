"""pytest hooks and fixtures for the whole suite (the environment JAX starts in, the
``impl`` fixture, per-module cleanup). Shared helper functions live in tests/helpers."""

import os

# Eight simulated CPU devices for the multi-device tests; set before JAX initializes.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# fdecode's Engine and demo turn on JAX's persistent compilation cache in ~/.cache: not from
# the tests (scripts/test gives JAX a per-run folder, which is used as it is).
os.environ.setdefault("FDECODE_COMPILATION_CACHE", "0")

import gc

# tests/compile_tier runs in its own environment with the chip compilers (scripts/compile_tier).
collect_ignore = [] if os.environ.get("FDECODE_COMPILE_TIER") else ["compile_tier"]

import jax
import pytest

# Plain asserts in the helpers report their operands as they do in a test module.
pytest.register_assert_rewrite("helpers")

from helpers import host_arguments_for_interpreter_callbacks, tpu_interpret  # noqa: E402


def pytest_configure(config):
  """The Pallas interpreters' memory callbacks take their arguments as host copies
  (`helpers.host_arguments_for_interpreter_callbacks`)."""
  del config
  host_arguments_for_interpreter_callbacks()


def pytest_collection_finish(session):
  """Python's cyclic garbage collector, set for a process that traces and lowers programs
  by the thousand: what collection imported (JAX, fdecode, the test modules) moves to the
  permanent generation, which full collections skip, and the youngest generation collects
  after 20,000 allocations, not 700. Measured on 8 test modules over 2 workers: the
  collector's time per worker 7.4 -> 1.0 s, the run 164 -> 156 s. Module teardown still
  collects in full (`_release_compiled_code`)."""
  del session
  gc.collect()
  gc.freeze()
  gc.set_threshold(20000, 50, 100)


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


@pytest.fixture(params=["xla", "pallas", "mosaic"])
def impl(request):
  """The impl a test runs: the XLA path, the Triton kernel (Pallas interpreter) or the
  Mosaic TPU kernel (TPU interpreter, ``impl="pallas"`` under `tpu_interpret`)."""
  if request.param != "mosaic":
    yield request.param
    return
  with tpu_interpret():
    yield "pallas"


