"""Shared test helpers: random decode problems, dtype-keyed tolerances, comparisons, the TPU
interpreter, compile counting. Topic helpers live in the submodules (`helpers.fuzz`,
`helpers.ragged`, `helpers.lowering`, `helpers.paged`, `helpers.serving`, `helpers.gguf`...).
tests/ is on ``sys.path`` (pyproject's ``pythonpath``), so any test imports ``helpers``."""

import contextlib
import itertools
import logging

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


def tol(dtype):
  return TOLERANCES[jnp.dtype(dtype).type]


def make_problem(seed, *, b=2, t=1, hq=4, hkv=2, s=64, dk=64, dv=None, dtype=jnp.float32):
  """q [B, T, Hq, Dk] (or [B, Hq, Dk] if t is None), k [B, Hkv, S, Dk], v [B, Hkv, S, Dv]:
  standard normal draws (numpy's generator seeded with ``seed``), rounded to ``dtype``."""
  dv = dk if dv is None else dv
  q_shape = (b, hq, dk) if t is None else (b, t, hq, dk)
  rng = np.random.default_rng(seed)
  return tuple(randn(rng, shape, dtype) for shape in (q_shape, (b, hkv, s, dk), (b, hkv, s, dv)))


def randn(seed, shape, dtype=jnp.float32):
  """Standard normal draws of ``shape`` as a ``dtype`` array; ``seed`` is an int or a numpy
  Generator. Drawn on the host: a ``jax.random`` draw compiles (and lowers threefry for)
  one XLA program per shape, about 0.3 s each (some 480 programs a run of the suite)."""
  rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype)))


def host_f32(x) -> np.ndarray:
  """``x`` as a float32 numpy array, converted on the host (exact from bf16 / fp8 / f16):
  an eager ``jnp`` cast would compile one XLA program per shape and dtype."""
  return np.asarray(x).astype(np.float32)


def assert_close(actual, expected, *, atol, rtol, what="output"):
  """FlashMLA-style: inf/NaN positions must agree first, then the finite values."""
  a = host_f32(actual)
  e = host_f32(expected)
  assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
  assert not np.isnan(a).any(), f"{what}: NaN in result"
  np.testing.assert_array_equal(np.isinf(a), np.isinf(e), err_msg=f"{what}: inf positions differ")
  np.testing.assert_array_equal(np.sign(a[np.isinf(a)]), np.sign(e[np.isinf(e)]),
                                err_msg=f"{what}: inf signs differ")
  fin = np.isfinite(e)
  np.testing.assert_allclose(a[fin], e[fin], atol=atol, rtol=rtol, err_msg=what)


F32_EPS = float(np.finfo(np.float32).eps)


def max_abs(*arrays) -> float:
  """The largest finite magnitude in the arrays (a `assert_reordered` scale)."""
  vals = [np.abs(host_f32(x).astype(np.float64)) for x in arrays]
  return max(float(np.max(np.where(np.isfinite(x), x, 0.0), initial=0.0)) for x in vals)


def assert_reordered(actual, expected, *, terms, scale, what="output"):
  """``actual`` and ``expected`` are the same float math compiled into *different*
  programs (fused or not, another layout, sharding or op): XLA may order, fuse and
  vectorize their float32 sums differently, and how depends on the CPU (a fused ragged
  step differed from its two-step twin by up to 4.8e-7 on one AMD EPYC and not at all on
  another), so they are never compared bit for bit. Instead each element may differ by
  the rounding of reordering float32 sums of up to ``terms`` terms of magnitude up to
  ``scale`` (``terms * eps32 * scale``: for attention, terms = keys + Dk, scale = max|v|;
  both derived by the caller from the inputs), plus one rounding step of the result's
  dtype at ``scale`` and at the value itself (a bfloat16 result, or a bfloat16 softmax
  weight, may round either way). NaN and inf positions (and signs) must agree exactly."""
  dtype = jnp.result_type(actual)
  a = host_f32(actual).astype(np.float64)
  e = host_f32(expected).astype(np.float64)
  assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
  np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg=f"{what}: NaN positions differ")
  np.testing.assert_array_equal(np.where(np.isinf(a), np.sign(a), 0), np.where(np.isinf(e), np.sign(e), 0),
                                err_msg=f"{what}: inf positions differ")
  eps = float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.floating) else 0.0
  fin = np.isfinite(e)
  np.testing.assert_allclose(a[fin], e[fin], atol=(terms * F32_EPS + eps) * scale, rtol=eps,
                             err_msg=f"{what}: more than reordered float32 sums of {terms} terms of "
                                     f"magnitude {scale:.3g} explain")


