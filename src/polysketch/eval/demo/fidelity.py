"""The fidelity section of ``polysketch demo``: kernel error of every feature map.

Relative error ‖φq(Q)φk(K)ᵀ − E‖_F/‖E‖_F vs feature dim of every feature map against its
target kernel E (polynomial maps at degree 4: (q·k)^4; softmax random features:
exp(q·k/√D)), on the queries/keys the trained models feed their attention (after the q/k
LayerNorm and RoPE, ``polysketch.eval.fidelity.capture``) and on Gaussian data; and the ratio to the
Eckart–Young optimum of any map with that state size (LLoPS Thm 3.1). The models come from
the quality section of this run (``state["models"]``) or from the checkpoints a previous run
saved in ``--out/runs``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...data.corpus import load_corpus
from ...features import available, create
from ...features.optimal_rank import optimal_curve, optimal_rank_error_of
from ...nn.presets import POLYNOMIAL_MAPS, SOFTMAX_MAPS
from ...train import load_model
from ..fidelity.capture import capture_qk, head_samples, split_tokens
from ..fidelity.data_sources import load_qk
from ..fidelity.evaluate import evaluate_map, sweep
from ..tables import format_table
from .figures import plot_fidelity_panels
from .settings import DemoSizes, polysketch_attention

__all__ = ["MAX_FEATURE_DIM", "NOT_CALIBRATED", "section_fidelity"]

MAX_FEATURE_DIM = 2**14  # fidelity: maps with more features (exact maps at degree 4) are skipped
NOT_CALIBRATED = frozenset({"learned_polysketch"})  # trained inside a model (psf_learned), not
# fitted to a kernel: at initialisation its kernel error says nothing, and fitting it is slow


def _trained_model(attention: str, args, state: dict):
    """The model trained by section 1 in this run, else the one its checkpoint in --out holds."""
    model = state.get("models", {}).get(attention)
    if model is not None:
        return model, "trained in this run"
    path = Path(args.out) / "runs" / attention / "ckpt.pt"
    if not path.is_file():
        return None, f"no trained `{attention}` model (run the quality section first)"
    return load_model(path, "cpu")[0], f"loaded from `{path}`"


def _captured(model, args, sizes: DemoSizes, state: dict, seed: int):
    """(q, k, q_fit, k_fit) per-head samples (L·H, N, D) from validation text, disjoint tokens."""
    corpus = state.get("corpus") or load_corpus(args.corpus, max_bytes=sizes.max_bytes)
    t = model.config.block_size
    n_seq = max(1, min(sizes.capture_batch, (corpus.val.numel() - 1) // t))
    idx = corpus.val[: n_seq * t].reshape(n_seq, t) if n_seq * t <= corpus.val.numel() else None
    if idx is None:
        idx = corpus.train[: sizes.capture_batch * t].reshape(-1, t)
    captured = capture_qk(model, idx.to(next(model.parameters()).device))
    test, fit = split_tokens(idx.numel(), 2, seed=seed)
    q, k = head_samples(captured, num=sizes.num, seed=seed, positions=test)
    qf, kf = head_samples(captured, num=sizes.num, seed=seed + 1, positions=fit)
    return q, k, qf, kf


def _family_rows(family: str, q, k, fit, sizes: DemoSizes, args) -> tuple[list, list]:
    """Fidelity rows of every map of ``family`` on (q, k) and the optimum [(rank, rel)]."""
    d = q.shape[-1]
    common_eval = dict(trials=sizes.trials, seed=args.seed)
    common = dict(common_eval, progress=not args.no_progress)
    if family == "polynomial":
        names = sorted((POLYNOMIAL_MAPS & set(available())) - NOT_CALIBRATED)
        rows = sweep(
            names, q, k, degrees=[4], feature_dims=sizes.feature_dims, fit_data=fit,
            max_feature_dim=MAX_FEATURE_DIM, fit_steps=sizes.fit_steps, **common,
        )  # fmt: skip
        if "polysketch" in names:  # the psf_random map: degree-2 sketch, squared -> (q·k)^4
            for r in sketch_sizes(sizes.feature_dims):
                row = evaluate_map(
                    "polysketch", q, k, trials=sizes.trials, seed=args.seed,
                    **{**psf_random_sketch(), "num_features": r},
                )  # fmt: skip
                row.update(map=PSF_LABEL, degree=4, skipped="")
                rows.append(row)
        ranks = sorted({r["state_dim"] for r in rows if not r.get("skipped")})
        optimum = [
            (o["rank"], o["relative"]) for o in optimal_curve(q, k, degrees=[4], ranks=ranks)
        ]
        return rows, optimum
    names = sorted(SOFTMAX_MAPS & set(available()))
    scale = 1.0 / math.sqrt(d)
    rows = []
    jobs = [(n, f) for n in names for f in sizes.feature_dims]
    for name, f in tqdm(jobs, desc="fidelity", unit="map", disable=not common["progress"]):
        try:  # built here (scale=1/√D); evaluate_map redraws it per trial, fits hybrid_clustered
            fm = create(name, d, num_features=f, scale=scale, seed=args.seed)
            if fm.feature_dim > MAX_FEATURE_DIM:
                raise ValueError(f"feature_dim {fm.feature_dim} > {MAX_FEATURE_DIM}")
            row = evaluate_map(fm, q, k, fit_steps=sizes.fit_steps, fit_data=fit, **common_eval)
        except (ValueError, TypeError, RuntimeError) as err:
            rows.append({"map": name, "num_features": f, "skipped": f"{type(err).__name__}: {err}"})
            continue
        row.update(map=name, num_features=f, skipped="")
        rows.append(row)
    exact = create("positive", d, scale=scale, seed=0).target_kernel(q, k)
    ranks = sorted({r["state_dim"] for r in rows if not r.get("skipped")})
    return rows, [(m, optimal_rank_error_of(exact, m).relative) for m in ranks]


PSF_LABEL = "polysketch² (psf_random)"


def psf_random_sketch() -> dict:
    """The keywords of psf_random's feature map (degree-2 sketch, self-tensored), r included."""
    from ...nn import resolve_attention

    return dict(resolve_attention("psf_random", 64).map_kwargs)  # no keyword depends on D


