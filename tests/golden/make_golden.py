"""Regenerate the golden references of ``tests/test_nn_golden.py`` (see its docstring).

    PYTHONPATH=src python tests/golden/make_golden.py          # compare only, write nothing
    PYTHONPATH=src python tests/golden/make_golden.py --write  # replace the references
    PYTHONPATH=src python tests/golden/make_golden.py --new-cases  # add the missing ones only

Run it with ``--write`` ONLY when a change of behaviour is intended (new numbers from a
model, a renamed parameter, a new supported context) and CHANGELOG.md states that change:
the references are the proof that a refactor did not change behaviour, and rewriting them
after an unintended change deletes that proof. Without ``--write`` it prints, per case, the
largest relative difference from the stored references and writes nothing.

Writes ``golden.json`` (configs, structure, refusals, condition estimates, provenance),
``cases/<case>.pt`` (fp64 logits, decode steps, loss, gradient norms and probes) and
``checkpoints/<name>.ref.pt`` (the fp64 logits of ``checkpoints/<name>.ckpt.pt`` and the
parameter updates of the step ``--resume`` adds). The checkpoint files themselves were
written by ``polysketch train`` of an older version and are kept: they are what the loader
must keep loading (a migration of their stored config). Only ``--new-checkpoints`` trains
them anew (e.g. a new attention in ``CHECKPOINTS``; a missing file is always written).

Each case is checked before anything is written: decode, padded and packed logits equal the
plain forward within ``TOL``; the condition estimates stay under ``MAX_GAIN`` and
``MAX_GRAD_GAIN``; two resumptions of a checkpoint agree bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import test_nn_golden as g  # noqa: E402  (the cases and how they are computed)
from conftest import rel_err  # noqa: E402

DELTA = 1e-9  # relative weight perturbation of the condition estimate


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every floating parameter and buffer x (1 + DELTA·s), s = ±1 at random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                sign = torch.randint(0, 2, t.shape, generator=gen, dtype=t.dtype) * 2 - 1
                t.mul_(1 + DELTA * sign)
    return model


def compute_case(config: dict) -> tuple[dict, dict]:
    """(tensors, metadata) of one case, checked for consistency and conditioning."""
    model = g.build(config)
    idx = g.tokens(model.config.vocab_size)
    with torch.no_grad():
        logits, _ = model(idx)
    prefill, steps = g.decode(model, idx)
    assert rel_err(prefill, logits[:, : g.PREFILL]) <= g.TOL, "prefill != forward"
    refused = {}
    for context in ("padded", "packed"):
        refused[context] = g.refusal(model, idx, context)
        if refused[context] is None:
            got, where = g.context_logits(model, idx, context)
            for out, (b, t0, t1) in zip(got, where, strict=True):
                want = logits[:, t0:t1] if b is None else logits[b, t0:t1]
                assert rel_err(out, want) <= g.TOL, f"{context} != forward"
    grads = g.gradients(model, idx)
    # condition estimate: relative change of each stored float per relative weight change
    other = perturbed(g.build(config), seed=1)
    with torch.no_grad():
        logits2, _ = other(idx)
    grads2 = g.gradients(other, idx)
    norm = grads["grad_norm"]
    used = norm > 0
    gains = {
        "logits": rel_err(logits2, logits) / DELTA,
        "loss": rel_err(grads2["loss"], grads["loss"]) / DELTA,
        "grad_norm": float(((grads2["grad_norm"] - norm).abs()[used] / norm[used]).max())
        / DELTA,
        "grad_probe": float(
            ((grads2["grad_probe"] - grads["grad_probe"]).abs()[used]
             / (norm * grads["probe_norm"])[used]).max()
        ) / DELTA,
    }  # fmt: skip
    worst = max(gains["logits"], gains["loss"])
    assert worst <= g.MAX_GAIN, f"condition estimate {worst:.1f} > MAX_GAIN: {gains}"
    worst = max(gains["grad_norm"], gains["grad_probe"])
    assert worst <= g.MAX_GRAD_GAIN, f"condition estimate {worst:.1f} > MAX_GRAD_GAIN: {gains}"
    tensors = {"logits": logits, "steps": steps, **grads}
    meta = {"config": config, "structure": g.structure(model), "refused": refused,
            "condition_estimate": {k: round(v, 2) for k, v in gains.items()}}  # fmt: skip
    return tensors, meta


def _train(argv: list[str]) -> None:
    from polysketch.cli import main

    assert main(argv) == 0, f"polysketch {' '.join(argv)} failed"


def write_checkpoint(name: str, out: Path) -> list[str]:
    """Train the checkpoint of attention ``name`` with ``polysketch train`` into folder
    ``out``; returns the command's arguments."""
    argv = ["train", "--attention", name, *g.CHECKPOINTS[name], *g.CHECKPOINT_ARGS]
    steps = str(g.CHECKPOINT_STEPS)
    _train([*argv, "--steps", steps, "--eval-interval", steps, "--out", str(out)])
    return argv


