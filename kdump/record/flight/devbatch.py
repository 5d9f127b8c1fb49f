"""The flight recorder's batched host copies: eager calls' twin-to-host copies, a batch at a time.

When a salvage process holds the device tier (kdump.record.flight.devcopy), an eager call's host
copy need not run before the call: the salvage process holds the twin meanwhile, and salvage
completes a slot whose `post` is behind `pre` from it. So the copies are queued (`_defer`) and
issued on a side stream a quarter of the ring at a time, four driver calls and one per copy for
the lot instead of five for every call; runs of consecutive slots go as one strided copy each.
`HostBatches` is a base of `DeviceCopies` (its methods run on the per-call path as its own, with
no call in between); it uses the stream, event and copy helpers `DeviceCopies` defines.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from kdump.log import log_once
from kdump.record.flight import cudrv, gather


class HostBatches:
    """The queue of batched host copies (a base of `DeviceCopies`)."""

    # what `DeviceCopies` provides
    journal: Any
    side: Any
    _index: int
    _side_h: int
    _cu: cudrv.Driver | None
    _addr: int
    _host_dev: int
    _marks_h: int
    _fork: Callable[[int, int], None]
    _record: Callable[[Any, int], None]
    _wait: Callable[[int, Any], None]
    _d2h: Callable[[int, int, int, int], None]

    def _batching(self, slot_count: int, event: Callable[[], Any]) -> None:
        """The queue of `_defer`: batches of a quarter of the ring (at most one kd_marks
        launch), and an event per batch in the ring and two more, so a batch's event is recorded
        again only after its slots were all copied once more."""
        self.batch = max(1, min(gather.MAX_MARKS, slot_count // 4))
        self._pending: list[tuple[int, tuple[tuple[int, int, int], ...], int]] = []
        # slot index -> the batch that copies it last (`_batches` while it waits in `_pending`)
        self._slot_batch: dict[int, int] = {}
        self._batches = 0  # batches issued
        self._waited: dict[int, int] = {}  # stream -> the newest batch it has waited for
        self._strided = True  # runs of slots as one strided copy (off if the driver refuses)
        self._marks = gather.Marks()
        self._marks_args = (ctypes.c_void_p * 1)(ctypes.addressof(self._marks))
        self._batch_events = [event() for _ in range(-(-slot_count // self.batch) + 2)]

    def _defer(self, index: int, host: tuple[tuple[int, int, int], ...], stream: int) -> None:
        """Queue an eager call's host copies: the twin's payload extent(s), then `post` last.
        The salvage process holds the twin meanwhile, and salvage completes a slot whose `post`
        is behind `pre` from it; so the copies go to the side stream `batch` calls at a time,
        four driver calls and one per copy for the lot instead of five for every call."""
        self._pending.append((index, host, stream))
        self._slot_batch[index] = self._batches
        if len(self._pending) >= self.batch:
            self._issue()

    def _issue(self) -> None:
        """Enqueue the queued host copies on the side stream behind every stream that queued
        one (their snapshots wrote the twins), then all their `post` markers with one kernel
        (or a copy each without it), then the batch's event."""
        pending = self._pending
        if not pending:
            return
        side = self._side_h
        for stream in dict.fromkeys(s for _, _, s in pending):
            self._fork(stream, side)
        if self._cu is not None:
            self._copy_runs(pending, side)
        else:
            for _, host, _ in pending:
                for dst, src, n in host[:-1]:
                    self._d2h(dst, src, n, side)
        posts = [host[-1] for _, host, _ in pending]
        if self._cu is not None and self._marks_h:
            m = self._marks
            m.n = len(posts)
            for k, (dst, src, _) in enumerate(posts):
                m.src[k], m.dst[k] = src, self._host_dev + dst
            self._cu.launch(self._marks_h, 1, gather.MAX_MARKS, self._marks_args, side, "marks")
        else:
            for dst, src, n in posts:
                self._d2h(dst, src, n, side)
        b = self._batches
        self._record(self._batch_events[b % len(self._batch_events)], side)
        self._batches = b + 1
        pending.clear()

    def _copy_runs(
        self, pending: list[tuple[int, tuple[tuple[int, int, int], ...], int]], side: int
    ) -> None:
        """The batch's twin-to-host copies (all but `post`), those of consecutive slots that
        copy the same extents (an eager repeat going around the ring) as one strided copy each:
        the host slots and their twins lie a slot apart on both sides, so a run of slots is one
        driver call per extent instead of one per slot."""
        cu = self._cu
        assert cu is not None
        sb = self.journal.slot_bytes
        first: tuple[tuple[int, int, int], ...] = ()
        rows = 0
        prev: tuple[int, tuple[tuple[int, int, int], ...]] | None = None
        for index, host, _ in pending:
            copies = host[:-1]
            if (
                prev is not None
                and index == prev[0] + 1
                and len(copies) == len(prev[1])
                and all(
                    d == pd + sb and s == ps + sb and n == pn
                    for (d, s, n), (pd, ps, pn) in zip(copies, prev[1])
                )
            ):
                rows += 1
            else:
                self._copy_run(cu, first, rows, side)
                first, rows = copies, 1
            prev = (index, copies)
        self._copy_run(cu, first, rows, side)

    def _copy_run(
        self, cu: cudrv.Driver, first: tuple[tuple[int, int, int], ...], rows: int, side: int
    ) -> None:
        """The copies `first` of a run's first slot, for `rows` consecutive slots."""
        addr, sb = self._addr, self.journal.slot_bytes
        for dst, src, n in first:
            if rows > 1 and self._strided:
                try:
                    cu.d2h_rows(addr + dst, src, sb, n, rows, side)
                    continue
                except cudrv.DriverError as exc:
                    if not exc.refused:  # an error of the context, not of this call
                        raise
                    self._strided = False
                    log_once("devcopy-2d", f"flight recorder: one host copy per slot ({exc})")
            for k in range(rows):
                cu.d2h(addr + dst + k * sb, src + k * sb, n, side)

    def _free(self, index: int, stream: int) -> None:
        """Before an eager call's snapshot overwrites slot `index`'s twin: its last host copy has
        read it. A queued one is issued now; `stream` waits for the batch that holds it unless it
        waited for that one or a later one already (the side stream runs batches in order)."""
        b = self._slot_batch.get(index)
        if b == self._batches:  # still queued
            self._issue()
        if b is not None and self._waited.get(stream, -1) < b:
            self._wait(stream, self._batch_events[b % len(self._batch_events)])
            self._waited[stream] = b

    def drain(self, wait: bool = False) -> None:
        """Issue the queued host copies now (a flush, the start of a capture: under the
        recorder's lock, like `copy`), and with `wait` until they landed; never raises."""
        if not self._pending and not wait:
            return
        try:
            import torch

            with torch.cuda.device(self._index):
                self._issue()
                if wait:
                    self.side.synchronize()
        except Exception as exc:
            log_once("devcopy-drain", f"flight recorder: queued host copies: {exc}")
