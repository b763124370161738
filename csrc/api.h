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
#define WLLM_ABI_VERSION 7

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

// Programmatic Dependent Launch (sm_90+): the decode-path kernels (rms_norm, fused_add_rms_norm,
// rotary_and_cache, paged_decode_attention, act_and_mul, gemv) are launched so that each may start
// its independent prologue while the kernel before it finishes. Always on where the GPU has it; results
// are identical either way.
//
// Test hooks: the four setters below switch a default kernel choice off so that the tests on one GPU
// cover the paths other GPUs take by default (they are not user settings; nothing in the library reads
// the environment). Each is process-wide, affects launches made after the call (a CUDA graph keeps what
// it was captured with) and returns the previous setting.
//
// wllm_set_pdl(0): launch without the PDL attribute, as on pre-SM 9.0 GPUs (1 = the default).
WLLM_API int WLLM_FN(wllm_set_pdl)(int enable);

// Paged decode attention on tensor cores (sm_80+, fp16/bf16, head sizes up to 128) or on the FMA kernel
// that older GPUs, fp32 and head size 256 use. Modes: 2 = tensor cores for large batches, the FMA kernel
// for small ones (the default), 1 = tensor cores wherever they apply (their latency variant for small
// batches), 0 = the FMA kernel everywhere.
WLLM_API int WLLM_FN(wllm_set_decode_mma)(int mode);

// Paged decode attention's K/V tiles by TMA boxes on SM 9.0 (the tensor-core kernel's bandwidth variant,
// head sizes 64 and 128, no sliding window). Modes: 2 = calls without splits on the persistent kernel (a
// resident grid streaming unit after unit), the rest one CTA per unit (the default); 1 = one CTA per unit
// everywhere; 0 = off (per-row bulk copies, as other tensor-core GPUs run it).
WLLM_API int WLLM_FN(wllm_set_decode_tma)(int mode);

// The Hopper (wgmma) prefill-attention kernel on SM 9.0: 1 (the default) or 0 (the mma.sync kernel of
// other tensor-core GPUs).
WLLM_API int WLLM_FN(wllm_set_prefill_sm90)(int enabled);

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

// ---- Decode path (cache.cu, attention_decode.cu, activation.cu, sampling.cu) ----

// Writes the new keys/values key/value [num_tokens, num_kv_heads, head_size] (token and head
// strides given, head dims contiguous) into key_cache/value_cache [num_blocks, block_size,
// num_kv_heads, head_size] (shared block/token/head strides) at slot_mapping[t] (int64, device) =
// block * block_size + offset. Slots < 0 (graph padding) or >= num_blocks * block_size are skipped.
WLLM_API int WLLM_FN(wllm_reshape_and_cache)(const void* key, const void* value, void* key_cache,
                                             void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                                             int num_kv_heads, int head_size, int block_size, int64_t num_blocks,
                                             int64_t key_token_stride, int64_t key_head_stride,
                                             int64_t value_token_stride, int64_t value_head_stride,
                                             int64_t cache_block_stride, int64_t cache_token_stride,
                                             int64_t cache_head_stride, int dtype, void* stream);

// Rotary embedding fused with the KV-cache write (one launch instead of wllm_rotary_embedding +
// wllm_reshape_and_cache): rotates q [num_tokens, num_heads, head_size] in place exactly as
// wllm_rotary_embedding does, and writes the rotated key and the value [num_tokens, num_kv_heads,
// head_size] into key_cache/value_cache at slot_mapping[t] as wllm_reshape_and_cache does (slots < 0
// or >= num_blocks * block_size are skipped; q of such rows is still rotated). key is only read: the
// rotated keys exist only in the cache. q/key/value take token and head strides (head dims
// contiguous), so views straight out of a fused qkv projection need no copy; caches as above.
// Any head_size and even rot_dim <= head_size; 16-byte accesses when pointers and strides allow.
WLLM_API int WLLM_FN(wllm_rotary_and_cache)(
    const int64_t* positions, void* q, const void* key, const void* value, void* key_cache, void* value_cache,
    const int64_t* slot_mapping, const float* cos_sin_cache, int64_t num_tokens, int num_heads, int num_kv_heads,
    int head_size, int rot_dim, int block_size, int64_t num_blocks, int64_t max_position, int64_t q_token_stride,
    int64_t q_head_stride, int64_t key_token_stride, int64_t key_head_stride, int64_t value_token_stride,
    int64_t value_head_stride, int64_t cache_block_stride, int64_t cache_token_stride, int64_t cache_head_stride,
    int is_neox, int dtype, void* stream);

