// kdump packaged m-grouped FP8 GEMM, SM120 style: TMA + mbarrier pipeline + warp-level mma.sync.
//
// D[m, n] = sum_k A[m, k] * B[g(m), n, k] * scale_a[m, k/128] * scale_b[g(m), n, k/128]  (bf16 out)
//
// No wgmma and no tensor memory, so the same source runs on sm_120a (native FP8 warp MMA) and on
// sm_90a (no FP8 warp MMA there: the kernel converts the fragments and runs FP16 mma.sync).
//
// Every routing decision (which expert an M-tile belongs to, whether it is active, how many rows it
// may write) is read from device memory inside the kernel on every launch. The grid is sized from
// the shapes and the SM count alone (persistent CTAs stride over all M x N tiles and skip the
// inactive ones), so a captured CUDA graph stays correct when the routing changes in place.
//
// Compile-time parameters (set with -D by kdump.kernels.sm120.build):
//   KD_BM, KD_BN   tile rows (M) and columns (N); KD_BK is fixed at 128 (one scale block)
//   KD_STAGES      size of the shared-memory ring, in whole-tile stages (A and B tiles)
//   KD_SLOTS       most stages in flight: a stage only takes the A rows its tile needs, so thin
//                  (decode) tiles fit more stages into the same ring
//   KD_WARPS_M, KD_WARPS_N   math-warp grid
//   KD_A_BOX       rows per A TMA box (only the boxes holding a tile's rows are loaded)
//   KD_KK_UNROLL   unroll factor of the four k32 MMA steps of one K block

#include <cuda/std/type_traits>
// CUTLASS/CuTe refer to these std:: names; NVRTC has no host standard library, cccl has them.
namespace std {
using cuda::std::is_pointer_v;
using cuda::std::void_t;
}  // namespace std

#include <cuda_bf16.h>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm89.hpp>
#include <cutlass/arch/barrier.h>

#ifndef KD_BM
#define KD_BM 128
#endif
#ifndef KD_BN
#define KD_BN 128
#endif
#ifndef KD_STAGES
#define KD_STAGES 3
#endif
#ifndef KD_SLOTS
#define KD_SLOTS KD_STAGES
#endif
#ifndef KD_UNROLL_BLOCKS
#define KD_UNROLL_BLOCKS 2  // warps with at most this many m16 blocks unroll the k32 steps fully
#endif
#ifndef KD_KK_UNROLL
#define KD_KK_UNROLL 4
#endif
#ifndef KD_A_BOX
#define KD_A_BOX 16
#endif
#ifndef KD_PSUM_BALLOT
#define KD_PSUM_BALLOT 1  // psum layout: group lookup by lane ballots (0: binary search always)
#endif
#ifndef KD_WARPS_M
#define KD_WARPS_M 2
#endif
#ifndef KD_WARPS_N
#define KD_WARPS_N 4
#endif

