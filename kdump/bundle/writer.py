"""Writing bundles: write captured calls as one bundle (`save_calls`), or manifest records whose
blobs are named already (`save_entries`).

A bundle is written one of two ways, chosen in one place (`_spooled`): spooled, its blobs hashed
and written into the bundle's temporary file span by span and the header written last into the
space reserved for it (a bundle captured into its spool, or a large one whose bytes are not
hashed yet); or whole, from memory once every blob's digests are known (small bundles, bundles
whose blobs go to a store, bundles hashed already), the header built record by record or filled
into its call signature's template (`kdump.bundle.header_cache`).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import torch

from kdump.bundle.capture import CallRecord
from kdump.bundle.fileio import Digests, address_of, cpu_view
from kdump.bundle.header_cache import HeaderCache
from kdump.bundle.manifest import (
    WRITER,
    blob_alignments,
    blob_layout,
    header_bound,
    header_for,
    header_json,
    manifest_maker,
)
from kdump.bundle.spool import Spool, StoreSpool
from kdump.bundle.store import (
    BlobStore,
    Pieces,
    atomic_write,
    blob_digests,
    fast_checksum,
    piece_bytes,
    piece_cuts,
    pool,
    submit_or_run,
)
from kdump.errors import UsageError
from kdump.format.records import (
    ALIGN_MOD,
    ALIGNED_BLOB_MIN,
    FORMAT_VERSION,
    BlobRecord,
    CallEntry,
    Manifest,
    Source,
    Where,
    manifest_json,
)


def open_spool(path: str | os.PathLike[str]) -> Spool:
    """A spool for the bundle to be written at `path`: pass it to `capture_call` and
    `attach_outputs` as `sink`, then to `save_calls` as `spool` (or `abort()` it)."""
    return Spool(path, ALIGNED_BLOB_MIN)


# A bundle whose data section is at most this is assembled in memory and written in one write.
ONE_WRITE_MAX = 1 << 20
# What a recorder keeps inline in a store bundle (`inline_below`): a blob smaller than this costs
# more as a file of its own in the store (a temporary, a rename, an inode) than its bytes in each
# bundle that uses it.
STORE_MIN = 16 << 10

# Below this many bytes hashing on the calling thread beats handing blobs to the pool, and
# hashing before writing beats the spooled writer (which builds the manifest twice: once for
# the header's reserved space).
INLINE_HASH_MAX = 8 << 20

Progress = Callable[[int], None]  # told the bytes of blob data written, as they are
PROGRESS_CHUNK = 64 << 20  # a blob is written in pieces of this size when progress is reported


def save_calls(
    path: str | os.PathLike[str],
    calls: Sequence[CallRecord],
    *,
    env: dict[str, Any] | None = None,
    store: BlobStore | None = None,
    info: dict[str, Any] | None = None,
    spool: Spool | StoreSpool | None = None,
    inline_below: int = 0,
    headers: HeaderCache | None = None,
    progress: Progress | None = None,
    sized: Callable[[int], object] | None = None,
    headed: Callable[[bytes, Sequence[Digests]], object] | None = None,
) -> Path:
    """Write `calls` as one bundle, atomically. Identical storages are stored once. `progress`
    is told the bytes of blob data as they are written; `sized`, the size of the bundle's file
    where the writer knows it without asking the file system (a bundle written in one write).

    With `store`, blobs go to the shared store (each written once per capture directory) and the
    bundle holds only the manifest, except blobs smaller than `inline_below` bytes (a recorder
    passes STORE_MIN), which stay inline. With `spool` (the sink the calls were captured into,
    opened for `path`), the blobs already in its file stay there and the header completes it; a
    `StoreSpool`'s blobs are in the store already (and not written again). With `headers` (a
    recorder's `HeaderCache`), a small bundle's header is filled into the template of its call
    signature instead of being built and encoded record by record; an `env` or `info` passed to
    the same cache again as the same object is taken as unchanged (pass a new dict for new facts;
    never edit one that was passed). `headed` is told the header and the digests of the storages
    (in capture order) of a bundle whose header came through `headers`.
    """
    path = path if isinstance(path, Path) else Path(path)
    blobs = _collect(calls, store is not None, inline_below)
    created = _utc_now()
    make_manifest = manifest_maker(
        calls, blobs.sizes, blobs.wheres, env, info, created, counts=blobs.counts
    )
    sink = _spooled(path, spool, store, blobs, make_manifest)
    if sink is not None:
        done = _finish_spool(sink, path, blobs.data, blobs.aligns, blobs.known, make_manifest)
        if progress is not None:  # its bytes went to the file as they were captured or hashed
            progress(sum(len(v) for v in blobs.views))
        return done
    digests = _hash_all(blobs.views, blobs.known, blobs.addresses)
    inline: dict[str, tuple[memoryview, int]] = {}
    stored: dict[str, memoryview] = {}
    for (sha, _), view, align, where in zip(digests, blobs.views, blobs.aligns, blobs.wheres):
        if where is Where.STORE:
            stored.setdefault(sha, view)
        else:
            inline.setdefault(sha, (view, align))
    if store is not None:
        for sha, view in stored.items():
            store.put(sha, view)
            if progress is not None:
                progress(len(view))
    raw = None
    if headers is not None and _small(inline):
        raw = headers.header(
            calls, digests, blobs.wheres, inline, env or {}, info or {}, created, make_manifest
        )
        if raw is not None and headed is not None:
            headed(raw, digests)
    if raw is None:
        raw, layout, offset = header_for(make_manifest(digests), inline)
    else:
        layout, _, offset = blob_layout(inline)
    nbytes = _write_file(path, raw, layout, offset, inline, progress)
    if sized is not None:
        sized(nbytes)
    return path


@dataclass
class _Blobs:
    """The views of a bundle's blobs in capture order, with what the writer knows of each."""

    data: list[torch.Tensor] = field(default_factory=list)  # the snapshot bytes (kept alive)
    views: list[memoryview] = field(default_factory=list)
    aligns: list[int] = field(default_factory=list)  # recorded address modulo ALIGN_MOD
    known: list[Digests | None] = field(default_factory=list)  # digests the capture made
    sizes: list[int] = field(default_factory=list)
    wheres: list[Where] = field(default_factory=list)
    addresses: list[int] = field(default_factory=list)  # where each view's bytes start
    counts: list[int] = field(default_factory=list)  # views per storage that holds bytes

    def add(
        self, d: torch.Tensor, view: memoryview, align: int, dig: Digests | None, at: int
    ) -> None:
        self.data.append(d)
        self.views.append(view)
        self.aligns.append(align)
        self.known.append(dig)
        self.sizes.append(len(view))
        self.addresses.append(at)


