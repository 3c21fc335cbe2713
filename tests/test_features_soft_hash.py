"""Soft hashing: φ(x) = softmax(τ·xW/√D) over F learned buckets; its kernel is its own,
Σ_f P(x → f) P(y → f) (features/soft_hash.py, Eqs. 1–2)."""

import math

import pytest
import torch

from polysketch import features
from polysketch.features.soft_hash import SoftHashFeatureMap
from polysketch.ops import linear_attention, naive_linear_attention

D = 8


def _randomized(seed, **kwargs):
    fm = SoftHashFeatureMap(D, **{"num_features": 6, **kwargs}, seed=seed).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in fm.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return fm


def test_registered_sizes_and_declarations():
    fm = features.create("soft_hash", D, num_features=5, seed=0)
    assert isinstance(fm, SoftHashFeatureMap) and fm.name == "soft_hash"
    assert fm.kind == "learned" and fm.family == "own" and fm.nonnegative and not fm.square
    assert fm.feature_dim == fm.state_dim == 5
    assert features.create("soft_hash", D, seed=0).feature_dim == 4 * D
    x = torch.randn(2, 3, 7, D)
    assert fm.query(x).shape == fm.key(x).shape == (2, 3, 7, 5)


def test_features_match_the_naive_definition_and_lie_on_the_simplex():
    fm = _randomized(1)
    x = torch.randn(11, D, dtype=torch.float64) * 3
    tau = fm.temperature
    for feats, w in ((fm.query(x), fm.weight_q), (fm.key(x), fm.weight_k)):
        u = x @ w * (tau / math.sqrt(D))
        ref = torch.exp(u) / torch.exp(u).sum(-1, keepdim=True)
        assert torch.allclose(feats, ref, rtol=1e-12, atol=0)
        assert torch.allclose(feats.sum(-1), torch.ones(11, dtype=torch.float64), atol=1e-14)
    assert not torch.allclose(fm.query(x), fm.key(x))  # separate W_q, W_k once trained apart
    shared = _randomized(1, shared=True)
    assert shared.weight_k is None and torch.equal(shared.query(x), shared.key(x))


def test_scores_equal_the_target_kernel_and_lie_in_zero_one():
    fm = _randomized(2)
    x = torch.randn(3, 9, D, dtype=torch.float64) * 2
    y = torch.randn(3, 5, D, dtype=torch.float64) * 2
    s, t = fm.approx_kernel(x, y), fm.target_kernel(x, y)
    assert t.shape == (3, 9, 5)
    assert torch.allclose(s, t, rtol=1e-12, atol=1e-300)
    assert bool((t > 0).all()) and bool((t <= 1).all())


def test_a_sharp_map_retrieves_a_lone_key_without_a_one_over_t_floor():
    # With a high temperature each x puts its mass on its best bucket: a query equal to a key
    # whose bucket no other key uses keeps weight near 1 however many keys there are, while
    # a kernel with a floor (every key adding ≈ c to the normalizer) would fall like 1/t.
    g = torch.Generator().manual_seed(0)
    f, t = 64, 48
    w = torch.randn(D, f, generator=g, dtype=torch.float64)
    fm = SoftHashFeatureMap(D, num_features=f, temperature=1e3, shared=True).double()
    with torch.no_grad():
        fm.weight_q.copy_(w)
    keys = torch.randn(4 * t, D, generator=g, dtype=torch.float64)
    buckets = fm.key(keys).argmax(-1)
    lone = [i for i in range(keys.shape[0]) if int((buckets == buckets[i]).sum()) == 1]
    assert lone, "no key alone in its bucket"
    s = fm.approx_kernel(keys[lone[:1]], keys).detach()  # (1, 4t)
    assert float(s[0, lone[0]] / s.sum()) > 0.99


