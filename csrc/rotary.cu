// Rotary position embedding applied in place to q and k, NeoX or GPT-J pairing, fp32 math.
#include "common.cuh"

namespace WLLM_NS {

template <typename T>
__device__ __forceinline__ void rotate_heads(T* base, int num_heads, int head_size, int half,
                                             const float* cos_row, const float* sin_row, bool neox) {
  const int work = num_heads * half;
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int head = i / half;
    const int j = i - head * half;
    T* h = base + (int64_t)head * head_size;
    const int a = neox ? j : 2 * j;
    const int b = neox ? j + half : 2 * j + 1;
    const float x1 = Conv<T>::to_float(h[a]);
    const float x2 = Conv<T>::to_float(h[b]);
    const float c = cos_row[j];
    const float s = sin_row[j];
    h[a] = Conv<T>::from_float(x1 * c - x2 * s);
    h[b] = Conv<T>::from_float(x2 * c + x1 * s);
  }
}

template <typename T>
__global__ void rotary_kernel(const int64_t* __restrict__ positions, T* __restrict__ q, T* __restrict__ k,
                              const float* __restrict__ cache, int num_heads, int num_kv_heads,
                              int head_size, int rot_dim, int64_t q_stride, int64_t k_stride,
                              int64_t max_position, bool neox) {
  const int64_t token = blockIdx.x;
  int64_t pos = positions[token];
  // Out-of-range positions are a caller bug; clamp rather than read outside the cache.
  if (pos < 0) pos = 0;
  if (pos >= max_position) pos = max_position - 1;
  const int half = rot_dim / 2;
  const float* cos_row = cache + pos * rot_dim;
  const float* sin_row = cos_row + half;
  rotate_heads<T>(q + token * q_stride, num_heads, head_size, half, cos_row, sin_row, neox);
  if (k != nullptr) rotate_heads<T>(k + token * k_stride, num_kv_heads, head_size, half, cos_row, sin_row, neox);
}

}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_rotary_embedding)(const int64_t* positions, void* q, void* k, const float* cos_sin_cache,
                                   int64_t num_tokens, int num_heads, int num_kv_heads, int head_size,
                                   int rot_dim, int64_t q_token_stride, int64_t k_token_stride,
                                   int64_t max_position, int is_neox, int dtype, void* stream) {
  if (positions == nullptr || q == nullptr || cos_sin_cache == nullptr) {
    return WLLM_NS::fail(WLLM_ERR_INVALID_ARGUMENT, "rotary_embedding: null pointer");
  }
  if (num_tokens < 0 || num_heads <= 0 || head_size <= 0 || rot_dim <= 0 || rot_dim > head_size ||
      rot_dim % 2 != 0 || max_position <= 0 || (k != nullptr && num_kv_heads <= 0)) {
    return WLLM_NS::fail(WLLM_ERR_INVALID_ARGUMENT,
                      "rotary_embedding: bad sizes (heads=%d kv_heads=%d head_size=%d rot_dim=%d)", num_heads,
                      num_kv_heads, head_size, rot_dim);
  }
  if (num_tokens == 0) return WLLM_OK;
  const int pairs = (num_heads > num_kv_heads ? num_heads : num_kv_heads) * (rot_dim / 2);
  int threads = 32;
  while (threads < 512 && threads < pairs) threads <<= 1;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  WLLM_DISPATCH_FLOAT(dtype, T,
                      WLLM_NS::rotary_kernel<T><<<(unsigned)num_tokens, threads, 0, s>>>(
                          positions, static_cast<T*>(q), static_cast<T*>(k), cos_sin_cache, num_heads,
                          num_kv_heads, head_size, rot_dim, q_token_stride, k_token_stride, max_position,
                          is_neox != 0));
  return WLLM_NS::check_launch("rotary_embedding");
}