def _collect(calls: Sequence[CallRecord], to_store: bool, inline_below: int) -> _Blobs:
    """One pass over the storages that hold bytes (other kinds hold none; a sparse one holds its
    ranges, concatenated): this runs for every bundle a recorder writes. A blob storage larger
    than the piece size becomes one view per piece (each its own blob), and `counts` says how
    many views each storage has. With `to_store`, views of `inline_below` bytes and more go to
    the store."""
    out = _Blobs()
    seen: dict[int, tuple[memoryview, int]] = {}  # by snapshot (an unchanged output shares one)
    blob, sparse, store, inline = Source.BLOB, Source.SPARSE, Where.STORE, Where.INLINE
    piece = piece_bytes()
    for call in calls:
        for cap in (call.inputs, call.outputs):
            if cap is None:
                continue
            digs = cap.digests
            for i, (st, d) in enumerate(zip(cap.storages, cap.data)):
                if st.source is not blob and st.source is not sparse:
                    continue
                dig = digs[i] if i < len(digs) else None
                got = seen.get(id(d))  # `data` keeps d alive: its id is its own
                if got is None:
                    view = cpu_view(d)
                    got = seen[id(d)] = (view, d.data_ptr() if len(view) else 0)
                view = got[0]
                n = len(view)
                align = (st.base_ptr + st.span_start) % ALIGN_MOD  # st.alignment
                # A span hashed whole already (a plain pair) stays one blob; one hashed in pieces
                # of another size (the setting changed) is hashed again.
                if st.source is blob and n > piece and not isinstance(dig, tuple):
                    cuts = piece_cuts(n, piece)
                    parts: list[Digests | None] = [None] * len(cuts)
                    if isinstance(dig, Pieces) and dig.size == piece:
                        parts = list(dig.digests)
                    out.counts.append(len(cuts))
                    for (lo, hi), part in zip(cuts, parts):
                        out.add(d[lo:hi], view[lo:hi], (align + lo) % ALIGN_MOD, part, got[1] + lo)
                        out.wheres.append(store if to_store and hi - lo >= inline_below else inline)
                    continue
                out.counts.append(1)
                out.add(d, view, align, None if isinstance(dig, Pieces) else dig, got[1])
                out.wheres.append(store if to_store and n >= inline_below else inline)
    return out


