"""Re-materialisation: re-create a call's tensors from their storage and tensor records with the
exact layout (storage offsets, aliasing, base-address alignment) on a device, and re-create the
bytes of storages a bundle does not hold from their statistics (`synthesize_span`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kdump.errors import BundleError, CannotRunError
from kdump.format.dtypes import dtype_from_name
from kdump.format.records import ALIGN_MOD, PREFIX_LIMIT, StorageRecord, TensorRecord

# Elements drawn per step when re-creating a storage from its statistics: the temporaries of one
# step (float64 draws and their narrowing) stay a few MiB whatever the span.
SYNTH_CHUNK = 1 << 18


# float4_e2m1fn_x2: the magnitudes of the 3-bit code (sign in bit 3), two codes per byte (first
# in the low nibble); torch cannot convert to it.
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def synthesize_span(st: StorageRecord, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bytes for a storage the bundle does not hold (by-reference / missing): values drawn with
    `seed` from its recorded stats (normal at mean/std, clipped to min/max), zeros without
    stats. A replay that uses them says so (`Call.synthesized`). Drawn SYNTH_CHUNK elements at a
    time and written in the stats' dtype straight into `out` (a contiguous CPU uint8 tensor of
    the span's size; a new one when None), so it costs the span and a few MiB, for every dtype
    the format has."""
    n = st.span_nbytes
    if out is None:
        out = torch.empty(n, dtype=torch.uint8)
    if out.numel() != n:
        raise BundleError(f"a re-created span holds {n} bytes, not {out.numel()}")
    if st.stats is None or n == 0:
        return out.zero_()
    s = st.stats
    dtype = dtype_from_name(s.dtype)
    size = dtype.itemsize
    g = torch.Generator(device="cpu").manual_seed(seed)
    step = SYNTH_CHUNK * size
    for start in range(0, n, step):
        nbytes = min(step, n - start)
        values = _draw(g, -(-nbytes // size) * _values_per_element(dtype), s)
        out[start : start + nbytes].copy_(_encode(values, dtype)[:nbytes])
    return out


def _values_per_element(dtype: torch.dtype) -> int:
    """Values one element holds: a complex number's two components, float4_e2m1fn_x2's two."""
    return 2 if dtype.is_complex or dtype == getattr(torch, "float4_e2m1fn_x2", None) else 1


# Dtypes whose values float32 cannot hold exactly are drawn in float64; the others in float32
# (five times faster to draw).
_WIDE = ("float64", "int32", "int64", "uint32", "uint64")


def _draw(g: torch.Generator, count: int, s: Any) -> torch.Tensor:
    wide = torch.float64 if s.dtype in _WIDE else torch.float32
    values = torch.randn(count, generator=g, dtype=wide)
    return values.mul_(s.std).add_(s.mean).clamp_(s.min, s.max)


def _encode(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Drawn values as the bytes of `dtype` (uint8, contiguous)."""
    if dtype == getattr(torch, "float4_e2m1fn_x2", None):
        return _encode_fp4_pairs(values)
    if dtype.is_complex:
        return values.to(torch.float32).view(torch.uint8)
    if dtype == torch.bool:
        return values.abs().ge(0.5).view(torch.uint8)  # round(v) != 0
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        values = values.round().clamp(info.min, info.max)
    return values.to(dtype).view(torch.uint8)


def _encode_fp4_pairs(values: torch.Tensor) -> torch.Tensor:
    """Pairs of values as float4_e2m1fn_x2 bytes (nearest magnitude; NaN becomes zero)."""
    mids = torch.tensor(_FP4_MIDPOINTS, dtype=values.dtype)
    mag = torch.nan_to_num(values.abs(), nan=0.0)
    codes = torch.bucketize(mag, mids).to(torch.uint8) | (values < 0).to(torch.uint8) << 3
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | pairs[:, 1] << 4


@dataclass(frozen=True)
class Placement:
    """How storages are laid out in memory when re-materialised.

    align:      the span's first byte gets the recorded address modulo ALIGN_MOD.
    flush_end:  the span's last byte is the allocation's last byte (what a memory checker needs).
    halo:       bytes of guard before and after each span (filled with `halo_fill`).
    """

    align: bool = True
    flush_end: bool = False
    halo: int = 0
    halo_fill: int = 0xFF


@dataclass
class Allocation:
    """A materialised storage: the buffer that holds it and where the span sits inside it."""

    storage: int
    buffer: torch.Tensor  # uint8, the whole allocation (halo and alignment slack included)
    span_offset: int  # byte offset of the span inside `buffer`
    span_nbytes: int
    recorded: StorageRecord
    storage_view: torch.UntypedStorage  # what the tensors are views of; starts `prefix` before span
    prefix: int  # bytes of the original storage re-created before the span (unrecorded, zero)

    @property
    def span_ptr(self) -> int:
        return self.buffer.data_ptr() + self.span_offset

    @property
    def span(self) -> torch.Tensor:
        return self.buffer[self.span_offset : self.span_offset + self.span_nbytes]


@dataclass(frozen=True)
class OffsetChange:
    """A tensor whose storage offset could not be kept (its storage's prefix was over budget)."""

    tensor: int
    recorded: int  # storage offset in elements, as recorded
    placed: int  # storage offset in elements, as materialised

    def describe(self, name: str) -> str:
        return f"{name}: storage offset {self.recorded} became {self.placed}"


@dataclass
class Materialized:
    tensors: list[torch.Tensor]
    allocations: list[Allocation] = field(default_factory=list)
    # Empty unless a prefix did not fit the budget; a replay says so in its verdict.
    offset_changes: list[OffsetChange] = field(default_factory=list)


class _CudaRegion:
    """Exposes part of a CUDA buffer through __cuda_array_interface__ (keeps the buffer alive)."""

    def __init__(self, owner: torch.Tensor, ptr: int, nbytes: int) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _region_storage(buf: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
    """An untyped storage that starts `offset` bytes into `buf` (so storage offsets stay exact)."""
    if offset == 0 and nbytes == buf.numel():
        return buf.untyped_storage()
    ptr = buf.data_ptr() + offset
    if buf.device.type == "cuda":
        if nbytes == 0:
            return buf[offset:offset].untyped_storage()
        with torch.cuda.device(buf.device):
            region = torch.as_tensor(_CudaRegion(buf, ptr, nbytes), device=buf.device)
        return region.untyped_storage()
    arr = (ctypes.c_char * nbytes).from_address(ptr)
    arr._kdump_owner = buf  # type: ignore[attr-defined]  # keeps the allocation alive
    return (
        torch.frombuffer(arr, dtype=torch.uint8, count=nbytes).untyped_storage()
        if nbytes
        else (torch.empty(0, dtype=torch.uint8).untyped_storage())
    )


def _allocate(
    nbytes: int, device: torch.device, target_align: int, placement: Placement
) -> tuple[torch.Tensor, int]:
    """Allocate a buffer holding `nbytes` at an offset with the wanted alignment."""
    halo = placement.halo
    if not placement.align:
        buf = torch.empty(nbytes + 2 * halo, dtype=torch.uint8, device=device)
        return buf, halo
    if not placement.flush_end:
        buf = torch.empty(nbytes + 2 * halo + ALIGN_MOD, dtype=torch.uint8, device=device)
        pad = (target_align - (buf.data_ptr() + halo)) % ALIGN_MOD
        return buf, halo + pad
    # End flush: the allocation must end exactly at the region's end (+ halo). The allocator's
    # alignment is unknown until we allocate, so guess, check, and retry with the corrected pad.
    front = moat_front(nbytes + 2 * halo + ALIGN_MOD, device)
    pad = target_align % ALIGN_MOD
    buf = torch.empty(0, dtype=torch.uint8, device=device)
    for _ in range(4):
        del buf  # let the allocator hand the same block back with the corrected size
        buf = torch.empty(front + pad + halo + nbytes + halo, dtype=torch.uint8, device=device)
        if (buf.data_ptr() + front + pad + halo) % ALIGN_MOD == target_align:
            return buf, front + pad + halo
        pad = (target_align - buf.data_ptr() - front - halo) % ALIGN_MOD
    return buf, buf.numel() - halo - nbytes  # alignment could not be matched; the end stays flush


MOAT = 1 << 20  # unallocated address space wanted after a flush allocation on a GPU


def moat_front(total: int, device: torch.device) -> int:
    """Bytes to put in front of a flush-end GPU allocation of `total` bytes so that it ends
    MOAT bytes into a 2 MiB granule of an address range of its own.

    Without the caching allocator (how memory checkers run) small allocations share address
    ranges with their neighbours, so a write just past the end lands in another live allocation
    and looks valid; allocations of 2 MiB and more get 2 MiB-aligned ranges, and the rest of the
    last granule is no allocation at all: a write there is reported, against this buffer."""
    if device.type != "cuda":
        return 0
    granule = 2 * MOAT
    want = max(granule + MOAT, -(-(total - MOAT) // granule) * granule + MOAT)
    return want - total


def _direct(
    view: torch.Tensor | None, st: StorageRecord, placement: Placement
) -> torch.Tensor | None:
    """`view` if it can stand for storage `st` in place (right size and alignment)."""
    if view is None or view.numel() != st.span_nbytes:
        return None
    if placement.align and view.data_ptr() % ALIGN_MOD != st.alignment:
        return None
    return view


def materialize(
    storages: Sequence[StorageRecord],
    tensors: Sequence[TensorRecord],
    read_span: Callable[[int], torch.Tensor],
    device: torch.device | str = "cpu",
    placement: Placement | None = None,
    fill_spans: Callable[[Sequence[tuple[int, torch.Tensor]]], None] | None = None,
    view_span: Callable[[int], torch.Tensor | None] | None = None,
) -> Materialized:
    """Re-create `tensors` with their exact layout on `device`.

    `read_span(i)` returns storage i's bytes as a CPU uint8 tensor. In every placement storage
    offsets, aliasing and base-address alignment are those of the call: the unrecorded bytes of a
    storage before its span are re-created (zeros by default; `halo_fill` poison with a halo or a
    flush end, so a read of them shows), within PREFIX_LIMIT per call; the offsets that changed
    past it are listed in `offset_changes`.
    On CPU, `fill_spans([(i, dest), ...])`, when given, fills every non-empty span in one batch
    instead of `read_span` (so a reader can copy and verify all spans in parallel, in one pass).
    On CPU, `view_span(i)`, when given, may return a private (copy-on-write) uint8 tensor of span
    i's bytes that a storage with nothing before its span (and no halo or flush end) then uses in
    place, without a copy, where its address has the recorded alignment.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CannotRunError("no CUDA device is available here; materialise on 'cpu' instead")
    placement = placement or Placement()
    guarded = placement.halo > 0 or placement.flush_end
    allocations: list[Allocation] = []
    batch: list[tuple[int, torch.Tensor]] = []
    prefix_budget = PREFIX_LIMIT
    for idx, st in enumerate(storages):
        prefix = st.span_start if st.span_start <= prefix_budget else 0
        prefix_budget -= prefix
        if view_span is not None and not guarded and prefix == 0 and device.type == "cpu":
            direct = _direct(view_span(idx), st, placement) if st.span_nbytes else None
            if direct is not None:
                storage = direct.untyped_storage()
                allocations.append(Allocation(idx, direct, 0, st.span_nbytes, st, storage, 0))
                continue
        region = prefix + st.span_nbytes
        buf, off = _allocate(region, device, (st.span_ptr - prefix) % ALIGN_MOD, placement)
        if placement.halo:
            buf[:off].fill_(placement.halo_fill)
            buf[off + region :].fill_(placement.halo_fill)
        if prefix:
            buf[off : off + prefix].fill_(placement.halo_fill if guarded else 0)
        span_off = off + prefix
        if st.span_nbytes and fill_spans is not None and device.type == "cpu":
            batch.append((idx, buf[span_off : span_off + st.span_nbytes]))
        elif st.span_nbytes:
            src = read_span(idx)
            if src.numel() != st.span_nbytes:
                raise BundleError(
                    f"storage {idx}: blob holds {src.numel()} bytes, the manifest says "
                    f"{st.span_nbytes}"
                )
            buf[span_off : span_off + st.span_nbytes].copy_(src)
        view = _region_storage(buf, off, region)
        allocations.append(Allocation(idx, buf, span_off, st.span_nbytes, st, view, prefix))
    if batch and fill_spans is not None:
        fill_spans(batch)
    out: list[torch.Tensor] = []
    changes: list[OffsetChange] = []
    for i, rec in enumerate(tensors):
        alloc = allocations[rec.storage]
        dtype = dtype_from_name(rec.dtype)
        byte_off = alloc.prefix - alloc.recorded.span_start + rec.storage_offset * dtype.itemsize
        if rec.numel == 0:
            byte_off = max(byte_off, 0)
        if byte_off % dtype.itemsize:
            raise BundleError(
                f"tensor {i}: byte offset {byte_off} is not a multiple of {rec.dtype}'s size"
            )
        t = torch.empty(0, dtype=dtype, device=device)
        t.set_(alloc.storage_view, byte_off // dtype.itemsize, rec.shape, rec.stride)
        if rec.requires_grad and (dtype.is_floating_point or dtype.is_complex):
            t.requires_grad_(True)
        if t.storage_offset() != rec.storage_offset:
            changes.append(OffsetChange(i, rec.storage_offset, t.storage_offset()))
        out.append(t)
    return Materialized(out, allocations, changes)