namespace kd {

constexpr int BM = KD_BM;
constexpr int BN = KD_BN;
constexpr int BK = 128;  // bytes of K per stage == one scale block == one 128B swizzle row
constexpr int STAGES = KD_STAGES;
constexpr int SLOTS = KD_SLOTS;
static_assert(SLOTS >= STAGES, "a full ring of whole-tile stages needs STAGES slots");
constexpr int WARPS_M = KD_WARPS_M;
constexpr int WARPS_N = KD_WARPS_N;
constexpr int MATH_WARPS = WARPS_M * WARPS_N;
// A producer warpgroup in front of the math warps; its registers move to them with setmaxnreg.
// (Math warp 0 producing between its own math steps measured 25-55% slower on the H200.)
constexpr int PRODUCER_WARPS = 4;
constexpr int THREADS = (PRODUCER_WARPS + MATH_WARPS) * 32;
// Every warp starts with the launch-bounds share of the register file (168 for 384 threads).
// setmaxnreg.inc only takes what the CTA's own warps gave back with setmaxnreg.dec, so the math
// warps may grow by exactly what the producer warpgroup releases: asking for more hangs.
constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
constexpr int PRODUCER_REGS = 40;
constexpr int MATH_REGS_RAW =
    LAUNCH_REGS + (LAUNCH_REGS - PRODUCER_REGS) * PRODUCER_WARPS / MATH_WARPS;
constexpr int MATH_REGS = (MATH_REGS_RAW > 256 ? 256 : MATH_REGS_RAW) / 8 * 8;
static_assert(MATH_REGS >= LAUNCH_REGS, "setmaxnreg would shrink the math warps");
static_assert(MATH_WARPS % 4 == 0, "setmaxnreg works on whole warpgroups");
constexpr int A_BOX = KD_A_BOX;  // rows per A TMA box: a tile loads ceil(rows / A_BOX) boxes
constexpr int WM = BM / WARPS_M;  // rows per math warp
constexpr int WN = BN / WARPS_N;  // columns per math warp
constexpr int MI = WM / 16;       // m16 MMA tiles per warp
constexpr int NI = WN / 8;        // n8 MMA tiles per warp
constexpr int GROUP_ALIGN = 128;  // DeepGEMM's mk alignment for contiguous layouts
constexpr int A_TILE_BYTES = BM * BK;
constexpr int B_TILE_BYTES = BN * BK;
constexpr int STAGE_BYTES = A_TILE_BYTES + B_TILE_BYTES;
constexpr int RING_BYTES = STAGES * STAGE_BYTES;
static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile must hold whole m16 / pairs of n8 tiles");
static_assert(BM <= 256 && BN <= 256, "a TMA box dimension is at most 256");
static_assert(128 % WN == 0, "fp32 B scales: one 128-column scale block per math warp");
static_assert(BM % A_BOX == 0 && A_BOX % 16 == 0, "A boxes: whole m16 blocks, 1 KiB aligned");
static_assert(MI <= 8, "the MMA step dispatch has copies for 1..8 m16 blocks per warp");

enum Layout : int { kLabels = 0, kPsum = 1, kMasked = 2 };

// Launch parameters: plain struct, mirrored field by field by kdump.kernels.sm120.launch.KdParams.
struct Params {
  const void* sfa;    // A scales: fp32 [.., M, ceil(K/128)] or int32 UE8M0x4 [.., M, ceil(K/512)]
  const void* sfb;    // B scales: fp32 [G, ceil(N/128), ceil(K/128)] or int32 [G, N, ceil(K/512)]
  const int* layout;  // labels int32 [M] | psum ends int32 [G] | masked_m int32 [G]
  __nv_bfloat16* d;   // output, bf16, unit stride along N
  int* sched;         // stale-schedule workspace (fault-injection kernel only), else null
  long long sfa_stride_g, sfa_stride_m, sfa_stride_k;  // in elements (4 bytes)
  long long sfb_stride_g, sfb_stride_n, sfb_stride_k;
  long long d_stride_g, d_stride_m;  // in bf16 elements
  int m;                 // contiguous: total rows M; masked: max_m (rows per group)
  int n, k, num_groups;
  int m_tiles;           // contiguous: ceil(M/BM); masked: ceil(max_m/BM) per group
  int n_tiles;           // ceil(N/BN)
  int k_blocks;          // ceil(K/128)
  int reserved;
};

// A 128-byte TMA descriptor passed by value; its bytes come from cuTensorMapEncodeTiled.
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// What one tile of work is, decided by the producer warp from device-resident routing metadata.
struct TileJob {
  int active;
  int group;    // expert index: B / scale_b group, and A / D group for the masked layout
  int row0;     // first row of the tile (global for contiguous, within the group for masked)
  int rows;     // rows [row0, row0 + rows) are loaded, computed and written; the rest are skipped
  int row_end;  // rows >= row_end are never written
};

// What the producer tells the math warps about one stage, next to the bytes TMA put there.
struct StageJob {
  int n0;  // first column of the tile; -1 marks the end of this CTA's stream
  int group;
  int row0;
  int rows;
  int row_end;
  int kb;  // K block of this stage; 0 starts a tile, k_blocks - 1 ends it
  int off;    // byte offset of the stage in the ring: its B tile, then its A boxes
  int bytes;  // bytes it occupies there
};

__device__ __forceinline__ int ceil_align(int x, int a) { return (x + a - 1) / a * a; }

// Psum layout: grouped_layout[g] is the END row of group g in the padded row space; group g starts
// at align_up(grouped_layout[g-1], 128) (group 0 at 0). Find the last group whose start <= row.
__device__ __forceinline__ int psum_group_of(const int* ends, int num_groups, int row) {
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    const int start = ceil_align(__ldg(ends + mid - 1), GROUP_ALIGN);
    if (start <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The routing words a tile decision needs, loaded one tile ahead by the producer warp so their
// latency hides behind the current tile's stages (on two-K-block problems the producer's
// latency per tile set the pace): the label layout's BM / 32 labels per lane, the masked
// layout's row count, the psum layout's candidate group ends (v[0]) and their first index
// (v[1]; -1: too many groups, binary search at decision time).
template <int LAYOUT>
struct Fetched {
  int v[LAYOUT == kLabels ? BM / 32 : 2];
};

// The labels of the BM rows from row0, BM / 32 per lane (-1 past M).
__device__ __forceinline__ Fetched<kLabels> load_labels(const Params& p, int row0, int lane) {
  Fetched<kLabels> f;
#pragma unroll
  for (int r = 0; r < BM / 32; ++r) {
    const int row = row0 + r * 32 + lane;
    f.v[r] = -1;
    if (row < p.m) f.v[r] = __ldg(p.layout + row);
  }
  return f;
}

// One past the last of those rows that carries a label >= 0 (0 if none); rows past it are
// padding: neither loaded, computed nor written (decode batches fill a few rows of each tile).
// All 32 lanes of a warp call it.
__device__ __forceinline__ int label_extent(const Fetched<kLabels>& f, int lane) {
  int last = -1;
#pragma unroll
  for (int r = 0; r < BM / 32; ++r)
    if (f.v[r] >= 0) last = r * 32 + lane;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
  return last + 1;
}

// Psum layout with G groups: which group holds a row is the number of k in [0, G - 1) whose
// aligned end align(ends[k], 128) is <= row (the aligned ends never decrease). The producer
// splits those G - 1 ends into 32 chunks of psum_chunk_size(G) and keeps, per lane, the last
// aligned end of its chunk (psum_chunk_end, loaded once per CTA). A ballot over those finds the
// chunk, one load per lane of its ends the group: one round of loads per tile, not a binary
// search's ~log2(G) dependent ones. Chunks of up to 31 ends: G <= 993.
constexpr int PSUM_MAX_CHUNK = 31;
__device__ __forceinline__ int psum_chunk_size(int num_groups) { return (num_groups - 1 + 31) / 32; }

__device__ __forceinline__ int psum_chunk_end(const Params& p, int lane) {
  const int cands = p.num_groups - 1, size = psum_chunk_size(p.num_groups);
  if (size > PSUM_MAX_CHUNK || lane * size >= cands) return 0x7fffffff;
  return ceil_align(__ldg(p.layout + min((lane + 1) * size, cands) - 1), GROUP_ALIGN);
}

template <int LAYOUT, bool STALE>
__device__ __forceinline__ Fetched<LAYOUT> fetch_tile(const Params& p, int m_slot, bool valid,
                                                      int chunk_end, int lane) {
  Fetched<LAYOUT> f;
#pragma unroll
  for (int r = 0; r < int(sizeof(f.v) / sizeof(int)); ++r) f.v[r] = -1;
  if (STALE || !valid) return f;
  if constexpr (LAYOUT == kLabels) {
    f = load_labels(p, m_slot * BM, lane);
  } else if constexpr (LAYOUT == kMasked) {
    f.v[0] = __ldg(p.layout + m_slot / p.m_tiles);
  } else {
    const int cands = p.num_groups - 1, size = psum_chunk_size(p.num_groups);
    if (!KD_PSUM_BALLOT || size > PSUM_MAX_CHUNK) return f;
    // Whole chunks at or below the tile's first row (a prefix), then the chunk after them.
    const int below = __popc(__ballot_sync(0xffffffffu, chunk_end <= m_slot * BM));
    const int base = min(below * size, cands);
    if (lane <= size) f.v[0] = __ldg(p.layout + min(base + lane, cands));
    f.v[1] = base;
  }
  return f;
}

// Called by all 32 lanes of the producer warp with what fetch_tile loaded for m_slot.
template <int LAYOUT>
__device__ __forceinline__ TileJob decide_tile(const Params& p, int m_slot,
                                               const Fetched<LAYOUT>& f, int lane) {
  TileJob job{0, 0, 0, 0, 0};
  if constexpr (LAYOUT == kLabels) {
    job.row0 = m_slot * BM;
    // Lane 0's first label, shared, decides the tile, so the warp takes one branch even if the
    // labels change while the kernel runs.
    const int extent = label_extent(f, lane);  // all lanes: it shuffles
    job.group = __shfl_sync(0xffffffffu, f.v[0], 0);
    // -1 marks a padding tile (skipped, rows untouched); out-of-range ids are skipped too so a
    // corrupt label cannot make the kernel read scales out of bounds. Rows past the last
    // labelled one are padding: neither loaded, computed nor written.
    job.active = job.group >= 0 && job.group < p.num_groups;
    job.row_end = p.m;
    job.rows = job.active ? extent : 0;
  } else if constexpr (LAYOUT == kPsum) {
    job.row0 = m_slot * BM;
    int end;
    if (f.v[1] < 0) {
      job.group = psum_group_of(p.layout, p.num_groups, job.row0);
      end = __ldg(p.layout + job.group);
    } else {
      // Lane l fetched ends[base + l]: count those (within the chunk, below the last group)
      // whose aligned end is at or below the row; the group's own end sits in the lane after.
      const int base = f.v[1];
      const bool le = lane < psum_chunk_size(p.num_groups) && base + lane < p.num_groups - 1 &&
                      ceil_align(f.v[0], GROUP_ALIGN) <= job.row0;
      const int c = __popc(__ballot_sync(0xffffffffu, le));
      job.group = base + c;
      end = __shfl_sync(0xffffffffu, f.v[0], c);
    }
    end = min(end, p.m);
    job.active = job.row0 < end;
    job.row_end = end;
    job.rows = min(BM, end - job.row0);
  } else {
    job.group = m_slot / p.m_tiles;
    job.row0 = (m_slot % p.m_tiles) * BM;
    const int valid = min(f.v[0], p.m);
    job.active = job.row0 < valid;
    job.row_end = valid;
    job.rows = min(BM, valid - job.row0);
  }
  return job;
}

// Exponent byte `k` of a UE8M0 word -> 2^(byte - 127) as fp32. The byte goes to bits 23..30 (a
// byte permute to the top byte, a shift); byte 0 is the denormal 2^-127 = 0x00400000, the only
// pattern below it, hence the max.
__device__ __forceinline__ float ue8m0_to_float(unsigned int word, int k) {
  const unsigned int top = __byte_perm(word, 0u, 0x0444u | (static_cast<unsigned int>(k) << 12));
  return __uint_as_float(max(top >> 1, 0x00400000u));
}

// Scale "words": for UE8M0 one int32 holding the exponents of four K blocks, for fp32 the scale
// itself (the math loop loads them); scale_of turns one into the fp32 scale of K block kb.
template <bool UE8M0>
__device__ __forceinline__ float scale_of(unsigned int word, int kb) {
  if constexpr (UE8M0)
    return ue8m0_to_float(word, kb & 3);
  else
    return __uint_as_float(word);
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile written by TMA with 128B swizzle:
// within each 8-row x 128-byte atom the chunk index is XORed with the row index.
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>(row * BK + ((chunk ^ (row & 7)) << 4));
}

// CUTLASS's mbarrier wrappers are asm volatile without a "memory" clobber, so ordinary shared
// memory accesses (the StageJob) could be moved across them; this pins them (no instruction).
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
// Hopper has no FP8 warp MMA: ptxas would emulate each one as two zero-based FP16 MMAs plus four
// FADDs. Doing the conversion here lets the FP16 MMAs accumulate directly (e4m3 values are exact
// in FP16) and converts each fragment once per k32 step however many MMAs use it.
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t x, uint32_t& lo, uint32_t& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// part[i][j] += A_i(16x32) * B_j(32x8) for m16n8k32 e4m3 fragments af[i], bf[j]. Lane (g, t)
// holds k = 4t..4t+3 (and 16 + 4t..) in each register; the two k16 MMAs take them as their
// k = 2t, 2t+1 | 8 + 2t, 9 + 2t slots. A and B use the same relabelling of k, so the dot
// products are unchanged. All first-half MMAs go before the second halves that depend on them.
template <int ON, int NJ>
__device__ __forceinline__ void mma_block(float (&part)[MI][NI][4], const uint32_t (&af)[ON][4],
                                          const uint32_t (&bf)[NJ][2]) {
  uint32_t ah[ON][8], bh[NJ][4];
#pragma unroll
  for (int i = 0; i < ON; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) e4m3x4_to_f16(af[i][r], ah[i][2 * r], ah[i][2 * r + 1]);
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    e4m3x4_to_f16(bf[j][0], bh[j][0], bh[j][1]);
    e4m3x4_to_f16(bf[j][1], bh[j][2], bh[j][3]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h)  // k 0..15 from registers a0 / a1, then k 16..31 from a2 / a3
#pragma unroll
    for (int i = 0; i < ON; ++i)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        mma_f16(part[i][j], ah[i][4 * h], ah[i][4 * h + 2], ah[i][4 * h + 1], ah[i][4 * h + 3],
                bh[j][2 * h], bh[j][2 * h + 1]);
}
#else
// sm_120: native FP8 warp MMA.
template <int ON, int NJ>
__device__ __forceinline__ void mma_block(float (&part)[MI][NI][4], const uint32_t (&af)[ON][4],
                                          const uint32_t (&bf)[NJ][2]) {
#pragma unroll
  for (int i = 0; i < ON; ++i)
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      cute::SM89_16x8x32_F32E4M3E4M3F32_TN::fma(
          part[i][j][0], part[i][j][1], part[i][j][2], part[i][j][3], af[i][0], af[i][1],
          af[i][2], af[i][3], bf[j][0], bf[j][1], part[i][j][0], part[i][j][1], part[i][j][2],
          part[i][j][3]);
}
#endif

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(
                                    __cvta_shared_to_generic(addr)),
                                r0, r1, r2, r3);
}

// One output row of a warp tile: NI bf16 pairs 16 bytes apart, stored only if `ok`. Predicated
// stores in one basic block: a branch per row made ptxas reuse a couple of registers for all
// the packed pairs, each waiting for the store before it to read its value (w2: 10% of the
// math warps' samples in the epilogue).
template <int N>
__device__ __forceinline__ void store_row(__nv_bfloat16* ptr, const uint32_t (&v)[N], bool ok) {
  if constexpr (N == 4) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
        "@p st.global.b32 [%0], %1;\n\t@p st.global.b32 [%0+16], %2;\n\t"
        "@p st.global.b32 [%0+32], %3;\n\t@p st.global.b32 [%0+48], %4;\n\t}"
        ::"l"(ptr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]), "r"(static_cast<int>(ok))
        : "memory");
  } else {
    if (ok)
#pragma unroll
      for (int j = 0; j < N; ++j) reinterpret_cast<uint32_t*>(ptr + j * 8)[0] = v[j];
  }
}

