"""One layer's decoding step: a converted layer's attention vs SDPA over P cached keys.

Issue 22 ("Decoding speed"): a whole-model step at P = 2048 is dominated by the model's
matmuls, so the attention's per-call overhead decides the ratio to softmax. This times the
attention of one converted Llama layer alone (4 heads of 64, keys/values already repeated to
4 heads, batch 1, one token after a prefill of 130 tokens, no gradient) against
``F.scaled_dot_product_attention`` of one query over P keys of 2 key/value heads
(``enable_gqa``). The cases take turns within each round; each prints the minimum and the
median over the rounds of the mean µs per call, and the ratio SDPA / case of the minima
(> 1: faster than SDPA).

    python benchmarks/decode_step.py                         # psf_random psf_mixed hedgehog
    python benchmarks/decode_step.py --attentions psf_random --rounds 25

The minimum is the steadier figure on a shared machine (another job only ever adds time).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F


def _timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attentions", nargs="+", default=["psf_random", "psf_mixed", "hedgehog"])
    parser.add_argument("--position", type=int, default=2048, help="P, SDPA's cached keys")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300, help="calls per case and round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("position", "rounds", "calls", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    from polysketch.integrations.transformers.attention import PolysketchAttention

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1, 64, generator=g) for _ in range(3))
    kc, vc = (torch.randn(1, 2, args.position, 64, generator=g) for _ in range(2))
    cases = {"sdpa": lambda: F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)}
    for attention in args.attentions:
        core = PolysketchAttention.from_name(attention, head_dim=64, num_heads=4,
                                             scaling=0.125)  # fmt: skip
        state = core.new_state()
        prefill = [torch.randn(1, 4, 130, 64, generator=g) for _ in range(3)]
        with torch.no_grad():
            core(*prefill, state=state)

        def step(core=core, state=state):  # each call steps a copy: the same state every time
            core(q, k, v, state=copy.copy(state))

        cases[attention] = step
    times = {name: [] for name in cases}
    with torch.no_grad():
        for fn in cases.values():
            _timed(fn, 50)  # warm-up
        for _ in range(args.rounds):
            for name, fn in cases.items():
                times[name].append(_timed(fn, args.calls))
    print(f"one decoding step, 1 layer, P = {args.position}, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.calls} calls; torch {torch.__version__}")  # fmt: skip
    base = min(times["sdpa"])
    for name, xs in times.items():
        print(f"{name:12s} min {min(xs):7.1f} us   median {statistics.median(xs):7.1f} us   "
              f"x sdpa {base / min(xs):.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
