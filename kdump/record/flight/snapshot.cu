// The flight recorder's fused snapshot kernel: one launch per recorded call (under CUDA graphs the
// only node the recorder adds: it also writes the done marker of the site before it).
//
// Plain byte-range copies (metadata, routing, scalars) go into the journal slot's device twin;
// row gathers copy only the rows a call can touch (a row rule over labels / masked_m / psum ends)
// into a slot of the device ring, compacted: one record per touched row holds the row index and
// that row's bytes of every gathered tensor (A and its scales share one compaction). The slot
// position is chosen on the device from the ring's head, so a captured graph picks a fresh slot
// at every replay; the last block to finish writes the slot header and the twin's call record,
// then advances the head and the replay token. No includes: NVRTC compiles it without headers.
//
// Every constant the host also uses comes from kdump/record/flight/gather.py as a -D flag
// (gather.DEFINES, where each value's reasons are written); none has a default here, so a build
// that misses one does not compile. The structs below are what gather.py's ctypes mirrors
// describe: it passes their sizes too, checked by static_assert.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

// The constants from the host (gather.DEFINES); naming each here makes a missing one an error.
static_assert(KD_MAX_COPIES > 0 && KD_MAX_GATHERS > 0 && KD_MAX_MARKS > 0, "table sizes");
static_assert(KD_THREADS > 0 && KD_UNROLL > 0 && KD_CHUNK > 0 && KD_ROWS_PER_BLOCK > 0 &&
                  KD_UNITS > 0,
              "launch shape");
static_assert(KD_MIN_BLOCKS > 0 && KD_MIN_BLOCKS_SMALL_SMEM > 0, "blocks per SM");
static_assert(KD_STAGE_WORDS > 0 && KD_STAGE_UNROLL > 0 && KD_BUF_WORDS > 0, "staged gather");
static_assert(KD_BULK_WARPS > 0 && KD_BULK_STAGES > 0 && KD_BULK_STAGE > 0 &&
                  KD_OVERLAP_STAGES > 0,
              "bulk gather");
static_assert(KD_RULE_LABELS != KD_RULE_MASKED && KD_RULE_MASKED != KD_RULE_PSUM &&
                  KD_RULE_LABELS != KD_RULE_PSUM,
              "row rules (any other kind: every row)");
static_assert(KD_SLOT_MAGIC != KD_RECORD_MAGIC, "magics");
static_assert(KD_SLOT_HEAD_BYTES > 0 && KD_RECORD_BYTES > 0 && KD_PARAMS_BYTES > 0 &&
                  KD_MARKS_BYTES > 0,
              "struct sizes");

// Blocks an SM should hold at once (the register cap __launch_bounds__ sets): SMs with about
// 100 KiB of shared memory (sm_86/89, sm_120) fit fewer blocks of the buffer, so there the
// larger cap would only spill.
#if defined(__CUDA_ARCH__) && \
    ((__CUDA_ARCH__ >= 860 && __CUDA_ARCH__ < 900) || __CUDA_ARCH__ >= 1200)
#define KD_LAUNCH_MIN_BLOCKS KD_MIN_BLOCKS_SMALL_SMEM
#else
#define KD_LAUNCH_MIN_BLOCKS KD_MIN_BLOCKS
#endif
// Contiguous row gathers on sm_90+ go through shared memory with bulk asynchronous copies
// (cp.async.bulk, the TMA's 1-D form): KD_BULK_WARPS issuing threads (lane 0 of the first warps),
// each with KD_BULK_STAGES buffers of KD_BULK_STAGE bytes, so a block keeps WARPS x STAGES row
// pieces in flight with a few registers; before sm_90, plain loads and stores. The buffer is the
// launch's dynamic shared memory, KD_BUF_WORDS words (the host sizes the launch from it), so it
// may exceed the 48 KiB that static shared memory allows.
// Windows read whole before their rows are known (see dense_ok): a window's column takes
// KD_DENSE_LD words of the buffer (16-byte aligned for the bulk copies), so at most
// KD_DENSE_COLS columns (fp32 scales of K up to 7,936).
#define KD_DENSE_LD (KD_ROWS_PER_BLOCK + 4)
#define KD_DENSE_COLS (KD_BUF_WORDS / KD_DENSE_LD)
// A call's contiguous rows and its strided 4-byte rows (A and its MN-major scales) gathered side
// by side (see gather_pair): the rows then keep KD_OVERLAP_STAGES pieces in flight per issuer,
// and the strided rows stage through the rest of the buffer.
#define KD_OVERLAP_BULK_WORDS (KD_BULK_WARPS * KD_OVERLAP_STAGES * KD_BULK_STAGE / 4)

struct Copy {
  u64 src;
  u64 dst;
  u64 nbytes;
};

struct Gather {
  u64 src;           // address of the tensor's element [0, 0, ...]
  i64 outer_stride;  // bytes between outer rows (masked layout: between groups)
  i64 inner_stride;  // bytes between rows
  i64 col_stride;    // bytes between the elements of a row
  u32 cols;          // elements per row
  u32 elem;          // bytes per element
  u32 rec_off;       // where this tensor's row bytes start inside a record
  u32 pad;
};

