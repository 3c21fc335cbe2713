"""Context-parallel causal linear attention (gloo, 2 and 4 forked ranks) equals the
single-process ``linear_attention`` on the whole sequence: outputs, gradients of q, k, v, of the
feature map's parameters (through the features) and of the initial state, and the final
state. fp64 to 1e-10 relative; fp32 within the error of the fp32 naive reference."""

from __future__ import annotations

import pytest
import torch

from polysketch import features
from polysketch.distributed import cp_linear_attention, record_collectives
from polysketch.ops import LinearAttentionState, linear_attention, naive_linear_attention
from polysketch.ops.pairs import state_dim
from polysketch.ops.varlen import naive_varlen_linear_attention
from test_distributed_harness import bounds, combine, compare, grad_of, rel, run_ranks

B, H, D, E = 2, 2, 6, 4
MAPS = {
    "plain": ("hedgehog", {"num_features": 5}),
    "square": ("learned_polysketch", {"num_features": 4}),
}

CASES = {
    "plain": {"map": "plain"},
    "square": {"map": "square"},
    "plain_padding_offset": {"map": "plain", "padding": True, "offset": 1.0},
    "square_padding_states": {"map": "square", "padding": True, "initial": True, "final": True,
                              "offset": 1.0},
    "plain_states": {"map": "plain", "initial": True, "final": True},
    "unnormalized": {"map": "plain", "normalize": False, "final": True},
    "chunk_multiple": {"map": "square", "T": 32, "chunk": 8, "final": True},
    "T1": {"map": "plain", "T": 1, "initial": True, "final": True},
    "T1_square": {"map": "square", "T": 1, "final": True},
    "T_below_world": {"map": "square", "T": 3, "initial": True, "final": True},
    "T_below_world_no_state": {"map": "plain", "T": 3},  # an empty rank reads nothing
    "shard_starts_a_document": {"map": "plain", "cu": [0, 19, 37]},  # ranks 1 (W=2), 2 (W=4)
    "uneven_split": {"map": "plain", "split": {2: [5, 32], 4: [0, 20, 2, 15]}, "initial": True,
                     "final": True},
    "packed": {"map": "plain", "cu": [0, 3, 10, 12, 37], "initial": True, "final": True},
    "packed_square": {"map": "square", "cu": [0, 19, 20, 28, 30, 37], "padding": True,
                      "final": True},
    "packed_short_docs": {"map": "plain", "cu": [0, 2, 4, 9, 9, 11, 18, 19, 21, 37],
                          "split": {2: [4, 33], 4: [9, 0, 12, 16]}, "initial": True,
                          "final": True},
    "packed_one_rank_resets": {"map": "square", "cu": [0, 30, 37], "initial": True, "final": True},
}  # fmt: skip
FP32_CASES = ("plain", "square", "plain_padding_offset", "packed_square")


def _setting(name):
    c = {"T": 37, "chunk": 8, "offset": 0.0, "normalize": True, "padding": False,
         "initial": False, "final": False, "cu": None, "split": {}}  # fmt: skip
    c.update(CASES[name])
    return c


def make(name: str, dtype: torch.dtype, world: int) -> dict:
    """The case's global data, the same in every process (seeded)."""
    c = _setting(name)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    t = c["T"]
    kind, kwargs = MAPS[c["map"]]
    fmap = features.create(kind, D, seed=3, **kwargs).to(dtype)
    fs = state_dim(fmap.feature_dim, fmap.square)
    data = {
        "c": c,
        "fmap": fmap,
        "q": torch.randn(B, H, t, D, generator=g, dtype=dtype),
        "k": torch.randn(B, H, t, D, generator=g, dtype=dtype),
        "v": torch.randn(B, H, t, E, generator=g, dtype=dtype),
        "w": torch.randn(B, H, t, E, generator=g, dtype=dtype),
        "n0": torch.rand(B, H, fs, E, generator=g, dtype=dtype),
        "z0": torch.rand(B, H, fs, generator=g, dtype=dtype) + 0.5,
        "wn": torch.randn(world, B, H, fs, E, generator=g, dtype=dtype),
        "wz": torch.randn(world, B, H, fs, generator=g, dtype=dtype),
        "keep": torch.rand(B, 1, t, generator=g) > 0.3 if c["padding"] else None,
    }
    if data["keep"] is not None:
        data["keep"][..., 0] = True  # every query of the first document sees a key
    return data