// Copies whole blocks between two caches (or inside one): for each (src, dst) pair of `pairs`
// (int64 [num_pairs, 2], HOST memory), block_bytes contiguous bytes at src + plane * src_plane_stride +
// src * src_block_stride go to the same plane of dst, for num_planes planes (layers x K/V). Either
// side may be device or pinned host memory (cudaMemcpyDefault). Runs of consecutive pairs become
// one 2D copy each, so a swap is one call per direction. Strides in bytes.
WLLM_API int WLLM_FN(wllm_copy_blocks)(const void* src, void* dst, const int64_t* pairs, int64_t num_pairs,
                                       int64_t num_planes, int64_t block_bytes, int64_t src_num_blocks,
                                       int64_t dst_num_blocks, int64_t src_block_stride, int64_t dst_block_stride,
                                       int64_t src_plane_stride, int64_t dst_plane_stride, void* stream);

// The qkv projection of decode rows with the rotary embedding and the KV-cache write fused in (gemv.cu):
// weight is [(num_heads + 2 * num_kv_heads) * head_size, in_features] (q heads, k heads, v heads; optional
// bias of as many elements); for each of the `rows` rows of x (in_features elements, 1-2 per pass over the
// weight) the product is rounded to the dtype, then q and k heads are rotated by positions[r] as
// wllm_rotary_and_cache rotates them (cos_sin: fp32 [max_position, rot_dim], cos half then sin half;
// NeoX or GPT-J pairs; dims past rot_dim pass through), q goes to q_out (row r at r * q_row_stride, heads
// contiguous) and k, v into the caches [num_blocks, block_size, num_kv_heads, head_size] (strides in
// elements, head dims contiguous) at slots[r] (skipped when < 0). in_features and weight_row_stride must be
// multiples of 8 and the weight 16-byte aligned; fp16/bf16.
WLLM_API int WLLM_FN(wllm_gemv_rotary_cache)(void* q_out, const void* x, const void* weight, const void* bias,
                                             int64_t rows, int64_t in_features, int64_t q_row_stride,
                                             int64_t x_row_stride, int64_t weight_row_stride, const int64_t* positions,
                                             const int64_t* slots, const float* cos_sin, int64_t max_position,
                                             int rot_dim, void* key_cache, void* value_cache, int64_t num_blocks,
                                             int block_size, int num_heads, int num_kv_heads, int head_size,
                                             int64_t cache_block_stride, int64_t cache_token_stride,
                                             int64_t cache_head_stride, int is_neox, int dtype, void* stream);

// Grammar masks (grammar.cu): for each row r of logits [num_rows, vocab] (row stride logits_stride, contiguous
// columns) whose slot = mask_index[r] is >= 0 (mask_index int32 [num_rows] on the device; NULL: slot r), sets
// logits[r, v] = -inf for every token v whose bit (bit v % 32 of word v / 32) in bitmask row `slot` (int32
// [slots, mask_words], device) is 0; tokens past 32 * mask_words are masked too. fp32/fp16/bf16; in place.
WLLM_API int WLLM_FN(wllm_apply_token_bitmask)(void* logits, const int32_t* bitmask, const int32_t* mask_index,
                                               int64_t num_rows, int64_t vocab, int64_t logits_stride,
                                               int64_t mask_words, int dtype, void* stream);

// 1 when ptr is host memory a kernel can read and write at the same address (pinned with cudaHostAlloc,
// unified addressing), else 0 (then use copies). Never fails.
WLLM_API int WLLM_FN(wllm_host_mapped)(const void* ptr);

