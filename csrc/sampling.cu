// Token sampling on fp32 logits [S, V] (see api.h for the contract).
//
// Per row: raw log-softmax statistics (reported logprobs are those of the raw model distribution),
// then logit_bias and penalties applied in place (the touched logits are saved first and restored
// at the end, so the logits tensor is unchanged afterwards), then greedy argmax or, for random
// rows, temperature, top-k, top-p and min-p as value thresholds found by radix selection over the
// float bits, and an exponential race argmax(p_i / E_i) with E_i drawn from Philox4x32-10 keyed by
// the row's seed and counted by (token index, position): the same seed and position give the same
// token whatever else is in the batch. Histogram weights are integers (counts, or probability
// mass in 2^-32 units), so the selection is deterministic despite atomics.
//
// Work split: a row is cut into `splits` contiguous chunks of 4-logit groups, one thread block
// each. With few rows (batch-1 decode) one block per row would read a 600 KB row from one SM at
// a few GB/s; many blocks per row read it at the chip's bandwidth. The blocks of a row meet at
// barriers (an arrival counter per row in the caller's workspace) after each phase: statistics,
// then one per radix level; partial results go through the workspace and every block combines
// them in the same order, so all blocks of a row hold bit-identical maxima, thresholds and
// totals, and the result does not depend on the number of blocks (integer histograms, exact
// max/argmax, per-token random numbers). The last block to finish combines the race winners,
// writes the outputs and resets the counters, so the workspace is ready for the next launch and
// CUDA graph replays stay valid. Spinning at a barrier needs every block of the grid resident at
// once: the launcher splits rows only when rows * splits fits the device's resident capacity
// (SMs x blocks per SM), and otherwise runs one block per row with no barrier at all.
#include <math.h>
#include <stdint.h>

#include "common.cuh"

namespace WLLM_NS {
namespace sampling {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBins = 2048;
constexpr int kMaxSplits = 256;
constexpr int kMaxSplitRows = 128;    // rows that may be split (bounds the workspace)
constexpr int kMinGroupsPerSplit = 256;  // 1,024 logits: smaller chunks cost more in barriers than they save
constexpr float kMassScale = 4294967296.0f;  // 2^32

// Partial results of one block of a row, exchanged through the workspace.
struct Partial {
  float m, s;        // log-sum-exp pair of the raw logits
  float best;        // processed maximum
  float score;       // race winner's score
  long long best_i;  // processed argmax
  long long pick;    // race winner
};

// Workspace of one split row. counters[0]: barrier arrivals, counters[1]: finished blocks; both are
// zero between launches (the caller zeroes the workspace once, the last block resets them).
struct RowWork {
  unsigned int counters[32];  // 128 bytes: the counters own their cache line
  Partial part[kMaxSplits];
  unsigned long long hist[3][kMaxBins];  // a ring of global histograms, one per radix level in flight
};

struct Params {
  float* logits;
  int64_t row_stride, vocab;
  const float* params_f;    // [S, 6]: temperature, top_p, min_p, repetition, frequency, presence
  const int64_t* params_i;  // [S, 3]: top_k, seed, position
  const int32_t* bias_offsets;
  const int32_t* bias_tokens;
  const float* bias_values;
  const int32_t* penalty_offsets;
  const int32_t* penalty_tokens;
  const int32_t* penalty_counts;
  float* saved;
  int64_t* out_tokens;
  float* out_logprobs;
  float* raw_logprobs;
  int64_t raw_logprobs_stride;
  int num_rows;
  int splits;
  int64_t groups_per_split;
  RowWork* work;
};

struct Shared {
  unsigned long long hist[kMaxBins];
  unsigned long long wbuf[kWarps][32];
  unsigned long long warp_u64[kWarps];
  float warp_f[kWarps];
  float warp_f2[kWarps];
  long long warp_i[kWarps];
  int found_bin;
  int last;
  unsigned long long found_above;
  unsigned long long total;
};

// One block's view of its row.
struct Ctx {
  float* row;
  int64_t vocab;
  int64_t g0, g1;  // this block's 4-logit groups [g0, g1)
  bool vec;        // the row is 16-byte aligned: whole groups load as float4
  bool cg;         // the row is modified in place: read through L2 only (L1 may hold stale lines)
  int splits, split;
  RowWork* work;
  unsigned int phase;
};
// Order-preserving map of floats onto unsigned ints (-inf lowest, +inf highest).
__device__ __forceinline__ uint32_t float_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Larger value wins; on a tie the lower index does (torch.argmax returns the first maximum).
__device__ __forceinline__ void argmax_merge(float& v, long long& i, float v2, long long i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

__device__ void block_argmax(float& v, long long& i, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const long long i2 = __shfl_xor_sync(0xffffffffu, i, o);
    argmax_merge(v, i, v2, i2);
  }
  __syncthreads();
  if (lane == 0) {
    sh.warp_f[warp] = v;
    sh.warp_i[warp] = i;
  }
  __syncthreads();
  v = sh.warp_f[0];
  i = sh.warp_i[0];
  for (int w = 1; w < kWarps; ++w) argmax_merge(v, i, sh.warp_f[w], sh.warp_i[w]);
}

// Merges (max, sum of exp(x - max)) pairs.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  const float mx = fmaxf(m, m2);
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

__device__ void block_lse(float& m, float& s, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
  __syncthreads();
  if (lane == 0) {
    sh.warp_f[warp] = m;
    sh.warp_f2[warp] = s;
  }
  __syncthreads();
  m = sh.warp_f[0];
  s = sh.warp_f2[0];
  for (int w = 1; w < kWarps; ++w) lse_merge(m, s, sh.warp_f[w], sh.warp_f2[w]);
}

// Exclusive prefix sum over the block (thread order); every thread gets its own prefix.
__device__ unsigned long long block_exclusive_scan(unsigned long long v, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  __syncthreads();
  if (lane == 31) sh.warp_u64[warp] = inc;
  __syncthreads();
  unsigned long long before = 0;
  for (int w = 0; w < warp; ++w) before += sh.warp_u64[w];
  return before + inc - v;
}

__device__ __forceinline__ void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const unsigned long long p = (unsigned long long)a * b;
  hi = (uint32_t)(p >> 32);
  lo = (uint32_t)p;
}

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
__device__ __forceinline__ uint4 philox(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(0xD2511F53u, c.x, hi0, lo0);
    mulhilo(0xCD9E8D57u, c.z, hi1, lo1);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
  }
  return c;
}

