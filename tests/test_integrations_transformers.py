"""Hugging Face transformers integration: convert, decode, save/load, linearize, CLI.

Tiny random-init models built from configs (2 layers × 64 hidden); nothing is downloaded.
"""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from numerics import assert_as_accurate, rounding_sigma  # noqa: E402
from polysketch.cli import main  # noqa: E402
from polysketch.integrations.transformers import (  # noqa: E402
    PolysketchCache,
    attention_transfer,
    convert,
    finetune,
    load_converted,
    polysketch_settings,
    trainable_attention_parameters,
)
from polysketch.integrations.transformers.convert import _generate_cache_key  # noqa: E402

CACHE = _generate_cache_key()
"""The keyword a transformers forward/generate takes its cache by (``past_key_values`` before
5.24, ``cache`` from it; the old one is deprecated)."""

V = 64
FAMILIES = ["llama", "qwen2", "mistral", "gpt_neox", "gpt2"]
PRESETS = ["psf_random", "psf_learned", "psf_mixed"]


def tiny(family: str, *, vocab: int = V, kv_heads: int = 2, layers: int = 2):
    """A tiny random-init causal LM of ``family`` (eval mode, fp32)."""
    common = {"vocab_size": vocab, "num_hidden_layers": layers, "num_attention_heads": 4}
    if family in ("llama", "qwen2", "mistral"):
        cls = {
            "llama": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig,
        }[family]
        cfg = cls(hidden_size=64, intermediate_size=128, num_key_value_heads=kv_heads,
                  max_position_embeddings=256, **common)  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    elif family == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128,
                                         max_position_embeddings=256, **common)  # fmt: skip
        model = transformers.GPTNeoXForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=layers, n_head=4,
                                      n_positions=256)  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    return model.eval()


def ids(b=2, t=40, seed=0, vocab=V):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, x, **kw):
    return model(input_ids=x, use_cache=False, **kw).logits


@torch.no_grad()
def logits_in_other_shapes(model, x, extra=(0, 7, 13)):
    """x's logits from full forwards of x followed by e more tokens, for each e in ``extra``: a
    causal model's logits at x's positions are the same values, summed in other shapes (three
    references for ``assert_as_accurate``, issue 69)."""
    g = torch.Generator().manual_seed(12345)
    vocab = model.get_output_embeddings().weight.shape[0]
    out = []
    for e in extra:
        more = torch.randint(0, vocab, (x.shape[0], e), generator=g)
        out.append(logits(model, torch.cat([x, more], dim=1))[:, : x.shape[1]])
    return out


def assert_decoding_as_accurate(decoded, model, exact, x):
    """fp32 decoding as accurate, against the fp64 full forward, as the fp32 full forward in
    three shapes (``logits_in_other_shapes``): within 2x the largest of their errors + u, in
    the Frobenius norm or, where a few tokens' cancelling sums carry that norm (the ratio of
    two errors then being that of two single draws; issue 69), in units of each token's
    rounding sensitivity (``rounding_sigma``)."""
    full64 = logits(exact, x)
    assert_as_accurate(decoded, logits_in_other_shapes(model, x), full64, norm="fro",
                       sigma=lambda: rounding_sigma(lambda: logits(exact, x)))  # fmt: skip


# ----- softmax conversion changes nothing ---------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_conversion_keeps_logits(family):
    model = tiny(family)
    x = ids()
    ref = logits(model, x)
    convert(model, "softmax")
    assert model.config._attn_implementation == "polysketch"
    assert all(hasattr(m, "polysketch") for m in model.modules() if hasattr(m, "layer_idx"))
    assert (logits(model, x) - ref).abs().max() <= 1e-5


# ----- causality -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", PRESETS + ["llops", "positive", "polynomial", "hedgehog"])
def test_converted_model_is_causal(family, attention):
    model = tiny(family)
    convert(model, attention, chunk_size=8)
    x = ids(t=30)
    y = x.clone()
    y[:, 17:] = (y[:, 17:] * 7 + 3) % V  # change every token from 17 on
    a, b = logits(model, x), logits(model, y)
    assert torch.equal(a[:, :17], b[:, :17])
    assert not torch.equal(a[:, 17:], b[:, 17:])


