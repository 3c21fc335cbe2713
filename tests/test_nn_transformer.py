"""TransformerLM: causality, greedy generation == full forward, seeds, gradients, errors."""

import dataclasses

import pytest
import torch

from polysketch.nn import TransformerConfig, TransformerLM
from polysketch.nn.resolve import config_options

V = 19


def _model(attention, **kw):
    cfg = TransformerConfig(
        vocab_size=V, n_layer=2, n_head=2, n_embd=16, attention=attention, chunk_size=4, **kw
    )
    return TransformerLM(cfg)


@pytest.mark.parametrize("attention", ["softmax", "polysketch", "psf_mixed", "positive", "trig"])
def test_causality_bit_identical(attention):
    """Changing tokens after t leaves logits at <= t bit-identical."""
    model = _model(attention)
    idx = torch.randint(0, V, (2, 14))
    logits, _ = model(idx)
    for t in (0, 5, 9):
        other = idx.clone()
        other[:, t + 1 :] = (idx[:, t + 1 :] + 1 + torch.arange(13 - t)) % V
        changed, _ = model(other)
        assert torch.equal(changed[:, : t + 1], logits[:, : t + 1])
        assert not torch.allclose(changed[:, t + 1 :], logits[:, t + 1 :])


FAR_MAP = {"num_features": 12}  # soft_hash_far with few buckets
GEN = ["softmax", "polynomial", "polysketch", "tensor_power", "elu", "positive", "psf_mixed"]


@pytest.mark.parametrize(
    "attention,kw",
    [(a, {}) for a in GEN + ["psf_learned"]]
    + [("psf_random", {"local_window": 3}), ("soft_hash", {"local_window": 5, "short_conv": 2})]
    + [("soft_hash", {"local_window": 4, "local_shared": True, "short_conv": 2, "qk_dim": 4})]
    + [("soft_hash", {"local_window": 4, "global_heads": 1})]
    + [("soft_hash", {"local_window": 4, "global_heads": 1, "global_every": 2})]
    + [
        (
            "soft_hash_far",
            {"local_window": 4, "global_heads": 1, "map_kwargs": {"num_features": 12}},
        )
    ],
)
def test_greedy_generate_equals_full_forward_argmax(attention, kw):
    model = _model(attention, **kw).double()
    prompt = torch.randint(0, V, (2, 6))
    out = model.generate(prompt, 9, temperature=0.0)
    seq = prompt
    for _ in range(9):  # the reference: recompute the whole sequence at every step
        logits, _ = model(seq)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    # and the cached logits equal the full forward's (RoPE positions continue correctly)
    caches = model.new_caches()
    step_logits = [model(seq[:, :6], caches=caches)[0]]
    step_logits += [model(seq[:, t : t + 1], caches=caches)[0] for t in range(6, 15)]
    full, _ = model(seq)
    assert torch.allclose(torch.cat(step_logits, 1), full, rtol=1e-9, atol=1e-10)
    assert sum(c.num_floats() for c in caches) == 2 * model.decode_state_size(15)


