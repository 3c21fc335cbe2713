"""Clustering-based hybrid random features (HRF paper, Sec. 2.4 "data admitting clustering
structure", Eq. 21, and App. H.2, Def. H.2 "Zero-One-Mixtures").

Target: SM(x, y) = exp(scale · x·y). Queries are grouped into u clusters (centers x_1..x_u)
and keys into w clusters (centers y_1..y_w) by k-means. Each cluster pair (i, j) gets its own
complex exponential (CE) estimator (Eq. 14–16)

    SM^{ij}(x, y) = Ψ_{A_ij}(x)ᵀ Ψ_{(A_ijᵀ)⁻¹}(y),
    Ψ_M(u) = m^{-1/2} exp(-(Mu)²/2) (exp(ω_1ᵀMu), ..., exp(ω_mᵀMu)),   ω_l ~ N(0, I_D),

whose matrix A_ij minimizes the loss of Eq. 21, l(A) = |A x_i + (Aᵀ)⁻¹ y_j|² (zero loss means
zero variance at the centers, Eq. 17). The λ-coefficients are cluster indicators (Def. H.2,
Eq. 101–103): λ^{ij}(x, y) = 1[x ∈ X_i]·1[y ∈ Y_j], which sum to one, so the hybrid estimator
(Eq. 8) is SM^{c(x) c(y)}(x, y) — unbiased for every fixed clustering, since ω is drawn
independently of the data. As features (Lemma 2.3 with deterministic ρ):

    φq(x) = ⋆_{(i,j)} 1[c(x) = i] Ψ_{A_ij}(x),    φk(y) = ⋆_{(i,j)} 1[c(y) = j] Ψ_{(A_ijᵀ)⁻¹}(y),

F = u·w·k with k = 2m Ψ-entries for the antithetic rows [ω; -ω] (default, as ``complex_exp``)
or k = m, times 2 for complex A (real and imaginary parts: φq·φk = Re of the CE estimator).
All pairs share one ω (only one pair is active for any (x, y), so each pair's estimator is
exactly Eq. 16). Only the w blocks of the query's own cluster (u blocks for keys) are computed.

Families of A (closed forms, vectorized over all pairs):
    "real_diagonal"     A = diag(a), a_k = sqrt(|y_k / x_k|) (App. H.2, Eq. 88); the paper's
                        experiments use it. Loss Σ_k 2(x_k y_k + |x_k y_k|).
    "complex_diagonal"  A = diag(α + iβ) from Eq. 85–87: β = sqrt(y_k/x_k) if x_k y_k > 0,
                        α = sqrt(-y_k/x_k) if x_k y_k < 0 — zero loss for nonzero centers.
    "real"              full real A (our derivation; the paper gives no closed form): with
                        t = -y if x·y < 0 else y, M = t tᵀ/(x·t) + I - x xᵀ/|x|² is SPD with
                        M x = t, and A = M^{1/2} gives Aᵀ A x = t, i.e. loss 0 if x·y < 0 and the
                        global minimum 4 x·y over real A otherwise (|u + v|² ≥ 2|u·v| + 2u·v
                        for u = Ax, v = A⁻ᵀy, u·v = x·y).
Entries (eigenvalues for "real") are clamped to [1/A_BOUND, A_BOUND] so A stays invertible
when a center coordinate is (near) zero (App. H.2's "large"/"small" values). Any invertible A
gives an unbiased estimator, so clamping and fp32 rounding of A never add bias (clamping only
costs optimality, e.g. for "real" with nearly orthogonal centers); the key-side matrix
(Aᵀ)⁻¹ is computed from the stored A at use, in the compute dtype.

Caveat: A is tuned to the centers and scales a point's offset from its center by up to
A_BOUND, so loose clusters whose centers have near-zero coordinates can give a much larger
MSE than positive features (e.g. on standardized UCI rows); tight clusters give large gains.

For real A the relative MSE at (x, y) is exactly (cosh(l) - 1)/m with antithetic rows and
(exp(l) - 1)/m without, l = |A x + A⁻ᵀ y|² (from Eq. 13; ``relative_mse_real``): the loss of
Eq. 21 evaluated at (x, y) rather than at the centers.
"""

