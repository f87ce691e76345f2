"""Hopper (sm_90) kernels in Pallas' Mosaic GPU backend (TMA + wgmma). The MLA kernel is in
the default dispatch for bf16 MLA on sm_90 (measured 2-7x faster than Triton on an H200,
docs/semantics.md "Backends"); its 8-bit path (int8 / float8_e4m3fn latents with
per-token scales, `mla_decode(..., k_scale=)`) and the rows kernel are opt-in (built,
interpreted on CPU and lowered for sm_90, but no GPU has measured them yet, so Triton
stays the default for those calls). ``fdecode.flash_decode(impl="mosaic_gpu")`` (and
``ragged_decode``) opts in through the main API: both kernels, where they take the call.

`mla_decode` (MLA, one latent kv head, bf16 or 8-bit) and `rows_decode` (GQA over bf16 or
8-bit per-token caches, contiguous or paged pools read in place through the block table at
page sizes 8, 16, 32 and multiples of 64; T new tokens x G query heads as the MMA's rows)
are the public entry points (the final output, like `fdecode.flash_decode`). `mla_plan` /
`rows_plan` decide a launch (`split_count`: the splits both deal a sequence into);
`mla_run` / `rows_run` run a plan to the final output (the kernel, then the Triton
combine: what the sm_90 dispatch and ``impl="mosaic_gpu"`` run); `mla_partials` /
`rows_partials` give the per-split partial states (the states
`fdecode.combine.merge_states` merges); `unsupported` / `rows_unsupported` name what each
cannot take. `InterpretGPUParams`: jax's Mosaic GPU interpreter parameters (``interpret=``
of every entry point: the same kernels and plans on CPU).

What fdecode's route asks of them: `MLA_BACKEND` (the default GPU route's MLA kernel, where
`takes_mla`) and `BACKEND` (``impl="mosaic_gpu"``), `fdecode.kernels.backend.Backend` s;
`refusal` (what of a call neither kernel takes).

Layout: `mla/` (plan, kernel, api) and `gqa/` (plan, kernel, paging, api), one kernel
family each, over what both share: `fdecode.kernels.mosaic_gpu.plan` (the program's
shape, the split rule, the launch checks) and `fdecode.kernels.mosaic_gpu.ops` (the TMA
ring, 8-bit conversion, online softmax, epilogue, launch and Triton-combine hand-off);
`fdecode.kernels.mosaic_gpu.calls` holds the backends.
"""

try:  # jax >= 0.11 exports it; 0.10.2 only privately: waits for a jax>=0.11 floor (the compile tier pins 0.10.2)
  from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
except ImportError:
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

from fdecode.kernels.mosaic_gpu.calls import BACKEND, MLA_BACKEND, refusal, takes_mla
from fdecode.kernels.mosaic_gpu.gqa.api import rows_decode, rows_run
from fdecode.kernels.mosaic_gpu.gqa.kernel import rows_partials, rows_states
from fdecode.kernels.mosaic_gpu.gqa.plan import RowsPlan, rows_plan, rows_unsupported
from fdecode.kernels.mosaic_gpu.mla.api import mla_decode, mla_run
from fdecode.kernels.mosaic_gpu.mla.kernel import mla_partials, mla_states
from fdecode.kernels.mosaic_gpu.mla.plan import MlaPlan, mla_plan, unsupported
from fdecode.kernels.mosaic_gpu.plan import split_count

__all__ = ["BACKEND", "InterpretGPUParams", "MLA_BACKEND", "MlaPlan", "RowsPlan", "mla_decode", "mla_partials",
           "mla_plan", "mla_run", "mla_states", "refusal", "rows_decode", "rows_partials", "rows_plan", "rows_run",
           "rows_states", "rows_unsupported", "split_count", "takes_mla", "unsupported"]