def _spooled(
    path: Path,
    spool: Spool | StoreSpool | None,
    store: BlobStore | None,
    blobs: _Blobs,
    make_manifest: Callable[[Sequence[Digests]], dict[str, Any]],
) -> Spool | None:
    """The one choice of the write path: the spool to complete the bundle in, or None to write it
    whole from memory. A bundle captured into its spool is completed there, unless its blobs go
    to a store (its file was then only the snapshot's memory); a large bundle not hashed yet is
    hashed and written in one pass, each piece by a pool worker, into a new spool whose header
    space is reserved first."""
    if isinstance(spool, Spool) and spool.active:
        if store is None:
            return spool
        spool.abort()
    large = sum(len(v) for v in blobs.views) >= INLINE_HASH_MAX
    if store is not None or not large or all(blobs.known):
        return None
    sink = open_spool(path)
    sink.reserve(8 + header_bound(blobs.views, make_manifest))
    return sink


def _hash_all(
    views: Sequence[memoryview],
    known: Sequence[Digests | None] | None = None,
    addresses: Sequence[int] | None = None,
) -> list[Digests]:
    """Digests of `views`; those in `known` (a capture that hashed them already) are not hashed
    again, nor views of the same bytes (an unchanged output sharing its input's snapshot).
    `addresses`: where each view's bytes start, where the caller knows (else they are asked)."""
    known = known if known is not None else [None] * len(views)
    todo = [i for i, k in enumerate(known) if k is None]
    if len(todo) <= 1 or sum(len(views[i]) for i in todo) < INLINE_HASH_MAX:
        done: dict[tuple[int, int], Digests] = {}
        out = []
        for i in todo:
            v = views[i]
            key = (addresses[i] if addresses is not None else address_of(v), len(v))
            dig = done.get(key)
            if dig is None:
                dig = done[key] = blob_digests(v)
            out.append(dig)
        fresh = iter(out)
    else:
        fresh = iter([f.result() for f in _submit_once([views[i] for i in todo])])
    return [k if k is not None else next(fresh) for k in known]


def _submit_once(views: Sequence[memoryview]) -> list[Future[Digests]]:
    """Hash jobs for `views` on the shared pool; views of the same bytes (a snapshot shared by an
    unchanged output and its input) share one job."""
    jobs: dict[tuple[int, int], Future[Digests]] = {}
    out = []
    for v in views:
        key = (address_of(v), len(v))
        if key not in jobs:
            jobs[key] = submit_or_run(pool().submit, blob_digests, v)
        out.append(jobs[key])
    return out


def _small(inline: dict[str, tuple[memoryview, int]]) -> bool:
    """Whether a bundle's inline blobs are laid out back to back (no alignment padding) and
    written in one write: the bundles a header template is made for."""
    total = 0
    for view, _ in inline.values():
        if len(view) >= ALIGNED_BLOB_MIN:
            return False
        total += len(view)
    return total <= ONE_WRITE_MAX


_stamp: tuple[int, str] = (-1, "")


def _utc_now() -> str:
    """The manifest's `created` time (formatted once per second: bundles come faster)."""
    global _stamp
    now = int(time.time())
    if _stamp[0] != now:
        _stamp = (now, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)))
    return _stamp[1]