@pytest.mark.parametrize("factors,f", [(1, 6), (2, 9)])
def test_unit_directions_use_each_column_rescaled_to_norm_sqrt_d(factors, f):
    """unit_directions: the map of W equals the plain map of W with every column set to
    √D·w/‖w‖ (values and gradients through the rescaling), and a column's length no longer
    matters."""
    fm = _randomized(3, unit_directions=True, factors=factors, num_features=f)
    plain = _randomized(3, factors=factors, num_features=f)
    with torch.no_grad():
        for name in ("weight_q", "weight_k"):
            w = getattr(fm, name)
            getattr(plain, name).copy_(w * math.sqrt(D) / w.norm(dim=0))
    x = torch.randn(2, 7, D, dtype=torch.float64)
    y = torch.randn(2, 5, D, dtype=torch.float64)
    for role in ("query", "key"):
        assert torch.allclose(getattr(fm, role)(x), getattr(plain, role)(x), rtol=1e-12, atol=0)
    assert torch.allclose(fm.approx_kernel(x, y), fm.target_kernel(x, y), rtol=1e-12, atol=0)
    with torch.no_grad():  # lengthening one column changes nothing
        fm.weight_q[:, 1] *= 7.0
        fm.weight_k[:, 0] *= 0.1
    assert torch.allclose(fm.query(x), plain.query(x), rtol=1e-12, atol=0)
    assert torch.allclose(fm.key(x), plain.key(x), rtol=1e-12, atol=0)
    (g,) = torch.autograd.grad(fm.key(x)[..., 0].sum(), [fm.weight_k])
    w = fm.weight_k.detach()  # d/dW of a function of W/‖W‖ is orthogonal to each column
    assert torch.allclose((g * w).sum(0), torch.zeros(w.shape[1], dtype=torch.float64), atol=1e-12)
    assert "unit_directions=True" in repr(fm)


def test_temperature_rate_stores_log_tau_over_r_and_scales_its_gradient():
    """temperature_rate r: τ = exp(r·θ) with θ stored; the features equal the rate-1 map's at
    the same τ, and dL/dθ = r · dL/d(log τ)."""
    fast = SoftHashFeatureMap(D, num_features=6, temperature=5.0, temperature_rate=10.0,
                              seed=4).double()  # fmt: skip
    plain = SoftHashFeatureMap(D, num_features=6, temperature=5.0, seed=4).double()
    assert abs(fast.temperature - 5.0) < 1e-6 and abs(plain.temperature - 5.0) < 1e-6
    assert abs(float(fast.log_temperature.detach()) - math.log(5.0) / 10) < 1e-7
    x = torch.randn(3, 7, D, dtype=torch.float64)
    y = torch.randn(3, 4, D, dtype=torch.float64)
    for role in ("query", "key"):
        assert torch.allclose(getattr(fast, role)(x), getattr(plain, role)(x), rtol=1e-6, atol=0)
    w = torch.randn(3, 7, 4, dtype=torch.float64)
    (g_fast,) = torch.autograd.grad((fast.approx_kernel(x, y) * w).sum(), [fast.log_temperature])
    (g_plain,) = torch.autograd.grad((plain.approx_kernel(x, y) * w).sum(), [plain.log_temperature])
    # (θ and log τ start as float32 roundings of log 5 / 10 and log 5: τ differs by ~1e-7)
    assert torch.allclose(g_fast, 10.0 * g_plain, rtol=1e-3)
    assert torch.allclose(fast.approx_kernel(x, y), fast.target_kernel(x, y), rtol=1e-12, atol=0)
    assert "temperature_rate=10" in repr(fast) and "temperature_rate" not in repr(plain)
    with pytest.raises(ValueError, match="temperature_rate"):
        SoftHashFeatureMap(D, temperature_rate=0.0)


def test_unit_directions_fill_the_buckets_evenly_on_isotropic_inputs():
    """With Gaussian columns (norms √D ± 9 %) the longer columns win more inputs; rescaled to
    one norm they win alike: the mean bucket mass over many isotropic inputs is flatter."""
    dim, f = 64, 256
    x = torch.nn.functional.layer_norm(torch.randn(20000, dim, dtype=torch.float64), (dim,))
    spread = {}
    for unit in (False, True):
        fm = SoftHashFeatureMap(dim, num_features=f, temperature=8.0, seed=0,
                                unit_directions=unit).double()  # fmt: skip
        mass = fm.key(x).mean(0).detach()  # (F,): the share of inputs per bucket
        spread[unit] = float(mass.std() / mass.mean())
    assert spread[True] < 0.6 * spread[False], spread