def _attend(data, q, k, v, keep, *, initial, distributed):
    c, fmap = data["c"], data["fmap"]
    kw = {"square": fmap.square, "chunk_size": c["chunk"], "denominator_offset": c["offset"],
          "normalize": c["normalize"], "initial_state": initial, "return_state": c["final"],
          "key_padding_mask": keep, "cu_seqlens": c["cu"]}  # fmt: skip
    if distributed:
        return cp_linear_attention(fmap.query(q), fmap.key(k), v, **kw)
    return linear_attention(fmap.query(q), fmap.key(k), v, causal=True, **kw)


def _leaves(data, lo, hi):
    q, k, v = (data[x][..., lo:hi, :].clone().requires_grad_() for x in "qkv")
    init = None
    if data["c"]["initial"]:
        n0, z0 = data["n0"].clone().requires_grad_(), data["z0"].clone().requires_grad_()
        init = LinearAttentionState(n0, z0, 5)
    return q, k, v, init


def _grads(data, q, k, v, init, out, state, ranks, lo, hi):
    """Backward of Σ out·w + Σ_{r in ranks} state·w_r; the gradients and results."""
    loss = (out * data["w"][..., lo:hi, :]).sum()
    if state is not None:
        loss = loss + (state.numerator * data["wn"][ranks].sum(0)).sum()
        loss = loss + (state.denominator * data["wz"][ranks].sum(0)).sum()
    data["fmap"].zero_grad()
    loss.backward()
    res = {"out": out.detach(), "q": grad_of(q), "k": grad_of(k), "v": grad_of(v)}
    res.update({f"param.{n}": p.grad for n, p in data["fmap"].named_parameters()})
    if init is not None:
        res["n0"], res["z0"] = init.numerator.grad, init.denominator.grad
    if state is not None:
        res["state.n"], res["state.z"] = state.numerator.detach(), state.denominator.detach()
        res["state.length"] = state.length
    return res


def _rank_run(rank, world, names, dtype):
    dtype = getattr(torch, dtype)
    results = {}
    for name in names:
        data = make(name, dtype, world)
        lo, hi = bounds(data["c"], world, rank)
        q, k, v, init = _leaves(data, lo, hi)
        keep = None if data["keep"] is None else data["keep"][..., lo:hi]
        with record_collectives() as log:
            res = _attend(data, q, k, v, keep, initial=init, distributed=True)
            out, state = res if data["c"]["final"] else (res, None)
            results[name] = _grads(data, q, k, v, init, out, state, [rank], lo, hi)
        results[name]["bytes"] = [(r.name, r.phase, r.payload_bytes) for r in log.records]
    return results


def reference(name: str, dtype: torch.dtype, world: int) -> dict:
    data = make(name, dtype, world)
    t = data["c"]["T"]
    q, k, v, init = _leaves(data, 0, t)
    res = _attend(data, q, k, v, data["keep"], initial=init, distributed=False)
    out, state = res if data["c"]["final"] else (res, None)
    return _grads(data, q, k, v, init, out, state, list(range(world)), 0, t)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_linear_attention_equals_single_process_fp64(world):
    results = run_ranks(world, _rank_run, list(CASES), "float64")
    failures = []
    for name in CASES:
        bad = compare(combine(results, name), reference(name, torch.float64, world), 1e-10)
        failures += [f"{name}: {line}" for line in bad]
    assert not failures, "\n".join(failures)


def _naive32(name: str, world: int) -> dict:
    """fp32 naive (quadratic) output and gradients: the error budget of fp32."""
    data = make(name, torch.float32, world)
    c, fmap = data["c"], data["fmap"]
    q, k, v, _ = _leaves(data, 0, c["T"])
    kw = {"square": fmap.square, "denominator_offset": c["offset"],
          "key_padding_mask": data["keep"]}  # fmt: skip
    if c["cu"] is not None:
        out = naive_varlen_linear_attention(fmap.query(q), fmap.key(k), v, c["cu"], **kw)
    else:
        out = naive_linear_attention(fmap.query(q), fmap.key(k), v, causal=True, **kw)
    return _grads(data, q, k, v, None, out, None, [], 0, c["T"])


def test_cp_linear_attention_fp32_within_the_naive_reference_error():
    results = run_ranks(2, _rank_run, list(FP32_CASES), "float32")
    failures = []
    for name in FP32_CASES:
        truth = reference(name, torch.float64, 2)
        got, naive = combine(results, name), _naive32(name, 2)
        for key, want in truth.items():
            if key in naive and want is not None and float(want.abs().max()) > 0:
                budget = max(4 * rel(naive[key], want), 1e-6)
                if rel(got[key], want) > budget:
                    failures.append(f"{name}: {key} error {rel(got[key], want):.3g} > {budget:.3g}")
    assert not failures, "\n".join(failures)