def test_sampling_reproducible_and_top_k():
    model = _model("polysketch")
    prompt = torch.randint(0, V, (3, 4))
    a = model.generate(prompt, 7, temperature=1.5, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 7, temperature=1.5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (3, 11) and torch.equal(a[:, :4], prompt)
    greedy = model.generate(prompt, 7, temperature=0.0)
    assert torch.equal(model.generate(prompt, 7, top_k=1), greedy)
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_decode_state_constant_for_linear_and_growing_for_softmax():
    lin, sm = _model("psf_random"), _model("softmax")
    fs = 32 * 17  # the pair layout of a squared r = 32 sketch
    assert lin.decode_state_size(10) == lin.decode_state_size(10_000) == 2 * 2 * fs * 9
    assert sm.decode_state_size(100) == 2 * sm.decode_state_size(50) == 2 * 2 * 2 * 2 * 8 * 50


def test_feature_maps_independent_per_layer_and_reproducible():
    a, b, c = _model("polysketch"), _model("polysketch"), _model("polysketch", seed=1)
    w = [blk.attn.feature_map.map__leaf_gaussian.clone() for blk in a.blocks]
    assert not torch.equal(w[0], w[1])  # layers differ
    assert not torch.equal(w[0][0], w[0][1])  # heads differ
    assert torch.equal(w[0], b.blocks[0].attn.feature_map.map__leaf_gaussian)
    assert not torch.equal(w[0], c.blocks[0].attn.feature_map.map__leaf_gaussian)
    idx = torch.randint(0, V, (1, 8))
    assert torch.equal(a(idx)[0], b(idx)[0])
    # redraw: changes the buffers, reproducibly from a generator
    a.redraw_feature_maps_(torch.Generator().manual_seed(3))
    b.redraw_feature_maps_(torch.Generator().manual_seed(3))
    w2 = a.blocks[1].attn.feature_map.map__leaf_gaussian
    assert not torch.equal(w[1], w2)
    assert torch.equal(w2, b.blocks[1].attn.feature_map.map__leaf_gaussian)
    assert not torch.equal(w2, c.blocks[1].attn.feature_map.map__leaf_gaussian)


def test_redraw_changes_logits():
    model = _model("polysketch")
    idx = torch.randint(0, V, (1, 8))
    before = model(idx)[0]
    model.redraw_feature_maps_(torch.Generator().manual_seed(3))
    assert not torch.allclose(model(idx)[0], before)


def test_learned_preset_gets_gradients_in_both_branches():
    model = _model("psf_learned")
    idx = torch.randint(0, V, (2, 10))
    _, loss = model(idx, idx)
    loss.backward()
    for blk in model.blocks:
        fm = blk.attn.feature_map
        for branch in ("branch1", "branch2"):
            grads = [p.grad for n, p in fm.named_parameters() if n.startswith(f"map__{branch}")]
            assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_loss_ignore_index_and_tied_embeddings():
    model = _model("softmax")
    assert model.lm_head.weight is model.wte.weight
    untied = _model("softmax", tie_embeddings=False)
    assert untied.num_parameters() == model.num_parameters() + V * 16
    idx = torch.randint(0, V, (2, 6))
    targets = idx.clone()
    targets[:, :3] = -100
    logits, loss = model(idx, targets)
    ref = torch.nn.functional.cross_entropy(logits[:, 3:].flatten(0, 1), idx[:, 3:].flatten())
    assert torch.allclose(loss, ref)


def test_bf16_autocast_forward():
    model = _model("psf_random")
    idx = torch.randint(0, V, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    ref, _ = model(idx)
    assert (logits.float() - ref).abs().max() < 0.05


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match="n_embd"):
        TransformerLM(TransformerConfig(n_embd=10, n_head=3))
    with pytest.raises(ValueError, match="attention"):
        TransformerLM(TransformerConfig(attention="nope"))
    with pytest.raises(ValueError, match="n_layer"):
        TransformerLM(TransformerConfig(n_layer=0))
    with pytest.raises(ValueError, match="dropout"):
        TransformerLM(TransformerConfig(dropout=1.0))
    with pytest.raises(ValueError, match="chunk_size"):
        TransformerLM(TransformerConfig(chunk_size=0))
    model = _model("elu")
    with pytest.raises(ValueError, match="idx"):
        model(torch.full((1, 3), V))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=-1.0)


