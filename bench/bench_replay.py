"""Time to verdict of `kdump replay` (eager, graph, memcheck) against a bare call of the same
backend, measured in the same run.

    python bench/bench_replay.py [--backend reference|deep_gemm|packaged] [--tokens 32]

Eager: wall time of `kdump replay` from command start to verdict (two runs, first-call JIT
excluded by a warm-up replay) / the bare call's time on the same inputs. Graph and sanitizer: their
time to verdict / one eager replay's. Prints a table (the latest: bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kdump.bundle import capture_call, save_calls
from kdump.kernels.registry import get_backend, spec_for


def _cli(*args: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kdump", *args], capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode not in (0,):
        print(proc.stdout[-2000:], proc.stderr[-2000:])
        raise SystemExit(f"kdump {' '.join(args)} exited {proc.returncode}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per expert")
    ap.add_argument("--groups", type=int, default=288)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--modes", default="eager,graph,sanitizer")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = spec_for("deep_gemm:m_grouped_fp8_gemm_nt_contiguous")
    fmt = "fp32" if device == "cpu" or torch.cuda.get_device_capability()[0] == 9 else "ue8m0"
    call_args, kwargs = spec.generate(
        seed=0,
        device=device,
        num_groups=args.groups,
        n=args.n,
        k=args.k,
        expected_m=args.tokens,
        scale_format=fmt,
    )
    backend = get_backend(args.backend)
    fn = backend.resolve(spec, spec.id)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "bench.kdump")
        save_calls(path, [capture_call(spec.id, call_args, kwargs, names=spec.param_names())])
        fn(*call_args, **kwargs)  # JIT / warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        reps = 5
        for _ in range(reps):
            fn(*call_args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        bare = (time.perf_counter() - t0) / reps
        common = ["--backend", args.backend, "--device", device]
        _cli("replay", str(path), *common, "--repeat", "1")  # warm caches (JIT, imports)
        eager = min(_cli("replay", str(path), *common, "--repeat", "1") for _ in range(2))
        rows.append(("eager (time to verdict)", eager, eager / bare, "bare call"))
        modes = args.modes.split(",")
        if device == "cuda" and "graph" in modes:
            g = _cli("replay", str(path), *common, "--mode", "graph", "--mutations", "0")
            rows.append(("graph (6 synthesised phases)", g, g / eager, "eager replay"))
        if device == "cuda" and "sanitizer" in modes:
            from kdump.cuda.tools import find_tool

            if find_tool("compute-sanitizer"):
                m = _cli("replay", str(path), *common, "--mode", "sanitizer", "--timeout", "580")
                rows.append(("memcheck", m, m / eager, "eager replay"))
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    title = (
        f"G={args.groups} N={args.n} K={args.k}, {args.tokens} tokens/expert, backend "
        f"{args.backend}, {device} ({gpu})"
    )
    lines = [
        "",
        f"### bench_replay — {datetime.date.today()} — {platform.node()} — {title}",
        "",
        f"bare call {bare * 1e3:.2f} ms",
        "",
        "| what | seconds | ratio | against |",
        "|---|---|---|---|",
    ]
    for name, secs, ratio, against in rows:
        lines.append(f"| {name} | {secs:.2f} | {ratio:.1f}x | {against} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
