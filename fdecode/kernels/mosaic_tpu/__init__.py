"""The TPU backend (Pallas Mosaic): block sizes, VMEM and splits (`plan`); the entry
(`kernel.mosaic_partials`) over the contiguous (`contiguous`) and paged (`paged`) kernels;
token-major reads (`token_major`), sparse index lists (`sparse`); what the kernels share
(`shared`) and their operands by name (`operands`).

What the rest of fdecode uses: `BACKEND` (the kernels as a
`fdecode.kernels.backend.Backend`, `backend`), `make_plan` / `CallPlan` (a call's plan: its path, reads
and launch sizes), `mosaic_partials` and `mosaic_sparse_partials` (the per-split states),
`contiguous_as_pool` (a contiguous token-major cache as the pool the paged kernel reads)."""

from fdecode.kernels.mosaic_tpu.backend import BACKEND
from fdecode.kernels.mosaic_tpu.kernel import mosaic_partials
from fdecode.kernels.mosaic_tpu.plan import CallPlan, make_plan
from fdecode.kernels.mosaic_tpu.sparse import mosaic_sparse_partials
from fdecode.kernels.mosaic_tpu.token_major import contiguous_as_pool

__all__ = ["BACKEND", "CallPlan", "contiguous_as_pool", "make_plan", "mosaic_partials", "mosaic_sparse_partials"]
