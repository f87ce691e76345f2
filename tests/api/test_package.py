"""`import fdecode`: what it loads, and the names it answers to."""

import importlib
import os
import subprocess
import sys

import pytest

import fdecode


def test_import_fdecode_stays_cheap_and_adds_no_import_hooks():
  heavy = ("flax", "fdecode.decoding", "fdecode.models", "fdecode.cli", "fdecode.devtools")
  code = ("import sys; hooks = list(sys.meta_path); import fdecode; "
          f"print(sorted(m for m in sys.modules if m.startswith({heavy})), "
          "[type(h).__module__ for h in sys.meta_path if h not in hooks and type(h).__module__.startswith('fdecode')])")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
  assert out.stdout.strip() == "[] []", out.stdout


@pytest.mark.parametrize("old", ["fdecode.generate", "fdecode.serving", "fdecode.quant", "fdecode.demo",
                                 "fdecode.kernels.block"])
def test_paths_from_before_the_folders_are_gone(old):
  """Nothing was released under them: they are not kept as aliases."""
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module(old)


def test_public_names():
  assert sorted(fdecode.__all__) == ["apply_sinks", "cascade_decode", "combine_across", "flash_decode",
                                     "merge_states", "plan", "ragged_decode", "sharded_flash_decode"]
  for name in fdecode.__all__:
    assert callable(getattr(fdecode, name)), name
  with pytest.raises(AttributeError):
    fdecode.Config  # pylint: disable=pointless-statement
