"""kernel_attention: feature map + linear attention, square honored, rematerialization."""

import pytest
import torch

from conftest import rel_err
from polysketch import features, kernel_attention
from polysketch.ops import linear_attention, naive_linear_attention, polynomial_attention

F64 = torch.float64


def qkv(t=20, d=4, e=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, t, n, generator=g, dtype=F64) for n in (d, d, e))


@pytest.mark.parametrize("causal", [False, True])
def test_exact_maps_give_polynomial_attention(causal):
    q, k, v = qkv()
    ref = polynomial_attention(q, k, v, degree=2, causal=causal, denominator_offset=1.0)
    for fmap in (features.create("tensor_power", 4, degree=2),
                 features.create("tensor_power", 4, degree=1, square=True)):  # fmt: skip
        out = kernel_attention(q, k, v, fmap, causal=causal, chunk_size=8, denominator_offset=1.0)
        assert rel_err(out, ref) <= 1e-10


MAPS = [("polysketch", {"nonnegative": True, "seed": 1}), ("llops", {"seed": 1}),
        ("positive", {"seed": 1})]  # fmt: skip


@pytest.mark.parametrize("name,kw", MAPS)
def test_any_map_through_the_contract(name, kw):
    fmap = features.create(name, 4, **kw).to(F64)
    q, k, v = qkv(seed=2)
    with torch.no_grad():
        out = kernel_attention(q, k, v, fmap, causal=True, chunk_size=8, denominator_offset=1.0)
        ref = naive_linear_attention(
            fmap.query(q), fmap.key(k), v, causal=True, square=fmap.square, denominator_offset=1.0
        )
    assert rel_err(out, ref) <= 1e-10


def _saved_numel(fn):
    """Total number of elements autograd saves for backward while running fn()."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(sizes)


def test_checkpoint_same_values_and_gradients_less_memory():
    fmap = features.create("llops", 4, seed=3).to(F64)  # learned: has parameters
    q, k, v = (x.requires_grad_(True) for x in qkv(t=64, seed=3))
    params = [p for p in fmap.parameters() if p.requires_grad]
    assert params
    results = []
    for ckpt in (False, True):
        out, saved = _saved_numel(
            lambda ckpt=ckpt: kernel_attention(
                q, k, v, fmap, causal=True, chunk_size=16, denominator_offset=1.0, checkpoint=ckpt
            )  # fmt: skip
        )
        grads = torch.autograd.grad(out.square().sum(), [q, k, v, *params])
        results.append((out.detach(), grads, saved))
    (o1, g1, s1), (o2, g2, s2) = results
    assert torch.equal(o1, o2)
    for a, b in zip(g1, g2, strict=True):
        assert rel_err(b, a) <= 1e-12
    assert s2 < s1 / 2  # rematerialization stores (far) less for backward


def test_return_state_and_initial_state_through_kernel_attention():
    fmap = features.create("tensor_power", 4, degree=1, square=True)
    q, k, v = qkv(seed=4)
    init = kernel_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :], fmap, causal=True,
                            return_state=True)[1]  # fmt: skip
    for ckpt in (False, True):
        out, state = kernel_attention(
            q[..., 8:, :], k[..., 8:, :], v[..., 8:, :], fmap, causal=True, initial_state=init,
            return_state=True, checkpoint=ckpt,
        )  # fmt: skip
        full, fstate = linear_attention(q, k, v, causal=True, square=True, return_state=True)
        assert rel_err(out, full[..., 8:, :]) <= 1e-12
        assert rel_err(state.numerator, fstate.numerator) <= 1e-12 and state.length == 20
