"""Compare tile configurations of the packaged kernel on a few reference-shape cases.

Each variant is compiled (cached like the default one) and timed by CUDA-graph replay on the same
inputs, so the ratios are comparable within one run. Used to pick CONFIGS in
kdump/kernels/sm120/configs.py; the tables it printed are in lab/results/RESULTS_sm120_tuning.md.

Usage: python lab/sweep_sm120.py [--iters 20] [--cases w13:113,w2:512]
                                  [--variant "a_box=128,stages=5" ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sm120 import bench_ours, make_case, mn_major
from kdump.kernels.sm120 import configs
from sm120_variants import lab_config

CASES = (("w13", 1), ("w13", 32), ("w13", 113), ("w2", 1), ("w2", 32), ("w2", 113))
DEFAULT_VARIANTS = (
    "",
    "probe=1",  # the load path alone: math warps release every stage unread (results wrong)
    "probe=2",  # constant scale words: no scale loads or scale arithmetic (results wrong)
    "probe=3",  # no output stores (results wrong)
    "probe=4",  # no MMAs: loads, scale words, promotion and stores only (results wrong)
    "slots=7",  # no more stages in flight for thin tiles than for whole ones
    "split_thin=1",  # thin tiles split their K blocks over both warp rows
    "unroll_blocks=2",  # only thin warps unroll their k32 steps
    "bm=64,stages=9",
)


def correct() -> str:
    """A small mixed problem (odd, empty, full, multi-tile groups) against a float reference, with
    both scale formats: 'ok' or what is wrong, so a fast variant is never a wrong one."""
    from kdump.kernels import sm120
    from kdump.replay.metrics import calc_diff

    counts, n, k = [1, 0, 77, 128, 200, 16], 256, 640
    parts = []
    for g, c in enumerate(counts):
        slot = max(128, -(-c // 128) * 128)
        parts += [torch.full((c,), g), torch.full((slot - c,), -1)]
    lab = torch.cat(parts).to(torch.int32)
    m, groups = lab.numel(), len(counts)
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
    b = (torch.randn(groups, n, k, generator=gen) * 50).clamp(-448, 448)
    b = b.to(torch.float8_e4m3fn).cuda()
    # The same scales (1/64 on A, 1/32 on B) in the fp32 and the packed UE8M0 layout.
    kw = -(-k // 512)
    scales = {
        "fp32": (
            torch.full((k // 128, m), 1 / 64, device="cuda").T,
            torch.full((groups, n // 128, k // 128), 1 / 32, device="cuda"),
        ),
        "ue8m0": (
            mn_major(torch.full((m, kw), 0x79797979, dtype=torch.int32, device="cuda")),
            mn_major(torch.full((groups, n, kw), 0x7A7A7A7A, dtype=torch.int32, device="cuda")),
        ),
    }
    ref = torch.zeros(m, n, device="cuda")
    for g in range(groups):
        rows = (lab == g).nonzero().squeeze(1).cuda()
        ref[rows] = a[rows].float() @ b[g].float().T / (64 * 32)
    valid = (lab >= 0).cuda()
    for fmt, (sfa, sfb) in scales.items():
        d = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        sm120.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, lab.cuda())
        if torch.isnan(d[valid]).any():
            return f"WRONG ({fmt}): valid rows not written"
        diff = calc_diff(d[valid].float(), ref[valid])
        if not diff <= 1e-3:
            return f"WRONG ({fmt}): calc_diff {diff:.2e}"
        if not torch.isnan(d[~valid]).all():
            return f"WRONG ({fmt}): padding rows written"
    return "ok"


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
    ap.add_argument("--cases", default=None, help="shape:tokens,... (default: %(default)s)")
    args = ap.parse_args()
    family = configs.arch_family(torch.cuda.get_device_capability())
    names = CASES
    if args.cases:
        names = tuple((c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(","))
    cases = [make_case(shape, tokens) for shape, tokens in names]
    header = " | ".join(f"{s} t={t}" for s, t in names)
    print(f"| variant (sm_{family}) | {header} | check |")
    print("|---" * (len(names) + 2) + "|")
    for spec in args.variant or DEFAULT_VARIANTS:
        with lab_config(**parse(spec)):
            verdict = correct()
            times = [bench_ours(c, True, args.iters) for c in cases]
        cells = " | ".join(f"{t:.1f}" for t in times)
        print(f"| {spec or 'default'} | {cells} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
