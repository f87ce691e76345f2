"""Thin command-line mains over the package: ``python -m fdecode.cli.demo`` (`scripts/demo`)."""
