"""The one route from a call to a backend: ``(impl, interpret, platform lowered for, call)``
-> a `Path`, and the one place that branches on the platform being lowered for.

A call's path is decided per platform (`path`), so ``jax.export(..., platforms=["tpu"])``
on a CPU host embeds the TPU kernel (STYLE habit 5: the platform *lowered for*, never
``jax.default_backend()``). `lower` runs a caller's branches: once, when its choice is the
same whatever the platform (``impl="xla"``, an interpreter: nothing else is traced), or
each platform's when a program is lowered for that platform (a primitive whose lowering
rule traces the target's branch), so a call traces no kernel of a platform it is not
lowered for. `fdecode.plan` traces every branch at once, under one
``lax.platform_dependent``; nothing else in fdecode calls it. A TPU branch lowers the
Mosaic kernel for the chip `fdecode.kernels.common.chips.tpu_lowering` names (TPU v5e when
neither the trace nor the host names one).

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
import functools
import warnings
from typing import Callable, Hashable, Mapping, TypeVar

import jax
import jax.extend.core  # pylint: disable=unused-import
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad, batching, mlir
from jax.experimental.pallas import tpu as pltpu

from fdecode.kernels.common import chips
from fdecode.kernels import triton as triton_kernels

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
    _need_triton("impl='mosaic_gpu' merges the Hopper kernels' splits with a Triton kernel")
    return Path.MOSAIC_GPU
  if isinstance(interpret, pltpu.InterpretParams):
    return Path.MOSAIC_TPU_INTERPRET
  if impl == "pallas" and interpret:
    _need_triton("impl='pallas' with interpret=True runs the Triton kernel")
    return Path.TRITON_INTERPRET
  if platform == "cpu":
    if impl == "pallas":
      _need_triton("impl='pallas' on CPU runs the Triton kernel interpreted")
      return Path.TRITON_INTERPRET
    return Path.XLA
  if platform == "gpu":
    if not triton_kernels.pallas_triton_available():  # no Triton kernel (nor the Hopper ones, merged by one): XLA
      if impl == "pallas":
        _need_triton("impl='pallas' on GPU runs the Triton kernel")
      _warn_no_triton()
      return Path.XLA
    # impl="pallas" traced on a GPU host never falls back silently: the Triton plan raises.
    if not (triton_takes or (impl == "pallas" and jax.default_backend() == "gpu")):
      return Path.XLA
    return Path.MOSAIC_GPU if hopper_takes() else Path.TRITON
  return Path.MOSAIC_TPU


_WARNED = []


def _need_triton(what: str) -> None:
  """A ValueError naming the missing Triton backend for a call that asked for it."""
  if not triton_kernels.pallas_triton_available():
    raise ValueError(f"flash_decode: {what}, and {triton_kernels.PALLAS_TRITON_MISSING}; use impl=None or 'xla'")


def _warn_no_triton() -> None:
  """Once per process: GPU calls take the XLA path on a JAX without Pallas' Triton backend."""
  if not _WARNED:
    _WARNED.append(True)
    warnings.warn(f"fdecode: {triton_kernels.PALLAS_TRITON_MISSING}: GPU calls take the XLA path", RuntimeWarning, stacklevel=3)


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
  if not triton_kernels.pallas_triton_available():  # as `decode_path`: the XLA scatter, or impl="pallas" refused
    if impl == "pallas":
      _need_triton("impl='pallas' writes with the Triton kernel")
    return Path.XLA
  if impl == "pallas" and interpret:
    return Path.TRITON_INTERPRET
  if platform == "gpu":
    return Path.TRITON
  return Path.TRITON_INTERPRET if platform == "cpu" and impl == "pallas" else Path.XLA


_BRANCH = contextvars.ContextVar("fdecode_branch", default=None)
_EVERY_BRANCH = contextvars.ContextVar("fdecode_every_branch", default=False)


def branch_platform() -> str | None:
  """The platform whose branch of `lower` is being traced (None: a choice made for every
  platform at once): `fdecode.plan` keeps the plans of the platform it asks about."""
  return _BRANCH.get()


@contextlib.contextmanager
def every_branch():
  """Inside, `lower` traces every platform's branch when the call is made (under one
  ``lax.platform_dependent``) rather than each when lowered for it: `fdecode.plan`
  records the plans of platforms the host never lowers for."""
  token = _EVERY_BRANCH.set(True)
  try:
    yield
  finally:
    _EVERY_BRANCH.reset(token)


