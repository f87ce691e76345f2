"""fdecode's imports go down its layers: no module imports from a layer above its own, no
import circle, and nothing outside a kernel package reaches into its modules.

The layer order, written down once (top first; a module may import its own layer and
those below it):
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "fdecode"

LAYERS = (
    ("fdecode.cli", "fdecode.devtools"),                           # tools over everything
    ("fdecode.decoding", "fdecode.models"),                        # loops over models, models
    ("fdecode.flax",),                                             # layers
    ("fdecode",),                                                  # the package face
    ("fdecode.api", "fdecode.ragged", "fdecode.cascade", "fdecode.sharding"),  # entry points
    # the canonical call and its options, the one route to a backend, its derivative
    ("fdecode.call", "fdecode.options", "fdecode.dispatch", "fdecode.route", "fdecode.derivatives"),
    ("fdecode.kernels",),                                          # backends, their plans and block math
    ("fdecode.cache",),                                            # cache formats, quantization, writes
    ("fdecode.validation", "fdecode.combine", "fdecode.config", "fdecode.reference"),  # the base
)
__doc__ += "\n".join(f"  {i}. {', '.join(names)}" for i, names in enumerate(LAYERS))

KERNEL_PACKAGES = ("fdecode.kernels.triton", "fdecode.kernels.mosaic_gpu", "fdecode.kernels.mosaic_tpu",
                   "fdecode.kernels.xla")


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
  """The fdecode modules ``name`` imports at module level or inside functions (a name
  imported from a package counts as its module when it is one)."""
  found = set()
  for node in ast.walk(ast.parse(MODULES[name].read_text())):
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fdecode"):
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        found.add(sub if sub in MODULES else node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("fdecode"))
  return found - {name}


def layer(name: str) -> int:
  """The index in `LAYERS` of the longest layer prefix of ``name``."""
  best = None
  for i, prefixes in enumerate(LAYERS):
    for prefix in prefixes:
      if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
        best = (i, prefix)
  assert best is not None, f"{name} is in no layer: add it to LAYERS"
  return best[0]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers(name):
  upward = [f"{target} (layer {layer(target)})" for target in sorted(_imports(name)) if layer(target) < layer(name)]
  assert not upward, f"{name} (layer {layer(name)}) imports from above its layer: {upward}"


def test_no_import_circle():
  graph = {name: {t for t in _imports(name) if t in MODULES}
           for name in MODULES}
  done, path = set(), []

  def visit(node):
    if node in path:
      cycle = path[path.index(node):] + [node]
      raise AssertionError(f"import circle: {' -> '.join(cycle)}")
    if node in done:
      return
    path.append(node)
    for nxt in sorted(graph[node]):
      visit(nxt)
    path.pop()
    done.add(node)

  for name in sorted(graph):
    visit(name)


@pytest.mark.parametrize("package", KERNEL_PACKAGES)
def test_kernel_internals_stay_inside_their_package(package):
  """Outside a kernel package, only its face (``package`` itself) is imported."""
  reaching = [f"{name} -> {target}" for name in sorted(MODULES) if not name.startswith(package)
              for target in sorted(_imports(name)) if target.startswith(package + ".")]
  assert not reaching, reaching


def test_every_module_has_a_layer():
  for name in MODULES:
    layer(name)


def _functions(name):
  return [n for n in ast.walk(ast.parse(MODULES[name].read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_only_the_route_calls_lower():
  """`fdecode.route` is the one module that runs per-platform branches (`route.lower`):
  the others ask it (`run_decode`, `lower_step`, `lower_prefill`, `lower_blocks_call`,
  `lower_write`) rather than pass their own rules."""
  callers = []
  for name in sorted(MODULES):
    if name == "fdecode.route":
      continue
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
      f = getattr(node, "func", None)
      if isinstance(node, ast.Call) and ((isinstance(f, ast.Attribute) and f.attr == "lower" and
                                          isinstance(f.value, ast.Name) and f.value.id == "route")
                                         or (isinstance(f, ast.Name) and f.id == "lower")):
        callers.append(f"{name}:{node.lineno}")
  assert not callers, callers


def test_no_keyword_catch_alls_inside_the_library():
  """Inside the kernels, the dispatch, the canonical call and the ragged step no function
  takes ``**kwargs``: a misspelt option is a TypeError. (A public entry point's typed
  ``**options: Unpack[...]`` is its declared keyword set, not a catch-all.)"""
  inside = [n for n in MODULES if n.startswith(("fdecode.kernels", "fdecode.ragged")) or n in ("fdecode.dispatch", "fdecode.call")]
  found = [f"{name}.{fn.name}(**{fn.args.kwarg.arg})" for name in sorted(inside) for fn in _functions(name)
           if fn.args.kwarg is not None and "Unpack" not in ast.unparse(fn.args.kwarg.annotation or ast.Constant(""))]
  assert not found, found