def sketch_sizes(feature_dims) -> list[int]:
    """The sketch sizes r at which the demo draws psf_random's map: r ≈ √F for each F asked
    (state r(⌊r/2⌋+1) ≈ F/2, beside the other maps) and the r the psf_random models use."""
    asked = {max(2, math.isqrt(f)) for f in feature_dims}
    return sorted(asked | {psf_random_sketch()["num_features"]})


def _estimate_scale(name: str, q, k, fit, f: int, scale: float, args, sizes) -> float:
    """‖Ê‖_F / ‖E‖_F of one draw of softmax map ``name`` with ``f`` features (fitted as
    ``evaluate_map`` fits it): near 0 when the estimate misses the kernel's mass."""
    fm = create(name, q.shape[-1], num_features=f, scale=scale, seed=args.seed).to(q.dtype)
    keywords = type(fm).fit_keywords
    if keywords:
        extra = {"seed": args.seed} if "seed" in keywords else {}
        with torch.enable_grad():
            fm.fit(*fit, steps=sizes.fit_steps, **extra)
    exact = fm.target_kernel(q, k)
    approx = fm.approx_kernel(q, k)
    return float(approx.norm() / exact.norm())


def _complex_exp_note(names) -> str:
    """Why complex_exp's line is hidden under positive's (when both were measured)."""
    if not {"complex_exp", "positive"} <= set(names):
        return ""
    return (
        "complex_exp's line lies under positive's: with its default A = I the complex "
        "exponential estimator is exactly the positive (FAVOR+) one on the same draws (HRF "
        "§2.3). "
    )