// Stale-schedule workspace (fault injection): [0] = active tiles when planned, [1, 1+cap) = tile
// index per slot, [1+cap, 1+2cap) = expert per slot, cap = number of M-tiles.
template <int LAYOUT, bool STALE>
__device__ __forceinline__ TileJob job_for_lane(const Params& p, int m_slot, int active_now,
                                                const Fetched<LAYOUT>& f, int lane) {
  if constexpr (STALE) {
    // Fault injection. The number of slots to run is recounted from the CURRENT labels
    // (active_now), but which tile each slot runs comes from the schedule planned at the first
    // call. Slots beyond the planned count hold "past the end" sentinel tiles assumed unreachable.
    TileJob j{0, 0, 0, 0, 0};
    if (m_slot < active_now) {
      j.active = 1;
      j.row0 = __ldg(p.sched + 1 + m_slot) * BM;
      // The injected bug is the stale tile list, not stray scale reads: keep the expert valid.
      j.group = min(max(__ldg(p.sched + 1 + p.m_tiles + m_slot), 0), p.num_groups - 1);
      // Tiles inside D get their extent from the current labels, as in the clean kernel; the
      // plan's tiles past the end were trusted to be unreachable, so they are computed whole
      // and nothing clamps their rows.
      j.rows = j.row0 < p.m ? label_extent(load_labels(p, j.row0, lane), lane) : BM;
      j.row_end = 0x7fffffff;
    }
    return j;
  } else {
    return decide_tile<LAYOUT>(p, m_slot, f, lane);
  }
}

