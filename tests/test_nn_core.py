"""The one attention core (``nn.core.AttentionCore``, issue 23 §2) under KernelAttention and
the transformers adapter: same tensors give the same outputs for every preset and several
maps, in forward and decoding; the precision policy (half operands reach the ops under the
accelerator policy, also for a converted bf16 model); mixed attention with any map, its
learned balance and the global-part ablation; the sliding-window attention."""

import math

import pytest
import torch
from einops import rearrange

from conftest import rel_err, seeded
from polysketch.nn import (
    AttentionCore,
    KernelAttention,
    TransformerConfig,
    TransformerLM,
    ablate_global,
)
from polysketch.nn.ablate import is_ablated
from polysketch.ops import naive_window_attention, polynomial_attention

E, H = 16, 2
D = E // H

CASES = [
    ("softmax", {}),
    ("polynomial", {}),
    ("psf_random", {}),
    ("psf_learned", {}),
    ("psf_mixed", {}),
    ("sliding_window", {"window": 3}),
    ("sliding_window", {"window": 4, "kernel": "polynomial"}),
    ("positive", {}),
    ("hedgehog", {}),
    ("llops", {}),
    ("elu", {}),
    ("taylor", {}),
    ("hedgehog", {"mixed": True, "degree": 2}),
    ("psf_mixed", {"learn_balance": True}),
    ("llops", {"mixed": True, "learn_balance": True}),
    ("soft_hash_far", {"num_features": 12}),
]
IDS = [f"{a}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for a, kw in CASES]


def _layer(attention, **kw):
    torch.manual_seed(0)
    return KernelAttention(E, H, attention=attention, chunk_size=4, **kw).double()


def _adapter(layer, attention, kw):
    """The transformers adapter's core with the layer's core tensors."""
    from polysketch.integrations.transformers import PolysketchAttention
    from polysketch.nn import LayerSpec, resolve_attention
    from polysketch.nn.resolve import split_options

    opts, _, maps = split_options(kw)  # the core alone: no window beside soft_hash_far here
    opts = {**opts, "chunk_size": 4, "softmax_scale": D**-0.5}
    spec = resolve_attention(attention, D, maps, opts)
    core = PolysketchAttention(LayerSpec(spec), head_dim=D, num_heads=H,
                               layer_index=0).double()  # fmt: skip
    result = core.load_state_dict(layer.state_dict(), strict=False)
    assert not result.missing_keys  # every core tensor came from the layer
    return core


def _project(layer, x):
    q, k, v = (rearrange(p, "b t (h d) -> b h t d", h=H) for p in layer.qkv(x).split(E, dim=-1))
    return q, k, v


@pytest.mark.parametrize("attention,kw", CASES, ids=IDS)
def test_layer_and_transformers_adapter_share_one_core(attention, kw):
    pytest.importorskip("transformers")
    layer = _layer(attention, rope=False, **kw)  # no RoPE: the norm's place does not matter
    core = _adapter(layer, attention, kw)
    assert isinstance(core, AttentionCore) and core.form == layer.form
    x = torch.randn(2, 11, E, generator=seeded(1), dtype=torch.float64)
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[0, :3] = False
    for mask in (None, keep):
        want = layer(x, key_padding_mask=mask)
        q, k, v = _project(layer, x)
        got = layer.out_proj(rearrange(core(q, k, v, keep=mask), "b h t d -> b t (h d)"))
        assert rel_err(got, want) <= 1e-12, mask is None
    # decoding: prefill 6 then one token at a time, from each side's own cache
    a, b = layer.new_cache(), core.new_state() if core.uses_state_cache else core.new_cache()
    outs = []
    for lo, hi in [(0, 6)] + [(t, t + 1) for t in range(6, 11)]:
        q, k, v = (y[..., lo:hi, :] for y in _project(layer, x))
        mine = layer.out_proj(rearrange(core(q, k, v, state=b), "b h t d -> b t (h d)"))
        outs.append((layer(x[:, lo:hi], cache=a), mine))
    for want, got in outs:
        assert rel_err(got, want) <= 1e-12
    assert a.num_floats() == b.num_floats() == 2 * layer.decode_state_size(11)


@pytest.fixture
def accelerator_policy(monkeypatch):
    """The dispatcher as on an accelerator (operands keep half dtypes, the batched layout),
    on the CPU; records (backend, operand dtype) of every linear / mixed op call."""
    from polysketch.nn import core as core_module
    from polysketch.ops import dispatch, kernel, mixed

    monkeypatch.setattr(dispatch, "operand_dtype", lambda dtype, device: dtype)
    monkeypatch.setattr(dispatch, "layout_for", lambda device: "chunked_blocks")
    monkeypatch.setattr(mixed, "operand_dtype", lambda dtype, device: dtype)
    return _record(monkeypatch, kernel, mixed, core_module)


def _record(monkeypatch, kernel, mixed, core_module):
    seen = []
    real_plan, real_blocks = kernel.plan, mixed.blocks_lt_multiply
    real_step = core_module.linear_attention_token

    def plan(*args, **kwargs):
        p = real_plan(*args, **kwargs)
        seen.append((p.name, p.operand_dtype))
        return p

    def blocks(a, *args, **kwargs):
        seen.append(("mixed", a.dtype))
        return real_blocks(a, *args, **kwargs)

    def step(phi_q, *args, **kwargs):
        seen.append(("step", phi_q.dtype))
        return real_step(phi_q, *args, **kwargs)

    monkeypatch.setattr(kernel, "plan", plan)
    monkeypatch.setattr(mixed, "blocks_lt_multiply", blocks)
    monkeypatch.setattr(core_module, "linear_attention_token", step)
    return seen


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("attention", ["psf_random", "psf_mixed", "hedgehog"])
def test_converted_bf16_model_keeps_half_operands(attention, accelerator_policy):
    """Issue 23: the adapter cast q/k/v to fp32 on every device, so converted models never
    reached half operands (tensor cores, Triton). Now the dispatcher decides, as for the layer."""
    from polysketch.integrations.transformers import PolysketchCache, convert

    model = _tiny_llama().to(torch.bfloat16)
    convert(model, attention, chunk_size=8)
    x = torch.randint(0, 64, (2, 20), generator=seeded(0))
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits
        cache = PolysketchCache(model)
        model(input_ids=x[:, :12], past_key_values=cache)
        model(input_ids=x[:, 12:13], past_key_values=cache)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    kinds = {name for name, _ in accelerator_policy}
    assert kinds == ({"mixed"} if attention == "psf_mixed" else {"chunked_blocks", "step"})
    assert all(dtype == torch.bfloat16 for _, dtype in accelerator_policy)


def test_cpu_policy_computes_half_models_in_fp32(monkeypatch):
    from polysketch.integrations.transformers import convert
    from polysketch.nn import core as core_module
    from polysketch.ops import kernel, mixed

    seen = _record(monkeypatch, kernel, mixed, core_module)
    model = _tiny_llama().to(torch.bfloat16)
    convert(model, "psf_random", chunk_size=8)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (1, 20)), use_cache=False)
    assert seen and all(entry == ("chunked_scan", torch.float32) for entry in seen)


