"""Reading and writing .kdump bundles (normative spec: docs/FORMAT.md).

A bundle is a safetensors file. Each stored blob (the bytes of one storage span) is a 1-D uint8
tensor named by its SHA-256; the JSON manifest sits in `__metadata__["kdump.manifest"]`. Blobs may
instead live in the capture directory's shared content-addressed store (`blobs/ab/<sha256>`), which
`pack` folds back into one self-contained file.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kdump.bundle import argtree
from kdump.bundle.tensors import (
    Captured,
    Materialized,
    Placement,
    StorageRecord,
    TensorRecord,
    capture,
    materialize,
    validate_records,
)
from kdump.errors import BundleError

FORMAT_NAME = "kdump"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST_KEY = "kdump.manifest"
MAX_HEADER = 100 * 1000 * 1000  # safetensors' own cap
STORE_DIRNAME = "blobs"
STORE_SEARCH_DEPTH = 3  # a bundle looks for the shared store in its folder and this many parents
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
_COPY_CHUNK = 1 << 20  # copy-and-hash granularity: small enough to stay in cache


def _kdump_version() -> str:
    from kdump import __version__

    return __version__


# ---------------------------------------------------------------------------------------------
# Writer side


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
) -> CallRecord:
    """Snapshot a call's arguments (before the call runs)."""
    kwargs = kwargs or {}
    tensors: list[torch.Tensor] = []
    args_tree = [argtree.encode(a, tensors) for a in args]
    kwargs_tree = {str(k): argtree.encode(v, tensors) for k, v in kwargs.items()}
    return CallRecord(
        target=target,
        called_as=called_as or target,
        args=args_tree,
        kwargs=kwargs_tree,
        names=list(names) if names is not None else None,
        inputs=capture(tensors),
        meta=dict(meta or {}),
    )