// The producer warp's decision, identical in every lane (lane 0's), so the warp never diverges on
// it even if routing metadata is rewritten while the kernel runs.
template <int LAYOUT, bool STALE>
__device__ __forceinline__ TileJob job_for(const Params& p, int m_slot, int active_now,
                                          const Fetched<LAYOUT>& f, int lane) {
  TileJob j = job_for_lane<LAYOUT, STALE>(p, m_slot, active_now, f, lane);
  j.active = __shfl_sync(0xffffffffu, j.active, 0);
  j.group = __shfl_sync(0xffffffffu, j.group, 0);
  j.row0 = __shfl_sync(0xffffffffu, j.row0, 0);
  j.rows = __shfl_sync(0xffffffffu, j.rows, 0);
  j.row_end = __shfl_sync(0xffffffffu, j.row_end, 0);
  return j;
}

// Persistent CTAs: CTA b handles tiles b, b + gridDim.x, ... (tile t = M-slot t / n_tiles, N-tile
// t % n_tiles), skipping inactive ones. A producer warp decides the tiles and streams the K blocks
// of all of them through the stage ring, so the next tile's loads overlap this tile's epilogue;
// the math warps learn which tile a stage belongs to from its StageJob.
template <int LAYOUT, bool UE8M0, bool STALE>
__device__ __forceinline__ void gemm_body(const TensorMap* tmap_a, const TensorMap* tmap_b,
                                          const Params& p) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int active_count_s;
  __shared__ alignas(8) uint64_t full_bar[SLOTS];
  __shared__ alignas(8) uint64_t empty_bar[SLOTS];
  __shared__ StageJob stage_job[SLOTS];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int slots = LAYOUT == kMasked ? p.num_groups * p.m_tiles : p.m_tiles;
  const int total_tiles = slots * p.n_tiles;

  if (threadIdx.x == 0) {
    active_count_s = 0;
    for (int s = 0; s < SLOTS; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full_bar[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty_bar[s], MATH_WARPS);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  int active_now = 0;
  if constexpr (STALE) {
    int mine = 0;
    for (int t = threadIdx.x; t < p.m_tiles; t += THREADS) mine += __ldg(p.layout + t * BM) >= 0;
    if (mine) atomicAdd(&active_count_s, mine);
    __syncthreads();
    active_now = active_count_s;
  }

  // TMA with 128B swizzle needs 1024-byte aligned destinations. (Computed where used: a value
  // live across setmaxnreg is spilled.)
  auto aligned_smem = [&]() -> uint32_t {
    return (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  };

  // Producer state; all lanes of the producer warp keep the same copy: the tile being streamed
  // (ptile, pjob), its next K block, the index of the next load, the oldest load not yet seen
  // released (ptail), where the next stage goes in the ring (phead) and whether the end marker
  // went out.
  constexpr uint64_t kEvictNormal = 0x1000000000000000ull;
  int ptile = blockIdx.x, pkb = 0, pload = 0, ptail = 0, phead = 0;
  bool pdone = false;
  TileJob pjob{0, 0, 0, 0, 0};
  // pnext holds the routing words of tile ptile whenever advance() starts; each decision
  // fetches those of the tile after it (used at the next call, a tile's stages later).
  Fetched<LAYOUT> pnext;
  int pchunk = 0;  // psum layout: the last aligned group end of this lane's chunk
  auto advance = [&]() {  // move ptile to the next active tile (or past the end)
    for (; ptile < total_tiles; ptile += gridDim.x) {
      pjob = job_for<LAYOUT, STALE>(p, ptile / p.n_tiles, active_now, pnext, lane);
      const int after = ptile + gridDim.x;
      pnext = fetch_tile<LAYOUT, STALE>(p, after / p.n_tiles, after < total_tiles, pchunk, lane);
      if (pjob.active) return;
    }
  };
  // Stages are laid out one after the other in the ring (wrapping to 0 when the next one does
  // not fit) and released in order, so the loads in flight occupy one circular run starting at
  // the oldest. Before load pload takes [off, off + bytes) - plus the skipped end of the ring
  // when it wraps - wait for the oldest loads until none of them overlaps and a slot is free.
  auto reserve = [&](int bytes) -> int {
    const bool wrap = phead + bytes > RING_BYTES;
    const int off = wrap ? 0 : phead;
    while (ptail < pload) {
      const StageJob& old = stage_job[ptail % SLOTS];
      const int o_lo = old.off, o_hi = old.off + old.bytes;
      const bool overlap =
          wrap ? (o_hi > phead || o_lo < bytes) : (o_lo < off + bytes && off < o_hi);
      if (!overlap && pload - ptail < SLOTS) break;
      cutlass::arch::ClusterBarrier::wait(&empty_bar[ptail % SLOTS], (ptail / SLOTS) & 1);
      compiler_fence();  // the StageJob store of the new load stays after the wait
      ++ptail;
    }
    phead = off + bytes;
    return off;
  };
  auto produce = [&]() {  // issue load pload into a free part of the ring, or the end marker
    const int s = pload % SLOTS;
    if (ptile >= total_tiles) {
      reserve(0);
      if (lane == 0) {
        stage_job[s].n0 = -1;
        compiler_fence();
        cutlass::arch::ClusterBarrier::arrive(&full_bar[s]);
      }
      pdone = true;
    } else {
      // Only the boxes holding the tile's rows are loaded (and take room in the ring); the whole
      // of each box is always transferred (out-of-bounds parts are zero-filled), so the byte
      // count is exact.
      const int a_boxes = (pjob.rows + A_BOX - 1) / A_BOX;
      const int bytes = B_TILE_BYTES + a_boxes * A_BOX * BK;
      const int off = reserve(bytes);
      const int n0 = (ptile % p.n_tiles) * BN;
      if (lane == 0) {
        stage_job[s] =
            StageJob{n0, pjob.group, pjob.row0, pjob.rows, pjob.row_end, pkb, off, bytes};
        compiler_fence();  // the StageJob store stays before the arrive that publishes it
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
            &full_bar[s], static_cast<uint32_t>(bytes));
      }
      // One TMA per lane: A box `lane`, B from the last lane. (A copy may land before lane 0's
      // expect_tx: the barrier's transaction count goes negative meanwhile, and its phase
      // cannot complete before that arrive.)
      const uint32_t base = aligned_smem();
      uint8_t* sb =
          smem_raw + (base - static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw))) + off;
      static_assert(BM / A_BOX < 32, "one lane per A box, the last lane for B");
      if (lane < a_boxes)
        cute::SM90_TMA_LOAD_3D::copy(tmap_a, &full_bar[s], kEvictNormal,
                                     sb + B_TILE_BYTES + lane * A_BOX * BK, pkb * BK,
                                     pjob.row0 + lane * A_BOX,
                                     LAYOUT == kMasked ? pjob.group : 0);
      else if (lane == 31)
        cute::SM90_TMA_LOAD_3D::copy(tmap_b, &full_bar[s], kEvictNormal, sb, pkb * BK, n0,
                                     pjob.group);
      if (++pkb == p.k_blocks) {
        pkb = 0;
        ptile += gridDim.x;
        advance();
      }
    }
    ++pload;
    __syncwarp();
  };

  // Warpgroup 0 produces (one warp works, the other three leave) and gives its registers to the
  // math warpgroups, which need them for the accumulators.
  if (warp < PRODUCER_WARPS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS));
    if (warp != 0) return;
    if (lane == 0) {
      cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(tmap_a));
      cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(tmap_b));
    }
    pchunk = LAYOUT == kPsum ? psum_chunk_end(p, lane) : 0;
    pnext = fetch_tile<LAYOUT, STALE>(p, ptile / p.n_tiles, ptile < total_tiles, pchunk, lane);
    advance();
    while (!pdone) produce();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(MATH_REGS));

  // -------------------------------------------------------------------- math warps
  const uint32_t smem_base = aligned_smem();
  const int mwarp = warp - PRODUCER_WARPS;
  const int wrow = mwarp / WARPS_N;  // warp row: rows [wrow * WM, (wrow + 1) * WM) of a tile
  const int wcol = mwarp % WARPS_N;
  const int wn0 = wcol * WN;
  const int g = lane / 4;  // MMA "groupID"
  const int t = lane % 4;  // MMA "threadID_in_group"
  // ldmatrix source rows/chunks for this lane (see the fragment layouts of m16n8k32).
  // Their swizzled byte offsets per k32 step, computed once: adding 16-row (A) or 8-row (B)
  // multiples keeps a row's swizzle, so a block's address is a base plus constants.
  uint32_t a_ld_off[BK / 32], b_ld_off[BK / 32];
  {
    const int a_ld_row0 = (lane % 8) + ((lane / 8) % 2) * 8;  // + first row + i*16
    const int a_ld_chunk = lane / 16;                          // + 2*kk
    const int b_ld_row = wn0 + (lane % 8) + (lane / 16) * 8;   // + j*8 (pairs of n8 tiles)
    const int b_ld_chunk = (lane / 8) % 2;                     // + 2*kk
#pragma unroll
    for (int kk = 0; kk < BK / 32; ++kk) {
      a_ld_off[kk] = swz(a_ld_row0, 2 * kk + a_ld_chunk);
      b_ld_off[kk] = swz(b_ld_row, 2 * kk + b_ld_chunk);
    }
  }

  // The tile's sums. A warp's first promotion of a tile overwrites them instead of adding
  // (no zeroing pass: zeroing right after the epilogue waited for the stores to read the
  // registers, 1.5% of the math warps' samples on w2).
  float acc[MI][NI][4] = {};  // zeroed once, only so no path reads indeterminate values
  unsigned int wa[MI][2];  // scale words of this thread's rows / columns (see scale_of)
  unsigned int wb[NI][2];
  for (int load = 0;; ++load) {
    const int s = load % SLOTS;
    cutlass::arch::ClusterBarrier::wait(&full_bar[s], (load / SLOTS) & 1);
    compiler_fence();  // the StageJob load stays after the wait
    const StageJob sj = stage_job[s];
    if (sj.n0 < 0) break;
    const int kb = sj.kb;
    const int a_group = LAYOUT == kMasked ? sj.group : 0;
    // Thin (decode) tiles leave the second warp row idle: splitting their K blocks over both rows
    // and adding the sums at the end of the tile measured 3-7% slower on the H200 at every batch
    // size, decode included (lab/results/RESULTS_sm120_tuning.md, 2026-11-30).
    const int wm0 = wrow * WM;
    const bool last = kb + 1 == p.k_blocks;
    // m16 row blocks of this warp that hold rows of the tile (warp-uniform).
    const int mi_on = max(0, min(MI, (sj.rows - wm0 + 15) / 16));
    if (mi_on == 0) {
      // Nothing of this tile in this warp's rows: release the stage at once.
      __syncwarp();
      compiler_fence();
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&empty_bar[s]);
      continue;
    }
    // Scale words: fp32 ones every block, UE8M0 ones every fourth block (a word holds four).
    // Rows/columns are clamped so the loads stay inside the tensors; the clamped values only
    // scale results that are never stored. Their latency hides behind this block's MMAs.
    // (On the H200, prefetching them one block ahead measured 10-30% slower, and TMA-loading
    // them with each stage no faster, for (BM + BN) * 4 bytes of shared memory per stage.)
    auto load_words = [&](int kbw) {
      // One address per thread and operand, rows / columns at fixed strides from it, clamped to
      // the last row / column (words past M or N only scale results that are never stored).
      // Unconditional loads: predicated ones let the compiler hoist the fp32 scale products
      // above the MMAs, which then wait for the loads (H200: 35% slower with fp32 scales).
      const int kw = UE8M0 ? kbw >> 2 : kbw;
      const int ra = sj.row0 + wm0 + g;
      const unsigned int* pa = static_cast<const unsigned int*>(p.sfa) +
                               a_group * p.sfa_stride_g + ra * p.sfa_stride_m +
                               kw * p.sfa_stride_k;
      // Offsets from that base in 32 bits (the host checks that 128 rows of stride fit): a
      // 64-bit product per word cost some 130 instructions per tile and warp.
      const int last_a = p.m - 1 - ra;
      const int sa_m = static_cast<int>(p.sfa_stride_m);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (i < mi_on) wa[i][h] = __ldg(pa + min(i * 16 + h * 8, last_a) * sa_m);
      if constexpr (UE8M0) {
        const int cb = sj.n0 + wn0 + 2 * t;
        const unsigned int* pb = static_cast<const unsigned int*>(p.sfb) +
                                 sj.group * p.sfb_stride_g + cb * p.sfb_stride_n +
                                 kw * p.sfb_stride_k;
        const int last_b = p.n - 1 - cb;
        const int sb_n = static_cast<int>(p.sfb_stride_n);
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) wb[j][h] = __ldg(pb + min(j * 8 + h, last_b) * sb_n);
      } else {
        // 128x128 B blocks: one scale per 128 columns, uniform across a warp's columns (WN
        // divides 128 and warp tiles are WN-aligned).
        wb[0][0] = __ldg(static_cast<const unsigned int*>(p.sfb) + sj.group * p.sfb_stride_g +
                         (min(sj.n0 + wn0, p.n - 1) / 128) * p.sfb_stride_n +
                         kbw * p.sfb_stride_k);
      }
    };
    // A UE8M0 word serves four K blocks.
    if (!UE8M0 || (kb & 3) == 0) load_words(kb);
    auto release = [&]() {
      __syncwarp();
      compiler_fence();  // every read of the stage stays before its release
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&empty_bar[s]);
    };
    const uint32_t sb_base = smem_base + sj.off;
    const uint32_t sa_base = sb_base + B_TILE_BYTES;
    float part[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) part[i][j][c] = 0.f;

    // On sm_90 each FP8 MMA is unpacks plus two FP16 MMAs (mma_block); unrolling the k32 steps
    // can let the scheduler hoist unpacks until the accumulators spill (KD_KK_UNROLL);
    // thin tiles (up to KD_UNROLL_BLOCKS m16 blocks) have the registers to unroll fully.
    // Each count of m16 blocks gets its own branch-free copy (ON blocks): a branch per m16 block
    // makes sm_90 unpack the B fragments once per block and serializes the MMA chains.
    auto mma_steps = [&](auto on) {
      constexpr int ON = decltype(on)::value;
      constexpr int UNROLL = ON <= KD_UNROLL_BLOCKS ? 4 : KD_KK_UNROLL;
#pragma unroll UNROLL
      for (int kk = 0; kk < BK / 32; ++kk) {
        uint32_t af[ON][4];
        uint32_t bf[NI][2];
#pragma unroll
        for (int j = 0; j < NI; j += 2)
          ldsm_x4(sb_base + b_ld_off[kk] + j * 8 * BK, bf[j][0], bf[j][1],
                  bf[j + 1][0], bf[j + 1][1]);
#pragma unroll
        for (int i = 0; i < ON; ++i)
          ldsm_x4(sa_base + a_ld_off[kk] + (wm0 + i * 16) * BK, af[i][0], af[i][1], af[i][2],
                  af[i][3]);
        mma_block<ON>(part, af, bf);
      }
    };
    // Promote the 128-K partial sums of ON m16 blocks with their block scales in fp32; this
    // warp's first K block of a tile sets the sums instead.
    const bool first = kb == 0;
    auto promote = [&](auto on) {
      constexpr int ON = decltype(on)::value;
      float sb[NI][2];
      // fp32: the scale products need only the freshly loaded words, and ptxas hoists them
      // above the MMAs, where they wait for the loads (H200: up to 35% slower). One product
      // input made to depend on the MMAs' result (exactly: a finite value times 0) keeps them
      // after. (The same on the UE8M0 scales measured 1-7% slower.)
      const float sb_fp32 =
          UE8M0 ? 0.f
                : fmaf(fminf(fabsf(part[0][0][0]), 1.f), 0.f, scale_of<false>(wb[0][0], kb));
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          sb[j][h] = UE8M0 ? scale_of<true>(wb[j][h], kb) : sb_fp32;
      float s[ON][NI][4];
#pragma unroll
      for (int i = 0; i < ON; ++i) {
        const float sa0 = scale_of<UE8M0>(wa[i][0], kb);
        const float sa1 = scale_of<UE8M0>(wa[i][1], kb);
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) s[i][j][c] = (c < 2 ? sa0 : sa1) * sb[j][c % 2];
      }
      if (first) {
#pragma unroll
        for (int i = 0; i < ON; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = part[i][j][c] * s[i][j][c];
      } else {
#pragma unroll
        for (int i = 0; i < ON; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c)
              acc[i][j][c] = fmaf(part[i][j][c], s[i][j][c], acc[i][j][c]);
      }
    };
    // mi_on is warp-uniform and 1..MI here. The stage goes back to the producer between the
    // MMAs and the promotion.
    auto run_if = [&](auto on) {
      if constexpr (decltype(on)::value <= MI) {
        if (mi_on == decltype(on)::value) {
          mma_steps(on);
          release();
          promote(on);
          return true;
        }
      }
      return false;
    };
    using cuda::std::integral_constant;
    run_if(integral_constant<int, MI>{}) || run_if(integral_constant<int, 1>{}) ||
        run_if(integral_constant<int, 2>{}) || run_if(integral_constant<int, 3>{}) ||
        run_if(integral_constant<int, 4>{}) || run_if(integral_constant<int, 5>{}) ||
        run_if(integral_constant<int, 6>{}) || run_if(integral_constant<int, 7>{}) ||
        run_if(integral_constant<int, 8>{});

    if (!last) continue;
    // Epilogue: bf16 pairs straight from registers. Rows past the tile's extent or row_end and
    // columns past N are left untouched. One 64-bit address per thread; rows step by 8 * stride
    // and the n8 blocks are immediate offsets.
    int row_lim = min(sj.row0 + sj.rows, sj.row_end);
    if constexpr (!STALE) row_lim = min(row_lim, p.m);
    const int row_base = sj.row0 + wm0 + g;
    const int col_base = sj.n0 + wn0 + 2 * t;
    const long long row_step = 8 * p.d_stride_m;
    __nv_bfloat16* dst = p.d + (LAYOUT == kMasked ? sj.group * p.d_stride_g : 0ll) +
                         row_base * p.d_stride_m + col_base;
    if (sj.n0 + BN <= p.n) {
      // Whole N tiles (all but a partial last one): every pair packed first, then predicated
      // row stores without column checks.
      uint32_t pk[MI][2][NI];
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < NI; ++j)
            pk[i][h][j] = pack_bf16(acc[i][j][h * 2], acc[i][j][h * 2 + 1]);
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          store_row<NI>(dst + (2 * i + h) * row_step, pk[i][h],
                        row_base + i * 16 + h * 8 < row_lim);
    } else {
#pragma unroll
      for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (row_base + i * 16 + h * 8 < row_lim) {
#pragma unroll
            for (int j = 0; j < NI; ++j) {
              if (col_base + j * 8 < p.n)
                *reinterpret_cast<uint32_t*>(dst + j * 8) =
                    pack_bf16(acc[i][j][h * 2], acc[i][j][h * 2 + 1]);
            }
          }
          dst += row_step;
        }
      }
    }
  }
}

}  // namespace kd

