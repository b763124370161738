// Token sampling on fp32 logits [S, V], one thread block per row (see api.h for the contract).
//
// Per row: raw log-softmax statistics (reported logprobs are those of the raw model distribution),
// then logit_bias and penalties applied in place (the touched logits are saved first and restored
// at the end, so the logits tensor is unchanged afterwards), then greedy argmax or, for random
// rows, temperature, top-k, top-p and min-p as value thresholds found by radix selection over the
// float bits, and an exponential race argmax(p_i / E_i) with E_i drawn from Philox4x32-10 keyed by
// the row's seed and counted by (token index, position): the same seed and position give the same
// token whatever else is in the batch. Histogram weights are integers (counts, or probability
// mass in 2^-32 units), so the selection is deterministic despite atomics.
#include <math.h>

#include "common.cuh"

namespace WLLM_NS {
namespace sampling {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBins = 2048;
constexpr float kMassScale = 4294967296.0f;  // 2^32

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
};

struct Shared {
  unsigned long long hist[kMaxBins];
  unsigned long long warp_u64[kWarps];
  float warp_f[kWarps];
  float warp_f2[kWarps];
  long long warp_i[kWarps];
  int found_bin;
  unsigned long long found_above;
  unsigned long long total;
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

// Finds the key of the threshold value v: the element value at which the weight of elements strictly
// above it is < target <= that weight plus its own (over elements whose key is >= floor_key). Weights
// are 1 (top-k: the k-th largest value) or exp(x - xmax) in 2^-32 units (top-p). Returns floor_key
// when the total weight stays below target. *total receives the total weight.
template <bool MASS>
__device__ uint32_t radix_threshold(const float* row, int64_t vocab, float temperature, float xmax,
                                    uint32_t floor_key, double target_fraction, unsigned long long target_count,
                                    Shared& sh) {
  const int kLevels = 3;
  const int kShift[kLevels] = {21, 10, 0};
  const int kBits[kLevels] = {11, 11, 10};
  uint32_t prefix = 0;
  unsigned long long target = target_count;
  for (int level = 0; level < kLevels; ++level) {
    const int shift = kShift[level], bins = 1 << kBits[level];
    for (int b = threadIdx.x; b < bins; b += kThreads) sh.hist[b] = 0;
    if (threadIdx.x == 0) sh.found_bin = -1;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      const float x = row[i] / temperature;
      const uint32_t key = float_key(x);
      if (key < floor_key) continue;
      if (level > 0 && (key >> (shift + kBits[level])) != prefix) continue;
      unsigned long long w = 1;
      // exp(.) <= 1 scaled by 2^32 is exact in fp32; truncation gives an integer weight.
      if (MASS) w = __float2ull_rz(expf(x - xmax) * kMassScale);
      if (w) atomicAdd(&sh.hist[(key >> shift) & (bins - 1)], w);
    }
    __syncthreads();
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
      if (total < target) return floor_key;  // everything is kept
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

__global__ void __launch_bounds__(kThreads) sample_kernel(const Params p) {
  __shared__ Shared sh;
  const int r = blockIdx.x;
  float* row = p.logits + (int64_t)r * p.row_stride;
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

  // ---- raw statistics: log-sum-exp and argmax ----
  float m = -INFINITY, s = 0.0f, best = -INFINITY;
  long long best_i = vocab;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    const float x = row[i];
    argmax_merge(best, best_i, x, i);
    lse_merge(m, s, x, 1.0f);
  }
  block_lse(m, s, sh);
  block_argmax(best, best_i, sh);
  const float lse = m + logf(s);
  if (p.raw_logprobs != nullptr) {
    float* lp = p.raw_logprobs + (int64_t)r * p.raw_logprobs_stride;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) lp[i] = row[i] - lse;
  }

