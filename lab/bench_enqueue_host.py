"""The Python side of the flight recorder's device enqueue for an eager repeat, on CPU:
`DeviceCopies.copy` and its done marker with libcuda replaced by the recording stand-in of
tests/test_devcopy_memo.py while the memo fills and by a do-nothing one while timed, with the
per-slot memo of an eager repeat and without it (the full computation every call). Prints host
us per call (the best of the rounds) and Python function calls per call (cProfile), both ways,
in the same run; the driver's own time is not in it (on the H200 host: 3-12 us per driver call).

    python lab/bench_enqueue_host.py [--calls 20000] [--slots 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _machine, _timing

import test_devcopy_memo as stand_in
from _machine import cpu_model

from kdump.record.flight import devcopy


def _batch(
    memo: dict | None, plan: Any, calls: int, slots: int, held: bool, prof: Any = None
) -> float:
    dc = stand_in._copies(True)
    dc.tier.held = held
    dc._event_pool = list(range(1000, 1008 + slots))  # one per slot, two for the fork
    views, rule = stand_in._Views(), stand_in._Rule() if plan is not None else None
    ring = [stand_in._Slot(i, i + 1, stand_in.SPANS) for i in range(slots)]
    for s in ring:  # fill the memo (and the slot events) first
        dc.copy(s, views, None, plan, rule, 0, False, None, memo=memo)()
    dc._cu = _NoDriver()  # after the fill: the stand-in's own checks are not timed
    if prof is not None:
        prof.enable()
    t = time.perf_counter()
    for k in range(calls):
        dc.copy(ring[k % slots], views, None, plan, rule, k, False, None, memo=memo)()
    t = time.perf_counter() - t
    if prof is not None:
        prof.disable()
    return t / calls * 1e6


class _NoDriver:
    """cudrv.Driver's methods, each a Python call as there, doing nothing."""

    def launch(self, fn: int, grid: int, threads: int, args: Any, stream: int, what: str) -> None:
        pass

    def d2h(self, dst: int, src: int, n: int, stream: int) -> None:
        pass

    def d2d(self, dst: int, src: int, n: int, stream: int) -> None:
        pass

    def record(self, event: int, stream: int) -> None:
        pass

    def wait(self, stream: int, event: int) -> None:
        pass


def _count(memo: dict | None, plan: Any, slots: int, held: bool) -> float:
    prof = cProfile.Profile()
    n = 2000
    _batch(memo, plan, n, slots, held, prof)
    return pstats.Stats(prof).total_calls / n  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    opt = p.parse_args()
    devcopy.current_stream = lambda index: 7  # type: ignore[assignment]
    devcopy.DeviceCopies._here = lambda self: True  # type: ignore[method-assign]
    load = os.getloadavg()[0]
    print(
        f"{opt.rounds} rounds of {opt.calls} calls over {opt.slots} slots, load {load:.2f}, "
        f"{cpu_model()}, python {platform.python_version()}"
    )
    for plan_name, plan in (("no gather", None), ("one row gather", stand_in._PLAN)):
        for held in (False, True):
            full, fast = [], []
            for _ in range(opt.rounds):
                full.append(_batch(None, plan, opt.calls, opt.slots, held))
                fast.append(_batch({}, plan, opt.calls, opt.slots, held))
            cf, cm = _count(None, plan, opt.slots, held), _count({}, plan, opt.slots, held)
            print(
                f"{plan_name}, {'held' if held else 'not held'}: host us per call, full "
                f"{min(full):.2f} / memo {min(fast):.2f} "
                f"(x{min(full) / min(fast):.2f}); Python function "
                f"calls per call {cf:.0f} / {cm:.0f}"
            )


if __name__ == "__main__":
    main()
