"""``polysketch train``: train a TransformerLM on a text corpus or on MQAR.

Trains the byte-level language model of ``polysketch.nn.TransformerLM`` with any attention
(``--attention``: a feature-map name, ``softmax``, ``polynomial`` or a PolySketchFormer preset;
``--map-kw key=value`` passes keywords to the feature map) on ``--corpus`` (``shakespeare``,
``stdlib`` or a path to a text file / folder) or on the MQAR recall task (``--task mqar``).
Writes ``metrics.csv``, ``metrics.jsonl`` and the checkpoint ``ckpt.pt`` into ``--out``; a
non-empty ``--out`` is refused unless ``--resume`` (continue its run) or ``--overwrite``
(replace it). ``--resume`` continues from the checkpoint exactly: configs and data source
come from it (a model, data or optimization flag given with ``--resume`` is ignored, with a
warning); ``--steps`` may extend the run, ``--device``, ``--compile`` and ``--[no-]recompute``
(memory against time, the same arithmetic) apply. Under
``torchrun --nproc_per_node=N -m polysketch train ...`` it trains data-parallel (DDP);
``--batch-size`` is the global batch. ``--cp C`` splits every sequence over C of the N
processes (context parallelism; dp = N / C, a ``("dp", "cp")`` DeviceMesh) and ``--fsdp``
shards the parameters over all N (FSDP2); see ``polysketch.train.mesh``. A checkpoint of
any layout resumes on any other (``--cp`` and ``--fsdp`` describe this launch: with
``--resume`` they are taken as given, default 1 and off, never from the checkpoint).
``--warmup-steps`` defaults to 10% of ``--steps`` (at most 100); a warmup as long as the run
is warned about. A header (parameters, tokens per step, schedule, device, dtype) is printed
before the first step; running out of memory is an error line naming the batch and block
size, and a run that fails before its first step leaves no folder behind.
"""

from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import fields
from pathlib import Path

import torch

from .._checks import parse_key_values
from .._files import temporary_pattern
from ..data.corpus import load_corpus
from ..data.mqar import MQARConfig
from ..nn import TransformerConfig, TransformerLM, valid_model_attentions
from ..nn.transformer import EXECUTION_FIELDS
from ..train import (
    CHECKPOINT_NAME,
    CheckpointError,
    MQARData,
    TrainConfig,
    load_checkpoint,
    train,
)
from ..train.loop import TrainingOutOfMemoryError, WarmupWarning, check_launch
from ..train.schedule import default_warmup, learning_rate
from ._common import ERROR_EXIT, check_device, fail, prepare_out_dir, warn
from ._flags import add_config_flags, given, read_config

__all__ = ["add_parser", "run", "load_data", "default_warmup", "ERROR_EXIT", "RESUME_OVERRIDES"]

RESUME_OVERRIDES = ("steps", "device", "compile", "cp", "fsdp", *sorted(EXECUTION_FIELDS))
"""The configuration ``--resume`` takes from the flags (besides ``--out``, ``--no-progress``,
``--flush-denormals``); every other option is the checkpoint's, and one given is warned
about."""

DATA = {
    "corpus": "shakespeare", "task": None, "max_bytes": None, "val_fraction": 0.1,
    "mqar_vocab": 256, "mqar_seq_len": 64, "mqar_kv_pairs": 8, "mqar_train": 20000,
    "mqar_val": 1000,
}  # fmt: skip
"""The data options (``[data]`` of ``--config``) and their defaults."""

