"""``polysketch train``: train a TransformerLM on a text corpus or on MQAR.

Trains the byte-level language model of ``polysketch.nn.TransformerLM`` with any attention
(``--attention``: a feature-map name, ``softmax``, ``polynomial`` or a PolySketchFormer preset;
``--map-kw key=value`` passes keywords to the feature map) on ``--corpus`` (``shakespeare``,
``stdlib`` or a path to a text file / folder) or on the MQAR recall task (``--task mqar``).
Writes ``metrics.csv``, ``metrics.jsonl`` and the checkpoint ``ckpt.pt`` into ``--out``; a
non-empty ``--out`` is refused unless ``--resume`` (continue its run) or ``--overwrite``
(replace it). ``--resume`` continues from the checkpoint exactly: configs and data source
come from it (a model, data or optimization flag given with ``--resume`` is ignored, with a
warning); ``--steps`` may extend the run, ``--device`` and ``--compile`` apply. Under
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

from .._checks import parse_key_values
from .._files import temporary_pattern
from ..data.corpus import load_corpus
from ..data.mqar import MQARConfig
from ..nn import TransformerConfig, TransformerLM, valid_model_attentions
from ..train import (
    CHECKPOINT_NAME,
    CheckpointError,
    MQARData,
    TrainConfig,
    load_checkpoint,
    train,
)
from ..train.distributed import env_world_size, rank_slice
from ..train.loop import TrainingOutOfMemoryError, WarmupWarning
from ..train.mesh import check_cp_model
from ..train.schedule import learning_rate
from ._common import ERROR_EXIT, check_device, fail, prepare_out_dir, warn

__all__ = ["add_parser", "run", "load_data", "default_warmup", "ERROR_EXIT", "RESUME_FLAGS"]

RESUME_FLAGS = ("out", "resume", "steps", "device", "compile", "no_progress", "overwrite", "cp",
                "fsdp")  # fmt: skip
"""The options ``--resume`` honours; every other option is the checkpoint's (warned about)."""

_ACTIONS = {
    "store": argparse._StoreAction,
    "store_true": argparse._StoreTrueAction,
    "append": argparse._AppendAction,
}


def _recording(base: type[argparse.Action]) -> type[argparse.Action]:
    """``base`` that also records, in ``namespace.given``, the options the user typed."""

    class Recording(base):
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            given = dict(getattr(namespace, "given", None) or {})
            given[self.dest] = max(self.option_strings, key=len)
            namespace.given = given

    return Recording