def input_tensors(
    call: CallRecord, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The live tensors of a call in the order of its tensor table (same walk as capture_call)."""
    tensors: list[torch.Tensor] = []
    for a in args:
        argtree.encode(a, tensors)
    for v in kwargs.values():
        argtree.encode(v, tensors)
    return tensors


def attach_outputs(
    call: CallRecord, live: Sequence[torch.Tensor], indices: Iterable[int], returned: Any = None
) -> None:
    """Snapshot tensors `indices` of the call's tensor table after the call (in-place outputs),
    and tensors in the return value."""
    idx = sorted(set(indices))
    extra: list[torch.Tensor] = [live[i] for i in idx]
    ret_tree = argtree.encode(returned, extra) if returned is not None else None
    call.outputs = capture(extra)
    call.inplace = [(i, k) for k, i in enumerate(idx)]
    call.returned = ret_tree


def _blob_view(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU uint8 tensor."""
    n = t.numel()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _sha256(view: memoryview | bytes) -> str:
    return hashlib.sha256(view).hexdigest()


def _storage_json(st: StorageRecord) -> dict[str, Any]:
    return asdict(st)


def _tensor_json(t: TensorRecord) -> dict[str, Any]:
    d = asdict(t)
    d["shape"] = list(t.shape)
    d["stride"] = list(t.stride)
    return d


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
        if self.has(sha, len(data)):
            return
        p = self.path(sha)
        p.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(p, lambda f: f.write(data))


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


def _atomic_write(path: Path, write: Callable[[Any], Any]) -> None:
    """Write through a temporary file in the same folder, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; bundles are ordinary files
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _hash_all(views: Sequence[memoryview]) -> list[str]:
    if len(views) <= 1 or sum(len(v) for v in views) < (8 << 20):
        return [_sha256(v) for v in views]
    with ThreadPoolExecutor(_HASH_THREADS) as pool:  # hashlib releases the GIL on large data
        return list(pool.map(_sha256, views))


def save_calls(
    path: str | os.PathLike[str],
    calls: Sequence[CallRecord],
    *,
    env: dict[str, Any] | None = None,
    store: BlobStore | None = None,
    info: dict[str, Any] | None = None,
) -> Path:
    """Write `calls` as one bundle, atomically. Identical storages are stored once.

    With `store`, blobs go to the shared store (each written once per capture directory) and the
    bundle holds only the manifest.
    """
    path = Path(path)
    sources: list[tuple[StorageRecord, torch.Tensor]] = []
    for call in calls:
        for cap in (call.inputs, call.outputs):
            if cap is not None:
                sources.extend(zip(cap.storages, cap.data))
    views = [_blob_view(d) for _, d in sources]
    where = "store" if store is not None else "inline"
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def make_manifest(shas: Sequence[str]) -> dict[str, Any]:
        it = iter(shas)

        def storages_json(cap: Captured) -> list[dict[str, Any]]:
            out = []
            for st in cap.storages:
                d = _storage_json(st)
                d["blob"] = next(it)
                out.append(d)
            return out

        calls_json = []
        for i, call in enumerate(calls):
            entry: dict[str, Any] = {
                "index": i,
                "target": call.target,
                "called_as": call.called_as,
                "names": call.names,
                "args": call.args,
                "kwargs": call.kwargs,
                "storages": storages_json(call.inputs),
                "tensors": [_tensor_json(t) for t in call.inputs.tensors],
                "outputs": None,
                "meta": call.meta,
            }
            if call.outputs is not None:
                entry["outputs"] = {
                    "storages": storages_json(call.outputs),
                    "tensors": [_tensor_json(t) for t in call.outputs.tensors],
                    "inplace": [list(p) for p in call.inplace],
                    "returned": call.returned,
                }
            calls_json.append(entry)
        blob_table: dict[str, dict[str, Any]] = {}
        for sha, view in zip(shas, views):
            blob_table.setdefault(sha, {"nbytes": len(view), "where": where})
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "writer": f"kdump {_kdump_version()}",
            "created": created,
            "env": env or {},
            "info": info or {},
            "blobs": blob_table,
            "calls": calls_json,
        }

    if store is None and _write_pipelined(path, views, make_manifest):
        return path
    shas = _hash_all(views)
    blobs: dict[str, memoryview] = {}
    for sha, view in zip(shas, views):
        blobs.setdefault(sha, view)
    if store is not None:
        for sha, view in blobs.items():
            store.put(sha, view)
        _write_safetensors(path, make_manifest(shas), {})
    else:
        _write_safetensors(path, make_manifest(shas), blobs)
    return path


def _header_json(manifest: dict[str, Any], layout: dict[str, tuple[int, int]]) -> bytes:
    header: dict[str, Any] = {
        sha: {"dtype": "U8", "shape": [e - b], "data_offsets": [b, e]}
        for sha, (b, e) in layout.items()
    }
    header["__metadata__"] = {MANIFEST_KEY: json.dumps(manifest, separators=(",", ":"))}
    return json.dumps(header, separators=(",", ":")).encode()


def _write_pipelined(
    path: Path,
    views: Sequence[memoryview],
    make_manifest: Callable[[Sequence[str]], dict[str, Any]],
) -> bool:
    """Write an inline bundle while its blobs are still being hashed (False: header too big).

    The header goes first in the file but names blobs by their hashes, so its space is reserved
    from an upper bound (every blob unique: de-duplication only shortens it) and the real header
    is padded with spaces to that size. Blobs are written in order while a thread pool hashes
    them all; a blob whose hash turns out to repeat an earlier one is overwritten by the next.
    """
    placeholders = [f"{i:064x}" for i in range(len(views))]
    upper: dict[str, tuple[int, int]] = {}
    off = 0
    for name, view in zip(placeholders, views):
        upper[name] = (off, off + len(view))
        off += len(view)
    reserved = len(_header_json(make_manifest(placeholders), upper))
    reserved += -reserved % 8  # safetensors pads the header to 8 bytes
    if reserved > MAX_HEADER:
        return False
    data_start = 8 + reserved

    def write(f: Any) -> None:
        layout: dict[str, tuple[int, int]] = {}
        shas: list[str] = []
        pos = 0
        with ThreadPoolExecutor(_HASH_THREADS) as pool:
            futures = [pool.submit(_sha256, v) for v in views]
            for view, fut in zip(views, futures):
                if fut.done() and fut.result() in layout:
                    shas.append(fut.result())
                    continue
                f.seek(data_start + pos)
                f.write(view)
                sha = fut.result()
                shas.append(sha)
                if sha not in layout:
                    layout[sha] = (pos, pos + len(view))
                    pos += len(view)
        f.truncate(data_start + pos)
        raw = _header_json(make_manifest(shas), layout)
        if len(raw) > reserved:  # cannot happen: dedup only removes entries and digits
            raise BundleError("internal error: bundle header outgrew its reserved space")
        f.seek(0)
        f.write(struct.pack("<Q", reserved))
        f.write(raw + b" " * (reserved - len(raw)))

    _atomic_write(path, write)
    return True


def _write_safetensors(path: Path, manifest: dict[str, Any], blobs: dict[str, memoryview]) -> None:
    layout: dict[str, tuple[int, int]] = {}
    offset = 0
    for sha, view in blobs.items():
        layout[sha] = (offset, offset + len(view))
        offset += len(view)
    raw = _header_json(manifest, layout)
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    if len(raw) > MAX_HEADER:
        raise BundleError(
            f"bundle manifest is {len(raw)} bytes, over the {MAX_HEADER}-byte header limit: "
            "write fewer calls per bundle"
        )

    def write(f: Any) -> None:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for view in blobs.values():
            f.write(view)

    _atomic_write(path, write)


# ---------------------------------------------------------------------------------------------
# Reader side


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


def tensor_paths(
    names: Sequence[str] | None, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[str]:
    """Readable path of every tensor reference in an encoded call, e.g. 'a[1]' or 'd'."""
    paths: dict[int, str] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, list):
            for j, v in enumerate(node):
                walk(v, f"{path}[{j}]")
        elif isinstance(node, dict):
            if "$tensor" in node:
                paths.setdefault(node["$tensor"], path)
            elif "$tuple" in node and isinstance(node["$tuple"], list):
                for j, v in enumerate(node["$tuple"]):
                    walk(v, f"{path}[{j}]")
            elif "$dict" in node and isinstance(node["$dict"], list):
                for pair in node["$dict"]:
                    if isinstance(pair, list) and len(pair) == 2:
                        walk(pair[1], f"{path}[{pair[0]!r}]")

    for i, a in enumerate(args):
        name = names[i] if names is not None and i < len(names) else f"args[{i}]"
        walk(a, name)
    for k, v in kwargs.items():
        walk(v, k)
    return [paths.get(i, f"tensor{i}") for i in range(max(paths, default=-1) + 1)]


class Call:
    """One recorded call in a loaded bundle. Tensors materialise lazily."""

    def __init__(self, bundle: Bundle, entry: dict[str, Any]) -> None:
        self._bundle = bundle
        self._entry = entry
        self.index: int = entry["index"]
        self.target: str = entry["target"]
        self.called_as: str = entry["called_as"]
        self.names: list[str] | None = entry["names"]
        self.meta: dict[str, Any] = entry["meta"]
        self.storages = [StorageRecord(**s) for s in entry["storages"]]
        self.tensors = [_tensor_record(t) for t in entry["tensors"]]
        out = entry["outputs"]
        self.output_storages = [StorageRecord(**s) for s in out["storages"]] if out else []
        self.output_tensors = [_tensor_record(t) for t in out["tensors"]] if out else []
        self.inplace: list[tuple[int, int]] = [tuple(p) for p in out["inplace"]] if out else []
        self._cpu: MaterializedCall | None = None

    def __repr__(self) -> str:
        return f"<kdump.Call {self.index} {self.target} ({len(self.tensors)} tensors)>"

    @property
    def encoded_args(self) -> list[Any]:
        return self._entry["args"]

    @property
    def encoded_kwargs(self) -> dict[str, Any]:
        return self._entry["kwargs"]

    @property
    def tensor_names(self) -> list[str]:
        names = tensor_paths(self.names, self.encoded_args, self.encoded_kwargs)
        return names + [f"tensor{i}" for i in range(len(names), len(self.tensors))]

    @property
    def has_outputs(self) -> bool:
        return self._entry["outputs"] is not None

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
        if self._cpu is None:
            self._cpu = self.materialize("cpu")
        return self._cpu

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
    def outputs(self) -> dict[str, torch.Tensor] | None:
        """Recorded outputs by argument path ('d', 'args[2]'), or None when not recorded."""
        if not self.has_outputs:
            return None
        names = self.tensor_names
        return {names[i]: t for i, t in self.materialize_outputs("cpu").items()}

    @property
    def nbytes(self) -> int:
        return sum(s.span_nbytes for s in self.storages + self.output_storages)


def _tensor_record(d: dict[str, Any]) -> TensorRecord:
    return TensorRecord(
        storage=d["storage"],
        dtype=d["dtype"],
        shape=tuple(d["shape"]),
        stride=tuple(d["stride"]),
        storage_offset=d["storage_offset"],
        requires_grad=bool(d.get("requires_grad", False)),
        data_ptr=d.get("data_ptr", 0),
    )


class Bundle:
    """A loaded .kdump file. Use `load_bundle`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = None
        self._map: mmap.mmap | None = None
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - lives as long as the bundle
        except FileNotFoundError:
            raise BundleError(f"{path}: no such file")
        except IsADirectoryError:
            raise BundleError(f"{path} is a directory; give a .kdump file")
        except OSError as exc:
            raise BundleError(f"{path}: cannot open ({exc.strerror})")
        size = os.fstat(self._file.fileno()).st_size
        self.file_size = size
        header, self.data_start = _read_header(self._file, size, path)
        self.manifest, self.inline = _parse_header(header, size - self.data_start, path)
        self.env: dict[str, Any] = self.manifest.get("env", {})
        self.info: dict[str, Any] = self.manifest.get("info", {})
        self.version: int = self.manifest["version"]
        self.blobs: dict[str, dict[str, Any]] = self.manifest["blobs"]
        self.calls = [Call(self, c) for c in self.manifest["calls"]]
        self._store_root: Path | None = None

    # context manager and cleanup
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
        return sum(b["nbytes"] for b in self.blobs.values())

    def _mapped(self) -> mmap.mmap:
        with self._lock:  # blobs are read from several threads
            if self._map is None:
                if self._file is None:
                    self._file = open(self.path, "rb")  # noqa: SIM115
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
                    "run `kdump pack` where it is complete"
                )
        return BlobStore(self._store_root).path(sha)

    def blob_bytes(self, sha: str) -> memoryview:
        """Raw bytes of a blob (not verified)."""
        info = self.blobs.get(sha)
        if info is None:
            raise BundleError(f"{self.path}: manifest refers to blob {sha[:12]}…, which it lacks")
        nbytes = info["nbytes"]
        if nbytes == 0:
            return memoryview(b"")
        if info["where"] == "inline":
            begin, end = self.inline[sha]
            return memoryview(self._mapped())[self.data_start + begin : self.data_start + end]
        p = self._store_path(sha)
        try:
            with open(p, "rb") as f:
                if os.fstat(f.fileno()).st_size != nbytes:
                    raise BundleError(f"{p}: store blob has the wrong size (expected {nbytes})")
                return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
        except FileNotFoundError:
            raise BundleError(
                f"{self.path}: blob {sha[:12]}… is missing from the store {p.parent.parent}; "
                "copy the whole capture directory or re-pack the bundle"
            )

    def verify_blob(self, sha: str, view: memoryview | None = None) -> None:
        if sha in self._verified:
            return
        self._accept(sha, _sha256(view if view is not None else self.blob_bytes(sha)))

    def _accept(self, sha: str, got: str) -> None:
        """Remember a blob whose SHA-256 matched its name; a mismatch means a corrupt bundle."""
        if got != sha:
            raise BundleError(
                f"{self.path}: checksum mismatch in blob {sha[:12]}… (got {got[:12]}…): the "
                "bundle is corrupt; record it again or restore the file"
            )
        with self._lock:
            self._verified.add(sha)

    def read_blob(self, sha: str) -> torch.Tensor:
        """A blob as a CPU uint8 tensor (verified on first read; a copy-on-write view)."""
        view = self.blob_bytes(sha)
        self.verify_blob(sha, view)
        if len(view) == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(view, dtype=torch.uint8)

    def copy_blob_into(self, sha: str, dest: torch.Tensor) -> None:
        """Copy a blob into `dest` (contiguous CPU uint8), verifying its SHA-256 in the same pass
        (each chunk is hashed right after it was copied, while it is still in cache)."""
        view = self.blob_bytes(sha)
        n = len(view)
        if dest.numel() != n:
            raise BundleError(
                f"{self.path}: blob {sha[:12]}… holds {n} bytes, the manifest says {dest.numel()}"
            )
        if n == 0:
            self.verify_blob(sha, view)
            return
        src = ctypes.addressof(ctypes.c_char.from_buffer(view))
        dst = dest.data_ptr()
        h = hashlib.sha256() if sha not in self._verified else None
        for off in range(0, n, _COPY_CHUNK):
            k = min(_COPY_CHUNK, n - off)
            ctypes.memmove(dst + off, src + off, k)  # releases the GIL, like hashlib below
            if h is not None:
                h.update((ctypes.c_char * k).from_address(dst + off))
        if h is not None:
            self._accept(sha, h.hexdigest())

    def materialize_records(
        self,
        storages: Sequence[StorageRecord],
        tensors: Sequence[TensorRecord],
        device: torch.device | str = "cpu",
        placement: Placement | None = None,
    ) -> Materialized:
        """Re-create tensor records from this bundle's blobs (verified), blobs in parallel."""

        def fill(batch: Sequence[tuple[int, torch.Tensor]]) -> None:
            jobs = [(storages[i].blob, dest) for i, dest in batch]
            if len(jobs) == 1 or sum(d.numel() for _, d in jobs) < (8 << 20):
                for sha, dest in jobs:
                    self.copy_blob_into(sha, dest)
                return
            with ThreadPoolExecutor(min(_HASH_THREADS, len(jobs))) as pool:
                list(pool.map(lambda job: self.copy_blob_into(*job), jobs))

        if torch.device(device).type != "cpu":  # verify in parallel first, then copy one by one
            todo = sorted({s.blob for s in storages if s.blob not in self._verified})
            if len(todo) > 1:
                with ThreadPoolExecutor(min(_HASH_THREADS, len(todo))) as pool:
                    list(pool.map(self.verify_blob, todo))
        return materialize(
            storages,
            tensors,
            lambda i: self.read_blob(storages[i].blob),
            device,
            placement,
            fill_spans=fill,
        )

    def verify(self, progress: Callable[[int], None] | None = None) -> None:
        """Check every blob's SHA-256 (parallel over blobs)."""
        shas = list(self.blobs)

        def one(sha: str) -> int:
            self.verify_blob(sha)
            if progress:
                progress(self.blobs[sha]["nbytes"])
            return 0

        with ThreadPoolExecutor(_HASH_THREADS) as pool:
            list(pool.map(one, shas))

    def call(self, index: int) -> Call:
        for c in self.calls:
            if c.index == index:
                return c
        raise BundleError(f"{self.path} has no call {index} (it holds {len(self.calls)} calls)")


