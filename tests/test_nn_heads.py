"""Per-head feature maps: vmapped stack == Python loop over heads (values and gradients)."""

import copy

import pytest
import torch

from numerics import assert_as_accurate, per_token_in_other_shapes, rounding_sigma
from polysketch.features import create
from polysketch.nn import heads
from polysketch.nn.heads import MultiHeadFeatureMap, head_seed

H, D = 3, 8

CASES = [
    ("polysketch", {"nonnegative": True}),
    ("polysketch", {"projection": "srht", "degree": 4}),
    ("tensorsketch", {"num_features": 16}),
    ("positive", {"scale": 0.3}),
    ("hybrid_angular", {"scale": 0.3}),
    ("llops", {"degree": 2}),
    ("learned_polysketch", {"num_features": 8, "expansion": 2}),
    ("fpa", {"trainable": True}),
    ("elementwise_power", {}),
    ("tensor_power", {}),
]


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] + str(i) for i, c in enumerate(CASES)])
def test_vmap_equals_loop_values_and_grads(name, kw):
    mh = MultiHeadFeatureMap(name, D, H, seed=5, layer_index=2, **kw)
    assert mh.vectorized
    x = torch.randn(2, H, 5, D, dtype=torch.float64, requires_grad=True)
    for key in (False, True):
        got = mh.key(x) if key else mh.query(x)
        assert got.shape == (2, H, 5, mh.feature_dim)
        # the loop uses standalone maps built from the SAME seeds as the heads
        maps = [
            create(
                name, D, **({**kw, "seed": head_seed(5, 2, h)} if name != "tensor_power" else kw)
            )
            for h in range(H)
        ]
        ref = torch.stack([(m.key if key else m.query)(x[:, h]) for h, m in enumerate(maps)], 1)
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
        # gradients w.r.t. the input and (for trainable maps) w.r.t. the parameters
        w = torch.randn_like(got)
        gx = torch.autograd.grad((got * w).sum(), x, retain_graph=True)[0]
        gx_ref = torch.autograd.grad((ref * w).sum(), x)[0]
        assert torch.allclose(gx, gx_ref, rtol=1e-10, atol=1e-12)
    params = list(mh.parameters())
    if params:
        maps64 = [m.double() for m in maps]
        mh64 = mh.double()
        w2 = torch.randn_like(w)
        out = (mh64.query(x) * w).sum() + (mh64.key(x) * w2).sum()
        grads = torch.autograd.grad(out, params)
        ref_out = sum(
            (maps64[h].query(x[:, h]) * w[:, h]).sum() + (maps64[h].key(x[:, h]) * w2[:, h]).sum()
            for h in range(H)
        )
        names = [n for n, _ in maps64[0].named_parameters()]
        ref_grads = torch.autograd.grad(ref_out, [p for m in maps64 for p in m.parameters()])
        per = len(names)
        for i, g in enumerate(grads):
            ref_g = torch.stack([ref_grads[h * per + i] for h in range(H)])
            assert torch.allclose(g, ref_g, rtol=1e-10, atol=1e-12), names[i]


def test_heads_differ_and_seed_reproduces():
    a = MultiHeadFeatureMap("polysketch", D, H, seed=1)
    b = MultiHeadFeatureMap("polysketch", D, H, seed=1)
    c = MultiHeadFeatureMap("polysketch", D, H, seed=1, layer_index=1)
    x = torch.randn(1, 1, 4, D).expand(1, H, 4, D)  # the same input in every head
    qa = a.query(x)
    for h in range(1, H):
        assert not torch.allclose(qa[:, 0], qa[:, h])
    assert torch.equal(qa, b.query(x))
    assert not torch.allclose(qa, c.query(x))
    assert len({head_seed(1, layer, h) for layer in range(4) for h in range(8)}) == 32


