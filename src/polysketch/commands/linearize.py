"""``polysketch linearize``: turn a saved softmax transformers LM into a kernelized one.

Loads ``--model`` (a directory written by ``save_pretrained``) with transformers'
``from_pretrained``, converts its attention (``--attention``: a preset such as ``psf_mixed``,
any feature-map name, or a model preset such as ``soft_hash_far_local_balanced``, its attention
beside an exact sliding window), trains the added modules to match each layer's softmax outputs
on ``--data`` (attention transfer), fine-tunes on the LM loss (LoRA through peft, or full), and
reports the validation loss / perplexity of the original, after conversion, after stage 1 and
after stage 2, with the decode-state size against the KV cache. Writes into ``--out``
(atomically): ``results.json``, ``results.csv``, ``linearize.png`` and the converted model
(``model/``, reload it with ``polysketch.integrations.transformers.load_converted``); a
non-empty ``--out`` is refused unless ``--overwrite``. ``--model`` must be a folder; with
``--finetune lora`` (the default) the LoRA targets are checked against the model before any
conversion or training. Needs the ``hf`` extra (``pip install polysketch[hf]``). The data are
byte-tokenized (``polysketch.data``): the model must have a byte vocabulary (>= 256 ids)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .._checks import parse_key_values
from ..eval.linearize_report import format_result, write_results
from ..nn import valid_model_attentions
from ._common import fail, io_error, prepare_out_dir

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``linearize`` on the top-level CLI's ``subparsers``."""
    p = subparsers.add_parser(
        "linearize",
        help="convert a saved Hugging Face causal LM to kernelized attention and linearize it",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="directory written by save_pretrained")
    p.add_argument("--attention", default="psf_mixed", choices=valid_model_attentions(),
                   metavar="NAME",
                   help="attention preset, feature-map name or model preset (e.g. the recommended "
                   "soft_hash_far_local_balanced: "
                   "its attention beside an exact sliding window in every layer)")  # fmt: skip
    p.add_argument("--data", default="shakespeare", help="shakespeare, stdlib or a text path")
    p.add_argument(
        "--out", type=Path, default=Path("linearize-out"),
        help="folder for results.json, results.csv, linearize.png and the converted model/ "
        "(refused if not empty, unless --overwrite)",
    )  # fmt: skip
    p.add_argument(
        "--overwrite", action="store_true",
        help="write into a non-empty --out, replacing the results and model/ there",
    )  # fmt: skip
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--transfer-batch-size",
        type=int,
        default=argparse.SUPPRESS,  # no "(default: None)" beside the real default below
        help="sequences per transfer step (default: --batch-size)",
    )
    p.add_argument("--transfer-steps", type=int, default=100)
    p.add_argument("--transfer-lr", type=float, default=1e-2)
    p.add_argument("--finetune-steps", type=int, default=100)
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    p.add_argument("--finetune", choices=["lora", "full", "none"], default="lora")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument(
        "--lora-targets", nargs="+", default=None, metavar="NAME",
        help="module names LoRA adapts (default: the linear layers of the attention modules); "
        "checked against the model before any work",
    )  # fmt: skip
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=argparse.SUPPRESS,
                   help="block of the chunked and mixed forms (default: a model preset's own, "
                   "else 64)")  # fmt: skip
    p.add_argument("--local-window", type=int, default=argparse.SUPPRESS, metavar="W",
                   help="an exact sliding-window softmax branch over the last W keys beside the "
                   "attention (default: a model preset's own, else none; soft_hash_far needs "
                   "one >= --chunk-size)")  # fmt: skip
    p.add_argument("--global-heads", type=int, default=argparse.SUPPRESS, metavar="G",
                   help="with a window branch, the attention runs on the first G query heads "
                   "only (default: every head)")  # fmt: skip
    p.add_argument("--map-kw", action="append", metavar="KEY=VALUE", help="feature-map keyword")
    p.add_argument(
        "--mixed",
        action="store_true",
        help="with a feature-map attention: exact (q.k)^degree inside blocks of --chunk-size, "
        "the map for earlier blocks (psf_mixed's form, e.g. with psf_learned)",
    )
    p.add_argument("--max-bytes", type=int, default=None, help="read at most this much text")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-progress", action="store_true",
        help="no progress bars (shown on stderr otherwise, also when it is not a terminal)",
    )  # fmt: skip
    p.set_defaults(func=run)
    return p


def _check_model_dir(model) -> Path:
    """--model must be a folder written by save_pretrained (checked before transformers)."""
    path = Path(model)
    if not path.exists():
        raise ValueError(
            f"--model {path} does not exist: give the folder written by save_pretrained"
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(
            f"--model {path} is not a folder written by save_pretrained (no config.json in it)"
        )
    return path


def run(args: argparse.Namespace) -> int:
    """Linearize ``--model``; print the table. 2 (with an ``error:`` line) on bad input."""
    try:
        _check_model_dir(args.model)
        out = prepare_out_dir(args.out, overwrite=args.overwrite)
    except ValueError as err:
        return fail("linearize", err)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return fail("linearize", "needs transformers: pip install polysketch[hf]")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        from ..integrations.transformers import LinearizeConfig, linearize_saved

        map_kwargs = parse_key_values(args.map_kw, "--map-kw")
        if args.mixed:
            map_kwargs["mixed"] = True
        config = LinearizeConfig(
            seq_len=args.seq_len, batch_size=args.batch_size,
            transfer_batch_size=getattr(args, "transfer_batch_size", None),
            transfer_steps=args.transfer_steps, transfer_lr=args.transfer_lr,
            finetune_steps=args.finetune_steps, finetune_lr=args.finetune_lr,
            finetune=args.finetune, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
            eval_batches=args.eval_batches, seed=args.seed, progress=not args.no_progress,
        )  # fmt: skip
        for flag in ("local_window", "global_heads"):
            if hasattr(args, flag):
                map_kwargs[flag] = getattr(args, flag)
        res = linearize_saved(
            args.model, args.attention, args.data, config=config, save_to=out / "model",
            chunk_size=getattr(args, "chunk_size", None), max_bytes=args.max_bytes,
            **map_kwargs,
        )  # fmt: skip
        write_results([res], out)
    except OSError as err:
        return fail("linearize", io_error(err, out))
    except (ValueError, TypeError, ImportError) as err:
        return fail("linearize", err)
    print(format_result(res))
    print(f"wrote {out}/results.json, results.csv, linearize.png, model/")
    return 0
