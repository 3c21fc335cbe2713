"""Context parallelism of ``psf_random`` linear attention: bytes, wall time, peak memory.

Three measurements of one attention layer (polysketch degree-2 Gaussian sketch, r = 32,
self-tensored, normalizer 1 + Σ; B = 1, D = E = 64, block 256, fp32), each in fresh
processes joined by gloo on this CPU (``--worker``; one intra-op thread per process):

* ``bytes``: what one rank receives per layer and step, forward and backward, against ring
  attention's K/V exchange. The formulas, evaluated at the issue's target (T = 256k, H = 12,
  W = 4 ranks), and the all-gather sizes measured (``polysketch.distributed.record_collectives``)
  at smaller T with H = 12 and W = 4, which must equal the formula and not depend on T:

      ours, forward:   (W-1) · B·H·F'·(E+1) · 4 B  (+ 32 B of metadata),  F' = F(F/2+1) = 544
      ours, backward:  the same (the prefix gradients; twice with a returned final state)
      ring, forward:   (W-1) · (T/W)·B·H·(D+E) · 2 B  (every other shard's K and V in bf16)
      ring, backward:  at least twice the forward (K, V again and dK, dV in bf16)

* ``time``: forward + backward of the layer at growing T, 1 process (``linear_attention``)
  and 2 processes (``cp_linear_attention``), side by side in one run; the ratio 1-proc / 2-proc
  (> 1: context parallelism is faster). The machine's 2 cores are shared with other sessions,
  so two processes rarely get two cores: the load average is printed beside every figure, and
  one rank's work alone is timed too (``cp_linear_attention`` on T/2 in a group of one, the
  same process layout as 1-proc), whose ratio is the speed-up two idle cores would give
  before communication.
* ``rss``: peak RSS per process (``ru_maxrss``) of forward + backward at T = 256k, H = 4,
  with 4 processes against 1; also the RSS of a process before its data (interpreter + torch).
  glibc's malloc moves its mmap threshold with the allocation history, which made identical
  ranks' peaks differ by up to 270 MB here; ``--mmap-threshold`` (default 1 MiB, 0: glibc's
  default) fixes it (``MALLOC_MMAP_THRESHOLD_``) for every process, single and parallel alike.

Writes ``bytes.json``, ``time.json``, ``rss.json`` and ``README.md`` into ``--out``
(default ``docs/results/cp``; existing files are refused without ``--overwrite``)::

    python benchmarks/cp_attention.py all --out docs/results/cp
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
D = E = 64
R = 32  # sketch size: F = 32 features, squared
PAIRS = R * (R // 2 + 1)  # F' = 544


# ----- formulas -------------------------------------------------------------------------------
def ours_bytes(world, b, h, *, dense=False, final=False):
    """(forward, backward) bytes one rank receives: one all-gather of [N Z] per direction."""
    fs = R * R if dense else PAIRS
    state = b * h * fs * (E + 1) * 4
    return (world - 1) * (state + 32), (world - 1) * state * (2 if final else 1)


def ring_bytes(world, t, b, h):
    """(forward, backward) bytes one rank receives in ring attention: every other shard's K
    and V in bf16; the backward sends K, V again plus dK, dV (bf16): twice the forward."""
    fwd = (world - 1) * (t // world) * b * h * (D + E) * 2
    return fwd, 2 * fwd


# ----- workers (one process each) -----------------------------------------------------------
def worker(task, t_local, heads, repeats, seed):
    import resource

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from polysketch import features
    from polysketch.distributed import cp_linear_attention, record_collectives
    from polysketch.ops import linear_attention

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cp = world > 1 or os.environ.get("CP_ONE_RANK") == "1"  # a group of one: a rank's work
    if cp:
        dist.init_process_group("gloo")
    base_rss = _current_rss_mb()
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    fm = features.create("polysketch", D, degree=2, num_features=R, projection="gaussian",
                         nonnegative=True, seed=0)  # fmt: skip
    q, k = (F.layer_norm(torch.randn(1, heads, t_local, D, generator=g), (D,)) for _ in "qk")
    v = torch.randn(1, heads, t_local, E, generator=g)
    for x in (q, k, v):
        x.requires_grad_()
    kw = {"square": True, "chunk_size": 256, "denominator_offset": 1.0}

    def step():
        pq, pk = fm.query(q), fm.key(k)
        if not cp:
            out = linear_attention(pq, pk, v, causal=True, **kw)
        else:
            out = cp_linear_attention(pq, pk, v, **kw)
        out.sum().backward()

    result = {"rank": rank, "world": world, "t_local": t_local, "base_rss_mb": base_rss}
    if task == "bytes":
        with record_collectives() as log:
            step()
        result["records"] = [(r.name, r.phase, r.payload_bytes, r.received_bytes)
                             for r in log.records]  # fmt: skip
    elif task == "time":
        step()  # warm-up
        times = []
        for _ in range(repeats):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            step()
            if world > 1:
                dist.barrier()
            times.append(time.perf_counter() - start)
        result["seconds"] = times
    else:  # rss
        step()
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if cp:
        dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


def _current_rss_mb():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(task, world, t, heads, repeats=1, seed=0, mmap_threshold=0, one_rank=False):
    """Run ``task`` on ``world`` fresh processes (balanced shards of t); their results.
    ``one_rank``: a single process runs ``cp_linear_attention`` in a group of one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
           "PYTHONPATH": str(ROOT / "src"), "CP_ONE_RANK": "1" if one_rank else "0"}  # fmt: skip
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    procs = []
    for rank in range(world):
        t_local = t // world + (1 if rank < t % world else 0)
        cmd = [sys.executable, __file__, "--worker", task, str(t_local), str(heads),
               str(repeats), str(seed)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank)},
                                      stdout=subprocess.PIPE, text=True))  # fmt: skip
    results = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"worker failed ({p.returncode}): {out[-2000:]}")
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    return results


