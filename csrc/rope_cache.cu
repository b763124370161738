// Rotary embedding fused with the paged KV-cache write: q is rotated in place, k is rotated on its
// way into the cache (the k tensor itself is only read) and v is copied into the cache. One launch
// per layer instead of rotary_embedding + reshape_and_cache, both of which are launch-bound at
// decode batch sizes. Math as in rotary.cu (fp32, one rounding), so the cache holds the same bits.
#include <limits.h>
#include <string.h>

#include "common.cuh"

namespace WLLM_NS {

namespace rope_cache {

// VEC contiguous elements; moved as one 16-byte access when VEC * sizeof(T) == 16 (the caller
// guarantees alignment then), element by element otherwise.
template <typename T, int VEC>
struct Pack {
  T e[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load(const T* p) {
  Pack<T, VEC> r;
  if constexpr (VEC * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    memcpy(&r, &raw, 16);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) r.e[i] = p[i];
  }
  return r;
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T* p, const Pack<T, VEC>& v) {
  if constexpr (VEC * sizeof(T) == 16) {
    uint4 raw;
    memcpy(&raw, &v, 16);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) p[i] = v.e[i];
  }
}

// VEC consecutive fp32 table entries starting at p (16-byte aligned when VEC % 4 == 0 on the wide path).
template <int VEC>
__device__ __forceinline__ void load_angles(float (&dst)[VEC], const float* p) {
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      const float4 f = __ldg(reinterpret_cast<const float4*>(p + i));
      dst[i] = f.x;
      dst[i + 1] = f.y;
      dst[i + 2] = f.z;
      dst[i + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) dst[i] = __ldg(p + i);
  }
}

// Rotates rotary pairs j .. j + VEC - 1 of one head read from src and writes them to dst (src ==
// dst for q in place: one thread owns both elements of each of its pairs, so there is no race).
// NeoX pairs (i, i + half): two runs of VEC at j and half + j. GPT-J pairs (2i, 2i + 1): one run of
// 2 * VEC at 2j, loaded as two packs.
template <typename T, int VEC>
__device__ __forceinline__ void rotate(T* dst, const T* src, int j, int half, const float* cos_row,
                                       const float* sin_row, bool neox) {
  const int off0 = neox ? j : 2 * j;
  const int off1 = neox ? half + j : 2 * j + VEC;
  const Pack<T, VEC> a = load<T, VEC>(src + off0);
  const Pack<T, VEC> b = load<T, VEC>(src + off1);
  float c[VEC], s[VEC];
  load_angles<VEC>(c, cos_row + j);
  load_angles<VEC>(s, sin_row + j);
  float x[2 * VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    x[i] = Conv<T>::to_float(a.e[i]);
    x[VEC + i] = Conv<T>::to_float(b.e[i]);
  }
  float y[2 * VEC];
  if (neox) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float x1 = x[i], x2 = x[VEC + i];
      y[i] = x1 * c[i] - x2 * s[i];
      y[VEC + i] = x2 * c[i] + x1 * s[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float x1 = x[2 * i], x2 = x[2 * i + 1];
      y[2 * i] = x1 * c[i] - x2 * s[i];
      y[2 * i + 1] = x2 * c[i] + x1 * s[i];
    }
  }
  Pack<T, VEC> oa, ob;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    oa.e[i] = Conv<T>::from_float(y[i]);
    ob.e[i] = Conv<T>::from_float(y[VEC + i]);
  }
  store<T, VEC>(dst + off0, oa);
  store<T, VEC>(dst + off1, ob);
}

// Tokens per block for large batches (the launcher takes 1 otherwise).
constexpr int kManyPerBlock = 4;

