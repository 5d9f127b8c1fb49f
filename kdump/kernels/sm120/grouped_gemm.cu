// kdump packaged m-grouped FP8 GEMM, SM120 style: TMA + mbarrier pipeline + warp-level mma.sync.
//
// D[m, n] = sum_k A[m, k] * B[g(m), n, k] * scale_a[m, k/128] * scale_b[g(m), n, k/128]  (bf16 out)
//
// No wgmma and no tensor memory, so the same source runs on sm_120a (native FP8 warp MMA) and on
// sm_90a (where the FP8 mma.sync is emulated through FP16 tensor-core ops, but results are the same).
//
// Every routing decision (which expert an M-tile belongs to, whether it is active, how many rows it
// may write) is read from device memory inside the kernel on every launch. The grid is sized from
// the shapes and the SM count alone (persistent CTAs stride over all M x N tiles and skip the
// inactive ones), so a captured CUDA graph stays correct when the routing changes in place.
//
// Compile-time parameters (set with -D by kdump.kernels.sm120.build):
//   KD_BM, KD_BN   tile rows (M) and columns (N); KD_BK is fixed at 128 (one scale block)
//   KD_STAGES      depth of the shared-memory pipeline
//   KD_WARPS_M, KD_WARPS_N   math-warp grid; thread 0 also issues the TMA loads
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
#ifndef KD_KK_UNROLL
#define KD_KK_UNROLL 4
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
constexpr int WARPS_M = KD_WARPS_M;
constexpr int WARPS_N = KD_WARPS_N;
constexpr int MATH_WARPS = WARPS_M * WARPS_N;
constexpr int THREADS = MATH_WARPS * 32;
constexpr int WM = BM / WARPS_M;  // rows per math warp
constexpr int WN = BN / WARPS_N;  // columns per math warp
constexpr int MI = WM / 16;       // m16 MMA tiles per warp
constexpr int NI = WN / 8;        // n8 MMA tiles per warp
constexpr int GROUP_ALIGN = 128;  // DeepGEMM's mk alignment for contiguous layouts
constexpr int A_TILE_BYTES = BM * BK;
constexpr int B_TILE_BYTES = BN * BK;
constexpr int STAGE_BYTES = A_TILE_BYTES + B_TILE_BYTES;
static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tile must hold whole m16 / pairs of n8 tiles");
static_assert(BM <= 256 && BN <= 256, "a TMA box dimension is at most 256");

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

