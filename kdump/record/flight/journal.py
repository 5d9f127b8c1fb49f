"""The flight recorder's host-tier journal: the last N calls of a process in a crash-proof ring.

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
                  storages (with "payload": table index or null when missing), tensors (dtype,
                  shape, stride, storage_offset, nbytes, data_ptr), extra meta; since
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

import array
import ctypes
import enum
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kdump.errors import ExitCode, KdumpError

JOURNAL_MAGIC = b"KDJRNL\x00\x01"
# 2: 64-byte trailer with the pre/post/done markers; 3: call record; 4: post-call output
# payloads (extra's "outputs", the trailer's `out` marker)
JOURNAL_VERSION = 4
READ_VERSIONS = (3, 4)  # a version-3 journal is a version-4 one without outputs
DEFAULT_DIR = Path("/dev/shm")
FILE_PREFIX = "kdump-journal-"
RUN_PREFIX = "kdump-run-"  # a `kdump record` run's folder of journals under the journal folder
DEFAULT_SLOTS = 64
DEFAULT_SLOT_BYTES = 1 << 20
PAGE = 4096
ALIGN = 64  # payload alignment inside a slot
MAX_HOST = 255
MAX_PROCESS_JSON = 1 << 20
SHM_SHARE = 0.5  # the ring takes at most this share of the free space (NCCL needs /dev/shm too)

_FILE_FIXED = struct.Struct("<8sIIIIQQdII")  # through the process block length
_SLOT_FIXED = struct.Struct("<4sIQQIIQQQQI")  # through the JSON length
_SLOT_CRC = struct.Struct("<I")
_SLOT_HEAD = _SLOT_FIXED.size + _SLOT_CRC.size  # 72: where the payload table starts
_TABLE_ENTRY = struct.Struct("<QQ")
_TRAILER = struct.Struct("<4sIQI4xQQQQ8x")
_U64 = struct.Struct("<Q")  # a slot's seq (at offset 8) and the trailer's markers
_ZERO4 = bytes(4)
_memmove = ctypes.memmove
_SHIFTS_MAX = 256  # body lengths whose `_CrcShift` a journal shares between templates
_MARKER_AT = {"pre": 24, "post": 32, "done": 40, "out": 48}  # offsets inside the trailer
_DONE_AT = _MARKER_AT["done"] - _TRAILER.size  # the done marker, from the slot's end
TRAILER_BYTES = _TRAILER.size
MARKER_AT = dict(_MARKER_AT)
SLOT_MAGIC = b"KDSL"
TRAILER_MAGIC = b"KDTR"
REFILL_MAGIC = b"KDTX"  # the trailer of a slot being refilled: names the seq being written
FLAG_AFTER_KERNEL = 1
FLAG_MISSING = 2
TRAILER_FLAG_PAYLOAD_CRC = 1
TRAILER_FLAG_DEVICE = 2
MIN_SLOT_BYTES = 1024
CALL_RECORD_BYTES = 64  # before the trailer: the device snapshot's call record (devring)

log = logging.getLogger("kdump.record.flight.journal")


class JournalError(KdumpError):
    """The journal cannot be created, written or read (not a journal, truncated, no space)."""

    exit_code = ExitCode.USAGE


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
    args: list[Any] = field(default_factory=list)  # argument trees (kdump.bundle.argtree)
    kwargs: dict[str, Any] = field(default_factory=dict)
    storages: list[dict[str, Any]] = field(default_factory=list)  # StorageRecord fields
    tensors: list[dict[str, Any]] = field(default_factory=list)  # TensorRecord fields
    stream: int = 0
    capture_id: int = 0
    graph_id: int = 0
    replay: int = 0
    after_kernel: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Storages whose bytes are copied again after the call, each {"storage": j, "tensors":
    # [tensor indices]} (the outputs the call may write); their payloads follow the storages'.
    outputs: list[dict[str, Any]] = field(default_factory=list)


def meta_from_call(call: Any, call_index: int, **fields: Any) -> SlotMeta:
    """A SlotMeta from a `kdump.bundle.CallRecord` (its inputs' layouts; bytes go to payloads)."""
    layout = ("device", "base_ptr", "storage_nbytes", "span_start", "span_nbytes")
    storages = [{k: getattr(s, k) for k in layout} for s in call.inputs.storages]
    tensors = []
    for t in call.inputs.tensors:
        d = asdict(t)
        d["shape"], d["stride"] = list(t.shape), list(t.stride)
        d["nbytes"] = t.numel * t.itemsize
        tensors.append(d)
    return SlotMeta(
        call_index=call_index,
        target=call.target,
        called_as=call.called_as,
        names=call.names,
        args=call.args,
        kwargs=call.kwargs,
        storages=storages,
        tensors=tensors,
        extra=dict(call.meta),
        **fields,
    )


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


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _encode_file_header(
    slots: int, slot_bytes: int, pid: int, host: str, created: float, process: dict[str, Any]
) -> bytes:
    host_b = host.encode()[:MAX_HOST]
    proc = json.dumps(process, separators=(",", ":"), default=str).encode()
    if len(proc) > MAX_PROCESS_JSON:
        raise JournalError(
            f"process block is {len(proc)} bytes, over {MAX_PROCESS_JSON}: pass fewer variables"
        )
    body = len(host_b) + len(proc) + _FILE_FIXED.size + 4
    header_bytes = _round_up(body, PAGE)
    raw = _FILE_FIXED.pack(
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


def fit_slots(directory: Path, header_bytes: int, slots: int, slot_bytes: int) -> int:
    """How many slots the ring gets in `directory`: `slots`, or fewer when space is short (with
    one log line saying how to fix it). Refuses (JournalError) when not even one fits."""
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise JournalError(f"{directory}: cannot check free space ({exc.strerror}); pick a folder")
    free = st.f_bavail * st.f_frsize
    budget = int(free * SHM_SHARE) - header_bytes
    fits = max(0, budget // slot_bytes)
    if fits >= slots:
        return slots
    mib = free / (1 << 20)
    if fits == 0:
        raise JournalError(
            f"{directory} has {mib:.0f} MiB free, not enough for one {slot_bytes}-byte journal "
            "slot: give the container more shared memory (docker run --shm-size=1g) or use "
            "smaller slots"
        )
    log.warning(
        "kdump: flight recorder ring shrunk to %d of %d slots: %s has %.0f MiB free; give the "
        "container more shared memory (docker run --shm-size=1g) or record fewer slots",
        fits,
        slots,
        directory,
        mib,
    )
    return fits


def default_path(directory: Path = DEFAULT_DIR) -> Path:
    return directory / f"{FILE_PREFIX}{os.getpid()}-{time.time_ns():x}"


class SlotTemplate:
    """The header of a repeated call (`Journal.template`): its JSON cut where per-call integers
    go, what its payloads want and their sizes, the fixed header's constant fields, and the
    payload placement of the last JSON start offset it was used with."""

    __slots__ = (
        "capture_id",
        "flags",
        "format",
        "graph_id",
        "k",
        "k_in",
        "parts",
        "placed",
        "replay",
        "sizes",
        "target_id",
        "want",
    )

    def __init__(
        self,
        parts: tuple[bytes, ...],
        want: tuple[bool, ...],
        sizes: tuple[int, ...],
        target_id: int,
        capture_id: int,
        graph_id: int,
        replay: int,
        flags: int,
        k_in: int | None = None,
    ) -> None:
        self.parts = parts
        self.format = _format(parts)  # `reserve_from` fills it with a call's values
        self.want = want
        self.sizes = sizes
        self.k = len(sizes)
        self.k_in = self.k if k_in is None else k_in  # the storages' payloads; outputs follow
        self.target_id = target_id
        self.capture_id = capture_id
        self.graph_id = graph_id
        self.replay = replay
        self.flags = flags  # FLAG_AFTER_KERNEL; FLAG_MISSING follows from the placement
        # (JSON length, payload limit, spans, payload table, flags, `_CrcShift` of the body) of
        # the last call: the placement depends on nothing else, and the JSON length rarely
        # changes
        self.placed: tuple[int, int, tuple[Any, ...], bytes, int, _CrcShift] | None = None


class Slot:
    """A reserved slot: copy the payloads in (`payload(i)`), then `commit()`."""

    def __init__(
        self,
        journal: Journal,
        index: int,
        seq: int,
        spans: Sequence[tuple[int, int] | None],
        head_crc: int | None = None,
        base: int | None = None,
        inputs: int | None = None,
    ) -> None:
        self._journal = journal
        self.index = index
        self.seq = seq
        self._head_crc = head_crc  # CRC-32 of the header as written, where the writer knows it
        # per payload (the storages', then the outputs'): (offset in slot, length) or None
        self._spans = spans
        self.inputs = len(spans) if inputs is None else inputs  # the storages' payloads
        self._base = journal._slot_offset(index) if base is None else base  # the writer's
        self.committed = False

    @property
    def payload_count(self) -> int:
        return len(self._spans)

    @property
    def spans(self) -> list[tuple[int, int] | None]:
        """Per storage: (offset in the slot, length), or None when its payload is missing."""
        return list(self._spans[: self.inputs])

    @property
    def output_spans(self) -> list[tuple[int, int] | None]:
        """Per entry of the meta's `outputs`: (offset in the slot, length), or None when it did
        not fit."""
        return list(self._spans[self.inputs :])

    def output(self, m: int) -> memoryview:
        """Where output m's post-call bytes go (a view into the mapped journal)."""
        return self.payload(self.inputs + m)

    @property
    def offset(self) -> int:
        """Where the slot starts in the journal file (and its mapping)."""
        return self._base

    def has_payload(self, i: int) -> bool:
        return self._spans[i] is not None

    def payload(self, i: int) -> memoryview:
        """Where storage i's bytes go (a view into the mapped journal)."""
        span = self._spans[i]
        if span is None:
            raise JournalError(
                f"storage {i} did not fit the {self._journal.slot_bytes}-byte slot; its payload "
                "is marked missing (raise slot_bytes to keep it)"
            )
        off, n = span
        return self._journal._view[self._base + off : self._base + off + n]

    def commit(self, device: bool = False) -> None:
        """Write the trailer. Host path (`device` False): the payloads are in, the checksum
        covers them and the markers say so: from here on the slot reads as complete. Device path:
        the checksum covers the header only and the markers stay 0 until the stream's copies
        (`marker`) write them."""
        j = self._journal
        if j._fd < 0:
            raise JournalError("the journal was closed before this slot was committed")
        with j._lock:
            view = j._view
            base = self._base
            (seq,) = _U64.unpack_from(view, base + 8)
            if seq != self.seq or self.committed:
                raise JournalError(
                    f"slot {self.index} was reused before seq {self.seq} was committed: "
                    "use more slots"
                )
            crc = self._head_crc
            if crc is None:
                _, _, _, _, _, k, _, _, _, _, jlen = _SLOT_FIXED.unpack_from(view, base)
                crc = zlib.crc32(view[base : base + _SLOT_HEAD + 16 * k + jlen])
            if not device:
                for span in self._spans[: self.inputs]:  # outputs: written after the call
                    if span is not None:
                        crc = zlib.crc32(view[base + span[0] : base + span[0] + span[1]], crc)
            flags = TRAILER_FLAG_DEVICE if device else TRAILER_FLAG_PAYLOAD_CRC
            token = 0 if device else 1
            t = base + j.slot_bytes - _TRAILER.size
            view[t : t + _TRAILER.size] = _TRAILER.pack(
                TRAILER_MAGIC, flags, self.seq, crc, token, token, 0, 0
            )
            self.committed = True

    def marker(self, name: str) -> memoryview:
        """The 8 bytes of marker `name` (pre, post, done): device copies write them."""
        t = self._base + self._journal.slot_bytes - _TRAILER.size + _MARKER_AT[name]
        return self._journal._view[t : t + 8]

    def mark_outputs(self, token: int = 1) -> None:
        """Host path: the outputs' payloads were copied after the call (`out` marker). Nothing
        when the ring has reused the slot meanwhile."""
        self._store_marker("out", token)

    def write_outputs(self, sources: Sequence[int], token: int = 1) -> None:
        """Host path, after the call: output m's payload from host address `sources[m]` (its
        storage's span: as many bytes as the payload), then the `out` marker; under the
        journal's lock, so the ring cannot reuse the slot meanwhile (nothing when it did)."""
        spans = self._spans

        def fill(at: int) -> None:
            for m, src in enumerate(sources):
                sp = spans[self.inputs + m]
                if sp is not None and sp[1]:
                    _memmove(at + sp[0], src, sp[1])

        self._store_marker("out", token, fill)

    def current(self) -> bool:
        """Whether the slot still holds this call (the ring has not reused it)."""
        j = self._journal
        if j._fd < 0:
            return False
        (seq,) = _U64.unpack_from(j._view, self._base + 8)
        return bool(seq == self.seq)

    def _store_marker(
        self, name: str, token: int, fill: Callable[[int], None] | None = None
    ) -> None:
        """Marker `name` = `token`, after `fill(slot address)` when given; under the journal's
        lock and only while the slot still holds this call."""
        j = self._journal
        if j._fd < 0:
            return
        with j._lock:
            view, base = j._view, self._base
            (seq,) = _U64.unpack_from(view, base + 8)
            if seq == self.seq:
                if fill is not None:
                    fill(j.address + base)
                t = base + j.slot_bytes - _TRAILER.size + _MARKER_AT[name]
                view[t : t + 8] = _U64.pack(token)

    def finish(self, token: int = 1) -> None:
        """Host path: the kernel returned. Nothing when the ring has reused the slot meanwhile
        (another thread's calls wrapped it during this one): the done marker is the new call's."""
        j = self._journal
        if j._fd < 0:
            return
        with j._lock:
            view, base = j._view, self._base
            (seq,) = _U64.unpack_from(view, base + 8)
            if seq == self.seq:  # the done marker (`marker`), one store, without a view per call
                t = base + j.slot_bytes + _DONE_AT
                view[t : t + 8] = _U64.pack(token)


class Journal:
    """The writer: a mapped ring of fixed-size slots. Use `Journal.create`."""

    def __init__(self, path: Path, fd: int, header_bytes: int, slots: int, slot_bytes: int) -> None:
        self.path = path
        self.header_bytes = header_bytes
        self.slot_count = slots
        self.slot_bytes = slot_bytes
        self._fd = fd
        self._map = mmap.mmap(fd, header_bytes + slots * slot_bytes)
        self._view = memoryview(self._map)
        self.before_unmap: list[Callable[[], None]] = []  # run by close(), before unmapping
        self._lock = threading.Lock()
        self._seq = 0
        self._next = 0  # next index of the round robin
        self._pinned: set[int] = set()  # slots kept out of the rotation (capture sites)
        self._parts: dict[Any, tuple[tuple[Any, ...], bytes]] = {}  # `_json`'s memo
        self._limit = slot_bytes - _TRAILER.size - CALL_RECORD_BYTES  # where payloads end
        # the mapping's address (host copies of outputs go there by memmove; the export taken
        # to read it ends with the temporary)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._shifts: dict[int, _CrcShift] = {}  # `_shift`'s memo, per body length

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str] | None = None,
        slots: int = DEFAULT_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        process_info: dict[str, Any] | None = None,
    ) -> Journal:
        """A new journal file. `path` None: a fresh file in /dev/shm; a folder: a fresh file in
        it; else that file (replaced). The ring shrinks to fit the free space."""
        if slots < 1 or slot_bytes < MIN_SLOT_BYTES:
            raise JournalError(f"a journal needs slots >= 1 and slot_bytes >= {MIN_SLOT_BYTES}")
        slot_bytes = _round_up(slot_bytes, ALIGN)
        if path is None and not DEFAULT_DIR.is_dir():
            raise JournalError(f"{DEFAULT_DIR} does not exist here: give a folder for the journal")
        p = Path(path) if path is not None else DEFAULT_DIR
        if p.is_dir():
            p = default_path(p)
        created = time.time()
        host = socket.gethostname()
        process = dict(process_info or {})
        head = _encode_file_header(slots, slot_bytes, os.getpid(), host, created, process)
        header_bytes = _round_up(len(head), PAGE)
        slots = fit_slots(p.parent, header_bytes, slots, slot_bytes)
        head = _encode_file_header(slots, slot_bytes, os.getpid(), host, created, process)
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise JournalError(f"{p}: cannot create the journal ({exc.strerror}); pick a folder")
        size = header_bytes + slots * slot_bytes
        try:
            # Reserve the pages now: running out of tmpfs later would SIGBUS the program.
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, head, 0)
        except OSError as exc:
            os.close(fd)
            p.unlink(missing_ok=True)
            raise JournalError(
                f"{p}: cannot reserve {size} bytes ({exc.strerror}); free space or use fewer slots"
            )
        try:
            return cls(p, fd, header_bytes, slots, slot_bytes)
        except OSError as exc:
            os.close(fd)
            p.unlink(missing_ok=True)
            raise JournalError(f"{p}: cannot map the journal ({exc.strerror}); use fewer slots")

    def _slot_offset(self, index: int) -> int:
        return self.header_bytes + index * self.slot_bytes

    def pin(self, index: int) -> bool:
        """Keep slot `index` out of the rotation (False: the ring would be left with fewer than
        half its slots, so it stays in)."""
        with self._lock:
            if index in self._pinned:
                return True
            if len(self._pinned) + 1 > self.slot_count // 2:
                return False
            self._pinned.add(index)
            return True

    def pin_next(self) -> int | None:
        """Take the next slot of the rotation and pin it (None: the pinning budget is spent)."""
        with self._lock:
            if len(self._pinned) + 1 > self.slot_count // 2:
                return None
            i = self._take_index()
            self._pinned.add(i)
            return i

    @property
    def pinned(self) -> frozenset[int]:
        return frozenset(self._pinned)

    def _take_index(self) -> int:
        for _ in range(self.slot_count):
            i = self._next
            self._next = (self._next + 1) % self.slot_count
            if i not in self._pinned:
                return i
        raise JournalError("every journal slot is pinned: use more slots")

    def reserve(
        self, meta: SlotMeta, index: int | None = None, want: Sequence[bool] | None = None
    ) -> Slot:
        """Take the next slot round-robin (or slot `index`, a pinned one being refilled) and
        write its header. Storages whose bytes do not fit are marked missing (their layouts
        stay), and so are those `want` says to leave out."""
        if self._fd < 0:
            raise JournalError("the journal is closed")
        n_in = len(meta.storages)
        k = n_in + len(meta.outputs)
        limit = self.slot_bytes - _TRAILER.size - CALL_RECORD_BYTES
        wanted = list(want) if want is not None else [True] * n_in
        wanted += [True] * len(meta.outputs)  # placed after the storages' payloads
        guess: list[tuple[int, int] | None] = [(0, 0) if w else None for w in wanted]
        doc = self._json(meta, guess)
        # A payload dropped below turns its index into null (at most 3 more characters).
        head_end = _SLOT_HEAD + 16 * k + len(doc) + 3 * k
        if head_end > limit:
            raise SlotTooSmall(
                f"the call's metadata ({len(doc)} bytes) does not fit a {self.slot_bytes}-byte "
                "journal slot: raise slot_bytes"
            )
        spans = _place_sizes(_payload_sizes(meta), head_end, limit, wanted)
        if [s is None for s in spans] != [g is None for g in guess]:
            doc = self._json(meta, spans)
        flags = (FLAG_AFTER_KERNEL if meta.after_kernel else 0) | (
            FLAG_MISSING if any(s is None for s in spans[:n_in]) else 0
        )
        table = b"".join(_TABLE_ENTRY.pack(*(s or (0, 0))) for s in spans)
        ids = (meta.call_index, meta.target_id, meta.stream, meta.capture_id, meta.graph_id)
        return self._write(index, spans, table + doc, len(doc), flags, ids, meta.replay, None, n_in)

    def _write(
        self,
        index: int | None,
        spans: Sequence[tuple[int, int] | None],
        body: bytes,
        jlen: int,
        flags: int,
        ids: tuple[int, int, int, int, int],
        replay: int,
        shift: _CrcShift | None = None,
        inputs: int | None = None,
    ) -> Slot:
        """Write a slot header (payload table + JSON in `body`) in the crash-safe order of the
        module docstring; `ids`: call index, target id, stream, capture id, graph id. `shift`:
        `_CrcShift` of len(body), where the caller keeps one: one pass over the body."""
        call_index, target_id, stream, capture_id, graph_id = ids
        with self._lock:
            seq = self._seq + 1
            if index is None:
                if self._pinned:
                    index = self._take_index()
                else:  # `_take_index` with nothing pinned, without the call
                    index = self._next
                    self._next = (index + 1) % self.slot_count
            base = self.header_bytes + index * self.slot_bytes  # `_slot_offset`
            v = self._view
            # First the old trailer is invalidated: from here the old call never reads complete.
            t = base + self.slot_bytes - _TRAILER.size
            v[t : t + _TRAILER.size] = _TRAILER.pack(REFILL_MAGIC, 0, seq, 0, 0, 0, 0, 0)
            v[base : base + 4] = _ZERO4  # then the old header
            v[base + _SLOT_HEAD : base + _SLOT_HEAD + len(body)] = body
            fixed = _SLOT_FIXED.pack(
                SLOT_MAGIC,
                flags,
                seq,
                call_index,
                target_id,
                len(spans),
                stream,
                capture_id,
                graph_id,
                replay,
                jlen,
            )
            start = zlib.crc32(fixed)
            crc = zlib.crc32(body, start)
            head = fixed + _SLOT_CRC.pack(crc)
            v[base : base + _SLOT_HEAD] = head
            self._seq = seq
            # the trailer's checksum starts with these bytes: `commit` need not read them back
            if shift is None:
                head_crc = zlib.crc32(body, zlib.crc32(head))
            else:  # the same value, without a second pass over the body
                head_crc = shift(crc, start, zlib.crc32(head))
            return Slot(self, index, seq, spans, head_crc, base, inputs)

    def template(
        self,
        meta: SlotMeta,
        want: Sequence[bool],
        holes: Sequence[int],
        check: tuple[SlotMeta, Sequence[int]],
    ) -> SlotTemplate | None:
        """The slot JSON of `meta` (payloads as `want` asks) cut at the per-call integers: `meta`
        carries the integers `holes` (distinct sentinels, in JSON order) where a call's values go
        (`reserve_from`). `check`: a call's meta and its values, whose JSON the template must
        give byte for byte. None when a sentinel is not found exactly once, in order, or the
        check fails."""
        guess = [(0, 0) if w else None for w in want] + [(0, 0)] * len(meta.outputs)
        doc = self._json(meta, guess)
        parts: list[bytes] = []
        rest = doc
        for h in holes:
            text = str(int(h)).encode()
            if rest.count(text) != 1 or any(text in p for p in parts):
                return None
            before, rest = rest.split(text)
            if before[-1:].isdigit() or rest[:1].isdigit():  # part of a longer number
                return None
            parts.append(before)
        parts.append(rest)
        if _fill(tuple(parts), check[1]) != self._json(check[0], guess):
            return None
        return SlotTemplate(
            tuple(parts),
            tuple(bool(w) for w in want) + (True,) * len(meta.outputs),
            tuple(_payload_sizes(meta)),
            meta.target_id,
            meta.capture_id,
            meta.graph_id,
            meta.replay,
            FLAG_AFTER_KERNEL if meta.after_kernel else 0,
            len(meta.storages),
        )

    def reserve_from(
        self, tpl: SlotTemplate, values: Sequence[int], stream: int, call_index: int
    ) -> Slot | None:
        """`reserve` for a call whose JSON is `tpl` with `values` in its holes: the same header,
        written the same way. None (nothing written) where placing its payloads would change
        which of them are present (the full `reserve` then re-encodes)."""
        if self._fd < 0:
            raise JournalError("the journal is closed")
        doc = tpl.format % tuple(values)
        jlen = len(doc)
        limit = self._limit
        placed = tpl.placed
        # The placement follows from the JSON length and the limit alone: the last call's
        # while they repeat (one that did not fit was never kept).
        if placed is None or placed[0] != jlen or placed[1] != limit:
            k = tpl.k
            head_end = _SLOT_HEAD + 16 * k + jlen + 3 * k
            if head_end > limit:
                return None
            spans = tuple(_place_sizes(tpl.sizes, head_end, limit, tpl.want))
            if [s is None for s in spans] != [not w for w in tpl.want]:
                return None
            flags = tpl.flags | (FLAG_MISSING if any(s is None for s in spans[: tpl.k_in]) else 0)
            table = b"".join(_TABLE_ENTRY.pack(*(s or (0, 0))) for s in spans)
            placed = tpl.placed = (jlen, limit, spans, table, flags, self._shift(len(table) + jlen))
        _, _, spans, table, flags, shift = placed
        ids = (call_index, tpl.target_id, stream, tpl.capture_id, tpl.graph_id)
        return self._write(None, spans, table + doc, jlen, flags, ids, tpl.replay, shift, tpl.k_in)

    def _shift(self, n: int) -> _CrcShift:
        """The `_CrcShift` of n-byte bodies, shared by the templates of this journal (a template
        made again after eviction has the same body length)."""
        got = self._shifts.get(n)
        if got is None:
            if len(self._shifts) >= _SHIFTS_MAX:
                self._shifts.clear()
            got = self._shifts[n] = _CrcShift(n)
        return got

    def _json(self, meta: SlotMeta, spans: Sequence[tuple[int, int] | None] | None) -> bytes:
        """The slot JSON (one object: target, called_as, names, args, kwargs, storages with their
        payload index or null, tensors, extra; compact separators) from parts memoised by the
        identity of the objects they encode: the recorder passes the same argument trees, names
        and tensor list for repeated calls of one signature, and the same storage list while the
        storages' versions and static references repeat; only `extra` (call index, time, site)
        is always encoded again."""
        n_in = len(meta.storages)
        present = (
            tuple(True for _ in range(n_in + len(meta.outputs)))
            if spans is None
            else tuple(x is not None for x in spans)
        )
        outs = present[n_in:]
        present = present[:n_in]
        head = self._memo(
            ("head", id(meta.args), id(meta.kwargs), id(meta.names), meta.target, meta.called_as),
            (meta.args, meta.kwargs, meta.names),
            lambda: _head_json(meta),
        )
        storages = self._memo(
            ("storages", id(meta.storages), present),
            (meta.storages,),
            lambda: _storages_json(meta.storages, present),
        )
        tensors = self._memo(
            ("tensors", id(meta.tensors)), (meta.tensors,), lambda: _dumps(meta.tensors)
        )
        return b"".join(
            (
                head,
                b',"storages":',
                storages,
                b',"tensors":',
                tensors,
                b',"extra":',
                _extra_json(meta, n_in, outs),
                b"}",
            )
        )

    def _memo(self, key: Any, refs: tuple[Any, ...], make: Callable[[], bytes]) -> bytes:
        hit = self._parts.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], refs)):
            return hit[1]
        out = make()
        if len(self._parts) > 512:
            self._parts.clear()
        self._parts[key] = (refs, out)  # the refs keep the ids from being reused
        return out

    def record(self, meta: SlotMeta, payloads: Sequence[bytes | memoryview]) -> Slot:
        """Reserve, copy `payloads` (one per storage) and commit: the plain host-copy path."""
        slot = self.reserve(meta)
        for i, data in enumerate(payloads):
            if slot.has_payload(i):
                slot.payload(i)[:] = data
        slot.commit()
        return slot

    def close(self) -> None:
        if self._fd < 0:
            return
        for release in self.before_unmap:  # e.g. the pinned registration of the mapping
            release()
        self.before_unmap.clear()
        self._view.release()
        try:
            self._map.close()
        except BufferError:  # a payload view is still held; the mapping goes with it
            pass
        os.close(self._fd)
        self._fd = -1

    def unlink(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _CrcShift:
    """For n-byte bodies: crc32(body, b) from crc32(body, a) without a second pass. CRC-32 is
    affine in its start value, so crc32(body, a) ^ crc32(body, b) == M(a ^ b) for a map M that
    is linear and depends on n alone: M(x) = crc32(bytes(n), x) ^ crc32(bytes(n), 0), kept as
    four tables, one per byte of x. Made once per body length: 32
    passes over n zeros; 4 KiB (arrays: a template keeps its own while it lives)."""

    __slots__ = ("n", "t0", "t1", "t2", "t3")

    def __init__(self, n: int) -> None:
        zeros = bytes(n)
        z = zlib.crc32(zeros)
        images = [zlib.crc32(zeros, 1 << b) ^ z for b in range(32)]  # M of each bit
        tables: list[array.array[int]] = []
        for k in range(4):
            tab = [0] * 256
            for x in range(1, 256):
                low = x & -x  # M is linear: M(x) = M(x without its lowest bit) ^ M(that bit)
                tab[x] = tab[x ^ low] ^ images[8 * k + low.bit_length() - 1]
            tables.append(array.array("I", tab))  # u32
        self.n = n
        self.t0, self.t1, self.t2, self.t3 = tables

    def __call__(self, crc: int, a: int, b: int) -> int:
        """crc32(body, b), given crc == crc32(body, a) for an n-byte body."""
        x = a ^ b
        return (
            crc
            ^ self.t0[x & 0xFF]
            ^ self.t1[(x >> 8) & 0xFF]
            ^ self.t2[(x >> 16) & 0xFF]
            ^ self.t3[x >> 24]
        )


def _fill(parts: tuple[bytes, ...], values: Sequence[int]) -> bytes:
    """A template's JSON with `values` in its holes (as json.dumps writes integers)."""
    if len(values) + 1 != len(parts):
        raise JournalError(f"a slot template has {len(parts) - 1} holes, not {len(values)}")
    return _format(parts) % tuple(values)


def _format(parts: tuple[bytes, ...]) -> bytes:
    """The parts as one printf-style format with a %d per hole (one C pass per call)."""
    return b"%d".join(p.replace(b"%", b"%%") for p in parts)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), default=str).encode()