struct Params {
  Copy copies[KD_MAX_COPIES];
  Gather gathers[KD_MAX_GATHERS];
  u64 rule;        // int32 array of the rule (labels [rows], masked_m [G], psum ends [G])
  u64 ctrl;        // the device ring's control words: head, reserved-to mark
  u64 ring;        // the ring's first byte
  u64 ring_bytes;  // its size
  u64 worst;       // bytes of this call's slot if every row were touched
  u64 token_ptr;   // u64 replay counter of a graph site (0: eager call, token = seq)
  u64 record;      // the call record in the journal slot's twin (64 bytes)
  u64 host_pre;    // the host slot's `pre` marker, mapped (0: none)
  u64 seq;         // the journal slot's seq
  u64 call_index;
  u64 chain;       // a graph site's chain cell (0: none): the done marker of the call before it
  u64 host_done;   // this slot's `done` marker, mapped (what the next call of the chain writes)
  u32 n_copies;
  u32 n_gathers;
  u32 rule_kind;
  u32 rule_n;      // entries of the rule array
  u32 rows;        // rows of the gathered tensors (outer * inner)
  u32 inner;       // rows per outer index (masked: max_m; else rows)
  u32 alignment;   // psum layout: groups start at multiples of it
  u32 rec_bytes;   // bytes per record (a multiple of 16)
  u32 slot_index;  // the journal slot
  u32 gather_blocks;  // blocks taking the gather's units (the rest copy byte ranges)
  u32 split;          // units per window of KD_ROWS_PER_BLOCK rows (>= 1)
  u32 pad;
};

// Slot header in the device ring (64 bytes) and call record in the twin (64 bytes).
struct SlotHead {
  u32 magic;
  u32 slot_index;
  u64 seq;
  u64 token;
  u64 pos;  // logical position (never wraps; physical = pos % ring_bytes)
  u32 rows;
  u32 rec_bytes;
  u64 used;
  u64 call_index;
  u64 complete;  // == token once every block finished
};

struct Record {
  u32 magic;
  u32 rows;
  u64 seq;
  u64 token;
  u64 pos;  // ~0: no gather
  u32 done_blocks;  // scratch of the launch (reset by the last block)
  u32 row_counter;  // scratch of the launch (reset by the last block)
  u64 complete;
  u64 call_index;
  u64 head_after;
};

// The host mirrors (kdump/record/flight/gather.py) rely on these sizes.
static_assert(sizeof(Copy) == 24, "Copy layout");
static_assert(sizeof(Gather) == 48, "Gather layout");
static_assert(sizeof(Params) == KD_PARAMS_BYTES, "Params layout (gather.SnapParams)");
static_assert(sizeof(SlotHead) == KD_SLOT_HEAD_BYTES, "SlotHead layout (gather.SLOT_HEAD)");
static_assert(sizeof(Record) == KD_RECORD_BYTES, "Record layout (gather.CALL_RECORD)");
static_assert(KD_ROWS_PER_BLOCK <= KD_THREADS, "a gather block tests one row per thread");
static_assert(KD_CHUNK == KD_THREADS * 16 * KD_UNROLL, "a plain-copy step is one unrolled round");
static_assert(KD_BULK_STAGE % 16 == 0 && KD_BULK_WARPS * 32 <= KD_THREADS, "bulk gather shape");
static_assert(KD_BUF_WORDS * 4 >= KD_BULK_WARPS * KD_BULK_STAGES * KD_BULK_STAGE &&
                  KD_BUF_WORDS >= KD_STAGE_WORDS,
              "the buffer holds the bulk gather's stages and the staged gather's words");
static_assert(KD_OVERLAP_STAGES <= KD_BULK_STAGES && KD_OVERLAP_BULK_WORDS < KD_BUF_WORDS &&
                  KD_BULK_WARPS * 32 < KD_THREADS,
              "gather_pair's share of the buffer and of the warps");

__device__ __forceinline__ u64 slot_pos(const Params& p, u64 head) {
  // A slot never wraps around the end: skip to the next lap instead.
  if (p.ring_bytes == 0) return head;  // no device ring: nothing is gathered
  u64 phys = head % p.ring_bytes;
  return phys + p.worst > p.ring_bytes ? head - phys + p.ring_bytes : head;
}

__device__ __forceinline__ bool touched(const Params& p, u32 r) {
  const int* rule = (const int*)p.rule;
  switch (p.rule_kind) {
    case KD_RULE_LABELS:
      return r < p.rule_n && rule[r] >= 0;
    case KD_RULE_MASKED: {
      u32 g = r / p.inner;
      return g < p.rule_n && (int)(r % p.inner) < rule[g];
    }
    case KD_RULE_PSUM: {
      // group g: rows [align(end[g-1]), end[g]); the first group whose end is above r.
      u32 lo = 0, hi = p.rule_n;
      while (lo < hi) {
        u32 mid = (lo + hi) / 2;
        if ((i64)rule[mid] <= (i64)r) lo = mid + 1; else hi = mid;
      }
      if (lo >= p.rule_n) return false;
      i64 start = 0;
      if (lo > 0) {
        i64 prev = rule[lo - 1];
        i64 a = p.alignment ? p.alignment : 1;
        start = (prev + a - 1) / a * a;
      }
      return (i64)r >= start;
    }
    default:
      return true;
  }
}

// Every copy below keeps KD_UNROLL loads in flight per thread before it stores any of them: a
// copy that stores each value before loading the next runs at memory latency (a 64 KiB chunk took
// 16 round trips of ~1 us), not at HBM bandwidth.
template <typename T>
__device__ __forceinline__ void copy_units(char* __restrict__ dst, const char* __restrict__ src,
                                           u64 units, u32 tid, u32 threads) {
  const T* s = (const T*)src;
  T* d = (T*)dst;
  for (u64 b = 0; b < units; b += (u64)threads * KD_UNROLL) {
    T v[KD_UNROLL];
#pragma unroll
    for (u32 k = 0; k < KD_UNROLL; ++k) {
      const u64 i = b + tid + (u64)k * threads;
      if (i < units) v[k] = s[i];
    }
#pragma unroll
    for (u32 k = 0; k < KD_UNROLL; ++k) {
      const u64 i = b + tid + (u64)k * threads;
      if (i < units) d[i] = v[k];
    }
  }
}

