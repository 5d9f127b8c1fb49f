"""Benchmark of kdump's packaged grouped FP8 GEMM on the reference shapes.

G = 288 experts; w13: N = 512, K = 4096; w2: N = 4096, K = 256; 1 / 32 / 113 / 512 tokens per
expert, each expert padded to a 128-row multiple (contiguous label layout). Times CUDA-graph
replays of: the packaged kernel (UE8M0 and fp32 scales), DeepGEMM (if `deep_gemm` imports) and
torch._scaled_grouped_mm (rowwise scales, valid rows only, if available), and prints TFLOP/s (on
valid tokens), achieved GB/s (bytes that must move at least once), ratios to each peer, to the
measured HBM copy bandwidth and to a measured mma.sync FP8 ceiling.

Usage: python lab/bench_sm120.py [--out lab/results/RESULTS_sm120.md] [--iters 30]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import math
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kdump.kernels import sm120

G = 288
SHAPES = {"w13": (512, 4096), "w2": (4096, 256)}
TOKENS = (1, 32, 113, 512)
FP8 = torch.float8_e4m3fn


def time_graph(fn: Callable[[], None], iters: int) -> float:
    """Mean microseconds per replay of a graph holding one call (warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_graph(lambda: dst.copy_(src), 20)
    return 2 * n / us / 1e3


MMA_SRC = r"""
// Each iteration changes A and each of the 8 accumulators uses its own B, so the compiler can
// neither hoist the products out of the loop (MMA is linear in C) nor merge the chains.
extern "C" __global__ void mma_peak(float* out, int iters) {
  unsigned a0 = threadIdx.x * 0x01010101u, a1 = a0 ^ 0x11111111u, a2 = a0 + 3u, a3 = a0 + 5u;
  unsigned b[8][2];
  float c[8][4] = {};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    b[j][0] = a0 ^ (0x22222222u + j * 0x01010101u);
    b[j][1] = a0 + 7u + j * 0x00010001u;
  }
  for (int i = 0; i < iters; ++i) {
    a0 += 0x00010001u; a1 ^= a0; a2 += 0x01000100u; a3 ^= a2;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                   "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b[j][0]), "r"(b[j][1]));
  }
  float s = 0.f;
  for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  if (s == 12345.f) out[threadIdx.x] = s;  // keeps the MMAs alive
}

// Shared by the warp-tile kernels: fragments that differ per thread and tile position, and a
// sum that keeps the accumulators alive.
__device__ __forceinline__ void tile_init(unsigned (&a)[4][4], unsigned (&b)[4][2]) {
#pragma unroll
  for (int x = 0; x < 4; ++x) {
#pragma unroll
    for (int y = 0; y < 4; ++y) a[x][y] = threadIdx.x * 0x01010101u + x * 0x00110011u + y;
    b[x][0] = threadIdx.x ^ (0x22222222u + x * 0x01010101u);
    b[x][1] = threadIdx.x + 7u + x * 0x00010001u;
  }
}

__device__ __forceinline__ void tile_sink(const float (&c)[4][4][4], float* out) {
  float s = 0.f;
  for (int x = 0; x < 4; ++x)
    for (int y = 0; y < 4; ++y) s += c[x][y][0] + c[x][y][1] + c[x][y][2] + c[x][y][3];
  if (s == 12345.f) out[threadIdx.x] = s;
}

// What a GEMM warp tile of 64 x 32 (4 x 4 MMAs, as in the packaged kernel) can reach: every
// step brings fresh A and B fragments, so on sm_90 each is unpacked to FP16 again (48 unpacks per
// 32 HMMA, against 8 per 16 in mma_peak).
extern "C" __global__ void mma_tile(float* out, int iters) {
  unsigned a[4][4], b[4][2];
  float c[4][4][4] = {};
  tile_init(a, b);
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int x = 0; x < 4; ++x) {
#pragma unroll
      for (int y = 0; y < 4; ++y) a[x][y] += 0x00010001u;
      b[x][0] ^= a[x][0];
      b[x][1] += 0x01000100u;
    }
#pragma unroll
    for (int x = 0; x < 4; ++x)
#pragma unroll
      for (int y = 0; y < 4; ++y)
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[x][y][0]), "+f"(c[x][y][1]), "+f"(c[x][y][2]), "+f"(c[x][y][3])
                     : "r"(a[x][0]), "r"(a[x][1]), "r"(a[x][2]), "r"(a[x][3]), "r"(b[y][0]),
                       "r"(b[y][1]));
  }
  tile_sink(c, out);
}

// mma_tile as the packaged kernel runs it on sm_90: the fresh FP8 fragments are converted to
// FP16 once per step and each k32 product is two FP16 m16n8k16 MMAs accumulating directly.
__device__ __forceinline__ void to_f16(unsigned x, unsigned& lo, unsigned& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi) : "r"(x));
}

extern "C" __global__ void mma_tile_f16(float* out, int iters) {
  unsigned a[4][4], b[4][2];
  float c[4][4][4] = {};
  tile_init(a, b);
  for (int i = 0; i < iters; ++i) {
    unsigned ah[4][8], bh[4][4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
#pragma unroll
      for (int y = 0; y < 4; ++y) a[x][y] += 0x00010001u;
      b[x][0] ^= a[x][0];
      b[x][1] += 0x01000100u;
#pragma unroll
      for (int y = 0; y < 4; ++y) to_f16(a[x][y], ah[x][2 * y], ah[x][2 * y + 1]);
      to_f16(b[x][0], bh[x][0], bh[x][1]);
      to_f16(b[x][1], bh[x][2], bh[x][3]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int x = 0; x < 4; ++x)
#pragma unroll
        for (int y = 0; y < 4; ++y)
          asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                       "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                       : "+f"(c[x][y][0]), "+f"(c[x][y][1]), "+f"(c[x][y][2]), "+f"(c[x][y][3])
                       : "r"(ah[x][4 * h]), "r"(ah[x][4 * h + 2]), "r"(ah[x][4 * h + 1]),
                         "r"(ah[x][4 * h + 3]), "r"(bh[y][2 * h]), "r"(bh[y][2 * h + 1]));
  }
  tile_sink(c, out);
}
"""


def mma_ceiling(kernel: str = "mma_peak") -> float:
    """TFLOP/s of back-to-back FP8 mma.sync m16n8k32: `mma_peak` (8 independent accumulators per
    warp, fresh A each step), `mma_tile` (a 4 x 4 warp tile, fresh A and B each step) or
    `mma_tile_f16` (that tile through FP16 MMAs, as the packaged kernel runs it on sm_90)."""
    from cuda.bindings import driver
    from cuda.core import Program, ProgramOptions

    cc = torch.cuda.get_device_capability()
    cubin = Program(MMA_SRC, "c++", ProgramOptions(arch=f"sm_{cc[0]}{cc[1]}a")).compile("cubin")
    torch.cuda.init()
    _, mod = driver.cuModuleLoadData(bytes(cubin.code))
    _, fn = driver.cuModuleGetFunction(mod, kernel.encode())
    out = torch.zeros(1024, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, threads, iters = sms * 4, 256, 4096 if kernel == "mma_peak" else 2048
    mmas_per_step = 8 if kernel == "mma_peak" else 16
    ptr, it = ctypes.c_void_p(out.data_ptr()), ctypes.c_int32(iters)
    args = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(it))

    def run() -> None:
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        driver.cuLaunchKernel(fn, blocks, 1, 1, threads, 1, 1, 0, stream, ctypes.addressof(args), 0)

    us = time_graph(run, 5)
    flops = blocks * (threads // 32) * iters * mmas_per_step * (16 * 8 * 32 * 2)
    return flops / us / 1e6


@dataclass
class Case:
    shape: str
    tokens: int
    n: int
    k: int
    counts: list[int]
    m: int
    labels: torch.Tensor


def make_case(shape: str, tokens: int) -> Case:
    n, k = SHAPES[shape]
    counts = [tokens] * G
    slot = math.ceil(tokens / 128) * 128
    lab = torch.full((G, slot), -1, dtype=torch.int32)
    lab[:, :tokens] = torch.arange(G, dtype=torch.int32)[:, None]
    return Case(shape, tokens, n, k, counts, G * slot, lab.flatten().cuda())


def mn_major(t: torch.Tensor) -> torch.Tensor:
    *lead, r, c = t.shape
    ar = (r + 3) // 4 * 4
    strides = (c * ar, 1, ar) if lead else (1, ar)
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def operands(c: Case, ue8m0: bool) -> tuple[tuple, tuple]:
    a = (torch.randn(c.m, c.k, device="cuda") * 100).clamp(-448, 448).to(FP8)
    b = (torch.randn(G, c.n, c.k, device="cuda") * 100).clamp(-448, 448).to(FP8)
    kb = math.ceil(c.k / 128)
    if ue8m0:
        kw = math.ceil(kb / 4)
        sfa = mn_major(
            torch.randint(120, 127, (c.m, kw), device="cuda", dtype=torch.int32) * 0x01010101
        )
        sfb = mn_major(
            torch.randint(120, 127, (G, c.n, kw), device="cuda", dtype=torch.int32) * 0x01010101
        )
    else:
        sfa = mn_major(torch.rand(c.m, kb, device="cuda") / 256)
        sfb = torch.rand(G, math.ceil(c.n / 128), kb, device="cuda") / 256
    return (a, sfa), (b, sfb)


def min_bytes(c: Case) -> int:
    """Bytes any kernel must move: valid A rows, B of active experts, valid D rows (bf16);
    scales ignored."""
    rows = sum(c.counts)
    return rows * c.k + G * c.n * c.k + rows * c.n * 2


def computed_rows(tokens: int) -> int:
    """Rows the packaged kernel runs MMAs for per expert: whole m16 blocks up to the last
    labelled row of each 128-row tile."""
    full, rest = divmod(tokens, 128)
    return full * 128 + math.ceil(rest / 16) * 16


def bench_ours(c: Case, ue8m0: bool, iters: int) -> float:
    a, b = operands(c, ue8m0)
    d = torch.empty(c.m, c.n, dtype=torch.bfloat16, device="cuda")
    return time_graph(lambda: sm120.m_grouped_fp8_gemm_nt_contiguous(a, b, d, c.labels), iters)


def bench_deepgemm(c: Case, iters: int) -> float | None:
    try:
        import deep_gemm
    except Exception:
        return None
    a, b = operands(c, ue8m0=False)
    d = torch.empty(c.m, c.n, dtype=torch.bfloat16, device="cuda")
    fn = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous", None)
    if fn is None:
        return None
    return time_graph(lambda: fn(a, b, d, c.labels), iters)


def bench_torch_grouped(c: Case, iters: int) -> float | None:
    if not hasattr(torch, "_scaled_grouped_mm"):
        return None
    rows = sum(c.counts)
    a = (torch.randn(rows, c.k, device="cuda")).to(FP8)
    b = (torch.randn(G, c.n, c.k, device="cuda")).to(FP8).transpose(1, 2)  # [G, K, N] col-major
    sa = torch.rand(rows, device="cuda")
    sb = torch.rand(G, c.n, device="cuda")
    offs = torch.cumsum(torch.tensor(c.counts, device="cuda"), 0).to(torch.int32)
    try:
        return time_graph(
            lambda: torch._scaled_grouped_mm(
                a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
            ),
            iters,
        )
    except Exception as exc:  # unsupported arch / alignment: leave the column empty
        print(f"  torch._scaled_grouped_mm unavailable: {str(exc).splitlines()[0][:100]}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="lab/results/RESULTS_sm120.md")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    ok, why = sm120.is_available()
    if not ok:
        raise SystemExit(f"packaged kernel unavailable: {why}")
    name = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    peak = mma_ceiling()
    tile_peak = mma_ceiling("mma_tile")
    f16_peak = mma_ceiling("mma_tile_f16")
    print(
        f"{name}: copy {bw:.0f} GB/s (read+write), mma.sync FP8 ceiling {peak:.0f} TFLOP/s, "
        f"64x32 warp-tile ceiling {tile_peak:.0f} TFLOP/s, through FP16 {f16_peak:.0f} TFLOP/s"
    )
    rows = []
    for shape in SHAPES:
        for tokens in TOKENS:
            c = make_case(shape, tokens)
            ours = bench_ours(c, True, args.iters)
            ours32 = bench_ours(c, False, args.iters)
            dg = bench_deepgemm(c, args.iters)
            tg = bench_torch_grouped(c, args.iters)
            flops_valid = 2 * sum(c.counts) * c.n * c.k
            flops_tiles = 2 * G * computed_rows(tokens) * c.n * c.k
            gbs = min_bytes(c) / ours / 1e3
            rows.append(
                dict(
                    shape=shape,
                    tokens=tokens,
                    ours=ours,
                    ours32=ours32,
                    dg=dg,
                    tg=tg,
                    tflops=flops_valid / ours / 1e6,
                    gbs=gbs,
                    bw_frac=gbs / bw,
                    mma_frac=flops_tiles / ours / 1e6 / peak,
                    tile_frac=flops_tiles / ours / 1e6 / tile_peak,
                    f16_frac=flops_tiles / ours / 1e6 / f16_peak,
                )
            )
            r = rows[-1]
            print(
                f"{shape} t={tokens:4d}: ours {ours:8.1f} us (fp32 scales {ours32:8.1f}) "
                f"{r['tflops']:7.1f} TFLOP/s {gbs:7.0f} GB/s | DeepGEMM "
                f"{'-' if dg is None else f'{dg:.1f}'} | torch "
                f"{'-' if tg is None else f'{tg:.1f}'} us",
                flush=True,
            )
            torch.cuda.empty_cache()
    write_results(args.out, name, bw, (peak, tile_peak, f16_peak), rows)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


NOTES = """
Notes:
- Hopper has no FP8 warp MMA. Written as `mma.sync ... e4m3`, ptxas emulates each m16n8k32 with
  two zero-based HMMA.16816.F32, four FADDs and F2FP.F16.E4M3.UNPACK_B conversions; that is what
  'mma' and 'tile' measure. On sm_90 the packaged kernel instead converts each fragment once and
  runs FP16 m16n8k16 MMAs that accumulate directly ('f16' measures that path). DeepGEMM and
  torch._scaled_grouped_mm use wgmma on Hopper, a different class of instruction, so 'x DG' /
  'x torch' here say little about sm_120, where the same source compiles to native
  QMMA.16832.F32.E4M3.E4M3 (not measured: no sm_120 GPU).
- The kernel is persistent (one CTA per SM striding over all M x N tiles, inactive tiles
  skipped), so a graph replay's cost does not depend on the routing metadata beyond the tiles it
  computes. A producer warpgroup decides the tiles and issues the TMA loads into a ring of
  stages that take only the A rows their tile needs (its routing words fetched a tile ahead);
  eight math warps compute. Each tile is computed (and A loaded)
  only up to its last labelled row, in 16-row blocks: decode batches cost the B stream plus a
  few rows.
- See RESULTS_sm120_tuning.md for the variants measured and what limits the kernel.
"""


def write_results(
    path: str, name: str, bw: float, peaks: tuple[float, float, float], rows: list[dict]
) -> None:
    peak, tile_peak, f16_peak = peaks
    lines = [
        "# Packaged SM120-style grouped FP8 GEMM: benchmark",
        "",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: "
        f"{name}, {platform.node()}; torch {torch.__version__}.",
        f"Measured ceilings: D2D copy {bw:.0f} GB/s (read + write counted); FP8 mma.sync "
        f"m16n8k32 {peak:.0f} TFLOP/s (fresh A each step); the same with a 64 x 32 warp tile "
        f"(fresh A and B each step, as in the kernel) {tile_peak:.0f} TFLOP/s; that tile through "
        f"FP16 MMAs, as the kernel runs it on sm_90, {f16_peak:.0f} TFLOP/s.",
        "",
        "G = 288, contiguous label layout, every expert padded to 128-row multiples; CUDA-graph",
        "replay, mean per call. TFLOP/s on valid tokens; GB/s = (valid A rows + all B + valid",
        "D rows) / time, the bytes any kernel must move; 'HBM' = that over the copy bandwidth;",
        "'mma' = FLOP/s of the m16 blocks the kernel computes over the mma.sync ceiling, 'tile' /",
        "'f16' = the same over the warp-tile ceilings; 'x DG' / 'x torch' = peer time / our",
        "UE8M0 time (> 1: ours is faster); 'x DG fp32' = DeepGEMM's time over ours with the same",
        "fp32 scales DeepGEMM was given (DeepGEMM on sm_90 takes the SM90 fp32 format).",
        "",
        "| shape | tokens/expert | ours UE8M0 (us) | ours fp32 (us) | TFLOP/s | GB/s | HBM | mma |"
        " tile | f16 | DeepGEMM (us) | x DG | x DG fp32 | torch grouped (us) | x torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['ours']:.1f} | {r['ours32']:.1f} | "
            f"{r['tflops']:.1f} | {r['gbs']:.0f} | {r['bw_frac']:.2f} | {r['mma_frac']:.2f} | "
            f"{r['tile_frac']:.2f} | {r['f16_frac']:.2f} | "
            f"{_fmt(r['dg'], '.1f')} | "
            f"{_fmt(None if r['dg'] is None else r['dg'] / r['ours'], '.2f')} | "
            f"{_fmt(None if r['dg'] is None else r['dg'] / r['ours32'], '.2f')} | "
            f"{_fmt(r['tg'], '.1f')} | "
            f"{_fmt(None if r['tg'] is None else r['tg'] / r['ours'], '.2f')} |"
        )
    text = "\n".join(lines) + "\n" + NOTES
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