def test_layer_under_autocast_keeps_half_operands_with_qk_norm(accelerator_policy):
    """A LayerNorm under autocast returns fp32; the working dtype is autocast's (bf16)."""
    layer = KernelAttention(32, 2, attention="psf_random", chunk_size=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(1, 20, 32))
    assert y.dtype == torch.bfloat16
    assert accelerator_policy == [("chunked_blocks", torch.bfloat16)]


# ----- mixed attention with any map, learned balance, ablation -------------------------------
def test_one_spelling_for_mixed_attention():
    layer = _layer("hedgehog", mixed=True, degree=6)
    assert layer.form == "mixed" and layer.degree == 6
    assert layer.q_norm is not None and layer.denominator_offset == 1.0
    cfg = TransformerConfig(vocab_size=11, n_layer=1, n_head=2, n_embd=16, attention="llops",
                            mixed=True, chunk_size=4)  # fmt: skip
    model = TransformerLM(cfg)
    assert model.blocks[0].attn.form == "mixed"
    preset, spelled = _layer("psf_mixed"), _layer("polysketch", mixed=True, output_scale=32**-0.5)
    spelled.load_state_dict(preset.state_dict())
    x = torch.randn(2, 9, E, generator=seeded(0), dtype=torch.float64)
    assert torch.equal(preset(x), spelled(x))  # psf_mixed is a preset of mixed=True
    with pytest.raises(ValueError, match="mixed=True needs a feature-map attention"):
        _layer("softmax", mixed=True)
    with pytest.raises(ValueError, match="learn_balance"):
        _layer("psf_random", learn_balance=True)


