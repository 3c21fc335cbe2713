"""``TransformerLM`` under context parallelism (gloo, 2 and 4 forked ranks) equals the
single-process model on the whole sequence: logits and every parameter's gradient (summed
over the ranks, as the training loop reduces them), for psf_random, psf_mixed, the short
convolution, soft_hash_local's window branch and sliding_window, packed documents, T not
divisible by the ranks and T < ranks (empty shards).
fp64 to 1e-10 relative; fp32 within rounding (1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from numerics import assert_as_accurate
from polysketch.distributed import shard_bounds
from polysketch.nn import TransformerConfig, TransformerLM
from test_distributed_harness import rel, run_ranks

CASES = {
    "psf_random": {"attention": "psf_random"},
    "psf_mixed_conv": {"attention": "psf_mixed", "short_conv": 3},
    "random_conv_T3": {"attention": "psf_random", "short_conv": 4, "T": 3},
    "mixed_T2": {"attention": "psf_mixed", "T": 2},
    "packed_conv": {"attention": "psf_random", "short_conv": 3, "cu": [0, 5, 6, 19, 30, 37]},
    "hedgehog_packed": {"attention": "hedgehog", "cu": [0, 18, 19, 37]},
    "padded_conv": {"attention": "psf_random", "short_conv": 3, "pad": True},
    "padded_T3": {"attention": "hedgehog", "short_conv": 2, "pad": True, "T": 3},
    # soft_hash_local's form: a soft_hash branch beside an exact window; 13 keys back reach
    # two ranks back on 4 ranks (shards of 10, 9, 9, 9), 2 back at T = 3 cross empty shards
    "soft_hash_window": {
        "attention": "soft_hash_1k",
        "local_window": 14,
        "map_kwargs": {"num_features": 8, "temperature": 8.0},
    },
    "soft_hash_window_shared": {  # one projection for both branches, product buckets
        "attention": "soft_hash_1k",
        "local_window": 14,
        "local_shared": True,
        "map_kwargs": {"num_features": 9, "factors": 2, "temperature": 8.0},
    },
    "soft_hash_window_one_head": {  # one soft_hash head beside a two-head window
        "attention": "soft_hash_1k",
        "local_window": 14,
        "global_heads": 1,
        "map_kwargs": {"num_features": 8, "temperature": 8.0},
    },
    "soft_hash_far_window": {  # soft_hash_far: the blocks before the own one, beside a window
        "attention": "soft_hash_far",
        "local_window": 8,
        "global_heads": 1,
        "map_kwargs": {"num_features": 8},
    },
    "soft_hash_far_surrogate": {  # and the training-only surrogate gradient (nn.core)
        "attention": "soft_hash_far",
        "local_window": 8,
        "global_heads": 1,
        "map_kwargs": {"num_features": 8},
        "gradient_surrogate": 0.5,
    },
    "window_packed": {"attention": "sliding_window", "window": 6, "cu": [0, 5, 6, 19, 30, 37]},
    "soft_hash_window_T3": {
        "attention": "soft_hash_1k",
        "local_window": 3,
        "T": 3,
        "map_kwargs": {"num_features": 8},
    },
}


def _model(c: dict, dtype) -> TransformerLM:
    """The same model on every process: the short convolution's bias comes from torch's
    global RNG (the other weights from ``config.seed``)."""
    torch.manual_seed(0)
    return TransformerLM(_config(c)).to(dtype)


def _config(c: dict) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=29, block_size=64, n_layer=2, n_head=2, n_embd=16, chunk_size=8,
        attention=c["attention"], short_conv=c.get("short_conv", 0), seed=3,
        local_window=c.get("local_window"), window=c.get("window"),
        local_shared=c.get("local_shared"), global_heads=c.get("global_heads"),
        map_kwargs=c.get("map_kwargs", {}), gradient_surrogate=c.get("gradient_surrogate", 0.0),
    )  # fmt: skip


def _inputs(name: str, c: dict):
    """idx (2, T), the loss weights (2, T, V) (zero at pads) and the key padding mask or None:
    row 0 left-padded, row 1 with pads in the middle (and at the end when T >= 8)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    t = c.get("T", 37)
    idx = torch.randint(0, 29, (2, t), generator=g)
    weight = torch.randn(2, t, 29, generator=g, dtype=torch.float64)
    keep = None
    if c.get("pad"):
        keep = torch.ones(2, t, dtype=torch.bool)
        if t >= 8:
            keep[0, :5] = keep[1, 10:15] = keep[1, -2:] = False
        else:  # T = 3: a pad in each row, two real tokens (queries see more than one key)
            keep[0, 0] = keep[1, 1] = False
        weight = weight * keep[..., None]
    return idx, weight, keep