#define KD_DEFINE_KERNEL(NAME, LAYOUT, UE8M0, STALE)                                            \
  extern "C" __global__ void __launch_bounds__(kd::THREADS, 1)                                  \
      NAME(const __grid_constant__ kd::TensorMap tmap_a,                                        \
           const __grid_constant__ kd::TensorMap tmap_b,                                        \
           const __grid_constant__ kd::Params params) {                                         \
    kd::gemm_body<LAYOUT, UE8M0, STALE>(&tmap_a, &tmap_b, params);                              \
  }

KD_DEFINE_KERNEL(kd_gemm_labels_fp32, kd::kLabels, false, false)
KD_DEFINE_KERNEL(kd_gemm_labels_ue8m0, kd::kLabels, true, false)
KD_DEFINE_KERNEL(kd_gemm_psum_fp32, kd::kPsum, false, false)
KD_DEFINE_KERNEL(kd_gemm_psum_ue8m0, kd::kPsum, true, false)
KD_DEFINE_KERNEL(kd_gemm_masked_fp32, kd::kMasked, false, false)
KD_DEFINE_KERNEL(kd_gemm_masked_ue8m0, kd::kMasked, true, false)
KD_DEFINE_KERNEL(kd_gemm_labels_fp32_stale, kd::kLabels, false, true)
KD_DEFINE_KERNEL(kd_gemm_labels_ue8m0_stale, kd::kLabels, true, true)

