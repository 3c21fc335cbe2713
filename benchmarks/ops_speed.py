"""Speed of the attention ops, this checkout against another one, side by side in one run.

Times, with ``torch.utils.benchmark`` (median of blocked runs), PolySketchFormer's shapes
(psf_random: degree-2 Gaussian sketch, r = 32, self-tensored; B = 1, H = 4, D = E = 64, block
256, fp32, one thread):

* ``fwd T``: causal ``linear_attention`` on the features (no grad), T = 2048 and 8192;
* ``fwd+bwd T``: the same with gradients for the features and values;
* ``decode``: one ``linear_attention_step`` after a prefill of 2048 tokens (features given),
  and ``decode+map`` with the feature map of the new token's q and k.

Each measurement runs in a fresh process of the tree under test (``--worker``); with
``--baseline SRC`` the two trees alternate, round after round (so a drift of the machine's speed
hits both), and the table shows the median over rounds and the ratio baseline / this (> 1:
this checkout is faster)::

    python benchmarks/ops_speed.py --baseline /path/to/other/checkout/src --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def worker(lengths, min_time, prefill):
    import torch
    import torch.nn.functional as F
    from torch.utils.benchmark import Timer

    from polysketch import features
    from polysketch.ops import linear_attention, linear_attention_step

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    fm = features.create("polysketch", 64, degree=2, num_features=32, nonnegative=True, seed=0)
    kw = dict(causal=True, square=True, chunk_size=256, denominator_offset=1.0)

    def inputs(t):
        q, k = (F.layer_norm(torch.randn(1, 4, t, 64, generator=g), (64,)) for _ in "qk")
        return q, k, torch.randn(1, 4, t, 64, generator=g)

    def median_ms(fn):
        fn()
        return (
            Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_time).median * 1e3
        )

    out = {}
    for t in lengths:
        q, k, v = inputs(t)
        pq, pk = fm.query(q), fm.key(k)
        with torch.no_grad():
            out[f"fwd {t}"] = median_ms(lambda pq=pq, pk=pk, v=v: linear_attention(pq, pk, v, **kw))
        leaves = [x.clone().requires_grad_(True) for x in (pq, pk, v)]

        def train(leaves=leaves):
            linear_attention(*leaves, **kw).sum().backward()

        out[f"fwd+bwd {t}"] = median_ms(train)
    q, k, v = inputs(prefill + 1)
    with torch.no_grad():
        pq, pk = fm.query(q), fm.key(k)
        _, state = linear_attention(pq[..., :-1, :], pk[..., :-1, :], v[..., :-1, :],
                                    return_state=True, **kw)  # fmt: skip
        one = [x[..., -1:, :] for x in (pq, pk, v)]
        step = dict(square=True, denominator_offset=1.0)
        out["decode"] = median_ms(lambda: linear_attention_step(*one, state, **step))
        qk = [x[..., -1:, :] for x in (q, k)]

        def with_map():
            return linear_attention_step(fm.query(qk[0]), fm.key(qk[1]), one[2], state, **step)

        out["decode+map"] = median_ms(with_map)
    return out


def run_tree(src, args):
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", "--lengths", args.lengths,
           "--min-time", str(args.min_time), "--prefill", str(args.prefill)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--baseline", type=Path, help="the src/ folder of another checkout")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--min-time", type=float, default=1.0)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        lengths = [int(x) for x in args.lengths.split(",")]
        print(json.dumps(worker(lengths, args.min_time, args.prefill)))
        return
    trees = {"this": SRC} | ({"baseline": args.baseline} if args.baseline else {})
    runs = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            runs[name].append(run_tree(trees[name], args))
    keys = list(runs["this"][0])
    med = {n: {k: statistics.median(x[k] for x in rs) for k in keys} for n, rs in runs.items()}
    head = f"{'ms (median of ' + str(args.rounds) + ' rounds)':<28}{'this':>10}"
    if args.baseline:
        head += f"{'baseline':>10}{'baseline/this':>15}"
    print(head)
    for k in keys:
        row = f"{k:<28}{med['this'][k]:>10.3f}"
        if args.baseline:
            b = med["baseline"][k]
            row += f"{b:>10.3f}{b / med['this'][k]:>14.2f}x"
        print(row)


if __name__ == "__main__":
    main()
