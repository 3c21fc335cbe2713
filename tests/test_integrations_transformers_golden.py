"""Golden converted models: Hugging Face models converted and saved by an earlier version keep
loading, with the same logits (issue 71: convert builds its layers from the one spec).

``tests/golden/converted/<case>/`` holds what ``save_pretrained`` wrote after
``convert(tiny_model, ...)`` (config.json with its ``polysketch`` settings, the weights) on
2026-12-07, before convert was rebuilt on the resolver, and ``logits.pt``: the fp64 logits of
the loaded model on a fixed batch then. ``load_converted`` must rebuild each from its
config.json and reproduce those logits in fp64 to ``TOL`` (sums reordered by a refactor move a
logit by ≈ n·u₆₄·κ ≈ 1e-13 for these 2-layer models, n ≲ 2·10³ terms and condition κ ≲ 10²:
``TOL`` = 1e-10 leaves a factor of 10³; another computation moves them by ≳ 1e-3).

``python tests/test_integrations_transformers_golden.py --write`` writes the cases anew. Run
it ONLY for a change of behaviour stated in CHANGELOG.md: the stored folders are what a user's
saved models look like.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

GOLDEN = Path(__file__).resolve().parent / "golden" / "converted"
TOL = 1e-10
V = 64

CASES = {
    # name: (family, attention, convert keywords)
    "llama_psf_mixed": ("llama", "psf_mixed", {"chunk_size": 8}),
    "llama_psf_random_window_heads": (
        "llama", "psf_random", {"chunk_size": 8, "local_window": 8, "global_heads": 2}),
    "llama_soft_hash_far_local_balanced": ("llama", "soft_hash_far_local_balanced", {}),
    "gpt2_hedgehog_mixed": ("gpt2", "hedgehog", {"mixed": True, "degree": 4, "chunk_size": 8}),
    "gpt_neox_sliding_window": ("gpt_neox", "sliding_window", {"window": 12}),
    "llama_positive": ("llama", "positive", {"num_features": 32, "chunk_size": 16}),
}


def _tokens() -> torch.Tensor:
    return torch.randint(0, V, (2, 70), generator=torch.Generator().manual_seed(7))


def _build(case: str):
    from polysketch.integrations.transformers import convert
    from test_integrations_transformers import tiny

    family, attention, kw = CASES[case]
    torch.manual_seed(0)
    model = tiny(family, vocab=V)
    return convert(model, attention, seed=3, **kw)


@torch.no_grad()
def _logits64(model) -> torch.Tensor:
    return model.double()(input_ids=_tokens(), use_cache=False).logits


def write() -> None:
    from polysketch.integrations.transformers import load_converted

    for case in CASES:
        out = GOLDEN / case
        out.mkdir(parents=True, exist_ok=True)
        _build(case).save_pretrained(out)
        torch.save({"logits": _logits64(load_converted(out))}, out / "logits.pt")
        print(f"wrote {out}")


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_converted_and_saved_before_loads_with_the_same_logits(case):
    from polysketch.integrations.transformers import load_converted

    folder = GOLDEN / case
    want = torch.load(folder / "logits.pt", weights_only=True)["logits"]
    got = _logits64(load_converted(folder))
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) <= TOL


def test_every_case_is_stored():
    assert sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()) == sorted(CASES)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__)
    write()
