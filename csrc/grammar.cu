// Constrained decoding: masking the logits of tokens a grammar does not allow.
#include <limits.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace WLLM_NS {

template <typename T>
__device__ __forceinline__ T negative_infinity();
template <>
__device__ __forceinline__ float negative_infinity<float>() {
  return -INFINITY;
}
template <>
__device__ __forceinline__ __half negative_infinity<__half>() {
  return __float2half(-INFINITY);
}
template <>
__device__ __forceinline__ __nv_bfloat16 negative_infinity<__nv_bfloat16>() {
  return __float2bfloat16(-INFINITY);
}

// grid (column tiles, rows). One thread per logit, so the writes of a warp are contiguous; the warp's 32
// columns share one mask word, which the cache serves once.
template <typename T>
__global__ void apply_token_bitmask_kernel(T* __restrict__ logits, const int32_t* __restrict__ bitmask,
                                           const int32_t* __restrict__ mask_index, int64_t vocab,
                                           int64_t logits_stride, int64_t mask_words) {
  const int64_t row = blockIdx.y;
  const int32_t slot = mask_index == nullptr ? (int32_t)row : mask_index[row];
  if (slot < 0) return;
  const int64_t col = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= vocab) return;
  const int64_t word = col >> 5;
  const bool allowed = word < mask_words && ((bitmask[slot * mask_words + word] >> (col & 31)) & 1);
  if (!allowed) logits[row * logits_stride + col] = negative_infinity<T>();
}

}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_apply_token_bitmask)(void* logits, const int32_t* bitmask, const int32_t* mask_index,
                                               int64_t num_rows, int64_t vocab, int64_t logits_stride,
                                               int64_t mask_words, int dtype, void* stream) {
  using namespace WLLM_NS;
  if (num_rows < 0 || vocab < 0 || mask_words < 0 || logits_stride < vocab) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "apply_token_bitmask: bad sizes (rows=%lld vocab=%lld stride=%lld words=%lld)", (long long)num_rows,
                (long long)vocab, (long long)logits_stride, (long long)mask_words);
  }
  if (num_rows == 0 || vocab == 0) return WLLM_OK;
  if (logits == nullptr || (bitmask == nullptr && mask_words > 0)) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "apply_token_bitmask: null pointer");
  }
  if (num_rows > 65535) return fail(WLLM_ERR_INVALID_ARGUMENT, "apply_token_bitmask: too many rows");
  const int threads = 256;
  const int64_t tiles = (vocab + threads - 1) / threads;
  if (tiles > INT_MAX) return fail(WLLM_ERR_INVALID_ARGUMENT, "apply_token_bitmask: vocabulary too large");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid((unsigned)tiles, (unsigned)num_rows);
  WLLM_DISPATCH_FLOAT(dtype, T, {
    apply_token_bitmask_kernel<T><<<grid, threads, 0, s>>>(static_cast<T*>(logits), bitmask, mask_index, vocab,
                                                           logits_stride, mask_words);
  });
  return check_launch("apply_token_bitmask");
}
