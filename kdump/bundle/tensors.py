"""Exact-layout capture and re-materialisation of tensors.

A tensor argument is stored as the bytes of the storage span its views cover (never a
`.contiguous()` copy) plus the view's dtype, shape, stride and storage offset. Views that shared a
storage in the call share one buffer after loading, so aliasing (overlapping views, a view and its
base) survives the round trip. Absolute addresses are kept so fault addresses map back.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kdump.bundle import bytecmp
from kdump.errors import BundleError, CannotRunError
from kdump.format.records import (
    ALIGN_MOD,
    DTYPE_SIZES,
    StorageRecord,
    TensorRecord,
    view_byte_extent,
)

# Every dtype a bundle may hold that this torch has, by its stable name in the format.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in DTYPE_SIZES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise BundleError(f"dtype {dtype} is not supported by the kdump format") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise BundleError(f"unknown dtype {name!r} in bundle (this kdump knows {sorted(DTYPES)})")


@dataclass
class Captured:
    """Tensors of one call, grouped into storages, with the bytes of each span (CPU uint8)."""

    storages: list[StorageRecord]
    tensors: list[TensorRecord]
    data: list[torch.Tensor]  # one contiguous CPU uint8 tensor per storage
    # (SHA-256, fast check) of each storage's bytes where the capture already hashed them (a
    # capture written straight into its bundle file; `kdump.bundle.store.Pieces` for a span
    # written in pieces); empty or None where not yet known.
    digests: list[Any] = field(default_factory=list)
    # Device copies of the spans a call may write in place, made before it (storage index ->
    # uint8 device tensor): its outputs are compared with them on the device. Never stored.
    device_copies: dict[int, torch.Tensor] = field(default_factory=dict)

    def digest(self, idx: int) -> Any:
        return self.digests[idx] if idx < len(self.digests) else None

    @property
    def nbytes(self) -> int:
        return sum(s.span_nbytes for s in self.storages)


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


def _same_at(a: torch.Tensor, ptr: int, n: int) -> bool:
    """Whether a contiguous CPU uint8 tensor holds the `n` bytes at address `ptr` (memcmp:
    torch.equal allocates a result per byte)."""
    return a.numel() == n and bytecmp.same(a.data_ptr(), ptr, n)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU uint8 tensors hold the same bytes."""
    n = a.numel()
    return n == b.numel() and bytecmp.same(a.data_ptr(), b.data_ptr(), n)


# A large span's first bytes compared before its digests are asked for (a changed output
# usually differs there); the rest of its first bytecmp.PIECE by the pool job that hashes its
# first piece.
EARLY = 64 << 10


def _same_as_written(
    earlier: Captured, views: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]
) -> list[bool]:
    """For each (storage i, snapshot j): whether the CPU span `views[i]` still holds the bytes
    of its snapshot `earlier.data[j]`. Large spans written into a file (their digests known)
    are compared by memcmp over the first piece (a changed output usually differs early: the
    first EARLY bytes before anything else, the rest by the job hashing its first piece), and
    by their fast check digests, all spans' pieces on the pool at once: the live bytes are read
    once instead of them and a map of the file (xxh3-128: a change that keeps the digest is no
    concern for bytes a kernel wrote). Others by memcmp."""
    from kdump.bundle.spool import cpu_view
    from kdump.bundle.store import same_as_digests

    out: list[bool | None] = []
    by_digest: list[int] = []
    for i, j in pairs:
        written, live, digests = earlier.data[j], views[i], earlier.digest(j)
        n = live.numel()
        if n != written.numel():
            out.append(False)
        elif digests is None or n < bytecmp.SPLIT_MIN:
            out.append(_same_bytes(written, live))
        elif bytecmp.memcmp(written.data_ptr(), live.data_ptr(), EARLY) != 0:
            out.append(False)
        else:
            out.append(None)
            by_digest.append(len(out) - 1)
    items = [(cpu_view(views[pairs[k][0]]), earlier.digest(pairs[k][1])) for k in by_digest]

    def rest_of_first(k: int) -> bool:
        i, j = pairs[by_digest[k]]
        a, b = earlier.data[j].data_ptr() + EARLY, views[i].data_ptr() + EARLY
        return bytecmp.memcmp(a, b, bytecmp.PIECE - EARLY) == 0

    for k, ok in zip(by_digest, same_as_digests(items, rest_of_first)):
        i, j = pairs[k]
        out[k] = _same_bytes(earlier.data[j], views[i]) if ok is None else ok
    return [bool(x) for x in out]


class Sink(Protocol):
    """Where a capture can write storage spans as it reads them (kdump.bundle.spool.Spool)."""

    @property
    def active(self) -> bool: ...

    def put(
        self, sources: Sequence[torch.Tensor], aligns: Sequence[int], records: int = 0
    ) -> list[tuple[torch.Tensor, Any]]: ...  # digests: a pair, or a store.Pieces


SINK_MIN = 8 << 20  # a capture of fewer bytes stays in memory unless its sink is already in use


