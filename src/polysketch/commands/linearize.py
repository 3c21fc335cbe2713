"""``polysketch linearize``: turn a saved softmax transformers LM into a kernelized one.

Loads ``--model`` (a directory written by ``save_pretrained``) with transformers'
``from_pretrained``, converts its attention (``--attention``: a preset such as ``psf_mixed``,
or any feature-map name), trains the added modules to match each layer's softmax outputs on
``--data`` (attention transfer), fine-tunes on the LM loss (LoRA through peft, or full), and
reports the validation loss / perplexity of the original, after conversion, after stage 1
and after stage 2, with the decode-state size against the KV cache. Writes into ``--out``
(atomically): ``results.json``, ``results.csv``, ``linearize.png`` and the converted model
(``model/``, reload it with ``polysketch.integrations.transformers.load_converted``); a
non-empty ``--out`` is refused unless ``--overwrite``. ``--model`` must be a folder; with
``--finetune lora`` (the default) the LoRA targets are checked against the model before any
conversion or training.
Needs the ``hf`` extra (``pip install polysketch[hf]``). The data are byte-tokenized
(``polysketch.data``): the model must have a byte vocabulary (>= 256 ids).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path

from .._checks import parse_key_values
from .._files import atomic_write, replace_dir
from ..nn import valid_attentions
from ._common import fail, io_error, prepare_out_dir

__all__ = ["add_parser", "run", "linearize_saved", "write_csv", "write_json", "plot_results"]

STAGES = ("original", "converted", "transfer", "finetune")


def _summary_row(res: dict) -> dict:
    row = {"attention": res["attention"]}
    for s in STAGES:
        row[f"loss_{s}"] = round(res[f"loss_{s}"], 4)
    for s in STAGES:
        row[f"ppl_{s}"] = round(res[f"ppl_{s}"], 3)
    row["loss_ratio_finetune"] = round(res["loss_finetune"] / res["loss_original"], 4)
    row["tokens_transfer"] = res["tokens_transfer"]
    row["tokens_finetune"] = res["tokens_finetune"]
    for d in res["decode_state"]:
        row[f"state_floats_T{d['seq_len']}"] = d["state_floats"]
        row[f"kv_cache_floats_T{d['seq_len']}"] = d["kv_cache_floats"]
    row["seconds"] = round(res["seconds"], 1)
    return row


def write_csv(results: list[dict], path) -> Path:
    """One summary row per attention (losses, perplexities, tokens, state sizes)."""
    rows = [_summary_row(r) for r in results]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write(Path(path), buf.getvalue().encode())


def write_json(results: list[dict], path) -> Path:
    return atomic_write(Path(path), json.dumps(results, indent=1).encode())


def plot_results(results: list[dict], path) -> Path:
    """Left: validation loss per stage per attention; right: the stage-1 and stage-2 curves."""
    from ..eval.plots import pyplot, subplots

    fig, (ax0, ax1) = subplots(2, panel_size=(5.5, 3.8))
    labels = ["original\n(softmax)", "converted", "after\ntransfer", "after\nfine-tune"]
    for r in results:
        ax0.plot(range(4), [r[f"loss_{s}"] for s in STAGES], marker="o", label=r["attention"])
        th, fh = r["transfer_history"], r["finetune_history"]
        if th:
            ax1.plot(range(len(th)), th, label=f"{r['attention']}: transfer (rel. MSE)")
        if fh:
            ax1.plot(
                range(len(th), len(th) + len(fh)),
                fh,
                label=f"{r['attention']}: fine-tune (LM loss)",
            )
    ax0.axhline(
        results[0]["loss_original"] * 1.03, color="grey", ls="--", lw=1, label="original + 3%"
    )
    ax0.set_xticks(range(4), labels)
    ax0.set_ylabel("validation loss (nats/token)")
    ax0.legend(fontsize=7)
    ax0.grid(True, alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.legend(fontsize=7)
    ax1.grid(True, alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    pyplot().close(fig)
    return atomic_write(Path(path), buf.getvalue())


def _save_model_atomically(model, path: Path) -> Path:
    """``save_pretrained`` into a temporary folder, then swap it into ``path``."""
    return replace_dir(path, model.save_pretrained)


def linearize_saved(
    model_path,
    attention: str,
    data: str,
    *,
    out,
    seq_len: int = 256,
    batch_size: int = 8,
    transfer_batch_size: int | None = None,
    transfer_steps: int = 100,
    finetune_steps: int = 100,
    transfer_lr: float = 1e-2,
    finetune_lr: float = 1e-3,
    finetune: str = "lora",
    lora_rank: int = 8,
    lora_targets=None,
    eval_batches: int = 16,
    chunk_size: int = 64,
    seed: int = 0,
    map_kwargs: dict | None = None,
    progress: bool | None = None,
    max_bytes: int | None = None,
) -> dict:
    """Load, linearize, save and reload-check a model; write results to ``out``; return them."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..data.corpus import load_corpus
    from ..integrations.transformers import (
        LinearizeConfig,
        evaluate_loss,
        linearize,
        load_converted,
    )
    from ..integrations.transformers.linearize import EVAL_BATCH

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(data, max_bytes=max_bytes)
    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    vocab = model.get_output_embeddings().weight.shape[0]
    if vocab < corpus.vocab_size:
        raise ValueError(
            f"--model has a vocabulary of {vocab} ids; the byte-tokenized --data needs "
            f">= {corpus.vocab_size}"
        )
    cfg = LinearizeConfig(
        seq_len=seq_len, batch_size=batch_size, transfer_batch_size=transfer_batch_size,
        transfer_steps=transfer_steps,
        transfer_lr=transfer_lr, finetune_steps=finetune_steps, finetune_lr=finetune_lr,
        finetune=finetune, lora_rank=lora_rank, lora_targets=lora_targets,
        eval_batches=eval_batches, seed=seed, progress=progress,
    )  # fmt: skip
    torch.manual_seed(seed)
    model, res = linearize(
        model, corpus.train, corpus.val, attention=attention, config=cfg,
        chunk_size=chunk_size, seed=seed, **(map_kwargs or {}),
    )  # fmt: skip
    res["model"] = str(model_path)
    res["data"] = str(data)
    saved = _save_model_atomically(model, out / "model")
    reloaded = load_converted(saved)
    ev = {"seq_len": seq_len, "batch_size": EVAL_BATCH, "max_batches": eval_batches}
    res["loss_reloaded"] = evaluate_loss(reloaded, corpus.val, **ev)
    write_json([res], out / "results.json")
    write_csv([res], out / "results.csv")
    plot_results([res], out / "linearize.png")
    return res


