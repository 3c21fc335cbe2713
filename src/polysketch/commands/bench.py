"""``polysketch bench``: causal attention speed vs torch SDPA (forward, training, decode).

Prints, for T = 1k … 64k on this machine, the median time of causal SDPA, of PolySketchFormer
attention (degree-2 sketch, r = 32, self-tensored: degree 4) and of a plain F = 256 feature map
(positive random features, m = 128), their speed-up over SDPA, achieved GFLOP/s against a
matmul peak measured in the same run, peak memory, the per-token decode time vs position and
the crossover length. ``--mode train`` times forward + backward instead, ``--dtype bf16``
feeds half inputs (FlashAttention on CUDA), ``--device cuda`` measures peak memory, and
``--model`` times whole TransformerLM training steps, ``--decode`` whole-model greedy decoding
ms/token vs position (``polysketch.eval.bench.decode``). Writes ``results.csv`` and
``bench.png`` (``--model``: ``model_results.csv``, ``model_bench.png``; ``--decode``:
``decode_results.csv``) into ``--out``; a non-empty ``--out`` is refused unless
``--overwrite``. See ``polysketch.eval.bench`` for the
FLOP and memory formulas.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .._checks import check_choice, check_float, check_positive_int
from ..eval.bench import (
    DTYPES,
    MALLOC_TOP_PAD,
    METHODS,
    MODES,
    BenchConfig,
    ModelBenchConfig,
    check_model_attentions,
    format_model_report,
    format_report,
    parse_lengths,
    plot_results,
    run_benchmark,
    run_model_benchmark,
    write_csv,
    write_model_outputs,
)
from ..nn.resolve import split_attentions
from ..ops.dispatch import ALGORITHMS
from ._common import add_overwrite_argument, check_device, fail, io_error, prepare_out_dir

__all__ = ["add_parser", "add_arguments", "run_from_args", "main"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on the top-level CLI's ``subparsers``."""
    parser = subparsers.add_parser(
        "bench",
        help="attention speed vs torch scaled_dot_product_attention (CSV, PNG)",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def add_arguments(parser) -> None:
    """Add the benchmark's options to an ``argparse`` parser."""
    parser.add_argument(
        "--lengths", default=None, help="sequence lengths, e.g. '1k,2k,4k' (default 1k..64k)"
    )
    parser.add_argument(
        "--decode-positions", default=None, help="decode positions P (default: the lengths)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small fast version (T <= 512, one timed call)"
    )
    parser.add_argument(
        "--max-memory-gb",
        type=float,
        default=8.0,
        help="skip SDPA sizes whose B·H·T² fp32 score matrix exceeds this (only where SDPA "
        "would use its math backend; FlashAttention/memory-efficient kernels never build it)",
    )
    parser.add_argument("--out", default="bench-results", help="folder for CSV and PNG")
    add_overwrite_argument(parser, "CSV and PNG")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--chunk-size", type=int, default=None,
        help="block size b (default 256; with --model, a model preset's own where it carries "
        "one: soft_hash_far_local's 64, which its window needs)",
    )  # fmt: skip
    parser.add_argument("--min-time", type=float, default=None, help="seconds per measurement")
    parser.add_argument(
        "--rounds", type=int, default=None,
        help="with --model: time the attentions in N interleaved rounds (every model of a "
        "length held at once, each timed min-time/N seconds per round), so that a drifting "
        "machine's speed hits them alike; x softmax is the median of per-round ratios "
        "(default 1: one after the other)",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mode", choices=MODES, default="fwd",
        help="fwd: forward (inference) + decode; train: forward + backward",
    )  # fmt: skip
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="input dtype")
    parser.add_argument("--heads", type=int, default=4, help="attention heads H (B = 1, D = 64)")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}"
    )
    parser.add_argument(
        "--algorithms", default="chunked",
        help="backends the polysketch and positive methods run with, side by side "
        "(comma-separated; chunked: the default dispatch, e.g. chunked,chunked_blocks,triton)",
    )  # fmt: skip
    parser.add_argument(
        "--model", action="store_true",
        help="TransformerLM training tokens/s (softmax vs psf_random vs psf_mixed) instead; "
        "see polysketch.eval.bench.model",
    )  # fmt: skip
    parser.add_argument(
        "--attentions", default=None, metavar="SPECS",
        help="with --model or --decode: comma-separated attentions to time side by side, "
        "each NAME or NAME:key=value,... (model options and map keywords, as polysketch mqar "
        "reads them; default: softmax,psf_random,psf_mixed for --model; the decode set for "
        "--decode), e.g. psf_random,soft_hash_1k:num_features=320,local_window=64",
    )  # fmt: skip
    parser.add_argument(
        "--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
        help="with --model: torch.compile the models (backend inductor when given alone)",
    )  # fmt: skip
    parser.add_argument(
        "--decode", action="store_true",
        help="TransformerLM greedy decoding ms/token vs position (--decode-positions; default "
        "2k,16k; --quick: 256,1k): softmax's KV cache vs psf_random, psf_mixed, hedgehog "
        "states; see polysketch.eval.bench.decode",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="leave glibc malloc as found (default: keep 1 GiB of freed heap, M_TOP_PAD; "
        "see polysketch.eval.bench.MALLOC_TOP_PAD)",
    )


