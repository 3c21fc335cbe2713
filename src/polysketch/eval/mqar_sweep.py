"""MQAR recall vs decode-state size across attentions (Zoology / BASED's recall benchmark).

For every attention in the sweep, one ``TransformerLM`` of the same size is trained with the
same seed, data and schedule on multi-query associative recall (``polysketch.data.mqar``) and
scored on a held-out set by *recall accuracy*: the fraction of queried keys whose value is
the model's argmax next token. Each row also records the floats a model holds per sequence
while decoding at position T = ``seq_len`` (``TransformerLM.decode_state_size``): constant
for feature-map attention, 2·L·H·D·T for the softmax KV cache. Recall at a given state size is
the trade-off BASED's paper studies; softmax attention is the reference.

An attention is named as ``NAME`` or ``NAME:key=value,...`` (``polysketch.nn.resolve.
parse_attention``), e.g. ``llops:num_features=256,degree=4`` or ``taylor:qk_dim=16``: keys in
``MODEL_KEYS`` set the model (``TransformerConfig``), other keys the feature map. With several
learning rates (``lrs``) every attention is trained at each and reported at its best (Zoology's
protocol: a sweep per model, best validation accuracy); the CSV keeps every run.

``LLOPS`` is the LLoPS paper's Table 4 setting (d_model 128, m = 256, p = 4; BASED's 16-dim
q/k for ``taylor``; short convolutions as in BASED / Zoology's models) at a CPU budget.

``run_sweep`` does the work; ``write_csv`` and ``plot_sweep`` save ``mqar.csv`` and
``mqar.png``; ``polysketch mqar`` (``polysketch.commands.mqar``) is the command.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

from .._files import write_csv as _write_csv
from ..data.mqar import MQARConfig
from ..nn import TransformerConfig
from ..nn.resolve import MODEL_KEYS, parse_attention
from ..train import MQARData, TrainConfig, train
from .plots import log_axes, save_png, subplots

__all__ = [
    "DEFAULT_ATTENTIONS",
    "FULL",
    "QUICK",
    "LLOPS",
    "LLOPS_ATTENTIONS",
    "LONG",
    "LONG_512",
    "LONG_CURRICULUM",
    "CURRICULUM_256",
    "LONG_ATTENTIONS",
    "SETTINGS",
    "MODEL_KEYS",
    "parse_attention",
    "run_name",
    "best_rows",
    "make_data",
    "model_config_for",
    "train_one",
    "run_sweep",
    "write_csv",
    "plot_sweep",
    "format_table",
]

DEFAULT_ATTENTIONS = (
    "softmax",
    "polysketch",
    "llops",
    "tensorsketch",
    "hybrid_angular",
    "taylor",
    "elu",
)

FULL = {
    "vocab_size": 256, "seq_len": 64, "num_kv_pairs": 8, "num_train": 20000, "num_val": 1000,
    "n_layer": 2, "n_head": 2, "n_embd": 64, "steps": 3000, "batch_size": 64, "lr": 1e-3,
    "warmup_steps": 100, "short_conv": 0, "min_distance": 0,
}  # fmt: skip
"""Default sizes: about Zoology's smallest MQAR setting (T = 64, 8 pairs, d_model 64). At this
budget softmax solves the task (recall 0.974 on a 2-core CPU, 4 minutes); with lr 3e-3 and
2000 steps it reached only 0.21."""

QUICK = {
    "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2, "num_train": 256, "num_val": 64,
    "n_layer": 2, "n_head": 2, "n_embd": 16, "steps": 8, "batch_size": 16, "lr": 3e-3,
    "warmup_steps": 2, "short_conv": 0, "min_distance": 0,
}  # fmt: skip
"""``--quick``: a smoke run (seconds for the whole sweep on a CPU); accuracies are not
meaningful at this size."""

LLOPS = {**FULL, "n_embd": 128, "short_conv": 3}
"""``--setting llops``: LLoPS Table 4's model (2 layers, d_model 128) with BASED / Zoology's
short convolution (kernel 3) on every attention, on ``FULL``'s task (T = 64, 8 pairs, vocab
256, 20k examples) and schedule; Zoology's own runs use vocab 8192 and longer training, which
a 2-core CPU cannot afford (docs/results/README.md states the budget)."""

LLOPS_ATTENTIONS = (
    "softmax",
    "taylor:qk_dim=16",
    "llops:num_features=256,degree=4",
    "llops:num_features=256,degree=2,elementwise_square=True",
    "llops:num_features=16,degree=2,square=True,init='monomial'",
    "polysketch",
    "psf_mixed",
)
"""``--setting llops``'s default attentions: LLoPS at m = 256, p = 4 as Table 4 states it,
with signed scores; LLoPS in §3.2's non-negative form, (∏_j xΘ_j)^{*2} with two factors
(m = 256 features, degree 4); LLoPS self-tensored (m = 16, p = 2, scores (φq·φk)² of degree 4,
the same 256 state features per head) from its monomial start — signed p = 4 scores drive a
third to a half of the normalizers negative within 400 steps
(``experiments/llops_normalizers.py``), squared scores cannot; BASED's map on 16-dim queries
and keys (as Table 4's BASED)."""

LONG = {**LLOPS, "seq_len": 1024, "num_kv_pairs": 16, "min_distance": 512, "batch_size": 32}
"""``--setting long``: long-range recall. T = 1024 with 16 key-value pairs, every
query at least 512 tokens after its key (``MQARConfig.min_distance``), so no exact local
window of up to 512 tokens (``psf_mixed``'s block is the model's chunk, 64) sees a key and
its query together: the answer must come from the attention's global part. Model and
schedule of ``LLOPS`` (2 layers × 128, short convolutions of 3 taps) with batch 32. Zoology's
larger settings, the reference, use T = 512 with 64 pairs (and up to 2048 in its scaling
runs), vocabulary 8192, 100,000 training examples and d_model 64–512; ours keep
``FULL``'s vocabulary (256) and 20,000 examples, and 16 pairs, for a 2-core CPU."""

LONG_512 = {**LONG, "seq_len": 512, "min_distance": 256}
"""``--setting long512``: ``LONG`` at T = 512, queries at least 256 tokens after their keys."""

LONG_CURRICULUM = {
    **LONG,
    "n_embd": 64,
    "steps": 300,
    "curriculum": ((64, 0, 8, 1500), (256, 128, 8, 3000)),
}
"""``--setting long_curriculum``: ``LONG``'s task (T = 1024, 16 pairs, every query ≥ 512
tokens after its key) reached through shorter ones, as Zoology trains on a mixture of
lengths. ``curriculum`` lists the stages trained before the task, each
(seq_len, min_distance, num_kv_pairs, steps) with ``LONG``'s batch, learning rate, warm-up and
data sizes; each stage starts from the previous one's weights with a fresh optimizer and
schedule (``train(init_weights=...)``), and the task itself is the last stage
(``steps``). Without it softmax does not learn ``LONG`` at a CPU budget
(``docs/results/long_context/mqar/softmax_budget``: accuracy 0.009 after 1,500 steps of 8);
the T = 256 stage keeps every query 128 tokens from its key, past a 64-token window, so a
local branch cannot answer it either. d_model 64 (``LONG``: 128) halves the cost."""

CURRICULUM_256 = {
    **LONG_CURRICULUM,
    "seq_len": 256,
    "min_distance": 128,
    "num_kv_pairs": 8,
    "steps": 3000,
    "curriculum": LONG_CURRICULUM["curriculum"][:1],
}
"""``--setting curriculum256``: a screen for ``long_curriculum``: its first stage (T = 64,
1,500 steps), then its second (T = 256, 8 pairs, every query ≥ 128 tokens after its key, so
past a 64-token window) as the task, with that stage's data, schedule and steps: its recall
compares with the ``T256`` stage recall a ``long_curriculum`` run of the same seed and
learning rate records, without the T = 1,024 task (about two-thirds of its cost on a CPU). In
every run so far an attention's recall after this stage bounded its recall on the task after
it; one that learns it still has to be run on ``long_curriculum``. At half the steps
(``--steps 1500``) neither BASED nor the long-context preset had learned it yet
(``docs/results/long_context/mqar_screen256/``)."""

LONG_ATTENTIONS = (
    "softmax",
    "taylor:qk_dim=16",
    "llops:num_features=256,degree=2,elementwise_square=True",
    "polysketch",
    "psf_mixed",
    "hedgehog",
)
"""``--setting long`` / ``long512``'s default attentions."""

COLUMNS = (
    "attention", "lr", "state_size", "params", "val_loss", "accuracy", "train_s"
)  # fmt: skip


SETTINGS = {
    "default": (FULL, DEFAULT_ATTENTIONS),
    "llops": (LLOPS, LLOPS_ATTENTIONS),
    "long": (LONG, LONG_ATTENTIONS),
    "long512": (LONG_512, LONG_ATTENTIONS),
    "long_curriculum": (LONG_CURRICULUM, LONG_ATTENTIONS),
    "curriculum256": (CURRICULUM_256, LONG_ATTENTIONS),
}
"""``--setting`` name -> (sizes, default attentions)."""


def best_rows(rows: Sequence[dict]) -> list[dict]:
    """The best run (highest accuracy, then lowest validation loss) per attention, in order."""
    best: dict[str, dict] = {}
    for r in rows:
        b = best.get(r["attention"])
        if b is None or (r["accuracy"], -r["val_loss"]) > (b["accuracy"], -b["val_loss"]):
            best[r["attention"]] = r
    return list(best.values())


def run_sweep(
    attentions: Sequence[str] = DEFAULT_ATTENTIONS,
    *,
    settings: dict | None = None,
    seed: int = 0,
    device: str | None = None,
    progress: bool = False,
    lrs: Sequence[float] | None = None,
    log=print,
    on_row=None,
    save_dir=None,
) -> list[dict]:
    """Train and score one model per attention (and learning rate); returns rows with the
    ``COLUMNS`` keys, one per run (``best_rows`` picks the best learning rate of each).

    ``attentions``: specs as ``parse_attention`` reads them. ``settings`` overrides keys of
    ``FULL`` (data sizes, model size, steps, batch, lr, short_conv). ``lrs``: learning rates
    to sweep (None: ``settings["lr"]`` only). ``on_row``: called with the list of rows so
    far after every run (``polysketch mqar`` rewrites its CSV there, so a long sweep that is
    stopped keeps the runs it finished). ``save_dir``: each trained model's checkpoint and
    metrics go to ``save_dir/run_name(attention, lr)/`` (``train_one``'s ``out_dir``), for
    diagnostics after the sweep; None saves nothing.
    """
    s = {**FULL, **(settings or {})}
    if not attentions:
        raise ValueError("attentions must name at least one attention")
    specs = [(a, *parse_attention(a)) for a in attentions]
    lrs = [s["lr"]] if lrs is None else list(lrs)
    if not lrs or not all(isinstance(x, (int, float)) and x > 0 for x in lrs):
        raise ValueError(f"lrs must be positive numbers, got {lrs}")
    data = make_data(s, seed=seed)
    rows = []
    for (label, name, model_opts, map_kwargs), lr in ((a, x) for a in specs for x in lrs):
        t0 = time.perf_counter()
        out_dir = None if save_dir is None else Path(save_dir) / run_name(label, lr)
        history = train_one(
            name, data, settings=s, lr=lr, model_options=model_opts, map_kwargs=map_kwargs,
            seed=seed, device=device, progress=progress, out_dir=out_dir,
        )  # fmt: skip
        model, val = history["model"], history["val"][-1]
        row = {
            "attention": label,
            "lr": lr,
            "state_size": model.decode_state_size(data.train_inputs.shape[1]),
            "params": model.num_parameters(),
            "val_loss": val["loss"],
            "accuracy": val["accuracy"],
            "train_s": time.perf_counter() - t0,
        }
        if history["curriculum"]:  # each stage's recall on its own validation set
            row["curriculum_accuracy"] = " ".join(
                f"T{st['seq_len']}:{st['accuracy']:.3f}" for st in history["curriculum"]
            )
        rows.append(row)
        if on_row is not None:
            on_row(list(rows))
        if log is not None:
            log(
                f"{label:>16s} lr {lr:g}: accuracy {row['accuracy']:.3f}  "
                f"val loss {row['val_loss']:.3f}  "
                f"state {row['state_size']:,} floats  ({row['train_s']:.1f} s)"
            )
    return rows


def run_name(attention: str, lr: float) -> str:
    """A folder name for one run of the sweep: the attention spec with every character but
    letters, digits, ``.``, ``=`` and ``-`` as ``_``, then ``_lr`` and the learning rate
    (``taylor:qk_dim=16``, 0.003 -> ``taylor_qk_dim=16_lr0.003``)."""
    safe = "".join(c if c.isalnum() or c in ".=-" else "_" for c in attention)
    return f"{safe}_lr{lr:g}"


def curriculum_settings(settings: dict) -> list[dict]:
    """The settings of each stage ``settings["curriculum"]`` lists (none without one): the
    task's with that stage's seq_len, min_distance, num_kv_pairs and steps.

    Raises ValueError for a stage that is not four integers with seq_len, num_kv_pairs and
    steps ≥ 1 and min_distance ≥ 0 (checked here, before any stage trains)."""
    stages = []
    for stage in settings.get("curriculum") or ():
        if (
            not isinstance(stage, (tuple, list))
            or len(stage) != 4
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in stage)
            or min(stage[0], stage[2], stage[3]) < 1
            or stage[1] < 0
        ):
            raise ValueError(
                "curriculum stages must be (seq_len, min_distance, num_kv_pairs, steps) of "
                f"integers, seq_len, num_kv_pairs and steps >= 1, got {stage!r}"
            )
        seq_len, min_distance, num_kv_pairs, steps = stage
        stages.append({**settings, "seq_len": seq_len, "min_distance": min_distance,
                       "num_kv_pairs": num_kv_pairs, "steps": steps, "curriculum": ()})  # fmt: skip
    return stages


