// wLLM kernel library: the C ABI. Every exported function takes raw device pointers, sizes,
// strides (in elements), a dtype code and a cudaStream_t (passed as void*), never allocates,
// and returns 0 on success or a WllmStatus code; wllm_last_error() then describes the failure.
#pragma once
#include <stdint.h>

#if defined(_WIN32)
#define WLLM_API extern "C" __declspec(dllexport)
#else
#define WLLM_API extern "C" __attribute__((visibility("default")))
#endif

// Symbols of a secondary toolkit leg carry a suffix (see wheels.toml); the primary leg's have none.
#ifndef WLLM_SYMBOL_SUFFIX
#define WLLM_SYMBOL_SUFFIX
#endif
#define WLLM_CAT_(a, b) a##b
#define WLLM_CAT(a, b) WLLM_CAT_(a, b)
#define WLLM_FN(name) WLLM_CAT(name, WLLM_SYMBOL_SUFFIX)

// Bumped whenever a signature below changes; the Python loader refuses a mismatched library.
#define WLLM_ABI_VERSION 1

enum WllmStatus {
  WLLM_OK = 0,
  WLLM_ERR_INVALID_ARGUMENT = 1,
  WLLM_ERR_CUDA = 2,
  WLLM_ERR_NO_KERNEL_IMAGE = 3,
};

enum WllmDType {
  WLLM_FLOAT32 = 0,
  WLLM_FLOAT16 = 1,
  WLLM_BFLOAT16 = 2,
};

WLLM_API int WLLM_FN(wllm_abi_version)(void);
// Message of the last failure on the calling thread ("" if none).
WLLM_API const char* WLLM_FN(wllm_last_error)(void);
// Checks that the library holds code the given device can run. On success writes the SM of the
// machine code that will run (e.g. 90) to *binary_sm and the PTX version it came from (0 when
// the SASS was prebuilt for this SM) to *ptx_version.
WLLM_API int WLLM_FN(wllm_device_check)(int device, int* binary_sm, int* ptx_version);

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * (weight + weight_offset), in fp32.
WLLM_API int WLLM_FN(wllm_rms_norm)(void* out, const void* x, const void* weight, int64_t rows, int64_t hidden,
                           int64_t out_row_stride, int64_t x_row_stride, float eps, float weight_offset,
                           int dtype, void* stream);

// In place: residual = x + residual (rounded to dtype); x = rms_norm(residual).
WLLM_API int WLLM_FN(wllm_fused_add_rms_norm)(void* x, void* residual, const void* weight, int64_t rows,
                                     int64_t hidden, int64_t x_row_stride, int64_t residual_row_stride,
                                     float eps, float weight_offset, int dtype, void* stream);

// In place rotary embedding of q [T, num_heads, head_size] and k [T, num_kv_heads, head_size]
// (k may be NULL); heads are contiguous within a token, tokens are q_token_stride apart.
// cos_sin_cache is fp32 [max_position, rot_dim]: cos for the first rot_dim/2 columns, then sin.
// is_neox: rotate pairs (i, i + rot_dim/2); otherwise GPT-J pairs (2i, 2i + 1).
WLLM_API int WLLM_FN(wllm_rotary_embedding)(const int64_t* positions, void* q, void* k, const float* cos_sin_cache,
                                   int64_t num_tokens, int num_heads, int num_kv_heads, int head_size,
                                   int rot_dim, int64_t q_token_stride, int64_t k_token_stride,
                                   int64_t max_position, int is_neox, int dtype, void* stream);
