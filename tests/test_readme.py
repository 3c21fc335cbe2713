"""The README and the docs are part of the contract: the README's examples run, the tables of
feature maps and presets (docs/feature_maps.md, docs/models.md) match the code, every relative
link of the README and of docs/ resolves."""

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

from polysketch import features
from polysketch.nn import MODEL_PRESETS, PRESETS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FEATURE_MAPS = (ROOT / "docs" / "feature_maps.md").read_text(encoding="utf-8")
MODELS = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")


def _table_after(marker: str, text: str) -> list[list[str]]:
    """Rows (cells stripped) of the markdown table following ``marker`` in ``text``, header
    excluded."""
    assert marker in text, marker
    lines = text.split(marker, 1)[1].strip().splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_readme_names_the_two_commands():
    assert "make demo" in README and "make test" in README


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def _run(block: str, name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, name, "exec"), {})
    return out.getvalue()


def test_quickstart_runs_as_written():
    block = re.search(r"## Quickstart\s+```python\n(.*?)```", README, re.S).group(1)
    printed = _run(block, "README-quickstart")
    assert "torch.Size([2, 4, 1000, 32])" in printed
    assert "tensor_power" in printed
    # the exact map's printed relative error is what the comment says: fp64 rounding
    assert "# a few 1e-16" in block
    rel = float(printed.splitlines()[1])
    assert rel < 10 * torch.finfo(torch.float64).eps


def test_every_python_snippet_of_the_readme_runs(tmp_path, monkeypatch):
    """Each ```python block runs as written; the Hugging Face one on a tiny random Llama with a
    byte-level tokenizer saved at its ``path`` (nothing is downloaded)."""
    blocks = _python_blocks()
    assert len(blocks) == 2  # quickstart and Hugging Face: a new block needs a case here
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    hf = next(b for b in blocks if "path/to/llama" in b)
    model_dir = tmp_path / "llama"
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(model_dir)
    monkeypatch.chdir(tmp_path)  # save_pretrained("converted") writes here
    printed = _run(hf.replace('"path/to/llama"', repr(str(model_dir))), "README-hf")
    assert printed.startswith("To be, or not to be")
    assert (tmp_path / "converted" / "config.json").is_file()


def test_license_is_the_apache_license_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject and 'license-files = ["LICENSE"]' in pyproject
    assert "[LICENSE](LICENSE)" in README


def test_papers_are_cited_with_links_not_a_local_folder():
    assert "shared/papers" not in README
    papers = README.split("## Papers", 1)[1]
    for arxiv in ("2505.08146", "2310.01655", "2110.04367"):
        assert f"(https://arxiv.org/abs/{arxiv})" in papers
    assert "```bibtex" in papers


def test_feature_map_table_lists_every_registered_map():
    rows = _table_after("<!-- feature-map-table: checked by tests/test_readme.py -->", FEATURE_MAPS)
    names = [row[0].strip("`") for row in rows]
    assert sorted(names) == features.available()
    for row in rows:
        kind = row[4]
        assert features.get_class(row[0].strip("`")).kind.split()[0] in kind


def test_preset_table_matches_the_code():
    rows = _table_after("<!-- preset-table: checked by tests/test_readme.py -->", MODELS)
    assert {row[0].strip("`"): row[1] for row in rows} == {
        name: preset.description for name, preset in PRESETS.items()
    }


def test_model_preset_table_matches_the_code():
    rows = _table_after("<!-- model-preset-table: checked by tests/test_readme.py -->", MODELS)
    assert {row[0].strip("`"): row[1] for row in rows} == {
        name: preset.description for name, preset in MODEL_PRESETS.items()
    }


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped)."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            text = re.sub(r"[^\w\- ]", "", text)
            anchors.add(text.replace(" ", "-"))
    return anchors


def _broken_links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(target)
    return broken


def test_readme_is_short_and_names_the_recommended_preset_in_its_first_screen():
    """Issue 40: at most 250 lines; the table "which attention for what" and the recommended
    long-context preset within the first 50 lines; the GPU check a few lines."""
    lines = README.splitlines()
    assert len(lines) <= 250
    first_screen = "\n".join(lines[:50])
    assert "## Which attention for what" in first_screen
    assert "`soft_hash_far_local_balanced`" in first_screen and "recommended" in first_screen
    gpu = README.split("## On a GPU", 1)[1].split("\n## ", 1)[0]
    assert "make gpu-check" in gpu and "docs/gpu.md" in gpu and len(gpu.splitlines()) <= 12


def test_results_move_to_docs_and_every_link_resolves():
    """README keeps one table of headline ratios linking to docs/results/README.md, which holds
    the full tables; every relative link (and #anchor) of the README and of docs/ resolves."""
    results = ROOT / "docs" / "results" / "README.md"
    measured = README.split("## Measured results", 1)[1].split("\n## ", 1)[0]
    assert "docs/results/README.md" in measured
    assert "| 16384 | 888 / 948 |" in results.read_text()  # the full speed table moved there
    assert "| 16384 | 888 / 948 |" not in README
    assert "## Long context: which attentions use far context" in results.read_text()
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert len(pages) > 10
    broken = {str(p.relative_to(ROOT)): _broken_links(p) for p in pages}
    assert {page: links for page, links in broken.items() if links} == {}


def test_the_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "a.md").write_text("# Title here\n[ok](a.md#title-here) [bad](b.md) [x](a.md#no)\n")
    assert _broken_links(tmp_path / "a.md") == ["b.md", "a.md#no"]
