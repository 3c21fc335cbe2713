"""A harness that runs a function on W gloo ranks (forked processes) and returns their results,
and the tests of the pieces every distributed test relies on: the harness, the shard split,
the group argument and the metadata encoding of ``polysketch.distributed.comm``."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from polysketch.distributed import resolve_group, shard_bounds
from polysketch.distributed.comm import _decode, _encode

RANK_TIMEOUT_S = 60  # gloo's collective timeout inside the ranks, and the harness's deadline base


def _worker(rank, world_size, store, out_dir, fn, args):
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S),
        )  # fmt: skip
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # gloo connects the ranks pairwise inside init_process_group, and a rank returns from
        # it once its own pairs are up: a rank whose ``fn`` runs no collective could exit and
        # close its sockets while a peer is still connecting ("Connection closed by peer").
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_ranks(world_size: int, fn, *args, timeout: float = 2 * RANK_TIMEOUT_S) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` forked processes joined in a gloo
    group; returns the ranks' results (torch.save-able) in rank order. A rank that fails
    stops the others at once; the failure's traceback is in the raised error."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, tmp, fn, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = False
        while any(p.is_alive() for p in procs):
            failed = any(p.exitcode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        for p in procs:  # our own children only
            if p.is_alive():
                p.kill()
            p.join()
        errors = [
            open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp)) if f.endswith(".err")
        ]
        if errors or any(p.exitcode != 0 for p in procs):
            codes = [p.exitcode for p in procs]
            raise AssertionError(f"ranks failed (exit codes {codes}):\n" + "\n".join(errors))
        return [
            torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True)
            for r in range(world_size)
        ]


def bounds(c: dict, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s shard for a test case ``c``: ``c["split"][world]`` (shard
    lengths) when given, else the balanced split of ``c["T"]``."""
    lengths = c["split"].get(world)
    if lengths is None:
        return shard_bounds(c["T"], world, rank)
    start = sum(lengths[:rank])
    return start, start + lengths[rank]


def grad_of(x: torch.Tensor) -> torch.Tensor:
    """x.grad, or zeros for an empty shard (an input of no rows reaches no output: None)."""
    if x.grad is None:
        assert x.numel() == 0, f"no gradient reached an input of shape {tuple(x.shape)}"
        return torch.zeros_like(x)
    return x.grad


def combine(results: list[dict], name: str, cat=("out", "q", "k", "v")) -> dict:
    """The ranks' results as one: shards concatenated along T, parameter and initial-state
    gradients summed (what DDP/FSDP would all-reduce), final states checked equal."""
    ranks = [r[name] for r in results]
    out = {x: torch.cat([r[x] for r in ranks], dim=-2) for x in cat}
    for key in ranks[0]:
        if key.startswith("param.") or key in ("n0", "z0"):
            grads = [r[key] for r in ranks if r[key] is not None]
            out[key] = sum(grads) if grads else None
        elif key.startswith("state."):
            for r in ranks[1:]:  # the total is the same on every rank, bit for bit
                assert torch.equal(torch.as_tensor(r[key]), torch.as_tensor(ranks[0][key])), key
            out[key] = ranks[0][key]
    return out


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def compare(got: dict, want: dict, tol: float) -> list[str]:
    """Every entry of ``want`` against ``got``; the failures as lines."""
    bad = []
    for key, w in want.items():
        g = got.get(key)
        if w is None or g is None:
            if (w is None) != (g is None) and not (g is None and float(w.abs().max()) == 0):
                bad.append(f"{key}: one side is None")
            continue
        if key == "state.length":
            if g != w:
                bad.append(f"{key}: {g} != {w}")
            continue
        if tuple(torch.as_tensor(g).shape) != tuple(torch.as_tensor(w).shape):
            bad.append(f"{key}: shape {tuple(g.shape)} != {tuple(w.shape)}")
        elif float(torch.as_tensor(w).abs().max()) == 0:
            if float(torch.as_tensor(g).abs().max()) != 0:
                bad.append(f"{key}: expected zeros")
        elif rel(g, w) > tol:
            bad.append(f"{key}: relative error {rel(g, w):.3g} > {tol:g}")
    return bad


# ----- tests of the pieces -------------------------------------------------------------------
def test_shard_bounds_is_the_balanced_contiguous_split():
    for length in (0, 1, 3, 10, 37):
        for world in (1, 2, 4):
            pieces = [shard_bounds(length, world, r) for r in range(world)]
            assert pieces[0][0] == 0 and pieces[-1][1] == length
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
            sizes = [e - s for s, e in pieces]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            want = [len(x) for x in torch.arange(length).tensor_split(world)]
            assert sizes == want
    with pytest.raises(ValueError, match="rank"):
        shard_bounds(10, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        shard_bounds(10, 0, 0)


def test_metadata_digits_are_exact_in_every_float_dtype():
    values = [0, 1, 255, 256, 262_144, 2**32 - 1]
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        assert _decode(_encode(values, torch.empty(0, dtype=dtype))) == values
    with pytest.raises(ValueError, match="metadata"):
        _encode([2**32], torch.empty(0))


def test_group_refused_without_torch_distributed():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(ValueError, match="group"):
        resolve_group(None)


def _echo(rank, world_size, extra):
    value = torch.tensor([float(rank + extra)])
    out = [torch.empty(1) for _ in range(world_size)]
    dist.all_gather(out, value)
    return {"rank": rank, "gathered": torch.cat(out)}


def test_harness_runs_ranks_and_reports_failures():
    results = run_ranks(2, _echo, 10)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["gathered"].tolist() == [10.0, 11.0]
    with pytest.raises(AssertionError, match="ranks failed"):
        run_ranks(2, _echo, "not a number", timeout=30)
