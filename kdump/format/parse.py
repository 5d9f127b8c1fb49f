"""Parse a bundle's header and manifest JSON into typed records (torch-free, type-strict).

Only types and shapes are checked here (an int is an int: never a bool or a float); how the records
relate to each other is checked once, afterwards, by `kdump.format.validate`.
"""

from __future__ import annotations

import json
import math
import struct
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from kdump.errors import BundleError
from kdump.errors import BundleErrorKind as K
from kdump.format.records import (
    DTYPE_SIZES,
    FORMAT_NAME,
    LAUNCH_KINDS,
    MANIFEST_KEY,
    MAX_GRID,
    MAX_HEADER,
    STORAGE_LAYOUT_FIELDS,
    SUPPORTED_VERSIONS,
    XXH3_DIGEST_LEN,
    BlobRecord,
    CallEntry,
    Checksum,
    GeneratorRecord,
    LaunchRecord,
    Limits,
    Manifest,
    OutputsRecord,
    Source,
    Stats,
    StorageRecord,
    TensorRecord,
    Where,
    tensor_from_json,
)
from kdump.format.synthetic import refusal

_STORAGE_INTS = STORAGE_LAYOUT_FIELDS[1:]  # all but the device
_STORAGE_FIELDS = {1: {*STORAGE_LAYOUT_FIELDS, "blob"}}
_STORAGE_FIELDS[2] = _STORAGE_FIELDS[1] | {"source"}
_STORAGE_FIELDS[3] = _STORAGE_FIELDS[2] | {"stats"}
_STORAGE_FIELDS[4] = _STORAGE_FIELDS[3] | {"ranges", "generator"}
_STORAGE_FIELDS[5] = _STORAGE_FIELDS[4] | {"pieces"}
_STORAGE_FIELDS[6] = _STORAGE_FIELDS[5]
_SINCE = {
    Source.BY_REFERENCE: 3,
    Source.MISSING: 3,
    Source.SPARSE: 4,
    Source.SYNTHETIC: 4,
    Source.PIECES: 5,
}
_STATS_FLOATS = ("min", "max", "mean", "std")
E = TypeVar("E", bound=Enum)
_BLOB_FIELDS = {"nbytes", "where", "checksum", "digest"}
_SHA_DIGITS = frozenset("0123456789abcdef")


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_sha(x: str) -> bool:
    return len(x) == 64 and set(x) <= _SHA_DIGITS


def _member(kind: type[E], x: object) -> E | None:
    """The member of a str enum spelled `x`, or None (for any other value or type)."""
    return kind._value2member_map_.get(x) if isinstance(x, str) else None  # type: ignore[return-value]


def read_header(f: BinaryIO, size: int, path: Path) -> tuple[bytes, int]:
    """The raw header bytes and where the data section starts."""
    if size < 8:
        raise BundleError(
            f"{path}: file is {size} bytes, too short to be a .kdump bundle", K.TRUNCATED
        )
    (n,) = struct.unpack("<Q", f.read(8))
    if n == 0 or n > MAX_HEADER or n > size - 8:
        raise BundleError(
            f"{path}: header length {n} does not fit the {size}-byte file (truncated or not a "
            ".kdump bundle)",
            K.TRUNCATED,
        )
    return f.read(n), 8 + n


