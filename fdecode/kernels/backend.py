"""The one interface every kernel family implements (`Backend`), and what it takes and
gives: a decode's options (`Options`, static, hashable), its arrays (`Operands`, one
pytree), both as one `Decode`, the platform it is lowered for (`Target`) and its result
(`States`).

Each kernel package exports its backends (`fdecode.kernels.xla.BACKEND`,
`fdecode.kernels.triton.BACKEND`, `fdecode.kernels.mosaic_tpu.BACKEND`,
`fdecode.kernels.mosaic_gpu.MLA_BACKEND` / ``BACKEND``, `fdecode.kernels.common.reference.BACKEND`);
`fdecode.route` holds the order they are tried in per platform, and `fdecode.dispatch`
runs the one chosen and finishes its states. A backend:

* ``name``: what `fdecode.plan`'s refusals and errors call it;
* ``available()``: this JAX has what it needs;
* ``refuses(call, target)``: why it does not take the call when lowered for
  ``target``, as a sentence, or None;
* ``plan(call, target)``: its frozen plan of the call (recorded for `fdecode.plan`);
* ``run(plan, call, target)``: the `States`.

`note` records a plan while `recording` (`fdecode.plan`); `branch_platform` is the
platform whose branch `fdecode.route.lower` traces.

Legend: B batch, T new tokens, Hq / Hkv query / kv heads, G = Hq / Hkv, R = T * G rows of
one kv head, n splits, Dk / Dv key / value head dims.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from fdecode.cache.quant import is_quantized

__all__ = ["NO_INVARIANT_PLAN", "Backend", "Decode", "Operands", "Options", "Refused", "States", "TakesEveryCall",
           "Target", "branch_platform",
           "compute_dtype", "note", "recording", "tracing_branch"]


class Options(NamedTuple):
  """A decode's static options (hashable), canonical (`fdecode.call.canonical_call`):
  ``impl`` and ``interpret`` as the caller gave them, ``softmax_scale``, ``cfg`` (a
  `fdecode.config.Config`: split count, block size, schedule, the batch-invariant mode),
  ``mods`` (`fdecode.kernels.common.modifiers.Modifiers`), ``v_head_dim`` (MLA: the
  values are k's first ``v_head_dim`` columns; else None) and ``sparse``
  (`fdecode.kernels.common.sparse.Sparse`, or None)."""
  impl: object
  softmax_scale: float
  cfg: object
  interpret: object
  mods: object
  v_head_dim: object
  sparse: object


class RowSource(NamedTuple):
  """Where a call's query rows and block-table rows are read from, for a caller whose
  q / block_tables are gathers of larger arrays (`fdecode.ragged`: a serving step's
  blocks of packed rows, each over its sequence's table row). A backend may read them in
  place through the indices (the Triton kernels do: no gather launch); the others read
  the gathered arrays the call was given, so the gathers run only there (XLA drops them
  where no lowered path reads them).

  ``q``: ``[N, Hq, Dq]`` packed rows; ``q_start``: int32 ``[B]``, the call's q row
  ``(b, t)`` is ``q[clip(q_start[b] + t, 0, N - 1)]``; ``tables``: int32 ``[M, n]`` and
  ``table_rows``: int32 ``[B]``, the call's table row b is ``tables[table_rows[b]]`` (both
  None: the call's own block tables, or none; table rows are clipped into ``[0, M)``).
  ``caches`` and ``cache_rows`` (a contiguous cache's call, of which k, v, k_rope and
  per-sequence scales are gathers): the whole contiguous caches, a
  `fdecode.cache.layout.CacheView` of ``M`` sequence rows (canonical scales, as the call's
  own view), and int32 ``[B]``: the call's sequence b is cache row ``cache_rows[b]``
  (clipped into ``[0, M)``); ``caches`` without ``cache_rows``: sequence b is cache row b
  (B = M: the call's caches are the whole ones, read as a source's for the balanced
  schedule). ``step``: ``(cu, kv_lens, num_seqs)`` of a ragged step (int32 ``[M + 1]``
  clipped non-decreasing, ``[M]``, ``[1]``), whose part (the Triton ``make_plan``'s ``step``) the call
  is: each work unit's sequence, first q row, table / cache row and kv length are derived
  in the kernels from them (`fdecode.kernels.triton.geometry`), and ``q_start``,
  ``table_rows``, ``cache_rows`` and the call's ends are not read. ``mask`` / ``bias``
  (with ``step``): the step's per-row arrays as `fdecode.ragged_decode` takes them,
  ``[N|1, S]`` or ``[N|1, Hq, S]``, read by each program at its rows' packed rows (the
  call's own mask / bias are gathers, read only for their form)."""
  q: object
  q_start: object
  tables: object = None
  table_rows: object = None
  caches: object = None
  cache_rows: object = None
  step: object = None
  mask: object = None
  bias: object = None


class Operands(NamedTuple):
  """A decode's arrays, one pytree: ``q`` ``[B, T, Hq, Dk]``, ``view`` its cache
  (`fdecode.cache.layout.CacheView`: arrays as stored, canonical scales, int32 tables),
  ``ends`` int32 ``[B]``, ``lists`` (index lists: canonical ``indices`` / ``index_bounds``,
  and ``index_runs``, the Triton kernel's; else empty), ``mod_arrays`` (the canonical
  ``mask`` / ``bias`` / ``alibi``, each or None), ``sinks`` (f32 ``[Hq]`` or None) and
  ``source`` (a `RowSource` of which q and the view's tables or
  caches are gathers, read in place by the Triton kernels; or None)."""
  q: object
  view: object
  ends: object
  lists: dict
  mod_arrays: dict
  sinks: object
  source: object = None


class Decode(NamedTuple):
  """One decode as every backend takes it."""
  options: Options
  operands: Operands

  @property
  def compute_dtype(self):
    """The dtype the matmuls read (`compute_dtype` of q and the float caches)."""
    view = self.operands.view
    return compute_dtype(self.operands.q.dtype, *(None if x is None else x.dtype for x in (view.k, view.v, view.k_rope)))

  def q_rows_struct(self) -> jax.ShapeDtypeStruct:
    """The shape and dtype of `q_rows` (what a plan reads of them)."""
    b, t, hq, dk = self.operands.q.shape
    return jax.ShapeDtypeStruct((b, self.operands.view.kv_heads, t * (hq // self.operands.view.kv_heads), dk),
                                self.compute_dtype)

  def q_rows(self):
    """q as the rows of each kv head, ``[B, Hkv, R, Dk]`` (row r = t * G + g), in the
    compute dtype: what the XLA and Mosaic TPU kernels read."""
    q = self.operands.q
    b, t, hq, dk = q.shape
    hkv = self.operands.view.kv_heads
    return q.reshape(b, t, hkv, hq // hkv, dk).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * (hq // hkv), dk).astype(
        self.compute_dtype)


class Target(NamedTuple):
  """Where a backend runs: ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``: the platform
  lowered for; None: whatever lowers the call) and ``interpret`` (False: compiled; else
  the kernel's interpreter: True, or the interpreter's parameters)."""
  platform: str | None
  interpret: object = False


class States(NamedTuple):
  """What every backend returns. ``merged`` False: per-split states, ``o`` f32 ``[B, Hkv,
  n, R, Dv]`` and ``lse`` f32 ``[B, Hkv, n, R]`` (`fdecode.combine.merge_states` merges
  them; sinks not applied). ``merged`` True: the output ``[B, T, Hq, Dv]`` in q's dtype
  and its lse f32 ``[B, T, Hq]``, sinks applied."""
  o: object
  lse: object
  merged: bool


class Backend(Protocol):
  """A kernel family as `fdecode.route` and `fdecode.dispatch` use it (module doc)."""
  name: str

  def available(self) -> bool: ...

  def refuses(self, call: Decode, target: Target) -> str | None: ...

  def plan(self, call: Decode, target: Target): ...

  def run(self, plan, call: Decode, target: Target) -> States: ...


class TakesEveryCall:
  """A backend's ``available`` and ``refuses`` when it runs on every JAX and takes every
  call on every platform (the XLA path, the reference)."""

  def available(self) -> bool:
    return True

  def refuses(self, call: Decode, target: Target) -> None:
    del call, target


# Why a Pallas backend refuses ``batch_invariant=True``.
NO_INVARIANT_PLAN = "it has no batch-invariant plan (the route takes the next backend that has one; the XLA path has)"


class Refused(NamedTuple):
  """A backend that did not take a call, and why (`fdecode.plan`'s ``refused``)."""
  backend: str
  reason: str


def compute_dtype(q_dtype, *cache_dtypes):
  """The dtype the matmuls read: q's dtype promoted with every float cache's dtype (an
  8-bit cache contributes nothing: it is dequantized to q's dtype; None entries are
  absent caches). A float32 query on a bfloat16 cache computes in float32; a bfloat16
  query on a float32 cache too."""
  dtypes = [q_dtype] + [d for d in cache_dtypes if d is not None and not is_quantized(d)]
  with jax.numpy_dtype_promotion("standard"):  # fdecode's own documented rule, under a caller's "strict" too
    return jnp.result_type(*dtypes)


# `fdecode.plan`: while a list is set, each backend's plan is appended as (platform, plan);
# the platform is the `fdecode.route.lower` branch being traced (None: every platform).
_PLANS = contextvars.ContextVar("fdecode_plans", default=None)
_BRANCH = contextvars.ContextVar("fdecode_branch", default=None)


@contextlib.contextmanager
def recording_log():
  """Inside, each plan noted is appended to the list yielded."""
  log = []
  token = _PLANS.set(log)
  try:
    yield log
  finally:
    _PLANS.reset(token)


def recording() -> bool:
  return _PLANS.get() is not None


def note(plan, platform: str | None = None) -> None:
  """Records ``plan`` (any frozen plan, or a `Refused`) for `fdecode.plan`, as the plan
  of ``platform`` (None: of the branch being traced, `branch_platform`)."""
  log = _PLANS.get()
  if log is not None:
    log.append((platform or _BRANCH.get(), plan))


def branch_platform() -> str | None:
  """The platform whose branch of `fdecode.route.lower` is being traced (None: a choice
  made for every platform at once): `fdecode.plan` keeps the plans of the platform it
  asks about."""
  return _BRANCH.get()


@contextlib.contextmanager
def tracing_branch(platform):
  token = _BRANCH.set(platform)
  try:
    yield
  finally:
    _BRANCH.reset(token)