// n bytes with the widest units both ends' alignment allows, the tail bytewise.
__device__ void copy_bytes(char* dst, const char* src, u64 n, u32 tid, u32 threads) {
  const u64 mis = (u64)dst | (u64)src;
  u64 body = 0;
  if ((mis & 15) == 0) {
    body = n / 16 * 16;
    copy_units<uint4>(dst, src, n / 16, tid, threads);
  } else if ((mis & 3) == 0) {
    body = n / 4 * 4;
    copy_units<u32>(dst, src, n / 4, tid, threads);
  }
  for (u64 i = body + tid; i < n; i += threads) dst[i] = src[i];
}

__device__ __forceinline__ bool contiguous(const Gather& g) {
  return g.cols == 1 || g.col_stride == (i64)g.elem;
}

// Row q of the block's touched rows: its outer and inner index (s_outer/s_inner, found once per
// row: a division per copied unit would cost more instructions than the copy).
__device__ __forceinline__ const char* row_at(const Gather& g, const u32* outer, const u32* inner,
                                              u32 q) {
  return (const char*)g.src + (i64)outer[q] * g.outer_stride + (i64)inner[q] * g.inner_stride;
}

// The contiguous rows of one gather for the block's `count` touched rows (in row order; record q
// of the block at out + q * rec_bytes): the block's threads take the rows' T-sized units as one
// flat range, so a block with one touched row still spreads it over every thread. Each thread's
// (row, unit) moves by KD_THREADS units per step without a division.
template <typename T>
__device__ void gather_contiguous(const Gather& g, const u32* outer, const u32* inner, u32 count,
                                  char* out, u32 rec_bytes, u32 tid) {
  const u32 per_row = g.cols * g.elem / sizeof(T);
  const u32 total = count * per_row;
  const u32 dq = KD_THREADS / per_row, dc = KD_THREADS - dq * per_row;
  u32 q = tid / per_row, c = tid - q * per_row;
  for (u32 b = 0; b < total; b += KD_THREADS * KD_UNROLL) {
    T v[KD_UNROLL];
    u32 qs[KD_UNROLL], cs[KD_UNROLL];
#pragma unroll
    for (u32 k = 0; k < KD_UNROLL; ++k) {
      qs[k] = q;
      cs[k] = c;
      if (b + tid + k * KD_THREADS < total) v[k] = ((const T*)row_at(g, outer, inner, q))[c];
      q += dq;
      c += dc;
      if (c >= per_row) {
        c -= per_row;
        ++q;
      }
    }
#pragma unroll
    for (u32 k = 0; k < KD_UNROLL; ++k)
      if (b + tid + k * KD_THREADS < total)
        ((T*)(out + (u64)qs[k] * rec_bytes + g.rec_off))[cs[k]] = v[k];
  }
}

// A strided gather (e.g. MN-major scales: a row's elements lie a column stride apart): elements
// as one flat range, rows fastest, so neighbouring threads read neighbouring rows of one column
// (adjacent in memory for MN-major layouts).
template <typename T>
__device__ void gather_strided(const Gather& g, const u32* outer, const u32* inner, u32 count,
                               char* out, u32 rec_bytes, u32 tid) {
  const u32 total = count * g.cols;
  for (u32 b = 0; b < total; b += KD_THREADS * KD_UNROLL) {
    T v[KD_UNROLL];
#pragma unroll
    for (u32 k = 0; k < KD_UNROLL; ++k) {
      const u32 f = b + tid + k * KD_THREADS;
      if (f < total) {
        const u32 c = f / count, q = f - c * count;
        v[k] = *(const T*)(row_at(g, outer, inner, q) + (i64)c * g.col_stride);
      }
    }
#pragma unroll
    for (u32 k = 0; k < KD_UNROLL; ++k) {
      const u32 f = b + tid + k * KD_THREADS;
      if (f < total) {
        const u32 c = f / count, q = f - c * count;
        *(T*)(out + (u64)q * rec_bytes + g.rec_off + (u64)c * sizeof(T)) = v[k];
      }
    }
  }
}

// A strided gather of 4-byte elements (MN-major fp32 or packed UE8M0 scales) staged through
// shared memory: reads go rows-fastest (neighbouring threads read neighbouring rows of one
// column), writes go columns-fastest (neighbouring threads write neighbouring words of one
// record), so both sides coalesce. Written directly, a warp's 32 stores landed 32 records apart:
// at 113 tokens per expert the scales alone took 26 us. `stage` is column-major with an odd
// column stride, so neither phase has bank conflicts. THREADS threads call it (tid counted from
// the first of them), `words` words of `stage` theirs: the whole block (barrier 0, that is
// __syncthreads), or the warps a gather beside it leaves (gather_pair: named barrier 1).
template <u32 THREADS, u32 BARRIER>
__device__ __forceinline__ void stage_sync() {
  if (BARRIER == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"n"(BARRIER), "n"(THREADS) : "memory");
  }
}

