"""Eager replay of a folder of small bundles: time per bundle against one bundle alone, both
measured in this run (the replay reuses worker processes between clean bundles).

    python bench/bench_replay_many.py [--bundles 20] [--backend reference]

Both numbers are wall times of `kdump replay` from command start to verdict; the goal is a
per-bundle time of at most 0.3x the single bundle's. Prints a table (the latest: bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kdump.bundle import capture_call, save_calls
from kdump.kernels.registry import spec_for

sys.path.insert(0, str(Path(__file__).parent))
from _machine import cpu_model

GOAL = 0.3


def _cli(*args: str) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kdump", *args], capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-2000:])
        raise SystemExit(f"kdump {' '.join(args)} exited {proc.returncode}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundles", type=int, default=20)
    ap.add_argument("--backend", default="reference")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = spec_for("deep_gemm:m_grouped_fp8_gemm_nt_contiguous")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, "many")
        folder.mkdir()
        for i in range(args.bundles):
            call_args, kwargs = spec.generate(
                seed=i, device=device, num_groups=2, n=128, k=128, expected_m=16,
                scale_format="fp32",
            )  # fmt: skip
            rec = capture_call(spec.id, call_args, kwargs, names=spec.param_names())
            save_calls(folder / f"b{i:03d}.kdump", [rec])
        one = folder / "b000.kdump"
        common = ["--backend", args.backend, "--device", device, "--repeat", "1"]
        _cli("replay", str(one), *common)  # warm the page cache and any JIT
        single = min(_cli("replay", str(one), *common) for _ in range(2))
        many = _cli("replay", str(folder), *common)
    per = many / args.bundles
    ratio = per / single
    where = torch.cuda.get_device_name() if device == "cuda" else cpu_model()
    title = (
        f"{args.bundles} bundles (G=2 N=128 K=128), backend {args.backend}, {device} ({where}), "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(title)
    print(f"one bundle alone   {single:7.2f} s")
    lines = [
        "",
        f"### bench_replay_many — {datetime.date.today()} — {platform.node()} — {title}",
        "",
        "| what | seconds | per bundle | ratio to one alone |",
        "|---|---:|---:|---:|",
        f"| one bundle alone | {single:.2f} | {single:.2f} | 1.00x |",
        f"| {args.bundles} bundles, one command | {many:.2f} | {per:.2f} | {ratio:.2f}x |",
        "",
        f"goal: at most {GOAL}x per bundle; {'met' if ratio <= GOAL else 'NOT met'}",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
