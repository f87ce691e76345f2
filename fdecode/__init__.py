"""fdecode: FlashDecode attention for LLM decoding in JAX."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from fdecode.api import flash_decode, plan
from fdecode.cascade import cascade_decode
from fdecode.combine import apply_sinks, combine_across, merge_states
from fdecode.ragged import ragged_decode
from fdecode.sharding import sharded_flash_decode

__all__ = ["apply_sinks", "cascade_decode", "combine_across", "flash_decode", "merge_states", "plan", "ragged_decode", "sharded_flash_decode"]
__version__ = "0.1.0"

# Old import paths (before issue 33's folders) -> the modules that hold their names now. They keep
# working for one release: the first import of an old path imports its new module(s) and warns
# (DeprecationWarning); nothing here is imported until someone asks for an old path.
MOVED = {
    "fdecode.generate": ("fdecode.decoding.generate", "fdecode.models.base"),
    "fdecode.serving": ("fdecode.decoding.serving",),
    "fdecode.beam": ("fdecode.decoding.beam",),
    "fdecode.quant": ("fdecode.kernels.common.quant",),
    "fdecode.modifiers": ("fdecode.kernels.common.modifiers",),
    "fdecode.sparse": ("fdecode.kernels.common.sparse",),
    "fdecode.chips": ("fdecode.kernels.common.chips",),
    "fdecode.meshes": ("fdecode.cache.meshes",),
    "fdecode.ragged_checks": ("fdecode.ragged.checks",),
    "fdecode.demo": ("fdecode.cli.synthetic",),
    "fdecode.multihost_demo": ("fdecode.cli.multihost_demo",),
    "fdecode.compile_check": ("fdecode.devtools.compile_check",),
    "fdecode.kernels.block": ("fdecode.kernels.common.block",),
    "fdecode.kernels.mosaic_tpu_plan": ("fdecode.kernels.mosaic_tpu.plan",),
    "fdecode.kernels.mosaic_tpu_sparse": ("fdecode.kernels.mosaic_tpu.sparse",),
    "fdecode.kernels.mosaic_tpu_token_major": ("fdecode.kernels.mosaic_tpu.token_major",),
    "fdecode.kernels.xla_sparse": ("fdecode.kernels.xla.sparse",),
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Finds an old path of `MOVED` and loads it as its new module (one target: the very module,
  so ``fdecode.serving.Engine is fdecode.decoding.serving.Engine``; several: a module holding
  their public names)."""

  def find_spec(self, fullname, path=None, target=None):
    return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

  def create_module(self, spec):
    return None

  def exec_module(self, module):
    old, targets = module.__name__, MOVED[module.__name__]
    # stacklevel 2: the importer's line (warnings skips importlib's own frames)
    warnings.warn(f"{old} moved to {' and '.join(targets)}; the old path goes away in the next release",
                  DeprecationWarning, stacklevel=2)
    new = [importlib.import_module(t) for t in targets]
    if len(new) == 1:
      sys.modules[old] = new[0]  # the import system returns what sys.modules holds after exec
      return
    for mod in new:
      names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
      module.__dict__.update({n: getattr(mod, n) for n in names})


if not any(isinstance(f, MovedModules) for f in sys.meta_path):
  sys.meta_path.insert(0, MovedModules())  # first: it answers only the old names of MOVED


def __getattr__(name):
  """``fdecode.Config`` (no public function takes it; issue 33) for one release, with a warning."""
  if name == "Config":
    warnings.warn("fdecode.Config leaves the public API in the next release: no public function takes it. "
                  "Pass num_splits / block_k to flash_decode; fdecode.plan(...) shows what a call decides. "
                  "It stays importable as fdecode.config.Config", DeprecationWarning, stacklevel=2)
    from fdecode.config import Config  # pylint: disable=g-import-not-at-top
    return Config
  raise AttributeError(f"module 'fdecode' has no attribute {name!r}")