def _head_json(meta: SlotMeta) -> bytes:
    """The slot JSON from its opening brace through `kwargs`."""
    doc = {
        "target": meta.target,
        "called_as": meta.called_as or meta.target,
        "names": meta.names,
        "args": meta.args,
        "kwargs": meta.kwargs,
    }
    return _dumps(doc)[:-1]


def _extra_json(meta: SlotMeta, n_in: int, present: Sequence[bool]) -> bytes:
    """The slot JSON's "extra" object; with outputs, its last member "outputs": each entry with
    its payload's table index (after the storages' entries) or null when it did not fit."""
    extra = {k: v for k, v in meta.extra.items() if k != "outputs"} if meta.outputs else meta.extra
    doc = _dumps(extra)
    if not meta.outputs:
        return doc
    items = [
        {"storage": o["storage"], "tensors": o["tensors"], "payload": n_in + m if p else None}
        for m, (o, p) in enumerate(zip(meta.outputs, present))
    ]
    return doc[:-1] + (b"," if extra else b"") + b'"outputs":' + _dumps(items) + b"}"


def _payload_sizes(meta: SlotMeta) -> list[int]:
    """Every payload's size in table order: the storages', then the outputs' (their storages')."""
    sizes = [int(s.get("span_nbytes", 0)) for s in meta.storages]
    return sizes + [sizes[int(o["storage"])] for o in meta.outputs]


