"""PolySketchFormer's learned sketch (learned.py)."""

import math

import pytest
import torch
from torch.func import functional_call

from conftest import rel_err
from polysketch.features import create
from polysketch.features.learned import LearnedPolySketch, lecun_normal


def _naive_features(fmap, x):
    """Reference: the architecture written with torch.nn.functional, fp64, no casting tricks."""

    def branch(blocks, h):
        for block in blocks:
            h = torch.nn.functional.layer_norm(
                h, (h.shape[-1],), block.norm.weight.double(), block.norm.bias.double()
            )
            h = torch.nn.functional.linear(h, block.up.double())
            h = torch.nn.functional.gelu(h)
            h = torch.nn.functional.linear(h, block.down.double())
        return h

    r = fmap.num_features
    prod = branch(fmap.branch1, x) * branch(fmap.branch2, x)
    return math.sqrt(r) * torch.tanh(prod / math.sqrt(r))


def test_architecture_and_formula():
    fmap = LearnedPolySketch(6, num_features=5, expansion=3, levels=3, seed=0)
    assert fmap.kind == "learned" and fmap.square and fmap.nonnegative
    assert fmap.feature_dim == 5 and fmap.state_dim == 15  # pair layout 5 * (5 // 2 + 1)
    for branch in (fmap.branch1, fmap.branch2):
        assert len(branch) == 3
        assert [tuple(b.up.shape) for b in branch] == [(15, 6), (15, 5), (15, 5)]
        assert [tuple(b.down.shape) for b in branch] == [(5, 15)] * 3
    names = [n for n, _ in fmap.named_parameters()]
    assert not any(n.endswith("up.bias") or n.endswith("down.bias") for n in names)
    x = 3 * torch.randn(2, 7, 6, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(fmap.query(x), _naive_features(fmap, x)) < 1e-13
        assert torch.equal(fmap.query(x), fmap.key(x))
    default = create("learned_polysketch", 8)
    assert default.feature_dim == 32 and default.levels == 2 and default.expansion == 8


def test_lecun_normal_has_variance_one_over_fan_in_and_is_truncated():
    g = torch.Generator().manual_seed(0)
    w = lecun_normal((512, 256), g)
    assert w.dtype == torch.float32 and w.shape == (512, 256)
    assert abs(w.double().var().item() * 256 - 1.0) < 0.02
    assert abs(w.double().mean().item()) < 1e-3
    # truncated at two standard deviations of the underlying normal (σ = 1/(0.8796·√n))
    assert w.abs().max().item() <= 2.0 / (0.87962566103423978 * 16.0) + 1e-6
    assert torch.equal(w, lecun_normal((512, 256), torch.Generator().manual_seed(0)))


def test_initial_scores_are_order_one_on_layernormed_inputs():
    """The normalizer 1 + Σ s must not own the output at initialization: with LeCun-normal
    weights φ has RMS ≈ 0.4 and the mean score is O(1) (module docstring)."""
    x = torch.nn.functional.layer_norm(
        torch.randn(4, 128, 64, generator=torch.Generator().manual_seed(1)), (64,)
    )
    fm = LearnedPolySketch(64, seed=0)
    with torch.no_grad():
        phi = fm.query(x)
        s = (phi @ phi.transpose(-1, -2)) ** 2
    assert 0.25 < phi.pow(2).mean().sqrt().item() < 0.6
    assert 0.3 < s.mean().item() < 10.0


def test_scores_nonnegative_and_bounded():
    fmap = LearnedPolySketch(4, num_features=6, seed=1).requires_grad_(False)
    x = 50 * torch.randn(20, 4, dtype=torch.float64)
    y = -50 * torch.randn(30, 4, dtype=torch.float64)
    phi = fmap.query(x)
    assert bool((phi.abs() <= math.sqrt(6)).all())
    scores = fmap.approx_kernel(x, y)
    assert bool((scores >= 0).all()) and float(scores.max()) <= 6.0**4
    assert rel_err(scores, (fmap.query(x) @ fmap.key(y).T) ** 2) < 1e-15
    assert rel_err(fmap.target_kernel(x, y), (x @ y.T) ** 4) < 1e-15


def test_gradcheck_inputs_and_all_parameters():
    fmap = LearnedPolySketch(3, num_features=2, expansion=2, levels=2, seed=0).double()
    names, params = zip(*[(n, p.detach().clone()) for n, p in fmap.named_parameters()], strict=True)
    x = torch.randn(2, 3, dtype=torch.float64)
    inputs = (x, *params)
    for t in inputs:
        t.requires_grad_(True)

    def features(x, *ps):
        return functional_call(fmap, dict(zip(names, ps, strict=True)), (x,))

    assert torch.autograd.gradcheck(features, inputs)


def test_both_branches_receive_gradients():
    fmap = LearnedPolySketch(4, num_features=4, expansion=2, seed=0)
    x, y = torch.randn(5, 4), torch.randn(6, 4)
    fmap.approx_kernel(x, y).sum().backward()
    for name, p in fmap.named_parameters():
        assert p.grad is not None and float(p.grad.norm()) > 0, name
    assert any(n.startswith("branch1") for n, _ in fmap.named_parameters())
    assert any(n.startswith("branch2") for n, _ in fmap.named_parameters())


def test_fit_imitates_degree_4_kernel():
    g = torch.Generator().manual_seed(1)
    basis = torch.rand(3, 4, generator=g, dtype=torch.float64)

    def sample(n):
        x = (torch.rand(n, 3, generator=g, dtype=torch.float64) + 0.1) @ basis
        return x / x.norm(dim=-1, keepdim=True)

    q, k = sample(64), sample(64)
    fmap = LearnedPolySketch(4, num_features=4, expansion=2, seed=0).double()
    history = fmap.fit(q, k, steps=60, lr=1e-2, batch=None, seed=0, progress=False)
    assert history[-1] * 20 <= history[0]


def test_seed_reproducibility_and_state_dict():
    a = LearnedPolySketch(5, num_features=4, seed=1)
    b = LearnedPolySketch(5, num_features=4, seed=2)
    c = LearnedPolySketch(5, num_features=4, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 5)
    with torch.no_grad():
        assert torch.equal(a.query(x), c.query(x))
        assert not torch.equal(a.query(x), b.query(x))
        b.load_state_dict(a.state_dict())
        assert torch.equal(a.query(x), b.query(x))
        a.reset_parameters(seed=5)
        assert not torch.equal(a.query(x), b.query(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_output_dtype_follows_input(dtype):
    fmap = LearnedPolySketch(4, num_features=4, seed=0).requires_grad_(False)
    x = torch.randn(2, 3, 4).to(dtype)
    out = fmap.query(x)
    assert out.dtype == dtype and out.shape == (2, 3, 4)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(out.double(), fmap.query(x.double())) < tol
    assert fmap.to(torch.float64).query(x.double()).dtype == torch.float64


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_features": 0}, "num_features"),
        ({"expansion": 0}, "expansion"),
        ({"levels": 0}, "levels"),
        ({"degree": 3}, "degree"),
        ({"degree": 0}, "degree"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LearnedPolySketch(4, **kwargs)


def test_bad_input_names_argument():
    fmap = LearnedPolySketch(4, num_features=3, seed=0)
    with pytest.raises(ValueError, match="x"):
        fmap.query(torch.randn(2, 5))
    with pytest.raises(ValueError, match="q"):
        fmap.fit(torch.full((4, 4), float("nan")), torch.randn(4, 4), steps=1)


def _gaussian_qk(n, dim, seed):
    """q, k rows i.i.d. N(0, I/√D) (q·k has variance 1), as ``polysketch approx`` draws them."""
    g = torch.Generator().manual_seed(seed)
    scale = dim**-0.25
    return (
        torch.randn(n, dim, generator=g, dtype=torch.float64) * scale,
        torch.randn(n, dim, generator=g, dtype=torch.float64) * scale,
    )


def _frobenius(fmap, q, k):
    with torch.no_grad():
        return rel_err(fmap.approx_kernel(q, k), fmap.target_kernel(q, k))


def test_fit_lowers_frobenius_error_on_gaussian_qk():
    q, k = _gaussian_qk(128, 8, seed=0)
    fmap = LearnedPolySketch(8, num_features=16, seed=0).double()
    assert fmap.fit_lr == pytest.approx(0.25 / (8 * 16))
    start = _frobenius(fmap, q, k)
    history = fmap.fit(q, k, steps=50, seed=0, progress=False)
    end = _frobenius(fmap, q, k)
    assert start > 0.99  # the untrained map's scores are ~0
    assert end < 0.9 * start, (start, end)
    # the loss is the squared relative error, and the default lr never overshoots here
    assert history[0] == pytest.approx(start**2, rel=1e-9)
    assert max(history) <= history[0] * (1 + 1e-6)


def test_fit_too_large_lr_diverges_and_is_rolled_back():
    # The cause of the old blow-up (r = 128, e = 8): the old fixed lr = 1e-2 with fan-in
    # n = e·r = 1024 moves the last layer's output by ~lr·n·√3 ≈ 18x per step, the
    # degree-8 (in those weights) scores by ~1e10.
    q, k = _gaussian_qk(64, 8, seed=1)
    fmap = LearnedPolySketch(8, num_features=128, seed=0).double()
    start_state = {n: t.clone() for n, t in fmap.state_dict().items()}
    start = _frobenius(fmap, q, k)
    with pytest.warns(UserWarning, match="restored"):
        history = fmap.fit(q, k, steps=5, lr=1e-2, seed=0, progress=False)
    assert max(history) > 1e6 * history[0]
    for name, t in fmap.state_dict().items():
        assert torch.equal(t, start_state[name]), name
    assert _frobenius(fmap, q, k) == start


def test_fit_checks_arguments():
    fmap = LearnedPolySketch(4, num_features=3, seed=0)
    q = torch.randn(8, 4)
    with pytest.raises(ValueError, match="check_rows"):
        fmap.fit(q, q, steps=1, check_rows=0)
    with pytest.raises(ValueError, match="degree"):
        fmap.fit(q, q, steps=1, degree=0)
    with pytest.raises(ValueError, match="k"):
        fmap.fit(q, torch.randn(8, 5), steps=1)
