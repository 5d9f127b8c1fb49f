"""The flight recorder's journal writer: a mapped ring of fixed-size slots (`Journal`).

The layout, the typed records and the slot JSON are defined once in kdump.format.journal (its
docstring and docs/FORMAT.md describe them); the reader is kdump.record.flight.journal_reader.
Here: making the file (sized to the free space), reserving a slot and writing its header in the
crash-safe order, the payload views the copies fill, the trailer (`commit`) and the markers, and
the repeated call's fast path (`template` / `reserve_from`: the same header with new integers,
its checksum without a second pass).
"""

from __future__ import annotations

import array
import ctypes
import logging
import mmap
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kdump.format.journal import (
    ALIGN,
    CALL_RECORD_BYTES,
    DEFAULT_DIR,
    FILE_PREFIX,
    FLAG_AFTER_KERNEL,
    FLAG_MISSING,
    MARKER_AT,
    MIN_SLOT_BYTES,
    PAGE,
    REFILL_MAGIC,
    SLOT_CRC,
    SLOT_FIXED,
    SLOT_HEAD,
    SLOT_MAGIC,
    TABLE_ENTRY,
    TRAILER,
    TRAILER_FLAG_DEVICE,
    TRAILER_FLAG_PAYLOAD_CRC,
    TRAILER_MAGIC,
    U64,
    JournalError,
    SlotMeta,
    SlotTooSmall,
    dumps,
    encode_file_header,
    extra_json,
    head_json,
    payload_sizes,
    place_sizes,
    round_up,
    storages_json,
)
from kdump.format.records import launch_json, storage_layout_json, tensor_json

DEFAULT_SLOTS = 64
DEFAULT_SLOT_BYTES = 1 << 20
SHM_SHARE = 0.5  # the ring takes at most this share of the free space (NCCL needs /dev/shm too)

_ZERO4 = bytes(4)
_memmove = ctypes.memmove
_SHIFTS_MAX = 256  # body lengths whose `_CrcShift` a journal shares between templates
_DONE_AT = MARKER_AT["done"] - TRAILER.size  # the done marker, from the slot's end

log = logging.getLogger("kdump.record.flight.journal")


