"""Reading bundles: `load_bundle` parses and validates the manifest once (torch-free) and keeps
the typed records; tensors are built, and torch imported, only when a call is materialised."""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from kdump.bundle.store import BlobStore, can_check, hasher, pool, submit_or_run
from kdump.errors import BundleError
from kdump.errors import BundleErrorKind as K
from kdump.format import argtree
from kdump.format.parse import parse_header, parse_manifest, read_header
from kdump.format.records import (
    ALIGN_MOD,
    HELD_SOURCES,
    STORE_DIRNAME,
    BlobRecord,
    CallEntry,
    Checksum,
    Limits,
    Manifest,
    Source,
    StorageRecord,
    TensorRecord,
    Where,
)
from kdump.format.validate import check_load, default_limits, validate_manifest

if TYPE_CHECKING:
    import torch

    from kdump.bundle.materialize import Materialized, Placement

STORE_SEARCH_DEPTH = 3  # a bundle looks for the shared store in its folder and this many parents
# A recording process's folder holds an index (a capture root of its own); version 1 of the
# capture-folder layout wrote index.json, later versions an append-only index.jsonl.
INDEX_NAMES = ("index.jsonl", "index.json")
_COPY_CHUNK = 1 << 20  # copy-and-hash granularity: small enough to stay in cache
_PARALLEL_MIN = 8 << 20  # below this many bytes, one thread is faster than the pool


@dataclass
class MaterializedCall:
    """A call's arguments re-created on one device, with the allocations behind them."""

    args: list[Any]
    kwargs: dict[str, Any]
    tensors: list[torch.Tensor]
    tensor_names: list[str]
    materialized: Materialized

    def call(self, fn: Callable[..., Any]) -> Any:
        return fn(*self.args, **self.kwargs)


class Call:
    """One recorded call in a loaded bundle. Tensors materialise lazily."""

    def __init__(self, bundle: Bundle, entry: CallEntry) -> None:
        self._bundle = bundle
        self.entry = entry
        self.index = entry.index
        self.target = entry.target
        self.called_as = entry.called_as
        self.names: list[str] | None = list(entry.names) if entry.names is not None else None
        self.meta = entry.meta
        self.launch = entry.launch  # a JIT kernel's launch record (format version 6), or None
        self.storages: list[StorageRecord] = list(entry.storages)
        self.tensors: list[TensorRecord] = list(entry.tensors)
        out = entry.outputs
        self.output_storages: list[StorageRecord] = list(out.storages) if out else []
        self.output_tensors: list[TensorRecord] = list(out.tensors) if out else []
        self.inplace: list[tuple[int, int]] = list(out.inplace) if out else []

    def __repr__(self) -> str:
        return f"<kdump.Call {self.index} {self.target} ({len(self.tensors)} tensors)>"

    @property
    def encoded_args(self) -> list[Any]:
        return self.entry.args

    @property
    def encoded_kwargs(self) -> dict[str, Any]:
        return self.entry.kwargs

    @property
    def tensor_names(self) -> list[str]:
        names = argtree.tensor_paths(self.names, self.encoded_args, self.encoded_kwargs)
        return names + [f"tensor{i}" for i in range(len(names), len(self.tensors))]

    @property
    def has_outputs(self) -> bool:
        return self.entry.outputs is not None

    @property
    def synthesized(self) -> list[str]:
        """Names of the input tensors whose bytes the bundle lacks (by-reference / missing
        storages): materialising re-creates them from their stats, so results that depend on
        them are not the recorded ones."""
        names = self.tensor_names
        return [
            names[i]
            for i, t in enumerate(self.tensors)
            if self.storages[t.storage].source not in HELD_SOURCES
        ]

    def materialize(
        self, device: torch.device | str = "cpu", placement: Placement | None = None
    ) -> MaterializedCall:
        """A fresh copy of the call's arguments on `device` (exact layout)."""
        mat = self._bundle.materialize_records(self.storages, self.tensors, device, placement)
        args = [argtree.decode(a, mat.tensors.__getitem__) for a in self.encoded_args]
        kwargs = {
            k: argtree.decode(v, mat.tensors.__getitem__) for k, v in self.encoded_kwargs.items()
        }
        return MaterializedCall(args, kwargs, mat.tensors, self.tensor_names, mat)

    def _cpu_call(self) -> MaterializedCall:
        """The call's CPU materialisation behind `args` and `kwargs` (one, so that they alias as
        recorded): the bundle keeps only the last call's, so iterating over many calls holds
        one call's tensors at a time (plus those the caller keeps)."""
        return self._bundle.cpu_call(self)

    @property
    def args(self) -> list[Any]:
        return self._cpu_call().args

    @property
    def kwargs(self) -> dict[str, Any]:
        return self._cpu_call().kwargs

    def materialize_outputs(self, device: torch.device | str = "cpu") -> dict[int, torch.Tensor]:
        """Recorded post-call values, keyed by the input tensor index they belong to."""
        if not self.has_outputs:
            return {}
        mat = self._bundle.materialize_records(self.output_storages, self.output_tensors, device)
        return {inp: mat.tensors[out] for inp, out in self.inplace}

    @property
    def has_returned(self) -> bool:
        """True when the call returned something (not None) and the bundle recorded it."""
        return self.entry.outputs is not None and self.entry.outputs.returned is not None

    def materialize_returned(self, device: torch.device | str = "cpu") -> Any:
        """The recorded return value (its tensors materialised on `device`); None when the call
        returned None or the bundle did not record it (see `has_returned`)."""
        if not self.has_returned:
            return None
        mat = self._bundle.materialize_records(self.output_storages, self.output_tensors, device)
        return argtree.decode(self.entry.outputs.returned, mat.tensors.__getitem__)

    @property
    def outputs(self) -> dict[str, torch.Tensor] | None:
        """Recorded outputs by argument path ('d', 'args[2]'), or None when not recorded."""
        if not self.has_outputs:
            return None
        names = self.tensor_names
        return {names[i]: t for i, t in self.materialize_outputs("cpu").items()}

    @property
    def nbytes(self) -> int:
        return sum(s.span_nbytes for s in self.storages + self.output_storages)


