"""The device copies' memo for eager repeats (CPU, with a recording stand-in for libcuda): a
call into a slot the memo knows enqueues the same driver calls, with the same kernel arguments
byte for byte, as the full computation does; a slot whose payload placement changed, a capture,
or a process without the ctypes driver takes the full computation."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from kdump.record import devcopy, gather


class _Driver:
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def launch(self, fn: int, grid: int, threads: int, args: Any, stream: int, what: str) -> None:
        if what == "snapshot":
            raw = _used(ctypes.string_at(args[0], ctypes.sizeof(gather.SnapParams)))
        else:  # the done marker: two pointers to its source and destination
            raw = tuple(ctypes.c_uint64.from_address(args[k]).value for k in range(2))
        self.log.append(("launch", fn, grid, threads, stream, what, raw))

    def d2h(self, dst: int, src: int, n: int, stream: int) -> None:
        self.log.append(("d2h", dst, src, n, stream))

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
    dc._slot_events = {}
    dc._event_pool = list(range(1000, 1064))
    dc.kernel = object()
    dc.mark = object() if mark else None
    dc._cu = _Driver()
    dc._fn_h, dc._mark_h = 11, 12
    dc._params = gather.SnapParams()
    dc._snap_args = (ctypes.c_void_p * 1)(ctypes.addressof(dc._params))
    dc._params_plan = dc
    dc._host_dev = 0x7000_0000
    dc._addr = 0x1000_0000
    dc._side_h = 99
    dc._chains = {}
    dc.forked_in_capture = False
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
    p = gather.SnapParams.from_buffer_copy(launches[-1][6])
    assert (p.seq, p.call_index, p.slot_index) == (100 + len(CALLS) - 1, 7 + len(CALLS) - 1, 1)
    assert p.n_gathers == (1 if plan is not None else 0)


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
    monkeypatch.setattr(gather, "launch", lambda fn, p, stream, grid: launched.append(grid))
    monkeypatch.setattr(gather, "launch_mark", lambda *a: launched.append("mark"))
    dc._d2h = lambda *a: launched.append("d2h")
    kept = dict(memo)
    dc.copy(_Slot(0, 2, SPANS), _Views(), None, None, None, 2, False, None, memo=memo)()
    assert launched[0] == 3 and "d2h" in launched and launched[-1] == "mark"  # grid: 3 chunks
    assert memo == kept
