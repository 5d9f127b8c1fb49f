"""Host time of eager GPU calls, shared by the benchmarks and scripts/profile_recorder.py."""

from __future__ import annotations

import time
from typing import Any

import torch

CHUNK = 40  # calls enqueued between two synchronisations (see host_us)


def host_us(fn: Any, args: tuple, kwargs: dict, calls: int, prof: Any = None) -> float:
    """Host µs per call of `calls` calls of `fn`, timed in chunks of CHUNK with the device
    synchronised between chunks, outside the clock. A grouped GEMM takes ~230 µs of device time
    against ~20 µs of host time: an unbroken loop fills the launch queue (about a thousand
    entries) and then measures how fast the device drains it, not what the host pays. `prof`
    (a cProfile.Profile) is enabled inside the clock only."""
    torch.cuda.synchronize()
    total = 0.0
    done = 0
    while done < calls:
        n = min(CHUNK, calls - done)
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        for _ in range(n):
            fn(*args, **kwargs)
        if prof is not None:
            prof.disable()
        total += time.perf_counter() - t
        torch.cuda.synchronize()
        done += n
    return total / calls * 1e6