def make_data(settings: dict, *, seed: int = 0) -> MQARData:
    """The MQAR train / validation sets that ``settings`` (``FULL``'s keys) describe."""
    task = MQARConfig(
        vocab_size=settings["vocab_size"],
        seq_len=settings["seq_len"],
        num_kv_pairs=settings["num_kv_pairs"],
        min_distance=settings.get("min_distance", 0),
    )
    return MQARData.make(
        task, num_train=settings["num_train"], num_val=settings["num_val"], seed=seed
    )


def model_config_for(
    attention: str,
    data: MQARData,
    *,
    settings: dict,
    model_options: dict | None = None,
    map_kwargs: dict | None = None,
    seed: int = 0,
) -> TransformerConfig:
    """The ``TransformerConfig`` the sweep trains for ``attention`` on ``data`` (``settings``:
    ``FULL``'s keys; ``model_options`` override them, e.g. qk_dim)."""
    seq_len = data.train_inputs.shape[1]
    return TransformerConfig(
        vocab_size=data.vocab_size,
        block_size=seq_len,
        n_layer=settings["n_layer"],
        n_head=settings["n_head"],
        n_embd=settings["n_embd"],
        attention=attention,
        map_kwargs=dict(map_kwargs or {}),
        **{
            "chunk_size": min(64, seq_len),
            "short_conv": settings["short_conv"],
            **(model_options or {}),
        },
        seed=seed,
    )