def load():
    return round(os.getloadavg()[0], 2)


# ----- measurements ---------------------------------------------------------------------------
def measure_bytes(lengths, world=4, heads=12):
    target_t = 256 * 1024
    fwd, bwd = ours_bytes(world, 1, heads)
    dense_fwd, _ = ours_bytes(world, 1, heads, dense=True)
    ring_fwd, ring_bwd = ring_bytes(world, target_t, 1, heads)
    out = {
        "target": {
            "T": target_t,
            "B": 1,
            "H": heads,
            "D": D,
            "E": E,
            "W": world,
            "F": R,
            "F_pairs": PAIRS,
            "ours_forward": fwd,
            "ours_backward": bwd,
            "ours_forward_dense_FxF": dense_fwd,
            "ring_forward_bf16": ring_fwd,
            "ring_backward_bf16": ring_bwd,
            "ring_over_ours_forward": ring_fwd / fwd,
            "ring_over_ours_forward_dense": ring_fwd / dense_fwd,
        },  # fmt: skip
        "measured": [],
    }
    for t in lengths:
        ranks = launch("bytes", world, t, heads)
        recv = {ph: sum(r[3] for r in ranks[0]["records"] if r[1] == ph)
                for ph in ("forward", "backward")}  # fmt: skip
        same = all(r["records"] == ranks[0]["records"] for r in ranks)
        out["measured"].append({"T": t, "records_rank0": ranks[0]["records"],
                                "received_forward": recv["forward"],
                                "received_backward": recv["backward"],
                                "formula_forward": fwd, "formula_backward": bwd,
                                "equal_on_all_ranks": same})  # fmt: skip
    return out


def measure_time(lengths, heads=4, repeats=3):
    rows = []
    for t in lengths:
        load_1 = load()
        one = launch("time", 1, t, heads, repeats)[0]["seconds"]
        load_2 = load()
        two = launch("time", 2, t, heads, repeats)[0]["seconds"]  # barriers: rank 0's = wall
        load_w = load()
        work = launch("time", 1, t // 2, heads, repeats, one_rank=True)[0]["seconds"]
        s1, s2, sw = statistics.median(one), statistics.median(two), statistics.median(work)
        rows.append({"T": t, "H": heads, "one_process_s": s1, "two_processes_s": s2,
                     "ratio_one_over_two": s1 / s2, "rank_work_s": sw,
                     "ratio_one_over_rank_work": s1 / sw, "load_before_1": load_1,
                     "load_before_2": load_2, "load_before_work": load_w, "repeats": repeats,
                     "all_one": one, "all_two": two, "all_work": work})  # fmt: skip
        print(f"T={t}: 1 proc {s1:.3f} s (load {load_1}), 2 procs {s2:.3f} s (load {load_2}), "
              f"ratio {s1 / s2:.2f}; one rank's work (T/2, group of one) {sw:.3f} s "
              f"(load {load_w}), ratio {s1 / sw:.2f}", flush=True)  # fmt: skip
    return rows


def measure_rss(t=256 * 1024, heads=4, world=4, mmap_threshold=2**20):
    load_1 = load()
    one = launch("rss", 1, t, heads, mmap_threshold=mmap_threshold)[0]
    load_4 = load()
    four = launch("rss", world, t, heads, mmap_threshold=mmap_threshold)
    peak4 = max(r["peak_rss_mb"] for r in four)
    base = one["base_rss_mb"]
    return {
        "T": t, "H": heads, "W": world, "load_before_1": load_1, "load_before_4": load_4,
        "malloc_mmap_threshold": mmap_threshold or "glibc default",
        "one_process_peak_mb": one["peak_rss_mb"], "four_processes_peak_mb": [r["peak_rss_mb"]
                                                                             for r in four],
        "base_rss_mb": base, "ratio_peak": peak4 / one["peak_rss_mb"],
        "ratio_above_base": (peak4 - base) / (one["peak_rss_mb"] - base),
    }  # fmt: skip


def write(out: Path, name: str, data, overwrite: bool):
    path = out / name
    if path.exists() and not overwrite:
        raise SystemExit(f"error: {path} exists (pass --overwrite to replace it)")
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        task, t_local, heads, repeats, seed = sys.argv[2:7]
        return worker(task, int(t_local), int(heads), int(repeats), int(seed))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["bytes", "time", "rss", "all"])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "cp")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--byte-lengths", default="1024,4096")
    p.add_argument("--time-lengths", default="4096,16384,65536")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rss-length", type=int, default=256 * 1024)
    p.add_argument("--mmap-threshold", type=int, default=2**20)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    if args.what in ("bytes", "all"):
        write(args.out, "bytes.json", measure_bytes(ints(args.byte_lengths)), args.overwrite)
    if args.what in ("time", "all"):
        rows = measure_time(ints(args.time_lengths), repeats=args.repeats)
        write(args.out, "time.json", rows, args.overwrite)
    if args.what in ("rss", "all"):
        rss = measure_rss(args.rss_length, mmap_threshold=args.mmap_threshold)
        write(args.out, "rss.json", rss, args.overwrite)


if __name__ == "__main__":
    main()
