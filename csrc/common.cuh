// Shared helpers for every kernel file: error reporting, dtype dispatch, conversions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "api.h"

// Each toolkit leg compiles into its own namespace so that legs can share one library.
#ifndef WLLM_NS
#define WLLM_NS wllm
#endif

namespace WLLM_NS {

// Records a printf-style message as the calling thread's last error and returns `code`.
int fail(int code, const char* fmt, ...);

// Checks the launch that just happened; returns WLLM_OK or WLLM_ERR_CUDA with the CUDA message.
int check_launch(const char* what);

template <typename T>
struct Conv;
template <>
struct Conv<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <>
struct Conv<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};
template <>
struct Conv<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds >= 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int num_warps = (blockDim.x + 31) >> 5;
  v = (lane < num_warps) ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

}  // namespace WLLM_NS

// Runs the following statement with `T` bound to the element type of dtype code `code`.
#define WLLM_DISPATCH_FLOAT(code, T, ...)                                                   \
  switch (code) {                                                                           \
    case WLLM_FLOAT32: {                                                                    \
      typedef float T;                                                                      \
      __VA_ARGS__;                                                                          \
    } break;                                                                                \
    case WLLM_FLOAT16: {                                                                    \
      typedef __half T;                                                                     \
      __VA_ARGS__;                                                                          \
    } break;                                                                                \
    case WLLM_BFLOAT16: {                                                                   \
      typedef __nv_bfloat16 T;                                                              \
      __VA_ARGS__;                                                                          \
    } break;                                                                                \
    default:                                                                                \
      return ::WLLM_NS::fail(WLLM_ERR_INVALID_ARGUMENT, "unsupported dtype code %d", (int)code); \
  }
