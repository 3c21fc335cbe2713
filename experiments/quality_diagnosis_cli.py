"""Why PolySketchFormer's sketches trail softmax: measurements on trained models (issue #10).

Usage (from the repository root):

    python -m experiments.quality_diagnosis_cli --poly-ckpt RUN/polynomial/ckpt.pt
        [--random-ckpt RUN/psf_random/ckpt.pt] [--learned-ckpt RUN/psf_learned/ckpt.pt]
        [--out docs/results] [--threads 1]

The checkpoints come from ``python -m experiments.quality --out RUN``
(``RUN/runs/LABEL/ckpt.pt``) or ``polysketch train``. Writes into ``--out``:
``quality_diagnosis.md`` (all tables), ``quality_diagnosis_*.csv`` and
``quality_diagnosis.png``; ``experiments.quality_diagnosis`` says what each number is.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from polysketch._files import write_csv
from polysketch.data.corpus import load_corpus
from polysketch.eval.plots import log_axes, save_png, subplots
from polysketch.nn import TransformerConfig, TransformerLM
from polysketch.train import load_model

from .quality_diagnosis import (
    capture_qkv,
    debiased_core,
    grad_norms,
    kernel_errors,
    layer_errors,
    learned_sketch_stats,
    sketch_core,
    swap_loss,
)

SKETCH = {"name": "polysketch", "nonnegative": True}
VARIANTS = {
    "psf_random (tree, r=32)": {**SKETCH, "num_features": 32},
    "product, r=32": {**SKETCH, "num_features": 32, "projection": "product"},
    "tree, r=64": {**SKETCH, "num_features": 64},
    "product, r=64": {**SKETCH, "num_features": 64, "projection": "product"},
    "tree, r=128": {**SKETCH, "num_features": 128},
    "psf_mixed, unbiased scale 1 (former preset)": {**SKETCH, "num_features": 32, "mixed": True},
    "psf_mixed, public scale 1/√r (preset)": {
        **SKETCH,
        "num_features": 32,
        "mixed": True,
        "output_scale": 32**-0.5,
    },
    "local exact only (mixed, far ×1e-24)": {
        **SKETCH,
        "num_features": 32,
        "mixed": True,
        "output_scale": 1e-6,
    },
}


def _batches(corpus, n, batch, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(corpus.val) - block - 1, (batch,), generator=g)
        x = torch.stack([corpus.val[s : s + block] for s in starts])
        y = torch.stack([corpus.val[s + 1 : s + block + 1] for s in starts])
        out.append((x, y))
    return out


def _ln_rows(dim: int, g: torch.Generator, n: int = 128) -> torch.Tensor:
    """n LayerNorm'd standard Gaussian rows of dim ``dim`` (fp64)."""
    return torch.nn.functional.layer_norm(
        torch.randn(n, dim, generator=g, dtype=torch.float64), (dim,)
    )


def _write(path: Path, rows: list[dict]) -> None:
    write_csv(rows, path)


