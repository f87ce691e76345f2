"""The built wheel carries the license pyproject declares and the PEP 561 ``py.typed``."""

import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_wheel_has_license_and_py_typed(tmp_path):
  meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert meta["license"] == "Apache-2.0"
  license_text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
  # The same build path as the install (`pip install -e`): PEP 517 with build isolation,
  # from a copy of the sources (setuptools writes build/ and egg-info into the tree).
  src = tmp_path / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, src / name)
  shutil.copytree(ROOT / "fdecode", src / "fdecode", ignore=shutil.ignore_patterns("__pycache__"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                 check=True, capture_output=True, timeout=300)
  wheel, = tmp_path.glob("fdecode-*.whl")
  with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert licenses, names
    assert z.read(licenses[0]).decode() == license_text
    assert "fdecode/py.typed" in names
    metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
  assert "License-Expression: Apache-2.0" in metadata