template <u32 THREADS, u32 BARRIER>
__device__ void gather_strided_staged(const Gather& g, const u32* outer, const u32* inner,
                                      u32 count, char* out, u32 rec_bytes, u32 tid, u32* stage,
                                      u32 words) {
  const u32 cols = g.cols;
  const u32 per = words / cols - 2;  // rows per pass (>= 1: the callers check cols <= words / 3)
  for (u32 q0 = 0; q0 < count; q0 += per) {
    const u32 n = count - q0 < per ? count - q0 : per;
    const u32 ld = (n + 1) | 1u;
    const u32 total = n * cols;
    for (u32 b = 0; b < total; b += THREADS * KD_STAGE_UNROLL) {
      u32 v[KD_STAGE_UNROLL];
#pragma unroll
      for (u32 k = 0; k < KD_STAGE_UNROLL; ++k) {
        const u32 f = b + tid + k * THREADS;
        if (f < total) {
          const u32 c = f / n, q = f - c * n;
          v[k] = *(const u32*)(row_at(g, outer, inner, q0 + q) + (i64)c * g.col_stride);
        }
      }
#pragma unroll
      for (u32 k = 0; k < KD_STAGE_UNROLL; ++k) {
        const u32 f = b + tid + k * THREADS;
        if (f < total) {
          const u32 c = f / n, q = f - c * n;
          stage[c * ld + q] = v[k];
        }
      }
    }
    stage_sync<THREADS, BARRIER>();
    for (u32 f = tid; f < total; f += THREADS) {
      const u32 q = f / cols, c = f - q * cols;
      *(u32*)(out + (u64)(q0 + q) * rec_bytes + g.rec_off + (u64)c * 4) = stage[c * ld + q];
    }
    stage_sync<THREADS, BARRIER>();
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KD_HAVE_BULK 1
__device__ __forceinline__ u32 smem_addr(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

// The barrier's one arrival of a phase, which expects n bytes of bulk copies before it completes.
__device__ __forceinline__ void bulk_expect(u32 bar, u32 n) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(n)
               : "memory");
}

// n bytes (a multiple of 16, both ends 16-byte aligned) into shared memory, counted on `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 n, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(dst), "l"(src), "r"(n), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 n, u32 bar) {
  bulk_expect(bar, n);
  bulk_copy(dst, src, n, bar);
}

__device__ __forceinline__ void bulk_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "wait_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra wait_%=;\n}" ::"r"(bar), "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_store(void* dst, u32 src, u32 n) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src),
               "r"(n)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// The contiguous rows of one gather by bulk copies: piece j (row j / per_row, piece j % per_row
// of KD_BULK_STAGE bytes) belongs to issuer j % KD_BULK_WARPS, which loads it into its buffer
// (j / WARPS) % STAGES, waits for it, stores it to its record, and reloads the buffer of the
// piece before once that store has read it. Lane 0 of each warp w < KD_BULK_WARPS calls it, with
// the block's buffer (issuer w's STAGES pieces at w x STAGES x KD_BULK_STAGE bytes) and barriers.
template <u32 STAGES>
__device__ void bulk_issue(const Gather& g, const u32* outer, const u32* inner, u32 count,
                           char* out, u32 rec_bytes, u32 w, u32* buf, u64* bars) {
  const u32 row_bytes = g.cols * g.elem;
  const u32 per_row = (row_bytes + KD_BULK_STAGE - 1) / KD_BULK_STAGE;
  const u32 total = count * per_row;
  const u32 mine = total > w ? (total - w + KD_BULK_WARPS - 1) / KD_BULK_WARPS : 0;
  const u32 base = smem_addr(buf) + w * STAGES * KD_BULK_STAGE;
  const u32 bar0 = smem_addr(bars + w * STAGES);
  // Fresh barriers per call (phase 0; one arrival each: the issuer's expect_tx), retired at
  // its end, so the next gather of the launch starts at phase 0 again.
  for (u32 k = 0; k < STAGES; ++k)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * k) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  // piece k of this issuer: j = w + k * WARPS
#define KD_PIECE(k, q, at, n)                                   \
  const u32 j_##q = w + (k) * KD_BULK_WARPS;                     \
  const u32 q = j_##q / per_row;                                 \
  const u32 at = (j_##q - q * per_row) * KD_BULK_STAGE;          \
  const u32 n = row_bytes - at < KD_BULK_STAGE ? row_bytes - at : KD_BULK_STAGE;
  for (u32 k = 0; k < mine && k < STAGES; ++k) {
    KD_PIECE(k, q, at, n)
    bulk_load(base + k * KD_BULK_STAGE, row_at(g, outer, inner, q) + at, n, bar0 + 8 * k);
  }
  for (u32 k = 0; k < mine; ++k) {
    const u32 s = k % STAGES;
    bulk_wait(bar0 + 8 * s, (k / STAGES) & 1);
    {
      KD_PIECE(k, q, at, n)
      bulk_store(out + (u64)q * rec_bytes + g.rec_off + at, base + s * KD_BULK_STAGE, n);
    }
    // the previous piece's store has read its buffer once at most this one is pending
    if (k >= 1 && k - 1 + STAGES < mine) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      const u32 r = k - 1 + STAGES, rs = (k - 1) % STAGES;
      KD_PIECE(r, q, at, n)
      bulk_load(base + rs * KD_BULK_STAGE, row_at(g, outer, inner, q) + at, n, bar0 + 8 * rs);
    }
  }
#undef KD_PIECE
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");  // the stores before the publication
  for (u32 k = 0; k < STAGES; ++k)  // every load was waited for: none is pending
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar0 + 8 * k) : "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // before generic reuse
}

// One gather's contiguous rows by bulk copies, the whole block's buffer. Every thread of the
// block calls it.
__device__ void gather_bulk(const Gather& g, const u32* outer, const u32* inner, u32 count,
                            char* out, u32 rec_bytes, u32 tid, u32* buf, u64* bars) {
  // The buffers may hold what a staged gather wrote through the generic proxy: order those
  // writes before the async proxy's loads overwrite them (every writer fences, then the barrier).
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (tid / 32 < KD_BULK_WARPS && tid % 32 == 0)
    bulk_issue<KD_BULK_STAGES>(g, outer, inner, count, out, rec_bytes, tid / 32, buf, bars);
  __syncthreads();  // the buffers are free again (the staged gathers use them next)
}

