"""Experiments: paper-table reproductions, diagnoses and studies that measure the library.

Not part of the installed package (DESIGN.md: the package holds what a user imports or runs from
the CLI): each module imports ``polysketch``, never the other way, and is tested by ``make test``
(pytest's ``pythonpath`` holds the repository root, so tests ``import experiments``). Run one
from the repository root with polysketch importable (``make`` installs it into ``.venv``):

    python -m experiments.quality             # softmax vs polynomial vs sketches, equal budgets
    python -m experiments.quality_diagnosis_cli --poly-ckpt RUN/runs/polynomial/ckpt.pt
    python -m experiments.llops_table3        # LLoPS Table 3 on captured queries and keys
    python -m experiments.hrf_table1          # HRF Table 1: softmax estimators on UCI data
    python -m experiments.llops_normalizers   # signed LLoPS scores: negative normalizers
    python -m experiments.linearize_llama     # a Llama trained here, then linearized
    python benchmarks/long_context.py grid   # the copy probe over distances, schedules, seeds
"""
