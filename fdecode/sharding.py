"""Multi-device FlashDecode: `jax.shard_map` wrappers over `flash_decode`.

Legend: B batch, T new tokens per sequence, Hq query heads, Hkv kv heads, G = Hq // Hkv,
S cache capacity, Dk / Dv head dims; n_b, n_h, n_s the sizes of the batch, head and
sequence mesh axes.

Three ways to split one decode step, combinable on one mesh:

* batch (``batch_axis``): sequences split across devices; no communication.
* heads (``head_axis``): kv heads split, each with its G query heads; no communication.
  If ``Hkv < n_h`` (MQA / few kv heads) and ``n_h % Hkv == 0``, every kv head is
  replicated on ``n_h / Hkv`` devices and its query group is split among them.
* sequence (``seq_axis``): the token axis S split in ``n_s`` contiguous chunks. Each
  device decodes against its chunk only and yields a partial state (o, lse); the states
  are merged across devices by `fdecode.combine.combine_across` (all-gather of the states,
  then `merge_states`). Only ``O(B * Hq * Dv)`` values per device cross the network per
  step, never cache bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal, Unpack, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.typing import ArrayLike
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from fdecode.api import DecodeOptions, flash_decode
from fdecode.cache.layout import CacheView, kv_head_axis
from fdecode.combine import apply_sinks, combine_across
from fdecode.cache.meshes import host_values
from fdecode.cache.quant import canonical_scale
from fdecode.options import ARRAY_ARGS, static_options
from fdecode.validation import as_array, as_arrays, short_repr

# A mesh axis name, several (their product), or none.
AxisNames = str | tuple[str, ...] | None

# Options laid out like the cache ([B|1, Hkv|1, S|1, n_tiles]): split with it.
_CACHE_SHAPED = ("k_scale", "v_scale", "k_offset", "v_offset")
# Cache-shaped options that are not scales: MLA's key-only RoPE columns.
_CACHE_LIKE = _CACHE_SHAPED + ("k_rope",)
# Options whose values flash_decode checks when they are concrete (with lengths).
_VALUE_CHECKED = ("block_tables", "kv_offset", "indices")

@overload
def sharded_flash_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *,
                         mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, head_axis: AxisNames = None,
                         seq_axis: AxisNames = None, batch_axis: AxisNames = None, return_lse: Literal[False] = False,
                         **flash_decode_kwargs: Unpack[DecodeOptions]) -> Array: ...


@overload
def sharded_flash_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *,
                         mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, head_axis: AxisNames = None,
                         seq_axis: AxisNames = None, batch_axis: AxisNames = None, return_lse: Literal[True],
                         **flash_decode_kwargs: Unpack[DecodeOptions]) -> tuple[Array, Array]: ...


@overload
def sharded_flash_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *,
                         mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, head_axis: AxisNames = None,
                         seq_axis: AxisNames = None, batch_axis: AxisNames = None, return_lse: bool,
                         **flash_decode_kwargs: Unpack[DecodeOptions]) -> Array | tuple[Array, Array]: ...


def sharded_flash_decode(q: ArrayLike, k: ArrayLike, v: ArrayLike | None, lengths: ArrayLike, *,
                         mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, head_axis: AxisNames = None,
                         seq_axis: AxisNames = None, batch_axis: AxisNames = None, return_lse: bool = False,
                         **flash_decode_kwargs: Unpack[DecodeOptions]) -> Array | tuple[Array, Array]:
  """`flash_decode` with the work split over the devices of ``mesh``.

  Args:
    q: ``[B, Hq, Dk]`` or ``[B, T, Hq, Dk]`` float queries (T new tokens per sequence,
      causal among themselves, as in `flash_decode`).
    k: ``[B, Hkv, S, Dk]`` head-major key cache (with ``kv_layout="NHD"``: token-major
      ``[B, S, Hkv, Dk]``, as `flash_decode` takes it).
    v: ``[B, Hkv, S, Dv]`` value cache (``[B, S, Hkv, Dv]``).
    lengths: int ``[B]`` valid tokens per sequence (new ones included), in ``[0, S]``.
    mesh: a `jax.sharding.Mesh` (e.g. `jax.make_mesh`) with Explicit or Auto axes, or a
      `jax.sharding.AbstractMesh` of the target devices to `jax.export` for another
      platform (e.g. TPU from a CPU host, with ``abstract_device=jax.sharding.AbstractDevice(
      device_kind="TPU v5 lite", num_cores=1, platform="tpu")``, exported inside
      ``jax.sharding.use_abstract_mesh`` of it; the kernel is chosen per lowering platform).
    head_axis: mesh axis name (or tuple of names) over which the kv heads, and their
      query heads with them, are split. Needs ``Hkv % n_h == 0``, or else
      ``n_h % Hkv == 0`` and ``Hq % n_h == 0`` (kv heads replicated, query groups split).
    seq_axis: mesh axis name(s) over which the cache's token axis is split into
      contiguous chunks of ``S / n_s`` tokens (needs ``S % n_s == 0``).
    batch_axis: mesh axis name(s) over which the sequences are split (``B % n_b == 0``).
    return_lse: also return the float32 LSE, as `flash_decode` does.
    **flash_decode_kwargs: passed to `flash_decode` on every device (``impl``,
      ``num_splits``, ``block_k``, ``softmax_scale``, ``interpret``...). ``num_splits``
      and ``block_k`` apply to each device's local chunk. 8-bit caches: ``k_scale`` /
      ``v_scale`` / offsets of every granularity are split like the cache on their
      non-broadcast axes (per token: with the tokens). ``kv_offset`` (int or int ``[B]``,
      split with the batch) only without ``seq_axis``, which sets each device's offset
      itself. Score modifiers: ``mask`` / ``bias`` are split with the cache's token axis
      (paged: with the table's columns) over ``seq_axis``, with the sequences over
      ``batch_axis`` and, per-head forms, with the query heads over ``head_axis``;
      ``alibi_slopes`` / ``sinks`` with the query heads. ``sinks`` join once per head,
      after the cross-device merge (never per device). With a ``window``, a device whose
      chunk no query sees reads nothing and contributes an empty state. ``window``,
      ``logits_soft_cap`` and ``causal`` are static. Other array options are replicated.

  Inputs may be unsharded (they are resharded to the layout below) or already sharded
  that way. Mesh axes named by none of the three roles replicate the work.

  Returns:
    ``out`` shaped like ``q`` with last dim Dv (dtype of q), and with ``return_lse`` the
    float32 ``lse`` ``[B, Hq]`` / ``[B, T, Hq]``, equal to single-device `flash_decode`
    within float tolerance. Output sharding: ``NamedSharding(mesh, spec)`` with the
    batch dim over ``batch_axis`` and the Hq dim over ``head_axis``, i.e.
    ``P(batch_axis, head_axis, None)`` for ``[B, Hq, Dv]`` and
    ``P(batch_axis, None, head_axis, None)`` for ``[B, T, Hq, Dv]`` (lse likewise, less
    the last dim); replicated over ``seq_axis`` and every other mesh axis. With a
    ``seq_axis`` the cross-device merge is deterministic and bitwise identical on all
    devices.

  Raises:
    ValueError: every error `flash_decode` raises for the same inputs, with the same
      message (shapes, dtypes, and when concrete: lengths out of range, page ids of live
      tokens outside the pool); a ``mesh`` that is not a Mesh, an axis role that is not a
      name (str) or tuple of names, unknown or repeated mesh axes, sizes the mesh axes do
      not divide, ``kv_offset`` with ``seq_axis`` (the message names the argument and
      shows the shapes).
  Paged caches (``block_tables=`` int ``[B, n]``, k/v pools ``[Hkv, P, page_size, D]``):
  the pool is split over kv heads on ``head_axis`` and over pages on ``seq_axis``
  (``P % n_s == 0``), the table by rows over ``batch_axis`` and by columns over
  ``seq_axis`` (``n % n_s == 0``). Each device owns the pages of its token range: table
  columns ``[d*n/n_s, (d+1)*n/n_s)`` (tokens of sequence shard d) must name pages of pool
  shard d, ``[d*P/n_s, (d+1)*P/n_s)`` (checked when the table is concrete). The pool is
  replicated over ``batch_axis`` (sequences of every batch shard may use any page).

  Token-major caches (``kv_layout="NHD"``: ``[B, S, Hkv, D]``, pools ``[P, page_size, Hkv, D]``)
  are split on the same logical axes (kv heads, tokens or pages, sequences); their
  scales, offsets and ``k_rope`` follow them, and each device calls `flash_decode` with
  the same ``kv_layout`` on its share.
  """
  _check_roles(mesh, head_axis=head_axis, seq_axis=seq_axis, batch_axis=batch_axis,
               kv_offset=flash_decode_kwargs.get("kv_offset"))
  # Static options as Python values (a concrete jax scalar is not an operand to shard), lists
  # and Python numbers numpy arrays, as flash_decode takes them (same errors).
  flash_decode_kwargs = static_options(return_lse=return_lse, **flash_decode_kwargs)
  return_lse = flash_decode_kwargs.pop("return_lse")
  q, k, v, lengths = as_arrays(q=q, k=k, v=v, lengths=lengths)
  flash_decode_kwargs = {n: as_array(n, x) if n in ARRAY_ARGS else x
                         for n, x in flash_decode_kwargs.items()}
  _flash_decode_checks(q, k, v, lengths, flash_decode_kwargs)
  tables = flash_decode_kwargs.get("block_tables")
  # The caches' layout, checked by flash_decode above: its view gives their geometry.
  view = CacheView(k, v, block_tables=tables, layout=flash_decode_kwargs.get("kv_layout", "HND"),
                   paged=tables is not None)
  pool_pages = view.num_pages
  plan = _plan(q.shape, (q.shape[0], view.kv_heads, view.capacity), mesh=mesh, head_axis=head_axis,
               seq_axis=seq_axis, batch_axis=batch_axis, pool_pages=pool_pages,
               table_cols=0 if tables is None else np.shape(tables)[1], shapes_of=(q, k),
               kv_layout=view.layout)
  if tables is not None:
    _check_page_ownership(tables, lengths, pool_pages, plan)

  kwargs = dict(flash_decode_kwargs)
  for name in _CACHE_SHAPED:  # 8-bit scales / offsets: rank 4, split like the cache
    if kwargs.get(name) is not None:
      kwargs[name] = canonical_scale(kwargs[name], (k if name[0] == "k" else v).shape, name)
  static = tuple(sorted((n, x) for n, x in kwargs.items() if not _is_array(x)))
  arrays = {n: x for n, x in kwargs.items() if _is_array(x)}
  array_specs = tuple(sorted((n, _array_spec(n, x, plan, q.ndim == 3)) for n, x in arrays.items()))
  try:
    fn = _build(mesh, plan, q.ndim == 3, static, array_specs)
  except TypeError:  # an unhashable option: build without the cache
    fn = _build.__wrapped__(mesh, plan, q.ndim == 3, static, array_specs)
  out, lse = fn(q, k, v, jnp.asarray(lengths).astype(jnp.int32), arrays)
  return (out, lse) if return_lse else out


def _flash_decode_checks(q, k, v, lengths, kwargs) -> None:
  """Every check `flash_decode` makes, in its order and with its messages, by tracing it
  on the global shapes (so errors show them) without running it. Operands are abstracted
  with their shardings dropped (explicitly sharded ones would trip its einsums); lengths,
  block tables and kv_offset go in as host values when readable here, so that its value
  checks (lengths in range, page ids of live tokens in the pool) run as well."""
  def plain(x, name=None):
    if not _is_array(x):
      return x
    if name in _VALUE_CHECKED + ("lengths",):
      values = host_values(x)
      if values is not None:
        return values
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
  lengths = plain(lengths, "lengths")
  opts = {n: plain(x, n) for n, x in kwargs.items()}
  traced = {n: x for n, x in opts.items() if isinstance(x, jax.ShapeDtypeStruct)}
  fixed = {n: x for n, x in opts.items() if n not in traced}
  if isinstance(lengths, jax.ShapeDtypeStruct):
    traced["lengths"] = lengths
  else:
    fixed["lengths"] = lengths
  def run(q, k, v, arrs):
    arrs = dict(arrs, **fixed)
    return flash_decode(q, k, v, arrs.pop("lengths"), **arrs)
  jax.eval_shape(run, *(plain(x) for x in (q, k, v)), traced)


def _check_roles(mesh, *, head_axis, seq_axis, batch_axis, kv_offset) -> None:
  """The arguments only sharded_flash_decode has (the mesh and the axis roles)."""
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise ValueError(f"sharded_flash_decode: mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh), "
                     f"got {type(mesh).__name__}")
  for role, axis in (("head_axis", head_axis), ("seq_axis", seq_axis), ("batch_axis", batch_axis)):
    _names(axis, role)
  if kv_offset is not None and _names(seq_axis):
    raise ValueError(f"sharded_flash_decode: kv_offset cannot be combined with seq_axis={seq_axis!r}: "
                     "the sequence axis sets each device's kv_offset itself (the start of its chunk)")


@functools.lru_cache(maxsize=64)
def _build(mesh, plan, single_token, static_kwargs, array_specs):
  """The jitted step: reshard the inputs, then shard_map `_local_decode` over the mesh."""
  q_spec = plan.q_spec(single_token)
  k_spec = P(*plan.cache_axes())
  array_specs = dict(array_specs)
  in_specs = (q_spec, k_spec, k_spec, P(plan.batch), array_specs)
  out_specs = (q_spec, P(*q_spec[:-1]))
  body = functools.partial(_local_decode, plan=plan, single_token=single_token,
                           kwargs=static_kwargs)
  # Compiled kernels type their outputs' varying axes (check_vma=True holds), but Pallas'
  # interpreters allocate unvarying buffers inside the kernel, which the check rejects:
  # only for an interpreted Pallas kernel is it off. combine_across's collective is
  # invariant by construction either way (all_gather_invariant).
  opts = dict(static_kwargs)
  interpreted = opts.get("impl") == "pallas" and (
      jax.default_backend() == "cpu" or opts.get("interpret") not in (None, False))
  mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=not interpreted)

  @jax.jit
  def step(q, k, v, lengths, arrays):  # v None: MLA, the values are k's first columns
    args = [None if x is None else _reshard(x, mesh, spec) for x, spec in zip((q, k, v, lengths), in_specs)]
    arrays = {n: _reshard(x, mesh, array_specs[n]) for n, x in arrays.items()}
    return mapped(*args, arrays)

  return step


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How the global problem maps onto the mesh (static and hashable)."""

  batch: Any        # PartitionSpec entry of B: None, a mesh axis name or a tuple of names
  head: Any         # entry of Hq
  kv_head: Any      # entry of Hkv (None when kv heads are replicated)
  seq: Any          # entry of S
  seq_size: int     # n_s
  chunk: int        # S / n_s tokens per device
  kv_replicas: int  # devices sharing one kv head (1: the kv heads are split)
  paged: bool = False
  pages_per_shard: int = 0  # paged: P / n_s pool pages per sequence shard
  kv_layout: str = "HND"    # the caches' layout (`fdecode.cache.layout`)

  def q_spec(self, single_token):
    return P(self.batch, self.head, None) if single_token else P(self.batch, None, self.head, None)

  def cache_axes(self) -> tuple:
    """PartitionSpec entries of a cache-shaped array in ``kv_layout``: kv heads over the
    head axis, tokens (paged: pool pages) over the seq axis, contiguous rows over the batch
    axis (a pool is replicated over it)."""
    if self.kv_layout == "NHD":
      return (self.seq, None, self.kv_head, None) if self.paged else (self.batch, self.seq, self.kv_head, None)
    return (self.kv_head, self.seq, None, None) if self.paged else (self.batch, self.kv_head, self.seq, None)


def _plan(q_shape, bhs, *, mesh, head_axis, seq_axis, batch_axis, pool_pages=None,
          table_cols=0, shapes_of=(), kv_layout="HND") -> _Plan:
  """bhs: (B, Hkv, S); pool_pages, table_cols: P and n for a paged cache (else None, 0)."""
  b, hkv, s = bhs
  hq = q_shape[-2]
  shapes = ", ".join(f"{n}.shape={tuple(x.shape)}" for n, x in zip("qk", shapes_of))
  shapes += f", mesh.shape={dict(mesh.shape)}"
  roles = {"head_axis": _names(head_axis, "head_axis"), "seq_axis": _names(seq_axis, "seq_axis"),
           "batch_axis": _names(batch_axis, "batch_axis")}
  seen = {}
  for role, names in roles.items():
    for name in names:
      if name not in mesh.shape:
        raise ValueError(f"sharded_flash_decode: {role}={name!r} is not an axis of the mesh; "
                         f"mesh axes are {tuple(mesh.axis_names)}")
      if name in seen:
        raise ValueError(f"sharded_flash_decode: mesh axis {name!r} is given as both "
                         f"{seen[name]} and {role}")
      seen[name] = role
  size = {role: math.prod(mesh.shape[n] for n in names) for role, names in roles.items()}
  if b % size["batch_axis"]:
    raise ValueError(f"sharded_flash_decode: batch_axis of size {size['batch_axis']} must divide "
                     f"the batch B={b}; got {shapes}")
  if s % size["seq_axis"]:
    raise ValueError(f"sharded_flash_decode: seq_axis of size {size['seq_axis']} must divide "
                     f"the cache capacity S={s}; got {shapes}")
  if pool_pages is not None:
    if pool_pages % size["seq_axis"] or table_cols % size["seq_axis"]:
      raise ValueError(f"sharded_flash_decode: seq_axis of size {size['seq_axis']} must divide the "
                       f"pool's page count P={pool_pages} and the block table's width n={table_cols}; "
                       f"got {shapes}")
  n_h = size["head_axis"]
  if hkv % n_h == 0:
    kv_replicas = 1
  elif n_h % hkv == 0 and hq % n_h == 0:
    kv_replicas = n_h // hkv
  else:
    raise ValueError(
        f"sharded_flash_decode: head_axis of size {n_h} must divide Hkv={hkv}, or be a multiple "
        f"of Hkv that divides Hq={hq} (kv heads replicated, query groups split); got {shapes}")
  entry = lambda names: None if not names else names[0] if len(names) == 1 else names
  return _Plan(batch=entry(roles["batch_axis"]), head=entry(roles["head_axis"]),
               kv_head=entry(roles["head_axis"]) if kv_replicas == 1 else None,
               seq=entry(roles["seq_axis"]), seq_size=size["seq_axis"],
               chunk=s // size["seq_axis"], kv_replicas=kv_replicas,
               paged=pool_pages is not None,
               pages_per_shard=0 if pool_pages is None else pool_pages // size["seq_axis"],
               kv_layout=kv_layout)


def _local_decode(q, k, v, lengths, arrays, *, plan, single_token, kwargs):
  """One device's share. q ``[b, (T,) hq, Dk]``, k/v ``[b, hkv, S/n_s, D]``, lengths ``[b]``
  -> (out like q with Dv, lse f32 ``[b, (T,) hq]``), merged over the seq axis; sinks
  (this device's heads) join once, after that merge."""
  kwargs = dict(kwargs, **arrays)
  sinks = kwargs.pop("sinks", None)
  out, lse = _merged_decode(q, k, v, lengths, plan=plan, single_token=single_token, kwargs=kwargs)
  if sinks is not None:
    out, lse = apply_sinks(out, lse, sinks)
  return out, lse


def _merged_decode(q, k, v, lengths, *, plan, single_token, kwargs):
  if plan.kv_replicas > 1:
    # k/v hold every kv head; this device's query heads belong to one of them.
    kv_head = jax.lax.axis_index(plan.head) // plan.kv_replicas
    kv_axis = kv_head_axis(plan.kv_layout, plan.paged)  # of k, v and cache-like arrays
    one_head = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, kv_head, 1, axis=axis)
    k = one_head(k, kv_axis)
    v = None if v is None else one_head(v, kv_axis)
    for name in _CACHE_LIKE:
      if name in kwargs and kwargs[name].shape[kv_axis] > 1:
        kwargs[name] = one_head(kwargs[name], kv_axis)
    axis = _index_head_axis(kwargs.get("indices"), single_token)
    if axis is not None:
      kwargs["indices"] = one_head(kwargs["indices"], axis)
  if plan.paged and plan.seq is not None:
    # This shard's table columns name pages of this shard's pool slice: make them local.
    kwargs["block_tables"] = kwargs["block_tables"] - jax.lax.axis_index(plan.seq) * plan.pages_per_shard
  if plan.seq is None:
    return flash_decode(q, k, v, lengths, return_lse=True, **kwargs)
  q4 = q[:, None] if single_token else q
  out, lse = _chunk_decode(q4, k, v, lengths, plan=plan, kwargs=kwargs)
  out, lse = combine_across(out, lse, plan.seq)
  if single_token:
    out, lse = out[:, 0], lse[:, 0]
  return out, lse


