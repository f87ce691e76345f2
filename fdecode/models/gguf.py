"""Reading GGUF files (llama.cpp's model format) into numpy / JAX arrays.

Legend: V vocabulary, E model width, F MLP width, Hq / Hkv query / kv heads, D head dim.

GGUF stores each tensor with its llama.cpp shape ``ne`` (fastest axis first) and a
``ggml`` type (F32, F16, BF16 or a block quantization such as Q8_0 / Q4_K). `GGUFFile`
returns tensors in numpy order (``ne`` reversed: a linear layer ``E -> F`` is ``[F, E]``)
dequantized to float32 by ``gguf.quants.dequantize`` (the reference numpy dequantizers of
the ``gguf`` package that ships with llama.cpp), checking names, shapes and types first:

  f = GGUFFile(path)
  f.metadata["gemma3.block_count"]                 # 18
  w = f.tensor("blk.0.attn_q.weight", (1024, 640))  # float32 [Hq*D, E]

Needs the ``gguf`` package (``pip install 'fdecode[demo]'``).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from fdecode.validation import F32_MAX, INT32_MAX, describe

__all__ = ["GGUFFile", "SUPPORTED_TYPES"]

# ggml types this loader dequantizes: what the Gemma 3 Q4_K_M file holds, plus plain floats.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_K", "Q6_K")


_REQUIRED = object()


def _gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("fdecode.models needs the 'gguf' package: pip install 'fdecode[demo]' "
                      "(or pip install gguf)") from e
  return gguf


def _field_value(field) -> Any:
  """One GGUF key/value field as a Python value (str, int, float, bool or list)."""
  gguf = _gguf()
  types = field.types
  if not types:
    return None
  def scalar(part, kind):
    if kind == gguf.GGUFValueType.STRING:
      return bytes(part).decode("utf-8", errors="replace")
    value = part[0]
    return bool(value) if kind == gguf.GGUFValueType.BOOL else value.item()
  if types[0] == gguf.GGUFValueType.ARRAY:
    kind = types[-1]
    if kind == gguf.GGUFValueType.STRING:
      return [scalar(field.parts[i], kind) for i in field.data]
    return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.zeros(0)
  return scalar(field.parts[field.data[0]], types[0])


class GGUFFile:
  """A GGUF file opened for reading (memory-mapped; tensors are read on demand).

  Attributes:
    path: the file.
    metadata: ``{key: value}`` of every key/value field (``general.architecture``,
      ``gemma3.block_count``, ``tokenizer.ggml.tokens`` as a list of str, ``scores`` /
      ``token_type`` as numpy arrays...).
    tensor_types: ``{name: ggml type name}`` of every tensor, e.g. ``"Q4_K"``.
    tensor_shapes: ``{name: shape}`` of every tensor in numpy order (``ne`` reversed).

  Raises (constructor):
    FileNotFoundError: no file at ``path``.
    ValueError: the file is not a readable GGUF file (bad magic, truncated).
  """

  def __init__(self, path: str | os.PathLike):
    gguf = _gguf()
    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"GGUFFile: no file at {self.path!r}")
    try:
      self._reader = gguf.GGUFReader(self.path)
    except Exception as e:  # the reader raises ValueError / struct errors / IndexError
      raise ValueError(f"GGUFFile: {self.path!r} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    self.metadata = {name: _field_value(f) for name, f in self._reader.fields.items()
                     if not name.startswith("GGUF.")}
    self._tensors = {t.name: t for t in self._reader.tensors}
    self.tensor_types = {name: t.tensor_type.name for name, t in self._tensors.items()}
    self.tensor_shapes = {name: tuple(int(n) for n in reversed(t.shape.tolist()))
                          for name, t in self._tensors.items()}

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
      ValueError: the tensor is missing, has another shape, or a ggml type not in
        `SUPPORTED_TYPES`; each message names the tensor, the file and the shapes.
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
    if kind not in SUPPORTED_TYPES:
      raise ValueError(f"GGUFFile: tensor {name!r} {got} has unsupported quantization type "
                       f"{kind}; supported: {', '.join(SUPPORTED_TYPES)}")
    t = self._tensors[name]
    data = _gguf().quants.dequantize(np.asarray(t.data), t.tensor_type)
    return np.asarray(data, np.float32).reshape(shape)
