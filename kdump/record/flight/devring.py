"""The flight recorder's device tier: one allocation per device, shared with the salvage process.

Layout of the allocation (every integer little-endian; offsets from its first byte):

    0       8     head: logical byte position of the next device ring slot (never wraps)
    8       8     reserved-to: the end of what the newest snapshot may overwrite
    256     64    header: magic b"KDDEVT01", version (u32), 4 zero bytes, twin offset, twin
                  bytes, ring offset, ring bytes, journal slot count (u32), journal slot bytes
                  (u32), all u64 unless noted
    1024    3072  replay counters of capture sites (u64 each, MAX_SITES)
    4096    T     twin: slot_count x slot_bytes, the device copy of each journal slot's payload
                  area (same offsets as the host slot); its last 128..64 bytes before the host
                  trailer hold the snapshot's call record (kdump.record.flight.gather.CALL_RECORD)
    R       N     ring: device ring slots, each a 64-byte SlotHead then one record per touched
                  row (kdump.record.flight.gather); a slot never straddles the end

The allocation is made at the first recorded CUDA call outside capture and never during one;
it is exported through CUDA IPC (kdump.record.flight.devshare) and announced
(kdump.record.flight.announce) to the salvage process of `kdump record`
(kdump.record.flight.salvager), which writes it to `<journal>.cuda<N>` when the process ends,
however it ends. `read_dump` parses such a file strictly.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdump.errors import UsageError
from kdump.record.flight import announce, devshare

MAGIC = b"KDDEVT01"
VERSION = 1
HEADER_AT = 256
COUNTERS_AT = 1024
MAX_SITES = 384
TWIN_AT = 4096
_HEADER = struct.Struct("<8sI4xQQQQII")


class DeviceTierError(UsageError):
    """The device tier does not fit its budget, or a device-tier dump is not one or is damaged
    (a usage error, exit 2, as an unreadable bundle is)."""


@dataclass(frozen=True)
class Layout:
    twin_at: int
    twin_bytes: int
    ring_at: int
    ring_bytes: int
    slot_count: int
    slot_bytes: int

    @property
    def total(self) -> int:
        return self.ring_at + self.ring_bytes

    def header(self) -> bytes:
        return _HEADER.pack(
            MAGIC,
            VERSION,
            self.twin_at,
            self.twin_bytes,
            self.ring_at,
            self.ring_bytes,
            self.slot_count,
            self.slot_bytes,
        )


def plan_layout(budget: int, slot_count: int, slot_bytes: int) -> tuple[Layout | None, str]:
    """The layout within `budget` bytes (None and why when it does not fit)."""
    if budget <= 0:
        return None, "the device tier is off (device budget 0)"
    twin = slot_count * slot_bytes
    ring_at = -(-(TWIN_AT + twin) // 4096) * 4096
    ring = (budget - ring_at) // 4096 * 4096
    if ring < 1 << 20:
        return None, (
            f"the device budget of {budget} bytes does not hold the journal's twin "
            f"({twin} bytes) and a 1 MiB ring: raise --device-bytes or use fewer/smaller slots"
        )
    return Layout(TWIN_AT, twin, ring_at, ring, slot_count, slot_bytes), ""


@dataclass(frozen=True)
class Dump:
    """A device-tier dump, read back: its layout and the raw bytes."""

    layout: Layout
    raw: bytes

    @property
    def head(self) -> int:
        return struct.unpack_from("<Q", self.raw, 0)[0]

    @property
    def reserved_to(self) -> int:
        return struct.unpack_from("<Q", self.raw, 8)[0]

    def twin_slot(self, index: int) -> bytes:
        lay = self.layout
        if not 0 <= index < lay.slot_count:
            raise DeviceTierError(f"journal slot {index} is not in the device twin")
        a = lay.twin_at + index * lay.slot_bytes
        return self.raw[a : a + lay.slot_bytes]

    def ring(self, pos: int, nbytes: int) -> bytes:
        lay = self.layout
        phys = pos % lay.ring_bytes
        if phys + nbytes > lay.ring_bytes:
            raise DeviceTierError("a device ring slot runs past the end of the ring")
        return self.raw[lay.ring_at + phys : lay.ring_at + phys + nbytes]


def read_dump(path: Path) -> Dump:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise DeviceTierError(f"{path}: cannot read the device tier ({exc.strerror})")
    if len(raw) < TWIN_AT:
        raise DeviceTierError(f"{path}: not a device-tier dump (too short)")
    magic, version, twin_at, twin_bytes, ring_at, ring_bytes, count, sbytes = _HEADER.unpack_from(
        raw, HEADER_AT
    )
    if magic != MAGIC or version != VERSION:
        raise DeviceTierError(f"{path}: not a device-tier dump of this kdump (bad magic/version)")
    lay = Layout(twin_at, twin_bytes, ring_at, ring_bytes, count, sbytes)
    if (
        twin_at != TWIN_AT
        or twin_bytes != count * sbytes
        or ring_at < twin_at + twin_bytes
        or ring_bytes <= 0
        or lay.total != len(raw)
    ):
        raise DeviceTierError(f"{path}: device-tier dump header describes another size")
    return Dump(lay, raw)


class DeviceTier:
    """The allocation on one device, exported to the salvage process when there is one."""

    def __init__(self, journal: Any, device: Any, budget: int) -> None:
        import torch

        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else 0
        layout, why = plan_layout(budget, journal.slot_count, journal.slot_bytes)
        if layout is None:
            raise DeviceTierError(why)
        self.layout = layout
        with torch.cuda.device(self.device):
            self.mem = torch.zeros(layout.total, dtype=torch.uint8, device=self.device)
            head = torch.frombuffer(bytearray(layout.header()), dtype=torch.uint8)
            self.mem[HEADER_AT : HEADER_AT + head.numel()].copy_(head)
            torch.cuda.current_stream().synchronize()
        self.base = int(self.mem.data_ptr())
        self.counters = self.mem[COUNTERS_AT : COUNTERS_AT + 8 * MAX_SITES].view(torch.int64)
        self.held, self.reason = self._announce(journal.path)

    def _announce(self, journal_path: Path) -> tuple[bool, str]:
        """Hand the memory to the salvage process (kdump.record.flight.announce)."""
        try:
            doc = devshare.export_cuda(self.mem)
            why = announce.announce(journal_path, self.index, doc)
        except Exception as exc:  # announcing must never break the program
            return False, f"exporting the device tier failed ({type(exc).__name__}: {exc})"
        return (why is None), (why or "")

    def twin_addr(self, slot_index: int, offset: int = 0) -> int:
        return self.base + self.layout.twin_at + slot_index * self.layout.slot_bytes + offset

    @property
    def ctrl_addr(self) -> int:
        return self.base

    @property
    def ring_addr(self) -> int:
        return self.base + self.layout.ring_at

    def counter_addr(self, i: int) -> int:
        return self.base + COUNTERS_AT + 8 * i

    def facts(self) -> dict[str, Any]:
        return {
            "device_index": self.index,
            "bytes": self.layout.total,
            "ring_bytes": self.layout.ring_bytes,
            "held": self.held,
            "reason": self.reason or None,
        }

    def dump(self, path: Path) -> Path:
        """Write the tier to `path` from this (live) process: flush uses it."""
        import torch

        from kdump.bundle.store import atomic_write

        torch.cuda.synchronize(self.device)
        host = self.mem.cpu()
        atomic_write(path, ctypes.string_at(host.data_ptr(), host.numel()))
        return path