// What one CTA works on, decided from device-resident routing metadata.
struct TileJob {
  int active;
  int group;     // expert index: B / scale_b group, and A / D group for the masked layout
  int row0;      // first row of the tile (global for contiguous, within the group for masked)
  int row_end;   // rows >= row_end are not written
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

template <int LAYOUT>
__device__ __forceinline__ TileJob decide_tile(const Params& p, int m_slot) {
  TileJob job{0, 0, 0, 0};
  if constexpr (LAYOUT == kLabels) {
    job.row0 = m_slot * BM;
    job.group = __ldg(p.layout + job.row0);
    // -1 marks a padding tile (skipped, rows untouched); out-of-range ids are skipped too so a
    // corrupt label cannot make the kernel read scales out of bounds.
    job.active = job.group >= 0 && job.group < p.num_groups;
    job.row_end = p.m;
  } else if constexpr (LAYOUT == kPsum) {
    job.row0 = m_slot * BM;
    job.group = psum_group_of(p.layout, p.num_groups, job.row0);
    const int end = min(__ldg(p.layout + job.group), p.m);
    job.active = job.row0 < end;
    job.row_end = end;
  } else {
    job.group = m_slot / p.m_tiles;
    job.row0 = (m_slot % p.m_tiles) * BM;
    const int valid = min(__ldg(p.layout + job.group), p.m);
    job.active = job.row0 < valid;
    job.row_end = valid;
  }
  return job;
}

// UE8M0 exponent byte -> 2^(byte - 127) as fp32 (byte 0 is the denormal 2^-127).
__device__ __forceinline__ float ue8m0_to_float(unsigned int byte) {
  return byte == 0 ? __int_as_float(0x00400000) : __int_as_float(static_cast<int>(byte << 23));
}

template <bool UE8M0>
__device__ __forceinline__ float load_scale_a(const Params& p, int group, int row, int kb) {
  const long long base = group * p.sfa_stride_g + row * p.sfa_stride_m;
  if constexpr (UE8M0) {
    const unsigned int w = __ldg(static_cast<const unsigned int*>(p.sfa) + base +
                                 (kb >> 2) * p.sfa_stride_k);
    return ue8m0_to_float((w >> ((kb & 3) * 8)) & 0xffu);
  } else {
    return __ldg(static_cast<const float*>(p.sfa) + base + kb * p.sfa_stride_k);
  }
}

template <bool UE8M0>
__device__ __forceinline__ float load_scale_b(const Params& p, int group, int col, int kb) {
  if constexpr (UE8M0) {
    const unsigned int w = __ldg(static_cast<const unsigned int*>(p.sfb) + group * p.sfb_stride_g +
                                 col * p.sfb_stride_n + (kb >> 2) * p.sfb_stride_k);
    return ue8m0_to_float((w >> ((kb & 3) * 8)) & 0xffu);
  } else {
    return __ldg(static_cast<const float*>(p.sfb) + group * p.sfb_stride_g +
                 (col / 128) * p.sfb_stride_n + kb * p.sfb_stride_k);
  }
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile written by TMA with 128B swizzle:
// within each 8-row x 128-byte atom the chunk index is XORed with the row index.
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>(row * BK + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(
                                    __cvta_shared_to_generic(addr)),
                                r0, r1, r2, r3);
}

// Stale-schedule workspace (fault injection): [0] = active tiles when planned, [1, 1+cap) = tile
// index per slot, [1+cap, 1+2cap) = expert per slot, cap = number of M-tiles.
template <int LAYOUT, bool STALE>
__device__ __forceinline__ TileJob job_for(const Params& p, int m_slot, int active_now) {
  if constexpr (STALE) {
    // Fault injection. The number of slots to run is recounted from the CURRENT labels
    // (active_now), but which tile each slot runs comes from the schedule planned at the first
    // call. Slots beyond the planned count hold "past the end" sentinel tiles assumed unreachable.
    TileJob j{0, 0, 0, 0};
    if (m_slot < active_now) {
      j.active = 1;
      j.row0 = __ldg(p.sched + 1 + m_slot) * BM;
      j.group = __ldg(p.sched + 1 + p.m_tiles + m_slot);
      j.row_end = 0x7fffffff;  // the planned tiles were trusted to lie inside D: no row clamp
    }
    return j;
  } else {
    return decide_tile<LAYOUT>(p, m_slot);
  }
}

// Persistent CTAs: CTA b handles tiles b, b + gridDim.x, ... (tile t = M-slot t / n_tiles, N-tile
// t % n_tiles), skipping inactive ones. The K blocks of all its active tiles form one flat stream
// of loads through the stage ring, so the next tile's loads overlap this tile's epilogue.
template <int LAYOUT, bool UE8M0, bool STALE>
__device__ __forceinline__ void gemm_body(const TensorMap* tmap_a, const TensorMap* tmap_b,
                                          const Params& p) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int active_count_s;
  __shared__ alignas(8) uint64_t full_bar[STAGES];
  __shared__ alignas(8) uint64_t empty_bar[STAGES];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int slots = LAYOUT == kMasked ? p.num_groups * p.m_tiles : p.m_tiles;
  const int total_tiles = slots * p.n_tiles;

