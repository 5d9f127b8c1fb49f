"""Where a recorded graph step's time goes on the GPU: the device activities (kernels, memcpys,
memsets) of CUDA-graph replays of the grouped GEMM, without and with the flight recorder, from
torch's profiler (CUPTI), with one replay's timeline (start offsets and durations in µs).

    python lab/profile_flight_step.py [--tokens 1] [--n 512] [--k 4096] [--no-held]
        [--scales-only] [--floor] [--backend deep_gemm|packaged] [--define NAME=VALUE]
        [--carveout PCT]

(A recorded graph call adds one kernel node, the snapshot: the done marker of a capture site is
written by the next snapshot of its chain, so there is no marker node to vary.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_flight

import flight_variants
import kdump
from kdump.record.config import RingConfig


def _replays(g: Any, n: int) -> list[Any]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type.name == "CUDA"]


def _report(title: str, events: list[Any], n: int) -> None:
    by: dict[str, list[float]] = defaultdict(list)
    for e in events:
        by[e.name[:70]].append(e.time_range.end - e.time_range.start)
    print(f"\n## {title}: {len(events)} device activities in {n} replays")
    for name, ts in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {len(ts) // n:3d}/replay  avg {sum(ts) / len(ts):8.2f} us  {name}")
    # one replay's timeline: the activities of the middle replay, by start time
    evs = sorted(events, key=lambda e: e.time_range.start)
    per = len(evs) // n
    one = evs[per * (n // 2) : per * (n // 2 + 1)]
    if one:
        t0 = one[0].time_range.start
        print("  timeline of one replay (start us, duration us, name):")
        for e in one:
            dur = e.time_range.end - e.time_range.start
            print(f"    {e.time_range.start - t0:8.2f} {dur:8.2f}  {e.name[:70]}")
        span = max(e.time_range.end for e in one) - t0
        print(f"  first start to last end: {span:.2f} us")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--no-held", action="store_true")
    p.add_argument("--scales-only", action="store_true")
    p.add_argument(
        "--floor",
        action="store_true",
        help="profile flight_variants' (i) floor node before the GEMM instead of the recorder",
    )
    p.add_argument("--backend", choices=sorted(bench_flight.MODULES), default="deep_gemm")
    flight_variants.add_kernel_options(p)
    opt = p.parse_args()
    flight_variants.apply_kernel_options(opt)
    fn = bench_flight.gemm(opt.backend)
    args, kwargs = bench_flight.case(opt.n, opt.k, opt.tokens)

    def graph() -> Any:
        fn(*args, **kwargs)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args, **kwargs)
        g.replay()
        return g

    g = graph()
    _report("plain", _replays(g, opt.replays), opt.replays)
    if opt.floor:
        fn = flight_variants._with_floor_node(fn, args)
        _report("(i) floor", _replays(graph(), opt.replays), opt.replays)
        return
    shm = Path(tempfile.mkdtemp(prefix="kdump-prof-", dir="/dev/shm"))
    ring = RingConfig(slots=64, slot_bytes=1 << 20, journal_dir=shm, device_bytes=1 << 30)
    ctx = bench_flight._ScalesOnly() if opt.scales_only else None
    if ctx is not None:
        ctx.__enter__()
    with kdump.recording("deep_gemm", out=shm / "out", mode="ring", ring=ring) as rec:
        fn(*args, **kwargs)
        cuda = rec.recorder._cuda
        if cuda is None or cuda.tier is None:
            raise SystemExit("no device tier")
        cuda.tier.held = not opt.no_held
        g2 = graph()
        what = "scales only" if opt.scales_only else "with rows"
        held = "not held" if opt.no_held else "held"
        _report(f"recorded ({what}, {held})", _replays(g2, opt.replays), opt.replays)
        rec.recorder.flush = lambda: None


if __name__ == "__main__":
    main()
