"""Compare tile configurations of the packaged kernel on a few reference-shape cases.

Each variant is compiled (cached like the default one) and timed by CUDA-graph replay on the same
inputs, so the ratios are comparable within one run. Used to pick CONFIGS in
kdump/kernels/sm120/configs.py; the table it prints is recorded in bench/RESULTS_sm120.md.

Usage: python bench/sweep_sm120.py [--iters 20] [--variant "a_box=128,stages=5" ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sm120 import bench_ours, make_case

from kdump.kernels.sm120 import configs, launch

CASES = (("w13", 1), ("w13", 32), ("w13", 113), ("w2", 1), ("w2", 113))
DEFAULT_VARIANTS = ("", "stages=5", "a_box=128", "warps_m=4,warps_n=2")


def parse(spec: str) -> dict[str, int]:
    out = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        out[key.strip()] = int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variant", action="append", default=None)
    args = ap.parse_args()
    family = configs.arch_family(torch.cuda.get_device_capability())
    base = configs.CONFIGS[family]
    cases = [make_case(shape, tokens) for shape, tokens in CASES]
    header = " | ".join(f"{s} t={t}" for s, t in CASES)
    print(f"| variant (sm_{family}) | {header} |")
    print("|---" * (len(CASES) + 1) + "|")
    for spec in args.variant or DEFAULT_VARIANTS:
        cfg = dataclasses.replace(base, **parse(spec))
        cfg.check()
        configs.CONFIGS[family] = cfg
        launch._modules.clear()
        times = [bench_ours(c, True, args.iters) for c in cases]
        print(
            f"| {spec or 'default'} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True
        )
    configs.CONFIGS[family] = base
    launch._modules.clear()


if __name__ == "__main__":
    main()
