"""Host time of eager GPU calls, shared by bench/bench_flight.py and the lab's profilers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

CHUNK = 40  # calls enqueued between two synchronisations (see host_us)


def host_us(
    fn: Any,
    args: tuple,
    kwargs: dict,
    calls: int,
    prof: Any = None,
    fresh: Callable[[tuple], tuple] | None = None,
) -> float:
    """Host µs per call of `calls` calls of `fn`, timed in chunks of CHUNK with the device
    synchronised between chunks, outside the clock. A grouped GEMM takes ~230 µs of device time
    against ~20 µs of host time: an unbroken loop fills the launch queue (about a thousand
    entries) and then measures how fast the device drains it, not what the host pays. `prof`
    (a cProfile.Profile) is enabled inside the clock only. `fresh`: each call gets
    `fresh(args)` instead of `args`, made outside the clock."""
    torch.cuda.synchronize()
    total = 0.0
    done = 0
    while done < calls:
        n = min(CHUNK, calls - done)
        argsets = [fresh(args) if fresh is not None else args for _ in range(n)]
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        for a in argsets:
            fn(*a, **kwargs)
        if prof is not None:
            prof.disable()
        total += time.perf_counter() - t
        torch.cuda.synchronize()
        done += n
    return total / calls * 1e6


def new_objects(t: Any) -> Any:
    """`t` (a tensor, or a tuple or list of them) as new tensor objects over the same memory: what
    a serving loop passes each step where the caching allocator hands out the same blocks."""
    if isinstance(t, torch.Tensor):
        return t.as_strided(t.shape, t.stride(), t.storage_offset())
    if isinstance(t, (tuple, list)):
        return type(t)(new_objects(x) for x in t)
    return t


def new_step_objects(args: tuple) -> tuple:
    """DeepGEMM's grouped-GEMM arguments ((A, its scales), (B, its scales), D, labels, ...) with
    every tensor but B's pair a new object over the same memory: a serving step's activations,
    output and routing in the caching allocator's blocks of the step before, its weights the
    same objects."""
    return (new_objects(args[0]), args[1], *(new_objects(a) for a in args[2:]))
