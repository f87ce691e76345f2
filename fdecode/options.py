"""`flash_decode`'s arguments, declared once: its array arguments (`CallArrays`) and its
static options (`StaticOptions`, a frozen, hashable dataclass whose fields carry their
shape-free checks).

Everything that lists the options derives the list from here: `fdecode.call.canonical_call`
takes one of each; `ARRAY_ARGS` / `STATIC_ARGS` name them for the entry points that forward
to `flash_decode` (`fdecode.cascade`, `fdecode.sharding`, `fdecode.plan`); `ragged_decode`
forwards `RAGGED_OPTIONS` and keys its compiled step with a `StaticOptions`. The typed
keyword dicts of the public signatures (`ScoreOptions`, `DecodeOptions`) are these names
with their types, for type checkers; a test checks that they name the same fields.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple, TypedDict, Union

from jax.experimental.pallas import tpu as pltpu
from jax.typing import ArrayLike

from fdecode import validation
from fdecode.kernels import mosaic_gpu

IMPLS = ("pallas", "mosaic_gpu", "xla", "reference")

# The types of the public signatures (flash_decode's, and what ragged_decode, cascade_decode
# and sharded_flash_decode forward to it).
Impl = Literal["pallas", "mosaic_gpu", "xla", "reference"]
KvLayout = Literal["HND", "NHD"]
Interpret = Union[bool, pltpu.InterpretParams, mosaic_gpu.InterpretGPUParams, None]


class CallArrays(NamedTuple):
  """`flash_decode`'s array arguments by name (arrays, `jax.ShapeDtypeStruct` s, lists or
  None), as its docstring gives their shapes and dtypes."""
  q: object
  k: object
  v: object
  lengths: object
  block_tables: object = None
  k_scale: object = None
  v_scale: object = None
  k_offset: object = None
  v_offset: object = None
  kv_offset: object = None
  mask: object = None
  bias: object = None
  alibi_slopes: object = None
  sinks: object = None
  k_rope: object = None
  indices: object = None


def _static(default, check=None):
  """A `StaticOptions` field: its default and its shape-free check ``check(value, caller)
  -> value`` (run on a value that is not None), or None where `fdecode.call.canonical_call`
  checks it against the call (``impl``, ``kv_layout``)."""
  return dataclasses.field(default=default, metadata={"check": check})


@dataclasses.dataclass(frozen=True)
class StaticOptions:
  """`flash_decode`'s static options: Python values, compiled into the kernels (so they key
  its jit, and a traced one is an error naming it). Build one with `static_options_of`,
  which checks each field as far as no shape is needed; see `flash_decode` for what each
  means."""
  softmax_scale: float | None = _static(None, lambda x, caller: validation.static_scale(x, 1, caller))
  num_splits: int | Literal["balance"] | None = _static(None, validation.static_num_splits)
  block_k: int | None = _static(None, lambda x, caller: validation.tuning_knob("block_k", x, caller))
  impl: Impl | None = _static(None)
  interpret: Interpret = _static(None, lambda x, caller: validation.static_scalar("interpret", x, caller))
  causal: bool = _static(True, lambda x, caller: validation.static_bool("causal", x, caller))
  window: int | None = _static(None, validation.static_window)
  logits_soft_cap: float | None = _static(None, validation.static_soft_cap)
  v_head_dim: int | None = _static(None, validation.static_v_head_dim)
  kv_layout: KvLayout = _static("HND")
  batch_invariant: bool = _static(False, lambda x, caller: validation.static_bool("batch_invariant", x, caller))
  split_size: int | None = _static(None, lambda x, caller: validation.tuning_knob("split_size", x, caller))


_FIELDS = {f.name: f for f in dataclasses.fields(StaticOptions)}
ARRAY_ARGS = CallArrays._fields
# The options that key the compiled kernels (`StaticOptions`), and ``return_lse``.
STATIC_ARGS = tuple(_FIELDS) + ("return_lse",)
# flash_decode's keywords that ragged_decode forwards (kv_layout is its own; a step's
# caches are whole, so no block table of flash_decode's and no kv_offset), and return_lse.
RAGGED_OPTIONS = tuple(n for n in ARRAY_ARGS[4:] + STATIC_ARGS if n not in ("block_tables", "kv_offset", "kv_layout"))


def _check(name, x, caller):
  """A static option's shape-free check (None always passes): a traced value raises
  ValueError naming it and how to pass it static (`fdecode.validation.traced_static`); a
  concrete numpy / jax scalar is taken as its value (`fdecode.validation.static_scalar`),
  in the domain flash_decode checks it in."""
  if name == "return_lse":
    check = lambda x, caller: validation.static_scalar("return_lse", x, caller)
  else:
    check = _FIELDS[name].metadata["check"]
  return x if check is None or x is None else check(x, caller)


def static_options_of(caller: str = "flash_decode", **given) -> StaticOptions:
  """The `StaticOptions` of ``given`` (`flash_decode` keywords among `StaticOptions`' fields;
  the rest default), each checked as far as no shape is needed. Raises ValueError for a
  bad or traced value (naming it and how to pass it static)."""
  return StaticOptions(**{n: _check(n, x, caller) for n, x in given.items()})


def static_options(caller: str = "flash_decode", **options) -> dict:
  """``options`` (`flash_decode` keywords) with each static one (`STATIC_ARGS`) as the Python
  value it holds, checked as `static_options_of` checks it; the others come back as given.
  For the entry points that forward a keyword dict to `flash_decode`."""
  return {n: _check(n, x, caller) if n in STATIC_ARGS else x for n, x in options.items()}


def split_call(caller: str = "flash_decode", **given) -> tuple[CallArrays, StaticOptions]:
  """`flash_decode`'s arguments (``q``, ``k``, ``v``, ``lengths`` and its keywords but
  ``return_lse``) as a `CallArrays` and a checked `StaticOptions`. Raises TypeError naming
  a keyword that is neither."""
  unknown = sorted(n for n in given if n not in ARRAY_ARGS and n not in _FIELDS)
  if unknown:
    raise TypeError(f"{caller}: unexpected keyword(s) {unknown}; it takes the arrays {list(ARRAY_ARGS)} "
                    f"and the options {list(_FIELDS)}")
  arrays = CallArrays(**{n: x for n, x in given.items() if n in ARRAY_ARGS})
  return arrays, static_options_of(caller, **{n: x for n, x in given.items() if n in _FIELDS})


class ScoreOptions(TypedDict, total=False):
  """`flash_decode`'s keyword options that `ragged_decode` forwards (all but the cache's
  layout and table, ``kv_offset`` and ``return_lse``), with their types."""
  k_scale: ArrayLike | None
  v_scale: ArrayLike | None
  k_offset: ArrayLike | None
  v_offset: ArrayLike | None
  softmax_scale: float | None
  num_splits: int | Literal["balance"] | None
  block_k: int | None
  impl: Impl | None
  interpret: Interpret
  causal: bool
  mask: ArrayLike | None
  bias: ArrayLike | None
  alibi_slopes: ArrayLike | None
  window: int | None
  logits_soft_cap: float | None
  sinks: ArrayLike | None
  v_head_dim: int | None
  k_rope: ArrayLike | None
  indices: ArrayLike | None
  batch_invariant: bool
  split_size: int | None


class DecodeOptions(ScoreOptions, total=False):
  """Every keyword option of `flash_decode` but ``return_lse``, with its type."""
  block_tables: ArrayLike | None
  kv_offset: ArrayLike | None
  kv_layout: KvLayout
