"""``polysketch demo``: what polysketch is for, measured on this machine, as a report.

Writes ``--out`` (default ``demo-report/``) with ``README.md`` and ``index.html`` (same
blocks, PNGs referenced by relative path) and ``results.json`` (every number in the report).
Three sections, each printing its table when it finishes:

1. quality — the same tiny ``TransformerLM`` (same size, steps, seed, data order) trained on
   ``--corpus`` with exact softmax attention and with PolySketchFormer's ``psf_random``
   attention (linear time; ``polysketch`` if the preset is missing): loss curves, final
   validation loss, a generated sample from the same prompt with the same sampling seed.
2. fidelity — kernel error ‖φq(Q)φk(K)ᵀ − E‖_F/‖E‖_F vs feature dim of every feature map
   against its target kernel E (polynomial maps at degree 4: (q·k)^4; softmax random
   features: exp(q·k/√D)), on the queries/keys the trained models feed their attention
   (after the q/k LayerNorm and RoPE, ``polysketch.eval.fidelity.capture``) and on Gaussian
   data; and the ratio to the Eckart–Young optimum of any map with that state size (LLoPS
   Thm 3.1).
3. speed — causal attention time vs T against ``scaled_dot_product_attention``, the
   crossover length, and decode-step time vs position (``polysketch.eval.bench``).

Every number comes from this run (with ``--sections fidelity`` alone, the captured q/k come
from the models a previous run saved in ``--out/runs``, and the report says so). ``--quick``
is a one-minute version (tiny model, few steps, short sequences) used by the tests.

A non-empty ``--out`` is refused unless ``--overwrite`` is given, so no earlier report or
trained model is lost. Reuse mode: when ``--sections`` has ``fidelity`` but not ``quality``,
``--out`` may hold a previous demo's ``runs/`` (its models are read, never changed); an
earlier report there (README.md, index.html, results.json, its PNGs and CSVs) is replaced
only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from .._checks import check_positive_int
from .._files import atomic_write
from ..eval.demo import (
    CUDA_FULL,
    FULL,
    QUICK,
    DemoSizes,
    Report,
    load_average,
    machine_info,
    section_fidelity,
    section_quality,
    section_speed,
)
from ._common import check_device, fail, io_error, prepare_out_dir

__all__ = ["DemoSizes", "FULL", "CUDA_FULL", "QUICK", "SECTIONS", "add_parser", "run"]

# The section runners live in polysketch.eval.demo; this module parses arguments, runs them and
# writes the report.
SECTIONS = ("quality", "fidelity", "speed")
REPORT_FILES = ("README.md", "index.html", "results.json")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``demo`` on the top-level CLI's ``subparsers``."""
    parser = subparsers.add_parser(
        "demo",
        help="train, measure and benchmark; write a Markdown + HTML report",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="demo-report", help="report folder (default %(default)s)")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run"
    )
    parser.add_argument(
        "--corpus", default="shakespeare", help="shakespeare (default), stdlib or a text path"
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per model")
    parser.add_argument("--lengths", default=None, help="speed: sequence lengths, e.g. 1k,2k,4k")
    parser.add_argument("--quick", action="store_true", help="one-minute version (tiny sizes)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default=None,
        help="torch device (default: cuda when available, else cpu); on CUDA the model, "
        "contexts and lengths grow and training speed is timed against FlashAttention",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="write into a non-empty --out, replacing its report (and, with the quality "
        "section, its runs/); without quality, --out may hold the runs/ to reuse",
    )  # fmt: skip
    parser.set_defaults(func=run)
    return parser


def _loads(*values) -> str:
    """``a–b`` of the known load averages (``-`` when none is known)."""
    known = [f"{v:.2f}" for v in values if v is not None]
    return "–".join(known) if known else "-"


def _finite(x):
    """JSON-safe copy: NaN/inf floats -> None, tensors/paths -> plain values."""
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (int, str, bool)) or x is None:
        return x
    return str(x)


# ----- driver -----------------------------------------------------------------------------------
SECTION_FUNCS = {"quality": section_quality, "fidelity": section_fidelity, "speed": section_speed}


