"""What every sub-command of ``benchmarks/long_context.py`` shares: options, errors, headers.

Each table writes CSV + PNG + a markdown table into ``--out`` (default
``docs/results/long_context/TABLE``; with ``--smoke``, ``runs/long_context_smoke/TABLE`` so a
smoke run never touches stored results), shows tqdm progress (``--no-progress`` hides it),
continues an earlier run with ``--reuse`` (rows already in the CSV are skipped) and refuses to
overwrite one without ``--overwrite``. Errors in the options print
``long_context.py CMD: error: ...`` to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

__all__ = ["add_common", "out_dir", "guarded", "command_line", "header", "record_command"]


def add_common(parser: argparse.ArgumentParser, table: str) -> None:
    """The options every table takes."""
    parser.add_argument(
        "--out", default=None,
        help=f"folder for the CSV, PNG and markdown (default docs/results/long_context/{table}; "
        f"with --smoke runs/long_context_smoke/{table})",
    )  # fmt: skip
    parser.add_argument("--reuse", action="store_true", help="continue: skip rows in the CSV")
    parser.add_argument("--overwrite", action="store_true", help="start the CSV over")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds), for tests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument(
        "--flush-denormals", action="store_true",
        help="flush subnormal floats to zero (torch.set_flush_denormal): a sharp soft hash's "
        "bucket probabilities below 1.2e-38 otherwise slow x86 matmuls several-fold",
    )  # fmt: skip
    parser.set_defaults(table=table)


def out_dir(args) -> Path:
    """``--out``, or the table's default folder."""
    if args.out:
        return Path(args.out)
    root = "runs/long_context_smoke" if args.smoke else "docs/results/long_context"
    return Path(root) / args.table


def command_line(argv) -> str:
    """The command that reproduces this table, for the markdown header (``--reuse``,
    ``--overwrite`` and the grid's ``--report-only`` dropped: they do not change the rows)."""
    args = [a for a in (sys.argv[1:] if argv is None else argv)
            if a not in ("--reuse", "--overwrite", "--report-only")]  # fmt: skip
    return "python benchmarks/long_context.py " + shlex.join(args)


def record_command(path: Path, argv, *, wrote: bool, fresh: bool = False) -> list[str]:
    """The commands that wrote rows into a resumable table, kept one per line in ``path``
    (``TABLE.commands.txt`` beside its CSV): this call's ``command_line(argv)`` is appended
    when it ``wrote`` rows and is not there yet; ``fresh`` (``--overwrite``) starts the list
    over. -> the list, oldest first (this call's command alone when none is recorded: a
    table written before the list was kept)."""
    this = command_line(argv)
    known = [] if fresh or not path.exists() else path.read_text().splitlines()
    if wrote and this not in known:
        known.append(this)
        path.write_text("".join(line + "\n" for line in known))
    return known or [this]


def header(
    title: str, argv, *, cpu_s: float, extra: list[str] = (), resumable: bool = True,
    rows_cpu: bool | None = None, commands: list[str] | None = None,
) -> str:  # fmt: skip
    """The markdown header: title, command, threads and CPU time (of the CSV's rows, or of
    this run when the output is not a resumable table; ``rows_cpu`` overrides: a table
    gathered from others reports its rows' CPU time without being resumable). ``commands``:
    every call that wrote the table's rows (``record_command``), listed when more than one."""
    note = " (add `--reuse` to continue a stopped run)" if resumable else ""
    rows_cpu = resumable if rows_cpu is None else rows_cpu
    what = "of the rows in the CSV" if rows_cpu else "of this run"
    if commands and len(commands) > 1:
        calls = [
            "Commands (each call that wrote rows, in order; add `--reuse` to all but the first):",
            "",
            *(f"- `{c}`" for c in commands),
        ]
    else:
        calls = [f"Command: `{commands[0] if commands else command_line(argv)}`{note}"]
    lines = [
        f"# {title}",
        "",
        *calls,
        "",
        f"Torch threads: {torch.get_num_threads()}. CPU time {what}: "
        f"{cpu_s:.0f} s ({cpu_s / 3600:.2f} CPU-hours). Written {time.strftime('%Y-%m-%d')}.",
    ]
    for line in extra:
        lines += ["", line]
    return "\n".join(lines) + "\n"


def guarded(run, args, argv) -> int:
    """``run(args, argv)``, turning a ValueError/TypeError/FileNotFoundError into an
    ``error:`` line on stderr and exit status 2."""
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"--threads must be >= 1, got {args.threads}")
            torch.set_num_threads(args.threads)
        if getattr(args, "flush_denormals", False) and not torch.set_flush_denormal(True):
            raise ValueError("--flush-denormals: this CPU cannot flush subnormals (no SSE3)")
        return run(args, argv)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"long_context.py {args.table}: error: {err}", file=sys.stderr)
        return 2