from __future__ import annotations

import math

import torch

from .._checks import (
    check_choice,
    check_feature_input,
    check_finite,
    check_float,
    check_int,
    check_positive_int,
    check_tensor,
)
from ..random import make_generator
from .base import FeatureMap, Hyperparameter, register
from .random_features import draw_directions

__all__ = [
    "ClusteredHybrid",
    "kmeans",
    "closed_form_A",
    "pair_loss",
    "relative_mse_real",
    "A_FAMILIES",
    "A_BOUND",
]

A_FAMILIES = ("real_diagonal", "complex_diagonal", "real")
A_BOUND = 100.0


# ----- k-means -------------------------------------------------------------------------------
def kmeans(
    x: torch.Tensor, k: int, *, steps: int = 50, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means with k-means++ seeding (Arthur & Vassilvitskii, 2007).

    x: (N, D) -> (centers (k, D), labels (N,) int64). Deterministic given ``generator`` (a
    CPU generator: the seeding draws happen on the CPU, the distances on ``x.device``). Stops
    early when the labels stop changing; an emptied cluster keeps its previous center.
    """
    x = check_tensor(x, "x", min_dim=2)
    if x.dim() != 2:
        raise ValueError(f"x must have shape (N, D), got {tuple(x.shape)}")
    k = check_positive_int(k, "k")
    steps = check_positive_int(steps, "steps")
    n = x.shape[0]
    if n < k:
        raise ValueError(f"k must be <= the number of points ({n}), got {k}")
    first = int(torch.randint(0, n, (1,), generator=generator))
    centers = x[first : first + 1]
    dist = torch.cdist(x, centers).squeeze(-1).square()
    for _ in range(1, k):
        weights = dist.detach().to("cpu", torch.float64)
        if float(weights.sum()) <= 0:  # fewer distinct points than k: take any point
            weights = torch.ones_like(weights)
        nxt = int(torch.multinomial(weights, 1, generator=generator))
        centers = torch.cat([centers, x[nxt : nxt + 1]], dim=0)
        dist = torch.minimum(dist, (x - x[nxt]).square().sum(-1))
    labels = torch.cdist(x, centers).argmin(dim=-1)
    for _ in range(steps):
        onehot = torch.nn.functional.one_hot(labels, k).to(x.dtype)  # (N, k)
        counts = onehot.sum(0)
        sums = onehot.T @ x
        centers = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], centers)
        new = torch.cdist(x, centers).argmin(dim=-1)
        if torch.equal(new, labels):
            break
        labels = new
    return centers, labels


# ----- closed-form A (Eq. 21, App. H.2) ------------------------------------------------------
def closed_form_A(
    centers_q: torch.Tensor, centers_k: torch.Tensor, family: str = "real_diagonal"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Matrices A_ij minimizing Eq. 21 within ``family`` for every pair of centers.

    centers_q: (u, D), centers_k: (w, D) ->
        "real_diagonal":    (A (u, w, D), None)        A_ij = diag(a_ij)        (Eq. 88)
        "complex_diagonal": (Re A (u, w, D), Im A (u, w, D))                     (Eq. 85–87)
        "real":             (A (u, w, D, D), None)     A_ij = M_ij^{1/2} (module docstring)
    """
    family = check_choice(family, "A_family", A_FAMILIES)
    x = centers_q[:, None, :]  # (u, 1, D)
    y = centers_k[None, :, :]  # (1, w, D)
    lo, hi = 1.0 / A_BOUND, A_BOUND
    tiny = torch.finfo(centers_q.dtype).tiny ** 0.5
    xz, yz = x.abs() <= tiny, y.abs() <= tiny
    ratio = (y.abs() / x.abs().clamp_min(tiny)).sqrt().clamp(lo, hi)  # sqrt|y_k / x_k|
    if family == "real_diagonal":
        a = torch.where(xz & yz, torch.ones_like(ratio), ratio)
        return a.contiguous(), None
    if family == "complex_diagonal":
        same = (x * y) > 0
        # x_k y_k > 0: a = i sqrt(y/x) (Eq. 86); x_k y_k < 0: a = sqrt(-y/x) (Eq. 87); both 0:
        # a = 1 + i; x_k = 0 only: a large (ratio = hi); y_k = 0 only: α = β small.
        re = torch.where(same, torch.zeros_like(ratio), ratio)
        im = torch.where(same, ratio, torch.zeros_like(ratio))
        re = torch.where(xz & yz, torch.ones_like(re), re)
        im = torch.where(xz & yz, torch.ones_like(im), im)
        y_only = yz & ~xz
        re = torch.where(y_only, torch.full_like(re, lo), re)
        im = torch.where(y_only, torch.full_like(im, lo), im)
        return re.contiguous(), im.contiguous()
    # "real": A = M^{1/2}, M = t tᵀ/(x·t) + I - x xᵀ/|x|², t = -sign(x·y) y.
    x, y = torch.broadcast_tensors(x, y)  # (u, w, D)
    dot = (x * y).sum(-1, keepdim=True)
    t = torch.where(dot < 0, -y, y)
    xt = (x * t).sum(-1, keepdim=True).clamp_min(tiny)
    xx = (x * x).sum(-1, keepdim=True).clamp_min(tiny)
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
    m = (
        t[..., :, None] * t[..., None, :] / xt[..., None]
        + eye
        - x[..., :, None] * x[..., None, :] / xx[..., None]
    )
    evals, evecs = torch.linalg.eigh(m)
    root = evals.clamp(lo * lo, hi * hi).sqrt()
    return (evecs * root[..., None, :]) @ evecs.transpose(-1, -2), None


def _key_matrix(a_re, a_im, family):
    """(Aᵀ)⁻¹ for every pair: the key-side matrix (same layout as A)."""
    if family == "real_diagonal":
        return 1.0 / a_re, None
    if family == "complex_diagonal":
        den = a_re.square() + a_im.square()
        return a_re / den, -a_im / den
    return torch.linalg.inv(a_re).transpose(-1, -2), None


def _apply(a_re, a_im, x, family):
    """z = A x for stacked A (..., D[, D]) and x (..., D): returns (Re z, Im z or None)."""
    if family == "real":
        return (a_re @ x.unsqueeze(-1)).squeeze(-1), None
    return a_re * x, (None if a_im is None else a_im * x)


def pair_loss(
    a_re: torch.Tensor,
    a_im: torch.Tensor | None,
    centers_q: torch.Tensor,
    centers_k: torch.Tensor,
    family: str = "real_diagonal",
) -> torch.Tensor:
    """Eq. 21, l(A_ij) = |A_ij x_i + (A_ijᵀ)⁻¹ y_j|² (complex modulus), for every pair: (u, w)."""
    family = check_choice(family, "A_family", A_FAMILIES)
    b_re, b_im = _key_matrix(a_re, a_im, family)
    x, y = centers_q[:, None, :], centers_k[None, :, :]
    zx_re, zx_im = _apply(a_re, a_im, x, family)
    zy_re, zy_im = _apply(b_re, b_im, y, family)
    loss = (zx_re + zy_re).square().sum(-1)
    if zx_im is not None:
        loss = loss + (zx_im + zy_im).square().sum(-1)
    return loss


def relative_mse_real(
    loss: torch.Tensor, num_features: int, *, antithetic: bool = True
) -> torch.Tensor:
    """MSE/SM² of a real-A CE estimator with m i.i.d. directions, l = |Ax + A⁻ᵀy|² (Eq. 21).

    From Eq. 13, E[exp(2ωᵀz)] = exp(2|z|²): (exp(l) - 1)/m for m independent features, and
    (cosh(l) - 1)/m for the antithetic rows [ω; -ω] (2m features; A = I gives Lemma 2.2's
    MSE of FAVOR+ with z = x + y).
    """
    if antithetic:
        return (torch.cosh(loss) - 1.0) / num_features
    return torch.expm1(loss) / num_features


def _parse_clusters(clusters) -> tuple[int, int]:
    if isinstance(clusters, (tuple, list)):
        if len(clusters) != 2:
            raise ValueError(f"clusters must be an int or a pair (u, w), got {clusters!r}")
        return check_positive_int(clusters[0], "clusters"), check_positive_int(
            clusters[1], "clusters"
        )
    c = check_positive_int(clusters, "clusters")
    return c, c


# ----- the feature map -----------------------------------------------------------------------
@register("hybrid_clustered")
class ClusteredHybrid(FeatureMap):
    """Clustering-based HRF for SM(x, y) = exp(scale·x·y) (Sec. 2.4, Eq. 21, Def. H.2).

    Call ``fit(q, k)`` once (k-means on queries and keys, closed-form A per cluster pair)
    before ``query``/``key``. Shapes: (..., D) -> (..., F), F = u·w·m (2·u·w·m for
    ``A_family="complex_diagonal"``), k = 2m (``antithetic``, default) or m.

    Args:
        dim: D.
        num_features: m, random features per cluster-pair estimator.
        clusters: u = w (int) or (u, w), the default cluster counts for ``fit``.
        A_family: "real_diagonal" (default; the paper's choice, Eq. 88), "complex_diagonal"
            (Eq. 85–87) or "real".
        scale: the kernel is exp(scale·x·y) (inputs are multiplied by sqrt(scale)).
        orthogonal: draw ω in orthogonal blocks (still marginally N(0, I)).
        antithetic: use the rows [ω; -ω] (2m Ψ-entries per pair; lower variance).
        seed, generator: source of ω and of the k-means seeding / subsampling in ``fit``.

    Buffers: ``omega`` (m, D); after fit ``centers_q`` (u, D), ``centers_k`` (w, D),
    ``A_real`` (u, w, D) or (u, w, D, D), ``A_imag`` (complex only).
    """

    kind = "unbiased"
    is_random = True
    family = "softmax"
    stable_query = True
    hyperparameters = {
        "num_features": Hyperparameter(16, "m >= 1 random features per cluster-pair estimator"),
        "clusters": Hyperparameter(2, "u = w (int) or (u, w), the default cluster counts of fit"),
        "A_family": Hyperparameter("real_diagonal", f"family of A, one of {A_FAMILIES}"),
        "scale": Hyperparameter(1.0, "s > 0 of the target exp(s·x·y)"),
        "orthogonal": Hyperparameter(False, "draw ω in orthogonal blocks"),
        "antithetic": Hyperparameter(True, "use the rows [ω; −ω]"),
        "seed": Hyperparameter(None, "seed of ω and of fit's k-means"),
        "generator": Hyperparameter(None, "torch.Generator for both (not with seed)"),
    }
    fit_keywords = frozenset({"clusters", "steps", "max_samples", "seed", "generator"})
    _fitted_names = ("centers_q", "centers_k", "A_real", "A_imag")

    def __init__(
        self,
        dim: int,
        *,
        num_features: int = 16,
        clusters=2,
        A_family: str = "real_diagonal",
        scale: float = 1.0,
        orthogonal: bool = False,
        antithetic: bool = True,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        family = check_choice(A_family, "A_family", A_FAMILIES)
        super().__init__(dim, nonnegative=family != "complex_diagonal")
        self.num_features = check_positive_int(num_features, "num_features")
        self.num_clusters = _parse_clusters(clusters)
        self.A_family = family
        self.scale = check_float(scale, "scale", minimum=0.0, strict_minimum=True)
        if not isinstance(orthogonal, bool):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.orthogonal = orthogonal
        if not isinstance(antithetic, bool):
            raise TypeError(f"antithetic must be a bool, got {type(antithetic).__name__}")
        self.antithetic = antithetic
        self._generator = make_generator(seed, generator)
        for name in self._fitted_names:
            self.register_buffer(name, None)
        self._draw(self._generator)

    # ----- sizes / kernel --------------------------------------------------------------------
    @property
    def fitted(self) -> bool:
        return self.centers_q is not None

    @property
    def feature_dim(self) -> int:
        u, w = self.num_clusters
        k = self.num_features * (2 if self.antithetic else 1)
        return u * w * k * (2 if self.A_family == "complex_diagonal" else 1)

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """exp(scale · x yᵀ): (..., Tx, D), (..., Ty, D) -> (..., Tx, Ty)."""
        check_feature_input(x, self.dim, "x")
        check_feature_input(y, self.dim, "y")
        return torch.exp(self.scale * (x @ y.transpose(-1, -2)))

    def _draw(self, generator: torch.Generator) -> None:
        omega = draw_directions(
            self.num_features, self.dim, orthogonal=self.orthogonal, generator=generator
        )
        self._set_buffer("omega", omega)

    # ----- fitting -----------------------------------------------------------------------------
    @torch.no_grad()
    def fit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        clusters=None,
        *,
        steps: int = 50,
        max_samples: int | None = 4096,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ) -> ClusteredHybrid:
        """Cluster queries ``q`` (..., D) and keys ``k`` (..., D), then set A per pair.

        k-means (``steps`` Lloyd iterations, k-means++ seeding) runs on at most
        ``max_samples`` rows of each, drawn without replacement. Randomness comes from
        ``seed``/``generator`` if given, else from the map's own generator. ``clusters``
        (int or (u, w)) overrides the counts given at construction. Returns ``self``.
        """
        q = check_finite(check_feature_input(q, self.dim, "q"), "q").reshape(-1, self.dim)
        k = check_finite(check_feature_input(k, self.dim, "k"), "k").reshape(-1, self.dim)
        u, w = self.num_clusters if clusters is None else _parse_clusters(clusters)
        if q.shape[0] < u:
            raise ValueError(f"clusters: {u} query clusters need at least {u} rows of q")
        if k.shape[0] < w:
            raise ValueError(f"clusters: {w} key clusters need at least {w} rows of k")
        steps = check_positive_int(steps, "steps")
        if max_samples is not None:
            max_samples = check_int(max_samples, "max_samples", minimum=max(u, w))
        gen = (
            self._generator
            if seed is None and generator is None
            else make_generator(seed, generator)
        )
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        sq, sk = q.to(work), k.to(work)
        if max_samples is not None and sq.shape[0] > max_samples:
            sq = sq[torch.randperm(sq.shape[0], generator=gen)[:max_samples].to(sq.device)]
        if max_samples is not None and sk.shape[0] > max_samples:
            sk = sk[torch.randperm(sk.shape[0], generator=gen)[:max_samples].to(sk.device)]
        cq, _ = kmeans(sq, u, steps=steps, generator=gen)
        ck, _ = kmeans(sk, w, steps=steps, generator=gen)
        root = math.sqrt(self.scale)  # A is fitted to the scaled centers
        a_re, a_im = closed_form_A(cq.double() * root, ck.double() * root, self.A_family)
        self.num_clusters = (u, w)
        ref = self.omega
        for name, value in zip(self._fitted_names, (cq, ck, a_re, a_im), strict=True):
            if value is not None:
                self._buffers[name] = value.to(device=ref.device, dtype=ref.dtype)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Fitted buffers change shape with the cluster counts: size them from the state.
        for name in self._fitted_names:
            value = state_dict.get(prefix + name)
            if value is not None:
                self._buffers[name] = torch.empty_like(value, device=self.omega.device)
        if self.centers_q is not None and self.centers_k is not None:
            self.num_clusters = (self.centers_q.shape[0], self.centers_k.shape[0])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ----- features ----------------------------------------------------------------------------
    def _check_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError(
                "ClusteredHybrid has no clusters yet: call fit(q, k) first "
                "(k-means on sample queries and keys)"
            )

    def _assign(self, x: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        """Index of the nearest center (Euclidean) for every row: (..., D) -> (...,)."""
        c = centers.to(x.dtype)
        d2 = (x.square().sum(-1, keepdim=True) - 2 * x @ c.T) + c.square().sum(-1)
        return d2.argmin(dim=-1)

    def _psi(self, zr, zi, key: bool, stabilize: bool = False) -> torch.Tensor:
        """Ψ for z = M u (Eq. 15): (..., P, D) -> (..., P, m) or (..., P, 2m) when complex.

        ``stabilize``: subtract the largest log-modulus over the P blocks and m features of a
        row, i.e. multiply the query row by one positive factor (``FeatureMap.query_stabilized``).
        """
        omega = self.omega.to(zr.dtype)
        if self.antithetic:
            omega = torch.cat([omega, -omega])
        m = omega.shape[0]
        log_mod = zr @ omega.T - 0.5 * zr.square().sum(-1, keepdim=True) - 0.5 * math.log(m)
        if zi is not None:  # exp(-(z)²/2 + ωᵀz), z = zr + i zi, (z)² = |zr|² - |zi|² + 2i zr·zi
            log_mod = log_mod + 0.5 * zi.square().sum(-1, keepdim=True)
        if stabilize:
            log_mod = log_mod - log_mod.amax(dim=(-2, -1), keepdim=True).detach()
        mod = torch.exp(log_mod)
        if zi is None:
            return mod
        phase = zi @ omega.T - (zr * zi).sum(-1, keepdim=True)
        sin = mod * torch.sin(phase)
        return torch.cat([mod * torch.cos(phase), -sin if key else sin], dim=-1)

    def _query(self, x: torch.Tensor, stabilize: bool = False) -> torch.Tensor:
        self._check_fitted()
        u, w = self.num_clusters
        c = self._assign(x, self.centers_q)  # (...,)
        xs = x * math.sqrt(self.scale)
        a_re = self.A_real.to(x.dtype)[c]  # (..., w, D[, D])
        a_im = None if self.A_imag is None else self.A_imag.to(x.dtype)[c]
        zr, zi = _apply(a_re, a_im, xs.unsqueeze(-2), self.A_family)
        psi = self._psi(zr, zi, key=False, stabilize=stabilize)  # (..., w, m')
        onehot = torch.nn.functional.one_hot(c, u).to(x.dtype)  # (..., u)
        feats = onehot[..., :, None, None] * psi[..., None, :, :]  # (..., u, w, m')
        return feats.reshape(*x.shape[:-1], self.feature_dim)

    def _query_stabilized(self, x: torch.Tensor) -> torch.Tensor:
        return self._query(x, stabilize=True)

    def _key(self, y: torch.Tensor) -> torch.Tensor:
        self._check_fitted()
        u, w = self.num_clusters
        c = self._assign(y, self.centers_k)
        ys = y * math.sqrt(self.scale)
        a_im = None if self.A_imag is None else self.A_imag.to(y.dtype)
        b_re, b_im = _key_matrix(self.A_real.to(y.dtype), a_im, self.A_family)
        b_re = b_re.transpose(0, 1)[c]  # (..., u, D[, D])
        b_im = None if b_im is None else b_im.transpose(0, 1)[c]
        zr, zi = _apply(b_re, b_im, ys.unsqueeze(-2), self.A_family)
        psi = self._psi(zr, zi, key=True)  # (..., u, m')
        onehot = torch.nn.functional.one_hot(c, w).to(y.dtype)  # (..., w)
        feats = onehot[..., None, :, None] * psi[..., :, None, :]  # (..., u, w, m')
        return feats.reshape(*y.shape[:-1], self.feature_dim)

    def extra_repr(self) -> str:
        u, w = self.num_clusters
        return (
            f"dim={self.dim}, num_features={self.num_features}, clusters=({u}, {w}), "
            f"A_family={self.A_family!r}, scale={self.scale}, fitted={self.fitted}"
        )
