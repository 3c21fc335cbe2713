"""benchmarks/long_context.py grid-collect: one grid from cells measured into several folders."""

import csv
import json
import shutil

import long_context
import pytest
from experiments.long_context.grid_cli import SMOKE
from experiments.long_context.grid_collect_cli import same_model

TIED = "soft_hash_far_local_tied:num_features=64"
TIED_BY_OPTION = "soft_hash_far_local:num_features=64,global_out_tied=True"
UNTIED = "soft_hash_far_local:num_features=64"


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _smoke_grid(out, seed, attention):
    argv = ["grid", "--smoke", "--no-progress", "--out", str(out), "--schedules", "cli",
            "--seeds", str(seed), "--attentions", "softmax", attention]  # fmt: skip
    assert long_context.main(argv) == 0


@pytest.fixture(scope="module")
def grids(tmp_path_factory):
    """Two smoke grids, seed 0 measured under the option's name, seed 1 under the preset's."""
    root = tmp_path_factory.mktemp("grids")
    _smoke_grid(root / "s0", 0, TIED_BY_OPTION)
    _smoke_grid(root / "s1", 1, TIED)
    return root


def test_same_model_reads_the_built_model_not_the_name():
    settings = {"model": {k: SMOKE[k] for k in ("n_layer", "n_embd", "n_head", "chunk_size")}}
    assert same_model(TIED, TIED_BY_OPTION, settings, 32)
    assert not same_model(TIED, UNTIED, settings, 32)  # another W_o at init
    assert not same_model(TIED, "soft_hash_far_local_tied:num_features=32", settings, 32)
    assert not same_model(TIED, TIED + "@outinit=0", settings, 32)  # a remedy tag: itself only
    assert same_model(TIED + "@outinit=0", TIED + "@outinit=0", settings, 32)


def test_collect_merges_folders_under_the_requested_names(grids, capsys):
    out = grids / "all"
    argv = ["grid-collect", "--from", str(grids / "s0"), str(grids / "s1"), "--attentions",
            "softmax", TIED, "--out", str(out)]  # fmt: skip
    assert long_context.main(argv) == 0
    cells = _rows(out / "grid.csv")
    assert [(r["seed"], r["attention"]) for r in cells] == [
        ("0", "softmax"), ("0", TIED), ("1", "softmax"), ("1", TIED)]  # fmt: skip
    for seed in (0, 1):  # every measurement is the source's, only the name changes
        for name in ("grid.csv", "grid_curve.csv", "grid_diag.csv"):
            source = _rows(grids / f"s{seed}" / name)
            mine = [r for r in _rows(out / name) if r["seed"] == str(seed)]
            assert [{**r, "attention": r["attention"].replace(TIED_BY_OPTION, TIED)}
                    for r in source] == mine  # fmt: skip
    assert json.loads((out / "grid.settings.json").read_text()) == json.loads(
        (grids / "s0" / "grid.settings.json").read_text())  # fmt: skip
    md = (out / "grid.md").read_text()
    assert f"`{TIED}` (measured as `{TIED_BY_OPTION}`)" in md
    assert "| 0,1 |" in md and "grid-collect" in md and "--reuse" not in md
    assert (out / "grid.png").stat().st_size > 0 and (out / "grid_diag.png").stat().st_size > 0
    capsys.readouterr()
    assert long_context.main(argv) == 2  # an existing collection is not replaced silently
    assert "--overwrite" in capsys.readouterr().err
    assert long_context.main([*argv, "--overwrite"]) == 0
    assert _rows(out / "grid.csv") == cells
    # a model the requested name does not build is left out
    only_untied = [*argv[:4], "--attentions", "softmax", UNTIED, "--out", str(grids / "u")]
    assert long_context.main(only_untied) == 2
    assert "no cell of" in capsys.readouterr().err


def test_collect_refuses_what_it_cannot_merge(grids, capsys):
    base = ["grid-collect", "--attentions", "softmax", TIED]
    # settings that differ
    other = grids / "other_settings"
    shutil.copytree(grids / "s1", other)
    settings = json.loads((other / "grid.settings.json").read_text())
    settings["probe_every"] += 1
    (other / "grid.settings.json").write_text(json.dumps(settings))
    argv = [*base, "--from", str(grids / "s0"), str(other), "--out", str(grids / "x")]
    assert long_context.main(argv) == 2
    err = capsys.readouterr().err
    assert "other settings" in err and "probe_every" in err
    # one cell measured twice with different values (timings may differ)
    twice = grids / "twice"
    shutil.copytree(grids / "s0", twice)
    cells = _rows(twice / "grid.csv")
    cells[0]["cpu_s"] = "1.0"
    with open(twice / "grid.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(cells[0]))
        writer.writeheader()
        writer.writerows(cells)
    argv = [*base, "--from", str(grids / "s0"), str(twice), "--out", str(grids / "y")]
    unfinished = _rows(twice / "grid_curve.csv")[-1]  # a seed still training: no cell row
    with open(twice / "grid_curve.csv", "a", newline="") as f:
        csv.DictWriter(f, list(unfinished)).writerow({**unfinished, "seed": "7"})
    assert long_context.main(argv) == 0  # the same measurements, another CPU time
    assert "7" not in {r["seed"] for r in _rows(grids / "y" / "grid_curve.csv")}
    cells[0]["gain"] = str(float(cells[0]["gain"]) + 0.5)
    with open(twice / "grid.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(cells[0]))
        writer.writeheader()
        writer.writerows(cells)
    assert long_context.main([*argv[:-1], str(grids / "z")]) == 2
    err = capsys.readouterr().err
    assert "measured twice" in err and "gain" in err
    # no softmax, a folder that is no grid, --out among the sources
    assert long_context.main([*base[:2], TIED, "--from", str(grids / "s0"), "--out",
                              str(grids / "w")]) == 2  # fmt: skip
    assert "must include softmax" in capsys.readouterr().err
    assert long_context.main([*base, "--from", str(grids), "--out", str(grids / "v")]) == 2
    assert "not a grid folder" in capsys.readouterr().err
    assert long_context.main([*base, "--from", str(grids / "s0"), "--out",
                              str(grids / "s0")]) == 2  # fmt: skip
    assert "one of the --from folders" in capsys.readouterr().err
