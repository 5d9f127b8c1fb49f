"""Files on disk: the one atomic-write helper of the project, and the shared blob store."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from kdump.bundle.format import STORE_DIRNAME


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def atomic_write(
    path: str | os.PathLike[str], content: bytes | memoryview | Callable[[BinaryIO], object]
) -> Path:
    """Write `content` (bytes, or a function that writes to the open file) to a temporary file in
    the same folder, then rename it over `path`: readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; these are ordinary files
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            f.flush()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def sha256_hex(data: memoryview | bytes) -> str:
    """A blob's name: the SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


class BlobStore:
    """A capture directory's content-addressed blob store: `<root>/blobs/ab/<sha256>`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, sha: str) -> Path:
        return self.root / STORE_DIRNAME / sha[:2] / sha

    def has(self, sha: str, nbytes: int) -> bool:
        p = self.path(sha)
        return p.is_file() and p.stat().st_size == nbytes

    def put(self, sha: str, data: memoryview) -> None:
        if not self.has(sha, len(data)):
            atomic_write(self.path(sha), data)
