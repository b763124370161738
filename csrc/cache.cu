// KV-cache maintenance: writing a step's new keys/values into their paged slots, and copying
// whole blocks between two caches (swap out/in, copy-on-write).
#include <limits.h>

#include "common.cuh"

namespace WLLM_NS {

// One block per token; threads stride over (head, vector) pairs of both K and V. VEC elements
// move per access (16 bytes when every pointer and stride allows it, else 1).
template <typename T, int VEC>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int num_kv_heads,
                                         int head_size, int block_size, int64_t num_slots, int64_t k_tok,
                                         int64_t k_head, int64_t v_tok, int64_t v_head, int64_t c_block,
                                         int64_t c_tok, int64_t c_head) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  // Graph padding rows carry slot -1; an out-of-range slot would write outside the cache.
  if (slot < 0 || slot >= num_slots) return;
  const int64_t block = slot / block_size;
  const int64_t offset = slot - block * block_size;
  const int64_t dst_base = block * c_block + offset * c_tok;
  const int vecs_per_head = head_size / VEC;
  const int work = num_kv_heads * vecs_per_head;
  for (int i = threadIdx.x; i < work; i += blockDim.x) {
    const int head = i / vecs_per_head;
    const int d = (i - head * vecs_per_head) * VEC;
    const int64_t dst = dst_base + head * c_head + d;
    const T* ks = key + token * k_tok + head * k_head + d;
    const T* vs = value + token * v_tok + head * v_head + d;
    if (VEC == 1) {
      key_cache[dst] = *ks;
      value_cache[dst] = *vs;
    } else {
      *reinterpret_cast<uint4*>(key_cache + dst) = *reinterpret_cast<const uint4*>(ks);
      *reinterpret_cast<uint4*>(value_cache + dst) = *reinterpret_cast<const uint4*>(vs);
    }
  }
}

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_reshape_and_cache)(const void* key, const void* value, void* key_cache,
                                             void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                                             int num_kv_heads, int head_size, int block_size, int64_t num_blocks,
                                             int64_t key_token_stride, int64_t key_head_stride,
                                             int64_t value_token_stride, int64_t value_head_stride,
                                             int64_t cache_block_stride, int64_t cache_token_stride,
                                             int64_t cache_head_stride, int dtype, void* stream) {
  using namespace WLLM_NS;
  if (key == nullptr || value == nullptr || key_cache == nullptr || value_cache == nullptr ||
      slot_mapping == nullptr) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "reshape_and_cache: null pointer");
  }
  if (num_tokens < 0 || num_kv_heads <= 0 || head_size <= 0 || block_size <= 0 || num_blocks < 0) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "reshape_and_cache: bad sizes (tokens=%lld kv_heads=%d head_size=%d block_size=%d)",
                (long long)num_tokens, num_kv_heads, head_size, block_size);
  }
  if (num_tokens == 0) return WLLM_OK;
  if (num_tokens > INT_MAX) return fail(WLLM_ERR_INVALID_ARGUMENT, "reshape_and_cache: too many tokens");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t num_slots = num_blocks * block_size;
  WLLM_DISPATCH_FLOAT(dtype, T, {
    const int vec = 16 / (int)sizeof(T);
    const bool wide = aligned16(key) && aligned16(value) && aligned16(key_cache) && aligned16(value_cache) &&
                      head_size % vec == 0 && key_token_stride % vec == 0 && key_head_stride % vec == 0 &&
                      value_token_stride % vec == 0 && value_head_stride % vec == 0 &&
                      cache_block_stride % vec == 0 && cache_token_stride % vec == 0 &&
                      cache_head_stride % vec == 0;
    const int work = num_kv_heads * (wide ? head_size / vec : head_size);
    int threads = 32;
    while (threads < 256 && threads < work) threads <<= 1;
    if (wide) {
      reshape_and_cache_kernel<T, 16 / sizeof(T)><<<(unsigned)num_tokens, threads, 0, s>>>(
          static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(key_cache),
          static_cast<T*>(value_cache), slot_mapping, num_kv_heads, head_size, block_size, num_slots,
          key_token_stride, key_head_stride, value_token_stride, value_head_stride, cache_block_stride,
          cache_token_stride, cache_head_stride);
    } else {
      reshape_and_cache_kernel<T, 1><<<(unsigned)num_tokens, threads, 0, s>>>(
          static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(key_cache),
          static_cast<T*>(value_cache), slot_mapping, num_kv_heads, head_size, block_size, num_slots,
          key_token_stride, key_head_stride, value_token_stride, value_head_stride, cache_block_stride,
          cache_token_stride, cache_head_stride);
    }
  });
  return check_launch("reshape_and_cache");
}

