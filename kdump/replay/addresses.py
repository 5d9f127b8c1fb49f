"""Mapping a device address from a sanitizer report back to the argument and element it falls in
or near: 'd[4097, 12]' or '16 bytes past the end of d'."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kdump.bundle.tensors import StorageRecord, TensorRecord


@dataclass(frozen=True)
class PlacedTensor:
    """Where a replayed argument lived in the sanitizer run."""

    name: str
    data_ptr: int
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def locate(addr: int, tensors: Sequence[PlacedTensor]) -> str:
    """'d[4097, 12]' or '16 bytes past the end of d' for the nearest argument."""
    storages = [StorageRecord("cuda", t.data_ptr, 0, 0, 0) for t in tensors]
    records = [
        TensorRecord(i, _DTYPE_BY_SIZE[t.itemsize], t.shape, t.stride, 0, data_ptr=t.data_ptr)
        for i, t in enumerate(tensors)
    ]
    found = locate_address(addr, storages, records, [t.name for t in tensors])
    return found or "no argument nearby"


# locate_address needs only the element size of a placed tensor, not its real dtype.
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
    idx = []
    # Walk dimensions by decreasing stride: exact for non-overlapping dense layouts.
    dims = sorted(range(len(rec.shape)), key=lambda d: -rec.stride[d])
    coord = [0] * len(rec.shape)
    for d in dims:
        if rec.stride[d] > 0 and rec.shape[d] > 1:
            coord[d] = min(elem // rec.stride[d], rec.shape[d] - 1)
            elem -= coord[d] * rec.stride[d]
    idx = ", ".join(str(c) for c in coord)
    return f"{name}[{idx}]"
