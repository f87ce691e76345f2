"""Thin command-line mains over the package: `fdecode.cli.demo` (Gemma 3; the ``fdecode-demo``
console script, ``scripts/demo``, ``python -m fdecode.cli.demo``; ``--synthetic``:
`fdecode.cli.synthetic`) and `fdecode.cli.multihost_demo` (``scripts/multihost_demo``)."""

from __future__ import annotations

import os
import sys

# The scripts/ wrappers set it to the path they were run as.
PROG_ENV_VAR = "FDECODE_PROG"


def prog(module: str) -> str:
  """The command as the user ran it, for usage lines and ``--help``: ``$FDECODE_PROG``
  (``scripts/demo``), a console script's name (``fdecode-demo``), else ``python -m module``
  (``sys.argv[0]`` is then the module's file)."""
  name = os.environ.get(PROG_ENV_VAR)
  if name:
    return name
  argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
  if argv0 and not argv0.endswith(".py") and argv0 not in ("-c", "-m"):
    return argv0
  return f"python -m {module}"
