"""The differential fuzzer (tests/kernels/test_fuzz.py) on the compiled GPU kernels (issue 31):
random valid `flash_decode` calls, ``impl="pallas"`` compiled for the local GPU, against
the float64 numpy oracle. Skipped unless ``jax.default_backend() == "gpu"``;
`scripts/gpu_check` runs it.

Shapes are the ones that broke the Triton lowering and others like them: T up to 16,
G = 1..12 including 3, 5, 6, 7, MQA with 40 / 48 query heads, head dims the kernel tiles
(multiples of 16 for every piece and scale tile), k_rope of 32 columns, page sizes 1 to
64, lengths 0 .. S, every cache form and modifier the CPU fuzzer draws, garbage in every
dead slot. ``FDECODE_GPU_FUZZ_EXAMPLES`` (default 25) examples per shard, 8 shards (one
per pytest-xdist worker), random seeds (hypothesis prints the failing call).

Tolerances: bfloat16 as the CPU fuzzer's; float32 5e-3, since Triton's float32 dots may
run in TF32 on the GPU (10-bit mantissa) whatever precision the kernel asks for.
"""

import os

import jax
import pytest

if jax.default_backend() != "gpu":
  pytest.skip(f"needs a GPU: jax.default_backend() is {jax.default_backend()!r} "
              "(run scripts/gpu_check on a CUDA machine)", allow_module_level=True)

from hypothesis import given, settings

from helpers import fuzz
from helpers.fuzz import COMMON, valid_cases

GPU_SHAPES = dict(
    b=[1, 2, 3], t=[None, 1, 2, 3, 5, 9, 12, 16],
    heads=[(2, 2), (8, 2), (6, 2), (10, 2), (14, 2), (12, 1), (24, 2), (40, 1), (48, 1), (7, 1), (16, 8), (35, 5)],
    head_dims=[(64, 64), (128, 128), (128, 64), (256, 256), (192, 128)],
    contiguous_s=[1, 16, 37, 129, 300], pages=[(1, 40), (12, 9), (16, 7), (64, 3)],
    splits=[None, 1, 2, 3, 64], block_k=[None, 16, 32], rope=32)
EXAMPLES = int(os.environ.get("FDECODE_GPU_FUZZ_EXAMPLES", 25))


_CPU_TOLERANCES = fuzz.tolerances


def _gpu_tolerances(c):
  if c["dtype"] == "float32" and c["cache_form"] != "other-float":
    return dict(out=(5e-3, 5e-3), lse=(5e-3, 5e-3))
  return _CPU_TOLERANCES(c)


fuzz.tolerances = _gpu_tolerances  # this module loads on a GPU only


@pytest.mark.parametrize("shard", range(8))
@settings(max_examples=EXAMPLES, derandomize=False, **COMMON)
@given(c=valid_cases(shapes=GPU_SHAPES))
def test_compiled_kernels_match_float64_oracle(shard, c):
  del shard  # one hypothesis run per xdist worker; each draws its own random examples
  fuzz.check_valid("pallas", c)