# ----- a sliding-window branch beside the attention (local_window) -----------------------------
def test_local_window_block_sums_two_branches_and_ablation_keeps_the_window():
    from polysketch.nn import ablate_global

    model = _model("psf_random", local_window=3).double()
    block = model.blocks[0]
    assert block.local_attn.form == "window" and block.local_attn.window == 3
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    h = block.ln_1(x)
    mid = x + block.attn(h) + block.local_attn(h)
    got = block(x)
    torch.testing.assert_close(got, mid + block.ffn(block.ln_2(mid)))
    # the local branch is exact softmax over the last 3 keys (its own projections and RoPE)
    la = block.local_attn
    q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in la.qkv(h).split(16, dim=-1))
    q, k = la.rotary.rotate(q, k, offset=0)
    i = torch.arange(11)
    near = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3)
    o = ((q @ k.transpose(-1, -2)) / 8**0.5).masked_fill(~near, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(la(h), la.out_proj(o.transpose(1, 2).flatten(2)))
    with ablate_global(model):
        ablated = block(x)
        ref = x + block.local_attn(h)
        torch.testing.assert_close(ablated, ref + block.ffn(block.ln_2(ref)))
    torch.testing.assert_close(block(x), got)
    assert model.decode_state_size(100) == sum(
        b.attn.decode_state_size(100) + b.local_attn.decode_state_size(100) for b in model.blocks
    )


def test_local_window_configs_and_refusals():
    with pytest.raises(ValueError, match="local_window"):
        TransformerLM(TransformerConfig(attention="psf_random", local_window=0))
    with pytest.raises(ValueError, match="local_window"):
        TransformerLM(TransformerConfig(attention="softmax", local_window=4))
    model = _model("psf_random", local_window=3)
    idx = torch.randint(0, V, (1, 12))
    packed, _ = model(idx, cu_seqlens=[0, 5, 12])  # the window resets at document starts
    torch.testing.assert_close(packed[:, 5:], model(idx[:, 5:])[0])
    with pytest.raises(TypeError, match="ParallelCache"):
        model(idx, caches=[b.attn.new_cache() for b in model.blocks])


def test_soft_hash_local_model_preset_is_one_soft_hash_512_head_at_temperature_8_beside_a_window():
    from polysketch.nn import MODEL_PRESETS, KernelAttention, valid_model_attentions

    assert "soft_hash_local" in valid_model_attentions()
    small = dict(vocab_size=V, n_layer=2, n_head=2, n_embd=16, chunk_size=4)
    preset = TransformerLM(TransformerConfig(attention="soft_hash_local", **small))
    spelled = TransformerLM(TransformerConfig(attention="soft_hash_1k", local_window=64,
                                              map_kwargs={"num_features": 512, "temperature": 8.0},
                                              global_heads=1, **small))  # fmt: skip
    assert MODEL_PRESETS["soft_hash_local"].hybrid.window == 64
    assert preset.blocks[0].attn.num_heads == 1 and preset.blocks[0].local_attn.num_heads == 2
    two = TransformerConfig(attention="soft_hash_local", global_heads=2, **small)
    assert TransformerLM(two).blocks[0].attn.num_heads == 2  # the user's win
    for a, b in zip(preset.state_dict().items(), spelled.state_dict().items(), strict=True):
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    assert preset.blocks[0].attn.attention == "soft_hash_1k"
    assert preset.blocks[0].attn.feature_map.feature_dim == 512
    log_t = [v for k, v in preset.state_dict().items() if k.endswith("log_temperature")]
    assert len(log_t) == 2 and all(torch.allclose(t.exp(), torch.tensor(8.0)) for t in log_t)
    assert preset.blocks[0].local_attn.window == 64
    idx = torch.randint(0, V, (1, 9))
    assert torch.equal(preset(idx)[0], spelled(idx)[0])
    narrower = TransformerConfig(attention="soft_hash_local", local_window=8, **small).resolve()
    assert (narrower.attention.name, narrower.hybrid.window) == ("soft_hash_1k", 8)
    wider = TransformerConfig(attention="soft_hash_local", map_kwargs={"num_features": 64}, **small)
    assert dict(wider.resolve().attention.map_kwargs) == {
        "num_features": 64,
        "temperature": 8.0,
    }  # the user's win
    assert TransformerLM(wider).blocks[1].attn.feature_map.feature_dim == 64
    spelled_out = "model preset.*soft_hash_1k, num_features=512, temperature=8.0.*global_heads=1"
    with pytest.raises(ValueError, match=spelled_out):
        KernelAttention(16, 2, attention="soft_hash_local")


def test_soft_hash_far_local_model_preset_is_the_far_head_with_narrow_values_and_surrogate():
    from polysketch.nn import MODEL_PRESETS, valid_model_attentions

    assert "soft_hash_far_local" in valid_model_attentions()
    small = dict(vocab_size=V, n_layer=2, n_head=2, n_embd=64, chunk_size=4)
    config = TransformerConfig(attention="soft_hash_far_local", **small)
    assert MODEL_PRESETS["soft_hash_far_local"].hybrid.value_fraction == 29 / 32
    spec = config.resolve()
    assert spec.value_dim == 29 and spec.attention.gradient_surrogate == 50.0
    assert (spec.attention.name, spec.hybrid.window) == ("soft_hash_far", 64)
    # heads of 64, the measured models: values of 58, the spec the runs spelled out
    wide = TransformerConfig(attention="soft_hash_far_local", n_embd=128, n_head=2)
    assert wide.resolve().value_dim == 58
    preset = TransformerLM(config).double()
    spelled_config = TransformerConfig(attention="soft_hash_far", local_window=64, global_heads=1,
                                       value_dim=29, gradient_surrogate=50.0, **small)  # fmt: skip
    spelled = TransformerLM(spelled_config).double()
    attn = preset.blocks[0].attn
    assert attn.num_heads == 1 and attn.value_dim == 29 and attn.gradient_surrogate == 50.0
    assert attn.feature_map.feature_dim == 1920 and preset.blocks[0].local_attn.window == 64
    for a, b in zip(preset.state_dict().items(), spelled.state_dict().items(), strict=True):
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    idx = torch.randint(0, V, (2, 13))
    out, loss = preset(idx, idx)
    torch.testing.assert_close(out, spelled(idx)[0], rtol=0, atol=0)
    (grad,) = torch.autograd.grad(loss, [preset.blocks[0].attn.qkv.weight])
    plain = TransformerLM(TransformerConfig(attention="soft_hash_far_local",
                                            gradient_surrogate=0.0, **small)).double()  # fmt: skip
    (plain_grad,) = torch.autograd.grad(plain(idx, idx)[1], [plain.blocks[0].attn.qkv.weight])
    assert not torch.allclose(grad, plain_grad)  # the surrogate reaches the q/k projection
    user = TransformerConfig(attention="soft_hash_far_local", value_dim=16,
                             gradient_surrogate=0.0, **small)  # fmt: skip
    user = user.resolve()
    assert user.value_dim == 16 and user.attention.gradient_surrogate == 0.0  # the user's win
    with pytest.raises(ValueError, match="gradient_surrogate"):
        TransformerConfig(attention="soft_hash_far_local", gradient_surrogate=-1.0).validate()


def test_local_window_caches_select_rows_in_both_branches():
    model = _model("psf_random", local_window=3).double()
    idx = torch.randint(0, V, (2, 9))
    caches = model.new_caches()
    model(idx[:, :8], caches=caches)
    for c in caches:
        c.select_rows(torch.tensor([1, 1, 0]))  # reorder and repeat rows (beam search)
    step, _ = model(idx[[1, 1, 0], 8:], caches=caches)
    full, _ = model(idx[[1, 1, 0]])
    torch.testing.assert_close(step[:, 0], full[:, 8], rtol=1e-9, atol=1e-10)
    assert all(c.length == 9 for c in caches)


# ----- the window branch on the attention's projections (local_shared) ------------------------
def _shared_and_unshared(attention="soft_hash", **kw):
    """A local_shared model and the unshared model whose local q/k/v and output projections
    are copies of the global ones: the same function."""
    shared = _model(attention, local_window=4, local_shared=True, **kw).double()
    plain = _model(attention, local_window=4, **kw).double()
    state = shared.state_dict()
    copied = {
        name: state[name.replace("local_attn.", "attn.")] if ".local_attn.qkv." in name
        or ".local_attn.out_proj." in name else state[name]
        for name in plain.state_dict()
    }  # fmt: skip
    plain.load_state_dict(copied)
    return shared, plain


@pytest.mark.parametrize("kw", [{}, {"short_conv": 2}])
def test_local_shared_equals_the_unshared_layer_with_equal_projections_values_and_grads(kw):
    shared, plain = _shared_and_unshared(**kw)
    assert shared.blocks[0].local_attn.qkv is None and shared.blocks[0].local_attn.out_proj is None
    n_shared = sum(p.numel() for p in shared.parameters())
    assert n_shared < sum(p.numel() for p in plain.parameters())
    idx = torch.randint(0, V, (2, 13))
    targets = torch.randint(0, V, (2, 13))
    (ls, loss_s), (lp, loss_p) = shared(idx, targets), plain(idx, targets)
    torch.testing.assert_close(ls, lp, rtol=1e-12, atol=1e-12)
    loss_s.backward()
    loss_p.backward()
    grads = dict(plain.named_parameters())
    for name, p in shared.named_parameters():
        want = grads[name].grad
        if ".attn.qkv." in name or ".attn.out_proj." in name:  # both branches' share
            want = want + grads[name.replace(".attn.", ".local_attn.")].grad
        torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-12)


