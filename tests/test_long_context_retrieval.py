"""Kernel-level retrieval (experiments/long_context): weights on the matching key."""

import csv
import math

import pytest
import torch
from experiments.long_context.inputs import layer_norm_gaussian, near_queries
from experiments.long_context.kernels import build_kernel
from experiments.long_context.report import ResultCSV
from experiments.long_context.retrieval import (
    FeatureKernel,
    PolynomialKernel,
    SoftmaxKernel,
    match_weights,
    naive_match_weights,
    rank_bound_for,
)

from conftest import seeded
from polysketch.features import create


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def _kernels(dim):
    return {
        "softmax": SoftmaxKernel(1 / math.sqrt(dim)),
        "polynomial": PolynomialKernel(4, offset=1.0, dim=dim),
        "psf sketch (square)": FeatureKernel(
            create("polysketch", dim, degree=2, num_features=8, nonnegative=True, seed=3).double(),
            offset=1.0,
        ),
        "positive": FeatureKernel(create("positive", dim, seed=1).double(), offset=0.0),
        "taylor (signed features)": FeatureKernel(create("taylor", dim).double(), offset=0.0),
        "elu": FeatureKernel(create("elu", dim).double(), offset=0.5),
    }


@pytest.mark.parametrize("name", list(_kernels(8)))
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_weights_equal_the_naive_reference(name, chunk):
    dim, t = 8, 37  # t not a multiple of any chunk
    kernel = _kernels(dim)[name]
    keys = layer_norm_gaussian(t, dim, generator=seeded(0))
    match = torch.tensor([0, 5, 36, 5, 20])
    others = layer_norm_gaussian(5, dim, generator=seeded(1))
    for cosine in (1.0, 0.7):
        q = near_queries(keys[match], cosine, others)
        fast = match_weights(kernel, q, keys, match, chunk=chunk)
        ref = naive_match_weights(kernel, q, keys, match)
        assert fast.dtype == torch.float64 and _rel(fast, ref) <= 1e-10
        assert bool((ref > 0).all()) and bool((ref <= 1).all())


def test_softmax_and_polynomial_weights_match_the_direct_formula():
    # keys a·e_1 … a·e_t (orthogonal), query = the first key: every other score is exp(0) = 1
    # for softmax and 0^p = 0 for the polynomial, so w has a closed form.
    t, a = 16, 1.7
    keys = a * torch.eye(t, dtype=torch.float64)
    match = torch.tensor([0, 3])
    q = keys[match]
    scale = 1 / math.sqrt(t)
    w = match_weights(SoftmaxKernel(scale), q, keys, match, chunk=5)
    expected = math.exp(scale * a * a) / (math.exp(scale * a * a) + t - 1)
    assert torch.allclose(w, torch.full((2,), expected, dtype=torch.float64), rtol=1e-12)
    w = match_weights(PolynomialKernel(4, offset=1.0, dim=t), q, keys, match, chunk=5)
    expected = a**8 / (1.0 + a**8)
    assert torch.allclose(w, torch.full((2,), expected, dtype=torch.float64), rtol=1e-12)


def test_issue_numbers_for_softmax_and_degree_4_at_64_keys():
    # issue 21: LayerNorm'd Gaussians, D = 64, t = 64: softmax 0.96, exact degree 4 0.95
    keys = layer_norm_gaussian(64, 64, generator=seeded(0))
    match = torch.arange(64)
    w_soft = match_weights(SoftmaxKernel(1 / 8), keys, keys, match).mean()
    w_poly = match_weights(PolynomialKernel(4, offset=1.0, dim=64), keys, keys, match).mean()
    assert 0.93 < float(w_soft) < 0.99 and 0.92 < float(w_poly) < 0.99


@pytest.mark.parametrize(
    "build",
    [
        lambda d: create("elu", d),
        lambda d: create("positive", d, num_features=6, seed=2),
        lambda d: create("polysketch", d, degree=2, num_features=3, nonnegative=True, seed=4),
        lambda d: create("llops", d, degree=2, num_features=2, square=True, seed=5,
                         init="random"),  # asymmetric φq ≠ φk, still bounded
        lambda d: create("hedgehog", d, num_features=3, seed=6),
    ],
)  # fmt: skip
def test_mean_exact_match_weight_respects_the_rank_bound(build):
    d, t = 4, 50
    fmap = build(d).double()
    assert fmap.nonnegative
    kernel = FeatureKernel(fmap, offset=0.0)
    keys = torch.randn(t, d, generator=seeded(1), dtype=torch.float64)
    w = match_weights(kernel, keys, keys, torch.arange(t))
    assert float(w.mean()) <= kernel.rank_bound / t + 1e-12
    assert kernel.bound(t) == min(1.0, kernel.rank_bound / t)


