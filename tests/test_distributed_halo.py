"""Halos (gloo, 2 and 4 forked ranks): ``halo(x, w)`` is the w rows before each shard of the
whole sequence, taken from as many ranks as needed, with gradients sent back to their owners;
and ``cp_short_conv`` (``short_conv=K`` under context parallelism) equals ``ShortConv`` on the
whole sequence: outputs and gradients of the inputs, weight and bias, fp64 to 1e-10."""

from __future__ import annotations

import pytest
import torch

from polysketch.distributed import cp_short_conv, halo
from polysketch.nn.short_conv import ShortConv
from test_distributed_harness import bounds, combine, compare, grad_of, run_ranks

B, C = 2, 5
CONV_CASES = {
    "K4": {"K": 4},
    "K2_padding": {"K": 2, "padding": True},
    "K4_T3": {"K": 4, "T": 3},  # W=4: shards of one token, one empty
    "K4_T1": {"K": 4, "T": 1},
    "K3_uneven": {"K": 3, "padding": True, "split": {2: [1, 36], 4: [2, 0, 1, 34]}},
}
WIDTHS = (0, 1, 3, 12)


def _setting(name):
    c = {"T": 37, "padding": False, "split": {}}
    c.update(CONV_CASES[name])
    return c


def make(name):
    c = _setting(name)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    torch.manual_seed(7)
    conv = ShortConv(C, c["K"]).double()
    u = torch.randn(B, c["T"], C, generator=g, dtype=torch.float64)
    keep = torch.rand(B, c["T"], generator=g) > 0.3 if c["padding"] else None
    return c, conv, u, keep, torch.randn(B, c["T"], C, generator=g, dtype=torch.float64)


def _conv(name, lo, hi, world_tail):
    c, conv, u, keep, w = make(name)
    x = u[:, lo:hi].clone().requires_grad_()
    k = None if keep is None else keep[:, lo:hi]
    if world_tail:
        y = cp_short_conv(x, conv.weight, conv.bias, keep=k)
    else:
        y, _ = conv(x, keep=k)
    (y * w[:, lo:hi]).sum().backward()
    res = {"out": y.detach(), "u": grad_of(x)}
    res.update({f"param.{n}": p.grad for n, p in conv.named_parameters()})
    return res


def _rank_conv(rank, world, names):
    return {n: _conv(n, *bounds(_setting(n), world, rank), True) for n in names}


@pytest.mark.parametrize("world", [2, 4])
def test_short_conv_with_a_halo_equals_the_single_process_convolution(world):
    results = run_ranks(world, _rank_conv, list(CONV_CASES))
    failures = []
    for name in CONV_CASES:
        want = _conv(name, 0, _setting(name)["T"], False)
        got = combine(results, name, cat=("out", "u"))
        failures += [f"{name}: {line}" for line in compare(got, want, 1e-10)]
    assert not failures, "\n".join(failures)


def _rank_halo(rank, world, lengths):
    g = torch.Generator().manual_seed(1)
    full = torch.randn(3, sum(lengths), 2, generator=g, dtype=torch.float64)
    lo = sum(lengths[:rank])
    x = full[:, lo : lo + lengths[rank]].clone().requires_grad_()
    out = {}
    for width in WIDTHS:
        h = halo(x, width)
        weight = torch.arange(1.0, h.numel() + 1, dtype=h.dtype).view(h.shape) * (rank + 1)
        (grad,) = torch.autograd.grad((h * weight).sum(), x)
        out[width] = {"halo": h.detach(), "grad": grad}
    return out


@pytest.mark.parametrize("lengths", [[5, 4], [3, 0, 1, 9], [0, 0, 4, 2]], ids=str)
def test_halo_is_the_rows_before_the_shard_and_returns_their_gradients(lengths):
    results = run_ranks(len(lengths), _rank_halo, lengths)
    t = sum(lengths)
    for width in WIDTHS:
        full = torch.randn(3, t, 2, generator=torch.Generator().manual_seed(1),
                           dtype=torch.float64).requires_grad_()  # fmt: skip
        padded = torch.cat([full.new_zeros(3, width, 2), full], dim=1)
        loss = 0
        for rank, r in enumerate(results):
            start = sum(lengths[:rank])
            want = padded[:, start : start + width]  # rows start-w .. start-1 of the sequence
            assert torch.equal(r[width]["halo"], want.detach()), (width, rank)
            weight = torch.arange(1.0, want.numel() + 1, dtype=want.dtype).view(want.shape)
            loss = loss + (want * weight * (rank + 1)).sum()
        (grad,) = torch.autograd.grad(loss, full) if width else (torch.zeros_like(full),)
        got = torch.cat([r[width]["grad"] for r in results], dim=1)
        assert torch.equal(got, grad), width