WLLM_API int WLLM_FN(wllm_copy_blocks)(const void* src, void* dst, const int64_t* pairs, int64_t num_pairs,
                                       int64_t num_planes, int64_t block_bytes, int64_t src_num_blocks,
                                       int64_t dst_num_blocks, int64_t src_block_stride, int64_t dst_block_stride,
                                       int64_t src_plane_stride, int64_t dst_plane_stride, void* stream) {
  using namespace WLLM_NS;
  if (num_pairs < 0 || num_planes <= 0 || block_bytes <= 0 || src_block_stride < block_bytes ||
      dst_block_stride < block_bytes) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "copy_blocks: bad sizes (pairs=%lld planes=%lld block_bytes=%lld block strides %lld/%lld)",
                (long long)num_pairs, (long long)num_planes, (long long)block_bytes, (long long)src_block_stride,
                (long long)dst_block_stride);
  }
  if (num_pairs == 0) return WLLM_OK;
  if (src == nullptr || dst == nullptr || pairs == nullptr) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "copy_blocks: null pointer");
  }
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t a = pairs[2 * i], b = pairs[2 * i + 1];
    if (a < 0 || a >= src_num_blocks || b < 0 || b >= dst_num_blocks) {
      return fail(WLLM_ERR_INVALID_ARGUMENT,
                  "copy_blocks: pair %lld (%lld -> %lld) is outside the caches (%lld source, %lld destination "
                  "blocks)",
                  (long long)i, (long long)a, (long long)b, (long long)src_num_blocks, (long long)dst_num_blocks);
    }
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const char* src_bytes = static_cast<const char*>(src);
  char* dst_bytes = static_cast<char*>(dst);
  // Consecutive pairs that are consecutive on both sides merge into one run when blocks are packed,
  // so a swap of a request's (usually contiguous) blocks costs one copy per run, not per block.
  const bool packed = src_block_stride == block_bytes && dst_block_stride == block_bytes;
  // One 2D copy covers a run in every layer (the planes are a fixed pitch apart); pitches above
  // what the copy engine accepts fall back to one copy per plane.
  const bool use_2d = src_plane_stride <= INT_MAX && dst_plane_stride <= INT_MAX;
  int64_t i = 0;
  while (i < num_pairs) {
    int64_t run = 1;
    while (packed && i + run < num_pairs && pairs[2 * (i + run)] == pairs[2 * i] + run &&
           pairs[2 * (i + run) + 1] == pairs[2 * i + 1] + run) {
      ++run;
    }
    const char* from = src_bytes + pairs[2 * i] * src_block_stride;
    char* to = dst_bytes + pairs[2 * i + 1] * dst_block_stride;
    const size_t width = (size_t)(run * block_bytes);
    cudaError_t err = cudaSuccess;
    if (use_2d && width <= (size_t)src_plane_stride && width <= (size_t)dst_plane_stride) {
      err = cudaMemcpy2DAsync(to, (size_t)dst_plane_stride, from, (size_t)src_plane_stride, width,
                              (size_t)num_planes, cudaMemcpyDefault, s);
    } else {
      for (int64_t p = 0; p < num_planes && err == cudaSuccess; ++p) {
        err = cudaMemcpyAsync(to + p * dst_plane_stride, from + p * src_plane_stride, width, cudaMemcpyDefault, s);
      }
    }
    if (err != cudaSuccess) {
      return fail(WLLM_ERR_CUDA, "copy_blocks: copying blocks %lld -> %lld failed: %s", (long long)pairs[2 * i],
                  (long long)pairs[2 * i + 1], cudaGetErrorString(err));
    }
    i += run;
  }
  return WLLM_OK;
}