# ----- decoding from the constant-size state ----------------------------------------------
def _decisive(model):
    """Scale the LM head so greedy choices are far from ties (robust argmax comparisons)."""
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone() * 30)
    model.generation_config.eos_token_id = None  # never stop early
    return model


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
@pytest.mark.parametrize("attention", PRESETS + ["llops", "hedgehog"])
def test_cached_decoding_equals_full_forward(family, attention):
    """Decoding from the state equals the full forward: in fp64 to 1e-10 of the largest logit
    (the same sums in other orders), and in fp32 as accurate as the full forward
    (``assert_as_accurate``) for the maps with non-negative scores. llops' scores are signed
    and cancel in its normalizer (Σ_j |s_ij| / |1 + Σ_j s_ij| reaches ~1.7e3 at random init in
    these models), so there both fp32 paths err by up to ~1e-3 of the largest logit, by turns;
    its fp32 decoding is held to the first-order bound κ γ_n at the op
    (``test_ops_recurrent.py::test_fp32_decoding_is_within_rounding_of_fp64_however_...``).
    The fp32 errors are compared token by token in units of each token's rounding sensitivity,
    against the full forward in three shapes (``assert_decoding_as_accurate``): in a plain norm
    a few cancelling tokens carry the error, and the ratio of two errors is a draw, not a
    property (under other simulated summation orders, ``blas_noise``, psf_random's Frobenius
    ratio against one reference reached 2.6 in llama)."""
    model = tiny(family)
    convert(model, attention, chunk_size=8)
    x = ids(t=27)

    def decode(m):
        cache = PolysketchCache(m)
        with torch.no_grad():
            parts = [m(input_ids=x[:, :5], **{CACHE: cache}, use_cache=True).logits]
            for i in range(5, x.shape[1]):
                parts.append(m(input_ids=x[:, i : i + 1], **{CACHE: cache}).logits)
        assert cache.get_seq_length() == x.shape[1]
        return torch.cat(parts, dim=1)

    exact = copy.deepcopy(model).double()
    full64 = logits(exact, x)
    assert (decode(exact) - full64).abs().max() <= 1e-10 * full64.abs().max()
    cores = [m.polysketch for m in model.modules() if hasattr(m, "polysketch")]
    if all(c.feature_map is None or c.feature_map.nonnegative for c in cores):
        assert_decoding_as_accurate(decode(model), model, exact, x)


def test_mixed_form_with_a_learnable_map_is_causal_and_decodes():
    model = tiny("llama")
    convert(model, "psf_learned", mixed=True, degree=8, chunk_size=8)
    core = model.model.layers[0].self_attn.polysketch
    assert core.form == "mixed" and core.degree == 8
    x = ids(t=27)
    y = x.clone()
    y[:, 13:] = (y[:, 13:] + 1) % V
    full = logits(model, x)
    assert torch.equal(full[:, :13], logits(model, y)[:, :13])
    cache = PolysketchCache(model)
    with torch.no_grad():
        parts = [model(input_ids=x[:, :10], **{CACHE: cache}).logits]
        parts += [model(input_ids=x[:, i : i + 1], **{CACHE: cache}).logits for i in range(10, 27)]
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-4 * full.abs().max()
    with pytest.raises(ValueError, match="mixed"):
        convert(model, "softmax", mixed=True)
    with pytest.raises(ValueError, match="window of >= chunk_size"):  # none of its own block
        convert(model, "soft_hash_far")


def test_mixed_form_with_hedgehog_takes_the_local_degree_and_decodes():
    """hedgehog has no degree: degree= is the local one; the local polynomial gets q/k norms."""
    model = tiny("llama")
    convert(model, "hedgehog", mixed=True, degree=8, chunk_size=8)
    core = model.model.layers[0].self_attn.polysketch
    assert core.form == "mixed" and core.degree == 8
    assert core.q_norm is not None and core.denominator_offset == 1.0
    assert not hasattr(core.feature_map.head_map(0), "degree")
    x = ids(t=27)
    full = logits(model, x)
    y = x.clone()
    y[:, 13:] = (y[:, 13:] + 1) % V
    assert torch.equal(full[:, :13], logits(model, y)[:, :13])
    cache = PolysketchCache(model)
    with torch.no_grad():
        parts = [model(input_ids=x[:, :10], **{CACHE: cache}).logits]
        parts += [model(input_ids=x[:, i : i + 1], **{CACHE: cache}).logits for i in range(10, 27)]
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-4 * full.abs().max()
    plain = tiny("llama")
    convert(plain, "hedgehog", chunk_size=8)
    core = plain.model.layers[0].self_attn.polysketch
    assert core.form == "linear" and core.q_norm is None and core.denominator_offset == 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("attention", ["psf_random", "psf_mixed"])
