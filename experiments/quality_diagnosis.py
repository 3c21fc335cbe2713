"""Why sketched polynomial attention trains worse than softmax: measurements on trained models.

The argument these functions measure (``docs/quality_gap.md``). PolySketchFormer's random
attention scores are s_ij = (φ(q_i)·φ(k_j))², φ an unbiased degree-2 sketch of size r. Since
E[φq·φk] = (q·k)², squaring gives

    E[s_ij] = (q_i·k_j)^4 + Var[φ(q_i)·φ(k_j)],

and for Gaussian sketches the variance is, to first order, ‖q‖⁴‖k‖⁴/r (the one-node
``product`` form: exactly ((‖q‖²‖k‖² + 2(q·k)²)² − (q·k)⁴)/r; Ahle et al.'s tree adds the
leaves' variance on top). With the q/k LayerNorm every ‖q‖, ‖k‖ is about √D, so the bias is
a *floor* the same for every key: in units of ‖q‖⁴‖k‖⁴ a key at angle θ gets
cos⁴θ + ≈1/r instead of cos⁴θ. At position t the floor sums to ≈ t/r against at most 1 for
the best-matching key, so beyond t ≈ r the sketched attention is mostly a uniform average of
the prefix — a limit no amount of training removes (scaling q or k scales both terms).

* ``capture_qkv`` (``polysketch.eval.fidelity.capture``) records the (q, k, v) each layer's
  attention core receives.
* ``layer_errors`` runs exact polynomial attention and sketched variants on the same
  (q, k, v) (teacher forcing: every layer gets the exact model's inputs) and reports the
  relative output error, the floor share (the part of the sketch's normalizer that is bias,
  Σ_j (E s_ij − (q·k)⁴) / Σ_j E s_ij, from the mean over draws) and row entropies.
* ``kernel_errors`` gives the relative Frobenius error of the (q·k)⁴ estimate against r, D
  and the projection (captured or LayerNorm'd Gaussian vectors).
* ``swap_loss`` evaluates trained weights with the attention core swapped (e.g. a model
  trained with exact polynomial attention, run with the sketch) — the loss the sketch alone
  costs, with no training dynamics involved.
* ``learned_sketch_stats`` / ``grad_norms``: the learned sketch's scale before squaring, its
  tanh saturation, the normalizer share of the offset 1 and gradient norms per module.
* ``normalizer_sign_stats``: for maps with signed scores (``llops`` without ``square``), the
  share of negative scores and normalizers and how much of Σ|s| cancels in Σ s. A row whose
  normalizer offset + Σ_j s_ij is near zero divides its output by almost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from polysketch.eval.fidelity.capture import attention_layers, capture_qkv
from polysketch.features import create
from polysketch.nn.heads import head_seed
from polysketch.ops import linear_attention, polynomial_attention
from polysketch.ops.mixed import mixed_attention

__all__ = [
    "capture_qkv",
    "sketch_features",
    "layer_errors",
    "kernel_errors",
    "swap_loss",
    "sketch_core",
    "debiased_core",
    "learned_sketch_stats",
    "normalizer_sign_stats",
    "grad_norms",
]


def sketch_features(
    q: torch.Tensor, k: torch.Tensor, name: str, seed: int, **kw
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Per-head independent maps ``create(name, D, seed=head_seed(seed, 0, h), **kw)`` applied
    to q, k (B, H, T, D); returns (φq, φk, square)."""
    heads = q.shape[1]
    pq, pk, square = [], [], False
    for h in range(heads):
        fm = create(name, q.shape[-1], seed=head_seed(seed, 0, h), **kw).to(q.dtype)
        pq.append(fm.query(q[:, h]))
        pk.append(fm.key(k[:, h]))
        square = fm.square
    return torch.stack(pq, 1), torch.stack(pk, 1), square


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _row_entropy(s: torch.Tensor, offset: float) -> float:
    """Mean over rows of the entropy of the causal attention weights s / (offset + Σ s),
    divided by log(t) (1 = uniform over the prefix); the offset's share is left out."""
    t = s.shape[-1]
    mask = torch.ones(t, t, dtype=torch.bool, device=s.device).tril()
    s = s.masked_fill(~mask, 0.0).clamp_min(0.0)
    p = s / (offset + s.sum(-1, keepdim=True))
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    norm = torch.log(torch.arange(1, t + 1, dtype=s.dtype, device=s.device)).clamp_min(1e-9)
    return float((ent[..., 1:] / norm[1:]).mean())