// A block per TPB consecutive tokens. Its threads stride over four kinds of work item per token, each VEC
// wide: rotary pairs of q heads (in place), rotary pairs of k heads (into the key cache), the pass-through
// dims of k heads beyond rot_dim (copied into the key cache) and whole v heads (into the value cache).
// Padding rows (slot < 0) and out-of-range slots rotate q only. Several tokens per block because a token's
// position and slot are one global round trip before its data's: every thread loads all of the block's
// positions and slots at once (broadcast loads, no shared memory or barrier), so they cost one round trip
// per block rather than per token (prefill batches of thousands of tokens ran at ~55% of the copy
// bandwidth with a block per token).
template <typename T, int VEC, int TPB>
__global__ void rotary_and_cache_kernel(const int64_t* __restrict__ positions, T* __restrict__ q,
                                        const T* __restrict__ key, const T* __restrict__ value,
                                        T* __restrict__ key_cache, T* __restrict__ value_cache,
                                        const int64_t* __restrict__ slot_mapping,
                                        const float* __restrict__ cos_sin_cache, int64_t num_tokens,
                                        int num_heads, int num_kv_heads, int head_size, int rot_dim,
                                        int block_size, int64_t num_slots, int64_t max_position, int64_t q_tok,
                                        int64_t q_head, int64_t k_tok, int64_t k_head, int64_t v_tok,
                                        int64_t v_head, int64_t c_block, int64_t c_tok, int64_t c_head, bool neox) {
  pdl_trigger_early<PDL_ROPE>();
  const int64_t token0 = (int64_t)blockIdx.x * TPB;
  const int n_tok = (int)min((int64_t)TPB, num_tokens - token0);
  int64_t r_pos[TPB], r_slot[TPB];
#pragma unroll
  for (int u = 0; u < TPB; ++u) {
    int64_t pos = 0, slot = -1;
    if (u < n_tok) {
      pos = positions[token0 + u];
      slot = slot_mapping[token0 + u];
    }
    // Out-of-range positions are a caller bug; clamp (as rotary.cu does) rather than read outside the table.
    r_pos[u] = pos < 0 ? 0 : (pos >= max_position ? max_position - 1 : pos);
    r_slot[u] = slot;
  }
  const int half = rot_dim / 2;
  // positions, slot_mapping (host->device copies) and the cos/sin table (constant) are never written by
  // a kernel in flight: read them and start the tokens' table rows (rot_dim floats each) moving into L2
  // before waiting. q, key and value are that kernel's outputs (the qkv projection), and the cache slots
  // may still be read by it: both only after pdl_wait().
#pragma unroll
  for (int u = 0; u < TPB; ++u) {
    if (u >= n_tok) break;
    const float* cos_row = cos_sin_cache + r_pos[u] * rot_dim;
    for (int b = (int)threadIdx.x * 32; b < rot_dim; b += (int)blockDim.x * 32) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(cos_row + b));
    }
  }
  pdl_wait_and_trigger<PDL_ROPE>();

  const int rot_items = half / VEC;                    // per head, VEC pairs each
  const int pass_items = (head_size - rot_dim) / VEC;  // per k head, VEC elements each
  const int head_items = head_size / VEC;              // per v head
  const int q_work = num_heads * rot_items;
#pragma unroll
  for (int u = 0; u < TPB; ++u) {
    if (u >= n_tok) break;
    const int64_t token = token0 + u, slot = r_slot[u];
    const float* cos_row = cos_sin_cache + r_pos[u] * rot_dim;
    const float* sin_row = cos_row + half;
    const bool cached = slot >= 0 && slot < num_slots;
    const int kr_work = cached ? num_kv_heads * rot_items : 0;
    const int kp_work = cached ? num_kv_heads * pass_items : 0;
    const int v_work = cached ? num_kv_heads * head_items : 0;
    const int total = q_work + kr_work + kp_work + v_work;

    int64_t dst_base = 0;
    if (cached) {
      const int64_t block = slot / block_size;
      dst_base = block * c_block + (slot - block * block_size) * c_tok;
    }
    T* q_row = q + token * q_tok;
    const T* k_row = key + token * k_tok;
    const T* v_row = value + token * v_tok;

    for (int i = threadIdx.x; i < total; i += blockDim.x) {
      int r = i;
      if (r < q_work) {
        const int head = r / rot_items;
        const int j = (r - head * rot_items) * VEC;
        T* h = q_row + head * q_head;
        rotate<T, VEC>(h, h, j, half, cos_row, sin_row, neox);
        continue;
      }
      r -= q_work;
      if (r < kr_work) {
        const int head = r / rot_items;
        const int j = (r - head * rot_items) * VEC;
        rotate<T, VEC>(key_cache + dst_base + head * c_head, k_row + head * k_head, j, half, cos_row, sin_row, neox);
        continue;
      }
      r -= kr_work;
      if (r < kp_work) {
        const int head = r / pass_items;
        const int d = rot_dim + (r - head * pass_items) * VEC;
        store<T, VEC>(key_cache + dst_base + head * c_head + d, load<T, VEC>(k_row + head * k_head + d));
        continue;
      }
      r -= kp_work;
      const int head = r / head_items;
      const int d = (r - head * head_items) * VEC;
      store<T, VEC>(value_cache + dst_base + head * c_head + d, load<T, VEC>(v_row + head * v_head + d));
    }
  }
}

// From this many tokens on, blocks take kManyPerBlock tokens each.
constexpr int64_t kManyTokens = 1024;

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, int VEC>
static void launch(int threads, cudaStream_t s, int64_t num_tokens, const int64_t* positions, void* q,
                   const void* key, const void* value, void* key_cache, void* value_cache,
                   const int64_t* slot_mapping, const float* cos_sin_cache, int num_heads, int num_kv_heads,
                   int head_size, int rot_dim, int block_size, int64_t num_slots, int64_t max_position, int64_t q_tok,
                   int64_t q_head, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head, int64_t c_block,
                   int64_t c_tok, int64_t c_head, bool neox) {
  // Several tokens per block only where the grid stays many waves deep (prefill batches); decode batches of
  // a few hundred tokens keep a block each, so every SM gets work.
  const bool many = num_tokens >= kManyTokens;
  const int tpb = many ? kManyPerBlock : 1;
  const unsigned blocks = (unsigned)((num_tokens + tpb - 1) / tpb);
  launch_pdl(many ? rotary_and_cache_kernel<T, VEC, kManyPerBlock> : rotary_and_cache_kernel<T, VEC, 1>, dim3(blocks),
      dim3(threads), 0, s, positions, static_cast<T*>(q), static_cast<const T*>(key), static_cast<const T*>(value),
      static_cast<T*>(key_cache), static_cast<T*>(value_cache), slot_mapping, cos_sin_cache, num_tokens, num_heads,
      num_kv_heads, head_size, rot_dim, block_size, num_slots, max_position, q_tok, q_head, k_tok, k_head, v_tok,
      v_head, c_block, c_tok, c_head, neox);
}

}  // namespace rope_cache

