"""The flight recorder's graph step beside the floors of any device-side recorder, and with
variants of its snapshot kernel: bench/bench_flight.py's table with more columns.

* 1 / 2 empty nodes: the step with one empty one-thread kernel before the GEMM (the floor of any
  recorder that adds one node per recorded call: the snapshot kernel, which also writes the
  previous site's done marker) and with two around it (what a snapshot plus a done-marker node
  would cost);
* (i) floor: the step with one kernel before the GEMM that reads the labels, copies them and the
  touched rows' scales (to the same places of a buffer of the scales' layout) and marks each
  block done behind a fence (no compaction, no ring slot, no publication): what no snapshot of
  case (i) that copies only the touched rows and says it completed can beat;
* (i) plain ring: the same kernel writing the touched rows compacted (one row-counter atomic per
  block of 128 rows) and published by the last block to finish (a block counter behind a fence,
  then the row count and the token), as a compacting ring needs (the next slot starts after
  this one's rows): what the compaction and the publication add when written plainly, beside
  kdump's snapshot (a reference, not a bound: a tuned kernel may beat it);

then bench_flight's columns of the same case.

    python lab/flight_variants.py [--iters 50] [--pdl] [--define NAME=VALUE] [--carveout PCT]
        [--shape 512x4096] [--tokens 1,32]

`--define KD_DENSE=0` records with that variant of the snapshot kernel (the -D flags and patches
lab/bench_snapshot_kernel.py takes: `--define KD_OVERLAP=0`: case (ii)'s rows of A, then their
scales, not side by side; `--define KD_EARLY_LAUNCH=2` with `--pdl`; `--define
patch=fixed-rows+no-copies`: parts of the launch taken out, the step's cost of each, not a valid
recording); `--carveout 100` with the snapshot kernel preferring the SM's whole shared-memory
carveout (as the GEMM does).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_flight
from bench_flight import _d2d_gbs, _graph_ms


def _with_empty_nodes(fn: Callable[..., Any], count: int = 2) -> Callable[..., Any]:
    """`fn` after one (`count` 1) or between two one-thread kernels (kdump's done-marker kernel
    reading and writing one word): in a graph, the step of any recorder that launches a snapshot
    before the kernel (and a marker after it) costs at least this much."""
    from kdump.record.flight import gather

    mark = gather.get_kernel(torch.cuda.current_device()).mark
    word = torch.zeros(2, dtype=torch.int64, device="cuda")

    def wrapped(*a: Any, **k: Any) -> Any:
        stream = torch.cuda.current_stream().cuda_stream
        gather.launch_mark(mark, word.data_ptr(), word.data_ptr() + 8, stream)
        out = fn(*a, **k)
        if count > 1:
            gather.launch_mark(mark, word.data_ptr(), word.data_ptr() + 8, stream)
        return out

    return wrapped


_FLOOR_SRC = r"""
// The floor of case (i) for any device-side snapshot that copies only the rows a call touches:
// one node that reads the labels, copies them and the touched rows' scales (MN-major fp32, to
// the same places of a buffer of the same layout: neighbouring threads read and write
// neighbouring words), then marks each block done behind a fence (per-block completion flags):
// no compaction, no ring slot, no publication of a slot (what kdump's snapshot adds for its
// ring).
extern "C" __global__ void kd_floor(const int* __restrict__ labels, const float* __restrict__ sf,
                                    long long col_stride, unsigned cols, unsigned rows,
                                    float* __restrict__ out, int* __restrict__ out_labels,
                                    unsigned long long* flags, const unsigned long long* token) {
  const unsigned r = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long tok = *(const volatile unsigned long long*)token;
  if (r < rows) {
    const int l = labels[r];
    out_labels[r] = l;
    if (l >= 0) {
#pragma unroll 8
      for (unsigned c = 0; c < cols; ++c) out[r + c * col_stride] = sf[r + c * col_stride];
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *(volatile unsigned long long*)&flags[blockIdx.x] = tok;
}

// Case (i) written plainly for a compacting ring (kdump's design: a slot holds only the touched
// rows, so the next slot starts after them): kd_floor's reads, but each block reserves its
// touched rows' places with one atomic on a row counter and writes them compacted (the row
// index, then the scales column by column: coalesced), and the last block to finish (a block
// counter behind a fence) publishes the row count and the token as the slot's head and resets
// both counters. No slot position from a ring head, no call record, no plain copies of B's
// scales. A reference for what compaction and publication add, not a bound.
extern "C" __global__ void kd_floor_ring(const int* __restrict__ labels,
                                         const float* __restrict__ sf, long long col_stride,
                                         unsigned cols, unsigned rows, float* __restrict__ out,
                                         int* __restrict__ out_rows, unsigned* counters,
                                         unsigned long long* head,
                                         const unsigned long long* token) {
  __shared__ unsigned warp_sum[4];
  __shared__ unsigned base;
  const unsigned r = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  const unsigned long long tok = *(const volatile unsigned long long*)token;
  const bool hit = r < rows && labels[r] >= 0;
  const unsigned ballot = __ballot_sync(0xffffffffu, hit);
  if (lane == 0) warp_sum[warp] = __popc(ballot);
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned n = warp_sum[0] + warp_sum[1] + warp_sum[2] + warp_sum[3];
    base = n ? atomicAdd(&counters[0], n) : 0u;
  }
  __syncthreads();
  if (hit) {
    unsigned pos = base + __popc(ballot & ((1u << lane) - 1u));
    for (unsigned w = 0; w < warp; ++w) pos += warp_sum[w];
    out_rows[pos] = (int)r;
#pragma unroll 8
    for (unsigned c = 0; c < cols; ++c) out[pos + c * rows] = sf[r + c * col_stride];
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(&counters[1], 1u) == gridDim.x - 1) {
    __threadfence();
    const unsigned n = atomicExch(&counters[0], 0u);
    counters[1] = 0u;
    head[1] = n;
    __threadfence();
    *(volatile unsigned long long*)&head[0] = tok;
  }
}
"""


def _with_floor_node(fn: Callable[..., Any], args: tuple, ring: bool = False) -> Callable[..., Any]:
    """`fn` after kd_floor (_FLOOR_SRC) over its labels and A's scales: the step of case (i)
    that no snapshot copying the touched rows (and marking itself complete) can beat; `ring`:
    after kd_floor_ring, the same written plainly for a compacting ring (a reference)."""
    from bench_snapshot_kernel import load_function  # lab/, beside this script
    from kdump.cuda.nvrtc import check, driver

    d = driver()
    name = "kd_floor_ring" if ring else "kd_floor"
    kernel = load_function(_FLOOR_SRC, name)
    labels, sf = args[3], args[0][1]
    rows, cols = sf.shape
    assert sf.dtype == torch.float32 and sf.stride(0) == 1, "MN-major fp32 scales"
    out = torch.empty_like(sf)  # kd_floor: the same strides, the copy keeps the scales' layout
    out_labels = torch.empty_like(labels)  # kd_floor_ring: the touched rows' indices
    blocks = -(-rows // 128)
    # kd_floor: a flag per block; kd_floor_ring: its two counters, then the slot head
    flags = torch.zeros(max(blocks, 4), dtype=torch.int64, device="cuda")
    token = torch.ones(1, dtype=torch.int64, device="cuda")
    ptr = flags.data_ptr()
    tail = (ptr, ptr + 16) if ring else (ptr,)
    vals = (
        ctypes.c_uint64(labels.data_ptr()),
        ctypes.c_uint64(sf.data_ptr()),
        ctypes.c_int64(sf.stride(1)),
        ctypes.c_uint32(cols),
        ctypes.c_uint32(rows),
        ctypes.c_uint64(out.data_ptr()),
        ctypes.c_uint64(out_labels.data_ptr()),
        *(ctypes.c_uint64(v) for v in tail),
        ctypes.c_uint64(token.data_ptr()),
    )
    params = (ctypes.c_void_p * len(vals))(*(ctypes.addressof(v) for v in vals))
    keep = (out, out_labels, flags, token, vals, params)

    def wrapped(*a: Any, **k: Any) -> Any:
        assert keep
        stream = d.CUstream(torch.cuda.current_stream().cuda_stream)
        check(
            d.cuLaunchKernel(
                kernel, blocks, 1, 1, 128, 1, 1, 0, stream, ctypes.addressof(params), 0
            ),
            f"cuLaunchKernel({name})",
        )
        return fn(*a, **k)

    return wrapped


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--backend", choices=sorted(bench_flight.MODULES), default="deep_gemm")
    p.add_argument("--pdl", action="store_true", help="launch the GEMM with PDL (set_pdl)")
    add_kernel_options(p)
    p.add_argument("--shape", action="append", default=[], metavar="NxK", help="only these")
    p.add_argument("--tokens", default="", metavar="T,...", help="only these tokens per expert")
    opt = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in opt.shape] or list(bench_flight.SHAPES)
    token_counts = [int(t) for t in opt.tokens.split(",") if t] or list(bench_flight.TOKENS)
    apply_kernel_options(opt)
    fn = bench_flight.gemm(opt.backend)
    if opt.pdl:
        import deep_gemm

        deep_gemm.set_pdl(True)
        print(f"GEMM launched with PDL (deep_gemm.get_pdl() = {deep_gemm.get_pdl()})")
    shm = Path(tempfile.mkdtemp(prefix="kdump-lab-", dir="/dev/shm"))
    d2d = _d2d_gbs(256 << 20)
    print(f"plain D2D: {d2d:.0f} GB/s (HBM bound below uses it)\n")
    head = "| 1 empty node | 2 empty nodes | (i) floor | (i) plain ring "
    header = bench_flight.HEADER.replace("| plain ms ", "| plain ms " + head)
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for n, k in shapes:
        for tokens in token_counts:
            args, kwargs = bench_flight.case(n, k, tokens)
            cells, _ = bench_flight.case_cells(fn, args, kwargs, k, tokens, d2d, shm, opt.iters)
            plain = float(cells[0])
            floors = [
                _graph_ms(_with_empty_nodes(fn, 1), args, kwargs, opt.iters),
                _graph_ms(_with_empty_nodes(fn), args, kwargs, opt.iters),
                _graph_ms(_with_floor_node(fn, args), args, kwargs, opt.iters),
                _graph_ms(_with_floor_node(fn, args, ring=True), args, kwargs, opt.iters),
            ]
            extra = [f"{ms:.3f} ({ms / plain:.3f}x)" for ms in floors]
            print(f"| {n} | {k} | {tokens} | " + " | ".join([cells[0], *extra, *cells[1:]]) + " |")


def add_kernel_options(p: argparse.ArgumentParser) -> None:
    """`--define NAME=VALUE` (repeatable): what `_redefine` takes; `--carveout PCT`: what
    `_set_carveout` takes. `apply_kernel_options` applies both."""
    p.add_argument(
        "--define",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="record with snapshot.cu built with this #define changed (repeatable)",
    )
    p.add_argument(
        "--carveout",
        type=int,
        metavar="PCT",
        help="record with kd_snapshot's preferred shared-memory carveout set to PCT %% of the"
        " SM's unified L1 (100: all the shared memory the SM has, as big GEMMs run)",
    )


def apply_kernel_options(opt: argparse.Namespace) -> None:
    if opt.define:
        _redefine(opt.define)
    if opt.carveout is not None:
        _set_carveout(opt.carveout)


def _set_carveout(pct: int) -> None:
    """Load kd_snapshot with CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = pct: an SM
    whose carveout differs between two kernels is reconfigured between them."""
    from kdump.cuda.nvrtc import check, driver
    from kdump.record.flight import gather

    allow = gather.allow_smem

    def allow_and_prefer(fn: Any, smem: int) -> None:
        allow(fn, smem)
        d = driver()
        attr = d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        check(d.cuFuncSetAttribute(fn, attr, pct), f"cuFuncSetAttribute(carveout {pct} %)")

    gather.allow_smem = allow_and_prefer  # type: ignore[assignment]
    print(f"kd_snapshot's preferred shared-memory carveout: {pct} %")


def _redefine(defines: list[str]) -> None:
    """Record with a variant of the snapshot kernel: its -D flags and patches as
    bench_snapshot_kernel.py takes them (its own cache entry)."""
    from bench_snapshot_kernel import variant
    from kdump.record.flight import gather

    v = variant(",".join(defines))
    for name in ("KD_THREADS", "KD_ROWS_PER_BLOCK"):
        if v.defines[name] != gather.DEFINES[name]:
            raise SystemExit(f"--define {name}: the recorder launches with gather.py's own")
    gather.kernel_source = lambda: v.source  # type: ignore[assignment]
    gather.DEFINES.update(v.defines)  # define_flags and the cache key read this dict
    gather.SMEM_BYTES, gather.SPLIT_BYTES = v.smem, v.split_bytes
    print(f"snapshot kernel built with {', '.join(defines)}")


if __name__ == "__main__":
    main()
