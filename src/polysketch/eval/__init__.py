"""Fidelity measurement, benchmarks and reports."""