def test_generate_equals_full_forward_greedy(family, attention):
    model = _decisive(tiny(family))
    convert(model, attention, chunk_size=8)
    prompt = ids(t=6, seed=1)
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        seq = prompt
        for _ in range(20):
            nxt = logits(model, seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)


def test_softmax_conversion_generates_like_the_original():
    model = _decisive(tiny("llama"))
    prompt = ids(t=6)
    kw = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 10, "do_sample": False,
          "pad_token_id": 0}  # fmt: skip
    with torch.no_grad():
        ref = model.generate(prompt, **kw)
        convert(model, "softmax")  # decodes from transformers' own KV cache
        assert torch.equal(model.generate(prompt, **kw), ref)


@pytest.mark.parametrize("attention", ["psf_random", "psf_mixed"])
def test_beam_search_with_the_state_cache_equals_beam_search_without_cache(attention):
    model = _decisive(tiny("llama"))
    convert(model, attention, chunk_size=8)  # beams reorder / repeat the states
    prompt = ids(t=6)
    kw = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 12, "do_sample": False,
          "num_beams": 3, "pad_token_id": 0}  # fmt: skip
    with torch.no_grad():
        assert torch.equal(
            model.generate(prompt, **kw), model.generate(prompt, use_cache=False, **kw)
        )


def test_generate_uses_constant_size_state():
    model = tiny("llama")
    convert(model, "psf_random")
    sizes = []
    for n in (5, 40):
        cache = PolysketchCache(model)
        with torch.no_grad():
            model.generate(ids(t=4), attention_mask=torch.ones(2, 4, dtype=torch.long),
                           max_new_tokens=n, do_sample=False, **{CACHE: cache},
                           pad_token_id=0)  # fmt: skip
        sizes.append(cache.num_floats())
        assert cache.get_seq_length() == 4 + n - 1  # the last token is never fed back
    assert sizes[0] == sizes[1] > 0
    # generate picks the PolysketchCache by itself after convert
    seen = []
    orig = PolysketchCache.__init__

    def spy(self, m):
        seen.append(1)
        orig(self, m)

    PolysketchCache.__init__ = spy
    try:
        with torch.no_grad():
            model.generate(ids(t=4), attention_mask=torch.ones(2, 4, dtype=torch.long),
                           max_new_tokens=3, do_sample=False, pad_token_id=0)  # fmt: skip
    finally:
        PolysketchCache.__init__ = orig
    assert seen


def test_padding_left_padded_sequence_matches_unpadded():
    model = tiny("llama")
    convert(model, "psf_random", chunk_size=8)
    x = ids(b=1, t=20)
    pad = 5
    xp = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], dim=1)
    mask = torch.cat(
        [torch.zeros(1, pad, dtype=torch.long), torch.ones(1, 20, dtype=torch.long)], 1
    )
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    a = logits(model, x)
    b = logits(model, xp, attention_mask=mask, position_ids=pos)[:, pad:]
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()


def test_non_causal_masks_are_refused():
    model = tiny("mistral")
    model.config.sliding_window = 8
    with pytest.raises(ValueError, match='sliding_window="full"'):  # convert says it first now
        convert(model, "psf_random")
    convert(model, "psf_random", sliding_window="full")
    t = 20  # a mask that is not "causal AND key kept" (here a window of 8, given as 4D)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    band = ((j <= i) & (j > i - 8)).expand(2, 1, t, t)
    with pytest.raises(ValueError, match="causal mask with key padding"):
        logits(model, ids(t=t), attention_mask=band)