def test_trainable_params_are_registered_and_train():
    mh = MultiHeadFeatureMap("llops", D, H, seed=0)
    params = dict(mh.named_parameters())
    assert set(params) == {"map__theta_q", "map__theta_k"}
    assert params["map__theta_q"].shape[0] == H and params["map__theta_q"].requires_grad
    x = torch.randn(2, H, 4, D)
    (mh.query(x) * mh.key(x)).sum().backward()
    assert params["map__theta_q"].grad.abs().sum() > 0


def test_state_dict_round_trip_and_to_float64():
    a = MultiHeadFeatureMap("positive", D, H, seed=3)
    b = MultiHeadFeatureMap("positive", D, H, seed=4)
    x = torch.randn(2, H, 4, D)
    assert not torch.allclose(a.query(x), b.query(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.query(x), b.query(x))
    a64 = a.to(torch.float64)
    assert a64.query(x.double()).dtype == torch.float64


def test_the_repr_names_every_option_of_the_heads_maps():
    """The heads' own maps live in a stacked state (no submodule shows them): the repr names
    their options, e.g. a training-only loss that changes no output."""
    heads = MultiHeadFeatureMap("soft_hash", 8, 2, num_features=6, bucket_balance=0.01,
                                bucket_balance_form="usage")  # fmt: skip
    assert heads.vectorized
    text = repr(heads)
    assert "bucket_balance=0.01" in text and "bucket_balance_form='usage'" in text
    assert "num_features=6" in text
    assert ", num_features" not in repr(MultiHeadFeatureMap("soft_hash", 8, 2))


def test_redraw_changes_buffers_reproducibly():
    a = MultiHeadFeatureMap("polysketch", D, H, seed=0)
    b = MultiHeadFeatureMap("polysketch", D, H, seed=0)
    before = a.map__leaf_gaussian.clone()
    a.redraw_(torch.Generator().manual_seed(9))
    b.redraw_(torch.Generator().manual_seed(9))
    assert not torch.equal(before, a.map__leaf_gaussian)
    assert torch.equal(a.map__leaf_gaussian, b.map__leaf_gaussian)
    assert not torch.equal(a.map__leaf_gaussian[0], a.map__leaf_gaussian[1])
    # head_map exposes exactly the stacked tensors of that head
    assert torch.equal(a.head_map(1).leaf_gaussian, a.map__leaf_gaussian[1])


@pytest.mark.parametrize("name,kw", [("soft_hash", {"num_features": 6}), ("llops", {"degree": 2}),
                                     ("polysketch", {"nonnegative": True})])  # fmt: skip
def test_a_state_loads_across_the_stacked_and_the_per_head_layouts(name, kw, monkeypatch):
    """A map vmapped here may fall back to the loop elsewhere (its probe raising under another
    torch): each layout loads the other's state_dict (strict), with equal features."""
    stacked = MultiHeadFeatureMap(name, D, H, seed=3, **kw)
    assert stacked.vectorized
    with torch.no_grad():
        for p in stacked.parameters():  # not the draw the other gets from its own seed
            p.add_(torch.randn_like(p))
    monkeypatch.setattr(heads, "_VMAP_OK", {})
    monkeypatch.setattr(MultiHeadFeatureMap, "_vmap_works", lambda self, feature_map: False)
    looped = MultiHeadFeatureMap(name, D, H, seed=4, **kw)
    assert not looped.vectorized and set(looped.state_dict()) != set(stacked.state_dict())
    x = torch.randn(2, H, 5, D)
    looped.load_state_dict(stacked.state_dict())
    # the two layouts sum in other orders: equal up to fp64 rounding (eps 1.1e-16 · D terms)
    torch.testing.assert_close(looped.double().query(x.double()), stacked.double().query(
        x.double()), rtol=1e-12, atol=1e-14)  # fmt: skip
    looped, stacked = looped.float(), stacked.float()
    again = MultiHeadFeatureMap(name, D, H, seed=5, **kw)  # the loop layout again
    again.load_state_dict(looped.state_dict())
    monkeypatch.undo()
    back = MultiHeadFeatureMap(name, D, H, seed=6, **kw)
    assert back.vectorized
    back.load_state_dict(looped.state_dict())
    torch.testing.assert_close(back.key(x), stacked.key(x), rtol=0, atol=0)
    torch.testing.assert_close(again.key(x), looped.key(x), rtol=0, atol=0)


def test_hybrid_clustered_falls_back_to_loop():
    mh = MultiHeadFeatureMap("hybrid_clustered", D, 2, seed=0, num_features=4)
    assert not mh.vectorized
    q, k = torch.randn(2, 2, 20, D) * 0.3, torch.randn(2, 2, 20, D) * 0.3
    mh.fit_(q, k)
    out = mh.query(q)
    ref = torch.stack([mh.maps[h].query(q[:, h]) for h in range(2)], 1)
    assert torch.equal(out, ref)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="num_heads"):
        MultiHeadFeatureMap("elu", D, 0)
    with pytest.raises(ValueError, match="seed"):
        MultiHeadFeatureMap("polysketch", D, H, seed=-1)
    with pytest.raises(ValueError, match="map_kwargs"):
        MultiHeadFeatureMap("polysketch", D, H, generator=torch.Generator())
    mh = MultiHeadFeatureMap("elu", D, H)
    with pytest.raises(ValueError, match="x"):
        mh.query(torch.randn(2, H + 1, 4, D))
    with pytest.raises(ValueError, match="unknown feature map"):
        MultiHeadFeatureMap("nope", D, H)