_MODEL_SKIP = ("vocab_size", "seed", "map_kwargs")  # from the data, --seed, --map-kw
_TRAIN_SKIP = ("out_dir", "block_size", "seed")  # --out, the model's block, --seed
_TRAIN_OPTIONS = {
    "amp": {"choices": ["bf16"]},
    "compile": {"nargs": "?", "const": "inductor", "metavar": "BACKEND"},
    "warmup_steps": {"help": "linear warmup steps (default: 10%% of --steps, at most 100)"},
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``train`` on the top-level CLI's ``subparsers``: the model and training flags
    are generated from ``TransformerConfig`` and ``TrainConfig`` (``commands._flags``)."""
    p = subparsers.add_parser(
        "train",
        help="train a small LM (corpus or MQAR) with any attention; checkpoints, resume, DDP",
        description=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--config", default=None, metavar="TOML",
        help="a TOML file of [data], [model] and [train] tables (keys: the flags' names with "
        "underscores; [model] map_kwargs a table), read first; flags given override it",
    )  # fmt: skip
    data = p.add_argument_group("data")
    src = data.add_mutually_exclusive_group()
    src.add_argument("--corpus", default=argparse.SUPPRESS,
                     help="shakespeare | stdlib | PATH (default: shakespeare)")  # fmt: skip
    src.add_argument("--task", choices=["mqar"], default=argparse.SUPPRESS,
                     help="the synthetic MQAR task instead of a corpus")  # fmt: skip
    for name, kind, text in (
        ("max_bytes", int, "cap on the corpus size"),
        ("val_fraction", float, "validation share of the corpus"),
        ("mqar_vocab", int, "MQAR vocabulary"),
        ("mqar_seq_len", int, "MQAR sequence length"),
        ("mqar_kv_pairs", int, "MQAR key-value pairs per sequence"),
        ("mqar_train", int, "MQAR training examples"),
        ("mqar_val", int, "MQAR validation examples"),
    ):
        data.add_argument("--" + name.replace("_", "-"), type=kind, default=argparse.SUPPRESS,
                          help=f"{text} (default: {DATA[name]!r})")  # fmt: skip
    model = p.add_argument_group("model (polysketch.nn.TransformerConfig)")
    add_config_flags(model, TransformerConfig, skip=_MODEL_SKIP)
    model.add_argument("--map-kw", action="append", metavar="KEY=VALUE", dest="map_kw",
                       default=argparse.SUPPRESS, help="feature-map keyword (repeat)")  # fmt: skip
    opt = p.add_argument_group("training (polysketch.train.TrainConfig)")
    add_config_flags(opt, TrainConfig, skip=_TRAIN_SKIP, options=_TRAIN_OPTIONS)
    opt.add_argument(
        "--seed",
        type=int,
        default=argparse.SUPPRESS,
        help="seed of the model, its feature maps and the data (default: 0)",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--out", default="runs/train",
        help="folder for metrics and ckpt.pt (refused if not empty, unless --resume or "
        "--overwrite) (default: runs/train)",
    )  # fmt: skip
    out.add_argument(
        "--resume", action="store_true",
        help="continue from OUT/ckpt.pt (its configs win: model, data and optimization flags "
        "are ignored, with a warning; " + ", ".join(f"--{f}" for f in RESUME_OVERRIDES) + " apply)",
    )  # fmt: skip
    out.add_argument(
        "--overwrite", action="store_true",
        help="train into a non-empty --out, replacing the run there (its ckpt.pt and metrics)",
    )  # fmt: skip
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--flush-denormals", action="store_true",
        help="on a CPU, flush subnormal floats to zero for the run (torch.set_flush_denormal): "
        "a sharp soft hash's bucket probabilities fall below fp32's smallest normal (1.2e-38), "
        "where x86 arithmetic runs several times slower; changes only values below it",
    )  # fmt: skip
    p.set_defaults(func=run)
    return p


def _model_flags() -> list[str]:
    return [f.name for f in fields(TransformerConfig) if f.name not in _MODEL_SKIP]


def _train_flags() -> list[str]:
    return [f.name for f in fields(TrainConfig) if f.name not in _TRAIN_SKIP]


def given_options(args) -> dict[str, str]:
    """{dest: flag} of the data, model and training options the user typed."""
    names = [*DATA, *_model_flags(), *_train_flags(), "map_kw", "seed"]
    out = {}
    for name, value in given(args, names).items():
        flag = name.replace("_", "-")
        out[name] = f"--no-{flag}" if value is False else f"--{flag}"  # --x / --no-x
    return out


def _configs_from_args(args):
    file = {"data": {}, "model": {}, "train": {}}
    if args.config is not None:
        keys = {"data": list(DATA), "model": [*_model_flags(), "map_kwargs", "seed"],
                "train": [*_train_flags(), "seed"]}  # fmt: skip
        file = read_config(args.config, keys)
    data = {**DATA, **file["data"], **given(args, DATA)}
    model = {k: v for k, v in file["model"].items() if k not in ("map_kwargs", "seed")}
    model |= given(args, _model_flags())
    opts = {k: v for k, v in file["train"].items() if k != "seed"} | given(args, _train_flags())
    seed = getattr(args, "seed", file["model"].get("seed", file["train"].get("seed", 0)))
    map_kwargs = dict(file["model"].get("map_kwargs", {}))
    map_kwargs.update(parse_key_values(getattr(args, "map_kw", None), "--map-kw"))
    attention = model.get("attention", TransformerConfig.attention)
    if attention not in valid_model_attentions():
        raise ValueError(
            f"--attention must be one of {valid_model_attentions()}, got {attention!r}"
        )
    if data["task"] == "mqar":
        source = {"task": "mqar", "vocab_size": data["mqar_vocab"],
                  "seq_len": data["mqar_seq_len"], "num_kv_pairs": data["mqar_kv_pairs"],
                  "num_train": data["mqar_train"], "num_val": data["mqar_val"]}  # fmt: skip
        model["vocab_size"], model["block_size"] = data["mqar_vocab"], data["mqar_seq_len"]
    elif data["task"] is None:
        source = {
            "task": "corpus",
            "corpus": str(data["corpus"]),
            "max_bytes": data["max_bytes"],
            "val_fraction": data["val_fraction"],
        }
        model["vocab_size"] = 256
    else:
        raise ValueError(f"[data] task must be mqar or absent, got {data['task']!r}")
    model_config = TransformerConfig(**model, map_kwargs=map_kwargs, seed=seed).validate()
    steps = opts.setdefault("steps", TrainConfig.steps)
    opts.setdefault("warmup_steps", default_warmup(steps))
    opts["min_lr"] = min(opts.get("min_lr", TrainConfig.min_lr), opts.get("lr", TrainConfig.lr))
    if "betas" in opts:
        opts["betas"] = tuple(opts["betas"])
    train_config = TrainConfig(**opts, block_size=model_config.block_size, seed=seed,
                               out_dir=str(args.out)).validate()  # fmt: skip
    if train_config.warm_start_steps:
        TransformerLM(model_config).set_exact_attention(True)  # fail early: nothing to switch
    return model_config, train_config, source


def _configs_from_checkpoint(args):
    path = Path(args.out) / CHECKPOINT_NAME
    if args.config is not None:
        raise ValueError("--config and --resume exclude each other: a resumed run takes its "
                         "configs from its checkpoint")  # fmt: skip
    state = load_checkpoint(path, restore_rng=False)
    try:
        # --[no-]recompute applies: it trades memory for time, the gradients are the same
        stored = {**state["model_config"], **given(args, EXECUTION_FIELDS)}
        model_config = TransformerConfig(**stored).validate()
        names = {f.name for f in fields(TrainConfig)}
        tc = {k: v for k, v in state["train_config"].items() if k in names}
        source = state["metadata"]["source"]
        if not isinstance(source, dict) or source.get("task") not in ("mqar", "corpus"):
            raise ValueError(f"unknown data source {source!r}")
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {path} was not written by `polysketch train` or does not fit this "
            f"version ({type(err).__name__}: {err})"
        ) from None
    tc["out_dir"] = str(args.out)
    tc |= given(args, ("steps", "device", "compile"))
    tc["cp"], tc["fsdp"] = getattr(args, "cp", 1), getattr(args, "fsdp", False)  # this launch's
    if "betas" in tc:
        tc["betas"] = tuple(tc["betas"])
    train_config = TrainConfig(**tc).validate()
    check_device(
        train_config.device,
        "--device" if hasattr(args, "device") else "--device (the checkpoint's)",
    )
    _warn_ignored(args, state)
    return model_config, train_config, source


def _warn_ignored(args, state: dict) -> None:
    """One warning line per option given with --resume that the checkpoint's config overrides."""
    configs = {**state.get("train_config", {}), **state.get("model_config", {})}
    aliases = {"map_kw": "map_kwargs"}
    for dest, flag in given_options(args).items():
        if dest in RESUME_OVERRIDES:
            continue
        key = aliases.get(dest, dest)
        if key in configs:
            kept = f"the checkpoint's {key}={configs[key]!r} is used"
        else:
            kept = "the checkpoint's data source is used"
        warn("train", f"{flag} is ignored with --resume ({kept})")


def _replace_previous_run(out: Path) -> None:
    """--overwrite: remove the files of the run in ``out`` (checkpoint, metrics, temporaries)."""
    doomed = [out / CHECKPOINT_NAME, out / "metrics.csv", out / "metrics.jsonl"]
    doomed += sorted(out.glob(temporary_pattern(out / CHECKPOINT_NAME)))
    for path in doomed:
        if path.is_file() or path.is_symlink():
            path.unlink()


def _warn_warmup(cfg: TrainConfig) -> None:
    """A warning line when the schedule never leaves warmup (``--warmup-steps >= --steps``)."""
    if cfg.warmup_steps < cfg.steps:
        return
    last = learning_rate(cfg.steps - 1, lr=cfg.lr, min_lr=cfg.min_lr,
                         warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)  # fmt: skip
    warn("train", f"--warmup-steps {cfg.warmup_steps} >= --steps {cfg.steps}: the learning rate "
         f"never leaves warmup and its last step uses {last:.3g}, not --lr {cfg.lr:g} (leave "
         "--warmup-steps out for 10% of --steps)")  # fmt: skip


def _remove_if_empty(out: Path) -> None:
    """Remove the folder this run created when the run failed before writing into it."""
    try:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
    except OSError:
        pass  # another rank removed it, or it cannot be: it blocks nothing when empty


def load_data(source: dict):
    """The ``Corpus`` or ``MQARData`` described by a checkpoint's ``metadata["source"]``."""
    if source["task"] == "mqar":
        cfg = MQARConfig(
            vocab_size=source["vocab_size"],
            seq_len=source["seq_len"],
            num_kv_pairs=source["num_kv_pairs"],
        )
        return MQARData.make(cfg, num_train=source["num_train"], num_val=source["num_val"])
    return load_corpus(
        source["corpus"], val_fraction=source["val_fraction"], max_bytes=source["max_bytes"]
    )


def run(args: argparse.Namespace) -> int:
    """Train; print the final validation loss and where the checkpoint is. 2 on bad input."""
    out = Path(args.out)
    created = not out.exists() and not args.resume
    flushing = False  # --flush-denormals in force, undone at the end
    try:
        if args.resume and args.overwrite:
            raise ValueError(
                "--resume continues the run in --out, --overwrite replaces it: not both"
            )
        if args.resume:
            if out.exists() and not out.is_dir():
                raise ValueError(f"--out {out} is a file, not a folder: choose another --out")
            model_config, train_config, source = _configs_from_checkpoint(args)
        else:
            check_device(getattr(args, "device", None))
            model_config, train_config, source = _configs_from_args(args)
            has_run = (out / CHECKPOINT_NAME).is_file()
            hint = ", --resume to continue the run there" if has_run else ""
            prepare_out_dir(out, overwrite=args.overwrite, hint=hint)  # every rank refuses
            if args.overwrite and int(os.environ.get("RANK", "0")) == 0:  # rank 0 owns --out
                _replace_previous_run(out)
        check_launch(model_config, train_config)  # before loading data
        if args.flush_denormals:
            if not torch.set_flush_denormal(True):
                raise ValueError("--flush-denormals: this CPU cannot flush subnormals (no SSE3)")
            flushing = True
        data = load_data(source)
        main_rank = int(os.environ.get("RANK", "0")) == 0
        if main_rank:
            _warn_warmup(train_config)
        with warnings.catch_warnings():  # said above, in the flags' names
            warnings.simplefilter("ignore", WarmupWarning)
            history = train(
                model_config,
                train_config,
                data,
                resume=args.resume,
                progress=not args.no_progress,
                metadata={"source": source},
                log=print if main_rank else None,
            )
    except (ValueError, TypeError, OSError, TrainingOutOfMemoryError) as err:
        if created:
            _remove_if_empty(out)
        return fail("train", err)
    finally:
        if flushing:
            torch.set_flush_denormal(False)
    if int(os.environ.get("RANK", "0")) == 0:
        val = history["val"][-1] if history["val"] else None
        model = history["model"]
        summary = f"attention={model_config.attention} params={model.num_parameters():,}"
        if val is not None:
            summary += f" step={val['step']} val_loss={val['loss']:.4f} "
            summary += f"val_accuracy={val['accuracy']:.4f}"
        print(summary)
        print(f"checkpoint: {Path(train_config.out_dir) / CHECKPOINT_NAME}")
    return 0
