"""The plain-XLA backend (the CPU default): its plan (`plan`: chunk sizes and splits), dense
caches (`dense`) and sparse index lists (`sparse`).

What the rest of fdecode uses: `BACKEND` (the path as a
`fdecode.kernels.backend.Backend`, `backend`), `make_plan` / `XlaPlan` (a call's launch), `xla_partials`
and `sparse_partials` (the per-split states), `invariant_partials` (the batch-invariant
mode's one merged state), `split_count` (the split rule other
plans share on a CPU host)."""

from fdecode.kernels.xla.backend import BACKEND
from fdecode.kernels.xla.dense import xla_partials
from fdecode.kernels.xla.invariant import invariant_partials, split_tokens
from fdecode.kernels.xla.plan import XlaPlan, make_plan, split_count
from fdecode.kernels.xla.sparse import sparse_partials

__all__ = ["BACKEND", "XlaPlan", "invariant_partials", "make_plan", "split_tokens", "split_count", "sparse_partials", "xla_partials"]