def parse_header(
    raw: bytes, data_size: int, path: Path, limits: Limits | None = None
) -> tuple[Any, dict[str, tuple[int, int]]]:
    """The manifest JSON (not yet parsed into records) and the inline blobs' byte ranges.

    The inline blobs must fit the data section together, not only one by one (overlapping
    ranges would let a small file declare many large blobs)."""
    limits = limits or Limits()
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BundleError(
            f"{path}: header is not valid JSON (corrupt or not a .kdump bundle)", K.BAD_HEADER
        )
    if not isinstance(header, dict):
        raise BundleError(f"{path}: header is not a JSON object", K.BAD_HEADER)
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get(MANIFEST_KEY), str):
        raise BundleError(
            f"{path}: safetensors file without a kdump manifest (not a .kdump bundle)",
            K.NOT_A_BUNDLE,
        )
    if len(header) > limits.max_blobs:
        raise BundleError(
            f"{path}: header lists {len(header)} blobs, over the limit of {limits.max_blobs}",
            K.LIMIT,
        )
    inline: dict[str, tuple[int, int]] = {}
    total = 0
    for name, entry in header.items():
        offs = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (
            not isinstance(entry, dict)
            or entry.get("dtype") != "U8"
            or not isinstance(offs, list)
            or len(offs) != 2
            or not all(is_int(o) for o in offs)
            or not isinstance(shape, list)
            or len(shape) != 1
            or not is_int(shape[0])
        ):
            raise BundleError(
                f"{path}: blob {name[:16]!r} has a malformed header entry", K.BAD_HEADER
            )
        b, e = offs
        if not 0 <= b <= e <= data_size or e - b != shape[0]:
            raise BundleError(
                f"{path}: blob {name[:16]!r} claims bytes [{b}, {e}) but the data section has "
                f"{data_size} bytes (truncated or corrupt)",
                K.TRUNCATED,
            )
        inline[name] = (b, e)
        total += e - b
    if total > data_size:
        raise BundleError(
            f"{path}: the header's blobs add up to {total} bytes but the data section has "
            f"{data_size} (corrupt: blobs overlap)",
            K.LIMIT,
        )
    try:
        manifest = json.loads(meta[MANIFEST_KEY])
    except (ValueError, RecursionError):
        raise BundleError(f"{path}: kdump manifest is not valid JSON", K.BAD_HEADER)
    return manifest, inline


