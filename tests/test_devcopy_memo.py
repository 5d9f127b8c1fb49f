"""The device copies' memo for eager repeats (CPU, with a recording stand-in for libcuda): a
call into a slot the memo knows enqueues the same driver calls, with the same kernel arguments
byte for byte, as the full computation does; a slot whose payload placement changed, a capture,
or a process without the ctypes driver takes the full computation."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import pytest

from kdump.format.journal import MARKER_AT, TRAILER_BYTES
from kdump.record.flight import devcopy, gather


class _Driver:
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def launch(
        self, fn: int, grid: int, threads: int, args: Any, stream: int, what: str, smem: int = 0
    ) -> None:
        if what == "snapshot":
            raw = _used(ctypes.string_at(args[0], ctypes.sizeof(gather.SnapParams)))
        elif what == "marks":  # a batch of `post` markers: (source, destination) each
            m = gather.Marks.from_address(args[0])
            raw = tuple((m.src[k], m.dst[k]) for k in range(m.n))
        else:  # the done marker: two pointers to its source and destination
            raw = tuple(ctypes.c_uint64.from_address(args[k]).value for k in range(2))
        self.log.append(("launch", fn, grid, threads, stream, what, raw, smem))

    def d2h(self, dst: int, src: int, n: int, stream: int) -> None:
        self.log.append(("d2h", dst, src, n, stream))

    def d2h_rows(self, dst: int, src: int, pitch: int, n: int, rows: int, stream: int) -> None:
        self.log.append(("d2h_rows", dst, src, pitch, n, rows, stream))

    def write64(self, stream: int, dst: int, value: int) -> None:
        self.log.append(("write64", stream, dst, value))

    def d2d(self, dst: int, src: int, n: int, stream: int) -> None:
        self.log.append(("d2d", dst, src, n, stream))

    def record(self, event: int, stream: int) -> None:
        self.log.append(("record", event, stream))

    def wait(self, stream: int, event: int) -> None:
        self.log.append(("wait", stream, event))


def _used(raw: bytes) -> bytes:
    """The kernel arguments the kernel reads: table entries past n_copies / n_gathers zeroed
    (what an earlier call left there is never read)."""
    p = gather.SnapParams.from_buffer_copy(raw)
    for k in range(int(p.n_copies), gather.MAX_COPIES):
        ctypes.memset(ctypes.addressof(p.copies[k]), 0, ctypes.sizeof(p.copies[k]))
    for k in range(int(p.n_gathers), gather.MAX_GATHERS):
        ctypes.memset(ctypes.addressof(p.gathers[k]), 0, ctypes.sizeof(p.gathers[k]))
    return bytes(p)


class _Layout:
    ring_bytes = 1 << 20


class _Tier:
    layout = _Layout()
    ctrl_addr = 0x9000_0000
    ring_addr = 0x9001_0000

    def __init__(self) -> None:
        self.held = False

    def twin_addr(self, slot_index: int, offset: int = 0) -> int:
        return 0xA000_0000 + slot_index * 0x10_0000 + offset

    def counter_addr(self, i: int) -> int:
        return 0x9000_1000 + 8 * i


class _Journal:
    slot_bytes = 1 << 20


class _Slot:
    def __init__(self, index: int, seq: int, spans: list[Any]) -> None:
        self.index, self.seq, self._spans = index, seq, spans
        self.offset = 4096 + index * (1 << 20)
        self.commits = 0

    @property
    def spans(self) -> list[Any]:
        return list(self._spans)

    @property
    def output_spans(self) -> list[Any]:
        return []  # no outputs kept after the call (DeepGEMM-like: its spec has a reference)

    def commit(self, device: bool = False) -> None:
        self.commits += 1


class _Views:
    def ptr(self, i: int) -> int:
        return 0x5000_0000 + i * 0x1_0000


def _copies(mark: bool) -> Any:
    dc = object.__new__(devcopy.DeviceCopies)
    dc.tier = _Tier()
    dc.journal = _Journal()
    dc._index = 0
    dc._event_pool = list(range(1000, 1064))
    events = iter(range(2000, 3000))
    dc._batching(16, lambda: next(events))
    dc.kernel = object()
    dc.mark = object() if mark else None
    dc._cu = _Driver()
    dc._fn_h, dc._mark_h, dc._marks_h = 11, 12, 13
    dc._smem = gather.SMEM_BYTES
    dc._resident = 396  # 3 blocks on each of 132 SMs
    dc._params = gather.SnapParams()
    dc._snap_args = (ctypes.c_void_p * 1)(ctypes.addressof(dc._params))
    dc._params_plan = dc
    dc._host_dev = 0x7000_0000
    dc._addr = 0x1000_0000
    dc._side_h = 99
    dc._chains = {}
    dc.forked_in_capture = False
    dc._writes = True
    return dc


_PLAN = gather.Plan(
    rule="labels",
    rule_tensor=3,
    rows=512,
    inner=1,
    alignment=1,
    gathers=(gather.RowGather(0, 0, 0, 4096, 4096, 1, 4096, 1, 0),),
    rec_bytes=4096,
)


class _Rule:
    def data_ptr(self) -> int:
        return 0x6000_0000

    def numel(self) -> int:
        return 512


SPANS = [(256, 4096), None, (8192, 64), (8448, 2048)]


def _run(dc: Any, memo: dict | None, plan: Any, calls: list[tuple[int, list[Any], bool]]) -> Any:
    """Each call: (slot index, spans, held); returns the driver log."""
    for k, (index, spans, held) in enumerate(calls):
        dc.tier.held = held
        slot = _Slot(index, 100 + k, spans)
        rule = _Rule() if plan is not None else None
        after = dc.copy(slot, _Views(), None, plan, rule, 7 + k, False, None, memo=memo)
        dc._cu.log.append(("call",))
        after()
    return dc._cu.log


CALLS = [
    (0, SPANS, False),
    (1, SPANS, False),
    (0, SPANS, False),
    (1, SPANS, True),
    (0, SPANS, True),
    (0, [(256, 4096), (4352, 128), (8192, 64), (8448, 2048)], True),  # placement changed
    (0, SPANS, False),
    (1, SPANS, False),
]


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devcopy, "current_stream", lambda index: 7)
    monkeypatch.setattr(devcopy.DeviceCopies, "_here", lambda self: True)


@pytest.mark.parametrize("mark", [True, False])
@pytest.mark.parametrize("plan", [None, _PLAN])
def test_memo_enqueues_what_the_full_computation_enqueues(mark: bool, plan: Any) -> None:
    taken = []
    again = devcopy.DeviceCopies._copy_again

    def spy(self: Any, *a: Any) -> Any:
        taken.append(a[1].index)
        return again(self, *a)

    full = _run(_copies(mark), None, plan, CALLS)
    memo: dict[int, Any] = {}
    dc = _copies(mark)
    dc._copy_again = spy.__get__(dc)
    fast = _run(dc, memo, plan, CALLS)
    assert fast == full
    # calls 3, 4, 5 and 8 from the memo; the sixth's placement changed (recomputed and kept),
    # so the seventh, back to the first placement, is recomputed too
    assert taken == [0, 1, 0, 1]
    assert sorted(memo) == [0, 1]
    launches = [e for e in full if e[0] == "launch" and e[5] == "snapshot"]
    assert len(launches) == len(CALLS)
    assert {e[7] for e in launches} == {gather.SMEM_BYTES}, "its buffer is dynamic smem"
    p = gather.SnapParams.from_buffer_copy(launches[-1][6])
    assert (p.seq, p.call_index, p.slot_index) == (100 + len(CALLS) - 1, 7 + len(CALLS) - 1, 1)
    assert p.n_gathers == (1 if plan is not None else 0)
    # each call's done marker: its seq, written by the stream after the call, into its trailer
    done = [e for e in full if e[0] == "write64"]
    trailer = 4096 + (1 << 20) - TRAILER_BYTES + MARKER_AT["done"]
    assert done == [
        ("write64", 7, 0x7000_0000 + trailer + i * (1 << 20), 100 + k)
        for k, (i, _, _) in enumerate(CALLS)
    ]
    assert all(full[full.index(e) - 1] == ("call",) for e in done)


class _Cells:
    def data_ptr(self) -> int:
        return 0x9100_0000


def test_no_memo_inside_a_capture_or_without_the_ctypes_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dc = _copies(True)
    dc._cells = _Cells()
    memo: dict[int, Any] = {}
    dc.copy(_Slot(0, 1, SPANS), _Views(), 0, None, None, 1, True, None, 5, memo=memo)
    assert memo == {} and dc.forked_in_capture is False  # not held: no side branch
    _run(_copies(True), memo, None, CALLS[:1])
    assert sorted(memo) == [0]
    # the cuda-bindings path (no ctypes driver): the full computation, the memo left alone
    dc = _copies(True)
    dc._cu = None
    launched: list[Any] = []
    monkeypatch.setattr(gather, "launch", lambda fn, p, stream, grid, smem: launched.append(grid))
    monkeypatch.setattr(gather, "launch_mark", lambda *a: launched.append("mark"))
    dc._d2h = lambda *a: launched.append("d2h")
    kept = dict(memo)
    dc.copy(_Slot(0, 2, SPANS), _Views(), None, None, None, 2, False, None, memo=memo)()
    assert launched[0] == 3 and "d2h" in launched and launched[-1] == "mark"  # grid: 3 chunks
    assert memo == kept


def _held_calls(dc: Any, calls: list[tuple[int, int]], memo: dict | None) -> list[Any]:
    """Held eager calls, each (slot index, stream); returns the driver log."""
    for k, (index, stream) in enumerate(calls):
        # (the autouse fixture's monkeypatch restores the module's own current_stream)
        devcopy.current_stream = lambda i, s=stream: s  # type: ignore[assignment]
        slot = _Slot(index, 100 + k, SPANS)
        after = dc.copy(slot, _Views(), None, None, None, k, False, memo=memo)
        dc._cu.log.append(("call", index))
        after()
    return dc._cu.log


@pytest.mark.parametrize("memo", [None, {}])
def test_held_eager_host_copies_go_to_the_side_stream_a_batch_at_a_time(memo: Any) -> None:
    dc = _copies(True)
    dc.tier.held = True
    assert dc.batch == 4  # a quarter of the 16-slot ring
    log = _held_calls(dc, [(i % 16, 7) for i in range(24)], memo)
    # the calls' stream gets the snapshot and the done marker, nothing else while the batch fills
    ops = [e[5] if e[0] == "launch" else e[0] for e in log]
    assert ops[:9] == ["snapshot", "call", "write64"] * 3
    assert all(e[-1] == dc._side_h for e in log if e[0] in ("d2h", "d2h_rows"))
    marks = [i for i, e in enumerate(log) if e[0] == "launch" and e[5] == "marks"]
    assert len(marks) == 24 // 4
    # a batch: the fork from the calls' stream, each slot's twin copy, one marks launch with the
    # four `post` words, the batch's event
    k = marks[0]
    f = next(i for i, e in enumerate(log) if e[0] == "record")
    fork = log[f][1]
    assert log[f] == ("record", fork, 7) and log[f + 1] == ("wait", dc._side_h, fork)
    assert log[f - 1][5] == "snapshot" and log[f - 3] == ("call", 2)  # the fourth call's
    twins = log[f + 2 : k]
    # the four slots (0-3) copy the same extents: one strided copy per extent for the four,
    # here the payloads' extent and the call record
    assert [e[0] for e in twins] == ["d2h_rows", "d2h_rows"]
    assert all(e[3] == dc.journal.slot_bytes and e[5] == 4 for e in twins)
    assert log[k + 1] == ("record", dc._batch_events[0], dc._side_h)
    posts = log[k][6]
    assert len(posts) == 4 and len({d for _, d in posts}) == 4
    # the slot ring's second round: slots 0-3 wait for the first batch once, 4-7 the second
    waits = [e for e in log if e[0] == "wait" and e[1] == 7]
    assert waits == [("wait", 7, dc._batch_events[0]), ("wait", 7, dc._batch_events[1])]
    assert log.index(waits[0]) < log.index(("call", 0), log.index(("call", 15)))


def test_held_eager_batches_fork_from_every_stream_and_free_a_queued_slot_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dc = _copies(True)
    dc.tier.held = True
    # slot 0 on stream 7, slot 1 on stream 8, then slot 0 again before the batch is full
    log = _held_calls(dc, [(0, 7), (1, 8), (0, 7)], None)
    marks = [i for i, e in enumerate(log) if e[0] == "launch" and e[5] == "marks"]
    assert len(marks) == 1
    forks = [e for e in log[: marks[0]] if e[0] == "record"]
    assert [e[2] for e in forks] == [7, 8]  # the side stream waits for both streams' snapshots
    assert log[marks[0] + 1][0] == "record"
    # then stream 7 waits for that batch before the third call's snapshot overwrites slot 0
    assert log[marks[0] + 2] == ("wait", 7, dc._batch_events[0])
    assert log[marks[0] + 3][5] == "snapshot"
    # a drain issues what is queued (the third call) and nothing more when the queue is empty
    n = len(log)
    monkeypatch.setattr("torch.cuda.device", lambda index: contextlib.nullcontext())
    dc.drain()
    assert [e[5] for e in log[n:] if e[0] == "launch"] == ["marks"]
    n = len(log)
    dc.drain()
    assert len(log) == n
