"""The flight recorder's cost on a GPU, measured in one run against baselines of the same run.

Reference shapes G=288 with N=512, K=4096 (w13) and N=4096, K=256 (w2); 1, 32 and 113 tokens per
expert (A is always 36,864 rows: every expert padded to 128). For each:

* graph step (CUDA-graph replay of the GEMM) without the recorder, and with it:
  (i) metadata and scales only (A's rows not gathered), (ii) with activations (A's valid rows),
  each with a salvage process holding the device tier (host copy on a side branch) and without
  (host copy before the kernel); for (ii) the HBM bound of copying those rows (their bytes at the
  plain D2D rate measured here), the floor it sets ((plain + bound) / plain: no recorder that
  copies those rows before the kernel steps faster) and the added time against the bound;
* the step with one empty one-thread kernel before the GEMM (the floor of any recorder that adds
  one node per recorded call: the snapshot kernel, which also writes the previous site's done
  marker) and with two around it (what a snapshot plus a done-marker node would cost);
* (i) floor: the step with one kernel before the GEMM that reads the labels, copies them and the
  touched rows' scales (to the same places of a buffer of the scales' layout) and marks each
  block done behind a fence (no compaction, no ring slot, no publication): what no snapshot of
  case (i) that copies only the touched rows and says it completed can beat;
* (i) plain ring: the same kernel writing the touched rows compacted (one row-counter atomic per
  block of 128 rows) and published by the last block to finish (a block counter behind a fence,
  then the row count and the token), as a compacting ring needs (the next slot starts after
  this one's rows): what the compaction and the publication add when written plainly, beside
  kdump's snapshot (a reference, not a bound: a tuned kernel may beat it);
* eager host time per call, unhooked and recorded (the call signature cache warm), at least
  400 calls timed in chunks with the device synchronised between them (bench/_timing.py), and
  recorded with A, its scales, D and the labels new tensor objects over the same memory at
  every call (a serving loop's step; the weights the same objects);

then the copy throughput of each tier: the snapshot kernel's D2D against a plain D2D copy of the
same bytes, the journal's pinned D2H against a plain pinned buffer; then the outputs column: a
generic target (no spec: `scale(x, out)`, `torch.mul(x, 2, out=out)`, x and out of
`--generic-kib` each) whose graph step and eager call are recorded with `--outputs none` and
with its outputs kept (the default for a target without a reference spec: out copied into the
slot after the kernel, a captured node in the graph), with and without a salvage process
holding the device tier (DeepGEMM keeps none by default: the rows above are its cost).

    python bench/bench_flight.py [--iters 50] [--pdl] [--define NAME=VALUE] [--carveout PCT]
        [--shape 512x4096] [--tokens 1,32] [--generic-kib 64,512] [--only-generic]

`--pdl` launches the GEMM with programmatic dependent launch (DeepGEMM's `set_pdl(True)`), every
column of the run: the snapshot kernel lets such a kernel start its prologue early.
`--define KD_EARLY_LAUNCH=2` records with that #define of kdump/record/flight/snapshot.cu changed
(`--define KD_DENSE=0`: case (i)'s scales read only where rows are touched, after the rule, not
as whole windows before it; `--define KD_OVERLAP=0`: case (ii)'s rows of A, then their scales,
not side by side);
`--define patch=fixed-rows+no-copies` with bench_snapshot_kernel.py's timing experiments (parts
of the launch taken out: the step's cost of each, not a valid recording); `--carveout 100` with
the snapshot kernel preferring the SM's whole shared-memory carveout (as the GEMM does).

Needs DeepGEMM (the GEMM measured) or --backend packaged (kdump's packaged kernel).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _timing import CHUNK, host_us, new_step_objects

import kdump
from kdump.kernels import registry
from kdump.record.config import RingConfig
from kdump.record.flight import recorder as ring_mod

SHAPES = ((512, 4096), (4096, 256))
TOKENS = (1, 32, 113)
G = 288
TARGET = "deep_gemm:m_grouped_fp8_gemm_nt_contiguous"
MODULES = {"deep_gemm": "deep_gemm", "packaged": "kdump.kernels.sm120.api"}


def _case(n: int, k: int, tokens: int) -> tuple[tuple, dict]:
    spec = registry.spec_for(TARGET)
    args, kwargs = spec.generate(
        seed=1, device="cuda", scale_format="fp32", num_groups=G, n=n, k=k, expected_m=tokens
    )
    # exactly `tokens` rows per expert
    labels = args[3]
    rows = torch.arange(labels.numel(), device=labels.device)
    labels.copy_(torch.where(rows % 128 < tokens, rows // 128, -1).to(torch.int32))
    return tuple(args), kwargs


def gemm(backend: str) -> Callable[..., Any]:
    """The grouped GEMM of `backend`, called by module attribute at call time (so the recorder's
    hook on deep_gemm's name is taken); the packaged kernel is recorded under that name."""
    import sys
    import types

    module = importlib.import_module(MODULES[backend])
    if backend == "packaged":
        sys.modules.setdefault("deep_gemm", types.ModuleType("deep_gemm"))
        sys.modules["deep_gemm"].m_grouped_fp8_gemm_nt_contiguous = (  # type: ignore[attr-defined]
            module.m_grouped_fp8_gemm_nt_contiguous
        )
        module = sys.modules["deep_gemm"]

    def fn(*a: Any, **k: Any) -> Any:
        return module.m_grouped_fp8_gemm_nt_contiguous(*a, **k)

    return fn


def _graph_ms(fn: Callable[..., Any], args: tuple, kwargs: dict, iters: int) -> float:
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args, **kwargs)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):  # best of three batches: other work on the host shifts single batches
        t0 = time.perf_counter()
        for _ in range(iters):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / iters * 1e3)
    return best


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
    from bench_snapshot_kernel import load_function

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


