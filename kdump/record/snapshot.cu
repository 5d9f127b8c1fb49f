// The flight recorder's fused snapshot kernel: one launch per recorded call.
//
// Plain byte-range copies (metadata, routing, scalars) go into the journal slot's device twin;
// row gathers copy only the rows a call can touch (a row rule over labels / masked_m / psum ends)
// into a slot of the device ring, compacted: one record per touched row holds the row index and
// that row's bytes of every gathered tensor (A and its scales share one compaction). The slot
// position is chosen on the device from the ring's head, so a captured graph picks a fresh slot
// at every replay; the last block to finish writes the slot header and the twin's call record,
// then advances the head and the replay token. No includes: NVRTC compiles it without headers.
// Mirrors kdump/record/gather.py (SnapParams, the record layouts); keep both in step.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

#define KD_MAX_COPIES 16
#define KD_MAX_GATHERS 4
#define KD_ROWS_PER_BLOCK 128
#define KD_THREADS 256
#define KD_PIECE 512u  // bytes of a contiguous row one warp copies per work item (32 x 16)
#define KD_CHUNK 65536ull  // bytes of a plain copy per block step

#define RULE_ALL 0
#define RULE_LABELS 1
#define RULE_MASKED 2
#define RULE_PSUM 3

#define SLOT_MAGIC 0x5352444bu    // "KDRS": a device ring slot header
#define RECORD_MAGIC 0x5244444bu  // "KDDR": the call record in the twin

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
  u64 token_ptr;   // u64 replay counter of a graph site (0: eager call, token 1)
  u64 record;      // the call record in the journal slot's twin (64 bytes)
  u64 host_pre;    // the host slot's `pre` marker, mapped (0: none)
  u64 seq;         // the journal slot's seq
  u64 call_index;
  u32 n_copies;
  u32 n_gathers;
  u32 rule_kind;
  u32 rule_n;      // entries of the rule array
  u32 rows;        // rows of the gathered tensors (outer * inner)
  u32 inner;       // rows per outer index (masked: max_m; else rows)
  u32 alignment;   // psum layout: groups start at multiples of it
  u32 rec_bytes;   // bytes per record (a multiple of 16)
  u32 slot_index;  // the journal slot
  u32 gather_blocks;
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

// The host mirrors (kdump/record/gather.py) rely on these sizes.
static_assert(sizeof(Copy) == 24, "Copy layout");
static_assert(sizeof(Gather) == 48, "Gather layout");
static_assert(sizeof(Params) == 696, "Params layout");
static_assert(sizeof(SlotHead) == 64, "SlotHead layout");
static_assert(sizeof(Record) == 64, "Record layout");

__device__ __forceinline__ u64 slot_pos(const Params& p, u64 head) {
  // A slot never wraps around the end: skip to the next lap instead.
  if (p.ring_bytes == 0) return head;  // no device ring: nothing is gathered
  u64 phys = head % p.ring_bytes;
  return phys + p.worst > p.ring_bytes ? head - phys + p.ring_bytes : head;
}

