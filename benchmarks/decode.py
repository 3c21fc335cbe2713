"""Decoding speed: converted HF Llama and TransformerLM, kernelized vs softmax, side by side.

Issue 22 ("Decoding speed"): batch 1, 1 thread, greedy, 32 tokens timed after a warm-up, the
median of 3 runs, on a 4 × 256 Llama (4 query heads, 2 key/value heads, head dim 64) and a
TransformerLM of the same size, at prompt lengths 2048 and 16384. Targets: converted-model
decode <= the softmax original's time per token at 2048, and >= 2x faster at 16k; the same
for TransformerLM.generate. Each row prints ms/token and the ratio to softmax measured in
the same run (> 1: faster than softmax); the attentions take turns within each of the 3
rounds, so a machine whose load drifts slows them alike.

    python benchmarks/decode.py                       # both, P = 2048 and 16384, 1 thread
    python benchmarks/decode.py --positions 2048 --models lm --threads 1

Random weights (speed does not depend on them); random prompt tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from polysketch.eval.bench.decode import (
    DECODE_ATTENTIONS,
    DecodeBenchConfig,
    format_decode_report,
    rows_of,
    run_decode_benchmark,
    time_decode,
)


def _llama(device, max_positions=32768):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=max_positions,
                                   tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(device).eval()


def hf_rows(attentions, positions, *, tokens, warmup, repeats, device, chunk_size,
            progress=None):  # fmt: skip
    """Rows like ``run_decode_benchmark``'s for a converted Llama (softmax: the original);
    ``progress(position, runs)`` after each position (default: print to stderr)."""
    import transformers

    from polysketch.integrations.transformers import PolysketchCache, convert

    models = {}
    longest = max(32768, max(positions) + warmup + tokens)
    for attention in attentions:
        models[attention] = _llama(device, max_positions=longest)
        if attention != "softmax":
            convert(models[attention], attention, chunk_size=chunk_size)

    def step(state, model):
        cache, token = state
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
        return cache, logits[:, -1:].argmax(-1)

    measured = {}
    for position in positions:
        gen = torch.Generator().manual_seed(position)
        prompt = torch.randint(0, 256, (1, position), generator=gen).to(device)

        def prefill(model, attention, prompt=prompt):
            cache = (transformers.DynamicCache() if attention == "softmax"
                     else PolysketchCache(model))  # fmt: skip
            logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits
            return cache, logits[:, -1:].argmax(-1)

        cases = {a: (lambda m=m, a=a: prefill(m, a), lambda s, m=m: step(s, m))
                 for a, m in models.items()}  # fmt: skip
        measured[position] = time_decode(cases, tokens=tokens, warmup=warmup, repeats=repeats,
                                         device=device)  # fmt: skip
        if progress is None:
            _progress("hf", position, measured[position])
        else:
            progress(position, measured[position])
    return rows_of(measured)


def _progress(kind, position, runs):
    for attention, values in runs.items():
        text = " ".join(f"{v:.2f}" for v in values)
        print(f"  {kind} {attention} P={position}: {text} ms/token", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--attentions", nargs="+", default=list(DECODE_ATTENTIONS))
    parser.add_argument("--models", nargs="+", choices=["hf", "lm"], default=["hf", "lm"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="rounds (median reported)")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), device {args.device}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    if "hf" in args.models:
        kw = {"tokens": args.tokens, "warmup": args.warmup, "repeats": args.repeats,
              "device": args.device, "chunk_size": args.chunk_size}  # fmt: skip
        rows = hf_rows(args.attentions, args.positions, **kw)
        print(format_decode_report(rows, "converted Llama 4 x 256 (GQA 4/2): decode ms/token"))
    if "lm" in args.models:
        config = DecodeBenchConfig(attentions=args.attentions, positions=args.positions,
                                   tokens=args.tokens, warmup=args.warmup, repeats=args.repeats,
                                   chunk_size=args.chunk_size, device=args.device)  # fmt: skip

        rows = run_decode_benchmark(config, lambda p, runs: _progress("lm", p, runs))
        print(format_decode_report(rows, "TransformerLM 4 x 256: decode ms/token"))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