@torch.no_grad()
def layer_errors(
    qkv: list[tuple[torch.Tensor, ...]],
    variants: dict[str, dict],
    *,
    degree: int = 4,
    offset: float = 1.0,
    draws: int = 4,
    chunk_size: int = 64,
) -> list[dict]:
    """Per layer and variant: relative error of the attention output against exact degree-
    ``degree`` polynomial attention on the same (q, k, v), mean over ``draws`` seeds; the
    floor share of the normalizer and the row entropies (exact and sketched).

    ``variants``: label -> {"name": map name, "mixed": bool (local exact blocks of
    ``chunk_size``), **map keywords}. Computed in float64.
    """
    rows = []
    for layer, (q, k, v) in enumerate(qkv):
        q, k, v = q.double(), k.double(), v.double()
        exact = polynomial_attention(q, k, v, degree=degree, causal=True, denominator_offset=offset)
        s_exact = (q @ k.transpose(-1, -2)) ** degree
        t = q.shape[-2]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        for label, spec in variants.items():
            kw = {key: val for key, val in spec.items() if key not in ("name", "mixed")}
            errs, mean_s = [], torch.zeros_like(s_exact)
            for d in range(draws):
                pq, pk, square = sketch_features(q, k, spec["name"], 1000 + d, **kw)
                if spec.get("mixed"):
                    out = mixed_attention(
                        q,
                        k,
                        v,
                        pq,
                        pk,
                        chunk_size=chunk_size,
                        local="polynomial",
                        degree=degree,
                        square=square,
                        denominator_offset=offset,
                    )
                else:
                    out = linear_attention(
                        pq, pk, v, causal=True, square=square, denominator_offset=offset
                    )
                errs.append(_rel(out, exact))
                s = pq @ pk.transpose(-1, -2)
                mean_s += (s * s if square else s) / draws
            bias = (mean_s - s_exact).masked_fill(~causal, 0.0)
            total = mean_s.masked_fill(~causal, 0.0)
            s_one = s * s if square else s  # the last draw's scores
            na = float("nan")  # mixed: local scores are exact, the sketch-only stats don't apply
            mixed = bool(spec.get("mixed"))
            rows.append(
                {
                    "layer": layer,
                    "variant": label,
                    "output_rel_error": sum(errs) / len(errs),
                    "floor_share": na
                    if mixed
                    else float(bias.sum(-1).mean() / total.sum(-1).mean()),
                    "entropy_exact": _row_entropy(s_exact, offset),
                    "entropy_sketch": na if mixed else _row_entropy(s_one, offset),
                    "score_rel_error": na
                    if mixed
                    else _rel(s_one.masked_fill(~causal, 0.0), s_exact.masked_fill(~causal, 0.0)),
                }
            )
    return rows