// A decode step's staging in one small kernel (one CTA) on `stream`: copies nbytes from src to dst
// (either may be pinned host memory, see wllm_host_mapped; read uncached, written through), then, when
// n > 0, sets input_ids[t_i] = prev_tokens[r_i] for i < n, (t_i, r_i) = (pairs[i], pairs[n + i]) or (i, i)
// when pairs is NULL (prev_dtype 1: int64 ids, 2: float64 ids; pairs int64 [2, n] on the device, may lie
// inside dst). For a few KB: larger transfers belong to the copy engine.
WLLM_API int WLLM_FN(wllm_stage_copy)(void* dst, const void* src, int64_t nbytes, int64_t* input_ids,
                                      const void* prev_tokens, int prev_dtype, const int64_t* pairs, int64_t n,
                                      void* stream);

// Bytes of fp32 workspace wllm_paged_decode_attention needs for these sizes (0 when it will not split).
WLLM_API int WLLM_FN(wllm_paged_decode_workspace_size)(int num_seqs, int num_heads, int num_kv_heads, int head_size,
                                                       int64_t max_seq_len, int num_splits, int64_t* bytes);

// Paged decode attention: one query per sequence. q [num_seqs, num_heads, head_size], out likewise
// (own strides, contiguous head dims); K/V of sequence s in blocks block_tables[s * block_table_stride
// + j] of k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_size] (shared strides);
// seq_lens int32 [num_seqs] (device) counts the context, the current token included; a 0 gives a zero
// output row. Scores are q.k * scale, then logit_softcap * tanh(score / logit_softcap) when
// logit_softcap > 0; only the last sliding_window keys when sliding_window > 0. max_seq_len is a host
// bound on seq_lens that sizes the split grid (a CUDA graph captured for it serves any shorter
// context); num_splits 0 splits automatically, > 0 asks for that many (tests, tuning). The workspace
// (fp32, 16-byte aligned) must hold wllm_paged_decode_workspace_size(...) bytes for the same sizes and
// be zero-filled before its first use: its first 16 KB hold the tickets with which the last CTA of a
// split sequence merges the splits in the same launch; every call leaves them zero again, so one
// workspace serves calls of any size and CUDA-graph replays, on one stream at a time.
// fp16/bf16/fp32; head_size 64, 80, 96, 128 or 256; block_size a power of two >= 8; q and caches
// 16-byte aligned with strides that are multiples of 16 bytes.
WLLM_API int WLLM_FN(wllm_paged_decode_attention)(
    void* out, const void* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* seq_lens, int num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,
    int64_t max_seq_len, int64_t block_table_stride, int64_t q_seq_stride, int64_t q_head_stride,
    int64_t out_seq_stride, int64_t out_head_stride, int64_t kv_block_stride, int64_t kv_token_stride,
    int64_t kv_head_stride, float scale, int sliding_window, float logit_softcap, int num_splits, void* workspace,
    int64_t workspace_bytes, int dtype, void* stream);

// out[r, i] = act(x[r, i]) * x[r, inter + i] for i < inter (x rows are [gate | up]), fp32 math.
// activation: 0 = SiLU, 1 = tanh-approximated GELU.
WLLM_API int WLLM_FN(wllm_act_and_mul)(void* out, const void* x, int64_t rows, int64_t inter, int64_t out_row_stride,
                                       int64_t x_row_stride, int activation, int dtype, void* stream);

// Bytes of workspace wllm_sample may use (a constant of this library). The caller zeroes it once; every
// call leaves it zeroed again. One workspace serves calls that run one after another (one stream, or
// the replays of CUDA graphs captured on it), not calls that run at the same time.
WLLM_API int WLLM_FN(wllm_sample_workspace_size)(int64_t* bytes);

