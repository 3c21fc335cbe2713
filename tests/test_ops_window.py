"""Sliding-window attention (``ops.window``): the O(T·w) block algorithm against the quadratic
reference, outputs and gradients in fp64, awkward lengths, key padding, both kernels; each on
the CPU path and on the accelerators' (``presented_device("cuda")``: the softmax window
without padding through SDPA)."""

import contextlib

import pytest
import torch

from conftest import rel_err, seeded
from polysketch._device import presented_device
from polysketch.ops import (
    naive_window_attention,
    polynomial_attention,
    softmax_attention,
    window_attention,
)


@pytest.fixture(params=["cpu", "cuda"])
def path(request):
    """The device branch ``window_attention`` takes: the CPU's blocks, or the accelerators'
    (SDPA for the softmax window without a key padding mask), on CPU tensors."""
    with presented_device(request.param) if request.param != "cpu" else contextlib.nullcontext():
        yield request.param


def _qkv(t, *, b=2, h=3, d=5, e=4, seed=0, scale=1.0):
    g = seeded(seed)
    q, k = (scale * torch.randn(b, h, t, d, generator=g, dtype=torch.float64) for _ in "qk")
    v = torch.randn(b, h, t, e, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("t", [1, 2, 6, 7, 8, 97])
@pytest.mark.parametrize("window", [1, 3, 7, 200])
@pytest.mark.parametrize("kernel", ["softmax", "polynomial"])
def test_blocks_equal_the_reference_outputs_and_gradients(t, window, kernel, path):
    q, k, v = (x.requires_grad_() for x in _qkv(t, scale=0.7))
    kw = {"window": window, "kernel": kernel, "degree": 4, "denominator_offset": 1.0}
    ours, ref = window_attention(q, k, v, **kw), naive_window_attention(q, k, v, **kw)
    assert rel_err(ours, ref) <= 1e-10
    w = torch.randn_like(ref)
    g1 = torch.autograd.grad((ours * w).sum(), (q, k, v))
    g2 = torch.autograd.grad((ref * w).sum(), (q, k, v))
    # all gradients together (w = 1 softmax: dq = dk = 0 up to the reference's rounding)
    assert (
        rel_err(torch.cat([g.flatten() for g in g1]), torch.cat([g.flatten() for g in g2])) <= 1e-10
    )


@pytest.mark.parametrize("kernel", ["softmax", "polynomial"])
def test_key_padding_and_nonfinite_padded_keys(kernel, path):
    q, k, v = (x.requires_grad_() for x in _qkv(23, seed=1))
    keep = torch.rand(2, 1, 23, generator=seeded(2)) > 0.3
    k2, v2 = (torch.where(keep[..., None], x, float("nan")) for x in (k, v))
    kw = {"window": 5, "kernel": kernel, "key_padding_mask": keep, "denominator_offset": 1.0}
    ours, ref = window_attention(q, k2, v2, **kw), naive_window_attention(q, k, v, **kw)
    assert rel_err(ours, ref) <= 1e-10 and torch.isfinite(ours).all()
    (gq,) = torch.autograd.grad(ours.sum(), q)
    assert torch.isfinite(gq).all()


@pytest.mark.parametrize("kernel", ["softmax", "polynomial"])
@pytest.mark.parametrize("window", [1, 4, 9])
def test_segments_keep_each_document_to_itself(kernel, window, path):
    """With document ids the blocks equal the reference, outputs and gradients, and each
    document equals the same attention on that document alone (no key of another one)."""
    q, k, v = (x.requires_grad_() for x in _qkv(29, seed=5, scale=0.7))
    bounds = [0, 3, 4, 12, 20, 29]  # documents of 3, 1, 8, 8 and 9 tokens
    seg = torch.repeat_interleave(torch.arange(5), torch.tensor(bounds).diff())
    keep = torch.rand(2, 1, 29, generator=seeded(6)) > 0.2
    for kpm in (None, keep):
        kw = {"window": window, "kernel": kernel, "denominator_offset": 1.0,
              "key_padding_mask": kpm, "segments": seg}  # fmt: skip
        ours, ref = window_attention(q, k, v, **kw), naive_window_attention(q, k, v, **kw)
        assert rel_err(ours, ref) <= 1e-10
        w = torch.randn_like(ref)
        g1 = torch.autograd.grad((ours * w).sum(), (q, k, v))
        g2 = torch.autograd.grad((ref * w).sum(), (q, k, v))
        assert rel_err(torch.cat([g.flatten() for g in g1]),
                       torch.cat([g.flatten() for g in g2])) <= 1e-10  # fmt: skip
    kw = {"window": window, "kernel": kernel, "denominator_offset": 1.0}
    ours = window_attention(q, k, v, segments=seg, **kw)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        alone = window_attention(*(x[..., lo:hi, :] for x in (q, k, v)), **kw)
        assert rel_err(ours[..., lo:hi, :], alone) <= 1e-12
    if window > 1:  # the documents matter (w = 1: each query sees only itself)
        assert rel_err(ours, window_attention(q, k, v, **kw)) > 1e-3


def test_the_band_is_the_last_w_keys(path):
    """Each row equals the exact attention over its own last w keys (itself included)."""
    q, k, v = _qkv(19, seed=3)
    w = 4
    sm = window_attention(q, k, v, window=w)
    poly = window_attention(q, k, v, window=w, kernel="polynomial", denominator_offset=1.0)
    for i in range(19):
        lo = max(0, i - w + 1)
        sl = slice(lo, i + 1)
        ref = softmax_attention(q[..., i : i + 1, :], k[..., sl, :], v[..., sl, :], causal=False)
        assert rel_err(sm[..., i : i + 1, :], ref) <= 1e-12
        ref = polynomial_attention(q[..., i : i + 1, :], k[..., sl, :], v[..., sl, :], degree=4,
                                   causal=False, denominator_offset=1.0)  # fmt: skip
        assert rel_err(poly[..., i : i + 1, :], ref) <= 1e-12
    # a window covering the sequence is plain causal attention
    assert (
        rel_err(window_attention(q, k, v, window=19), softmax_attention(q, k, v, causal=True))
        < 1e-12
    )


def test_causal_and_bf16(path):
    q, k, v = _qkv(40, seed=4)
    out = window_attention(q, k, v, window=6)
    k2, v2 = k.clone(), v.clone()
    k2[..., 30:, :] *= 100
    v2[..., 30:, :] = 7.0
    assert torch.equal(window_attention(q, k2, v2, window=6)[..., :30, :], out[..., :30, :])
    half = window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), window=6)
    same = naive_window_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), window=6)
    assert half.dtype == torch.bfloat16 and rel_err(half.double(), same.double()) < 1e-2


