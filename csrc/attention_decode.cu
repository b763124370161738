// Paged decode attention: one query token per sequence over its paged K/V.
//
// One thread block (CTA) per (sequence, KV head [, chunk of its query-head group], split); the heads of
// a sequence are adjacent in blockIdx.x, so they run together and share DRAM pages. The CTA reads each
// key and value row of its KV head once for all the query heads it serves (GQA). K and V rows stream
// through shared memory in tiles of TT tokens with an S-stage cp.async pipeline (sm_80+; plain loads on
// older GPUs; on sm_90+ the tensor-core kernel's rows come by bulk copies completing on one mbarrier per
// stage): the K and V loads of a tile are issued together, S - 1 tiles ahead of the one being computed, so
// a CTA pays about one memory latency however many tiles it reads. Block-table entries go
// through shared memory in windows of one entry per thread, each loaded a whole window ahead, so no tile
// issue waits on a table read. There is one __syncthreads per tile: each token group of lanes keeps its own online
// softmax (max, sum) and fp32 accumulator, and groups and warps are combined once at the end.
//
// Splits (flash-decoding): with few sequences the context is split over blockIdx.z. A sequence spreads
// its own attended span over the grid's splits in multiples of UNIT tokens (a few tiles, at least
// kMinSplitTokens), so short contexts use few CTAs and the rest exit at once; a span of at most one unit
// plus kSinglePassExtraTiles tiles is not split at all (one CTA, no merge). Each split writes a
// normalised partial output plus its (max, sum); the last CTA of a (sequence, KV-head chunk) to finish
// -- an atomic ticket in the workspace that this CTA resets to zero, so CUDA graph replays find it zero
// again -- merges the partials (the reads of up to ~20 splits in flight at once) and writes the output,
// with no second launch. The grid only depends on host-side sizes, so a CUDA graph captured for a
// maximum context stays valid for shorter ones.
//
// Two kernels share that structure (Work/plan_work, Pipeline, finish): the FMA kernel below (every GPU,
// dtype and head size) and the tensor-core kernel further down (sm_80+, fp16/bf16, head sizes up to
// 128), which runs large batches by default; launch_for_gq chooses. On sm_90 the tensor-core kernel takes
// its tiles as TMA boxes, and a call without splits runs persistent instead (a resident grid whose CTAs
// take (sequence, KV head) units in turn, a producer warp streaming their tiles without a break between
// units: paged_decode_tma_persistent_kernel).
//
// FMA kernel lane layout: LPT lanes share one token, each loading VEC contiguous elements per vector and
// NV vectors (strided by LPT * VEC) of the head; a warp covers TPW = 32 / LPT tokens at a time. LPT
// and VEC are chosen so that a lane holds at most ~32 fp32 values of q (and of the accumulator).
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <type_traits>

#include "common.cuh"
#include "hopper.cuh"

