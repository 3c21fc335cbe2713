"""LLoPS Table 3: how well sketches approximate (q·k)^p on the queries and keys of a trained model.

The LLoPS paper (§4.3, ``llops-learnable-polynomial-sketch.md``) trains transformers with exact
polynomial attention (p = 2, 3) on associative recall, samples the queries and keys of the
first, middle and last attention layers, and reports the relative mean absolute error (Eq. 21)

    RMAE = E_{q,k} | ((q·k)^p − φq(q)·φk(k)) / (q·k)^p |

of PolySketchFormer's random sketch (PSF: ``polysketch`` at degree p) and of the fitted LLoPS
map (``llops``). This module does the same with our pieces, in three stages:

1. ``train_exact``: a ``TransformerLM`` with ``attention="polynomial"`` at degree p (LayerNorm
   on q/k, normalizer 1 + Σ) trained on MQAR (``polysketch.eval.mqar_sweep.train_one``);
2. ``capture_files``: the (Q, K) each chosen layer's attention core receives
   (``polysketch.eval.fidelity.capture.capture_qk``), per head, written as ``.pt`` files
   ``{"q": (N, D), "k": (N, D)}``: a ``test`` file from validation sequences and a ``fit``
   file from training sequences (so the fitted maps are measured out of sample);
3. ``measure``: what ``polysketch approx --source TEST --fit-source FIT --target polynomial``
   measures, on each file pair (``polysketch.eval.fidelity.approx``, the library behind that
   command; its files are written to ``OUT/approx/``), collected into one table. LLoPS is fitted as
   ``LLoPS.fit`` does by default: the closed-form data start (``features.llops_init``: the
   best rank-s bilinear form of the fit samples, raised to the p-th power through its
   monomials), then Adam on Eq. 6; the start alone is measured too (``llops_start``).

``run`` chains them and writes ``table3.csv`` (one row per p, map, F, layer, head),
``table3.md`` (RMAE per layer averaged over heads, as the paper's table) and ``table3.png``.
RMAE divides by (q·k)^p; ``approx`` floors that denominator at ``rel_floor`` · max |(q·k)^p|
(default 1e-3) so near-orthogonal pairs do not dominate; the paper does not say how it
handles them.

Run it from the repository root (``docs/results/README.md`` has the figures and the run)::

    python -m experiments.llops_table3 [--out runs/llops_table3] [--steps 2000] [--degrees 2 3]
        [--feature-dims 64 256] [--fit-steps 1000] [--num 512] [--fit-num 4096] [--threads N]
        [--quick] [--reuse-captures]

The captured files stay in ``OUT/qk/``, so any other map can be measured on them later;
``--reuse-captures`` skips the training and measures the files already there; ``--quick`` is
a seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from polysketch._checks import check_positive_int
from polysketch._files import write_csv
from polysketch.eval.fidelity import approx
from polysketch.eval.fidelity.capture import capture_qk
from polysketch.eval.fidelity.data_sources import load_qk
from polysketch.eval.fidelity.metrics import relative_frobenius_error, rmae
from polysketch.eval.mqar_sweep import LLOPS, QUICK, make_data, train_one
from polysketch.eval.plots import save_png, subplots
from polysketch.features.optimal_rank import fitted_optima, optimal_rank_error_of

__all__ = [
    "SETTINGS",
    "MAP_NAMES",
    "train_exact",
    "capture_files",
    "measure",
    "eq7_fitted",
    "captured_files",
    "summarize",
    "run",
    "main",
]

SETTINGS = {**LLOPS, "n_layer": 3, "steps": 2000}
"""MQAR model and task: LLoPS Table 4's model (d_model 128, 2 heads of 64, short convolution)
with 3 layers, so that first, middle and last layer differ (the paper's model had 16+)."""


def train_exact(degree: int, *, settings: dict, lr: float, seed: int = 0, progress=False):
    """Train a model with exact degree-``degree`` polynomial attention; returns (model, data,
    final validation scores)."""
    degree = check_positive_int(degree, "degree")
    data = make_data(settings, seed=seed)
    history = train_one(
        "polynomial", data, settings=settings, lr=lr, map_kwargs={"degree": degree},
        seed=seed, progress=progress,
    )  # fmt: skip
    return history["model"], data, history["val"][-1]


def _layers(n_layer: int) -> list[int]:
    """First, middle and last layer (deduplicated for shallow models)."""
    return sorted({0, n_layer // 2, n_layer - 1})


def capture_files(
    model, data, out: Path, *, degree: int, num_sequences: int = 64
) -> list[tuple[int, int, Path, Path]]:
    """Write per-head (Q, K) of the first, middle and last layer; returns (layer, head,
    test file, fit file) tuples. Test tokens come from ``num_sequences`` validation sequences,
    fit tokens from as many training sequences."""
    num_sequences = check_positive_int(num_sequences, "num_sequences")
    layers = _layers(len(model.blocks))
    device = next(model.parameters()).device
    sources = {
        "test": data.val_inputs[:num_sequences].to(device),
        "fit": data.train_inputs[:num_sequences].to(device),
    }
    captured = {name: capture_qk(model, idx, layers=layers) for name, idx in sources.items()}
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i, layer in enumerate(layers):
        for head in range(model.config.n_head):
            paths = []
            for name in ("test", "fit"):
                c = captured[name][i]
                q = c.q[:, head].reshape(-1, c.q.shape[-1]).double()
                k = c.k[:, head].reshape(-1, c.k.shape[-1]).double()
                path = out / f"qk_p{degree}_layer{layer}_head{head}_{name}.pt"
                torch.save({"q": q, "k": k}, path)
                paths.append(path)
            files.append((layer, head, *paths))
    return files


def captured_files(folder: Path, *, degree: int) -> list[tuple[int, int, Path, Path]]:
    """The (layer, head, test file, fit file) tuples ``capture_files`` wrote into ``folder``
    for ``degree``, in (layer, head) order; an error if there are none."""
    found = []
    for test in folder.glob(f"qk_p{degree}_layer*_head*_test.pt"):
        layer, head = map(
            int, re.fullmatch(r"qk_p\d+_layer(\d+)_head(\d+)_test", test.stem).groups()
        )
        fit = test.with_name(test.name.replace("_test.pt", "_fit.pt"))
        if not fit.is_file():
            raise FileNotFoundError(f"{test} has no fitting file {fit.name} beside it")
        found.append((layer, head, test, fit))
    if not found:
        raise FileNotFoundError(f"no captured q/k for p = {degree} in {folder}")
    return sorted(found)


MAP_NAMES = {
    "polysketch": "PSF (polysketch)",
    "llops_start": "LLoPS (llops, data start only)",
    "llops": "LLoPS (llops, data start + Adam on Eq. 6)",
    "eq7_fitted": "Eq. 7 optimum on the fitting samples (any linear map of ψ_p)",
}
"""Table labels of the rows' ``map`` keys."""


def _approx(
    test: Path,
    fit: Path,
    out: Path,
    *,
    names,
    degree,
    fit_steps,
    fit_init=None,
    feature_dims,
    num,
    trials,
    seed,
    fit_num,
) -> list[dict]:
    """``polysketch approx --target polynomial`` on one file pair, through its library
    (``eval.fidelity.approx``): the measured rows (not skipped); its files go to ``out``."""
    q, k = load_qk(str(test), dim=None, num=num, seed=seed)
    fit_data = approx.fit_samples(str(test), dim=q.shape[-1], num=num, seed=seed,
                                  fit_source=str(fit), fit_num=fit_num)  # fmt: skip
    result = approx.measure_polynomial(
        q, k, names, degrees=[degree], feature_dims=feature_dims, trials=trials, seed=seed,
        progress=False, fit_steps=fit_steps, fit_init=fit_init, fit_data=fit_data,
        target="polynomial", fit_maps=["llops"],
    )  # fmt: skip
    approx.write_polynomial(result, out)
    return [r for r in result["rows"] if not r.get("skipped")]


def measure(
    test: Path,
    fit: Path,
    out: Path,
    *,
    degree: int,
    feature_dims: Sequence[int],
    fit_steps: int,
    num: int,
    trials: int,
    seed: int = 0,
    fit_num: int = 4096,
) -> list[dict]:
    """``polysketch approx``'s measurement on one file pair: the PSF sketch and LLoPS fitted on
    ``fit`` (closed-form data start + ``fit_steps`` Adam steps), then LLoPS at the data start alone
    (``--fit-steps 0 --fit-init data``, rows relabelled ``llops_start``); returns the
    ``results.csv`` rows of both runs and one ``eq7_fitted`` row per F (``eq7_fitted``).
    Every fit uses up to ``fit_num`` fitting vectors (default 4096: all that ``capture_files``
    writes at its defaults, 64 sequences of T = 64)."""
    common = dict(degree=degree, feature_dims=feature_dims, num=num, trials=trials, seed=seed,
                  fit_num=fit_num)  # fmt: skip
    rows = _approx(test, fit, out, names=["polysketch", "llops"], fit_steps=fit_steps, **common)
    start = _approx(test, fit, out / "data_start", names=["llops"], fit_steps=0,
                    fit_init="data", **common)  # fmt: skip
    rows += [{**r, "map": "llops_start"} for r in start]
    return rows + eq7_fitted(test, fit, degree=degree, feature_dims=feature_dims, num=num,
                             seed=seed, fit_num=fit_num)  # fmt: skip


def eq7_fitted(
    test: Path,
    fit: Path,
    *,
    degree: int,
    feature_dims: Sequence[int],
    num: int,
    seed: int,
    fit_num: int = 4096,
) -> list[dict]:
    """Rows (``results.csv`` keys) of the unconstrained Eq. 6 optimum on this file pair.

    ``fitted_optima``: Eq. 8's optimal linear maps of ψ_p (Thm 3.1; LLoPS is a CP-factored
    one), chosen by Eq. 7 on the same fitting samples ``approx --fit-source`` draws, measured
    on the same test samples (``load_qk`` with ``approx``'s seeds), as RMAE (Eq. 21, the same
    denominator floor) and relative Frobenius error. On the fitting samples no F-feature map
    fitted by Eq. 6 beats it. On the test samples it is the reference such a fit aims at, not
    a bound: with fewer fitting vectors than dim ψ_p = C(D + p − 1, p) (2080 at D = 64,
    p = 2) it interpolates them and can generalise worse than LLoPS's constrained map.
    """
    q, k = load_qk(str(test), dim=None, num=num, seed=seed)
    q_fit, k_fit = load_qk(str(fit), dim=q.shape[-1], num=fit_num, seed=seed + 1)
    exact = (q @ k.T) ** degree
    approxes = fitted_optima(q_fit, k_fit, q, k, degree=degree, ranks=feature_dims)
    rows = []
    for f, estimate in zip(feature_dims, approxes, strict=True):
        rows.append({"map": "eq7_fitted", "num_features": f, "rmae_mean": rmae(estimate, exact),
                     "rel_frobenius_mean": relative_frobenius_error(estimate, exact),
                     "optimal_rel": optimal_rank_error_of(exact, f).relative})  # fmt: skip
    return rows


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Mean RMAE over heads per (p, map, F, layer), plus the mean over layers (``layer`` =
    "avg"), in the paper's layout."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        key = (int(r["p"]), r["map"], int(r["F"]), r["layer"])
        groups.setdefault(key, []).append(float(r["rmae"]))
    table = [{"p": p, "map": m, "F": f, "layer": layer, "rmae": sum(v) / len(v)}
             for (p, m, f, layer), v in groups.items()]  # fmt: skip
    for p, m, f in sorted({(t["p"], t["map"], t["F"]) for t in table}):
        per_layer = [t["rmae"] for t in table if (t["p"], t["map"], t["F"]) == (p, m, f)]
        table.append({"p": p, "map": m, "F": f, "layer": "avg",
                      "rmae": sum(per_layer) / len(per_layer)})  # fmt: skip
    return table


def _markdown(table: Sequence[dict], layers: Sequence[int], meta: str) -> str:
    cols = [str(x) for x in layers] + ["avg"]
    lines = [meta, "", "| p | map | F | " + " | ".join(f"layer {c}" for c in cols[:-1])
             + " | avg |", "|---|---|---|" + "---|" * len(cols)]  # fmt: skip
    for p, m, f in sorted({(t["p"], t["map"], t["F"]) for t in table}):
        vals = {
            str(t["layer"]): t["rmae"] for t in table if (t["p"], t["map"], t["F"]) == (p, m, f)
        }
        name = MAP_NAMES.get(m, m)
        lines.append(f"| {p} | {name} | {f} | " + " | ".join(f"{vals[c]:.3f}" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def _plot(table: Sequence[dict], path: Path) -> Path:
    degrees = sorted({t["p"] for t in table})
    fig, axes = subplots(len(degrees), panel_size=(4.5, 3.5))
    for ax, p in zip(axes, degrees, strict=True):
        for m, f in sorted({(t["map"], t["F"]) for t in table if t["p"] == p}):
            pts = [t for t in table if (t["p"], t["map"], t["F"]) == (p, m, f)]
            ax.plot([str(t["layer"]) for t in pts], [t["rmae"] for t in pts], marker="o",
                    label=f"{m} F={f}")  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("RMAE (Eq. 21)")
        ax.set_title(f"(q·k)^{p} on captured q, k")
        ax.legend(fontsize=7)
    return save_png(fig, path)


def run(
    out: str | Path,
    *,
    degrees: Sequence[int] = (2, 3),
    settings: dict | None = None,
    lr: float = 1e-3,
    feature_dims: Sequence[int] = (64, 256),
    fit_steps: int = 1000,
    fit_num: int = 4096,
    num: int = 512,
    trials: int = 3,
    seed: int = 0,
    reuse_captures: bool = False,
    log=print,
) -> list[dict]:
    """Train, capture, measure and write ``table3.{csv,md,png}`` into ``out``; returns the
    per-(p, map, F, layer, head) rows. ``reuse_captures``: skip training and capturing and
    measure the files an earlier run left in ``out/qk`` (``captured_files``)."""
    out = Path(out)
    s = {**SETTINGS, **(settings or {})}
    rows, meta = [], []
    for p in degrees:
        if reuse_captures:
            files = captured_files(out / "qk", degree=p)
            meta.append(f"p = {p}: q/k reused from {out / 'qk'}")
        else:
            t0 = time.perf_counter()
            model, data, val = train_exact(p, settings=s, lr=lr, seed=seed)
            seconds = time.perf_counter() - t0
            meta.append(f"p = {p}: recall {val['accuracy']:.3f} ({seconds:.0f} s)")
            log(f"trained exact degree-{p} model: recall accuracy {val['accuracy']:.3f}")
            files = capture_files(model, data, out / "qk", degree=p)
        for layer, head, test, fit in files:
            measured = measure(test, fit, out / "approx" / test.stem, degree=p,
                               feature_dims=feature_dims, fit_steps=fit_steps, num=num,
                               trials=trials, seed=seed, fit_num=fit_num)  # fmt: skip
            for r in measured:
                rows.append({"p": p, "map": r["map"], "F": int(r["num_features"]),
                             "layer": layer, "head": head, "rmae": float(r["rmae_mean"]),
                             "rel_frobenius": float(r["rel_frobenius_mean"]),
                             "optimal_rel": float(r["optimal_rel"])})  # fmt: skip
    write_csv(rows, out / "table3.csv")
    table = summarize(rows)
    info = (
        f"Models: {s['n_layer']} layers x {s['n_embd']} (head dim "
        f"{s['n_embd'] // s['n_head']}), short conv {s['short_conv']}, MQAR T = "
        f"{s['seq_len']}, {s['num_kv_pairs']} pairs, {s['steps']} steps, lr {lr:g}; "
        + "; ".join(meta)
        + f". LLoPS fitted on training-sequence q/k (closed-form data start, then {fit_steps} "
        f"Adam steps; up to {fit_num} fitting vectors), measured on {num} validation q x {num} "
        f"k per head; PSF {trials} draws."
    )
    (out / "table3.md").write_text(_markdown(table, _layers(s["n_layer"]), info))
    _plot(table, out / "table3.png")
    log(_markdown(table, _layers(s["n_layer"]), info))
    return rows


def main(argv=None) -> int:
    """The command line of the module docstring; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/llops_table3")
    parser.add_argument("--steps", type=int, default=SETTINGS["steps"])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--degrees", nargs="+", type=int, default=[2, 3])
    parser.add_argument("--feature-dims", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--fit-steps", type=int, default=1000)
    parser.add_argument("--num", type=int, default=512)
    parser.add_argument("--fit-num", type=int, default=4096, help="fitting vectors per head")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny smoke-test sizes")
    parser.add_argument(
        "--reuse-captures",
        action="store_true",
        help="measure the q/k files an earlier run left in OUT/qk (no training)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = {"steps": args.steps}
    if args.quick:
        settings = {**QUICK, "n_layer": 3, "steps": 4}
        args.feature_dims, args.fit_steps, args.num, args.trials = [8], 5, 32, 1
    run(args.out, degrees=args.degrees, settings=settings, lr=args.lr,
        feature_dims=args.feature_dims, fit_steps=args.fit_steps, num=args.num,
        fit_num=args.fit_num,
        trials=args.trials, seed=args.seed, reuse_captures=args.reuse_captures)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
