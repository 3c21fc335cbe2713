"""Converted HF models: every cache a user can pass is supported exactly or refused before
anything is computed (issue 22 item 2); sliding-window configs (Mistral, Qwen3, Phi-3,
Gemma-3) and Gemma-2's logit soft-capping are refused or handled as ``convert`` says, and
forward and generate agree (items 4, 5)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from polysketch.integrations.transformers import PolysketchCache, convert  # noqa: E402
from polysketch.nn.core import AttentionCore  # noqa: E402

V = 64
COMMON = {
    "vocab_size": V,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _model(family="llama", window=8):
    kw = dict(COMMON)
    if family == "llama":
        cfg = transformers.LlamaConfig(**kw)
    elif family == "mistral":
        cfg = transformers.MistralConfig(sliding_window=window, **kw)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(use_sliding_window=True, sliding_window=window,
                                       max_window_layers=0, head_dim=16, **kw)  # fmt: skip
    elif family == "phi3":
        cfg = transformers.Phi3Config(sliding_window=window, pad_token_id=0, eos_token_id=1, **kw)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(sliding_window=window, head_dim=16,
                                            layer_types=["sliding_attention", "full_attention"],
                                            **kw)  # fmt: skip
    else:
        cfg = transformers.Gemma2Config(sliding_window=window, head_dim=16, **kw)
        cfg._attn_implementation = "eager"  # soft-capping: SDPA cannot run it
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def _ids(b=2, t=25, seed=0):
    return torch.randint(1, V, (b, t), generator=torch.Generator().manual_seed(seed))


class _Counter:
    """Counts attention-core calls (nothing computed = 0)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = AttentionCore.attend

        def attend(core, *args, **kwargs):
            self.calls += 1
            return real(core, *args, **kwargs)

        monkeypatch.setattr(AttentionCore, "attend", attend)


GEN = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}


# ----- caches (item 2) --------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["psf_random", "psf_mixed", "hedgehog", "polynomial"])
@pytest.mark.parametrize("impl", ["static", "offloaded_static", "sliding_window", "hybrid",
                                  "offloaded", "dynamic", "quantized"])  # fmt: skip
def test_generate_refuses_unsupported_caches_before_computing(attention, impl, monkeypatch):
    """Every cache_implementation: refused before the prefill, or exactly the tokens of
    decoding without a cache (never anything else)."""
    model = _model()
    convert(model, attention, chunk_size=8)
    x = _ids()
    count = _Counter(monkeypatch)
    try:
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x),
                                 cache_implementation=impl, **GEN)  # fmt: skip
    except ImportError:  # quantized caches need optimum-quanto / hqq
        assert impl == "quantized"
        pytest.skip("no quantization backend installed")
    except ValueError as err:
        assert "Cache" in str(err) and attention in str(err)
        assert count.calls == 0  # refused before the prefill
        assert not (attention == "polynomial" and impl == "dynamic")  # its own cache
        return
    assert impl in ("hybrid", "dynamic")  # dynamic: polynomial's own cache; hybrid: none
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x), use_cache=False, **GEN)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("attention", ["psf_random", "psf_mixed", "polynomial", "sliding_window"])
def test_forward_refuses_cache_objects_it_cannot_use(attention, monkeypatch):
    model = _model()
    kw = {"window": 6} if attention == "sliding_window" else {}
    convert(model, attention, chunk_size=8, **kw)
    x = _ids()
    caches = [transformers.StaticCache(config=model.config, max_cache_len=64),
              transformers.DynamicCache(config=_model("mistral").config)]  # fmt: skip
    if attention != "polynomial":
        caches.append(transformers.DynamicCache())
    else:
        caches.append(PolysketchCache.__new__(PolysketchCache))  # any other Cache class
    count = _Counter(monkeypatch)
    for cache in caches:
        if isinstance(cache, transformers.DynamicCache):  # one step already in it
            with torch.no_grad():
                model.model(input_ids=x[:, :3], past_key_values=cache, use_cache=True)
            count.calls = 0
        with pytest.raises(ValueError, match="Cache"), torch.no_grad():
            model(input_ids=x, past_key_values=cache, use_cache=True)
        assert count.calls == 0


def test_supported_caches_still_work():
    """A plain forward (transformers makes a DynamicCache itself) and the state cache."""
    model = _model()
    convert(model, "psf_mixed", chunk_size=8)
    x = _ids()
    with torch.no_grad():
        a = model(input_ids=x).logits  # use_cache=True by default: an internal DynamicCache
        b = model(input_ids=x, use_cache=False).logits
        cache = PolysketchCache(model)
        c = model(input_ids=x, past_key_values=cache).logits
    assert torch.equal(a, b) and (c - b).abs().max() <= 1e-5