@contextlib.contextmanager
def _tracing(platform):
  token = _BRANCH.set(platform)
  try:
    yield
  finally:
    _BRANCH.reset(token)


def lower(choice: Callable[[str], K], branches: Mapping[K, Callable[..., T]], *operands) -> T:
  """``branches[choice(platform)](platform, *operands)`` for the platform lowered for.

  ``choice`` maps each of `PLATFORMS` to a key of ``branches`` (a `Path`, or any value the
  caller's branches are keyed by). When it is the same for all three, that branch is traced
  once, with ``platform`` None (a host-independent choice: it runs as chosen on whatever
  lowers it). Otherwise each platform's branch is traced only when a program is lowered
  for that platform (`_Branches`): the host's (``jax.default_backend()``, which gives
  the call's result types) when the call is traced, another's (a ``jax.export`` for TPU
  or CUDA from a CPU host, a deviceless compile) when lowered for it. So a decode on a GPU
  never traces the TPU kernel, nor a CPU test the GPU's. Inside `every_branch` (and for
  branches with effects) every branch is traced at once under one
  ``lax.platform_dependent`` (ROCm as CUDA), and the target's is lowered.

  ``operands``: pytrees of what the branches read that is traced (arrays and the pytrees
  holding them: `fdecode.cache.layout.CacheView`, `RowSource`, dicts); a branch reads
  traced values only through them (a branch traced at lowering time cannot reach the
  caller's tracers; a host branch that closes over one raises here).
  """
  keys = {p: choice(p) for p in PLATFORMS}
  if len(set(keys.values())) == 1:
    return branches[keys["cpu"]](None, *operands)
  fns = {p: _branch_fn(branches[keys[p]], p) for p in PLATFORMS}
  if _EVERY_BRANCH.get():
    return _every(fns, operands)
  return _Branches.bind(fns, operands)


def _branch_fn(branch, platform):
  def run(*operands):
    with _tracing(platform):
      return branch(platform, *operands)
  return run


def _split(operands):
  """The operand pytrees' leaves, their structure, and the indices of the traced leaves
  (arrays, tracers included); the other leaves are static values kept as given."""
  leaves, treedef = jax.tree_util.tree_flatten(operands)
  return leaves, treedef, [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]


def _every(fns, operands):
  """Every platform's branch, traced now under one ``lax.platform_dependent`` (its operands:
  the traced leaves; the others kept as given)."""
  leaves, treedef, traced = _split(operands)
  branch = {p: (lambda *xs, _fn=fns[p]: _fn(*_Branches.operands(leaves, treedef, traced, xs))) for p in PLATFORMS}
  return lax.platform_dependent(*(leaves[i] for i in traced), cpu=branch["cpu"], cuda=branch["gpu"],
                                rocm=branch["gpu"], tpu=branch["tpu"])


def _host() -> str:
  backend = jax.default_backend()
  return backend if backend in PLATFORMS else "gpu"  # ROCm, CUDA


class _Branches:
  """A call's per-platform branches as one primitive (``fdecode_route``) whose lowering
  rule traces the branch of the platform lowered for: the host's jaxpr, traced when
  the call is (it gives the primitive's result types), and any other platform's when a
  program is lowered for it. Its operands are the traced leaves of the call's operand
  pytrees; the other leaves (static values: strings, numbers, numpy arrays) are kept
  as given."""

  def __init__(self, fns, leaves, treedef, traced, host, jaxpr, out_tree):
    self.fns, self.leaves, self.treedef, self.traced = fns, leaves, treedef, traced
    self.host, self.jaxpr, self.out_tree = host, jaxpr, out_tree

  @classmethod
  def bind(cls, fns, operands):
    leaves, treedef, traced = _split(operands)
    args = [leaves[i] for i in traced]
    host = _host()
    out_tree = []

    def flat(*xs):
      out = fns[host](*cls.operands(leaves, treedef, traced, xs))
      flat_out, tree = jax.tree_util.tree_flatten(out)
      out_tree.append(tree)
      return flat_out

    jaxpr = jax.make_jaxpr(flat)(*args)
    if any(isinstance(c, jax.core.Tracer) for c in jaxpr.consts):
      raise AssertionError(f"fdecode.route.lower: the {host} branch {fns[host]} closes over a traced value; "
                           "pass it among the operands")
    if jaxpr.effects:  # lowered under a platform switch, as effects are threaded
      return _every(fns, operands)
    statics = [None if i in traced else x for i, x in enumerate(leaves)]  # no tracer kept past this trace
    branches = cls(fns, statics, treedef, traced, host, jaxpr, out_tree[0])
    out = _route_p.bind(*args, branches=branches)
    return jax.tree_util.tree_unflatten(out_tree[0], out)

  @staticmethod
  def operands(leaves, treedef, traced, xs):
    """The operand pytrees with the traced leaves (at ``traced``) replaced by ``xs``."""
    leaves = list(leaves)
    for i, x in zip(traced, xs):
      leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)

  def flat(self, platform):
    """``platform``'s branch as a function of the primitive's operands to its flat results."""
    if platform == self.host:
      return jax.extend.core.jaxpr_as_fun(self.jaxpr)

    def flat(*xs):
      out = self.fns[platform](*self.operands(self.leaves, self.treedef, self.traced, xs))
      flat_out, tree = jax.tree_util.tree_flatten(out)
      if tree != self.out_tree:
        raise AssertionError(f"fdecode.route.lower: the {platform} branch returns {tree}, the {self.host} "
                             f"branch {self.out_tree}")
      return flat_out
    return flat