def _forward(name: str, dtype, lo: int, hi: int, group) -> dict:
    c = CASES[name]
    model = _model(c, dtype)
    idx, weight, keep = _inputs(name, c)
    keep = None if keep is None else keep[:, lo:hi]
    logits, _ = model(idx[:, lo:hi], cp_group=group, cu_seqlens=c.get("cu"),
                      key_padding_mask=keep)  # fmt: skip
    (logits * weight[:, lo:hi].to(dtype)).sum().backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in
             model.named_parameters()}  # fmt: skip
    return {"logits": _real(logits, keep), "grads": grads}


def _real(logits, keep):
    """The logits at real tokens (pads' outputs are meaningless: zeroed)."""
    return logits.detach() if keep is None else logits.detach() * keep[..., None]


def _rank(rank: int, world: int, name: str, dtype) -> dict:
    t = CASES[name].get("T", 37)
    lo, hi = shard_bounds(t, world, rank)
    return _forward(name, dtype, lo, hi, group=dist.group.WORLD)


def _single(name: str, dtype) -> dict:
    """The whole sequence on one process (packed: ``cu_seqlens`` without a group, itself
    checked against each document alone below)."""
    c = CASES[name]
    model = _model(c, dtype)
    idx, weight, keep = _inputs(name, c)
    logits, _ = model(idx, cu_seqlens=c.get("cu"), key_padding_mask=keep)
    (logits * weight.to(dtype)).sum().backward()
    return {"logits": _real(logits, keep),
            "grads": {n: p.grad for n, p in model.named_parameters()}}  # fmt: skip


def _check(results: list[dict], want: dict, tol: float) -> None:
    logits = torch.cat([r["logits"] for r in results], dim=1)
    assert logits.shape == want["logits"].shape
    assert rel(logits, want["logits"]) <= tol, rel(logits, want["logits"])
    total = torch.cat([g.flatten() for g in want["grads"].values()]).norm()
    for n, g in want["grads"].items():
        got = sum(r["grads"][n] for r in results)
        # relative to the tensor's norm, floored at 1e-6 of all gradients' norm: a gradient
        # that cancels to ~1e-9 of the others (hedgehog's key bias) carries rounding only
        err = float((got - g).norm() / torch.clamp(g.norm(), min=1e-6 * total))
        assert err <= tol, (n, err, rel(got, g))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_cp_model_equals_single_process_fp64(name, world):
    want = _single(name, torch.float64)
    _check(run_ranks(world, _rank, name, torch.float64), want, 1e-10)