def test_seed_beyond_64_bits_and_deterministic_maps_get_a_seed():
    with pytest.raises(ValueError, match=r"^seed must be < 2\*\*64"):
        MultiHeadFeatureMap("polysketch", D, H, seed=2**64)
    # every map takes seed= now, deterministic ones ignore it: one code path for all
    a, b = MultiHeadFeatureMap("taylor", D, H, seed=1), MultiHeadFeatureMap("taylor", D, H, seed=2)
    x = torch.randn(2, H, 3, D)
    assert torch.equal(a.query(x), b.query(x))


BATCHED = [
    ("polysketch", {"nonnegative": True}),  # the psf presets' sketch (degree 2, Gaussian)
    ("polysketch", {"degree": 1}),
    ("polysketch", {"degree": 3}),  # e1 leaves complete the tree
    ("polysketch", {"degree": 4, "num_features": 8, "output_scale": 0.3}),
    ("polysketch", {"projection": "product", "degree": 3}),
    ("hedgehog", {}),
    ("hedgehog", {"shared": True, "num_features": 5, "output_scale": 2.0}),
    ("soft_hash", {"num_features": 12}),
    ("soft_hash", {"num_features": 16, "factors": 2, "output_scale": 2.0}),
    ("soft_hash", {"num_features": 9, "factors": 2, "unit_directions": True}),
    ("soft_hash", {"num_features": 6, "temperature_rate": 10.0, "temperature": 3.0}),
    ("soft_hash", {"num_features": 9, "factors": 2, "linear_weight": 0.2, "output_scale": 2.0}),
    ("soft_hash", {"num_features": 7, "linear_weight": 0.2, "linear_offset": 2.5}),
    (
        "soft_hash",
        {
            "num_features": 6,
            "shared": True,
            "learn_temperature": False,
            "temperature": 2.0,
            "output_scale": 3.0,
        },
    ),
]