namespace WLLM_NS {
namespace decode {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMinBlockSize = 8;          // block sizes are powers of two >= this
constexpr int kTargetCtas = 512;          // split the context until the grid has about this many CTAs
constexpr int kSplitUnit = 128;           // host-side grid bound: at most one split per this many tokens
constexpr int kMinSplitTokens = 32;       // a split covers at least this many tokens (whole tiles)
constexpr int kTileBytes = 4096;          // target bytes of one K (or V) tile in shared memory
constexpr int kStageBudget = 44 * 1024;   // shared-memory bytes for all pipeline stages of a CTA
constexpr int kCounterSlots = 4096;       // fused-merge tickets at the start of the workspace
constexpr int64_t kCounterBytes = kCounterSlots * 4;

constexpr int pow2_ceil(int x) { return x <= 1 ? 1 : 2 * pow2_ceil((x + 1) / 2); }
constexpr int cmin(int a, int b) { return a < b ? a : b; }
constexpr int cmax(int a, int b) { return a > b ? a : b; }

template <typename T, int D, int GQ>
struct Layout {
  static constexpr int kElemTarget = cmax((sizeof(T) == 4 ? 16 : 32) / GQ, 4);  // q values per lane per head
  static constexpr int VEC = cmin(kElemTarget, 16 / (int)sizeof(T));
  static constexpr int NVEC = D / VEC;
  static constexpr int LPT = cmin(32, cmax(GQ, pow2_ceil((D + kElemTarget - 1) / kElemTarget)));
  static constexpr int NV = (NVEC + LPT - 1) / LPT;
  static constexpr int TPW = 32 / LPT;
  static constexpr int HEADS_PER_LANE = LPT / GQ;  // lanes that end up holding one head's score
  static_assert(D % VEC == 0, "head size must be a multiple of the vector width");
  static_assert(LPT >= GQ, "the score reduction needs at least one lane per head");
};

// VEC elements of T, moved as one 8- or 16-byte access and kept as 32-bit words, so that 16-bit
// pairs stay packed in one register until they are converted.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  uint32_t w[VEC * sizeof(T) / 4];
};

template <typename T>
__device__ __forceinline__ void word_to_float(uint32_t w, float* out);
template <>
__device__ __forceinline__ void word_to_float<float>(uint32_t w, float* out) {
  out[0] = __uint_as_float(w);
}
template <>
__device__ __forceinline__ void word_to_float<__half>(uint32_t w, float* out) {
  __half2 h;
  memcpy(&h, &w, 4);
  const float2 f = __half22float2(h);
  out[0] = f.x;
  out[1] = f.y;
}
template <>
__device__ __forceinline__ void word_to_float<__nv_bfloat16>(uint32_t w, float* out) {
  // bf16 is the top half of an fp32: widening is a shift or a mask.
  out[0] = __uint_as_float(w << 16);
  out[1] = __uint_as_float(w & 0xffff0000u);
}

template <typename T, int VEC>
__device__ __forceinline__ void to_float(const Vec<T, VEC>& in, float* out) {
  constexpr int kPerWord = 4 / (int)sizeof(T);
#pragma unroll
  for (int i = 0; i < VEC / kPerWord; ++i) word_to_float<T>(in.w[i], out + i * kPerWord);
}

// Shared-memory tiling of one instantiation: TT tokens per tile (a multiple of the tokens all warps
// cover in one pass), K and V rows padded so that the token groups of a warp hit different banks,
// S pipeline stages within the static shared-memory budget.
template <typename T, int D, int GQ>
struct Tiling {
  using L = Layout<T, D, GQ>;
  static constexpr bool TMA = false;
  static constexpr int THREADS = kThreads, WARPS = kWarps;
  static constexpr int kElem = (int)sizeof(T);
  static constexpr int ROW_BYTES = D * kElem + (L::LPT < 8 ? L::LPT * L::VEC * kElem : 16);
  static constexpr int PASS = kWarps * L::TPW;  // tokens the CTA covers in one pass
  static constexpr int TT = cmax(PASS, kTileBytes / (D * kElem) / PASS * PASS);
  static constexpr int U = TT / PASS;  // passes per tile
  static constexpr int STAGE_BYTES = 2 * TT * ROW_BYTES;
  static constexpr int S = cmin(6, cmax(2, kStageBudget / STAGE_BYTES));
  static constexpr int CPR = D * kElem / 16;  // 16-byte chunks per row
  static constexpr int NCH = (TT * CPR + kThreads - 1) / kThreads;  // chunks per thread per K (or V) tile
  // Tokens a split covers at least, whole tiles. Short: with few sequences most SMs are idle, and a
  // tile's compute (a chain of shuffles, exps and one __syncthreads) costs more than the extra CTA and
  // the extra partial, which the merge reads in the same round trip as the others.
  static constexpr int UNIT = (cmax(kMinSplitTokens, TT) + TT - 1) / TT * TT;
  static constexpr int ACC_BYTES = kWarps * GQ * D * 4;  // the end-of-loop combine reuses the stages
  static constexpr int SMEM_BYTES = cmax(S * STAGE_BYTES, ACC_BYTES);
  static constexpr int USABLE_BYTES = SMEM_BYTES;  // of it, from the kernel's smem pointer
  static_assert(ROW_BYTES % 16 == 0, "rows must keep 16-byte alignment for cp.async");
  static_assert(SMEM_BYTES <= 44 * 1024, "static shared memory must stay under 48 KB");
  static_assert(TT % PASS == 0 && TT * CPR <= NCH * kThreads, "tile shape");
};

// 16-byte global -> shared copy: asynchronous (cp.async, L2 only) on sm_80+, an L2 load (__ldcg) and a
// store before that (then the pipeline is synchronous but still correct). L2 only matters for the fused
// merge, which reads partials other CTAs wrote.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
  *static_cast<uint4*>(smem) = __ldcg(static_cast<const uint4*>(gmem));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

struct Params {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  unsigned int* counters;  // [S * KV heads * chunks] tickets, zero between calls (fused merge)
  float* partial_out;      // [S, Hq, splits, D] (split mode)
  float* partial_stats;    // [S, Hq, splits, 2] = (max, sum) (split mode)
  int64_t q_seq_stride, q_head_stride, out_seq_stride, out_head_stride;
  int64_t block_stride, token_stride, head_stride, block_table_stride;
  int num_heads, num_kv_heads, group, chunks, per_chunk;
  int block_shift;
  int splits, split_unit;
  int single_max;  // spans up to this many tokens are never split (set per instantiation)
  int fused;  // 1: the last split CTA merges; 0: merge_splits_kernel runs after
  float scale, softcap;
  int window;
};

// A sequence whose attended span is at most one split unit plus this many tiles runs in one CTA per
// (KV head, chunk) even when the grid has splits: a couple of tiles more in one CTA (one more memory
// round trip, overlapped with compute) cost less than the partial write, fence, ticket and merge reads
// of a second split (about four dependent L2 round trips).
constexpr int kSinglePassExtraTiles = 2;

// True when one CTA covers the sequence's whole span (no partials, no merge).
__device__ __forceinline__ bool single_pass(int span, int splits, int single_max) {
  return splits == 1 || span <= single_max;
}

// Tokens per split for a sequence that splits: its attended span spread over the grid's splits in
// multiples of `unit` (the grid itself is fixed by the host-side maximum, which keeps CUDA graphs valid).
__device__ __forceinline__ int seq_split_tokens(int span, int splits, int unit) {
  const int per = (span + splits - 1) / splits;
  return max((per + unit - 1) / unit, 1) * unit;
}

// Splits of a sequence that hold tokens (<= splits, as split_tokens >= span / splits).
__device__ __forceinline__ int active_splits(int span, int splits, int unit, int single_max) {
  if (span <= 0) return 0;
  if (single_pass(span, splits, single_max)) return 1;
  const int st = seq_split_tokens(span, splits, unit);
  return (span + st - 1) / st;
}

// Block-table entries stream through shared memory in windows of THREADS entries (two slots, one entry
// per thread), loaded one window ahead into a register of each thread, so that issuing a tile never
// waits on a global load of its block ids (under full bandwidth load that round trip, once per tile,
// set the pace). A tile spans far fewer entries than a window.
template <int THREADS>
struct IdWindow {
  static constexpr int SHIFT = THREADS == 128 ? 7 : 6;
  static_assert((1 << SHIFT) == THREADS, "windows of 64 or 128 entries");
};

// This thread's entry of window w: table index tb0 + w * THREADS + threadIdx.x, 0 past the span's last
// block (the row may end there: never read past it).
template <int THREADS>
__device__ __forceinline__ int load_window(const int32_t* table, int tb0, int tb_last, int w) {
  const int idx = tb0 + w * THREADS + (int)threadIdx.x;
  return idx <= tb_last ? __ldg(table + idx) : 0;
}

// Block id of table row r (relative to tb0) from the window slots.
template <int THREADS>
__device__ __forceinline__ int window_id(const int (*ids)[THREADS], int r) {
  return ids[(r >> IdWindow<THREADS>::SHIFT) & 1][r & (THREADS - 1)];
}

// Issues the cp.async copies of one K/V tile: chunk c = threadIdx.x + i * THREADS of the tile is
// row c / CPR, 16-byte column c % CPR; the row's block id comes from the shared-memory window slots.
// The row of position skip_pos (-1: none) is left out (see the PDL note in the kernel). Rows past `end`
// are never read from global memory; with ZERO_TAIL they are zero-filled in shared memory (the tensor-core
// kernel multiplies whole 16-row slices, and 0 * garbage may be NaN), otherwise left as they are.
template <typename TL, bool ZERO_TAIL, typename T>
__device__ __forceinline__ void issue_tile(unsigned char* stage, const T* k_cache, const T* v_cache,
                                           const int (*ids)[TL::THREADS], int tb0, int tile0, int end,
                                           const Params& p, int block_mask, int skip_pos) {
  constexpr int kPerChunk = 16 / (int)sizeof(T);
#pragma unroll
  for (int i = 0; i < TL::NCH; ++i) {
    const int c = threadIdx.x + i * TL::THREADS;
    const int row = c / TL::CPR, col = c - row * TL::CPR;
    const int pos = tile0 + row;
    if (c >= TL::TT * TL::CPR) continue;
    unsigned char* dst = stage + row * TL::ROW_BYTES + col * 16;
    if (pos < end) {
      if (pos != skip_pos) {
        const int id = window_id<TL::THREADS>(ids, (pos >> p.block_shift) - tb0);
        const int64_t off = (int64_t)id * p.block_stride + (int64_t)(pos & block_mask) * p.token_stride +
                            col * kPerChunk;
        cp_async16(dst, k_cache + off);
        cp_async16(dst + TL::TT * TL::ROW_BYTES, v_cache + off);
      }
    } else if (ZERO_TAIL) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(dst + TL::TT * TL::ROW_BYTES) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// sm_90+ device code: the tensor-core kernel's K and V rows come by bulk copies (the TMA engine), one
// instruction per row instead of D / 8 16-byte cp.async with their address arithmetic each; the
// instruction issue of those copies was what kept its few warps per SM (shared memory allows six 2-warp
// CTAs) from keeping more bytes in flight.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kBulkRows = true;
#else
constexpr bool kBulkRows = false;
#endif

// issue_tile for kBulkRows: thread t copies row t % TT of K (t < TT) or V as one bulk copy and arrives on
// the stage's barrier (which counts THREADS arrivals); a row left out or past `end` only arrives (rows past
// `end` zero-filled first with ZERO_TAIL).
template <typename TL, bool ZERO_TAIL, typename T>
__device__ __forceinline__ void issue_tile_bulk(unsigned char* stage, uint64_t* bar, const T* k_cache,
                                                const T* v_cache, const int (*ids)[TL::THREADS], int tb0, int tile0,
                                                int end, const Params& p, int block_mask, int skip_pos) {
  static_assert(2 * TL::TT == TL::THREADS, "one K or V row per thread");
  const int row = (int)threadIdx.x % TL::TT, is_v = (int)threadIdx.x / TL::TT;
  const int pos = tile0 + row;
  unsigned char* dst = stage + is_v * TL::TT * TL::ROW_BYTES + row * TL::ROW_BYTES;
  if (pos < end && pos != skip_pos) {
    const int id = window_id<TL::THREADS>(ids, (pos >> p.block_shift) - tb0);
    const int64_t off = (int64_t)id * p.block_stride + (int64_t)(pos & block_mask) * p.token_stride;
    const T* src = (is_v ? v_cache : k_cache) + off;
    hopper::mbar_expect_tx(smem_addr(bar), TL::CPR * 16);
    hopper::bulk_load(smem_addr(dst), src, TL::CPR * 16, smem_addr(bar));
    return;
  }
  if (ZERO_TAIL && pos >= end) {
#pragma unroll
    for (int c = 0; c < TL::CPR; ++c) reinterpret_cast<uint4*>(dst)[c] = make_uint4(0u, 0u, 0u, 0u);
  }
  hopper::mbar_arrive(smem_addr(bar));
}

// issue_tile for TL::TMA: thread 0 raises the stage barrier's transaction count (its one arrival) and
// issues, per cache block of the tile that holds rows before `end`, one box of min(block size, TT) rows x
// 64 columns per column block for K and for V, into [column block][TT rows][128 bytes] (128-byte swizzled
// by the TMA engine). Rows past `end` are left as they are; the kernel zeroes V's (tma_zero_tail).
template <typename TL>
__device__ __forceinline__ void issue_tile_tma(unsigned char* stage, uint64_t* bar, const CUtensorMap* map_k,
                                               const CUtensorMap* map_v, const int (*ids)[TL::THREADS], int tb0,
                                               int tile0, int end, const Params& p, int col0) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if (threadIdx.x != 0) return;
  constexpr int H = TL::DIM / 64;
  const int bs = 1 << p.block_shift;
  const int rows = bs < TL::TT ? bs : TL::TT;
  const int boxes = min(TL::TT / rows, (end - tile0 + rows - 1) / rows);
  hopper::mbar_expect_tx(smem_addr(bar), (uint32_t)(2 * H * boxes * rows * 128));
  for (int b = 0; b < boxes; ++b) {
    const int pos = tile0 + b * rows;
    const int id = window_id<TL::THREADS>(ids, (pos >> p.block_shift) - tb0);
#pragma unroll
    for (int h = 0; h < H; ++h) {
      unsigned char* dst = stage + h * TL::TT * 128 + b * rows * 128;
      hopper::tma_load_3d(smem_addr(dst), map_k, col0 + 64 * h, pos & (bs - 1), id, smem_addr(bar));
      hopper::tma_load_3d(smem_addr(dst + TL::TT * TL::ROW_BYTES), map_v, col0 + 64 * h, pos & (bs - 1), id,
                          smem_addr(bar));
    }
  }
#endif
}

// TL::TMA, the tile starting at tile0 once landed: zero its V rows at and past `end` (stale or never
// written shared memory; the MMA multiplies whole 16-row slices by P, and 0 * NaN is NaN). K's rows there
// only feed scores that are masked to -inf by selection.
template <typename TL>
__device__ __forceinline__ void tma_zero_tail(unsigned char* stage, int tile0, int end) {
  const int first = end - tile0;
  if (first >= TL::TT) return;
  constexpr int H = TL::DIM / 64;
  unsigned char* v = stage + TL::TT * TL::ROW_BYTES;
  for (int i = threadIdx.x; i < H * TL::TT * 8; i += TL::THREADS) {
    const int h = i / (TL::TT * 8), r = (i / 8) % TL::TT;
    if (r >= first) reinterpret_cast<uint4*>(v + h * TL::TT * 128 + r * 128)[i % 8] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// What one CTA covers: blockIdx.x = sequence * (KV heads x chunks) + KV-head chunk, so the CTAs of one
// sequence's heads are launched together and read the interleaved head rows of the same cache blocks at
// about the same time (DRAM pages opened once rather than once per wave); blockIdx.z = split.
struct Work {
  int seq, kv_head, head0, heads, split;
  int seq_len, begin, end, n_active;
};

// Unit u = (sequence, KV head, chunk of its query-head group) of a call, in blockIdx.x order: the heads of
// a sequence are adjacent. Sets everything of w but the split and the span.
__device__ __forceinline__ void unit_work(const Params& p, int u, Work& w) {
  const int pairs = p.num_kv_heads * p.chunks;
  w.seq = u / pairs;
  const int hc = u - w.seq * pairs;
  w.kv_head = hc / p.chunks;
  const int g0 = (hc - w.kv_head * p.chunks) * p.per_chunk;
  w.heads = min(p.per_chunk, p.group - g0);  // query heads this CTA serves
  w.head0 = w.kv_head * p.group + g0;
}

// Zeros as the output of w's query heads (an empty sequence: a graph padding row gets zeros, never
// uninitialised memory), written by the first THREADS threads.
template <typename T, int D, int THREADS>
__device__ __forceinline__ void zero_output(const Params& p, const Work& w) {
  T* out = static_cast<T*>(p.out) + (int64_t)w.seq * p.out_seq_stride;
  for (int i = threadIdx.x; i < w.heads * D; i += THREADS) {
    out[(int64_t)(w.head0 + i / D) * p.out_head_stride + i % D] = Conv<T>::from_float(0.0f);
  }
}

// PDL (see common.cuh): seq_lens comes from a memory copy, so it is read before pdl_wait(). Returns false
// when this CTA has nothing to attend (after waiting, and after writing zeros for an empty sequence: a
// graph padding row gets zeros, never uninitialised memory).
template <typename T, int D, int THREADS>
__device__ __forceinline__ bool plan_work(const Params& p, Work& w) {
  unit_work(p, (int)blockIdx.x, w);
  w.split = blockIdx.z;
  w.seq_len = max(p.seq_lens[w.seq], 0);
  const int lo = p.window > 0 ? max(0, w.seq_len - p.window) : 0;
  const int span = w.seq_len - lo;
  w.n_active = active_splits(span, p.splits, p.split_unit, p.single_max);
  if (w.n_active == 0 || w.split >= w.n_active) {
    pdl_wait_and_trigger<PDL_ATTENTION>();
    if (w.n_active == 0 && w.split == 0) zero_output<T, D, THREADS>(p, w);
    return false;  // an empty sequence, or an idle split: no tokens, no ticket
  }
  w.begin = lo;
  w.end = w.seq_len;
  if (w.n_active > 1) {
    const int st = seq_split_tokens(span, p.splits, p.split_unit);
    w.begin = lo + w.split * st;
    w.end = min(w.seq_len, w.begin + st);
  }
  return true;
}

// The K/V pipeline of one CTA: block-id windows and the tile copies ahead of the one being computed.
// BULK: rows by bulk copies completing on one mbarrier per stage (issue_tile_bulk), else cp.async groups.
template <typename TL, bool ZERO_TAIL, typename T, bool BULK = false>
struct Pipeline {
  uint64_t* bars;  // BULK: [S] stage barriers in shared memory
  const T* k_cache;
  const T* v_cache;
  const int32_t* table;
  int tb0, tb_last, block_mask, begin, end, num_tiles;
  int have;         // the highest window held in s_ids (window w sits in slot w & 1)
  int next_window;  // this thread's entry of window have + 1
  const CUtensorMap* map_k;  // TL::TMA: the caches' tensor maps and this CTA's first column in them
  const CUtensorMap* map_v;
  int col0;

  // Block-id windows 0 and 1 (one round trip; window 2 stays in flight in a register), then the copies
  // of the first S - 1 tiles, which lie within windows 0 and 1; then pdl_wait() and the newest row.
  // The newest row may still be being written by the previous kernel: the prologue tiles leave it out and
  // it is loaded after pdl_wait() (one 16-byte chunk of its K and V rows per thread, an L2 load stored
  // straight into its stage; the __syncthreads at the top of the tile loop publishes it with the
  // cp.async data). Tiles issued in the main loop come after the wait. TL::TMA copies whole cache blocks,
  // so the prologue tile holding the newest row is issued after pdl_wait() instead.
  __device__ __forceinline__ void start(const Params& p, const Work& w, unsigned char* smem,
                                        int (*s_ids)[TL::THREADS], uint64_t* stage_bars = nullptr,
                                        const CUtensorMap* tma_k = nullptr, const CUtensorMap* tma_v = nullptr) {
    bars = stage_bars;
    map_k = tma_k;
    map_v = tma_v;
    col0 = w.kv_head * (int)p.head_stride;
    if (BULK && threadIdx.x == 0) {  // published by the __syncthreads below
      for (int s = 0; s < TL::S; ++s) hopper::mbar_init(smem_addr(bars + s), TL::TMA ? 1 : TL::THREADS);
      hopper::fence_mbar_init();
    }
    k_cache = static_cast<const T*>(p.k_cache) + (int64_t)w.kv_head * p.head_stride;
    v_cache = static_cast<const T*>(p.v_cache) + (int64_t)w.kv_head * p.head_stride;
    table = p.block_tables + (int64_t)w.seq * p.block_table_stride;
    block_mask = (1 << p.block_shift) - 1;
    begin = w.begin;
    end = w.end;
    num_tiles = (end - begin + TL::TT - 1) / TL::TT;
    tb0 = begin >> p.block_shift;
    tb_last = (end - 1) >> p.block_shift;
    have = 1;
    {
      const int w0 = load_window<TL::THREADS>(table, tb0, tb_last, 0);
      const int w1 = load_window<TL::THREADS>(table, tb0, tb_last, 1);
      next_window = load_window<TL::THREADS>(table, tb0, tb_last, 2);
      s_ids[0][threadIdx.x] = w0;
      s_ids[1][threadIdx.x] = w1;
    }
    __syncthreads();
    const int newest = w.seq_len - 1;
    const int t_new = (newest - begin) / TL::TT;  // tile of the newest row when this CTA covers it
    const bool new_in_prologue = newest >= begin && newest < end && t_new < TL::S - 1;
#pragma unroll
    for (int s = 0; s < TL::S - 1; ++s) {
      if (s < num_tiles && !(TL::TMA && new_in_prologue && s == t_new)) {
        issue(smem, s, s_ids, begin + s * TL::TT, p, newest);
      }
      cp_async_commit();  // empty groups keep the group count uniform
    }
    pdl_wait_and_trigger<PDL_ATTENTION>();
    if constexpr (TL::TMA) {
      if (new_in_prologue) issue(smem, t_new, s_ids, begin + t_new * TL::TT, p, -1);
    } else if (new_in_prologue && (int)threadIdx.x < TL::CPR) {
      constexpr int kPerChunk = 16 / (int)sizeof(T);
      const int id = window_id<TL::THREADS>(s_ids, (newest >> p.block_shift) - tb0);
      const int64_t off = (int64_t)id * p.block_stride + (int64_t)(newest & block_mask) * p.token_stride +
                          (int)threadIdx.x * kPerChunk;
      unsigned char* dst = smem + t_new * TL::STAGE_BYTES + (newest - begin - t_new * TL::TT) * TL::ROW_BYTES +
                           threadIdx.x * 16;
      *reinterpret_cast<uint4*>(dst) = __ldcg(reinterpret_cast<const uint4*>(k_cache + off));
      *reinterpret_cast<uint4*>(dst + TL::TT * TL::ROW_BYTES) = __ldcg(reinterpret_cast<const uint4*>(v_cache + off));
    }
  }

  // Issues the copies of the tile starting at tile0 into `stage`.
  __device__ __forceinline__ void issue(unsigned char* smem, int stage, const int (*s_ids)[TL::THREADS], int tile0,
                                        const Params& p, int skip_pos) {
    if constexpr (TL::TMA) {
      issue_tile_tma<TL>(smem + stage * TL::STAGE_BYTES, bars + stage, map_k, map_v, s_ids, tb0, tile0, end, p, col0);
    } else if constexpr (BULK) {
      issue_tile_bulk<TL, ZERO_TAIL>(smem + stage * TL::STAGE_BYTES, bars + stage, k_cache, v_cache, s_ids, tb0,
                                     tile0, end, p, block_mask, skip_pos);
    } else {
      issue_tile<TL, ZERO_TAIL>(smem + stage * TL::STAGE_BYTES, k_cache, v_cache, s_ids, tb0, tile0, end, p,
                                block_mask, skip_pos);
    }
  }

  // Top of tile j: waits for it (this thread's copies or the stage's barrier, then everyone: all threads
  // are also done with tile j - 1), then issues tile j + S - 1 into the stage tile j - 1 used.
  __device__ __forceinline__ void advance(int j, const Params& p, unsigned char* smem, int (*s_ids)[TL::THREADS]) {
    if constexpr (BULK) {
      const unsigned parity = (unsigned)(j / TL::S) & 1u;
      hopper::mbar_wait(smem_addr(bars + j % TL::S), parity);
      if constexpr (TL::TMA) tma_zero_tail<TL>(smem + (j % TL::S) * TL::STAGE_BYTES, begin + j * TL::TT, end);
    } else {
      cp_async_wait<TL::S - 2>();
    }
    __syncthreads();
    if (j + TL::S - 1 < num_tiles) {
      const int tile_in = begin + (j + TL::S - 1) * TL::TT;
      const int last_window = (((min(end, tile_in + TL::TT) - 1) >> p.block_shift) - tb0) >> IdWindow<TL::THREADS>::SHIFT;
      if (last_window > have) {
        // The tile reaches the next window (uniform over the CTA; one step at most). Its slot held window
        // have - 1, whose last reader issued before the __syncthreads above; the register was loaded a
        // whole window of tiles ago.
        s_ids[(have + 1) & 1][threadIdx.x] = next_window;
        __syncthreads();
        ++have;
        next_window = load_window<TL::THREADS>(table, tb0, tb_last, have + 1);
      }
      issue(smem, (j + TL::S - 1) % TL::S, s_ids, tile_in, p, -1);
    }
    cp_async_commit();
  }
};

// End of a CTA: s_acc [WARPS][GQ][D] holds each warp's unnormalised output and s_m / s_l [WARPS][GQ] its
// running (max, sum) per head. The warps are combined; a CTA that covers the whole span writes the
// output, a split writes its normalised partial and (max, sum), and with the fused merge the last split
// CTA of a (sequence, KV-head chunk) to finish -- an atomic ticket in the workspace that this CTA resets
// to zero, so CUDA graph replays find it zero again -- merges all partials and writes the output.
//
// Everything here is on the critical path of a small batch (a merge whose per-element loops chained an
// exp per split took a sizeable share of a batch-1 call). So the exps run once per
// (warp or split, head) -- a thread per head, or a warp per head with a lane per split -- and each output
// element is then a dot product over warps or splits whose loads and FMAs do not wait on each other.
// Barrier over the CTA's first THREADS threads (named barrier 1) -- the consumer warps of a kernel whose
// producer warp does not take part -- or, with NAMED false, over the whole CTA.
template <bool NAMED, int THREADS>
__device__ __forceinline__ void cta_or_named_sync() {
  if constexpr (NAMED) {
    asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
  } else {
    __syncthreads();
  }
}

// NAMED: only the first TL::THREADS threads run this (see cta_or_named_sync), and the CTA covers the whole
// span (no splits).
template <typename T, int D, int GQ, typename TL, bool NAMED = false>
__device__ __forceinline__ void finish(const Params& p, const Work& w, unsigned char* smem, const float* s_m,
                                       const float* s_l, int* s_last) {
  constexpr int W = TL::WARPS;
  constexpr int R = (GQ * D + TL::THREADS - 1) / TL::THREADS;  // output elements per thread
  __shared__ float s_f[W * GQ];       // weight of warp ww's output in head h's (1 / sum folded in)
  __shared__ float s_hm[GQ], s_hl[GQ];  // per head: (max, sum); the merge's running values later
  __shared__ float s_r[GQ];           // merge: rescale of the running output per chunk
  const float* s_acc = reinterpret_cast<const float*>(smem);
  const bool direct = w.n_active == 1;  // this CTA holds the whole span: write the output itself
  if ((int)threadIdx.x < GQ) {
    const int h = threadIdx.x;
    float m = -INFINITY;
#pragma unroll
    for (int ww = 0; ww < W; ++ww) m = fmaxf(m, s_m[ww * GQ + h]);
    float f[W];
    float sum = 0.0f;
#pragma unroll
    for (int ww = 0; ww < W; ++ww) {
      f[ww] = s_m[ww * GQ + h] == -INFINITY ? 0.0f : __expf(s_m[ww * GQ + h] - m);
      sum += s_l[ww * GQ + h] * f[ww];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
    for (int ww = 0; ww < W; ++ww) s_f[ww * GQ + h] = f[ww] * inv;
    s_hm[h] = m;
    s_hl[h] = sum;
  }
  cta_or_named_sync<NAMED, TL::THREADS>();
  const int64_t row_base = ((int64_t)w.seq * p.num_heads + w.head0) * p.splits + w.split;
  for (int i = threadIdx.x; i < w.heads * D; i += TL::THREADS) {
    const int h = i / D, d = i - h * D;
    float o = 0.0f;
#pragma unroll
    for (int ww = 0; ww < W; ++ww) o = fmaf(s_f[ww * GQ + h], s_acc[(ww * GQ + h) * D + d], o);
    if (direct) {
      T* out = static_cast<T*>(p.out) + (int64_t)w.seq * p.out_seq_stride + (int64_t)(w.head0 + h) * p.out_head_stride;
      out[d] = Conv<T>::from_float(o);
    } else {
      const int64_t row = row_base + (int64_t)h * p.splits;
      p.partial_out[row * D + d] = o;
      if (d == 0) {
        p.partial_stats[row * 2] = s_hm[h];
        p.partial_stats[row * 2 + 1] = s_hl[h];
      }
    }
  }
  if (NAMED || direct || !p.fused) return;

  // ---- fused merge: the last split CTA of this (sequence, KV-head chunk) combines them all ------
  // One thread takes the ticket for the CTA: the barrier orders every thread's partials before its
  // release fence, and its fence after the ticket orders the loads below (the CUTLASS semaphore pattern).
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int* counter = p.counters + blockIdx.x;  // one ticket per (sequence, KV-head chunk)
    __threadfence();
    const unsigned int ticket = atomicAdd(counter, 1u);
    const bool last = ticket == (unsigned int)(w.n_active - 1);
    if (last) {
      *counter = 0u;  // every active split has arrived: leave it zero for the next call
      __threadfence();
    }
    *s_last = last;
  }
  __syncthreads();
  if (!*s_last) return;
  // The partials of up to kChunk splits are copied into the (now idle) stage memory all at once --
  // every 16-byte piece its own cp.async -- so a merge costs one L2 round trip per kChunk splits. While
  // they travel, warp ww turns the (max, sum) of heads ww, ww + W, ... into one weight per split (a lane
  // per split: kChunk <= 32) and the rescale of what earlier chunks summed.
  constexpr int kQuads = D / 4;
  constexpr int kChunk = cmin(32, TL::USABLE_BYTES / ((GQ * D + GQ) * (int)sizeof(float)));
  static_assert(kChunk >= 1 && D % 4 == 0, "merge staging");
  float* s_po = reinterpret_cast<float*>(smem);  // [kChunk][GQ][D] partial outputs
  float* s_w = s_po + kChunk * GQ * D;           // [kChunk][GQ] weights
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row0 = ((int64_t)w.seq * p.num_heads + w.head0) * p.splits;
  for (int h = warp; h < w.heads; h += W) {
    if (lane == 0) {
      s_hm[h] = -INFINITY;
      s_hl[h] = 0.0f;
    }
  }
  __syncwarp();  // each warp reads back only the heads its lane 0 reset
  float o[R];
#pragma unroll
  for (int r = 0; r < R; ++r) o[r] = 0.0f;
  for (int sp0 = 0; sp0 < w.n_active; sp0 += kChunk) {
    const int nc = min(kChunk, w.n_active - sp0);
    for (int c = threadIdx.x; c < w.heads * nc * kQuads; c += TL::THREADS) {
      const int hs = c / kQuads, q4 = c - hs * kQuads;
      const int h = hs / nc, sp = hs - h * nc;
      // cp.async.cg reads L2, where the other CTAs' partials are (never a stale L1 line).
      const int64_t row = row0 + (int64_t)h * p.splits + sp0 + sp;
      cp_async16(s_po + (sp * GQ + h) * D + q4 * 4, p.partial_out + row * D + q4 * 4);
    }
    cp_async_commit();
    for (int h = warp; h < w.heads; h += W) {  // uniform over the warp
      const float2 st = lane < nc ? __ldcg(reinterpret_cast<const float2*>(p.partial_stats) + row0 +
                                           (int64_t)h * p.splits + sp0 + lane)
                                  : make_float2(-INFINITY, 0.0f);
      float cm = st.x;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, off));
      const float m_old = s_hm[h];
      const float m_new = fmaxf(m_old, cm);
      const float wgt = st.x == -INFINITY ? 0.0f : st.y * __expf(st.x - m_new);
      const float lsum = warp_sum(wgt);
      if (lane < nc) s_w[lane * GQ + h] = wgt;
      __syncwarp();
      if (lane == 0) {
        const float resc = m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
        s_r[h] = resc;
        s_hm[h] = m_new;
        s_hl[h] = s_hl[h] * resc + lsum;
      }
    }
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = threadIdx.x + r * TL::THREADS;
      if (i < w.heads * D) o[r] *= s_r[i / D];
    }
    // Splits outer, elements inner: R independent FMA chains per thread.
    for (int sp = 0; sp < nc; ++sp) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int i = threadIdx.x + r * TL::THREADS;
        if (i < w.heads * D) {
          const int h = i / D, d = i - h * D;
          o[r] = fmaf(s_w[sp * GQ + h], s_po[(sp * GQ + h) * D + d], o[r]);
        }
      }
    }
    __syncthreads();  // the next chunk's copies overwrite the staging
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = threadIdx.x + r * TL::THREADS;
    if (i < w.heads * D) {
      const int h = i / D, d = i - h * D;
      const float l = s_hl[h];
      T* out = static_cast<T*>(p.out) + (int64_t)w.seq * p.out_seq_stride + (int64_t)(w.head0 + h) * p.out_head_stride;
      out[d] = Conv<T>::from_float(l > 0.0f ? o[r] / l : 0.0f);
    }
  }
}