WLLM_TRACE_TU(rope)
}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_rotary_and_cache)(
    const int64_t* positions, void* q, const void* key, const void* value, void* key_cache, void* value_cache,
    const int64_t* slot_mapping, const float* cos_sin_cache, int64_t num_tokens, int num_heads, int num_kv_heads,
    int head_size, int rot_dim, int block_size, int64_t num_blocks, int64_t max_position, int64_t q_token_stride,
    int64_t q_head_stride, int64_t key_token_stride, int64_t key_head_stride, int64_t value_token_stride,
    int64_t value_head_stride, int64_t cache_block_stride, int64_t cache_token_stride, int64_t cache_head_stride,
    int is_neox, int dtype, void* stream) {
  using namespace WLLM_NS;
  if (positions == nullptr || q == nullptr || key == nullptr || value == nullptr || key_cache == nullptr ||
      value_cache == nullptr || slot_mapping == nullptr || cos_sin_cache == nullptr) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "rotary_and_cache: null pointer");
  }
  if (num_tokens < 0 || num_heads <= 0 || num_kv_heads <= 0 || head_size <= 0 || rot_dim <= 0 ||
      rot_dim > head_size || rot_dim % 2 != 0 || block_size <= 0 || num_blocks < 0 || max_position <= 0) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "rotary_and_cache: bad sizes (tokens=%lld heads=%d kv_heads=%d head_size=%d rot_dim=%d "
                "block_size=%d)",
                (long long)num_tokens, num_heads, num_kv_heads, head_size, rot_dim, block_size);
  }
  if (num_tokens == 0) return WLLM_OK;
  if (num_tokens > INT_MAX) return fail(WLLM_ERR_INVALID_ARGUMENT, "rotary_and_cache: too many tokens");
  // Work items per block are counted in int; keep every count far from overflow.
  if ((int64_t)(num_heads + 3 * (int64_t)num_kv_heads) * head_size > INT_MAX / 2) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "rotary_and_cache: too many heads (%d + %d of %d)", num_heads,
                num_kv_heads, head_size);
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t num_slots = num_blocks * block_size;
  const int half = rot_dim / 2;
  WLLM_DISPATCH_FLOAT(dtype, T, {
    constexpr int vec = 16 / (int)sizeof(T);
    // The wide path needs every row, head and pair run to start on a 16-byte boundary.
    const bool wide = rope_cache::aligned16(q) && rope_cache::aligned16(key) && rope_cache::aligned16(value) &&
                      rope_cache::aligned16(key_cache) && rope_cache::aligned16(value_cache) &&
                      rope_cache::aligned16(cos_sin_cache) && head_size % vec == 0 && half % vec == 0 &&
                      q_token_stride % vec == 0 && q_head_stride % vec == 0 && key_token_stride % vec == 0 &&
                      key_head_stride % vec == 0 && value_token_stride % vec == 0 && value_head_stride % vec == 0 &&
                      cache_block_stride % vec == 0 && cache_token_stride % vec == 0 && cache_head_stride % vec == 0;
    const int v = wide ? vec : 1;
    const int work = num_heads * (half / v) + num_kv_heads * ((half + head_size - rot_dim + head_size) / v);
    int threads = 32;
    while (threads < 512 && threads < work) threads <<= 1;
    if (wide) {
      rope_cache::launch<T, vec>(threads, s, num_tokens, positions, q, key, value, key_cache, value_cache,
                                 slot_mapping, cos_sin_cache, num_heads, num_kv_heads, head_size, rot_dim, block_size,
                                 num_slots, max_position, q_token_stride, q_head_stride, key_token_stride,
                                 key_head_stride, value_token_stride, value_head_stride, cache_block_stride,
                                 cache_token_stride, cache_head_stride, is_neox != 0);
    } else {
      rope_cache::launch<T, 1>(threads, s, num_tokens, positions, q, key, value, key_cache, value_cache, slot_mapping,
                               cos_sin_cache, num_heads, num_kv_heads, head_size, rot_dim, block_size, num_slots,
                               max_position, q_token_stride, q_head_stride, key_token_stride, key_head_stride,
                               value_token_stride, value_head_stride, cache_block_stride, cache_token_stride,
                               cache_head_stride, is_neox != 0);
    }
  });
  return check_launch("rotary_and_cache");
}
