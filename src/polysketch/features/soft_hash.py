"""Soft hashing: a learned soft assignment of queries and keys to F buckets.

For a head dimension D and F learned directions (the columns of W ∈ R^{D×F}),

    φq(x) = softmax( τ · x W_q / √D ),      φk(x) = softmax( τ · x W_k / √D ),      (1)

each a probability vector over the F buckets, with one learnable temperature τ = exp(log τ)
shared by queries and keys. The score is

    s(q, k) = φq(q) · φk(k) = Σ_f P(q → f) P(k → f),                                  (2)

the probability that q and k land in the same bucket when each draws its bucket from its own
softmax. So 0 < s ≤ 1, and s → 1 only when both put all their mass on one bucket: a key whose
bucket no other key shares is retrieved among t keys with weight s* / Σ_j s_j, which does not
fall as 1/t the way a sketch's does (its floor is the mass the other keys put on q's buckets,
not a variance term). Linear attention with this map has the decode state F × (E + 1) per
head (not squared); F = 1024 is 1.9× ``psf_random``'s 544 pair features.

Why: on the long-context repeat probe (``docs/results/long_context/screens/``), this is the
first linear-time map found that learns to copy a passage 1024 tokens back within the budget
in which softmax and exact degree-4 attention do; the random and learned polynomial sketches,
Hedgehog (up to 1024 features), exact degree 4 on 8-dim q/k and BASED's Taylor map do not.
The init matters for that: W is Gaussian N(0, 1) and τ starts at 4, so on LayerNorm'd inputs
(‖x‖ = √D) the logits x·w_f·τ/√D have standard deviation τ and each softmax starts peaked
on a few buckets (Hedgehog's semi-orthogonal W starts near the uniform distribution when F ≫
D, and learned nothing on the probe).

**Product buckets** (``factors = m > 1``, F = B^m): m soft hashes of B buckets each, with
their own directions W = [W_1 … W_m] ∈ R^{D×mB}, and a query or key lands in the bucket
(f_1, …, f_m) of the product:

    φ(x) = φ_1(x) ⊗ … ⊗ φ_m(x),     φ_i(x) = softmax( τ · x W_i / √D ) ∈ Δ^B,              (3)

flattened with f_1 slowest (the Kronecker product), so that

    s(q, k) = Π_i φq_i(q) · φk_i(k)                                                       (4)

is the probability that q and k collide in all m hashes: LSH's AND-construction. The features
and the decode state keep F = B^m entries, but the projection is D × mB instead of D × F
(64 × 46 instead of 64 × 529 for B = 23, m = 2), and F = B^m buckets cost only m·B softmax
entries per token. ``factors=1`` is (1)–(2).

**Unit directions** (``unit_directions=True``): every bucket direction is rescaled to the
norm √D of a LayerNorm'd input before use, w_f ← √D · w_f / ‖w_f‖ (in the forward, so it
holds while W trains), and the logits τ · x·w_f / √D = τ ‖x‖ cos(x, w_f) depend on the
directions only. Gaussian columns have norms √D ± 9 %; a bucket with a longer column wins
more inputs, so the buckets are unevenly filled and unrelated keys collide more often than
1/F. Equal norms make the buckets equally likely on isotropic inputs, which is what the
exact-match weight s* / Σ_j s_j of a key among t others depends on (measured:
``docs/results/implementation_choices.md``).

**Temperature rate** (``temperature_rate = r``, default 1): τ = exp(r·θ), with θ the stored
parameter ``log_temperature`` (= log τ / r). Adam moves a parameter by about its learning
rate per step whatever the gradient's size, so with r = 1 log τ moves by ≤ lr per step. With
r > 1 the model can sharpen its buckets once they are useful while starting soft enough to
learn (what τ did in the copy runs: ``docs/results/implementation_choices.md``).

**A linear term** (``linear_weight = α > 0``): D + 1 more features, the same for queries and
keys, √(α/2) · (1, x/‖x‖), appended to the buckets', so that the score becomes

    s(q, k) = s_hash(q, k) + α (1 + cos(q, k)) / 2,                                       (5)

still ≥ 0 (cos ≥ −1). Why: a sharp soft hash passes almost no gradient between a query and a
key that share no bucket. With logits of standard deviation τ (LayerNorm'd x, equal-norm
directions), φq puts its mass on the few buckets nearest q, where an unrelated key's
logits are typical (≈ 0 standard deviations) and its largest ≈ 3.4 (F = 1,920), so its
probabilities there are about e^{−3.4τ} of its largest, and ∂s_hash/∂q carries no pull towards a
key that is not already near q; learning to retrieve waits for a chance collision. The
linear term's
gradient ∂s/∂q = (α/2) ∂cos(q, k)/∂q points at every key, as softmax's exp(q·k/√D) does near
init (≈ 1 + q·k/√D). Its cost is retrieval: each unrelated key adds ≈ α/2 to the normalizer
against the hash's 1/F on average, so α = 0.1/F gives the linear term about 5 % of an
unrelated key's score. Off by default; what it costs and gains in retrieval is measured in
``docs/results/long_context/soft_hash_local/``.

**A floor under the linear term** (``linear_offset = c ≥ 1``, default 1): the D + 1 features
become √(α/(1 + c)) · (√c, x/‖x‖), and the score

    s(q, k) = s_hash(q, k) + α (c + cos(q, k)) / (1 + c)  ≥  α (c − 1) / (1 + c),        (6)

equal to (5) at c = 1, with the same largest linear score α (at cos = 1). With c = 1 the
linear term vanishes where q is anti-parallel to k, so it puts no floor under a key the query
has turned away from; with c > 1 every key keeps a score of at least α (c − 1)/(1 + c). Off
(c = 1) by default; what it changes in the copy probe is in
``docs/results/long_context/grid/``.

**Informative buckets** (``bucket_balance = β > 0``, training only): a regularizer on how
much a bucket says about which token of the sequence it holds. For the T rows p_t = φ(x_t) of
one sequence (the buckets only, not the linear term), with ū = (1/T) Σ_t p_t the buckets'
usage,

    I = H(ū) − (1/T) Σ_t H(p_t),        L_bal = β (log F − I) ∈ [0, β log F],            (7)

I being the mutual information between a token drawn from the sequence and its bucket. It is
largest (log F) when every token is sure of its bucket and the buckets are used equally, and 0
both when all tokens share one distribution (the collapse onto one bucket that
``docs/results/long_context/mqar_screen256/`` diagnoses in the heads that fail to retrieve)
and when every distribution is uniform, so that the loss cannot be met by softening τ (it
rewards sharpening instead; what that did on MQAR: ``docs/results/implementation_choices.md``;
no preset uses it). Queries
and keys each add their L_bal (per head and per sequence, averaged over the batch); it changes
no output: ``polysketch._auxiliary.add_auxiliary_loss`` back-propagates it beside the features
whenever autograd records them (so under ``torch.no_grad`` it costs nothing). It is computed
over the tokens the map sees in one call (a rank's shard under context parallelism; padded
positions count). Off (β = 0) by default.

**Even usage** (``bucket_balance_form = "usage"``): the balance on the usage alone,

    L_use = β (log F − H(ū)) = β KL(ū ‖ U) ∈ [0, β log F],                                (8)

0 when the sequence's tokens spread evenly over the buckets, whatever each token's own
sharpness. It penalizes the collapse onto few buckets as (7) does, without rewarding sure
tokens; unlike (7) it can be met by softening every token towards uniform, so it is meant
with ``bucket_balance_temperature=False``: the balance's gradient then reaches the bucket
directions W and the inputs x (and through x the layers below) but not this map's τ (as if its
logits used τ detached), so that τ learns from the model's loss alone. That flag applies to
(7) too (the sharpening measured there came through τ). Eq. 8 costs no second softmax nor
x W product: ``usage_gradient`` gives its gradient from the features already made, joined
to theirs before their softmax's backward, and takes back what would reach τ. With
``bucket_balance_inputs=False`` the balance's logits also use x detached: its gradient then
reaches W alone (and τ unless held out), so it cannot make the layers below widen each
token's buckets, which is how (8) at β = 0.01 delayed the copy probe's onset (measured in
``docs/results/long_context/README.md`` section 5); with one factor that costs one xᵀg
product (``usage_direction_surrogate``: g the deficit's gradient in the logits, from φ).
The map attaches these gradients to φ's backward as they are (``attach_usage_balance``,
``polysketch._auxiliary.add_auxiliary_gradient``), not through a loss to differentiate:
under the cores' recomputation (``torch.utils.checkpoint``) the balance is then computed
once, in the first forward, not again in the backward's rerun.

The target kernel is the map's own (2) or (4) (plus the linear term of (5)–(6)), computed in
log space as ``Π_i exp(logsumexp_f(log φq_i + log φk_i))`` (no feature map is imitated; ``family =
"own"``). Parameters: ``weight_q`` (D, m·B), ``weight_k`` (D, m·B) unless ``shared`` (both
start from the same draw), ``log_temperature`` (a scalar θ = log τ / r, a buffer when
``learn_temperature=False``); stored float32, cast to the input's compute dtype at use.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .._auxiliary import add_auxiliary_gradient, add_auxiliary_loss, replaying
from .._checks import check_float, check_positive_int, check_tensor
from ..random import gaussian, make_generator
from .base import FeatureMap, Hyperparameter, register

__all__ = [
    "BALANCE_FORMS", "SoftHashFeatureMap", "information_deficit", "product_softmax",
    "attach_usage_balance", "unit_directions", "usage_deficit", "usage_direction_surrogate",
    "usage_gradient", "usage_surrogate",
]  # fmt: skip


def product_softmax(logits: torch.Tensor, factors: int) -> torch.Tensor:
    """φ_1 ⊗ … ⊗ φ_m (Eq. 3) of logits (..., m·B), φ_i = softmax of the i-th B: -> (..., B^m),
    f_1 slowest; ``factors=1``: the plain softmax (Eq. 1)."""
    if factors == 1:
        return logits.softmax(-1)
    parts = logits.unflatten(-1, (factors, -1)).softmax(-1).unbind(-2)
    phi = parts[0]
    for p in parts[1:]:  # (..., F_so_far) ⊗ (..., B) -> (..., F_so_far · B)
        phi = (phi.unsqueeze(-1) * p.unsqueeze(-2)).flatten(-2)
    return phi


def _entropy(p: torch.Tensor, dims=-1) -> torch.Tensor:
    """−Σ p log p over ``dims``, with log p as log(max(p, tiny)), not log_softmax: its backward
    (and exp(log p)) calls torch's exp on arguments below −87 for sharp buckets, which on a
    CPU takes a path ~100× slower than softmax's own exponentials; p log p is the same where
    p ≥ tiny, 0 below."""
    return -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(dims)


def information_deficit(logits: torch.Tensor, factors: int) -> torch.Tensor:
    """log F − I of Eq. 7 for the bucket logits (..., T, m·B) of sequences of T tokens: -> (...,),
    in float32; F = B^m and the rows are the product distributions of Eq. 3."""
    logits = logits.float()
    p = logits.unflatten(-1, (factors, -1)).softmax(-1)  # (..., T, m, B)
    token_entropy = _entropy(p, (-1, -2)).mean(-1)  # mean over t of Σ_i H(φ_i)
    joint = p.squeeze(-2) if factors == 1 else product_softmax(logits, factors)  # (..., T, F)
    usage = joint.mean(-2)  # ū: (..., F)
    return math.log(usage.shape[-1]) - (_entropy(usage) - token_entropy)


def usage_deficit(logits: torch.Tensor, factors: int) -> torch.Tensor:
    """log F − H(ū) = KL(ū ‖ U) of Eq. 8 for the bucket logits (..., T, m·B) of sequences of T
    tokens: -> (...,), in float32; ū the mean over T of the product distributions of Eq. 3."""
    usage = product_softmax(logits.float(), factors).mean(-2)  # (..., F)
    return math.log(usage.shape[-1]) - _entropy(usage)


BALANCE_FORMS = {"information": information_deficit, "usage": usage_deficit}
"""``bucket_balance_form`` -> its deficit: Eq. 7's log F − I, or Eq. 8's log F − H(ū)."""


def _usage_slope(usage: torch.Tensor) -> torch.Tensor:
    """h_f = ∂(Σ_f ū_f log ū_f)/∂ū_f = log ū_f + 1 as ``_entropy`` differentiates it: log
    max(ū_f, tiny), + 1 where ū_f > tiny."""
    tiny = torch.finfo(usage.dtype).tiny
    return usage.clamp_min(tiny).log() + (usage > tiny).to(usage.dtype)


def usage_gradient(
    phi: torch.Tensor, logits: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eq. 8's gradient per sequence, from the features φ = softmax(z) (..., T, F) a map has
    already made: -> (g_φ (..., 1, F), g_s (...,) or None), in float32 (float64 for float64
    features), detached.

    With ū = (1/T) Σ_t φ_t and h_f = ∂(Σ_f ū_f log ū_f)/∂ū_f = log ū_f + 1 (as ``_entropy``
    differentiates it: log max(ū_f, tiny), + 1 where ū_f > tiny), log F − H(ū) has the gradient
    g_φ = h_f / T at every φ_tf (the same for every t); joined to the features' own gradient
    it crosses their softmax and the x W product once, where ``usage_deficit(z)`` makes the
    softmax and its backward again (and, with τ held out, one more x W product and the two of
    its backward).

    ``scale``: the s of z = s·u (τ/√D, per sequence or broadcastable to (...,)) whose gradient
    the balance must not reach (``bucket_balance_temperature=False``); only for F buckets of
    one factor (φ the plain softmax of z). g_s = −∂/∂s of what g_φ gives s, the correction that
    takes it back: s·∂/∂s = Σ_tf z_tf g_tf, g_tf = φ_tf (h_f − c_t) / T the gradient in z and
    c_t = Σ_f φ_tf h_f (∂φ_tf/∂z_tf' = φ_tf(δ_ff' − φ_tf')), summed without forming g."""
    p = phi.detach().to(torch.promote_types(phi.dtype, torch.float32))
    tokens = p.shape[-2]
    h = _usage_slope(p.sum(-2) / tokens)  # (..., F)
    g_phi = (h / tokens).unsqueeze(-2)
    if scale is None:
        return g_phi, None
    per_token = torch.einsum("...tf,...f->...t", p, h)  # c_t (einsum: not bmm's slow matvec)
    weighted = logits.detach().to(p.dtype) * p  # z_tf φ_tf
    spread = torch.einsum("...tf,...f->...t", weighted, h) - per_token * weighted.sum(-1)
    d_scale = spread.sum(-1) / tokens  # s · ∂S/∂s = Σ_tf z_tf g_tf
    return g_phi, -d_scale / scale.detach().to(p.dtype)


