"""Model presets in converted HF models (issue 43 item 1): a window branch beside the attention.

``convert(model, "soft_hash_far_local")`` (and every name of ``MODEL_PRESETS``, and
``convert(model, "soft_hash_far", local_window=w)``): each converted layer computes, per query
head, an exact sliding-window softmax over the last w keys plus the preset's global attention
on the same q, k, v (``integrations.transformers.hybrid``). Tested against a naive reference
(per-head maps, masked sums in fp64), for causality, decode == full forward, batched
left-padded == each row alone (forward and generate), save/load, the surrogate gradient in
training and attention transfer, and the refusals. Tiny random-init models; nothing is
downloaded.
"""

import copy
import dataclasses
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from polysketch.cli import main  # noqa: E402
from polysketch.integrations.transformers import (  # noqa: E402
    LinearizeConfig,
    PolysketchCache,
    attention_transfer,
    convert,
    linearize,
    load_converted,
    polysketch_settings,
    trainable_attention_parameters,
)
from polysketch.nn import MODEL_PRESETS, TransformerConfig  # noqa: E402
from polysketch.ops.naive import DEFAULT_EPS  # noqa: E402
from test_integrations_transformers import (  # noqa: E402
    _decisive,
    assert_decoding_as_accurate,
    ids,
    logits,
    tiny,
)
from test_integrations_transformers_padding import assert_padding_as_accurate  # noqa: E402