def run_from_args(args) -> int:
    """Run the benchmark for parsed ``args``; print the report; write results.csv, bench.png
    (``--model``: model_results.csv, model_bench.png).

    A bad option (checked before anything runs), a device torch cannot use here, a refused
    ``--out`` (non-empty without ``--overwrite``, a file, unwritable) or a failed write return
    2 with an ``error:`` line.
    """
    try:  # every option is checked before anything runs
        if args.decode:
            config = _decode_config(args)
        else:
            config = _model_config(args) if args.model else _config(args)
        if args.attentions is not None:
            if not (args.model or args.decode):
                raise ValueError("attentions is taken with --model or --decode only")
            parse_attentions(args.attentions)
        if args.rounds is not None and not args.model:
            raise ValueError("rounds is taken with --model only")
        if args.model:
            check_model_attentions(config)
    except (ValueError, TypeError) as err:
        return fail("bench", err)
    try:
        check_device(args.device)
        out = prepare_out_dir(args.out, overwrite=args.overwrite)
    except ValueError as err:
        return fail("bench", err)
    try:
        if args.decode:
            return _run_decode(config, args, out)
        if args.model:
            result = run_model_benchmark(config)
            csv_path, png_path = write_model_outputs(result, out)
            report = format_model_report(result)
        else:
            result = run_benchmark(config)
            csv_path = write_csv(result["rows"], out / "results.csv")
            png_path = plot_results(result["rows"], out / "bench.png")
            report = format_report(result)
    except OSError as err:
        return fail("bench", io_error(err, out))
    except ImportError as err:  # the figure without matplotlib: the error names the extra
        return fail("bench", err)
    print(report)
    print(f"\nwrote {csv_path} and {png_path}")
    return 0


def _decode_config(args):
    """The checked ``DecodeBenchConfig`` of parsed ``args`` (``--decode``): every attention's
    model is built once, so a bad option is reported before ``--out`` is touched."""
    from ..eval.bench.decode import DecodeBenchConfig

    if args.threads is not None:
        check_positive_int(args.threads, "threads")
    positions = (256, 1024) if args.quick else (2048, 16384)
    if args.decode_positions:
        positions = parse_lengths(args.decode_positions)
    extra = {} if args.attentions is None else {"attentions": parse_attentions(args.attentions)}
    config = DecodeBenchConfig(positions=positions, device=args.device, seed=args.seed, **extra,
                               tokens=8 if args.quick else 32,
                               repeats=1 if args.quick else 3)  # fmt: skip
    return config.check_attentions()


def _run_decode(config, args, out) -> int:
    """``--decode``: time whole-model decoding, print the table, write decode_results.csv."""
    import torch

    from ..eval.bench.decode import format_decode_report, run_decode_benchmark, write_decode_csv

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = run_decode_benchmark(config)
    path = write_decode_csv(rows, out / "decode_results.csv")
    print(format_decode_report(rows, f"TransformerLM 4 x 256 on {args.device}: decode ms/token"))
    print(f"\nwrote {path}")
    return 0


def _model_config(args) -> ModelBenchConfig:
    """The ``ModelBenchConfig`` of parsed ``args`` (``--model``)."""
    config = ModelBenchConfig(
        device=args.device,
        threads=args.threads,
        chunk_size=_chunk_size(args),
        compile=args.compile,
        seed=args.seed,
        progress=not args.no_progress,
        amp="bf16" if args.dtype == "bf16" else None,
    )
    if args.lengths:
        config.contexts = parse_lengths(args.lengths)
    if args.attentions is not None:
        config.attentions = parse_attentions(args.attentions)
    if args.quick:
        config.contexts = config.contexts or (128, 256)
        config.n_layer, config.n_head, config.n_embd = 1, 2, 32
        config.min_time, config.min_repeats = 0.0, 1
    if args.min_time is not None:
        config.min_time = args.min_time
    if args.rounds is not None:
        config.rounds = check_positive_int(args.rounds, "rounds")
    return config


def _chunk_size(args) -> int | None:
    """``--chunk-size`` checked, or None when not given (the command's default applies)."""
    if args.chunk_size is None:
        return None
    return check_positive_int(args.chunk_size, "chunk_size")


def parse_attentions(text: str) -> tuple[str, ...]:
    """``--attentions`` "a,b:k=v,k2=v2,c" -> ("a", "b:k=v,k2=v2", "c"): attention specs
    (``polysketch.nn.resolve.split_attentions``), each naming one of
    ``valid_model_attentions()``."""
    return split_attentions(text)


def _config(args) -> BenchConfig:
    """The ``BenchConfig`` of parsed ``args`` (ValueError naming a bad option)."""
    kw = dict(
        mode=args.mode,
        dtype=args.dtype,
        heads=check_positive_int(args.heads, "heads"),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        max_memory_gb=check_float(args.max_memory_gb, "max_memory_gb", minimum=0.0),
        threads=args.threads,
        chunk_size=_chunk_size(args) or BenchConfig.chunk_size,
        device=args.device,
        seed=args.seed,
        progress=not args.no_progress,
        malloc_top_pad=None if args.default_malloc else MALLOC_TOP_PAD,
    )
    for name in kw["methods"]:
        check_choice(name, "methods", METHODS)
    kw["algorithms"] = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    if not kw["algorithms"]:
        raise ValueError("algorithms must name at least one backend, e.g. chunked")
    for name in kw["algorithms"]:
        check_choice(name, "algorithms", ALGORITHMS)
    if args.lengths:
        kw["lengths"] = parse_lengths(args.lengths)
    if args.decode_positions:
        kw["decode_positions"] = parse_lengths(args.decode_positions)
    if args.min_time is not None:
        kw["min_time"] = check_float(args.min_time, "min_time", minimum=0.0)
    return BenchConfig.quick(**kw) if args.quick else BenchConfig(**kw)


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``benchmarks/bench_attention.py``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