// -log(E) with E ~ Exp(1) from a 32-bit random word. u = (top 23 bits + 1/2) / 2^23 lies in
// (0, 1) and is exact in fp32 (24 significant bits), so neither log ever sees 0 or 1.
__device__ __forceinline__ float neg_log_exponential(uint32_t r) {
  const float u = ((float)(r >> 9) + 0.5f) * 1.1920928955078125e-7f;  // 2^-23
  return -logf(-logf(u));
}

// Loads the 4-logit group g of the row; ok[j] marks logits inside the vocabulary.
__device__ __forceinline__ void load_group(const Ctx& c, int64_t g, float v[4], bool ok[4]) {
  const int64_t i = g * 4;
  if (c.vec && i + 4 <= c.vocab) {
    const float4* src = reinterpret_cast<const float4*>(c.row + i);
    const float4 q = c.cg ? __ldcg(src) : *src;
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
#pragma unroll
    for (int j = 0; j < 4; ++j) ok[j] = true;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      ok[j] = i + j < c.vocab;
      v[j] = ok[j] ? (c.cg ? __ldcg(c.row + i + j) : c.row[i + j]) : -INFINITY;
    }
  }
}

// Calls f(g, v, ok) for every group of the block's chunk. UNROLL groups per thread are loaded before
// any is used, so each thread keeps UNROLL x 16 bytes in flight. The trip count is the same for every
// thread (groups past the chunk come with ok all false), so f may use warp collectives.
template <int UNROLL, typename F>
__device__ __forceinline__ void for_each_group(const Ctx& c, F f) {
  for (int64_t base = c.g0; base < c.g1; base += (int64_t)kThreads * UNROLL) {
    float v[UNROLL][4];
    bool ok[UNROLL][4];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t g = base + (int64_t)u * kThreads + threadIdx.x;
      if (g < c.g1) {
        load_group(c, g, v[u], ok[u]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          v[u][j] = -INFINITY;
          ok[u][j] = false;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) f(base + (int64_t)u * kThreads + threadIdx.x, v[u], ok[u]);
  }
}

// Barrier of the blocks of one row: every block's writes before it are visible to every block after
// it (read them with __ldcg: L1 is not coherent across SMs). Phase k waits for splits * k arrivals.
__device__ void row_barrier(Ctx& c) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int target = ++c.phase * (unsigned int)c.splits;
    __threadfence();
    atomicAdd(&c.work->counters[0], 1u);
    volatile unsigned int* arrived = &c.work->counters[0];
    while (*arrived < target) __nanosleep(32);
    __threadfence();
  } else {
    ++c.phase;
  }
  __syncthreads();
}

