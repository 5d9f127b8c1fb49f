"""The flight recorder's cost on a GPU: decode-step time under CUDA graphs with and without the
recorder (reference shapes G=288 with N=512, K=4096 and N=4096, K=256; 1, 32 and 113 tokens per
expert), host time added per recorded eager call, and the host tier's copy throughput against a
plain pinned copy of the same bytes.

    python bench/bench_flight.py [--iters 50]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import kdump
from kdump.kernels import registry
from kdump.record.config import RingConfig

SHAPES = ((512, 4096), (4096, 256))
TOKENS = (1, 32, 113)
G = 288
TARGET = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"


def _case(n: int, k: int, tokens: int) -> tuple[tuple, dict]:
    spec = registry.spec_for(TARGET)
    return spec.generate(
        seed=1, device="cuda", scale_format="fp32", num_groups=G, n=n, k=k, expected_m=tokens
    )


def _graph_step_ms(fn, args, kwargs, iters: int) -> float:
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args, **kwargs)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def _eager_host_us(fn, args, kwargs, iters: int) -> float:
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args, **kwargs)
    host = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=50)
    args_ = p.parse_args()
    import deep_gemm

    print(
        "| N | K | tokens/expert | graph step plain ms | recorded ms | eager host us plain | "
        "recorded us |"
    )
    print("|---|---|---|---|---|---|---|")
    shm = Path(tempfile.mkdtemp(prefix="kdump-bench-", dir="/dev/shm"))
    for n, k in SHAPES:
        for tokens in TOKENS:
            args, kwargs = _case(n, k, tokens)
            plain_g = _graph_step_ms(
                deep_gemm.m_grouped_fp8_gemm_nt_contiguous, args, kwargs, args_.iters
            )
            plain_h = _eager_host_us(
                deep_gemm.m_grouped_fp8_gemm_nt_contiguous, args, kwargs, args_.iters
            )
            ring = RingConfig(slots=64, slot_bytes=64 << 20, journal_dir=shm)
            with kdump.recording("deep_gemm", out=shm / "out", mode="ring", ring=ring):
                rec_h = _eager_host_us(
                    deep_gemm.m_grouped_fp8_gemm_nt_contiguous, args, kwargs, args_.iters
                )
                rec_g = _graph_step_ms(
                    deep_gemm.m_grouped_fp8_gemm_nt_contiguous, args, kwargs, args_.iters
                )
            print(
                f"| {n} | {k} | {tokens} | {plain_g:.3f} | {rec_g:.3f} | {plain_h:.1f} | "
                f"{rec_h:.1f} |"
            )
    # copy throughput: the registered journal vs a plain pinned buffer, same bytes
    from kdump.record.journal import Journal

    nbytes = 256 << 20
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    j = Journal.create(shm, slots=2, slot_bytes=nbytes + (1 << 20))
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(j._map))
    torch.cuda.cudart().cudaHostRegister(addr, len(j._map), 0)
    slot_view = torch.frombuffer(
        j._view[j.header_bytes : j.header_bytes + nbytes], dtype=torch.uint8
    )
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    for name, dst in (("plain pinned", pinned), ("journal (host tier)", slot_view)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        print(f"{name}: {5 * nbytes / (time.perf_counter() - t0) / 1e9:.1f} GB/s D2H")
    torch.cuda.cudart().cudaHostUnregister(addr)
    del slot_view
    j.unlink()
    print("device tier: none (this recorder has the host tier only)")


if __name__ == "__main__":
    main()
