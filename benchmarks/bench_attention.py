"""Attention speed benchmark (same as ``polysketch bench``); see ``polysketch.eval.bench``
(measurements) and ``polysketch.commands.bench`` (options).

Usage: python benchmarks/bench_attention.py [--quick] [--lengths 1k,2k,...] [--out DIR]
"""

from polysketch.commands.bench import main  # the CLI of polysketch.eval.bench

if __name__ == "__main__":
    raise SystemExit(main())
