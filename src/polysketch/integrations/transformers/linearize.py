"""Linearizing a pretrained softmax LM: attention transfer, then a short fine-tune.

Following Hedgehog (Zhang et al. 2024) and LoLCATs (Zhang et al. 2025):

* stage 0: ``convert(model, attention, ...)`` keeps every pretrained weight and adds the new
  modules (q/k LayerNorms, per-head feature maps);
* stage 1, attention transfer (``attention_transfer``): only the added modules train; each
  layer minimizes ‖O_lin − O_softmax‖² / ‖O_softmax‖² between its kernelized output and its
  own softmax output on real text, the losses of all layers summed. One forward pass
  computes both: in transfer mode every layer returns the softmax output (the teacher's),
  so layer l learns on exactly the inputs the softmax model gives it (what hooks on the
  softmax model would capture, without storing them);
* stage 2, fine-tune (``finetune``): the LM loss with LoRA adapters (peft) on the attention
  projections plus the added modules, merged back afterwards, or a full fine-tune.

``linearize`` runs all of it and measures the validation loss (nats/token; perplexity =
exp) of the original, after conversion, after stage 1 and after stage 2; ``linearize_saved``
does it for a model saved with ``save_pretrained`` and a ``polysketch.data`` corpus, and saves
and reloads the converted model (what ``polysketch linearize`` runs). With LoRA, the
target modules (``lora_targets``: the linear layers of the attention modules, or the names
given) are checked against the model before any work, so a model they do not fit fails at
once, not after conversion and transfer.

Using peft yourself: ``get_peft_model`` freezes every module it does not adapt, the ones
``convert`` added included, so they would silently stop training. Pass
``modules_to_save=peft_modules_to_save(model)`` to ``LoraConfig`` (trainable copies, merged
back by ``merge_and_unload``), or set ``requires_grad`` on ``trainable_attention_parameters``
after ``get_peft_model`` (what ``finetune`` does)::

    config = LoraConfig(r=8, target_modules=lora_targets(model),
                        modules_to_save=peft_modules_to_save(model))
    peft_model = get_peft_model(model, config)
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from ..._checks import check_float, check_int, check_positive_int
from ..._files import replace_dir
from ...data.corpus import load_corpus
from ...train.batches import CorpusBatches
from .convert import attention_modules, convert, converted_cores, load_converted
from .lora import lora_model, lora_targets, peft_modules_to_save, require_peft

__all__ = [
    "LinearizeConfig",
    "attention_transfer",
    "evaluate_loss",
    "finetune",
    "linearize",
    "linearize_saved",
    "lora_targets",
    "peft_modules_to_save",
    "trainable_attention_parameters",
    "EVAL_BATCH",
]

EVAL_BATCH = 8
"""Windows per evaluation batch: the validation set is ``eval_batches · EVAL_BATCH`` windows."""


@dataclass
class LinearizeConfig:
    """Budgets and optimizer settings of ``linearize`` (tokens = steps · batch · seq_len).

    transfer_batch_size: sequences per attention-transfer step (None: ``batch_size``); the
    transfer loss is dense (every position of every layer), so smaller batches and more
    steps use a token budget better.

    finetune: "lora" (peft adapters on the attention projections + the added modules,
    merged after training), "full" (every weight) or "none".

    lora_targets: module names (or name suffixes, as peft matches them) that LoRA adapts;
    None: the linear layers of the attention modules (``lora_targets(model)``).
    """

    seq_len: int = 256
    batch_size: int = 8
    transfer_batch_size: int | None = None
    transfer_steps: int = 100
    transfer_lr: float = 1e-2
    finetune_steps: int = 100
    finetune_lr: float = 1e-3
    finetune: str = "lora"
    lora_rank: int = 8
    lora_targets: tuple[str, ...] | None = None
    eval_batches: int = 16
    seed: int = 0
    progress: bool | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "lora_rank", "eval_batches"):
            setattr(self, name, check_positive_int(getattr(self, name), name))
        if self.transfer_batch_size is None:
            self.transfer_batch_size = self.batch_size
        self.transfer_batch_size = check_positive_int(
            self.transfer_batch_size, "transfer_batch_size"
        )
        for name in ("transfer_steps", "finetune_steps", "seed"):
            setattr(self, name, check_int(getattr(self, name), name, minimum=0))
        for name in ("transfer_lr", "finetune_lr"):
            v = check_float(getattr(self, name), name, minimum=0.0, strict_minimum=True)
            setattr(self, name, v)
        if self.finetune not in ("lora", "full", "none"):
            raise ValueError(f"finetune must be 'lora', 'full' or 'none', got {self.finetune!r}")
        if self.lora_targets is not None:
            if isinstance(self.lora_targets, str) or not all(
                isinstance(t, str) and t for t in self.lora_targets
            ):
                raise TypeError(
                    f"lora_targets must be a sequence of module names, got {self.lora_targets!r}"
                )
            self.lora_targets = tuple(self.lora_targets)

    def tokens(self, steps: int, batch_size: int | None = None) -> int:
        return steps * (self.batch_size if batch_size is None else batch_size) * self.seq_len


def trainable_attention_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``convert`` added (q/k norms, learnable feature maps)."""
    return [p for core in converted_cores(model) for p in core.parameters()]


