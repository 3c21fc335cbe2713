"""The ``polysketch`` command line.

Each subcommand lives in its own module under ``polysketch.commands`` and exposes
``add_parser(subparsers) -> argparse.ArgumentParser`` (which sets ``func`` via
``set_defaults``); this module only discovers and dispatches them.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import pkgutil
import sys

from . import __version__, commands
from ._malloc import hold_freed_memory


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


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Command name -> its parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _suggestion(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """' (did you mean --x?)' for the first unknown flag close to one of ``parser``'s."""
    flags = [o for action in parser._actions for o in action.option_strings]
    for word in extra:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the chosen command (glibc's malloc set
    to keep freed memory for the process first: ``polysketch._malloc``)."""
    hold_freed_memory()
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if extra:  # a typo'd flag: the command's own usage, not the top-level one
        command = _subparsers(parser).get(getattr(args, "command", None), parser)
        command.error(f"unrecognized arguments: {' '.join(extra)}{_suggestion(command, extra)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
