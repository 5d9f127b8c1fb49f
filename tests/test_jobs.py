"""`kdump replay DIR --jobs N`: a work queue over the GPUs, never two replays on one GPU while
another idles, verdicts in the order of the bundles."""

from __future__ import annotations

import threading
import time

from kdump.replay import run_on_slots


def test_each_gpu_runs_one_replay_at_a_time_and_takes_the_next_when_free() -> None:
    lock = threading.Lock()
    busy: dict[int | None, int] = {}
    worst: dict[int | None, int] = {}
    ran_on: dict[int, int | None] = {}
    # uneven durations: pre-assigning item k to GPU k mod 2 would give GPU 0 all the long ones
    durations = [0.20 if k % 2 == 0 else 0.01 for k in range(12)]

    def fn(k: int, gpu: int | None):
        with lock:
            busy[gpu] = busy.get(gpu, 0) + 1
            worst[gpu] = max(worst.get(gpu, 0), busy[gpu])
            ran_on[k] = gpu
        time.sleep(durations[k])
        with lock:
            busy[gpu] -= 1
        return k * 10

    t0 = time.perf_counter()
    out = run_on_slots(list(range(12)), jobs=2, gpus=2, fn=fn)
    took = time.perf_counter() - t0
    assert out == [k * 10 for k in range(12)]  # the items' order, whatever ran first
    assert worst == {0: 1, 1: 1}  # never two at once on one GPU
    assert set(ran_on.values()) == {0, 1}
    # a queue balances the load: both GPUs share the long items (pre-assignment needs 6 x 0.2 s)
    assert {ran_on[k] for k in range(0, 12, 2)} == {0, 1}
    assert took < 6 * 0.20


def test_without_gpus_slots_run_on_the_cpu() -> None:
    seen: list[int | None] = []
    assert run_on_slots([1, 2, 3], jobs=3, gpus=0, fn=lambda k, g: seen.append(g) or k) == [1, 2, 3]
    assert seen == [None, None, None]