@torch.no_grad()
def kernel_errors(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    projections=("gaussian", "product"),
    sizes=(16, 32, 64, 128),
    draws: int = 10,
    degree: int = 2,
) -> list[dict]:
    """Relative Frobenius error of the self-tensored degree-p sketch (p = ``degree``) against
    (q·k)^{2p} on rows q (N, D), k (M, D) (fp64), per projection and r: mean over ``draws``
    seeds, plus the measured floor: mean over pairs of (E s − (q·k)^{2p}) / (‖q‖^{2p}‖k‖^{2p}/r)
    and the signal-to-floor ratio: mean over rows of max_j (q·k_j)^{2p} / Σ_j floor_j."""
    q, k = q.double(), k.double()
    target = (q @ k.T) ** (2 * degree)
    unit = (q.norm(dim=-1, keepdim=True) ** (2 * degree)) * (k.norm(dim=-1) ** (2 * degree))
    rows = []
    for proj in projections:
        for r in sizes:
            errs, mean = [], torch.zeros_like(target)
            for d in range(draws):
                fm = create(
                    "polysketch",
                    q.shape[-1],
                    num_features=r,
                    projection=proj,
                    nonnegative=True,
                    degree=degree,
                    seed=d,
                )
                est = fm.approx_kernel(q, k)
                errs.append(_rel(est, target))
                mean += est / draws
            rows.append(
                {
                    "projection": proj,
                    "r": r,
                    "dim": q.shape[-1],
                    "degree": 2 * degree,
                    "rel_error": sum(errs) / len(errs),
                    "floor_times_r": float(((mean - target) / unit).mean() * r),
                    "signal_to_floor": float(
                        (target.max(-1).values / (mean - target).sum(-1)).mean()
                    ),
                }
            )
    return rows


@torch.no_grad()
def swap_loss(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    core: Callable | None = None,
) -> float:
    """Mean cross-entropy of ``model`` on ``batches`` with each layer's attention core
    replaced by ``core(layer, q, k, v) -> out`` (None: the model as it is)."""
    layers = attention_layers(model)
    was = model.training
    model.eval()
    try:
        if core is not None:
            for layer in layers:
                layer._attend = (lambda lyr: lambda q, k, v, *a, **kw: core(lyr, q, k, v))(layer)
        losses = [float(model(x, y)[1]) for x, y in batches]
    finally:
        for layer in layers:
            layer.__dict__.pop("_attend", None)
        model.train(was)
    return sum(losses) / len(losses)


def sketch_core(name: str, seed: int = 0, mixed: bool = False, chunk_size: int = 64, **kw):
    """A ``swap_loss`` core running the sketch ``name`` (per-layer, per-head seeds) in place
    of a layer's exact polynomial attention, with the layer's offset (degree 4)."""

    def core(layer, q, k, v):
        pq, pk, square = sketch_features(q, k, name, seed * 1000 + layer.layer_index, **kw)
        if mixed:
            return mixed_attention(
                q,
                k,
                v,
                pq,
                pk,
                chunk_size=chunk_size,
                local="polynomial",
                degree=4,
                square=square,
                denominator_offset=layer.denominator_offset,
            )
        return linear_attention(
            pq, pk, v, causal=True, square=square, denominator_offset=layer.denominator_offset
        )

    return core


def debiased_core(beta: float, num_features: int = 32, projection: str = "gaussian"):
    """A quadratic-time ``swap_loss`` core: squared-sketch scores minus β·‖q‖⁴‖k‖⁴/r (the
    floor's rank-1 part, computable in linear time too), causal, normalizer offset + Σ.
    The scores are signed; this measures whether removing the floor's mean helps."""

    def core(layer, q, k, v):
        pq, pk, _ = sketch_features(
            q,
            k,
            "polysketch",
            layer.layer_index,
            num_features=num_features,
            projection=projection,
            nonnegative=True,
        )
        s = (pq @ pk.transpose(-1, -2)) ** 2
        b = beta * q.norm(dim=-1, keepdim=True) ** 4 * (k.norm(dim=-1) ** 4).unsqueeze(-2)
        t = s.shape[-1]
        w = (s - b / num_features).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), 0.0)
        return (w @ v) / (layer.denominator_offset + w.sum(-1, keepdim=True))

    return core


