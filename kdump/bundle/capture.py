"""Capturing a call: snapshot the storage spans its tensors cover, as CPU bytes, before the call
(`capture_call`) and after it (`attach_outputs`), into memory or straight into a bundle's file
(a `Sink`); a call's record (`CallRecord`) is what `kdump.bundle.writer.save_calls` writes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kdump.bundle import bytecmp
from kdump.bundle.fileio import cpu_view
from kdump.bundle.staging import same_as_device_copies, same_on_device
from kdump.bundle.tensors import _byte_view, _grouped
from kdump.format import argtree
from kdump.format.records import LaunchRecord, StorageRecord, TensorRecord


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
            earlier.setdefault(_span_key(old), i)
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
                j = earlier.get(_span_key(st))
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


def _span_key(st: StorageRecord) -> tuple[str, int, int, int]:
    """Which span of which storage a record holds: an output's snapshot may share the snapshot
    of the input with the same key (when its bytes did not change)."""
    return (st.device, st.base_ptr, st.span_start, st.span_nbytes)


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
            j = earlier.get(_span_key(st))
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


@dataclass
class CallRecord:
    """One captured call, ready to be written."""

    target: str  # canonical entry-point id, "module:qualname"
    called_as: str  # the name it was called by
    args: list[Any]  # encoded argument trees (argtree.encode)
    kwargs: dict[str, Any]
    names: list[str] | None  # parameter name of each positional argument, when known
    inputs: Captured  # tensors of the tree, snapshot before the call
    outputs: Captured | None = None  # snapshots after the call
    inplace: list[tuple[int, int]] = field(default_factory=list)  # (input idx, output idx)
    returned: Any = None  # encoded tree of the return value (tensors refer to outputs)
    meta: dict[str, Any] = field(default_factory=dict)
    launch: LaunchRecord | None = None  # a JIT kernel's launch (grid, options, source hash)

    @property
    def nbytes(self) -> int:
        return self.inputs.nbytes + (self.outputs.nbytes if self.outputs else 0)


def capture_call(
    target: str,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    called_as: str | None = None,
    names: Sequence[str] | None = None,
    meta: dict[str, Any] | None = None,
    sink: Sink | None = None,
    encoded: tuple[list[Any], list[torch.Tensor]] | None = None,
    watch: Sequence[int] = (),
) -> CallRecord:
    """Snapshot a call's arguments (before the call runs). With `sink` (a `Spool` for the bundle
    `save_calls` will write), a large snapshot is written straight into that bundle's file.
    `encoded` is what `argtree.encode_all([*args, *kwargs.values()], tensors)` gave, where the
    caller has walked the arguments already. `watch`: the tensor-table indices of the tensors
    the call may write in place (`attach_outputs` will compare them; see `capture`)."""
    kwargs = kwargs or {}
    if encoded is None:
        tensors: list[torch.Tensor] = []
        # One node budget for all of a call's arguments: the reader checks them together.
        trees = argtree.encode_all([*args, *kwargs.values()], tensors)
    else:
        trees, tensors = encoded
    args_tree = trees[: len(args)]
    kwargs_tree = {str(k): v for k, v in zip(kwargs, trees[len(args) :])}
    return CallRecord(
        target=target,
        called_as=called_as or target,
        args=args_tree,
        kwargs=kwargs_tree,
        names=list(names) if names is not None else None,
        inputs=capture(tensors, sink=sink, watch=watch),
        meta=dict(meta or {}),
    )


def input_tensors(
    call: CallRecord, args: Sequence[Any], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The live tensors of a call in the order of its tensor table (same walk as capture_call)."""
    return argtree.tensors_in(*args, *kwargs.values())


def attach_outputs(
    call: CallRecord,
    live: Sequence[torch.Tensor],
    indices: Iterable[int],
    returned: Any = None,
    sink: Sink | None = None,
) -> None:
    """Snapshot tensors `indices` of the call's tensor table after the call (in-place outputs),
    and tensors in the return value (into `sink`'s file when the inputs went there)."""
    idx = sorted(set(indices))
    extra: list[torch.Tensor] = [live[i] for i in idx]
    ret_tree = argtree.encode(returned, extra) if returned is not None else None
    try:
        call.outputs = capture(extra, unchanged_from=call.inputs, sink=sink)
    finally:
        call.inputs.device_copies.clear()  # device memory the comparison no longer needs
    call.inplace = [(i, k) for k, i in enumerate(idx)]
    call.returned = ret_tree
