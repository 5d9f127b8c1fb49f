"""Static operands of the flight recorder: weights copied once per (storage, version).

A static operand is a storage bigger than `MIN_BYTES` that the kernel only reads and that does not
change between calls: for a target with a spec, an argument of role `weight` (kdump.kernels.plugin);
for a target without one, an input whose storage (device, data pointer, size, and the same tensor
object, so a fresh allocation at a recycled address is new) and version counter (`tensor._version`,
bumped by every in-place torch op) were already seen at an earlier eager call. Instead of into
every call's journal slot, its span is copied ONCE per (storage, version) into the static region,
a second shared-memory file next to the journal (`<journal>.static`, pinned with cudaHostRegister
for CUDA tensors), asynchronously on the call's stream at an eager call; its value statistics are
computed once too (on the device, into the region, with no host sync). A slot names the entry
(index, sequence number, offset, nbytes, version) in its storage's metadata; salvage
(kdump.record.flight.statics_reader) checks the entry still holds that sequence number,
completely copied, so an entry overwritten or being rewritten later is detected. Never during
stream capture: a static first seen there is recorded by reference and says why. What is over the
region's budget keeps its statistics only.

Limits: a kernel that writes a storage through its raw pointer (not a torch op) leaves its
version unchanged; for targets without a spec such a buffer reads as static and keeps the bytes of
its first static copy, also at a CUDA graph's capture site whose static entry exists by then
(the graph then does not copy it at every replay). The region only grows: when full, new
statics keep their statistics, and a storage already copied re-uses its own entry for its next
version (older slots then read by reference).

Region file (little-endian):

    offset  size  field
    0       8     magic b"KDSTAT\\0\\1"
    8       4     version (REGION_VERSION)
    12      4     entry count E
    16      8     table offset (4096)
    24      8     data offset (a multiple of 4096)
    32      8     data capacity in bytes
    40      8     pid of the recording process
    48      4     CRC-32 of bytes [0, 48)

    Entry e at table offset + e * ENTRY_BYTES:
    0       4     magic b"KDSE" (zero: unused or being rewritten)
    4       4     flags: bit 0 bytes copied, bit 1 host copy (the data CRC is valid), bit 2 stats
    8       8     seq (unique in the region, from 1)
    16      8     offset of the bytes in the file
    24      8     nbytes
    32      8     storage base pointer
    40      8     storage nbytes
    48      8     span start
    56      8     version counter
    64      4     dtype index (sorted format dtype names) of the statistics' element type
    68      4     device index (-1: CPU), signed
    72      4     CRC-32 of [0, 72)
    80      8     pre marker: seq, written before the bytes
    88      8     post marker: seq, written after them
    96      4     CRC-32 of the bytes (host copies)
    104     40    statistics: count, sum, sum of squares, min, max (float64, finite values only)
    144     8     statistics marker: seq as float64, written after them
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import struct
import threading
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kdump.format.journal import PAGE, JournalError
from kdump.format.records import DTYPE_SIZES, Stats
from kdump.log import log_once
from kdump.record.flight import pinned
from kdump.record.flight.journal import SHM_SHARE

STATIC_SUFFIX = ".static"
REGION_MAGIC = b"KDSTAT\x00\x01"
REGION_VERSION = 1
ENTRY_MAGIC = b"KDSE"
ENTRY_BYTES = 160
DEFAULT_ENTRIES = 4096
MIN_BYTES = 64 << 10  # smaller inputs are cheaper to copy into every slot
ALIGN = 64
SEEN_MAX = 1 << 16  # storage identities remembered for the "unchanged since" test
STATS_CHUNK = 1 << 22  # elements reduced at once (float64 temporaries of 32 MiB)

FLAG_DATA = 1
FLAG_HOST = 2
FLAG_STATS = 4

REGION_HEADER = struct.Struct("<8sIIQQQQ")  # through the pid; its CRC follows
ENTRY_HEAD = struct.Struct("<4sIQQQQQQQIi")  # through the device index; its CRC follows
AT_CRC, AT_PRE, AT_POST, AT_DATA_CRC, AT_STATS, AT_STATS_MARK = 72, 80, 88, 96, 104, 144
STATS_DTYPES = sorted(DTYPE_SIZES)

log = logging.getLogger("kdump.record.flight.statics")


def region_path(journal: Path) -> Path:
    return journal.with_name(journal.name + STATIC_SUFFIX)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def device_index(device: str) -> int:
    kind, _, idx = device.partition(":")
    return -1 if kind == "cpu" else int(idx or 0)


def fit_capacity(directory: Path, fixed: int, budget: int) -> int:
    """The data capacity the region gets in `directory`: `budget`, or less when shared memory is
    short (one log line says how to fix it)."""
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise JournalError(f"{directory}: cannot check free space ({exc.strerror})")
    free = st.f_bavail * st.f_frsize
    fits = max(0, (int(free * SHM_SHARE) - fixed) // PAGE * PAGE)
    if fits >= budget:
        return budget
    log.warning(
        "kdump: flight recorder static region shrunk to %.0f of %.0f MiB: %s has %.0f MiB free; "
        "give the container more shared memory (docker run --shm-size=1g) or lower "
        "KDUMP_STATIC_BYTES",
        fits / (1 << 20),
        budget / (1 << 20),
        directory,
        free / (1 << 20),
    )
    return fits


# ---------------------------------------------------------------------------------------------
# Value statistics


def stats_dtype(dtype: Any) -> str:
    """The element type statistics are over: complex values count as their real components."""
    import torch

    from kdump.format.dtypes import dtype_name

    return "float32" if dtype == torch.complex64 else dtype_name(dtype)


def value_stats(values: Any, conj: bool = False, neg: bool = False) -> Any:
    """[count, sum, sum of squares, min, max] (float64, on `values`' device) over the finite
    decoded values as the kernel saw them (lazy conj / neg applied). Queues device work only:
    nothing here waits for the device."""
    import torch

    f64 = torch.float64
    flat = values.reshape(-1)
    dev = flat.device
    acc = torch.zeros(3, dtype=f64, device=dev)
    lo = torch.full((1,), math.inf, dtype=f64, device=dev)
    hi = torch.full((1,), -math.inf, dtype=f64, device=dev)
    for start in range(0, flat.numel(), STATS_CHUNK):
        x = flat[start : start + STATS_CHUNK]
        if x.is_complex():
            x = torch.view_as_real(x.conj_physical() if conj else x)
        x = x.to(f64)
        if neg:
            x = -x
        fin = torch.isfinite(x)
        z = torch.where(fin, x, 0.0)
        acc += torch.stack([fin.sum(dtype=f64), z.sum(), (z * z).sum()])
        lo = torch.minimum(lo, torch.where(fin, x, math.inf).amin().reshape(1))
        hi = torch.maximum(hi, torch.where(fin, x, -math.inf).amax().reshape(1))
    return torch.cat([acc, lo, hi])


def decode_stats(dtype: str, raw: Sequence[float], checksum: str = "") -> Stats:
    """Stats from [count, sum, sum of squares, min, max]; std is torch's (unbiased)."""
    n, s, ss, lo, hi = (float(v) for v in raw)
    if n <= 0 or not all(math.isfinite(v) for v in (s, ss, lo, hi)):
        return Stats(dtype, 0.0, 0.0, 0.0, 0.0, checksum)
    mean = s / n
    var = max(0.0, (ss - s * mean) / (n - 1)) if n > 1 else 0.0
    return Stats(dtype, lo, hi, mean, math.sqrt(var), checksum)


# ---------------------------------------------------------------------------------------------
# Lazy conj / neg bits


def lazy_bits(
    tensors: Sequence[Any],
    records: Sequence[Any],
    count: int,
    firsts: Sequence[int] | None = None,
) -> list[dict | None]:
    """Per storage: the lazy conj / neg bits of its first view (as the sync recorder resolves
    them), or None. The bytes are copied raw; salvage applies the bits (`resolve_lazy`).
    `firsts`: per storage, the index of its first view, when the caller knows them."""
    if firsts is None:
        firsts = first_views(records, count)
    out: list[dict | None] = [None] * count
    for i, f in enumerate(firsts):
        t = tensors[f]
        conj, neg = bool(t.is_conj()), bool(t.is_neg())
        if conj or neg:
            from kdump.format.dtypes import dtype_name

            out[i] = {"dtype": dtype_name(t.dtype), "conj": conj, "neg": neg}
    return out


def first_views(records: Sequence[Any], count: int) -> tuple[int, ...]:
    """Per storage: the index of the first tensor record viewing it."""
    out: dict[int, int] = {}
    for i, r in enumerate(records):
        out.setdefault(r.storage, i)
    return tuple(out[i] for i in range(count))


def resolve_lazy(data: Any, lazy: dict | None) -> Any:
    """The values the kernel saw, from raw span bytes (a CPU uint8 tensor, changed in place)."""
    if not lazy:
        return data
    from kdump.format.dtypes import dtype_from_name

    dtype = dtype_from_name(str(lazy.get("dtype")))
    if data.numel() % dtype.itemsize:
        return data  # a span shared with views of other dtypes: no whole elements to resolve
    values = data.view(dtype)
    if lazy.get("conj") and values.is_complex():
        values.conj_physical_()
    if lazy.get("neg"):
        values.neg_()
    return data


# ---------------------------------------------------------------------------------------------
# The writer


@dataclass(frozen=True)
class Candidates:
    """Which storages of a call layout may be static (what `Statics.refer` asks of the layout,
    the same for every call of one signature)."""

    by_role: bool  # a spec names the weights: only they are static
    storages: tuple[tuple[int, int], ...]  # (storage, index of its first view), in order

    @classmethod
    def of(
        cls, records: Sequence[Any], storages: Sequence[Any], roles: Sequence[str | None]
    ) -> Candidates:
        barred: set[int] = set()
        weights: set[int] = set()
        for r, role in zip(records, roles):
            if role == "weight":
                weights.add(r.storage)
            elif role is not None:
                barred.add(r.storage)
        by_role = any(role is not None for role in roles)
        firsts = first_views(records, len(storages))
        keep = tuple(
            (i, firsts[i])
            for i, s in enumerate(storages)
            if not (i in barred or s.span_nbytes <= MIN_BYTES or (by_role and i not in weights))
        )
        return cls(by_role, keep)


@dataclass
class _Entry:
    index: int
    seq: int
    offset: int
    nbytes: int
    span_start: int
    version: int
    copied: bool
    owner: Any  # a weak reference to the tensor the storage was seen through


def _owner(t: Any) -> Any:
    """The tensor object that owns t's version counter (its base for a view)."""
    return t._base if t._base is not None else t


class Statics:
    """The static region of one recording process and the decisions that fill it."""

    def __init__(self, journal: Path, budget: int, entries: int = DEFAULT_ENTRIES) -> None:
        self.path = region_path(journal)
        self.budget = budget
        self.entry_count = entries
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, int, int], tuple[int, Any]] = OrderedDict()
        self._by_key: dict[tuple[str, int, int], _Entry] = {}
        self._fd = -1
        self._view: memoryview | None = None
        self._map: mmap.mmap | None = None
        self._seq = 0
        self._next_entry = 0
        self._used = 0
        self.capacity = 0
        self.data_offset = 0
        self._registered = False
        self._failed = False
        # Bumped by every change to what `refer` decides from (seen storages, entries, failure):
        # a call whose `refer` changed nothing gets the same references again while it holds.
        self.generation = 0

    # -- the file ---------------------------------------------------------------------------------
    def _open(self) -> memoryview:
        if self._view is not None:
            return self._view
        table = PAGE
        self.data_offset = _round_up(table + self.entry_count * ENTRY_BYTES, PAGE)
        self.capacity = fit_capacity(self.path.parent, self.data_offset, self.budget)
        size = self.data_offset + self.capacity
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # running out of tmpfs later would SIGBUS
            head = REGION_HEADER.pack(
                REGION_MAGIC,
                REGION_VERSION,
                self.entry_count,
                table,
                self.data_offset,
                self.capacity,
                os.getpid(),
            )
            os.pwrite(fd, head + struct.pack("<I", zlib.crc32(head)), 0)
            self._map = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise JournalError(f"{self.path}: cannot make the static region ({exc.strerror})")
        self._fd = fd
        self._view = memoryview(self._map)
        return self._view

    def _register(self) -> bool:
        """Pin the region for the device's asynchronous copies (once)."""
        if self._registered:
            return True

        assert self._map is not None
        addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._end_pin = pinned.register(
            addr, len(self._map), 0, "the static region", self, path=self.path
        )
        self._addr = addr
        self._registered = True
        return True

    def close(self, unlink: bool = False) -> None:
        with self._lock:
            if self._registered:
                try:
                    import torch

                    torch.cuda.synchronize()
                    self._end_pin()
                except Exception:
                    pass
                self._registered = False
            if self._view is not None:
                self._view.release()
                self._view = None
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:  # a view is still held; the mapping goes with it
                    pass
                self._map = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if unlink:
                self.path.unlink(missing_ok=True)

    # -- the decisions ----------------------------------------------------------------------------
    def refer(
        self,
        tensors: Sequence[Any],
        records: Sequence[Any],
        storages: Sequence[Any],
        roles: Sequence[str | None],
        capturing: bool,
        candidates: Candidates | None = None,
    ) -> list[dict | None]:
        """Per storage: the static reference its slot metadata carries (None: not static). Queues
        the copy and the statistics of a static seen for the first time (eager calls only).
        `candidates`: `candidates(records, storages, roles)`, when the caller keeps it."""
        if candidates is None:
            candidates = Candidates.of(records, storages, roles)
        out: list[dict | None] = [None] * len(storages)
        if self._failed or not candidates.storages:
            return out
        by_role = candidates.by_role
        with self._lock:
            for i, first in candidates.storages:
                s = storages[i]
                t = tensors[first]
                try:
                    out[i] = self._one(t, s, capturing, by_role)
                except Exception as exc:
                    self._failed = True
                    self.generation += 1
                    log_once(f"statics:{os.getpid()}", f"static operands are off: {exc}")
                    return [None] * len(storages)
        return out

    def _one(self, t: Any, s: Any, capturing: bool, by_role: bool) -> dict | None:
        version = version_of(t)
        if version is None:
            return None
        key = (s.device, s.base_ptr, s.storage_nbytes)
        owner = _owner(t)
        known = self._by_key.get(key)
        end = s.span_start + s.span_nbytes
        if (
            known is not None
            and known.version == version
            and (by_role or known.owner() is owner)
            and known.span_start <= s.span_start
            and end <= known.span_start + known.nbytes
        ):
            return self._ref(known, s)
        if not by_role:  # no spec: static once seen unchanged at an earlier eager call
            seen = self._seen.get(key)
            if seen is None or seen[0] != version or seen[1]() is not owner:
                if not capturing:
                    self.generation += 1
                    self._seen[key] = (version, weakref.ref(owner))
                    self._seen.move_to_end(key)
                    while len(self._seen) > SEEN_MAX:
                        self._seen.popitem(last=False)
                return None
        if capturing:
            return {"version": version, "why": "first seen during stream capture: not copied"}
        entry = self._new_entry(key, t, s, version)
        if entry is None:
            return {"version": version, "why": "the static region's entry table is full"}
        self.generation += 1
        self._by_key[key] = entry
        return self._ref(entry, s)

    @staticmethod
    def _ref(e: _Entry, s: Any) -> dict:
        return {
            "entry": e.index,
            "seq": e.seq,
            "offset": e.offset + (s.span_start - e.span_start),
            "nbytes": s.span_nbytes,
            "version": e.version,
            "copied": e.copied,
        }

    def _new_entry(self, key: tuple[str, int, int], t: Any, s: Any, version: int) -> _Entry | None:
        view = self._open()
        fill = self._fill_for(t)
        host = fill == self._host_fill
        if not host:
            self._register()
        n = s.span_nbytes
        old = self._by_key.get(key)
        if self._used + n <= self.capacity:
            index = self._take_index()
            if index is None:
                return None
            offset, copied = self.data_offset + self._used, True
            self._used = _round_up(self._used + n, ALIGN)
        elif old is not None and old.copied and n <= old.nbytes:
            index, offset, copied = old.index, old.offset, True  # full: its own copy is refreshed
        else:
            index = self._take_index() if old is None else old.index
            if index is None:
                return None
            offset, copied = 0, False  # over budget: the statistics only
        self._seq += 1
        seq = self._seq
        base = PAGE + index * ENTRY_BYTES
        view[base : base + ENTRY_BYTES] = bytes(ENTRY_BYTES)  # first: no old copy reads valid
        flags = (FLAG_DATA if copied else 0) | (FLAG_HOST if host else 0) | FLAG_STATS
        try:
            sdtype = STATS_DTYPES.index(stats_dtype(t.dtype))
        except Exception:
            sdtype, flags = 0, flags & ~FLAG_STATS
        head = ENTRY_HEAD.pack(
            ENTRY_MAGIC,
            flags,
            seq,
            offset,
            n if copied else 0,
            s.base_ptr,
            s.storage_nbytes,
            s.span_start,
            version,
            sdtype,
            device_index(s.device),
        )
        view[base + AT_CRC : base + AT_CRC + 4] = struct.pack("<I", zlib.crc32(head))
        view[base : base + ENTRY_HEAD.size] = head
        from kdump.bundle.tensors import _byte_view

        fill(view, base, seq, offset if copied else None, _byte_view(t, s.span_start, n), t, flags)
        owner = weakref.ref(_owner(t))
        return _Entry(index, seq, offset, n, s.span_start, version, copied, owner)

    def _fill_for(self, t: Any) -> Any:
        """How an entry is filled: queued on the current stream for device tensors, by the host
        (with a CRC of the bytes) for CPU tensors."""
        return self._device_fill if t.is_cuda else self._host_fill

    def _take_index(self) -> int | None:
        if self._next_entry >= self.entry_count:
            return None
        self._next_entry += 1
        return self._next_entry - 1

    @staticmethod
    def _stats_of(src: Any, t: Any, flags: int) -> Any | None:
        """The span's statistics as the view's dtype; None where they cannot be taken (no whole
        elements, a dtype torch cannot decode): the entry then keeps its layout only."""
        if not flags & FLAG_STATS:
            return None
        try:
            return value_stats(src.view(t.dtype), bool(t.is_conj()), bool(t.is_neg()))
        except (RuntimeError, TypeError, NotImplementedError):
            return None

    def _host_fill(
        self, view: memoryview, base: int, seq: int, offset: int | None, src: Any, t: Any, f: int
    ) -> None:
        import torch

        crc = 0
        if offset is not None:
            dst = view[offset : offset + src.numel()]
            if src.numel():
                torch.frombuffer(dst, dtype=torch.uint8).copy_(src)
            crc = zlib.crc32(dst)
        else:
            crc = zlib.crc32(memoryview(src.numpy()))
        struct.pack_into("<I", view, base + AT_DATA_CRC, crc)
        struct.pack_into("<QQ", view, base + AT_PRE, seq, seq)
        raw = self._stats_of(src, t, f)
        if raw is not None:
            struct.pack_into("<5d", view, base + AT_STATS, *raw.tolist())
            struct.pack_into("<d", view, base + AT_STATS_MARK, float(seq))

    def _device_fill(
        self, view: memoryview, base: int, seq: int, offset: int | None, src: Any, t: Any, f: int
    ) -> None:
        """Queue the copy and the statistics on the current stream; markers ordered around them."""
        import torch

        def host(at: int, n: int, dtype: Any) -> Any:
            return torch.frombuffer(view[base + at : base + at + n], dtype=dtype)

        dev = src.device
        if offset is not None:
            tok = torch.full((1,), seq, dtype=torch.int64, device=dev)
            host(AT_PRE, 8, torch.int64).copy_(tok, non_blocking=True)
            if src.numel():
                dst = torch.frombuffer(view[offset : offset + src.numel()], dtype=torch.uint8)
                dst.copy_(src, non_blocking=True)
            host(AT_POST, 8, torch.int64).copy_(tok, non_blocking=True)
        raw = self._stats_of(src, t, f)
        if raw is not None:
            host(AT_STATS, 40, torch.float64).copy_(raw, non_blocking=True)
            mark = torch.full((1,), float(seq), dtype=torch.float64, device=dev)
            host(AT_STATS_MARK, 8, torch.float64).copy_(mark, non_blocking=True)


