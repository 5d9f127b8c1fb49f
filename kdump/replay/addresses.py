"""Mapping a device address from a sanitizer report back to the argument and element it falls in
or near: 'd[4097, 12]', '16 bytes past the end of d', or, for an address in no argument, the
nearest argument and how far it is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kdump.format.records import StorageRecord, TensorRecord

NOT_AN_ARGUMENT = "not an argument — an allocation of the library itself"


@dataclass(frozen=True)
class PlacedTensor:
    """Where a replayed argument lived in the sanitizer run: its view and, when known, the whole
    allocation that holds its storage."""

    name: str
    data_ptr: int
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    alloc_ptr: int | None = None
    alloc_nbytes: int | None = None

    @property
    def view(self) -> tuple[int, int]:
        """[lo, hi) of the bytes the view can touch (non-negative strides)."""
        if any(s == 0 for s in self.shape):
            return self.data_ptr, self.data_ptr
        last = sum((n - 1) * st for n, st in zip(self.shape, self.stride))
        return self.data_ptr, self.data_ptr + (last + 1) * self.itemsize

    @property
    def allocation(self) -> tuple[int, int]:
        lo, hi = self.view
        if self.alloc_ptr is None or self.alloc_nbytes is None:
            return lo, hi
        return min(lo, self.alloc_ptr), max(hi, self.alloc_ptr + self.alloc_nbytes)

    @classmethod
    def from_event(cls, p: Mapping[str, Any]) -> PlacedTensor:
        """From a replay child's `placed` progress event."""
        return cls(
            p["name"],
            p["data_ptr"],
            p["itemsize"],
            tuple(p["shape"]),
            tuple(p["stride"]),
            p.get("alloc_ptr"),
            p.get("alloc_nbytes"),
        )


@dataclass(frozen=True)
class Location:
    """Where an address is, relative to the replay's arguments."""

    text: str  # 'd[4097, 12]', '16 bytes past the end of d', '120 bytes before out's ...'
    argument: str | None  # the argument it is in or attributed to; None when in none
    distance: int  # 0 inside a view; else bytes to the nearest argument
    in_argument: bool  # inside an argument's view


def locate(addr: int, tensors: Sequence[PlacedTensor]) -> str:
    """'d[4097, 12]' or '16 bytes past the end of d' for the nearest argument."""
    return locate_access(addr, tensors).text


def locate_access(
    addr: int,
    tensors: Sequence[PlacedTensor],
    nearest: Mapping[str, Any] | None = None,
) -> Location:
    """Where `addr` is: an element of a view; bytes before a view but inside its allocation;
    bytes past the end of an argument (storages end flush with their allocation in sanitizer
    mode: an overrun leaves it); or, before an argument's allocation or near an allocation no
    argument owns (`nearest`: the sanitizer's nearest allocation), in no argument at all."""
    if not tensors:
        return Location("no argument was placed", None, 0, False)
    for t in tensors:
        lo, hi = t.view
        if lo <= addr < hi:
            return Location(_element(t, addr - lo), t.name, 0, True)
    for t in tensors:
        a_lo, a_hi = t.allocation
        lo, hi = t.view
        if a_lo <= addr < lo:
            return Location(f"{lo - addr} bytes before {t.name}", t.name, lo - addr, False)
        if hi <= addr < a_hi:
            dist = addr - hi + 1
            return Location(f"{dist} bytes past the end of {t.name}", t.name, dist, False)
    owner = _owner(nearest, tensors) if nearest else None
    if nearest and owner is None:
        dist, name = _nearest_argument(addr, tensors)
        where = "after" if nearest.get("direction") == "after" else "before"
        return Location(
            f"{nearest.get('distance')} bytes {where} an allocation of "
            f"{nearest.get('allocation_size')} bytes at {int(nearest['allocation']):#x}: "
            f"{NOT_AN_ARGUMENT} (nearest argument: {name}, {dist} bytes away)",
            None,
            dist,
            False,
        )
    candidates = [owner] if owner is not None else list(tensors)
    best: Location | None = None
    for t in candidates:
        a_lo, _ = t.allocation
        _, hi = t.view
        if addr < a_lo and t.alloc_ptr is None:  # allocation unknown: attribute to the view
            dist = a_lo - addr
            loc = Location(f"{dist} bytes before {t.name}", t.name, dist, False)
        elif addr < a_lo:
            dist = a_lo - addr
            text = f"{dist} bytes before {t.name}'s allocation: {NOT_AN_ARGUMENT}"
            loc = Location(text, None, dist, False)
        else:
            dist = addr - hi + 1
            loc = Location(f"{dist} bytes past the end of {t.name}", t.name, dist, False)
        if best is None or loc.distance < best.distance:
            best = loc
    assert best is not None
    return best


def _owner(nearest: Mapping[str, Any], tensors: Sequence[PlacedTensor]) -> PlacedTensor | None:
    """The argument whose allocation is the sanitizer's nearest allocation."""
    start = int(nearest.get("allocation", -1))
    end = start + int(nearest.get("allocation_size", 0))
    for t in tensors:
        lo, hi = t.allocation
        if lo < end and start < hi:
            return t
    return None


def _nearest_argument(addr: int, tensors: Sequence[PlacedTensor]) -> tuple[int, str]:
    def distance(t: PlacedTensor) -> int:
        lo, hi = t.allocation
        return lo - addr if addr < lo else max(addr - hi + 1, 0)

    t = min(tensors, key=distance)
    return distance(t), t.name


def _element(t: PlacedTensor, byte_off: int) -> str:
    rec = TensorRecord(0, _DTYPE_BY_SIZE[t.itemsize], t.shape, t.stride, 0, data_ptr=t.data_ptr)
    return describe_element(t.name, rec, byte_off)


# Element coordinates need only the element size of a placed tensor, not its real dtype.
_DTYPE_BY_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def locate_address(
    addr: int,
    storages: Sequence[StorageRecord],
    tensors: Sequence[TensorRecord],
    names: Sequence[str],
) -> str | None:
    """Describe which recorded argument an absolute address falls in or near (None if far)."""
    best: tuple[int, str] | None = None
    for name, rec in zip(names, tensors):
        st = storages[rec.storage]
        lo = st.base_ptr + rec.storage_offset * rec.itemsize
        _, hi_rel = rec.byte_extent()
        hi = st.base_ptr + hi_rel
        if lo <= addr < hi:
            return describe_element(name, rec, addr - lo)
        dist = lo - addr if addr < lo else addr - hi + 1
        where = (
            f"{dist} bytes before {name}" if addr < lo else f"{dist} bytes past the end of {name}"
        )
        if best is None or dist < best[0]:
            best = (dist, where)
    return best[1] if best else None


def describe_element(name: str, rec: TensorRecord, byte_off: int) -> str:
    """'name[i, j]' for the element at `byte_off` bytes from the view's first element."""
    elem = byte_off // rec.itemsize
    # Walk dimensions by decreasing stride: exact for non-overlapping dense layouts.
    dims = sorted(range(len(rec.shape)), key=lambda d: -rec.stride[d])
    coord = [0] * len(rec.shape)
    for d in dims:
        if rec.stride[d] > 0 and rec.shape[d] > 1:
            coord[d] = min(elem // rec.stride[d], rec.shape[d] - 1)
            elem -= coord[d] * rec.stride[d]
    idx = ", ".join(str(c) for c in coord)
    return f"{name}[{idx}]"
