"""docs/api.md from the docstrings: every public name of fdecode's public modules, its
signature and its docstring as written.

``python -m fdecode.devtools.api_docs`` rewrites docs/api.md (``--check``: exit 1 if it is
not current). A name is public when its module lists it in ``__all__``; `PUBLIC_MODULES`
are the modules a user imports, in the order the page shows them.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys

PUBLIC_MODULES = (
    "fdecode",
    "fdecode.cache",
    "fdecode.flax",
    "fdecode.flax.prefix",
    "fdecode.ragged",
    "fdecode.decoding.generate",
    "fdecode.decoding.beam",
    "fdecode.decoding.serving",
    "fdecode.decoding.compilation_cache",
    "fdecode.models",
    "fdecode.kernels.mosaic_gpu",
)

DEFAULT_PATH = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md"

_HEADER = """# API reference

Every public name of fdecode, by module: its signature and its docstring. Generated from
the code by `python -m fdecode.devtools.api_docs` (a test checks that this page is current
and names everything each module exports). The rules every call follows are in
[semantics.md](semantics.md); examples in [guide.md](guide.md).

Legend: B batch, T new tokens per sequence, Hq / Hkv query / kv heads, G = Hq // Hkv, S
cache capacity, Dk / Dv head dims, P pages, page_size tokens per page, N packed rows of a
serving step, M sequence slots.
"""


def public_names(module_name: str) -> list[str]:
  """``module_name``'s ``__all__`` (a public module must declare it)."""
  module = importlib.import_module(module_name)
  names = getattr(module, "__all__", None)
  if names is None:
    raise ValueError(f"{module_name} declares no __all__: its public names are not written down")
  return list(names)


def _doc(obj) -> str:
  doc = inspect.getdoc(obj)
  return "```text\n" + doc.strip() + "\n```\n" if doc else "(no docstring)\n"


class _Written:
  """An annotation as written in the source (``from __future__ import annotations`` keeps
  them as strings), shown without quotes."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


def _signature(name: str, obj) -> str:
  """``name(params) -> result``, annotations as written, no memory addresses (a sentinel
  default's repr)."""
  try:
    sig = inspect.signature(obj)
  except (TypeError, ValueError):
    return name
  written = lambda a: _Written(a) if isinstance(a, str) else a
  sig = sig.replace(parameters=[p.replace(annotation=written(p.annotation)) for p in sig.parameters.values()],
                    return_annotation=written(sig.return_annotation))
  return re.sub(r" at 0x[0-9a-f]+", "", f"{name}{sig}")


def _entry(qualname: str, obj) -> list[str]:
  if inspect.isclass(obj):
    lines = [f"### class `{_signature(qualname, obj)}`\n", _doc(obj)]
    for attr, member in vars(obj).items():
      if attr.startswith("_"):
        continue
      if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
      if isinstance(member, property):
        lines += [f"#### property `{qualname}.{attr}`\n", _doc(member)]
      elif inspect.isfunction(member):
        lines += [f"#### `{_signature(f'{qualname}.{attr}', member)}`\n", _doc(member)]
    return lines
  if callable(obj):
    return [f"### `{_signature(qualname, obj)}`\n", _doc(obj)]
  return [f"### `{qualname} = {obj!r}`\n"]


def render() -> str:
  """The whole page."""
  out = [_HEADER]
  for module_name in PUBLIC_MODULES:
    module = importlib.import_module(module_name)
    summary = (inspect.getdoc(module) or "").split("\n\n")[0].replace("\n", " ")
    out += [f"## `{module_name}`\n", summary + "\n"]
    for name in public_names(module_name):
      out += _entry(f"{module_name}.{name}", getattr(module, name))
  return "\n".join(out)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  text = render()
  if "--check" in argv:
    current = DEFAULT_PATH.read_text() if DEFAULT_PATH.exists() else ""
    if current != text:
      print(f"{DEFAULT_PATH} is not current: run python -m fdecode.devtools.api_docs", file=sys.stderr)
      return 1
    return 0
  DEFAULT_PATH.write_text(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