def _single_in_other_shapes(name: str) -> list[dict]:
    """The fp32 single process in three shapes: the batch of two rows, each row alone (logits
    side by side, gradients summed) and the rows in reverse order (no pads nor packing: the
    same values, summed in other shapes)."""
    c = CASES[name]
    assert not c.get("pad") and not c.get("cu")
    idx, weight, _ = _inputs(name, c)

    def run(rows):
        model = _model(c, torch.float32)
        logits, _ = model(idx[rows])
        (logits * weight[rows].float()).sum().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    both, one, other = run([0, 1]), run([0]), run([1])
    flipped = run([1, 0])
    return [
        {"logits": both[0], "grads": both[1]},
        {"logits": torch.cat([one[0], other[0]]),
         "grads": {n: one[1][n] + other[1][n] for n in one[1]}},
        {"logits": flipped[0].flip(0),
         "grads": flipped[1]},
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["psf_random", "psf_mixed_conv"])
def test_cp_model_fp32_within_rounding(name):
    """In fp32 the shards sum in other orders than one process: the logits and every summed
    gradient are about as accurate, against the fp64 single process, as the fp32 single
    process in three shapes (``assert_as_accurate`` against the largest of their errors, not
    one draw: issue 69; a fixed tolerance would depend on the CPU's BLAS kernels). A summed
    gradient is two shards' partial sums, each as accurate as one process's, plus the
    rounding of their sum: within 3x, norm-wise (small tensors)."""
    want32, want64 = _single_in_other_shapes(name), _single(name, torch.float64)
    results = run_ranks(2, _rank, name, torch.float32)
    logits = torch.cat([r["logits"] for r in results], dim=1)
    assert logits.dtype == torch.float32
    assert_as_accurate(logits, [w["logits"] for w in want32], want64["logits"])
    for n, g in want64["grads"].items():
        got = sum(r["grads"][n] for r in results)
        assert_as_accurate(got, [w["grads"][n] for w in want32], g, factor=3.0, norm="fro")


@pytest.mark.parametrize("name", ["packed_conv", "window_packed"])
def test_packed_documents_equal_each_document_alone(name):
    """A packed row's logits (single process) equal each document's logits run alone."""
    c = CASES[name]
    model = _model(c, torch.float64)
    idx, _, _ = _inputs(name, c)
    packed, _ = model(idx, cu_seqlens=c["cu"])
    for a, b in zip(c["cu"], c["cu"][1:], strict=False):
        alone, _ = model(idx[:, a:b])
        assert rel(packed[:, a:b], alone) <= 1e-12, (a, b)


def _refusal(rank: int, world: int, attention: str) -> str:
    model = TransformerLM(_config({"attention": attention}))
    try:
        model(torch.zeros(1, 3, dtype=torch.long), cp_group=dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("attention", ["softmax", "polynomial"])
def test_cp_refuses_attentions_without_a_cp_op(attention):
    for message in run_ranks(2, _refusal, attention):
        assert f"attention={attention!r}" in message and "supported" in message
        assert "psf_mixed" in message and "linear" in message


def _padded_refusal(rank: int, world: int) -> str:
    model = TransformerLM(_config({"attention": "psf_mixed"}))
    keep = torch.tensor([[False, True, True]])
    try:
        model(torch.zeros(1, 3, dtype=torch.long), cp_group=dist.group.WORLD,
              key_padding_mask=keep)  # fmt: skip
    except ValueError as err:
        return str(err)
    return ""


def test_cp_refuses_padding_with_mixed_attention():
    for message in run_ranks(2, _padded_refusal):
        assert "key_padding_mask on a context-parallel shard needs a linear attention" in message


def test_packing_refuses_what_it_cannot_compute():
    idx = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="attention='softmax'.*supported"):
        TransformerLM(_config({"attention": "softmax"}))(idx, cu_seqlens=[0, 2, 6])
    with pytest.raises(ValueError, match="mixed attention with packed sequences"):
        TransformerLM(_config({"attention": "psf_mixed"}))(idx, cu_seqlens=[0, 2, 6])
    model = TransformerLM(_config({"attention": "psf_random"}))
    with pytest.raises(ValueError, match="key_padding_mask with cu_seqlens is not supported"):
        model(idx, cu_seqlens=[0, 2, 6], key_padding_mask=torch.ones(1, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end"):
        model(idx, cu_seqlens=[0, 2, 5])
    model.set_exact_attention(True)
    with pytest.raises(ValueError, match="warm start"):
        model(idx, cu_seqlens=[0, 2, 6])