def _finish_spool(
    spool: Spool,
    path: Path,
    data: Sequence[torch.Tensor],
    aligns: Sequence[int],
    known: Sequence[Digests | None],
    make_manifest: Callable[[Sequence[Digests]], dict[str, Any]],
    records: int = 0,
) -> Path:
    """Complete a spooled bundle: blobs not in its file yet (captured in memory, or all of them
    for a bundle written from memory) join it, each hashed and written in one pass by a pool
    worker; then the header names them all."""
    if spool.path != path:
        raise UsageError(f"the spool was opened for {spool.path}, not {path}")
    try:
        missing = [i for i, dig in enumerate(known) if dig is None]
        digests: list[Digests | None] = list(known)
        if missing:
            put = spool.put([data[i] for i in missing], [aligns[i] for i in missing], records)
            for i, (_, dig) in zip(missing, put):
                assert isinstance(dig, tuple)  # each is one piece at most
                digests[i] = dig
        final = [d for d in digests if d is not None]
        layout, pads, _ = spool.layout({sha for sha, _ in final})
        raw = header_json(make_manifest(final), layout, pads)
    except BaseException:
        spool.abort()  # nothing of a bundle that could not be completed stays behind
        raise
    return spool.finish(raw)


def _write_view(f: BinaryIO, view: memoryview, progress: Progress | None) -> None:
    if progress is None:
        f.write(view)
        return
    for at in range(0, len(view), PROGRESS_CHUNK):
        piece = view[at : at + PROGRESS_CHUNK]
        f.write(piece)
        progress(len(piece))


def write_whole(
    path: Path,
    manifest: dict[str, Any],
    blobs: dict[str, tuple[memoryview, int]],
    progress: Progress | None = None,
) -> int:
    """Write a bundle whose blobs (sha → (bytes, recorded alignment)) are all known; the size
    of its file."""
    raw, layout, offset = header_for(manifest, blobs)
    return _write_file(path, raw, layout, offset, blobs, progress)


def _write_file(
    path: Path,
    raw: bytes,
    layout: dict[str, tuple[int, int]],
    offset: int,
    blobs: dict[str, tuple[memoryview, int]],
    progress: Progress | None,
) -> int:
    """Write the padded header `raw` and the blobs at their `layout` offsets (`offset`: the data
    section's length), atomically; the size of the file."""
    if offset <= ONE_WRITE_MAX:  # a small bundle: assembled here, written by one write
        parts: list[bytes | memoryview] = [struct.pack("<Q", len(raw)), raw]
        pos = 0
        for sha, (view, _) in blobs.items():
            start = layout[sha][0]
            if start > pos:
                parts.append(bytes(start - pos))
            parts.append(view)
            pos = start + len(view)
        data = b"".join(parts)
        atomic_write(path, data)
        if progress is not None:
            progress(sum(len(v) for v, _ in blobs.values()))
        return len(data)

    def write(f: BinaryIO) -> None:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        data_start = 8 + len(raw)
        for sha, (view, _) in blobs.items():
            f.seek(data_start + layout[sha][0])
            _write_view(f, view, progress)
        f.truncate(data_start + offset)

    atomic_write(path, write)
    return 8 + len(raw) + offset


def save_entries(
    path: str | os.PathLike[str],
    calls: Sequence[CallEntry],
    data: dict[str, bytes | memoryview],
    *,
    env: dict[str, Any] | None = None,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write manifest records whose blobs are already named (sha → bytes in `data`) as one
    self-contained bundle, atomically: what a rewriting tool (`kdump slim`) produces. Every
    storage that holds bytes (blob, sparse) must name a blob of `data`; the names are checked."""
    algo = fast_checksum()
    aligns = blob_alignments(calls)
    blobs: dict[str, BlobRecord] = {}
    views: dict[str, tuple[memoryview, int]] = {}
    for sha in aligns:
        if sha not in data:
            raise UsageError(f"storage names blob {sha[:12]}…, which is not given")
    for sha in aligns:
        view = memoryview(data[sha]).cast("B")
        name, fast = blob_digests(view)
        if name != sha:
            raise UsageError(f"blob {sha[:12]}… does not hold the bytes its name says")
        blobs[sha] = BlobRecord(len(view), Where.INLINE, algo, fast)
        if len(view):
            views[sha] = (view, aligns[sha])
    manifest = Manifest(
        version=FORMAT_VERSION,
        writer=WRITER,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        env=env or {},
        info=info or {},
        blobs=blobs,
        calls=tuple(replace(c, index=i) for i, c in enumerate(calls)),
    )
    out = Path(path)
    write_whole(out, manifest_json(manifest), views)
    return out