V = 64
H = 4  # the tiny models' query heads
# the model presets at their own window and block, and small windows/blocks that reach the
# global branch within a few dozen tokens
SMALL = [
    ("soft_hash_far_local", {"local_window": 8, "chunk_size": 8}),
    ("soft_hash_local", {"local_window": 8, "chunk_size": 8}),
    ("soft_hash_far", {"local_window": 8, "chunk_size": 8}),
    ("psf_random", {"local_window": 8, "chunk_size": 8, "global_heads": 2}),
]
SMALL_IDS = [f"{a}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for a, kw in SMALL]


def _cores(model):
    return [m.polysketch for m in model.modules() if hasattr(m, "polysketch")]


# ----- what a preset becomes -----------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_every_model_preset_converts(family, name):
    preset = MODEL_PRESETS[name]
    model = convert(tiny(family), name)
    settings = polysketch_settings(model)
    assert settings["attention"] == name
    for layer in settings["layers"]:  # each layer's LayerSpec, stored
        assert layer["window_attention"]["window"] == preset.hybrid.window
        assert layer["attention"]["chunk_size"] == (preset.chunk_size or 64)
        assert layer["attention"]["gradient_surrogate"] == preset.gradient_surrogate
    # the global attention is the one a TransformerLM of the preset runs (its spec, but the
    # softmax scale: the model's own)
    lm = TransformerConfig(attention=name, n_embd=64, n_head=H).resolve().attention
    for core in _cores(model):
        assert dataclasses.replace(core.spec, softmax_scale=None) == lm
        assert core.local_window == preset.hybrid.window
        assert core.num_heads == core.total_heads == H  # the global branch on every head
        assert core.local_attn.form == "window"
        assert core.local_attn.softmax_scale == pytest.approx(core.head_dim**-0.5)
    assert torch.isfinite(logits(model, ids(t=140))).all()


def _naive_layer(core, q, k, v):
    """The converted layer of ``hybrid`` in fp64 from per-head maps and masked sums: window
    softmax over the last w keys (all heads) + the global attention (heads < g): linear
    attention over every earlier key, or, without in-block scores, over the blocks before the
    query's own, its normalizer guarded as the ops guard it (max(Z, eps), ``ops.naive``).
    q, k, v (B, H, T, D) -> (B, H, T, D)."""
    q, k, v = q.double(), k.double(), v.double()
    t, w, b = q.shape[-2], core.local_window, core.chunk_size
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    band = (j <= i) & (j > i - w)
    scores = (q @ k.transpose(-1, -2)) * core.local_attn.softmax_scale
    out = torch.softmax(scores.masked_fill(~band, -math.inf), dim=-1) @ v
    far = (j < (i // b) * b) if core.spec.local == "none" else (j <= i)
    qn = torch.nn.functional.layer_norm(q, (q.shape[-1],), core.q_norm.weight.double(),
                                        core.q_norm.bias.double())  # fmt: skip
    kn = torch.nn.functional.layer_norm(k, (k.shape[-1],), core.k_norm.weight.double(),
                                        core.k_norm.bias.double())  # fmt: skip
    heads = []
    for h in range(core.num_heads):
        fm = core.feature_map.head_map(h).double()
        s = fm.query(qn[:, h]) @ fm.key(kn[:, h]).transpose(-1, -2)
        s = (s * s if fm.square else s) * far
        z = core.denominator_offset + s.sum(-1, keepdim=True)  # >= 0: nonnegative maps
        heads.append((s @ v[:, h]) / z.clamp_min(DEFAULT_EPS))  # the ops' denominator guard
    glob = torch.stack(heads, dim=1)
    return torch.cat([out[:, : core.num_heads] + glob, out[:, core.num_heads :]], dim=1)


@pytest.mark.parametrize("name,kw", SMALL, ids=SMALL_IDS)
def test_converted_layer_equals_the_naive_window_plus_global_sum(name, kw):
    model = convert(tiny("llama"), name, **kw).double()
    core = _cores(model)[0]
    with torch.no_grad():  # LayerNorm gains away from the identity: the norm is exercised
        core.q_norm.weight.uniform_(0.5, 1.5)
        core.k_norm.bias.uniform_(-0.2, 0.2)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, 37, 16, generator=g, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        got = core(q, k, v)
    ref = _naive_layer(core, q, k, v)
    assert (got - ref).abs().max() <= 1e-12 * ref.abs().max()


# ----- causality -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name,kw", SMALL + [("soft_hash_far_local", {})],
                         ids=SMALL_IDS + ["soft_hash_far_local"])  # fmt: skip
def test_converted_preset_is_causal(family, name, kw):
    model = convert(tiny(family), name, **kw)
    t, cut = (140, 100) if not kw else (40, 27)
    x = ids(t=t)
    y = x.clone()
    y[:, cut:] = (y[:, cut:] * 7 + 3) % V  # change every token from cut on
    a, b = logits(model, x), logits(model, y)
    assert torch.equal(a[:, :cut], b[:, :cut])
    assert not torch.equal(a[:, cut:], b[:, cut:])


# ----- decoding ------------------------------------------------------------------------------
def _decode(model, x, prefill):
    cache = PolysketchCache(model)
    with torch.no_grad():
        parts = [model(input_ids=x[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for i in range(prefill, x.shape[1]):
            parts.append(model(input_ids=x[:, i : i + 1], past_key_values=cache).logits)
    assert cache.get_seq_length() == x.shape[1]
    return torch.cat(parts, dim=1), cache


@pytest.mark.parametrize(
    "family,name,kw,t,prefill",
    [("llama", n, kw, 37, 5) for n, kw in SMALL]
    + [(f, "soft_hash_far_local", {}, 136, 100) for f in ("llama", "gpt_neox", "gpt2")]
    + [("llama", "soft_hash_local", {}, 136, 100)],
    ids=[f"llama-{i}" for i in SMALL_IDS]
    + [f"{f}-soft_hash_far_local" for f in ("llama", "gpt_neox", "gpt2")]
    + ["llama-soft_hash_local"],
)
def test_cached_decoding_equals_full_forward(family, name, kw, t, prefill):
    """fp64: to 1e-10 of the largest logit; fp32: as accurate as the full forward. The
    presets' own window and block (64) are crossed by the prefill and by the steps (128)."""
    model = convert(tiny(family), name, **kw)
    x = ids(t=t)
    exact = copy.deepcopy(model).double()
    full64 = logits(exact, x)
    dec64, cache = _decode(exact, x, prefill)
    assert (dec64 - full64).abs().max() <= 1e-10 * full64.abs().max()
    cores = _cores(model)
    assert cache.num_floats() == x.shape[0] * sum(c.decode_state_size(t) for c in cores)
    assert_decoding_as_accurate(_decode(model, x, prefill)[0], model, exact, x)


def test_decode_state_counts_both_branches():
    model = convert(tiny("llama"), "soft_hash_far_local")
    core = _cores(model)[0]
    d = e = core.head_dim
    f, w, b = core.feature_map.feature_dim, core.local_window, core.chunk_size
    for t in (1, 63, 64, 100, 128, 4096):
        window = H * (d + e) * min(t, w)
        far = (H * f * (e + 1) if t >= b else 0) + H * (t % b) * (d + e)
        assert core.decode_state_size(t) == window + far
    g = convert(tiny("llama"), "soft_hash_far_local", global_heads=1)
    assert _cores(g)[0].decode_state_size(128) == H * (d + e) * w + 1 * f * (e + 1)


# ----- padding: batched == each row alone ---------------------------------------------------
def _batch(lengths=(100, 70, 30)):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, V, (n,), generator=g) for n in lengths]
    t = max(lengths)
    x = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros(len(prompts), t, dtype=torch.long)
    for r, p in enumerate(prompts):
        x[r, t - len(p) :], mask[r, t - len(p) :] = p, 1
    return prompts, x, mask


@pytest.mark.parametrize("name,kw", [("soft_hash_far_local", {}), ("soft_hash_local", {}),
                                     SMALL[3]], ids=["soft_hash_far_local", "soft_hash_local",
                                                     SMALL_IDS[3]])  # fmt: skip
def test_left_padded_generate_equals_each_row_alone(name, kw):
    """Prompts of 100, 70 and 30 tokens (blocks and window of 64) in one left-padded batch:
    the same 12 greedy tokens as each alone, and first-step logits as accurate as the rows'
    own runs (``assert_padding_as_accurate``)."""
    model = _decisive(convert(tiny("llama"), name, **kw))
    exact = copy.deepcopy(model).double()
    prompts, x, mask = _batch()
    gen = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "output_logits": True,
           "return_dict_in_generate": True}  # fmt: skip
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, **gen)
        for r, p in enumerate(prompts):
            ones = torch.ones(1, len(p), dtype=torch.long)
            alone = model.generate(p[None], attention_mask=ones, **gen)
            assert torch.equal(out.sequences[r, x.shape[1] :], alone.sequences[0, len(p) :]), r
    # the first step's logits are the prompts' last tokens' (the padding module's bound)
    assert_padding_as_accurate(model, prompts, exact, steps=[out.logits[0]])


# ----- save / load ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_save_load_keeps_logits(tmp_path, family):
    model = convert(tiny(family), "soft_hash_far_local", global_heads=3)
    with torch.no_grad():  # the added modules (norms, soft_hash directions, τ) trained away
        for p in trainable_attention_parameters(model):
            p.add_(0.1 * torch.randn_like(p))
    x = ids(t=140)
    ref = logits(model, x)
    model.save_pretrained(tmp_path / "m")
    loaded = load_converted(tmp_path / "m").eval()
    assert polysketch_settings(loaded) == polysketch_settings(model)
    assert polysketch_settings(loaded)["options"]["global_heads"] == 3
    assert all(layer["global_heads"] == 3 for layer in polysketch_settings(loaded)["layers"])
    assert torch.equal(logits(loaded, x), ref)


# ----- training: the surrogate gradient ----------------------------------------------------
def test_surrogate_gradient_is_zero_in_value_and_reaches_q_and_k():
    """In training (autograd recording) λ·(o_lin − sg(o_lin)) is added: the logits are
    bit-identical for every λ, and the gradients of the last layer's q and k projections move
    linearly in λ (fp64: the difference at λ = 100 is twice that at λ = 50; an earlier layer's
    also gets the later layers' surrogates on its way back, so there it is not linear)."""
    base = tiny("llama").double()
    x = ids(t=70)  # past the first block of 64: the far blocks are read
    grads, outs = {}, {}
    for lam in (0.0, 50.0, 100.0):
        model = convert(copy.deepcopy(base), "soft_hash_far_local", gradient_surrogate=lam)
        model.train()
        out = model(input_ids=x, use_cache=False).logits
        out.square().mean().backward()
        attn = model.model.layers[-1].self_attn
        outs[lam] = out.detach()
        grads[lam] = torch.cat([attn.q_proj.weight.grad.flatten(),
                                attn.k_proj.weight.grad.flatten()])  # fmt: skip
    assert torch.equal(outs[0.0], outs[50.0]) and torch.equal(outs[0.0], outs[100.0])
    d50, d100 = grads[50.0] - grads[0.0], grads[100.0] - grads[0.0]
    assert d50.abs().max() > 1e-6 * grads[0.0].abs().max()  # it reaches q and k
    assert (d100 - 2 * d50).abs().max() <= 1e-9 * d100.abs().max()
    default = convert(tiny("llama"), "soft_hash_far_local")
    assert all(c.gradient_surrogate == 50.0 for c in _cores(default))


def test_linearize_runs_with_the_preset():
    """Attention transfer (the added modules train, the surrogate gradient on) and a full
    fine-tune step on a preset; the transfer moves the global branch's norms and map."""
    model = convert(tiny("llama"), "soft_hash_far_local")
    start = {n: p.detach().clone() for n, p in model.named_parameters() if ".polysketch." in n}
    tokens = ids(b=1, t=3000, seed=3).flatten()
    hist = attention_transfer(model, tokens, steps=2, seq_len=96, batch_size=2, lr=1e-2)
    assert len(hist) == 2 and all(math.isfinite(h) for h in hist)
    after = dict(model.named_parameters())
    assert any("feature_map" in n for n in start) and any("q_norm" in n for n in start)
    assert all(not torch.equal(after[n], p) for n, p in start.items())
    cfg = LinearizeConfig(seq_len=96, batch_size=2, transfer_steps=1, finetune_steps=1,
                          finetune="full", eval_batches=1)  # fmt: skip
    out, res = linearize(tiny("llama"), tokens, ids(b=1, t=800, seed=5).flatten(),
                         attention="soft_hash_far_local", config=cfg)  # fmt: skip
    assert math.isfinite(res["loss_finetune"])
    assert polysketch_settings(out)["attention"] == "soft_hash_far_local"
    state = res["decode_state"][1]  # at 64k tokens: far below the KV cache
    assert state["state_floats"] < state["kv_cache_floats"]


def test_cli_linearize_takes_a_model_preset(tmp_path, monkeypatch):
    import polysketch.integrations.transformers as hf

    seen = {}

    def stop(model, attention, data, *, config, chunk_size, **kwargs):
        seen.update(attention=attention, chunk_size=chunk_size, **kwargs)
        raise ValueError("stopped here")

    monkeypatch.setattr(hf, "linearize_saved", stop)
    tiny("llama", vocab=256, layers=1).save_pretrained(tmp_path / "base")
    argv = ["linearize", "--model", str(tmp_path / "base"), "--out", str(tmp_path / "o"),
            "--attention", "soft_hash_far_local", "--global-heads", "2"]  # fmt: skip
    assert main(argv) == 2
    assert seen["attention"] == "soft_hash_far_local" and seen["chunk_size"] is None
    assert seen["global_heads"] == 2 and seen.get("local_window") is None


# ----- refusals ------------------------------------------------------------------------------
def test_refusals_name_the_cause():
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"local_window >= 64, or a model preset"):
        convert(model, "soft_hash_far")  # reads none of its own block: needs a window
    with pytest.raises(ValueError, match="local_window=32"):
        convert(model, "soft_hash_far", local_window=32)  # < the block of 64
    with pytest.raises(ValueError, match="chunk_size=128"):
        convert(model, "soft_hash_far_local", chunk_size=128)  # the preset's window is 64
    with pytest.raises(ValueError, match="global_heads.*local_window"):
        convert(model, "psf_random", global_heads=2)
    with pytest.raises(ValueError, match="global_heads=5"):
        convert(model, "soft_hash_far_local", global_heads=5)
    for exact in ("softmax", "polynomial"):
        with pytest.raises(ValueError, match="local_window"):
            convert(model, exact, local_window=16)
    with pytest.raises(ValueError, match="local_window"):
        convert(model, "sliding_window", window=16, local_window=16)
    with pytest.raises(ValueError, match="mixed=True"):
        convert(model, "soft_hash_local", mixed=True)
    with pytest.raises(ValueError, match="gradient_surrogate"):
        convert(model, "psf_random", local_window=16, gradient_surrogate=1.0)
    with pytest.raises(TypeError, match="local_window"):
        convert(model, "soft_hash_far", local_window=64.0)
    with pytest.raises(ValueError, match="local_window must be"):
        convert(model, "soft_hash_far", local_window=0)
    assert not hasattr(model.model.layers[0].self_attn, "polysketch")  # nothing converted
