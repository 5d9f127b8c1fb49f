"""The packaged kernel's psum layout against its label layout on the same problems.

Both layouts describe the same rows (expert g owns rows [g * slot, g * slot + tokens)), so any
difference is the producer's tile decision: a label scan against a psum group lookup, by lane
ballots (default) or by binary search (psum_ballot=0). CUDA-graph replay, UE8M0, us.

Usage: python lab/psum_sm120.py [--iters 20]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sm120 import G, make_case, operands, time_graph
from kdump.kernels import sm120
from sm120_variants import lab_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print("| case | labels | psum, ballots | psum, binary search |")
    print("|---|---|---|---|")
    for shape, tokens in (("w13", 1), ("w13", 32), ("w2", 1), ("w2", 32), ("w2", 113)):
        c = make_case(shape, tokens)
        a, b = operands(c, ue8m0=True)
        # NaN-filled: rows no layout writes stay NaN, and equal_nan compares them too
        d = torch.full((c.m, c.n), float("nan"), dtype=torch.bfloat16, device="cuda")
        slot = c.m // G
        ends = (torch.arange(G, dtype=torch.int32) * slot + tokens).cuda()
        fn = functools.partial(sm120.m_grouped_fp8_gemm_nt_contiguous, a, b, d)
        lab_us = time_graph(functools.partial(fn, c.labels), args.iters)
        ref = d.clone()
        psum = functools.partial(fn, ends, use_psum_layout=True)
        psum_us = time_graph(psum, args.iters)
        same = torch.allclose(d, ref, rtol=0, atol=0, equal_nan=True)
        with lab_config(psum_ballot=0):
            search_us = time_graph(psum, args.iters)
        same = same and torch.allclose(d, ref, rtol=0, atol=0, equal_nan=True)
        flag = "" if same else " (OUTPUTS DIFFER)"
        print(f"| {shape} t={tokens} | {lab_us:.1f} | {psum_us:.1f} | {search_us:.1f}{flag} |")


if __name__ == "__main__":
    main()
