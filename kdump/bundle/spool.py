"""A bundle written while its call is captured: every storage span goes straight from the
argument's memory into the bundle's temporary file, hashed on the way, with no snapshot copy in
between. Device memory goes through pinned staging buffers in chunks, the copy of the next chunk
overlapping the hashing and writing of the current one.

The header comes first in the file but is known only when the call is complete, so space is
reserved for it at the front (and the data moved back in the kernel, once, in the rare case it
outgrows that space). The data section starts at a multiple of ALIGN_MOD and each large span at
an offset congruent to its recorded address, as `save_calls` lays them out. The temporary has the
name of an `atomic_write` temporary, so one left by a killed writer is found and removed as those
are, and the bundle appears by one rename.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from kdump.bundle import bytecmp
from kdump.bundle.store import (
    HASH_THREADS,
    BlobStore,
    Pieces,
    ProcessPool,
    blob_digests,
    fast_checksum,
    hasher,
    open_temp,
    piece_bytes,
    piece_cuts,
    pool,
    share_out,
    submit_or_run,
)
from kdump.errors import BundleError
from kdump.errors import BundleErrorKind as K
from kdump.format.records import ALIGN_MOD, STORE_DIRNAME

Digests = tuple[str, str]  # (SHA-256 name, fast check digest or "")
Named = Digests | Pieces  # a span's digests: one blob's, or one per piece (a large span)

# A call holding fewer bytes than this is snapshot in memory and written in one go (a temporary
# file and a mapping per call cost more than copying a few MiB).
SPOOL_MIN = 8 << 20
WRITE_CHUNK = 16 << 20  # one read of a move inside the file
HASH_CHUNK = 1 << 20  # the SHA-256 and the fast check read the same chunk while it is in cache
FAST_APART = 4 << 20  # pieces from this size get their fast check on another thread
STAGE_CHUNK = 16 << 20  # pinned staging buffer per device copy (two per span being copied)
RESERVE_MIN = 128 << 10  # header space reserved up front
DEVICE_DEDUP_MIN = 64 << 10  # device spans from this size are compared before being written
DEVICE_COMPARE_CHUNK = 64 << 20  # bytes per device comparison (its temporary: an eighth)
RESERVE_PER_RECORD = 1 << 10  # and per tensor or storage record of the capture


def round_up(n: int, unit: int) -> int:
    return n + (-n) % unit


def aligned(pos: int, nbytes: int, align: int, min_aligned: int) -> int:
    """Where a blob of `nbytes` goes: the first offset at or after `pos` congruent to `align`
    modulo ALIGN_MOD (blobs of `min_aligned` bytes or more), or `pos`."""
    return pos + (align - pos) % ALIGN_MOD if nbytes >= min_aligned else pos


# The process's file-write pool (os.pwrite releases the GIL). Separate from the hashing pool so
# that a hashing job may wait on writes without ever waiting on itself.
io_pool = ProcessPool("kdump-write")
# The fast checks beside the SHA-256 (`_Digester`): a pool of their own, so that one never waits
# behind a span's queued writes.
check_pool = ProcessPool("kdump-check")


def _address(view: memoryview) -> int:
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


class _Digester:
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
    h = _Digester(apart=False)
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
    h = _Digester(apart=False)
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


class _Region:
    """One span written (or being written) into the file, relative to the data section."""

    __slots__ = ("alias", "digests", "nbytes", "piece", "start")

    def __init__(self, start: int, nbytes: int, piece: bool = False) -> None:
        self.start = start
        self.nbytes = nbytes
        self.digests: Digests | None = None
        self.alias: _Region | None = None  # the earlier region with the same bytes (not kept)
        # One piece of a span written in pieces: it keeps its place even when an earlier region
        # holds the same bytes (the span's snapshot is one run of the file), and is then a gap.
        self.piece = piece

    @property
    def end(self) -> int:
        return self.start + self.nbytes


class Spool:
    """A bundle's temporary file, filled span by span; `finish` writes the header and renames it
    to `path`, `abort` removes it. The file is made on the first `put`."""

    def __init__(self, path: str | os.PathLike[str], min_aligned: int) -> None:
        self.path = Path(path)
        self.min_aligned = min_aligned
        self._fd: int | None = None
        self._tmp: str | None = None
        self._reserved = 0  # header bytes, length prefix included; a multiple of ALIGN_MOD
        self._pos = 0  # end of the data written, relative to the data section
        self._regions: list[_Region] = []
        self._length = 0  # data bytes the header covers (set by `layout`)
        self._done = False

    @property
    def active(self) -> bool:
        return self._fd is not None

    @property
    def data_start(self) -> int:
        return self._reserved

    def _open(self, records: int, header: int = 0) -> int:
        if self._done:
            raise BundleError(f"{self.path}: the bundle was already finished or abandoned")
        if self._fd is None:
            fd, tmp = open_temp(self.path)
            self._fd, self._tmp = fd, tmp
            want = header or RESERVE_MIN + RESERVE_PER_RECORD * records
            self._reserved = round_up(want, ALIGN_MOD)
        return self._fd

    def reserve(self, header: int) -> None:
        """Make the file with `header` bytes reserved for the header (an upper bound the caller
        knows, length prefix included), before the first `put`."""
        self._open(0, header)

    # -- spans ------------------------------------------------------------------------------------
    def put(
        self, sources: Sequence[torch.Tensor], aligns: Sequence[int], records: int = 0
    ) -> list[tuple[torch.Tensor, Named]]:
        """Write each source span (a contiguous uint8 tensor, CPU or CUDA) into the file; for each,
        a CPU uint8 tensor of the bytes as written (a private view of the file) and the digests
        (`Pieces` for a span larger than the piece size: each piece hashed on its own). CPU
        spans are written by this thread while the pool hashes them, device spans by pool
        workers. Sources with the same bytes are written once. Returns when every byte is in
        the file."""
        fd = self._open(records)
        piece = piece_bytes()
        spans: list[list[_Region]] = []
        jobs: list[tuple[_Region, Future[Digests]]] = []
        # The CPU spans are written once every span has its place, by this thread, in file
        # order, while the hashing pool hashes their pieces (`write_and_hash`).
        writes: list[tuple[memoryview, int]] = []
        pieces: list[tuple[_Region, memoryview]] = []
        # CPU sources written, by size and edge bytes: equal bytes have equal names, so a source
        # is compared with the earlier ones that could be equal instead of being written twice.
        firsts: dict[tuple[int, bytes], list[tuple[torch.Tensor, list[_Region]]]] = {}
        # Device sources likewise, by device and size, compared on the device: one found equal
        # only after both were written would leave its bytes in the file as a hole.
        dev_firsts: dict[tuple[Any, int], list[tuple[torch.Tensor, list[_Region]]]] = {}
        streams = _caller_streams(sources)
        try:
            for src, align in zip(sources, aligns):
                n = src.numel()
                twin = None
                if src.device.type == "cpu":
                    key = _edge_key(src)
                    twin = next((r for s, r in firsts.get(key, ()) if _same(s, src)), None)
                elif n >= DEVICE_DEDUP_MIN:
                    after = streams[src.device]
                    dkey = (src.device, n)
                    twin = next(
                        (r for s, r in dev_firsts.get(dkey, ()) if _equal_on_device(s, src, after)),
                        None,
                    )
                if twin is not None:
                    regions = []
                    for t in twin:
                        region = _Region(t.start, t.nbytes)
                        region.alias = t
                        regions.append(region)
                    spans.append(regions)
                    continue
                start = aligned(self._pos, n, align, self.min_aligned)
                self._pos = start + n
                cuts = piece_cuts(n, piece)
                regions = [_Region(start + lo, hi - lo, len(cuts) > 1) for lo, hi in cuts]
                spans.append(regions)
                at = self._reserved + start
                if src.device.type == "cpu":
                    # Each piece is hashed by a pool worker while the span is written in file
                    # order: the hashing spreads over the cores and overlaps the write, which
                    # one file cannot spread.
                    firsts.setdefault(key, []).append((src, regions))
                    view = cpu_view(src)
                    writes.append((view, at))
                    pieces += [(r, view[lo:hi]) for (lo, hi), r in zip(cuts, regions)]
                else:
                    if n >= DEVICE_DEDUP_MIN:
                        dev_firsts.setdefault((src.device, n), []).append((src, regions))
                    for (lo, hi), r in zip(cuts, regions):
                        job = submit_or_run(
                            pool().submit,
                            _write_device,
                            fd,
                            src[lo:hi],
                            at + lo,
                            streams[src.device],
                        )
                        jobs.append((r, job))
            if writes:
                digests = write_and_hash(fd, writes, [v for _, v in pieces])
                for (region, _), dig in zip(pieces, digests):
                    region.digests = dig
        finally:
            errors: list[BaseException] = []
            for region, job in jobs:
                try:
                    region.digests = job.result()
                except BaseException as exc:  # wait for every job before reporting: they share fd
                    errors.append(exc)
        if errors:
            raise errors[0]
        self._dedup([r for regions in spans for r in regions])
        return self._views(spans, piece)

    def _dedup(self, regions: list[_Region]) -> None:
        """Regions whose bytes turned out to equal an earlier region's (device spans: compared
        by name after hashing) point to it; trailing ones are given back to the file. Pieces
        keep their place (`_Region.piece`)."""
        known: dict[str, _Region] = {
            r.digests[0]: r for r in self._regions if r.alias is None and r.digests
        }
        for r in regions:
            if r.alias is not None:
                r.digests = r.alias.digests
                continue
            assert r.digests is not None
            first = known.get(r.digests[0])
            if first is not None and first.nbytes == r.nbytes and not r.piece:
                r.alias = first
            elif first is None:
                known[r.digests[0]] = r
        self._regions.extend(regions)
        live_end = max((r.end for r in self._regions if r.alias is None), default=0)
        self._pos = live_end

    def _views(
        self, spans: Sequence[Sequence[_Region]], piece: int
    ) -> list[tuple[torch.Tensor, Named]]:
        assert self._fd is not None
        total = self._reserved + self._pos
        mm = mmap.mmap(self._fd, total, access=mmap.ACCESS_COPY) if self._pos else None
        out: list[tuple[torch.Tensor, Named]] = []
        for regions in spans:
            first = regions[0].alias or regions[0]  # pieces of a span lie back to back
            nbytes = sum(r.nbytes for r in regions)
            named: Named
            if len(regions) == 1:
                assert regions[0].digests is not None
                named = regions[0].digests
            else:
                named = Pieces(piece, tuple(r.digests for r in regions))  # type: ignore[misc]
            if nbytes == 0 or mm is None:
                out.append((torch.empty(0, dtype=torch.uint8), named))
                continue
            t = torch.frombuffer(
                mm, dtype=torch.uint8, count=nbytes, offset=self._reserved + first.start
            )
            out.append((t, named))
        return out

    # -- the end ----------------------------------------------------------------------------------
    def layout(
        self, keep: set[str] | None = None
    ) -> tuple[dict[str, tuple[int, int]], list[tuple[int, int]], int]:
        """(sha → [begin, end) in the data section, gaps to cover with padding, data length).
        Regions whose blob is not in `keep` (snapshots the bundle does not use) are gaps."""
        live = sorted((r for r in self._regions if r.alias is None), key=lambda r: r.start)
        layout: dict[str, tuple[int, int]] = {}
        pads: list[tuple[int, int]] = []
        pos = 0
        for r in live:
            assert r.digests is not None
            if keep is not None and r.digests[0] not in keep:
                continue
            if r.digests[0] in layout:  # a piece equal to an earlier blob: padding
                pads.append((pos, r.end))
                pos = r.end
                continue
            if r.start > pos:
                pads.append((pos, r.start))
            layout[r.digests[0]] = (r.start, r.end)
            pos = r.end
        self._length = pos
        return layout, pads, pos

    def finish(self, raw: bytes) -> Path:
        """Write the header `raw` (the JSON naming `layout()`'s entries; padded here with spaces)
        and rename the file to `path`."""
        fd = self._open(0)
        length = self._length
        need = 8 + len(raw)
        try:
            if need > self._reserved:
                fd = self._relocate(round_up(need, ALIGN_MOD), length)
            os.ftruncate(fd, self._reserved + length)
            body = raw + b" " * (self._reserved - need)
            pwrite_all(fd, memoryview(struct.pack("<Q", len(body)) + body), 0)
            os.close(fd)
            self._fd = None
            assert self._tmp is not None
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return self.path

    def _relocate(self, reserved: int, length: int) -> int:
        """Move the data section of the file to start at `reserved` (a new temporary: the
        mappings handed out keep seeing the old one)."""
        assert self._fd is not None and self._tmp is not None
        fd, tmp = open_temp(self.path)
        try:
            _copy_range(self._fd, fd, self._reserved, reserved, length)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)
        self._fd, self._tmp, self._reserved = fd, tmp, reserved
        return fd

    def abort(self) -> None:
        """Remove the temporary (nothing reaches `path`)."""
        self._done = True
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            self._tmp = None

    def __del__(self) -> None:  # an abandoned spool leaves no temporary behind
        with contextlib.suppress(Exception):
            if not self._done:
                self.abort()


class StoreSpool:
    """The sink of a recorder that writes to a capture directory's blob store: each large span
    goes straight from the tensor's memory into a temporary in the store's folder, hashed on the
    way, and is then renamed to its name (or dropped, when the store already holds it). Spans
    smaller than `min_blob` stay in memory (they go inline into the bundle). `created` holds the
    blobs it added (name → bytes)."""

    def __init__(self, store: Callable[[], BlobStore], min_blob: int) -> None:
        self._store = store
        self.min_blob = min_blob
        self.created: dict[str, int] = {}
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def put(
        self, sources: Sequence[torch.Tensor], aligns: Sequence[int], records: int = 0
    ) -> list[tuple[torch.Tensor, Named]]:
        store = self._store()
        self._active = True
        piece = piece_bytes()
        out: list[tuple[torch.Tensor, Named] | None] = [None] * len(sources)
        streams = _caller_streams(sources)
        # (source, piece size, descriptor, temporary, job): one file per piece, hashed while
        # written by one pool worker.
        jobs: list[tuple[int, int, int, str, Future[Digests]]] = []
        try:
            for i, src in enumerate(sources):
                if src.numel() < max(self.min_blob, 1):
                    host = src.clone() if src.device.type == "cpu" else src.cpu()
                    out[i] = (host, blob_digests(cpu_view(host)))
                    continue
                view = cpu_view(src) if src.device.type == "cpu" else None
                for lo, hi in piece_cuts(src.numel(), piece):
                    fd, tmp = open_temp(store.root / STORE_DIRNAME / "spool")
                    try:
                        if view is not None:
                            job = submit_or_run(pool().submit, hash_write, fd, view[lo:hi], 0)
                        else:
                            job = submit_or_run(
                                pool().submit, _write_device, fd, src[lo:hi], 0, streams[src.device]
                            )
                    except BaseException:
                        os.close(fd)
                        os.unlink(tmp)
                        raise
                    jobs.append((i, hi - lo, fd, tmp, job))
        finally:  # every job started is waited for, and every file closed
            errors: list[BaseException] = []
            done: dict[int, list[tuple[int, Digests, mmap.mmap | None]]] = {}
            for i, n, fd, tmp, job in jobs:
                try:
                    digests = job.result()
                    mapped = mmap.mmap(fd, n, access=mmap.ACCESS_COPY)
                except BaseException as exc:
                    errors.append(exc)
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    continue
                try:
                    if store.adopt(digests[0], tmp, n):
                        self.created[digests[0]] = n
                    done.setdefault(i, []).append((fd, digests, mapped))
                except BaseException as exc:
                    os.close(fd)
                    errors.append(exc)
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
            try:
                if not errors:
                    for i, parts in done.items():
                        out[i] = _joined(parts, piece)
            finally:
                for parts in done.values():
                    for fd, _, _ in parts:
                        os.close(fd)
            if errors:
                raise errors[0]
        return out  # type: ignore[return-value]

    def abort(self) -> None:
        """Nothing to undo: what it added to the store are whole blobs under their names."""


def _copy_range(src_fd: int, dst_fd: int, src: int, dst: int, length: int) -> None:
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


EDGE = 64  # bytes from each end of a span that key the search for an equal earlier span


def _edge_key(t: torch.Tensor) -> tuple[int, bytes]:
    """A CPU span's size and its first and last EDGE bytes: spans with different keys differ."""
    n = t.numel()
    if n <= 2 * EDGE:
        return n, ctypes.string_at(t.data_ptr(), n) if n else b""
    ptr = t.data_ptr()
    return n, ctypes.string_at(ptr, EDGE) + ctypes.string_at(ptr + n - EDGE, EDGE)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    n = a.numel()
    return n == b.numel() and bytecmp.same(a.data_ptr(), b.data_ptr(), n)


def _joined(
    parts: Sequence[tuple[int, Digests, mmap.mmap | None]], piece: int
) -> tuple[torch.Tensor, Named]:
    """One span's snapshot from its pieces' store files (descriptor, digests, private map): the
    map of a single piece, or the pieces' files mapped back to back into one reserved range of
    addresses (a copy where the system refuses that)."""
    if len(parts) == 1:
        _, digests, mapped = parts[0]
        assert mapped is not None
        return torch.frombuffer(mapped, dtype=torch.uint8), digests
    named = Pieces(piece, tuple(d for _, d, _ in parts))
    sizes = [len(m) for _, _, m in parts if m is not None]
    total = sum(sizes)
    joined = _map_back_to_back([fd for fd, _, _ in parts], sizes, total)
    if joined is None:
        copy = torch.empty(total, dtype=torch.uint8)
        pos = 0
        for (_, _, m), n in zip(parts, sizes):
            assert m is not None
            ctypes.memmove(copy.data_ptr() + pos, _address(memoryview(m)), n)
            pos += n
        return copy, named
    return torch.frombuffer(joined, dtype=torch.uint8, count=total), named


_PROT = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # Linux


def _map_back_to_back(fds: Sequence[int], sizes: Sequence[int], total: int) -> mmap.mmap | None:
    """An anonymous map of `total` bytes whose parts are replaced by private maps of the files
    `fds` (all but the last a whole number of pages long), in order: one range of addresses that
    reads as the files concatenated; unmapping it unmaps them all. None where it cannot be made."""
    import sys

    if not sys.platform.startswith("linux") or any(n % mmap.PAGESIZE for n in sizes[:-1]):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.mmap
        fn.restype = ctypes.c_void_p
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        reserved = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = _address(memoryview(reserved))
        pos = 0
        for fd, n in zip(fds, sizes):
            got = fn(base + pos, n, _PROT, mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
            if got != base + pos:
                reserved.close()
                return None
            pos += n
        return reserved
    except (OSError, AttributeError, ValueError):
        return None


def _caller_streams(sources: Sequence[torch.Tensor]) -> dict[torch.device, Any]:
    """The caller's current stream of each device involved: the staging copies wait for the
    work queued on it (the producers of the bytes)."""
    out: dict[torch.device, Any] = {}
    for s in sources:
        if s.device.type == "cuda" and s.device not in out:
            out[s.device] = torch.cuda.current_stream(s.device)
    return out


def _staged(src: torch.Tensor, after: Any) -> Iterator[tuple[int, memoryview]]:
    """(offset, host bytes) of a device span, chunk by chunk, through two pinned staging
    buffers: chunk k+1 is being copied on a side stream (after the work queued on `after`) while
    the caller uses chunk k. A chunk's bytes are valid until the next one is asked for."""
    n = src.numel()
    if n == 0:
        return
    with torch.cuda.device(src.device):
        side = torch.cuda.Stream(src.device)
        side.wait_stream(after)
        chunk = min(STAGE_CHUNK, n)
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        views = [cpu_view(b) for b in bufs]
        events = [torch.cuda.Event(), torch.cuda.Event()]

        def issue(k: int) -> None:
            lo = k * chunk
            part = src[lo : lo + chunk]
            with torch.cuda.stream(side):
                bufs[k % 2][: part.numel()].copy_(part, non_blocking=True)
                events[k % 2].record(side)

        count = -(-n // chunk)
        issue(0)
        try:
            for k in range(count):
                events[k % 2].synchronize()
                if k + 1 < count:
                    issue(k + 1)  # into the buffer the caller finished with
                lo = k * chunk
                yield lo, views[k % 2][: min(n, lo + chunk) - lo]
        finally:
            side.synchronize()  # no copy may still target the buffers once they are released


def _write_device(fd: int, src: torch.Tensor, at: int, after: Any) -> Digests:
    """Copy a device span to the file at offset `at`: each staged chunk is written on the write
    pool while it is hashed here."""
    d = _Digester()
    for lo, piece in _staged(src, after):
        write = submit_or_run(io_pool().submit, pwrite_all, fd, piece, at + lo)
        try:
            d.update(piece)
        finally:
            write.result()  # before the buffer is reused
    return d.digests()


def _equal_on_device(a: torch.Tensor, b: torch.Tensor, after: Any) -> bool:
    """Whether two device spans of one size hold the same bytes, compared on the device after
    the work queued on `after`, in pieces (the comparison's temporary stays small); False when
    the device cannot say (e.g. out of memory: the span is then written, as before)."""
    n = a.numel()
    if n != b.numel() or a.device != b.device:
        return False
    try:
        with torch.cuda.device(a.device):
            side = torch.cuda.Stream(a.device)
            side.wait_stream(after)
            with torch.cuda.stream(side):
                for lo in range(0, n, DEVICE_COMPARE_CHUNK):
                    x, y = a[lo : lo + DEVICE_COMPARE_CHUNK], b[lo : lo + DEVICE_COMPARE_CHUNK]
                    if x.numel() % 8 == 0 and x.data_ptr() % 8 == 0 and y.data_ptr() % 8 == 0:
                        x, y = x.view(torch.int64), y.view(torch.int64)
                    if not torch.equal(x, y):
                        return False
        return True
    except (RuntimeError, torch.cuda.OutOfMemoryError):
        return False


def _same_device(src: torch.Tensor, snapshot: torch.Tensor, after: Any) -> bool:
    """Whether a device span holds the bytes of a host snapshot, compared chunk by chunk as
    they arrive (stops at the first chunk that differs)."""
    if src.numel() != snapshot.numel():
        return False
    base = snapshot.data_ptr()
    for lo, piece in _staged(src, after):
        if bytecmp.memcmp(_address(piece), base + lo, len(piece)) != 0:
            return False
    return True


def same_as_device_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """For each (device span, device copy made before the call) pair: whether they hold the same
    bytes, compared on the device after the work queued on the caller's streams (False where the
    device cannot say: the span is then written)."""
    streams = _caller_streams([src for src, _ in pairs])
    return [_equal_on_device(src, copy, streams[src.device]) for src, copy in pairs]


def same_on_device(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """For each (device span, host snapshot) pair: whether they hold the same bytes (the spans
    compared in parallel, after the work queued on the caller's streams)."""
    streams = _caller_streams([src for src, _ in pairs])
    jobs = [
        submit_or_run(pool().submit, _same_device, src, snap, streams[src.device])
        for src, snap in pairs
    ]
    return [j.result() for j in jobs]