def train_one(
    attention: str,
    data: MQARData,
    *,
    settings: dict,
    lr: float,
    model_options: dict | None = None,
    map_kwargs: dict | None = None,
    seed: int = 0,
    device: str | None = None,
    progress: bool = False,
    out_dir=None,
) -> dict:
    """Train one ``TransformerLM`` on ``data`` as the sweep does; returns ``train``'s history
    (``history["model"]`` the trained model, ``history["val"][-1]`` its final scores).

    ``settings``: ``FULL``'s keys (model size, steps, batch, warm-up, short_conv), and
    optionally ``curriculum`` (``LONG_CURRICULUM``): stages trained first, each from the last
    one's weights; ``history["curriculum"]`` holds each stage's final validation row (with
    its ``seq_len``). ``model_options``: ``TransformerConfig`` fields that override them
    (qk_dim, ...). The model's ``block_size`` is ``data``'s length, the longest stage's.
    ``out_dir``: the last stage writes its checkpoint (``ckpt.pt``, ``polysketch.train.
    load_model`` reads it) and metrics there (``TrainConfig.out_dir``); None writes nothing.
    """
    seq_len = data.train_inputs.shape[1]
    model_config = model_config_for(
        attention, data, settings=settings, model_options=model_options,
        map_kwargs=map_kwargs, seed=seed,
    )  # fmt: skip
    weights, stages = None, []
    for stage in curriculum_settings(settings):
        stage_data = make_data(stage, seed=seed)
        history = train(model_config, _train_config(stage, lr, seed, device), stage_data,
                        progress=progress, init_weights=weights)  # fmt: skip
        weights = history["model"].state_dict()
        stages.append({"seq_len": stage["seq_len"], **history["val"][-1]})
    last = _train_config(settings, lr, seed, device, seq_len)
    if out_dir is not None:
        last = dataclasses.replace(last, out_dir=str(out_dir))
    history = train(model_config, last, data, progress=progress, init_weights=weights)
    history["curriculum"] = stages
    return history