class _Parser:
    """Turns manifest JSON into records; every message starts with the file and the place."""

    def __init__(self, path: Path, limits: Limits) -> None:
        self.path = path
        self.limits = limits

    def fail(self, where: str, what: str, kind: K = K.SCHEMA) -> BundleError:
        return BundleError(f"{self.path}: {where}{': ' if where else ''}{what}", kind)

    def manifest(self, m: Any) -> Manifest:
        if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
            raise self.fail("", "manifest is not a kdump manifest", K.NOT_A_BUNDLE)
        version = m.get("version")
        if not is_int(version) or version not in SUPPORTED_VERSIONS:
            raise self.fail(
                "",
                f"format version {repr(version)[:40]} is not supported by this kdump (reads "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade kdump-gpu",
                K.UNSUPPORTED_VERSION,
            )
        blobs, calls = m.get("blobs"), m.get("calls")
        if not isinstance(blobs, dict) or not isinstance(calls, list):
            raise self.fail("", "manifest lacks its blob table or call list")
        for key in ("env", "info"):
            if key in m and not isinstance(m[key], dict):
                raise self.fail("", f"manifest field {key!r} is not an object")
        for key in ("writer", "created"):
            if key in m and not isinstance(m[key], str):
                raise self.fail("", f"manifest field {key!r} is not a string")
            self.string(m.get(key, ""), "", key)
        self.count(len(calls), self.limits.max_calls, "", "calls")
        self.count(len(blobs), self.limits.max_blobs, "", "blobs")
        for key in ("env", "info"):
            self.free_json(m.get(key, {}), "", key)
        return Manifest(
            version=version,
            writer=m.get("writer", ""),
            created=m.get("created", ""),
            env=m.get("env", {}),
            info=m.get("info", {}),
            blobs={sha: self.blob(sha, info, version) for sha, info in blobs.items()},
            calls=tuple(self.call(c, i, version) for i, c in enumerate(calls)),
        )

    def count(self, n: int, limit: int, where: str, what: str) -> None:
        if n > limit:
            raise self.fail(where, f"holds {n} {what}, over the limit of {limit}", K.LIMIT)

    def string(self, value: object, where: str, what: str) -> None:
        if isinstance(value, str) and len(value) > self.limits.max_string:
            raise self.fail(
                where,
                f"{what} is a string of {len(value)} characters, over the limit of "
                f"{self.limits.max_string}",
                K.LIMIT,
            )

    def free_json(self, value: Any, where: str, what: str) -> None:
        """Free-form JSON (env, info, meta): bounded in depth, nodes and string length."""
        nodes = 0
        todo = [(value, 0)]
        while todo:
            node, depth = todo.pop()
            nodes += 1
            if nodes > self.limits.max_tree_nodes or depth > self.limits.max_tree_depth:
                raise self.fail(
                    where,
                    f"{what} is nested deeper than {self.limits.max_tree_depth} levels or holds "
                    f"more than {self.limits.max_tree_nodes} values",
                    K.LIMIT,
                )
            if isinstance(node, str):
                self.string(node, where, f"a value in {what}")
            elif isinstance(node, dict):
                for k, v in node.items():
                    self.string(k, where, f"a key in {what}")
                    todo.append((v, depth + 1))
            elif isinstance(node, list):
                todo.extend((v, depth + 1) for v in node)

    def blob(self, sha: str, info: Any, version: int) -> BlobRecord:
        where = _member(Where, info.get("where")) if isinstance(info, dict) else None
        ok = (
            where is not None
            and is_int(info.get("nbytes"))
            and info["nbytes"] >= 0
            and _is_sha(sha)
            and (version < 2 or set(info) <= _BLOB_FIELDS)  # version 1 tolerated extra fields
        )
        if not ok:
            raise self.fail("", f"malformed blob table entry {sha[:16]!r}")
        algo = info.get("checksum", Checksum.SHA256.value)
        checksum = _member(Checksum, algo)
        if checksum is None:
            raise self.fail(
                "",
                f"blob {sha[:12]}… uses checksum {str(algo)[:20]!r}, unknown here; "
                "upgrade kdump-gpu",
            )
        digest = info.get("digest", "")
        want = 0 if checksum is Checksum.SHA256 else XXH3_DIGEST_LEN
        if not isinstance(digest, str) or len(digest) != want or not set(digest) <= _SHA_DIGITS:
            raise self.fail("", f"blob {sha[:12]}… has a malformed {checksum.value} digest")
        return BlobRecord(nbytes=info["nbytes"], where=where, checksum=checksum, digest=digest)

    def storages(self, raw: Any, where: str, version: int) -> tuple[StorageRecord, ...]:
        if not isinstance(raw, list):
            raise self.fail(where, "storages is not a list")
        self.count(len(raw), self.limits.max_storages, where, "storages")
        out = []
        ranges_left = self.limits.max_ranges  # shared by the part's sparse storages
        pieces_left = self.limits.max_pieces  # and its pieced storages' pieces
        for j, s in enumerate(raw):
            if not isinstance(s, dict) or not all(
                is_int(s.get(k)) and s[k] >= 0 for k in _STORAGE_INTS
            ):
                raise self.fail(where, f"storage {j} is malformed")
            if not isinstance(s.get("device"), str) or not isinstance(s.get("blob"), str):
                raise self.fail(where, f"storage {j} lacks its device or blob")
            self.string(s["device"], where, f"storage {j}'s device")
            # A storage without one blob (by-reference, missing, synthetic, pieces) names "".
            if not _is_sha(s["blob"]) and not (
                s["blob"] == "" and s.get("source", "blob") not in ("blob", "sparse")
            ):
                raise self.fail(where, f"storage {j} does not name a blob by its SHA-256")
            extra = set(s) - _STORAGE_FIELDS[version]
            if extra:
                raise self.fail(where, f"storage {j} has unknown fields {sorted(map(str, extra))}")
            raw_source = s.get("source", Source.BLOB.value)  # version 1 knows only blobs
            source = _member(Source, raw_source)
            if source is not None and version < _SINCE.get(source, 1):
                source = None  # a kind is unknown to the versions before the one it came with
            if source is None:
                raise self.fail(
                    where,
                    f"storage {j} has source {str(raw_source)[:40]!r}, unknown to this kdump "
                    f"(it reads {', '.join(k.value for k in Source)}); upgrade kdump-gpu",
                    K.UNKNOWN_SOURCE,
                )
            stats = None
            if "stats" in s:
                stats = self.stats(s["stats"], where, j)
            if source not in (Source.BLOB, Source.SPARSE) and s["blob"]:
                raise self.fail(where, f"storage {j} is {source.value} but names a blob")
            if ("ranges" in s) != (source is Source.SPARSE):
                raise self.fail(where, f"storage {j}: ranges belong to sparse storages (only)")
            if ("generator" in s) != (source is Source.SYNTHETIC):
                raise self.fail(where, f"storage {j}: a generator belongs to synthetic storages")
            if ("pieces" in s) != (source is Source.PIECES):
                raise self.fail(where, f"storage {j}: pieces belong to pieced storages (only)")
            ranges: tuple[tuple[int, int], ...] = ()
            pieces: tuple[tuple[str, int], ...] = ()
            generator = None
            if source is Source.PIECES:
                pieces = self.pieces(s["pieces"], s["span_nbytes"], where, j, pieces_left)
                pieces_left -= len(pieces)
            if source is Source.SPARSE:
                ranges = self.ranges(s["ranges"], s["span_nbytes"], where, j, ranges_left)
                ranges_left -= len(ranges)
            if source is Source.SYNTHETIC:
                generator = self.generator(s["generator"], stats, where, j)
            out.append(
                StorageRecord(
                    **{k: s[k] for k in STORAGE_LAYOUT_FIELDS},
                    blob=s["blob"],
                    source=source,
                    stats=stats,
                    ranges=ranges,
                    generator=generator,
                    pieces=pieces,
                )
            )
        return tuple(out)

    def pieces(
        self, raw: Any, span: int, where: str, j: int, left: int
    ) -> tuple[tuple[str, int], ...]:
        """A pieced storage's pieces: [blob, nbytes] pairs, each non-empty, adding up to the
        span exactly; no more of them than the part's budget (checked before they are read)."""
        if not isinstance(raw, list):
            raise self.fail(where, f"storage {j}: pieces is not a list")
        if len(raw) > left:
            raise self.fail(
                where,
                f"storage {j}: {len(raw)} pieces, over the limit of {self.limits.max_pieces} "
                "per call part",
                K.LIMIT,
            )
        if len(raw) < 2:
            raise self.fail(where, f"storage {j}: a pieced storage has at least two pieces")
        out: list[tuple[str, int]] = []
        total = 0
        for p in raw:
            if not (
                isinstance(p, list)
                and len(p) == 2
                and isinstance(p[0], str)
                and _is_sha(p[0])
                and is_int(p[1])
                and p[1] > 0
            ):
                raise self.fail(
                    where, f"storage {j}: a piece is not a [SHA-256, positive size] pair"
                )
            total += p[1]
            if total > span:
                raise self.fail(
                    where, f"storage {j}: its pieces hold more than the {span}-byte span"
                )
            out.append((p[0], p[1]))
        if total != span:
            raise self.fail(where, f"storage {j}: its pieces hold {total} bytes, the span {span}")
        return tuple(out)

    def ranges(
        self, raw: Any, span: int, where: str, j: int, left: int
    ) -> tuple[tuple[int, int], ...]:
        """A sparse storage's held byte ranges: sorted, disjoint, non-empty, inside the span."""
        if not isinstance(raw, list):
            raise self.fail(where, f"storage {j}: ranges is not a list")
        if len(raw) > left:
            raise self.fail(
                where,
                f"storage {j}: {len(raw)} byte ranges, over the limit of "
                f"{self.limits.max_ranges} per call part",
                K.LIMIT,
            )
        out: list[tuple[int, int]] = []
        end = 0
        for r in raw:
            if not (isinstance(r, list) and len(r) == 2 and is_int(r[0]) and is_int(r[1])):
                raise self.fail(where, f"storage {j}: a byte range is not a pair of integers")
            b, e = r
            if not end <= b < e <= span:
                raise self.fail(
                    where,
                    f"storage {j}: byte range [{b}, {e}) is empty, overlaps or precedes the one "
                    f"before it, or leaves the {span}-byte span",
                )
            out.append((b, e))
            end = e
        return tuple(out)

    def generator(self, raw: Any, stats: Stats | None, where: str, j: int) -> GeneratorRecord:
        """A synthetic storage's generator: one of kdump's, over finite, ordered stats."""
        if not isinstance(raw, dict) or set(raw) != {"name", "version", "seed"}:
            raise self.fail(where, f"storage {j}: generator is not {{name, version, seed}}")
        if stats is None:
            raise self.fail(where, f"storage {j}: a synthetic storage needs its stats")
        why = refusal(raw["name"], raw["version"], raw["seed"], stats.dtype)
        if why is not None:
            raise self.fail(where, f"storage {j}: {why}")
        values = (stats.min, stats.max, stats.mean, stats.std)
        if not all(math.isfinite(v) for v in values) or stats.min > stats.max or stats.std < 0:
            raise self.fail(
                where, f"storage {j}: synthetic stats must be finite, min <= max and std >= 0"
            )
        return GeneratorRecord(raw["name"], raw["version"], raw["seed"])

    def stats(self, raw: Any, where: str, j: int) -> Stats:
        ok = (
            isinstance(raw, dict)
            and set(raw) <= {"dtype", "checksum", *_STATS_FLOATS}
            and isinstance(raw.get("dtype"), str)
            and raw["dtype"] in DTYPE_SIZES
            and isinstance(raw.get("checksum", ""), str)
            and all(
                isinstance(raw.get(k), (int, float)) and not isinstance(raw.get(k), bool)
                for k in _STATS_FLOATS
            )
        )
        if not ok:
            raise self.fail(where, f"storage {j} has malformed stats")
        try:
            values = {k: float(raw[k]) for k in _STATS_FLOATS}
        except OverflowError:  # an integer beyond float range
            raise self.fail(where, f"storage {j} has stats out of float range") from None
        return Stats(dtype=raw["dtype"], checksum=raw.get("checksum", ""), **values)

    def tensors(self, raw: Any, where: str) -> tuple[TensorRecord, ...]:
        if not isinstance(raw, list):
            raise self.fail(where, "tensors is not a list")
        self.count(len(raw), self.limits.max_tensors, where, "tensors")
        out = []
        for j, t in enumerate(raw):
            if (
                not isinstance(t, dict)
                or not is_int(t.get("storage"))
                or not isinstance(t.get("dtype"), str)
                or not isinstance(t.get("shape"), list)
                or not isinstance(t.get("stride"), list)
                or len(t["shape"]) + len(t["stride"]) > 64  # far above MAX_NDIM; checked later
                or not is_int(t.get("storage_offset"))
                or not all(is_int(x) for x in t["shape"] + t["stride"])
                or not isinstance(t.get("requires_grad", False), bool)
                or not is_int(t.get("data_ptr", 0))
            ):
                raise self.fail(where, f"tensor {j} is malformed")
            self.string(t["dtype"], where, f"tensor {j}'s dtype")
            out.append(tensor_from_json(t))
        return tuple(out)

    def call(self, c: Any, i: int, version: int) -> CallEntry:
        where = f"call {i}"
        if not isinstance(c, dict) or c.get("index") != i or not is_int(c.get("index")):
            raise self.fail("", f"{where} is malformed or out of order")
        for key in ("target", "called_as"):
            if not isinstance(c.get(key), str):
                raise self.fail("", f"{where} lacks its {key}")
            self.string(c[key], where, key)
        for key in ("names", "outputs"):  # both may be null, neither may be missing
            if key not in c:
                raise self.fail("", f"{where} lacks its {key!r} field")
        names = c["names"]
        if names is not None and (
            not isinstance(names, list) or not all(isinstance(n, str) for n in names)
        ):
            raise self.fail(where, "names is not a list of strings")
        if names is not None:
            self.count(len(names), self.limits.max_tensors, where, "parameter names")
            for n in names:
                self.string(n, where, "a parameter name")
        if not isinstance(c.get("args"), list) or not isinstance(c.get("kwargs"), dict):
            raise self.fail(where, "args/kwargs malformed")
        if not isinstance(c.get("meta"), dict):
            raise self.fail(where, "meta is not an object")
        self.free_json(c["meta"], where, "meta")
        self.count(len(c["args"]) + len(c["kwargs"]), self.limits.max_tree_nodes, where, "args")
        for k in c["kwargs"]:
            self.string(k, where, "a keyword name")
        return CallEntry(
            index=i,
            target=c["target"],
            called_as=c["called_as"],
            names=tuple(names) if names is not None else None,
            args=c["args"],
            kwargs=c["kwargs"],
            storages=self.storages(c.get("storages"), where, version),
            tensors=self.tensors(c.get("tensors"), where),
            outputs=self.outputs(c["outputs"], where + " outputs", version),
            meta=c["meta"],
            launch=self.launch(c.get("launch"), where + " launch", version),
        )

    def launch(self, raw: Any, where: str, version: int) -> LaunchRecord | None:
        """A JIT kernel's launch record (version 6, optional: absent or null for other calls)."""
        if raw is None:
            return None
        if version < 6:
            raise self.fail(where, f"launch records came with version 6, not {version}")
        fields = {"kind", "grid", "options", "constexprs", "source_sha256", "version"}
        if not isinstance(raw, dict) or set(raw) != fields:
            raise self.fail(where, f"is not an object of exactly {sorted(fields)}")
        if raw["kind"] not in LAUNCH_KINDS:
            raise self.fail(where, f"kind {str(raw['kind'])[:40]!r} is not one of {LAUNCH_KINDS}")
        grid = raw["grid"]
        if (
            not isinstance(grid, list)
            or not 1 <= len(grid) <= 3
            or not all(is_int(g) and 0 <= g <= MAX_GRID for g in grid)
        ):
            raise self.fail(where, f"grid is not 1 to 3 integers in [0, {MAX_GRID}]")
        options, constexprs = raw["options"], raw["constexprs"]
        if not isinstance(options, dict) or not all(
            o is None or isinstance(o, (bool, str)) or is_int(o) for o in options.values()
        ):
            raise self.fail(where, "options is not an object of null, boolean, integer or string")
        if not isinstance(constexprs, list) or not all(isinstance(n, str) for n in constexprs):
            raise self.fail(where, "constexprs is not a list of strings")
        self.count(len(options) + len(constexprs), self.limits.max_tensors, where, "names")
        for text in [*options, *(o for o in options.values() if isinstance(o, str)), *constexprs]:
            self.string(text, where, "a launch option or parameter name")
        sha = raw["source_sha256"]
        if not isinstance(sha, str) or len(sha) != 64 or not set(sha) <= _SHA_DIGITS:
            raise self.fail(where, "source_sha256 is not 64 lowercase hex digits")
        if not isinstance(raw["version"], str):
            raise self.fail(where, "version is not a string")
        self.string(raw["version"], where, "version")
        return LaunchRecord(
            kind=raw["kind"],
            grid=tuple(grid),
            options=dict(options),
            constexprs=tuple(constexprs),
            source_sha256=sha,
            version=raw["version"],
        )

    def outputs(self, out: Any, where: str, version: int) -> OutputsRecord | None:
        if out is None:
            return None
        if not isinstance(out, dict):
            raise self.fail(where, "outputs is malformed")
        inplace = out.get("inplace")
        if isinstance(inplace, list):
            self.count(len(inplace), self.limits.max_tensors, where, "in-place pairs")
        if not isinstance(inplace, list) or not all(
            isinstance(p, list) and len(p) == 2 and is_int(p[0]) and is_int(p[1]) for p in inplace
        ):
            raise self.fail(where, "outputs.inplace is malformed")
        return OutputsRecord(
            storages=self.storages(out.get("storages"), where, version),
            tensors=self.tensors(out.get("tensors"), where),
            inplace=tuple((p[0], p[1]) for p in inplace),
            returned=out.get("returned"),
        )


def parse_manifest(m: Any, path: Path, limits: Limits | None = None) -> Manifest:
    """Manifest JSON -> typed records (BundleError, kind SCHEMA and others, on any mistyping;
    kind LIMIT where a count or a string is over `limits`)."""
    return _Parser(path, limits or Limits()).manifest(m)
