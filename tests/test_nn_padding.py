"""Padding means removal: a padded batch computes, at its real tokens, what each row computes
alone (``polysketch.nn.padding``), for every attention, with RoPE, the short convolution and
decoding; left-padded generation equals per-row generation (issue 22 item 1)."""

import pytest
import torch

from conftest import rel_err, seeded
from polysketch.nn import KernelAttention, TransformerConfig, TransformerLM
from polysketch.nn.padding import compaction, gather_time, real_positions

E, H = 16, 2

# (attention, layer keywords): every preset, mixed=True with other maps, plain maps
CASES = [
    ("softmax", {}),
    ("polynomial", {}),
    ("psf_random", {}),
    ("psf_learned", {}),
    ("psf_mixed", {}),
    ("sliding_window", {"window": 3}),
    ("sliding_window", {"window": 5, "kernel": "polynomial"}),
    ("hedgehog", {"mixed": True, "degree": 2}),
    ("positive", {}),
    ("elu", {"mixed": True}),
    ("tensor_power", {"degree": 2, "square": True, "mixed": True}),
    ("soft_hash_far", {"num_features": 12}),
]
IDS = [f"{a}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for a, kw in CASES]


def _layer(attention, **kw):
    torch.manual_seed(0)
    return KernelAttention(E, H, attention=attention, chunk_size=4, **kw).double()


def _masks():
    """Rows of 13 steps: left padding 6, right padding 3, pads in the middle, none."""
    keep = torch.ones(4, 13, dtype=torch.bool)
    keep[0, :6] = False
    keep[1, 10:] = False
    keep[2, [2, 3, 7]] = False
    return keep


def test_compaction_and_positions():
    keep = _masks()
    perm, inverse = compaction(keep)
    x = torch.arange(13).expand(4, 13)
    moved = x.gather(1, perm)
    for b in range(4):
        n = int(keep[b].sum())
        assert torch.equal(moved[b, :n], x[b][keep[b]])  # real tokens first, in order
    assert torch.equal(moved.gather(1, inverse), x)
    y = torch.randn(4, 3, 13, 2)
    assert torch.equal(gather_time(gather_time(y, perm, dim=2), inverse, dim=2), y)
    pos = real_positions(keep, torch.tensor([0, 2, 0, 5]))
    assert pos[0, 6] == 0 and pos[1, 9] == 2 + 9 and pos[2, 8] == 5
    assert pos[2, 4] == 2  # the real token after two pads is the third


@pytest.mark.parametrize("attention,kw", CASES, ids=IDS)
@pytest.mark.parametrize("short_conv", [0, 3])
def test_padded_batch_equals_each_row_alone(attention, kw, short_conv):
    layer = _layer(attention, short_conv=short_conv, **kw)
    keep = _masks()
    x = torch.randn(4, 13, E, generator=seeded(1), dtype=torch.float64)
    x = torch.where(keep[..., None], x, 1e3)  # pad content must not matter
    y = layer(x, key_padding_mask=keep)
    for b in range(4):
        alone = layer(x[b : b + 1, keep[b]])
        assert rel_err(y[b, keep[b]], alone[0]) < 1e-10, b


@pytest.mark.parametrize("attention,kw", CASES, ids=IDS)
def test_padded_decoding_equals_each_row_alone(attention, kw):
    """Prefill a padded batch (pads left, right, in the middle), then 6 steps: each row's
    outputs equal its own unpadded prefill + steps (RoPE positions, block grids, windows)."""
    layer = _layer(attention, short_conv=2, **kw)
    keep = _masks()
    x = torch.randn(4, 13 + 6, E, generator=seeded(2), dtype=torch.float64)
    cache = layer.new_cache()
    first = layer(x[:, :13], key_padding_mask=keep, cache=cache)
    steps = [layer(x[:, t : t + 1], cache=cache) for t in range(13, 19)]
    got = torch.cat(steps, 1)
    for b in range(4):
        seq = torch.cat([x[b, :13][keep[b]], x[b, 13:]])[None]
        alone = layer(seq)
        n = int(keep[b].sum())
        assert rel_err(first[b, keep[b]], alone[0, :n]) < 1e-10, b
        assert rel_err(got[b], alone[0, n:]) < 1e-10, b


def test_a_padded_step_changes_nothing():
    """A padded time step during decoding: no output that matters, no state change."""
    for attention, kw in CASES:
        layer = _layer(attention, **kw)
        x = torch.randn(2, 9, E, generator=seeded(3), dtype=torch.float64)
        a, b = layer.new_cache(), layer.new_cache()
        layer(x[:, :5], cache=a)
        layer(x[:, :5], cache=b)
        layer(x[:, 5:6], cache=a, key_padding_mask=torch.tensor([[False], [True]]))
        ya = layer(x[:, 6:9], cache=a)
        layer(x[:, 5:6], cache=b)
        yb = layer(x[:, 6:9], cache=b)
        assert rel_err(ya[1], yb[1]) < 1e-10, attention  # row 1 stepped in both
        alone = layer(torch.cat([x[:1, :5], x[:1, 6:9]], 1))
        assert rel_err(ya[0], alone[0, 5:]) < 1e-10, attention  # row 0 skipped the pad


V = 23


@pytest.mark.parametrize(
    "attention,kw",
    [
        ("psf_mixed", {}),
        ("psf_random", {}),
        ("softmax", {}),
        ("hedgehog", {"mixed": True}),
        ("sliding_window", {"window": 4}),
        ("psf_random", {"local_window": 3}),
        (
            "soft_hash_far",
            {"local_window": 4, "global_heads": 1, "map_kwargs": {"num_features": 12}},
        ),
    ],  # fmt: skip
)
def test_left_padded_generate_equals_each_row_alone(attention, kw):
    cfg = TransformerConfig(vocab_size=V, n_layer=2, n_head=2, n_embd=16, attention=attention,
                            chunk_size=4, short_conv=2, **kw)  # fmt: skip
    model = TransformerLM(cfg).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # decisive argmax
    lengths = [11, 7, 3]
    prompts = [torch.randint(0, V, (n,), generator=seeded(n)) for n in lengths]
    t0 = max(lengths)
    idx = torch.zeros(3, t0, dtype=torch.long)
    keep = torch.zeros(3, t0, dtype=torch.bool)
    for b, p in enumerate(prompts):
        idx[b, t0 - len(p) :], keep[b, t0 - len(p) :] = p, True
    out = model.generate(idx, 12, temperature=0.0, key_padding_mask=keep)
    logits, _ = model(idx, key_padding_mask=keep)
    for b, p in enumerate(prompts):
        alone = model.generate(p[None], 12, temperature=0.0)
        assert torch.equal(out[b, t0:], alone[0, len(p) :]), b
        ref, _ = model(p[None])
        assert rel_err(logits[b, keep[b]], ref[0]) < 1e-10
    assert torch.equal(out[:, :t0], idx)


def test_generate_padding_errors():
    model = TransformerLM(TransformerConfig(vocab_size=V, n_layer=1, n_head=2, n_embd=16))
    idx = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="key_padding_mask"):
        model.generate(idx, 2, key_padding_mask=torch.ones(2, 3, dtype=torch.bool))
    empty = torch.ones(2, 4, dtype=torch.bool)
    empty[1] = False
    with pytest.raises(ValueError, match="at least one real token"):
        model.generate(idx, 2, key_padding_mask=empty)