def _train_config(settings: dict, lr: float, seed: int, device, seq_len=None) -> TrainConfig:
    """The sweep's ``TrainConfig`` for ``settings`` (steps, batch, warm-up) at ``lr``."""
    return TrainConfig(
        steps=settings["steps"],
        batch_size=settings["batch_size"],
        block_size=seq_len or settings["seq_len"],
        lr=lr,
        min_lr=lr / 10,
        warmup_steps=settings["warmup_steps"],
        weight_decay=0.1,
        eval_interval=None,
        seed=seed,
        device=device,
    )


def write_csv(rows: Sequence[dict], path) -> Path:
    """Write the sweep rows to ``path`` (CSV with ``COLUMNS``; atomically, parents created)."""
    return _write_csv(rows, path, columns=COLUMNS)


def plot_sweep(rows: Sequence[dict], path, *, title: str = "MQAR") -> Path:
    """Recall accuracy vs decode state size (log₂ x axis), one labelled point per attention
    (its best learning rate)."""
    fig, (ax,) = subplots(1, panel_size=(6.0, 4.0))
    labels = []
    for r in best_rows(rows):
        marker = "*" if r["attention"] == "softmax" else "o"
        ax.scatter([r["state_size"]], [r["accuracy"]], marker=marker, s=60)
        labels.append(ax.annotate(r["attention"], (r["state_size"], r["accuracy"]), fontsize=7,
                                  xytext=(4, 4), textcoords="offset points"))  # fmt: skip
    log_axes(ax, x=True, y=False)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("decode state per sequence at T = seq_len (floats)")
    ax.set_ylabel("recall accuracy")
    ax.set_title(title)
    _unstack(fig, labels)
    return save_png(fig, path)


def _unstack(fig, labels, step: float = 9.0, tries: int = 12) -> None:
    """Move each label down in steps of ``step`` points until its box overlaps no label
    placed before it (at most ``tries`` steps): points close in state size and recall have
    long labels that would print over each other."""
    renderer = fig.canvas.get_renderer()
    placed = []
    for label in labels:
        x, y = label.get_position()
        for _ in range(tries):
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
            y -= step
            label.set_position((x, y))
        placed.append(label.get_window_extent(renderer))


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table of each attention's best run, sorted by state size."""
    head = ("attention", "best lr", "state floats", "params", "val loss", "acc")
    lines = ["{:>32s} {:>8s} {:>13s} {:>9s} {:>9s} {:>6s}".format(*head)]
    for r in sorted(best_rows(rows), key=lambda r: r["state_size"]):
        lines.append(
            f"{r['attention']:>32s} {r['lr']:>8g} {r['state_size']:>13,d} {r['params']:>9,d} "
            f"{r['val_loss']:>9.4f} {r['accuracy']:>6.3f}"
        )
    return "\n".join(lines)