def run(args) -> int:
    """Run the chosen sections and write the report; 1 if a section failed (reported), 2 (with
    an ``error:`` line) for a bad option, ``--device`` or ``--out``."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        check_device(args.device)
        cuda = torch.device(args.device).type == "cuda"
        sizes = QUICK if args.quick else (CUDA_FULL if cuda else FULL)
        if args.steps is not None:
            sizes = replace(sizes, steps=check_positive_int(args.steps, "--steps"))
        if args.threads is not None:
            check_positive_int(args.threads, "--threads")
        _check_out(args)
    except (ValueError, TypeError) as err:
        return fail("demo", err)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, sizes)
    finally:
        torch.set_num_threads(threads)


def _check_out(args) -> None:
    """Refuse an --out whose contents the demo would replace unasked (see the module doc)."""
    out = Path(args.out)
    if "quality" in args.sections or "fidelity" not in args.sections:
        prepare_out_dir(out, overwrite=args.overwrite)
        return
    # reuse mode: the models of --out/runs are read; only the demo's own outputs are refused
    held = sorted(
        p.name for p in (out.iterdir() if out.is_dir() else ())
        if p.name in REPORT_FILES or p.suffix in (".png", ".csv")
    )  # fmt: skip
    if held and not args.overwrite:
        raise ValueError(
            f"--out {out} already holds a report ({', '.join(held[:4])}): pass --overwrite to "
            f"replace it (the models in {out / 'runs'} are only read), or choose another --out"
        )
    prepare_out_dir(out, overwrite=True)  # a file or an unwritable folder is still refused


def _run(args, sizes: DemoSizes) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    report = Report(
        "polysketch demo report" + (" (quick)" if sizes is QUICK else "") + f" on {args.device}"
    )
    report.paragraph(
        "polysketch replaces the T×T softmax attention matrix by kernel feature maps, "
        "s(q, k) ≈ φq(q)·φk(k), so causal attention costs O(T) and decoding keeps a "
        "constant-size state instead of a growing KV cache. This report, produced by "
        "`polysketch demo` on this machine, shows what that buys and costs: model quality "
        "(section 1), how well the maps approximate their kernels (section 2) and speed (3)."
    )
    body = Report("")
    timings, results, failures, state = {}, {}, [], {}
    for name in [s for s in SECTIONS if s in args.sections]:
        start = time.perf_counter()
        try:
            results[name] = SECTION_FUNCS[name](args, sizes, body, state)
        except Exception as err:  # a section that cannot run is reported, the others go on
            failures.append(name)
            detail = "".join(traceback.format_exception_only(type(err), err)).strip()
            body.heading(f"{name}: not run")
            body.note(f"the {name} section failed: {detail}")
            print(f"[{name}] FAILED: {detail}", flush=True)
            traceback.print_exc()
        timings[name] = time.perf_counter() - start
        print(f"[{name}] {timings[name]:.1f} s", flush=True)
    report.heading("Machine and run")
    machine["load_1min_end"] = load_average()
    report.table(
        ["CPUs", "load (1 min) at start–end", "torch threads", "torch", "CUDA", "Python",
         "platform", "date"],
        [[machine["cpu_count"], _loads(machine["load_1min"], machine["load_1min_end"]),
          machine["torch_threads"], machine["torch_version"], machine["cuda_available"],
          machine["python"], machine["platform"], machine["date"]]],
    )  # fmt: skip
    report.table(
        ["section", "wall time (s)"],
        [[n, t] for n, t in timings.items()] + [["total", sum(timings.values())]],
    )
    report.blocks += body.blocks
    try:
        md, page = report.write(out)
        numbers = {"machine": machine, "seconds": timings, "sizes": sizes.__dict__,
                   "failed": failures, **results}  # fmt: skip
        atomic_write(out / "results.json", json.dumps(_finite(numbers), indent=1).encode())
    except OSError as err:
        return fail("demo", io_error(err, out))
    print(f"wrote {md}, {page} and {out / 'results.json'}")
    return 1 if failures else 0