def _at_one_note(rows, q, k, fit, args, sizes) -> str:
    """Why some softmax maps sit at error ≈ 1 on these q, k: their measured ‖Ê‖/‖E‖ (one
    draw at their largest F) and, when the estimate is near 0, the reason (HRF Lemma 2.2)."""
    points = {}
    for r in rows:
        if not r.get("skipped"):
            points.setdefault(r["map"], []).append((r["num_features"], r["rel_frobenius_mean"]))
    at_one = sorted(n for n, pts in points.items() if all(abs(e - 1.0) < 0.02 for _, e in pts))
    if not at_one:
        return ""
    scale = 1.0 / math.sqrt(q.shape[-1])
    ratio = {
        n: _estimate_scale(n, q, k, fit, max(f for f, _ in points[n]), scale, args, sizes)
        for n in at_one
    }
    listed = ", ".join(f"{n}: ‖Ê‖/‖E‖ = {v:.1e}" for n, v in ratio.items())
    if not all(v < 0.1 for v in ratio.values()):
        return f"At error ≈ 1 on captured q, k ({listed}; one draw at the largest F)."
    return (
        f"At error ≈ 1 on captured q, k ({listed}; one draw at the largest F): the estimate "
        "is close to 0 next to E, so ‖Ê − E‖/‖E‖ ≈ 1. E = exp(q·k/√D) of trained q, k is "
        "dominated by the few pairs with the largest logits, and these estimators, whose "
        "relative variance grows like exp(‖q + k‖²/√D)/m (HRF Lemma 2.2), almost never draw "
        "features that reach them."
    )


def _scale_stats(q: torch.Tensor, k: torch.Tensor) -> str:
    """Mean ‖q‖, ‖k‖ and the largest |q·k|/√D of a sample: what drives the kernels' range."""
    logits = float((q @ k.transpose(-1, -2)).abs().max()) / math.sqrt(q.shape[-1])
    qn, kn = float(q.norm(dim=-1).mean()), float(k.norm(dim=-1).mean())
    return f"mean ‖q‖ {qn:.3g}, mean ‖k‖ {kn:.3g}, max |q·k|/√D {logits:.3g}"


