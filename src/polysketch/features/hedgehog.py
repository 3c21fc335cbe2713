"""Hedgehog: a learnable "spiky" feature map trained to mimic softmax attention.

Hedgehog (Zhang et al. 2024, "The Hedgehog & the Porcupine: Expressive Linear Attentions
with Softmax Mimicry") replaces ``exp(scale·q·k)`` by the dot product of learned features

    u = x W + b,        φ(x) = [softmax(u), softmax(−u)]  ∈ R^{2M}   (softmax over features)

with W ∈ R^{D×M}, b ∈ R^M per head, W initialized to the identity (M = D). The exponentials
keep scores positive and "spiky" (low entropy, like softmax rows); the negated half keeps
directions in which q·k is negative. The map is trained by *attention distillation*: the
cross-entropy between each softmax attention row ``A_i = softmax_j(scale·q_i·k_j)`` and the
map's normalized row ``P_i = s_i / Σ_j s_ij``, ``s_ij = φq(q_i)·φk(k_j)`` (``fit``).

Like LLoPS this is a learned imitation of its ``target_kernel``, not an estimator: nothing
makes ``φq·φk`` equal (or unbiased for) ``exp(scale·q·k)``; only the normalized attention rows
are trained to match, and the scores' absolute scale is arbitrary (each half of φ sums to 1,
so 0 < φq·φk ≤ 2; ``output_scale`` = c multiplies them by c²).
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn
from tqdm import tqdm

from .._checks import check_finite, check_float, check_positive_int, check_tensor
from ..random import gaussian, make_generator
from .base import FeatureMap, Hyperparameter, register
from .fitting import flat_finite, keep_start_if_worse, strided_rows

__all__ = ["HedgehogFeatureMap", "distillation_loss"]


def _log_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """log φ(x) = [log_softmax(u), log_softmax(−u)], u = x W + b: (..., D) -> (..., 2M)."""
    u = x @ weight.to(x.dtype) + bias.to(x.dtype)
    return torch.cat([u.log_softmax(-1), (-u).log_softmax(-1)], dim=-1)


def _features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """φ(x) = [softmax(u), softmax(−u)] = exp(``_log_features``) in one pass per half."""
    u = x @ weight.to(x.dtype) + bias.to(x.dtype)
    return torch.cat([u.softmax(-1), (-u).softmax(-1)], dim=-1)


def distillation_loss(
    log_phi_q: torch.Tensor, log_phi_k: torch.Tensor, logits: torch.Tensor, *, causal: bool
) -> torch.Tensor:
    """Mean over rows of the cross-entropy −Σ_j A_ij log P_ij (Hedgehog's distillation loss).

    ``A = softmax(logits)`` row-wise (the teacher), ``P_ij = s_ij / Σ_j s_ij`` with
    ``s_ij = Σ_f exp(log φq_if + log φk_jf)`` computed in log space (no underflow).
    Shapes: log_phi_q (..., Tq, F), log_phi_k (..., Tk, F), logits (..., Tq, Tk); ``causal``
    masks j > i (needs Tq = Tk). Returns a scalar.
    """
    log_phi_q = check_tensor(log_phi_q, "log_phi_q", min_dim=2)
    log_phi_k = check_tensor(log_phi_k, "log_phi_k", min_dim=2, last_dim=log_phi_q.shape[-1])
    logits = check_tensor(logits, "logits", min_dim=2)
    tq, tk = log_phi_q.shape[-2], log_phi_k.shape[-2]
    if logits.shape[-2:] != (tq, tk):
        raise ValueError(f"logits must have shape (..., {tq}, {tk}), got {tuple(logits.shape)}")
    if causal and tq != tk:
        raise ValueError(f"causal needs as many queries as keys, got Tq={tq}, Tk={tk}")
    log_s = torch.logsumexp(log_phi_q.unsqueeze(-2) + log_phi_k.unsqueeze(-3), dim=-1)
    if causal:
        t = logits.shape[-1]
        mask = torch.ones(t, t, dtype=torch.bool, device=logits.device).tril()
        logits = logits.masked_fill(~mask, -math.inf)
        log_s = log_s.masked_fill(~mask, -math.inf)
    log_a = logits.log_softmax(-1)
    log_p = log_s.log_softmax(-1)
    ce = -(log_a.exp() * log_p.masked_fill(~torch.isfinite(log_p), 0.0)).sum(-1)
    return ce.mean()


@register("hedgehog")
class HedgehogFeatureMap(FeatureMap):
    """Hedgehog's learnable softmax-mimicking map (module docstring): (..., D) -> (..., 2M).

    ``φq(x) = [softmax(x Wq + bq), softmax(−(x Wq + bq))]`` and the same with ``Wk, bk`` for
    keys (``shared=False``, the default) or with the query weights (``shared=True``).
    Defaults follow the public Hedgehog / LoLCATs code, which learns separate query and key
    maps (``feature_map_q`` / ``feature_map_k``); ``shared=True`` ties them (one map, as a
    symmetric kernel). ``nonnegative`` (every score is > 0), not ``square``.

    ``target_kernel(x, y) = exp(scale·x·y)``, the softmax kernel the map imitates (a learned
    imitation: see the module docstring; only normalized rows are trained, by ``fit`` or by
    attention transfer in ``polysketch.integrations.transformers``).

    Args:
        dim: D. num_features: M ≥ 1, the size of each half (default D); F = 2M.
        shared: one (W, b) for queries and keys.
        scale: temperature of the target, > 0 (default 1/√D, softmax attention's).
        output_scale: a constant c > 0 multiplying the features (scores × c²; default 1).
            Normalized attention rows do not depend on it; it matters only where the
            scores are added to other unnormalized scores, as in the mixed form of
            ``ops.mixed_attention`` (exact local polynomial blocks + this map before them),
            where φq·φk ≤ 2 is otherwise negligible next to the local (q·k)^p. Features
            reach c and scores 2c²: fp16 features overflow for c > 65504 (the ops accumulate
            scores in fp32; the transformers integration computes features in fp32).
        seed, generator: the initial draw when M ≠ D (a seeded semi-orthogonal W, see
            ``reset_parameters``); M = D starts from W = I, b = 0 (Hedgehog's init).

    Parameters: ``weight_q`` (D, M), ``bias_q`` (M,), and ``weight_k``, ``bias_k`` unless
    ``shared``; stored float32, cast to the input's compute dtype at use.
    """

    kind = "learned"
    is_random = False
    family = "softmax"
    hyperparameters = {
        "num_features": Hyperparameter(None, "M >= 1, the size of each half (None: D)"),
        "shared": Hyperparameter(False, "one (W, b) for queries and keys"),
        "scale": Hyperparameter(None, "temperature of the target exp(scale·x·y) (None: 1/√D)"),
        "output_scale": Hyperparameter(1.0, "c > 0 multiplying the features"),
        "seed": Hyperparameter(None, "seed of the initial W when M != D"),
        "generator": Hyperparameter(None, "torch.Generator for W (not with seed)"),
    }
    fit_keywords = frozenset(
        {"causal", "steps", "lr", "batch", "seed", "generator", "progress", "check_rows"}
    )

    def __init__(
        self,
        dim: int,
        *,
        num_features: int | None = None,
        shared: bool = False,
        scale: float | None = None,
        output_scale: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(dim, square=False, nonnegative=True)
        self.num_features = check_positive_int(
            self.dim if num_features is None else num_features, "num_features"
        )
        if not isinstance(shared, bool):
            raise TypeError(f"shared must be a bool, got {type(shared).__name__}")
        self.shared = shared
        self.scale = (
            1.0 / math.sqrt(self.dim)
            if scale is None
            else check_float(scale, "scale", minimum=0.0, strict_minimum=True)
        )
        self.output_scale = check_float(
            output_scale, "output_scale", minimum=0.0, strict_minimum=True
        )
        shape = (self.dim, self.num_features)
        self.weight_q = nn.Parameter(torch.zeros(shape))
        self.bias_q = nn.Parameter(torch.zeros(self.num_features))
        self.weight_k = None if shared else nn.Parameter(torch.zeros(shape))
        self.bias_k = None if shared else nn.Parameter(torch.zeros(self.num_features))
        self.reset_parameters(seed=seed, generator=generator)

    @property
    def feature_dim(self) -> int:
        return 2 * self.num_features

    @torch.no_grad()
    def reset_parameters(
        self, *, seed: int | None = None, generator: torch.Generator | None = None
    ) -> HedgehogFeatureMap:
        """W = I (M = D) or a seeded semi-orthogonal D×M matrix (M ≠ D), b = 0; same for Q, K.

        M ≠ D: the QR factor of a Gaussian (max(D, M) × min(D, M)) matrix, transposed when
        M > D, so W has orthonormal columns (M ≤ D) or rows (M > D). Returns ``self``.
        """
        d, m = self.dim, self.num_features
        if m == d:
            w = torch.eye(d)
        else:
            g = gaussian(max(d, m), min(d, m), generator=make_generator(seed, generator))
            qmat, r = torch.linalg.qr(g.double())
            qmat = qmat * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, 1.0)
            w = (qmat if m <= d else qmat.T).float()
        for weight, bias in ((self.weight_q, self.bias_q), (self.weight_k, self.bias_k)):
            if weight is not None:
                weight.copy_(w)
                bias.zero_()
        return self

    def _params(self, key: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if key and not self.shared:
            return self.weight_k, self.bias_k
        return self.weight_q, self.bias_q

    def _scaled(self, phi: torch.Tensor) -> torch.Tensor:
        return phi if self.output_scale == 1.0 else phi * self.output_scale

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self._scaled(_features(x, *self._params(False)))

    def _key(self, x: torch.Tensor) -> torch.Tensor:
        return self._scaled(_features(x, *self._params(True)))

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``exp(scale·x·y)``: (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        x = check_tensor(x, "x", min_dim=2, last_dim=self.dim)
        y = check_tensor(y, "y", min_dim=2, last_dim=self.dim)
        return torch.exp(self.scale * (x @ y.transpose(-1, -2)))

    # ----- attention distillation ----------------------------------------------------------
    def distillation_loss(self, q: torch.Tensor, k: torch.Tensor, *, causal: bool = False):
        """Hedgehog's loss on q (..., Tq, D), k (..., Tk, D): see ``distillation_loss``."""
        q = check_tensor(q, "q", min_dim=2, last_dim=self.dim)
        k = check_tensor(k, "k", min_dim=2, last_dim=self.dim)
        dt = torch.promote_types(q.dtype, self.weight_q.dtype)
        q, k = q.to(dt), k.to(dt)
        return distillation_loss(
            _log_features(q, *self._params(False)),
            _log_features(k, *self._params(True)),
            self.scale * (q @ k.transpose(-1, -2)),
            causal=causal,
        )

    def fit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        causal: bool = False,
        steps: int = 300,
        lr: float = 3e-2,
        batch: int | None = 256,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        progress: bool | None = None,
        check_rows: int = 1024,
    ) -> list[float]:
        """Train (W, b) by attention distillation (Hedgehog): Adam on ``distillation_loss``.

        Non-causal: q (N, D), k (M, D) or with leading dims (flattened); each step draws
        ``batch`` queries and ``batch`` keys (without replacement) and matches the rows of
        softmax(scale·Q_b K_bᵀ). Causal: q and k have the same shape (..., T, D), read as
        sequences (leading dims flattened); each step draws ``batch`` sequences and matches
        the causal rows (j ≤ i). ``batch=None`` uses everything. lr: Adam's learning rate
        (default 3e-2: W starts at I, entries O(1); on the test's data 1e-2
        needs ~3× the steps for the same loss). The loss on the data (at most ``check_rows`` rows
        or sequences, evenly strided) is measured before and after; if training made it worse
        the initial parameters are restored with a warning, so ``fit`` never ends worse than
        it started.

        Returns: the loss before each step (``steps`` floats).
        """
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        steps = check_positive_int(steps, "steps")
        lr = check_float(lr, "lr", minimum=0.0, strict_minimum=True)
        if batch is not None:
            batch = check_positive_int(batch, "batch")
        check_rows = check_positive_int(check_rows, "check_rows")
        device = self.weight_q.device
        if causal:
            q = check_finite(check_tensor(q, "q", min_dim=2, last_dim=self.dim), "q")
            k = check_finite(check_tensor(k, "k", min_dim=2, last_dim=self.dim), "k")
            if k.shape != q.shape:
                raise ValueError(
                    f"k must have the shape of q {tuple(q.shape)} when causal, got {tuple(k.shape)}"
                )
            q = q.reshape(-1, *q.shape[-2:]).to(device)
            k = k.reshape(-1, *k.shape[-2:]).to(device)
        else:
            q = flat_finite(q, "q", self.dim).to(device)
            k = flat_finite(k, "k", self.dim).to(device)
        gen = make_generator(seed, generator)
        qc, kc = strided_rows(q, check_rows), strided_rows(k, check_rows)

        def loss_on_data() -> float:
            with torch.no_grad():
                return float(self.distillation_loss(qc, kc, causal=causal))

        def train() -> list[float]:
            params = [p for p in self.parameters() if p.requires_grad]
            optimizer = torch.optim.Adam(params, lr=lr)
            show = sys.stderr.isatty() if progress is None else bool(progress)
            history: list[float] = []
            with torch.enable_grad():
                for _ in tqdm(range(steps), desc="hedgehog fit", disable=not show):
                    qb, kb = q, k
                    if causal:  # whole sequences, queries and keys of the same ones
                        if batch is not None and batch < q.shape[0]:
                            idx = torch.randperm(q.shape[0], generator=gen)[:batch].to(device)
                            qb, kb = q[idx], k[idx]
                    else:
                        if batch is not None and batch < q.shape[0]:
                            qb = q[torch.randperm(q.shape[0], generator=gen)[:batch].to(device)]
                        if batch is not None and batch < k.shape[0]:
                            kb = k[torch.randperm(k.shape[0], generator=gen)[:batch].to(device)]
                    loss = self.distillation_loss(qb, kb, causal=causal)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    history.append(float(loss.detach()))
            return history

        label = f"hedgehog.fit: distillation loss (lr={lr:g})"
        return keep_start_if_worse(self, loss_on_data, train, label=label)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, shared={self.shared}, scale={self.scale:g}, "
            f"output_scale={self.output_scale:g}"
        )