template <typename T, int D, int GQ>
__global__ void __launch_bounds__(kThreads, 4) paged_decode_kernel(const Params p) {
  using L = Layout<T, D, GQ>;
  using TL = Tiling<T, D, GQ>;
  constexpr int VEC = L::VEC, NVEC = L::NVEC, LPT = L::LPT, NV = L::NV, TPW = L::TPW, HPL = L::HEADS_PER_LANE;
  constexpr int TT = TL::TT, U = TL::U, S = TL::S, ROW = TL::ROW_BYTES;
  typedef Vec<T, VEC> VecT;

  __shared__ __align__(16) unsigned char smem[TL::SMEM_BYTES];
  __shared__ float s_m[kWarps][GQ], s_l[kWarps][GQ];
  __shared__ int s_ids[2][kThreads];
  __shared__ int s_last;

  pdl_trigger_early<PDL_ATTENTION>();
  Work w;
  if (!plan_work<T, D, kThreads>(p, w)) return;
  const int heads = w.heads, head0 = w.head0, seq = w.seq, begin = w.begin, end = w.end;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int li = lane % LPT;   // lane within its token group
  const int tig = lane / LPT;  // token group within the warp
  const int gbase = tig * LPT;  // first lane of the group

  // PDL: the block table and every K/V row but the newest (written by an earlier step) are read before
  // pdl_wait(); q and the newest row (just written by rotary_and_cache / reshape_and_cache) after it.
  Pipeline<TL, false, T> pipe;
  pipe.start(p, w, smem, s_ids);
  const int num_tiles = pipe.num_tiles;

  // q (in flight with the first tiles), padded heads as zeros.
  float qf[GQ][NV][VEC];
  {
    const T* q_base =
        static_cast<const T*>(p.q) + (int64_t)seq * p.q_seq_stride + (int64_t)head0 * p.q_head_stride;
#pragma unroll
    for (int h = 0; h < GQ; ++h)
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int vi = li + v * LPT;
        if (h < heads && vi < NVEC) {
          to_float(*reinterpret_cast<const VecT*>(q_base + (int64_t)h * p.q_head_stride + vi * VEC), qf[h][v]);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) qf[h][v][e] = 0.0f;
        }
      }
  }

  // Per token group: the running max and sum of head li / HPL (replicated over its HPL lanes) and
  // the unnormalised output of every head over this lane's vectors.
  float m_own = -INFINITY, l_own = 0.0f;
  float acc[GQ][NV][VEC];
