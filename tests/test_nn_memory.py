"""What a training step keeps for backward (issue 42): no per-token features of a map.

soft_hash's features are F = 1,920 bucket probabilities per token and head, against 2·64 floats
of a KV cache; kept for backward they made ``soft_hash_far_local`` keep 3.4x softmax's bytes.
The attention core recomputes the features and the attention in the backward pass instead
(``AttentionCore.checkpoint``, on by default for the linear, mixed and window forms), as
FlashAttention recomputes its scores. Counted with ``saved_tensors_hooks``, each storage once.
"""

import pytest
import torch

from polysketch.nn import TransformerConfig, TransformerLM
from polysketch.nn.core import AttentionCore

T = 4096
SIZE = dict(vocab_size=256, block_size=T, n_layer=2, n_head=2, n_embd=128, chunk_size=64)


def saved_mib(model: TransformerLM, idx: torch.Tensor) -> float:
    """MiB autograd keeps for backward in a forward with loss, each storage counted once."""
    storages: dict = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(storages.values()) / 2**20


@pytest.fixture(scope="module")
def softmax_mib():
    idx = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    return saved_mib(TransformerLM(TransformerConfig(attention="softmax", **SIZE)), idx)


@pytest.mark.parametrize("name", ["psf_random", "psf_mixed", "soft_hash_local",
                                  "soft_hash_far_local"])  # fmt: skip
def test_a_training_step_keeps_at_most_a_quarter_more_than_softmax(name, softmax_mib):
    idx = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    model = TransformerLM(TransformerConfig(attention=name, **SIZE))
    mib = saved_mib(model, idx)
    assert mib <= 1.25 * softmax_mib, (name, mib, softmax_mib)
    for core in model.modules():  # without the recomputation it keeps far more: the test bites
        if isinstance(core, AttentionCore):
            core.checkpoint = False
    assert saved_mib(model, idx) > 1.25 * softmax_mib or name == "psf_mixed"


@pytest.mark.parametrize("name,kw", [
    ("soft_hash_far_local", {"map_kwargs": {"num_features": 24}}),
    ("psf_random", {}),
    ("hedgehog", {}),
    ("sliding_window", {"window": 5}),
    ("soft_hash_local", {"map_kwargs": {"num_features": 24}}),
])  # fmt: skip
def test_recomputing_changes_neither_outputs_nor_any_gradient(name, kw):
    """fp64: the recomputed backward equals the stored one for every parameter (the map's
    W and τ, the surrogate's gradient through q and k, the window's projections)."""
    config = TransformerConfig(attention=name, vocab_size=32, block_size=64, n_layer=2,
                               n_head=2, n_embd=32, chunk_size=8, **kw)  # fmt: skip
    idx = torch.randint(0, 32, (2, 41), generator=torch.Generator().manual_seed(1))
    results = []
    for recompute in (True, False):
        model = TransformerLM(config).double()
        cores = [m for m in model.modules() if isinstance(m, AttentionCore)]
        for core in cores:
            core.checkpoint = recompute
        assert all(core.recomputes() == recompute for core in cores)
        logits, loss = model(idx, idx)
        grads = torch.autograd.grad(loss, [p for p in model.parameters()])
        results.append((logits, grads))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-15)


def test_recomputation_is_the_default_where_features_are_kept_and_off_elsewhere():
    def forms(name, **kw):
        model = TransformerLM(TransformerConfig(attention=name, vocab_size=16, n_layer=1,
                                                n_head=2, n_embd=16, **kw))  # fmt: skip
        return {(m.form, m.recomputes()) for m in model.modules() if isinstance(m, AttentionCore)}

    assert forms("psf_random") == {("linear", True)}
    assert forms("soft_hash_far_local") == {("mixed", True), ("window", True)}
    assert forms("softmax") == {("softmax", False)}
    assert forms("polynomial") == {("polynomial", False)}
    with torch.no_grad():  # nothing to recompute without autograd
        model = TransformerLM(TransformerConfig(attention="psf_random", vocab_size=16,
                                                n_layer=1, n_head=2, n_embd=16))  # fmt: skip
        assert not model.blocks[0].attn.recomputes()


def test_the_models_recompute_switch_reaches_every_core_and_changes_no_result():
    """``TransformerConfig.recompute`` (default True: each core's default, the linear, mixed
    and window forms recompute); False: no core recomputes. fp64, one step's loss and every
    gradient equal; a non-bool is refused naming the field."""
    kw = dict(attention="soft_hash_far_local", vocab_size=32, block_size=64, n_layer=2, n_head=2,
              n_embd=32, chunk_size=8, map_kwargs={"num_features": 24})  # fmt: skip
    idx = torch.randint(0, 32, (2, 41), generator=torch.Generator().manual_seed(1))
    results = {}
    for recompute in (True, False):
        model = TransformerLM(TransformerConfig(recompute=recompute, **kw)).double()
        cores = [c for block in model.blocks for c in block.cores()]
        assert len(cores) == 4  # the soft-hash attention and the window branch of each layer
        assert all(c.recomputes() == recompute for c in cores)
        logits, loss = model(idx, idx)
        results[recompute] = (logits, torch.autograd.grad(loss, list(model.parameters())))
    (a, ga), (b, gb) = results[True], results[False]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-15)
    softmax = TransformerLM(TransformerConfig(attention="softmax", n_layer=1))
    assert not softmax.blocks[0].attn.recomputes()  # SDPA keeps O(T): never recomputed
    with pytest.raises(TypeError, match="recompute"):
        TransformerConfig(recompute="no").validate()


def test_a_spec_and_the_train_command_turn_recomputation_off():
    from polysketch.nn.resolve import config_options

    opts = config_options("soft_hash_far_local:recompute=False,num_features=24")
    assert opts["recompute"] is False and opts["map_kwargs"] == {"num_features": 24}
    import argparse

    from polysketch.commands import train as train_cmd

    parser = train_cmd.add_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args(["--no-recompute"]).recompute is False
    assert not hasattr(parser.parse_args([]), "recompute")  # not given: the config's default