// Samples one token per row of fp32 logits [num_rows, vocab] (row_stride apart). Per row r:
// params_f32[r] = (temperature, top_p, min_p, repetition_penalty, frequency_penalty, presence_penalty),
// params_i64[r] = (top_k, seed, position). logit_bias is CSR: entries bias_offsets[r] ..
// bias_offsets[r + 1] - 1 of (bias_tokens, bias_values) are added (duplicates add up; -inf bans, e.g.
// for min_tokens). Penalties are CSR too: (penalty_tokens, penalty_counts) lists each token of the
// prompt or output once with its count in the output (0 = prompt only); seen tokens get the
// repetition penalty (positive logits divided, others multiplied), then logit -= frequency * count +
// presence when count > 0. Either offsets pointer may be NULL (no entries). saved (fp32) holds
// bias_offsets[num_rows] + penalty_offsets[num_rows] floats of scratch; logits are modified during
// the call and restored before it returns. temperature <= 0: argmax of the processed logits (first
// index on ties). Otherwise x = logits / temperature; keep x >= the top_k-th largest (top_k in
// (0, vocab)); then, over those, the tokens whose strictly-more-probable mass is < top_p (ties with
// the last kept value kept); and exp(x - max) >= min_p; then pick argmax(x - log E_i), E_i ~ Exp(1)
// from Philox4x32-10 with key = seed and counter = (i / 4, position). Writes out_tokens (int64) and
// out_logprobs (the raw log-softmax of the chosen token); raw_logprobs (optional, [num_rows, vocab],
// raw_logprobs_stride apart) receives the whole raw log-softmax. workspace (optional, 128-byte
// aligned, wllm_sample_workspace_size bytes, see there) lets several thread blocks share a row when
// there are few rows; without it each row gets one block. Results do not depend on it.
WLLM_API int WLLM_FN(wllm_sample)(float* logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                                  const float* params_f32, const int64_t* params_i64, const int32_t* bias_offsets,
                                  const int32_t* bias_tokens, const float* bias_values, const int32_t* penalty_offsets,
                                  const int32_t* penalty_tokens, const int32_t* penalty_counts, float* saved,
                                  int64_t* out_tokens, float* out_logprobs, float* raw_logprobs,
                                  int64_t raw_logprobs_stride, void* workspace, int64_t workspace_bytes,
                                  void* stream);

// Skinny GEMM for decode (gemv.cu): out[r, n] = sum_k in[r, k] * weight[n, k] (+ bias[n]) for r < rows, with
// fp32 accumulation, rounded once to the dtype (fp16 or bf16 only). weight is [out_features, in_features]
// (nn.Linear's layout), rows weight_row_stride apart; bias (optional, NULL for none) has out_features
// elements. prologue 0: in = x, x rows hold in_features elements. prologue 1 (SiLU) or 2 (tanh-GELU): x rows
// are [gate | up] (2 * in_features elements) and in = round(act(gate) * up), as wllm_act_and_mul would
// produce it. Strides in elements. Meant for a few rows (decode, 1..16): it reads the weight once per 16
// rows. Fastest with 16-byte aligned weight and x, in_features and the row strides multiples of 8; any
// layout works. One row of x must fit in the GPU's shared memory (in_features up to ~24K on every GPU).
// Bits 8..15 of prologue force a kernel variant (benchmarks, tests; 0 = automatic): 1 = split-K, 2 = row-group
// (lanes per row from K), 3/4/5 = row-group with 32/16/8 lanes per row; a row-group variant that does not
// apply (rows > 4, K not a multiple of 8, unaligned) runs split-K. Bits 16..23 (with bits 0..7 zero): a gated
// output, 1 = SiLU, 2 = tanh-GELU: weight holds [gate rows | up rows] (out_features of them, even) and out
// gets out_features / 2 columns, out[r, n] = round(act(round(g)) * round(u)) with g and u rows n and
// n + out_features / 2 of the product (plus bias), as wllm_act_and_mul over the plain product would give; it
// needs in_features and weight_row_stride multiples of 8 and a 16-byte aligned weight.
WLLM_API int WLLM_FN(wllm_gemv)(void* out, const void* x, const void* weight, const void* bias, int64_t rows,
                                int64_t out_features, int64_t in_features, int64_t out_row_stride,
                                int64_t x_row_stride, int64_t weight_row_stride, int prologue, int dtype,
                                void* stream);
