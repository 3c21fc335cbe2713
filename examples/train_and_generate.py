"""Train a tiny polysketch language model, save a checkpoint, load it back and generate.

The model is a ``polysketch.nn.TransformerLM`` with PolySketchFormer's linear-time
``psf_random`` attention (LayerNorm on q/k, a degree-2 Gaussian sketch with r = 32,
self-tensored so scores approximate (q·k)^4, block lower-triangular causal algorithm). It is
trained with ``polysketch.train.train`` (AdamW, warmup + cosine, atomic checkpoints) for a few
steps on a short built-in text tokenized to bytes — enough to see the loss fall, not to write
Shakespeare. The checkpoint written by ``train`` (``out_dir/ckpt.pt``) holds the model's
weights *and* its feature maps' random sketch matrices, so the reloaded model computes exactly
the same function; we check that, then decode with a constant-size state per layer.

Run: ``python examples/train_and_generate.py`` (well under a minute on CPU).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from polysketch.data.corpus import Corpus
from polysketch.data.tokenizer import ByteTokenizer
from polysketch.nn import TransformerConfig, TransformerLM
from polysketch.train import TrainConfig, load_checkpoint, train

TEXT = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune,
must be in want of a wife. However little known the feelings or views of such a man may be on
his first entering a neighbourhood, this truth is so well fixed in the minds of the
surrounding families, that he is considered as the rightful property of some one or other of
their daughters.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in
my purse, and nothing particular to interest me on shore, I thought I would sail about a
little and see the watery part of the world.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age
of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season
of Light, it was the season of Darkness, it was the spring of hope, it was the winter of
despair.
"""


def main() -> None:
    torch.manual_seed(0)
    tokenizer = ByteTokenizer()
    tokens = tokenizer.encode(TEXT * 4)
    split = int(0.9 * len(tokens))
    corpus = Corpus(tokens[:split], tokens[split:], tokenizer.vocab_size, "built-in text")

    model_config = TransformerConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=64, attention="psf_random", chunk_size=32
    )
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp) / "run"
        train_config = TrainConfig(
            steps=40, batch_size=8, lr=3e-3, min_lr=3e-4, warmup_steps=5, eval_interval=20,
            eval_batches=2, log_interval=10, seed=0, out_dir=str(out_dir),
        )  # fmt: skip
        history = train(model_config, train_config, corpus, progress=False)
        first, last = history["train"][0]["loss"], history["train"][-1]["loss"]
        print(f"trained {train_config.steps} steps: train loss {first:.3f} -> {last:.3f}")
        for row in history["val"]:
            print(f"  step {row['step']}: validation loss {row['loss']:.3f}")

        # Reload from the checkpoint: same weights and same random sketches.
        ckpt = load_checkpoint(out_dir / "ckpt.pt", restore_rng=False)
        model = TransformerLM(TransformerConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"])
        model.eval()
        trained = history["model"].eval()
        probe = tokens[:64][None]
        same = torch.equal(model(probe)[0], trained(probe)[0])
        print(f"checkpoint {ckpt['step']} steps reloaded; identical logits: {same}")
        if not same:
            raise SystemExit("the reloaded model should compute the same logits")

    prompt = "It was the "
    idx = tokenizer.encode(prompt)[None]
    out = model.generate(
        idx, 80, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(0)
    )
    print(f"sample: {tokenizer.decode(out[0])!r}")
    state = model.decode_state_size(out.shape[1])
    print(f"decoding state: {state} floats per sequence, the same at any length")


if __name__ == "__main__":
    main()
