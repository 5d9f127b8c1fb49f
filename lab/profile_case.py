"""Run one reference-shape case of the packaged kernel a few times (for ncu / nsys).

Usage: python lab/profile_case.py w13 1 [--calls 4] [--fp32] [--variant "stages=6,..."]
"""

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sm120 import make_case, operands
from kdump.kernels import sm120
from sm120_variants import lab_config

ap = argparse.ArgumentParser()
ap.add_argument("shape")
ap.add_argument("tokens", type=int)
ap.add_argument("--calls", type=int, default=4)
ap.add_argument("--fp32", action="store_true")
ap.add_argument("--variant", default="", help="TileConfig fields to replace, k=v,...")
args = ap.parse_args()
changes = {k: int(v) for k, v in (p.split("=") for p in args.variant.split(",") if p)}
c = make_case(args.shape, args.tokens)
a, b = operands(c, ue8m0=not args.fp32)
d = torch.empty(c.m, c.n, dtype=torch.bfloat16, device="cuda")
with lab_config(**changes) if changes else contextlib.nullcontext():
    for _ in range(args.calls):
        sm120.m_grouped_fp8_gemm_nt_contiguous(a, b, d, c.labels)
    torch.cuda.synchronize()
print("done", args.shape, args.tokens)