def _storages_json(storages: Sequence[dict[str, Any]], present: Sequence[bool]) -> bytes:
    # Before placement every storage claims a payload; placement may take some back.
    return _dumps(
        [{**s, "payload": i if p else None} for i, (s, p) in enumerate(zip(storages, present))]
    )


def _place(
    storages: Sequence[dict[str, Any]],
    head_end: int,
    limit: int,
    want: Sequence[bool] | None = None,
) -> list[tuple[int, int] | None]:
    """Payload spans in order, each 64-byte aligned, first fit; what does not fit (or is not
    wanted) is None."""
    return _place_sizes([int(s.get("span_nbytes", 0)) for s in storages], head_end, limit, want)


def _place_sizes(
    sizes: Sequence[int], head_end: int, limit: int, want: Sequence[bool] | None = None
) -> list[tuple[int, int] | None]:
    spans: list[tuple[int, int] | None] = []
    pos = _round_up(head_end, ALIGN)
    for j, n in enumerate(sizes):
        if (want is None or want[j]) and pos + n <= limit:
            spans.append((pos, n))
            pos = _round_up(pos + n, ALIGN)
        else:
            spans.append(None)
    return spans


# ---------------------------------------------------------------------------------------------
# Reader: never trusts the file.


class _Torn(Exception):
    pass


