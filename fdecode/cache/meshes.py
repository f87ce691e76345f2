"""Small helpers for arrays typed on a mesh's Explicit axes (the `jax.make_mesh` default).

On Explicit axes a sharding is part of an array's type, and JAX refuses to guess the
output sharding of some ops (scatters, gathers from a sharded index, contractions over a
sharded axis); on Auto axes the compiler decides. These helpers tell the two apart.
"""

from __future__ import annotations

import jax
import numpy as np


def is_explicit(mesh) -> bool:
  """Whether ``mesh`` has at least one Explicit axis."""
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def explicit_sharding(x):
  """``x``'s NamedSharding if ``x`` is typed on Explicit mesh axes, else None (under
  tracing too: reads the abstract type)."""
  sharding = jax.typeof(x).sharding
  return sharding if is_explicit(getattr(sharding, "mesh", None)) else None


def replicated(x):
  """``x`` gathered to every device of its Explicit mesh; unchanged otherwise. For small
  arrays (block tables, positions, attention outputs) whose sharded layout would make a
  following gather or contraction ambiguous."""
  sharding = explicit_sharding(x)
  if sharding is None:
    return x
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))


def host_values(x):
  """``x``'s values as numpy when they are known on this host: not traced, and fully
  addressable or replicated (a global array of a multi-host mesh may be neither); else
  None. For value checks that run only on concrete inputs."""
  if isinstance(x, jax.core.Tracer):
    return None
  if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
    return None
  return np.asarray(x)