def _eager_host_us(
    fn: Callable[..., Any], args: tuple, kwargs: dict, iters: int, renew: bool = False
) -> float:
    """`renew`: every call's activations, output and labels new objects over the same memory."""
    fresh = new_step_objects if renew else None
    for _ in range(3):
        fn(*(fresh(args) if fresh else args), **kwargs)
    return host_us(fn, args, kwargs, max(iters, 10 * CHUNK), fresh=fresh)


def _d2d_gbs(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 20 * nbytes / (time.perf_counter() - t0) / 1e9


class _ScalesOnly:
    """Plans without A's data rows: case (i), metadata and scales only."""

    def __enter__(self) -> None:
        self.orig = ring_mod._plan_for

        def plan_for(st: Any, args: Any, kwargs: Any, tensors: Any) -> Any:
            plan, rule = self.orig(st, args, kwargs, tensors)
            if plan is None or len(plan.gathers) < 2:
                return None, None
            from dataclasses import replace

            from kdump.record.flight.gather import RECORD_HEAD

            keep = plan.gathers[1:]
            off, moved = RECORD_HEAD, []
            for g in keep:
                moved.append(replace(g, rec_off=off))
                off = -(-(off + g.row_bytes) // 16) * 16
            return replace(plan, gathers=tuple(moved), rec_bytes=off), rule

        ring_mod._plan_for = plan_for

    def __exit__(self, *exc: object) -> None:
        ring_mod._plan_for = self.orig


def _recorded(
    fn: Callable[..., Any], args: tuple, kwargs: dict, shm: Path, held: bool, iters: int
) -> tuple[float, float, dict, float]:
    ring = RingConfig(slots=64, slot_bytes=1 << 20, journal_dir=shm, device_bytes=1 << 30)
    with kdump.recording("deep_gemm", out=shm / "out", mode="ring", ring=ring) as rec:
        fn(*args, **kwargs)  # the journal and the device tier are made here
        cuda = rec.recorder._cuda
        if cuda is None or cuda.tier is None:
            raise SystemExit(f"no device tier: {cuda.facts() if cuda else 'no CUDA side'}")
        cuda.tier.held = held  # as if a salvage process held it (or not)
        host = _eager_host_us(fn, args, kwargs, iters)
        renewed = _eager_host_us(fn, args, kwargs, iters, renew=True)
        step = _graph_ms(fn, args, kwargs, iters)
        facts = cuda.facts()
        # Leaving writes every slot as a bundle: not what this bench measures (the salvage's
        # time is scripts/profile_recorder.py's), and it took most of the run's time.
        rec.recorder.flush = lambda: None
    return step, host, facts, renewed


GENERIC = "kdump_bench_generic:scale"
GENERIC_KIB = (64, 512)
GENERIC_HEADER = (
    "| x, out KiB each (slot) | plain ms | none, held | kept, held | none, not held | "
    "kept, not held | eager us plain | eager us none | eager us kept | outputs held |"
)


def generic_module() -> types.ModuleType:
    """The outputs column's target, put in sys.modules: no spec, so the flight recorder keeps
    its outputs by default."""
    mod = types.ModuleType("kdump_bench_generic")

    def scale(x: torch.Tensor, out: torch.Tensor) -> None:
        torch.mul(x, 2, out=out)

    mod.scale = scale  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    return mod


def _generic_fn() -> Callable[..., Any]:
    mod = sys.modules.get("kdump_bench_generic") or generic_module()

    def fn(*a: Any) -> Any:  # by attribute at call time: the recorder's hook is taken
        return mod.scale(*a)

    return fn


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize()


def _generic_host_us(fn: Callable[..., Any], args: tuple, calls: int) -> float:
    """Host µs per eager call, in chunks with the device synchronised between them (CPU
    tensors: no device to wait for)."""
    for _ in range(3):
        fn(*args)
    _sync(args[0])
    total, done = 0.0, 0
    while done < calls:
        n = min(CHUNK, calls - done)
        t = time.perf_counter()
        for _ in range(n):
            fn(*args)
        total += time.perf_counter() - t
        _sync(args[0])
        done += n
    return total / calls * 1e6


def generic_slot_bytes(nbytes: int) -> int:
    """A slot that holds both arguments before the call and both again after it (the
    default keeps every tensor argument of a generic target): 1 MiB, doubled as needed."""
    slot = 1 << 20
    while slot * 0.9 < 4 * (nbytes + 64):
        slot *= 2
    return slot


def generic_recorded(
    x: torch.Tensor, out: torch.Tensor, shm: Path, outputs: str, held: bool, iters: int
) -> dict[str, Any]:
    """The generic target recorded with `--outputs` `outputs`: "host" (µs per eager call),
    "step" (ms per graph replay; CUDA tensors only) and "held" (whether the journal's newest
    complete slot holds the outputs of its call, read after the copies landed)."""
    from kdump.format.journal import SlotState
    from kdump.record.flight.journal_reader import read_journal

    fn = _generic_fn()
    device_bytes = 1 << 30 if x.is_cuda else 0
    slot = generic_slot_bytes(x.numel() * x.element_size())
    ring = RingConfig(slots=64, slot_bytes=slot, journal_dir=shm, device_bytes=device_bytes)
    res: dict[str, Any] = {}
    with kdump.recording(
        GENERIC, out=shm / "out-generic", mode="ring", ring=ring, outputs=outputs
    ) as rec:
        fn(x, out)  # the journal (and the device tier) are made here
        cuda = rec.recorder._cuda
        if cuda is not None and cuda.tier is not None:
            cuda.tier.held = held  # as if a salvage process held it (or not)
        res["host"] = _generic_host_us(fn, (x, out), max(iters, 2 * CHUNK))
        if x.is_cuda:
            res["step"] = _graph_ms(fn, (x, out), {}, iters)
            assert cuda is not None
            with rec.recorder.lock:
                cuda.drain(wait=True)
            torch.cuda.synchronize()
        slots = read_journal(rec.recorder.journal.path).having(SlotState.COMPLETE)
        res["held"] = bool(slots) and slots[0].outputs_held
        # Leaving would write every slot as a bundle: not what this measures.
        rec.recorder.flush = lambda: None
    return res


def generic_row(kib: int, plain_ms: float | None, plain_us: float, res: dict) -> str:
    """One row of the outputs column's table (`GENERIC_HEADER`); `res[outputs, held]` as
    `generic_recorded` returns them."""

    def step(key: tuple[str, bool]) -> str:
        ms = res[key].get("step")
        if ms is None or plain_ms is None:
            return "-"
        return f"{ms:.4f} ({ms / plain_ms:.2f}x)"

    none_us = statistics.median(res[k]["host"] for k in res if k[0] == "none")
    kept_us = statistics.median(res[k]["host"] for k in res if k[0] == "default")
    cells = [
        f"{kib} ({generic_slot_bytes(kib * 1024) >> 20}M)",
        f"{plain_ms:.4f}" if plain_ms is not None else "-",
        step(("none", True)),
        step(("default", True)),
        step(("none", False)),
        step(("default", False)),
        f"{plain_us:.1f}",
        f"{none_us:.1f} (+{none_us - plain_us:.1f})",
        f"{kept_us:.1f} (+{kept_us - plain_us:.1f})",
        "yes" if all(res[k]["held"] for k in res if k[0] == "default") else "no",
    ]
    return "| " + " | ".join(cells) + " |"


def generic_table(shm: Path, sizes_kib: list[int], iters: int, device: str) -> list[str]:
    """The outputs column: a row per size (x and out of that many KiB each)."""
    rows = [GENERIC_HEADER, "|" + "---|" * 10]
    fn = _generic_fn()
    for kib in sizes_kib:
        n = max(1, kib * 1024 // 4)
        x = torch.randn(n, device=device)
        out = torch.zeros(n, device=device)
        plain_ms = _graph_ms(fn, (x, out), {}, iters) if x.is_cuda else None
        plain_us = _generic_host_us(fn, (x, out), max(iters, 2 * CHUNK))
        res = {
            (outputs, held): generic_recorded(x, out, shm, outputs, held, iters)
            for held in (True, False)
            for outputs in ("none", "default")
        }
        rows.append(generic_row(kib, plain_ms, plain_us, res))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--backend", choices=sorted(MODULES), default="deep_gemm")
    p.add_argument("--pdl", action="store_true", help="launch the GEMM with PDL (set_pdl)")
    add_kernel_options(p)
    p.add_argument("--shape", action="append", default=[], metavar="NxK", help="only these")
    p.add_argument("--tokens", default="", metavar="T,...", help="only these tokens per expert")
    p.add_argument(
        "--generic-kib",
        default=",".join(map(str, GENERIC_KIB)),
        metavar="KIB,...",
        help="the outputs column's sizes of x and out",
    )
    p.add_argument(
        "--only-generic", action="store_true", help="only the outputs column (no GEMM needed)"
    )
    opt = p.parse_args()
    generic_kib = [int(v) for v in opt.generic_kib.split(",") if v]
    if opt.only_generic:
        shm = Path(tempfile.mkdtemp(prefix="kdump-bench-", dir="/dev/shm"))
        print("\n".join(generic_table(shm, generic_kib, opt.iters, "cuda")))
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in opt.shape] or list(SHAPES)
    token_counts = [int(t) for t in opt.tokens.split(",") if t] or list(TOKENS)
    apply_kernel_options(opt)
    fn = gemm(opt.backend)
    if opt.pdl:
        import deep_gemm

        if not hasattr(deep_gemm, "set_pdl"):
            raise SystemExit("--pdl: this deep_gemm has no set_pdl")
        deep_gemm.set_pdl(True)
        print(f"GEMM launched with PDL (deep_gemm.get_pdl() = {deep_gemm.get_pdl()})")

    shm = Path(tempfile.mkdtemp(prefix="kdump-bench-", dir="/dev/shm"))
    d2d = _d2d_gbs(256 << 20)
    print(f"plain D2D: {d2d:.0f} GB/s (HBM bound below uses it)\n")
    print(
        "| N | K | tok/exp | plain ms | 1 empty node | 2 empty nodes | (i) floor | "
        "(i) plain ring | (i) held | "
        "(i) not held | (ii) held | "
        "(ii) not held | rows MB | HBM bound ms | (ii) floor | (ii) held added / bound | "
        "eager us plain | eager us rec | eager us rec, new objects |"
    )
    print("|" + "---|" * 19)
    facts: dict = {}
    for n, k in shapes:
        for tokens in token_counts:
            args, kwargs = _case(n, k, tokens)
            plain = _graph_ms(fn, args, kwargs, opt.iters)
            node1 = _graph_ms(_with_empty_nodes(fn, 1), args, kwargs, opt.iters)
            nodes = _graph_ms(_with_empty_nodes(fn), args, kwargs, opt.iters)
            floor_i = _graph_ms(_with_floor_node(fn, args), args, kwargs, opt.iters)
            floor_r = _graph_ms(_with_floor_node(fn, args, ring=True), args, kwargs, opt.iters)
            plain_h = _eager_host_us(fn, args, kwargs, opt.iters)
            res = {}
            with _ScalesOnly():
                for held in (True, False):
                    res["i", held] = _recorded(fn, args, kwargs, shm, held, opt.iters)
            for held in (True, False):
                res["ii", held] = _recorded(fn, args, kwargs, shm, held, opt.iters)
            facts = res["ii", True][2]
            rows = G * tokens
            row_bytes = k + (k // 128) * 4 + 16
            mb = rows * row_bytes / 1e6
            bound = rows * row_bytes / (d2d * 1e9) * 1e3  # those bytes at the plain D2D rate
            added = res["ii", True][0] - plain
            cells = [
                f"{plain:.3f}",
                f"{node1:.3f} ({node1 / plain:.3f}x)",
                f"{nodes:.3f} ({nodes / plain:.3f}x)",
                f"{floor_i:.3f} ({floor_i / plain:.3f}x)",
                f"{floor_r:.3f} ({floor_r / plain:.3f}x)",
                *(
                    f"{res[c, h][0]:.3f} ({res[c, h][0] / plain:.2f}x)"
                    for c in ("i", "ii")
                    for h in (True, False)
                ),
                f"{mb:.1f}",
                f"{bound:.4f}",
                # no recorder that copies those rows before the kernel can step faster than this
                f"{(plain + bound) / plain:.3f}x",
                f"{added / bound:.2f}" if bound else "-",
                f"{plain_h:.1f}",
                f"{res['ii', True][1]:.1f} (+{res['ii', True][1] - plain_h:.1f})",
                f"{res['ii', True][3]:.1f} (+{res['ii', True][3] - plain_h:.1f})",
            ]
            print(f"| {n} | {k} | {tokens} | " + " | ".join(cells) + " |")
    print(f"\ndevice tier: {facts}")
    _throughput(shm)
    print("\noutputs column (generic target, graph step and eager call):")
    print("\n".join(generic_table(shm, generic_kib, opt.iters, "cuda")))


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
    """Record with a variant of the snapshot kernel: its #defines changed as
    bench_snapshot_kernel.py changes them (its own cache entry)."""
    from bench_snapshot_kernel import variant_source

    from kdump.record.flight import gather

    src = variant_source(",".join(defines))[0]
    gather.kernel_source = lambda: src  # type: ignore[assignment]
    gather.shipped_smem.cache_clear()
    gather.shipped_split_bytes.cache_clear()
    print(f"snapshot kernel built with {', '.join(defines)}")


def _timed(run: Callable[[], None], nbytes: int) -> float:
    """GB/s of `run` moving `nbytes` (best of ten after a warm-up)."""
    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        run()
    torch.cuda.synchronize()
    return 10 * nbytes / (time.perf_counter() - t0) / 1e9


def _throughput(shm: Path) -> None:
    """Tier copy rates: the snapshot kernel (plain byte ranges; a row gather) against a plain D2D
    copy of the same bytes; the journal's registered pinned memory against a plain pinned buffer."""
    from kdump.bundle.tensors import group_storages
    from kdump.record.flight import gather
    from kdump.record.flight.journal import Journal

    kernels = gather.get_kernel(torch.cuda.current_device())
    fn = kernels.snapshot
    stream = torch.cuda.current_stream().cuda_stream
    record = torch.zeros(64, dtype=torch.uint8, device="cuda")
    ctrl = torch.zeros(16, dtype=torch.uint8, device="cuda")
    # 64 MB: the launch's fixed chain (rule, counters, publication: a few us) still shows;
    # 256 MB: the steady copy rate
    for nbytes in (64 << 20, 256 << 20):
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        p = gather.SnapParams()
        per = nbytes // gather.MAX_COPIES
        for c in range(gather.MAX_COPIES):
            p.copies[c].src = src.data_ptr() + c * per
            p.copies[c].dst = dst.data_ptr() + c * per
            p.copies[c].nbytes = per
        p.n_copies = gather.MAX_COPIES
        p.record, p.ctrl, p.inner, p.alignment = record.data_ptr(), ctrl.data_ptr(), 1, 1
        plain = _timed(lambda: dst.copy_(src), nbytes)  # noqa: B023 (called in this iteration)
        snap = _timed(lambda: gather.launch(fn, p, stream), nbytes)  # noqa: B023
        print(
            f"D2D byte ranges ({nbytes >> 20} MB): snapshot kernel {snap:.0f} GB/s, plain copy "
            f"{plain:.0f} GB/s ({snap / plain:.2f}x)"
        )
    nbytes, src, dst = 64 << 20, src[: 64 << 20], None  # the D2H part below copies 64 MB
    # a row gather of every row of a 36,864 x 4,096 A (what the ring gets at full routing)
    a = torch.randint(0, 255, (36864, 4096), dtype=torch.uint8, device="cuda")
    storages, records = group_storages([a])
    plan = gather.make_plan([a], records, storages, [0], "all", None, 1)
    assert plan is not None
    ring = torch.empty(plan.worst, dtype=torch.uint8, device="cuda")
    g = gather.SnapParams()
    gather.set_plan(g, plan, lambda _: a.data_ptr(), kernels.resident)  # as the recorder does
    g.ring, g.ring_bytes = ring.data_ptr(), plan.worst
    g.record, g.ctrl = record.data_ptr(), ctrl.data_ptr()
    copy_a = torch.empty_like(a)
    plain = _timed(lambda: copy_a.copy_(a), a.numel())
    snap = _timed(lambda: gather.launch(fn, g, stream), a.numel())
    print(
        f"D2D row gather (151 MB of A): snapshot kernel {snap:.0f} GB/s, plain copy "
        f"{plain:.0f} GB/s ({snap / plain:.2f}x)"
    )
    j = Journal.create(shm, slots=2, slot_bytes=nbytes + (1 << 20))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(j._map))
    torch.cuda.cudart().cudaHostRegister(addr, len(j._map), 3)
    view = torch.frombuffer(j._view[j.header_bytes : j.header_bytes + nbytes], dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rate_j = _timed(lambda: view.copy_(src, non_blocking=True), nbytes)
    rate_p = _timed(lambda: pinned.copy_(src, non_blocking=True), nbytes)
    print(
        f"D2H: journal (host tier) {rate_j:.1f} GB/s, plain pinned {rate_p:.1f} GB/s "
        f"({rate_j / rate_p:.2f}x)"
    )
    torch.cuda.cudart().cudaHostUnregister(addr)
    view = None  # the journal's mapping can close once nothing views it
    j.unlink()


if __name__ == "__main__":
    main()