def _show(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else bool(progress)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def evaluate_loss(
    model: nn.Module, tokens: torch.Tensor, *, seq_len: int, batch_size: int = 8, max_batches=None
) -> float:
    """Mean next-token cross-entropy (nats/token) over consecutive windows of ``tokens``.

    Windows of ``seq_len + 1`` tokens, stepped by ``seq_len`` (every target predicted once,
    with the context of its window), ``max_batches`` batches at most (None: all).
    """
    seq_len = check_positive_int(seq_len, "seq_len")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise TypeError("tokens must be a 1-D tensor of token ids")
    windows = tokens.unfold(0, seq_len + 1, seq_len)
    if len(windows) == 0:
        raise ValueError(f"tokens holds {tokens.numel()} ids, fewer than seq_len + 1")
    if max_batches is not None:
        windows = windows[: check_positive_int(max_batches, "max_batches") * batch_size]
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    dev = _device(model)
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size].to(dev)
        logits = model(input_ids=w[:, :-1], use_cache=False).logits
        loss = nn.functional.cross_entropy(
            logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum"
        )
        total += float(loss)
        count += w[:, 1:].numel()
    model.train(was_training)
    return total / count


def attention_transfer(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    steps: int,
    seq_len: int = 256,
    batch_size: int = 8,
    lr: float = 1e-2,
    seed: int = 0,
    progress: bool | None = None,
) -> list[float]:
    """Stage 1: train only the added modules to match each layer's softmax output (see doc).

    ``tokens``: 1-D training token stream; random windows of ``seq_len`` tokens. Returns the
    mean per-layer relative output MSE before each step (empty if nothing is trainable).
    """
    steps = check_int(steps, "steps", minimum=0)
    lr = check_float(lr, "lr", minimum=0.0, strict_minimum=True)
    cores = converted_cores(model)
    params = trainable_attention_parameters(model)
    if not params or steps == 0:
        return []
    if cores[0].form == "softmax":
        raise ValueError("attention transfer needs a kernelized attention, not softmax")
    requires = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    batches = CorpusBatches(tokens, seq_len, seed, name="tokens")
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, steps))
    history: list[float] = []
    was_training = model.training
    model.eval()  # no dropout: the teacher must be the model itself
    for core in cores:
        core.transfer = True
    try:
        with torch.enable_grad():
            bar = tqdm(range(steps), desc="attention transfer", disable=not _show(progress))
            for _ in bar:
                x, _ = batches.next(batch_size)
                model(input_ids=x.to(_device(model)), use_cache=False)
                loss = torch.stack([c.transfer_loss for c in cores]).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                history.append(float(loss.detach()))
                bar.set_postfix(mse=f"{history[-1]:.4f}")
    finally:
        for core in cores:
            core.transfer, core.transfer_loss = False, None
        for p, r in requires.items():
            p.requires_grad_(r)
        model.train(was_training)
    return history