# ----- scale ---------------------------------------------------------------------------------
def test_qk_layernorm_makes_polynomial_kernels_scale_free():
    """A pretrained q·k has any scale: after the q/k LayerNorm, scaling q and k changes nothing."""
    x = ids()
    changes = {}
    for qk_norm in (None, False):  # None: the default for polynomial presets (on)
        model = tiny("llama")
        convert(model, "psf_mixed", chunk_size=8, qk_norm=qk_norm)
        core = model.model.layers[0].self_attn.polysketch
        assert (core.q_norm is not None) == (qk_norm is None)
        ref = logits(model, x)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(10.0)
                layer.self_attn.k_proj.weight.mul_(3.0)
        changes[qk_norm] = float((logits(model, x) - ref).abs().max() / ref.abs().max())
    assert changes[None] <= 1e-3  # only LayerNorm's eps is not scale-free
    assert changes[False] > 1e-2


def test_softmax_random_features_use_the_models_own_scaling():
    model = tiny("gpt2")
    model.config.scale_attn_by_inverse_layer_idx = True
    model = transformers.GPT2LMHeadModel(model.config).eval()  # per-layer scale 1/(√D (l+1))
    convert(model, "positive")
    for block in model.transformer.h:
        core = block.attn.polysketch
        assert core.q_norm is None
        assert core.feature_map.head_map(0).scale == pytest.approx(block.attn.scaling)
    assert model.transformer.h[0].attn.scaling != model.transformer.h[1].attn.scaling
    convert(model, "hedgehog")  # imitates exp(scaling·q·k): the target of its fit
    for block in model.transformer.h:
        assert block.attn.polysketch.q_norm is None
        assert block.attn.polysketch.feature_map.head_map(0).scale == pytest.approx(
            block.attn.scaling
        )


# ----- GQA -----------------------------------------------------------------------------------
def test_gqa_matches_the_equivalent_multi_head_model():
    gqa = tiny("llama", kv_heads=2)
    mha = tiny("llama", kv_heads=4)
    sd = gqa.state_dict()
    d = 16
    for key in list(sd):
        if key.endswith(("k_proj.weight", "v_proj.weight")):  # kv head g serves heads 2g, 2g+1
            w = sd[key].unflatten(0, (2, d))
            sd[key] = w.repeat_interleave(2, dim=0).flatten(0, 1)
    mha.load_state_dict(sd)
    x = ids()
    assert (logits(gqa, x) - logits(mha, x)).abs().max() <= 1e-5
    for m in (gqa, mha):
        convert(m, "psf_mixed", chunk_size=8)
    assert (logits(gqa, x) - logits(mha, x)).abs().max() <= 1e-4


# ----- save / load -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_save_load_round_trip(tmp_path, family):
    model = tiny(family)
    convert(model, "psf_learned", chunk_size=8)
    with torch.no_grad():  # make the added modules differ from their initialization
        for p in trainable_attention_parameters(model):
            p.add_(0.1 * torch.randn_like(p))
    x = ids()
    ref = logits(model, x)
    model.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["polysketch"]["attention"] == "psf_learned"
    loaded = load_converted(tmp_path / "m").eval()
    assert polysketch_settings(loaded) == polysketch_settings(model)
    assert torch.equal(logits(loaded, x), ref)


def test_load_converted_refuses_a_plain_checkpoint(tmp_path):
    tiny("llama").save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="polysketch settings"):
        load_converted(tmp_path / "plain")


# ----- arguments -------------------------------------------------------------------------------
def test_bad_arguments_name_the_argument():
    model = tiny("llama")
    with pytest.raises(ValueError, match="attention"):
        convert(model, "not_a_map")
    with pytest.raises(TypeError, match="attention"):
        convert(model, 3)
    with pytest.raises(ValueError, match="chunk_size"):
        convert(model, "psf_random", chunk_size=0)
    with pytest.raises(TypeError, match="qk_norm"):
        convert(model, "psf_random", qk_norm="yes")
    with pytest.raises(TypeError, match="map_kwargs"):
        convert(model, "psf_random", projection=object())
    with pytest.raises(TypeError, match="model"):
        convert(torch.nn.Linear(2, 2), "psf_random")
    with pytest.raises(ValueError, match="steps"):
        attention_transfer(convert(model, "psf_learned"), ids(t=100).flatten(), steps=-1)
    with pytest.raises(ValueError, match="mode"):
        finetune(model, ids(t=100).flatten(), steps=1, mode="half")


