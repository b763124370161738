// RMSNorm and fused residual-add + RMSNorm. One block per row; fp32 accumulation.
#include "common.cuh"

namespace WLLM_NS {

template <typename T>
__global__ void rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                                int64_t hidden, int64_t out_stride, int64_t x_stride, float eps,
                                float weight_offset) {
  __shared__ float scratch[32];
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
  __shared__ float scratch[32];
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

}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_rms_norm)(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden,
                           int64_t out_row_stride, int64_t x_row_stride, float eps, float weight_offset,
                           int dtype, void* stream) {
  if (int rc = WLLM_NS::check_norm_args(rows, hidden, x, weight)) return rc;
  if (rows == 0) return WLLM_OK;
  const int threads = WLLM_NS::block_size_for(hidden);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  WLLM_DISPATCH_FLOAT(dtype, T,
                      WLLM_NS::rms_norm_kernel<T><<<(unsigned)rows, threads, 0, s>>>(
                          static_cast<T*>(out), static_cast<const T*>(x), static_cast<const T*>(weight),
                          hidden, out_row_stride, x_row_stride, eps, weight_offset));
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
                      WLLM_NS::fused_add_rms_norm_kernel<T><<<(unsigned)rows, threads, 0, s>>>(
                          static_cast<T*>(x), static_cast<T*>(residual), static_cast<const T*>(weight),
                          hidden, x_row_stride, residual_row_stride, eps, weight_offset));
  return WLLM_NS::check_launch("fused_add_rms_norm");
}
