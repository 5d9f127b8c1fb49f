"""Writing bundles: snapshot a call (`capture_call`), write calls as one bundle (`save_calls`),
and fold a store bundle into one self-contained file (`pack`)."""

from __future__ import annotations

import ctypes
import filecmp
import json
import os
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import torch

from kdump._version import __version__
from kdump.bundle import argtree
from kdump.bundle.header_cache import HeaderCache
from kdump.bundle.spool import Spool, StoreSpool, cpu_view
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
from kdump.bundle.tensors import Captured, capture
from kdump.errors import BundleError, UsageError
from kdump.errors import BundleErrorKind as K
from kdump.format.records import (
    ALIGN_MOD,
    FORMAT_VERSION,
    MANIFEST_KEY,
    MAX_HEADER,
    STORE_DIRNAME,
    BlobRecord,
    CallEntry,
    Manifest,
    OutputsRecord,
    Source,
    StorageRecord,
    Where,
    manifest_json,
)

# The data section starts at a multiple of ALIGN_MOD and each large blob at an offset congruent to
# its storage's recorded address modulo ALIGN_MOD, so a page-aligned map of the file hands out
# views with the call's alignment; the gaps are covered by padding entries (safetensors allows no
# holes). Small blobs are copied on load anyway and are not padded.
DATA_ALIGN = ALIGN_MOD
ALIGNED_BLOB_MIN = 64 << 10
PAD_PREFIX = "kdump.pad."
Digests = tuple[str, str]  # (SHA-256 name, fast check digest or "")


@dataclass
class CallRecord:
    """One captured call, ready to be written."""

    target: str  # canonical entry-point id, "module:qualname"
    called_as: str  # the name it was called by
    args: list[Any]  # encoded argument trees (argtree.encode)
    kwargs: dict[str, Any]
    names: list[str] | None  # parameter name of each positional argument, when known
    inputs: Captured  # tensors of the tree, snapshot before the call
    outputs: Captured | None = None  # snapshots after the call
    inplace: list[tuple[int, int]] = field(default_factory=list)  # (input idx, output idx)
    returned: Any = None  # encoded tree of the return value (tensors refer to outputs)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.inputs.nbytes + (self.outputs.nbytes if self.outputs else 0)


def capture_call(
    target: str,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    called_as: str | None = None,
    names: Sequence[str] | None = None,
    meta: dict[str, Any] | None = None,
    sink: Spool | StoreSpool | None = None,
    encoded: tuple[list[Any], list[torch.Tensor]] | None = None,
    watch: Sequence[int] = (),
) -> CallRecord:
    """Snapshot a call's arguments (before the call runs). With `sink` (a `Spool` for the bundle
    `save_calls` will write), a large snapshot is written straight into that bundle's file.
    `encoded` is what `argtree.encode_all([*args, *kwargs.values()], tensors)` gave, where the
    caller has walked the arguments already. `watch`: the tensor-table indices of the tensors
    the call may write in place (`attach_outputs` will compare them; see `capture`)."""
    kwargs = kwargs or {}
    if encoded is None:
        tensors: list[torch.Tensor] = []
        # One node budget for all of a call's arguments: the reader checks them together.
        trees = argtree.encode_all([*args, *kwargs.values()], tensors)
    else:
        trees, tensors = encoded
    args_tree = trees[: len(args)]
    kwargs_tree = {str(k): v for k, v in zip(kwargs, trees[len(args) :])}
    return CallRecord(
        target=target,
        called_as=called_as or target,
        args=args_tree,
        kwargs=kwargs_tree,
        names=list(names) if names is not None else None,
        inputs=capture(tensors, sink=sink, watch=watch),
        meta=dict(meta or {}),
    )


