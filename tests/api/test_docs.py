"""The documentation's Python examples run as written, and its links lead somewhere.

Each file's blocks run in order in one namespace of their own (README.md, docs/*.md,
CONTRIBUTING.md): a page's examples build on each other, never on another page's."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])


def _blocks(page):
  return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_examples_run(page):
  namespace: dict = {"__name__": f"doc:{page.name}"}
  for i, block in enumerate(_blocks(page)):
    try:
      exec(compile(block, f"{page.relative_to(ROOT)} python block {i}", "exec"), namespace)  # pylint: disable=exec-used
    except Exception as e:  # name the failing block
      raise AssertionError(f"{page.relative_to(ROOT)}: python block {i} failed: {e!r}\n{block}") from e


def _anchors(page) -> set[str]:
  """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
  heads = re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists()], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"[a-z]+:", target):
      continue  # an outside address
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
      broken.append(target)
    elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
      broken.append(target)
  assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


def test_readme_first_screen_installs_and_calls():
  """A newcomer meets the install line and a flash_decode call before any test or CI detail."""
  text = (ROOT / "README.md").read_text()
  install, quick, call = text.index("## Install"), text.index("## Quickstart"), text.index("fdecode.flash_decode(")
  assert install < quick < call < 3000, (install, quick, call)
  assert len(text) < 49415 // 3, f"README.md is {len(text)} bytes"