def test_bad_arguments_name_themselves():
    q, k, v = _qkv(5)
    with pytest.raises(ValueError, match="window"):
        window_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="kernel"):
        window_attention(q, k, v, window=2, kernel="relu")
    with pytest.raises(ValueError, match="same length"):
        window_attention(q[..., :3, :], k, v, window=2)
    with pytest.raises(ValueError, match="key_padding_mask"):
        window_attention(q, k, v, window=2, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="segments"):
        window_attention(q, k, v, window=2, segments=torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="segments"):
        window_attention(q, k, v, window=2, segments=torch.zeros(5))


def test_the_accelerator_path_runs_sdpa_for_the_softmax_window(monkeypatch):
    """On the accelerators' branch the softmax window without padding is one SDPA call (the
    fused kernel); with a key padding mask, or the polynomial kernel, the blocks run."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))  # fmt: skip
    q, k, v = _qkv(50)
    keep = torch.ones(2, 1, 50, dtype=torch.bool)
    with presented_device("cuda"):
        window_attention(q, k, v, window=8)
        assert len(calls) == 1
        window_attention(q, k, v, window=8, key_padding_mask=keep)
        window_attention(q, k, v, window=8, kernel="polynomial")
    window_attention(q, k, v, window=8)  # the CPU's blocks
    assert len(calls) == 1