def finetune(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    steps: int,
    seq_len: int = 256,
    batch_size: int = 8,
    lr: float = 1e-3,
    mode: str = "lora",
    lora_rank: int = 8,
    lora_targets: Sequence[str] | None = None,
    seed: int = 1,
    progress: bool | None = None,
) -> tuple[nn.Module, list[float]]:
    """Stage 2: next-token loss on random windows of ``tokens``; returns (model, losses).

    ``mode="lora"``: peft LoRA (rank ``lora_rank``) on ``lora_targets`` (None: the attention
    projections, see ``lora_targets``), plus the added polysketch modules, merged into the
    weights afterwards (the returned model is a plain transformers model again); ``"full"``:
    every parameter trains.
    """
    steps = check_int(steps, "steps", minimum=0)
    if mode not in ("lora", "full"):
        raise ValueError(f"mode must be 'lora' or 'full', got {mode!r}")
    if steps == 0:
        return model, []
    requires = {p: p.requires_grad for p in model.parameters()}
    added = trainable_attention_parameters(model)
    if mode == "lora":
        train_model = lora_model(model, check_positive_int(lora_rank, "lora_rank"), lora_targets)
        for p in added:
            p.requires_grad_(True)
    else:
        train_model = model
        for p in model.parameters():
            p.requires_grad_(True)
    params = [p for p in train_model.parameters() if p.requires_grad]
    batches = CorpusBatches(tokens, seq_len, seed, name="tokens")
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))
        ),
    )
    history: list[float] = []
    train_model.train()
    with torch.enable_grad():
        bar = tqdm(range(steps), desc=f"fine-tune ({mode})", disable=not _show(progress))
        for _ in bar:
            x, y = batches.next(batch_size)
            dev = _device(model)
            logits = train_model(input_ids=x.to(dev), use_cache=False).logits
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.to(dev).flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            history.append(float(loss.detach()))
            bar.set_postfix(loss=f"{history[-1]:.4f}")
    train_model.eval()
    if mode == "lora":
        model = train_model.merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(requires.get(p, True))
    return model, history


def decode_state_floats(model: nn.Module, seq_len: int) -> dict[str, int]:
    """Decode memory per sequence at ``seq_len`` tokens: polysketch state vs the KV cache.

    KV cache: 2·H_kv·D·T per layer (the model's own, GQA-aware); state: see
    ``PolysketchAttention.decode_state_size`` (query heads; k, v are repeated for GQA).
    """
    config = model.config.get_text_config(decoder=True)
    h_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    cores = converted_cores(model)
    kv = sum(2 * h_kv * c.head_dim * seq_len for c in cores)
    if cores[0].uses_state_cache:
        state = sum(c.decode_state_size(seq_len) for c in cores)
    else:  # softmax / exact polynomial decode from the model's own (GQA) KV cache
        state = kv
    return {"seq_len": seq_len, "kv_cache_floats": kv, "state_floats": state}


