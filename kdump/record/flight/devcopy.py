"""Per-call device-side copies of the flight recorder: the snapshot, the host copy, the markers.

With the snapshot kernel (kdump.record.flight.gather), a recorded CUDA call costs on its stream one
kernel launch before the call: small arguments go D2D into the journal slot's twin
(kdump.record.flight.devring), touched rows of bulky ones into a device ring slot, the slot's `pre`
marker is stored through the journal's mapped address. The twin then reaches the pinned host
slot as ONE D2H copy, followed by an 8-byte copy of the call's token into `post`:

* a salvage process holds the device tier: both copies run on a side stream that waits for the
  snapshot (inside a capture, a parallel branch joined back before the capture ends), so the
  kernel does not wait for PCIe. A crash before they ran still leaves the twin in the dump.
* no salvage process holds it: both run on the call's stream before the call; the host tier is
  then the only thing that survives a crash.

`done` is the token written after the call on the call's stream: an eager call's seq as a stream
write (cuStreamWriteValue64, behind a memory fence; where the driver refuses it, copied by a
one-thread kernel); for a
capture site the next snapshot of its chain (the next site captured on the same stream, or the
first site at the next replay) writes it instead, so a recorded graph call adds one node, not
two. The newest call of a chain therefore reads as not finished until a later replay runs: its
kernel may or may not have returned. Without the kernel
(no NVRTC, or it failed) the same layout is filled by torch copies: small arguments D2D into the
twin, the token into the call record, the same host copies; bulky arguments keep their layouts
only, and the slot says so (`tiers`, `notes`).

Outputs (`outputs_after`): after the kernel, on its stream, each output's span goes straight to
its host payload (D2H; captured as nodes after the kernel under capture), then the call's token
(the call record's `complete` word, or the counter / one without a device tier) into `out`. The
twin's host copies never cover the outputs' payloads (they run before the kernel or beside it).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kdump.cuda import nvrtc
from kdump.format.journal import (
    CALL_RECORD_BYTES,
    CALL_RECORD_COMPLETE_AT,
    MARKER_AT,
    TRAILER_BYTES,
)
from kdump.log import log_once
from kdump.record.flight import cudrv, gather, pinned
from kdump.record.flight.devbatch import HostBatches
from kdump.record.flight.devring import DeviceTier, DeviceTierError
from kdump.record.flight.journal import Journal, Slot

RECORD_COMPLETE_AT = CALL_RECORD_COMPLETE_AT  # the call record's `complete` word
_TRAILER_BYTES = TRAILER_BYTES
_PRE_AT, _POST_AT, _DONE_AT = MARKER_AT["pre"], MARKER_AT["post"], MARKER_AT["done"]
_OUT_AT = MARKER_AT["out"]
_ONE_COPY_GAP = 4096  # bytes between the payloads and the call record still copied as one


@dataclass(frozen=True)
class _Enqueue:
    """What an eager repeat's call into one slot enqueues (`DeviceCopies.copy`'s memo): the
    snapshot kernel's arguments as bytes (sequence number and call index set per call), its
    grid, the D2D copies beyond the kernel's table, the D2H copies (host offset, device address,
    bytes: the twin, then `post`), the done marker's kernel arguments (None: its D2H copy,
    `done`) and the values they point at."""

    spans: list[Any]
    params: bytes
    grid: int
    surplus: tuple[tuple[int, int, int], ...]
    host: tuple[tuple[int, int, int], ...]
    mark_vals: Any
    mark_args: Any
    done: tuple[int, int, int]


def _drv() -> Any:
    return nvrtc.driver()


def _ok(result: Any, what: str) -> Any:
    return nvrtc.check(result, what)


_raw_stream: Callable[[int], int] | None = None  # torch's getter, found once
_get_device: Callable[[], int] | None = None


def current_stream(device_index: int) -> int:
    """The handle of the current stream of device `device_index` (what
    `torch.cuda.current_stream(device).cuda_stream` says, without making a Stream object)."""
    global _raw_stream
    raw = _raw_stream
    if raw is None:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:
            return int(torch.cuda.current_stream(device_index).cuda_stream)
        _raw_stream = raw
    return int(raw(device_index))


def current_device() -> int:
    """torch.cuda.current_device() without its Python layers (called per recorded call, after
    CUDA was initialised)."""
    global _get_device
    get = _get_device
    if get is None:
        import torch

        torch.cuda.current_device()  # initialises CUDA where that was still pending
        get = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
        _get_device = get
    return int(get())


class DeviceCopies(HostBatches):
    """The device side of one journal on one device (see the module docstring); the batched
    host copies are its base's (kdump.record.flight.devbatch)."""

    def __init__(self, journal: Journal, device: Any, device_bytes: int) -> None:
        import torch

        self.journal = journal
        self.device = torch.device(device)
        index = self.device.index
        self._index = int(index) if index is not None else torch.cuda.current_device()
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(journal._map))
        size = len(journal._map)
        # Mapped: the snapshot kernel stores the `pre` marker through the device address.
        flags = pinned.PORTABLE | pinned.MAPPED
        self._end_pin = pinned.register(
            self._addr, size, flags, "the journal", journal, device, journal.path
        )
        self._registered = True
        journal.before_unmap.append(self._unregister)  # whoever closes the journal
        self.notes: list[str] = []
        self.tier: DeviceTier | None = None
        try:
            self.tier = DeviceTier(journal, self.device, device_bytes)
        except (DeviceTierError, RuntimeError) as exc:
            self.notes.append(f"no device tier: {exc}")
        self.max_sites = max(1, journal.slot_count // 2)
        if self.tier is not None:
            from kdump.record.flight.devring import MAX_SITES

            self.max_sites = min(self.max_sites, MAX_SITES)
        with torch.cuda.device(self.device):
            self.one = torch.ones(1, dtype=torch.int64, device=self.device)
            self._own_counters = torch.zeros(self.max_sites, dtype=torch.int64, device=self.device)
            # A graph site's chain cell (done marker address, replay counter address), one per
            # (capture, stream), indexed by the chain's first site: see `_chain_cell`.
            self._cells = torch.zeros(self.max_sites, 2, dtype=torch.int64, device=self.device)
            self.side = torch.cuda.Stream(self.device)
        self._side_h = int(self.side.cuda_stream)
        self.kernel: Any = None
        self.mark: Any = None  # kd_mark: the done marker as a kernel node (else a memcpy)
        self.marks: Any = None  # kd_marks: a batch's `post` markers (else a memcpy each)
        self.kernel_note = ""
        self._smem = 0  # kd_snapshot's dynamic shared memory (gather.SMEM_BYTES)
        self._resident = 0  # kd_snapshot blocks the device holds at once (0: unknown)
        if self.tier is not None:
            try:
                k = gather.get_kernel(self.tier.index)
                self.kernel, self.mark, self.marks = k.snapshot, k.mark, k.marks
                self._smem = k.smem
                self._resident = k.resident
            except Exception as exc:
                self.kernel_note = (
                    f"no snapshot kernel ({type(exc).__name__}: {str(exc)[:300]}): torch "
                    "copies fill the twin and copy bulky operands whole (no row rule)"
                )
                self.notes.append(self.kernel_note)
        self._params = gather.SnapParams()
        self._host_dev = self._mapped_base()
        # The per-call driver calls go through ctypes on libcuda where it loads (kdump.record.
        # cudrv); else through cuda-bindings. Handles are plain ints on the ctypes path.
        self._cu = cudrv.driver()
        self._fn_h = cudrv.handle(self.kernel) if self.kernel is not None else 0
        self._mark_h = cudrv.handle(self.mark) if self.mark is not None else 0
        self._marks_h = cudrv.handle(self.marks) if self.marks is not None else 0
        self._snap_args = (ctypes.c_void_p * 1)(ctypes.addressof(self._params))  # under the lock
        self._streams: dict[int, Any] = {}
        self._event_pool: list[Any] = []
        with torch.cuda.device(self.device):  # made now: creating one inside a capture is not
            self._event_pool = [self._event() for _ in range(2)]
            self._batching(journal.slot_count, self._event)
        self.forked_in_capture = False
        self._params_plan: Any = self  # the plan `_params` holds (self: none yet)
        self._fb_slot = 0  # the torch fallback's fixed device ring slot size
        self._writes = True  # done markers as stream writes (off if the driver refuses them)
        self._chains: dict[tuple[int, int], int] = {}  # (capture id, stream) -> its cell

    # -- facts ------------------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self.tier is not None and self.tier.held

    @property
    def gathers(self) -> bool:
        """Whether bulky operands go to the device ring: touched rows with the kernel, whole
        spans with the torch fallback."""
        return self.tier is not None

    def whole_layout(self, plan: gather.Plan, storages: list[Any]) -> list[list[int]] | None:
        """The torch fallback's slot layout for `plan`'s storages: [storage, offset, bytes] each,
        after the 64-byte slot header; None when it does not fit the fallback's fixed slot
        (sized by the first call that uses it)."""
        assert self.tier is not None
        out, at = [], gather.SLOT_HEAD
        for i in sorted(plan.storages):
            n = int(storages[i].span_nbytes)
            out.append([i, at, n])
            at = -(-(at + n) // 16) * 16
        need = -(-at // gather.SLOT_ALIGN) * gather.SLOT_ALIGN
        if self._fb_slot == 0 and need <= self.tier.layout.ring_bytes:
            self._fb_slot = need
        return out if 0 < need <= self._fb_slot else None

    @property
    def counters(self) -> Any:
        return self.tier.counters if self.tier is not None else self._own_counters

    def tiers(self, gathered: bool) -> list[str]:
        out = ["host"]
        if self.tier is not None:
            out.append("device-twin")
            if gathered:
                out.append("device-ring")
        return out

    def facts(self) -> dict[str, Any]:
        if self.tier is None:
            snapshot = "none (one D2H copy per payload and marker)"
        else:
            snapshot = "kernel" if self.kernel is not None else "torch"
        d: dict[str, Any] = {
            "snapshot": snapshot,
            "host_copy": f"side stream, {self.batch} calls at a time"
            if self.held
            else "before the call",
        }
        if self.tier is not None:
            d.update(self.tier.facts())
        if self.notes:
            d["notes"] = list(self.notes)
        return d

    # -- helpers ----------------------------------------------------------------------------------
    def _mapped_base(self) -> int:
        try:
            drv = _drv()
            return int(_ok(drv.cuMemHostGetDevicePointer(self._addr, 0), "host device pointer"))
        except Exception:
            return self._addr  # unified addressing: the host address is the device address

    def _stream(self, handle: int) -> Any:
        s = self._streams.get(handle)
        if s is None:
            s = self._streams[handle] = _drv().CUstream(handle)
        return s

    def _event(self) -> Any:
        if self._event_pool:
            return self._event_pool.pop()
        drv = _drv()
        flags = int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        return _ok(drv.cuEventCreate(flags), "cuEventCreate")

    def _record(self, ev: Any, stream: int) -> None:
        if self._cu is not None:
            self._cu.record(cudrv.handle(ev), stream)
        else:
            _ok(_drv().cuEventRecord(ev, self._stream(stream)), "cuEventRecord")

    def _wait(self, stream: int, ev: Any) -> None:
        if self._cu is not None:
            self._cu.wait(stream, cudrv.handle(ev))
        else:
            _ok(_drv().cuStreamWaitEvent(self._stream(stream), ev, 0), "cuStreamWaitEvent")

    def _fork(self, main: int, side: int) -> None:
        ev = self._event()
        self._record(ev, main)
        self._wait(side, ev)
        self._event_pool.append(ev)  # reusable at once: the wait took the record it needs

    def join_capture(self) -> None:
        """Before a capture ends: its stream waits for the side branch forked in it."""

        if not self.forked_in_capture:
            return
        self.forked_in_capture = False
        self._fork(self._side_h, current_stream(self._index))

    def _d2h(self, host_off: int, dev: int, n: int, stream: int) -> None:
        if self._cu is not None:
            self._cu.d2h(self._addr + host_off, dev, n, stream)
            return
        drv = _drv()
        _ok(
            drv.cuMemcpyDtoHAsync(self._addr + host_off, dev, n, self._stream(stream)),
            "cuMemcpyDtoHAsync",
        )

    # -- the call ---------------------------------------------------------------------------------
    def copy(
        self,
        slot: Slot,
        views: list[Any],
        token_index: int | None,
        plan: gather.Plan | None,
        rule: Any,
        call_index: int,
        capturing: bool,
        whole: list[list[int]] | None = None,
        capture_id: int = 0,
        memo: dict[int, _Enqueue] | None = None,
    ) -> Callable[[], None]:
        """Enqueue the slot's copies on the current stream; returns what marks it done after the
        call. `token_index`: the capture site's replay counter (None: an eager call); `whole`:
        the torch fallback's layout of the plan's storages (`whole_layout`); `capture_id`: the
        capture a site belongs to (its chain of done markers, with the stream); `memo`: an
        eager repeat's (one per learned call: same tensors, plan and slot layout) per slot
        index, filled by the first call into each slot, so later ones skip the arithmetic."""

        if self.tier is None:
            return self.direct(slot, views, token_index)
        tier = self.tier
        sb = self.journal.slot_bytes
        slot.commit(device=True)
        main = current_stream(self._index)
        if not capturing:
            self._free(slot.index, main)
        memo = memo if not capturing and self.kernel is not None and self._cu is not None else None
        if memo is not None:
            e = memo.get(slot.index)
            if e is not None and e.spans == slot.spans and self._here():
                return self._copy_again(e, slot, plan, call_index, main)
        record = tier.twin_addr(slot.index, sb - _TRAILER_BYTES - CALL_RECORD_BYTES)
        spans = slot.spans
        copies = [
            (views.ptr(i), tier.twin_addr(slot.index, sp[0]), sp[1])
            for i, sp in enumerate(spans)
            if sp is not None and sp[1]
        ]
        chained = self.kernel is not None and capturing and token_index is not None
        grid = 0
        if self.kernel is not None:
            chain = self._chain_cell(capture_id, main, token_index) if chained else 0
            grid = self._launch(
                slot, views, copies, token_index, plan, rule, call_index, record, main, chain
            )
        else:
            self._torch_snapshot(slot, views, copies, token_index, record, whole, call_index, main)
        present = [sp[0] for sp in spans if sp is not None]
        p0 = min(present) if present else sb - _TRAILER_BYTES - CALL_RECORD_BYTES
        trailer = slot.offset + sb - _TRAILER_BYTES
        host = self._host_copies(slot, spans, p0)
        host.append((trailer + _POST_AT, record + RECORD_COMPLETE_AT, 8))
        if self.held and not capturing:
            self._defer(slot.index, tuple(host), main)
        else:
            out = main
            if self.held:  # in a capture: a side branch of the graph, joined before it ends
                out = self._side_h
                self._fork(main, out)
                self.forked_in_capture = True
            for dst, src, n in host:
                self._d2h(dst, src, n, out)
        if memo is not None and grid and token_index is None and self._here():
            memo[slot.index] = self._enqueue(spans, grid, copies, host, record, trailer)

        # an eager call's token is its seq (the snapshot's): the done marker can be written as
        # a value after the kernel, with no kernel or copy of its own
        eager_token = slot.seq if self.kernel is not None and token_index is None else 0

        def after() -> None:
            # A graph site's done marker is written by the next snapshot of its chain: no node
            # after the recorded kernel (even an empty one cost 1-2 % of a decode step).
            if chained:
                return
            # Else the done marker follows the kernel on its own stream, as a kernel node where
            # the snapshot kernel is loaded (it starts as the recorded kernel ends; a memcpy node
            # there waited 2.5-7.5 us on the H200). Landing before the side's `post` is
            # harmless: the slot then reads in flight (post behind pre), and the device twin
            # completes it at salvage.
            cur = current_stream(self._index)
            if eager_token and self._done_by_write(cur, trailer, eager_token):
                return
            if self.mark is not None:
                dst = self._host_dev + trailer + _DONE_AT
                if self._cu is not None:  # own arguments: `after` runs outside the lock
                    vals = (ctypes.c_uint64 * 2)(record + RECORD_COMPLETE_AT, dst)
                    at = ctypes.addressof(vals)
                    args = (ctypes.c_void_p * 2)(at, at + 8)
                    self._cu.launch(self._mark_h, 1, 1, args, cur, gather.MARK_KERNEL)
                else:
                    gather.launch_mark(self.mark, record + RECORD_COMPLETE_AT, dst, cur)
            else:
                self._d2h(trailer + _DONE_AT, record + RECORD_COMPLETE_AT, 8, cur)

        return after

    def _enqueue(
        self,
        spans: list[Any],
        grid: int,
        copies: list[tuple[int, int, int]],
        host: list[tuple[int, int, int]],
        record: int,
        trailer: int,
    ) -> _Enqueue:
        """What `copy` just enqueued for an eager call, kept for its repeats (`_copy_again`):
        the snapshot's arguments as set now, its grid, the copies beyond its table, the host
        copies and the done marker's arguments."""
        vals = (ctypes.c_uint64 * 2)(
            record + RECORD_COMPLETE_AT, self._host_dev + trailer + _DONE_AT
        )
        at = ctypes.addressof(vals)
        return _Enqueue(
            list(spans),
            bytes(self._params),
            grid,
            tuple(copies[gather.MAX_COPIES :]),
            tuple(host),
            vals,
            (ctypes.c_void_p * 2)(at, at + 8) if self.mark is not None else None,
            (trailer + _DONE_AT, record + RECORD_COMPLETE_AT, 8),
        )

    def _host_copies(self, slot: Slot, spans: list[Any], p0: int) -> list[tuple[int, int, int]]:
        """The twin to the host slot, as (host offset, device address, bytes) D2H copies: the
        payloads' extent and the call record, as one copy when they are close, else two (a slot
        is mostly empty: copying all of it costs PCIe time)."""
        assert self.tier is not None
        sb = self.journal.slot_bytes
        record_at = sb - _TRAILER_BYTES - CALL_RECORD_BYTES
        end = max((sp[0] + sp[1] for sp in spans if sp is not None), default=p0)
        twin = self.tier.twin_addr(slot.index)
        # the outputs' payloads lie between: written after the kernel, never from the twin
        outputs = any(sp is not None for sp in slot.output_spans)
        if record_at - end <= _ONE_COPY_GAP and not outputs:
            return [(slot.offset + p0, twin + p0, record_at + CALL_RECORD_BYTES - p0)]
        out = []
        if end > p0:
            out.append((slot.offset + p0, twin + p0, end - p0))
        out.append((slot.offset + record_at, twin + record_at, CALL_RECORD_BYTES))
        return out

    def outputs_after(
        self,
        slot: Slot,
        views: Any,
        outputs: list[dict[str, Any]],
        token_index: int | None,
        direct: bool,
    ) -> None:
        """After the recorded kernel, on the current stream: each output storage's span into its
        host payload, then the call's token into the `out` marker (the payloads hold this call's
        results exactly when `out` equals the slot's token). Under capture these are captured
        after the kernel: every replay refreshes them. `direct`: the slot was filled by
        `direct` (no device tier for this call)."""
        spans = slot.output_spans
        if direct or self.tier is None:
            import torch

            for m, o in enumerate(outputs):
                sp = spans[m]
                if sp is not None and sp[1]:
                    dst = torch.frombuffer(slot.output(m), dtype=torch.uint8)
                    dst.copy_(views[o["storage"]], non_blocking=True)
            if token_index is not None:
                token = self._own_counters[token_index : token_index + 1]
            else:
                token = self.one
            out = torch.frombuffer(slot.marker("out"), dtype=torch.int64)
            out.copy_(token, non_blocking=True)
            return
        cur = current_stream(self._index)
        for m, o in enumerate(outputs):
            sp = spans[m]
            if sp is not None and sp[1]:
                self._d2h(slot.offset + sp[0], views.ptr(o["storage"]), sp[1], cur)
        sb = self.journal.slot_bytes
        record = self.tier.twin_addr(slot.index, sb - _TRAILER_BYTES - CALL_RECORD_BYTES)
        self._d2h(slot.offset + sb - _TRAILER_BYTES + _OUT_AT, record + RECORD_COMPLETE_AT, 8, cur)

    def _here(self) -> bool:
        return current_device() == self._index

    def _copy_again(
        self, e: _Enqueue, slot: Slot, plan: gather.Plan | None, call_index: int, main: int
    ) -> Callable[[], None]:
        """`copy` for an eager call into a slot `e` was made for: the same driver calls in the
        same order, from the kept kernel arguments (only the sequence number and the call index
        differ) and copy lists. The caller checked the slot's wait, the kernel and the driver."""
        cu = self._cu
        p = self._params
        ctypes.memmove(ctypes.addressof(p), e.params, len(e.params))
        p.seq = slot.seq
        p.call_index = call_index
        self._params_plan = plan
        for src, dst, n in e.surplus:
            cu.d2d(dst, src, n, main)
        cu.launch(self._fn_h, e.grid, gather.THREADS, self._snap_args, main, "snapshot", self._smem)
        addr = self._addr
        if self.held:
            self._defer(slot.index, e.host, main)
        else:
            for dst, src, n in e.host:
                cu.d2h(addr + dst, src, n, main)

        seq = slot.seq
        trailer = e.done[0] - _DONE_AT

        def after() -> None:
            cur = current_stream(self._index)
            if self._done_by_write(cur, trailer, seq):
                return
            if e.mark_args is not None:
                cu.launch(self._mark_h, 1, 1, e.mark_args, cur, gather.MARK_KERNEL)
            else:
                dst, src, n = e.done
                cu.d2h(addr + dst, src, n, cur)

        return after

    def _done_by_write(self, stream: int, trailer: int, token: int) -> bool:
        """An eager call's done marker (its slot's trailer at journal offset `trailer`) as one
        stream write of its token after the kernel: the stream's earlier work (the recorded
        kernel) is done and visible first, as with the marker kernel, for one driver call with
        four arguments instead of a launch. False where the driver has no such write (then
        never tried again): the caller falls back to the marker kernel."""
        if not self._writes or self._cu is None:
            return False
        try:
            self._cu.write64(stream, self._host_dev + trailer + _DONE_AT, token)
            return True
        except cudrv.DriverError as exc:
            if not exc.refused:  # an error of the context (a sticky one), not of this call
                raise
            self._writes = False
            log_once("devcopy-write", f"flight recorder: done markers by kernel ({exc})")
            return False

    def _launch(
        self,
        slot: Slot,
        views: list[Any],
        copies: list[tuple[int, int, int]],
        token_index: int | None,
        plan: gather.Plan | None,
        rule: Any,
        call_index: int,
        record: int,
        stream: int,
        chain: int = 0,
    ) -> int:
        """Enqueue the snapshot kernel; returns its grid."""
        import torch

        assert self.tier is not None
        tier = self.tier
        p = self._params
        p.chain = chain
        trailer_dev = self._host_dev + slot.offset + self.journal.slot_bytes - _TRAILER_BYTES
        p.host_done = trailer_dev + _DONE_AT
        if len(copies) > gather.MAX_COPIES:  # rare: the surplus as plain async copies first
            for src, dst, n in copies[gather.MAX_COPIES :]:
                if self._cu is not None:
                    self._cu.d2d(dst, src, n, stream)
                else:
                    _ok(_drv().cuMemcpyDtoDAsync(dst, src, n, self._stream(stream)), "D2D")
            copies = copies[: gather.MAX_COPIES]
        chunks = 0
        for k, (src, dst, n) in enumerate(copies):
            c = p.copies[k]
            c.src, c.dst, c.nbytes = src, dst, n
            chunks += -(-n // gather.COPY_CHUNK)
        p.n_copies = len(copies)
        if plan is not self._params_plan:  # the plan's fields: the same for its signature's calls
            self._plan_params(p, plan, views)
        rt = rule
        p.rule = int(rt.data_ptr()) if plan is not None and rt is not None else 0
        p.rule_n = int(rt.numel()) if plan is not None and rt is not None else 0
        p.token_ptr = tier.counter_addr(token_index) if token_index is not None else 0
        p.record = record
        p.host_pre = trailer_dev + _PRE_AT
        p.seq = slot.seq
        p.call_index = call_index
        p.slot_index = slot.index
        grid = max(1, int(p.gather_blocks) + min(chunks, gather.MAX_COPY_BLOCKS))
        here = self._here()
        if self._cu is not None and here:
            self._cu.launch(
                self._fn_h, grid, gather.THREADS, self._snap_args, stream, "snapshot", self._smem
            )
        elif here:
            gather.launch(self.kernel, p, stream, grid, self._smem)
        else:
            with torch.cuda.device(self.device):
                gather.launch(self.kernel, p, stream, grid, self._smem)
        return grid

    def _chain_cell(self, capture_id: int, stream: int, token_index: int) -> int:
        """The device address of the chain cell of the sites captured on `stream` in capture
        `capture_id`. Each site's snapshot writes the done marker of the call the cell names
        (the site before it; for the first, the last site of the previous replay: launches of
        one graph are serialized) and then names itself. Cells are never shared between
        chains (indexed by the chain's first site's counter, and counters are never reused), so
        a cell holds nothing stale."""
        key = (capture_id, stream)
        cell = self._chains.get(key)
        if cell is None:
            cell = self._chains[key] = token_index
        return int(self._cells.data_ptr()) + 16 * cell

    def _plan_params(self, p: gather.SnapParams, plan: gather.Plan | None, views: Any) -> None:
        """The snapshot arguments that follow from the plan (and its signature's addresses)."""
        assert self.tier is not None
        tier = self.tier
        gather.set_plan(p, plan, views.ptr, self._resident)
        p.ctrl = tier.ctrl_addr
        p.ring = tier.ring_addr
        p.ring_bytes = tier.layout.ring_bytes
        self._params_plan = plan

    def _torch_snapshot(
        self,
        slot: Slot,
        views: list[Any],
        copies: list[tuple[int, int, int]],
        token_index: int | None,
        record: int,
        whole: list[list[int]] | None,
        call_index: int,
        main: int,
    ) -> None:
        """The fallback without the kernel: the same twin, call record and device ring slot
        header, by torch and driver copies (capturable). Bulky storages are copied whole into a
        fixed-size device ring slot picked on the device (index_copy_ with a device index)."""
        import torch

        assert self.tier is not None
        tier = self.tier
        drv = _drv()
        if token_index is not None:
            token = self.counters[token_index : token_index + 1]
            token.add_(1)  # captured: every replay counts itself
        else:
            token = self.one
        trailer = slot.offset + self.journal.slot_bytes - _TRAILER_BYTES
        self._d2h(trailer + _PRE_AT, int(token.data_ptr()), 8, main)
        for src, dst, n in copies:
            _ok(drv.cuMemcpyDtoDAsync(dst, src, n, self._stream(main)), "cuMemcpyDtoDAsync")
        mem = tier.mem
        at = record - tier.base
        rec = mem[at : at + CALL_RECORD_BYTES].view(torch.int64)
        ctrl = mem[0:16].view(torch.int64)
        ring_bytes = tier.layout.ring_bytes
        if whole:
            size = self._fb_slot
            count = ring_bytes // size
            ring = mem[tier.layout.ring_at : tier.layout.ring_at + count * size].view(count, size)
            head = ctrl[0:1]
            phys = head % ring_bytes
            pos = torch.where(phys + size > ring_bytes, head - phys + ring_bytes, head)
            k = (pos % ring_bytes) // size
            ctrl[1:2].copy_(pos + size)  # what this call overwrites, before it does
            for storage, off, n in whole:
                ring[:, off : off + n].index_copy_(0, k, views[storage].reshape(1, n))
            hdr = torch.zeros(1, 8, dtype=torch.int64, device=self.device)
            hdr[:, 0].fill_(gather.SLOT_MAGIC | (slot.index << 32))
            hdr[:, 1].fill_(slot.seq)
            hdr[:, 2:3] = token.view(1, 1)
            hdr[:, 3:4] = pos.view(1, 1)
            hdr[:, 5].fill_(size)
            hdr[:, 6].fill_(call_index)
            hdr[:, 7:8] = token.view(1, 1)
            ring[:, 0:64].view(torch.int64).index_copy_(0, k, hdr)
            ctrl[0:1].copy_(pos + size)
            rec[3:4].copy_(pos)
        else:
            rec[3:4].fill_(-1)  # no device ring slot
        # fill_ with Python numbers: captured as constants (an indexed store copies from the host)
        rec[0:1].fill_(gather.RECORD_MAGIC)
        rec[1:2].fill_(slot.seq)
        rec[2:3].copy_(token)
        rec[4:5].fill_(0)
        rec[6:7].fill_(call_index)
        rec[5:6].copy_(token)  # complete, last

    def direct(self, slot: Slot, views: list[Any], token_index: int | None) -> Callable[[], None]:
        """No device tier: every payload and marker is its own D2H copy on the call's stream."""
        import torch

        slot.commit(device=True)

        def marker(name: str) -> Any:
            return torch.frombuffer(slot.marker(name), dtype=torch.int64)

        if token_index is not None:
            token = self._own_counters[token_index : token_index + 1]
            token.add_(1)  # captured: every replay counts itself
        else:
            token = self.one
        marker("pre").copy_(token, non_blocking=True)
        for i in range(len(views)):
            if slot.has_payload(i) and views.nbytes(i):
                dst = torch.frombuffer(slot.payload(i), dtype=torch.uint8)
                dst.copy_(views[i], non_blocking=True)
        marker("post").copy_(token, non_blocking=True)
        done = marker("done")

        def after() -> None:
            done.copy_(token, non_blocking=True)

        return after

    def release(self) -> None:
        import torch

        try:
            torch.cuda.synchronize(self.device)
        except Exception as exc:
            log_once("devcopy-release", f"releasing the journal's pinned mapping failed: {exc}")
        self._unregister()

    def _unregister(self) -> None:
        if self._registered:
            self._registered = False
            self._end_pin()
