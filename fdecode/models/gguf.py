"""Reading GGUF files (llama.cpp's model format) into numpy / JAX arrays.

Legend: V vocabulary, E model width, F MLP width, Hq / Hkv query / kv heads, D head dim.

GGUF stores each tensor with its llama.cpp shape ``ne`` (fastest axis first) and a
``ggml`` type (F32, F16, BF16 or a block quantization such as Q4_0 / Q8_0 / Q4_K). `GGUFFile`
returns tensors in numpy order (``ne`` reversed: a linear layer ``E -> F`` is ``[F, E]``)
dequantized to float32 by ``gguf.quants.dequantize`` (the reference numpy dequantizers of
the ``gguf`` package that ships with llama.cpp), checking names, shapes and types first.
The header (metadata and tensor index) is parsed here (`_Header`) rather than by
``gguf.GGUFReader``, which builds a numpy view of every array element: Gemma 3's 262,144-token
vocabulary (tokens, scores, types) took it 18 s on a 2-core VM, the parse here 1 s.

  f = GGUFFile(path)
  f.metadata["gemma3.block_count"]                 # 18
  w = f.tensor("blk.0.attn_q.weight", (1024, 640))  # float32 [Hq*D, E]

Which types load is asked of the installed ``gguf`` (`supported_types`), not kept in a list
here, so a newer ``gguf`` that decodes more quantizations loads them too.

Needs the ``gguf`` package: ``pip install gguf sentencepiece protobuf`` (the packages of
fdecode's ``gguf`` extra; the tokenizer needs the other two).
"""

from __future__ import annotations

import functools
import importlib.metadata
import mmap
import os
import struct
from typing import Any, Sequence

import numpy as np

from fdecode.validation import F32_MAX, INT32_MAX, describe

__all__ = ["GGUFFile", "supported_types"]

# ggml types the reader hands over as plain numpy arrays and ``gguf.quants.dequantize`` leaves
# out; cast to float32 here where float32 holds the values (checked per tensor in `_to_float32`).
_NUMPY_TYPES = ("F64", "I8", "I16", "I32", "I64")
_INT_EXACT = 2**24  # float32 holds every integer in [-2**24, 2**24]

_REQUIRED = object()


def _gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("fdecode.models needs the 'gguf' package to read GGUF files: pip install gguf "
                      "sentencepiece protobuf (the packages of fdecode's 'gguf' extra)") from e
  return gguf


def _gguf_version() -> str:
  try:
    return importlib.metadata.version("gguf")
  except importlib.metadata.PackageNotFoundError:  # pragma: no cover - gguf from a source tree
    return "(version unknown)"


@functools.cache
def supported_types() -> tuple[str, ...]:
  """Names of the ggml tensor types `GGUFFile.tensor` loads with the installed ``gguf``.

  Every type ``gguf.quants.dequantize`` decodes (asked of the package by dequantizing one
  zero block of each type it knows: F32, F16, BF16, the Q*, K-quant, IQ*, TQ* and FP4
  families, whatever this version implements), plus the plain numeric types the reader returns
  as numpy arrays (F64, I8, I16, I32, I64), cast to float32 where float32 holds their values.
  """
  gguf = _gguf()
  names = []
  for kind in gguf.GGMLQuantizationType:
    sizes = gguf.GGML_QUANT_SIZES.get(kind)
    if sizes is None:
      continue
    if kind.name in _NUMPY_TYPES:
      names.append(kind.name)
      continue
    try:  # NotImplementedError where this gguf has no dequantizer for the type
      gguf.quants.dequantize(np.zeros((1, sizes[1]), np.uint8), kind)
    except Exception:  # pylint: disable=broad-exception-caught
      continue
    names.append(kind.name)
  return tuple(names)


# GGUF value types (``gguf.GGUFValueType``) -> struct format of one value; 8 STRING, 9 ARRAY.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_SUPPORTED_VERSIONS = (2, 3)