def logical_bytes(tensors: Sequence[TensorRecord]) -> int:
    """The bytes `tensors` cover as dense tensors (elements times size): what a replay may
    allocate when it copies, compares or computes a reference of them. A broadcast (stride 0)
    view covers far more than its storage span: a small file can name 2**48 elements."""
    return sum(t.numel * t.itemsize for t in tensors)


def check_logical(tensors: Sequence[TensorRecord], limits: Limits, what: str) -> None:
    """Raise BundleError (LIMIT) when the tensors' dense sizes add up to over the load limit,
    before anything is allocated for them."""
    need = logical_bytes(tensors)
    if need > limits.max_load_bytes:
        raise BundleError(
            f"{what}: as dense tensors they cover {need} bytes (a view repeating its elements "
            f"over a larger shape?), over the load limit of {limits.max_load_bytes}; raise it "
            "with --max-load-bytes or KDUMP_MAX_LOAD_BYTES if the bundle is trusted",
            K.LIMIT,
        )


def open_regular(path: Path, what: str = "bundle") -> BinaryIO:
    """Open a regular file for reading; anything else (a FIFO, a device, a directory) is a
    BundleError. O_NONBLOCK keeps the open itself from waiting on a FIFO's writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BundleError(f"{path}: no such file", K.NOT_FOUND)
    except OSError as exc:
        raise BundleError(f"{path}: cannot open the {what} ({exc.strerror})", K.NOT_FOUND)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise BundleError(f"{path} is a directory; give a .kdump file", K.NOT_FOUND)
        if not stat.S_ISREG(mode):
            raise BundleError(
                f"{path}: the {what} is not a regular file (a FIFO or device?); give a file",
                K.NOT_FOUND,
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class Bundle:
    """A loaded .kdump file. Use `load_bundle`."""

    def __init__(self, path: Path, limits: Limits | None = None, verify: bool = True) -> None:
        self.path = path
        self.limits = limits or default_limits()
        self.verifies = verify  # False: blobs are used unchecked (callers say so loudly)
        self._file: BinaryIO | None = None
        self._map: mmap.mmap | None = None
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        self._file = open_regular(path)
        try:
            self._load(path)
        except BaseException:
            self.close()
            raise

    def _load(self, path: Path) -> None:
        assert self._file is not None
        size = os.fstat(self._file.fileno()).st_size
        self.file_size = size
        header, self.data_start = read_header(self._file, size, path)
        if len(header) != self.data_start - 8:
            raise BundleError(f"{path}: file shrank while it was read", K.TRUNCATED)
        raw, self.inline = parse_header(header, size - self.data_start, path, self.limits)
        self.manifest: Manifest = parse_manifest(raw, path, self.limits)
        validate_manifest(self.manifest, self.inline, path, self.limits)
        for c in self.manifest.calls:  # a replay may copy them densely: bounded before it does
            out = c.outputs.tensors if c.outputs is not None else ()
            check_logical([*c.tensors, *out], self.limits, f"{path}: call {c.index}'s tensors")
        self.env: dict[str, Any] = self.manifest.env
        self.info: dict[str, Any] = self.manifest.info
        self.version: int = self.manifest.version
        self.blobs: dict[str, BlobRecord] = self.manifest.blobs
        self.calls = [Call(self, c) for c in self.manifest.calls]
        self._store_root: Path | None = None
        # The last call whose `args` / `kwargs` were asked for, with its CPU tensors (one entry:
        # a cache per call kept every call's tensors alive).
        self._last_cpu: tuple[Call, MaterializedCall] | None = None

    def cpu_call(self, call: Call) -> MaterializedCall:
        """`call` materialised on the CPU, shared by its `args` and `kwargs`; asking for
        another call's releases this one (unless the caller holds its tensors)."""
        last = self._last_cpu
        if last is not None and last[0] is call:
            return last[1]
        self._last_cpu = None  # released before the next call's tensors are allocated
        made = call.materialize("cpu")
        self._last_cpu = (call, made)
        return made

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        # The mmap stays open while tensors built from it may live; copies are made on read.
        if self._file is not None:
            self._file.close()
            self._file = None

    def __repr__(self) -> str:
        return f"<kdump.Bundle {self.path} v{self.version} calls={len(self.calls)}>"

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blobs.values())

    def _mapped(self) -> mmap.mmap:
        with self._lock:  # blobs are read from several threads
            if self._map is None:
                if self._file is None:
                    self._file = open_regular(self.path)
                # Copy-on-write: tensors built over it can never write into the file.
                self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
            return self._map

    def _store_path(self, sha: str) -> Path:
        if self._store_root is None:
            here = self.path.resolve().parent
            for cand in [here, *list(here.parents)[:STORE_SEARCH_DEPTH]]:
                if (cand / STORE_DIRNAME).is_dir():
                    self._store_root = cand
                    break
            else:
                raise BundleError(
                    f"{self.path}: its blobs live in a capture directory's '{STORE_DIRNAME}/' "
                    "store, which was not found next to it; copy the whole capture directory or "
                    "run `kdump pack` where it is complete",
                    K.MISSING_BLOB,
                )
        return BlobStore(self._store_root).path(sha)

    def blob_bytes(self, sha: str) -> memoryview:
        """Raw bytes of a blob (not verified)."""
        info = self.blobs.get(sha)
        if info is None:
            raise BundleError(
                f"{self.path}: manifest refers to blob {sha[:12]}…, which it lacks", K.MISSING_BLOB
            )
        if info.nbytes == 0:
            return memoryview(b"")
        if info.where is Where.INLINE:
            begin, end = self.inline[sha]
            return memoryview(self._mapped())[self.data_start + begin : self.data_start + end]
        with self._open_store_blob(sha, info) as f:
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))

    def _open_store_blob(self, sha: str, info: BlobRecord) -> Any:
        p = self._store_path(sha)
        try:
            f = open_regular(p, "store blob")
        except BundleError as exc:
            if p.exists() or p.is_symlink():
                raise BundleError(str(exc), K.MISSING_BLOB) from None
            raise BundleError(
                f"{self.path}: blob {sha[:12]}… is missing from the store {p.parent.parent}; "
                "copy the whole capture directory or re-pack the bundle",
                K.MISSING_BLOB,
            ) from None
        if os.fstat(f.fileno()).st_size != info.nbytes:
            f.close()
            raise BundleError(
                f"{p}: store blob has the wrong size (expected {info.nbytes})", K.CHECKSUM
            )
        return f

    @property
    def verified(self) -> frozenset[str]:
        """Blobs checked in this process, to pass on to a replay child (`trust`)."""
        with self._lock:
            return frozenset(self._verified)

    def trust(self, shas: Iterable[str]) -> None:
        """Treat blobs as verified: a parent process checked them in this same file."""
        with self._lock:
            self._verified.update(shas)

    def _needs_check(self, sha: str) -> bool:
        return self.verifies and sha not in self._verified

    def _hasher(self, sha: str) -> tuple[Any, str]:
        """A hasher for blob `sha` and the digest it must give: the fast check recorded beside
        the name where this kdump can compute it, else the SHA-256 name itself."""
        info = self.blobs.get(sha)
        if info is not None and info.checksum is not Checksum.SHA256 and can_check(info.checksum):
            return hasher(info.checksum), info.digest
        return hasher(Checksum.SHA256), sha

    def verify_blob(self, sha: str, view: memoryview | None = None) -> None:
        if not self._needs_check(sha):
            return
        h, want = self._hasher(sha)
        h.update(view if view is not None else self.blob_bytes(sha))
        self._accept(sha, h.hexdigest(), want)

    def _accept(self, sha: str, got: str, want: str) -> None:
        """Remember a blob whose check matched; a mismatch means a corrupt bundle."""
        if got != want:
            raise BundleError(
                f"{self.path}: checksum mismatch in blob {sha[:12]}… (got {got[:12]}…): the "
                "bundle is corrupt; record it again or restore the file",
                K.CHECKSUM,
            )
        with self._lock:
            self._verified.add(sha)

    def read_blob(self, sha: str) -> torch.Tensor:
        """A blob as a CPU uint8 tensor (verified on first read; a copy-on-write view)."""
        import torch

        view = self.blob_bytes(sha)
        self.verify_blob(sha, view)
        if len(view) == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(view, dtype=torch.uint8)

    def private_view(self, sha: str) -> torch.Tensor | None:
        """A blob as a CPU uint8 tensor over its own copy-on-write map of the file (not yet
        verified): writes stay private to this view, so two views of one blob never alias and
        nothing reaches the file. None for an empty blob."""
        import torch

        info = self.blobs.get(sha)
        if info is None or info.nbytes == 0:
            return None
        if info.where is Where.INLINE:
            file, start = None, self.data_start + self.inline[sha][0]
        else:
            file, start = self._open_store_blob(sha, info), 0
        try:
            if file is None and self._file is None:
                self._file = open(self.path, "rb")  # noqa: SIM115
            fd = (file or self._file).fileno()
            lead = start % mmap.ALLOCATIONGRANULARITY
            m = mmap.mmap(fd, lead + info.nbytes, access=mmap.ACCESS_COPY, offset=start - lead)
        except (OSError, ValueError) as exc:
            raise BundleError(f"{self.path}: cannot map blob {sha[:12]}… ({exc})", K.TRUNCATED)
        finally:
            if file is not None:
                file.close()
        return torch.frombuffer(memoryview(m)[lead:], dtype=torch.uint8)

    def _mappable(self, st: StorageRecord) -> bool:
        """Whether a page-aligned map puts `st`'s bytes at its recorded address alignment, in one
        run of the file (a pieced storage: its pieces inline, back to back, in order)."""
        return self._file_run(st) is not None

    def _file_run(self, st: StorageRecord) -> tuple[str, int] | None:
        """(the first blob, its data-section offset) of a blob or pieced storage whose bytes lie
        in one run of one file at the recorded alignment; None otherwise."""
        if st.source is Source.BLOB:
            info = self.blobs.get(st.blob)
            if info is None or info.nbytes == 0:
                return None
            start = self.data_start + self.inline[st.blob][0] if info.where is Where.INLINE else 0
            return (st.blob, start) if start % ALIGN_MOD == st.alignment else None
        if st.source is not Source.PIECES:
            return None
        first = None
        end = -1
        for sha, _ in st.pieces:
            info = self.blobs.get(sha)
            if info is None or info.where is not Where.INLINE:
                return None
            b, e = self.inline[sha]
            if first is None:
                first = b
            elif b != end:
                return None
            end = e
        assert first is not None  # the parser requires two pieces or more
        start = self.data_start + first
        return (st.pieces[0][0], start) if start % ALIGN_MOD == st.alignment else None

    def _private_run(self, st: StorageRecord) -> torch.Tensor | None:
        """A pieced storage's span as one private copy-on-write map of its run of the file."""
        import torch

        run = self._file_run(st)
        if run is None:
            return None
        start = run[1]
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115
        lead = start % mmap.ALLOCATIONGRANULARITY
        try:
            m = mmap.mmap(
                self._file.fileno(),
                lead + st.span_nbytes,
                access=mmap.ACCESS_COPY,
                offset=start - lead,
            )
        except (OSError, ValueError) as exc:
            raise BundleError(f"{self.path}: cannot map a pieced storage ({exc})", K.TRUNCATED)
        return torch.frombuffer(memoryview(m)[lead:], dtype=torch.uint8)

    def verify_tensor(self, sha: str, data: torch.Tensor) -> None:
        """Check the bytes handed out for blob `sha` (a contiguous CPU uint8 tensor)."""
        if not self._needs_check(sha):
            return
        n = data.numel()
        h, want = self._hasher(sha)
        if n:
            h.update((ctypes.c_char * n).from_address(data.data_ptr()))
        self._accept(sha, h.hexdigest(), want)

    def copy_blob_into(self, sha: str, dest: torch.Tensor) -> None:
        """Copy a blob into `dest` (contiguous CPU uint8), verifying it in the same pass (each
        chunk is hashed right after it was copied, while it is still in cache)."""
        view = self.blob_bytes(sha)
        n = len(view)
        if dest.numel() != n:
            raise BundleError(
                f"{self.path}: blob {sha[:12]}… holds {n} bytes, the manifest says {dest.numel()}",
                K.SCHEMA,
            )
        if n == 0:
            self.verify_blob(sha, view)
            return
        src = ctypes.addressof(ctypes.c_char.from_buffer(view))
        dst = dest.data_ptr()
        h, want = self._hasher(sha) if self._needs_check(sha) else (None, "")
        for off in range(0, n, _COPY_CHUNK):
            k = min(_COPY_CHUNK, n - off)
            ctypes.memmove(dst + off, src + off, k)  # releases the GIL, like the hashers below
            if h is not None:
                h.update((ctypes.c_char * k).from_address(dst + off))
        if h is not None:
            self._accept(sha, h.hexdigest(), want)

    def _run(self, fn: Callable[..., None], jobs: Sequence[tuple[Any, ...]], nbytes: int) -> None:
        """Run `fn(*job)` for every job, on the shared pool when there is enough to share."""
        if len(jobs) <= 1 or nbytes < _PARALLEL_MIN:
            for job in jobs:
                fn(*job)
            return
        for fut in [submit_or_run(pool().submit, fn, *job) for job in jobs]:
            fut.result()

    def materialize_records(
        self,
        storages: Sequence[StorageRecord],
        tensors: Sequence[TensorRecord],
        device: torch.device | str = "cpu",
        placement: Placement | None = None,
    ) -> Materialized:
        """Re-create tensor records from this bundle's blobs (verified), blobs in parallel.
        What it will allocate is checked against the load limit first. On CPU, storages the
        placement lets start at their blob (no halo, no flush end, nothing before the span) are
        copy-on-write views of the file; the rest are copies."""
        import torch

        from kdump.bundle.materialize import Placement, materialize, synthesize_span

        place = placement or Placement()
        check_load(
            storages,
            self.limits,
            f"{self.path}: materialising {len(storages)} storages",
            halo=place.halo,
            keep_prefix=place.halo == 0 and not place.flush_end,
        )
        check_logical(tensors, self.limits, f"{self.path}: materialising {len(tensors)} tensors")

        def fill(batch: Sequence[tuple[int, torch.Tensor]]) -> None:
            jobs = []
            for i, dest in batch:
                st = storages[i]
                if st.source is Source.BLOB:
                    jobs.append((st.blob, dest))
                elif st.source is Source.PIECES:  # each piece copied (and checked) apart
                    jobs.extend((sha, dest[b:e]) for sha, b, e in st.piece_spans())
                elif st.source in (Source.BY_REFERENCE, Source.MISSING):
                    synthesize_span(st, i, out=dest)  # in place: no second copy of the span
                else:
                    dest.copy_(self.recreate_span(st, i))
            self._run(self.copy_blob_into, jobs, sum(d.numel() for _, d in jobs))

        handed: list[tuple[str, torch.Tensor]] = []

        def view_span(i: int) -> torch.Tensor | None:
            st = storages[i]
            if st.source is Source.PIECES:
                view = self._private_run(st)
                if view is not None:
                    handed.extend((sha, view[b:e]) for sha, b, e in st.piece_spans())
                return view
            if st.source is not Source.BLOB or not self._mappable(st):
                return None
            view = self.private_view(st.blob)
            if view is not None:
                handed.append((st.blob, view))
            return view

        if torch.device(device).type != "cpu":  # verify in parallel first, then copy one by one
            todo = sorted(
                {
                    sha
                    for s in storages
                    if s.source in (Source.BLOB, Source.PIECES)
                    for sha in s.blobs
                    if self._needs_check(sha)
                }
            )
            self._run(self.verify_blob, [(sha,) for sha in todo], 1 << 62)
        mat = materialize(
            storages,
            tensors,
            lambda i: self.span_bytes(storages[i], i),
            device,
            placement,
            fill_spans=fill,
            view_span=view_span,
        )
        # Check what was handed out (a blob handed out twice is checked once).
        once = {sha: view for sha, view in handed if self._needs_check(sha)}
        self._run(self.verify_tensor, list(once.items()), sum(v.numel() for v in once.values()))
        return mat

    def span_bytes(self, st: StorageRecord, index: int) -> torch.Tensor:
        """A storage's span bytes (CPU uint8) whatever its source (`index`: its position, the
        seed of a by-reference or missing storage's re-creation)."""
        if st.source is Source.BLOB:
            return self.read_blob(st.blob)
        return self.recreate_span(st, index)

    def pieces_bytes(self, st: StorageRecord) -> torch.Tensor:
        """A pieced storage's span (CPU uint8): a private map of the file where its pieces lie
        back to back, else a copy; every piece verified."""
        view = self._private_run(st)
        if view is not None:
            once = [(sha, view[b:e]) for sha, b, e in st.piece_spans() if self._needs_check(sha)]
            self._run(self.verify_tensor, once, sum(v.numel() for _, v in once))
            return view
        import torch

        out = torch.empty(st.span_nbytes, dtype=torch.uint8)
        jobs = [(sha, out[b:e]) for sha, b, e in st.piece_spans()]
        self._run(self.copy_blob_into, jobs, st.span_nbytes)
        return out

    def recreate_span(self, st: StorageRecord, index: int) -> torch.Tensor:
        """The span bytes (CPU uint8) of a storage not held whole as a blob: a sparse one's
        ranges from its blob (verified), zeros elsewhere; a synthetic one from kdump's generator;
        a by-reference or missing one from its stats with the seed `index`."""
        import torch

        if st.source is Source.PIECES:
            return self.pieces_bytes(st)
        if st.source is Source.SPARSE:
            out = torch.zeros(st.span_nbytes, dtype=torch.uint8)
            held = self.read_blob(st.blob)
            pos = 0
            for b, e in st.ranges:
                out[b:e].copy_(held[pos : pos + e - b])
                pos += e - b
            return out
        if st.source is Source.SYNTHETIC:
            from kdump.format.synthetic import Params, generate

            assert st.generator is not None and st.stats is not None  # the parser checked
            g, s = st.generator, st.stats
            p = Params(g.seed, s.dtype, s.min, s.max, s.mean, s.std, g.name, g.version)
            return torch.from_numpy(generate(p, st.span_nbytes))
        from kdump.bundle.materialize import synthesize_span

        return synthesize_span(st, index)

    def verify(
        self,
        progress: Callable[[int], None] | None = None,
        known_good: Collection[str] = (),
    ) -> None:
        """Check every blob (parallel over blobs), even with verification turned off, except
        those in `known_good` (the caller checked those very files already)."""

        def one(sha: str) -> None:
            if sha not in self._verified and sha not in known_good:
                h, want = self._hasher(sha)
                h.update(self.blob_bytes(sha))
                self._accept(sha, h.hexdigest(), want)
            if progress:
                progress(self.blobs[sha].nbytes)

        self._run(one, [(sha,) for sha in self.blobs], 1 << 62)

    def call(self, index: int) -> Call:
        for c in self.calls:
            if c.index == index:
                return c
        raise BundleError(f"{self.path} has no call {index} (it holds {len(self.calls)} calls)")


def load_bundle(
    path: str | os.PathLike[str], limits: Limits | None = None, *, verify: bool = True
) -> Bundle:
    """Open a bundle: header and manifest validated against `limits` (default: the format's,
    with KDUMP_MAX_LOAD_BYTES); blobs load lazily, verified on first use (`verify=False`: used
    unchecked, for speed on trusted files)."""
    return Bundle(Path(path), limits, verify)


def iter_bundles(paths: Iterable[str | os.PathLike[str]]) -> Iterator[Path]:
    """Expand folders into the .kdump files they hold (sorted), keep files as given.

    A folder named `blobs` is a blob store (skipped) only directly under a capture root: the
    folder given, or a recording process's folder (one that holds an index file).
    """
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(_bundles_under(p))
            if not found:
                raise BundleError(f"{p}: folder holds no .kdump bundles", K.NOT_FOUND)
            yield from found
        else:
            yield p


def _bundles_under(root: Path) -> Iterator[Path]:
    for folder, subdirs, files in os.walk(root):
        if folder == str(root) or any(n in files for n in INDEX_NAMES):
            subdirs[:] = [d for d in subdirs if d != STORE_DIRNAME]
        yield from (Path(folder) / f for f in files if f.endswith(".kdump"))
