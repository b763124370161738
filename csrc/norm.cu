// RMSNorm and fused residual-add + RMSNorm. One block per row; fp32 accumulation.
#include "common.cuh"

namespace WLLM_NS {

template <typename T>
__global__ void rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                                int64_t hidden, int64_t out_stride, int64_t x_stride, float eps,
                                float weight_offset) {
  pdl_trigger_early<PDL_NORM>();
  __shared__ float scratch[32];
  // x is the previous kernel's output: nothing to do before the wait but start the weight moving.
  if (threadIdx.x * 64 < hidden * (int64_t)sizeof(T)) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(weight) + threadIdx.x * 64));
  }
  pdl_wait_and_trigger<PDL_NORM>();
  const T* row = x + blockIdx.x * x_stride;
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float v = Conv<T>::to_float(row[i]);
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / (float)hidden + eps);
  T* dst = out + blockIdx.x * out_stride;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float w = Conv<T>::to_float(weight[i]) + weight_offset;
    dst[i] = Conv<T>::from_float(Conv<T>::to_float(row[i]) * inv_rms * w);
  }
}

template <typename T>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ x, T* __restrict__ residual,
                                          const T* __restrict__ weight, int64_t hidden, int64_t x_stride,
                                          int64_t res_stride, float eps, float weight_offset) {
  pdl_trigger_early<PDL_NORM>();
  __shared__ float scratch[32];
  if (threadIdx.x * 64 < hidden * (int64_t)sizeof(T)) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(weight) + threadIdx.x * 64));
  }
  pdl_wait_and_trigger<PDL_NORM>();
  T* xr = x + blockIdx.x * x_stride;
  T* rr = residual + blockIdx.x * res_stride;
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    // Round the sum to T first, as an unfused `residual + x` in T would.
    const T s = Conv<T>::from_float(Conv<T>::to_float(xr[i]) + Conv<T>::to_float(rr[i]));
    rr[i] = s;
    const float v = Conv<T>::to_float(s);
    sum_sq += v * v;
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / (float)hidden + eps);
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float w = Conv<T>::to_float(weight[i]) + weight_offset;
    xr[i] = Conv<T>::from_float(Conv<T>::to_float(rr[i]) * inv_rms * w);
  }
}

// Vectorised path for rows whose length, pointers and strides allow 16-byte accesses: each thread
// keeps its VPT vectors of the row in registers, so the row is read once and written once.
// ADD: residual = x + residual (rounded to T) first, and the norm is taken of that sum; then out
// may be x itself (no __restrict__ on them).
template <typename T, int VPT, bool ADD>
__global__ void rms_norm_vec_kernel(T* out, const T* x, T* __restrict__ residual,
                                    const T* __restrict__ weight, int nvec, int64_t out_stride,
                                    int64_t x_stride, int64_t res_stride, float eps, float weight_offset) {
  pdl_trigger_early<PDL_NORM>();
  constexpr int V = 16 / sizeof(T);
  __shared__ float scratch[32];
  const uint4* xr = reinterpret_cast<const uint4*>(x + blockIdx.x * x_stride);
  uint4* rr = ADD ? reinterpret_cast<uint4*>(residual + blockIdx.x * res_stride) : nullptr;
  // The weight is never written by a kernel in flight: fetch it before waiting on the previous kernel,
  // whose outputs (x, residual) are read only after pdl_wait(). Into registers when that costs few
  // (VPT <= 2: hidden up to 8K-16K); larger rows only prefetch it into L2, since the extra registers
  // would not fit the up-to-1024-thread CTAs those rows use.
  constexpr bool kEarlyWeight = VPT <= 2;
  const uint4* wr = reinterpret_cast<const uint4*>(weight);
  uint4 wv[kEarlyWeight ? VPT : 1];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int vi = threadIdx.x + i * blockDim.x;
    if (vi < nvec) {
      if (kEarlyWeight) {
        wv[i] = __ldg(wr + vi);
      } else {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(wr + vi));
      }
    }
  }
  pdl_wait_and_trigger<PDL_NORM>();
  float vals[VPT][V];
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int vi = threadIdx.x + i * blockDim.x;
    if (vi < nvec) {
      uint4 raw = xr[vi];
      const T* e = reinterpret_cast<const T*>(&raw);
      if (ADD) {
        uint4 rraw = rr[vi];
        T* r = reinterpret_cast<T*>(&rraw);
#pragma unroll
        for (int j = 0; j < V; ++j) r[j] = Conv<T>::from_float(Conv<T>::to_float(e[j]) + Conv<T>::to_float(r[j]));
        rr[vi] = rraw;
#pragma unroll
        for (int j = 0; j < V; ++j) vals[i][j] = Conv<T>::to_float(r[j]);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) vals[i][j] = Conv<T>::to_float(e[j]);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) sum_sq += vals[i][j] * vals[i][j];
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / (float)(nvec * V) + eps);
  uint4* dst = reinterpret_cast<uint4*>(out + blockIdx.x * out_stride);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int vi = threadIdx.x + i * blockDim.x;
    if (vi < nvec) {
      const uint4 wraw = kEarlyWeight ? wv[kEarlyWeight ? i : 0] : __ldg(wr + vi);
      const T* w = reinterpret_cast<const T*>(&wraw);
      uint4 oraw;
      T* o = reinterpret_cast<T*>(&oraw);
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = Conv<T>::from_float(vals[i][j] * inv_rms * (Conv<T>::to_float(w[j]) + weight_offset));
      dst[vi] = oraw;
    }
  }
}

static bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Launches the vectorised kernel when the shapes allow it; returns false to use the scalar one.
template <typename T, bool ADD>
static bool launch_vec(T* out, const T* x, T* residual, const T* weight, int64_t rows, int64_t hidden,
                       int64_t out_stride, int64_t x_stride, int64_t res_stride, float eps, float weight_offset,
                       cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  if (hidden % V || out_stride % V || x_stride % V || res_stride % V || !aligned16(out) || !aligned16(x) ||
      !aligned16(weight) || (ADD && !aligned16(residual)) || hidden > (int64_t)1024 * 8 * V) {
    return false;
  }
  const int nvec = (int)(hidden / V);
  int vpt = 1;
  while (nvec > 1024 * vpt) vpt *= 2;
  int threads = (nvec + vpt - 1) / vpt;
  threads = (threads + 31) / 32 * 32;
  const dim3 grid((unsigned)rows);
  switch (vpt) {
    case 1: launch_pdl(rms_norm_vec_kernel<T, 1, ADD>, grid, dim3(threads), 0, s, out, x, residual, weight, nvec, out_stride, x_stride, res_stride, eps, weight_offset); break;
    case 2: launch_pdl(rms_norm_vec_kernel<T, 2, ADD>, grid, dim3(threads), 0, s, out, x, residual, weight, nvec, out_stride, x_stride, res_stride, eps, weight_offset); break;
    case 4: launch_pdl(rms_norm_vec_kernel<T, 4, ADD>, grid, dim3(threads), 0, s, out, x, residual, weight, nvec, out_stride, x_stride, res_stride, eps, weight_offset); break;
    default: launch_pdl(rms_norm_vec_kernel<T, 8, ADD>, grid, dim3(threads), 0, s, out, x, residual, weight, nvec, out_stride, x_stride, res_stride, eps, weight_offset); break;
  }
  return true;
}

static int block_size_for(int64_t hidden) {
  int threads = 32;
  while (threads < 1024 && threads < hidden) threads <<= 1;
  return threads;
}

static int check_norm_args(int64_t rows, int64_t hidden, const void* x, const void* weight) {
  if (rows < 0 || hidden <= 0) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "rms_norm: bad shape rows=%lld hidden=%lld", (long long)rows,
                (long long)hidden);
  }
  if (x == nullptr || weight == nullptr) return fail(WLLM_ERR_INVALID_ARGUMENT, "rms_norm: null pointer");
  return WLLM_OK;
}

WLLM_TRACE_TU(norm)
}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_rms_norm)(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden,
                           int64_t out_row_stride, int64_t x_row_stride, float eps, float weight_offset,
                           int dtype, void* stream) {
  if (int rc = WLLM_NS::check_norm_args(rows, hidden, x, weight)) return rc;
  if (rows == 0) return WLLM_OK;
  const int threads = WLLM_NS::block_size_for(hidden);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  WLLM_DISPATCH_FLOAT(dtype, T,
                      if (!WLLM_NS::launch_vec<T, false>(static_cast<T*>(out), static_cast<const T*>(x), nullptr,
                                                         static_cast<const T*>(weight), rows, hidden,
                                                         out_row_stride, x_row_stride, 0, eps, weight_offset, s)) {
                        WLLM_NS::launch_pdl(
                            WLLM_NS::rms_norm_kernel<T>, dim3((unsigned)rows), dim3(threads), 0, s, static_cast<T*>(out), static_cast<const T*>(x), static_cast<const T*>(weight),
                            hidden, out_row_stride, x_row_stride, eps, weight_offset);
                      });
  return WLLM_NS::check_launch("rms_norm");
}

WLLM_API int WLLM_FN(wllm_fused_add_rms_norm)(void* x, void* residual, const void* weight, int64_t rows,
                                     int64_t hidden, int64_t x_row_stride, int64_t residual_row_stride,
                                     float eps, float weight_offset, int dtype, void* stream) {
  if (int rc = WLLM_NS::check_norm_args(rows, hidden, x, weight)) return rc;
  if (residual == nullptr) return WLLM_NS::fail(WLLM_ERR_INVALID_ARGUMENT, "fused_add_rms_norm: null residual");
  if (rows == 0) return WLLM_OK;
  const int threads = WLLM_NS::block_size_for(hidden);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  WLLM_DISPATCH_FLOAT(dtype, T,
                      if (!WLLM_NS::launch_vec<T, true>(static_cast<T*>(x), static_cast<const T*>(x),
                                                        static_cast<T*>(residual), static_cast<const T*>(weight),
                                                        rows, hidden, x_row_stride, x_row_stride,
                                                        residual_row_stride, eps, weight_offset, s)) {
                        WLLM_NS::launch_pdl(
                            WLLM_NS::fused_add_rms_norm_kernel<T>, dim3((unsigned)rows), dim3(threads), 0, s, static_cast<T*>(x), static_cast<T*>(residual), static_cast<const T*>(weight),
                            hidden, x_row_stride, residual_row_stride, eps, weight_offset);
                      });
  return WLLM_NS::check_launch("fused_add_rms_norm");
}
