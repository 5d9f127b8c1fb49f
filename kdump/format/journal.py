"""The flight recorder's journal in code, torch-free: its layout, typed records and encoding.

The writer (kdump.record.flight.journal) and the reader (kdump.record.flight.journal_reader) both
build on what is defined here: the file header's and the slot's fixed parts, the slot JSON (written
from a `SlotMeta`, parsed back into one) and the records a read returns. docs/FORMAT.md is the
normative description.

The journal is one file (in /dev/shm by default) mapped into the recording process. It survives
abort and SIGKILL because the bytes live in the page cache, not in the process; `salvage` turns
its complete slots into bundles after the process died. Every integer is little-endian.

File header (at offset 0; slot 0 starts at `header_bytes`, a multiple of 4096):

    offset  size  field
    0       8     magic b"KDJRNL\\0\\1"
    8       4     format version (JOURNAL_VERSION)
    12      4     header_bytes: where slot 0 starts
    16      4     slot_count
    20      4     reserved (0)
    24      8     slot_bytes: size of every slot (a multiple of 64)
    32      8     pid of the recording process
    40      8     creation time, Unix seconds (float64)
    48      4     host name length H (at most 255)
    52      4     process block length P
    56      H     host name, UTF-8
    56+H    P     process block: compact JSON object (argv, an environment subset; given by the
                  caller)
    56+H+P  4     CRC-32 of bytes [0, 56+H+P)

Slot (slot i starts at header_bytes + i * slot_bytes):

    offset  size  field
    0       4     magic b"KDSL" (zero while the slot is being refilled)
    4       4     flags: bit 0 completed after the kernel, bit 1 some payloads missing
    8       8     seq: 1, 2, 3, ... across the whole ring (0: never used)
    16      8     call index (per process)
    24      4     target id (the process' number for the target; its name is in the JSON)
    28      4     payload count K: one per storage, then one per entry of "outputs"
    32      8     stream id
    40      8     capture id (0: not capturing)
    48      8     graph id (0: not in a graph)
    56      8     replay counter
    64      4     JSON length J
    68      4     CRC-32 of the slot header: bytes [0, 68) then [72, 72 + 16K + J)
    72      16K   payload table: K pairs (offset from the slot's start, length), u64 each
    72+16K  J     compact JSON: target, called_as, names, args, kwargs (argument trees),
                  for a JIT kernel's launch only "launch" (the bundle's launch record, FORMAT.md
                  §5.6; absent for every other call, so older readers skip it), storages
                  (with "payload": table index or null when missing), tensors (dtype, shape,
                  stride, storage_offset, nbytes, data_ptr), extra meta; since
                  version 4 extra's last member may be "outputs": the storages whose bytes
                  are copied again after the call, [{"storage": j, "tensors": [tensor
                  indices], "payload": table index (after the storages' entries) or null
                  when it did not fit}]
    ...           payloads, each at a 64-byte aligned offset, before the call record: the
                  storages' (before the call), then the outputs' (after it)
    S-128   64    call record: what the device snapshot wrote for this call (device slot, rows,
                  token; kdump.record.flight.devring), zero without a device tier
    S-64    64    trailer: magic b"KDTR" (b"KDTX" while refilling), flags (bit 0: the
                  checksum covers the payloads; bit 1: device copies write the payloads after
                  the trailer), seq (u64), CRC-32 of the slot header bytes [0, 72 + 16K + J)
                  and, with bit 0, of every storage's payload in table order (u32; never the
                  outputs' payloads), 4 zero bytes, then four u64 markers: `pre` (written before
                  the payloads), `post` (after them), `done` (after the kernel), `out` (after
                  the outputs' copies that follow the kernel; version 4, zero in version 3),
                  then 8 zero bytes

Markers: each holds a token: for an eager call its seq where the snapshot kernel writes them (1
where the host or the torch fallback does), the replay number for a slot refreshed by a
CUDA graph (a device-side counter the graph increments, copied by the graph itself). A slot whose
`post` is 0 or differs from `pre` holds no consistent payloads (they were being copied at the
crash): it reads as in flight. Otherwise it is complete, and `done == post` says the kernel
finished; `done < post` that it was running (or queued) when the process died, or, for a
CUDA-graph site, that no later recorded call of its graph had started yet (the next snapshot of
the site's chain writes its `done`: kdump.record.flight.devcopy).

Device payloads are copied on the call's stream, so the stream order (markers, payloads, kernel,
marker) replaces the payload checksum there.

Outputs (version 4): the payloads of the "outputs" entries are copied after the kernel on the
call's stream (under CUDA-graph capture: captured nodes after the kernel, refreshed by every
replay), then the call's token into `out`. They hold the call's results exactly when `out`
equals the token of the slot's payloads (`post`, or the device twin's for a slot completed from
it); no checksum covers them (they are written after `commit`), the marker orders them.

Writing a slot: the old trailer is replaced by a refill marker (magic b"KDTX", the new seq, zero
flags and checksum), then the header's magic is zeroed, then the new table and JSON are written
and the fixed part last; the payloads are copied; `commit` writes the trailer. A crash at any
moment therefore leaves a slot that reads as torn (refill marker over the old header, or
checksums that fail), in flight (a valid header whose seq the refill marker names), or complete;
never an old header with new payloads, nor an old call reported as in flight.

CRC-32 (zlib) is the checksum: it is in the standard library, runs at memory speed, and catches
torn writes and stray bytes with certainty up to 32-bit bursts; nothing here is adversarial, so a
cryptographic hash would only cost time in the recording process.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdump.errors import UsageError
from kdump.format.records import LaunchRecord

JOURNAL_MAGIC = b"KDJRNL\x00\x01"
# 2: 64-byte trailer with the pre/post/done markers; 3: call record; 4: post-call output
# payloads (extra's "outputs", the trailer's `out` marker)
JOURNAL_VERSION = 4
READ_VERSIONS = (3, 4)  # a version-3 journal is a version-4 one without outputs
DEFAULT_DIR = Path("/dev/shm")  # where journals are made and looked for by default
FILE_PREFIX = "kdump-journal-"
RUN_PREFIX = "kdump-run-"  # a `kdump record` run's folder of journals under the journal folder
PAGE = 4096
ALIGN = 64  # payload alignment inside a slot
MAX_HOST = 255
MAX_PROCESS_JSON = 1 << 20
MIN_SLOT_BYTES = 1024

FILE_FIXED = struct.Struct("<8sIIIIQQdII")  # through the process block length
SLOT_FIXED = struct.Struct("<4sIQQIIQQQQI")  # through the JSON length
SLOT_CRC = struct.Struct("<I")
SLOT_HEAD = SLOT_FIXED.size + SLOT_CRC.size  # 72: where the payload table starts
TABLE_ENTRY = struct.Struct("<QQ")
TRAILER = struct.Struct("<4sIQI4xQQQQ8x")
U64 = struct.Struct("<Q")  # a slot's seq (at offset 8) and the trailer's markers
TRAILER_BYTES = TRAILER.size
MARKER_AT = {"pre": 24, "post": 32, "done": 40, "out": 48}  # offsets inside the trailer
SLOT_MAGIC = b"KDSL"
TRAILER_MAGIC = b"KDTR"
REFILL_MAGIC = b"KDTX"  # the trailer of a slot being refilled: names the seq being written
FLAG_AFTER_KERNEL = 1
FLAG_MISSING = 2
TRAILER_FLAG_PAYLOAD_CRC = 1
TRAILER_FLAG_DEVICE = 2
# Before the trailer: the device snapshot's call record (snapshot.cu's Record, whose size the
# kernel is given as a -D flag): magic, rows, seq, token, pos, done_blocks, row_counter, complete,
# call_index, head_after. The one definition of its layout.
CALL_RECORD = struct.Struct("<IIQQQIIQQQ")
CALL_RECORD_BYTES = CALL_RECORD.size  # 64
CALL_RECORD_COMPLETE_AT = struct.calcsize("<IIQQQII")  # 40: `complete`, the token once it ran


class JournalError(UsageError):
    """The journal cannot be created, written or read (not a journal, truncated, no space): a
    usage or environment error (exit 2), as an unreadable bundle is."""


class SlotTooSmall(JournalError):
    """One call's metadata does not fit a slot: that call cannot be recorded, the next may."""


