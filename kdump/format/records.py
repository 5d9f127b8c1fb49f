"""The bundle format's constants and its manifest as frozen typed records (torch-free).

A reader parses the manifest into these records once (`kdump.format.parse`), validates them in one
pass (`kdump.format.validate`) and keeps them; the writer builds them and serialises them with
`manifest_json`. docs/FORMAT.md is the normative description.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

FORMAT_NAME = "kdump"
FORMAT_VERSION = 6  # what this writer writes
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5, 6)  # what this reader reads
MANIFEST_KEY = "kdump.manifest"
MAX_HEADER = 100 * 1000 * 1000  # safetensors' own cap
STORE_DIRNAME = "blobs"

# Base addresses are re-created modulo this (TMA needs 16 B, swizzled tiles up to 1024 B).
ALIGN_MOD = 1024
# The data section starts at a multiple of ALIGN_MOD (else of 8) and each inline blob of at least
# this many bytes at an offset congruent to its storage's recorded address modulo ALIGN_MOD, so a
# page-aligned map of the file hands out views with the call's alignment; the gaps are covered by
# padding entries named PAD_PREFIX<i> (safetensors allows no holes; FORMAT.md §2.1). Smaller blobs
# are copied on load anyway and follow back to back.
ALIGNED_BLOB_MIN = 64 << 10
PAD_PREFIX = "kdump.pad."

# Upper bounds that keep a hostile header from describing absurd objects.
MAX_NDIM = 16
MAX_DIM = 1 << 48

# A view's storage offset is kept exactly, in every placement, by re-creating the unrecorded bytes
# before its span (zeros, or poison with a halo or a flush end), as long as the prefixes of one
# call's storages add up to at most this (so a small hostile file cannot make the reader fill
# gigabytes). Past it a storage starts at its span and the offsets that changed are reported.
PREFIX_LIMIT = 64 << 20

DEFAULT_MAX_LOAD_BYTES = 64 << 30  # the one default of the allocation cap (KDUMP_MAX_LOAD_BYTES)


def blob_offset(pos: int, nbytes: int, align: int, min_aligned: int = ALIGNED_BLOB_MIN) -> int:
    """Where in the data section a blob of `nbytes` goes: the first offset at or after `pos`
    congruent to `align` (its storage's address modulo ALIGN_MOD) for blobs of `min_aligned`
    bytes or more, else `pos`."""
    return pos + (align - pos) % ALIGN_MOD if nbytes >= min_aligned else pos


@dataclass(frozen=True)
class Limits:
    """What a reader accepts before it allocates anything, and what the writer keeps to.

    Counts are per bundle (calls, blobs) or per call part (storages, tensors); the argument-tree
    bounds hold for each tree; `max_string` for every string the manifest names (targets, devices,
    parameter names, dict keys) and every string inside argument trees; `max_load_bytes` for the
    bytes one materialisation of a call may allocate and for the blobs a bundle declares.
    docs/FORMAT.md ("Limits") is the normative list.
    """

    max_calls: int = 100_000
    max_blobs: int = 1_000_000
    max_storages: int = 10_000
    max_tensors: int = 10_000
    max_tree_depth: int = 64
    max_tree_nodes: int = 100_000
    max_string: int = 1 << 20
    max_load_bytes: int = DEFAULT_MAX_LOAD_BYTES
    max_ranges: int = 1_000_000  # byte ranges of the sparse storages of one call part together
    max_pieces: int = 1_000_000  # pieces of the pieced storages of one call part together


# Every dtype a bundle may hold, by its stable name in the format, with its size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float4_e2m1fn_x2": 1,
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex64": 8,
}


class Source(str, Enum):
    """Where a storage's bytes come from. A reader rejects a kind it does not know."""

    BLOB = "blob"  # the span's bytes are a blob of the blob table
    BY_REFERENCE = "by-reference"  # a static operand (weights): shape, layout and stats only
    MISSING = "missing"  # device data the recorder could not keep (salvage); stats if known
    SPARSE = "sparse"  # only listed byte ranges are held (the blob: them, concatenated); rest zero
    SYNTHETIC = "synthetic"  # produced by kdump's generator from a seed and the stats
    PIECES = "pieces"  # the span is its pieces' blobs, concatenated in order (version 5)


# The storages whose bytes are held in the bundle (the others are re-created from records).
HELD_SOURCES = (Source.BLOB, Source.SPARSE, Source.PIECES)


@dataclass(frozen=True)
class GeneratorRecord:
    """Which of kdump's generators made a synthetic storage (kdump.format.synthetic)."""

    name: str
    version: int
    seed: int


@dataclass(frozen=True)
class Stats:
    """Value statistics of a storage not held as bytes: what a replay re-creates it from."""

    dtype: str  # the element type the statistics are over
    min: float
    max: float
    mean: float
    std: float
    checksum: str = ""  # of the bytes at record time, when the recorder computed one


class Where(str, Enum):
    """Where a blob's bytes live."""

    INLINE = "inline"  # this file's data section
    STORE = "store"  # the capture directory's shared store


class Checksum(str, Enum):
    """The algorithm a blob is verified with (its name is always its SHA-256)."""

    SHA256 = "sha256"  # the name itself
    XXH3_128 = "xxh3-128"  # a fast check recorded beside the name, in the entry's `digest`


XXH3_DIGEST_LEN = 32  # hex digits of an xxh3-128 digest


@dataclass(frozen=True)
class StorageRecord:
    """One storage span as seen at the call: where it lived and which bytes the views cover."""

    device: str
    base_ptr: int  # storage's data pointer at the call
    storage_nbytes: int  # the whole storage's size at the call
    span_start: int  # byte offset of the stored span inside the storage
    span_nbytes: int  # bytes stored
    blob: str = ""  # sha256 of the span's bytes, filled in by the writer ("" unless a blob)
    source: Source = Source.BLOB
    stats: Stats | None = None  # by-reference / missing storages: what their values looked like
    # sparse: the held [start, end) byte ranges, relative to the span's start (sorted, disjoint)
    ranges: tuple[tuple[int, int], ...] = ()
    generator: GeneratorRecord | None = None  # synthetic: how the bytes are produced
    # pieces: (blob, nbytes) of each piece, in order; they add up to the span
    pieces: tuple[tuple[str, int], ...] = ()

    @property
    def held_nbytes(self) -> int:
        """Bytes of the span its blobs hold (sparse: the ranges; no blob: 0)."""
        if self.source is Source.SPARSE:
            return sum(e - b for b, e in self.ranges)
        return self.span_nbytes if self.source in (Source.BLOB, Source.PIECES) else 0

    @property
    def blobs(self) -> tuple[str, ...]:
        """The blobs the storage's bytes are in, in order (none for a storage without bytes)."""
        if self.source is Source.PIECES:
            return tuple(sha for sha, _ in self.pieces)
        return (self.blob,) if self.source in (Source.BLOB, Source.SPARSE) else ()

    def piece_spans(self) -> tuple[tuple[str, int, int], ...]:
        """(blob, begin, end) inside the span of each of the storage's blobs: its pieces, or
        its one blob over the whole span (sparse: over the held ranges' bytes)."""
        if self.source is not Source.PIECES:
            return tuple((sha, 0, self.held_nbytes) for sha in self.blobs)
        out = []
        pos = 0
        for sha, n in self.pieces:
            out.append((sha, pos, pos + n))
            pos += n
        return tuple(out)

    @property
    def span_ptr(self) -> int:
        return self.base_ptr + self.span_start

    @property
    def alignment(self) -> int:
        """Address of the span's first byte modulo ALIGN_MOD."""
        return self.span_ptr % ALIGN_MOD


@dataclass(frozen=True)
class TensorRecord:
    """One tensor view over a stored storage."""

    storage: int  # index into the call's storage list
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements, relative to the original storage's start
    requires_grad: bool = False
    data_ptr: int = 0  # absolute address of element 0 at the call

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def byte_extent(self) -> tuple[int, int]:
        """[first, end) byte offsets inside the storage that the view can touch."""
        return view_byte_extent(self.shape, self.stride, self.storage_offset, self.itemsize)


def view_byte_extent(
    shape: Sequence[int], stride: Sequence[int], offset: int, itemsize: int
) -> tuple[int, int]:
    start = offset * itemsize
    if any(s == 0 for s in shape):
        return start, start
    last = offset + sum((n - 1) * st for n, st in zip(shape, stride))
    return start, (last + 1) * itemsize


@dataclass(frozen=True)
class BlobRecord:
    """One entry of the blob table."""

    nbytes: int
    where: Where
    checksum: Checksum = Checksum.SHA256
    digest: str = ""  # lowercase hex of the `checksum` algorithm's digest (not for sha256)


@dataclass(frozen=True)
class OutputsRecord:
    """Post-call snapshots of a call."""

    storages: tuple[StorageRecord, ...]
    tensors: tuple[TensorRecord, ...]
    inplace: tuple[tuple[int, int], ...]  # (input tensor index, output tensor index)
    returned: Any  # encoded argument tree; its tensors index `tensors`


# Launch records (version 6): how a call that is a kernel launch of a JIT language was launched.
LAUNCH_KINDS = ("triton",)
MAX_GRID = (1 << 31) - 1  # CUDA's grid x bound; y and z are smaller, the launch itself checks


@dataclass(frozen=True)
class LaunchRecord:
    """A JIT kernel's launch as recorded (version 6, the call's `launch` field): what, beside the
    arguments, is needed to launch it again exactly. The kernel's source is never part of it: a
    replay launches the installed kernel and compares `source_sha256` with it."""

    kind: str  # "triton"
    grid: tuple[int, ...]  # the grid as evaluated for this launch, 1 to 3 dimensions
    options: dict[str, Any]  # launch options (num_warps, num_stages, num_ctas, ...): JSON scalars
    constexprs: tuple[str, ...]  # the kernel's parameters that are compile-time constants
    source_sha256: str  # of the kernel's source text, as the language normalises it
    version: str  # the language's version (triton.__version__)


@dataclass(frozen=True)
class CallEntry:
    """One call of the manifest."""

    index: int
    target: str
    called_as: str
    names: tuple[str, ...] | None
    args: list[Any]  # encoded argument trees
    kwargs: dict[str, Any]
    storages: tuple[StorageRecord, ...]
    tensors: tuple[TensorRecord, ...]
    outputs: OutputsRecord | None
    meta: dict[str, Any]
    launch: LaunchRecord | None = None  # version 6: a JIT kernel's launch


@dataclass(frozen=True)
class Manifest:
    """A whole manifest."""

    version: int
    writer: str
    created: str
    env: dict[str, Any]
    info: dict[str, Any]
    blobs: dict[str, BlobRecord]  # by SHA-256
    calls: tuple[CallEntry, ...]


# The one definition of the storage and tensor records' JSON fields, in the order they are
# written: the manifest's storages and tensors, the journal slot's (which adds a tensor's "nbytes")
# and the strict parser (kdump.format.parse) all use these.
STORAGE_LAYOUT_FIELDS = ("device", "base_ptr", "storage_nbytes", "span_start", "span_nbytes")
TENSOR_FIELDS = (
    "storage",
    "dtype",
    "shape",
    "stride",
    "storage_offset",
    "requires_grad",
    "data_ptr",
)


def storage_layout_json(st: StorageRecord) -> dict[str, Any]:
    """Where a storage lived and which span of it is recorded (no bytes, no source): what the
    flight recorder's slot says of a storage before its bytes are known."""
    return {
        "device": st.device,
        "base_ptr": st.base_ptr,
        "storage_nbytes": st.storage_nbytes,
        "span_start": st.span_start,
        "span_nbytes": st.span_nbytes,
    }


def storage_json(st: StorageRecord) -> dict[str, Any]:
    out = storage_layout_json(st)
    out["blob"] = st.blob
    out["source"] = st.source.value
    if st.stats is not None:
        s = st.stats
        out["stats"] = {
            "dtype": s.dtype,
            "min": s.min,
            "max": s.max,
            "mean": s.mean,
            "std": s.std,
            "checksum": s.checksum,
        }
    if st.source is Source.SPARSE:
        out["ranges"] = [[b, e] for b, e in st.ranges]
    if st.generator is not None:
        g = st.generator
        out["generator"] = {"name": g.name, "version": g.version, "seed": g.seed}
    if st.source is Source.PIECES:
        out["pieces"] = [[sha, n] for sha, n in st.pieces]
    return out


def tensor_json(t: TensorRecord, *, nbytes: bool = False) -> dict[str, Any]:
    """A tensor record's JSON; `nbytes` adds the view's element bytes (the journal slot's field,
    which sizes the call's payloads without the dtype table)."""
    out: dict[str, Any] = {
        "storage": t.storage,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "stride": list(t.stride),
        "storage_offset": t.storage_offset,
        "requires_grad": t.requires_grad,
        "data_ptr": t.data_ptr,
    }
    if nbytes:
        out["nbytes"] = t.numel * t.itemsize
    return out


def storage_from_json(d: dict[str, Any]) -> StorageRecord:
    """A storage record from a trusted dict (the journal's own, one `storage_json` wrote): no
    checks beyond Python's; a manifest from a file goes through `kdump.format.parse` instead.
    The fields after the layout are optional (a journal slot holds only the layout)."""
    stats = d.get("stats")
    generator = d.get("generator")
    return StorageRecord(
        **{k: d[k] for k in STORAGE_LAYOUT_FIELDS},
        blob=d.get("blob", ""),
        source=Source(d.get("source", Source.BLOB.value)),
        stats=Stats(**stats) if stats is not None else None,
        ranges=tuple((b, e) for b, e in d.get("ranges", ())),
        generator=GeneratorRecord(**generator) if generator is not None else None,
        pieces=tuple((sha, n) for sha, n in d.get("pieces", ())),
    )


def tensor_from_json(d: dict[str, Any]) -> TensorRecord:
    """A tensor record from a trusted dict (`tensor_json`'s, with or without "nbytes")."""
    return TensorRecord(
        storage=d["storage"],
        dtype=d["dtype"],
        shape=tuple(d["shape"]),
        stride=tuple(d["stride"]),
        storage_offset=d["storage_offset"],
        requires_grad=d.get("requires_grad", False),
        data_ptr=d.get("data_ptr", 0),
    )


def launch_json(r: LaunchRecord) -> dict[str, Any]:
    return {
        "kind": r.kind,
        "grid": list(r.grid),
        "options": dict(r.options),
        "constexprs": list(r.constexprs),
        "source_sha256": r.source_sha256,
        "version": r.version,
    }


def call_json(c: CallEntry) -> dict[str, Any]:
    out = None
    if c.outputs is not None:
        out = {
            "storages": [storage_json(s) for s in c.outputs.storages],
            "tensors": [tensor_json(t) for t in c.outputs.tensors],
            "inplace": [list(p) for p in c.outputs.inplace],
            "returned": c.outputs.returned,
        }
    entry = {
        "index": c.index,
        "target": c.target,
        "called_as": c.called_as,
        "names": list(c.names) if c.names is not None else None,
        "args": c.args,
        "kwargs": c.kwargs,
        "storages": [storage_json(s) for s in c.storages],
        "tensors": [tensor_json(t) for t in c.tensors],
        "outputs": out,
        "meta": c.meta,
    }
    if c.launch is not None:
        entry["launch"] = launch_json(c.launch)
    return entry


def blob_json(b: BlobRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"nbytes": b.nbytes, "where": b.where.value, "checksum": b.checksum.value}
    if b.checksum is not Checksum.SHA256:
        out["digest"] = b.digest
    return out


def manifest_json(m: Manifest) -> dict[str, Any]:
    """The manifest as written (always the current FORMAT_VERSION's layout)."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "writer": m.writer,
        "created": m.created,
        "env": m.env,
        "info": m.info,
        "blobs": {sha: blob_json(b) for sha, b in m.blobs.items()},
        "calls": [call_json(c) for c in m.calls],
    }
