"""Converted HF models under left padding (issue 22 item 1): batched == each row alone.

A Llama generates, in one left-padded batch, prompts of 100, 70 and 30 tokens with blocks of
64: first-step logits and 20 greedy tokens equal each row's own run, for every preset and for
``convert(..., mixed=True)``; a plain forward with left padding equals the rows alone.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from numerics import assert_as_accurate  # noqa: E402
from polysketch.integrations.transformers import convert  # noqa: E402

V = 64
LENGTHS = (100, 70, 30)
SETTINGS = [
    ("psf_random", {}),
    ("psf_learned", {}),
    ("psf_mixed", {}),
    ("polynomial", {}),
    ("softmax", {}),
    ("hedgehog", {}),
    ("sliding_window", {"window": 24}),
    ("hedgehog", {"mixed": True, "degree": 4}),
    ("psf_learned", {"mixed": True}),
    ("positive", {"mixed": True}),
]
IDS = [f"{a}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for a, kw in SETTINGS]


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # decisive argmax: greedy choices far from ties
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone() * 30)
    model.generation_config.eos_token_id = None
    return model


def _batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, V, (n,), generator=g) for n in LENGTHS]
    t = max(LENGTHS)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros(len(prompts), t, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, t - len(p) :], mask[b, t - len(p) :] = p, 1
    return prompts, ids, mask


@pytest.mark.parametrize("attention,kw", SETTINGS, ids=IDS)
def test_left_padded_generate_equals_each_row_alone(attention, kw):
    model = _llama()
    convert(model, attention, chunk_size=64, **kw)
    prompts, ids, mask = _batch()
    gen = {"max_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, output_logits=True,
                             return_dict_in_generate=True, **gen)  # fmt: skip
        for b, p in enumerate(prompts):
            ones = torch.ones(1, len(p), dtype=torch.long)
            alone = model.generate(p[None], attention_mask=ones, output_logits=True,
                                   return_dict_in_generate=True, **gen)  # fmt: skip
            assert torch.equal(out.sequences[b, ids.shape[1] :], alone.sequences[0, len(p) :]), b
            first, ref = out.logits[0][b], alone.logits[0][0]
            assert (first - ref).abs().max() <= 1e-4 * ref.abs().max(), b


@pytest.mark.parametrize("attention,kw", SETTINGS, ids=IDS)
def test_left_padded_forward_equals_each_row_alone(attention, kw):
    model = _llama()
    convert(model, attention, chunk_size=64, **kw)
    prompts, ids, mask = _batch()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)  # transformers' position ids for left padding
    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        for b, p in enumerate(prompts):
            ref = model(input_ids=p[None], use_cache=False).logits[0]
            truth = exact(input_ids=p[None], use_cache=False).logits[0]
            # a padded batch rounds in other shapes than the row alone: as accurate as it
            assert_as_accurate(got[b, ids.shape[1] - len(p) :], ref, truth)


# ----- a plain forward without position_ids (issue 43 item 3) -----------------------------
# Every preset and model preset (soft_hash_far with the window it needs beside it, issue 43
# item 1), on a RoPE family and on GPT-2 (learned absolute positions): the caller passes only
# the mask.
PRESET_SETTINGS = [
    ("psf_random", {}),
    ("psf_learned", {}),
    ("psf_mixed", {}),
    ("polynomial", {}),
    ("soft_hash_1k", {}),
    ("soft_hash_far", {"local_window": 64}),
    ("softmax", {}),
    ("sliding_window", {"window": 24}),
    ("hedgehog", {}),
    ("positive", {"mixed": True}),
    ("soft_hash_local", {}),
    ("soft_hash_far_local", {}),
    ("soft_hash_far_local_tied", {}),
    ("soft_hash_far_local_balanced", {}),
]
PRESET_IDS = [f"{a}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for a, kw in PRESET_SETTINGS]


def _tiny(family):
    from test_integrations_transformers import tiny

    return tiny(family, vocab=V)


def test_every_preset_is_in_the_list():
    from polysketch.nn.presets import MODEL_PRESETS, PRESETS

    assert set(PRESETS) | set(MODEL_PRESETS) <= {a for a, _ in PRESET_SETTINGS}


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
@pytest.mark.parametrize("attention,kw", PRESET_SETTINGS, ids=PRESET_IDS)
def test_left_padded_forward_without_position_ids_equals_each_row_alone(family, attention, kw):
    model = _tiny(family)
    convert(model, attention, chunk_size=64, **kw)
    prompts, ids, mask = _batch()
    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for b, p in enumerate(prompts):
            ref = model(input_ids=p[None], use_cache=False).logits[0]
            truth = exact(input_ids=p[None], use_cache=False).logits[0]
            assert_as_accurate(got[b, ids.shape[1] - len(p) :], ref, truth)


def test_left_padded_cached_steps_without_position_ids_equal_each_row_alone():
    """A hand-written decode loop passing only the growing mask (no position_ids)."""
    from polysketch.integrations.transformers import PolysketchCache

    model = _tiny("llama")
    convert(model, "psf_mixed", chunk_size=64)
    prompts, ids, mask = _batch()
    nxt = torch.randint(1, V, (len(prompts), 3), generator=torch.Generator().manual_seed(1))
    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        cache = PolysketchCache(model)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        steps = []
        for i in range(nxt.shape[1]):
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
            out = model(input_ids=nxt[:, i : i + 1], attention_mask=mask, past_key_values=cache)
            steps.append(out.logits[:, -1])
        for b, p in enumerate(prompts):
            row = torch.cat([p, nxt[b]])[None]
            ref = model(input_ids=row, use_cache=False).logits[0]
            truth = exact(input_ids=row, use_cache=False).logits[0]
            for i, step in enumerate(steps):
                assert_as_accurate(step[b], ref[len(p) + i], truth[len(p) + i])


def test_a_padded_4d_mask_without_position_ids_is_refused():
    model = _tiny("llama")
    convert(model, "psf_random", chunk_size=64)
    _, ids, mask = _batch()
    t = ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mask4 = causal[None, None] & mask.bool()[:, None, None, :]
    with pytest.raises(ValueError, match="position_ids"):
        model(input_ids=ids, attention_mask=mask4, use_cache=False)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)  # with them, it runs
    model(input_ids=ids, attention_mask=mask4, position_ids=pos, use_cache=False)
