"""TransformerLM(idx, targets): float targets are refused, out-of-range ids name vocab_size."""

import pytest
import torch

from polysketch.nn import TransformerConfig, TransformerLM

V = 32


@pytest.fixture(scope="module")
def model():
    return TransformerLM(TransformerConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2,
                                           n_embd=16, chunk_size=4))  # fmt: skip


def _idx():
    return torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))


def test_float_targets_are_refused_not_truncated(model):
    idx = _idx()
    with pytest.raises(TypeError, match="targets must be integer token ids"):
        model(idx, idx.float() + 0.7)  # .long() would have made them idx, silently
    with pytest.raises(TypeError, match="targets"):
        model(idx, idx.to(torch.bfloat16))


@pytest.mark.parametrize("bad", [V, 1000, -1, -101])
def test_out_of_range_targets_name_vocab_size(model, bad):
    idx = _idx()
    targets = idx.clone()
    targets[1, 3] = bad
    with pytest.raises(ValueError, match=f"vocab_size={V}"):
        model(idx, targets)


def test_valid_targets_ignored_positions_and_int32(model):
    idx = _idx()
    targets = idx.clone()
    targets[:, :2] = -100
    _, loss = model(idx, targets)
    _, loss32 = model(idx, targets.int())
    logits, _ = model(idx)
    want = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100
    )
    torch.testing.assert_close(loss, want)
    assert torch.equal(loss, loss32)


def test_compiled_model_checks_targets_without_a_graph_break(model):
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    idx = _idx()
    _, loss = compiled(idx, idx)
    assert torch.isfinite(loss)
    with pytest.raises(RuntimeError, match="vocab_size"):
        compiled(idx, torch.full_like(idx, V))
