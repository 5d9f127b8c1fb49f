"""The static region read back after the process (salvage): never trusts the file.

The region's layout and how the recorder fills it are in kdump.record.flight.statics. Salvage asks
`salvaged_storage` for each storage of a complete slot: the slot's payload, else a complete copy
in the region (the entry the slot names, or one of the same storage and version made at a later
call), else the entry's statistics by reference, or missing.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdump.format.journal import JournalError
from kdump.format.records import Source, Stats
from kdump.record.flight.statics import (
    AT_CRC,
    AT_DATA_CRC,
    AT_PRE,
    AT_STATS,
    AT_STATS_MARK,
    ENTRY_BYTES,
    ENTRY_HEAD,
    ENTRY_MAGIC,
    FLAG_DATA,
    FLAG_HOST,
    FLAG_STATS,
    REGION_HEADER,
    REGION_MAGIC,
    REGION_VERSION,
    STATS_DTYPES,
    decode_stats,
    device_index,
    log,
    region_path,
    resolve_lazy,
)


@dataclass(frozen=True)
class EntryRecord:
    index: int
    flags: int
    seq: int
    offset: int
    nbytes: int
    base_ptr: int
    storage_nbytes: int
    span_start: int
    version: int
    dtype: str
    device: int
    copied: bool  # the bytes are complete (markers agree; host copies: the CRC holds)
    stats: tuple[float, ...] | None
    reason: str  # why the bytes are not complete


@dataclass(frozen=True)
class Resolved:
    """One storage of a salvaged call: its bytes, or why not and its statistics."""

    data: bytes | memoryview | None
    source: Source
    stats: Stats | None = None
    note: str = ""
    static: bool = False  # the bytes came from the static region
    digests: Any = None  # of `data` (a pair, or kdump.bundle.store.Pieces), where already known


class Region:
    """A static region read back after the process (salvage). Use `read_region`."""

    def __init__(self, path: Path, raw: mmap.mmap) -> None:
        self.path = path
        self._raw = raw
        self._view = memoryview(raw)
        n = len(raw)
        if n < REGION_HEADER.size + 4 or raw[:8] != REGION_MAGIC:
            raise JournalError(f"{path}: not a kdump static region")
        _, version, count, table, data_offset, capacity, _pid = REGION_HEADER.unpack_from(raw)
        (crc,) = struct.unpack_from("<I", raw, REGION_HEADER.size)
        if crc != zlib.crc32(raw[: REGION_HEADER.size]):
            raise JournalError(f"{path}: static region header checksum mismatch")
        if version != REGION_VERSION:
            raise JournalError(f"{path}: static region version {version} is not supported")
        if table + count * ENTRY_BYTES > n or data_offset + capacity > n:
            raise JournalError(f"{path}: static region is truncated")
        self.table, self.count = table, count
        self.entries = [e for e in (self._entry(i) for i in range(count)) if e is not None]
        self._by_index = {e.index: e for e in self.entries}
        # One salvage writes a bundle per call, and each names the same weights: their bytes
        # are copied and hashed once (keyed by span and lazy bits), and a blob the first
        # bundle's check read back from the shared store is not read again.
        self._shared: dict[tuple[int, int, str], tuple[Any, Any]] = {}
        self.verified: set[str] = set()

    def _entry(self, i: int) -> EntryRecord | None:
        raw = self._raw
        base = self.table + i * ENTRY_BYTES
        if raw[base : base + 4] != ENTRY_MAGIC:
            return None
        fields = ENTRY_HEAD.unpack_from(raw, base)
        (crc,) = struct.unpack_from("<I", raw, base + AT_CRC)
        if crc != zlib.crc32(raw[base : base + ENTRY_HEAD.size]):
            return None
        _, flags, seq, offset, nbytes, ptr, snb, span, version, dti, dev = fields
        pre, post = struct.unpack_from("<QQ", raw, base + AT_PRE)
        (data_crc,) = struct.unpack_from("<I", raw, base + AT_DATA_CRC)
        copied, reason = False, ""
        if not flags & FLAG_DATA:
            reason = "over the static region's budget"
        elif offset + nbytes > len(raw):
            reason = "static entry lies outside the region"
        elif pre != seq or post != seq:
            reason = "static copy was in flight"
        elif flags & FLAG_HOST and zlib.crc32(self._view[offset : offset + nbytes]) != data_crc:
            reason = "static copy is torn (checksum mismatch)"
        else:
            copied = True
        stats = None
        (mark,) = struct.unpack_from("<d", raw, base + AT_STATS_MARK)
        if flags & FLAG_STATS and mark == float(seq) and dti < len(STATS_DTYPES):
            stats = struct.unpack_from("<5d", raw, base + AT_STATS)
        dtype = STATS_DTYPES[dti] if dti < len(STATS_DTYPES) else ""
        return EntryRecord(
            i, flags, seq, offset, nbytes, ptr, snb, span, version, dtype, dev, copied, stats,
            reason,
        )  # fmt: skip

    def _stats(self, e: EntryRecord) -> Stats | None:
        if e.stats is None:
            return None
        checksum = ""
        if e.flags & FLAG_HOST:  # host entries: the CRC of the bytes at record time
            at = self.table + e.index * ENTRY_BYTES + AT_DATA_CRC
            checksum = f"crc32:{struct.unpack_from('<I', self._raw, at)[0]:08x}"
        return decode_stats(e.dtype, e.stats, checksum)

    def resolve(self, s: dict[str, Any]) -> Resolved | None:
        """What the region holds for storage `s` of a slot: None when it names no static entry
        and no complete entry holds its (storage, version)."""
        ref = s.get("static")
        if isinstance(ref, dict) and "entry" in ref:
            e = self._by_index.get(int(ref["entry"]))
            if e is None or e.seq != ref.get("seq"):
                why = "static entry was overwritten by a later version"
                return Resolved(None, Source.BY_REFERENCE, None, why, static=True)
            return self._from_entry(e, int(ref["offset"]), int(ref["nbytes"]))
        if not isinstance(ref, dict):
            return None
        # Static, but not copied at this call (first seen during capture): a copy of the same
        # storage and version made at a later eager call holds its bytes.
        found = self._matching(s, int(ref.get("version", -1)))
        if found is not None:
            return found
        return Resolved(None, Source.BY_REFERENCE, None, str(ref.get("why", "")), static=True)

    def _matching(self, s: dict[str, Any], version: int) -> Resolved | None:
        """A complete copy of the same storage at the same version (made at a later call)."""
        for e in reversed(self.entries):
            lo = int(s["span_start"]) - e.span_start
            if (
                e.copied
                and e.version == version
                and e.base_ptr == int(s["base_ptr"])
                and e.storage_nbytes == int(s["storage_nbytes"])
                and e.device == device_index(str(s["device"]))
                and lo >= 0
                and lo + int(s["span_nbytes"]) <= e.nbytes
            ):
                return self._from_entry(e, e.offset + lo, int(s["span_nbytes"]))
        return None

    def _from_entry(self, e: EntryRecord, offset: int, n: int) -> Resolved:
        if e.copied and e.offset <= offset and offset + n <= e.offset + e.nbytes:
            return Resolved(self._view[offset : offset + n], Source.BLOB, static=True)
        return Resolved(None, Source.BY_REFERENCE, self._stats(e), e.reason, static=True)

    def shared_bytes(self, data: memoryview, lazy: dict | None) -> tuple[Any, Any]:
        """The uint8 tensor of a static span (lazy bits applied) and its digests (per piece for
        a span larger than the piece size: `kdump.bundle.store.span_digests`), made once."""
        key = (_address(data), len(data), json.dumps(lazy, sort_keys=True) if lazy else "")
        got = self._shared.get(key)
        if got is None:
            from kdump.bundle.store import span_digests

            t = resolve_lazy(private_bytes(data), lazy)
            got = self._shared[key] = (t, span_digests(memoryview(t.numpy())))
        return got

    def close(self) -> None:
        self._shared.clear()
        try:
            self._view.release()
            self._raw.close()
        except BufferError:  # a slice is still held; the mapping goes with it
            pass


def private_bytes(data: Any) -> Any:
    """A private uint8 CPU tensor of `data`'s bytes (torch.frombuffer refuses an empty buffer:
    a call that touched no row, a zero-size tensor)."""
    import torch

    if not len(data):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _address(v: memoryview) -> int:
    """Where a (read-only) buffer's bytes start."""
    import numpy as np

    return int(np.frombuffer(v, dtype=np.uint8).ctypes.data) if len(v) else 0