  if (threadIdx.x == 0) {
    active_count_s = 0;
    for (int s = 0; s < STAGES; ++s) {
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

  // Every thread walks the same deterministic sequence of active tiles (routing metadata does not
  // change while the kernel runs), so no per-tile broadcast or block barrier is needed.
  auto next_active = [&](int t, TileJob& job) -> int {
    for (; t < total_tiles; t += gridDim.x) {
      job = job_for<LAYOUT, STALE>(p, t / p.n_tiles, active_now);
      if (job.active) return t;
    }
    return total_tiles;
  };

  // TMA with 128B swizzle needs 1024-byte aligned destinations.
  const uint32_t raw_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t smem_base = (raw_base + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (smem_base - raw_base);

  // Producer state (used by thread 0 only, which also computes): position in the load stream.
  TileJob pjob{0, 0, 0, 0};
  int ptile = 0, pkb = 0;
  constexpr uint64_t kEvictNormal = 0x1000000000000000ull;
  auto issue_next_load = [&](int load_index) {
    const int s = load_index % STAGES;
    // The whole box is always transferred (out-of-bounds parts are zero-filled): constant bytes.
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full_bar[s], STAGE_BYTES);
    uint8_t* sa = smem + s * STAGE_BYTES;
    const int a_group = LAYOUT == kMasked ? pjob.group : 0;
    cute::SM90_TMA_LOAD_3D::copy(tmap_a, &full_bar[s], kEvictNormal, sa, pkb * BK, pjob.row0,
                                 a_group);
    cute::SM90_TMA_LOAD_3D::copy(tmap_b, &full_bar[s], kEvictNormal, sa + A_TILE_BYTES, pkb * BK,
                                 (ptile % p.n_tiles) * BN, pjob.group);
    if (++pkb == p.k_blocks) {
      pkb = 0;
      ptile = next_active(ptile + gridDim.x, pjob);
    }
  };
  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(tmap_a));
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(tmap_b));
    ptile = next_active(blockIdx.x, pjob);
    for (int l = 0; l < STAGES && ptile < total_tiles; ++l) issue_next_load(l);
  }

  const int wm0 = (warp / WARPS_N) * WM;
  const int wn0 = (warp % WARPS_N) * WN;
  const int g = lane / 4;  // MMA "groupID"
  const int t = lane % 4;  // MMA "threadID_in_group"
  // ldmatrix source rows/chunks for this lane (see the fragment layouts of m16n8k32).
  const int a_ld_row = wm0 + (lane % 8) + ((lane / 8) % 2) * 8;  // + i*16
  const int a_ld_chunk = lane / 16;                              // + 2*kk
  const int b_ld_row = wn0 + (lane % 8) + (lane / 16) * 8;       // + j*8 (pairs of n8 tiles)
  const int b_ld_chunk = (lane / 8) % 2;                         // + 2*kk

  int load = 0;  // index of the next load to consume in the flat stream
  TileJob job;
  for (int tile = next_active(blockIdx.x, job); tile < total_tiles;
       tile = next_active(tile + gridDim.x, job)) {
    const int n0 = (tile % p.n_tiles) * BN;
    const int a_group = LAYOUT == kMasked ? job.group : 0;

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    // Rows/columns whose scales this thread needs; clamped so scale reads stay inside the
    // tensors (the clamped values only ever multiply zero-filled or never-stored results).
    int srow[MI][2];
    int scol[NI][2];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) srow[i][h] = min(job.row0 + wm0 + i * 16 + g + h * 8, p.m - 1);
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) scol[j][h] = min(n0 + wn0 + j * 8 + 2 * t + h, p.n - 1);

    for (int kb = 0; kb < p.k_blocks; ++kb, ++load) {
      const int s = load % STAGES;
      // Refill the stage that the previous load used once every warp released it. Lagging one
      // block behind keeps warp 0 from waiting on the slowest warp's current block.
      if (threadIdx.x == 0 && load >= 1 && ptile < total_tiles) {
        const int prev = load - 1;
        cutlass::arch::ClusterBarrier::wait(&empty_bar[prev % STAGES], (prev / STAGES) & 1);
        issue_next_load(prev + STAGES);
      }
      __syncwarp();
      // Issue this block's scale loads first; their latency hides behind the MMAs.
      float sa[MI][2];
      float sb[NI][2];
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) sa[i][h] = load_scale_a<UE8M0>(p, a_group, srow[i][h], kb);
      if constexpr (UE8M0) {
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) sb[j][h] = load_scale_b<true>(p, job.group, scol[j][h], kb);
      } else {
        // 128x128 B blocks: one scale per 128 columns; BN <= 128 and n0 % BN == 0 keep it
        // uniform across the tile.
        const float b = load_scale_b<false>(p, job.group, scol[0][0], kb);
#pragma unroll
        for (int j = 0; j < NI; ++j) sb[j][0] = sb[j][1] = b;
      }

      cutlass::arch::ClusterBarrier::wait(&full_bar[s], (load / STAGES) & 1);
      const uint32_t sa_base = smem_base + s * STAGE_BYTES;
      const uint32_t sb_base = sa_base + A_TILE_BYTES;

      float part[MI][NI][4];
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) part[i][j][c] = 0.f;

      // sm_90 emulates each FP8 MMA with FP16 ones plus unpack instructions; unrolling the k32
      // steps there lets the scheduler hoist unpacks until the accumulators spill (unroll 1).