__device__ __forceinline__ bool touched(const Params& p, u32 r) {
  const int* rule = (const int*)p.rule;
  switch (p.rule_kind) {
    case RULE_LABELS:
      return r < p.rule_n && rule[r] >= 0;
    case RULE_MASKED: {
      u32 g = r / p.inner;
      return g < p.rule_n && (int)(r % p.inner) < rule[g];
    }
    case RULE_PSUM: {
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

__device__ void copy_bytes(char* dst, const char* src, u64 n, u32 lane, u32 lanes) {
  if ((((u64)dst | (u64)src | n) & 15) == 0) {
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
#pragma unroll 8
    for (u64 i = lane; i < n / 16; i += lanes) d[i] = s[i];
  } else if ((((u64)dst | (u64)src | n) & 3) == 0) {
    const u32* s = (const u32*)src;
    u32* d = (u32*)dst;
    for (u64 i = lane; i < n / 4; i += lanes) d[i] = s[i];
  } else {
    for (u64 i = lane; i < n; i += lanes) dst[i] = src[i];
  }
}

__device__ __forceinline__ bool contiguous(const Gather& g) {
  return g.cols == 1 || g.col_stride == (i64)g.elem;
}

__device__ void copy_row(const Gather& g, u32 r, u32 inner, char* rec, u32 lane) {
  const char* row = (const char*)g.src + (i64)(r / inner) * g.outer_stride +
                    (i64)(r % inner) * g.inner_stride;
  char* out = rec + g.rec_off;
  if (g.cols == 1 || g.col_stride == (i64)g.elem) {
    copy_bytes(out, row, (u64)g.cols * g.elem, lane, 32);
    return;
  }
  for (u32 c = lane; c < g.cols; c += 32) {
    const char* e = row + (i64)c * g.col_stride;
    char* o = out + (u64)c * g.elem;
    if (g.elem == 4 && (((u64)e | (u64)o) & 3) == 0) {
      *(u32*)o = *(const u32*)e;
    } else {
      for (u32 b = 0; b < g.elem; ++b) o[b] = e[b];
    }
  }
}

extern "C" __global__ void __launch_bounds__(KD_THREADS) kd_snapshot(const __grid_constant__ Params p) {
  __shared__ u32 s_count;
  __shared__ u32 s_base;
  __shared__ u32 s_rank[KD_ROWS_PER_BLOCK];
  __shared__ u32 s_rows[KD_ROWS_PER_BLOCK];
  __shared__ bool s_last;
  __shared__ u64 s_token, s_head;
  Record* rec = (Record*)p.record;
  volatile u64* ctrl = (volatile u64*)p.ctrl;
  const u32 tid = threadIdx.x;
  // One thread per block reads the shared words: every thread reading them would queue
  // thousands of requests on one L2 line.
  if (tid == 0) {
    s_token = p.token_ptr ? *(volatile u64*)p.token_ptr + 1 : 1;
    s_head = ctrl[0];
  }
  __syncthreads();
  const u64 token = s_token;
  const u64 head = s_head;
  const u64 pos = slot_pos(p, head);

  if (blockIdx.x == 0 && tid == 0 && p.host_pre) {
    *(volatile u64*)p.host_pre = token;  // the host slot now reads in flight until `post`
    __threadfence_system();
  }
  if (blockIdx.x < p.gather_blocks) {
    if (tid == 0) {
      ctrl[1] = pos + p.worst;  // what this launch may overwrite (salvage checks older slots)
      s_count = 0;
    }
    __syncthreads();
    const u32 r0 = blockIdx.x * KD_ROWS_PER_BLOCK;
    if (tid < KD_ROWS_PER_BLOCK) {
      u32 r = r0 + tid;
      if (r < p.rows && touched(p, r)) {
        u32 k = atomicAdd(&s_count, 1u);
        s_rows[k] = r;
      }
    }
    __syncthreads();
    if (tid == 0) s_base = s_count ? atomicAdd(&rec->row_counter, s_count) : 0;
    // Records in row order inside a block: rank = rows of this block below it.
    if (tid < s_count) {
      u32 mine = s_rows[tid], below = 0;
      for (u32 j = 0; j < s_count; ++j) below += s_rows[j] < mine;
      s_rank[tid] = below;
    }
    __syncthreads();
    char* slot = (char*)p.ring + (pos % p.ring_bytes);
    const u32 warp = tid / 32, lane = tid % 32;
    // Work items per row: KD_PIECE-byte pieces of each contiguous row, then one item for the
    // record head and the strided rows. Warps take items round robin, so even a block with one
    // touched row spreads its bytes over all its warps.
    u32 pieces = 0;
    for (u32 gi = 0; gi < p.n_gathers; ++gi) pieces += contiguous(p.gathers[gi])
        ? (p.gathers[gi].cols * p.gathers[gi].elem + KD_PIECE - 1) / KD_PIECE : 0;
    const u32 per_row = pieces + 1;
    for (u32 it = warp; it < s_count * per_row; it += KD_THREADS / 32) {
      const u32 j = it / per_row, q = it % per_row;
      const u32 r = s_rows[j];
      char* out = slot + sizeof(SlotHead) + (u64)(s_base + s_rank[j]) * p.rec_bytes;
      if (q == pieces) {
        if (lane == 0) {
          ((u32*)out)[0] = r;
          ((u32*)out)[1] = 0;
          ((u64*)out)[1] = 0;
        }
        for (u32 gi = 0; gi < p.n_gathers; ++gi)
          if (!contiguous(p.gathers[gi])) copy_row(p.gathers[gi], r, p.inner, out, lane);
        continue;
      }
      u32 c = q;  // the piece: find its gather
      for (u32 gi = 0; gi < p.n_gathers; ++gi) {
        const Gather& g = p.gathers[gi];
        if (!contiguous(g)) continue;
        const u32 n = g.cols * g.elem, k = (n + KD_PIECE - 1) / KD_PIECE;
        if (c < k) {
          const char* row = (const char*)g.src + (i64)(r / p.inner) * g.outer_stride +
                            (i64)(r % p.inner) * g.inner_stride;
          const u32 at = c * KD_PIECE, len = n - at < KD_PIECE ? n - at : KD_PIECE;
          copy_bytes(out + g.rec_off + at, row + at, len, lane, 32);
          break;
        }
        c -= k;
      }
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
  // The last block to finish publishes the call.
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&rec->done_blocks, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last || tid != 0) return;
  __threadfence();
  const u32 rows = *(volatile u32*)&rec->row_counter;
  u64 used = 0;
  if (p.gather_blocks) {
    used = ((u64)sizeof(SlotHead) + (u64)rows * p.rec_bytes + 255) / 256 * 256;
    SlotHead* h = (SlotHead*)((char*)p.ring + (pos % p.ring_bytes));
    h->magic = SLOT_MAGIC;
    h->slot_index = p.slot_index;
    h->seq = p.seq;
    h->token = token;
    h->pos = pos;
    h->rows = rows;
    h->rec_bytes = p.rec_bytes;
    h->used = used;
    h->call_index = p.call_index;
    __threadfence();
    h->complete = token;
    ctrl[0] = pos + used;
  }
  rec->magic = RECORD_MAGIC;
  rec->rows = rows;
  rec->seq = p.seq;
  rec->pos = p.gather_blocks ? pos : ~0ull;
  rec->call_index = p.call_index;
  rec->head_after = p.gather_blocks ? pos + used : head;
  rec->row_counter = 0;
  rec->done_blocks = 0;
  rec->token = token;
  __threadfence();
  rec->complete = token;
  if (p.token_ptr) *(volatile u64*)p.token_ptr = token;
  __threadfence();
}