def section_fidelity(args, sizes: DemoSizes, report, state: dict) -> dict:
    out = Path(args.out)
    report.heading("2. Fidelity: how well each feature map reproduces its kernel")
    report.paragraph(
        "Relative Frobenius error ‖φq(Q)φk(K)ᵀ − E‖_F / ‖E‖_F of each map against its target "
        "kernel E, vs the state size m of the map (F, or F(⌊F/2⌋+1) for self-tensored maps: "
        "the floats per value dimension their decoding state holds, the `state dim` column), "
        "mean over "
        f"{sizes.trials} seeded draws, on {sizes.num} queries × {sizes.num} keys per (layer, "
        "head) as the trained models feed them to the attention core (after the q/k LayerNorm "
        "and RoPE; fitted maps are calibrated on other tokens), and on Gaussian q, k with "
        "q·k of unit variance. `ratio` = error / the Eckart–Young optimum, the least error of "
        "any rank-m approximation of E (LLoPS Thm 3.1; n/a where E has rank ≤ m, e.g. exact "
        "maps). `polysketch² (psf_random)` is the sketch the psf_random attention uses: a "
        "degree-2 sketch of r features, squared (F asked = r, state r(⌊r/2⌋+1)), drawn at "
        f"r = {', '.join(str(r) for r in sketch_sizes(sizes.feature_dims))}; r = "
        f"{psf_random_sketch()['num_features']} is the size the psf_random models use "
        "(ringed in the figure). "
        "`learned_polysketch` is left out: it is trained inside a model (psf_learned), not "
        "fitted to a kernel."
    )
    result = {}
    for family, attention, target in (
        ("polynomial", polysketch_attention(), "(q·k)^4"),
        ("softmax", "softmax", "exp(q·k/√D)"),
    ):
        model, origin = _trained_model(attention, args, state)
        panels, sources = {}, {}
        if model is None:
            report.note(f"{family} maps on captured q/k skipped: {origin}.")
            d = sizes.n_embd // sizes.n_head
        else:
            q, k, qf, kf = _captured(model, args, sizes, state, args.seed)
            d = q.shape[-1]
            sources[f"captured from `{attention}` model ({origin})"] = (q, k, (qf, kf))
        gq, gk = load_qk("gaussian", dim=d, num=sizes.num, seed=args.seed)
        fq, fk = load_qk("gaussian", dim=d, num=sizes.num, seed=args.seed + 1)
        sources["Gaussian q, k"] = (gq, gk, (fq, fk))
        print(f"[fidelity] {family} maps vs {target}", flush=True)
        table: dict[tuple, dict] = {}
        skipped = []
        rows_by_label = {}
        for label, (q, k, fit) in sources.items():
            rows, optimum = _family_rows(family, q, k, fit, sizes, args)
            rows_by_label[label] = rows
            comparable = [r for r in rows if family == "softmax" or r.get("target") == target]
            panels[label.split(" (")[0].replace("`", "")] = (comparable, optimum)
            for r in rows:
                if r.get("skipped"):
                    skipped.append(f"{r['map']} F={r['num_features']}: {r['skipped']}")
                    continue
                key = (r["map"], r["num_features"], r["state_dim"])
                table.setdefault(key, {})[label] = r
        if family == "softmax":
            captured = [lb for lb in sources if lb.startswith("captured")]
            names = {r["map"] for rows in rows_by_label.values() for r in rows}
            footnote = _complex_exp_note(names)
            if captured:
                q, k, fit = sources[captured[0]]
                footnote += _at_one_note(rows_by_label[captured[0]], q, k, fit, args, sizes)
            footnote, marks = footnote.strip(), {}
        else:
            r_model = psf_random_sketch()["num_features"]
            marks = {PSF_LABEL: create("polysketch", d, **psf_random_sketch()).state_dim}
            footnote = (
                f"{PSF_LABEL}: the degree-2 sketch of r features, self-tensored (state "
                f"r(⌊r/2⌋+1)); ringed: r = {r_model}, the size the psf_random models use. Maps "
                "measured against their own kernel (not (q·k)^4) are in the table only."
            )
        png = plot_fidelity_panels(panels, out / f"fidelity_{family}.png", footnote=footnote,
                                   marks=marks)  # fmt: skip
        labels = list(sources)
        headers = ["map", "measured against", "F asked", "state dim"]
        for label in labels:
            short = "captured" if label.startswith("captured") else "Gaussian"
            headers += [f"error ({short})", f"ratio ({short})"]
        rows = []
        for (name, f, m), per in table.items():
            against = next(iter(per.values())).get("target", target)
            row = [name, target if family == "softmax" else against, f, m]
            for label in labels:
                r = per.get(label)
                row += (
                    [None, None] if r is None else [r["rel_frobenius_mean"], r["ratio_to_optimal"]]
                )
            rows.append(row)
        report.heading(f"{family.capitalize()} maps, target {target}", level=3)
        stats = "; ".join(f"{lb}: {_scale_stats(q, k)}" for lb, (q, k, _) in sources.items())
        note = (
            "Random-feature estimators of exp(q·k/√D) have relative mean squared error growing "
            "like exp(‖q + k‖²/√D)/m (HRF Lemma 2.2, Eq. 7), so they degrade sharply when "
            "trained queries and keys have large norms."
            if family == "softmax"
            else "`own kernel`: a map whose target is not a polynomial kernel (measured "
            "against that target)."
        )
        report.paragraph(f"Data ({stats}). Head dim D = {d}. {note}")
        report.table(headers, rows)
        report.image(
            png.name,
            f"{family} maps: error vs state dim against {target} (maps measured against their "
            "own kernel are in the table only)",
        )
        if footnote:
            report.paragraph(footnote)
        if skipped:
            report.paragraph("Not measured: " + "; ".join(sorted(set(skipped))) + ".")
        print(format_table(headers, rows), flush=True)
        result[family] = {"headers": headers, "rows": rows, "skipped": sorted(set(skipped)),
                          "note": footnote}  # fmt: skip
    return result