def read_journal(path: str | os.PathLike[str]) -> JournalContents:
    """Read a journal file. A file that is not a journal raises JournalError; damaged or
    truncated slots read as torn."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise JournalError(f"{p}: no such journal file")
    except IsADirectoryError:
        raise JournalError(f"{p} is a directory; give a journal file")
    except OSError as exc:
        raise JournalError(f"{p}: cannot read ({exc.strerror})")
    header = _parse_file_header(raw, p)
    records = []
    for i in range(header.slot_count):
        base = header.header_bytes + i * header.slot_bytes
        records.append(_read_slot(raw, base, header.slot_bytes, i, header.version))
    records.sort(key=_newest_first)
    return JournalContents(p, header, records)


def _newest_first(r: SlotRecord) -> tuple[int, int, int]:
    group = 2 if r.state is SlotState.EMPTY else (1 if r.seq == 0 else 0)
    return (group, -r.seq, r.index)


def read_pid(path: str | os.PathLike[str]) -> int:
    """The recording process' pid from a journal's header (JournalError when not a journal)."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(PAGE + MAX_PROCESS_JSON)
    except OSError as exc:
        raise JournalError(f"{p}: cannot read ({exc.strerror}); give a journal file or folder")
    return _parse_file_header(raw, p, whole=False).pid


