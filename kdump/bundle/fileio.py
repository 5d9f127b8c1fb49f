"""Writing spans into files: zero-copy views of CPU bytes, positioned writes, allocation ahead
of large writes where the file system gains from it, and hashing (the SHA-256 name and the fast
check) while writing, on the process's pools. What a bundle's spool and the blob store's files
are written with.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Callable, Sequence

import torch

from kdump.bundle.store import (
    HASH_THREADS,
    ProcessPool,
    fast_checksum,
    hasher,
    share_out,
    submit_or_run,
)
from kdump.errors import BundleError
from kdump.errors import BundleErrorKind as K

Digests = tuple[str, str]  # (SHA-256 name, fast check digest or "")

WRITE_CHUNK = 16 << 20  # one read of a move inside the file
HASH_CHUNK = 1 << 20  # the SHA-256 and the fast check read the same chunk while it is in cache
FAST_APART = 4 << 20  # pieces from this size get their fast check on another thread


def round_up(n: int, unit: int) -> int:
    return n + (-n) % unit


# The fast checks beside the SHA-256 (`Digester`): a pool of their own, so that one never waits
# behind a span's queued writes.
check_pool = ProcessPool("kdump-check")


def address_of(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


def cpu_view(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU uint8 tensor."""
    n = t.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


class Digester:
    """A span's SHA-256 name and fast check, fed piece by piece. Pieces of FAST_APART bytes and
    more have the fast check computed on another thread while SHA-256 runs here (both release
    the GIL): on one thread the fast check added a tenth to the SHA-256's time, and a 600 MB
    span is bound by its hashing. Smaller pieces are checked here, in HASH_CHUNK parts, while
    they are in cache. `apart` False: always here (pieces already hashed in parallel)."""

    __slots__ = ("apart", "fast", "sha")

    def __init__(self, apart: bool = True) -> None:
        algo = fast_checksum()
        self.sha = hashlib.sha256()
        self.fast = hasher(algo) if algo.value != "sha256" else None
        self.apart = apart

    def update(self, piece: memoryview) -> None:
        fast = self.fast
        if fast is not None and self.apart and len(piece) >= FAST_APART:
            job = submit_or_run(check_pool().submit, fast.update, piece)
            try:
                for j in range(0, len(piece), HASH_CHUNK):
                    self.sha.update(piece[j : j + HASH_CHUNK])
            finally:
                job.result()  # before the caller reuses the piece's memory
            return
        for j in range(0, len(piece), HASH_CHUNK):
            part = piece[j : j + HASH_CHUNK]
            self.sha.update(part)
            if fast is not None:
                fast.update(part)

    def digests(self) -> Digests:
        return self.sha.hexdigest(), self.fast.hexdigest() if self.fast is not None else ""


# Written in groups of this many bytes, right after they were hashed (mostly still in cache): the
# page cache keeps what one write brings in as large folios where the file system can (ext4 and
# XFS on recent kernels); a file written in 1 MiB writes mapped at about half the speed on load.
PASS_WRITE = 16 << 20


def hash_only(view: memoryview) -> Digests:
    """The digests of `view` (SHA-256 and the fast check), on the calling thread."""
    h = Digester(apart=False)
    h.update(view)
    return h.digests()


# Spans from this size have their range of the file allocated before they are written, on the
# file systems where that was measured to help (ALLOCATING_FS): a buffered write over allocated
# (unwritten) blocks skips ext4's per-block delayed allocation (a third less system time for a
# 40 MB span; no gain below about 1 MiB). On tmpfs it costs a tenth more, so not there.
ALLOCATE_MIN = 1 << 20


ALLOCATING_FS = frozenset({0xEF53})  # statfs f_type: ext2/3/4 (one magic)