def checkpoint_references(name: str, first: Path, work: Path) -> tuple[dict, dict]:
    """(reference tensors, metadata) of the checkpoint folder ``first`` (``ckpt.pt``): its
    fp64 logits through ``load_model`` and the step ``--resume`` adds (run twice: the same
    bits)."""
    from polysketch.train import load_checkpoint, load_model

    resumed, again = work / f"{name}-b", work / f"{name}-c"
    steps = g.CHECKPOINT_STEPS
    for out in (resumed, again):
        shutil.copytree(first, out)
        _train(["train", "--out", str(out), "--resume", "--steps", str(steps + 1),
                "--no-progress", "--device", "cpu"])  # fmt: skip
    a = load_checkpoint(resumed / "ckpt.pt", restore_rng=False)
    b = load_checkpoint(again / "ckpt.pt", restore_rng=False)
    losses = [[row["loss"] for row in s["history"]["train"]] for s in (a, b)]
    assert losses[0] == losses[1], f"two resumed runs differ: {losses}"
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"two resumed runs differ: {k}"
    model, _ = load_model(first / "ckpt.pt", "cpu")
    after, _ = load_model(resumed / "ckpt.pt", "cpu")
    updates = g.update_norms(model, after)
    model = model.double()
    idx = g.tokens(model.config.vocab_size)
    with torch.no_grad():
        logits, _ = model(idx)
        other, _ = perturbed(copy.deepcopy(model), seed=1)(idx)
    gain = rel_err(other, logits) / DELTA
    assert gain <= g.MAX_GAIN, f"checkpoint {name}: condition estimate {gain:.1f} > MAX_GAIN"
    meta = {"structure": g.structure(model), "next_loss": a["history"]["train"][steps]["loss"],
            "condition_estimate": {"logits": round(gain, 2)}}  # fmt: skip
    return {"logits": logits, "update_norm": updates}, meta


def _provenance() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=TESTS, capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"commit": commit, "torch": torch.__version__}


def _report(case: str, tensors: dict, meta: dict, old_meta: dict | None, old: Path) -> str:
    if old_meta is None or not old.is_file():
        return f"{case}: new"
    ref = g._load(old)
    diffs = [f"{k} {rel_err(v, ref[k]):.1e}" for k, v in tensors.items()
             if k in ref and v.shape == ref[k].shape]  # fmt: skip
    same = {k: meta[k] == old_meta.get(k) for k in meta if k not in ("condition_estimate",)}
    changed = [k for k, ok in same.items() if not ok]
    return f"{case}: {', '.join(diffs)}" + (f"; changed: {changed}" if changed else "")


def add_new_cases(old: dict) -> int:
    """Compute, check and write the cases of ``g.cases()`` without a stored reference (their
    metadata records the version that wrote them); the stored ones are not recomputed."""
    added = {}
    for case, config in g.cases().items():
        path = g.GOLDEN / "cases" / f"{case}.pt"
        if case in old["cases"] and path.is_file():
            continue
        tensors, meta = compute_case(config)
        added[case] = ({**meta, "made_with": _provenance()}, tensors, path)
        print(f"{case}: new")
    for case, (meta, tensors, path) in added.items():
        torch.save({k: v.detach().clone() for k, v in tensors.items()}, path)
        old["cases"][case] = meta
    if added:
        g.META.write_text(json.dumps(old, indent=1) + "\n")
    print(f"added {len(added)} case(s) to {g.GOLDEN}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="replace the stored references")
    parser.add_argument(
        "--new-checkpoints", action="store_true",
        help="train the checkpoints anew with this version (default: keep the stored files, "
        "written by an older version, which the loader must keep loading)",
    )  # fmt: skip
    parser.add_argument(
        "--new-cases", action="store_true",
        help="compute and write only the cases that have no stored reference (a new attention "
        "name or variant), leaving every stored reference as it is",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    old = json.loads(g.META.read_text()) if g.META.is_file() else {"cases": {}, "checkpoints": {}}
    if args.new_cases:
        return add_new_cases(old)
    meta = {
        "about": "golden references of tests/test_nn_golden.py; regenerate with "
        "tests/golden/make_golden.py --write only for a behaviour change stated in CHANGELOG.md",
        "made_with": _provenance(),
        "tolerance": {
            "logits": g.TOL,
            "gradients": g.GRAD_TOL,
            "resumed_loss": g.RESUME_TOL,
            "resumed_update": g.UPDATE_TOL,
        },  # fmt: skip
        "cases": {},
        "checkpoints": {},
    }
    outputs: dict[Path, dict] = {}
    for case, config in g.cases().items():
        tensors, meta["cases"][case] = compute_case(config)
        path = g.GOLDEN / "cases" / f"{case}.pt"
        print(_report(case, tensors, meta["cases"][case], old["cases"].get(case), path))
        outputs[path] = tensors
    new_files: dict[Path, Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in g.CHECKPOINTS:
            target = g.GOLDEN / "checkpoints" / f"{name}.ckpt.pt"
            first = work / f"{name}-a"
            kept = old["checkpoints"].get(name, {})
            if target.is_file() and not args.new_checkpoints:  # the file of an older version
                first.mkdir()
                shutil.copyfile(target, first / "ckpt.pt")
                written = {k: kept[k] for k in ("argv", "written_with") if k in kept}
            else:
                written = {"argv": write_checkpoint(name, first), "written_with": _provenance()}
                new_files[target] = first / "ckpt.pt"
            tensors, refs = checkpoint_references(name, first, work)
            meta["checkpoints"][name] = {**written, **refs}
            path = g.GOLDEN / "checkpoints" / f"{name}.ref.pt"
            print(_report(f"checkpoint {name}", tensors, meta["checkpoints"][name], kept, path))
            outputs[path] = tensors
        if not args.write:
            print("nothing written (pass --write to replace the references)")
            return 0
        for path in [*outputs, *new_files]:
            path.parent.mkdir(parents=True, exist_ok=True)
        for stale in g.GOLDEN.glob("cases/*.pt"):
            stale.unlink()
        for path, tensors in outputs.items():
            torch.save({k: v.detach().clone() for k, v in tensors.items()}, path)
        for target, source in new_files.items():
            shutil.copyfile(source, target)
    g.META.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {g.GOLDEN}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