#pragma unroll
  for (int h = 0; h < GQ; ++h)
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[h][v][e] = 0.0f;

  for (int j = 0; j < num_tiles; ++j) {
    pipe.advance(j, p, smem, s_ids);

    const unsigned char* k_tile = smem + (j % S) * TL::STAGE_BYTES;
    const unsigned char* v_tile = k_tile + TT * TL::ROW_BYTES;
    const int tile0 = begin + j * TT;

    // ---- scores of this group's U tokens: sc[u] = head (li / HPL)'s score -------------------
    float sc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = u * TL::PASS + warp * TPW + tig;
      const bool valid = tile0 + t < end;  // uniform over the token group
      float part[GQ];
#pragma unroll
      for (int h = 0; h < GQ; ++h) part[h] = 0.0f;
      if (valid) {
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          const int vi = li + v * LPT;
          if (vi < NVEC) {
            float kf[VEC];
            to_float(*reinterpret_cast<const VecT*>(k_tile + t * ROW + vi * VEC * (int)sizeof(T)), kf);
#pragma unroll
            for (int h = 0; h < GQ; ++h)
#pragma unroll
              for (int e = 0; e < VEC; ++e) part[h] = fmaf(qf[h][v][e], kf[e], part[h]);
          }
        }
      }
      // Reduce-scatter the GQ partial sums over the LPT lanes of the token: each halving step
      // keeps half of the heads and trades the other half with the partner lane, so the work
      // is GQ - 1 + log2(LPT / GQ) shuffles instead of GQ * log2(LPT).
#pragma unroll
      for (int c = GQ; c > 1; c >>= 1) {
        const int offset = LPT * c / (2 * GQ);
        const bool upper = (li & offset) != 0;
#pragma unroll
        for (int i = 0; i < c / 2; ++i) {
          const float send = upper ? part[i] : part[i + c / 2];
          const float keep = upper ? part[i + c / 2] : part[i];
          part[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
      }
#pragma unroll
      for (int offset = HPL / 2; offset > 0; offset >>= 1) {
        part[0] += __shfl_xor_sync(0xffffffffu, part[0], offset);
      }
      float score = part[0] * p.scale;
      if (p.softcap > 0.0f) score = p.softcap * tanhf(score / p.softcap);
      sc[u] = valid ? score : -INFINITY;
    }

    // ---- online softmax of the group: rescale only when the running max grows ----------------
    float mx = sc[0];
#pragma unroll
    for (int u = 1; u < U; ++u) mx = fmaxf(mx, sc[u]);
    float r = 1.0f;
    if (mx > m_own) {
      r = __expf(m_own - mx);  // 0 while nothing was seen (m_own = -inf)
      m_own = mx;
    }
    float pr[U];
    float psum = 0.0f;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      pr[u] = sc[u] == -INFINITY ? 0.0f : __expf(sc[u] - m_own);
      psum += pr[u];
    }
    l_own = l_own * r + psum;
#pragma unroll
    for (int h = 0; h < GQ; ++h) {
      const float rh = __shfl_sync(0xffffffffu, r, gbase + h * HPL);
      if (rh != 1.0f) {
#pragma unroll
        for (int v = 0; v < NV; ++v)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[h][v][e] *= rh;
      }
    }

    // ---- values: acc[h] += p[h][t] * v[t] ----------------------------------------------------
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float w[GQ];
#pragma unroll
      for (int h = 0; h < GQ; ++h) w[h] = __shfl_sync(0xffffffffu, pr[u], gbase + h * HPL);
      const int t = u * TL::PASS + warp * TPW + tig;
      if (tile0 + t < end) {  // rows past the end were never loaded: never read them
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          const int vi = li + v * LPT;
          if (vi < NVEC) {
            float vf[VEC];
            to_float(*reinterpret_cast<const VecT*>(v_tile + t * ROW + vi * VEC * (int)sizeof(T)), vf);
#pragma unroll
            for (int h = 0; h < GQ; ++h)
#pragma unroll
              for (int e = 0; e < VEC; ++e) acc[h][v][e] = fmaf(w[h], vf[e], acc[h][v][e]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the combine below reuses the stage memory

  // ---- combine the token groups of each warp (max-rescaled), then the warps -----------------
  float mh[GQ], lh[GQ];
#pragma unroll
  for (int h = 0; h < GQ; ++h) {
    mh[h] = __shfl_sync(0xffffffffu, m_own, gbase + h * HPL);
    lh[h] = __shfl_sync(0xffffffffu, l_own, gbase + h * HPL);
  }
#pragma unroll
  for (int offset = LPT; offset < 32; offset <<= 1) {
#pragma unroll
    for (int h = 0; h < GQ; ++h) {
      const float m_o = __shfl_xor_sync(0xffffffffu, mh[h], offset);
      const float l_o = __shfl_xor_sync(0xffffffffu, lh[h], offset);
      const float m_new = fmaxf(mh[h], m_o);
      const float ra = mh[h] == -INFINITY ? 0.0f : __expf(mh[h] - m_new);
      const float rb = m_o == -INFINITY ? 0.0f : __expf(m_o - m_new);
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float a_o = __shfl_xor_sync(0xffffffffu, acc[h][v][e], offset);
          acc[h][v][e] = acc[h][v][e] * ra + a_o * rb;
        }
      lh[h] = lh[h] * ra + l_o * rb;
      mh[h] = m_new;
    }
  }
  float* s_acc = reinterpret_cast<float*>(smem);  // [kWarps][GQ][D]
  if (tig == 0) {
#pragma unroll
    for (int h = 0; h < GQ; ++h)
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int vi = li + v * LPT;
        if (vi < NVEC) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) s_acc[(warp * GQ + h) * D + vi * VEC + e] = acc[h][v][e];
        }
      }
    if (li == 0) {
#pragma unroll
      for (int h = 0; h < GQ; ++h) {
        s_m[warp][h] = mh[h];
        s_l[warp][h] = lh[h];
      }
    }
  }
  __syncthreads();

  finish<T, D, GQ, TL>(p, w, smem, &s_m[0][0], &s_l[0][0], &s_last);
}

