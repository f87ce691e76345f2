"""The randomized leg of the compile tier (issue 31): shapes drawn by hypothesis
(tests/compile_tier/fuzz.py), each compiled deviceless for H100, A100 and TPU v5e like the
fixed cases, in the same workers (the `compiled` fixture, tests/compile_tier/conftest.py).

CI: a fixed seed and ``FDECODE_COMPILE_FUZZ_EXAMPLES`` draws (default 9: 6 decodes, 1 MLA,
1 ragged step, 8 distinct shapes; what fits the 30-minute CI beside the rest), each
compiled for every target. ``FDECODE_COMPILE_FUZZ=long``: random seeds, 60 shapes. A failing
case's name is the case: add it to `fuzz.FOUND` to keep it as a fixed case. Asserts, per
shape and chip: it compiles; on GPU every fdecode kernel has no register spills and fits
the chip's shared memory, and a decode launches at most two fdecode kernels.
"""

import pytest

from fdecode.kernels.common import chips

import fuzz

TARGETS, NAMES = fuzz.TARGETS, fuzz.drawn_names()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_drawn_shape_compiles(compiled, target, name):
  report = compiled[target][name]
  assert report["ok"], f"{name} on {target}: {report.get('error')}"
  if target not in chips.GPUS:
    return
  gpu = chips.GPUS[target]
  kernels = report["kernels"]
  for k in kernels:
    assert k.get("spill_stores") == 0 and k.get("spill_loads") == 0, f"{name} on {target}: {k} spills"
    assert k["smem"] <= gpu.smem_per_block, f"{name} on {target}: {k['smem']} B shared memory"
  if "kind=decode" in name or "kind=mla" in name:
    assert len(kernels) <= 2, f"{name} on {target}: {[k['name'] for k in kernels]}"
