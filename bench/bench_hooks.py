"""Hook overhead: an armed hook whose trigger is not met vs the unpatched call (cheap Python
target), and sync-mode capture cost per MB vs a plain `tensor.cpu()` of the same bytes.

    python bench/bench_hooks.py          # prints its tables (the latest: bench/RESULTS.md)
"""

from __future__ import annotations

import platform
import statistics
import sys
import tempfile
import time
import timeit
import types

import torch
from _machine import cpu_model

import kdump
from kdump.bundle import capture_call


def _per_call_ns(fn, number: int = 200_000, repeat: int = 15) -> float:
    times = timeit.repeat(lambda: fn(1), number=number, repeat=repeat)
    return statistics.median(times) / number * 1e9


def hook_overhead() -> list[str]:
    mod = types.ModuleType("kdump_bench_target")
    exec("def cheap(x):\n    return x + 1\n", mod.__dict__)
    sys.modules[mod.__name__] = mod
    base = _per_call_ns(lambda x: mod.cheap(x))
    rows = [("unpatched", base)]
    with tempfile.TemporaryDirectory() as out:
        # Armed: counts every call, trigger (call 10**12 only) never met.
        with kdump.recording(f"{mod.__name__}:cheap", out=out, calls=str(10**12)):
            rows.append(("armed, calls range not met", _per_call_ns(lambda x: mod.cheap(x))))
        with kdump.recording(f"{mod.__name__}:cheap", out=out, every=10**12):
            # call 0 is due; take it, then measure the calls that are not
            mod.cheap(0)
            rows.append(("armed, every-N not met", _per_call_ns(lambda x: mod.cheap(x))))
    lines = ["| case | ns/call | added µs/call |", "|---|---:|---:|"]
    for name, ns in rows:
        lines.append(f"| {name} | {ns:.0f} | {(ns - base) / 1000:.3f} |")
    return lines


def _median_ms(f, device: str, reps: int = 5) -> float:
    f()  # warm up (pinned allocations, caches)
    ts = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        if device == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def capture_cost(device: str) -> list[str]:
    lines = [
        f"| MB ({device}) | tensor.cpu() ms | capture_call ms | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for mb in (1, 16, 64):
        t = torch.randn(mb * (1 << 20) // 4, device=device)
        plain = (lambda t=t: t.cpu()) if device != "cpu" else (lambda t=t: t.clone())

        def snap(t: torch.Tensor = t) -> None:
            capture_call("bench:x", (t,), {})

        a, b = _median_ms(plain, device), _median_ms(snap, device)
        lines.append(f"| {mb} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    return lines


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    head = (
        f"\n## bench_hooks\n\n{time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} "
        f"({cpu_model()}; torch {torch.__version__}; device {device})\n"
    )
    body = ["", "Armed hook, trigger not met (cheap Python target, median of 15 × 200k calls):", ""]
    body += hook_overhead()
    body += ["", "Sync capture of one tensor vs a plain copy to the host (CPU: clone):", ""]
    body += capture_cost(device)
    text = head + "\n".join(body) + "\n"
    print(text)


if __name__ == "__main__":
    main()