def _chunk_decode(q, k, v, lengths, *, plan, kwargs):
  """State of this device's chunk of the token axis: the chunk holds global positions
  ``[off, off + C)`` with ``off = axis_index * C``, which `flash_decode`'s ``kv_offset``
  expresses exactly (causal T > 1 queries included).

  Args:
    q: ``[b, T, hq, Dk]``; k, v: ``[b, hkv, C, D]``; lengths: int32 ``[b]`` global.

  Returns:
    (o ``[b, T, hq, Dv]`` in q.dtype, lse float32 ``[b, T, hq]``) of this chunk.
  """
  offset = jax.lax.axis_index(plan.seq) * plan.chunk
  return flash_decode(q, k, v, lengths, kv_offset=offset, return_lse=True, **kwargs)


def _index_head_axis(indices, single_token):
  """The kv-head axis of sparse ``indices`` (`fdecode.kernels.common.sparse`), None without one (or size 1):
  ``[B, Hkv, K]`` for a single-token q, ``[B, T, Hkv, K]``."""
  if indices is None:
    return None
  axis = {(3, True): 1, (4, False): 2}.get((np.ndim(indices), single_token))
  return axis if axis is not None and np.shape(indices)[axis] > 1 else None


def _array_spec(name, x, plan, single_token):
  """Cache-shaped scales / offsets (and MLA's ``k_rope``) follow the cache's split on their
  non-broadcast axes; sparse ``indices`` split with the sequences and kv heads;
  masks and biases (``[B|1, S]``, ``[B|1, T|1, S]``, ``[B|1, T|1, Hq|1, S]``) split their
  B, Hq and S axes like q's and the cache's; per-head ``[Hq]`` vectors like q's heads;
  any other array option is replicated."""
  if name == "block_tables":
    return P(plan.batch, plan.seq)
  if name in ("mask", "bias"):
    shape = np.shape(x)
    lead = [plan.batch if shape[0] > 1 else None] + [None] * (len(shape) - 2)
    if len(shape) == 4 and shape[2] > 1:
      lead[2] = plan.head
    return P(*lead, plan.seq)
  if name in ("alibi_slopes", "sinks"):
    return P(plan.head)
  if name == "kv_offset":  # int [B]: per sequence, split with them
    return P(plan.batch) if np.ndim(x) == 1 else P()
  if name == "indices":  # global positions: split with the sequences and (per-head lists) kv heads
    spec = [plan.batch] + [None] * (np.ndim(x) - 1)
    head = _index_head_axis(x, single_token)
    if head is not None:
      spec[head] = plan.kv_head
    return P(*spec)
  if name not in _CACHE_LIKE:
    return P()
  return P(*(axis if size > 1 else None for axis, size in zip(plan.cache_axes()[:3], x.shape[:3])), None)


