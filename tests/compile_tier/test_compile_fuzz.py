"""The randomized leg of the compile tier (issue 31): shapes drawn by hypothesis
(tests/compile_tier/fuzz.py), each compiled deviceless for H100, A100 and TPU v5e like the
fixed cases (`fdecode.devtools.compile_check`, `run_targets`).

CI: a fixed seed and ``FDECODE_COMPILE_FUZZ_EXAMPLES`` draws (default 9: 6 decodes, 1 MLA,
1 ragged step, 8 distinct shapes; what fits the 30-minute CI beside the rest), each
compiled for every target. ``FDECODE_COMPILE_FUZZ=long``: random seeds, 60 shapes. A failing
case's name is the case: add it to `fuzz.FOUND` to keep it as a fixed case. Asserts, per
shape and chip: it compiles; on GPU every fdecode kernel has no register spills and fits
the chip's shared memory, and a decode launches at most two fdecode kernels.
"""

import os

import pytest
from hypothesis import given, settings

from fdecode.kernels.common import chips
from fdecode.devtools.compile_check import run_targets

import fuzz

HERE = os.path.dirname(os.path.abspath(__file__))
LONG = os.environ.get("FDECODE_COMPILE_FUZZ") == "long"
EXAMPLES = int(os.environ.get("FDECODE_COMPILE_FUZZ_EXAMPLES", 60 if LONG else 9))
TARGETS = [t for t in os.environ.get("FDECODE_COMPILE_TARGETS", "h100,a100,v5e,v6e").split(",")
           if t in ("h100", "a100", "v5e")]


def drawn_names() -> list[str]:
  """The leg's shapes: hypothesis draws (derandomized unless long), named by `fuzz.name_of`:
  two thirds flash_decode calls, a sixth each MLA and ragged_decode steps."""
  names = []
  for kind, share in (("decode", 4), ("mla", 1), ("ragged", 1)):
    @settings(max_examples=max(1, EXAMPLES * share // 6), derandomize=not LONG, database=None, deadline=None)
    @given(spec=fuzz.specs(kind))
    def collect(spec):
      names.append(fuzz.name_of(spec))
    collect()
  return list(dict.fromkeys(fuzz.FOUND + names))


NAMES = drawn_names()


@pytest.fixture(scope="session")
def fuzz_reports():
  return run_targets(os.path.join(HERE, "cases.py"), {t: NAMES for t in TARGETS})


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", NAMES)
def test_drawn_shape_compiles(fuzz_reports, target, name):
  report = fuzz_reports[target][name]
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