def test_rank_bound_is_tight_for_one_positive_feature_and_counts_pairs_for_square_maps():
    # φ(x) = elu(x) + 1 > 0 with D = F = 1: w_i = φ_i / Σ_j φ_j, so mean w = 1/t = F'/t
    t = 30
    kernel = FeatureKernel(create("elu", 1).double(), offset=0.0)
    keys = torch.randn(t, 1, generator=seeded(0), dtype=torch.float64)
    w = match_weights(kernel, keys, keys, torch.arange(t))
    assert abs(float(w.mean()) - 1 / t) < 1e-12
    assert rank_bound_for(32, square=True) == 528 and rank_bound_for(32, square=False) == 32
    assert SoftmaxKernel(1.0).bound(10) is None  # full rank: no bound
    signed = FeatureKernel(create("polysketch", 4, num_features=4, seed=0).double(), offset=0.0)
    assert not signed.nonnegative and signed.bound(10) is None


def test_near_queries_have_the_cosine_and_norm_asked():
    keys = layer_norm_gaussian(20, 16, generator=seeded(0))
    others = layer_norm_gaussian(20, 16, generator=seeded(1))
    assert torch.allclose(keys.norm(dim=-1), torch.full((20,), 4.0, dtype=torch.float64),
                          rtol=1e-4)  # fmt: skip
    for c in (0.9, 0.7):
        q = near_queries(keys, c, others)
        cos = (q * keys).sum(-1) / (q.norm(dim=-1) * keys.norm(dim=-1))
        assert torch.allclose(cos, torch.full_like(cos, c), atol=1e-12)
        assert torch.allclose(q.norm(dim=-1), keys.norm(dim=-1), rtol=1e-12)
        assert float(q.mean(-1).abs().max()) < 1e-12  # still LayerNorm-like (mean 0)
    # a captured key can recur among the fit keys: a parallel row borrows the next one
    clash = others.clone()
    clash[3], clash[4] = 2.0 * keys[3], -keys[4]
    q = near_queries(keys, 0.7, clash)
    cos = (q * keys).sum(-1) / (q.norm(dim=-1) * keys.norm(dim=-1))
    assert torch.allclose(cos, torch.full_like(cos, 0.7), atol=1e-12)
    assert torch.equal(q[:3], near_queries(keys, 0.7, others)[:3])  # other rows unchanged
    one = keys[:1]
    with pytest.raises(ValueError, match="parallel"):
        near_queries(one, 0.7, 3.0 * one)
    assert torch.equal(near_queries(keys, 1.0, others), keys)
    with pytest.raises(ValueError, match="cosine"):
        near_queries(keys, 0.0, others)
    q = near_queries(keys, 0.9, 2 * keys)  # every row parallel to its own key: each borrows
    cos = (q * keys).sum(-1) / (q.norm(dim=-1) * keys.norm(dim=-1))
    assert torch.allclose(cos, torch.full_like(cos, 0.9), atol=1e-12)