def _route_abstract_eval(*avals, branches):
  del avals
  return branches.jaxpr.out_avals


def _route_impl(*args, branches):
  """Outside ``jit`` (``jax.disable_jit``): the host's branch, as traced."""
  return branches.flat(branches.host)(*args)


def _route_batch(args, dims, *, branches):
  """``vmap``: each platform's branch vmapped, still traced only when lowered for."""
  fns = {p: _vmapped(branches.flat(p), dims, loop_in_shard_map=p == "tpu") for p in PLATFORMS}
  out = _Branches.bind(fns, tuple(args))
  return out, [0] * len(out)


def _vmapped(fn, dims, *, loop_in_shard_map):
  """``jax.vmap(fn, in_axes=dims)``; with ``loop_in_shard_map``, a `lax.map` over the batch
  instead when a position operand (int32 or wider: lengths, block tables, index lists,
  offsets; not an 8-bit cache) is batched inside ``shard_map``. Pallas batches a Mosaic
  call whose scalar-prefetched operands (those) are batched with a loop of its own, whose
  carry starts typed invariant over the mesh axes, and ``check_vma`` refuses it ("scan body
  function carry input and carry output must have equal types", jax 0.10). `lax.map`
  carries nothing, and loops just the same."""
  vmapped = jax.vmap(fn, in_axes=dims)
  if not loop_in_shard_map:
    return vmapped

  def run(*args):
    ints = any(d is not None and np.issubdtype(x.dtype, np.integer) and x.dtype.itemsize >= 4
               for x, d in zip(args, dims))
    manual = any(jax.typeof(x).manual_axis_type.varying for x in args)
    if not (ints and manual):
      return vmapped(*args)

    def one(xs):
      xs = iter(xs)
      return fn(*(x if d is None else next(xs) for x, d in zip(args, dims)))
    return lax.map(one, [jnp.moveaxis(x, d, 0) for x, d in zip(args, dims) if d is not None])
  return run


def _route_jvp(primals, tangents, *, branches):
  """``jvp`` (and, through it, every derivative): the host's branch differentiated as
  traced. The kernels inside it keep their own route and derivative
  (`fdecode.derivatives`); what is the host's here is only the choice between a ragged
  step's structures (one batched call or a loop of calls, the fused write's kernel or
  XLA's scatter), which compute the same values."""
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  return jax.jvp(branches.flat(branches.host), list(primals), tangents)


def _route_lowering(ctx, *args, branches, platform):
  lower = mlir.lower_fun(branches.flat(platform), multiple_results=True)
  if platform != "tpu":
    return lower(ctx, *args)
  with chips.tpu_lowering():  # the chip Pallas lowers a Mosaic kernel for, on any host
    return lower(ctx, *args)


_route_p = jax.extend.core.Primitive("fdecode_route")
_route_p.multiple_results = True
_route_p.def_abstract_eval(_route_abstract_eval)
_route_p.def_impl(_route_impl)
if hasattr(batching, "primitive_batchers"):  # a JAX without the registry: vmap raises JAX's own error
  batching.primitive_batchers[_route_p] = _route_batch
ad.primitive_jvps[_route_p] = _route_jvp
for _lowered, _platform in (("cpu", "cpu"), ("cuda", "gpu"), ("rocm", "gpu"), ("tpu", "tpu")):
  mlir.register_lowering(_route_p, functools.partial(_route_lowering, platform=_platform), platform=_lowered)