def input_tensors(
    call: CallRecord, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The live tensors of a call in the order of its tensor table (same walk as capture_call)."""
    return argtree.tensors_in(*args, *kwargs.values())


def attach_outputs(
    call: CallRecord,
    live: Sequence[torch.Tensor],
    indices: Iterable[int],
    returned: Any = None,
    sink: Spool | StoreSpool | None = None,
) -> None:
    """Snapshot tensors `indices` of the call's tensor table after the call (in-place outputs),
    and tensors in the return value (into `sink`'s file when the inputs went there)."""
    idx = sorted(set(indices))
    extra: list[torch.Tensor] = [live[i] for i in idx]
    ret_tree = argtree.encode(returned, extra) if returned is not None else None
    try:
        call.outputs = capture(extra, unchanged_from=call.inputs, sink=sink)
    finally:
        call.inputs.device_copies.clear()  # device memory the comparison no longer needs
    call.inplace = [(i, k) for k, i in enumerate(idx)]
    call.returned = ret_tree


_blob_view = cpu_view  # zero-copy bytes of a contiguous CPU uint8 tensor


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
            key = (addresses[i] if addresses is not None else _address(v), len(v))
            dig = done.get(key)
            if dig is None:
                dig = done[key] = blob_digests(v)
            out.append(dig)
        fresh = iter(out)
    else:
        fresh = iter([f.result() for f in _submit_once([views[i] for i in todo])])
    return [k if k is not None else next(fresh) for k in known]


def _address(v: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(v)) if len(v) else 0


def _submit_once(views: Sequence[memoryview]) -> list[Future[Digests]]:
    """Hash jobs for `views` on the shared pool; views of the same bytes (a snapshot shared by an
    unchanged output and its input) share one job."""
    jobs: dict[tuple[int, int], Future[Digests]] = {}
    out = []
    for v in views:
        key = (_address(v), len(v))
        if key not in jobs:
            jobs[key] = submit_or_run(pool().submit, blob_digests, v)
        out.append(jobs[key])
    return out


def _aligned(pos: int, nbytes: int, align: int) -> int:
    """Where a blob of `nbytes` goes: the first offset at or after `pos` congruent to `align`
    modulo ALIGN_MOD (large blobs), or `pos`."""
    return pos + (align - pos) % ALIGN_MOD if nbytes >= ALIGNED_BLOB_MIN else pos


def _entries(
    calls: Sequence[CallRecord], shas: Sequence[str | tuple[tuple[str, int], ...]]
) -> tuple[CallEntry, ...]:
    """The manifest records of `calls`, their storages named by `shas` (in capture order): a
    blob's name, or the (name, size) of each piece of a storage written in pieces."""
    it = iter(shas)

    def one(st: StorageRecord) -> StorageRecord:
        name = next(it)
        pieces: tuple[tuple[str, int], ...] = ()
        if isinstance(name, tuple):
            blob, pieces, source = "", name, Source.PIECES
        else:
            blob, source = name, st.source
        # The constructor, not dataclasses.replace: this runs for every storage of every bundle.
        return StorageRecord(
            st.device,
            st.base_ptr,
            st.storage_nbytes,
            st.span_start,
            st.span_nbytes,
            blob,
            source,
            st.stats,
            pieces=pieces,
        )

    def named(cap: Captured) -> tuple[StorageRecord, ...]:
        return tuple(
            one(st)
            if st.source is Source.BLOB
            else replace(st, blob=next(it))
            if st.source is Source.SPARSE
            else st
            for st in cap.storages
        )

    out = []
    for i, call in enumerate(calls):
        storages = named(call.inputs)
        outputs = None
        if call.outputs is not None:
            outputs = OutputsRecord(
                storages=named(call.outputs),
                tensors=tuple(call.outputs.tensors),
                inplace=tuple(call.inplace),
                returned=call.returned,
            )
        out.append(
            CallEntry(
                index=i,
                target=call.target,
                called_as=call.called_as,
                names=tuple(call.names) if call.names is not None else None,
                args=call.args,
                kwargs=call.kwargs,
                storages=storages,
                tensors=tuple(call.inputs.tensors),
                outputs=outputs,
                meta=_bounded(call.meta),
            )
        )
    return tuple(out)


def _bounded(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with strings cut to the reader's string limit (an exception text may be huge)."""
    limit = argtree.LIMITS.max_string
    try:  # no string is longer than the whole JSON text: nothing to cut (the common case)
        if len(json.dumps(meta)) <= limit:
            return meta
    except (TypeError, ValueError):
        pass

    def cut(v: Any) -> Any:
        if isinstance(v, str) and len(v) > limit:
            return v[: limit - 40] + f"…[{len(v) - limit + 40} more characters]"
        if isinstance(v, dict):
            return {cut(k): cut(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [cut(x) for x in v]
        return v

    return cut(meta)


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
    # One pass over the storages that hold bytes (other kinds hold none; a sparse one holds its
    # ranges, concatenated): this runs for every bundle a recorder writes. A blob storage larger
    # than the piece size becomes one view per piece (each its own blob), and `counts` says how
    # many views each storage has.
    held: list[tuple[StorageRecord, torch.Tensor, Digests | None]] = []
    views: list[memoryview] = []
    aligns: list[int] = []
    known: list[Digests | None] = []
    sizes: list[int] = []
    wheres: list[Where] = []
    addresses: list[int] = []  # where each view's bytes start
    counts: list[int] = []
    seen: dict[int, tuple[memoryview, int]] = {}  # by snapshot (an unchanged output shares one)
    blob, sparse, to_store, to_inline = Source.BLOB, Source.SPARSE, Where.STORE, Where.INLINE
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
                got = seen.get(id(d))  # `held` keeps d alive: its id is its own
                if got is None:
                    view = _blob_view(d)
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
                    counts.append(len(cuts))
                    for (lo, hi), part in zip(cuts, parts):
                        held.append((st, d[lo:hi], part))
                        views.append(view[lo:hi])
                        aligns.append((align + lo) % ALIGN_MOD)
                        known.append(part)
                        sizes.append(hi - lo)
                        wheres.append(
                            to_store if store is not None and hi - lo >= inline_below else to_inline
                        )
                        addresses.append(got[1] + lo)
                    continue
                if isinstance(dig, Pieces):
                    dig = None
                counts.append(1)
                held.append((st, d, dig))
                views.append(view)
                aligns.append(align)
                known.append(dig)
                sizes.append(n)
                wheres.append(to_store if store is not None and n >= inline_below else to_inline)
                addresses.append(got[1])
    created = _utc_now()
    make_manifest = _manifest_maker(calls, sizes, wheres, env, info, created=created, counts=counts)
    if isinstance(spool, Spool) and spool.active:
        if store is None:
            done = _finish_spool(spool, path, held, aligns, known, make_manifest)
            if progress is not None:  # its bytes went to the file as they were captured
                progress(sum(len(v) for v in views))
            return done
        spool.abort()  # the blobs go to the store: its file was only the snapshot's memory
    small = sum(len(v) for v in views) < INLINE_HASH_MAX
    if store is None and not small and not all(known):
        # Hashed and written in one pass, each piece by a pool worker, into a new spool.
        sink = open_spool(path)
        sink.reserve(8 + _header_bound(views, make_manifest))
        done = _finish_spool(sink, path, held, aligns, known, make_manifest)
        if progress is not None:
            progress(sum(len(v) for v in views))
        return done
    digests = _hash_all(views, known, addresses)
    inline: dict[str, tuple[memoryview, int]] = {}
    stored: dict[str, memoryview] = {}
    for (sha, _), view, align, where in zip(digests, views, aligns, wheres):
        if where is Where.STORE:
            stored.setdefault(sha, view)
        else:
            inline.setdefault(sha, (view, align))
    if store is not None:
        for sha, view in stored.items():
            store.put(sha, view)
            if progress is not None:
                progress(len(view))
    if headers is not None and _small(inline):
        raw = headers.header(
            calls, digests, wheres, inline, env or {}, info or {}, created, make_manifest
        )
        if raw is not None:
            if headed is not None:
                headed(raw, digests)
            parts = [struct.pack("<Q", len(raw)), raw, *(v for v, _ in inline.values())]
            data = b"".join(parts)
            atomic_write(path, data)
            if progress is not None:
                progress(sum(len(v) for v, _ in inline.values()))
            if sized is not None:
                sized(len(data))
            return path
    nbytes = _write_safetensors(path, make_manifest(digests), inline, progress)
    if sized is not None:
        sized(nbytes)
    return path


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


def _manifest_maker(
    calls: Sequence[CallRecord],
    sizes: Sequence[int],
    wheres: Sequence[Where],
    env: dict[str, Any] | None,
    info: dict[str, Any] | None,
    created: str | None = None,
    counts: Sequence[int] | None = None,
) -> Callable[[Sequence[Digests]], dict[str, Any]]:
    """The manifest of `calls` given the digests of their blobs (in capture order; `counts`:
    how many blobs each storage that holds bytes has, where one was written in pieces)."""
    created = created if created is not None else _utc_now()
    algo = fast_checksum()
    pieced = counts is not None and any(k > 1 for k in counts)

    def names(digests: Sequence[Digests]) -> list[str | tuple[tuple[str, int], ...]]:
        if not pieced:
            return [sha for sha, _ in digests]
        assert counts is not None
        out: list[str | tuple[tuple[str, int], ...]] = []
        pos = 0
        for k in counts:
            if k == 1:
                out.append(digests[pos][0])
            else:
                out.append(tuple((digests[j][0], sizes[j]) for j in range(pos, pos + k)))
            pos += k
        return out

    def make_manifest(digests: Sequence[Digests]) -> dict[str, Any]:
        blobs: dict[str, BlobRecord] = {}
        for (sha, fast), n, where in zip(digests, sizes, wheres):
            blobs.setdefault(sha, BlobRecord(n, where, algo, fast))
        return manifest_json(
            Manifest(
                version=FORMAT_VERSION,
                writer=f"kdump {__version__}",
                created=created,
                env=env or {},
                info=info or {},
                blobs=blobs,
                calls=_entries(calls, names(digests)),
            )
        )

    return make_manifest


def _header_bound(
    views: Sequence[memoryview], make_manifest: Callable[[Sequence[Digests]], dict[str, Any]]
) -> int:
    """An upper bound of the padded header of a bundle of `views` (every blob unique and fully
    padded: de-duplication only shortens it), so its space is reserved before the blobs are
    hashed."""
    placeholder = [(f"{i:064x}", "0" * 32) for i in range(len(views))]
    upper: dict[str, tuple[int, int]] = {}
    pads = []
    off = 0
    for (name, _), view in zip(placeholder, views):
        pads.append((off, off + ALIGN_MOD - 1))
        off += ALIGN_MOD - 1
        upper[name] = (off, off + len(view))
        off += len(view)
    raw = _header_json(make_manifest(placeholder), upper, pads)
    return _padded_size(len(raw), map(len, views))


def _finish_spool(
    spool: Spool,
    path: Path,
    held: Sequence[tuple[StorageRecord, torch.Tensor, Digests | None]],
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
            put = spool.put([held[i][1] for i in missing], [aligns[i] for i in missing], records)
            for i, (_, dig) in zip(missing, put):
                assert isinstance(dig, tuple)  # each is one piece at most
                digests[i] = dig
        final = [d for d in digests if d is not None]
        layout, pads, _ = spool.layout({sha for sha, _ in final})
        raw = _header_json(make_manifest(final), layout, pads)
    except BaseException:
        spool.abort()  # nothing of a bundle that could not be completed stays behind
        raise
    return spool.finish(raw)


def pack(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    progress: Progress | None = None,
    force: bool = False,
) -> Path:
    """Rewrite a bundle (whose blobs may live in a shared store) as one self-contained file;
    `progress` is told the blob bytes written (`packed_bytes` of the bundle in all). A file
    already at `dst` is replaced only with `force` or when it holds the same bytes (UsageError
    otherwise, and it stays as it was)."""
    from kdump.bundle.reader import load_bundle

    bundle = load_bundle(src)
    bundle.verify()
    m = bundle.manifest
    inline = {sha: replace(b, where=Where.INLINE) for sha, b in m.blobs.items()}
    aligns: dict[str, int] = {}
    for c in m.calls:
        for st in (*c.storages, *(c.outputs.storages if c.outputs else ())):
            for sha, begin, _ in st.piece_spans():  # pieces lie back to back, as written
                aligns.setdefault(sha, (st.alignment + begin) % ALIGN_MOD)
    views = {
        sha: (bundle.blob_bytes(sha), aligns.get(sha, 0)) for sha, b in m.blobs.items() if b.nbytes
    }
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    manifest = manifest_json(replace(m, blobs=inline))
    if force or not os.path.lexists(out):
        _write_safetensors(out, manifest, views, progress)
        return out
    # Something is there already: written beside it first, kept only when it is the same.
    if not out.is_file():
        raise UsageError(f"{out} exists and is not a file; pass another -o")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.pack-tmp")
    try:
        _write_safetensors(tmp, manifest, views, progress)
        if not filecmp.cmp(tmp, out, shallow=False):
            raise UsageError(
                f"{out} exists and holds something else; pass --force to overwrite it, or "
                "another -o"
            )
    finally:
        tmp.unlink(missing_ok=True)
    return out


def packed_bytes(src: str | os.PathLike[str]) -> int:
    """The blob bytes `pack` writes for bundle `src` (its header is read, no blob)."""
    from kdump.bundle.reader import load_bundle

    with load_bundle(src) as bundle:
        return sum(b.nbytes for b in bundle.manifest.blobs.values())


PACKED_SUFFIX = ".packed"


def capture_root(bundle: str | os.PathLike[str]) -> Path | None:
    """The capture directory (the folder holding the shared blob store) a bundle belongs to,
    looked for where the reader looks for its store; None for a bundle outside one."""
    from kdump.bundle.reader import STORE_SEARCH_DEPTH

    here = Path(bundle).resolve().parent
    for cand in [here, *list(here.parents)[:STORE_SEARCH_DEPTH]]:
        if (cand / STORE_DIRNAME).is_dir():
            return cand
    return None


def _lexical(path: str | os.PathLike[str]) -> Path:
    """An absolute path as given: `..` folded, symlinks not followed (a link packs beside the
    link, not beside what it points to)."""
    return Path(os.path.abspath(path))


def _lexical_capture_root(bundle: Path) -> Path | None:
    """capture_root, looked for along the path as given."""
    from kdump.bundle.reader import STORE_SEARCH_DEPTH

    here = bundle.parent
    for cand in [here, *list(here.parents)[:STORE_SEARCH_DEPTH]]:
        if (cand / STORE_DIRNAME).is_dir():
            return cand
    return None


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path` is inside `folder`, as given or with symlinks followed on either side."""
    real_path, real_folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return any(p.is_relative_to(f) for p in (path, real_path) for f in (folder, real_folder))


def pack_destination(
    src: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    base: str | os.PathLike[str] | None = None,
) -> Path:
    """Where `kdump pack` writes the packed copy of bundle `src` (found under folder `base`, if
    one was given): never inside the capture directory or `base`, so a later replay of that
    folder does not replay the copy as well. Paths count as given: a symlinked bundle packs
    beside the link, under its name (and its target's capture directory is kept clear too).

    Default: `<root>.packed/<path of src under root>` beside `root`, the outer of `base` and the
    capture directory, else the bundle's own folder. An `output` that is an existing folder
    receives the bundle under its name (its path under `base` when packing a folder); any other
    `output` is the file to write."""
    src_p = _lexical(src)
    base_p = _lexical(base) if base is not None else None
    capture = _lexical_capture_root(src_p)
    # Both hold src, so one holds the other: the outer one is the folder a replay would read.
    folders = [f for f in (capture, base_p) if f is not None]
    root = min(folders, key=lambda f: len(f.parts)) if folders else src_p.parent
    if output is None:
        if not root.name:  # the file system's root has no folder beside it
            raise UsageError(f"{src}: no default place beside {root} for the packed copy; pass -o")
        dst = root.with_name(root.name + PACKED_SUFFIX) / src_p.relative_to(root)
    elif Path(output).is_dir():
        inner = src_p.relative_to(base_p) if base_p is not None else Path(src_p.name)
        dst = _lexical(output) / inner
    else:
        dst = _lexical(output)
    if dst == src_p or os.path.realpath(dst) == os.path.realpath(src_p):
        raise UsageError(f"{src}: the packed copy would overwrite the bundle; pass another -o")
    real_capture = capture_root(src_p)  # where the bundle's store really is
    for folder in {*folders, *([real_capture] if real_capture is not None else [])}:
        if _inside(dst, folder):
            raise UsageError(
                f"{dst} is inside {folder}, which a replay would read twice; pass -o outside it"
            )
    return dst


def _header_json(
    manifest: dict[str, Any], layout: dict[str, tuple[int, int]], pads: Sequence[tuple[int, int]]
) -> bytes:
    """The safetensors header: one U8 entry per inline blob and padding span, and the manifest
    as a JSON string in `__metadata__`. Entry names are hex digests and `kdump.pad.<i>` (nothing
    to escape), so the entries are formatted directly and only the manifest goes through json."""
    entries = [*layout.items(), *((f"{PAD_PREFIX}{i}", span) for i, span in enumerate(pads))]
    parts = [
        f'"{name}":{{"dtype":"U8","shape":[{e - b}],"data_offsets":[{b},{e}]}}'
        for name, (b, e) in entries
    ]
    text = json.dumps(json.dumps(manifest, separators=(",", ":")))
    parts.append(f'"__metadata__":{{{json.dumps(MANIFEST_KEY)}:{text}}}')
    return ("{" + ",".join(parts) + "}").encode()


def _padded_size(raw_len: int, sizes: Iterable[int]) -> int:
    """Header length with its space padding: the data section starts at a multiple of DATA_ALIGN
    when a blob is to be aligned (else of 8, so small bundles stay small)."""
    unit = DATA_ALIGN if any(n >= ALIGNED_BLOB_MIN for n in sizes) else 8
    return raw_len + (-(8 + raw_len)) % unit


Progress = Callable[[int], None]  # told the bytes of blob data written, as they are
PROGRESS_CHUNK = 64 << 20  # a blob is written in pieces of this size when progress is reported


def _write_view(f: BinaryIO, view: memoryview, progress: Progress | None) -> None:
    if progress is None:
        f.write(view)
        return
    for at in range(0, len(view), PROGRESS_CHUNK):
        piece = view[at : at + PROGRESS_CHUNK]
        f.write(piece)
        progress(len(piece))


def _write_safetensors(
    path: Path,
    manifest: dict[str, Any],
    blobs: dict[str, tuple[memoryview, int]],
    progress: Progress | None = None,
) -> int:
    """Write a bundle whose blobs (sha → (bytes, recorded alignment)) are all known; the size
    of its file."""
    raw, layout, offset = _header_for(manifest, blobs)

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


def _header_for(
    manifest: dict[str, Any], blobs: dict[str, tuple[memoryview, int]]
) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """(padded header, data offsets of the blobs, data section length) of a bundle."""
    layout: dict[str, tuple[int, int]] = {}
    pads: list[tuple[int, int]] = []
    offset = 0
    for sha, (view, align) in blobs.items():
        start = _aligned(offset, len(view), align)
        if start > offset:
            pads.append((offset, start))
        layout[sha] = (start, start + len(view))
        offset = start + len(view)
    raw = _header_json(manifest, layout, pads)
    raw += b" " * (_padded_size(len(raw), (len(v) for v, _ in blobs.values())) - len(raw))
    if len(raw) > MAX_HEADER:
        raise BundleError(
            f"bundle manifest is {len(raw)} bytes, over the {MAX_HEADER}-byte header limit: "
            "write fewer calls per bundle",
            K.LIMIT,
        )
    return raw, layout, offset


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
    aligns: dict[str, int] = {}
    for c in calls:
        for st in (*c.storages, *(c.outputs.storages if c.outputs else ())):
            for sha, begin, _ in st.piece_spans():
                if sha not in data:
                    raise UsageError(f"storage names blob {sha[:12]}…, which is not given")
                aligns.setdefault(sha, (st.alignment + begin) % ALIGN_MOD)
    blobs: dict[str, BlobRecord] = {}
    views: dict[str, tuple[memoryview, int]] = {}
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
        writer=f"kdump {__version__}",
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        env=env or {},
        info=info or {},
        blobs=blobs,
        calls=tuple(replace(c, index=i) for i, c in enumerate(calls)),
    )
    out = Path(path)
    _write_safetensors(out, manifest_json(manifest), views)
    return out