def _parse_file_header(raw: bytes, p: Path, whole: bool = True) -> JournalHeader:
    if len(raw) < _FILE_FIXED.size + 4 or raw[:8] != JOURNAL_MAGIC:
        raise JournalError(f"{p}: not a kdump journal (bad magic or too short)")
    (_, version, header_bytes, slots, _, slot_bytes, pid, created, hlen, plen) = (
        _FILE_FIXED.unpack_from(raw)
    )
    if version not in READ_VERSIONS:
        known = ", ".join(map(str, READ_VERSIONS))
        raise JournalError(
            f"{p}: journal format version {version} is not supported (reads {known}); "
            "salvage it with the kdump that recorded it"
        )
    end = _FILE_FIXED.size + hlen + plen
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
        host = raw[_FILE_FIXED.size : _FILE_FIXED.size + hlen].decode()
        process = json.loads(raw[_FILE_FIXED.size + hlen : end])
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise JournalError(f"{p}: journal header holds invalid text")
    if not isinstance(process, dict):
        raise JournalError(f"{p}: journal process block is not an object")
    return JournalHeader(version, header_bytes, slots, slot_bytes, pid, host, created, process)


def _read_slot(
    raw: bytes, base: int, slot_bytes: int, index: int, version: int = JOURNAL_VERSION
) -> SlotRecord:
    if base + slot_bytes > len(raw):
        if base >= len(raw) or not any(raw[base:]):
            return SlotRecord(index, SlotState.TORN, reason="file truncated before this slot")
        return SlotRecord(index, SlotState.TORN, reason="file truncated inside this slot")
    fixed = raw[base : base + _SLOT_FIXED.size]
    (magic, flags, seq, call_index, target_id, k, stream, capture, graph, replay, jlen) = (
        _SLOT_FIXED.unpack(fixed)
    )
    t = base + slot_bytes - _TRAILER.size
    tmagic, tflags, tseq, tcrc, pre, post, done, out = _TRAILER.unpack_from(raw, t)
    if magic != SLOT_MAGIC:
        if magic == bytes(4) and tmagic == bytes(4):
            return SlotRecord(index, SlotState.EMPTY)
        return SlotRecord(index, SlotState.TORN, reason="slot header has no valid magic")
    try:
        body_end = _SLOT_HEAD + 16 * k + jlen
        if k > slot_bytes // 16 or body_end > slot_bytes - _TRAILER.size:
            raise _Torn("slot header lengths run past the slot")
        (hcrc,) = _SLOT_CRC.unpack_from(raw, base + _SLOT_FIXED.size)
        body = raw[base + _SLOT_HEAD : base + body_end]
        if hcrc != zlib.crc32(body, zlib.crc32(fixed)):
            raise _Torn("slot header checksum mismatch")
        spans = [_TABLE_ENTRY.unpack_from(body, 16 * j) for j in range(k)]
        meta, present = _parse_meta(
            body[16 * k :],
            flags,
            call_index,
            target_id,
            k,
            (stream, capture, graph, replay),
        )
        if meta.outputs and version < 4:
            raise _Torn(f"a version-{version} slot names outputs")
        _check_spans(spans, present, meta, body_end, slot_bytes - _TRAILER.size - CALL_RECORD_BYTES)
        n_in = len(meta.storages)
        placed_all = [(int(o), int(n)) if ok else None for (o, n), ok in zip(spans, present)]
        placed = tuple(placed_all[:n_in])
        outs = tuple(
            None if sp is None else raw[base + sp[0] : base + sp[0] + sp[1]]
            for sp in placed_all[n_in:]
        )
    except _Torn as exc:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason=str(exc))
    if tmagic == REFILL_MAGIC:
        if tseq == seq and tflags == 0 and tcrc == 0 and not (pre or post or done or out):
            return SlotRecord(
                index, SlotState.IN_FLIGHT, seq=seq, meta=meta, spans=placed, output_bytes=outs
            )
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="refill began over this call")
    if tmagic != TRAILER_MAGIC:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="trailer is damaged")
    if tseq != seq:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="trailer seq differs")
    known = TRAILER_FLAG_PAYLOAD_CRC | TRAILER_FLAG_DEVICE
    # version 3 kept the `out` marker's bytes zero too
    pad = raw[t + 20 : t + 24] + raw[t + (48 if version < 4 else 56) : t + _TRAILER.size]
    if out and not meta.outputs:  # only a slot with outputs has an `out` marker
        pad += b"\x01"
    if tflags & ~known or any(pad) or tflags == known:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="trailer has unknown bits set")
    crc = zlib.crc32(raw[base : base + body_end])
    if tflags & TRAILER_FLAG_PAYLOAD_CRC:  # the storages' payloads (outputs come later)
        for (off, n), ok in zip(spans[:n_in], present):
            if ok:
                crc = zlib.crc32(raw[base + off : base + off + n], crc)
    if crc != tcrc:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="slot checksum mismatch")
    if post == 0 or pre != post:
        why = "payloads not copied yet" if post == 0 else "payloads were being rewritten"
        return SlotRecord(
            index,
            SlotState.IN_FLIGHT,
            seq=seq,
            meta=meta,
            reason=why,
            token=post,
            spans=placed,
            markers=(pre, post, done),
            call_record=raw[t - CALL_RECORD_BYTES : t],
            output_bytes=outs,
            out_marker=out,
        )
    if done > post:
        return SlotRecord(index, SlotState.TORN, seq=seq, reason="done marker is ahead of post")
    payloads = tuple(
        raw[base + off : base + off + n] if ok else None
        for (off, n), ok in zip(spans[:n_in], present)
    )
    return SlotRecord(
        index,
        SlotState.COMPLETE,
        seq=seq,
        meta=meta,
        payloads=payloads,
        finished=done == post,
        token=post,
        spans=placed,
        markers=(pre, post, done),
        call_record=raw[t - CALL_RECORD_BYTES : t],
        output_bytes=outs,
        out_marker=out,
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _names_ok(names: Any) -> bool:
    return names is None or (isinstance(names, list) and all(isinstance(n, str) for n in names))


def _parse_meta(
    doc: bytes, flags: int, call_index: int, target_id: int, k: int, ids: tuple[int, ...]
) -> tuple[SlotMeta, list[bool]]:
    try:
        d = json.loads(doc)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _Torn("slot JSON does not parse")
    if not isinstance(d, dict):
        raise _Torn("slot JSON is not an object")
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
    ):
        raise _Torn("slot JSON lacks fields or has the wrong types")
    outputs = _parse_outputs(d["extra"].get("outputs", []), len(storages), len(tensors))
    if len(storages) + len(outputs) != k:
        raise _Torn("slot JSON lacks fields or has the wrong types")
    present = []
    for j, s in enumerate(storages):
        if not _is_int(s.get("span_nbytes")) or s["span_nbytes"] < 0:
            raise _Torn(f"storage {j} has no valid span_nbytes")
        pay = s.get("payload")
        if pay is not None and pay != j:
            raise _Torn(f"storage {j} names payload {pay!r}")
        present.append(pay is not None)
    for m, o in enumerate(outputs):
        pay = o.pop("payload")
        if pay is not None and pay != len(storages) + m:
            raise _Torn(f"output {m} names payload {pay!r}")
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
    )
    return meta, present