// ---- tensor-core kernel (sm_80+, fp16/bf16, head sizes 64-128) ----------------------------------
// The same pipeline, split and merge as the kernel above; the arithmetic runs on mma.m16n8k16 with the
// (up to 8) query heads of a CTA as the n = 8 side, which takes far fewer instructions per token than
// the FMA/shuffle kernel (that one is issue-bound on large batches and stays well below the copy
// bandwidth there). Each of the 2 warps owns 16 tokens of every 32-token tile and keeps its own
// online softmax; the warps are combined once at the end.
//  - scores, transposed: S^T[16 tokens x 8 heads] = K[16 x D] q^T, A = K rows by ldmatrix, B = q in
//    registers (k-step kk: head lane/4, dims 16kk + 2(lane%4) + {0, 1} and + 8);
//  - the C fragment holds tokens lane/4 and lane/4 + 8 of heads 2(lane%4) + {0, 1}: a head's max is a
//    shuffle over the 8 lanes that share lane%4; its sum stays per lane until the end;
//  - P^T packed to 16 bits, each 8x8 half transposed by movmatrix, is exactly the B fragment of
//    O^T[D x 8 heads] += V^T[D x 16 tokens] P^T (A = V^T by ldmatrix.trans); O^T's C fragment holds the
//    same two heads per lane as S^T's, so the softmax rescale needs no shuffle.
constexpr int kMmaThreads = 64;
constexpr int kMmaHeads = 8;  // query heads per CTA: the n side of the MMA (padded with zero heads)

// Two stage counts per head size: STAGES_BW keeps a CTA within 44 KB, so that the many CTAs of a large
// batch are all resident at once (bandwidth); STAGES_LAT (dynamic shared memory up to ~70 KB) puts a
// short context in flight before pdl_wait() for the few CTAs of a small batch (latency; used for small
// batches only when wllm_set_decode_mma asks for tensor cores everywhere, see g_mma_switch).
template <int D>
struct MmaStages {
  static constexpr int TT = 16 * (kMmaThreads / 32);  // tokens per tile: 16 per warp
  // +16 bytes per row: the 8 rows of an 8x8 ldmatrix (16 bytes each) then start 4 banks apart (D = 64,
  // 128) or at other distinct multiples of 4 banks (D = 80, 96): conflict-free, and cp.async stays aligned.
  static constexpr int ROW_BYTES = D * 2 + 16;
  static constexpr int STAGE_BYTES = 2 * TT * ROW_BYTES;  // K and V
  static constexpr int STAGES_BW = cmin(6, cmax(2, kStageBudget / STAGE_BYTES));
  static constexpr int STAGES_LAT = cmax(STAGES_BW, D >= 96 ? 4 : 6);
};

// TMA_: the tile comes as TMA boxes of 16-32 rows x 64 columns per cache block (one thread issues a
// handful per tile instead of one bulk copy per row and lane, which the compiler serialises lane by lane);
// its rows are then dense, D / 64 column blocks of TT rows x 128 bytes, 128-byte swizzled (tile_chunk).
template <typename T, int D, int STAGES, bool TMA_ = false>
struct MmaTiling {
  static constexpr bool TMA = TMA_;
  static constexpr int DIM = D;
  static constexpr int THREADS = kMmaThreads, WARPS = kMmaThreads / 32;
  static constexpr int TT = MmaStages<D>::TT;
  static constexpr int ROW_BYTES = TMA ? D * 2 : MmaStages<D>::ROW_BYTES;
  static constexpr int STAGE_BYTES = 2 * TT * ROW_BYTES;  // K and V
  static constexpr int S = STAGES;
  static constexpr bool LATENCY = STAGES > MmaStages<D>::STAGES_BW;
  static constexpr int CPR = D * 2 / 16;
  static constexpr int NCH = (TT * CPR + THREADS - 1) / THREADS;
  // Latency variant: one CTA takes a span of up to 4 tiles (128 tokens), all but the last in flight
  // before pdl_wait() (faster than the FMA kernel on such short contexts); longer spans split into
  // one-tile units like the FMA kernel's, because a 2-warp CTA pays for every further tile (copy issue
  // and MMA chains of only 64 threads) more than a split costs.
  static constexpr int UNIT = LATENCY ? TT : (cmax(kMinSplitTokens, TT) + TT - 1) / TT * TT;
  static constexpr int SINGLE_MAX = LATENCY ? 4 * TT : UNIT + kSinglePassExtraTiles * TT;
  static constexpr int ACC_BYTES = WARPS * kMmaHeads * D * 4;
  // Dynamic shared memory; TMA: plus slack to align the stages to the 1,024-byte swizzle atom, so that
  // USABLE_BYTES of it follow the aligned pointer the kernel works with.
  static constexpr int USABLE_BYTES = cmax(S * STAGE_BYTES, ACC_BYTES);
  static constexpr int SMEM_BYTES = USABLE_BYTES + (TMA ? 1024 : 0);
  static_assert(D % 16 == 0, "head size must be a multiple of the MMA's k = 16");
  static_assert(!TMA || D % 64 == 0, "TMA tiles are 64-column blocks");
  static_assert(S >= 2 && SMEM_BYTES <= 96 * 1024, "fits every sm_80+ GPU's shared memory per block");
};

// Four 8x8 matrices of 16-bit values from shared memory (lanes 8i..8i+7 address the rows of matrix i),
// transposed with TRANS; fragment layout.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* ptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned a = (unsigned)__cvta_generic_to_shared(ptr);
  if (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
#else
  r[0] = r[1] = r[2] = r[3] = 0u;  // never launched below sm_80
#endif
}

// The transpose of an 8x8 matrix of 16-bit values held one row pair per lane (fragment layout).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t v) {
  uint32_t r = v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(v));
#endif
  return r;
}

// c += a * b for one m16n8k16 tile, fp32 accumulation.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (std::is_same<T, __nv_bfloat16>::value) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// Address of 16-byte chunk `chunk` of row `row` of a K or V tile: padded rows, or (TL::TMA) the TMA
// engine's layout, D / 64 column blocks of TT rows x 128 bytes with the 16-byte chunks of row r permuted
// by r mod 8 (128-byte swizzle; the stages are 1,024-byte aligned).
template <typename TL>
__device__ __forceinline__ const unsigned char* tile_chunk(const unsigned char* tile, int row, int chunk) {
  if constexpr (TL::TMA) {
    return tile + (chunk >> 3) * (TL::TT * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
  } else {
    return tile + row * TL::ROW_BYTES + chunk * 16;
  }
}

// q of query heads head0 .. head0 + heads - 1 as the B operand of the scores (fragment layout; heads past
// `heads` are zero: their columns are never written).
template <typename T, int D>
__device__ __forceinline__ void load_q_fragment(uint32_t (&qb)[D / 16][2], const Params& p, int seq, int head0,
                                                int heads, int lane) {
  const int qd = lane & 3, qr = lane >> 2;
  const T* qh = static_cast<const T*>(p.q) + (int64_t)seq * p.q_seq_stride +
                (int64_t)(head0 + min(qr, heads - 1)) * p.q_head_stride + 2 * qd;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qb[kk][0] = qr < heads ? *reinterpret_cast<const uint32_t*>(qh + 16 * kk) : 0u;
    qb[kk][1] = qr < heads ? *reinterpret_cast<const uint32_t*>(qh + 16 * kk + 8) : 0u;
  }
}

// One warp's online softmax over its 16 rows of each K/V tile, for the kMmaHeads query heads of the CTA
// (tensor-core kernels). O^T m-tile mt: o[mt][0] = (dim 16mt + qr, head 2qd), [1] = (same dim, head
// 2qd + 1), [2], [3] = dim + 8; m0 / m1 are the running maxima of heads 2qd and 2qd + 1 (the same in all
// 8 lanes of qd), l0 / l1 this lane's part of their running sums.
template <typename T, int D, typename TL>
struct WarpSoftmax {
  static constexpr int KS = D / 16;  // k-steps of the scores, m-tiles of the output
  float o[KS][4];
  float m0, m1, l0, l1;

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
    m0 = m1 = -INFINITY;
    l0 = l1 = 0.0f;
  }

  // Rows row0 .. row0 + 15 (positions; row0 < end) of the tile whose K rows start at k_tile (local rows
  // r0 .. r0 + 15) and whose V rows follow them.
  __device__ __forceinline__ void tile(const unsigned char* k_tile, const uint32_t (&qb)[KS][2], int r0, int row0,
                                       int end, float scale, float softcap, int lane) {
    const int qr = lane >> 2;
    const unsigned char* v_tile = k_tile + TL::TT * TL::ROW_BYTES;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t a[4];
      ldsm_x4<false>(a, tile_chunk<TL>(k_tile, r0 + (lane & 15), kk * 2 + (lane >> 4)));
      mma16816<T>(c, a, qb[kk][0], qb[kk][1]);
    }
    // c: tokens qr (c[0], c[1]) and qr + 8 (c[2], c[3]) of heads 2qd, 2qd + 1.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float sc = c[i] * scale;
      if (softcap > 0.0f) sc = softcap * tanhf(sc / softcap);
      c[i] = row0 + qr + (i >> 1) * 8 < end ? sc : -INFINITY;
    }
    float mx0 = fmaxf(c[0], c[2]), mx1 = fmaxf(c[1], c[3]);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    // Row row0 is before the end, so both maxima are finite.
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float f0 = __expf(m0 - n0), f1 = __expf(m1 - n1);  // 0 while nothing was seen
    m0 = n0;
    m1 = n1;
    const float p0 = __expf(c[0] - n0), p1 = __expf(c[1] - n1), p2 = __expf(c[2] - n0), p3 = __expf(c[3] - n1);
    l0 = l0 * f0 + p0 + p2;
    l1 = l1 * f1 + p1 + p3;
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      o[mt][0] *= f0;
      o[mt][1] *= f1;
      o[mt][2] *= f0;
      o[mt][3] *= f1;
    }
    // P^T as the B fragment: tokens 2qd + {0, 1} (and + 8) of head qr.
    const uint32_t b0 = transpose8x8(pack2<T>(p0, p1));
    const uint32_t b1 = transpose8x8(pack2<T>(p2, p3));
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      uint32_t a[4];
      ldsm_x4<true>(a, tile_chunk<TL>(v_tile, r0 + (lane & 7) + ((lane >> 4) << 3), mt * 2 + ((lane >> 3) & 1)));
      mma16816<T>(o[mt], a, b0, b1);
    }
  }

  // The warp's unnormalised output into s_acc [WARPS][kMmaHeads][D] and its (max, sum) per head into
  // s_m / s_l [WARPS][kMmaHeads], for finish().
  __device__ __forceinline__ void store(float* s_acc, float* s_m, float* s_l, int warp, int lane) {
    constexpr int GQ = kMmaHeads;
    const int qd = lane & 3, qr = lane >> 2;
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      l0 += __shfl_xor_sync(0xffffffffu, l0, off);
      l1 += __shfl_xor_sync(0xffffffffu, l1, off);
    }
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      float* h0 = s_acc + (warp * GQ + 2 * qd) * D + mt * 16 + qr;
      h0[0] = o[mt][0];
      h0[D] = o[mt][1];
      h0[8] = o[mt][2];
      h0[D + 8] = o[mt][3];
    }
    if (qr == 0) {
      s_m[warp * GQ + 2 * qd] = m0;
      s_m[warp * GQ + 2 * qd + 1] = m1;
      s_l[warp * GQ + 2 * qd] = l0;
      s_l[warp * GQ + 2 * qd + 1] = l1;
    }
  }
};