@torch.no_grad()
def learned_sketch_stats(model: nn.Module, idx: torch.Tensor) -> list[dict]:
    """Per layer with a ``learned_polysketch`` map: the scale of b1∘b2/√r before the tanh
    (RMS), the fraction of features with |tanh| > 0.9 (saturated), RMS of φ, the mean score
    (φq·φk)² and the mean share of the normalizer taken by the offset, offset/(offset + Σ s)."""
    rows = []
    for layer, (q, k, _) in enumerate(capture_qkv(model, idx)):
        attn = attention_layers(model)[layer]
        fm = attn.feature_map
        if fm is None or fm.name != "learned_polysketch":
            continue
        pre, phis = [], []
        for h in range(q.shape[1]):
            m = fm.head_map(h)
            x = torch.cat([q[:, h], k[:, h]], 0)
            r = m.num_features
            prod = m._run(m.branch1, x) * m._run(m.branch2, x) / math.sqrt(r)
            pre.append(prod)
            phis.append(torch.tanh(prod) * math.sqrt(r))
        pre, phi = torch.stack(pre), torch.stack(phis)
        pq, pk = fm.query(q), fm.key(k)
        s = (pq @ pk.transpose(-1, -2)) ** 2
        t = s.shape[-1]
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), 0.0)
        off = attn.denominator_offset
        rows.append(
            {
                "layer": layer,
                "pre_tanh_rms": float(pre.pow(2).mean().sqrt()),
                "saturated": float((torch.tanh(pre).abs() > 0.9).double().mean()),
                "phi_rms": float(phi.pow(2).mean().sqrt()),
                "mean_score": float(s.sum() / (t * (t + 1) / 2 * s.shape[0] * s.shape[1])),
                "offset_share": float((off / (off + s.sum(-1))).mean()),
            }
        )
    return rows


@torch.no_grad()
def normalizer_sign_stats(
    model: nn.Module, idx: torch.Tensor, *, cancel: float = 0.1
) -> list[dict]:
    """Per feature-map layer, over the causal scores s_ij = φq(q_i)·φk(k_j) (squared when the
    map is ``square``) of ``idx``'s sequences: median |s|, the share of negative scores, the
    share of rows whose normalizer ``offset + Σ_{j≤i} s_ij`` is negative, the median of
    ``|offset + Σ s| / (offset + Σ |s|)`` (1: no cancellation) and the share of rows where
    that ratio is below ``cancel``."""
    rows = []
    for layer, (q, k, _) in enumerate(capture_qkv(model, idx)):
        attn = attention_layers(model)[layer]
        fm = attn.feature_map
        if fm is None:
            continue
        s = fm.query(q) @ fm.key(k).transpose(-1, -2)
        if fm.square:
            s = s.square()
        t = s.shape[-1]
        causal = torch.ones(t, t, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~causal, 0.0)
        off = attn.denominator_offset
        den = off + s.sum(-1)
        kept = den.abs() / (off + s.abs().sum(-1)).clamp_min(torch.finfo(s.dtype).tiny)
        scores = s[..., causal]
        rows.append(
            {
                "layer": layer,
                "median_abs_score": float(scores.abs().median()),
                "negative_scores": float((scores < 0).double().mean()),
                "negative_normalizers": float((den < 0).double().mean()),
                "median_kept": float(kept.median()),
                "cancelled_rows": float((kept < cancel).double().mean()),
            }
        )
    return rows


def grad_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Gradient norms of one batch's loss, grouped: feature maps, attention q/k/v/out
    projections, q/k norms, everything else."""
    model.zero_grad(set_to_none=True)
    model(x, y)[1].backward()
    groups: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if ".feature_map." in name:
            g = "feature_map"
        elif ".attn." in name and ("q_norm" in name or "k_norm" in name):
            g = "qk_norm"
        elif ".attn." in name:
            g = "attn_proj"
        else:
            g = "other"
        groups[g] = groups.get(g, 0.0) + float(p.grad.pow(2).sum())
    model.zero_grad(set_to_none=True)
    return {g: math.sqrt(v) for g, v in groups.items()}