def test_temperature_is_learned_or_fixed():
    fm = features.create("soft_hash", D, num_features=6, temperature=2.5, seed=0)
    assert abs(fm.temperature - 2.5) < 1e-6
    x = torch.randn(4, D)
    fm.approx_kernel(x, x).sum().backward()
    assert fm.log_temperature.grad is not None and fm.weight_q.grad is not None
    assert fm.weight_k.grad is not None
    fixed = features.create("soft_hash", D, learn_temperature=False, seed=0)
    assert "log_temperature" in dict(fixed.named_buffers())
    assert "log_temperature" not in dict(fixed.named_parameters())


def test_seeded_draw_is_reproducible_and_q_k_start_equal():
    a = features.create("soft_hash", D, seed=7)
    b = features.create("soft_hash", D, seed=7)
    c = features.create("soft_hash", D, seed=8)
    assert torch.equal(a.weight_q, b.weight_q) and not torch.equal(a.weight_q, c.weight_q)
    assert torch.equal(a.weight_q, a.weight_k)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"num_features": 1}, ValueError, "num_features"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"shared": 1}, TypeError, "shared"),
        ({"learn_temperature": "yes"}, TypeError, "learn_temperature"),
        ({"linear_weight": -0.1}, ValueError, "linear_weight"),
        ({"linear_weight": float("nan")}, ValueError, "linear_weight"),
        ({"linear_weight": 0.1, "linear_offset": 0.5}, ValueError, "linear_offset"),
        ({"linear_weight": 0.1, "linear_offset": "2"}, TypeError, "linear_offset"),
        ({"linear_offset": 2.0}, ValueError, "linear_offset needs linear_weight"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        features.create("soft_hash", D, **kwargs)


@pytest.mark.parametrize(
    "kwargs", [{}, {"linear_weight": 0.3}, {"linear_weight": 0.3, "linear_offset": 3.0}]
)
def test_linear_attention_with_the_map_equals_the_naive_reference(kwargs):
    fm = _randomized(3, **kwargs)
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 2, 37, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 2, 37, 5, generator=g, dtype=torch.float64)
    params = list(fm.parameters())

    def run(fn):
        out = fn(fm.query(q), fm.key(k), v, causal=True)
        grads = torch.autograd.grad((out * out).sum(), params)
        return out, grads

    (o1, g1), (o2, g2) = run(linear_attention), run(naive_linear_attention)
    assert torch.allclose(o1, o2, rtol=1e-10, atol=0)
    for a, b in zip(g1, g2, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14)


def test_output_scale_multiplies_the_scores_by_its_square_and_seeds_the_learned_balance():
    fm = _randomized(5)
    scaled = _randomized(5, output_scale=3.0)
    x = torch.randn(4, D, dtype=torch.float64)
    assert torch.allclose(scaled.approx_kernel(x, x), 9 * fm.approx_kernel(x, x), rtol=1e-12)
    assert torch.allclose(scaled.target_kernel(x, x), scaled.approx_kernel(x, x), rtol=1e-12)
    with pytest.raises(ValueError, match="output_scale"):
        features.create("soft_hash", D, output_scale=0.0)
    from polysketch.nn import KernelAttention

    layer = KernelAttention(16, 2, attention="soft_hash", mixed=True, learn_balance=True,
                            chunk_size=4, num_features=8, output_scale=10.0)  # fmt: skip
    assert torch.allclose(layer.log_balance, torch.full((2,), 2 * math.log(10.0)))
    assert layer.feature_map.head_map(0).output_scale == 1.0  # moved into the balance


@pytest.mark.parametrize("t", [1, 3, D, 11])
def test_logits_scaled_before_or_after_the_product_match_the_naive_map(t):
    """Fewer rows than D (a decoding step) scale the T×F logits, more rows scale W: both
    equal softmax(τ·xW/√D), values and gradients (x, W, log τ)."""
    fm = _randomized(5)
    x = (torch.randn(2, t, D, dtype=torch.float64) * 2).requires_grad_()
    for role, w in (("query", fm.weight_q), ("key", fm.weight_k)):
        ours = getattr(fm, role)(x)
        ref = torch.softmax(x @ w * (fm.log_temperature.exp() / math.sqrt(D)), dim=-1)
        assert (ours - ref).abs().max() <= 1e-13
        g = torch.randn_like(ref)
        params = (x, w, fm.log_temperature)
        g1 = torch.autograd.grad((ours * g).sum(), params)
        g2 = torch.autograd.grad((ref * g).sum(), params)
        for a, b in zip(g1, g2, strict=True):
            assert (a - b).abs().max() <= 1e-12 * b.abs().max()


