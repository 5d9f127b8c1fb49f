"""Run one reference-shape case of the packaged kernel a few times (for ncu / nsys).

Usage: python scripts/profile_case.py w13 1 [--calls 4]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from bench_sm120 import make_case, operands

from kdump.kernels import sm120

ap = argparse.ArgumentParser()
ap.add_argument("shape")
ap.add_argument("tokens", type=int)
ap.add_argument("--calls", type=int, default=4)
ap.add_argument("--fp32", action="store_true")
args = ap.parse_args()
c = make_case(args.shape, args.tokens)
a, b = operands(c, ue8m0=not args.fp32)
d = torch.empty(c.m, c.n, dtype=torch.bfloat16, device="cuda")
for _ in range(args.calls):
    sm120.m_grouped_fp8_gemm_nt_contiguous(a, b, d, c.labels)
torch.cuda.synchronize()
print("done", args.shape, args.tokens)