def test_local_shared_decodes_packs_and_ablates_like_the_unshared_layer():
    from polysketch.nn import ablate_global

    shared, plain = _shared_and_unshared()
    idx = torch.randint(0, V, (2, 12))
    caches = shared.new_caches()
    steps = [shared(idx[:, :7], caches=caches)[0]]
    steps += [shared(idx[:, t : t + 1], caches=caches)[0] for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), plain(idx)[0], rtol=1e-9, atol=1e-10)
    cu = [0, 5, 12]
    torch.testing.assert_close(shared(idx, cu_seqlens=cu)[0], plain(idx, cu_seqlens=cu)[0])
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[0, :3] = False
    torch.testing.assert_close(shared(idx, key_padding_mask=keep)[0],
                               plain(idx, key_padding_mask=keep)[0])  # fmt: skip
    with ablate_global(shared), ablate_global(plain):
        torch.testing.assert_close(shared(idx)[0], plain(idx)[0])
    assert shared.decode_state_size(12) == plain.decode_state_size(12)


def test_local_shared_configs_and_refusals():
    from polysketch.nn import KernelAttention

    with pytest.raises(ValueError, match="local_shared"):
        TransformerLM(TransformerConfig(attention="psf_random", local_shared=True))
    with pytest.raises(TypeError, match="local_shared"):
        TransformerLM(TransformerConfig(attention="psf_random", local_window=3, local_shared=1))
    assert not TransformerConfig(attention="soft_hash_local").resolve().hybrid.shared
    assert TransformerConfig(attention="psf_random", local_window=3,
                             local_shared=True).resolve().hybrid.shared  # fmt: skip
    branch = KernelAttention(16, 2, attention="sliding_window", window=3, projections=False)
    with pytest.raises(RuntimeError, match="attend_projected"):
        branch(torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match="qkv"):
        branch.attend_projected(torch.randn(1, 4, 40))
    with pytest.raises(ValueError, match="short_conv"):
        KernelAttention(16, 2, attention="sliding_window", window=3, projections=False,
                        short_conv=2)  # fmt: skip
    with pytest.raises(TypeError, match="projections"):
        KernelAttention(16, 2, projections=1)