def test_build_kernel_resolves_specs_like_the_model():
    kernel, info = build_kernel("psf_random", 16)
    assert isinstance(kernel, FeatureKernel) and kernel.offset == 1.0 and kernel.square
    assert info["feature_dim"] == 32 and info["state_dim"] == 544 and info["rank_bound"] == 528
    kernel, info = build_kernel("softmax", 16)
    assert isinstance(kernel, SoftmaxKernel) and kernel.scale == 0.25 and info["state_dim"] is None
    kernel, _ = build_kernel("polynomial", 16)
    assert kernel.degree == 4 and kernel.offset == 1.0 and kernel.rank_bound == math.comb(19, 4)
    kernel, info = build_kernel("symmetric_power:degree=2", 16)
    assert kernel.offset == 1.0 and info["feature_dim"] == math.comb(17, 2)
    with pytest.raises(ValueError, match="position-free"):
        build_kernel("psf_mixed", 16)
    # no in-block scores: the measured keys are earlier blocks' keys, the map's own kernel
    far, _ = build_kernel("soft_hash_far:num_features=24", 16)
    same, _ = build_kernel("soft_hash_1k:num_features=24,temperature=10.0,unit_directions=True", 16)
    x, y = torch.randn(3, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
    assert isinstance(far, FeatureKernel) and far.offset == 0.0
    assert torch.equal(far.map.target_kernel(x, y), same.map.target_kernel(x, y))
    with pytest.raises(ValueError, match="model options"):
        build_kernel("taylor:qk_dim=4", 16)
    with pytest.raises(ValueError, match="fit_data"):
        build_kernel("hedgehog", 16)
    with pytest.raises(ValueError, match="unknown"):
        build_kernel("nonsense", 16)


def test_learnable_maps_are_fitted_on_the_fit_data():
    fit = (layer_norm_gaussian(64, 8, generator=seeded(0), dtype=torch.float32),
           layer_norm_gaussian(64, 8, generator=seeded(1), dtype=torch.float32))  # fmt: skip
    keys = layer_norm_gaussian(10, 8, generator=seeded(2))
    for spec, name, kw in (
        ("hedgehog", "hedgehog", {}),
        ("llops:num_features=16,degree=2,elementwise_square=True", "llops",
         {"num_features": 16, "degree": 2, "elementwise_square": True}),
    ):  # fmt: skip
        fitted, info = build_kernel(spec, 8, fit_data=fit, fit_steps=5)
        again, _ = build_kernel(spec, 8, fit_data=fit, fit_steps=5)
        assert info["fitted"] and info["fit_s"] > 0
        assert next(fitted.map.parameters()).dtype == torch.float64
        # the same seed and data give the same fit (the table's resumption relies on it) ...
        assert torch.equal(fitted.scores(keys, keys), again.scores(keys, keys))
        # ... and the fit moved the map away from its construction
        built = create(name, 8, seed=0, **kw).double()
        assert not torch.allclose(fitted.scores(keys, keys), built.approx_kernel(keys, keys))


def test_result_csv_resumes_and_refuses_to_overwrite(tmp_path):
    path = tmp_path / "t.csv"
    table = ResultCSV(path, ("a", "b", "w"), ("a", "b"), settings={"x": 1})
    table.add({"a": "m", "b": 64, "w": 0.5})
    with pytest.raises(ValueError, match="--reuse"):
        ResultCSV(path, ("a", "b", "w"), ("a", "b"), settings={"x": 1})
    again = ResultCSV(path, ("a", "b", "w"), ("a", "b"), settings={"x": 1}, reuse=True)
    assert again.has({"a": "m", "b": 64}) and not again.has({"a": "m", "b": 128})
    assert again.rows == [{"a": "m", "b": 64, "w": 0.5}]
    with pytest.raises(ValueError, match="settings"):
        ResultCSV(path, ("a", "b", "w"), ("a", "b"), settings={"x": 2}, reuse=True)
    with pytest.raises(ValueError, match="columns"):
        ResultCSV(path, ("a", "b"), ("a",), settings={"x": 1}, reuse=True)
    fresh = ResultCSV(path, ("a", "b", "w"), ("a", "b"), settings={"x": 2}, overwrite=True)
    assert fresh.rows == [] and not fresh.has({"a": "m", "b": 64})


def test_result_csv_reload_sees_rows_another_writer_appended(tmp_path):
    """Two runs writing one folder (a cell each): each one's report is drawn after ``reload``,
    so the one that finishes last shows both cells, not only its own."""
    path = tmp_path / "t.csv"
    first = ResultCSV(path, ("a", "w"), ("a",), settings={"x": 1})
    second = ResultCSV(path, ("a", "w"), ("a",), settings={"x": 1}, reuse=True)
    first.add({"a": "m", "w": 0.5})
    second.add({"a": "n", "w": 1.5})
    assert first.rows == [{"a": "m", "w": 0.5}] and not first.has({"a": "n"})
    first.reload()
    assert first.rows == [{"a": "m", "w": 0.5}, {"a": "n", "w": 1.5}] and first.has({"a": "n"})


def test_result_csv_reused_with_columns_added_at_the_end(tmp_path):
    path = tmp_path / "t.csv"
    ResultCSV(path, ("a", "w"), ("a",), settings={"x": 1}).add({"a": "m", "w": 0.5})
    before = path.read_text()
    for columns in (("a", "v", "w"), ("w", "a", "v"), ("a",)):  # inserted, reordered, fewer
        with pytest.raises(ValueError, match="columns"):
            ResultCSV(path, columns, ("a",), settings={"x": 1}, reuse=True)
    with pytest.raises(ValueError, match="settings"):  # refused before anything is rewritten
        ResultCSV(path, ("a", "w", "v"), ("a",), settings={"x": 2}, reuse=True)
    assert path.read_text() == before
    grown = ResultCSV(path, ("a", "w", "v"), ("a",), settings={"x": 1}, reuse=True)
    assert grown.rows == [{"a": "m", "w": 0.5, "v": ""}] and grown.has({"a": "m"})
    grown.add({"a": "n", "w": 1.5, "v": 2})
    with open(path, newline="") as f:
        assert list(csv.reader(f)) == [["a", "w", "v"], ["m", "0.5", ""], ["n", "1.5", "2"]]
    again = ResultCSV(path, ("a", "w", "v"), ("a",), settings={"x": 1}, reuse=True)
    assert again.rows == grown.rows
