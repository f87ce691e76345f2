"""Thin command-line mains over the package: ``python -m fdecode.cli.demo`` (`scripts/demo`:
Gemma 3; ``--synthetic``: `fdecode.cli.synthetic`) and ``python -m fdecode.cli.multihost_demo``
(`scripts/multihost_demo`)."""