// A call's two gathers side by side: contiguous rows (A) by bulk copies, issued by
// lane 0 of the first KD_BULK_WARPS warps with KD_OVERLAP_STAGES buffers each, while the other
// warps stage 4-byte strided rows (A's MN-major scales) through the rest of the buffer. One after
// the other, each unit paid the scales' load round trip after the rows' last piece had landed
// (H100, kd_snapshot in a recorded step of A and its scales: side by side 1.3 us shorter at 32
// tokens per expert, 2.7 us at 113; alone, 2.2 and 3.9 us; lab/results/RESULTS.md).
// Every thread of the block calls it.
__device__ void gather_pair(const Gather& rows, const Gather& strided, const u32* outer,
                            const u32* inner, u32 count, char* out, u32 rec_bytes, u32 tid,
                            u32* buf, u64* bars) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const u32 w = tid / 32;
  if (w < KD_BULK_WARPS) {
    if (tid % 32 == 0)
      bulk_issue<KD_OVERLAP_STAGES>(rows, outer, inner, count, out, rec_bytes, w, buf, bars);
  } else {
    gather_strided_staged<KD_THREADS - 32 * KD_BULK_WARPS, 1>(
        strided, outer, inner, count, out, rec_bytes, tid - 32 * KD_BULK_WARPS,
        buf + KD_OVERLAP_BULK_WORDS, KD_BUF_WORDS - KD_OVERLAP_BULK_WORDS);
  }
  __syncthreads();
}

// Which of a call's two gathers gather_pair takes as its rows (0 or 1), or -1: it runs when one
// is contiguous rows the bulk copies take (16-byte aligned) and the other strided 4-byte rows the
// rest of the buffer stages (the record's alignment is checked per unit).
__device__ __forceinline__ int pair_rows(const Params& p) {
  if (p.n_gathers != 2) return -1;
  for (int a = 0; a < 2; ++a) {
    const Gather& r = p.gathers[a];
    const Gather& s = p.gathers[1 - a];
    const u64 row_bytes = (u64)r.cols * r.elem;
    const u64 rmis = r.src | (u64)r.outer_stride | (u64)r.inner_stride | r.rec_off | p.rec_bytes |
                     row_bytes;
    const u64 smis = s.src | (u64)s.outer_stride | (u64)s.inner_stride | (u64)s.col_stride |
                     s.rec_off | p.rec_bytes;
    if (contiguous(r) && (rmis & 15) == 0 && row_bytes < (1ull << 24) && !contiguous(s) &&
        s.elem == 4 && (smis & 3) == 0 && s.cols <= (KD_BUF_WORDS - KD_OVERLAP_BULK_WORDS) / 3)
      return a;
  }
  return -1;
}

// Windows read whole: when a call gathers one tensor of 4-byte elements whose rows
// are adjacent in a column (MN-major scales) and a window's columns fit the buffer, a gather
// block copies its next window's columns whole (every row, touched or not: they lie inside the
// tensor) into shared memory with bulk copies, issued before it knows which rows are touched.
// The rule, the ring head and the row counter's round trip then overlap those loads, and the
// records are written from shared memory: no load waits in the chain between the counter and
// the publication. Column c of the window sits at KD_DENSE_LD * c words of the buffer. The
// untouched rows' bytes are read, never stored: a tool that reports reads of memory nothing
// wrote (compute-sanitizer's initcheck) may name this kernel where padding rows of the scales
// were left unwritten (the plain path, before sm_90, reads only the touched rows). H100,
// kd_snapshot in a recorded step of scales alone: 1.0 us shorter at 1 token per expert, 3.7 us
// at 113, than reading only the touched rows (lab/results/RESULTS.md).
__device__ __forceinline__ bool dense_ok(const Params& p) {
  if (p.n_gathers != 1 || p.split > 1) return false;
  const Gather& g = p.gathers[0];
  const bool one_outer = p.inner >= p.rows;
  return g.elem == 4 && g.inner_stride == 4 && g.cols > 1 && g.cols <= KD_DENSE_COLS &&
         ((g.src | (u64)g.col_stride) & 15) == 0 &&
         (one_outer || (p.inner % KD_ROWS_PER_BLOCK == 0 && ((u64)g.outer_stride & 15) == 0));
}

// Rows of window w that the bulk copies bring (a multiple of 4: a copy moves 16-byte units);
// the last window's rows past them, if any, are read from global memory when stored.
__device__ __forceinline__ u32 dense_rows(const Params& p, u32 w) {
  const u32 w0 = w * KD_ROWS_PER_BLOCK;
  const u32 left = p.rows - w0;
  return (left < KD_ROWS_PER_BLOCK ? left : KD_ROWS_PER_BLOCK) & ~3u;
}

// Warp 1 starts the copies of window w's columns, one phase of `bar` (count 1).
__device__ void dense_issue(const Params& p, u32 w, u32 tid, u32* buf, u32 bar) {
  if (tid / 32 != 1) return;
  const Gather& g = p.gathers[0];
  const u32 lane = tid % 32;
  const u32 w0 = w * KD_ROWS_PER_BLOCK, n = dense_rows(p, w) * 4;
  if (lane == 0) bulk_expect(bar, n * g.cols);
  __syncwarp();
  if (n == 0) return;
  const char* src =
      (const char*)g.src + (i64)(w0 / p.inner) * g.outer_stride + (i64)(w0 % p.inner) * 4;
  const u32 base = smem_addr(buf);
  for (u32 c = lane; c < g.cols; c += 32)
    bulk_copy(base + c * KD_DENSE_LD * 4, src + (i64)c * g.col_stride, n, bar);
}