template <typename T, int D, int STAGES, bool TMA>
__device__ __forceinline__ void mma_decode(const Params& p, const CUtensorMap* tma_k, const CUtensorMap* tma_v) {
  using TL = MmaTiling<T, D, STAGES, TMA>;
  constexpr int GQ = kMmaHeads, KS = D / 16;
  constexpr int TT = TL::TT;

  extern __shared__ __align__(16) unsigned char smem_raw[];  // TL::SMEM_BYTES
  unsigned char* smem = smem_raw;
  if constexpr (TMA) smem += ((smem_addr(smem_raw) + 1023u) & ~1023u) - smem_addr(smem_raw);
  __shared__ float s_m[TL::WARPS][GQ], s_l[TL::WARPS][GQ];
  __shared__ int s_ids[2][TL::THREADS];
  __shared__ int s_last;

  pdl_trigger_early<PDL_ATTENTION>();
  Work w;
  if (!plan_work<T, D, TL::THREADS>(p, w)) return;
  // PDL: the block table and every K/V row but the newest (written by an earlier step) are read before
  // pdl_wait(); q and the newest row (just written by rotary_and_cache / reshape_and_cache) after it.
  __shared__ uint64_t s_bars[TL::S];
  Pipeline<TL, true, T, kBulkRows> pipe;
  pipe.start(p, w, smem, s_ids, s_bars, tma_k, tma_v);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = warp * 16;  // this warp's first row of every tile
  uint32_t qb[KS][2];
  load_q_fragment<T, D>(qb, p, w.seq, w.head0, w.heads, lane);
  WarpSoftmax<T, D, TL> acc;
  acc.reset();
  for (int j = 0; j < pipe.num_tiles; ++j) {
    pipe.advance(j, p, smem, s_ids);
    const int tile0 = w.begin + j * TT;
    if (tile0 + r0 >= w.end) continue;  // this warp's rows of the last tile are all past the end
    acc.tile(smem + (j % TL::S) * TL::STAGE_BYTES, qb, r0, tile0 + r0, w.end, p.scale, p.softcap, lane);
  }
  cp_async_wait<0>();
  __syncthreads();  // the combine below reuses the stage memory
  acc.store(reinterpret_cast<float*>(smem), &s_m[0][0], &s_l[0][0], warp, lane);
  __syncthreads();
  finish<T, D, GQ, TL>(p, w, smem, &s_m[0][0], &s_l[0][0], &s_last);
}

template <typename T, int D, int STAGES>
__global__ void __launch_bounds__(kMmaThreads) paged_decode_mma_kernel(const Params p) {
  mma_decode<T, D, STAGES, false>(p, nullptr, nullptr);
}

// The same with the tiles by TMA boxes (sm_90a; see MmaTiling): map_k / map_v describe the caches as
// [blocks][block rows][KV-head columns] with boxes of min(block size, TT) rows x 64 columns.
template <typename T, int D, int STAGES>
__global__ void __launch_bounds__(kMmaThreads)
    paged_decode_tma_kernel(const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
                            const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  mma_decode<T, D, STAGES, true>(p, &map_k, &map_v);
#endif
}

// Persistent TMA decode (sm_90a, calls without splits; the offline batch's regime of many short
// contexts). With one CTA per (sequence, KV-head chunk), each CTA paid its start-up -- block-table and q
// loads, the pipeline fill -- and its combine with no K/V bytes in flight, a visible share of the
// bandwidth at the few tiles per CTA of short contexts. Here a grid of resident CTAs takes units
// u = blockIdx.x, blockIdx.x + gridDim.x, ... in turn, and one producer warp streams all of its units'
// tiles through the stages without a break: the next unit's first tiles land while the consumers finish
// the last one. The two consumer warps
// compute as mma_decode does; their combine has its own shared memory (the stages stay in flight).
//
// Stages: full[s] completes when a tile's boxes land (the producer's expect_tx), empty[s] when both
// consumer warps are done with it. Tile g of the CTA's stream (over all its units) uses stage g % S in
// phase g / S. PDL: the producer issues the first unit's tiles before pdl_wait() up to the one holding the
// newest row; the consumers wait before reading q or writing anything.
//
// The packed build (PACKED > 1, head size 128) combines in the unit's last stage, held back from the
// producer until the output is written (the other stage stays in flight), instead of an area of its own,
// and caps its registers so that PACKED CTAs fit an SM (one more than the plain build). It runs grids of
// more units than the plain build holds at once, where more stages in flight per SM win (many short
// contexts); one long unit per CTA streams faster with the plain build's registers (benchmarks/RESULTS.md).
template <typename T, int D, int STAGES, bool PACKED = false>
struct PersistTiling {
  using TL = MmaTiling<T, D, STAGES, true>;
  static constexpr int THREADS = TL::THREADS + 32;  // consumers + one producer warp
  static constexpr int ACC_OFFSET = STAGES * TL::STAGE_BYTES;
  static constexpr int ACC_BYTES = PACKED ? 0 : TL::ACC_BYTES;
  static constexpr int SMEM_BYTES = ACC_OFFSET + ACC_BYTES + 1024;  // + the 1,024-byte alignment slack
  static_assert(!PACKED || TL::ACC_BYTES <= TL::STAGE_BYTES, "the packed combine fits a stage");
};

// CTAs per SM for the packed build: as many as its shared memory allows on a 228 KB SM (+ ~1.3 KB static,
// 1 KB reserved per CTA). 1 (no packed build) for head size 64, whose CTAs shared memory already bounds.
template <typename T, int D, int STAGES>
constexpr int packed_ctas() {
  return D == 128 ? 228 * 1024 / (PersistTiling<T, D, STAGES, true>::SMEM_BYTES + 2048) : 1;
}

// The largest stage count whose stages and combine memory fit the shared-memory budget of the bandwidth
// variant (D = 128: 2 stages, D = 64: 5).
template <int D>
struct PersistStages {
  using TL = MmaTiling<__half, D, 2, true>;  // the sizes do not depend on the 16-bit type
  static constexpr int STAGES = cmin(6, cmax(2, (kStageBudget - TL::ACC_BYTES) / TL::STAGE_BYTES));
};

// PACKED: 1 the plain build, else the packed one with PACKED CTAs per SM (its launch bound).
template <typename T, int D, int STAGES, int PACKED>
__global__ void __launch_bounds__(PersistTiling<T, D, STAGES>::THREADS, PACKED > 1 ? PACKED : 0)
    paged_decode_tma_persistent_kernel(const __grid_constant__ CUtensorMap map_k,
                                       const __grid_constant__ CUtensorMap map_v, const Params p, int units) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using PT = PersistTiling<T, D, STAGES, (PACKED > 1)>;
  using TL = typename PT::TL;
  constexpr int GQ = kMmaHeads, KS = D / 16, TT = TL::TT, S = STAGES, H = D / 64;
  extern __shared__ __align__(16) unsigned char smem_raw[];  // PT::SMEM_BYTES
  unsigned char* smem = smem_raw + (((smem_addr(smem_raw) + 1023u) & ~1023u) - smem_addr(smem_raw));
  __shared__ float s_m[TL::WARPS][GQ], s_l[TL::WARPS][GQ];
  __shared__ uint64_t full[S], empty[S];
  __shared__ int s_last;  // unused: finish() never merges here

  pdl_trigger_early<PDL_ATTENTION>();
  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) {
      hopper::mbar_init(smem_addr(full + i), 1);
      hopper::mbar_init(smem_addr(empty + i), TL::WARPS);
    }
    hopper::fence_mbar_init();
  }
  __syncthreads();

  if (threadIdx.x >= TL::THREADS) {  // ---- producer warp: lane 0 issues every tile ----
    if (threadIdx.x == TL::THREADS) {
      const int bs = 1 << p.block_shift;
      const int rows = bs < TT ? bs : TT;  // rows per box
      constexpr int kMaxBoxes = TT / kMinBlockSize;
      bool waited = false;
      int g = 0;
      int len = blockIdx.x < (unsigned)units ? max(p.seq_lens[(int)blockIdx.x / (p.num_kv_heads * p.chunks)], 0) : 0;
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        Work w;
        unit_work(p, u, w);
        const int un = u + (int)gridDim.x;  // the next unit's length, loaded a unit ahead
        const int next_len = un < units ? max(p.seq_lens[un / (p.num_kv_heads * p.chunks)], 0) : 0;
        const int32_t* table = p.block_tables + (int64_t)w.seq * p.block_table_stride;
        const int col0 = w.kv_head * (int)p.head_stride;
        for (int tile0 = 0; tile0 < len; tile0 += TT, ++g) {
          const int boxes = min(TT / rows, (len - tile0 + rows - 1) / rows);
          int ids[kMaxBoxes];
#pragma unroll
          for (int b = 0; b < kMaxBoxes; ++b) ids[b] = b < boxes ? __ldg(table + ((tile0 + b * rows) >> p.block_shift)) : 0;
          const int st = g % S;
          if (g >= S) hopper::mbar_wait(smem_addr(empty + st), (unsigned)(g / S - 1) & 1u);
          if (!waited && tile0 + TT >= len) {  // this tile holds the newest row, written by the kernel before
            pdl_wait_and_trigger<PDL_ATTENTION>();
            waited = true;
          }
          unsigned char* stage = smem + st * TL::STAGE_BYTES;
          hopper::mbar_expect_tx(smem_addr(full + st), (uint32_t)(2 * H * boxes * rows * 128));
#pragma unroll
          for (int b = 0; b < kMaxBoxes; ++b) {
            if (b < boxes) {
              const int pos = tile0 + b * rows;
#pragma unroll
              for (int h = 0; h < H; ++h) {
                unsigned char* dst = stage + h * TT * 128 + b * rows * 128;
                hopper::tma_load_3d(smem_addr(dst), &map_k, col0 + 64 * h, pos & (bs - 1), ids[b], smem_addr(full + st));
                hopper::tma_load_3d(smem_addr(dst + TT * TL::ROW_BYTES), &map_v, col0 + 64 * h, pos & (bs - 1), ids[b],
                                    smem_addr(full + st));
              }
            }
          }
        }
        len = next_len;
      }
      if (!waited) pdl_wait_and_trigger<PDL_ATTENTION>();
    } else {
      pdl_wait_and_trigger<PDL_ATTENTION>();
    }
    return;
  }

  // ---- consumer warps ----
  pdl_wait_and_trigger<PDL_ATTENTION>();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = warp * 16;
  int g = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    Work w;
    unit_work(p, u, w);
    w.split = 0;
    w.begin = 0;
    w.seq_len = max(p.seq_lens[w.seq], 0);
    w.end = w.seq_len;
    w.n_active = 1;
    if (w.seq_len == 0) {
      zero_output<T, D, TL::THREADS>(p, w);
      continue;
    }
    uint32_t qb[KS][2];
    load_q_fragment<T, D>(qb, p, w.seq, w.head0, w.heads, lane);
    WarpSoftmax<T, D, TL> acc;
    acc.reset();
    const int num_tiles = (w.end + TT - 1) / TT;
    for (int j = 0; j < num_tiles; ++j, ++g) {
      const int st = g % S;
      unsigned char* stage = smem + st * TL::STAGE_BYTES;
      hopper::mbar_wait(smem_addr(full + st), (unsigned)(g / S) & 1u);
      const int tile0 = j * TT;
      if (j == num_tiles - 1) {
        // Zero V's rows past the end (whole cache blocks landed), before the async proxy writes this stage
        // again; the barrier also keeps a warp's next combine from overtaking the other's output loop.
        tma_zero_tail<TL>(stage, tile0, w.end);
        hopper::fence_proxy_async();
        cta_or_named_sync<true, TL::THREADS>();
      }
      if (tile0 + r0 < w.end) acc.tile(stage, qb, r0, tile0 + r0, w.end, p.scale, p.softcap, lane);
      if (PACKED == 1 || j < num_tiles - 1) {
        __syncwarp();
        if (lane == 0) hopper::mbar_arrive(smem_addr(empty + st));
      }
    }
    // The combine: in its own area, or (packed) in the last tile's stage once both warps are done
    // reading its K/V, that stage then going back to the producer.
    const int last = (g - 1) % S;
    unsigned char* s_acc = smem + (PACKED == 1 ? PT::ACC_OFFSET : last * TL::STAGE_BYTES);
    if constexpr (PACKED > 1) cta_or_named_sync<true, TL::THREADS>();
    acc.store(reinterpret_cast<float*>(s_acc), &s_m[0][0], &s_l[0][0], warp, lane);
    cta_or_named_sync<true, TL::THREADS>();
    finish<T, D, GQ, TL, true>(p, w, s_acc, &s_m[0][0], &s_l[0][0], &s_last);
    if constexpr (PACKED > 1) {
      hopper::fence_proxy_async();  // this warp's generic writes before the TMA writes the stage again
      __syncwarp();
      if (lane == 0) hopper::mbar_arrive(smem_addr(empty + last));
    }
  }
