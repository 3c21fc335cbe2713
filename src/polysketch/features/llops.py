"""LLoPS: the Learnable Low-Rank Polynomial Sketch.

The LLoPS paper (``llops-learnable-polynomial-sketch.md``) approximates the degree-p
polynomial kernel ``(q·k)^p`` (Eq. 3) by learned, asymmetric features

    φQ(x)_f = Σ_{r=1..t} ∏_{j=1..p} (x Θ^Q_{j,r})_f,    φK(y)_f = Σ_r ∏_j (y Θ^K_{j,r})_f

(Eq. 13–15; Def. 3.3, Eq. 17 is the rank t = 1 case). Each column f is a rank-t CP
decomposition of a column of the linear sketch ``W`` of ``vec(x^{⊗p})`` (Eq. 9–12, 16), so
φ costs O(D·F·t·p) per token and never builds the D^p tensor. The parameters are trained to
minimise Eq. 6, ``‖φQ(Q)φK(K)ᵀ − (QKᵀ)^{∘p}‖_F²``; Theorem 3.1 says no rank-F map can beat
the truncated SVD of ``(QKᵀ)^{∘p}`` (``optimal_error``). The fitting machinery (``fit_kernel``,
``relative_loss``, re-exported here) is ``polysketch.features.fitting``.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from .._checks import (
    check_choice,
    check_finite,
    check_float,
    check_int,
    check_positive_int,
    check_tensor,
)
from ..random import gaussian, make_generator, orthogonal_gaussian
from .base import FeatureMap, Hyperparameter, register
from .fitting import (
    fit_kernel,
    flat_finite,
    keep_start_if_worse,
    kernel_loss,
    random_rows,
    relative_loss,
)
from .llops_init import (
    largest_rank,
    low_rank_bilinear,
    monomial_factors,
    principal_directions,
)
from .optimal_rank import optimal_rank_error

__all__ = ["LLoPS", "based_factors", "fit_kernel", "optimal_error", "relative_loss"]

_SPARE_SCALE = 1e-2
"""Scale of the columns and rank slots a monomial start leaves over (small, not zero: a
product of zero factors has zero gradient)."""


def optimal_error(q: torch.Tensor, k: torch.Tensor, *, degree: int, num_features: int) -> float:
    """Theorem 3.1 / Eq. 7: the least relative Eq. 6 loss any F-dimensional map can reach.

    With ``A = (QKᵀ)^{∘p}`` and singular values σ_1 ≥ σ_2 ≥ ..., a pair of maps into R^F gives
    a matrix ``φQ(Q)φK(K)ᵀ`` of rank ≤ F, so ``‖φQφKᵀ − A‖_F² ≥ Σ_{i>F} σ_i²`` (Eckart–Young).
    Returns ``Σ_{i>F} σ_i² / Σ_i σ_i²``, a lower bound for ``relative_loss``: the square of
    ``features.optimal_rank.optimal_rank_error``'s relative error, of which this is the
    one-matrix case in Eq. 6's squared units.

    Shapes: q (N, D), k (M, D) (leading dims are flattened). Cost O(N·M·min(N, M)).
    """
    degree = check_positive_int(degree, "degree")
    num_features = check_positive_int(num_features, "num_features")
    q = check_tensor(q, "q", min_dim=1)
    k = check_tensor(k, "k", min_dim=1, last_dim=q.shape[-1])
    d = q.shape[-1]
    opt = optimal_rank_error(q.reshape(-1, d), k.reshape(-1, d), degree, num_features)
    return opt.relative**2


def based_factors(projection: torch.Tensor) -> torch.Tensor:
    """LLoPS factors that recover BASED's quadratic map ``ψ2(Wx)`` exactly (Eq. 20).

    With ``W = projection`` of shape (D', D), feature ``(a, b)`` (a, b < D') uses
    ``Θ_1[:, (a,b)] = W_a`` and ``Θ_2[:, (a,b)] = W_b`` (``Θ_1ᵀ = W ⊙col 1``,
    ``Θ_2ᵀ = 1 ⊙col W``), so ``(xΘ_1)_{ab} (xΘ_2)_{ab} = (Wx)_a (Wx)_b = ψ2(Wx)_{ab}`` and
    ``φ(x)·φ(y) = ((Wx)·(Wy))²``.

    Returns: (1, 2, D, D'²), i.e. (rank, degree, D, F) for ``LLoPS(D, degree=2,
    num_features=D'**2).set_factors_(...)``.
    """
    w = check_tensor(projection, "projection", min_dim=2)
    if w.dim() != 2:
        raise ValueError(f"projection must have shape (D', D), got {tuple(w.shape)}")
    d_out, d_in = w.shape
    theta1 = w.T.repeat_interleave(d_out, dim=1)  # column a*D'+b holds W_a
    theta2 = w.T.repeat(1, d_out)  # column a*D'+b holds W_b
    return torch.stack([theta1, theta2]).reshape(1, 2, d_in, d_out * d_out)


@register("llops")
class LLoPS(FeatureMap):
    """Learnable Low-Rank Polynomial Sketch (LLoPS paper Def. 3.3, Eq. 13–17).

    ``φQ(x) = Σ_r ∏_j x Θ^Q_{j,r}`` and ``φK(y) = Σ_r ∏_j y Θ^K_{j,r}``, with CP rank
    t = ``rank`` and p = ``degree`` factors Θ_{j,r} ∈ R^{D×F} per map (Eq. 14, 15).
    Shapes: x (..., D) -> (..., F), F = ``num_features`` (m in the paper).

    ``target_kernel`` is the polynomial kernel the map is trained to imitate:
    ``(x·y)^p``, or ``(x·y)^{2p}`` when ``square`` (scores ``(φQ·φK)²``: the self-tensoring
    of PolySketchFormer §2.1; effective features φ⊗φ, never materialised) or
    ``elementwise_square`` (features ``(∏_j xΘ_j)^{*2}``, §3.2's formula for a non-negative
    LLoPS: each of the F features squared, so the state keeps F features). ``kind`` is
    "learned": φ approximates, it is not an estimator, except at ``init="sketch"`` without
    either square, where it is an unbiased random sketch.

    Args:
        dim: D, the input dimension.
        degree: p ≥ 1. num_features: F ≥ 1 (default 2·D). rank: t ≥ 1 (paper: t = 1).
        square: score ``(φQ·φK)²`` (non-negative; target degree 2p; F² state features).
        elementwise_square: features ``φ_f(x)²`` (§3.2: "apply another square to the feature
            map, φQ(Q) = (∏_j QΘ_j)^{*2}", *p being the element-wise power of Eq. 6): scores
            ``Σ_f φ_f(q)² φ_f(k)² ≥ 0``, target degree 2p, F state features. Not with
            ``square``; there is no closed-form start for it (``init="monomial"`` and
            ``init_from_data_`` refuse it; ``fit(init="current")`` trains it).
        shared: one set of factors for queries and keys (φQ = φK).
        init: ``"sketch"``: Θ_{j,r} i.i.d. N(0, (F·t)^{-1/p}) entries, the same draw for Q
            and K — a Gaussian product sketch with ``E[φQ(x)·φK(y)] = (x·y)^p``, since
            ``E[∏_j (x·g_j)(y·g_j)] = (x·y)^p`` for independent g_j ~ N(0, I) and the F·t
            terms average; ``"random"``: independent draws of the same size for Q and K
            (the paper does not fix an init; this starts from E[φQ·φK] = 0);
            ``"monomial"``: the exact degree-p kernel of a random s-dimensional projection,
            ``φQ(x)·φK(y) = (Aᵀx·Aᵀy)^p`` with A = Gᵀ/√s (G an (s, D) orthogonal Gaussian
            draw, so E[AAᵀ] = I) through its C(s + p − 1, p) monomials (``init_from_data_``'s
            construction without data; s the largest rank that fits in F; the other columns
            get the sketch draw × 1e-2). Unlike the sketch draw, whose variance
            ‖x‖^{2p}‖y‖^{2p}/F dwarfs (x·y)^p at p = 4 so that half the scores and
            normalizers of a freshly built model are negative, this start is a positive
            semi-definite kernel with non-negative scores for even p: BASED's start (Eq. 20,
            §4.2) generalised to any p. Use it to train LLoPS inside a model.
        seed, generator: make the initial draw reproducible (``make_generator``).

    Parameters: ``theta_q`` (and ``theta_k`` unless ``shared``), shape (t, p, D, F), stored
    float32 and cast to the input's compute dtype at use.
    """

    kind = "learned"
    is_random = False
    family = "polynomial"
    hyperparameters = {
        "degree": Hyperparameter(2, "p >= 1, factors per feature (target degree p, 2p squared)"),
        "num_features": Hyperparameter(None, "F >= 1 (None: 2·D)"),
        "rank": Hyperparameter(1, "t >= 1, the CP rank of each feature"),
        "square": Hyperparameter(False, "score (φQ·φK)², target (x·y)^{2p}"),
        "elementwise_square": Hyperparameter(False, "features φ_f², target (x·y)^{2p}, F state"),
        "shared": Hyperparameter(False, "one set of factors for queries and keys"),
        "init": Hyperparameter("sketch", "'sketch', 'random' or 'monomial' start"),
        "seed": Hyperparameter(None, "seed of the initial draw"),
        "generator": Hyperparameter(None, "torch.Generator for the draw (not with seed)"),
    }
    fit_keywords = frozenset(
        {"degree", "steps", "lr", "batch", "init", "seed", "generator", "progress"}
    )

    def __init__(
        self,
        dim: int,
        *,
        degree: int = 2,
        num_features: int | None = None,
        rank: int = 1,
        square: bool = False,
        elementwise_square: bool = False,
        shared: bool = False,
        init: str = "sketch",
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        if not isinstance(elementwise_square, bool):
            raise TypeError(
                f"elementwise_square must be a bool, got {type(elementwise_square).__name__}"
            )
        if elementwise_square and square:
            raise ValueError("square and elementwise_square are two different squarings; pick one")
        super().__init__(dim, square=square, nonnegative=bool(square) or elementwise_square)
        self.elementwise_square = elementwise_square
        self.degree = check_positive_int(degree, "degree")
        if num_features is None:
            num_features = 2 * self.dim
        self.num_features = check_positive_int(num_features, "num_features")
        self.rank = check_positive_int(rank, "rank")
        if not isinstance(shared, bool):
            raise TypeError(f"shared must be a bool, got {type(shared).__name__}")
        self.shared = shared
        self.init = check_choice(init, "init", ("sketch", "random", "monomial"))
        if elementwise_square and self.init == "monomial":
            raise ValueError(
                'init="monomial" builds (Aᵀx·Aᵀy)^p, which elementwise_square=True does not '
                'keep; use init="sketch" or "random"'
            )
        shape = (self.rank, self.degree, self.dim, self.num_features)
        self.theta_q = nn.Parameter(torch.zeros(shape))
        self.theta_k = None if shared else nn.Parameter(torch.zeros(shape))
        self.reset_parameters(seed=seed, generator=generator)

    @property
    def feature_dim(self) -> int:
        return self.num_features

    @torch.no_grad()
    def reset_parameters(
        self, *, seed: int | None = None, generator: torch.Generator | None = None
    ) -> LLoPS:
        """Redraw Θ as ``init`` says (see the class docstring); returns ``self``."""
        gen = make_generator(seed, generator)
        self._draw(gen)
        if self.init == "monomial":
            s = largest_rank(self.num_features, self.degree, self.dim)
            a = orthogonal_gaussian(s, self.dim, generator=gen).T / s**0.5  # (D, s)
            self._place_monomials(a, a, _SPARE_SCALE)
        return self

    @torch.no_grad()
    def _draw(self, gen: torch.Generator) -> None:
        """Θ_{j,r} i.i.d. N(0, (F·t)^{-1/p}); Θ^K = Θ^Q except at ``init="random"``."""
        shape = tuple(self.theta_q.shape)
        std = (self.num_features * self.rank) ** (-0.5 / self.degree)
        draw_q = gaussian(*shape, generator=gen) * std
        self.theta_q.copy_(draw_q)
        if self.theta_k is not None:
            draw_k = draw_q if self.init != "random" else gaussian(*shape, generator=gen) * std
            self.theta_k.copy_(draw_k)

    @torch.no_grad()
    def _place_monomials(self, a: torch.Tensor, b: torch.Tensor, spare_scale: float) -> None:
        """Columns 0..n−1 of rank slot 0 <- ``monomial_factors`` of A (queries) and B (keys),
        so ``φQ(x)·φK(y) = (Aᵀx·Bᵀy)^p``; every other entry is scaled by ``spare_scale``."""
        for theta, proj in ((self.theta_q, a), (self.theta_k, b)):
            if theta is None:
                continue
            factors = monomial_factors(proj, self.degree).to(theta)  # (p, D, n)
            theta.mul_(spare_scale)
            theta[0, :, :, : factors.shape[-1]] = factors

    @torch.no_grad()
    def set_factors_(self, theta_q: torch.Tensor, theta_k: torch.Tensor | None = None) -> LLoPS:
        """Overwrite the factors: (t, p, D, F) tensors, or (p, D, F) when t = 1.

        ``theta_k=None`` sets the key factors equal to ``theta_q`` (for a non-shared map).
        Used e.g. to start from BASED (``based_factors``), as the paper does in §4.2.
        """
        shape = tuple(self.theta_q.shape)

        def _shaped(t, name):
            t = check_tensor(t, name, min_dim=3)
            if t.dim() == 3:
                t = t.unsqueeze(0)
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{name} must have shape {shape} (t, p, D, F), got {tuple(t.shape)}"
                )
            return check_finite(t, name)

        tq = _shaped(theta_q, "theta_q")
        if self.shared and theta_k is not None:
            raise ValueError("theta_k must be None for a map with shared=True")
        tk = tq if theta_k is None else _shaped(theta_k, "theta_k")
        self.theta_q.copy_(tq)
        if self.theta_k is not None:
            self.theta_k.copy_(tk)
        return self

    @torch.no_grad()
    def init_from_data_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        spare_scale: float = _SPARE_SCALE,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ) -> LLoPS:
        """Closed-form start from sampled queries and keys (``polysketch.features.llops_init``).

        Sets the first n = C(s + p − 1, p) columns of rank slot 0 so that
        ``φQ(q)·φK(k) = (Aᵀq·Bᵀk)^p`` exactly, with s the largest rank whose monomials fit in
        F and (A, B) the Eckart–Young optimum of ``‖QKᵀ − (QA)(KB)ᵀ‖_F`` on the samples (a
        ``shared`` map uses A = B = the top-s principal directions of Q and K together).
        The other columns and rank slots get the ``init`` draw times ``spare_scale`` per
        factor, small but not zero so that ``fit`` can still move them (a product of zero
        factors has zero gradient). With ``square`` the scores (φQ·φK)² then approximate
        (q·k)^{2p} = ``target_kernel``.

        Shapes: q (..., D), k (..., D) (leading dims flattened). Returns ``self``.
        """
        if self.elementwise_square:
            raise ValueError(
                "init_from_data_: the monomial start is exact for the plain and squared maps, "
                "not for elementwise_square=True; fit it with fit(init='current')"
            )
        spare_scale = check_float(spare_scale, "spare_scale", minimum=0.0)
        rank = largest_rank(self.num_features, self.degree, self.dim)
        q, k = flat_finite(q, "q", self.dim), flat_finite(k, "k", self.dim)
        if self.shared:
            a = b = principal_directions(torch.cat([q, k.to(q.dtype)]), rank)
        else:
            a, b = low_rank_bilinear(q, k, rank)
        self._draw(make_generator(seed, generator))  # spare entries: the Gaussian draw, scaled
        self._place_monomials(a, b, spare_scale)
        return self

    def _sketch(self, x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        """Eq. 15: Σ_r ∏_j x Θ_{j,r} (squared when ``elementwise_square``), (..., D) -> (..., F);
        one matmul for all (r, j)."""
        w = rearrange(theta.to(x.dtype), "r j d f -> d (r j f)")
        z = rearrange(x @ w, "... (r j f) -> ... r j f", r=self.rank, j=self.degree)
        # unbind, not z[..., j, :]: each select's backward would fill a zero tensor of z's
        # size (5x slower training at p = 4, F = 256); unbind's backward is one stack
        first, *rest = z.unbind(dim=-2)
        out = first
        for factor in rest:  # p is small; a chain of products, no zero checks
            out = out * factor
        out = out.sum(dim=-2)
        return out * out if self.elementwise_square else out

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self._sketch(x, self.theta_q)

    def _key(self, x: torch.Tensor) -> torch.Tensor:
        return self._sketch(x, self.theta_q if self.theta_k is None else self.theta_k)

    @property
    def target_degree(self) -> int:
        """Degree of ``target_kernel``: p, or 2p when ``square`` or ``elementwise_square``."""
        return 2 * self.degree if self.square or self.elementwise_square else self.degree

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``(x·y)^p``, or ``(x·y)^{2p}`` when ``square`` or ``elementwise_square``.

        Shapes: x (..., Tx, D), y (..., Ty, D) -> (..., Tx, Ty).
        """
        x = check_tensor(x, "x", min_dim=2, last_dim=self.dim)
        y = check_tensor(y, "y", min_dim=2, last_dim=self.dim)
        return (x @ y.transpose(-1, -2)) ** self.target_degree

    def fit(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        degree: int | None = None,
        steps: int = 500,
        lr: float = 1e-2,
        batch: int | None = 1024,
        init: str = "data",
        seed: int | None = None,
        generator: torch.Generator | None = None,
        progress: bool | None = None,
    ) -> list[float]:
        """Calibrate Θ on sampled queries/keys: a closed-form start, then Adam on Eq. 6.

        ``init="data"`` first sets Θ with ``init_from_data_`` on (q, k) (a data-driven
        start far closer to the kernel than a random one); ``"current"`` starts from Θ as
        it is. Then ``steps`` (≥ 0) Adam steps minimise Eq. 6 (see ``fit_kernel``);
        ``degree=None`` imitates ``target_kernel`` ((q·k)^p, or ^{2p} when ``square``).
        Eq. 6 weighs entries by their size, so the steps lower the Frobenius error and may
        raise the relative error (Eq. 21) of small entries. If the steps end with a higher
        Eq. 6 loss than they started from (on up to 2048 of the samples each; from an exact
        or nearly exact start Adam can only add noise), the start is kept.
        Returns the loss history (relative squared Frobenius error per step).
        """
        init = check_choice(init, "init", ("data", "current"))
        steps = check_int(steps, "steps", minimum=0)
        check_float(lr, "lr", minimum=0.0, strict_minimum=True)
        if batch is not None:
            check_positive_int(batch, "batch")
        gen = make_generator(seed, generator)
        if init == "data":
            self.init_from_data_(q, k, generator=gen)
        if steps == 0:
            return []
        check = random_rows(q, k, self.dim, gen)

        def train() -> list[float]:
            return fit_kernel(
                self, q, k, degree=degree, steps=steps, lr=lr, batch=batch, generator=gen,
                progress=progress,
            )  # fmt: skip

        # Adam left a better start (e.g. the exact closed form): keep it, silently
        return keep_start_if_worse(self, lambda: self._fit_loss(*check, degree), train)

    def _fit_loss(self, q: torch.Tensor, k: torch.Tensor, degree: int | None) -> float:
        """Eq. 6, relative, on (q, k): the score ``fit`` keeps the better parameters by."""
        return kernel_loss(self, q, k, degree)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, degree={self.degree}, rank={self.rank}, "
            f"shared={self.shared}, init={self.init!r}"
            + (", elementwise_square=True" if self.elementwise_square else "")
        )
