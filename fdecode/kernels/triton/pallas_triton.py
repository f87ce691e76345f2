"""Pallas' Triton backend (``jax.experimental.pallas.triton``, deprecated in JAX 0.11), when
this JAX has it: `plgpu`, or None with `MISSING` saying why.

Every Triton kernel module imports ``plgpu`` from here, so fdecode imports and runs on a
JAX without it: `fdecode.route` then sends GPU calls to the Hopper MLA kernel where it
applies and to the XLA path elsewhere (one warning), and refuses ``impl="pallas"`` by name;
the Hopper kernels merge their splits with XLA instead of the Triton combine
(`fdecode.kernels.mosaic_gpu.ops.combine`)."""

from __future__ import annotations

import jax

try:
  from jax.experimental.pallas import triton as plgpu
except ImportError as e:  # a JAX without Pallas' Triton backend
  plgpu = None
  MISSING = f"jax.experimental.pallas.triton is not importable in jax {jax.__version__} ({e})"
else:
  MISSING = None

__all__ = ["MISSING", "available", "plgpu"]


def available() -> bool:
  """Whether this JAX has Pallas' Triton backend."""
  return plgpu is not None