#endif
}

// Merges the splits of one (sequence, query head) when the main kernel could not (more
// sequence x head chunks than the workspace has tickets): out = sum_i w_i o_i / sum_i w_i with
// w_i = sum_i * exp(max_i - max). Sequences that one CTA covered were written by the main kernel.
template <typename T>
__global__ void merge_splits_kernel(const Params p, int head_size) {
  const int seq = blockIdx.x, head = blockIdx.y;
  const int seq_len = max(p.seq_lens[seq], 0);
  const int lo = p.window > 0 ? max(0, seq_len - p.window) : 0;
  const int n_active = active_splits(seq_len - lo, p.splits, p.split_unit, p.single_max);
  if (n_active <= 1) return;
  T* out = static_cast<T*>(p.out) + (int64_t)seq * p.out_seq_stride + (int64_t)head * p.out_head_stride;
  const int64_t row0 = ((int64_t)seq * p.num_heads + head) * p.splits;
  float m = -INFINITY;
  for (int i = 0; i < n_active; ++i) m = fmaxf(m, p.partial_stats[(row0 + i) * 2]);
  float total = 0.0f;
  for (int i = 0; i < n_active; ++i) {
    total += p.partial_stats[(row0 + i) * 2 + 1] * __expf(p.partial_stats[(row0 + i) * 2] - m);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float o = 0.0f;
    for (int i = 0; i < n_active; ++i) {
      const float w = p.partial_stats[(row0 + i) * 2 + 1] * __expf(p.partial_stats[(row0 + i) * 2] - m);
      o += w * p.partial_out[(row0 + i) * head_size + d];
    }
    out[d] = Conv<T>::from_float(o * inv);
  }
}

struct Plan {
  int chunks, per_chunk, gq, splits;
  bool fused;  // the last split CTA merges (tickets fit in the workspace's counter slots)
  int64_t workspace_bytes;
};

static Plan make_plan(int num_seqs, int num_heads, int num_kv_heads, int head_size, int64_t max_seq_len,
                      int num_splits) {
  Plan plan;
  const int group = num_heads / num_kv_heads;
  const int gq_max = head_size > 128 ? 4 : 8;
  plan.chunks = (group + gq_max - 1) / gq_max;
  plan.per_chunk = (group + plan.chunks - 1) / plan.chunks;
  plan.gq = pow2_ceil(plan.per_chunk);
  const int64_t units = max_seq_len <= 0 ? 1 : (max_seq_len + kSplitUnit - 1) / kSplitUnit;
  const int64_t ctas = (int64_t)num_seqs * num_kv_heads * plan.chunks;
  int64_t splits = 1;
  if (num_splits > 0) {
    splits = num_splits;
  } else if (ctas < kTargetCtas) {
    splits = (kTargetCtas + ctas - 1) / ctas;
  }
  if (splits > units) splits = units;
  if (splits > 65535) splits = 65535;
  plan.splits = (int)splits;
  plan.fused = splits > 1 && ctas <= kCounterSlots;
  // Layout: [kCounterBytes of tickets][partial outputs][partial (max, sum)]. The tickets sit at a
  // fixed place, so calls of other sizes sharing one workspace never write over them.
  plan.workspace_bytes =
      splits > 1 ? kCounterBytes + (int64_t)num_seqs * num_heads * splits * (head_size + 2) * (int64_t)sizeof(float)
                 : 0;
  return plan;
}

// Split calls whose partials the main kernel could not merge itself (more sequence x head chunks than
// the workspace has tickets) get the merge as a second kernel.
template <typename T>
static void launch_merge_fallback(const Params& p, dim3 grid, int head_size, cudaStream_t s) {
  if (p.splits <= 1 || p.fused) return;
  const unsigned seqs = grid.x / (unsigned)(p.num_kv_heads * p.chunks);
  merge_splits_kernel<T><<<dim3(seqs, (unsigned)p.num_heads), 128, 0, s>>>(p, head_size);
}

template <typename T, int D, int GQ>
static void launch_kernel(Params p, dim3 grid, cudaStream_t s) {
  p.split_unit = Tiling<T, D, GQ>::UNIT;
  p.single_max = Tiling<T, D, GQ>::UNIT + kSinglePassExtraTiles * Tiling<T, D, GQ>::TT;
  launch_pdl(paged_decode_kernel<T, D, GQ>, grid, dim3(kThreads), 0, s, p);
  launch_merge_fallback<T>(p, grid, D, s);
}

// Lets `kernel` use `bytes` of dynamic shared memory (above 48 KB needs the opt-in), once per device.
template <typename Kernel>
static bool allow_smem(Kernel kernel, int bytes, std::atomic<uint64_t>& done) {
  if (bytes <= 48 * 1024) return true;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const uint64_t bit = device < 64 ? (uint64_t)1 << device : 0;
  if (bit != 0 && (done.load(std::memory_order_relaxed) & bit) != 0) return true;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) {
    cudaGetLastError();  // not sticky: the caller falls back to the FMA kernel
    return false;
  }
  done.fetch_or(bit, std::memory_order_relaxed);
  return true;
}

// Launches the tensor-core kernel with STAGES pipeline stages; false when its shared memory cannot be
// had (the caller then uses the FMA kernel).
template <typename T, int D, int STAGES>
static bool launch_mma_kernel(Params p, dim3 grid, cudaStream_t s) {
  using TL = MmaTiling<T, D, STAGES>;
  static std::atomic<uint64_t> smem_allowed(0);
  if (!allow_smem(paged_decode_mma_kernel<T, D, STAGES>, TL::SMEM_BYTES, smem_allowed)) return false;
  p.split_unit = TL::UNIT;
  p.single_max = TL::SINGLE_MAX;
  launch_pdl(paged_decode_mma_kernel<T, D, STAGES>, grid, dim3(TL::THREADS), TL::SMEM_BYTES, s, p);
  launch_merge_fallback<T>(p, grid, D, s);
  return true;
}

// The bandwidth variant with TMA tiles: on sm_90 (the kernels are built as sm_90a), for head sizes 64 and
// 128, without a sliding window (whose span starts inside a cache block; TMA boxes are whole blocks), when
// TMA can describe the caches. Mode (g_tma_switch): 2 (the default) calls without splits on the persistent
// kernel, the rest one CTA per unit (paged_decode_tma_kernel); 1 one CTA per unit everywhere; 0 off, the
// per-row bulk copies that other tensor-core GPUs use. wllm_set_decode_tma is the tests' hook to run the
// other modes on an SM 9.0 GPU.
static std::atomic<int> g_tma_switch(2);

// CTAs of `kernel` resident per SM with `threads` threads and `smem` bytes of dynamic shared memory, asked
// once (every sm_90 GPU has the same SM resources; only sm_90 runs these kernels).
template <typename Kernel>
static int resident_ctas(Kernel kernel, int threads, int smem, std::atomic<int>& cached) {
  int n = cached.load(std::memory_order_relaxed);
  if (n > 0) return n;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, (size_t)smem) != cudaSuccess || n < 1) {
    cudaGetLastError();
    return 0;
  }
  cached.store(n, std::memory_order_relaxed);
  return n;
}