// ---------------------------------------------------------------------------------------------------
// Step staging: the few KB of a decode step's inputs (and its sampled ids) moved by one small kernel
// that reads or writes pinned host memory in place (unified addressing), instead of a copy-engine
// transfer. A copy-engine copy between two kernels leaves the GPU idle ~9 us on each side (measured at
// batch 1 on an H200: graph -> D2H, D2H -> H2D, H2D -> the next kernel); a kernel follows a kernel ~1-2
// us apart. The same kernel then writes a lookahead step's input ids from the previous step's samples
// (input_ids[pairs[i]] = prev[pairs[n + i]]: token index, then the previous step's sampling row).
// ---------------------------------------------------------------------------------------------------

namespace WLLM_NS {
namespace {

constexpr int kStageThreads = 512;
constexpr int kStageInFlight = 4;  // loads each thread issues before its first store

// Host memory is read uncached (__ldcv: the host rewrites it between launches) and written through
// (__stwt: the host reads it after the step's event), whichever side is the host.
__global__ void __launch_bounds__(kStageThreads) stage_copy_kernel(char* dst, const char* src, int64_t nbytes,
                                                                    int64_t* input_ids, const void* prev,
                                                                    int prev_dtype, const int64_t* pairs, int64_t n) {
  const bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u) == 0;
  const int64_t width = vec ? 16 : 1;
  const int64_t units = nbytes / width;
  for (int64_t base = threadIdx.x; base < units; base += kStageInFlight * blockDim.x) {
    uint4 v[kStageInFlight];
    char c[kStageInFlight];
#pragma unroll
    for (int j = 0; j < kStageInFlight; ++j) {
      const int64_t i = base + j * blockDim.x;
      if (i < units) {
        if (vec) {
          v[j] = __ldcv(reinterpret_cast<const uint4*>(src) + i);
        } else {
          c[j] = __ldcv(src + i);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kStageInFlight; ++j) {
      const int64_t i = base + j * blockDim.x;
      if (i < units) {
        if (vec) {
          __stwt(reinterpret_cast<uint4*>(dst) + i, v[j]);
        } else {
          __stwt(dst + i, c[j]);
        }
      }
    }
  }
  for (int64_t i = units * width + threadIdx.x; i < nbytes; i += blockDim.x) __stwt(dst + i, __ldcv(src + i));
  if (n > 0) {
    // pairs (when given) may lie in dst, written above by this CTA: visible to every thread after the barrier.
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const int64_t t = pairs != nullptr ? __ldcg(pairs + i) : i;
      const int64_t r = pairs != nullptr ? __ldcg(pairs + n + i) : i;
      input_ids[t] = prev_dtype == 2 ? static_cast<int64_t>(static_cast<const double*>(prev)[r])
                                     : static_cast<const int64_t*>(prev)[r];
    }
  }
}

}  // namespace
}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_host_mapped)(const void* ptr) {
  if (ptr == nullptr) return 0;
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // not sticky: unregistered host memory reports an error on some drivers
    return 0;
  }
  return attr.type == cudaMemoryTypeHost && attr.devicePointer == ptr ? 1 : 0;
}

WLLM_API int WLLM_FN(wllm_stage_copy)(void* dst, const void* src, int64_t nbytes, int64_t* input_ids,
                                      const void* prev_tokens, int prev_dtype, const int64_t* pairs, int64_t n,
                                      void* stream) {
  using namespace WLLM_NS;
  if (nbytes < 0 || n < 0 || prev_dtype < 0 || prev_dtype > 2 || (n > 0 && (prev_dtype == 0 || input_ids == nullptr ||
                                                                          prev_tokens == nullptr))) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "stage_copy: bad arguments (nbytes=%lld, n=%lld, prev_dtype=%d: 1 = int64, 2 = float64; input ids "
                "and previous tokens are needed when n > 0)",
                (long long)nbytes, (long long)n, prev_dtype);
  }
  if (nbytes > 0 && (dst == nullptr || src == nullptr)) return fail(WLLM_ERR_INVALID_ARGUMENT, "stage_copy: null pointer");
  if (nbytes == 0 && n == 0) return WLLM_OK;
  stage_copy_kernel<<<1, kStageThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<char*>(dst), static_cast<const char*>(src), nbytes, input_ids, prev_tokens, prev_dtype, pairs, n);
  return check_launch("stage_copy");
}