  // ---- logit_bias, then penalties; originals saved for the restore ----
  const int b0 = p.bias_offsets ? p.bias_offsets[r] : 0, b1 = p.bias_offsets ? p.bias_offsets[r + 1] : 0;
  const int n0 = p.penalty_offsets ? p.penalty_offsets[r] : 0;
  const int n1 = p.penalty_offsets ? p.penalty_offsets[r + 1] : 0;
  const int bias_total = p.bias_offsets ? p.bias_offsets[p.num_rows] : 0;
  const bool penalise = repetition != 1.0f || frequency != 0.0f || presence != 0.0f;
  const bool modified = b1 > b0 || (penalise && n1 > n0);
  if (modified) {
    for (int e = b0 + threadIdx.x; e < b1; e += kThreads) {
      const int t = p.bias_tokens[e];
      if (t >= 0 && t < vocab) p.saved[e] = row[t];
    }
    for (int e = n0 + threadIdx.x; e < n1; e += kThreads) {
      const int t = p.penalty_tokens[e];
      if (t >= 0 && t < vocab) p.saved[bias_total + e] = row[t];
    }
    __syncthreads();
    for (int e = b0 + threadIdx.x; e < b1; e += kThreads) {
      const int t = p.bias_tokens[e];
      if (t >= 0 && t < vocab) atomicAdd(row + t, p.bias_values[e]);
    }
    __syncthreads();
    if (penalise) {
      for (int e = n0 + threadIdx.x; e < n1; e += kThreads) {
        const int t = p.penalty_tokens[e];
        if (t < 0 || t >= vocab) continue;
        float v = row[t];
        // Same operation order as the CPU sampler, without FMA contraction.
        if (repetition != 1.0f) v = v > 0.0f ? __fdiv_rn(v, repetition) : __fmul_rn(v, repetition);
        const int count = p.penalty_counts[e];
        if (count > 0) v = __fsub_rn(v, __fadd_rn(__fmul_rn(frequency, (float)count), presence));
        row[t] = v;
      }
    }
    __syncthreads();
    // The processed argmax.
    best = -INFINITY;
    best_i = vocab;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) argmax_merge(best, best_i, row[i], i);
    block_argmax(best, best_i, sh);
  }
  long long token = best_i < vocab ? best_i : 0;

  // ---- random rows: thresholds, then the exponential race ----
  if (temperature > 0.0f && best > -INFINITY) {
    const float xmax = best / temperature;
    uint32_t floor_key = 0;
    if (top_k > 0 && top_k < vocab) {
      floor_key = radix_threshold<false>(row, vocab, temperature, xmax, 0u, 0.0, (unsigned long long)top_k, sh);
    }
    if (top_p < 1.0f) {
      floor_key = radix_threshold<true>(row, vocab, temperature, xmax, floor_key, (double)top_p, 0ull, sh);
    }
    float best_score = -INFINITY;
    long long pick = vocab;
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int64_t g = threadIdx.x; g * 4 < vocab; g += kThreads) {
      float xs[4];
      bool keep[4];
      bool any = false;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t i = g * 4 + j;
        keep[j] = false;
        if (i < vocab) {
          xs[j] = row[i] / temperature;
          keep[j] = float_key(xs[j]) >= floor_key && !(min_p > 0.0f && expf(xs[j] - xmax) < min_p);
          any |= keep[j];
        }
      }
      if (!any) continue;
      const uint4 rnd = philox(make_uint4((uint32_t)g, (uint32_t)(g >> 32), (uint32_t)position,
                                          (uint32_t)(position >> 32)),
                               k0, k1);
      const uint32_t words[4] = {rnd.x, rnd.y, rnd.z, rnd.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (keep[j]) argmax_merge(best_score, pick, xs[j] + neg_log_exponential(words[j]), g * 4 + j);
      }
    }
    block_argmax(best_score, pick, sh);
    if (pick < vocab) token = pick;
  }

  // ---- restore the raw logits and report ----
  if (modified) {
    __syncthreads();
    for (int e = b0 + threadIdx.x; e < b1; e += kThreads) {
      const int t = p.bias_tokens[e];
      if (t >= 0 && t < vocab) row[t] = p.saved[e];
    }
    for (int e = n0 + threadIdx.x; e < n1; e += kThreads) {
      const int t = p.penalty_tokens[e];
      if (t >= 0 && t < vocab) row[t] = p.saved[bias_total + e];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    p.out_tokens[r] = token;
    p.out_logprobs[r] = row[token] - lse;
  }
}

}  // namespace sampling
}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_sample)(float* logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                                  const float* params_f32, const int64_t* params_i64, const int32_t* bias_offsets,
                                  const int32_t* bias_tokens, const float* bias_values, const int32_t* penalty_offsets,
                                  const int32_t* penalty_tokens, const int32_t* penalty_counts, float* saved,
                                  int64_t* out_tokens, float* out_logprobs, float* raw_logprobs,
                                  int64_t raw_logprobs_stride, void* stream) {
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
  sampling::sample_kernel<<<(unsigned)num_rows, sampling::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return check_launch("sample");
}