def _md(rows: list[dict], digits: int = 3) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in r.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--poly-ckpt", required=True, help="a model trained with `polynomial`")
    p.add_argument("--random-ckpt", default=None, help="a model trained with `psf_random`")
    p.add_argument("--learned-ckpt", default=None, help="a model trained with `psf_learned`")
    p.add_argument("--corpus", default="shakespeare")
    p.add_argument("--batches", type=int, default=4, help="validation batches for swap losses")
    p.add_argument("--draws", type=int, default=3, help="sketch seeds per layer measurement")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(args.corpus)
    poly, state = load_model(args.poly_ckpt, "cpu")
    block = poly.config.block_size
    batches = _batches(corpus, args.batches, 8, block)
    x0 = batches[0][0][:2]
    md = [
        "# Quality-gap diagnosis (`python -m experiments.quality_diagnosis_cli`)\n",
        f"polynomial-trained model: `{args.poly_ckpt}` ({poly.config.n_layer} layers × "
        f"{poly.config.n_embd}, {poly.config.n_head} heads, D = "
        f"{poly.config.n_embd // poly.config.n_head}, block {block}, step {state['step']})\n",
    ]

    # 1. per-layer output error, floor share, entropies (teacher forcing, same weights)
    layer_rows = []
    for label, path in (("polynomial", args.poly_ckpt), ("psf_random", args.random_ckpt)):
        if path is None:
            continue
        model = poly if label == "polynomial" else load_model(path, "cpu")[0]
        rows = layer_errors(capture_qkv(model, x0), VARIANTS, draws=args.draws)
        layer_rows += [{"trained_with": label, **r} for r in rows]
    _write(out / "quality_diagnosis_layers.csv", layer_rows)
    md += [
        "## 1. Per-layer error of sketched vs exact degree-4 attention, same q, k, v\n",
        _md(layer_rows),
        "",
    ]

    # 2. kernel error vs r, projection and D (captured q/k and LayerNorm'd Gaussians)
    q, k, _ = capture_qkv(poly, x0)[poly.config.n_layer // 2]
    kern = [
        {"data": "captured (middle layer, head 0)", **r}
        for r in kernel_errors(q[0, 0, ::2], k[0, 0, ::2], draws=8)
    ]
    g = torch.Generator().manual_seed(0)
    for dim in (16, 32, 64, 128):
        a = torch.nn.functional.layer_norm(
            torch.randn(128, dim, generator=g, dtype=torch.float64), (dim,)
        )
        b = torch.nn.functional.layer_norm(
            torch.randn(128, dim, generator=g, dtype=torch.float64), (dim,)
        )
        kern += [
            {"data": f"LayerNorm'd Gaussian D={dim}", **r}
            for r in kernel_errors(a, b, sizes=(16, 32, 64, 128), draws=8)
        ]
    a = torch.nn.functional.layer_norm(
        torch.randn(128, 64, generator=g, dtype=torch.float64), (64,)
    )
    b = torch.nn.functional.layer_norm(
        torch.randn(128, 64, generator=g, dtype=torch.float64), (64,)
    )
    kern += [
        {"data": "LayerNorm'd Gaussian D=64, degree-4 sketch", **r}
        for r in kernel_errors(a, b, sizes=(32, 64, 128), draws=8, degree=4)
    ]
    _write(out / "quality_diagnosis_kernel.csv", kern)
    md += [
        "## 2. Relative Frobenius error of the (q·k)^4 estimate; floor × r in units of ‖q‖⁴‖k‖⁴\n",
        _md(kern),
        "",
    ]

    # 3. swap losses: the polynomial-trained weights run with each sketch
    swap = [{"core": "exact polynomial (as trained)", "val_loss": swap_loss(poly, batches)}]
    for label, spec in VARIANTS.items():
        kw = {key: v for key, v in spec.items() if key != "name"}
        swap.append(
            {"core": label, "val_loss": swap_loss(poly, batches, sketch_core(spec["name"], **kw))}
        )
    for beta in (0.5, 1.0):  # subtract β·‖q‖⁴‖k‖⁴/r, the floor's rank-1 part (signed scores)
        swap.append(
            {
                "core": f"psf_random minus {beta:g}×floor (debiased)",
                "val_loss": swap_loss(poly, batches, debiased_core(beta)),
            }
        )
    if args.random_ckpt:
        rnd = load_model(args.random_ckpt, "cpu")[0]
        swap.append(
            {
                "core": "psf_random-trained model, its own sketch",
                "val_loss": swap_loss(rnd, batches),
            }
        )
        rnd.set_exact_attention(True)
        swap.append(
            {"core": "psf_random-trained model, run exact", "val_loss": swap_loss(rnd, batches)}
        )
    _write(out / "quality_diagnosis_swap.csv", swap)
    md += [
        "## 3. Validation loss of trained weights with the attention core swapped\n",
        _md(swap, 4),
        "",
    ]

    # 4. the learned sketch: scale, saturation, offset share, gradient norms (init vs trained)
    learned = []
    if args.learned_ckpt:
        trained, lstate = load_model(args.learned_ckpt, "cpu")
        init = TransformerLM(TransformerConfig(**lstate["model_config"]))
        xb, yb = batches[0]
        for label, model in (("init", init), (f"trained ({lstate['step']} steps)", trained)):
            norms = grad_norms(model, xb, yb)
            for r in learned_sketch_stats(model, x0):
                learned.append(
                    {"model": label, **r, **{f"grad_{k}": v for k, v in sorted(norms.items())}}
                )
        _write(out / "quality_diagnosis_learned.csv", learned)
        md += [
            "## 4. learned_polysketch: scale before squaring, saturation, offset share, "
            "gradient norms (one batch)\n",
            _md(learned, 4),
            "",
        ]

    _plot(layer_rows, kern, swap, out / "quality_diagnosis.png")
    md.append(f"{time.perf_counter() - t0:.0f} s on {torch.get_num_threads()} thread(s).")
    (out / "quality_diagnosis.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


def _plot(layer_rows, kern, swap, path):
    fig, axes = subplots(4, ncols=2, panel_size=(5.5, 3.8))
    ax = axes[0]
    poly = [r for r in layer_rows if r["trained_with"] == "polynomial"]
    labels = list(dict.fromkeys(r["variant"] for r in poly))
    for key, marker in (("output_rel_error", "o"), ("floor_share", "s")):
        vals = [
            sum(r[key] for r in poly if r["variant"] == v)
            / max(1, sum(r["variant"] == v for r in poly))
            for v in labels
        ]
        ax.plot(range(len(labels)), vals, marker=marker, ls="", label=key.replace("_", " "))
    ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=30, ha="right")
    ax.set_title("polynomial-trained q/k/v: mean over layers")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    ax = axes[1]
    for data in dict.fromkeys(r["data"] for r in kern if r["degree"] == 4):
        for proj, style in (("gaussian", "-"), ("product", "--")):
            rows = [r for r in kern if r["data"] == data and r["projection"] == proj]
            ax.plot(
                [r["r"] for r in rows],
                [r["rel_error"] for r in rows],
                style,
                marker="o",
                ms=3,
                label=f"{data.split(' (')[0].replace(chr(39) + 'd Gaussian', '')} {proj}",
            )
    log_axes(ax)
    ax.set_xlabel("sketch size r")
    ax.set_title("rel. error of (q·k)^4 estimate (– tree, -- product)")
    ax.legend(fontsize=5)
    ax = axes[2]
    ax.barh(range(len(swap)), [r["val_loss"] for r in swap])
    ax.set_yticks(range(len(swap)), [r["core"] for r in swap], fontsize=6)
    lo = min(r["val_loss"] for r in swap)
    ax.set_xlim(lo - 0.1, max(r["val_loss"] for r in swap) + 0.05)
    ax.set_title("val loss with the attention core swapped")
    ax = axes[3]
    layers = sorted({r["layer"] for r in poly})
    first = [r for r in poly if r["variant"] == labels[0]]
    ax.plot(layers, [r["entropy_exact"] for r in first], marker="o", label="exact degree 4")
    for v in labels[:3]:
        ax.plot(
            layers, [r["entropy_sketch"] for r in poly if r["variant"] == v], marker="s", label=v
        )
    ax.set_xlabel("layer")
    ax.set_ylabel("row entropy / log t (1 = uniform)")
    ax.set_title("attention entropy")
    ax.legend(fontsize=6)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
