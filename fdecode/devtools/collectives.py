"""Bytes that cross devices in a compiled program: what the sharding tests and
`benchmarks/bench_sharding.py` measure (`collective_bytes`)."""

from __future__ import annotations

import math
import re

_COLLECTIVE = re.compile(
    r"=\s*(\([^)]*\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter|collective-broadcast)"
    r"(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def collective_bytes(hlo_text: str) -> dict:
  """Bytes each cross-device op of compiled HLO produces, per device.

  Args:
    hlo_text: ``jax.jit(f).lower(...).compile().as_text()``.

  Returns:
    ``{op name: [bytes of each instance]}`` over all-gather, all-reduce,
    collective-permute, all-to-all, reduce-scatter (async ``*-start`` counted once).
  """
  out = {}
  for m in _COLLECTIVE.finditer(hlo_text):
    total = 0
    for dtype, dims in _SHAPE.findall(m.group(1)):
      if dtype in ("token", "u32") and not dims:
        continue
      n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
      total += n * _dtype_bytes(dtype)
    out.setdefault(m.group(2), []).append(total)
  return out


def _dtype_bytes(hlo_dtype: str) -> int:
  if hlo_dtype == "pred":
    return 1
  digits = "".join(c for c in hlo_dtype if c.isdigit())
  return max(int(digits) // 8, 1) if digits else 4