class _Header:
  """A GGUF file's header: ``metadata`` (key -> value as gguf's ``ReaderField.contents()``
  gives it: str, int, float, bool, or a list of them) and ``tensors`` (name -> (ggml type
  id, ``ne`` dims, absolute data offset)). Raises ValueError / struct.error / IndexError on
  a file that is not GGUF, is truncated, or holds an unknown value type."""

  def __init__(self, buf):
    self.buf = buf
    if bytes(buf[:4]) != b"GGUF":
      raise ValueError("GGUF magic invalid")
    self.at, self.order = 4, "<"
    version = self._take("I")
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
      self.order = ">"
      version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in _SUPPORTED_VERSIONS:
      raise ValueError(f"Sorry, file appears to be version {version} which we cannot handle")
    n_tensors, n_kv = self._take("Q"), self._take("Q")
    self.metadata = {}
    for _ in range(n_kv):
      key = self._string("(a key)")
      if key in self.metadata:
        raise KeyError(f"Duplicate {key} already in list")
      self.metadata[key] = self._value(self._take("I"), key)
    infos = []
    for _ in range(n_tensors):
      name = self._string("a tensor name")
      dims = [self._take("Q") for _ in range(self._take("I"))]
      infos.append((name, self._take("I"), dims, self._take("Q")))
    align = self.metadata.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
      raise ValueError(f"Invalid alignment {align!r}: must be a non-zero power of two")
    start = -(-self.at // align) * align
    self.tensors = {}
    for name, kind, dims, offset in infos:
      if name in self.tensors:
        raise ValueError(f"Found duplicated tensor with name {name}")
      self.tensors[name] = (kind, dims, start + offset)

  def _take(self, fmt):
    fmt = self.order + fmt
    value = struct.unpack_from(fmt, self.buf, self.at)[0]
    self.at += struct.calcsize(fmt)
    return value

  def _string(self, key):
    n = self._take("Q")
    raw = self.buf[self.at:self.at + n]
    if len(raw) != n:
      raise ValueError("truncated string")
    self.at += n
    try:
      return str(raw, "utf-8")
    except UnicodeDecodeError as e:
      raise _NotUtf8(key, e) from None

  def _value(self, kind, key):
    if kind == _STRING:
      return self._string(key)
    if kind == _ARRAY:
      sub, n = self._take("I"), self._take("Q")
      if sub in _SCALARS:  # one read for the whole array
        fmt = f"{self.order}{n}{_SCALARS[sub]}"
        values = list(struct.unpack_from(fmt, self.buf, self.at))
        self.at += struct.calcsize(fmt)
        return values
      return [self._value(sub, key) for _ in range(n)]  # strings (nested arrays as lists)
    if kind not in _SCALARS:
      raise ValueError(f"{kind} is not a valid GGUFValueType (metadata {key!r})")
    return self._take(_SCALARS[kind])


class _NotUtf8(Exception):
  def __init__(self, key, error):
    super().__init__(key, error)
    self.key, self.error = key, error


class GGUFFile:
  """A GGUF file opened for reading (memory-mapped; tensors are read on demand).

  Attributes:
    path: the file.
    metadata: ``{key: value}`` of every key/value field as gguf's ``ReaderField.contents()``
      reads it: str, int, float or bool (``general.architecture``, ``gemma3.block_count``),
      a list of them for arrays (``tokenizer.ggml.tokens`` a list of str, ``scores`` of float).
    tensor_types: ``{name: ggml type name}`` of every tensor, e.g. ``"Q4_K"``.
    tensor_shapes: ``{name: shape}`` of every tensor in numpy order (``ne`` reversed).

  Raises (constructor):
    FileNotFoundError: no file at ``path``.
    ValueError: the file is not a readable GGUF file (bad magic, truncated, an unknown
      ggml type id), or a metadata string is not UTF-8.
  """

  def __init__(self, path: str | os.PathLike):
    gguf = _gguf()
    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"GGUFFile: no file at {self.path!r}")
    try:
      with open(self.path, "rb") as file:
        self._data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if os.path.getsize(self.path) else b""
      header = _Header(memoryview(self._data))
      self._tensors = {name: (gguf.GGMLQuantizationType(kind), dims, offset)
                       for name, (kind, dims, offset) in header.tensors.items()}
    except _NotUtf8 as e:
      raise ValueError(f"GGUFFile: metadata {e.key!r} holds a string that is not UTF-8 ({e.error}) in "
                       f"{self.path!r}; GGUF strings are UTF-8") from None
    except Exception as e:  # ValueError / struct errors / IndexError / KeyError
      raise ValueError(f"GGUFFile: {self.path!r} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    self._order = header.order
    self.metadata = header.metadata
    self.tensor_types = {name: kind.name for name, (kind, _, _) in self._tensors.items()}
    self.tensor_shapes = {name: tuple(int(n) for n in reversed(dims)) for name, (_, dims, _) in self._tensors.items()}

  def _raw(self, name: str) -> np.ndarray:
    """Tensor ``name``'s stored data as ``gguf.GGUFReader`` gives it: numpy order, typed for
    the plain types (F32, F16, F64, I8 ... I64; in the machine's byte order, which
    ``gguf.quants.dequantize`` assumes), bytes ``[..., row bytes]`` for the others."""
    gguf = _gguf()
    kind, dims, offset = self._tensors[name]
    shape = tuple(int(n) for n in reversed(dims))
    plain = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64}.get(kind.name)
    if plain is not None:
      dtype, count = np.dtype(plain).newbyteorder(self._order), int(np.prod(shape))
    else:
      try:
        dtype, shape = np.dtype(np.uint8), gguf.quants.quant_shape_to_byte_shape(shape, kind)
      except ValueError as e:  # a row that is no whole number of blocks
        raise ValueError(f"GGUFFile: tensor {name!r} in {self.path!r}: {e}") from None
      count = int(np.prod(shape))
    if offset + count * dtype.itemsize > len(self._data):
      raise ValueError(f"GGUFFile: tensor {name!r} runs past the end of {self.path!r} (truncated file)")
    data = np.frombuffer(self._data, dtype, count, offset).reshape(shape)
    return data if dtype.isnative else data.astype(dtype.newbyteorder("="))

  def require(self, key: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """The metadata value under ``key``; ValueError naming the key if it is missing (or,
    with ``kind``, not of that Python type)."""
    if key not in self.metadata:
      raise ValueError(f"GGUFFile: {self.path!r} has no metadata key {key!r} "
                       f"(architecture {self.metadata.get('general.architecture')!r})")
    value = self.metadata[key]
    if kind is not None and not isinstance(value, kind):
      names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
      raise ValueError(f"GGUFFile: metadata {key!r} must be {names}, got {describe(value)} in {self.path!r}")
    return value

  def int_value(self, key: str, default: Any = _REQUIRED, *, low: int = 1,
                high: int = INT32_MAX) -> int:
    """The integer under ``key`` (``default`` when absent; required without one), in
    ``[low, high]`` (default ``[1, 2**31 - 1]``: sizes used as int32).

    Raises:
      ValueError: missing, not an integer (a bool, float, string or array), or out of
        range; names the key, the value and what is allowed.
    """
    if key not in self.metadata and default is not _REQUIRED:
      return default
    value = self.require(key)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
      raise ValueError(f"GGUFFile: metadata {key!r} must be an integer in [{low}, {high}]; got "
                       f"{describe(value)} in {self.path!r}")
    return int(value)

  def float_value(self, key: str, default: Any = _REQUIRED, *, allow_zero: bool = False) -> float:
    """The real number under ``key`` (``default`` when absent), > 0 (or >= 0 with
    ``allow_zero``) and finite in float32 (the dtype the model uses it in; a positive
    value that rounds to 0 in float32 counts as 0).

    Raises:
      ValueError: missing, not a number, negative, zero, NaN or beyond float32; names the
        key, the value and what is allowed.
    """
    if key not in self.metadata and default is not _REQUIRED:
      return default
    value = self.require(key)
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    as32 = np.float32(value) if ok and abs(float(value)) <= F32_MAX else np.float32(np.nan)
    if not (np.isfinite(as32) and (as32 >= 0 if allow_zero else as32 > 0)):
      bound = ">= 0" if allow_zero else "> 0"
      raise ValueError(f"GGUFFile: metadata {key!r} must be a number {bound} and finite in float32 "
                       f"(at most {F32_MAX:.4g}, and nonzero there when > 0 is required); got "
                       f"{describe(value)} in {self.path!r}")
    return float(value)

  def tensor(self, name: str, shape: Sequence[int]) -> np.ndarray:
    """Tensor ``name`` dequantized to float32, numpy order.

    Args:
      name: GGUF tensor name, e.g. ``"blk.3.ffn_up.weight"``.
      shape: the expected numpy shape (``ne`` reversed), e.g. ``(F, E)`` for ``ffn_up``.

    Returns:
      float32 ``np.ndarray`` of ``shape``.

    Raises:
      ValueError: the tensor is missing, has another shape, has a ggml type not in
        `supported_types` (or values float32 cannot hold); each message names the tensor,
        the file, and the shapes or the type and the supported ones.
    """
    shape = tuple(int(n) for n in shape)
    if name not in self._tensors:
      near = sorted(n for n in self._tensors if n.split(".")[-2:] == name.split(".")[-2:])[:3]
      hint = f"; tensors of that kind: {near}" if near else ""
      raise ValueError(f"GGUFFile: missing tensor {name!r} (expected shape {shape}) in "
                       f"{self.path!r}, which has {len(self._tensors)} tensors{hint}")
    got = self.tensor_shapes[name]
    if got != shape:
      raise ValueError(f"GGUFFile: tensor {name!r} has shape {got}, expected {shape} "
                       f"(numpy order, i.e. GGUF ne reversed) in {self.path!r}")
    kind = self.tensor_types[name]
    if kind not in supported_types():
      raise ValueError(f"GGUFFile: tensor {name!r} {got} in {self.path!r} has ggml type {kind}, which the "
                       f"installed gguf {_gguf_version()} cannot dequantize; supported: "
                       f"{', '.join(supported_types())}")
    data = self._raw(name)
    if kind in _NUMPY_TYPES:
      return self._to_float32(name, kind, data).reshape(shape)
    return np.asarray(_gguf().quants.dequantize(data, self._tensors[name][0]), np.float32).reshape(shape)

  def _to_float32(self, name: str, kind: str, data: np.ndarray) -> np.ndarray:
    """An F64 / I8 / I16 / I32 / I64 tensor as float32; ValueError where float32 cannot hold
    a value (an F64 beyond float32's range, an integer beyond +-2**24 that it would round)."""
    with np.errstate(over="ignore"):  # an F64 beyond float32's range: reported below
      out = data.astype(np.float32)
    if data.dtype.kind == "f":
      bad, limit = np.isfinite(data) & ~np.isfinite(out), f"float32's range (+-{F32_MAX:.4g})"
    else:
      bad, limit = (data < -_INT_EXACT) | (data > _INT_EXACT), "+-2**24 (float32 holds integers exactly up to there)"
    if bad.any():
      where = np.unravel_index(int(np.argmax(bad)), data.shape)
      raise ValueError(f"GGUFFile: tensor {name!r} ({kind}) in {self.path!r} holds {data[where].item()!r} at "
                       f"{tuple(int(i) for i in where)} (numpy order), beyond {limit}; it cannot load as float32")
    return out