@pytest.mark.parametrize("name,kw", BATCHED, ids=[c[0] + str(i) for i, c in enumerate(BATCHED)])
def test_batched_heads_form_equals_the_vmapped_map(name, kw):
    """nn.heads_batched: all heads by batched matmuls, no vmap: the same values, gradients."""
    mh = MultiHeadFeatureMap(name, D, H, seed=3, layer_index=1, **kw).double()
    assert mh._batched is not None
    x = torch.randn(2, 4, H, 5, D, dtype=torch.float64, requires_grad=True)  # extra lead dim
    for role in ("query", "key", "query_stabilized"):
        fast = getattr(mh, role)(x)
        mh.use_batched = False
        try:
            slow = getattr(mh, role)(x)
        finally:
            mh.use_batched = True
        assert fast.shape == slow.shape and fast.dtype == slow.dtype
        assert (fast - slow).abs().max() <= 1e-13 * slow.abs().max()
        w = torch.randn_like(fast)
        params = [x, *mh.parameters()]
        g1 = torch.autograd.grad((fast * w).sum(), params, allow_unused=True)
        g2 = torch.autograd.grad((slow * w).sum(), params, allow_unused=True)
        for a, b in zip(g1, g2, strict=True):  # None: a key weight in a query call
            assert (a is None) == (b is None)
            if a is not None:
                assert (a - b).abs().max() <= 1e-12 * b.abs().max().clamp_min(1e-300)
    x32 = x.detach().float()
    mh32 = mh.float()
    with torch.no_grad():
        fast = mh32.query(x32)
        mh32.use_batched = False
        slow = mh32.query(x32)
    assert fast.dtype == torch.float32 and (fast - slow).abs().max() <= 1e-5 * slow.abs().max()


def test_batched_soft_hash_one_row_equals_the_row_of_a_long_input():
    """soft_hash scales the T×F logits for T < D and W otherwise: a decoding step's one row
    equals that row computed among more than D rows, values and gradients."""
    mh = MultiHeadFeatureMap("soft_hash", D, H, seed=2, num_features=7).double()
    long = torch.randn(2, H, D + 3, D, dtype=torch.float64, requires_grad=True)
    row = long.detach()[..., 4:5, :].clone().requires_grad_()
    for role in ("query", "key"):
        many, one = getattr(mh, role)(long), getattr(mh, role)(row)
        assert (many[..., 4:5, :] - one).abs().max() <= 1e-14
        w = torch.randn_like(one)
        params = list(mh.parameters())
        g_many = torch.autograd.grad((many[..., 4:5, :] * w).sum(), params, allow_unused=True)
        g_one = torch.autograd.grad((one * w).sum(), params, allow_unused=True)
        for a, b in zip(g_many, g_one, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert (a - b).abs().max() <= 1e-12 * b.abs().max().clamp_min(1e-300)


def test_batched_sketch_follows_redraws_and_moves():
    """The composed sketch matrices kept between decoding calls are rebuilt when the buffers
    change (redraw, load_state_dict, .to()) and never leak into autograd."""
    mh = MultiHeadFeatureMap("polysketch", D, H, seed=0, nonnegative=True)
    x = torch.randn(1, H, 1, D)
    with torch.inference_mode():
        before = mh.query(x)
        assert torch.equal(mh.query(x), before)  # from the kept matrices
        mh.redraw_(torch.Generator().manual_seed(9))
        after = mh.query(x)
    assert not torch.allclose(after, before)
    exact = copy.deepcopy(mh).double()
    exact.use_batched = False
    exact64 = exact
    exact = exact.query(x.double())
    mh.use_batched = False
    # the reference path, in three shapes; the batched one rounds in others (issue 69)
    per_head = per_token_in_other_shapes(mh.query, x)
    assert_as_accurate(after, per_head, exact,
                       sigma=lambda: rounding_sigma(lambda: exact64.query(x.double())))
    mh.use_batched = True
    other = MultiHeadFeatureMap("polysketch", D, H, seed=4, nonnegative=True)
    with torch.no_grad():
        mh.load_state_dict(other.state_dict())
        assert torch.equal(mh.query(x), other.query(x))  # the same matrices, the same shapes
        assert torch.allclose(mh.double().query(x.double()), other.double().query(x.double()))
    y = x.requires_grad_()
    (g,) = torch.autograd.grad(mh.float().query(y).sum(), y)  # after inference-mode calls
    assert torch.isfinite(g).all()