def _names(axis, role: str = "mesh axis") -> tuple:
  """A role's mesh axis names: None -> (), "x" -> ("x",), ("x", "y") as is."""
  if axis is None:
    return ()
  names = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, (tuple, list)) else None
  if names is None or not all(isinstance(n, str) for n in names):
    raise ValueError(f"sharded_flash_decode: {role} must be a mesh axis name (str) or a tuple of names, "
                     f"got {short_repr(axis)}")
  return names


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _reshard(x, mesh, spec):
  """Lays x out as ``spec`` on the Explicit axes of ``mesh``; shard_map rejects inputs
  whose Explicit sharding differs from its in_specs. Auto axes are left to shard_map,
  which reshards them itself (reshard refuses Auto axes)."""
  explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
  if not explicit:
    return x
  def keep(entry):
    names = tuple(n for n in _names(entry) if n in explicit)
    return None if not names else names[0] if len(names) == 1 else names
  return jax.sharding.reshard(x, NamedSharding(mesh, P(*(keep(e) for e in spec))))


def _check_page_ownership(tables, lengths, pool_pages, plan) -> None:
  """Concrete table: the pages a live token of sequence shard d needs lie in pool shard d."""
  tables, lens = host_values(tables), host_values(lengths)
  if plan.seq is None or tables is None or lens is None:
    return
  n = tables.shape[1]
  page_size = plan.chunk * plan.seq_size // n
  live = np.arange(n)[None, :] < -(-lens[:, None] // page_size)
  shard = np.arange(n)[None, :] // (n // plan.seq_size)
  owner = tables // plan.pages_per_shard
  bad = live & (owner != shard)
  if bad.any():
    i, j = map(int, np.argwhere(bad)[0])
    raise ValueError(
        f"sharded_flash_decode: block_tables[{i}, {j}] = {int(tables[i, j])} must be a page of pool "
        f"shard {int(shard[i, j])} (pages [{int(shard[i, j]) * plan.pages_per_shard}, "
        f"{(int(shard[i, j]) + 1) * plan.pages_per_shard})): with seq_axis each device owns the "
        f"pages of its token range")