def assert_attention_reordered(actual, expected, *, keys, dk, values, what="out"):
  """`assert_reordered` for an attention result ``out`` or ``(out, lse)`` from two
  different programs: a row's sums run over up to ``keys`` weighted values and ``dk``
  score products (``keys + dk`` terms); ``values`` is the largest |value| (dequantized)
  a row may see, the scale of out; lse's scale is its own magnitude (at least 1)."""
  pairs = zip(actual, expected) if isinstance(actual, (tuple, list)) else [(actual, expected)]
  for i, (a, e) in enumerate(pairs):
    lse = i == 1
    assert_reordered(a, e, terms=int(keys) + int(dk), scale=max(1.0, max_abs(e)) if lse else values,
                     what="lse" if lse else what)


# The TPU kernel's interpreter: simulated HBM / VMEM / SMEM, DMAs and semaphores, race
# detection, and NaN in every uninitialized buffer (so a read of unwritten memory shows).
TPU_INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def host_arguments_for_interpreter_callbacks() -> bool:
  """Hands the Pallas interpreters' memory callbacks their arguments as host copies.

  The TPU and Mosaic GPU interpreters run every load, store, DMA and semaphore op of a
  kernel as an ``io_callback`` into Python, whose arguments arrive from XLA:CPU as numpy
  arrays; JAX's ``io_callback_impl`` first ``device_put``s each one to a ``jax.Array``, and
  the interpreter reads it straight back as numpy. That round trip was a fifth of a Mosaic
  test's time (py-spy, test_layout's Mosaic cases: 91 -> 78 s without it). Here the
  interpreters' own callbacks (and only theirs) get a numpy copy instead: the values they
  see are the same, and any other callback keeps JAX's path. Returns whether it could
  install (False: a JAX without ``io_callback_impl``, which then runs as it is)."""
  from jax._src import callback as jax_callback

  original = getattr(jax_callback, "io_callback_impl", None)
  if original is None or getattr(original, "_fdecode_host_arguments", False):
    return original is not None

  def io_callback_impl(*args, callback, **params):
    fn = getattr(callback, "callback_func", None)
    fn = getattr(fn, "func", fn)  # the interpreters pass functools.partial(op, ...)
    if not getattr(fn, "__module__", "").startswith(_INTERPRETERS):
      return original(*args, callback=callback, **params)
    return jax.tree.map(np.asarray, callback(*(np.array(a) for a in args)))

  io_callback_impl._fdecode_host_arguments = True
  jax_callback.io_callback_impl = io_callback_impl
  return True


_INTERPRETERS = ("jax._src.pallas.mosaic.interpret.", "jax._src.pallas.mosaic_gpu.interpret.")


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


def covering_pairs(**factors) -> list[tuple]:
  """A pairwise covering set of ``factors`` (name -> its values; a name ``"a,b"`` takes
  tuples of two parameters): cases, each a tuple of one value per factor in ``factors``'
  order, in which every pair of values of any two factors occurs (so every value of
  every factor does). Chosen greedily from the full product in its order: deterministic."""
  names = list(factors)
  values = [list(v) for v in factors.values()]
  product = list(itertools.product(*values))
  pairs = lambda case: {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(names)), 2)}
  uncovered = set().union(*map(pairs, product)) if len(names) > 1 else set()
  cases = [] if uncovered else [product[0]] if len(names) > 1 else product
  while uncovered:
    best = max(product, key=lambda case: len(pairs(case) & uncovered))
    cases.append(best)
    uncovered -= pairs(best)
  return cases


def _case(request, names):
  params = request.node.callspec.params
  return tuple(tuple(params[n] for n in name.split(",")) if "," in name else params[name] for name in names)


def pairwise_only(request, reason: str, **factors) -> None:
  """Skips a case outside `covering_pairs` of ``factors`` (parameter names as in the test's
  parametrize): for a test whose every case runs an interpreter, where each pair of
  factor values exercises the code paths (``reason`` says why) and the full product
  repeats them."""
  if _case(request, factors) not in covering_pairs(**factors):
    pytest.skip(f"a pairwise cover of {', '.join(factors)} ({reason})")


def interpreted_pairwise(request, reason: str, **factors) -> None:
  """`pairwise_only` for the interpreted kernels ("pallas" / "mosaic"); the XLA path runs
  every case."""
  if request.node.callspec.params["impl"] != "xla":
    pairwise_only(request, reason, **factors)


_PXLA = logging.getLogger("jax._src.interpreters.pxla")


class _Compiles(logging.Handler):
  """Counts JAX compilations by function name while installed."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.names = []

  def emit(self, record):
    if record.msg.startswith("Compiling %s"):
      self.names.append(str(record.args[0]))

  def count(self, fn: str) -> int:
    return sum(name == f"jit({fn})" for name in self.names)


@contextlib.contextmanager
def counting_compiles():
  handler, level = _Compiles(), _PXLA.level
  _PXLA.addHandler(handler)
  _PXLA.setLevel(logging.DEBUG)
  try:
    yield handler
  finally:
    _PXLA.removeHandler(handler)
    _PXLA.setLevel(level)
