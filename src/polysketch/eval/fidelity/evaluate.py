"""Fidelity of feature maps: how well φq(Q)φk(K)ᵀ reproduces the target kernel matrix.

For queries Q: (Nq, D) and keys K: (Nk, D) (any leading dims, e.g. heads, are allowed and
treated as a batch), a feature map gives the approximate kernel matrix
``A = φq(Q) φk(K)ᵀ`` (squared elementwise for ``square`` maps) and its ``target_kernel``
gives the exact matrix ``E`` (for polynomial maps ``E = (Q Kᵀ)^{∘p}``). Metrics:

- the metrics of ``metrics``: relative Frobenius error, RMAE (LLoPS Eq. 21, with a guarded
  denominator) and max relative error;
- the Eckart–Young optimum (LLoPS Thm 3.1, Eq. 7): no m-dimensional feature map can beat
  ``min_{rank ≤ m} ‖A − E‖_F = sqrt(Σ_{i>m} σ_i²)``, σ_i the singular values of E, reached by
  the truncated SVD ``U Σ_m Vᵀ``. A map's effective rank is its ``state_dim`` (F, or F² for
  ``square`` maps, whose scores are (φq·φk)² = (φq⊗φq)·(φk⊗φk)).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..._checks import check_choice, check_float, check_int, check_positive_int
from ...features import FeatureMap, get_class
from ...features.optimal_rank import (
    OptimalError,
    check_qk,
    optimal_rank_error_of,
    polynomial_target,
)
from ...random import fresh_seed, make_generator
from .metrics import (
    METRICS,
    kernel_matrices,
    max_relative_error,
    relative_frobenius_error,
    rmae,
)

__all__ = ["evaluate_map", "sweep"]


# ----- evaluating maps ---------------------------------------------------------------------
def _mean_std(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    std = float(t.std()) if t.numel() > 1 else 0.0
    return float(t.mean()), std


def _fit(
    feature_map, q_fit, k_fit, steps: int, seed: int, init: str | None, lr: float | None
) -> None:
    """Calibrate a learnable map (one with a ``fit`` method, e.g. LLoPS) on sampled q, k:
    ``steps`` optimiser steps from start ``init`` (the map's default when None) at ``lr``
    (the map's default when None). Which keywords ``fit`` takes is the map's declared
    ``fit_keywords``."""
    keywords = type(feature_map).fit_keywords
    kwargs = {"steps": steps}
    for key, value in (("init", init), ("lr", lr)):
        if value is None:
            continue
        if key not in keywords:
            raise TypeError(f"fit_{key}: {type(feature_map).__name__}.fit takes no {key}=")
        kwargs[key] = value
    if "progress" in keywords:
        kwargs["progress"] = False
    if "seed" in keywords:
        kwargs["seed"] = seed
    with torch.enable_grad():
        feature_map.fit(q_fit, k_fit, **kwargs)


def evaluate_map(
    name: str | FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    degree: int = 2,
    num_features: int | None = None,
    trials: int = 5,
    seed: int = 0,
    rel_floor: float = 1e-3,
    optimum_floor: float = 1e-9,
    fit_steps: int = 0,
    fit_data: tuple[torch.Tensor, torch.Tensor] | None = None,
    fit_trials: int = 1,
    fit_init: str | None = None,
    fit_lr: float | None = None,
    target: str = "map",
    **map_kwargs,
) -> dict:
    """Mean ± std of the fidelity metrics of one map over ``trials`` seeded draws.

    Args:
        name: a registry name (built with ``create(name, D, degree=, num_features=, seed=,
            **map_kwargs)``, passing degree and num_features only to maps that declare them as
            hyperparameters, ``FeatureMap.takes``) or a
            ``FeatureMap`` instance (deep-copied; random ones are redrawn per trial).
        q, k: (..., Nq, D), (..., Nk, D) samples; use float64 for meaningful small errors.
        degree: p, passed to maps that take ``degree=``.
        num_features: F asked (None: the map's default), passed to maps that take it.
        trials: number of seeded draws for random maps (maps without randomness, i.e. neither
            ``is_random`` nor a ``seed`` hyperparameter, are evaluated once).
        seed: base seed; trial t uses the t-th seed drawn from ``make_generator(seed)``.
        rel_floor: denominator guard of RMAE / max relative error (module docstring).
        optimum_floor: when the optimal relative error at rank ``state_dim`` (mean over
            trials when the target depends on the draw) is below this
            (the target matrix has rank ≤ state_dim, e.g. state_dim ≥ min(Nq, Nk) or ≥ the
            dimension of the polynomial feature space, so Eckart–Young allows zero error up to
            rounding), ``ratio_to_optimal`` is NaN: any nonzero error divided by a rounding-
            level optimum is meaningless. ``ratio_note`` then says why.
        fit_steps: if > 0 and the map has ``fit`` (LLoPS), calibrate it first on ``fit_data``
            (default: q, k themselves, i.e. an in-sample fit) with that many steps.
        fit_init: the start of the fit, passed as ``fit(init=...)`` (LLoPS: ``"data"``, its
            closed-form data-driven start, or ``"current"``, the constructed draw); None
            keeps the map's default. Given with ``fit_steps=0``, the map is fitted with no
            steps: for LLoPS ``"data"``, the closed-form start alone.
        fit_lr: the fit's learning rate (None: the map's default).
        fit_trials: the most trials done for a fitted map (fitting is costly and the fitted
            map depends little on its initial draw).
        target: ``"map"`` measures against the map's ``target_kernel`` (the kernel it computes
            or estimates); ``"polynomial"`` against (Q Kᵀ)^{∘p} at ``degree``, which shows how
            well maps with other targets (baselines, learned maps) imitate the polynomial
            kernel. The row's ``target`` names the kernel measured against: ``"(q·k)^d"`` when
            the matrix is the degree-d polynomial kernel (checked numerically, d ≤ 8), else
            ``"own kernel"``.

    Returns a dict with ``map``, ``kind``, ``degree``, ``num_features`` (asked), ``feature_dim``,
    ``state_dim``, ``square``, ``trials`` (done), ``{metric}_mean`` / ``{metric}_std`` for
    ``rel_frobenius``, ``rmae``, ``max_rel``, ``optimal_rel`` / ``optimal_abs`` (at rank
    state_dim, on the map's own target kernel), ``ratio_to_optimal``, ``ratio_note``,
    ``fitted`` (steps), ``fit_init`` (the fit's start, "" when not fitted), ``target`` and
    ``seconds``.
    """
    q, k = check_qk(q, k)
    degree = check_positive_int(degree, "degree")
    trials = check_positive_int(trials, "trials")
    seed = check_int(seed, "seed", minimum=0)
    fit_steps = check_int(fit_steps, "fit_steps", minimum=0)
    fit_trials = check_positive_int(fit_trials, "fit_trials")
    if fit_init is not None and not isinstance(fit_init, str):
        raise TypeError(f"fit_init must be a string or None, got {type(fit_init).__name__}")
    if fit_lr is not None:
        fit_lr = check_float(fit_lr, "fit_lr", minimum=0.0, strict_minimum=True)
    target = check_choice(target, "target", ("map", "polynomial"))
    if num_features is not None:
        num_features = check_positive_int(num_features, "num_features")
    start = time.perf_counter()
    gen = make_generator(seed)
    label, stochastic, build = _map_builder(name, q.shape[-1], degree, num_features, map_kwargs)

    n_trials = trials if stochastic else 1
    fitting = (fit_steps > 0 or fit_init is not None) and callable(getattr(build(0), "fit", None))
    if fitting:
        n_trials = min(n_trials, fit_trials)
    values = {m: [] for m in METRICS}
    fm = None
    poly = polynomial_target(q, k, degree) if target == "polynomial" else None
    optima = []
    for _ in range(n_trials):
        trial_seed = fresh_seed(gen)
        fm = build(trial_seed).to(device=q.device, dtype=q.dtype)
        if fitting:
            q_fit, k_fit = fit_data if fit_data is not None else (q, k)
            _fit(fm, q_fit, k_fit, fit_steps, trial_seed, fit_init, fit_lr)
        approx, own = kernel_matrices(fm, q, k)
        # A random map's own target may depend on its draw (e.g. fpa with random W_l).
        exact = own if poly is None else poly
        if poly is None or not optima:
            optima.append(optimal_rank_error_of(exact, fm.state_dim))
        values["rel_frobenius"].append(relative_frobenius_error(approx, exact))
        values["rmae"].append(rmae(approx, exact, rel_floor=rel_floor))
        values["max_rel"].append(max_relative_error(approx, exact, rel_floor=rel_floor))

    row = _row(label, fm, degree, num_features, n_trials, values, optima, optimum_floor)
    row["fitted"] = fit_steps if fitting else 0
    row["fit_init"] = (fit_init or "default") if fitting else ""
    row["target"] = _describe_target(exact, q, k)
    row["seconds"] = time.perf_counter() - start
    return row


def _map_builder(name, dim: int, degree: int, num_features: int | None, map_kwargs: dict):
    """(label, stochastic, build): ``build(seed)`` makes the trial's map of ``name`` (a
    registry name or a ``FeatureMap`` to copy and, if random, redraw); ``stochastic``: whether
    trials differ (the map is random or takes a seed)."""
    if isinstance(name, FeatureMap):
        template = copy.deepcopy(name)
        stochastic = template.is_random

        def build(trial_seed: int) -> FeatureMap:
            fm = copy.deepcopy(template)
            if stochastic:
                fm.redraw_(make_generator(trial_seed))
            return fm

        return template.name or type(template).__name__, stochastic, build
    if not isinstance(name, str):
        raise TypeError(f"name must be a map name or a FeatureMap, got {type(name).__name__}")
    cls = get_class(name)
    kwargs = dict(map_kwargs)
    if cls.takes("degree"):
        kwargs.setdefault("degree", degree)
    if num_features is not None and cls.takes("num_features"):
        kwargs.setdefault("num_features", num_features)
    stochastic = bool(cls.is_random) or cls.takes("seed")

    def build(trial_seed: int) -> FeatureMap:
        extra = {"seed": trial_seed} if stochastic and "generator" not in kwargs else {}
        return cls(dim, **kwargs, **extra)

    return name, stochastic, build


def _row(label, fm, degree, num_features, n_trials, values, optima, optimum_floor) -> dict:
    """The result row of ``evaluate_map``: the map's sizes, mean ± std of each metric over
    the trials, the mean Eckart–Young optimum at rank ``state_dim`` and the ratio to it."""
    opt = OptimalError(
        sum(o.absolute for o in optima) / len(optima),
        sum(o.relative for o in optima) / len(optima),
        fm.state_dim,
    )
    row = {
        "map": label,
        "kind": fm.kind,
        "degree": degree,
        "num_features": num_features,
        "feature_dim": int(fm.feature_dim),
        "state_dim": int(fm.state_dim),
        "square": bool(fm.square),
        "trials": n_trials,
    }
    for m in METRICS:
        row[f"{m}_mean"], row[f"{m}_std"] = _mean_std(values[m])
    row["optimal_rel"], row["optimal_abs"] = opt.relative, opt.absolute
    if opt.relative <= optimum_floor:
        row["ratio_to_optimal"] = math.nan
        row["ratio_note"] = (
            f"optimum ~0 at rank {opt.rank} (target rank <= state_dim): ratio undefined"
        )
    else:
        row["ratio_to_optimal"] = row["rel_frobenius_mean"] / opt.relative
        row["ratio_note"] = ""
    return row


def _describe_target(exact: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> str:
    """Name the kernel of ``exact``: "(q·k)^d" for the degree-d polynomial (d ≤ 8), or else
    "own kernel"."""
    s = (q @ k.transpose(-1, -2)).to(torch.float64)
    exact = exact.to(torch.float64)
    tol = 1e-9 if q.dtype == torch.float64 else 1e-4
    for d in range(1, 9):
        poly = s**d
        if float((exact - poly).norm()) <= tol * float(poly.norm()):
            return f"(q·k)^{d}"
    return "own kernel"


def _skipped(name, degree, num_features, reason) -> dict:
    return {"map": name, "degree": degree, "num_features": num_features, "skipped": reason}


def sweep(
    names: Sequence[str],
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    degrees: Sequence[int] = (2, 4),
    feature_dims: Sequence[int] = (16, 32, 64, 128),
    trials: int = 5,
    seed: int = 0,
    progress: bool = True,
    max_feature_dim: int = 2**14,
    map_kwargs: dict[str, dict] | None = None,
    fit_maps: Sequence[str] | None = None,
    **evaluate_kwargs,
) -> list[dict]:
    """``evaluate_map`` over maps × degrees × feature dims, with a tqdm progress bar.

    Maps that do not declare ``num_features`` as a hyperparameter (exact maps such as
    ``tensor_power``, whose F is fixed by D and p) are evaluated once per degree
    (``num_features`` None).
    A combination the map refuses (its constructor raises ValueError/TypeError, e.g. an
    unsupported degree) or whose ``feature_dim`` exceeds ``max_feature_dim`` (the N×F
    feature matrices would be too large) gives a row ``{"map", "degree", "num_features",
    "skipped": reason}`` instead of an exception (an unknown map name gives one such row
    with degree None); every other row has ``skipped`` = "".

    Args:
        map_kwargs: optional per-map extra constructor keywords, ``{name: {kw: value}}``.
        fit_maps: when given, ``fit_steps`` applies only to these map names (the others are
            measured as constructed).
        evaluate_kwargs: passed to ``evaluate_map`` (rel_floor, fit_steps, fit_data, ...).

    Returns the rows in order (map, degree, feature dim).
    """
    q, k = check_qk(q, k)
    max_feature_dim = check_positive_int(max_feature_dim, "max_feature_dim")
    degrees = [check_positive_int(p, "degrees") for p in degrees]
    feature_dims = [check_positive_int(f, "feature_dims") for f in feature_dims]
    map_kwargs = dict(map_kwargs or {})
    no_fit = {**evaluate_kwargs, "fit_steps": 0, "fit_init": None}
    jobs, rows = [], []
    for name in names:
        try:
            cls = get_class(name)
        except (ValueError, TypeError) as err:  # unknown name: one skipped row, no crash
            rows.append(_skipped(name, None, None, f"{type(err).__name__}: {err}"))
            continue
        dims = feature_dims if cls.takes("num_features") else [None]
        jobs.extend((name, p, f) for p in degrees for f in dims)

    bar = tqdm(jobs, desc="fidelity", disable=not progress, unit="map")
    for name, degree, f in bar:
        bar.set_postfix_str(f"{name} p={degree} F={f}")
        kwargs = dict(map_kwargs.get(name, {}))
        try:
            probe = get_class(name)
            ctor = dict(kwargs)
            if probe.takes("degree"):
                ctor["degree"] = degree
            if f is not None and probe.takes("num_features"):
                ctor["num_features"] = f
            ctor.setdefault("seed", seed)  # every map takes seed= (deterministic ones ignore it)
            fdim = int(probe(q.shape[-1], **ctor).feature_dim)
            if fdim > max_feature_dim:
                rows.append(_skipped(name, degree, f, f"feature_dim {fdim} > {max_feature_dim}"))
                continue
            row = evaluate_map(
                name,
                q,
                k,
                degree=degree,
                num_features=f,
                trials=trials,
                seed=seed,
                **(evaluate_kwargs if fit_maps is None or name in fit_maps else no_fit),
                **kwargs,
            )
        except (ValueError, TypeError, RuntimeError) as err:
            rows.append(_skipped(name, degree, f, f"{type(err).__name__}: {err}"))
            continue
        row["skipped"] = ""
        rows.append(row)
    bar.close()
    return rows
