"""The README's Python examples run as written, in order, in one namespace."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
  assert len(blocks) >= 3, "README lost its examples"
  namespace: dict = {}
  for i, block in enumerate(blocks):
    try:
      exec(compile(block, f"README.md python block {i}", "exec"), namespace)  # pylint: disable=exec-used
    except Exception as e:  # name the failing block
      raise AssertionError(f"README python block {i} failed: {e!r}\n{block}") from e
