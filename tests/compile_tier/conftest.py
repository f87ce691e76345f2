"""The compile tier's one compile run: the `compiled` fixture."""

import os

import pytest

from fdecode.devtools.compile_check import run_targets

import cases
import fuzz

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def compiled(request):
  """target -> case -> report of every case the selected tests read: the fixed cases
  (test_compile_tier.py, `cases.names_for`) and the drawn shapes (test_compile_fuzz.py,
  `fuzz.drawn_names`). One `run_targets` call compiles both, so each target starts two
  workers, not four, and the two lanes end together."""
  files = {item.path.name for item in request.session.items}
  names = {}
  if "test_compile_tier.py" in files:
    names = {t: cases.names_for(t) for t in cases.TARGETS}
  if "test_compile_fuzz.py" in files:
    for t in fuzz.TARGETS:
      names[t] = list(dict.fromkeys(names.get(t, []) + fuzz.drawn_names()))
  return run_targets(os.path.join(HERE, "cases.py"), names)
