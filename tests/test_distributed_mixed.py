"""Context-parallel mixed attention (psf_mixed; gloo, 2 and 4 forked ranks) equals the
single-process ``mixed_attention`` on the whole sequence: the block grid stays global, the
halo brings the previous shards' rows of the block that crosses each boundary, and the
prefix over ranks never counts that block twice. Outputs and gradients of q, k, v and of the
feature map's parameters; fp64 to 1e-10, fp32 within the naive reference's error."""

from __future__ import annotations

import pytest
import torch

from polysketch import features
from polysketch.distributed import cp_mixed_attention, record_collectives
from polysketch.ops import mixed_attention, naive_mixed_attention
from polysketch.ops.pairs import state_dim
from test_distributed_harness import bounds, combine, compare, grad_of, rel, run_ranks

B, H, D, E = 2, 2, 6, 4
MAPS = {
    "plain": ("hedgehog", {"num_features": 5}),
    "square": ("learned_polysketch", {"num_features": 4}),
}
CASES = {
    "square_chunk8": {"map": "square"},  # W=4: halos of 2, 3, 4 rows
    "plain_offset_scale": {"map": "plain", "offset": 1.0, "scale": 0.5},
    "chunk16_short_shards": {"map": "square", "chunk": 16},  # halos spanning two ranks
    "chunk_over_T": {"map": "plain", "chunk": 64},  # one block: everything local
    "aligned": {"map": "square", "T": 32},  # shards end on the block grid
    "chunk1": {"map": "plain", "chunk": 1},  # no halo: everything through the features
    "T1": {"map": "square", "T": 1},
    "T_below_world": {"map": "plain", "T": 3, "chunk": 2},
    "uneven_split": {"map": "square", "split": {2: [5, 32], 4: [0, 17, 3, 17]}, "offset": 1.0},
    "no_local_scores": {"map": "plain", "local": "none"},  # soft_hash_far's form
    "no_local_scores_uneven": {"map": "square", "local": "none", "split": {2: [5, 32]}},
}
FP32_CASES = ("square_chunk8", "plain_offset_scale")


def _setting(name):
    c = {"T": 37, "chunk": 8, "offset": 0.0, "scale": None, "split": {}, "local": "polynomial"}
    c.update(CASES[name])
    return c


def make(name, dtype):
    c = _setting(name)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    kind, kwargs = MAPS[c["map"]]
    shape = (B, H, c["T"])
    return {
        "c": c,
        "fmap": features.create(kind, D, seed=5, **kwargs).to(dtype),
        "q": torch.randn(*shape, D, generator=g, dtype=dtype) / 2,
        "k": torch.randn(*shape, D, generator=g, dtype=dtype) / 2,
        "v": torch.randn(*shape, E, generator=g, dtype=dtype),
        "w": torch.randn(*shape, E, generator=g, dtype=dtype),
    }


def _run(data, lo, hi, op):
    c, fmap = data["c"], data["fmap"]
    q, k, v = (data[x][..., lo:hi, :].clone().requires_grad_() for x in "qkv")
    out = op(q, k, v, fmap.query(q), fmap.key(k), chunk_size=c["chunk"], degree=4,
             square=fmap.square, denominator_offset=c["offset"], scale=c["scale"],
             local=c["local"])  # fmt: skip
    fmap.zero_grad()
    (out * data["w"][..., lo:hi, :]).sum().backward()
    res = {"out": out.detach(), "q": grad_of(q), "k": grad_of(k), "v": grad_of(v)}
    res.update({f"param.{n}": p.grad for n, p in fmap.named_parameters()})
    return res


def _rank_run(rank, world, names, dtype):
    results = {}
    for name in names:
        data = make(name, getattr(torch, dtype))
        with record_collectives() as log:
            results[name] = _run(data, *bounds(data["c"], world, rank), cp_mixed_attention)
        results[name]["bytes"] = [(r.name, r.phase, r.payload_bytes) for r in log.records]
    return results


def reference(name, dtype, op=mixed_attention):
    data = make(name, dtype)
    return _run(data, 0, data["c"]["T"], op)


def _check(world, names, results, tol=1e-10):
    failures = []
    for name in names:
        bad = compare(combine(results, name), reference(name, torch.float64), tol)
        failures += [f"{name}: {line}" for line in bad]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_mixed_attention_equals_single_process_fp64(world):
    _check(world, list(CASES), run_ranks(world, _rank_run, list(CASES), "float64"))


def test_cp_mixed_attention_fp32_within_the_naive_reference_error():
    results = run_ranks(2, _rank_run, list(FP32_CASES), "float32")
    failures = []
    for name in FP32_CASES:
        truth = reference(name, torch.float64)
        got, naive = combine(results, name), reference(name, torch.float32, naive_mixed_attention)
        for key, want in truth.items():
            if want is not None and float(want.abs().max()) > 0:
                budget = max(4 * rel(naive[key], want), 1e-6)
                if rel(got[key], want) > budget:
                    failures.append(f"{name}: {key} error {rel(got[key], want):.3g} > {budget:.3g}")
    assert not failures, "\n".join(failures)


def test_bytes_are_one_halo_and_one_state_per_direction():
    """A halo of b - 1 rows of [k φk v] (+ the shard length) and [N Z] of the complete blocks,
    forward and backward; independent of T."""
    names = ["square_chunk8", "aligned", "chunk16_short_shards"]
    results = run_ranks(2, _rank_run, names, "float64")
    for name in names:
        data = make(name, torch.float64)
        b, fmap = data["c"]["chunk"], data["fmap"]
        halo = B * H * (b - 1) * (D + fmap.feature_dim + E) * 8
        state = B * H * state_dim(fmap.feature_dim, fmap.square) * (E + 1) * 8
        want = [("halo", "forward", halo + 4 * 8), ("state", "forward", state),
                ("state", "backward", state), ("halo", "backward", halo)]  # fmt: skip
        for r in results:
            assert r[name]["bytes"] == want, name


def _refuse_relu(rank, world):
    x = torch.randn(1, 4, 3, dtype=torch.float64)
    try:
        cp_mixed_attention(x, x, x, x.exp(), x.exp(), local="relu", chunk_size=2)
    except ValueError as err:
        return {"message": str(err)}
    return {"message": ""}


def test_relu_local_kernel_is_refused():
    for r in run_ranks(2, _refuse_relu):
        assert "local" in r["message"] and "polynomial" in r["message"]