// The records of the block's `count` touched rows of window w (absolute row indices in rows[],
// in row order) from the window in shared memory: neighbouring threads write neighbouring words
// of a record.
__device__ void dense_store(const Params& p, u32 w, const u32* rows, u32 count, char* out,
                            u32 tid, const u32* buf) {
  const Gather& g = p.gathers[0];
  const u32 cols = g.cols, w0 = w * KD_ROWS_PER_BLOCK, have = dense_rows(p, w);
  const u32 total = count * cols;
  for (u32 f = tid; f < total; f += KD_THREADS) {
    const u32 q = f / cols, c = f - q * cols;
    const u32 r = rows[q], at = r - w0;
    u32 v;
    if (at < have) {
      v = buf[c * KD_DENSE_LD + at];
    } else {
      v = *(const u32*)((const char*)g.src + (i64)(r / p.inner) * g.outer_stride +
                        (i64)(r % p.inner) * 4 + (i64)c * g.col_stride);
    }
    *(u32*)(out + (u64)q * p.rec_bytes + g.rec_off + (u64)c * 4) = v;
  }
}
#endif

__device__ void gather_one(const Gather& g, const u32* outer, const u32* inner, u32 count,
                           char* out, u32 rec_bytes, u32 tid, u32* stage, u64* bars) {
  const u64 row_bytes = (u64)g.cols * g.elem;
  if (contiguous(g)) {
    // Units of 16 or 4 bytes when every row start, record offset and the row length allow them.
    const u64 mis = (u64)g.src | (u64)g.outer_stride | (u64)g.inner_stride | (u64)g.rec_off |
                    (u64)rec_bytes | (u64)out | row_bytes;
    if (row_bytes * count < (1ull << 32)) {
#ifdef KD_HAVE_BULK
      if ((mis & 15) == 0 && count) return gather_bulk(g, outer, inner, count, out, rec_bytes, tid,
                                                       stage, bars);
#endif
      if ((mis & 15) == 0)
        return gather_contiguous<uint4>(g, outer, inner, count, out, rec_bytes, tid);
      if ((mis & 3) == 0)
        return gather_contiguous<u32>(g, outer, inner, count, out, rec_bytes, tid);
      return gather_contiguous<unsigned char>(g, outer, inner, count, out, rec_bytes, tid);
    }
    for (u32 q = 0; q < count; ++q)  // rows of gigabytes: one after another, all threads on each
      copy_bytes(out + (u64)q * rec_bytes + g.rec_off, row_at(g, outer, inner, q), row_bytes,
                 tid, KD_THREADS);
    return;
  }
  const u64 mis = (u64)g.src | (u64)g.outer_stride | (u64)g.inner_stride | (u64)g.col_stride |
                  (u64)g.rec_off | (u64)rec_bytes | (u64)out;
  if ((u64)count * g.cols < (1ull << 32)) {
    if (g.elem == 8 && (mis & 7) == 0)
      return gather_strided<u64>(g, outer, inner, count, out, rec_bytes, tid);
    if (g.elem == 4 && (mis & 3) == 0 && g.cols <= KD_STAGE_WORDS / 3)
      return gather_strided_staged<KD_THREADS, 0>(g, outer, inner, count, out, rec_bytes, tid,
                                                   stage, KD_STAGE_WORDS);
    if (g.elem == 4 && (mis & 3) == 0)
      return gather_strided<u32>(g, outer, inner, count, out, rec_bytes, tid);
    if (g.elem == 2 && (mis & 1) == 0)
      return gather_strided<unsigned short>(g, outer, inner, count, out, rec_bytes, tid);
    if (g.elem == 1) return gather_strided<unsigned char>(g, outer, inner, count, out, rec_bytes, tid);
  }
  // Any other element size: element by element, bytewise.
  for (u32 q = 0; q < count; ++q) {
    const char* row = row_at(g, outer, inner, q);
    char* o = out + (u64)q * rec_bytes + g.rec_off;
    for (u64 i = tid; i < row_bytes; i += KD_THREADS) {
      const u64 c = i / g.elem, b = i - c * g.elem;
      o[i] = row[(i64)c * g.col_stride + (i64)b];
    }
  }
}

// Each record's first 16 bytes: the row index, then zeros (thread q writes record q).
__device__ __forceinline__ void write_heads(char* out, const u32* rows, u32 count, u32 rec_bytes,
                                            u32 tid) {
  if (tid >= count) return;
  u32* h = (u32*)(out + (u64)tid * rec_bytes);
  h[0] = rows[tid];
  h[1] = 0;
  h[2] = 0;
  h[3] = 0;
}