# ----- stage 1: attention transfer -------------------------------------------------------------
def test_attention_transfer_lowers_output_mse():
    model = tiny("llama")
    convert(model, "psf_learned", chunk_size=16)
    tokens = ids(b=1, t=4000, seed=3).flatten()
    frozen = {k: v.clone() for k, v in model.state_dict().items() if ".polysketch." not in k}
    hist = attention_transfer(model, tokens, steps=40, seq_len=32, batch_size=4, lr=1e-2)
    first, last = sum(hist[:5]) / 5, sum(hist[-5:]) / 5
    assert last < 0.7 * first
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # the rest stays frozen


def test_attention_transfer_trains_the_hedgehog_weights():
    model = tiny("llama")
    convert(model, "hedgehog", chunk_size=16)
    names = [n for n, _ in model.named_parameters() if ".polysketch." in n]
    assert any("weight_q" in n for n in names) and any("weight_k" in n for n in names)
    assert len(trainable_attention_parameters(model)) == len(names) == 2 * 4  # 2 layers
    start = {n: p.detach().clone() for n, p in model.named_parameters() if ".polysketch." in n}
    tokens = ids(b=1, t=4000, seed=3).flatten()
    hist = attention_transfer(model, tokens, steps=30, seq_len=32, batch_size=4, lr=1e-2)
    assert sum(hist[-5:]) < 0.9 * sum(hist[:5])
    after = dict(model.named_parameters())
    assert all(not torch.equal(after[n], t) for n, t in start.items())


def test_finetune_lora_merges_back_into_a_plain_model():
    model = tiny("llama")
    convert(model, "psf_random", chunk_size=8)
    tokens = ids(b=1, t=2000, seed=4).flatten()
    out, hist = finetune(model, tokens, steps=3, seq_len=16, batch_size=2, lr=1e-3, mode="lora")
    assert type(out).__name__ == "LlamaForCausalLM" and len(hist) == 3
    assert not any("lora" in k for k in out.state_dict())
    x = ids()
    assert torch.isfinite(logits(out, x)).all()


# ----- the command line ------------------------------------------------------------------------
def test_cli_linearize_end_to_end(tmp_path, capsys):
    model = tiny("llama", vocab=256, layers=1)
    model.save_pretrained(tmp_path / "base")
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"Now is the winter of our discontent {i}.\n" for i in range(200)))
    out = tmp_path / "out"
    rc = main(["linearize", "--model", str(tmp_path / "base"), "--attention", "psf_learned",
               "--data", str(text), "--out", str(out), "--seq-len", "32", "--batch-size", "2",
               "--transfer-steps", "2", "--finetune-steps", "2", "--eval-batches", "1",
               "--chunk-size", "8", "--mixed", "--map-kw", "num_features=8"])  # fmt: skip
    assert rc == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "perplexity" in printed and "KV cache" in printed
    # progress shows though stderr is not a terminal (issue 43)
    assert "attention transfer" in captured.err and "fine-tune (lora)" in captured.err
    res = json.loads((out / "results.json").read_text())[0]
    for stage in ("original", "converted", "transfer", "finetune"):
        assert res[f"loss_{stage}"] > 0
    assert abs(res["loss_reloaded"] - res["loss_finetune"]) < 1e-5
    assert (out / "results.csv").exists() and (out / "linearize.png").stat().st_size > 0
    settings = load_converted(out / "model").config.polysketch
    assert settings["attention"] == "psf_learned" and settings["options"]["mixed"] is True


def test_cli_linearize_no_progress_reaches_the_config(tmp_path, capsys, monkeypatch):
    import polysketch.integrations.transformers as hf

    seen = {}

    def stop(model, attention, data, *, config, **kwargs):
        seen["progress"] = config.progress
        raise ValueError("stopped here")

    monkeypatch.setattr(hf, "linearize_saved", stop)
    model = tiny("llama", vocab=256, layers=1)
    model.save_pretrained(tmp_path / "base")
    for flag, progress in (([], True), (["--no-progress"], False)):
        out = tmp_path / f"out{len(flag)}"
        assert main(["linearize", "--model", str(tmp_path / "base"), "--out", str(out), *flag]) == 2
        assert seen.pop("progress") is progress
    assert "stopped here" in capsys.readouterr().err


def test_cli_linearize_reports_bad_model(tmp_path, capsys):
    rc = main(["linearize", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "error" in capsys.readouterr().err