# ----- product buckets (factors = m > 1, Eqs. 3–4) ---------------------------------------------
def test_product_buckets_are_the_kronecker_product_of_m_softmaxes():
    for m, f in ((2, 9), (3, 8)):
        fm = SoftHashFeatureMap(D, num_features=f, factors=m, seed=m).double()
        b = fm.buckets
        assert b**m == f and fm.weight_q.shape == (D, m * b) and fm.feature_dim == f
        x = torch.randn(7, D, dtype=torch.float64) * 2
        u = x @ fm.weight_q * (fm.temperature / math.sqrt(D))
        parts = [torch.softmax(u[:, i * b : (i + 1) * b], -1) for i in range(m)]
        ref = parts[0]
        for p in parts[1:]:  # f_1 slowest: row-major Kronecker product
            ref = torch.stack([torch.kron(r, q) for r, q in zip(ref, p, strict=True)])
        assert torch.allclose(fm.query(x), ref, rtol=1e-12, atol=0)
        assert torch.allclose(fm.key(x).sum(-1), torch.ones(7, dtype=torch.float64))


def test_product_bucket_scores_are_the_product_of_collision_probabilities():
    fm = SoftHashFeatureMap(D, num_features=16, factors=2, seed=4).double()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        fm.weight_k.copy_(torch.randn(fm.weight_k.shape, generator=g, dtype=torch.float64))
    x = torch.randn(2, 6, D, dtype=torch.float64)
    y = torch.randn(2, 5, D, dtype=torch.float64)
    s = fm.approx_kernel(x, y)
    assert torch.allclose(s, fm.target_kernel(x, y), rtol=1e-12, atol=1e-300)
    tau = fm.temperature / math.sqrt(D)
    uq, uk = x @ fm.weight_q * tau, y @ fm.weight_k * tau
    pq, pk = (torch.softmax(u.unflatten(-1, (2, 4)), -1) for u in (uq, uk))
    collide = [pq[..., i, :] @ pk[..., i, :].transpose(-1, -2) for i in (0, 1)]
    assert torch.allclose(s, collide[0] * collide[1], rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"num_features": 10, "factors": 2}, ValueError, "num_features=10"),
        ({"num_features": 9, "factors": 3}, ValueError, "num_features=9"),
        ({"num_features": 9, "factors": 0}, ValueError, "factors"),
        ({"num_features": 9, "factors": 2.0}, TypeError, "factors"),
    ],
)
def test_product_bucket_arguments_name_themselves(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        features.create("soft_hash", D, **kwargs)


@pytest.mark.parametrize("factors,f,scale", [(1, 6, 1.0), (2, 9, 1.5)])
def test_linear_weight_appends_sqrt_half_alpha_one_and_unit_x(factors, f, scale):
    """Eq. 5: φ = c·[buckets, √(α/2)(1, x/‖x‖)], s = c²(s_hash + α(1 + cos)/2), written out."""
    alpha = 0.4
    plain = _randomized(6, num_features=f, factors=factors, output_scale=scale)
    fm = _randomized(6, num_features=f, factors=factors, output_scale=scale, linear_weight=alpha)
    assert fm.feature_dim == fm.state_dim == f + D + 1 and plain.feature_dim == f
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, D, generator=g, dtype=torch.float64) * 2
    y = torch.randn(4, D, generator=g, dtype=torch.float64) * 0.5
    for feats, base in ((fm.query(x), plain.query(x)), (fm.key(x), plain.key(x))):
        assert torch.equal(feats[:, :f], base)
        c = scale * math.sqrt(alpha / 2)
        assert torch.allclose(feats[:, f], torch.full((5,), c, dtype=x.dtype))
        assert torch.allclose(feats[:, f + 1 :], c * x / x.norm(dim=-1, keepdim=True))
    cos = (x @ y.T) / (x.norm(dim=-1)[:, None] * y.norm(dim=-1)[None])
    expected = plain.target_kernel(x, y) + scale**2 * alpha * (1 + cos) / 2
    assert torch.allclose(fm.target_kernel(x, y), expected, rtol=1e-12)
    assert torch.allclose(fm.approx_kernel(x, y), expected, rtol=1e-12)
    assert (fm.target_kernel(x, -x) >= 0).all()  # cos = -1 still scores >= 0