def test_softmax_conversion_keeps_every_cache_it_had():
    model = _model()
    x = _ids()
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x), **GEN)
        convert(model, "softmax")
        for impl in ("static", "dynamic"):
            got = model.generate(x, attention_mask=torch.ones_like(x), cache_implementation=impl,
                                 **GEN)  # fmt: skip
            assert torch.equal(got, ref), impl


# ----- sliding windows (item 4) ----------------------------------------------------------------
FAMILIES = ["mistral", "qwen3", "phi3", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_window_is_refused_unless_convert_is_told(family):
    model = _model(family)
    with pytest.raises(ValueError, match='sliding_window="full"') as err:
        convert(model, "psf_random")
    assert "8 tokens" in str(err.value)
    with pytest.raises(ValueError, match="sliding_window must be one of"):
        convert(model, "psf_random", sliding_window="window")
    x = _ids(t=30)
    with torch.no_grad():
        ref = model(input_ids=x).logits
        convert(model, "softmax")  # the model's own windowed attention: kept exactly
        assert torch.equal(model(input_ids=x).logits, ref)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["psf_mixed", "polynomial", "hedgehog"])
def test_full_window_forward_and_generate_agree(family, attention):
    model = _model(family)
    convert(model, attention, chunk_size=8, sliding_window="full")
    x = _ids(t=30)
    with torch.no_grad():
        full = model(input_ids=x, use_cache=False).logits
        y = x.clone()
        y[:, 2] = (y[:, 2] + 1) % V  # 27 tokens before the last one: far outside the window
        assert not torch.allclose(model(input_ids=y, use_cache=False).logits[:, -1], full[:, -1])
        out = model.generate(x[:, :10], attention_mask=torch.ones(2, 10, dtype=torch.long),
                             max_new_tokens=20, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        ref = model(input_ids=out.sequences, use_cache=False).logits[:, 9:-1]
    got = torch.stack(out.logits, dim=1)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_full_window_refuses_a_window_mask_with_more_than_padding():
    """Packed sequences (position ids restarting) under a dropped window: refused."""
    model = _model("mistral")
    convert(model, "psf_random", chunk_size=8, sliding_window="full")
    x = _ids(b=1, t=20)
    pos = torch.cat([torch.arange(10), torch.arange(10)])[None]
    with pytest.raises(ValueError, match="packed"), torch.no_grad():
        model(input_ids=x, position_ids=pos, use_cache=False)


# ----- Gemma-2 soft-capping (item 5) ---------------------------------------------------------
def test_gemma2_softcapping_kept_in_softmax_mode_and_refused_or_dropped_in_linear_modes():
    model = _model("gemma2")
    assert model.config.attn_logit_softcapping is not None
    x = _ids(t=30)
    with torch.no_grad():
        ref = model(input_ids=x).logits
        convert(model, "softmax")  # exact: the model's own eager attention applies the cap
        assert (model(input_ids=x).logits - ref).abs().max() <= 1e-5
        gen = model.generate(x[:, :6], attention_mask=torch.ones(2, 6, dtype=torch.long), **GEN)
    linear = _model("gemma2")
    with pytest.raises(ValueError, match='softcap="drop"'):
        convert(linear, "psf_random", sliding_window="full")
    convert(linear, "psf_random", sliding_window="full", softcap="drop", chunk_size=8)
    with torch.no_grad():
        assert torch.isfinite(linear(input_ids=x).logits).all()
    linear.model.layers[0].self_attn.polysketch.drop_softcap = False  # as if not told
    with pytest.raises(ValueError, match="soft-caps"), torch.no_grad():
        linear(input_ids=x)
    assert gen.shape == (2, 10)


def test_load_converted_keeps_the_window_policy(tmp_path):
    from polysketch.integrations.transformers import load_converted, polysketch_settings

    model = _model("mistral")
    convert(model, "psf_random", chunk_size=8, sliding_window="full")
    model.save_pretrained(tmp_path / "m")
    loaded = load_converted(tmp_path / "m").eval()
    assert polysketch_settings(loaded)["sliding_window"] == "full"
    x = _ids(t=30)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)
    # a model saved before the policy was recorded: the caller says it
    import json

    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["polysketch"]["sliding_window"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match='sliding_window="full"'):
        load_converted(tmp_path / "m")
    assert load_converted(tmp_path / "m", sliding_window="full") is not None
