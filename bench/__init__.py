"""Benchmarks, run from the repository root as `python -m bench SUBCOMMAND` (see __main__.py)."""