def usage_surrogate(
    phi: torch.Tensor, logits: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """A stand-in for Eq. 8's deficit with its gradient (``usage_gradient``), as a loss:
    S = Σ_tf φ_tf sg(h_f / T) (+ s·sg(g_s) with ``scale`` held) -> (...,) per sequence, in
    float32 (float64 for float64 features). Its value is not the deficit's (it only carries
    the gradient). The maps attach the gradient itself (``attach_usage_balance``)."""
    g_phi, g_s = usage_gradient(phi, logits, scale)
    surrogate = (phi.to(g_phi.dtype) * g_phi).sum((-1, -2))
    return surrogate if g_s is None else surrogate + g_s * scale.to(g_s.dtype)


def _direction_slope(phi: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """xᵀg (..., D, F) for logits of one factor, g_tf = φ_tf (h_f − c_t) / T the gradient of
    Eq. 8's deficit in them (``usage_gradient``): (xᵀφ ∘ h − (c ∘ x)ᵀφ) / T, one product of
    [x, c ∘ x] (T × 2D) with φ; float32 (float64 for float64 features), detached."""
    p = phi.detach().to(torch.promote_types(phi.dtype, torch.float32))
    tokens, dim = p.shape[-2], x.shape[-1]
    h = _usage_slope(p.mean(-2))  # (..., F)
    per_token = torch.einsum("...tf,...f->...t", p, h)  # c_t
    xs = x.detach().to(p.dtype)
    both = torch.cat([xs, xs * per_token.unsqueeze(-1)], dim=-1).transpose(-1, -2) @ p
    return (both[..., :dim, :] * h.unsqueeze(-2) - both[..., dim:, :]) / tokens


def usage_direction_surrogate(
    phi: torch.Tensor, x: torch.Tensor, directions: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """A stand-in for Eq. 8's deficit whose gradient reaches the bucket directions (and the
    scale) but not the inputs (``bucket_balance_inputs=False``), for logits z = s · x W of one
    factor and their features φ = softmax(z) (..., T, F): -> (...,) per sequence, in float32
    (float64 for float64 features).

    With g_tf = ∂(log F − H(ū))/∂z_tf = φ_tf (h_f − c_t) / T (h and c as in
    ``usage_gradient``) and x held, the deficit's gradient is s xᵀg at W and Σ_tf g_tf
    (x W)_tf at s, both those of S = s Σ_df W_df sg(xᵀg)_df. xᵀg = (xᵀφ ∘ h − (c ∘ x)ᵀφ) / T
    (h scales xᵀφ's columns, c x's rows) is one product of [x, c ∘ x] (T × 2D) with φ: φ is
    read three times (ū, c, the product) and no T × F array is written, where the deficit
    recomputed from x detached costs the x W product, its softmax, and both again in its
    backward. ``directions``: W (D, F) or broadcastable per head (H, D, F); ``scale``: s
    broadcastable to (...,), detached by the caller when τ is held out. Its value is not the
    deficit's (it only carries the gradient). The maps attach the gradient itself
    (``attach_usage_balance``)."""
    slope = _direction_slope(phi, x)
    return scale.to(slope.dtype) * (slope * directions.to(slope.dtype)).sum((-1, -2))


def _total(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """g (..., *like.shape) summed over its leading (per-sequence) dims: like's gradient."""
    lead = g.dim() - like.dim()
    return g.sum(tuple(range(lead))) if lead else g


def attach_usage_balance(
    phi: torch.Tensor,
    x: torch.Tensor,
    logits: torch.Tensor,
    directions: torch.Tensor,
    scale: torch.Tensor,
    weight: float,
    *,
    inputs: bool,
    through_scale: bool,
) -> torch.Tensor:
    """φ (..., T, F) itself, with the gradient of weight · Σ_seq (log F − H(ū)) (Eq. 8, one
    sequence per leading index) attached to its backward (``add_auxiliary_gradient``): the
    gradients of ``weight`` times the sum over sequences of ``usage_surrogate`` (``inputs``:
    through φ, so into x, W and s) or of ``usage_direction_surrogate`` (not ``inputs``: into
    W and s only), without a surrogate loss to differentiate, so that a checkpoint's rerun
    may leave the balance out (``_auxiliary.replaying``). ``directions`` W (D, F) or (H, D, F)
    and ``scale`` s (0-d, or (H,) per head) are the tensors the logits z = s · x W were made
    from; ``through_scale`` False: s gets none of it (τ held out; one factor)."""
    if inputs:
        g_phi, g_s = usage_gradient(phi, logits, None if through_scale else scale)
        held = () if g_s is None else ((scale, _total(weight * g_s, scale)),)
        return add_auxiliary_gradient(phi, weight * g_phi, held)
    slope = weight * _direction_slope(phi, x)  # (..., D, F), each sequence's xᵀg
    s = scale.detach().to(slope.dtype)
    grads = [(directions, _total(s[..., None, None] * slope, directions))]
    if through_scale:
        per_seq = (slope * directions.detach().to(slope.dtype)).sum((-1, -2))
        grads.append((scale, _total(per_seq, scale)))
    return add_auxiliary_gradient(phi, None, tuple(grads))


def unit_directions(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Every column of W (..., D, m·B) rescaled to norm √D: √D · w_f / ‖w_f‖."""
    return w * (math.sqrt(dim) / w.norm(dim=-2, keepdim=True).clamp_min(1e-12))


def _root(f: int, m: int) -> int:
    """B with B^m = f and B >= 2, or a ValueError naming num_features."""
    b = round(f ** (1.0 / m))
    for cand in (b - 1, b, b + 1):
        if cand >= 2 and cand**m == f:
            return cand
    raise ValueError(
        f"num_features={f} must be B**factors for an integer B >= 2 (factors={m}), e.g. "
        f"{max(2, b) ** m}"
    )


@register("soft_hash")
class SoftHashFeatureMap(FeatureMap):
    """φ(x) = softmax(τ · x W / √D) over F learned buckets (module docstring, Eqs. 1–2).

    Args:
        dim: D. num_features: F ≥ 2, the number of buckets (default 4D).
        temperature: τ's initial value, > 0 (default 4).
        factors: m ≥ 1; with m > 1 the buckets are the product of m soft hashes of B buckets
            each (Eqs. 3–4), and num_features must be B^m for an integer B ≥ 2.
        learn_temperature: τ is trained (a parameter) or fixed (a buffer).
        shared: one W for queries and keys (a symmetric kernel); default separate W_q, W_k.
        linear_weight: α ≥ 0; α > 0 appends the D + 1 features √(α/2)·(1, x/‖x‖) (Eq. 5), so
            the score gains α(1 + cos(q, k))/2 and F grows to F + D + 1.
        linear_offset: c ≥ 1 (with linear_weight > 0): the linear features are
            √(α/(1 + c))·(√c, x/‖x‖) and the score gains α(c + cos(q, k))/(1 + c) ≥
            α(c − 1)/(1 + c) (Eq. 6); c = 1 (default) is Eq. 5.
        bucket_balance: β ≥ 0; β > 0 back-propagates the training-only loss β(log F − I) of
            Eq. 7 for queries and for keys (the features' values do not change).
        bucket_balance_form: ``"information"`` (Eq. 7, default) or ``"usage"`` (Eq. 8:
            β KL(ū ‖ U), the buckets' usage alone).
        bucket_balance_temperature: the balance's gradient reaches τ (default True); False
            computes its logits with τ detached (the directions and inputs still learn from it).
        bucket_balance_inputs: the balance's gradient reaches the inputs x, and through them
            the layers below (default True); False computes its logits from x detached.
        output_scale: a constant c > 0 multiplying the features (scores × c², so 0 < s ≤ c²).
            Normalized linear attention does not depend on it; in mixed attention
            (``mixed=True``) it weighs the far blocks against the exact local ones, and with
            ``learn_balance=True`` it becomes the learned balance's start (β₀ = 2 ln c).
        seed, generator: the Gaussian draw of W.
    """

    kind = "learned"
    is_random = False
    family = "own"
    hyperparameters = {
        "num_features": Hyperparameter(None, "F >= 2, the number of buckets (None: 4D)"),
        "temperature": Hyperparameter(4.0, "initial τ > 0 of softmax(τ·xW/√D)"),
        "factors": Hyperparameter(1, "m >= 1: F = B^m product buckets of m soft hashes"),
        "learn_temperature": Hyperparameter(True, "τ is a parameter (else a buffer)"),
        "shared": Hyperparameter(False, "one W for queries and keys"),
        "output_scale": Hyperparameter(1.0, "c > 0 multiplying the features (scores × c²)"),
        "unit_directions": Hyperparameter(False, "rescale each bucket direction to norm √D"),
        "temperature_rate": Hyperparameter(1.0, "r > 0: τ = exp(r·θ), θ the stored parameter"),
        "linear_weight": Hyperparameter(0.0, "α >= 0: the score gains α(1 + cos(q, k))/2"),
        "linear_offset": Hyperparameter(1.0, "c >= 1: the linear score is α(c + cos)/(1 + c)"),
        "bucket_balance": Hyperparameter(0.0, "β >= 0: training loss β(log F − I(token; bucket))"),
        "bucket_balance_form": Hyperparameter(
            "information", "the balance's deficit: 'information' (log F − I) or 'usage' (KL(ū‖U))"
        ),
        "bucket_balance_temperature": Hyperparameter(True, "the balance's gradient reaches τ"),
        "bucket_balance_inputs": Hyperparameter(True, "the balance's gradient reaches x"),
        "seed": Hyperparameter(None, "seed of the Gaussian draw of W"),
        "generator": Hyperparameter(None, "torch.Generator for W (not with seed)"),
    }

    def __init__(
        self,
        dim: int,
        *,
        num_features: int | None = None,
        temperature: float = 4.0,
        factors: int = 1,
        learn_temperature: bool = True,
        shared: bool = False,
        output_scale: float = 1.0,
        unit_directions: bool = False,
        temperature_rate: float = 1.0,
        linear_weight: float = 0.0,
        linear_offset: float = 1.0,
        bucket_balance: float = 0.0,
        bucket_balance_form: str = "information",
        bucket_balance_temperature: bool = True,
        bucket_balance_inputs: bool = True,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ):
        super().__init__(dim, square=False, nonnegative=True)
        self.num_features = check_positive_int(
            4 * self.dim if num_features is None else num_features, "num_features"
        )
        if self.num_features < 2:
            raise ValueError(f"num_features must be >= 2 buckets, got {self.num_features}")
        self.factors = check_positive_int(factors, "factors")
        self.buckets = _root(self.num_features, self.factors)  # B: F = B^m
        temperature = check_float(temperature, "temperature", minimum=0.0, strict_minimum=True)
        flags = (("learn_temperature", learn_temperature), ("shared", shared),
                 ("unit_directions", unit_directions),
                 ("bucket_balance_temperature", bucket_balance_temperature),
                 ("bucket_balance_inputs", bucket_balance_inputs))  # fmt: skip
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.shared, self.unit_directions = shared, unit_directions
        self.output_scale = check_float(
            output_scale, "output_scale", minimum=0.0, strict_minimum=True
        )
        columns = self.factors * self.buckets  # [W_1 … W_m], each D × B
        w = gaussian(self.dim, columns, generator=make_generator(seed, generator))
        self.weight_q = nn.Parameter(w.float().clone())
        self.weight_k = None if shared else nn.Parameter(w.float().clone())
        self.temperature_rate = check_float(
            temperature_rate, "temperature_rate", minimum=0.0, strict_minimum=True
        )
        self.linear_weight = check_float(linear_weight, "linear_weight", minimum=0.0)
        self.linear_offset = check_float(linear_offset, "linear_offset", minimum=1.0)
        self.bucket_balance = check_float(bucket_balance, "bucket_balance", minimum=0.0)
        if bucket_balance_form not in BALANCE_FORMS:
            raise ValueError(f"bucket_balance_form must be one of {sorted(BALANCE_FORMS)}, got "
                             f"{bucket_balance_form!r}")  # fmt: skip
        self.bucket_balance_form = bucket_balance_form
        self.bucket_balance_temperature = bucket_balance_temperature
        self.bucket_balance_inputs = bucket_balance_inputs
        if self.linear_offset != 1 and not self.linear_weight:
            raise ValueError("linear_offset needs linear_weight > 0 (it shapes the linear term)")
        log_t = torch.tensor(math.log(temperature) / self.temperature_rate, dtype=torch.float32)
        if learn_temperature:
            self.log_temperature = nn.Parameter(log_t)
        else:
            self.register_buffer("log_temperature", log_t)

    @property
    def feature_dim(self) -> int:
        """F buckets, plus D + 1 linear features when ``linear_weight`` > 0 (Eq. 5)."""
        return self.num_features + (self.dim + 1 if self.linear_weight else 0)

    @property
    def temperature(self) -> float:
        """τ = exp(r·θ), the current temperature (θ = ``log_temperature``, r its rate)."""
        return float((self.log_temperature.detach() * self.temperature_rate).exp())

    def _logit_scale(self) -> torch.Tensor:
        """τ / √D, the scale of the logits (a differentiable scalar tensor)."""
        return (self.log_temperature * self.temperature_rate).exp() / math.sqrt(self.dim)

    @property
    def balance_reuses_features(self) -> bool:
        """The balance is computed from the features themselves (``attach_usage_balance``): Eq.
        8's gradient at φ (``usage_gradient``: reaching x; τ reached, or held out with one
        factor) or, with the inputs held out and one factor, at W (``usage_direction_surrogate``'s
        xᵀg)."""
        if self.bucket_balance_form != "usage":
            return False
        return self.factors == 1 or (self.bucket_balance_inputs and self.bucket_balance_temperature)

    def _directions(self, key: bool) -> torch.Tensor:
        """W (D, m·B): the key weights for keys unless shared, each column to norm √D when
        ``unit_directions``."""
        w = self.weight_k if key and not self.shared else self.weight_q
        return unit_directions(w, self.dim) if self.unit_directions else w

    def _logits(self, x: torch.Tensor, key: bool, *, learn_tau: bool = True) -> torch.Tensor:
        """τ · x W / √D: (..., D) -> (..., m·B); ``learn_tau=False``: τ detached."""
        scale = self._logit_scale()
        return self._logits_of(x, self._directions(key), scale if learn_tau else scale.detach())

    def _logits_of(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """s · x W for W (D, m·B) and the scale s: W is scaled first (D×mB, not T×mB, products)
        unless x has fewer rows than D (a decoding step)."""
        if x.dim() >= 2 and x.shape[-2] < self.dim:
            return (x @ w.to(x.dtype)) * scale.to(x.dtype)
        return x @ (w * scale).to(x.dtype)

    def _scaled(self, phi: torch.Tensor) -> torch.Tensor:
        return phi if self.output_scale == 1.0 else phi * self.output_scale

    def linear_features(self, x: torch.Tensor) -> torch.Tensor:
        """√(α/(1 + c))·(√c, x/‖x‖), c = ``linear_offset`` (Eqs. 5–6): (..., D) -> (..., D + 1)."""
        c = self.linear_offset
        unit = torch.nn.functional.normalize(x, dim=-1)
        one = torch.full_like(unit[..., :1], math.sqrt(c))
        return torch.cat([one, unit], dim=-1) * math.sqrt(self.linear_weight / (1 + c))

    def _features(self, x: torch.Tensor, key: bool) -> torch.Tensor:
        w, scale = self._directions(key), self._logit_scale()
        logits = self._logits_of(x, w, scale)
        phi = product_softmax(logits, self.factors)
        if self.bucket_balance and x.shape[-2] > 1 and torch.is_grad_enabled():  # Eqs. 7–8
            if self.balance_reuses_features:  # Eq. 8's gradient from φ, attached to it
                if not replaying():  # a checkpoint's rerun: attached in the first run
                    weight = self.bucket_balance / math.prod(phi.shape[:-2])  # the batch mean
                    phi = attach_usage_balance(
                        phi, x, logits, w, scale, weight, inputs=self.bucket_balance_inputs,
                        through_scale=self.bucket_balance_temperature,
                    )  # fmt: skip
            else:
                if not (self.bucket_balance_temperature and self.bucket_balance_inputs):
                    inputs = x if self.bucket_balance_inputs else x.detach()
                    logits = self._logits(inputs, key, learn_tau=self.bucket_balance_temperature)
                deficit = BALANCE_FORMS[self.bucket_balance_form](logits, self.factors)
                phi = add_auxiliary_loss(phi, self.bucket_balance * deficit.mean())
        if self.linear_weight:
            phi = torch.cat([phi, self.linear_features(x).to(phi.dtype)], dim=-1)
        return self._scaled(phi)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        return self._features(x, False)

    def _key(self, x: torch.Tensor) -> torch.Tensor:
        return self._features(x, True)

    def target_kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """c² (Π_i Σ_f P_i(x → f) P_i(y → f) + α(c' + cos(x, y))/(1 + c')) (Eqs. 2, 4 and 5–6
        × output_scale², c' = ``linear_offset``), the product in log space: (..., Tx, D),
        (..., Ty, D) -> (..., Tx, Ty)."""
        x = check_tensor(x, "x", min_dim=2, last_dim=self.dim)
        y = check_tensor(y, "y", min_dim=2, last_dim=self.dim)
        lq = self._logits(x, False).unflatten(-1, (self.factors, self.buckets))
        lk = self._logits(y, True).unflatten(-1, (self.factors, self.buckets))
        log_q = lq.log_softmax(-1).unsqueeze(-3)  # (..., Tx, 1, m, B)
        log_k = lk.log_softmax(-1).unsqueeze(-4)  # (..., 1, Ty, m, B)
        log_s = torch.logsumexp(log_q + log_k, dim=-1).sum(-1)  # Σ_i log P(collide in i)
        s = log_s.exp()
        if self.linear_weight:
            xu = torch.nn.functional.normalize(x, dim=-1)
            yu = torch.nn.functional.normalize(y, dim=-1)
            c = self.linear_offset
            s = s + self.linear_weight * (c + xu @ yu.transpose(-1, -2)) / (1 + c)
        return s * self.output_scale**2

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_features={self.num_features}, factors={self.factors}, "
            f"temperature={self.temperature:.4g}, shared={self.shared}"
            + (", unit_directions=True" if self.unit_directions else "")
            + (
                f", temperature_rate={self.temperature_rate:g}"
                if self.temperature_rate != 1
                else ""
            )
            + (f", linear_weight={self.linear_weight:g}" if self.linear_weight else "")
            + (f", linear_offset={self.linear_offset:g}" if self.linear_offset != 1 else "")
            + (
                f", bucket_balance={self.bucket_balance:g}, "
                f"bucket_balance_form={self.bucket_balance_form!r}, "
                f"bucket_balance_temperature={self.bucket_balance_temperature}, "
                f"bucket_balance_inputs={self.bucket_balance_inputs}"
                if self.bucket_balance
                else ""
            )
        )