// Adds weight w to hist[bin] for the lanes with valid set. Lanes of a warp that hit the same bin add
// their weights first and one of them issues the atomic: clustered values (most of the probability
// mass in a few bins) would otherwise serialise 32 shared-memory atomics on one address.
template <bool MASS>
__device__ __forceinline__ void warp_hist_add(unsigned long long* hist, uint32_t bin, unsigned long long w,
                                              bool valid, unsigned long long* wbuf) {
  const unsigned int active = __ballot_sync(0xffffffffu, valid);
  if (!valid) return;
  const int lane = threadIdx.x & 31;
  const unsigned int peers = __match_any_sync(active, bin);
  const int leader = __ffs(peers) - 1;
  if (!MASS) {
    if (lane == leader) atomicAdd(hist + bin, (unsigned long long)__popc(peers));
    return;
  }
  wbuf[lane] = w;
  __syncwarp(active);
  if (lane == leader) {
    unsigned long long sum = 0;
    for (unsigned int rest = peers; rest; rest &= rest - 1) sum += wbuf[__ffs(rest) - 1];
    atomicAdd(hist + bin, sum);
  }
  __syncwarp(active);  // wbuf is rewritten by the next call
}

// Finds the key of the threshold value v: the element value at which the weight of elements strictly
// above it is < target <= that weight plus its own (over elements whose key is >= floor_key). Weights
// are 1 (top-k: the k-th largest value) or exp(x - xmax) in 2^-32 units (top-p). Returns floor_key
// when the total weight stays below target. With several blocks per row the histograms of each
// level are summed in the workspace (level_id picks the ring slot) and every block scans the sum.
template <bool MASS>
__device__ uint32_t radix_threshold(Ctx& c, float temperature, float xmax, uint32_t floor_key,
                                    double target_fraction, unsigned long long target_count, int& level_id,
                                    Shared& sh) {
  const int kLevels = 3;
  const int kShift[kLevels] = {21, 10, 0};
  const int kBits[kLevels] = {11, 11, 10};
  const int warp = threadIdx.x >> 5;
  uint32_t prefix = 0;
  unsigned long long target = target_count;
  for (int level = 0; level < kLevels; ++level) {
    const int shift = kShift[level], bins = 1 << kBits[level];
    for (int b = threadIdx.x; b < bins; b += kThreads) sh.hist[b] = 0;
    if (threadIdx.x == 0) sh.found_bin = -1;
    if (c.splits > 1) {
      // The next level's global histogram was last read before the previous barrier: clear it now,
      // the barrier of this level orders the clearing before anyone adds to it.
      unsigned long long* next = c.work->hist[(level_id + 1) % 3];
      for (int b = c.split * kThreads + threadIdx.x; b < kMaxBins; b += c.splits * kThreads) next[b] = 0;
    }
    __syncthreads();
    const int high = shift + kBits[level];
    for_each_group<2>(c, [&](int64_t, const float* v, const bool* ok) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float x = v[j] / temperature;
        const uint32_t key = float_key(x);
        bool valid = ok[j] && key >= floor_key && (level == 0 || (key >> high) == prefix);
        unsigned long long w = 1;
        // exp(.) <= 1 scaled by 2^32 is exact in fp32; truncation gives an integer weight.
        if (MASS && valid) w = __float2ull_rz(expf(x - xmax) * kMassScale);
        valid = valid && w != 0;
        warp_hist_add<MASS>(sh.hist, (key >> shift) & (uint32_t)(bins - 1), w, valid, sh.wbuf[warp]);
      }
    });
    __syncthreads();
    if (c.splits > 1) {
      unsigned long long* global = c.work->hist[level_id % 3];
      for (int b = threadIdx.x; b < bins; b += kThreads) {
        if (sh.hist[b]) atomicAdd(global + b, sh.hist[b]);
      }
      row_barrier(c);
      for (int b = threadIdx.x; b < bins; b += kThreads) sh.hist[b] = __ldcg(global + b);
      __syncthreads();
    }
    ++level_id;
    // Thread t owns bins_per_thread consecutive bins, counted from the top.
    const int per = bins / kThreads;
    unsigned long long local = 0;
    for (int j = 0; j < per; ++j) local += sh.hist[bins - 1 - (threadIdx.x * per + j)];
    unsigned long long above = block_exclusive_scan(local, sh);
    if (level == 0) {
      // The last thread's inclusive prefix is the total weight.
      if (threadIdx.x == kThreads - 1) sh.total = above + local;
      __syncthreads();
      const unsigned long long total = sh.total;
      if (MASS) target = (unsigned long long)ceil(target_fraction * (double)total);
      if (target == 0) target = 1;
      if (total < target) return floor_key;  // everything is kept (the same decision in every block)
      __syncthreads();
    }
    for (int j = 0; j < per; ++j) {
      const int b = bins - 1 - (threadIdx.x * per + j);
      const unsigned long long h = sh.hist[b];
      if (above < target && above + h >= target) {
        sh.found_bin = b;
        sh.found_above = above;
      }
      above += h;
    }
    __syncthreads();
    prefix = (prefix << kBits[level]) | (uint32_t)sh.found_bin;
    target -= sh.found_above;
    __syncthreads();  // hist, found_* are reused by the next level
  }
  return prefix;
}