# Device copies for the output compare (`capture`'s `watch`): spans from this size (comparing a
# smaller span through the host costs little), within this share of the device's free memory
# and at most DEVICE_COPY_MAX bytes per call (a recorded program keeps its memory).
DEVICE_COPY_MIN = 64 << 10
DEVICE_COPY_SHARE = 4
DEVICE_COPY_MAX = 2 << 30


def _device_copies(
    tensors: Sequence[torch.Tensor],
    storages: Sequence[StorageRecord],
    records: Sequence[TensorRecord],
    first: Sequence[int],
    watch: Collection[int],
) -> dict[int, torch.Tensor]:
    """Device copies of the watched tensors' storage spans (those a call may write in place),
    queued on the caller's stream before the call, so that the comparison after it runs on the
    device instead of copying the span to the host a second time. Only within a share of the
    free device memory; none during stream capture, for spans seen through lazy conj / neg
    views, or when the device refuses (the comparison then goes through the host, as before)."""
    want = sorted(
        {
            records[k].storage
            for k in watch
            if 0 <= k < len(records)
            and storages[records[k].storage].device.startswith("cuda")
            and storages[records[k].storage].span_nbytes >= DEVICE_COPY_MIN
        }
    )
    out: dict[int, torch.Tensor] = {}
    budget: dict[torch.device, int] = {}
    try:
        if not want or torch.cuda.is_current_stream_capturing():
            return {}
        for i in want:
            t = tensors[first[i]]
            if _has_lazy_bits(t):
                continue
            dev = t.device
            if dev not in budget:
                free, _ = torch.cuda.mem_get_info(dev)
                cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
                budget[dev] = min((free + cached) // DEVICE_COPY_SHARE, DEVICE_COPY_MAX)
            st = storages[i]
            if st.span_nbytes > budget[dev]:
                continue
            budget[dev] -= st.span_nbytes
            with torch.cuda.device(dev):
                out[i] = _byte_view(t, st.span_start, st.span_nbytes).clone()
    except Exception:  # out of memory, a device that cannot say: the copies made so far still
        pass  # serve, the rest compare through the host
    return out


def capture(
    tensors: Sequence[torch.Tensor],
    unchanged_from: Captured | None = None,
    sink: Sink | None = None,
    watch: Collection[int] = (),
) -> Captured:
    """Snapshot the storage spans that `tensors` cover, as CPU bytes.

    Device tensors are copied to pinned host memory in one batch and synchronised once. A CPU
    span that `unchanged_from` (an earlier snapshot) holds with the same bytes shares its snapshot
    (comparing is cheaper than copying into fresh memory: outputs a call left unchanged).
    With `sink` (and at least SINK_MIN bytes, or a sink already written to), the spans go straight
    from the tensors' memory into the sink's file, hashed on the way, and the snapshot's bytes
    are views of that file. `watch`: indices of the tensors the call may write in place (their
    device spans are also copied on the device, for `_unchanged`).
    """
    storages, records, first = _grouped(tensors)
    kept = _device_copies(tensors, storages, records, first, watch) if watch else {}
    earlier: dict[tuple[str, int, int, int], int] = {}
    if unchanged_from is not None:
        for i, old in enumerate(unchanged_from.storages):
            key = (old.device, old.base_ptr, old.span_start, old.span_nbytes)
            earlier.setdefault(key, i)
    if sink is not None and (sink.active or sum(st.span_nbytes for st in storages) >= SINK_MIN):
        firsts = {idx: tensors[k] for idx, k in enumerate(first)}
        got = _capture_into(sink, list(storages), list(records), firsts, unchanged_from, earlier)
        got.device_copies = kept
        return got
    data: list[torch.Tensor] = []
    digests: list[tuple[str, str] | None] = []
    pending_sync: set[torch.device] = set()
    lazy: list[int] = []  # storages seen through a lazy conj / neg view: resolved after the copy
    for idx, st in enumerate(storages):
        t = tensors[first[idx]]
        seen_lazy = _has_lazy_bits(t)
        if seen_lazy:
            lazy.append(idx)
        if st.device == "cpu":  # read at the span's address: no view to build
            n = st.span_nbytes
            ptr = st.base_ptr + st.span_start
            if earlier and not seen_lazy:
                j = earlier.get((st.device, st.base_ptr, st.span_start, n))
                if j is not None and _same_at(unchanged_from.data[j], ptr, n):  # type: ignore[union-attr]
                    data.append(unchanged_from.data[j])  # type: ignore[union-attr]
                    digests.append(unchanged_from.digest(j))  # type: ignore[union-attr]
                    continue
            copy = torch.empty(n, dtype=torch.uint8)
            if n:
                _memmove(copy.data_ptr(), ptr, n)
            data.append(copy)
        else:
            src = _byte_view(t, st.span_start, st.span_nbytes)
            host = torch.empty(st.span_nbytes, dtype=torch.uint8, pin_memory=True)
            host.copy_(src, non_blocking=True)
            pending_sync.add(src.device)
            data.append(host)
        digests.append(None)
    for dev in pending_sync:
        torch.cuda.current_stream(dev).synchronize()
    for idx in lazy:
        _resolve_lazy_bits(data[idx], tensors[first[idx]])
    return Captured(
        storages=list(storages),
        tensors=list(records),
        data=data,
        digests=digests,
        device_copies=kept,
    )


_memmove = ctypes.memmove


def _capture_into(
    sink: Sink,
    storages: list[StorageRecord],
    records: list[TensorRecord],
    firsts: dict[int, torch.Tensor],
    unchanged_from: Captured | None,
    earlier: dict[tuple[str, int, int, int], int],
) -> Captured:
    data: list[torch.Tensor | None] = []
    digests: list[tuple[str, str] | None] = []
    todo: list[int] = []
    sources: list[torch.Tensor] = []
    views = [_byte_view(firsts[i], st.span_start, st.span_nbytes) for i, st in enumerate(storages)]
    matches: dict[int, int] = {}  # storage -> the earlier snapshot of the same span
    if unchanged_from is not None:
        for idx, st in enumerate(storages):
            j = earlier.get((st.device, st.base_ptr, st.span_start, st.span_nbytes))
            if j is not None and not _has_lazy_bits(firsts[idx]):
                matches[idx] = j
    unchanged = _unchanged(views, matches, unchanged_from)
    for idx in range(len(storages)):
        t = firsts[idx]
        src = views[idx]
        if idx in unchanged and unchanged_from is not None:  # the bytes already in the file
            j = matches[idx]
            data.append(unchanged_from.data[j])
            digests.append(unchanged_from.digest(j))
            continue
        if _has_lazy_bits(t):  # the values the kernel saw, resolved on a private copy
            src = src.clone() if src.device.type == "cpu" else src.cpu()
            _resolve_lazy_bits(src, t)
        data.append(None)
        digests.append(None)
        todo.append(idx)
        sources.append(src)
    if sources:
        aligns = [storages[i].alignment for i in todo]
        for idx, (view, dig) in zip(todo, sink.put(sources, aligns, len(storages) + len(records))):
            data[idx], digests[idx] = view, dig
    return Captured(storages=storages, tensors=records, data=data, digests=digests)  # type: ignore[arg-type]


def _unchanged(
    views: Sequence[torch.Tensor], matches: dict[int, int], earlier: Captured | None
) -> set[int]:
    """The storages in `matches` whose bytes equal their earlier snapshot (device spans are
    compared through staging buffers as they arrive, without writing them again)."""
    if earlier is None or not matches:
        return set()
    cpu = [(i, j) for i, j in matches.items() if views[i].device.type == "cpu"]
    same = {i for (i, _), ok in zip(cpu, _same_as_written(earlier, views, cpu)) if ok}
    device = [i for i in matches if views[i].device.type != "cpu"]
    if device:
        from kdump.bundle.spool import same_as_device_copies, same_on_device

        kept = earlier.device_copies
        copied = [i for i in device if matches[i] in kept]
        if copied:
            pairs = [(views[i], kept[matches[i]]) for i in copied]
            same.update(i for i, ok in zip(copied, same_as_device_copies(pairs)) if ok)
        staged = [i for i in device if matches[i] not in kept]
        if staged:
            pairs = [(views[i], earlier.data[matches[i]]) for i in staged]
            same.update(i for i, ok in zip(staged, same_on_device(pairs)) if ok)
    return same


def _has_lazy_bits(t: torch.Tensor) -> bool:
    return bool(t.is_conj() or t.is_neg())


def _resolve_lazy_bits(snapshot: torch.Tensor, t: torch.Tensor) -> None:
    """Turn the raw bytes of a span that `t` sees through torch's lazy conj / neg bits into the
    values the kernel saw, in place on the private host snapshot (the argument is untouched and
    the layout unchanged, so the bundle needs no record of the bits)."""
    size = t.element_size()
    if snapshot.numel() % size:
        return  # a span shared with views of other dtypes: no whole elements to resolve
    values = snapshot.view(t.dtype)
    if t.is_conj():
        values.conj_physical_()
    if t.is_neg():
        values.neg_()


# ---------------------------------------------------------------------------------------------
# Re-materialisation


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


def clone_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in memory of its own with the same shape and strides: the elements its view
    covers are copied and viewed again, so a broadcast (stride 0) view costs its span, never its
    dense size (`Tensor.clone` makes such a view dense)."""
    if t.numel() == 0 or t.is_contiguous():
        return t.clone()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.as_strided((span,), (1,)).clone().as_strided(t.shape, t.stride())


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


# A view's storage offset is kept exactly, in every placement, by re-creating the unrecorded bytes
# before its span (zeros, or poison with a halo or a flush end), as long as the prefixes of one
# call's storages add up to at most this (so a small hostile file cannot make the reader fill
# gigabytes). Past it a storage starts at its span and the offsets that changed are reported.
PREFIX_LIMIT = 64 << 20


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
