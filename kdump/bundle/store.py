"""Files on disk: the one atomic-write helper of the project, and the shared blob store."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import re
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kdump.format.records import STORE_DIRNAME, Checksum

try:  # optional: without it blobs are checked by their SHA-256 name (slower, same safety)
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

HASH_THREADS = max(1, min(16, os.cpu_count() or 1))  # one per core: pieces hash in parallel


TEMP_SUFFIX = ".tmp"
# `.<name>.<pid>@<host>.<random>.tmp`: who owns a temporary, so a later process can tell one
# left by a killed writer (its pid gone on this host) from one still being written.
_TEMP_RE = re.compile(r"^\..+\.(?P<pid>\d+)@(?P<host>[A-Za-z0-9-]*)\.[^.]+\.tmp$")


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())


def temp_owner(name: str) -> tuple[int, str] | None:
    """(pid, host tag) of an `atomic_write` temporary's file name; None for any other name."""
    m = _TEMP_RE.match(name)
    return (int(m["pid"]), m["host"]) if m else None


def is_own_host(tag: str) -> bool:
    return tag == _host_tag()


def atomic_write(
    path: str | os.PathLike[str], content: bytes | memoryview | Callable[[BinaryIO], object]
) -> str | os.PathLike[str]:
    """Write `content` (bytes, or a function that writes to the open file) to a temporary file in
    the same folder, then rename it over `path`: readers see the old file or the whole new one.
    Returns `path` as given (no Path is made: this runs once per small recorded call)."""
    fd, tmp = open_temp(path)
    try:
        if not callable(content):
            try:  # one write for a small file; no buffered file object
                view = memoryview(content).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        else:
            with os.fdopen(fd, "wb") as f:
                content(f)
                f.flush()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def open_temp(path: str | os.PathLike[str]) -> tuple[int, str]:
    """A new temporary file (read-write descriptor, ordinary permissions) in `path`'s folder,
    named so that `temp_owner` tells who wrote it; the caller renames it over `path` or removes
    it."""
    owner = _PID_HOST[0] if _PID_HOST[1] == os.getpid() else _pid_host()
    where = os.fspath(path)
    folder, name = os.path.dirname(where) or ".", os.path.basename(where)  # no Path per file
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    made = False
    for _ in range(100):
        tmp = f"{folder}/.{name}.{owner}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
        try:
            # Mode 0666 under the umask: an ordinary file (mkstemp would make it 0600).
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
        except FileNotFoundError:
            if made:
                raise
            os.makedirs(folder, exist_ok=True)  # the folder, on first need
            made = True
    raise FileExistsError(f"no free temporary name beside {path}")


def _pid_host() -> str:
    global _PID_HOST
    _PID_HOST = (f"{os.getpid()}@{_host_tag()}", os.getpid())
    return _PID_HOST[0]


_PID_HOST: tuple[str, int] = ("", -1)  # the temporaries' owner tag, made once per process


def sha256_hex(data: memoryview | bytes) -> str:
    """A blob's name: the SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


def fast_checksum() -> Checksum:
    """The per-blob check new bundles record: xxh3-128 where the xxhash module is installed."""
    return Checksum.XXH3_128 if _xxhash is not None else Checksum.SHA256


def can_check(algo: Checksum) -> bool:
    return algo is Checksum.SHA256 or _xxhash is not None


def hasher(algo: Checksum) -> Any:
    """An incremental hasher (update / hexdigest) for `algo`; `can_check(algo)` must hold."""
    if algo is Checksum.XXH3_128:
        return _xxhash.xxh3_128()
    return hashlib.sha256()


def blob_digests(data: memoryview | bytes) -> tuple[str, str]:
    """A new blob's name (SHA-256) and its fast check digest ("" when that is the name)."""
    return sha256_hex(data), fast_digest(data)


def fast_digest(data: memoryview | bytes) -> str:
    """The fast check digest alone ("" without xxhash)."""
    return _xxhash.xxh3_128_hexdigest(data) if _xxhash is not None else ""


def on_pool_thread() -> bool:
    """Whether this thread is one of the hashing pool's: its jobs must not wait on the pool."""
    return threading.current_thread().name.startswith(POOL_PREFIX)


def submit_or_run(
    submit: Callable[..., Future[Any]], fn: Callable[..., Any], *args: Any
) -> Future[Any]:
    """`submit(fn, *args)`, or `fn` run here where no pool takes new work: after interpreter
    shutdown began (an atexit flush), a pool refuses every new job."""
    try:
        return submit(fn, *args)
    except RuntimeError as exc:
        # Only the refusal to take work: "can't start new thread" comes after the job was
        # queued, and running it here too would run it twice.
        if "cannot schedule new futures" not in str(exc):
            raise
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done


def share_out(
    tasks: Sequence[Any],
    job: Callable[[Any], None],
    helpers: int,
    own: Callable[[], None] | None = None,
) -> None:
    """`job(task)` for every task, in order of `tasks`, by `helpers` pool workers and the calling
    thread, which first does `own` (its work beside theirs) and then takes tasks too. Returns
    once every worker has stopped, even after a failure (the jobs read the caller's memory); a
    failure of the calling thread drops the tasks not yet started; the first failure is raised."""
    todo = collections.deque(tasks)

    def drain() -> None:
        while True:
            try:
                task = todo.popleft()
            except IndexError:
                return
            job(task)

    started = [submit_or_run(pool().submit, drain) for _ in range(helpers)]
    errors: list[BaseException] = []
    try:
        if own is not None:
            own()
        drain()
    except BaseException as exc:
        todo.clear()
        errors.append(exc)
    finally:
        for f in started:
            if f.cancel():  # never started: its tasks were run by the others
                continue
            try:
                f.result()
            except BaseException as exc:
                errors.append(exc)
    if errors:
        raise errors[0]