// Fault injection: plans the stale schedule from the labels of the current call. Launched once
// per (d, grouped_layout) buffer pair and never again - that is the injected bug. One warp.
extern "C" __global__ void kd_plan_stale_schedule(const int* labels, int m_tiles, int* ws) {
  const int lane = threadIdx.x;
  const int cap = m_tiles;
  int count = 0;
  int last_group = 0;
  for (int base = 0; base < m_tiles; base += 32) {
    const int tile = base + lane;
    const int grp = tile < m_tiles ? labels[tile * kd::BM] : -1;
    const bool on = grp >= 0;
    const unsigned mask = __ballot_sync(0xffffffffu, on);
    if (on) {
      const int slot = count + __popc(mask & ((1u << lane) - 1u));
      ws[1 + slot] = tile;
      ws[1 + cap + slot] = grp;
    }
    if (mask) last_group = __shfl_sync(0xffffffffu, grp, 31 - __clz(mask));
    count += __popc(mask);
  }
  // Unused slots point one tile, two tiles, ... past the end of D ("never reached").
  for (int slot = count + lane; slot < cap; slot += 32) {
    ws[1 + slot] = m_tiles + (slot - count);
    ws[1 + cap + slot] = last_group;
  }
  if (lane == 0) ws[0] = count;
}
