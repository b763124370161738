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

// Paged prefill attention. q [num_tokens, num_heads, head_size] holds the new tokens of num_seqs
// sequences back to back: sequence s owns rows query_start_loc[s] .. query_start_loc[s + 1] - 1
// (int32 [num_seqs + 1], device memory) and has seq_lens[s] tokens of context in total, the new
// ones included (their K/V already in the cache). Query i of sequence s sits at position
// seq_lens[s] - q_len + i and sees keys at positions <= its own (and > position - sliding_window
// when sliding_window > 0). Keys of sequence s live in blocks block_tables[s * block_table_stride
// + j] of k_cache / v_cache, each [num_blocks, block_size, num_kv_heads, head_size] with the
// given (shared) block/token/head strides and contiguous head dims. Scores are q.k * scale, then
// logit_softcap * tanh(score / logit_softcap) when logit_softcap > 0. Writes out rows
// 0 .. query_start_loc[num_seqs] - 1 (same layout as q, own strides). fp16/bf16 (tensor cores on
// SM 8.0+; pointers 16-byte aligned, strides multiples of 8) and fp32; head_size 64, 80, 96, 128 or
// 256; block_size a power of two.
WLLM_API int WLLM_FN(wllm_paged_prefill_attention)(
    void* out, const void* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* seq_lens, const int32_t* query_start_loc, int64_t num_tokens, int num_seqs, int num_heads,
    int num_kv_heads, int head_size, int block_size, int64_t block_table_stride, int64_t q_token_stride,
    int64_t q_head_stride, int64_t out_token_stride, int64_t out_head_stride, int64_t kv_block_stride,
    int64_t kv_token_stride, int64_t kv_head_stride, float scale, int sliding_window, float logit_softcap,
    int dtype, void* stream);
