"""Packed sequences: the cost of resetting the state at document boundaries, measured.

Forward + backward (one thread, fp32) of causal linear attention on one packed row of
T = 8192 tokens, psf_random features (degree-2 Gaussian sketch, r = 32, squared; B = 1, H = 4,
D = E = 64, block 256), side by side in one run (``torch.utils.benchmark``, median):

* ``unpacked``: ``linear_attention`` on the whole row, no boundaries (the cost to match);
* ``varlen``: ``linear_attention(..., cu_seqlens=...)``, the pad-to-batch fast path of
  ``polysketch.ops.varlen`` (documents before the last sorted by length, in zero-padded
  batches under the dispatcher's group budget; the last alone);
* ``loop``: ``linear_attention`` once per document, concatenated;

for several packings, and prints the ratios to ``unpacked`` (< 1: faster). The load average
is printed beside the table (2 shared cores)::

    python benchmarks/cp_varlen.py [--out docs/results/cp] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from polysketch import features  # noqa: E402
from polysketch.ops import linear_attention  # noqa: E402

T = 8192
PACKINGS = {
    "8 x 1024": [1024] * 8,
    "64 x 128": [128] * 64,
    "2 x 4096": [4096] * 2,
    "32 x 128 + 4096 last": [128] * 32 + [4096],
    "4096 first + 32 x 128": [4096] + [128] * 32,
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--min-time", type=float, default=1.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    fm = features.create("polysketch", 64, degree=2, num_features=32, projection="gaussian",
                         nonnegative=True, seed=0)  # fmt: skip
    q, k = (F.layer_norm(torch.randn(1, 4, T, 64, generator=g), (64,)) for _ in "qk")
    v = torch.randn(1, 4, T, 64, generator=g)
    pq, pk = fm.query(q), fm.key(k)
    leaves = [x.detach().requires_grad_() for x in (pq, pk, v)]
    kw = {"causal": True, "square": True, "chunk_size": 256, "denominator_offset": 1.0}

    def run(cu, loop):
        a, b, c = leaves
        if loop:  # one call per document
            bounds = zip(cu, cu[1:], strict=False)
            out = torch.cat([linear_attention(a[..., s:e, :], b[..., s:e, :], c[..., s:e, :], **kw)
                             for s, e in bounds], dim=-2)  # fmt: skip
        else:
            out = linear_attention(a, b, c, cu_seqlens=cu, **kw)
        out.sum().backward()

    def ms(cu, loop=False):
        run(cu, loop)
        timer = Timer("run(cu, loop)", globals={"run": run, "cu": cu, "loop": loop})
        return timer.blocked_autorange(min_run_time=args.min_time).median * 1e3

    rows = []
    load = round(os.getloadavg()[0], 2)
    base = ms(None)
    for name, lengths in PACKINGS.items():
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        fast, loop = ms(cu), ms(cu, loop=True)
        rows.append({"packing": name, "documents": len(lengths), "unpacked_ms": base,
                     "varlen_ms": fast, "loop_ms": loop, "varlen_over_unpacked": fast / base,
                     "loop_over_unpacked": loop / base,
                     "load": load})  # fmt: skip
    print(f"T = {T}, B = 1, H = 4, psf_random, fwd+bwd, 1 thread; load average {load}")
    print(f"{'packing':24} {'unpacked':>9} {'varlen':>9} {'loop':>9} {'varlen/unp':>10} "
          f"{'loop/unp':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['packing']:24} {r['unpacked_ms']:8.0f}ms {r['varlen_ms']:8.0f}ms "
              f"{r['loop_ms']:8.0f}ms {r['varlen_over_unpacked']:10.2f} "
              f"{r['loop_over_unpacked']:9.2f}")  # fmt: skip
    if args.out is not None:
        path = args.out / "varlen.json"
        if path.exists() and not args.overwrite:
            raise SystemExit(f"error: {path} exists (pass --overwrite to replace it)")
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
