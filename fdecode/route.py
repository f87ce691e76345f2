"""The one route from a call to a backend: ``(impl, interpret, platform lowered for, call)``
-> a `Path`, and the one place that branches on the platform being lowered for.

A call's path is decided per platform (`path`), so ``jax.export(..., platforms=["tpu"])``
on a CPU host embeds the TPU kernel (STYLE habit 5: the platform *lowered for*, never
``jax.default_backend()``). `lower` runs a caller's branches: once, when its choice is the
same whatever the platform (``impl="xla"``, an interpreter: nothing else is traced), or
each platform's under one ``lax.platform_dependent``, which traces every branch and lowers
the target's. Nothing else in fdecode calls ``platform_dependent``.

The rules, by the call:

* **a decode** (`fdecode.dispatch.decode`, and every part a ragged step hands to it):
  ``impl="reference"`` / ``"xla"`` / ``"mosaic_gpu"`` run that path everywhere; a TPU
  ``InterpretParams`` runs the Mosaic kernel interpreted, ``impl="pallas"`` with a true
  ``interpret`` the Triton kernel interpreted, anywhere. Otherwise: on CPU the XLA path
  (``impl="pallas"``: the Triton interpreter, CPU's only Pallas); on GPU the Triton kernel
  where it takes the call, the Hopper MLA kernel where that takes it
  (`fdecode.kernels.mosaic_gpu.takes_mla`), else the XLA path (``impl="pallas"`` traced on a
  GPU host keeps the Triton kernel, whose plan then names the shape it cannot tile); on TPU
  the Mosaic kernel (its plan may hand a call to the XLA path itself).
* **a ragged step's Triton kernels** (`fdecode.ragged.decode`): where a decode would run the
  Triton kernel (compiled or interpreted) and the step's kernels take the call; else the
  step runs as two decodes (`fdecode.ragged.parts`).
* **a ragged step's cache write** (`fdecode.ragged.write`): the Triton write kernel where
  the step's attention runs on a GPU (any impl but ``"xla"`` / ``"reference"``) or in the
  Triton interpreter; XLA's scatter elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from typing import Callable, Hashable, Mapping, TypeVar

import jax
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

__all__ = ["PLATFORMS", "Path", "branch_platform", "decode_path", "lower", "resolve_interpret", "step_path",
           "write_path"]

PLATFORMS = ("cpu", "gpu", "tpu")
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


class Path(enum.Enum):
  """Where a call runs."""
  REFERENCE = "reference"                        # the float32 reference
  XLA = "xla"                                    # the plain-XLA path
  TRITON = "triton"                              # the Triton kernels, compiled for the GPU lowered for
  TRITON_INTERPRET = "triton-interpret"          # the Triton kernels in Pallas' interpreter, any host
  MOSAIC_TPU = "mosaic-tpu"                      # the Mosaic kernels, compiled for the TPU lowered for
  MOSAIC_TPU_INTERPRET = "mosaic-tpu-interpret"  # the Mosaic kernels under the TPU interpreter, any host
  MOSAIC_GPU = "mosaic-gpu"                      # the Hopper kernels (sm_90), compiled or interpreted


def resolve_interpret(impl, interpret):
  """``interpret`` as a call takes it: with ``impl="pallas"`` and ``interpret=None``, the
  parameters of an enclosing ``pltpu.force_tpu_interpret_mode(...)`` (the TPU kernel
  interpreted, as that context promises); numpy bools as bools."""
  if impl == "pallas" and interpret is None:
    from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
    flag = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
    interpret = None if flag is None else flag.value
  return bool(interpret) if isinstance(interpret, np.bool_) else interpret


def decode_path(impl, interpret, platform: str, *, triton_takes: bool = True,
                hopper_takes: Callable[[], bool] = lambda: False) -> Path:
  """A decode's path when lowered for ``platform``. ``triton_takes``: the compiled Triton
  kernel tiles the call's head dims; ``hopper_takes()``: the Hopper MLA kernel takes it in
  the default dispatch, asked only on a GPU where the Triton kernel would run (both decided
  by the kernels' packages)."""
  if impl == "reference":
    return Path.REFERENCE
  if impl == "xla":
    return Path.XLA
  if impl == "mosaic_gpu":
    return Path.MOSAIC_GPU
  if isinstance(interpret, pltpu.InterpretParams):
    return Path.MOSAIC_TPU_INTERPRET
  if impl == "pallas" and interpret:
    return Path.TRITON_INTERPRET
  if platform == "cpu":
    return Path.TRITON_INTERPRET if impl == "pallas" else Path.XLA
  if platform == "gpu":
    # impl="pallas" traced on a GPU host never falls back silently: the Triton plan raises.
    if not (triton_takes or (impl == "pallas" and jax.default_backend() == "gpu")):
      return Path.XLA
    return Path.MOSAIC_GPU if hopper_takes() else Path.TRITON
  return Path.MOSAIC_TPU


def step_path(impl, interpret, platform: str, *, step_takes: bool, compiled_takes: Callable[[], bool]) -> Path | None:
  """The Triton path a ragged step's own kernels run on when lowered for ``platform``, or
  None where the step runs as two decodes. ``step_takes``: its kernels take the call (no
  index lists, no fixed split count); ``compiled_takes()``: compiled for a GPU, they take
  it too (head dims Triton tiles, a decode part the Hopper MLA kernel does not take),
  asked only where the step would run compiled."""
  if not step_takes:
    return None
  path = decode_path(impl, interpret, platform)
  if path is Path.TRITON_INTERPRET or (path is Path.TRITON and compiled_takes()):
    return path
  return None


def write_path(impl, interpret, platform: str) -> Path:
  """A ragged step's cache write when lowered for ``platform``: ``Path.TRITON`` /
  ``Path.TRITON_INTERPRET`` (the write kernel) or ``Path.XLA`` (a scatter per cache)."""
  if impl in ("xla", "reference") or isinstance(interpret, pltpu.InterpretParams):
    return Path.XLA
  if impl == "pallas" and interpret:
    return Path.TRITON_INTERPRET
  if platform == "gpu":
    return Path.TRITON
  return Path.TRITON_INTERPRET if platform == "cpu" and impl == "pallas" else Path.XLA


_BRANCH = contextvars.ContextVar("fdecode_branch", default=None)


def branch_platform() -> str | None:
  """The platform whose branch of `lower` is being traced (None: a choice made for every
  platform at once): `fdecode.plan` keeps the plans of the platform it asks about."""
  return _BRANCH.get()


@contextlib.contextmanager
def _tracing(platform):
  token = _BRANCH.set(platform)
  try:
    yield
  finally:
    _BRANCH.reset(token)


def lower(choice: Callable[[str], K], branches: Mapping[K, Callable[[str | None], T]]) -> T:
  """``branches[choice(platform)](platform)`` for the platform lowered for.

  ``choice`` maps each of `PLATFORMS` to a key of ``branches`` (a `Path`, or any value the
  caller's branches are keyed by). When it is the same for all three, that branch is traced
  once, with ``platform`` None (a host-independent choice: it runs as chosen on whatever
  lowers it); otherwise each platform's branch is traced, with its platform, under one
  ``lax.platform_dependent`` (ROCm as CUDA), and only the target's is lowered.
  """
  keys = {p: choice(p) for p in PLATFORMS}
  if len(set(keys.values())) == 1:
    return branches[keys["cpu"]](None)

  def branch(platform):
    def run():
      with _tracing(platform):
        return branches[keys[platform]](platform)
    return run

  gpu = branch("gpu")
  return lax.platform_dependent(cpu=branch("cpu"), cuda=gpu, rocm=gpu, tpu=branch("tpu"))