def _fallocate() -> Callable[[int, int, int], int] | None:
    """fallocate(2) (mode 0: allocate, extending the file), or None where there is none."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # The 64-bit offset entry; plain fallocate takes them only where off_t is 64 bits.
        fn = getattr(libc, "fallocate64", None)
        if fn is None and ctypes.sizeof(ctypes.c_long) == 8:
            fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    if fn is None:
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int

    def allocate(fd: int, offset: int, length: int) -> int:
        return int(fn(fd, 0, offset, length))

    return allocate


_allocate = _fallocate()


def allocate(fd: int, offset: int, length: int) -> bool:
    """Allocate `length` bytes of `fd` from `offset` (what the file holds is unchanged: a hole
    becomes blocks that read as zeros). A hint: False where the file system or the system
    cannot (the write that follows then allocates as it goes, and reports a full disk)."""
    return _allocate is not None and length > 0 and _allocate(fd, offset, length) == 0


def _fs_type(fd: int) -> int | None:
    """The statfs f_type (file system magic) of the file `fd`, or None where it cannot be had."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fstatfs = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(512)  # struct statfs, f_type (a long) first
    if fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


_allocating: dict[int, bool] = {}  # by st_dev: whether a file there is allocated before writing


def allocation_helps(fd: int) -> bool:
    """Whether `write_groups` allocates a large span's range of `fd` first (ALLOCATING_FS)."""
    dev = os.fstat(fd).st_dev
    got = _allocating.get(dev)
    if got is None:
        got = _allocating[dev] = _allocate is not None and _fs_type(fd) in ALLOCATING_FS
    return got


def write_groups(fd: int, view: memoryview, at: int) -> None:
    """Write `view` to `fd` at `at` in PASS_WRITE groups (the file writer's job), its range
    allocated first where that helps (ALLOCATE_MIN, ALLOCATING_FS)."""
    if len(view) >= ALLOCATE_MIN and allocation_helps(fd):
        allocate(fd, at, len(view))
    for lo in range(0, len(view), PASS_WRITE):
        pwrite_all(fd, view[lo : lo + PASS_WRITE], at + lo)


def hash_write(fd: int, view: memoryview, at: int) -> Digests:
    """Hash `view` and write it to `fd` at offset `at` in one pass over its bytes: each group is
    hashed and then written while it is in cache (a file of its own: the store's pieces).
    One pool worker runs it per piece; hashlib, xxhash and os.pwrite release the GIL."""
    h = Digester(apart=False)
    for lo in range(0, len(view), PASS_WRITE):
        group = view[lo : lo + PASS_WRITE]
        h.update(group)
        pwrite_all(fd, group, at + lo)
    return h.digests()


def write_and_hash(
    fd: int, writes: Sequence[tuple[memoryview, int]], pieces: Sequence[memoryview]
) -> list[Digests]:
    """Write each (bytes, offset) of `writes` to `fd`, in order, on the calling thread, while
    pool workers hash `pieces` (the largest first, so that no core is left with one large piece
    at the end); once its writes are done the calling thread hashes what is left beside them.
    Buffered writes into one file are serialised by the file system, so one thread writes; one
    worker fewer than the pool's threads hashes beside it, so that the write never waits for a
    core. The digests of `pieces`, in order; returns when every write and every hash is done."""
    out: list[Digests | None] = [None] * len(pieces)

    def hash_piece(k: int) -> None:
        out[k] = hash_only(pieces[k])

    def write() -> None:
        for view, at in writes:
            write_groups(fd, view, at)

    share_out(
        sorted(range(len(pieces)), key=lambda k: -len(pieces[k])),
        hash_piece,
        max(1, min(HASH_THREADS - 1, len(pieces))),
        own=write,
    )
    return out  # type: ignore[return-value]


def copy_range(src_fd: int, dst_fd: int, src: int, dst: int, length: int) -> None:
    """Copy `length` bytes between files, in the kernel where it can (else through a buffer:
    some sandboxes have no copy_file_range)."""
    left = length
    try:
        while left:
            n = os.copy_file_range(src_fd, dst_fd, left, src, dst)
            if n <= 0:
                break
            src, dst, left = src + n, dst + n, left - n
    except OSError:
        pass
    while left:
        piece = os.pread(src_fd, min(left, WRITE_CHUNK), src)
        if not piece:
            raise BundleError("the bundle's temporary ended while its data was moved", K.LIMIT)
        pwrite_all(dst_fd, memoryview(piece), dst)
        src, dst, left = src + len(piece), dst + len(piece), left - len(piece)