template <typename T, int D, int STAGES>
static bool launch_tma_kernel(const Params& p, dim3 grid, const DeviceProps& dev, cudaStream_t s) {
  if constexpr (D % 64 != 0) {
    return false;
  } else {
    using TL = MmaTiling<T, D, STAGES, true>;
    const int mode = g_tma_switch.load(std::memory_order_relaxed);
    if (!(dev.major == 9 && dev.minor == 0) || p.window != 0 || mode == 0) return false;
    const int block_size = 1 << p.block_shift;
    CUtensorMap map_k, map_v;
    if (!hopper::paged_cache_maps(&map_k, &map_v, std::is_same<T, __half>::value, p.k_cache, p.v_cache,
                                  p.num_kv_heads, p.head_stride, D, block_size, p.token_stride, p.block_stride,
                                  block_size < TL::TT ? block_size : TL::TT)) {
      return false;
    }
    Params pt = p;
    if (mode == 2 && p.splits == 1) {
      constexpr int PS = PersistStages<D>::STAGES;
      using PT = PersistTiling<T, D, PS>;
      constexpr int kPacked = packed_ctas<T, D, PS>();
      using PK = PersistTiling<T, D, PS, true>;
      static std::atomic<uint64_t> persist_smem_allowed(0), packed_smem_allowed(0);
      static std::atomic<int> per_sm(0), packed_per_sm(0);
      const auto plain = paged_decode_tma_persistent_kernel<T, D, PS, 1>;
      if (allow_smem(plain, PT::SMEM_BYTES, persist_smem_allowed)) {
        const int n = resident_ctas(plain, PT::THREADS, PT::SMEM_BYTES, per_sm);
        if (n > 0) {
          const int units = (int)grid.x;
          auto kernel = plain;
          int smem = PT::SMEM_BYTES;
          int64_t slots = (int64_t)n * dev.sms;
          if constexpr (kPacked > 1) {  // more units than the plain grid holds at once: the packed build
            const auto packed = paged_decode_tma_persistent_kernel<T, D, PS, kPacked>;
            if (units > slots && allow_smem(packed, PK::SMEM_BYTES, packed_smem_allowed)) {
              const int np = resident_ctas(packed, PK::THREADS, PK::SMEM_BYTES, packed_per_sm);
              if (np > n) {
                kernel = packed;
                smem = PK::SMEM_BYTES;
                slots = (int64_t)np * dev.sms;
              }
            }
          }
          launch_pdl(kernel, dim3((unsigned)min((int64_t)units, slots)), dim3(PT::THREADS), smem, s, map_k, map_v, pt,
                     units);
          return true;
        }
      }
    }
    static std::atomic<uint64_t> smem_allowed(0);
    if (!allow_smem(paged_decode_tma_kernel<T, D, STAGES>, TL::SMEM_BYTES, smem_allowed)) return false;
    pt.split_unit = TL::UNIT;
    pt.single_max = TL::SINGLE_MAX;
    launch_pdl(paged_decode_tma_kernel<T, D, STAGES>, grid, dim3(TL::THREADS), TL::SMEM_BYTES, s, map_k, map_v, pt);
    launch_merge_fallback<T>(pt, grid, D, s);
    return true;
  }
}

// Tensor-core mode: 2 (the default: large grids only, small batches on the FMA kernel, which is as fast
// end to end at batch 1 -- the 2-warp tensor-core CTA wins only on short contexts), 1 (everywhere: the
// latency variant for small grids) or 0 (off: the FMA kernel of older GPUs everywhere). wllm_set_decode_mma
// is the tests' hook to cover every kernel on one GPU.
static std::atomic<int> g_mma_switch(2);

// The tensor-core kernel: sm_80+, 16-bit types, head sizes up to 128 (a CTA serves <= 8 query heads, as
// make_plan chunks the group for those sizes), unless switched off.
template <typename T>
static bool use_mma(int head_size, const DeviceProps& dev) {
  if (std::is_same<T, float>::value || head_size > 128) return false;
  return g_mma_switch.load(std::memory_order_relaxed) && dev.major >= 8;
}

template <typename T, int D>
static void launch_for_gq(const Params& p, int gq, dim3 grid, cudaStream_t s) {
  if constexpr (!std::is_same<T, float>::value && D <= 128) {
    DeviceProps dev;
    if (current_device_props(&dev) == WLLM_OK && use_mma<T>(D, dev)) {
      // Few CTAs (a small batch): the latency variant, whose deeper pipeline puts a short context or a
      // whole split in flight before pdl_wait(). Many: the bandwidth variant, small enough that the
      // whole grid is resident at once.
      const bool few = (int64_t)grid.x * 4 <= (int64_t)dev.sms;
      if (few && g_mma_switch.load(std::memory_order_relaxed) == 2) {
        // small batches on the FMA kernel (below)
      } else if (few ? launch_mma_kernel<T, D, MmaStages<D>::STAGES_LAT>(p, grid, s)
              : launch_tma_kernel<T, D, MmaStages<D>::STAGES_BW>(p, grid, dev, s) ||
                    launch_mma_kernel<T, D, MmaStages<D>::STAGES_BW>(p, grid, s)) {
        return;
      }
    }
  }
  switch (gq) {
    case 1: launch_kernel<T, D, 1>(p, grid, s); break;
    case 2: launch_kernel<T, D, 2>(p, grid, s); break;
    case 4: launch_kernel<T, D, 4>(p, grid, s); break;
    default: launch_kernel<T, D, (D > 128 ? 4 : 8)>(p, grid, s); break;
  }
}

template <typename T>
static int launch(const Params& p, int head_size, int gq, int num_seqs, cudaStream_t s) {
  if ((int64_t)num_seqs * p.num_kv_heads * p.chunks > INT_MAX) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "paged_decode_attention: %d sequences x %d KV heads is too many CTAs",
                num_seqs, p.num_kv_heads);
  }
  const dim3 grid((unsigned)((int64_t)num_seqs * p.num_kv_heads * p.chunks), 1u, (unsigned)p.splits);
  switch (head_size) {
    case 64: launch_for_gq<T, 64>(p, gq, grid, s); break;
    case 80: launch_for_gq<T, 80>(p, gq, grid, s); break;
    case 96: launch_for_gq<T, 96>(p, gq, grid, s); break;
    case 128: launch_for_gq<T, 128>(p, gq, grid, s); break;
    case 256: launch_for_gq<T, 256>(p, gq, grid, s); break;
    default: return fail(WLLM_ERR_INVALID_ARGUMENT, "paged_decode_attention: unsupported head size %d", head_size);
  }
  return check_launch("paged_decode_attention");
}

static bool supported_head_size(int d) { return d == 64 || d == 80 || d == 96 || d == 128 || d == 256; }

static int check_sizes(int num_seqs, int num_heads, int num_kv_heads, int head_size, int64_t max_seq_len) {
  if (num_seqs < 0 || num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || max_seq_len < 0 ||
      max_seq_len > INT_MAX) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "paged_decode_attention: bad sizes (seqs=%d heads=%d kv_heads=%d max_seq_len=%lld); num_heads must "
                "be a multiple of num_kv_heads",
                num_seqs, num_heads, num_kv_heads, (long long)max_seq_len);
  }
  if (!supported_head_size(head_size)) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "paged_decode_attention: head size %d is not supported (supported: 64, 80, 96, 128, 256)", head_size);
  }
  return WLLM_OK;
}

}  // namespace decode
WLLM_TRACE_TU(attn)
}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_set_decode_mma)(int mode) {
  return WLLM_NS::decode::g_mma_switch.exchange(mode == 0 || mode == 2 ? mode : 1);
}

WLLM_API int WLLM_FN(wllm_set_decode_tma)(int mode) {
  return WLLM_NS::decode::g_tma_switch.exchange(mode == 0 || mode == 1 ? mode : 2);
}

WLLM_API int WLLM_FN(wllm_paged_decode_workspace_size)(int num_seqs, int num_heads, int num_kv_heads, int head_size,
                                                       int64_t max_seq_len, int num_splits, int64_t* bytes) {
  using namespace WLLM_NS::decode;
  if (bytes == nullptr) return WLLM_NS::fail(WLLM_ERR_INVALID_ARGUMENT, "paged_decode_workspace_size: null output");
  if (int rc = check_sizes(num_seqs, num_heads, num_kv_heads, head_size, max_seq_len)) return rc;
  *bytes = make_plan(num_seqs, num_heads, num_kv_heads, head_size, max_seq_len, num_splits).workspace_bytes;
  return WLLM_OK;
}

WLLM_API int WLLM_FN(wllm_paged_decode_attention)(
    void* out, const void* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* seq_lens, int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,
    int64_t max_seq_len, int64_t block_table_stride, int64_t q_seq_stride, int64_t q_head_stride,
    int64_t out_seq_stride, int64_t out_head_stride, int64_t kv_block_stride, int64_t kv_token_stride,
    int64_t kv_head_stride, float scale, int sliding_window, float logit_softcap, int num_splits, void* workspace,
    int64_t workspace_bytes, int dtype, void* stream) {
  using namespace WLLM_NS;
  using namespace WLLM_NS::decode;
  if (int rc = check_sizes(num_seqs, num_heads, num_kv_heads, head_size, max_seq_len)) return rc;
  if (num_seqs == 0) return WLLM_OK;
  if (out == nullptr || q == nullptr || k_cache == nullptr || v_cache == nullptr || block_tables == nullptr ||
      seq_lens == nullptr) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "paged_decode_attention: null pointer");
  }
  if (block_size < kMinBlockSize || (block_size & (block_size - 1)) != 0) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "paged_decode_attention: block size %d is not supported (a power of two >= %d)", block_size,
                kMinBlockSize);
  }
  if (sliding_window < 0 || !(logit_softcap >= 0.0f) || num_splits < 0) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "paged_decode_attention: sliding_window (%d), logit_softcap (%g) and num_splits (%d) must be >= 0",
                sliding_window, (double)logit_softcap, num_splits);
  }
  const int elem = dtype == WLLM_FLOAT32 ? 4 : 2;
  const int64_t vec = 16 / elem;
  const uintptr_t addr_bits = reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k_cache) |
                              reinterpret_cast<uintptr_t>(v_cache);
  if ((addr_bits & 15u) != 0 || q_seq_stride % vec || q_head_stride % vec || kv_block_stride % vec ||
      kv_token_stride % vec || kv_head_stride % vec) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "paged_decode_attention: q and the caches must be 16-byte aligned with strides that are multiples "
                "of %lld elements",
                (long long)vec);
  }
  const Plan plan = make_plan(num_seqs, num_heads, num_kv_heads, head_size, max_seq_len, num_splits);
  if (plan.splits > 1 && (reinterpret_cast<uintptr_t>(workspace) & 15u) != 0) {
    // The fused merge copies partials with 16-byte cp.async.
    return fail(WLLM_ERR_INVALID_ARGUMENT, "paged_decode_attention: the workspace must be 16-byte aligned");
  }
  if (plan.splits > 1 && (workspace == nullptr || workspace_bytes < plan.workspace_bytes)) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "paged_decode_attention: workspace of %lld bytes is too small (%lld needed; ask "
                "wllm_paged_decode_workspace_size)",
                (long long)workspace_bytes, (long long)plan.workspace_bytes);
  }
  Params p;
  p.out = out;
  p.q = q;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.counters = static_cast<unsigned int*>(workspace);
  p.partial_out = plan.splits > 1 ? reinterpret_cast<float*>(static_cast<char*>(workspace) + kCounterBytes) : nullptr;
  p.partial_stats = plan.splits > 1 ? p.partial_out + (int64_t)num_seqs * num_heads * plan.splits * head_size : nullptr;
  p.q_seq_stride = q_seq_stride;
  p.q_head_stride = q_head_stride;
  p.out_seq_stride = out_seq_stride;
  p.out_head_stride = out_head_stride;
  p.block_stride = kv_block_stride;
  p.token_stride = kv_token_stride;
  p.head_stride = kv_head_stride;
  p.block_table_stride = block_table_stride;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_heads / num_kv_heads;
  p.chunks = plan.chunks;
  p.per_chunk = plan.per_chunk;
  p.block_shift = 0;
  while ((1 << p.block_shift) < block_size) ++p.block_shift;
  p.splits = plan.splits;
  p.split_unit = 0;  // these two are set per instantiation by launch_kernel
  p.single_max = 0;
  p.fused = plan.fused ? 1 : 0;
  p.scale = scale;
  p.softcap = logit_softcap;
  p.window = sliding_window;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  WLLM_DISPATCH_FLOAT(dtype, T, return launch<T>(p, head_size, plan.gq, num_seqs, s));
  return WLLM_OK;
}
