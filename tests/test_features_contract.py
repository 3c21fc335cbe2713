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
        "soft_hash",  # not in DESIGN.md: added for issue 21 (long context)
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


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(0, DIM), (2, 0, DIM), (0, 3, DIM)])
def test_empty_leading_dims_give_empty_features(name, shape):
    # README promises empty outputs for T = 0 or B = 0; tensorsketch's FFT used to fail on them.
    fm = build(name)
    x = torch.randn(*shape)
    for out in (fm.query(x), fm.key(x)):
        assert out.shape == (*shape[:-1], fm.feature_dim)
    s, t = fm.approx_kernel(torch.randn(2, 0, DIM), torch.randn(2, 3, DIM)), None
    t = fm.target_kernel(torch.randn(2, 0, DIM), torch.randn(2, 3, DIM))
    assert s.shape == t.shape == (2, 0, 3)


@pytest.mark.parametrize("name", NAMES)
def test_map_on_another_device_is_refused_naming_both_devices(name):
    # Before: a map moved to "meta" returned uninitialized (meta) features for CPU inputs.
    fm = build(name)
    has_tensors = any(True for _ in fm.parameters()) or any(True for _ in fm.buffers())
    fm = fm.to("meta")
    x = torch.randn(3, DIM)
    if not has_tensors:  # elu, taylor: nothing that could live elsewhere; features still right
        assert fm.query(x).device == x.device
        return
    for role in (fm.query, fm.key):
        with pytest.raises(ValueError, match=r"x is on cpu.*meta"):
            role(x)


# ----- the declared contract (family, hyperparameters, shared keywords) --------------------------
SWEEP = {"degree": 2, "num_features": None, "seed": 0}


def test_one_kwargs_dict_builds_every_map():
    # issue 23 §4: create("symmetric_power", 64, degree=2, seed=0) and create("taylor", 64,
    # seed=0) raised "unexpected keyword argument 'seed'", so no sweep with one dict could work.
    for name in NAMES:
        fm = features.create(name, 64, **SWEEP)
        assert fm.name == name and fm.dim == 64
        if features.get_class(name).takes("degree"):
            assert fm.degree == 2
    for name in ("symmetric_power", "taylor"):
        assert features.create(name, 64, degree=2, seed=0).feature_dim > 0
        assert features.create(name, 64, seed=0).feature_dim > 0


@pytest.mark.parametrize("name", NAMES)
def test_shared_num_features_is_taken_or_fixed_never_silently_changed(name):
    cls = features.get_class(name)
    if cls.takes("num_features"):
        a = features.create(name, DIM, num_features=5, seed=0)
        b = features.create(name, DIM, num_features=9, seed=0)
        assert a.num_features == 5 and b.num_features == 9 and a.feature_dim < b.feature_dim
        return
    fixed = cls.fixed["num_features"]  # every map either takes num_features or fixes it
    fm = features.create(name, DIM, degree=2, seed=0)
    own = getattr(fm, fixed.attribute)
    assert features.create(name, DIM, degree=2, num_features=own).feature_dim == fm.feature_dim
    with pytest.raises(ValueError, match=rf"num_features={own + 1} conflicts.*fixed at {own}"):
        features.create(name, DIM, degree=2, num_features=own + 1, seed=0)


def test_fixed_and_unused_degree():
    with pytest.raises(ValueError, match="degree=4 conflicts with taylor's degree.*fixed at 2"):
        features.create("taylor", DIM, degree=4)
    assert features.create("taylor", DIM, degree=2).degree == 2
    for name in features.available("softmax") + ["elu"]:  # no degree: ignored
        assert not features.get_class(name).takes("degree")
        a = build(name, degree=3)
        b = build(name)
        x = torch.randn(4, DIM, dtype=torch.float64)
        assert torch.equal(a.double().query(x), b.double().query(x))


def test_seed_is_ignored_by_deterministic_maps_but_still_validated():
    for name in ("tensor_power", "symmetric_power", "elu", "taylor"):
        assert not features.get_class(name).takes("seed")
        x = torch.randn(3, DIM)
        a = features.create(name, DIM, seed=1)
        b = features.create(name, DIM, seed=2, generator=None)
        assert torch.equal(a.query(x), b.query(x))
        with pytest.raises(ValueError, match="seed"):
            features.create(name, DIM, seed=-1)
        with pytest.raises(TypeError, match="generator"):
            features.create(name, DIM, generator=3)


def test_undeclared_keyword_is_refused():
    # e.g. trig used to accept its base class's internal nonnegative=True, a false claim
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonnegative'"):
        features.create("trig", DIM, nonnegative=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'default_num_features'"):
        features.create("positive", DIM, default_num_features=3)


def _constructor_parameters(cls) -> dict:
    """Keyword parameters of cls(dim, ...) and their defaults, following **kwargs up the MRO.

    Introspection belongs here, in the test that checks the declarations, and nowhere in src.
    """
    import inspect

    params: dict = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is FeatureMap:
            continue
        sig = inspect.signature(vars(klass)["__init__"]).parameters.values()
        for p in sig:
            if p.kind is p.KEYWORD_ONLY and p.name not in params:
                params[p.name] = p.default
        if not any(p.kind is p.VAR_KEYWORD for p in sig):
            break
    return params


INTERNAL = {"default_num_features", "nonnegative"}  # SoftmaxRandomFeatureMap's, for subclasses


@pytest.mark.parametrize("name", NAMES)
def test_declarations_match_the_constructor(name):
    cls = features.get_class(name)
    assert cls.family in features.base.FAMILIES
    params = _constructor_parameters(cls)
    if issubclass(cls, features.random_features.SoftmaxRandomFeatureMap):
        params = {k: v for k, v in params.items() if k not in INTERNAL}
    declared = cls.hyperparameters
    assert set(declared) == set(params), name
    for key, value in params.items():
        default = declared[key].default
        assert default is value or default == value, (name, key)
        assert declared[key].meaning.strip(), (name, key)
    # every shared keyword is taken, fixed or ignored; fixed ones name an attribute
    for key, fixed in cls.fixed.items():
        assert key in features.base.SHARED_KEYWORDS and not cls.takes(key)
        assert hasattr(build(name), fixed.attribute)
    if hasattr(cls, "fit"):
        fit = _fit_parameters(cls)
        assert cls.fit_keywords == fit, name
    else:
        assert cls.fit_keywords == frozenset()


def _fit_parameters(cls) -> frozenset:
    import inspect

    sig = inspect.signature(cls.fit).parameters.values()
    return frozenset(p.name for p in sig if p.kind is p.KEYWORD_ONLY or p.name == "clusters")


def test_families_partition_the_registry():
    by_family = [features.available(f) for f in features.base.FAMILIES]
    assert sorted(sum(by_family, [])) == NAMES
    assert features.available("softmax") == [
        "complex_exp", "hedgehog", "hybrid_angular", "hybrid_clustered", "hybrid_gaussian",
        "positive", "trig",
    ]  # fmt: skip
    assert features.available("own") == ["elu", "soft_hash", "taylor"]
    with pytest.raises(ValueError, match="families"):
        features.available("gaussian")


def test_register_requires_declarations():
    class Undeclared(FeatureMap):
        feature_dim = 1

        def target_kernel(self, x, y):
            return x @ y.transpose(-1, -2)

    with pytest.raises(TypeError, match="hyperparameters"):
        features.register("undeclared_map")(Undeclared)
    assert "undeclared_map" not in features.available()
