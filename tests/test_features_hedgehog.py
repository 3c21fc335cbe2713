"""Hedgehog (Zhang et al. 2024): φ(x) = [softmax(xW + b), softmax(−(xW + b))], fit by
attention distillation to imitate softmax attention rows (target exp(scale·x·y))."""

import math

import pytest
import torch

from polysketch import features
from polysketch.features.hedgehog import HedgehogFeatureMap, _log_features, distillation_loss

D = 8
_MIX = torch.randn(D, D, generator=torch.Generator().manual_seed(99), dtype=torch.float64)


def _sample(n, seed, s=0.3):
    """Correlated Gaussian vectors (a fixed mixing matrix): q·k/√D spans a few units."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, D, generator=g, dtype=torch.float64) @ _MIX) * s


def _row_kl(fm, q, k):
    """Mean KL(softmax rows of target_kernel ‖ normalized rows of φq·φk)."""
    with torch.no_grad():
        s, t = fm.approx_kernel(q, k), fm.target_kernel(q, k)
        p, a = s / s.sum(-1, keepdim=True), t / t.sum(-1, keepdim=True)
        return float((a * (a.log() - p.log())).sum(-1).mean())


def _randomize(fm, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fm.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return fm


def test_registered_and_sizes():
    fm = features.create("hedgehog", D, num_features=5)
    assert isinstance(fm, HedgehogFeatureMap) and fm.name == "hedgehog"
    assert fm.kind == "learned" and fm.nonnegative and not fm.square
    assert fm.feature_dim == 10 and fm.state_dim == 10
    assert features.create("hedgehog", D).feature_dim == 2 * D
    x = torch.randn(2, 3, 7, D)
    assert fm.query(x).shape == fm.key(x).shape == (2, 3, 7, 10)


def test_features_match_the_naive_definition():
    fm = _randomize(HedgehogFeatureMap(D, num_features=6).double(), seed=1)
    x = torch.randn(11, D, dtype=torch.float64) * 3
    for feats, w, b in ((fm.query(x), fm.weight_q, fm.bias_q), (fm.key(x), fm.weight_k, fm.bias_k)):
        u = x @ w + b
        pos = torch.exp(u) / torch.exp(u).sum(-1, keepdim=True)
        neg = torch.exp(-u) / torch.exp(-u).sum(-1, keepdim=True)
        ref = torch.cat([pos, neg], -1)
        assert torch.allclose(feats, ref, rtol=1e-12, atol=0)
        # the distillation loss's log features are the log of these (computed apart)
        assert torch.allclose(_log_features(x, w, b).exp(), feats, rtol=1e-12, atol=0)
        assert torch.allclose(feats[..., :6].sum(-1), torch.ones(11, dtype=torch.float64))
    assert not torch.allclose(fm.query(x), fm.key(x))  # separate query/key maps by default
    shared = _randomize(HedgehogFeatureMap(D, shared=True).double(), seed=1)
    assert shared.weight_k is None and torch.equal(shared.query(x), shared.key(x))


def test_scores_are_positive_and_bounded_even_for_large_inputs():
    fm = _randomize(HedgehogFeatureMap(D), seed=2)
    x = torch.randn(40, D) * 100
    s = fm.approx_kernel(x, x.flip(0))
    assert torch.isfinite(s).all() and (s >= 0).all() and (s <= 2 + 1e-5).all()


def test_output_scale_multiplies_features_not_rows():
    x = torch.randn(5, D, dtype=torch.float64)
    base = _randomize(HedgehogFeatureMap(D).double(), seed=3)
    scaled = _randomize(HedgehogFeatureMap(D, output_scale=10.0).double(), seed=3)
    assert torch.allclose(scaled.query(x), 10 * base.query(x), rtol=1e-14)
    assert torch.allclose(scaled.approx_kernel(x, x), 100 * base.approx_kernel(x, x), rtol=1e-13)
    with torch.no_grad():
        assert float(scaled.distillation_loss(x, x)) == pytest.approx(
            float(base.distillation_loss(x, x)), rel=1e-12
        )


def test_initialization():
    fm = HedgehogFeatureMap(D)
    assert torch.equal(fm.weight_q, torch.eye(D)) and torch.equal(fm.weight_k, torch.eye(D))
    assert not fm.bias_q.any() and not fm.bias_k.any()
    narrow, wide = (
        HedgehogFeatureMap(D, num_features=3, seed=4),
        HedgehogFeatureMap(D, num_features=13, seed=4),
    )
    eye3, eye8 = torch.eye(3), torch.eye(D)
    assert torch.allclose(narrow.weight_q.T @ narrow.weight_q, eye3, atol=1e-6)
    assert torch.allclose(wide.weight_q @ wide.weight_q.T, eye8, atol=1e-6)
    assert torch.equal(HedgehogFeatureMap(D, num_features=3, seed=4).weight_q, narrow.weight_q)
    assert not torch.equal(HedgehogFeatureMap(D, num_features=3, seed=5).weight_q, narrow.weight_q)


def test_target_kernel_is_the_softmax_kernel():
    x = torch.randn(4, D, dtype=torch.float64)
    y = torch.randn(5, D, dtype=torch.float64)
    fm = HedgehogFeatureMap(D)
    assert fm.scale == pytest.approx(1 / math.sqrt(D))
    assert torch.allclose(fm.target_kernel(x, y), torch.exp(x @ y.T / math.sqrt(D)), rtol=1e-14)
    fm = HedgehogFeatureMap(D, scale=0.7)
    assert torch.allclose(fm.target_kernel(x, y), torch.exp(0.7 * x @ y.T), rtol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_distillation_loss_is_the_row_cross_entropy(causal):
    g = torch.Generator().manual_seed(6)
    fm = _randomize(HedgehogFeatureMap(D, num_features=4).double(), seed=6)
    q = torch.randn(2, 9, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, 9, D, generator=g, dtype=torch.float64)
    loss = fm.distillation_loss(q, k, causal=causal).detach()
    total, rows = 0.0, 0
    for b in range(2):
        for i in range(9):
            n = i + 1 if causal else 9
            a = torch.softmax(fm.scale * k[b, :n] @ q[b, i], 0)
            s = fm.key(k[b, :n]) @ fm.query(q[b, i])
            total -= float((a * torch.log(s / s.sum())).sum().detach())
            rows += 1
    assert float(loss) == pytest.approx(total / rows, rel=1e-10)
    with pytest.raises(ValueError, match="^logits must"):
        distillation_loss(torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(3, 3), causal=False)
    with pytest.raises(ValueError, match="causal"):
        distillation_loss(torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(3, 2), causal=True)


def test_fit_improves_fidelity_on_held_out_data():
    """Measured: the held-out row KL falls from 0.407 to 0.085 (×4.8); we require ×3."""
    fm = HedgehogFeatureMap(D, num_features=16, seed=0).double()
    q, k = _sample(512, 1), _sample(512, 2)
    qt, kt = _sample(256, 3), _sample(256, 4)
    before = _row_kl(fm, qt, kt)
    history = fm.fit(q, k, steps=100, batch=64, seed=0, progress=False)
    after = _row_kl(fm, qt, kt)
    assert len(history) == 100
    assert before > 0.3, before  # the identity init is far from softmax here: the test has power
    assert after * 3 <= before, (before, after)
    # the fit is reproducible
    again = HedgehogFeatureMap(D, num_features=16, seed=0).double()
    assert again.fit(q, k, steps=100, batch=64, seed=0, progress=False) == history


def test_causal_fit_lowers_the_causal_loss():
    fm = HedgehogFeatureMap(D, num_features=16, seed=0).double()
    q, k = _sample(512, 1).reshape(16, 32, D), _sample(512, 2).reshape(16, 32, D)
    before = float(fm.distillation_loss(q, k, causal=True).detach())
    fm.fit(q, k, causal=True, steps=60, batch=8, seed=0, progress=False)
    after = float(fm.distillation_loss(q, k, causal=True).detach())
    assert after < before - 0.15, (before, after)


def test_fit_rolls_back_when_training_makes_it_worse():
    fm = HedgehogFeatureMap(D, num_features=16, seed=0).double()
    q, k = _sample(64, 1), _sample(64, 2)
    start = {n: t.clone() for n, t in fm.state_dict().items()}
    with pytest.warns(UserWarning, match="restored"):
        fm.fit(q, k, steps=3, lr=1e4, batch=None, progress=False)
    assert all(torch.equal(fm.state_dict()[n], t) for n, t in start.items())


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="dim"):
        HedgehogFeatureMap(0)
    with pytest.raises(ValueError, match="num_features"):
        HedgehogFeatureMap(D, num_features=0)
    with pytest.raises(TypeError, match="shared"):
        HedgehogFeatureMap(D, shared=1)
    with pytest.raises(ValueError, match="^scale"):
        HedgehogFeatureMap(D, scale=-1.0)
    with pytest.raises(ValueError, match="^output_scale"):
        HedgehogFeatureMap(D, output_scale=0.0)
    fm = HedgehogFeatureMap(D)
    q = torch.randn(2, 5, D)
    with pytest.raises(ValueError, match="steps"):
        fm.fit(q, q, steps=0)
    with pytest.raises(ValueError, match="lr"):
        fm.fit(q, q, lr=0.0)
    with pytest.raises(ValueError, match="batch"):
        fm.fit(q, q, batch=0)
    with pytest.raises(TypeError, match="causal"):
        fm.fit(q, q, causal="yes")
    with pytest.raises(ValueError, match="^k must"):
        fm.fit(q, q[:, :4], causal=True)
    with pytest.raises(ValueError, match="^q must"):
        fm.fit(torch.randn(3, D + 1), q)
    with pytest.raises(ValueError, match="q"):
        fm.fit(torch.full((3, D), float("nan")), q)
    with pytest.raises(ValueError, match="^k must"):
        fm.distillation_loss(q, torch.randn(5, D + 1))
