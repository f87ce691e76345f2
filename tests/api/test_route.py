"""`fdecode.route.lower`: a call traces the branch of each platform it is lowered for, and
no other: a CPU call no GPU or TPU kernel, an export for TPU or CUDA that platform's kernel
(and the host's, whose trace gives the call's result types)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.lowering import TPU_CALL, TRITON_CALL, lower_for_cuda, lower_for_tpu

import fdecode
from fdecode import route


@pytest.fixture
def traced(monkeypatch):
  """The backends run (in order), by name."""
  seen = []
  for backend in (route.BACKENDS[route.Path.XLA], route.BACKENDS[route.Path.TRITON],
                  route.BACKENDS[route.Path.MOSAIC_TPU]):
    cls = type(backend)
    monkeypatch.setattr(cls, "run", lambda self, *a, _real=cls.run, **kw: seen.append(self.name) or _real(self, *a, **kw))
  return seen


def _problem(paged: bool, s: int):
  """An odd shape (its own trace: no other test's jit cache entry)."""
  rng = np.random.default_rng(s)
  q = jnp.asarray(rng.standard_normal((2, 8, 64), np.float32))
  if paged:
    k = jnp.asarray(rng.standard_normal((2, 2 * s // 16, 16, 64), np.float32))
    tables = jnp.arange(2 * s // 16, dtype=jnp.int32).reshape(2, -1)
    return q, k, dict(block_tables=tables), jnp.array([s - 3, s], jnp.int32)
  k = jnp.asarray(rng.standard_normal((2, 2, s, 64), np.float32))
  return q, k, {}, jnp.array([s - 3, s], jnp.int32)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_each_platform_traces_its_own_branch(traced, paged):
  q, k, kw, lengths = _problem(paged, 208 + 16 * paged)
  f = lambda q: fdecode.flash_decode(q, k, k, lengths, **kw)
  out = f(q)
  assert traced == ["xla"]  # the CPU's: no Triton or Mosaic kernel traced
  np.testing.assert_allclose(out, fdecode.flash_decode(q, k, k, lengths, impl="reference", **kw), atol=2e-5, rtol=2e-5)
  del traced[:]
  assert TPU_CALL in lower_for_tpu(f, q)
  assert traced[-1] == "mosaic_tpu" and set(traced) <= {"xla", "mosaic_tpu"}, traced  # (the host's: the types)
  del traced[:]
  assert TRITON_CALL in lower_for_cuda(f, q)
  assert traced[-1] == "triton" and set(traced) <= {"xla", "triton"}, traced


def test_plan_traces_every_platform(traced):
  q, k, kw, lengths = _problem(False, 176)
  (tpu,) = fdecode.plan(q, k, k, lengths, platform="tpu", **kw)
  assert sorted(traced) == ["mosaic_tpu", "triton", "xla"] and tpu.backend == "mosaic"


def test_vmap_and_disable_jit_run_the_hosts_branch():
  q, k, kw, lengths = _problem(False, 144)
  qs, ks = jnp.stack([q, 2 * q, -q]), jnp.stack([k, k[::-1], 0.5 * k])
  out = jax.vmap(lambda q, k: fdecode.flash_decode(q, k, k, lengths))(qs, ks)
  want = jnp.stack([fdecode.flash_decode(a, b, b, lengths, impl="reference") for a, b in zip(qs, ks)])
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
  with jax.disable_jit():
    np.testing.assert_allclose(fdecode.flash_decode(q, k, k, lengths), want[0], atol=2e-5, rtol=2e-5)


def test_a_branch_reads_traced_values_only_through_its_operands():
  branches = {"a": lambda platform, x: x + 1, "b": lambda platform, x: x + 2}
  choice = lambda platform: "a" if platform == "cpu" else "b"
  np.testing.assert_array_equal(jax.jit(lambda x: route.lower(choice, branches, x))(jnp.ones(3)), 2.0)

  def closes_over(x):
    y = x * 3  # traced, and not an operand
    return route.lower(choice, {"a": lambda platform: y + 1, "b": lambda platform: y + 2})

  with pytest.raises(AssertionError, match="closes over a traced value"):
    jax.jit(closes_over)(jnp.ones(3))


def test_branches_with_effects_run_under_one_switch():
  """A host branch with an effect (a callback: the interpreters') takes the every-branch
  switch; operand leaves that are not arrays (a step's options) stay as given."""
  seen = []

  def branch(platform, x, opts):
    jax.debug.callback(lambda: seen.append(opts["impl"]))
    return x + (1 if platform == "cpu" else 2)

  choice = lambda platform: "cpu" if platform == "cpu" else "other"
  out = jax.jit(lambda x: route.lower(choice, {"cpu": branch, "other": branch}, x, {"impl": "pallas"}))(jnp.ones(2))
  jax.effects_barrier()
  np.testing.assert_array_equal(out, 2.0)
  assert seen == ["pallas"]
