"""The quality-gap measurements (``experiments.quality_diagnosis``) and their facts."""

import torch
from experiments.quality_diagnosis import (
    capture_qkv,
    grad_norms,
    kernel_errors,
    layer_errors,
    learned_sketch_stats,
    sketch_core,
    swap_loss,
)

from polysketch.nn import TransformerConfig, TransformerLM
from polysketch.ops import polynomial_attention


def _model(attention, **kw):
    cfg = dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, chunk_size=8)
    return TransformerLM(TransformerConfig(attention=attention, **{**cfg, **kw}))


def _ln(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.layer_norm(torch.randn(n, d, generator=g, dtype=torch.float64), (d,))


def test_squared_sketch_floor_is_norm4_over_r():
    """E[(φq·φk)²] − (q·k)⁴ ≈ ‖q‖⁴‖k‖⁴/r for the product form (exactly
    ((‖q‖²‖k‖² + 2(q·k)²)² − (q·k)⁴)/r, whose first term dominates for LayerNorm'd
    q, k at D = 32); the tree's floor is at least as large. Error falls with r."""
    rows = kernel_errors(_ln(48, 32, 0), _ln(48, 32, 1), sizes=(16, 64), draws=60)
    by = {(r["projection"], r["r"]): r for r in rows}
    for r in (16, 64):
        assert 0.85 < by[("product", r)]["floor_times_r"] < 1.3, by[("product", r)]
        assert by[("gaussian", r)]["floor_times_r"] > 0.9 * by[("product", r)]["floor_times_r"]
    for proj in ("gaussian", "product"):
        assert by[(proj, 64)]["rel_error"] < 0.6 * by[(proj, 16)]["rel_error"]


def test_layer_errors_and_swap_loss_on_a_polynomial_model():
    torch.manual_seed(0)
    model = _model("polynomial")
    x = torch.randint(0, 64, (2, 32))
    y = torch.randint(0, 64, (2, 32))
    qkv = capture_qkv(model, x)
    assert len(qkv) == 2 and qkv[0][0].shape == (2, 2, 32, 16)
    # the captured inputs are those of the core: polynomial attention on them is its output
    spec = {
        "r8": {"name": "polysketch", "num_features": 8, "nonnegative": True},
        "r128": {"name": "polysketch", "num_features": 128, "nonnegative": True},
    }
    rows = layer_errors(qkv, spec, draws=2)
    assert [(r["layer"], r["variant"]) for r in rows] == [
        (0, "r8"),
        (0, "r128"),
        (1, "r8"),
        (1, "r128"),
    ]
    for a, b in ((rows[0], rows[1]), (rows[2], rows[3])):
        assert 0 < b["floor_share"] < a["floor_share"] < 1
        assert b["output_rel_error"] < a["output_rel_error"]
    base = swap_loss(model, [(x, y)])
    assert base == float(model(x, y)[1].detach())

    def exact(layer, q, k, v):
        return polynomial_attention(
            q, k, v, degree=4, causal=True, denominator_offset=layer.denominator_offset
        )

    assert abs(swap_loss(model, [(x, y)], exact) - base) < 1e-6
    assert (
        swap_loss(model, [(x, y)], sketch_core("polysketch", num_features=8, nonnegative=True))
        != base
    )
    assert all(not hasattr(m, "__dict__") or "_attend" not in m.__dict__ for m in model.modules())


def test_learned_sketch_starts_with_attention_switched_on():
    """With LeCun-normal weights (flax's Dense default, the public code's) psf_learned's scores
    start O(1), so the 1 in 1 + Σ s holds a small share of the normalizer. With torch's
    default U(±1/√n) weights the scores were ~1e-4 and the offset held > 90% of every
    normalizer: attention started switched off (docs/quality_gap.md)."""
    torch.manual_seed(0)
    model = _model("psf_learned")
    x = torch.randint(0, 64, (2, 32))
    stats = learned_sketch_stats(model, x)
    assert len(stats) == 2
    for s in stats:
        assert s["offset_share"] < 0.25 and s["saturated"] == 0.0
        assert 0.02 < s["pre_tanh_rms"] < 0.3 and s["mean_score"] > 0.5
    with torch.no_grad():  # layer 0's Linear weights to torch's default variance 1/(3n)
        for name, p in model.blocks[0].attn.feature_map.named_parameters():
            if name.endswith(("up", "down")):
                p.mul_(3**-0.5)
    off = learned_sketch_stats(model, x)[0]
    assert off["mean_score"] < 1e-2 * stats[0]["mean_score"]
    norms = grad_norms(model, x, torch.randint(0, 64, (2, 32)))
    assert set(norms) == {"feature_map", "attn_proj", "qk_norm", "other"}
    assert all(v > 0 for v in norms.values())


def test_normalizer_sign_stats_flags_signed_scores_only():
    """Squared sketch scores never give a negative normalizer; LLoPS's signed sketch draw at
    p = 4 does in a fresh model, and its monomial start does not."""
    from experiments.quality_diagnosis import normalizer_sign_stats

    x = torch.randint(0, 64, (2, 32))
    torch.manual_seed(0)
    (sq,) = normalizer_sign_stats(_model("polysketch", n_layer=1), x)
    assert sq["negative_scores"] == 0.0 and sq["negative_normalizers"] == 0.0
    assert sq["median_kept"] == 1.0 and sq["cancelled_rows"] == 0.0
    maps = {"num_features": 64, "degree": 4}
    torch.manual_seed(0)
    (signed,) = normalizer_sign_stats(_model("llops", n_layer=1, map_kwargs=maps), x)
    assert signed["negative_scores"] > 0.2 and signed["negative_normalizers"] > 0.1
    assert signed["median_kept"] < 0.9
    torch.manual_seed(0)
    mono = _model("llops", n_layer=1, map_kwargs={**maps, "init": "monomial"})
    (start,) = normalizer_sign_stats(mono, x)
    assert start["negative_normalizers"] == 0.0 and start["median_kept"] > 0.99
    assert normalizer_sign_stats(_model("softmax", n_layer=1), x) == []
