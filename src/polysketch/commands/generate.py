"""``polysketch generate``: sample text from a checkpoint written by ``polysketch train``.

Rebuilds the ``TransformerLM`` from the checkpoint's model config and weights (the feature
maps' random buffers included), encodes ``--prompt`` with the byte tokenizer and appends
``--max-new-tokens`` tokens decoded with the model's constant-size recurrent state (or KV
cache for softmax / polynomial attention). ``--temperature 0`` (or ``--top-k 1``) is greedy;
otherwise sampling is seeded by ``--seed``. Prints prompt + continuation. The checkpoint is
loaded without running code from it and verified against its checksum: a crafted, damaged or
mismatched file is refused with an error naming it.
"""

from __future__ import annotations

import argparse

import torch

from ..data.tokenizer import ByteTokenizer
from ..train import load_model  # re-exported: polysketch.commands.generate.load_model
from ._common import check_device, fail

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``generate`` on the top-level CLI's ``subparsers``."""
    p = subparsers.add_parser(
        "generate",
        help="sample text from a trained checkpoint",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, help="ckpt.pt written by `polysketch train`")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Print ``--num-samples`` continuations of ``--prompt``; 2 on bad input."""
    try:
        model, state = load_model(args.checkpoint, check_device(args.device))
        source = state.get("metadata", {}).get("source", {})
        if source.get("task") == "mqar":
            raise ValueError(
                f"--checkpoint {args.checkpoint} is an MQAR model, not a byte-level text model"
            )
        if not args.prompt:
            raise ValueError("--prompt must not be empty")
        if args.num_samples < 1:
            raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
        tokenizer = ByteTokenizer()
        device = next(model.parameters()).device
        idx = tokenizer.encode(args.prompt).to(device).unsqueeze(0).repeat(args.num_samples, 1)
        out = model.generate(
            idx,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            generator=torch.Generator().manual_seed(args.seed),
        )
    except (ValueError, TypeError, OSError) as err:
        return fail("generate", err)
    for i, row in enumerate(out.cpu()):
        if i:
            print("-" * 40)
        print(tokenizer.decode(row))
    return 0