def version_of(t: Any) -> int | None:
    """A tensor's version counter; None for an inference tensor (made under
    `torch.inference_mode`, as serving code runs), which has none: it is never taken for static,
    its in-place changes being invisible."""
    return None if t.is_inference() else int(t._version)


def storage_meta(
    storages: list[dict[str, Any]],
    tensors: Sequence[Any],
    records: Sequence[Any],
    refs: Sequence[dict | None],
    lazy: Sequence[dict | None] | None = None,
) -> list[dict[str, Any]]:
    """The slot's storage dicts with what this module adds: the version counter of the first
    view (salvage matches static copies made at later calls by it), the static reference, and
    the first view's lazy conj / neg bits (`lazy`: from `lazy_bits`, when the caller has them)."""
    if lazy is None:
        lazy = lazy_bits(tensors, records, len(storages))
    versions: dict[int, int | None] = {}
    for t, r in zip(tensors, records):
        versions.setdefault(r.storage, version_of(t))
    for i, (d, ref, bits) in enumerate(zip(storages, refs, lazy)):
        v = versions.get(i, 0)
        if v is not None:  # an inference tensor's storage has no version to record
            d["version"] = v
        if ref is not None:
            d["static"] = ref
        if bits is not None:
            d["lazy"] = bits
    return storages
