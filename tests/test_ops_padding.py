"""Key padding: a padded batch gives each sequence the output it gets alone."""

import pytest
import torch

from conftest import rel_err
from polysketch.ops import linear_attention, naive_linear_attention, polynomial_attention

F64 = torch.float64
LENGTHS = [5, 11, 8]
TMAX = 11


def sequences(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            (0.5 * torch.randn(2, n, 3, generator=g, dtype=F64)).exp(),  # (H, n, F) positive
            (0.5 * torch.randn(2, n, 3, generator=g, dtype=F64)).exp(),
            torch.randn(2, n, 4, generator=g, dtype=F64),
        )
        for n in LENGTHS
    ]


def pad_batch(seqs, side):
    """Stack to (B, H, TMAX, ·) with NaN in padded slots (they must never leak) and a mask."""
    qs, ks, vs, masks = [], [], [], []
    for q, k, v in seqs:
        n = q.shape[-2]
        lo = TMAX - n if side == "left" else 0
        sl = slice(lo, lo + n)
        bq, bk, bv = (
            torch.full((2, TMAX, x.shape[-1]), float("nan"), dtype=F64) for x in (q, k, v)
        )
        bq[:, sl], bk[:, sl], bv[:, sl] = q, k, v
        m = torch.zeros(1, TMAX, dtype=torch.bool)
        m[:, sl] = True
        qs.append(bq), ks.append(bk), vs.append(bv), masks.append(m)
    return torch.stack(qs), torch.stack(ks), torch.stack(vs), torch.stack(masks)  # mask (B,1,T)


@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize(
    "causal,side,algorithm",
    [(False, "left", "chunked"), (False, "right", "chunked"), (True, "right", "chunked"),
     (True, "right", "cumsum")],
)  # fmt: skip
def test_padded_batch_equals_each_sequence_alone(causal, side, algorithm, square):
    seqs = sequences()
    q, k, v, mask = pad_batch(seqs, side)
    q = torch.nan_to_num(q, nan=0.7)  # queries at padded slots are not used; keys/values stay NaN
    kw = {"causal": causal, "square": square, "denominator_offset": 0.5}
    out, state = linear_attention(
        q, k, v, key_padding_mask=mask, chunk_size=4, algorithm=algorithm, return_state=True, **kw
    )
    ref = naive_linear_attention(q, k, v, key_padding_mask=mask, **kw)
    for b, (sq, sk, sv) in enumerate(seqs):
        n = sq.shape[-2]
        lo = TMAX - n if side == "left" else 0
        alone, alone_state = linear_attention(sq, sk, sv, return_state=True, **kw)
        assert rel_err(out[b, :, lo : lo + n], alone) <= 1e-12
        assert rel_err(ref[b, :, lo : lo + n], alone) <= 1e-12
        # masked keys never enter the state
        assert rel_err(state.numerator[b], alone_state.numerator) <= 1e-12
        assert rel_err(state.denominator[b], alone_state.denominator) <= 1e-12
    assert bool(torch.isfinite(out).all())


def test_fully_masked_query_gets_zero_and_polynomial_padding():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 6, 3, generator=g, dtype=F64) for _ in range(3))
    mask = torch.tensor([[False, False, True, True, True, True]])
    out = linear_attention(q.exp(), k.exp(), v, causal=True, key_padding_mask=mask, chunk_size=4)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))  # no visible key -> 0
    ref = polynomial_attention(q[:, 2:], k[:, 2:], v[:, 2:], degree=2, causal=False)
    got = polynomial_attention(q[:, 2:], k, v, degree=2, causal=False, key_padding_mask=mask)
    assert rel_err(got, ref) <= 1e-12