class SlotState(enum.Enum):
    COMPLETE = "complete"  # header, payloads and trailer agree
    IN_FLIGHT = "in flight"  # header written, trailer missing: the call was being recorded
    TORN = "torn"  # checksums or bounds fail: a write was cut short or bytes were damaged
    EMPTY = "empty"  # never used


@dataclass(frozen=True)
class SlotMeta:
    """What the host knows about one call when it reserves a slot. JSON-able values only."""

    call_index: int
    target: str
    target_id: int = 0
    called_as: str = ""
    names: list[str] | None = None
    args: list[Any] = field(default_factory=list)  # argument trees (kdump.format.argtree)
    kwargs: dict[str, Any] = field(default_factory=dict)
    # kdump.format.records' storage_layout_json each (and the static region's keys: version,
    # static, lazy); tensor_json(nbytes=True) each
    storages: list[dict[str, Any]] = field(default_factory=list)
    tensors: list[dict[str, Any]] = field(default_factory=list)
    stream: int = 0
    capture_id: int = 0
    graph_id: int = 0
    replay: int = 0
    after_kernel: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Storages whose bytes are copied again after the call, each {"storage": j, "tensors":
    # [tensor indices]} (the outputs the call may write); their payloads follow the storages'.
    outputs: list[dict[str, Any]] = field(default_factory=list)
    # A JIT kernel's launch record as the bundle writes it (records.launch_json), or None.
    launch: dict[str, Any] | None = None


@dataclass(frozen=True)
class JournalHeader:
    version: int
    header_bytes: int
    slot_count: int
    slot_bytes: int
    pid: int
    host: str
    created: float
    process: dict[str, Any]


@dataclass(frozen=True)
class SlotRecord:
    """One slot as read back. `payloads` is filled for complete slots only."""

    index: int
    state: SlotState
    seq: int = 0
    meta: SlotMeta | None = None
    payloads: tuple[bytes | None, ...] = ()  # per storage: its bytes, or None when missing
    reason: str = ""  # why a slot is torn or in flight
    finished: bool = False  # complete slots: the kernel ran to its end
    token: int = 0  # the markers' token: an eager call's seq or 1, a graph slot's replay number
    spans: tuple[tuple[int, int] | None, ...] = ()  # per storage: (offset, length) when present
    markers: tuple[int, int, int] = (0, 0, 0)  # pre, post, done as read
    call_record: bytes = b""  # the device snapshot's call record (zeros for host-copied slots)
    # Per entry of `meta.outputs`: the bytes its payload holds (None: it did not fit), read for
    # complete and in-flight slots alike; they are the call's results only when `out_marker`
    # equals the token (`outputs_held`).
    output_bytes: tuple[bytes | None, ...] = ()
    out_marker: int = 0

    @property
    def outputs_held(self) -> bool:
        """Whether the outputs' payloads hold this call's (this replay's) post-call bytes."""
        return self.out_marker != 0 and self.out_marker == self.token


@dataclass(frozen=True)
class JournalContents:
    path: Path
    header: JournalHeader
    slots: list[SlotRecord]  # newest first; torn slots without a readable seq, then empty ones

    def having(self, state: SlotState) -> list[SlotRecord]:
        return [s for s in self.slots if s.state is state]


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def encode_file_header(
    slots: int, slot_bytes: int, pid: int, host: str, created: float, process: dict[str, Any]
) -> bytes:
    host_b = host.encode()[:MAX_HOST]
    proc = json.dumps(process, separators=(",", ":"), default=str).encode()
    if len(proc) > MAX_PROCESS_JSON:
        raise JournalError(
            f"process block is {len(proc)} bytes, over {MAX_PROCESS_JSON}: pass fewer variables"
        )
    body = len(host_b) + len(proc) + FILE_FIXED.size + 4
    header_bytes = round_up(body, PAGE)
    raw = FILE_FIXED.pack(
        JOURNAL_MAGIC,
        JOURNAL_VERSION,
        header_bytes,
        slots,
        0,
        slot_bytes,
        pid,
        created,
        len(host_b),
        len(proc),
    )
    raw += host_b + proc
    return raw + struct.pack("<I", zlib.crc32(raw))


def parse_file_header(raw: bytes, p: Path, whole: bool = True) -> JournalHeader:
    """The file header of `raw` (a journal's first bytes; `whole`: the whole file), checked
    strictly: JournalError names what is wrong with `p`."""
    if len(raw) < FILE_FIXED.size + 4 or raw[:8] != JOURNAL_MAGIC:
        raise JournalError(f"{p}: not a kdump journal (bad magic or too short)")
    (_, version, header_bytes, slots, _, slot_bytes, pid, created, hlen, plen) = (
        FILE_FIXED.unpack_from(raw)
    )
    if version not in READ_VERSIONS:
        known = ", ".join(map(str, READ_VERSIONS))
        raise JournalError(
            f"{p}: journal format version {version} is not supported (reads {known}); "
            "salvage it with the kdump that recorded it"
        )
    end = FILE_FIXED.size + hlen + plen
    if hlen > MAX_HOST or plen > MAX_PROCESS_JSON or end + 4 > len(raw) or end + 4 > header_bytes:
        raise JournalError(f"{p}: journal header is truncated or corrupt")
    (crc,) = struct.unpack_from("<I", raw, end)
    if crc != zlib.crc32(raw[:end]):
        raise JournalError(f"{p}: journal header checksum mismatch (corrupt file)")
    if slots < 1 or slot_bytes < MIN_SLOT_BYTES or slot_bytes % ALIGN or header_bytes % PAGE:
        raise JournalError(f"{p}: journal header describes an impossible ring")
    if whole and len(raw) < header_bytes:
        raise JournalError(f"{p}: journal is truncated inside its header")
    try:
        host = raw[FILE_FIXED.size : FILE_FIXED.size + hlen].decode()
        process = json.loads(raw[FILE_FIXED.size + hlen : end])
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise JournalError(f"{p}: journal header holds invalid text")
    if not isinstance(process, dict):
        raise JournalError(f"{p}: journal process block is not an object")
    return JournalHeader(version, header_bytes, slots, slot_bytes, pid, host, created, process)


# ---------------------------------------------------------------------------------------------
# The slot JSON: written from a SlotMeta, parsed back into one (never trusting the file).


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), default=str).encode()