def _print_table(res: dict) -> None:
    from ..eval.report import format_table

    rows = [[s, f"{res[f'loss_{s}']:.4f}", f"{res[f'ppl_{s}']:.3f}"] for s in STAGES]
    print(format_table(["stage", "val loss (nats/token)", "perplexity"], rows))
    d = res["decode_state"][-1]
    print(
        f"tokens: transfer {res['tokens_transfer']:,}, fine-tune {res['tokens_finetune']:,}; "
        f"decode memory at T={d['seq_len']:,}: state {d['state_floats']:,} floats vs KV cache "
        f"{d['kv_cache_floats']:,}; reloaded loss {res['loss_reloaded']:.4f}"
    )


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``linearize`` on the top-level CLI's ``subparsers``."""
    p = subparsers.add_parser(
        "linearize",
        help="convert a saved Hugging Face causal LM to kernelized attention and linearize it",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="directory written by save_pretrained")
    p.add_argument("--attention", default="psf_mixed", choices=valid_attentions(), metavar="NAME",
                   help="preset or feature-map name")  # fmt: skip
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
    p.add_argument("--chunk-size", type=int, default=64)
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
        map_kwargs = parse_key_values(args.map_kw, "--map-kw")
        if args.mixed:
            map_kwargs["mixed"] = True
        res = linearize_saved(
            args.model, args.attention, args.data, out=out, seq_len=args.seq_len,
            batch_size=args.batch_size,
            transfer_batch_size=getattr(args, "transfer_batch_size", None),
            transfer_steps=args.transfer_steps,
            finetune_steps=args.finetune_steps, transfer_lr=args.transfer_lr,
            finetune_lr=args.finetune_lr, finetune=args.finetune, lora_rank=args.lora_rank,
            lora_targets=args.lora_targets,
            eval_batches=args.eval_batches, chunk_size=args.chunk_size, seed=args.seed,
            map_kwargs=map_kwargs, max_bytes=args.max_bytes,
        )  # fmt: skip
    except OSError as err:
        return fail("linearize", io_error(err, out))
    except (ValueError, TypeError, ImportError) as err:
        return fail("linearize", err)
    _print_table(res)
    print(f"wrote {out}/results.json, results.csv, linearize.png, model/")
    return 0