# ----- fewer heads in the attention beside the window (global_heads) -----------------------
def test_global_heads_sets_the_attention_heads_beside_the_window_only():
    model = _model("soft_hash", local_window=4, global_heads=1)
    block = model.blocks[0]
    assert (block.attn.num_heads, block.attn.qk_dim, block.attn.head_dim) == (1, 8, 16)
    assert (block.local_attn.num_heads, block.local_attn.head_dim) == (2, 8)
    assert block.attn.feature_map.head_dim == 8  # the map's input keeps the model's head dim
    narrow = _model("soft_hash", local_window=4, global_heads=1, qk_dim=4).blocks[0].attn
    assert (narrow.num_heads, narrow.qk_dim) == (1, 4)
    same = _model("soft_hash", local_window=4, global_heads=2).blocks[0].attn
    plain = _model("soft_hash", local_window=4).blocks[0].attn
    assert same.num_heads == plain.num_heads == 2 and same.qk_dim == plain.qk_dim
    one = block.attn.decode_state_size(10)
    assert one == block.attn.feature_map.feature_dim * (16 + 1)  # F × (E + 1), one head
    assert TransformerConfig(attention="soft_hash", n_head=2).resolve().heads == 2


# ----- the global attention in every k-th layer only (global_every) ------------------------
def test_global_every_leaves_the_other_layers_to_the_window_alone():
    """Layers k-1, 2k-1, ... are the unchanged two-branch layers (same parameters as
    without global_every, same outputs for the same inputs); the others are exactly the
    sliding-window branch alone: the same module as that branch, and the same function as a
    ``sliding_window`` layer; the decode state and ablate_global count the global layers only."""
    from polysketch.nn import ablate_global

    kw = dict(local_window=4, global_heads=1)
    every = TransformerLM(TransformerConfig(vocab_size=V, n_layer=4, n_head=2, n_embd=16,
                                            attention="soft_hash", chunk_size=4, global_every=2,
                                            **kw)).double()  # fmt: skip
    full = TransformerLM(
        TransformerConfig(
            vocab_size=V, n_layer=4, n_head=2, n_embd=16, attention="soft_hash", chunk_size=4, **kw
        )
    ).double()
    assert [b.local_attn is not None for b in every.blocks] == [False, True, False, True]
    assert [b.attn.attention for b in every.blocks] == [
        "sliding_window",
        "soft_hash",
        "sliding_window",
        "soft_hash",
    ]
    x = torch.randn(2, 11, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for i in (0, 2):  # the window alone: the full model's local branch with its weights
        alone, branch = every.blocks[i], full.blocks[i]
        alone.attn.load_state_dict(branch.local_attn.state_dict())
        assert torch.equal(alone.attn(x), branch.local_attn(x))
    glob = every.blocks[1]
    assert glob.attn.feature_map is not None and glob.local_attn.attention == "sliding_window"
    per_layer = [b.decode_state_size(9) for b in every.blocks]
    assert per_layer[0] == per_layer[2] == full.blocks[0].local_attn.decode_state_size(9)
    assert per_layer[1] == full.blocks[1].decode_state_size(9)
    assert every.decode_state_size(9) == sum(per_layer)
    idx = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(4))
    with ablate_global(every):  # switches off layers 1 and 3's global branch only
        ablated, _ = every(idx)
        assert [b.global_ablated for b in every.blocks] == [False, True, False, True]
    assert not torch.allclose(ablated, every(idx)[0])
    spec = TransformerConfig(local_window=4, global_every=3, n_layer=6).resolve()
    assert spec.has_global(2) and not spec.has_global(3)


def test_block_parameter_order_is_stable():
    """A checkpoint's optimizer state follows the parameter order, i.e. the order in which a
    Block registers its submodules: it must not change between releases (a reordering broke
    the resume of runs written before it)."""
    for kw in ({}, {"local_window": 4}, {"local_window": 4, "global_every": 2}):
        model = _model("soft_hash", **kw)
        for block in model.blocks:
            names = [name for name, _ in block.named_children()]
            want = ["ln_1", "attn"] + (["local_attn"] if block.local_attn is not None else [])
            assert names == [*want, "ln_2", "ffn", "dropout"], kw


