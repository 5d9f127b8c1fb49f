"""Where one recording process writes: its folder, its blob store, its limits, its index.

Layout of a capture directory (one folder per process and recording, blobs shared):
    <out>/blobs/ab/<sha256>                                 shared blob store (weights stored once)
    <out>/<host>.<pid>[.rank<R>].<random>/<target>-<index:06d>.kdump
    <out>/<host>.<pid>[.rank<R>].<random>/index.jsonl       what this process wrote (append-only)
The random part makes every recording's folder new, so a second recording into the same output
folder (same host, even the same pid) never replaces an earlier bundle; folders and bundle names
are created exclusively. With a limit that deletes bundles (max_bytes, or keep=newest) the process
keeps its blobs in its own folder (`<proc>/blobs/`), so evicting never removes a blob another
process's bundle uses.

The index is one JSON object per line, appended with one write each: a header (who wrote the
folder), one line per bundle written, one per bundle evicted, and a status line at each flush. Its
cost per bundle is one line, however many were written before. `read_index` tolerates a torn last
line (a process killed mid-write) and adds the bundles on disk that the index lacks.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdump.log import log_once
from kdump.record.triggers import Limits, Written

INDEX_NAME = "index.jsonl"
INDEX_FORMAT = "kdump-index"
INDEX_VERSION = 2
BUNDLE_SUFFIX = ".kdump"
STORE_DIRNAME = "blobs"  # kdump.bundle.STORE_DIRNAME (that module is not imported at startup)
_NAME_ATTEMPTS = 100
# json.dumps(line, separators=(",", ":")), with the encoder made once (one line per bundle).
_encode = json.JSONEncoder(separators=(",", ":")).encode


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class IndexEntry:
    """One bundle of a process folder. `indexed` is False for a bundle found by scanning the
    folder (its index line is missing: the process died before writing it)."""

    path: Path
    target: str | None = None
    call_index: int | None = None
    nbytes: int | None = None
    exception: str | None = None
    indexed: bool = True


@dataclass(frozen=True)
class FolderIndex:
    folder: Path
    header: dict[str, Any] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)  # the latest flush's status line
    bundles: tuple[IndexEntry, ...] = ()

    @property
    def paths(self) -> list[Path]:
        return [e.path for e in self.bundles]


def _index_lines(path: Path) -> list[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:  # a torn line: its bundle, if on disk, is found by the scan
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_index(folder: str | os.PathLike[str]) -> FolderIndex:
    """Every bundle of a process folder: the index's entries that are still on disk, then the
    bundles on disk the index lacks."""
    folder = Path(folder)
    header: dict[str, Any] = {}
    status: dict[str, Any] = {}
    entries: dict[str, IndexEntry] = {}
    for line in _index_lines(folder / INDEX_NAME):
        kind = line.get("kind")
        name = line.get("path")
        if kind == "header":
            header = line
        elif kind == "status":
            status = line
        elif kind == "bundle" and isinstance(name, str):
            entries[name] = IndexEntry(
                folder / name,
                target=line.get("target"),
                call_index=line.get("call_index"),
                nbytes=line.get("bytes"),
                exception=line.get("exception"),
            )
        elif kind == "evicted" and isinstance(name, str):
            entries.pop(name, None)
    on_disk = {p.name for p in _bundle_files(folder)}
    bundles = [e for name, e in entries.items() if name in on_disk]
    for name in sorted(on_disk - entries.keys()):
        p = folder / name
        with contextlib.suppress(OSError):
            bundles.append(IndexEntry(p, nbytes=p.stat().st_size, indexed=False))
    return FolderIndex(folder, header, status, tuple(bundles))


def _bundle_files(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.suffix == BUNDLE_SUFFIX and p.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        return []


def process_folders(root: str | os.PathLike[str]) -> list[Path]:
    """Folders under `root` (itself included) that hold bundles or an index. A folder named
    `blobs` is a blob store (skipped) only directly under a capture root: `root` itself or a
    process folder (one that holds an index), as in `kdump.bundle.iter_bundles`."""
    root = Path(root)
    found: set[Path] = set()
    if not root.is_dir():
        return []
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == str(root) or INDEX_NAME in filenames:
            dirnames[:] = [d for d in dirnames if d != STORE_DIRNAME]
        if INDEX_NAME in filenames or any(f.endswith(BUNDLE_SUFFIX) for f in filenames):
            found.add(Path(dirpath))
    return sorted(found)


def list_bundles(root: str | os.PathLike[str]) -> list[Path]:
    """Every bundle under `root`, sorted, read through each folder's index."""
    return sorted(p for folder in process_folders(root) for p in read_index(folder).paths)