def head_json(meta: SlotMeta) -> bytes:
    """The slot JSON from its opening brace through `kwargs`."""
    doc = {
        "target": meta.target,
        "called_as": meta.called_as or meta.target,
        "names": meta.names,
        "args": meta.args,
        "kwargs": meta.kwargs,
    }
    if meta.launch is not None:
        doc["launch"] = meta.launch
    return dumps(doc)[:-1]


def extra_json(meta: SlotMeta, n_in: int, present: Sequence[bool]) -> bytes:
    """The slot JSON's "extra" object; with outputs, its last member "outputs": each entry with
    its payload's table index (after the storages' entries) or null when it did not fit."""
    extra = {k: v for k, v in meta.extra.items() if k != "outputs"} if meta.outputs else meta.extra
    doc = dumps(extra)
    if not meta.outputs:
        return doc
    items = [
        {"storage": o["storage"], "tensors": o["tensors"], "payload": n_in + m if p else None}
        for m, (o, p) in enumerate(zip(meta.outputs, present))
    ]
    return doc[:-1] + (b"," if extra else b"") + b'"outputs":' + dumps(items) + b"}"


def payload_sizes(meta: SlotMeta) -> list[int]:
    """Every payload's size in table order: the storages', then the outputs' (their storages')."""
    sizes = [int(s.get("span_nbytes", 0)) for s in meta.storages]
    return sizes + [sizes[int(o["storage"])] for o in meta.outputs]