extern "C" __global__ void __launch_bounds__(KD_THREADS, KD_LAUNCH_MIN_BLOCKS)
    kd_snapshot(const __grid_constant__ Params p) {
  __shared__ u32 s_base;
  __shared__ u32 s_ballot[KD_UNITS][KD_THREADS / 32];  // each warp's ballot of a round's units
  __shared__ u32 s_rows[KD_ROWS_PER_BLOCK];
  __shared__ u32 s_outer[KD_ROWS_PER_BLOCK];
  __shared__ u32 s_inner[KD_ROWS_PER_BLOCK];
  extern __shared__ __align__(128) u32 s_stage[];  // KD_BUF_WORDS: the staged and bulk gathers'
  __shared__ __align__(8) u64 s_bars[KD_BULK_WARPS * KD_BULK_STAGES];
  __shared__ bool s_last;
  __shared__ u64 s_head;
  Record* rec = (Record*)p.record;
  volatile u64* ctrl = (volatile u64*)p.ctrl;
  const u32 tid = threadIdx.x;
  // The launch is a chain of dependent memory round trips (the rule, the ring head, the row
  // counter, the rows, the block counter, the publication): every step below overlaps what it
  // can, a recorded graph step pays the chain before its kernel runs.
  if (p.chain && tid == 32 && blockIdx.x == gridDim.x - 1) {
    // The done marker of the chain's previous call (the site before this one on the capture's
    // stream, or the last one of the previous replay): stream order says its kernel returned
    // before this one started, so no node after the recorded kernel is needed. Its token is
    // what its own snapshot left in its replay counter.
    volatile u64* cell = (volatile u64*)p.chain;
    const u64 done = cell[0], tok = cell[1];
    if (done && tok) *(volatile u64*)done = *(volatile u64*)tok;
    cell[0] = p.host_done;
    cell[1] = p.token_ptr;
  }
  if (blockIdx.x < p.gather_blocks) {
    // Units: part `part` of window `w` (KD_ROWS_PER_BLOCK rows) is unit part * windows + w, and
    // gather block b takes units b, b + gather_blocks, ... (the host launches about as many
    // gather blocks as the GPU holds at once): every window's part 0 comes first, so under
    // sparse routing (one busy part per window) the busy units spread evenly over the blocks.
    // A window's touched rows are compacted in row order (a ballot per warp, then warp
    // offsets) and shared among as few of its parts as take at most `per` rows each; a part
    // past them does nothing. The rule is tested for KD_UNITS units at once, so a block with
    // many idle units (sparse routing) pays one round trip for them. Records of a unit are in
    // row order: neighbouring records hold neighbouring rows.
    const u32 warp = tid / 32, lane = tid % 32;
    const u32 split = p.split ? p.split : 1;
    const u32 per = (KD_ROWS_PER_BLOCK + split - 1) / split;
    const u64 windows = ((u64)p.rows + KD_ROWS_PER_BLOCK - 1) / KD_ROWS_PER_BLOCK;
    const u64 units = windows * split;
    const u64 stride = p.gather_blocks;
    // One thread per block reads the ring head (every thread reading it would queue thousands
    // of requests on one L2 line), while the others read the rule.
    if (tid == 0) s_head = ctrl[0];
#ifdef KD_HAVE_BULK
    // Windows read whole: the block's first window is on its way before the rule is read. The
    // barrier is initialised by the warp that arrives on it; the others first wait on it after
    // the rule's __syncthreads. (`pair`: whether a unit's two gathers go side by side.)
    const bool dense = dense_ok(p);
    const int pair = pair_rows(p);
    const u32 dense_bar = smem_addr(s_bars);
    u32 dense_phase = 0;
    if (dense && blockIdx.x < units) {
      if (tid == 32) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(dense_bar) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      }
      __syncwarp();
      dense_issue(p, (u32)(blockIdx.x % windows), tid, s_stage, dense_bar);
    }
#endif
    for (u64 u0 = blockIdx.x; u0 < units; u0 += KD_UNITS * stride) {
      // (The ballots live in shared memory: a per-thread array indexed in the loop below, which
      // is not unrolled, would sit in local memory.)
#pragma unroll
      for (u32 k = 0; k < KD_UNITS; ++k) {
        const u64 u = u0 + k * stride;
        const u32 r = (u32)(u % windows) * KD_ROWS_PER_BLOCK + tid;
        const bool mine = u < units && tid < KD_ROWS_PER_BLOCK && r < p.rows && touched(p, r);
        const u32 ballot = __ballot_sync(0xffffffffu, mine);
        if (lane == 0) s_ballot[k][warp] = ballot;
      }
      __syncthreads();
      const u64 pos = slot_pos(p, s_head);
      char* slot = (char*)p.ring + (pos % p.ring_bytes) + sizeof(SlotHead);
      // What this launch may overwrite (salvage checks older slots), marked by every gather
      // block before its records and its block count (so before the publication's slot head,
      // also when no row is touched); every gather block has a unit in its first round.
      if (tid == 0 && u0 == blockIdx.x) ctrl[1] = pos + p.worst;
#pragma unroll 1
      for (u32 k = 0; k < KD_UNITS; ++k) {
        const u64 u = u0 + k * stride;
        if (u >= units) break;
        const u32 part = (u32)(u / windows), window = (u32)(u - (u64)part * windows);
        u32 below = 0, count = 0;
        for (u32 w = 0; w < KD_THREADS / 32; ++w) {
          const u32 c = __popc(s_ballot[k][w]);
          below += w < warp ? c : 0;
          count += c;
        }
        const u32 ballot = s_ballot[k][warp];
#ifdef KD_HAVE_BULK
        if (dense) {
          // (split 1: the unit is its window.) The row counter's round trip overlaps the
          // window's copies; s_base is published by the __syncthreads after both.
          u32 base = 0;
          if (tid == 0 && count) base = atomicAdd(&rec->row_counter, count);
          if ((ballot >> lane) & 1u) s_rows[below + __popc(ballot & ((1u << lane) - 1u))] =
              window * KD_ROWS_PER_BLOCK + tid;
          if (tid == 0) s_base = base;
          bulk_wait(dense_bar, dense_phase);
          dense_phase ^= 1u;
          __syncthreads();
          if (count) {
            char* out = slot + (u64)s_base * p.rec_bytes;
            write_heads(out, s_rows, count, p.rec_bytes, tid);
            dense_store(p, window, s_rows, count, out, tid, s_stage);
          }
          // The buffer's generic reads before the next window's bulk copies overwrite it.
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          __syncthreads();
          if (u + stride < units) dense_issue(p, (u32)((u + stride) % windows), tid, s_stage,
                                              dense_bar);
          continue;
        }
#endif
        const u32 parts = (count + per - 1) / per;
        if (part >= parts) continue;  // the same answer in every thread of the block
        const u32 lo = count * part / parts;
        const u32 n = count * (part + 1) / parts - lo;
        if (tid == 0) s_base = atomicAdd(&rec->row_counter, n);
        if ((ballot >> lane) & 1u) {
          const u32 q = below + __popc(ballot & ((1u << lane) - 1u));
          const u32 r = window * KD_ROWS_PER_BLOCK + tid;
          if (q >= lo && q < lo + n) {
            s_rows[q - lo] = r;
            s_outer[q - lo] = r / p.inner;
            s_inner[q - lo] = r % p.inner;
          }
        }
        __syncthreads();
        char* out = slot + (u64)s_base * p.rec_bytes;
        write_heads(out, s_rows, n, p.rec_bytes, tid);
#ifdef KD_HAVE_BULK
        if (pair >= 0 && ((u64)out & 15) == 0) {
          gather_pair(p.gathers[pair], p.gathers[1 - pair], s_outer, s_inner, n, out,
                      p.rec_bytes, tid, s_stage, s_bars);
        } else
#endif
          for (u32 gi = 0; gi < p.n_gathers; ++gi)
            gather_one(p.gathers[gi], s_outer, s_inner, n, out, p.rec_bytes, tid, s_stage,
                       s_bars);
        __syncthreads();  // s_rows, s_base and the buffers are free for the next unit
      }
      __syncthreads();  // every thread has read s_ballot before the next round writes it
    }
  } else {
    // Copy blocks take KD_CHUNK-byte chunks of the plain copies, round robin.
    const u32 copy_blocks = gridDim.x - p.gather_blocks;
    u64 q = blockIdx.x - p.gather_blocks;
    u64 first = 0;  // first chunk of copy c
    for (u32 c = 0; c < p.n_copies; ++c) {
      const u64 n = p.copies[c].nbytes;
      const u64 chunks = (n + KD_CHUNK - 1) / KD_CHUNK;
      for (; q < first + chunks; q += copy_blocks) {
        const u64 at = (q - first) * KD_CHUNK;
        const u64 len = n - at < KD_CHUNK ? n - at : KD_CHUNK;
        copy_bytes((char*)p.copies[c].dst + at, (const char*)p.copies[c].src + at, len, tid,
                   KD_THREADS);
      }
      first += chunks;
    }
  }
  // The last block to finish publishes the call: what it writes, one fence, then the marks that
  // say it is complete (a reader that sees a mark sees everything before it).
  __threadfence();
  __syncthreads();
  // (One 64-bit word for both counters, so that this atomic returns the row count and the
  // publication reads nothing, measured 1.5-4 us slower at the decode shapes on the H200.)
  if (tid == 0) s_last = atomicAdd(&rec->done_blocks, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last || tid != 0) return;
  __threadfence();
  // A graph site's token counts its replays; an eager call's is its journal seq (never 0), so
  // a late marker of a slot's previous occupant never matches the new call's.
  const u64 token = p.token_ptr ? *(volatile u64*)p.token_ptr + 1 : p.seq;
  if (p.host_pre) *(volatile u64*)p.host_pre = token;  // the host slot reads in flight until `post`
  const u64 head = ctrl[0];
  const u64 pos = slot_pos(p, head);
  const u32 rows = *(volatile u32*)&rec->row_counter;
  u64 used = 0;
  SlotHead* h = (SlotHead*)((char*)p.ring + (p.ring_bytes ? pos % p.ring_bytes : 0));
  if (p.gather_blocks) {
    used = ((u64)sizeof(SlotHead) + (u64)rows * p.rec_bytes + 255) / 256 * 256;
    h->magic = KD_SLOT_MAGIC;
    h->slot_index = p.slot_index;
    h->seq = p.seq;
    h->token = token;
    h->pos = pos;
    h->rows = rows;
    h->rec_bytes = p.rec_bytes;
    h->used = used;
    h->call_index = p.call_index;
  }
  rec->magic = KD_RECORD_MAGIC;
  rec->rows = rows;
  rec->seq = p.seq;
  rec->pos = p.gather_blocks ? pos : ~0ull;
  rec->call_index = p.call_index;
  rec->head_after = p.gather_blocks ? pos + used : head;
  rec->row_counter = 0;
  rec->done_blocks = 0;
  rec->token = token;
  __threadfence();
  if (p.gather_blocks) {
    h->complete = token;
    ctrl[0] = pos + used;
  }
  rec->complete = token;
  if (p.token_ptr) *(volatile u64*)p.token_ptr = token;
}

// One u64 (a slot's completion token, written by the snapshot) to a marker of the mapped host
// journal, launched after the recorded kernel. In a graph on the H200 this kernel node started as
// the recorded kernel ended; an 8-byte memcpy node there started 2.5-7.5 us after it.
extern "C" __global__ void kd_mark(const u64* src, u64* dst) {
  *(volatile u64*)dst = *(const volatile u64*)src;
}

// A batch of `post` markers (eager calls' host copies, issued on the side stream after the
// batch's D2H copies): thread k copies word src[k] to dst[k], k < n. One block of KD_MAX_MARKS.
struct Marks {
  u64 n;
  const u64* src[KD_MAX_MARKS];
  u64* dst[KD_MAX_MARKS];
};

extern "C" __global__ void kd_marks(const Marks m) {
  const unsigned k = threadIdx.x;
  if (k < m.n) *(volatile u64*)m.dst[k] = *(const volatile u64*)m.src[k];
}

static_assert(sizeof(Marks) == KD_MARKS_BYTES, "Marks layout (gather.Marks)");