@pytest.mark.parametrize(
    "attention,kw,square",
    [("psf_mixed", {}, True), ("hedgehog", {"mixed": True, "degree": 2}, False)],
)
def test_learned_balance_is_exactly_an_output_scale(attention, kw, square):
    c = 7.3
    x = torch.randn(2, 13, E, generator=seeded(2), dtype=torch.float64)
    plain = _layer(attention, output_scale=c ** (0.25 if square else 0.5), **kw)
    learned = _layer(attention, learn_balance=True, output_scale=1.0, **kw)
    learned.load_state_dict(
        {**plain.state_dict(), "log_balance": torch.full((H,), math.log(c), dtype=torch.float64)}
    )
    assert rel_err(learned(x), plain(x)) <= 1e-12  # far-block scores × c, both ways
    default = _layer(attention, learn_balance=True, **kw)  # starts where the preset starts
    ref = _layer(attention, **kw)
    ref.load_state_dict(default.state_dict(), strict=False)
    assert rel_err(default(x), ref(x)) <= 1e-7  # β was made in fp32: its rounding only
    if attention == "psf_mixed":
        assert torch.allclose(default.log_balance, torch.full((H,), -2 * math.log(32.0)).double())
    y = default(x)
    (grad,) = torch.autograd.grad(y.square().sum(), default.log_balance)
    assert torch.isfinite(grad).all() and (grad.abs() > 0).all()  # gradients reach β_h
    cache = default.new_cache()  # and decoding reads the same balance
    parts = [default(x[:, :6], cache=cache)] + [default(x[:, t : t + 1], cache=cache)
                                               for t in range(6, 13)]  # fmt: skip
    assert rel_err(torch.cat(parts, 1), y) <= 1e-10


def test_ablate_global_leaves_block_local_exact_attention():
    layer = _layer("psf_mixed", rope=False)
    x = torch.randn(2, 13, E, generator=seeded(4), dtype=torch.float64)
    q, k, v = _project(layer, x)
    q, k = layer.q_norm(q), layer.k_norm(k)
    local = torch.cat([polynomial_attention(q[..., s : s + 4, :], k[..., s : s + 4, :],
                                            v[..., s : s + 4, :], degree=4, causal=True,
                                            denominator_offset=1.0)
                       for s in range(0, 13, 4)], dim=-2)  # fmt: skip
    want = layer.out_proj(rearrange(local, "b h t d -> b t (h d)"))
    full = layer(x)
    with ablate_global(layer):
        assert is_ablated(layer)
        assert rel_err(layer(x), want) <= 1e-12
        cache = layer.new_cache()
        steps = [layer(x[:, :5], cache=cache)] + [layer(x[:, t : t + 1], cache=cache)
                                                  for t in range(5, 13)]  # fmt: skip
        assert rel_err(torch.cat(steps, 1), want) <= 1e-10
    assert not is_ablated(layer) and torch.equal(layer(x), full)
    with pytest.raises(ValueError, match="no attention with a separate global part"):
        with ablate_global(_layer("psf_random")):
            pass


# ----- sliding window ----------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["softmax", "polynomial"])
def test_sliding_window_layer(kernel):
    layer = _layer("sliding_window", window=5, kernel=kernel, rope=False)
    assert layer.form == "window" and (layer.q_norm is not None) == (kernel == "polynomial")
    x = torch.randn(2, 17, E, generator=seeded(5), dtype=torch.float64)
    q, k, v = _project(layer, x)
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    ref = naive_window_attention(q, k, v, window=5, kernel=kernel,
                                 denominator_offset=layer.denominator_offset)  # fmt: skip
    assert rel_err(layer(x), layer.out_proj(rearrange(ref, "b h t d -> b t (h d)"))) <= 1e-12
    cache = layer.new_cache()
    steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t : t + 1], cache=cache)
                                              for t in range(3, 17)]  # fmt: skip
    assert rel_err(torch.cat(steps, 1), layer(x)) <= 1e-10
    assert layer.decode_state_size(3) == H * 2 * D * 3
    assert layer.decode_state_size(17) == layer.decode_state_size(1000) == H * 2 * D * 5
    assert cache.num_floats() == 2 * layer.decode_state_size(17)  # constant: the window
    with pytest.raises(ValueError, match="window=w"):
        _layer("sliding_window")
    with pytest.raises(ValueError, match="window= is an option"):
        _layer("psf_random", window=4)