def storages_json(storages: Sequence[dict[str, Any]], present: Sequence[bool]) -> bytes:
    # Before placement every storage claims a payload; placement may take some back.
    return dumps(
        [{**s, "payload": i if p else None} for i, (s, p) in enumerate(zip(storages, present))]
    )


def place_sizes(
    sizes: Sequence[int], head_end: int, limit: int, want: Sequence[bool] | None = None
) -> list[tuple[int, int] | None]:
    """Payload spans in order, each 64-byte aligned, first fit; what does not fit (or is not
    wanted) is None."""
    spans: list[tuple[int, int] | None] = []
    pos = round_up(head_end, ALIGN)
    for j, n in enumerate(sizes):
        if (want is None or want[j]) and pos + n <= limit:
            spans.append((pos, n))
            pos = round_up(pos + n, ALIGN)
        else:
            spans.append(None)
    return spans


class SlotTorn(Exception):
    """A slot's bytes do not hold a consistent call (the reader reads the slot as torn)."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _names_ok(names: Any) -> bool:
    return names is None or (isinstance(names, list) and all(isinstance(n, str) for n in names))


def parse_meta(
    doc: bytes, flags: int, call_index: int, target_id: int, k: int, ids: tuple[int, ...]
) -> tuple[SlotMeta, list[bool]]:
    """The SlotMeta of a slot's JSON `doc` and its fixed fields (`ids`: stream, capture id, graph
    id, replay), with which of its `k` payloads are present; SlotTorn when they disagree."""
    try:
        d = json.loads(doc)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise SlotTorn("slot JSON does not parse")
    if not isinstance(d, dict):
        raise SlotTorn("slot JSON is not an object")
    storages, tensors = d.get("storages"), d.get("tensors")
    names = d.get("names")
    if (
        not isinstance(d.get("target"), str)
        or not isinstance(d.get("called_as"), str)
        or not isinstance(d.get("args"), list)
        or not isinstance(d.get("kwargs"), dict)
        or not isinstance(d.get("extra"), dict)
        or not isinstance(storages, list)
        or not isinstance(tensors, list)
        or not all(isinstance(s, dict) for s in storages + tensors)
        or not _names_ok(names)
        or not _launch_ok(d.get("launch"))
    ):
        raise SlotTorn("slot JSON lacks fields or has the wrong types")
    outputs = _parse_outputs(d["extra"].get("outputs", []), len(storages), len(tensors))
    if len(storages) + len(outputs) != k:
        raise SlotTorn("slot JSON lacks fields or has the wrong types")
    present = []
    for j, s in enumerate(storages):
        if not _is_int(s.get("span_nbytes")) or s["span_nbytes"] < 0:
            raise SlotTorn(f"storage {j} has no valid span_nbytes")
        pay = s.get("payload")
        if pay is not None and pay != j:
            raise SlotTorn(f"storage {j} names payload {pay!r}")
        present.append(pay is not None)
    for m, o in enumerate(outputs):
        pay = o.pop("payload")
        if pay is not None and pay != len(storages) + m:
            raise SlotTorn(f"output {m} names payload {pay!r}")
        present.append(pay is not None)
    stream, capture, graph, replay = ids
    meta = SlotMeta(
        call_index=call_index,
        target=d["target"],
        target_id=target_id,
        called_as=d["called_as"],
        names=names,
        args=d["args"],
        kwargs=d["kwargs"],
        storages=[{k2: v for k2, v in s.items() if k2 != "payload"} for s in storages],
        tensors=tensors,
        stream=stream,
        capture_id=capture,
        graph_id=graph,
        replay=replay,
        after_kernel=bool(flags & FLAG_AFTER_KERNEL),
        extra=d["extra"],
        outputs=outputs,
        launch=d.get("launch"),
    )
    return meta, present


_LAUNCH_TYPES = {
    "kind": str,
    "grid": list,
    "options": dict,
    "constexprs": list,
    "source_sha256": str,
    "version": str,
}


def _launch_ok(raw: Any) -> bool:
    """A launch record's shape (absent is fine); its values are checked strictly where the
    salvaged bundle is read (kdump.format.parse)."""
    if raw is None:
        return True
    return (
        isinstance(raw, dict)
        and set(raw) == set(_LAUNCH_TYPES)
        and all(isinstance(raw[k], t) for k, t in _LAUNCH_TYPES.items())
        and all(_is_int(g) for g in raw["grid"])
    )


def launch_record(raw: dict[str, Any] | None) -> LaunchRecord | None:
    """The LaunchRecord of a slot's "launch" (checked by `_launch_ok` when it was read)."""
    if raw is None:
        return None
    return LaunchRecord(
        kind=raw["kind"],
        grid=tuple(raw["grid"]),
        options=dict(raw["options"]),
        constexprs=tuple(raw["constexprs"]),
        source_sha256=raw["source_sha256"],
        version=raw["version"],
    )


