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
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from kdump.bundle import bytecmp
from kdump.bundle.fileio import (
    Digests,
    address_of,
    copy_range,
    cpu_view,
    hash_write,
    pwrite_all,
    round_up,
    write_and_hash,
)
from kdump.bundle.staging import caller_streams, equal_on_device, write_device
from kdump.bundle.store import (
    BlobStore,
    Pieces,
    blob_digests,
    open_temp,
    piece_bytes,
    piece_cuts,
    pool,
    submit_or_run,
)
from kdump.errors import BundleError
from kdump.format.records import ALIGN_MOD, STORE_DIRNAME, blob_offset

Named = Digests | Pieces  # a span's digests: one blob's, or one per piece (a large span)

RESERVE_MIN = 128 << 10  # header space reserved up front
DEVICE_DEDUP_MIN = 64 << 10  # device spans from this size are compared before being written
RESERVE_PER_RECORD = 1 << 10  # and per tensor or storage record of the capture


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
        streams = caller_streams(sources)
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
                        (r for s, r in dev_firsts.get(dkey, ()) if equal_on_device(s, src, after)),
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
                start = blob_offset(self._pos, n, align, self.min_aligned)
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
                            write_device,
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
            copy_range(self._fd, fd, self._reserved, reserved, length)
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
        streams = caller_streams(sources)
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
                                pool().submit, write_device, fd, src[lo:hi], 0, streams[src.device]
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
            ctypes.memmove(copy.data_ptr() + pos, address_of(memoryview(m)), n)
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
        base = address_of(memoryview(reserved))
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