#pragma unroll KD_KK_UNROLL
      for (int kk = 0; kk < BK / 32; ++kk) {
        uint32_t af[MI][4];
        uint32_t bf[NI][2];
#pragma unroll
        for (int i = 0; i < MI; ++i)
          ldsm_x4(sa_base + swz(a_ld_row + i * 16, 2 * kk + a_ld_chunk), af[i][0], af[i][1],
                  af[i][2], af[i][3]);
#pragma unroll
        for (int j = 0; j < NI; j += 2)
          ldsm_x4(sb_base + swz(b_ld_row + j * 8, 2 * kk + b_ld_chunk), bf[j][0], bf[j][1],
                  bf[j + 1][0], bf[j + 1][1]);
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
          for (int j = 0; j < NI; ++j)
            cute::SM89_16x8x32_F32E4M3E4M3F32_TN::fma(
                part[i][j][0], part[i][j][1], part[i][j][2], part[i][j][3], af[i][0], af[i][1],
                af[i][2], af[i][3], bf[j][0], bf[j][1], part[i][j][0], part[i][j][1],
                part[i][j][2], part[i][j][3]);
      }
      // This warp is done reading the stage: hand it back to the producer.
      __syncwarp();
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&empty_bar[s]);

      // Promote the 128-K partial sums with their block scales in fp32.
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            acc[i][j][c] = fmaf(part[i][j][c], sa[i][c / 2] * sb[j][c % 2], acc[i][j][c]);
    }

    // Epilogue: bf16 pairs straight from registers; rows past row_end and columns past N are
    // left untouched.
    __nv_bfloat16* d = p.d + (LAYOUT == kMasked ? job.group * p.d_stride_g : 0ll);
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = job.row0 + wm0 + i * 16 + g + h * 8;
        if (row >= job.row_end || (!STALE && row >= p.m)) continue;
        __nv_bfloat16* drow = d + row * p.d_stride_m;
#pragma unroll
        for (int j = 0; j < NI; ++j) {
          const int col = n0 + wn0 + j * 8 + 2 * t;
          if (col >= p.n) continue;
          *reinterpret_cast<__nv_bfloat162*>(drow + col) =
              __floats2bfloat162_rn(acc[i][j][h * 2], acc[i][j][h * 2 + 1]);
        }
      }
    }
  }
}

}  // namespace kd

#define KD_DEFINE_KERNEL(NAME, LAYOUT, UE8M0, STALE)                                            \
  extern "C" __global__ void __launch_bounds__(kd::THREADS, 1)                                  \
      NAME(const __grid_constant__ kd::TensorMap tmap_a,                                        \
           const __grid_constant__ kd::TensorMap tmap_b, const __grid_constant__ kd::Params params) {             \
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