def read_region(journal: str | os.PathLike[str]) -> Region | None:
    """The static region next to `journal` (None: there is none, or it is unreadable, logged)."""
    path = region_path(Path(journal))
    try:
        with open(path, "rb") as f:
            raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    try:
        return Region(path, raw)
    except JournalError as exc:
        raw.close()
        log.warning("kdump: %s", exc)
        return None


def salvaged_storage(s: dict[str, Any], payload: bytes | None, region: Region | None) -> Resolved:
    """Storage `s` of a complete slot as the bundle gets it: the slot's payload, else the static
    region's copy, else by reference (with statistics when the region has them) or missing; the
    lazy conj / neg bits applied to the bytes."""
    got = None
    ref = s.get("static")
    if payload is not None:
        got = Resolved(payload, Source.BLOB)
    elif region is not None:
        got = region.resolve(s)
    elif isinstance(ref, dict):  # static, and no region was made (or it is gone)
        why = str(ref.get("why") or "the static region is missing")
        got = Resolved(None, Source.BY_REFERENCE, None, why, static=True)
    if got is None:
        return Resolved(None, Source.MISSING)
    if got.data is None:
        return got
    if got.static and region is not None and isinstance(got.data, memoryview):
        data, digests = region.shared_bytes(got.data, s.get("lazy"))
        return Resolved(data, got.source, got.stats, got.note, got.static, digests)
    data = resolve_lazy(private_bytes(got.data), s.get("lazy"))
    return Resolved(data, got.source, got.stats, got.note, got.static)