def same_as_digests(
    items: Sequence[tuple[memoryview, tuple[str, str] | Pieces]],
    first: Callable[[int], bool] | None = None,
) -> list[bool | None]:
    """For each (view, digests): whether `view` holds the bytes that were written under
    `digests`, by their fast check digests (xxh3-128), every piece and every blob hashed at
    once by the calling thread and the pool: one read of the views instead of a compare with a
    second copy. None where the digests carry no fast check or the sizes cannot match, and for
    every item on a pool worker (whose pool could be waiting on this very call).

    `first(k)`, where given, is the caller's own compare of the start of item k (its digests
    compared): run by whichever thread hashes the item's first piece, just before hashing it
    (the bytes it read then come from cache); False makes the item differ."""
    if _xxhash is None or on_pool_thread():
        return [None] * len(items)
    out: list[bool | None] = []
    tasks: list[tuple[int, memoryview, str, bool]] = []  # (item, piece, its digest, first)
    for k, (view, digests) in enumerate(items):
        parts = _digest_parts(view, digests)
        out.append(None if parts is None else True)
        for p, (part, fast) in enumerate(parts or ()):
            tasks.append((k, part, fast, first is not None and p == 0))

    def check(task: tuple[int, memoryview, str, bool]) -> None:
        k, part, fast, starts = task
        if out[k] is False:  # an item that differed: its other pieces need not be hashed
            return
        if (starts and first is not None and not first(k)) or fast_digest(part) != fast:
            out[k] = False

    # The largest pieces first (no thread is left with a large one at the end), by one worker
    # fewer than there are pieces: the calling thread hashes too.
    share_out(sorted(tasks, key=lambda t: -len(t[1])), check, min(HASH_THREADS - 1, len(tasks) - 1))
    return out


def _digest_parts(
    view: memoryview, digests: tuple[str, str] | Pieces
) -> list[tuple[memoryview, str]] | None:
    """(bytes, fast check digest) of each piece of `view` written under `digests`; None where
    they carry no fast check or the sizes cannot match."""
    if isinstance(digests, Pieces):
        cuts = piece_cuts(len(view), digests.size)
        if len(cuts) != len(digests.digests) or any(not f for _, f in digests.digests):
            return None
        return [(view[lo:hi], f) for (lo, hi), (_, f) in zip(cuts, digests.digests)]
    return [(view, digests[1])] if digests[1] else None


PIECE_UNIT = 1 << 20  # a piece size is a multiple of this (pieces then keep their alignment)
_piece_cache: tuple[str | None, int] = ("", 0)


def piece_bytes() -> int:
    """The piece size (KDUMP_PIECE_BYTES): a storage larger than this is written in pieces."""
    global _piece_cache
    from kdump import config

    raw = config.get("KDUMP_PIECE_BYTES")
    if raw == _piece_cache[0]:
        return _piece_cache[1]
    from kdump.config import parse_bytes
    from kdump.errors import UsageError

    assert raw is not None  # declared with a default
    n = parse_bytes(raw)
    if n < PIECE_UNIT or n % PIECE_UNIT:
        raise UsageError(
            f"KDUMP_PIECE_BYTES={raw}: the piece size is a multiple of 1M, at least 1M"
        )
    _piece_cache = (raw, n)
    return n


def piece_cuts(nbytes: int, piece: int) -> list[tuple[int, int]]:
    """[begin, end) of each piece of a span of `nbytes` (one piece unless it is larger than
    `piece`)."""
    if nbytes <= piece:
        return [(0, nbytes)]
    return [(lo, min(lo + piece, nbytes)) for lo in range(0, nbytes, piece)]


@dataclass(frozen=True)
class Pieces:
    """The (SHA-256, fast check) digests of a span written in pieces of `size` bytes, one per
    piece, in order (a plain pair of strings is the digests of a span written as one blob)."""

    size: int
    digests: tuple[tuple[str, str], ...]


def span_digests(view: memoryview) -> tuple[str, str] | Pieces:
    """The digests of a span's bytes as the writer names them: one blob's, or (a span larger
    than the piece size) each piece's, hashed in parallel on the pool. Not for pool workers."""
    piece = piece_bytes()
    if len(view) <= piece:
        return blob_digests(view)
    cuts = piece_cuts(len(view), piece)
    jobs = [submit_or_run(pool().submit, blob_digests, view[lo:hi]) for lo, hi in cuts]
    return Pieces(piece, tuple(j.result() for j in jobs))


class ProcessPool:
    """A thread pool of the process, made on first use and again in a forked child (whose copy of
    the parent's pool has no threads)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def __call__(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix=self._prefix)
                self._pid = os.getpid()
            return self._pool


# The process's one hashing / copying pool (hashlib and xxhash release the GIL).
POOL_PREFIX = "kdump-hash"
pool = ProcessPool(POOL_PREFIX)


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

    def adopt(self, sha: str, tmp: str, nbytes: int) -> bool:
        """Move a blob file already written (temporary `tmp`, in this store's folder) to its
        name; when the store holds the blob already, `tmp` is removed instead. True when it
        was added."""
        if self.has(sha, nbytes):
            os.unlink(tmp)
            return False
        dest = self.path(sha)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
        return True