// Applies `op(t, e, saved_index)` to the CSR entries of row r whose token lies in [lo, hi).
template <typename F>
__device__ __forceinline__ void for_each_entry(const int32_t* tokens, int e0, int e1, int64_t lo, int64_t hi, F op) {
  for (int e = e0 + threadIdx.x; e < e1; e += kThreads) {
    const int t = tokens[e];
    if (t >= lo && t < hi) op(t, e);
  }
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const Params p) {
  __shared__ Shared sh;
  const int r = (int)(blockIdx.x / (unsigned)p.splits);
  Ctx c;
  c.row = p.logits + (int64_t)r * p.row_stride;
  c.vocab = p.vocab;
  c.splits = p.splits;
  c.split = (int)(blockIdx.x % (unsigned)p.splits);
  const int64_t groups = (p.vocab + 3) / 4;
  c.g0 = min(groups, (int64_t)c.split * p.groups_per_split);
  c.g1 = min(groups, c.g0 + p.groups_per_split);
  c.vec = (reinterpret_cast<uintptr_t>(c.row) & 15) == 0;
  c.work = p.splits > 1 ? p.work + r : nullptr;
  c.phase = 0;
  const int64_t lo = c.g0 * 4, hi = min(c.g1 * 4, p.vocab);  // this block's logits
  const int64_t vocab = p.vocab;
  const float temperature = p.params_f[r * 6 + 0];
  const float top_p = p.params_f[r * 6 + 1];
  const float min_p = p.params_f[r * 6 + 2];
  const float repetition = p.params_f[r * 6 + 3];
  const float frequency = p.params_f[r * 6 + 4];
  const float presence = p.params_f[r * 6 + 5];
  const long long top_k = p.params_i[r * 3 + 0];
  const unsigned long long seed = (unsigned long long)p.params_i[r * 3 + 1];
  const unsigned long long position = (unsigned long long)p.params_i[r * 3 + 2];

  const int b0 = p.bias_offsets ? p.bias_offsets[r] : 0, b1 = p.bias_offsets ? p.bias_offsets[r + 1] : 0;
  const int n0 = p.penalty_offsets ? p.penalty_offsets[r] : 0;
  const int n1 = p.penalty_offsets ? p.penalty_offsets[r + 1] : 0;
  const int bias_total = p.bias_offsets ? p.bias_offsets[p.num_rows] : 0;
  const bool penalise = repetition != 1.0f || frequency != 0.0f || presence != 0.0f;
  const bool modified = b1 > b0 || (penalise && n1 > n0);
  c.cg = false;

  // ---- phase 1: raw statistics of the chunk (log-sum-exp, argmax) ----
  if (c.splits > 1) {
    // The first radix level's global histogram: cleared here, ordered before its use by the barrier below.
    unsigned long long* first = c.work->hist[0];
    for (int b = c.split * kThreads + threadIdx.x; b < kMaxBins; b += c.splits * kThreads) first[b] = 0;
  }
  float m = -INFINITY, s = 0.0f, best = -INFINITY;
  long long best_i = vocab;
  for_each_group<4>(c, [&](int64_t g, const float* v, const bool* ok) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (!ok[j]) continue;
      const float x = v[j];
      argmax_merge(best, best_i, x, g * 4 + j);
      // Online log-sum-exp: one exp per logit, a rescale only when the maximum moves.
      if (x > m) {
        s = (m == -INFINITY ? 0.0f : s * expf(m - x)) + 1.0f;
        m = x;
      } else if (x != -INFINITY) {
        s += expf(x - m);
      }
    }
  });
  block_lse(m, s, sh);
  block_argmax(best, best_i, sh);

  // ---- logit_bias, then penalties, on this block's logits; originals saved for the restore ----
  if (modified) {
    c.cg = true;  // logits change under L1 from here on
    for_each_entry(p.bias_tokens, b0, b1, lo, hi, [&](int t, int e) { p.saved[e] = __ldcg(c.row + t); });
    for_each_entry(p.penalty_tokens, n0, n1, lo, hi,
                   [&](int t, int e) { p.saved[bias_total + e] = __ldcg(c.row + t); });
    __syncthreads();
    for_each_entry(p.bias_tokens, b0, b1, lo, hi, [&](int t, int e) { atomicAdd(c.row + t, p.bias_values[e]); });
    __syncthreads();
    if (penalise) {
      for_each_entry(p.penalty_tokens, n0, n1, lo, hi, [&](int t, int e) {
        float v = __ldcg(c.row + t);
        // Same operation order as the CPU sampler, without FMA contraction.
        if (repetition != 1.0f) v = v > 0.0f ? __fdiv_rn(v, repetition) : __fmul_rn(v, repetition);
        const int count = p.penalty_counts[e];
        if (count > 0) v = __fsub_rn(v, __fadd_rn(__fmul_rn(frequency, (float)count), presence));
        c.row[t] = v;
      });
    }
    __syncthreads();
    // The processed argmax.
    best = -INFINITY;
    best_i = vocab;
    for_each_group<4>(c, [&](int64_t g, const float* v, const bool* ok) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (ok[j]) argmax_merge(best, best_i, v[j], g * 4 + j);
      }
    });
    block_argmax(best, best_i, sh);
  }

  // ---- combine the row's partial statistics (same order in every block: identical results) ----
  if (c.splits > 1) {
    if (threadIdx.x == 0) {
      Partial& q = c.work->part[c.split];
      q.m = m;
      q.s = s;
      q.best = best;
      q.best_i = best_i;
    }
    row_barrier(c);
    m = -INFINITY;
    s = 0.0f;
    best = -INFINITY;
    best_i = vocab;
    for (int k = threadIdx.x; k < c.splits; k += kThreads) {
      const Partial* q = &c.work->part[k];
      lse_merge(m, s, __ldcg(&q->m), __ldcg(&q->s));
      argmax_merge(best, best_i, __ldcg(&q->best), __ldcg(&q->best_i));
    }
    block_lse(m, s, sh);
    block_argmax(best, best_i, sh);
  }
  const float lse = m + logf(s);
  if (p.raw_logprobs != nullptr) {
    float* lp = p.raw_logprobs + (int64_t)r * p.raw_logprobs_stride;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) lp[i] = (c.cg ? __ldcg(c.row + i) : c.row[i]) - lse;
    if (modified) {
      __syncthreads();  // the saved raw values replace the processed ones just written
      for_each_entry(p.bias_tokens, b0, b1, lo, hi, [&](int t, int e) { lp[t] = p.saved[e] - lse; });
      for_each_entry(p.penalty_tokens, n0, n1, lo, hi, [&](int t, int e) { lp[t] = p.saved[bias_total + e] - lse; });
    }
  }
  long long token = best_i < vocab ? best_i : 0;

  // ---- random rows: thresholds, then the exponential race over this block's logits ----
  float best_score = -INFINITY;
  long long pick = vocab;
  const bool random = temperature > 0.0f && best > -INFINITY;  // the same in every block of the row
  if (random) {
    const float xmax = best / temperature;
    uint32_t floor_key = 0;
    int level_id = 0;
    if (top_k > 0 && top_k < vocab) {
      floor_key = radix_threshold<false>(c, temperature, xmax, 0u, 0.0, (unsigned long long)top_k, level_id, sh);
    }
    if (top_p < 1.0f) {
      floor_key = radix_threshold<true>(c, temperature, xmax, floor_key, (double)top_p, 0ull, level_id, sh);
    }
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for_each_group<2>(c, [&](int64_t g, const float* v, const bool* ok) {
      float xs[4];
      bool keep[4];
      bool any = false;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        xs[j] = v[j] / temperature;
        keep[j] = ok[j] && float_key(xs[j]) >= floor_key && !(min_p > 0.0f && expf(xs[j] - xmax) < min_p);
        any |= keep[j];
      }
      if (!any) return;
      const uint4 rnd = philox(make_uint4((uint32_t)g, (uint32_t)((unsigned long long)g >> 32), (uint32_t)position,
                                          (uint32_t)(position >> 32)),
                               k0, k1);
      const uint32_t words[4] = {rnd.x, rnd.y, rnd.z, rnd.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (keep[j]) argmax_merge(best_score, pick, xs[j] + neg_log_exponential(words[j]), g * 4 + j);
      }
    });
    block_argmax(best_score, pick, sh);
  }

  // ---- restore this block's logits ----
  if (modified) {
    __syncthreads();  // every thread is done reading the processed logits
    for_each_entry(p.bias_tokens, b0, b1, lo, hi, [&](int t, int e) { c.row[t] = p.saved[e]; });
    for_each_entry(p.penalty_tokens, n0, n1, lo, hi, [&](int t, int e) { c.row[t] = p.saved[bias_total + e]; });
  }

  // ---- the last block of the row combines the race winners and reports ----
  if (c.splits > 1) {
    if (threadIdx.x == 0) {
      Partial& q = c.work->part[c.split];
      q.score = best_score;
      q.pick = pick;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned int done = atomicAdd(&c.work->counters[1], 1u);
      sh.last = done == (unsigned int)c.splits - 1;
      if (sh.last) __threadfence();
    }
    __syncthreads();
    if (!sh.last) return;
    if (random) {
      best_score = -INFINITY;
      pick = vocab;
      for (int k = threadIdx.x; k < c.splits; k += kThreads) {
        const Partial* q = &c.work->part[k];
        argmax_merge(best_score, pick, __ldcg(&q->score), __ldcg(&q->pick));
      }
      block_argmax(best_score, pick, sh);
    }
  } else {
    __syncthreads();  // the restore above is complete
  }
  if (threadIdx.x == 0) {
    if (random && pick < vocab) token = pick;
    p.out_tokens[r] = token;
    p.out_logprobs[r] = __ldcg(c.row + token) - lse;
    if (c.splits > 1) {
      // Every other block has passed its last barrier: the counters can start over.
      c.work->counters[0] = 0;
      c.work->counters[1] = 0;
    }
  }
}

}  // namespace sampling
}  // namespace WLLM_NS