def default_warmup(steps: int) -> int:
    """``--warmup-steps`` when not given: 10% of the run, at most ``TrainConfig``'s 100 (so
    runs of 1000 steps and more keep it; a 30-step run warms up for 3)."""
    return min(TrainConfig.warmup_steps, steps // 10)


class _Recorded:
    """An argument group whose ``add_argument`` records the options given (``_recording``)."""

    def __init__(self, group):
        self.group = group

    def add_argument(self, *names, **kwargs):
        kwargs["action"] = _recording(_ACTIONS[kwargs.get("action", "store")])
        return self.group.add_argument(*names, **kwargs)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``train`` on the top-level CLI's ``subparsers``."""
    mdef, tdef = TransformerConfig(), TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train a small LM (corpus or MQAR) with any attention; checkpoints, resume, DDP",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.set_defaults(given=None)
    data = _Recorded(p.add_argument_group("data"))
    src = _Recorded(data.group.add_mutually_exclusive_group())
    src.add_argument("--corpus", default="shakespeare", help="shakespeare | stdlib | PATH")
    src.add_argument("--task", choices=["mqar"], default=None, help="synthetic task instead")
    data.add_argument("--max-bytes", type=int, default=None, help="cap on the corpus size")
    data.add_argument("--val-fraction", type=float, default=0.1)
    data.add_argument(
        "--pack", action="store_true",
        help="pack each micro-batch into one row of documents (a new one at every row start "
        "and after every blank line), each computed alone (linear attentions only)",
    )  # fmt: skip
    data.add_argument("--mqar-vocab", type=int, default=256)
    data.add_argument("--mqar-seq-len", type=int, default=64)
    data.add_argument("--mqar-kv-pairs", type=int, default=8)
    data.add_argument("--mqar-train", type=int, default=20000, help="training examples")
    data.add_argument("--mqar-val", type=int, default=1000, help="validation examples")

    model = _Recorded(p.add_argument_group("model"))
    model.add_argument("--attention", default=mdef.attention)
    model.add_argument(
        "--map-kw", action="append", metavar="KEY=VALUE", help="feature-map keyword (repeat)"
    )
    model.add_argument("--n-layer", type=int, default=mdef.n_layer)
    model.add_argument("--n-head", type=int, default=mdef.n_head)
    model.add_argument("--n-embd", type=int, default=mdef.n_embd)
    model.add_argument("--block-size", type=int, default=mdef.block_size)
    model.add_argument("--chunk-size", type=int, default=mdef.chunk_size)
    model.add_argument("--dropout", type=float, default=mdef.dropout)
    model.add_argument("--no-rope", action="store_true", help="disable rotary embeddings")
    model.add_argument(
        "--qk-dim", type=int, default=None, help="per-head query/key size (default: head dim)"
    )
    model.add_argument(
        "--value-dim", type=int, default=None,
        help="per-head value size of the attention (default: n_embd / its heads)",
    )  # fmt: skip
    model.add_argument(
        "--short-conv", type=int, default=0, metavar="K",
        help="causal depthwise convolution of K taps on q, k, v (BASED / Zoology); 0 = off",
    )  # fmt: skip
    model.add_argument(
        "--window", type=int, default=None, metavar="W",
        help="keys each query sees with --attention sliding_window (itself included; required "
        "there)",
    )  # fmt: skip
    model.add_argument(
        "--local-window", type=int, default=None, metavar="W",
        help="add an exact sliding-window softmax branch over the last W tokens beside the "
        "attention in every layer (its own projections and normalizer; BASED's local + global)",
    )  # fmt: skip
    model.add_argument(
        "--local-shared", action="store_true", default=None,
        help="the --local-window branch reads the attention's q/k/v and output projections "
        "(half the projections; default: the model preset's, else its own)",
    )  # fmt: skip
    model.add_argument(
        "--global-heads", type=int, default=None, metavar="G",
        help="heads of the attention beside the --local-window branch (q/k of the model's "
        "head dim, values of n_embd/G; default: the model preset's, else --n-head)",
    )  # fmt: skip
    model.add_argument(
        "--global-every", type=int, default=None, metavar="K",
        help="only every K-th layer (K-1, 2K-1, ...) has the attention beside the "
        "--local-window branch; the others are the window alone (default: every layer)",
    )  # fmt: skip

    model.add_argument(
        "--gradient-surrogate", type=float, default=None, metavar="LAMBDA",
        help="λ of the training-only surrogate gradient of attention without in-block scores "
        "(soft_hash_far; exactly 0 in value, see polysketch.nn.core; default: the model "
        "preset's, else 0)",
    )  # fmt: skip
    model.add_argument(
        "--no-global-rope", action="store_true",
        help="no RoPE on the q/k of the attention beside the --local-window branch (content "
        "only; the window keeps RoPE; default: the model preset's, else as the model)",
    )  # fmt: skip

    opt = _Recorded(p.add_argument_group("optimization"))
    opt.add_argument("--steps", type=int, default=None, help=f"(default {tdef.steps})")
    opt.add_argument("--batch-size", type=int, default=tdef.batch_size, help="global batch")
    opt.add_argument("--lr", type=float, default=tdef.lr)
    opt.add_argument("--min-lr", type=float, default=tdef.min_lr)
    opt.add_argument(
        "--warmup-steps", type=int, default=None,
        help=f"linear warmup steps (default: 10%% of --steps, at most {tdef.warmup_steps})",
    )  # fmt: skip
    opt.add_argument("--weight-decay", type=float, default=tdef.weight_decay)
    opt.add_argument("--grad-clip", type=float, default=tdef.grad_clip)
    opt.add_argument("--grad-accum", type=int, default=tdef.grad_accum)
    opt.add_argument("--amp", choices=["bf16"], default=None)
    opt.add_argument("--seed", type=int, default=tdef.seed, help="model, feature maps, data")
    opt.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    opt.add_argument(
        "--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
        help="torch.compile the model (backend: inductor when the flag is given alone)",
    )  # fmt: skip
    opt.add_argument(
        "--cp", type=int, default=tdef.cp, metavar="C",
        help="context parallelism: each sequence split over C processes (torchrun; dp = N / C)",
    )  # fmt: skip
    opt.add_argument(
        "--fsdp", action="store_true",
        help="FSDP2: shard parameters, gradients and optimizer state over all processes",
    )  # fmt: skip
    opt.add_argument(
        "--warm-start-steps",
        type=int,
        default=tdef.warm_start_steps,
        help="train the first N steps with exact polynomial attention, then the sketch",
    )

    out = _Recorded(p.add_argument_group("output"))
    out.add_argument(
        "--out", default="runs/train",
        help="folder for metrics and ckpt.pt (refused if not empty, unless --resume or "
        "--overwrite)",
    )  # fmt: skip
    out.add_argument(
        "--resume", action="store_true",
        help="continue from OUT/ckpt.pt (its configs win: model, data and optimization flags "
        "are ignored, with a warning; --steps, --device, --compile, --cp, --fsdp apply)",
    )  # fmt: skip
    out.add_argument(
        "--overwrite", action="store_true",
        help="train into a non-empty --out, replacing the run there (its ckpt.pt and metrics)",
    )  # fmt: skip
    out.add_argument("--eval-interval", type=int, default=tdef.eval_interval)
    out.add_argument("--eval-batches", type=int, default=tdef.eval_batches)
    out.add_argument("--log-interval", type=int, default=tdef.log_interval)
    out.add_argument("--checkpoint-interval", type=int, default=None, help="default: at end")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _configs_from_args(args):
    if args.attention not in valid_model_attentions():
        raise ValueError(
            f"--attention must be one of {valid_model_attentions()}, got {args.attention!r}"
        )
    if args.task == "mqar":
        source = {"task": "mqar", "vocab_size": args.mqar_vocab, "seq_len": args.mqar_seq_len,
                  "num_kv_pairs": args.mqar_kv_pairs, "num_train": args.mqar_train,
                  "num_val": args.mqar_val}  # fmt: skip
        vocab, block = args.mqar_vocab, args.mqar_seq_len
    else:
        source = {"task": "corpus", "corpus": str(args.corpus), "max_bytes": args.max_bytes,
                  "val_fraction": args.val_fraction}  # fmt: skip
        vocab, block = 256, args.block_size
    model_config = TransformerConfig(
        vocab_size=vocab,
        block_size=block,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        attention=args.attention,
        map_kwargs=parse_key_values(args.map_kw, "--map-kw"),
        chunk_size=args.chunk_size,
        rope=not args.no_rope,
        qk_dim=args.qk_dim,
        value_dim=args.value_dim,
        short_conv=args.short_conv,
        window=args.window,
        local_window=args.local_window,
        local_shared=args.local_shared,
        global_heads=args.global_heads,
        global_every=args.global_every,
        global_rope=False if args.no_global_rope else None,
        gradient_surrogate=args.gradient_surrogate,
        dropout=args.dropout,
        seed=args.seed,
    ).validate()
    steps = args.steps if args.steps is not None else TrainConfig.steps
    warmup = args.warmup_steps if args.warmup_steps is not None else default_warmup(steps)
    train_config = TrainConfig(
        steps=steps,
        batch_size=args.batch_size,
        block_size=block,
        lr=args.lr,
        min_lr=min(args.min_lr, args.lr),
        warmup_steps=warmup,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        grad_accum=args.grad_accum,
        eval_interval=args.eval_interval,
        eval_batches=args.eval_batches,
        log_interval=args.log_interval,
        amp=args.amp,
        seed=args.seed,
        out_dir=str(args.out),
        checkpoint_interval=args.checkpoint_interval,
        device=args.device,
        compile=args.compile,
        warm_start_steps=args.warm_start_steps,
        cp=args.cp,
        fsdp=args.fsdp,
        pack=args.pack,
    ).validate()
    if train_config.warm_start_steps:
        TransformerLM(model_config).set_exact_attention(True)  # fail early: nothing to switch
    return model_config, train_config, source


def _configs_from_checkpoint(args):
    path = Path(args.out) / CHECKPOINT_NAME
    state = load_checkpoint(path, restore_rng=False)
    try:
        model_config = TransformerConfig(**state["model_config"]).validate()
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
    if args.steps is not None:
        tc["steps"] = args.steps
    if args.device is not None:
        tc["device"] = args.device
    if args.compile is not None:
        tc["compile"] = args.compile
    tc["cp"], tc["fsdp"] = args.cp, args.fsdp  # the layout is this launch's, not the run's
    train_config = TrainConfig(**tc).validate()
    check_device(train_config.device, "--device" if args.device else "--device (the checkpoint's)")
    _warn_ignored(args, state)
    return model_config, train_config, source


def _warn_ignored(args, state: dict) -> None:
    """One warning line per option given with --resume that the checkpoint's config overrides."""
    configs = {**state.get("train_config", {}), **state.get("model_config", {})}
    configs["rope"] = state.get("model_config", {}).get("rope")
    aliases = {"no_rope": "rope", "no_global_rope": "global_rope", "map_kw": "map_kwargs"}
    for dest, flag in (args.given or {}).items():
        if dest in RESUME_FLAGS:
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
            check_device(args.device)
            model_config, train_config, source = _configs_from_args(args)
            has_run = (out / CHECKPOINT_NAME).is_file()
            hint = ", --resume to continue the run there" if has_run else ""
            prepare_out_dir(out, overwrite=args.overwrite, hint=hint)  # every rank refuses
            if args.overwrite and int(os.environ.get("RANK", "0")) == 0:  # rank 0 owns --out
                _replace_previous_run(out)
        # fail before loading data when the batch or the sequence cannot be split over ranks
        check_cp_model(model_config, train_config.cp, pack=train_config.pack)
        world = env_world_size()
        if train_config.cp > 1 and world % train_config.cp:
            raise ValueError(
                f"--cp {train_config.cp} must divide the number of processes ({world}): launch "
                f"with torchrun --nproc-per-node N, N a multiple of {train_config.cp}"
            )
        if train_config.fsdp and world == 1:
            raise ValueError("--fsdp needs several processes: launch with torchrun "
                             "--nproc-per-node N (N >= 2)")  # fmt: skip
        dp = max(world // train_config.cp, 1)
        rank_slice(train_config.batch_size, dp, 0, train_config.grad_accum)
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
