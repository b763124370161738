// Paged decode attention: one query token per sequence over its paged K/V.
//
// One thread block per (sequence, KV head [, chunk of its query-head group], split). The block
// reads each key and value row of its KV head once for all the query heads it serves (GQA), in
// tiles of TILE tokens: scores of the tile go to shared memory, a per-head online softmax merges
// tiles, and values accumulate in fp32 registers. With few sequences and long contexts the context
// is split over blockIdx.z (flash-decoding); each split writes a normalised partial output plus its
// (max, sum) and a second kernel merges the splits. The grid only depends on host-side sizes, so a
// CUDA graph captured for a maximum context stays valid for shorter ones (idle splits exit early).
//
// Lane layout: LPT lanes share one token, each loading VEC contiguous elements per vector and NV
// vectors (strided by LPT * VEC) of the head; a warp covers TPW = 32 / LPT tokens at a time. LPT
// and VEC are chosen so that a lane holds at most ~32 fp32 values of q (and of the accumulator).
#include <limits.h>
#include <math.h>

#include "common.cuh"

namespace WLLM_NS {
namespace decode {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 256;                 // tokens per shared-memory score tile
constexpr int kMinBlockSize = 8;           // block sizes are powers of two >= this
constexpr int kTargetCtas = 1024;          // split the context until the grid has about this many blocks
constexpr int kSplitUnit = 32;             // a split covers a multiple of this many tokens
constexpr int kMaxBlocksPerTile = kTile / kMinBlockSize + 1;

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
  static constexpr int UNROLL = cmax(1, 4 / NV);
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

struct Params {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  float* partial_out;    // [S, Hq, splits, D] (split mode)
  float* partial_stats;  // [S, Hq, splits, 2] = (max, sum) (split mode)
  int64_t q_seq_stride, q_head_stride, out_seq_stride, out_head_stride;
  int64_t block_stride, token_stride, head_stride, block_table_stride;
  int num_heads, num_kv_heads, group, chunks, per_chunk;
  int block_shift;
  int splits, split_tokens;
  float scale, softcap;
  int window;
};

// Tokens per split for one sequence: every sequence spreads its own attended span over all the
// grid's splits, so a short context still keeps many blocks busy (the grid itself is fixed by the
// host-side maximum, which keeps CUDA graphs valid).
__device__ __forceinline__ int seq_split_tokens(int span, int splits) {
  if (splits == 1) return INT_MAX;
  const int units = (span + kSplitUnit - 1) / kSplitUnit;
  const int per = (units + splits - 1) / splits;
  return (per > 0 ? per : 1) * kSplitUnit;
}

template <typename T, int D, int GQ>
__global__ void __launch_bounds__(kThreads, 4) paged_decode_kernel(const Params p) {
  using L = Layout<T, D, GQ>;
  constexpr int VEC = L::VEC, NVEC = L::NVEC, LPT = L::LPT, NV = L::NV, TPW = L::TPW, UNROLL = L::UNROLL;
  typedef Vec<T, VEC> VecT;

  __shared__ float s_scores[GQ][kTile];
  __shared__ float s_acc[kWarps][GQ][D];
  __shared__ int s_blocks[kMaxBlocksPerTile];
  __shared__ float s_max[GQ], s_sum[GQ], s_rescale[GQ];

  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y / p.chunks;
  const int g0 = (blockIdx.y - kv_head * p.chunks) * p.per_chunk;
  const int heads = min(p.per_chunk, p.group - g0);  // query heads this block serves (<= GQ)
  const int head0 = kv_head * p.group + g0;
  const int split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int li = lane % LPT;   // lane within its token group
  const int tig = lane / LPT;  // token group within the warp

  const int seq_len = max(p.seq_lens[seq], 0);
  const int lo = p.window > 0 ? max(0, seq_len - p.window) : 0;
  const int st = seq_split_tokens(seq_len - lo, p.splits);
  const int begin = p.splits == 1 ? lo : lo + split * st;
  const int end = p.splits == 1 ? seq_len : min(seq_len, lo + (split + 1) * st);
  if (p.splits == 1 && begin >= end) {
    // Empty sequence (a graph padding row): zeros, never uninitialised memory.
    T* out = static_cast<T*>(p.out) + (int64_t)seq * p.out_seq_stride;
    for (int i = threadIdx.x; i < heads * D; i += kThreads) {
      out[(int64_t)(head0 + i / D) * p.out_head_stride + i % D] = Conv<T>::from_float(0.0f);
    }
    return;
  }
  if (begin >= end) return;  // split mode: the merge kernel skips splits without tokens

  const T* k_cache = static_cast<const T*>(p.k_cache) + (int64_t)kv_head * p.head_stride;
  const T* v_cache = static_cast<const T*>(p.v_cache) + (int64_t)kv_head * p.head_stride;
  const int32_t* table = p.block_tables + (int64_t)seq * p.block_table_stride;
  const T* q_base = static_cast<const T*>(p.q) + (int64_t)seq * p.q_seq_stride + (int64_t)head0 * p.q_head_stride;
  const int block_mask = (1 << p.block_shift) - 1;

  if (threadIdx.x < GQ) {
    s_max[threadIdx.x] = -INFINITY;
    s_sum[threadIdx.x] = 0.0f;
  }
  float acc[GQ][NV][VEC];
#pragma unroll
  for (int h = 0; h < GQ; ++h)
#pragma unroll
    for (int v = 0; v < NV; ++v)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[h][v][e] = 0.0f;

  for (int tile0 = begin; tile0 < end; tile0 += kTile) {
    const int tile_len = min(kTile, end - tile0);
    const int first_block = tile0 >> p.block_shift;
    const int num_blocks = ((tile0 + tile_len - 1) >> p.block_shift) - first_block + 1;
    for (int i = threadIdx.x; i < num_blocks; i += kThreads) s_blocks[i] = table[first_block + i];
    __syncthreads();

    // ---- scores: s[h][t] = scale * q[h] . k[t] ------------------------------------------------
    {
      float qf[GQ][NV][VEC];
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
      // Warp-uniform loop: every lane takes part in the shuffles below.
      for (int base = warp * TPW * UNROLL; base < tile_len; base += kWarps * TPW * UNROLL) {
        VecT kv[UNROLL][NV];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int t = base + u * TPW + tig;
          if (t < tile_len) {
            const int pos = tile0 + t;
            const int64_t row = (int64_t)s_blocks[(pos >> p.block_shift) - first_block] * p.block_stride +
                                (int64_t)(pos & block_mask) * p.token_stride;
#pragma unroll
            for (int v = 0; v < NV; ++v) {
              const int vi = li + v * LPT;
              if (vi < NVEC) kv[u][v] = *reinterpret_cast<const VecT*>(k_cache + row + vi * VEC);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const int t = base + u * TPW + tig;
          float part[GQ];
#pragma unroll
          for (int h = 0; h < GQ; ++h) part[h] = 0.0f;
          if (t < tile_len) {
#pragma unroll
            for (int v = 0; v < NV; ++v) {
              if (li + v * LPT < NVEC) {
                float kf[VEC];
                to_float(kv[u][v], kf);
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
          for (int offset = L::HEADS_PER_LANE / 2; offset > 0; offset >>= 1) {
            part[0] += __shfl_xor_sync(0xffffffffu, part[0], offset);
          }
          if (t < tile_len && li % L::HEADS_PER_LANE == 0) {
            float score = part[0] * p.scale;
            if (p.softcap > 0.0f) score = p.softcap * tanhf(score / p.softcap);
            s_scores[li / L::HEADS_PER_LANE][t] = score;
          }
        }
      }
    }
    __syncthreads();

    // ---- online softmax over the tile, one warp per head -----------------------------------
    for (int h = warp; h < GQ; h += kWarps) {
      float m = -INFINITY;
      for (int t = lane; t < tile_len; t += 32) m = fmaxf(m, s_scores[h][t]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float m_old = s_max[h];
      const float m_new = fmaxf(m_old, m);
      float sum = 0.0f;
      for (int t = lane; t < tile_len; t += 32) {
        const float e = __expf(s_scores[h][t] - m_new);
        s_scores[h][t] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float r = m_old == -INFINITY ? 0.0f : __expf(m_old - m_new);
        s_rescale[h] = r;
        s_sum[h] = s_sum[h] * r + sum;
        s_max[h] = m_new;
      }
    }
    __syncthreads();

    // ---- values: acc[h] = acc[h] * rescale[h] + sum_t p[h][t] * v[t] ------------------------
#pragma unroll
    for (int h = 0; h < GQ; ++h) {
      const float r = s_rescale[h];
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[h][v][e] *= r;
    }
    for (int base = warp * TPW * UNROLL; base < tile_len; base += kWarps * TPW * UNROLL) {
      VecT vv[UNROLL][NV];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int t = base + u * TPW + tig;
        if (t < tile_len) {
          const int pos = tile0 + t;
          const int64_t row = (int64_t)s_blocks[(pos >> p.block_shift) - first_block] * p.block_stride +
                              (int64_t)(pos & block_mask) * p.token_stride;
#pragma unroll
          for (int v = 0; v < NV; ++v) {
            const int vi = li + v * LPT;
            if (vi < NVEC) vv[u][v] = *reinterpret_cast<const VecT*>(v_cache + row + vi * VEC);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int t = base + u * TPW + tig;
        if (t < tile_len) {
          float w[GQ];
#pragma unroll
          for (int h = 0; h < GQ; ++h) w[h] = s_scores[h][t];
#pragma unroll
          for (int v = 0; v < NV; ++v) {
            if (li + v * LPT < NVEC) {
              float vf[VEC];
              to_float(vv[u][v], vf);
#pragma unroll
              for (int h = 0; h < GQ; ++h)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[h][v][e] = fmaf(w[h], vf[e], acc[h][v][e]);
            }
          }
        }
      }
    }
    __syncthreads();  // the next tile overwrites s_blocks and s_scores
  }

  // ---- combine the token groups of each warp, then the warps ---------------------------------
#pragma unroll
  for (int offset = LPT; offset < 32; offset <<= 1)
#pragma unroll
    for (int h = 0; h < GQ; ++h)
#pragma unroll
      for (int v = 0; v < NV; ++v)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[h][v][e] += __shfl_xor_sync(0xffffffffu, acc[h][v][e], offset);
  if (tig == 0) {
#pragma unroll
    for (int h = 0; h < GQ; ++h)
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int vi = li + v * LPT;
        if (vi < NVEC) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) s_acc[warp][h][vi * VEC + e] = acc[h][v][e];
        }
      }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < heads * D; i += kThreads) {
    const int h = i / D, d = i - h * D;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += s_acc[w][h][d];
    const float sum = s_sum[h];
    o = sum > 0.0f ? o / sum : 0.0f;
    if (p.splits == 1) {
      T* out = static_cast<T*>(p.out) + (int64_t)seq * p.out_seq_stride + (int64_t)(head0 + h) * p.out_head_stride;
      out[d] = Conv<T>::from_float(o);
    } else {
      const int64_t row = ((int64_t)seq * p.num_heads + head0 + h) * p.splits + split;
      p.partial_out[row * D + d] = o;
      if (d == 0) {
        p.partial_stats[row * 2] = s_max[h];
        p.partial_stats[row * 2 + 1] = sum;
      }
    }
  }
}

// Merges the splits of one (sequence, query head): out = sum_i w_i o_i / sum_i w_i with
// w_i = sum_i * exp(max_i - max). Only splits that overlap the sequence's attended range are read.
template <typename T>
__global__ void merge_splits_kernel(const Params p, int head_size) {
  const int seq = blockIdx.x, head = blockIdx.y;
  T* out = static_cast<T*>(p.out) + (int64_t)seq * p.out_seq_stride + (int64_t)head * p.out_head_stride;
  const int seq_len = max(p.seq_lens[seq], 0);
  if (seq_len == 0) {
    for (int d = threadIdx.x; d < head_size; d += blockDim.x) out[d] = Conv<T>::from_float(0.0f);
    return;
  }
  const int lo = p.window > 0 ? max(0, seq_len - p.window) : 0;
  const int span = seq_len - lo;  // >= 1 here
  const int first = 0;
  const int last = min((span - 1) / seq_split_tokens(span, p.splits), p.splits - 1);
  const int64_t row0 = ((int64_t)seq * p.num_heads + head) * p.splits;
  float m = -INFINITY;
  for (int i = first; i <= last; ++i) m = fmaxf(m, p.partial_stats[(row0 + i) * 2]);
  float total = 0.0f;
  for (int i = first; i <= last; ++i) {
    total += p.partial_stats[(row0 + i) * 2 + 1] * __expf(p.partial_stats[(row0 + i) * 2] - m);
  }
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float o = 0.0f;
    for (int i = first; i <= last; ++i) {
      const float w = p.partial_stats[(row0 + i) * 2 + 1] * __expf(p.partial_stats[(row0 + i) * 2] - m);
      o += w * p.partial_out[(row0 + i) * head_size + d];
    }
    out[d] = Conv<T>::from_float(o * inv);
  }
}

struct Plan {
  int chunks, per_chunk, gq, splits, split_tokens;
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
  int64_t splits = 1;
  if (num_splits > 0) {
    splits = num_splits;
  } else {
    const int64_t ctas = (int64_t)num_seqs * num_kv_heads * plan.chunks;
    if (ctas < kTargetCtas) splits = (kTargetCtas + ctas - 1) / ctas;
  }
  if (splits > units) splits = units;
  if (splits > 65535) splits = 65535;
  plan.splits = (int)splits;
  plan.split_tokens = 0;  // chosen per sequence in the kernels (seq_split_tokens)
  plan.workspace_bytes =
      splits > 1 ? (int64_t)num_seqs * num_heads * splits * (head_size + 2) * (int64_t)sizeof(float) : 0;
  return plan;
}

template <typename T, int D>
static void launch_for_gq(const Params& p, int gq, dim3 grid, cudaStream_t s) {
  switch (gq) {
    case 1: paged_decode_kernel<T, D, 1><<<grid, kThreads, 0, s>>>(p); break;
    case 2: paged_decode_kernel<T, D, 2><<<grid, kThreads, 0, s>>>(p); break;
    case 4: paged_decode_kernel<T, D, 4><<<grid, kThreads, 0, s>>>(p); break;
    default: paged_decode_kernel<T, D, (D > 128 ? 4 : 8)><<<grid, kThreads, 0, s>>>(p); break;
  }
}

template <typename T>
static int launch(const Params& p, int head_size, int gq, int num_seqs, cudaStream_t s) {
  const dim3 grid((unsigned)num_seqs, (unsigned)(p.num_kv_heads * p.chunks), (unsigned)p.splits);
  switch (head_size) {
    case 64: launch_for_gq<T, 64>(p, gq, grid, s); break;
    case 80: launch_for_gq<T, 80>(p, gq, grid, s); break;
    case 96: launch_for_gq<T, 96>(p, gq, grid, s); break;
    case 128: launch_for_gq<T, 128>(p, gq, grid, s); break;
    case 256: launch_for_gq<T, 256>(p, gq, grid, s); break;
    default: return fail(WLLM_ERR_INVALID_ARGUMENT, "paged_decode_attention: unsupported head size %d", head_size);
  }
  if (int rc = check_launch("paged_decode_attention")) return rc;
  if (p.splits > 1) {
    merge_splits_kernel<T><<<dim3((unsigned)num_seqs, (unsigned)p.num_heads), 128, 0, s>>>(p, head_size);
    return check_launch("paged_decode_attention (merge)");
  }
  return WLLM_OK;
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
}  // namespace WLLM_NS

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
  p.partial_out = static_cast<float*>(workspace);
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
  p.split_tokens = plan.split_tokens;
  p.scale = scale;
  p.softcap = logit_softcap;
  p.window = sliding_window;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  WLLM_DISPATCH_FLOAT(dtype, T, return launch<T>(p, head_size, plan.gq, num_seqs, s));
  return WLLM_OK;
}
