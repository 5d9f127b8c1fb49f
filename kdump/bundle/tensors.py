"""The layout facts of tensor arguments: dtype names, and the grouping of a call's tensors into
the storage spans their views cover (storage and tensor records; reads no data).

A tensor argument is stored as the bytes of the storage span its views cover (never a
`.contiguous()` copy) plus the view's dtype, shape, stride and storage offset. Views that shared a
storage in the call share one buffer after loading, so aliasing (overlapping views, a view and its
base) survives the round trip. Absolute addresses are kept so fault addresses map back. Capturing
the bytes is `kdump.bundle.capture`'s job, re-creating the tensors `kdump.bundle.materialize`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from kdump.errors import BundleError
from kdump.format.dtypes import dtype_name, torch_dtypes
from kdump.format.records import (
    StorageRecord,
    TensorRecord,
    view_byte_extent,
)

# Every dtype a bundle may hold that this torch has, by its stable name in the format (the one
# table is kdump.format.dtypes').
DTYPES: dict[str, torch.dtype] = torch_dtypes()
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def _byte_view(t: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """A uint8 view of `nbytes` bytes of t's storage starting at byte `start`."""
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(t.untyped_storage(), start, (nbytes,), (1,))
    return out


# Results of group_storages by the layout facts of the tensors they came from (addresses
# included): a recorder calling a target again with the same tensors builds no records.
# Each entry: (storages, records, the index of the first tensor of each storage).
_Layout = tuple[tuple[StorageRecord, ...], tuple[TensorRecord, ...], tuple[int, ...]]
_LAYOUT_MEMO: dict[tuple[object, ...], _Layout] = {}
_LAYOUT_MEMO_MAX = 256


def layout_facts(t: torch.Tensor) -> tuple[object, ...]:
    """Everything group_storages reads of `t` (so equal facts give equal records). A strided
    tensor's own address follows from its storage's, its offset and its dtype."""
    if t.layout != torch.strided:  # no storage to ask for
        raise _layout_error(t)
    storage = t.untyped_storage()
    return (
        t.device,
        storage.data_ptr(),
        storage.nbytes(),
        t.dtype,
        t.shape,
        t.stride(),
        t.storage_offset(),
        t.requires_grad,
    )


def _layout_error(t: torch.Tensor) -> BundleError:
    return BundleError(f"tensor layout {t.layout} is not supported (strided tensors only)")


def group_storages(
    tensors: Sequence[torch.Tensor],
) -> tuple[list[StorageRecord], list[TensorRecord]]:
    """Group tensors by storage and compute each storage's covered span. Reads no data.

    The records are frozen and the lists returned are new, so a remembered result is shared."""
    storages, records, _ = _grouped(tensors)
    return list(storages), list(records)


def _grouped(tensors: Sequence[torch.Tensor]) -> _Layout:
    key = tuple(layout_facts(t) for t in tensors)
    hit = _LAYOUT_MEMO.get(key)
    if hit is None:
        storages, records = _group_storages(tensors)
        firsts: dict[int, int] = {}
        for k, rec in enumerate(records):
            firsts.setdefault(rec.storage, k)
        hit = (tuple(storages), tuple(records), tuple(firsts[i] for i in range(len(storages))))
        if len(_LAYOUT_MEMO) >= _LAYOUT_MEMO_MAX:
            # The oldest entry; another thread may be trimming at the same moment.
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                _LAYOUT_MEMO.pop(next(iter(_LAYOUT_MEMO)))
        _LAYOUT_MEMO[key] = hit
    return hit


def _group_storages(
    tensors: Sequence[torch.Tensor],
) -> tuple[list[StorageRecord], list[TensorRecord]]:
    strided = torch.strided
    order: dict[tuple[str, int], int] = {}
    spans: list[list[int]] = []
    bases: list[tuple[str, int, int]] = []  # (device, data pointer, nbytes) of each storage
    records: list[TensorRecord] = []
    for t in tensors:
        if t.layout != strided:
            raise _layout_error(t)
        shape = tuple(t.shape)
        stride = tuple(t.stride())
        if any(s < 0 for s in stride):
            raise BundleError("tensors with negative strides are not supported")
        storage = t.untyped_storage()
        device = str(t.device)
        key = (device, storage.data_ptr())
        offset = t.storage_offset()
        lo, hi = view_byte_extent(shape, stride, offset, t.element_size())
        idx = order.get(key)
        if idx is None:
            idx = order[key] = len(spans)
            spans.append([lo, hi])
            bases.append((device, key[1], storage.nbytes()))
        elif hi > lo:  # an empty view adds nothing to the span
            span = spans[idx]
            if span[1] <= span[0]:
                span[0], span[1] = lo, hi
            else:
                span[0], span[1] = min(span[0], lo), max(span[1], hi)
        records.append(
            TensorRecord(
                storage=idx,
                dtype=dtype_name(t.dtype),
                shape=shape,
                stride=stride,
                storage_offset=offset,
                requires_grad=bool(t.requires_grad),
                data_ptr=t.data_ptr(),
            )
        )
    storages = []
    for (lo, hi), (device, ptr, nbytes) in zip(spans, bases):
        if hi <= lo:
            lo = hi = min(lo, nbytes)
        storages.append(StorageRecord(device, ptr, nbytes, lo, hi - lo))
    return storages, records


def clone_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in memory of its own with the same shape and strides: the elements its view
    covers are copied and viewed again, so a broadcast (stride 0) view costs its span, never its
    dense size (`Tensor.clone` makes such a view dense)."""
    if t.numel() == 0 or t.is_contiguous():
        return t.clone()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.as_strided((span,), (1,)).clone().as_strided(t.shape, t.stride())
