// Host helpers of the Hopper kernels (declared in hopper.cuh): TMA descriptors of fp16/bf16 tensors and of
// paged KV caches, encoded through the driver's cuTensorMapEncodeTiled (reached through cudart: the
// library does not link libcuda).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <mutex>

#include "common.cuh"
#include "hopper.cuh"

namespace WLLM_NS {
namespace hopper {

// cuTensorMapEncodeTiled from the driver, through cudart (the library does not link libcuda).
static PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> fn{nullptr};
  PFN_cuTensorMapEncodeTiled_v12000 f = fn.load(std::memory_order_acquire);
  if (f == nullptr) {
    cudaDriverEntryPointQueryResult q;
    void* p = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      f = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
      fn.store(f, std::memory_order_release);
    }
    cudaGetLastError();
  }
  return f;
}

bool make_tensor_map(CUtensorMap* map, bool is_half, const void* ptr, int rank, const uint64_t* dims,
                     const uint64_t* strides, const uint32_t* box) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
  if (encode == nullptr || rank < 1 || rank > 5) return false;
  cuuint64_t d[5], st[4];
  cuuint32_t b[5], e[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    e[i] = 1;
    if (i + 1 < rank) st[i] = strides[i];
  }
  return encode(map, is_half ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank,
                const_cast<void*>(ptr), d, st, b, e, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The encoded maps of recent paged caches: an eager step asks for the same per-layer maps at every step,
// and a map is a pure function of its key, so a hit is always right (even for a cache freed and another
// allocated at the same address with the same layout). Direct-mapped, 64 slots; the maps kept as bytes so
// that no over-aligned type sits in a static table.
struct CacheMapKey {
  const void* k;
  const void* v;
  int64_t head_stride, token_stride, block_stride;
  int num_kv_heads, head_size, block_size, box_rows, is_half;
  bool operator==(const CacheMapKey& o) const {
    return k == o.k && v == o.v && head_stride == o.head_stride && token_stride == o.token_stride &&
           block_stride == o.block_stride && num_kv_heads == o.num_kv_heads && head_size == o.head_size &&
           block_size == o.block_size && box_rows == o.box_rows && is_half == o.is_half;
  }
};
struct CacheMapSlot {
  CacheMapKey key;
  bool valid;
  unsigned char k_map[sizeof(CUtensorMap)], v_map[sizeof(CUtensorMap)];
};

bool paged_cache_maps(CUtensorMap* map_k, CUtensorMap* map_v, bool is_half, const void* k, const void* v,
                      int num_kv_heads, int64_t head_stride, int head_size, int block_size, int64_t token_stride,
                      int64_t block_stride, int box_rows) {
  static std::mutex lock;
  static CacheMapSlot slots[64];
  const CacheMapKey key{k, v, head_stride, token_stride, block_stride, num_kv_heads, head_size, block_size, box_rows,
                        is_half ? 1 : 0};
  // Fibonacci hashing: the per-layer caches of one allocation differ only in high address bits.
  const size_t slot =
      (size_t)((((uint64_t)reinterpret_cast<uintptr_t>(k) ^ (uint64_t)box_rows) * 0x9E3779B97F4A7C15ull) >> 58);
  {
    std::lock_guard<std::mutex> guard(lock);
    if (slots[slot].valid && slots[slot].key == key) {
      memcpy(map_k, slots[slot].k_map, sizeof(CUtensorMap));
      memcpy(map_v, slots[slot].v_map, sizeof(CUtensorMap));
      return true;
    }
  }
  const uint64_t dims[3] = {(uint64_t)(num_kv_heads - 1) * (uint64_t)head_stride + (uint64_t)head_size,
                            (uint64_t)block_size, (uint64_t)1 << 31};  // block ids come from the tables
  const uint64_t strides[2] = {(uint64_t)token_stride * 2, (uint64_t)block_stride * 2};
  const uint32_t box[3] = {64, (uint32_t)box_rows, 1};
  if (!make_tensor_map(map_k, is_half, k, 3, dims, strides, box) ||
      !make_tensor_map(map_v, is_half, v, 3, dims, strides, box)) {
    return false;
  }
  std::lock_guard<std::mutex> guard(lock);
  slots[slot].key = key;
  memcpy(slots[slot].k_map, map_k, sizeof(CUtensorMap));
  memcpy(slots[slot].v_map, map_v, sizeof(CUtensorMap));
  slots[slot].valid = true;
  return true;
}

}  // namespace hopper
}  // namespace WLLM_NS
