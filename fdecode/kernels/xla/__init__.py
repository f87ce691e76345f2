"""The plain-XLA backend (the CPU default): its plan (`plan`: chunk sizes and splits), dense
caches (`dense`) and sparse index lists (`sparse`).

What the rest of fdecode uses: `make_plan` / `XlaPlan` (a call's launch), `xla_partials`
and `sparse_partials` (the per-split states), `occupancy_splits` (the split rule other
plans share on a CPU host)."""

from fdecode.kernels.xla.dense import xla_partials
from fdecode.kernels.xla.plan import XlaPlan, make_plan, occupancy_splits
from fdecode.kernels.xla.sparse import sparse_partials

__all__ = ["XlaPlan", "make_plan", "occupancy_splits", "sparse_partials", "xla_partials"]