def _validated(n_layer=1, **kw) -> TransformerConfig:
    return TransformerConfig(vocab_size=V, n_layer=n_layer, n_head=2, n_embd=16, **kw).validate()


def test_global_every_refusals():
    def config(**kw):
        return _validated(n_layer=2, **kw)

    with pytest.raises(ValueError, match="global_every.*local_window"):
        config(attention="soft_hash", global_every=2)
    with pytest.raises(ValueError, match="global_every=3 > n_layer=2"):
        config(attention="soft_hash", local_window=4, global_every=3)
    with pytest.raises(ValueError, match="global_every"):
        config(attention="soft_hash", local_window=4, global_every=0)
    with pytest.raises(TypeError, match="global_every"):
        config(attention="soft_hash", local_window=4, global_every=2.0)
    assert config(attention="soft_hash_local", global_every=2).resolve().has_global(1)


def test_global_heads_refusals():
    config = _validated

    with pytest.raises(ValueError, match="global_heads.*local_window"):
        config(attention="soft_hash", global_heads=1)
    with pytest.raises(ValueError, match="global_heads"):
        config(attention="soft_hash", local_window=4, global_heads=0)
    with pytest.raises(TypeError, match="global_heads"):
        config(attention="soft_hash", local_window=4, global_heads=1.0)
    with pytest.raises(ValueError, match="divisible by global_heads=3"):
        config(attention="soft_hash", local_window=4, global_heads=3)
    with pytest.raises(ValueError, match="local_shared=True needs global_heads"):
        config(attention="soft_hash", local_window=4, global_heads=1, local_shared=True)


def test_soft_hash_far_needs_a_window_of_at_least_a_block_beside_it():
    small = dict(vocab_size=V, n_layer=2, n_head=2, n_embd=16, chunk_size=4,
                 map_kwargs={"num_features": 12})  # fmt: skip
    for window in (None, 3):  # alone, or a window that leaves keys of the own block unseen
        with pytest.raises(ValueError, match="local_window"):
            TransformerLM(
                TransformerConfig(attention="soft_hash_far", local_window=window, **small)
            )
    model = TransformerLM(TransformerConfig(attention="soft_hash_far", local_window=4, **small))
    assert model.blocks[0].attn.form == "mixed" and model.blocks[0].attn.spec.local == "none"


