"""Hopper (sm_90) kernels in Pallas' Mosaic GPU backend (TMA + wgmma); opt-in, not yet in
the default dispatch (Triton stays the GPU default until a GPU measures this faster).

`mla_decode` is the public entry point (the final output, like `fdecode.flash_decode`);
`mla_plan` decides a launch, `mla_partials` runs it (per-split partial states, the
states `fdecode.combine.merge_states` merges), `unsupported` names what it cannot
take.
"""

from fdecode.kernels.mosaic_gpu.api import mla_decode
from fdecode.kernels.mosaic_gpu.kernel import mla_partials, mla_states
from fdecode.kernels.mosaic_gpu.plan import MlaPlan, mla_plan, unsupported

__all__ = ["MlaPlan", "mla_decode", "mla_partials", "mla_plan", "mla_states", "unsupported"]