namespace {

// Blocks of sample_kernel that can be resident at once on the current device (0 when unknown),
// cached per device: a barrier inside the kernel may only wait for blocks that are running.
int resident_capacity() {
  using namespace WLLM_NS;
  static int cache[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
    cudaGetLastError();
    return 0;
  }
  if (cache[device] == 0) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sampling::sample_kernel, sampling::kThreads, 0) !=
            cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    cache[device] = sms * per_sm;
  }
  return cache[device];
}

}  // namespace

WLLM_API int WLLM_FN(wllm_sample_workspace_size)(int64_t* bytes) {
  if (bytes == nullptr) return WLLM_NS::fail(WLLM_ERR_INVALID_ARGUMENT, "sample_workspace_size: null output");
  *bytes = (int64_t)sizeof(WLLM_NS::sampling::RowWork) * WLLM_NS::sampling::kMaxSplitRows;
  return WLLM_OK;
}

WLLM_API int WLLM_FN(wllm_sample)(float* logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                                  const float* params_f32, const int64_t* params_i64, const int32_t* bias_offsets,
                                  const int32_t* bias_tokens, const float* bias_values, const int32_t* penalty_offsets,
                                  const int32_t* penalty_tokens, const int32_t* penalty_counts, float* saved,
                                  int64_t* out_tokens, float* out_logprobs, float* raw_logprobs,
                                  int64_t raw_logprobs_stride, void* workspace, int64_t workspace_bytes,
                                  void* stream) {
  using namespace WLLM_NS;
  if (num_rows < 0 || num_rows > 0x7fffffffLL || vocab <= 0 || vocab > 0x7fffffffLL || row_stride < vocab) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "sample: bad shape rows=%lld vocab=%lld row_stride=%lld",
                (long long)num_rows, (long long)vocab, (long long)row_stride);
  }
  if (num_rows == 0) return WLLM_OK;
  if (logits == nullptr || params_f32 == nullptr || params_i64 == nullptr || out_tokens == nullptr ||
      out_logprobs == nullptr) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "sample: null pointer");
  }
  if ((bias_offsets != nullptr && (bias_tokens == nullptr || bias_values == nullptr || saved == nullptr)) ||
      (penalty_offsets != nullptr && (penalty_tokens == nullptr || penalty_counts == nullptr || saved == nullptr))) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "sample: CSR offsets given without their entries or the saved buffer");
  }
  if (raw_logprobs != nullptr && raw_logprobs_stride < vocab) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "sample: raw_logprobs row stride %lld < vocab %lld",
                (long long)raw_logprobs_stride, (long long)vocab);
  }
  const int64_t need = (int64_t)sizeof(sampling::RowWork) * sampling::kMaxSplitRows;
  if (workspace != nullptr && (workspace_bytes < need || (reinterpret_cast<uintptr_t>(workspace) & 127) != 0)) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "sample: workspace of %lld bytes at %p; need %lld, 128-byte aligned",
                (long long)workspace_bytes, workspace, (long long)need);
  }
  // Blocks per row: enough to spread the row over the chip, at least kMinGroupsPerSplit groups each,
  // and all blocks resident at once (the barriers spin). One block per row needs no workspace.
  const int64_t groups = (vocab + 3) / 4;
  int64_t splits = 1;
  if (workspace != nullptr && num_rows <= sampling::kMaxSplitRows) {
    const int64_t capacity = resident_capacity();
    splits = capacity / num_rows;
    splits = splits < (groups + sampling::kMinGroupsPerSplit - 1) / sampling::kMinGroupsPerSplit
                 ? splits
                 : (groups + sampling::kMinGroupsPerSplit - 1) / sampling::kMinGroupsPerSplit;
    splits = splits < sampling::kMaxSplits ? splits : sampling::kMaxSplits;
    if (splits < 2) splits = 1;
  }
  const int64_t per_split = (groups + splits - 1) / splits;
  splits = (groups + per_split - 1) / per_split;  // no empty blocks
  sampling::Params p;
  p.logits = logits;
  p.row_stride = row_stride;
  p.vocab = vocab;
  p.params_f = params_f32;
  p.params_i = params_i64;
  p.bias_offsets = bias_offsets;
  p.bias_tokens = bias_tokens;
  p.bias_values = bias_values;
  p.penalty_offsets = penalty_offsets;
  p.penalty_tokens = penalty_tokens;
  p.penalty_counts = penalty_counts;
  p.saved = saved;
  p.out_tokens = out_tokens;
  p.out_logprobs = out_logprobs;
  p.raw_logprobs = raw_logprobs;
  p.raw_logprobs_stride = raw_logprobs_stride;
  p.num_rows = (int)num_rows;
  p.splits = (int)splits;
  p.groups_per_split = per_split;
  p.work = static_cast<sampling::RowWork*>(workspace);
  sampling::sample_kernel<<<(unsigned)(num_rows * splits), sampling::kThreads, 0,
                            static_cast<cudaStream_t>(stream)>>>(p);
  return check_launch("sample");
}
