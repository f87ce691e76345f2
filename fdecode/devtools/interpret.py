"""One compilation per interpreted Mosaic GPU kernel thread (`compiled_once`): for the tests
(tests/helpers/mosaic_gpu.py) and the GPU smoke's ``--interpret`` (`fdecode.devtools.gpu_smoke`).

jax's Mosaic GPU interpreter (jax 0.10.2) runs each program of a grid by tracing, lowering
and compiling the kernel body for each of its warpgroup threads
(``jax._src.pallas.mosaic.interpret.thread_map._run_jaxpr``): a new ``jax.jit`` each time,
so no cache hits, about 1.2 s of XLA:CPU compilation per thread per program, nearly all of
an interpreted program's cost. Its own comment expects JAX's caches to compile the jaxpr
once. `compiled_once` does that: the executable of one thread jaxpr (the same object for
every program of a call), for arguments of the same shapes and dtypes, is compiled once and
run for each program and thread, with that program's arguments (thread id, grid point,
buffers), exactly as a cached ``jax.jit`` would. What runs is unchanged; only the repeated
compilation goes. Where jax moves that function, or changes its arguments, the interpreter
runs as it is (slower, the same results).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import numpy as np


def _eval(jaxpr, consts, *args):
  jax.core.eval_jaxpr(jaxpr, consts, *args)


@contextlib.contextmanager
def compiled_once():
  """Within: each interpreted thread jaxpr compiles once per argument signature."""
  # No public replacement: this patches the interpreter's own per-thread compilation; waits
  # for JAX's interpreter to compile each thread jaxpr once itself.
  try:
    from jax._src.pallas.mosaic.interpret import thread_map  # pylint: disable=g-import-not-at-top
  except ImportError:
    yield
    return
  original = getattr(thread_map, "_run_jaxpr", None)
  if original is None or original.__code__.co_varnames[:2] != ("jaxpr", "consts"):
    yield
    return
  executables = {}  # (jaxpr, signature) -> compiled; holds the jaxpr, so no id is reused
  lock = threading.Lock()

  def run(jaxpr, consts, *args):
    signature = tuple((np.shape(x), str(x.dtype)) for x in jax.tree.leaves((consts, args)))
    key = (jaxpr, jax.tree.structure((consts, args)), signature)
    with lock:  # the other threads of the first program wait for this one compilation
      if key not in executables:
        executables[key] = jax.jit(_eval, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
      executable = executables[key]
    executable(consts, *args)

  thread_map._run_jaxpr = run
  try:
    yield
  finally:
    thread_map._run_jaxpr = original
