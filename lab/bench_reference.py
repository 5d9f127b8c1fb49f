"""Time the torch reference of m_grouped_fp8_gemm_nt_contiguous on the reference shapes.

G = 288 experts; w13 (N = 512, K = 4096) and w2 (N = 4096, K = 256); 1 / 32 / 113 tokens per
expert, each expert padded to 128 rows (contiguous layout, packed UE8M0 scales). Reports the
reference's time, its effective GFLOP/s counting valid rows only, and the ratio to one dense fp32
torch.mm with the same FLOPs ([valid rows, K] @ [K, N]) timed in the same run on the same device.

    python lab/bench_reference.py [--device cpu|cuda|all] [--no-append] [--results FILE]

Appends a table to lab/results/RESULTS.md under "## bench_reference" (append only).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # _machine, _timing
from _machine import cpu_model

from kdump.kernels.deepgemm.generators import label_layout
from kdump.kernels.deepgemm.scales import empty_mn_major
from kdump.kernels.deepgemm.specs import MGroupedFP8NTContiguous

RESULTS = Path(__file__).parent / "results" / "RESULTS.md"
GROUPS = 288
LAYERS = {"w13": (512, 4096), "w2": (4096, 256)}
TOKENS = (1, 32, 113)
_NAN_BYTES = (0x7F, 0xFF)  # e4m3fn NaN encodings


def _random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random finite e4m3 values straight from bytes (a float32 randn of B would be 2.4 GB)."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    for nan in _NAN_BYTES:
        raw[raw == nan] = 0x38  # 1.0
    return raw.view(torch.float8_e4m3fn)


def _random_packed_scales(g: int | None, mn: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Packed UE8M0 scales (exponents 2^-4..2^3) in the TMA-aligned MN-major layout."""
    kw = (k // 128 + 3) // 4
    batch = (g,) if g is not None else ()
    out = empty_mn_major(batch, mn, kw, torch.int32, "cpu")
    by = torch.randint(123, 131, (*batch, mn, kw * 4), dtype=torch.uint8, generator=gen)
    out.copy_(by.view(torch.int32))
    return out


def make_call(n: int, k: int, tokens: int, device: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(n * 7 + k + tokens)
    labels = label_layout([tokens] * GROUPS, 128)
    m = labels.numel()
    a = torch.zeros(m, k, dtype=torch.uint8).view(torch.float8_e4m3fn)
    valid = labels >= 0
    a[valid] = _random_fp8((int(valid.sum()), k), gen)
    # Eight random expert weights tiled over G (distinct storage, so memory traffic is real);
    # drawing 600 MB of random bytes would take longer than the benchmark itself.
    pool = _random_fp8((8, n, k), gen)
    b = torch.empty(GROUPS, n, k, dtype=torch.float8_e4m3fn)
    for g in range(GROUPS):
        b[g] = pool[g % 8]
    sfa = _random_packed_scales(None, m, k, gen)
    sfb = _random_packed_scales(GROUPS, n, k, gen)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    dev = torch.device(device)
    if dev.type != "cpu":
        a, b, labels, d = a.to(dev), b.to(dev), labels.to(dev), d.to(dev)
        sfa = torch.as_strided(_dense_copy(sfa, dev), sfa.shape, sfa.stride())
        sfb = torch.as_strided(_dense_copy(sfb, dev), sfb.shape, sfb.stride())
    spec = MGroupedFP8NTContiguous()
    return spec.bind([(a, sfa), (b, sfb), d, labels], {})


def _dense_copy(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    base = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return base.to(dev)


def _timeit(fn: Callable[[], Any], device: str, repeat: int) -> float:
    """Median seconds of `repeat` runs after one warm-up."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(device: str, repeat: int) -> list[str]:
    spec = MGroupedFP8NTContiguous()
    rows = [
        "| layer | tokens/expert | M (padded) | valid rows | reference ms | GFLOP/s | "
        "dense mm ms | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layer, (n, k) in LAYERS.items():
        for tokens in TOKENS:
            bound = make_call(n, k, tokens, device)
            m = bound["d"].shape[0]
            valid = GROUPS * tokens
            flops = 2.0 * valid * n * k
            t_ref = _timeit(lambda b=bound: spec.reference(b), device, repeat)
            x = torch.randn(valid, k, device=device)
            w = torch.randn(k, n, device=device)
            t_mm = _timeit(lambda x=x, w=w: torch.mm(x, w), device, max(repeat, 5))
            line = (
                f"| {layer} N={n} K={k} | {tokens} | {m} | {valid} | {t_ref * 1e3:.1f} | "
                f"{flops / t_ref / 1e9:.1f} | {t_mm * 1e3:.2f} | {t_ref / t_mm:.0f}× |"
            )
            print(line, flush=True)
            rows.append(line)
            del bound, x, w
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="all", help="cpu, cuda or all (cuda when available)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs after one warm-up")
    ap.add_argument("--no-append", action="store_true", help="print only")
    ap.add_argument("--results", type=Path, default=RESULTS, help="file to append to")
    opts = ap.parse_args()
    devices = ["cpu", "cuda"] if opts.device == "all" else [opts.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    sections = []
    for device in devices:
        if device == "cpu":
            load = os.getloadavg()[0]
            what = f"{cpu_model()}, {torch.get_num_threads()} threads, load {load:.1f} at start"
        else:
            what = torch.cuda.get_device_name()
        head = (
            f"{time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({what}; torch "
            f"{torch.__version__}; device {device}; G={GROUPS}, UE8M0 scales, median of "
            f"{opts.repeat})"
        )
        print(head, flush=True)
        table = bench(device, opts.repeat)
        sections.append("\n".join([head, "", *table]))
    if not opts.no_append and sections:
        # append only: other benches add their own sections
        with opts.results.open("a", encoding="utf-8") as f:
            f.write("\n## bench_reference\n\n" + "\n\n".join(sections) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
