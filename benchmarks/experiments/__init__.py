"""Experiments that measure or diagnose the library (not part of the package; see DESIGN.md).

``benchmarks/`` is on pytest's ``pythonpath`` so tests import ``experiments....``; the CLI
scripts in ``benchmarks/`` put their own folder on ``sys.path``.
"""
