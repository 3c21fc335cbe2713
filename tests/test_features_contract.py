"""The FeatureMap contract, checked for every registered map.

Per-map math (fidelity against ``target_kernel``) lives in the per-map test files; this file
checks what every map promises: shapes, ``feature_dim``/``state_dim``, dtype following, the
state_dict round trip, ``.to(float64)``, seeded reproducibility, ``redraw_`` semantics, the
``nonnegative`` claim and input validation.
"""

from __future__ import annotations

import pytest
import torch

from polysketch import features
from polysketch.features import FeatureMap

DIM = 6

# Extra construction keywords for maps whose defaults are too large for a quick check.
SMALL = {
    "tensor_power": {"degree": 2},
    "symmetric_power": {"degree": 2},
    "tensorsketch": {"num_features": 16},
    "polysketch": {"num_features": 8},
    "trig": {"num_features": 8},
    "positive": {"num_features": 8},
    "complex_exp": {"num_features": 8},
    "hybrid_angular": {"num_features": 4, "lambda_features": 2},
    "hybrid_gaussian": {"num_features": 4},
    "hybrid_clustered": {"num_features": 4},
    "llops": {"num_features": 8},
    "learned_polysketch": {"num_features": 8},
    "elementwise_power": {"num_features": 8},
}


def build(name: str, **extra) -> FeatureMap:
    kwargs = dict(SMALL.get(name, {}))
    if features.get_class(name).is_random:  # class default; instances may opt out
        kwargs["seed"] = 1234
    kwargs.update(extra)
    fm = features.create(name, DIM, **kwargs)
    if hasattr(fm, "fit") and name == "hybrid_clustered":
        g = torch.Generator().manual_seed(0)
        fm.fit(torch.randn(64, DIM, generator=g) * 0.3, torch.randn(64, DIM, generator=g) * 0.3)
    return fm


NAMES = features.available()
RANDOM = [n for n in NAMES if build(n).is_random]
DETERMINISTIC = [n for n in NAMES if not build(n).is_random]


def test_registry_lists_the_designed_names():
    # The names promised by DESIGN.md that exist so far must be registered under these names.
    designed = {
        "tensor_power", "symmetric_power", "fpa", "tensorsketch", "polysketch", "llops",
        "trig", "positive", "complex_exp", "hybrid_angular", "hybrid_gaussian",
        "hybrid_clustered", "learned_polysketch", "elu", "taylor", "elementwise_power", "hedgehog",
    }  # fmt: skip
    assert set(NAMES) == designed
    for name in NAMES:
        assert features.get_class(name).name == name


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown feature map name"):
        features.create("no_such_map", 4)
    with pytest.raises(TypeError, match="name"):
        features.get_class(3)


@pytest.mark.parametrize("name", NAMES)
def test_shapes_and_sizes(name):
    fm = build(name)
    assert fm.kind in {"exact", "unbiased", "learned", "approximate"}
    x = torch.randn(2, 3, 5, DIM)
    q, k = fm.query(x), fm.key(x)
    assert q.shape == (2, 3, 5, fm.feature_dim)
    assert k.shape == (2, 3, 5, fm.feature_dim)
    # squared maps: the symmetric pair layout of ops.pairs, F(F//2 + 1) (not F²)
    f = fm.feature_dim
    assert fm.state_dim == (f * (f // 2 + 1) if fm.square else f)
    s = fm.approx_kernel(x, x[..., :4, :])
    t = fm.target_kernel(x, x[..., :4, :])
    assert s.shape == t.shape == (2, 3, 5, 4)
    assert torch.isfinite(q).all() and torch.isfinite(k).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_output_dtype_follows_input(name, dtype):
    fm = build(name)
    x = torch.randn(4, DIM) * 0.5
    if dtype == torch.float64:
        fm = fm.to(torch.float64)
    out = fm.query(x.to(dtype))
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    # half inputs are computed with fp32 internals: close to the fp32 result
    if dtype != torch.float64:
        ref = fm.query(x.to(dtype).float())
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
        assert torch.allclose(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_gives_identical_features(name):
    fm = build(name)
    x = torch.randn(7, DIM, dtype=torch.float64)
    fm = fm.to(torch.float64)
    clone = build(name, **({"seed": 999} if name in RANDOM else {})).to(torch.float64)
    clone.load_state_dict(fm.state_dict())
    assert torch.equal(clone.query(x), fm.query(x))
    assert torch.equal(clone.key(x), fm.key(x))


@pytest.mark.parametrize("name", RANDOM)
def test_seed_reproducible_and_redraw(name):
    x = torch.randn(5, DIM, dtype=torch.float64)
    a, b = build(name).double(), build(name).double()
    assert torch.equal(a.query(x), b.query(x))
    before = a.query(x)
    a.redraw_(torch.Generator().manual_seed(7))
    assert not torch.equal(a.query(x), before), "redraw_ must change the random buffers"
    b.redraw_(torch.Generator().manual_seed(7))
    assert torch.equal(a.query(x), b.query(x)), "same generator state, same redraw"
    assert a.query(x).dtype == torch.float64, "redraw_ keeps the buffers' dtype"


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_redraw_is_a_no_op_for_deterministic_maps(name):
    fm = build(name)
    x = torch.randn(5, DIM)
    before = fm.query(x)
    assert fm.redraw_() is fm
    assert torch.equal(fm.query(x), before)


@pytest.mark.parametrize("name", RANDOM)
def test_random_buffers_live_in_state_dict(name):
    fm = build(name)
    assert len(fm.state_dict()) > 0


NONNEGATIVE_CASES = [
    (name, extra)
    for name in NAMES
    for extra in ([{}, {"nonnegative": True}] if name == "polysketch" else [{}])
    if build(name, **extra).nonnegative
]


@pytest.mark.parametrize(("name", "extra"), NONNEGATIVE_CASES)
def test_nonnegative_claim_holds(name, extra):
    fm = build(name, **extra).double()
    x = torch.randn(40, DIM, dtype=torch.float64)
    y = torch.randn(30, DIM, dtype=torch.float64) * 3
    assert (fm.approx_kernel(x, y) >= 0).all()


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_names_the_argument(name):
    fm = build(name)
    with pytest.raises(ValueError, match=r"^x must"):
        fm.query(torch.randn(3, DIM + 1))
    with pytest.raises(TypeError, match=r"^x must"):
        fm.key(torch.ones(3, DIM, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"^x must"):
        fm.query([[0.0] * DIM])