def load_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Open a bundle: header and manifest validated; blobs load lazily, verified on first use."""
    return Bundle(Path(path))


def _read_header(f: Any, size: int, path: Path) -> tuple[bytes, int]:
    if size < 8:
        raise BundleError(f"{path}: file is {size} bytes, too short to be a .kdump bundle")
    (n,) = struct.unpack("<Q", f.read(8))
    if n == 0 or n > MAX_HEADER or n > size - 8:
        raise BundleError(
            f"{path}: header length {n} does not fit the {size}-byte file (truncated or not a "
            ".kdump bundle)"
        )
    return f.read(n), 8 + n


def _parse_header(
    raw: bytes, data_size: int, path: Path
) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BundleError(f"{path}: header is not valid JSON (corrupt or not a .kdump bundle)")
    if not isinstance(header, dict):
        raise BundleError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get(MANIFEST_KEY), str):
        raise BundleError(
            f"{path}: safetensors file without a kdump manifest (not a .kdump bundle)"
        )
    inline: dict[str, tuple[int, int]] = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise BundleError(f"{path}: tensor entry {name[:40]!r} is not an object")
        offs = entry.get("data_offsets")
        shape = entry.get("shape")
        if (
            entry.get("dtype") != "U8"
            or not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not isinstance(shape, list)
            or len(shape) != 1
            or not isinstance(shape[0], int)
        ):
            raise BundleError(f"{path}: blob {name[:16]!r} has a malformed header entry")
        b, e = offs
        if not 0 <= b <= e <= data_size or e - b != shape[0]:
            raise BundleError(
                f"{path}: blob {name[:16]!r} claims bytes [{b}, {e}) but the data section has "
                f"{data_size} bytes (truncated or corrupt)"
            )
        inline[name] = (b, e)
        spans.append((b, e))
    try:
        manifest = json.loads(meta[MANIFEST_KEY])
    except (ValueError, RecursionError):
        raise BundleError(f"{path}: kdump manifest is not valid JSON")
    _validate_manifest(manifest, inline, path)
    return manifest, inline


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate_manifest(m: Any, inline: dict[str, tuple[int, int]], path: Path) -> None:
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise BundleError(f"{path}: manifest is not a kdump manifest")
    version = m.get("version")
    if version not in SUPPORTED_VERSIONS:
        raise BundleError(
            f"{path}: format version {version!r} is not supported by this kdump (reads "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade kdump-gpu"
        )
    blobs = m.get("blobs")
    calls = m.get("calls")
    if not isinstance(blobs, dict) or not isinstance(calls, list):
        raise BundleError(f"{path}: manifest lacks its blob table or call list")
    for sha, info in blobs.items():
        if (
            not isinstance(info, dict)
            or not _is_int(info.get("nbytes"))
            or info["nbytes"] < 0
            or info.get("where") not in ("inline", "store")
            or not isinstance(sha, str)
            or len(sha) != 64
            or any(c not in "0123456789abcdef" for c in sha)
        ):
            raise BundleError(f"{path}: malformed blob table entry {str(sha)[:16]!r}")
        if info["where"] == "inline" and info["nbytes"] > 0:
            span = inline.get(sha)
            if span is None or span[1] - span[0] != info["nbytes"]:
                raise BundleError(f"{path}: blob {sha[:12]}… is listed inline but not stored")
    for k in ("env", "info"):
        if k in m and not isinstance(m[k], dict):
            raise BundleError(f"{path}: manifest field {k!r} is not an object")
    for i, c in enumerate(calls):
        _validate_call(c, i, blobs, path)


def _validate_storages(
    raw: Any, blobs: dict[str, Any], where: str, path: Path
) -> list[StorageRecord]:
    if not isinstance(raw, list):
        raise BundleError(f"{path}: {where}: storages is not a list")
    out = []
    for j, s in enumerate(raw):
        keys = ("base_ptr", "storage_nbytes", "span_start", "span_nbytes")
        if not isinstance(s, dict) or not all(_is_int(s.get(k)) and s[k] >= 0 for k in keys):
            raise BundleError(f"{path}: {where}: storage {j} is malformed")
        if not isinstance(s.get("device"), str) or not isinstance(s.get("blob"), str):
            raise BundleError(f"{path}: {where}: storage {j} lacks its device or blob")
        blob = blobs.get(s["blob"])
        if blob is None or blob["nbytes"] != s["span_nbytes"]:
            raise BundleError(
                f"{path}: {where}: storage {j} needs {s['span_nbytes']} bytes from blob "
                f"{s['blob'][:12]}…, which the bundle does not hold"
            )
        extra = set(s) - {"device", "blob", *keys}
        if extra:
            raise BundleError(f"{path}: {where}: storage {j} has unknown fields {sorted(extra)}")
        out.append(StorageRecord(**s))
    return out


def _validate_tensors(
    raw: Any, storages: list[StorageRecord], where: str, path: Path
) -> list[TensorRecord]:
    if not isinstance(raw, list):
        raise BundleError(f"{path}: {where}: tensors is not a list")
    out = []
    for j, t in enumerate(raw):
        if (
            not isinstance(t, dict)
            or not _is_int(t.get("storage"))
            or not isinstance(t.get("dtype"), str)
            or not isinstance(t.get("shape"), list)
            or not isinstance(t.get("stride"), list)
            or not _is_int(t.get("storage_offset"))
            or not all(_is_int(x) for x in t["shape"] + t["stride"])
        ):
            raise BundleError(f"{path}: {where}: tensor {j} is malformed")
        out.append(_tensor_record(t))
    try:
        validate_records(storages, out)
    except BundleError as exc:
        raise BundleError(f"{path}: {where}: {exc}") from None
    return out


def _validate_call(c: Any, i: int, blobs: dict[str, Any], path: Path) -> None:
    where = f"call {i}"
    if not isinstance(c, dict) or c.get("index") != i:
        raise BundleError(f"{path}: {where} is malformed or out of order")
    for key in ("target", "called_as"):
        if not isinstance(c.get(key), str):
            raise BundleError(f"{path}: {where} lacks its {key}")
    for key in ("names", "outputs"):  # both may be null, neither may be missing
        if key not in c:
            raise BundleError(f"{path}: {where} lacks its {key!r} field")
    names = c.get("names")
    if names is not None and (
        not isinstance(names, list) or not all(isinstance(n, str) for n in names)
    ):
        raise BundleError(f"{path}: {where}: names is not a list of strings")
    if not isinstance(c.get("args"), list) or not isinstance(c.get("kwargs"), dict):
        raise BundleError(f"{path}: {where}: args/kwargs malformed")
    if not isinstance(c.get("meta"), dict):
        raise BundleError(f"{path}: {where}: meta is not an object")
    storages = _validate_storages(c.get("storages"), blobs, where, path)
    tensors = _validate_tensors(c.get("tensors"), storages, where, path)
    refs = argtree.tensor_refs(c["args"]) + argtree.tensor_refs(c["kwargs"])
    if any(not _is_int(r) or not 0 <= r < len(tensors) for r in refs):
        raise BundleError(f"{path}: {where}: argument tree refers to a tensor that does not exist")
    # Decode once with placeholders so a malformed tree is caught at load time, not at replay.
    for a in c["args"]:
        argtree.decode(a, lambda _i: None)
    for v in c["kwargs"].values():
        argtree.decode(v, lambda _i: None)
    out = c.get("outputs")
    if out is not None:
        if not isinstance(out, dict):
            raise BundleError(f"{path}: {where}: outputs is malformed")
        ost = _validate_storages(out.get("storages"), blobs, where + " outputs", path)
        ots = _validate_tensors(out.get("tensors"), ost, where + " outputs", path)
        inplace = out.get("inplace")
        if not isinstance(inplace, list) or not all(
            isinstance(p, list)
            and len(p) == 2
            and _is_int(p[0])
            and _is_int(p[1])
            and 0 <= p[0] < len(tensors)
            and 0 <= p[1] < len(ots)
            for p in inplace
        ):
            raise BundleError(f"{path}: {where}: outputs.inplace is malformed")


# ---------------------------------------------------------------------------------------------
# Packing


def pack(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Rewrite a bundle (whose blobs may live in a shared store) as one self-contained file."""
    bundle = load_bundle(src)
    bundle.verify()
    manifest = json.loads(json.dumps(bundle.manifest))
    views = {sha: bundle.blob_bytes(sha) for sha, info in bundle.blobs.items() if info["nbytes"]}
    for info in manifest["blobs"].values():
        info["where"] = "inline"
    out = Path(dst)
    _write_safetensors(out, manifest, views)
    return out


def iter_bundles(paths: Iterable[str | os.PathLike[str]]) -> Iterator[Path]:
    """Expand folders into the .kdump files they hold (sorted), keep files as given."""
    for p in paths:
        p = Path(p)
        if p.is_dir():
            from kdump.record.capture_dir import list_bundles

            found = list_bundles(p)
            if not found:
                raise BundleError(f"{p}: folder holds no .kdump bundles")
            yield from found
        else:
            yield p