def _parse_outputs(raw: Any, n_storages: int, n_tensors: int) -> list[dict[str, Any]]:
    """The slot JSON's "outputs" checked: storages and tensors in range (_Torn otherwise)."""
    if not isinstance(raw, list):
        raise _Torn("slot JSON's outputs is not a list")
    out = []
    for m, o in enumerate(raw):
        if not isinstance(o, dict):
            raise _Torn(f"output {m} is not an object")
        j, tensors, pay = o.get("storage"), o.get("tensors"), o.get("payload")
        if (
            not _is_int(j)
            or not 0 <= j < n_storages
            or not isinstance(tensors, list)
            or not all(_is_int(i) and 0 <= i < n_tensors for i in tensors)
            or not (pay is None or _is_int(pay))
        ):
            raise _Torn(f"output {m} names no valid storage, tensors or payload")
        out.append({"storage": j, "tensors": list(tensors), "payload": pay})
    return out


def _check_spans(
    spans: list[tuple[int, int]], present: list[bool], meta: SlotMeta, lo: int, hi: int
) -> None:
    pos = lo
    sizes = _payload_sizes(meta)
    for j, ((off, n), ok) in enumerate(zip(spans, present)):
        if not ok:
            continue
        if n != sizes[j] or off < pos or off + n > hi:
            raise _Torn(f"payload {j} lies outside the slot or overlaps another")
        pos = off + n