@pytest.mark.parametrize("factors,f,scale,offset", [(1, 6, 1.0, 3.0), (2, 9, 1.5, 1.5)])
def test_linear_offset_keeps_a_floor_under_every_key(factors, f, scale, offset):
    """Eq. 6: the linear features are √(α/(1 + c))(√c, x/‖x‖), s = s_hash + α(c + cos)/(1 + c),
    at least α(c − 1)/(1 + c) at cos = −1 (Eq. 5's vanishes there), at most α at cos = 1."""
    alpha = 0.4
    kw = dict(num_features=f, factors=factors, output_scale=scale, linear_weight=alpha)
    plain = _randomized(6, num_features=f, factors=factors, output_scale=scale)
    fm = _randomized(6, **kw, linear_offset=offset)
    eq5 = _randomized(6, **kw)
    assert fm.feature_dim == f + D + 1 and "linear_offset=" in repr(fm)
    assert "linear_offset" not in repr(eq5)  # c = 1 is Eq. 5, shown as before
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, D, generator=g, dtype=torch.float64) * 2
    y = torch.randn(4, D, generator=g, dtype=torch.float64) * 0.5
    for feats, base in ((fm.query(x), plain.query(x)), (fm.key(x), plain.key(x))):
        assert torch.equal(feats[:, :f], base)
        c = scale * math.sqrt(alpha / (1 + offset))
        assert torch.allclose(feats[:, f], torch.full((5,), c * math.sqrt(offset), dtype=x.dtype))
        assert torch.allclose(feats[:, f + 1 :], c * x / x.norm(dim=-1, keepdim=True))
    cos = (x @ y.T) / (x.norm(dim=-1)[:, None] * y.norm(dim=-1)[None])
    expected = plain.target_kernel(x, y) + scale**2 * alpha * (offset + cos) / (1 + offset)
    assert torch.allclose(fm.target_kernel(x, y), expected, rtol=1e-12)
    assert torch.allclose(fm.approx_kernel(x, y), expected, rtol=1e-12)
    # anti-parallel: Eq. 5's linear score is 0 (to rounding), Eq. 6's its floor
    lin = fm.target_kernel(x, -x).diagonal() - plain.target_kernel(x, -x).diagonal()
    floor = scale**2 * alpha * (offset - 1) / (1 + offset)
    assert torch.allclose(lin, torch.full_like(lin, floor), rtol=1e-12)
    lin5 = eq5.target_kernel(x, -x).diagonal() - plain.target_kernel(x, -x).diagonal()
    assert lin5.abs().max() < 1e-12
    same = fm.target_kernel(x, x).diagonal() - plain.target_kernel(x, x).diagonal()
    assert torch.allclose(same, torch.full_like(same, scale**2 * alpha), rtol=1e-12)


def test_linear_weight_pulls_a_query_towards_a_key_no_bucket_shares():
    """The reason for Eq. 5: at a sharp τ, ∂s_hash/∂q vanishes for an unrelated key, while the
    linear term's gradient is (α/2)(k̂ − cos·q̂)/‖q‖, which raises cos(q, k)."""
    alpha, g = 0.01, torch.Generator().manual_seed(8)
    kw = {"num_features": 64, "temperature": 40.0, "unit_directions": True}
    sharp = SoftHashFeatureMap(D, **kw, seed=0).double()
    mixed = SoftHashFeatureMap(D, **kw, linear_weight=alpha, seed=0).double()
    q = torch.randn(D, generator=g, dtype=torch.float64) * math.sqrt(D) / 3
    k = -q + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)  # far from q's buckets
    grads = []
    for fm in (sharp, mixed):
        qq = q.clone().requires_grad_(True)
        (s,) = (fm.query(qq[None]) @ fm.key(k[None]).T).flatten()
        grads.append(torch.autograd.grad(s, qq)[0])
    assert grads[0].norm() < 1e-12  # the hash alone passes nothing
    qn, kn = q.norm(), k / k.norm()
    cos = (q / qn) @ kn
    assert torch.allclose(grads[1], alpha / 2 * (kn - cos * q / qn) / qn, rtol=1e-8, atol=1e-14)
    assert grads[1] @ (kn - cos * q / qn) > 0  # a step along it raises cos(q, k)