def test_global_rope_off_leaves_the_global_branch_unrotated_and_the_window_rotated():
    small = dict(vocab_size=V, n_layer=2, n_head=2, n_embd=16, chunk_size=4, local_window=4,
                 global_heads=1, map_kwargs={"num_features": 12})  # fmt: skip
    model = TransformerLM(TransformerConfig(attention="soft_hash_far", global_rope=False, **small))
    for block in model.blocks:
        assert block.attn.rotary is None and block.local_attn.rotary is not None
    with_rope = TransformerLM(TransformerConfig(attention="soft_hash_far", **small))
    assert all(b.attn.rotary is not None for b in with_rope.blocks)  # default: as the model
    idx = torch.randint(0, V, (2, 11))
    logits, _ = model(idx)
    caches = model.new_caches()  # decoding without RoPE on the global branch
    steps = [model(idx[:, :5], caches=caches)[0]]
    steps += [model(idx[:, t : t + 1], caches=caches)[0] for t in range(5, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="local_window"):
        TransformerConfig(attention="psf_random", global_rope=False).validate()
    with pytest.raises(ValueError, match="rope=False"):
        TransformerConfig(attention="soft_hash_far", global_rope=True, rope=False,
                          **small).validate()  # fmt: skip
    with pytest.raises(TypeError, match="global_rope"):
        TransformerConfig(attention="soft_hash_far", global_rope="no", **small).validate()


def test_global_out_init_scales_only_the_global_branchs_output_projection():
    """global_out_init = S: the attention beside the window starts with its output projection
    at S × the default draw, every other weight as without it (the draw is the same); S = 0
    makes the model at step 0 the window branch alone (its global branch ablated)."""
    from polysketch.nn import ablate_global
    from polysketch.nn.resolve import config_options

    small = dict(vocab_size=V, n_layer=2, n_head=2, n_embd=16, chunk_size=4, block_size=16,
                 attention="soft_hash_far_local", map_kwargs={"num_features": 12})  # fmt: skip
    base = dict(TransformerLM(TransformerConfig(**small)).named_parameters())
    for scale in (0.0, 0.5):
        model = TransformerLM(TransformerConfig(global_out_init=scale, **small))
        assert model.spec.hybrid.out_init == scale
        for name, p in model.named_parameters():
            global_out = ".attn.out_proj." in name and "local_attn" not in name
            torch.testing.assert_close(p, base[name] * (scale if global_out else 1.0),
                                       rtol=0, atol=0)  # fmt: skip
    zero = TransformerLM(TransformerConfig(global_out_init=0.0, **small))
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = zero(idx)[0]
    with ablate_global(zero):
        torch.testing.assert_close(zero(idx)[0], logits, rtol=0, atol=0)
    assert config_options("soft_hash_far_local:global_out_init=0.0")["global_out_init"] == 0.0
    spec = zero.spec
    assert type(spec).from_dict(spec.to_dict()) == spec
    default = TransformerLM(TransformerConfig(**small)).spec
    assert "out_init" not in default.to_dict()["hybrid"]  # older readers know every key
    assert type(default).from_dict(default.to_dict()) == default
    with pytest.raises(ValueError, match="global_out_init"):
        TransformerConfig(**{**small, "global_out_init": -1.0}).validate()
    with pytest.raises(TypeError, match="global_out_init"):
        TransformerConfig(**{**small, "global_out_init": True}).validate()
    with pytest.raises(ValueError, match="global_out_init .*needs local_window"):
        TransformerConfig(attention="psf_random", global_out_init=0.0).validate()
    with pytest.raises(ValueError, match="share one output projection"):
        TransformerConfig(**{**small, "attention": "soft_hash_far", "local_window": 4,
                             "local_shared": True, "global_out_init": 0.0}).validate()  # fmt: skip


def test_global_out_tied_starts_the_global_branchs_output_as_its_values_transposed():
    """global_out_tied: the attention beside the window starts with W_o = c·W_vᵀ, c =
    global_out_init / √(2 n_layer), every other weight as without it (the draw is the same);
    each head's value–output circuit W_o,h W_v,h is then symmetric positive semidefinite."""
    from polysketch.nn.resolve import config_options

    small = dict(vocab_size=V, n_layer=2, n_head=2, n_embd=16, chunk_size=4, block_size=16,
                 attention="soft_hash_far_local", map_kwargs={"num_features": 12})  # fmt: skip
    base = dict(TransformerLM(TransformerConfig(**small)).named_parameters())
    for scale in (1.0, 0.5):
        model = TransformerLM(TransformerConfig(global_out_tied=True, global_out_init=scale,
                                                **small))  # fmt: skip
        assert model.spec.hybrid.out_tied
        for name, p in model.named_parameters():
            if ".attn.out_proj." not in name or "local_attn" in name:
                torch.testing.assert_close(p, base[name], rtol=0, atol=0)
        for blk in model.blocks:
            attn = blk.attn
            q_rows, k_rows, _ = attn._split  # q, k, v rows of qkv
            value = attn.qkv.weight[q_rows + k_rows :]
            assert attn.value_weight().equal(value)
            out = attn.out_proj.weight
            torch.testing.assert_close(out, value.T * scale / (2 * 2) ** 0.5, rtol=0, atol=0)
            for h in range(attn.num_heads):
                rows = slice(h * attn.value_dim, (h + 1) * attn.value_dim)
                circuit = (out[:, rows].double() @ value[rows].double()).detach()  # (E, E)
                # c·AᵀA in fp64: symmetric and its eigenvalues >= 0 up to E · eps64 · ‖·‖
                bound = float(16 * torch.finfo(torch.float64).eps * circuit.norm())
                torch.testing.assert_close(circuit, circuit.T, rtol=0, atol=bound)
                assert torch.linalg.eigvalsh(circuit).min() >= -bound
    options = config_options("soft_hash_far_local:global_out_tied=True")
    assert options["global_out_tied"] is True
    spec = TransformerLM(TransformerConfig(global_out_tied=True, **small)).spec
    assert spec.hybrid.to_dict()["out_tied"] is True
    assert type(spec).from_dict(spec.to_dict()) == spec
    default = TransformerLM(TransformerConfig(**small)).spec
    assert "out_tied" not in default.to_dict()["hybrid"]  # older readers know every key
    with pytest.raises(TypeError, match="global_out_tied"):
        TransformerConfig(**{**small, "global_out_tied": "true"}).validate()
    with pytest.raises(ValueError, match="global_out_tied .*needs local_window"):
        TransformerConfig(attention="psf_random", global_out_tied=True).validate()
    shared = {**small, "attention": "soft_hash_far", "local_window": 4, "local_shared": True}
    shared = TransformerLM(TransformerConfig(**shared))
    with pytest.raises(ValueError, match="no projections"):
        shared.blocks[0].local_attn.value_weight()  # reads the attention's projections
    with pytest.raises(ValueError, match="global_out_tied=True with local_shared"):
        TransformerConfig(**{**small, "attention": "soft_hash_far", "local_window": 4,
                             "local_shared": True, "global_out_tied": True}).validate()  # fmt: skip


def test_soft_hash_far_local_tied_is_the_tied_start_of_soft_hash_far_local():
    """The successor preset is soft_hash_far_local with global_out_tied and nothing else: the
    same spec but for ``out_tied``, the same weights but for the far branch's W_o; a config
    field still wins over it (global_out_tied=False gives soft_hash_far_local's model)."""
    small = dict(vocab_size=V, n_layer=2, n_head=2, n_embd=16, chunk_size=4, block_size=16,
                 map_kwargs={"num_features": 12})  # fmt: skip
    old = TransformerLM(TransformerConfig(attention="soft_hash_far_local", **small))
    new = TransformerLM(TransformerConfig(attention="soft_hash_far_local_tied", **small))
    tied = TransformerLM(TransformerConfig(attention="soft_hash_far_local", global_out_tied=True,
                                           **small))  # fmt: skip
    assert new.spec.hybrid.out_tied and not old.spec.hybrid.out_tied
    assert new.spec == tied.spec
    assert dataclasses.replace(new.spec, hybrid=old.spec.hybrid) == old.spec
    untied = TransformerLM(TransformerConfig(attention="soft_hash_far_local_tied",
                                             global_out_tied=False, **small))  # fmt: skip
    assert untied.spec == old.spec
    olds, ties, untieds = (dict(m.named_parameters()) for m in (old, tied, untied))
    for name, p in new.named_parameters():
        torch.testing.assert_close(p, ties[name], rtol=0, atol=0)
        torch.testing.assert_close(untieds[name], olds[name], rtol=0, atol=0)
        if ".attn.out_proj." not in name or "local_attn" in name:
            torch.testing.assert_close(p, olds[name], rtol=0, atol=0)
        else:
            assert not torch.equal(p, olds[name])


MEASURED_BALANCED = (
    "soft_hash_far_local_tied:temperature=6.0,global_heads=2,num_features=640,"
    "bucket_balance=0.001,bucket_balance_form=usage,bucket_balance_temperature=False,"
    "bucket_balance_inputs=False"
)
"""The spec the copy grid, natural text and MQAR measured (docs/results/long_context, C640i6)."""


@pytest.mark.parametrize("n_head", [2, 4])
def test_soft_hash_far_local_balanced_is_the_spec_that_was_measured(n_head):
    """The preset resolves to the spec string of its measurements, on a model whose heads
    equal the far heads (2) and on one with more (4: the far heads keep the model's head
    dim), and builds the same weights; a config field still wins over it."""
    small = dict(vocab_size=V, n_layer=2, n_head=n_head, n_embd=32, chunk_size=4,
                 block_size=16, seed=3)  # fmt: skip
    preset = TransformerLM(TransformerConfig(attention="soft_hash_far_local_balanced", **small))
    measured = TransformerLM(TransformerConfig(**config_options(MEASURED_BALANCED, **small)))
    assert preset.spec == measured.spec
    assert preset.spec.heads == 2 and preset.spec.hybrid.out_tied
    kwargs = preset.spec.attention.map_kwargs
    assert (kwargs["num_features"], kwargs["temperature"], kwargs["bucket_balance"]) == (
        640, 6.0, 1e-3)  # fmt: skip
    assert not kwargs["bucket_balance_inputs"] and not kwargs["bucket_balance_temperature"]
    other = dict(measured.named_parameters())
    for name, p in preset.named_parameters():
        torch.testing.assert_close(p, other[name], rtol=0, atol=0)
    override = TransformerConfig(attention="soft_hash_far_local_balanced", global_heads=1,
                                 map_kwargs={"bucket_balance": 0.0}, **small)  # fmt: skip
    spec = TransformerLM(override).spec
    assert spec.heads == 1 and spec.attention.map_kwargs["bucket_balance"] == 0.0


@pytest.mark.parametrize("short_conv", [0, 3])
def test_a_model_is_a_function_of_its_config_not_of_the_global_rng(short_conv):
    """Every parameter comes from ``config.seed`` (the short convolution's bias too): two
    builds under different global RNG states are identical."""
    small = dict(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32, chunk_size=16)
    cfg = TransformerConfig(attention="psf_mixed", short_conv=short_conv, **small)
    torch.manual_seed(1)
    a = TransformerLM(cfg).state_dict()
    torch.manual_seed(2)
    b = TransformerLM(cfg).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if short_conv:  # the bias keeps Conv1d's U(-1/sqrt(K), 1/sqrt(K))
        bias = a["blocks.0.attn.conv.bias"]
        assert bias.abs().max() <= 3**-0.5 and bias.std() > 0.1