def test_bytes_are_states_only_and_independent_of_the_length():
    """One forward all-gather of [N Z] (+ 2 metadata ints) and one backward gather of its
    gradient (two with the final state): B·H·F'·(E+1) elements, whatever T is."""
    results = run_ranks(2, _rank_run, ["plain", "chunk_multiple", "plain_states"], "float64")
    for name in ("plain", "chunk_multiple", "plain_states"):
        data = make(name, torch.float64, 2)
        fs = state_dim(data["fmap"].feature_dim, data["fmap"].square)
        state = B * H * fs * (E + 1) * 8
        meta = 2 * 4 * 8  # two ints, four digits each
        final = 2 if data["c"]["final"] else 1
        want = [("state", "forward", state + meta), ("state", "backward", final * state)]
        for r in results:
            assert r[name]["bytes"] == want, name


def _refusals(rank, world):
    """Errors every rank raises together (no rank left waiting in a collective)."""
    data = make("packed", torch.float64, world)
    lo, hi = bounds(data["c"], world, rank)
    q, k, v, _ = _leaves(data, lo, hi)
    fmap = data["fmap"]
    messages = []
    for cu in ([0, 3, 36], [0, 20, 10, 37]):
        try:
            cp_linear_attention(fmap.query(q), fmap.key(k), v, cu_seqlens=cu)
        except ValueError as err:
            messages.append(str(err))
    try:
        cp_linear_attention(fmap.query(q), fmap.key(k[..., :0, :]), v)
    except ValueError as err:
        messages.append(str(err))
    return {"messages": messages}


def test_refusals_name_the_argument_on_every_rank():
    for r in run_ranks(2, _refusals):
        first, second, third = r["messages"]
        assert "cu_seqlens" in first and "37" in first
        assert "cu_seqlens" in second and "non-decreasing" in second
        assert "phi_k" in third


def _mesh_run(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    dp, cp = mesh.get_coordinate()
    data = make("packed_square" if dp else "plain_states", torch.float64, 2)
    lo, hi = bounds(data["c"], 2, cp)
    q, k, v, init = _leaves(data, lo, hi)
    keep = None if data["keep"] is None else data["keep"][..., lo:hi]
    kw = {"square": data["fmap"].square, "chunk_size": data["c"]["chunk"],
          "initial_state": init, "return_state": True, "key_padding_mask": keep,
          "cu_seqlens": data["c"]["cu"], "group": mesh["cp"]}  # fmt: skip
    out, state = cp_linear_attention(data["fmap"].query(q), data["fmap"].key(k), v, **kw)
    try:
        cp_linear_attention(q, k, v, group=mesh)
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {"dp": dp, "cp": cp, "out": out.detach(), "state.n": state.numerator.detach(),
            "refused": refused}  # fmt: skip


def test_the_cp_dimension_of_a_dp_x_cp_device_mesh():
    """Two sequences on a 2 x 2 (dp, cp) mesh: each cp pair computes its own sequence."""
    results = run_ranks(4, _mesh_run)
    for dp, name in ((0, "plain_states"), (1, "packed_square")):
        ranks = sorted((r for r in results if r["dp"] == dp), key=lambda r: r["cp"])
        data = make(name, torch.float64, 2)
        q, k, v, init = _leaves(data, 0, data["c"]["T"])
        want, state = linear_attention(
            data["fmap"].query(q), data["fmap"].key(k), v, causal=True, square=data["fmap"].square,
            chunk_size=data["c"]["chunk"], initial_state=init, return_state=True,
            key_padding_mask=data["keep"], cu_seqlens=data["c"]["cu"],
        )  # fmt: skip
        assert rel(torch.cat([r["out"] for r in ranks], dim=-2), want) < 1e-10, name
        for r in ranks:
            assert rel(r["state.n"], state.numerator) < 1e-10, name
            assert "1-D" in r["refused"] and "mesh['cp']" in r["refused"]


def _inference(rank, world):
    data = make("square", torch.float64, world)
    lo, hi = bounds(data["c"], world, rank)
    with torch.no_grad():
        fmap = data["fmap"]
        out = cp_linear_attention(
            fmap.query(data["q"][..., lo:hi, :]), fmap.key(data["k"][..., lo:hi, :]),
            data["v"][..., lo:hi, :], square=True, chunk_size=8,
        )  # fmt: skip
    return {"out": out}


def test_inference_without_gradients():
    results = run_ranks(2, _inference)
    want = reference("square", torch.float64, 2)["out"]
    assert rel(torch.cat([r["out"] for r in results], dim=-2), want) < 1e-10