def _parse_outputs(raw: Any, n_storages: int, n_tensors: int) -> list[dict[str, Any]]:
    """The slot JSON's "outputs" checked: storages and tensors in range (SlotTorn otherwise)."""
    if not isinstance(raw, list):
        raise SlotTorn("slot JSON's outputs is not a list")
    out = []
    for m, o in enumerate(raw):
        if not isinstance(o, dict):
            raise SlotTorn(f"output {m} is not an object")
        j, tensors, pay = o.get("storage"), o.get("tensors"), o.get("payload")
        if (
            not _is_int(j)
            or not 0 <= j < n_storages
            or not isinstance(tensors, list)
            or not all(_is_int(i) and 0 <= i < n_tensors for i in tensors)
            or not (pay is None or _is_int(pay))
        ):
            raise SlotTorn(f"output {m} names no valid storage, tensors or payload")
        out.append({"storage": j, "tensors": list(tensors), "payload": pay})
    return out


def check_spans(
    spans: list[tuple[int, int]], present: list[bool], meta: SlotMeta, lo: int, hi: int
) -> None:
    """The present payloads' table entries: each of its payload's size, in order, without
    overlap, inside [lo, hi) (SlotTorn otherwise)."""
    pos = lo
    sizes = payload_sizes(meta)
    for j, ((off, n), ok) in enumerate(zip(spans, present)):
        if not ok:
            continue
        if n != sizes[j] or off < pos or off + n > hi:
            raise SlotTorn(f"payload {j} lies outside the slot or overlaps another")
        pos = off + n