def linearize(
    model: nn.Module,
    train_tokens: torch.Tensor,
    val_tokens: torch.Tensor,
    *,
    attention: str = "psf_mixed",
    config: LinearizeConfig | None = None,
    **convert_kwargs,
) -> tuple[nn.Module, dict]:
    """Convert a softmax ``model`` and linearize it (stages 0–2); returns (model, results).

    results: ``loss_*`` (nats/token on ``val_tokens``) and ``ppl_*`` for ``original``,
    ``converted``, ``transfer``, ``finetune``; ``tokens_*`` used by each stage; the loss
    histories; ``decode_state`` (``decode_state_floats`` at seq_len and 64k tokens); seconds.
    """
    cfg = LinearizeConfig() if config is None else config
    if not isinstance(cfg, LinearizeConfig):
        raise TypeError(f"config must be a LinearizeConfig, got {type(cfg).__name__}")
    attention_modules(model)  # fail early on unsupported models
    targets = None
    if cfg.finetune == "lora" and cfg.finetune_steps > 0:  # fail early, not after the transfer
        require_peft()
        targets = lora_targets(model, cfg.lora_targets)
    ev = {"seq_len": cfg.seq_len, "batch_size": EVAL_BATCH, "max_batches": cfg.eval_batches}
    res: dict = {"attention": attention, "config": asdict(cfg)}
    t0 = time.perf_counter()
    res["loss_original"] = evaluate_loss(model, val_tokens, **ev)
    convert(model, attention, **convert_kwargs)
    res["loss_converted"] = evaluate_loss(model, val_tokens, **ev)
    res["transfer_history"] = attention_transfer(
        model, train_tokens, steps=cfg.transfer_steps, seq_len=cfg.seq_len,
        batch_size=cfg.transfer_batch_size, lr=cfg.transfer_lr, seed=cfg.seed,
        progress=cfg.progress,
    )  # fmt: skip
    res["loss_transfer"] = evaluate_loss(model, val_tokens, **ev)
    ft_steps = 0 if cfg.finetune == "none" else cfg.finetune_steps
    model, res["finetune_history"] = finetune(
        model, train_tokens, steps=ft_steps, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
        lr=cfg.finetune_lr, mode="lora" if cfg.finetune == "none" else cfg.finetune,
        lora_rank=cfg.lora_rank, lora_targets=targets, seed=cfg.seed + 1,
        progress=cfg.progress,
    )  # fmt: skip
    res["loss_finetune"] = evaluate_loss(model, val_tokens, **ev)
    for stage in ("original", "converted", "transfer", "finetune"):
        res[f"ppl_{stage}"] = math.exp(res[f"loss_{stage}"])
    res["tokens_transfer"] = cfg.tokens(len(res["transfer_history"]), cfg.transfer_batch_size)
    res["tokens_finetune"] = cfg.tokens(ft_steps)
    res["decode_state"] = [decode_state_floats(model, t) for t in (cfg.seq_len, 65536)]
    res["seconds"] = time.perf_counter() - t0
    return model, res


def linearize_saved(
    model_path: str | os.PathLike,
    attention: str,
    data: str,
    *,
    config: LinearizeConfig | None = None,
    save_to: str | os.PathLike | None = None,
    chunk_size: int | None = None,
    max_bytes: int | None = None,
    **map_kwargs,
) -> dict:
    """``linearize`` a causal LM saved with ``save_pretrained`` on a byte-level corpus.

    Loads ``model_path`` with ``AutoModelForCausalLM.from_pretrained``, reads ``data``
    (``polysketch.data.load_corpus``: ``shakespeare``, ``stdlib`` or a text path; at most
    ``max_bytes``), seeds torch with ``config.seed`` and runs ``linearize`` (``chunk_size``
    and ``map_kwargs`` go to ``convert``: None is a model preset's block, else 64). With
    ``save_to``, the converted model is saved there atomically (a folder swapped into place)
    and reloaded with ``load_converted``; its validation loss is ``loss_reloaded``. Returns
    ``linearize``'s results plus ``model`` and ``data`` (the paths given). The model must
    have a byte vocabulary (>= 256 ids): a ValueError otherwise.
    """
    from transformers import AutoModelForCausalLM

    cfg = LinearizeConfig() if config is None else config
    corpus = load_corpus(data, max_bytes=max_bytes)
    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    vocab = model.get_output_embeddings().weight.shape[0]
    if vocab < corpus.vocab_size:
        raise ValueError(
            f"model {model_path} has a vocabulary of {vocab} ids; the byte-tokenized data "
            f"needs >= {corpus.vocab_size}"
        )
    torch.manual_seed(cfg.seed)
    model, res = linearize(
        model, corpus.train, corpus.val, attention=attention, config=cfg,
        chunk_size=chunk_size, seed=cfg.seed, **map_kwargs,
    )  # fmt: skip
    res["model"] = str(model_path)
    res["data"] = str(data)
    if save_to is not None:
        reloaded = load_converted(_save_model_atomically(model, Path(save_to)))
        ev = {"seq_len": cfg.seq_len, "batch_size": EVAL_BATCH, "max_batches": cfg.eval_batches}
        res["loss_reloaded"] = evaluate_loss(reloaded, corpus.val, **ev)
    return res


def _save_model_atomically(model: nn.Module, path: Path) -> Path:
    """``save_pretrained`` into a temporary folder, then swap it into ``path``."""
    return replace_dir(path, model.save_pretrained)
