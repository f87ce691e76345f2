"""Token-major (``kv_layout="NHD"``) caches and the memory an optimized HLO module writes."""

import math
import re

import jax.numpy as jnp

from fdecode.devtools.compile_check import _HLO_BYTES


def nhd(x, paged):
  """A head-major cache-shaped array in the token-major layout."""
  if x is None or jnp.ndim(x) < 4:  # absent, or a per-tensor scale
    return x
  return x.transpose(1, 2, 0, 3) if paged else x.swapaxes(1, 2)


# An optimized-HLO instruction and its result: `%name = dtype[dims]{layout} opcode(`.
_RESULT = re.compile(r"%\S+ = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")
# Results that name an existing buffer rather than compute a new one.
_NO_NEW_BUFFER = {"parameter", "get-tuple-element", "tuple", "while", "bitcast", "conditional", "call"}


def largest_new_array_bytes(hlo_text):
  """Bytes of the largest array an optimized HLO module writes to memory: results of the
  instructions outside fusion bodies (a fusion's body is computed in registers; its
  result is the fusion's). A copy, transpose or float32 widening of a whole cache shows
  up here."""
  fused = set(re.findall(r"kind=k\w+, calls=(%[\w.-]+)", hlo_text))
  best, inside = 0, False
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():  # a computation's header (or the module's)
      name = line.split(" ")[1] if line.startswith("ENTRY") else line.split(" ")[0]
      inside = name in fused
      continue
    m = _RESULT.search(line)
    if m and not inside and m.group(3) not in _NO_NEW_BUFFER:
      dtype, dims, _ = m.groups()
      best = max(best, _HLO_BYTES.get(dtype, 4) * math.prod(int(d) for d in filter(None, dims.split(","))))
  return best