def meta_from_call(call: Any, call_index: int, **fields: Any) -> SlotMeta:
    """A SlotMeta from a `kdump.bundle.CallRecord` (its inputs' layouts; bytes go to payloads)."""
    storages = [storage_layout_json(s) for s in call.inputs.storages]
    tensors = [tensor_json(t, nbytes=True) for t in call.inputs.tensors]
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
        launch=launch_json(call.launch) if call.launch is not None else None,
        **fields,
    )


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
            (seq,) = U64.unpack_from(view, base + 8)
            if seq != self.seq or self.committed:
                raise JournalError(
                    f"slot {self.index} was reused before seq {self.seq} was committed: "
                    "use more slots"
                )
            crc = self._head_crc
            if crc is None:
                _, _, _, _, _, k, _, _, _, _, jlen = SLOT_FIXED.unpack_from(view, base)
                crc = zlib.crc32(view[base : base + SLOT_HEAD + 16 * k + jlen])
            if not device:
                for span in self._spans[: self.inputs]:  # outputs: written after the call
                    if span is not None:
                        crc = zlib.crc32(view[base + span[0] : base + span[0] + span[1]], crc)
            flags = TRAILER_FLAG_DEVICE if device else TRAILER_FLAG_PAYLOAD_CRC
            token = 0 if device else 1
            t = base + j.slot_bytes - TRAILER.size
            view[t : t + TRAILER.size] = TRAILER.pack(
                TRAILER_MAGIC, flags, self.seq, crc, token, token, 0, 0
            )
            self.committed = True

    def marker(self, name: str) -> memoryview:
        """The 8 bytes of marker `name` (pre, post, done): device copies write them."""
        t = self._base + self._journal.slot_bytes - TRAILER.size + MARKER_AT[name]
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
        (seq,) = U64.unpack_from(j._view, self._base + 8)
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
            (seq,) = U64.unpack_from(view, base + 8)
            if seq == self.seq:
                if fill is not None:
                    fill(j.address + base)
                t = base + j.slot_bytes - TRAILER.size + MARKER_AT[name]
                view[t : t + 8] = U64.pack(token)

    def finish(self, token: int = 1) -> None:
        """Host path: the kernel returned. Nothing when the ring has reused the slot meanwhile
        (another thread's calls wrapped it during this one): the done marker is the new call's."""
        j = self._journal
        if j._fd < 0:
            return
        with j._lock:
            view, base = j._view, self._base
            (seq,) = U64.unpack_from(view, base + 8)
            if seq == self.seq:  # the done marker (`marker`), one store, without a view per call
                t = base + j.slot_bytes + _DONE_AT
                view[t : t + 8] = U64.pack(token)


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
        self._limit = slot_bytes - TRAILER.size - CALL_RECORD_BYTES  # where payloads end
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
        slot_bytes = round_up(slot_bytes, ALIGN)
        if path is None and not DEFAULT_DIR.is_dir():
            raise JournalError(f"{DEFAULT_DIR} does not exist here: give a folder for the journal")
        p = Path(path) if path is not None else DEFAULT_DIR
        if p.is_dir():
            p = default_path(p)
        created = time.time()
        host = socket.gethostname()
        process = dict(process_info or {})
        head = encode_file_header(slots, slot_bytes, os.getpid(), host, created, process)
        header_bytes = round_up(len(head), PAGE)
        slots = fit_slots(p.parent, header_bytes, slots, slot_bytes)
        head = encode_file_header(slots, slot_bytes, os.getpid(), host, created, process)
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
        limit = self.slot_bytes - TRAILER.size - CALL_RECORD_BYTES
        wanted = list(want) if want is not None else [True] * n_in
        wanted += [True] * len(meta.outputs)  # placed after the storages' payloads
        guess: list[tuple[int, int] | None] = [(0, 0) if w else None for w in wanted]
        doc = self._json(meta, guess)
        # A payload dropped below turns its index into null (at most 3 more characters).
        head_end = SLOT_HEAD + 16 * k + len(doc) + 3 * k
        if head_end > limit:
            raise SlotTooSmall(
                f"the call's metadata ({len(doc)} bytes) does not fit a {self.slot_bytes}-byte "
                "journal slot: raise slot_bytes"
            )
        spans = place_sizes(payload_sizes(meta), head_end, limit, wanted)
        if [s is None for s in spans] != [g is None for g in guess]:
            doc = self._json(meta, spans)
        flags = (FLAG_AFTER_KERNEL if meta.after_kernel else 0) | (
            FLAG_MISSING if any(s is None for s in spans[:n_in]) else 0
        )
        table = b"".join(TABLE_ENTRY.pack(*(s or (0, 0))) for s in spans)
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
            t = base + self.slot_bytes - TRAILER.size
            v[t : t + TRAILER.size] = TRAILER.pack(REFILL_MAGIC, 0, seq, 0, 0, 0, 0, 0)
            v[base : base + 4] = _ZERO4  # then the old header
            v[base + SLOT_HEAD : base + SLOT_HEAD + len(body)] = body
            fixed = SLOT_FIXED.pack(
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
            head = fixed + SLOT_CRC.pack(crc)
            v[base : base + SLOT_HEAD] = head
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
            tuple(payload_sizes(meta)),
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
            head_end = SLOT_HEAD + 16 * k + jlen + 3 * k
            if head_end > limit:
                return None
            spans = tuple(place_sizes(tpl.sizes, head_end, limit, tpl.want))
            if [s is None for s in spans] != [not w for w in tpl.want]:
                return None
            flags = tpl.flags | (FLAG_MISSING if any(s is None for s in spans[: tpl.k_in]) else 0)
            table = b"".join(TABLE_ENTRY.pack(*(s or (0, 0))) for s in spans)
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
            (
                "head",
                id(meta.args),
                id(meta.kwargs),
                id(meta.names),
                id(meta.launch),
                meta.target,
                meta.called_as,
            ),
            (meta.args, meta.kwargs, meta.names, meta.launch),
            lambda: head_json(meta),
        )
        storages = self._memo(
            ("storages", id(meta.storages), present),
            (meta.storages,),
            lambda: storages_json(meta.storages, present),
        )
        tensors = self._memo(
            ("tensors", id(meta.tensors)), (meta.tensors,), lambda: dumps(meta.tensors)
        )
        return b"".join(
            (
                head,
                b',"storages":',
                storages,
                b',"tensors":',
                tensors,
                b',"extra":',
                extra_json(meta, n_in, outs),
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
