"""The ``polysketch`` command line.

Each subcommand lives in its own module under ``polysketch.commands`` and exposes
``add_parser(subparsers) -> argparse.ArgumentParser`` (which sets ``func`` via
``set_defaults``); this module only discovers and dispatches them.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import __version__, commands


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per module in ``polysketch.commands``."""
    parser = argparse.ArgumentParser(
        prog="polysketch",
        description="Linear-time kernelized attention: fidelity, speed, training and demos.",
    )
    parser.add_argument("--version", action="version", version=f"polysketch {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the chosen command."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
