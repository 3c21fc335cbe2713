"""Fitting a feature map to data: the one implementation the learnable maps share.

LLoPS (``llops-learnable-polynomial-sketch.md``) trains a map by minimising Eq. 6,
``‖φQ(Q)φK(K)ᵀ − (QKᵀ)^{∘p}‖_F²``, here normalised by ``‖(QKᵀ)^{∘p}‖_F²`` (same minimiser,
scale free): ``relative_loss``, ``kernel_loss`` and the Adam loop ``fit_kernel`` serve LLoPS
and the learned PolySketchFormer sketch. Every ``fit`` method (LLoPS, learned_polysketch,
Hedgehog) ends with the same rule, ``keep_start_if_worse``: the loss on the fitted data is
measured before and after; if training made it worse (or NaN), the starting parameters are
restored, so a fit never returns a map worse on its data than the one it started from.
Samples are validated and flattened by ``flat_finite``; the loss is measured on a subset of
them (``strided_rows``, or ``random_rows`` drawn from a generator).

The Eckart–Young optimum a fitted map is compared with lives in ``features.optimal_rank``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from tqdm import tqdm

from .._checks import check_finite, check_float, check_positive_int, check_tensor
from ..random import make_generator

__all__ = [
    "relative_loss",
    "kernel_target",
    "kernel_loss",
    "flat_finite",
    "strided_rows",
    "random_rows",
    "fit_kernel",
    "keep_start_if_worse",
]

T = TypeVar("T")


def relative_loss(approx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Eq. 6 normalised: ``‖approx − target‖_F² / ‖target‖_F²`` (a scalar)."""
    return (approx - target).square().sum() / target.square().sum().clamp_min(1e-300)


def kernel_target(feature_map, q: torch.Tensor, k: torch.Tensor, degree: int | None):
    """The matrix a fit imitates: ``(Q Kᵀ)^{∘degree}``, or ``target_kernel(Q, K)`` when None.

    Shapes: q (N, D), k (M, D) -> (N, M).
    """
    if degree is None:
        return feature_map.target_kernel(q, k)
    return (q @ k.T) ** degree


@torch.no_grad()
def kernel_loss(feature_map, q: torch.Tensor, k: torch.Tensor, degree: int | None) -> float:
    """``relative_loss`` of the map's scores against ``kernel_target`` on (q, k), no gradients.

    q (N, D), k (M, D) are moved to the device of the map's tensors first.
    """
    ref = feature_map._reference_tensor()
    if ref is not None:
        q, k = q.to(ref.device), k.to(ref.device)
    target = kernel_target(feature_map, q, k, degree)
    return float(relative_loss(feature_map.approx_kernel(q, k), target))


def flat_finite(x, name: str, dim: int | None = None) -> torch.Tensor:
    """x (..., D) -> (N, D) with N ≥ 1 and finite entries; errors name ``name``."""
    x = check_tensor(x, name, min_dim=1, last_dim=dim)
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one vector, got shape {tuple(x.shape)}")
    return check_finite(x, name)


def strided_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """At most ``rows`` rows of x (N, ...), evenly strided from the first (deterministic)."""
    return x[:: -(-x.shape[0] // rows)]


def random_rows(q, k, dim: int, generator: torch.Generator, size: int = 2048):
    """Up to ``size`` rows each of the flattened q and k, drawn without replacement from
    ``generator`` (after ``flat_finite``)."""
    out = []
    for x, name in ((q, "q"), (k, "k")):
        x = flat_finite(x, name, dim)
        if x.shape[0] > size:
            x = x[torch.randperm(x.shape[0], generator=generator)[:size].to(x.device)]
        out.append(x)
    return out


def fit_kernel(
    feature_map,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    degree: int | None = None,
    steps: int = 500,
    lr: float = 1e-2,
    batch: int | None = 1024,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
) -> list[float]:
    """Train the parameters of ``feature_map`` so that its scores imitate a kernel on data.

    Minimises Eq. 6 of the LLoPS paper, normalised by ``‖target‖_F²`` (same minimiser, scale
    free), with Adam: at every step ``batch`` queries and ``batch`` keys are drawn (without
    replacement, from ``seed``/``generator``) and the loss is
    ``‖S − A‖_F² / ‖A‖_F²`` with ``S = approx_kernel(Q_b, K_b)`` (squared scores when
    ``feature_map.square``) and ``A = kernel_target(Q_b, K_b, degree)``.

    Args:
        q: sampled queries (N, D) or (..., D) (leading dims are flattened).
        k: sampled keys (M, D) or (..., D).
        degree: target polynomial degree; None uses the map's ``target_kernel``.
        steps: number of Adam steps. lr: learning rate.
        batch: rows of q and of k per step; None (or ≥ N, M) uses them all.
        progress: show a tqdm bar; None shows it only when stderr is a terminal.

    Returns: the loss before each step (a list of ``steps`` floats).
    """
    dim = feature_map.dim
    q = flat_finite(q, "q", dim)
    k = flat_finite(k, "k", dim)
    if degree is not None:
        degree = check_positive_int(degree, "degree")
    steps = check_positive_int(steps, "steps")
    lr = check_float(lr, "lr", minimum=0.0, strict_minimum=True)
    if batch is not None:
        batch = check_positive_int(batch, "batch")
    params = [p for p in feature_map.parameters() if p.requires_grad]
    if not params:
        raise ValueError("feature_map has no trainable parameters to fit")
    gen = make_generator(seed, generator)
    q = q.to(params[0].device)
    k = k.to(params[0].device)
    show = sys.stderr.isatty() if progress is None else bool(progress)
    optimizer = torch.optim.Adam(params, lr=lr)
    history: list[float] = []
    with torch.enable_grad():
        for _ in tqdm(range(steps), desc="fit", disable=not show):
            qb, kb = q, k
            if batch is not None and batch < q.shape[0]:
                qb = q[torch.randperm(q.shape[0], generator=gen)[:batch].to(q.device)]
            if batch is not None and batch < k.shape[0]:
                kb = k[torch.randperm(k.shape[0], generator=gen)[:batch].to(k.device)]
            target = kernel_target(feature_map, qb, kb, degree)
            loss = relative_loss(feature_map.approx_kernel(qb, kb), target.detach())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            history.append(float(loss.detach()))
    return history


def keep_start_if_worse(
    module: nn.Module,
    measure: Callable[[], float],
    train: Callable[[], T],
    *,
    label: str | None = None,
) -> T:
    """Run ``train()``; restore ``module``'s starting state if it left ``measure()`` worse.

    ``measure`` is called before and after training (the loss on the fitted data, lower is
    better). If the loss after is not ≤ the loss before (a rise, or NaN), every tensor of
    ``module.state_dict()`` is restored to its value before training, so the module never ends
    worse than it started. ``label`` (e.g. ``"hedgehog.fit (lr=0.03)"``) makes the restore
    warn with it; None restores silently (LLoPS: from a nearly exact closed-form start Adam can
    only add noise, which is expected). Returns what ``train()`` returned.
    """
    start = {name: t.detach().clone() for name, t in module.state_dict().items()}
    before = measure()
    result = train()
    after = measure()
    if not after <= before:  # also catches NaN
        module.load_state_dict(start)
        if label is not None:
            warnings.warn(
                f"{label}: loss rose from {before:.4g} to {after:.4g}; "
                "the initial parameters were restored",
                stacklevel=3,
            )
    return result
