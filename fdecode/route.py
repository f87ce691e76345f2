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

The rules, by the call, each the one place it is decided:

* **a decode** (`run_decode`: `fdecode.dispatch.decode`, and every part a ragged step hands
  to it) runs on the first backend of its route (`decode_route`) that is available and
  does not refuse it (`fdecode.kernels.backend.Backend.refuses`; `choose`), each refusal
  before it noted for `fdecode.plan`. The routes are data: `ROUTES` per platform for
  ``impl=None`` (CPU: XLA; GPU: the Hopper MLA kernel, Triton, XLA; TPU: Mosaic, XLA),
  `NAMED` for ``impl="reference"`` / ``"xla"`` / ``"mosaic_gpu"`` (a route of one, whose
  refusal is the call's ValueError: no fallback). A TPU ``InterpretParams`` runs the
  Mosaic kernel interpreted (XLA where it refuses), ``impl="pallas"`` the Pallas kernels:
  the Triton interpreter on CPU or with a true ``interpret``, the GPU's kernels without the
  XLA fallback when traced on a GPU host, the TPU's route on TPU.
* **a ragged step's Triton kernels** (`lower_step`): where a decode would run the Triton
  kernel (compiled or interpreted) and the step's kernels take the call; else the step
  runs as two decodes (`fdecode.ragged.parts`), whose prefill blocks are one batched call
  or a loop as the part's backend reads them (`lower_prefill`, `lower_blocks_call`).
* **a ragged step's cache write** (`lower_write`): the Triton write kernel where the
  step's attention runs on a GPU (any impl but ``"xla"`` / ``"reference"``) or in the
  Triton interpreter; XLA's scatter elsewhere.

Adding a backend: its package's ``BACKEND`` (`fdecode.kernels.backend.Backend`), a `Path`
and `BACKENDS` entry, and its place in `ROUTES` (docs/design.md lists the files).
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

from fdecode.kernels import backend as backend_lib
from fdecode.kernels import mosaic_gpu, mosaic_tpu, xla
from fdecode.kernels import triton as triton_kernels
from fdecode.kernels.backend import Decode, Refused, States, Target
from fdecode.kernels.common import chips, reference

__all__ = ["BACKENDS", "NAMED", "PLATFORMS", "Path", "ROUTES", "branch_platform", "choose", "part_path",
           "decode_route", "lower", "lower_blocks_call", "lower_prefill", "lower_step", "lower_write", "resolve_interpret",
           "run_decode", "step_path", "target", "write_path"]

PLATFORMS = ("cpu", "gpu", "tpu")
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


class Path(enum.Enum):
  """Where a call runs: a backend, compiled or interpreted (`BACKENDS`)."""
  REFERENCE = "reference"                        # the float32 reference
  XLA = "xla"                                    # the plain-XLA path
  TRITON = "triton"                              # the Triton kernels, compiled for the GPU lowered for
  TRITON_INTERPRET = "triton-interpret"          # the Triton kernels in Pallas' interpreter, any host
  MOSAIC_TPU = "mosaic-tpu"                      # the Mosaic kernels, compiled for the TPU lowered for
  MOSAIC_TPU_INTERPRET = "mosaic-tpu-interpret"  # the Mosaic kernels under the TPU interpreter, any host
  MOSAIC_GPU_MLA = "mosaic-gpu-mla"              # the default GPU route's Hopper MLA kernel (sm_90)
  MOSAIC_GPU = "mosaic-gpu"                      # impl="mosaic_gpu": the Hopper kernels, compiled or interpreted


# Each path's backend (`fdecode.kernels.backend.Backend`).
BACKENDS = {
    Path.REFERENCE: reference.BACKEND, Path.XLA: xla.BACKEND,
    Path.TRITON: triton_kernels.BACKEND, Path.TRITON_INTERPRET: triton_kernels.BACKEND,
    Path.MOSAIC_TPU: mosaic_tpu.BACKEND, Path.MOSAIC_TPU_INTERPRET: mosaic_tpu.BACKEND,
    Path.MOSAIC_GPU_MLA: mosaic_gpu.MLA_BACKEND, Path.MOSAIC_GPU: mosaic_gpu.BACKEND,
}

# The default route (``impl=None``) per platform lowered for: the first path whose backend
# is available and takes the call runs it.
ROUTES = {
    "cpu": (Path.XLA,),
    "gpu": (Path.MOSAIC_GPU_MLA, Path.TRITON, Path.XLA),
    "tpu": (Path.MOSAIC_TPU, Path.XLA),
}
# ``impl="<name>"``: a route of one, whose refusal is the call's ValueError (no fallback).
NAMED = {"reference": (Path.REFERENCE,), "xla": (Path.XLA,), "mosaic_gpu": (Path.MOSAIC_GPU,)}


def resolve_interpret(impl, interpret):
  """``interpret`` as a call takes it: with ``impl="pallas"`` and ``interpret=None``, the
  parameters of an enclosing ``pltpu.force_tpu_interpret_mode(...)`` (the TPU kernel
  interpreted, as that context promises); numpy bools as bools."""
  if impl == "pallas" and interpret is None:
    # No public getter of force_tpu_interpret_mode's parameters (jax 0.10.2 and 0.11): waits for one.
    from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
    flag = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
    interpret = None if flag is None else flag.value
  return bool(interpret) if isinstance(interpret, np.bool_) else interpret


def decode_route(impl, interpret, platform: str) -> tuple[Path, ...]:
  """A decode's route when lowered for ``platform``: the paths tried in order (module doc)."""
  if impl in NAMED:
    return NAMED[impl]
  if isinstance(interpret, pltpu.InterpretParams):
    return (Path.MOSAIC_TPU_INTERPRET, Path.XLA)
  if impl == "pallas":
    if interpret or platform == "cpu":  # CPU's only Pallas: the Triton interpreter
      return (Path.TRITON_INTERPRET,)
    if platform == "gpu":
      # Traced on a GPU host, impl="pallas" never falls back: the Triton kernel's refusal is the error.
      off_host = jax.default_backend() != "gpu" and triton_kernels.pallas_triton_available()
      return (Path.MOSAIC_GPU_MLA, Path.TRITON) + ((Path.XLA,) if off_host else ())
  return ROUTES[platform]


def target(path: Path, platform: str | None, interpret) -> Target:
  """Where ``path`` runs when lowered for ``platform`` (``interpret``: the call's)."""
  if path is Path.TRITON_INTERPRET:
    return Target(platform, True)
  if path in (Path.MOSAIC_TPU_INTERPRET, Path.MOSAIC_GPU):
    return Target(platform, interpret or False)
  return Target(platform, False)


def choose(call: Decode, platform: str) -> Path:
  """The path that runs ``call`` when lowered for ``platform``: the first of its route whose
  backend takes it (each refusal before it noted for `fdecode.plan`). A route's last path
  is taken whatever it says: its refusal is raised when its branch is traced, for the
  platform then lowered for."""
  o = call.options
  route = decode_route(o.impl, o.interpret, platform)
  for path in route[:-1]:
    backend = BACKENDS[path]
    reason = backend.refuses(call, target(path, platform, o.interpret))
    if reason is None:
      return path
    backend_lib.note(Refused(backend.name, reason), platform=platform)
    if not backend.available():
      _warn_unavailable(backend, reason, platform, BACKENDS[route[-1]])
  return route[-1]


def run_decode(call: Decode, finish: Callable[[States, object], T]) -> T:
  """``finish(states, operands)`` of the backend `choose` picks for each platform lowered for (`lower`),
  its plan noted for `fdecode.plan`. A route's last backend that refuses raises the
  ValueError naming the call's impl and the reason."""
  o = call.options

  def branch(path):
    def run(platform, operands):
      c = Decode(o, operands)
      backend, where = BACKENDS[path], target(path, platform, o.interpret)
      reason = backend.refuses(c, where)
      if reason is not None:
        raise ValueError(f"flash_decode: impl={o.impl!r}" + (f" on {platform}" if platform else "") + f": {reason}")
      plan = backend.plan(c, where)
      if plan is not None:
        backend_lib.note(plan)
      return finish(backend.run(plan, c, where), operands)
    return run

  return lower(lambda platform: choose(call, platform), {path: branch(path) for path in Path}, call.operands)


_WARNED = []


def _warn_unavailable(backend, reason, platform, last) -> None:
  """Once per process: a default route skipped a backend this JAX lacks."""
  if not _WARNED:
    _WARNED.append(True)
    warnings.warn(f"fdecode: the {backend.name} backend is not available ({reason}): {platform.upper()} calls "
                  f"take the {last.name.upper()} path", RuntimeWarning, stacklevel=4)


def write_path(impl, interpret, platform: str) -> Path:
  """A ragged step's cache write when lowered for ``platform``: ``Path.TRITON`` /
  ``Path.TRITON_INTERPRET`` (the write kernel) or ``Path.XLA`` (a scatter per cache)."""
  if impl in ("xla", "reference") or isinstance(interpret, pltpu.InterpretParams):
    return Path.XLA
  if not triton_kernels.pallas_triton_available():  # as a decode: the XLA scatter, or impl="pallas" refused
    if impl == "pallas":
      raise ValueError(f"flash_decode: impl='pallas' writes with the Triton kernel, and "
                       f"{triton_kernels.PALLAS_TRITON_MISSING}; use impl=None or 'xla'")
    return Path.XLA
  if impl == "pallas" and interpret:
    return Path.TRITON_INTERPRET
  if platform == "gpu":
    return Path.TRITON
  return Path.TRITON_INTERPRET if platform == "cpu" and impl == "pallas" else Path.XLA


def part_path(call: Decode, platform: str) -> Path:
  """The path a ragged step's part (``call``: the step's decode part, for its options and
  cache) takes when lowered for ``platform``, as far as the step's structure needs to know:
  `choose`'s, but never the Hopper MLA kernel (a part's shapes vary: it is asked of each
  call when it runs)."""
  o = call.options
  route = decode_route(o.impl, o.interpret, platform)
  for path in route[:-1]:
    if path is not Path.MOSAIC_GPU_MLA and BACKENDS[path].refuses(call, target(path, platform, o.interpret)) is None:
      return path
  return route[-1]


def step_path(call: Decode, platform: str, *, step_takes: bool) -> Path | None:
  """The Triton path a ragged step's own kernels run on when lowered for ``platform``, or
  None where the step runs as two decodes (`fdecode.ragged.parts`). ``call``: the step's
  decode part; ``step_takes``: its kernels take the call (no index lists, no fixed split
  count, not the batch-invariant mode). Compiled for a GPU they also leave a decode part
  the Hopper MLA kernel takes to it (the step then runs as two decodes)."""
  if not step_takes:
    return None
  path = part_path(call, platform)
  if path is Path.TRITON_INTERPRET:
    return path
  if path is Path.TRITON and BACKENDS[Path.MOSAIC_GPU_MLA].refuses(call, Target(platform)) is not None:
    return path
  return None


def lower_step(call: Decode, *, step_takes: bool, step_args, two_parts, operand):
  """A ragged step's attention: the step whole on the kernels `step_path` picks (their
  backend's ``ragged_step`` of ``step_args(operand)``: the decode and prefill parts'
  `Decode` s, the step's ``(cu, kv_lens, num_seqs)``, the prefill block's rows and the
  capacity), else ``two_parts(operand)``."""
  def whole(path):
    def run(platform, x):
      decode, prefill, step, block, capacity = step_args(x)
      return BACKENDS[path].ragged_step(decode, prefill, step, block=block, capacity=capacity,
                                        interpret=path is Path.TRITON_INTERPRET)
    return run
  return lower(lambda platform: step_path(call, platform, step_takes=step_takes),
               {None: lambda platform, x: two_parts(x), Path.TRITON: whole(Path.TRITON),
                Path.TRITON_INTERPRET: whole(Path.TRITON_INTERPRET)}, operand)


def lower_write(impl, interpret, *, scatter, operands):
  """A ragged step's cache write: the write kernel of the backend `write_path` picks (its
  ``write(*operands, interpret)``), else ``scatter(*operands)``."""
  return lower(lambda platform: write_path(impl, interpret, platform), {
      Path.XLA: lambda platform, *xs: scatter(*xs),
      Path.TRITON: lambda platform, *xs: BACKENDS[Path.TRITON].write(*xs, False),
      Path.TRITON_INTERPRET: lambda platform, *xs: BACKENDS[Path.TRITON_INTERPRET].write(*xs, True)}, *operands)


def lower_prefill(call: Decode, *, sparse: bool, looped, batched, operand):
  """A ragged step's prefill blocks on the two-part path: ``batched(operand)`` (every block
  in one call) where the part's backend reads each block's rows in place, else
  ``looped(operand)`` (a call per real block). ``call``: the step's decode part.

  * Contiguous caches: batched where the Triton kernels read each block's cache row through
    the `RowSource` (no index lists, ``sparse``); the others read the call's own gathered
    caches, so they loop.
  * Paged: the XLA path reads every block's whole table; it loops where it runs as chosen
    (``impl="xla"``) or on CPU, and the reference too. A GPU's or TPU's XLA fallback and
    the Pallas kernels batch."""
  impl, paged = call.options.impl, call.operands.view.paged

  def batches(platform):
    path = part_path(call, platform)
    if not paged:
      return not sparse and path in (Path.TRITON, Path.TRITON_INTERPRET)
    return not (path is Path.REFERENCE or (path is Path.XLA and (platform == "cpu" or impl == "xla")))
  return lower(batches, {True: lambda platform, x: batched(x), False: lambda platform, x: looped(x)}, operand)


def lower_blocks_call(call: Decode, *, run, skip_when_empty, operand):
  """A ragged step's batched prefill call: ``run(operand)``, or ``skip_when_empty(operand)``
  (the call under a ``lax.cond`` on there being a block). ``call``: the step's decode
  part. On GPU the kernels that skip empty blocks (Triton's, the Hopper ones) run without
  the cond: XLA:GPU's conditional copies its predicate to the host and waits for the
  stream, once per call. The GPU's XLA fallback reads every block, so it keeps the cond,
  as TPU (control flow on the chip) and CPU do."""
  skips = lambda platform: platform == "gpu" and part_path(call, platform) in (Path.TRITON, Path.MOSAIC_GPU)
  return lower(skips, {True: lambda platform, x: run(x), False: lambda platform, x: skip_when_empty(x)}, operand)


_EVERY_BRANCH = contextvars.ContextVar("fdecode_every_branch", default=False)
branch_platform = backend_lib.branch_platform


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
    with backend_lib.tracing_branch(platform):
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
