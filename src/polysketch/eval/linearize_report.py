"""Results of ``linearize_saved`` runs as files and text: what ``polysketch linearize`` writes
and prints, and ``experiments/linearize_llama.py`` collects.

* ``summary_row(result)``: one flat row per run (losses and perplexities per stage, tokens,
  decode-state floats against the KV cache at each measured length, seconds);
* ``write_results(results, out)``: ``results.json`` (everything but the model),
  ``results.csv`` (the summary rows) and ``linearize.png`` (``plot_results``) in ``out``;
* ``format_result(result)``: the table and the decode-memory line printed to the terminal.

The stages are ``original`` (the softmax model), ``converted``, ``transfer`` (after attention
transfer) and ``finetune``; see ``polysketch.integrations.transformers.linearize``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from .._files import atomic_write
from .._files import write_csv as _write_rows
from .plots import save_png, subplots
from .tables import format_table

__all__ = [
    "STAGES",
    "summary_row",
    "write_csv",
    "write_json",
    "plot_results",
    "write_results",
    "format_result",
]

STAGES = ("original", "converted", "transfer", "finetune")


def summary_row(res: dict) -> dict:
    """One run as a flat row: ``loss_*``, ``ppl_*`` per stage, ``loss_ratio_finetune``,
    tokens, ``state_floats_T*`` / ``kv_cache_floats_T*`` per decode length, seconds."""
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


def write_csv(results: Sequence[dict], path) -> Path:
    """One summary row per run (``summary_row``), atomically."""
    return _write_rows([summary_row(r) for r in results], path)


def write_json(results: Sequence[dict], path) -> Path:
    """The results as JSON, atomically."""
    return atomic_write(Path(path), json.dumps(list(results), indent=1).encode())


def plot_results(results: Sequence[dict], path) -> Path:
    """Left: validation loss per stage per run; right: the stage-1 and stage-2 curves."""
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
    return save_png(fig, path, dpi=110)


def write_results(results: Sequence[dict], out) -> list[Path]:
    """``results.json``, ``results.csv`` and ``linearize.png`` in ``out``; their paths."""
    out = Path(out)
    return [
        write_json(results, out / "results.json"),
        write_csv(results, out / "results.csv"),
        plot_results(results, out / "linearize.png"),
    ]


def format_result(res: dict) -> str:
    """The loss and perplexity per stage, tokens, decode memory and the reloaded loss."""
    rows = [[s, f"{res[f'loss_{s}']:.4f}", f"{res[f'ppl_{s}']:.3f}"] for s in STAGES]
    d = res["decode_state"][-1]
    reloaded = res.get("loss_reloaded")
    return (
        format_table(["stage", "val loss (nats/token)", "perplexity"], rows)
        + f"\ntokens: transfer {res['tokens_transfer']:,}, fine-tune {res['tokens_finetune']:,};"
        f" decode memory at T={d['seq_len']:,}: state {d['state_floats']:,} floats vs KV cache "
        f"{d['kv_cache_floats']:,}"
        + ("" if reloaded is None else f"; reloaded loss {reloaded:.4f}")
    )