# ---------------------------------------------------------------------------------------------
# Leftovers of killed writers


def remove_stale_temporaries(root: str | os.PathLike[str]) -> list[Path]:
    """Remove what writers killed mid-write left under `root`: `atomic_write` temporaries (blobs,
    bundles) whose owning process on this host is gone, and the empty reserved bundle names in
    process folders whose process is gone. Files of live processes and of other hosts are kept.
    Returns what was removed."""
    from kdump.bundle.store import is_own_host, temp_owner
    from kdump.record.flight.announce import pid_alive

    root = Path(root)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    host = socket.gethostname()
    for dirpath, _dirnames, filenames in os.walk(root):
        folder = Path(dirpath)
        dead_owner: bool | None = None  # of this folder's index header; asked once, if needed
        for name in filenames:
            path = folder / name
            owner = temp_owner(name)
            if owner is not None:
                stale = is_own_host(owner[1]) and not pid_alive(owner[0])
            elif name.endswith(BUNDLE_SUFFIX) and _is_empty(path):
                if dead_owner is None:
                    dead_owner = _dead_owner(folder, host, pid_alive)
                stale = dead_owner
            else:
                continue
            if stale:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
    return removed


def _is_empty(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size == 0
    except OSError:
        return False


def _dead_owner(folder: Path, host: str, pid_alive: Callable[[int], bool]) -> bool:
    """Whether the process that wrote `folder`'s index ran on this host and is gone."""
    header = read_index(folder).header
    pid = header.get("pid")
    return header.get("host") == host and isinstance(pid, int) and not pid_alive(pid)


# ---------------------------------------------------------------------------------------------
# Writing


class CountingStore:
    """A BlobStore that remembers which blobs the current bundle used and which it created.

    Blobs this process wrote or found in the store are remembered, so a blob that every call
    passes (a weight) costs no file-system look-up after the first: blobs are only ever removed
    by their owner's eviction (`forget`), never from a shared store."""

    def __init__(self, root: Path) -> None:
        from kdump.bundle import BlobStore

        outer = self

        class Store(BlobStore):
            def put(self, sha: str, data: memoryview) -> None:
                outer.used.append(sha)
                if sha in outer.present:
                    return
                if not self.has(sha, len(data)):
                    BlobStore.put(self, sha, data)
                    outer.created[sha] = len(data)
                outer.present.add(sha)

            def adopt(self, sha: str, tmp: str, nbytes: int) -> bool:
                if sha in outer.present:
                    os.unlink(tmp)
                    return False
                added = BlobStore.adopt(self, sha, tmp, nbytes)
                outer.present.add(sha)
                return added

        self.store = Store(root)
        self.used: list[str] = []
        self.created: dict[str, int] = {}
        self.present: set[str] = set()

    def begin(self) -> None:
        self.used, self.created = [], {}

    def forget(self, sha: str) -> None:
        self.present.discard(sha)


class CaptureDir:
    """One process's destination inside `out`. The folder appears with the first bundle."""

    def __init__(
        self,
        out: Path,
        limits: Limits,
        *,
        private_store: bool,
        host: str,
        pid: int,
        rank: Callable[[], int | None],
        mode: str,
    ) -> None:
        self.out = Path(out)
        self.limits = limits
        self.private_store = private_store
        self.host, self.pid, self.mode = host, pid, mode
        self._rank = rank
        self._folder: Path | None = None
        self._folder_str: str | None = None  # the folder as a string, once asked
        self._store: CountingStore | None = None
        self._bundle_blobs: dict[str, list[str]] = {}  # bundle path -> blobs it uses
        self._blob_refs: dict[str, int] = {}
        self._blob_owned: dict[str, int] = {}  # blobs this process created (private store)
        self._torn = False  # an index write failed part-way: the next line starts afresh
        self._names: set[str] = set()  # bundle names handed out in the folder
        self._index_fd: int | None = None  # kept open: one write per line
        self._index_pid = 0

    # -- the folder ------------------------------------------------------------------------------
    def folder(self) -> Path:
        if self._folder is None:
            self._folder = self._make_folder()
            self._append(
                {
                    "kind": "header",
                    "format": INDEX_FORMAT,
                    "version": INDEX_VERSION,
                    "mode": self.mode,
                    "host": self.host,
                    "pid": self.pid,
                    "rank": self._rank(),
                    "argv": list(sys.argv)[:32],
                    "started": _now(),
                    "store": str(self.store().store.root),
                }
            )
        return self._folder

    def _make_folder(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        try:  # a recording never fails for a predecessor's leftovers
            remove_stale_temporaries(self.out)
        except Exception as exc:
            log_once(f"leftovers:{self.out}", f"cannot tidy {self.out}: {exc}")
        rank = self._rank()
        base = f"{self.host}.{self.pid}" + (f".rank{rank}" if rank is not None else "")
        for _ in range(_NAME_ATTEMPTS):
            path = self.out / f"{base}.{secrets.token_hex(3)}"
            try:
                path.mkdir()  # exclusive: an existing folder is another recording's
                return path
            except FileExistsError:
                continue
        raise FileExistsError(f"no free process folder name under {self.out} for {base}")

    def store(self) -> CountingStore:
        if self._store is None:
            self._store = CountingStore(self.folder() if self.private_store else self.out)
        return self._store

    def new_bundle_path(self, stem: str) -> Path:
        """A bundle name nobody has used. The folder was created exclusively for this process and
        only this object names files in it, so the names it handed out are all there is to avoid
        (no file is made until the bundle is written, by one rename)."""
        return self.folder() / self._new_name(stem)

    def new_bundle_file(self, stem: str) -> str:
        """`new_bundle_path` as a string (no Path made: a recorder names a file per call)."""
        folder = self._folder_str
        if folder is None:
            folder = self._folder_str = str(self.folder())
        return f"{folder}/{self._new_name(stem)}"

    def _new_name(self, stem: str) -> str:
        for k in range(_NAME_ATTEMPTS):
            name = f"{stem}{BUNDLE_SUFFIX}" if k == 0 else f"{stem}.{k}{BUNDLE_SUFFIX}"
            if name not in self._names:
                self._names.add(name)
                return name
        raise FileExistsError(f"no free bundle name for {stem} in {self.folder()}")

    def abandon(self, path: Path | str) -> None:
        """Give back a name whose bundle could not be written (nothing of it is on disk: the
        writer removes its temporary)."""
        self._names.discard(os.path.basename(os.fspath(path)))

    # -- bookkeeping -----------------------------------------------------------------------------
    def admit(self) -> bool:
        return self.limits.admit()

    def add(
        self,
        path: Path | str,
        target: str,
        index: int,
        exception: str | None,
        nbytes: int | None = None,
    ) -> None:
        """Account for the bundle just written at `path` (`nbytes` long, where the writer said;
        else asked of the file system) with the store's last blobs, evict what the limits say,
        and append its index line."""
        store = self.store()
        key = path if type(path) is str else str(path)
        size = nbytes if nbytes is not None else os.stat(key).st_size
        added = size + (sum(store.created.values()) if store.created else 0)
        if store.used:  # a bundle with inline blobs only frees nothing of the store when evicted
            used = list(dict.fromkeys(store.used))
            self._bundle_blobs[key] = used
            for sha in used:
                self._blob_refs[sha] = self._blob_refs.get(sha, 0) + 1
        if self.private_store and store.created:
            self._blob_owned.update(store.created)
        self.limits.add(Written(key, target, index, added, exception))
        kept = True
        while (victim := self.limits.victim()) is not None:
            freed = self._delete(victim)
            self.limits.freed(freed)
            if victim.path == key:  # never kept: it gets no index line
                kept = False
                continue
            self._append({"kind": "evicted", "path": Path(victim.path).name, "freed": freed})
        if kept:
            name = os.path.basename(key)
            self._write_line(_bundle_line(name, target, index, added, exception))

    def _delete(self, w: Written) -> int:
        """Remove a bundle and the blobs only it used (private store); bytes freed."""
        freed = 0
        p = Path(w.path)
        with contextlib.suppress(FileNotFoundError):
            freed += p.stat().st_size
            p.unlink()
        for sha in self._bundle_blobs.pop(w.path, []):
            n = self._blob_refs.get(sha, 0) - 1
            self._blob_refs[sha] = n
            if n <= 0:
                self._blob_refs.pop(sha, None)
                size = self._blob_owned.pop(sha, None)
                if size is not None:
                    self.store().forget(sha)
                    with contextlib.suppress(FileNotFoundError):
                        self.store().store.path(sha).unlink()
                        freed += size
        return freed

    def note_status(self, errors: int) -> None:
        """Append a status line (flush points); nothing when this process wrote nothing."""
        if self._folder is None or not self._folder.is_dir():
            return
        self._append(
            {
                "kind": "status",
                "time": _now(),
                "bundles": len(self.limits.bundles),
                "total_bytes": self.limits.total_bytes,
                "stopped_by_limit": self.limits.stopped,
                "errors": errors,
            }
        )

    def _append(self, line: dict[str, Any]) -> None:
        self._write_line(_encode(line))

    def _write_line(self, text: str) -> None:
        """One line, one write, O_APPEND: concurrent readers see whole lines or a torn last one."""
        assert self._folder is not None
        data = (text + "\n").encode()
        if self._torn:
            data = b"\n" + data
        if self._index_fd is None or self._index_pid != os.getpid():
            path = self._folder / INDEX_NAME
            self._index_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            self._index_pid = os.getpid()
        try:
            self._torn = True
            view = memoryview(data)
            while view:
                view = view[os.write(self._index_fd, view) :]
            self._torn = False
        except OSError:
            self.close()  # reopened for the next line
            raise

    def close(self) -> None:
        """Close the index (a later line opens it again)."""
        fd, self._index_fd = self._index_fd, None
        if fd is not None and self._index_pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def written(self) -> list[Path]:
        return [Path(w.path) for w in self.limits.bundles]


_quote = json.encoder.encode_basestring_ascii  # a str as _encode writes it (ASCII, escaped)
_NAMES: dict[str, str] = {}  # target -> its encoded name (one per target, kept small)


def _bundle_line(name: str, target: str, index: int, nbytes: int, exception: str | None) -> str:
    """The index line of a bundle: what _encode gives for {"kind": "bundle", "path": name,
    "target": target, "call_index": index, "bytes": nbytes, "exception": exception}, formatted
    directly (one line per bundle; the encoder's own path builds a list of parts per value)."""
    plain = type(index) is int and type(nbytes) is int and type(target) is str
    if not plain or not (exception is None or type(exception) is str):  # as the encoder does
        return _encode(
            {
                "kind": "bundle",
                "path": name,
                "target": target,
                "call_index": index,
                "bytes": nbytes,
                "exception": exception,
            }
        )
    quoted = _NAMES.get(target)
    if quoted is None:
        if len(_NAMES) >= 256:
            _NAMES.clear()
        quoted = _NAMES[target] = _quote(target)
    exc = "null" if exception is None else _quote(exception)
    return (
        f'{{"kind":"bundle","path":{_quote(name)},"target":{quoted},"call_index":{index},'
        f'"bytes":{nbytes},"exception":{exc}}}'
    )


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
