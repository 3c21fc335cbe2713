"""`polysketch demo` end to end (quick), the report builder and q/k capture."""

from __future__ import annotations

import json
import math
import random
import re
import shutil

import pytest
import torch

from polysketch.cli import main
from polysketch.eval.demo.report import Report
from polysketch.eval.fidelity.capture import (
    attention_layers,
    capture_qk,
    head_samples,
    split_tokens,
)
from polysketch.eval.tables import fmt, format_table
from polysketch.nn import TransformerConfig, TransformerLM

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORDS = "the of and to in that it was his with for as he had not but by on at be all so".split()


def _write_text(path, n_words=6000, seed=0):
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(n_words // 12)]
    path.write_text("\n".join(lines))
    return path


def _numbers_in_tables(markdown: str) -> list[str]:
    """Every cell of every Markdown table body row that looks numeric (or nan/inf)."""
    cells = []
    for line in markdown.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells += [c.strip() for c in line.strip("|").split("|")]
    return cells


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    corpus = _write_text(root / "corpus.txt")
    out = root / "report"
    rc = main(
        ["demo", "--quick", "--out", str(out), "--corpus", str(corpus), "--no-progress",
         "--threads", "1"]
    )  # fmt: skip
    return rc, out


def test_demo_quick_writes_report_with_images(quick_report):
    rc, out = quick_report
    assert rc == 0
    md = (out / "README.md").read_text()
    page = (out / "index.html").read_text()
    md_images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    html_images = re.findall(r'<img src="([^"]+)"', page)
    assert md_images == html_images  # the same pictures, in the same order
    assert {
        "quality_loss.png",
        "fidelity_polynomial.png",
        "fidelity_softmax.png",
        "speed.png",
    } <= set(md_images)
    for name in md_images:
        assert not name.startswith("/")  # relative paths: the folder can be moved
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    for heading in ("1. Quality", "2. Fidelity", "3. Speed", "Machine and run"):
        assert heading in md and heading in page
    assert "not run" not in md


def test_demo_quick_numbers_are_finite_and_from_the_run(quick_report):
    rc, out = quick_report
    md = (out / "README.md").read_text()
    cells = _numbers_in_tables(md)
    numeric = [c for c in cells if re.fullmatch(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?", c)]
    assert len(numeric) > 50
    assert all(math.isfinite(float(c.replace(",", ""))) for c in numeric)
    assert not {"nan", "inf", "-inf"} & set(cells)

    results = json.loads((out / "results.json").read_text())
    assert results["failed"] == []
    assert set(results["seconds"]) == {"quality", "fidelity", "speed"}
    assert results["machine"]["cpu_count"] >= 1
    runs = results["quality"]["runs"]
    assert [r["attention"] for r in runs][0] == "softmax" and len(runs) == 2
    for r in runs:
        # A byte model starts near ln(256) = 5.55 nats and must not be worse than uniform.
        assert 0 < r["val_loss"] < math.log(256) + 0.5
        assert r["steps"] == 8 and r["parameters"] > 0
        assert f"{r['val_loss']:.3g}" in md  # the table shows this run's value
    # linear attention: a constant decoding state, smaller than the KV cache from a length
    soft, ours = runs
    assert soft["kv_floats_per_token"] * 32 == soft["state_floats_at_block"]
    cross = ours["state_smaller_from_T"]
    assert soft["kv_floats_per_token"] * cross >= ours["state_floats_at_block"]
    assert soft["kv_floats_per_token"] * (cross - 1) < ours["state_floats_at_block"]
    for r in runs:
        assert r["tokens_per_s_p10"] <= r["tokens_per_s"] <= r["tokens_per_s_p90"]
    for family in ("polynomial", "softmax"):
        rows = results["fidelity"][family]["rows"]
        assert rows
        errors = [v for row in rows for v in row[4::2] if v is not None]
        assert errors and all(math.isfinite(e) and e >= 0 for e in errors)
    forward = results["speed"]["tables"]["forward"][1]
    assert [row[0] for row in forward] == [64, 128, 256]
    assert all(v is not None and v > 0 for row in forward for v in row[1:])
    for row in forward:  # per method: median, low, high over the passes
        for i in range(1, len(row), 3):
            assert row[i + 1] <= row[i] <= row[i + 2]
    assert results["speed"]["passes"] == 3 and results["machine"]["load_1min"] is not None
    # the checkpoints of section 1 can be reloaded
    assert (out / "runs" / "psf_random" / "ckpt.pt").is_file()


def test_demo_fidelity_alone_reuses_saved_models(quick_report, tmp_path):
    _, previous = quick_report
    shutil.copytree(previous / "runs", tmp_path / "runs")
    corpus = _write_text(tmp_path / "corpus.txt")
    rc = main(
        ["demo", "--quick", "--sections", "fidelity", "--out", str(tmp_path), "--no-progress",
         "--corpus", str(corpus), "--threads", "1"]
    )  # fmt: skip
    assert rc == 0
    md = (tmp_path / "README.md").read_text()
    assert "2. Fidelity" in md and "1. Quality" not in md and "3. Speed" not in md
    for attention in ("psf_random", "softmax"):
        assert f"captured from `{attention}` model (loaded from" in md


def test_demo_section_choice_and_missing_corpus(tmp_path):
    out = tmp_path / "r"
    rc = main(
        ["demo", "--quick", "--sections", "quality", "--out", str(out), "--no-progress",
         "--corpus", str(tmp_path / "missing.txt"), "--threads", "1"]
    )  # fmt: skip
    assert rc == 1  # the section failed, and the report says why instead of crashing
    md = (out / "README.md").read_text()
    assert "quality: not run" in md and "missing.txt" in md
    assert "2. Fidelity" not in md and "3. Speed" not in md


def test_demo_rejects_bad_steps(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["demo", "--quick", "--steps", "0", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polysketch demo: error: ") and "--steps" in err
    assert not out.exists()  # refused before --out is touched


# ----- capture ------------------------------------------------------------------------------
def _model(attention="psf_random", n_layer=2):
    cfg = TransformerConfig(
        n_layer=n_layer, n_head=2, n_embd=16, block_size=16, attention=attention
    )
    return TransformerLM(cfg)


def test_capture_is_what_the_feature_map_sees():
    model = _model(n_layer=1)
    with torch.no_grad():  # non-trivial LayerNorm affine, so the test sees whether it is applied
        layer = attention_layers(model)[0]
        layer.q_norm.weight.uniform_(0.5, 2.0)
        layer.k_norm.bias.uniform_(-1.0, 1.0)
    idx = torch.randint(0, 256, (2, 12))
    expected_logits = model(idx)[0]
    (cap,) = capture_qk(model, idx)
    with torch.no_grad():  # recompute by hand: x -> qkv -> per-head LayerNorm -> RoPE
        x = model.blocks[0].ln_1(model.wte(idx))
        q, k, _ = layer.qkv(x).reshape(2, 12, 3, 2, 8).permute(2, 0, 3, 1, 4)
        q, k = layer.rotary(layer.q_norm(q), 0), layer.rotary(layer.k_norm(k), 0)
    torch.testing.assert_close(cap.q, q, rtol=0, atol=1e-6)
    torch.testing.assert_close(cap.k, k, rtol=0, atol=1e-6)
    assert cap.attention == "psf_random" and cap.algorithm == "linear"
    # the model is restored and computes the same thing
    assert "_attend" not in vars(layer)
    assert torch.equal(model(idx)[0], expected_logits)


def test_capture_layers_and_samples():
    model = _model("softmax", n_layer=3)
    idx = torch.randint(0, 256, (2, 10))
    caps = capture_qk(model, idx, layers=[-1, 0])
    assert [c.layer for c in caps] == [0, 2]
    assert caps[0].q.shape == (2, 2, 10, 8)
    fit, test = split_tokens(20, 2, seed=0)
    assert sorted(torch.cat([fit, test]).tolist()) == list(range(20))
    q, k = head_samples(caps, num=8, seed=0, positions=test)
    assert q.shape == k.shape == (4, 8, 8) and q.dtype == torch.float64
    flat = caps[0].q.transpose(0, 1).flatten(1, 2)  # (H, B·T, D) of layer 0
    rows = {tuple(r.tolist()) for r in flat[0].double()}
    assert all(tuple(r.tolist()) in rows for r in q[0])  # samples are captured rows of head 0


def test_capture_bad_input():
    with pytest.raises(ValueError, match="model"):
        capture_qk(torch.nn.Linear(2, 2), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="layers"):
        capture_qk(_model(), torch.zeros(1, 4, dtype=torch.long), layers=[5])
    with pytest.raises(ValueError, match="positions"):
        caps = capture_qk(_model(), torch.zeros(1, 4, dtype=torch.long))
        head_samples(caps, positions=torch.tensor([7]))


# ----- report -------------------------------------------------------------------------------
def test_report_markdown_and_html_hold_the_same_content(tmp_path):
    rep = Report("T")
    rep.heading("Section <1>")
    rep.paragraph("uses `code` and a|pipe")
    rep.table(["a", "b"], [[1, 0.000123456], [float("nan"), 12345678.0]])
    rep.image("fig.png", "caption")
    rep.pre("x < y")
    md, page = rep.write(tmp_path)
    text, html = md.read_text(), page.read_text()
    assert "| 1 | 1.23e-04 |" in text and "| n/a | 1.23e+07 |" in text
    assert "<td>1.23e-04</td>" in html and "<td>n/a</td>" in html
    assert "![caption](fig.png)" in text and '<img src="fig.png"' in html
    assert "&lt;1&gt;" in html and "x &lt; y" in html and "<code>code</code>" in html
    assert rep.images() == ["fig.png"]
    assert fmt(None) == "-" and fmt(3) == "3" and fmt(0.5) == "0.5"
    assert format_table(["x"], [[2.0]]).splitlines() == ["x", "-", "2"]
    with pytest.raises(ValueError, match="rows"):
        rep.table(["a", "b"], [[1]])


def test_demo_refuses_a_bad_device_naming_it(tmp_path, capsys):
    from polysketch.cli import main

    assert main(["demo", "--quick", "--device", "tpu9", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polysketch demo: error: ") and "--device" in err


def test_demo_report_claims_only_what_its_tables_support(quick_report):
    """Issue 43 items 8-10: spread and load stated, verdicts per length, the decode-state
    crossover instead of an untrained length, psf_random's sketch at the model's r, the state
    size formula the table uses, and the notes under the fidelity figures."""
    import csv

    _, out = quick_report
    md = (out / "README.md").read_text()
    results = json.loads((out / "results.json").read_text())
    speed = md.split("## 3. Speed", 1)[1]
    assert "ran 3 times (passes)" in speed and "Load: the 1-minute load average" in speed
    assert "faster than SDPA from T" not in speed
    for name, text in results["speed"]["claims"].items():
        assert text in speed and text.startswith(f"`{name}`")
    with open(out / "speed.csv") as f:
        rows = list(csv.DictReader(f))
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(r["passes"] == "3" for r in ok)
    assert all(float(r["low_ms"]) <= float(r["median_ms"]) <= float(r["high_ms"]) for r in ok)
    with open(out / "speed_passes.csv") as f:
        assert {r["passes"] for r in csv.DictReader(f)} == {"1", "2", "3"}
    quality = md.split("## 1. Quality", 1)[1].split("## 2.", 1)[0]
    assert "T = 8192" not in quality and "the state is the smaller one from T = " in quality
    assert "tokens/s p10" in quality and "load average" in quality
    fidelity = md.split("## 2. Fidelity", 1)[1].split("## 3.", 1)[0]
    assert "F(⌊F/2⌋+1)" in fidelity and "F² for" not in fidelity
    psf = [r for r in results["fidelity"]["polynomial"]["rows"] if r[0].startswith("polysketch²")]
    assert (32, 544) in {(r[2], r[3]) for r in psf}  # the r the psf_random models use
    assert "A = I" in results["fidelity"]["softmax"]["note"]
    assert results["fidelity"]["softmax"]["note"] in fidelity
