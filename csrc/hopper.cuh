// Hopper primitives shared by the SM 9.0+ kernels: mbarriers and bulk copies (every sm_90+ GPU; the
// decode-attention pipeline uses them there), TMA tensor loads, the async-proxy fence, wgmma group control
// and shared-memory matrix descriptors (defined only for device code compiled with the sm_90a feature set,
// __CUDA_ARCH_FEAT_SM90_ALL; callers guard their use the same way).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdint.h>

#include "common.cuh"

namespace WLLM_NS {
namespace hopper {

// mbarriers and bulk copies exist on every sm_90+ GPU (the wgmma helpers further down need sm_90a). These
// are declared in every compilation, so templates that also build for older GPUs may name them in code
// paths those GPUs never take; there the bodies are empty.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define WLLM_HOPPER_ASYNC 1
#endif

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#ifdef WLLM_HOPPER_ASYNC
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}

// Makes the barrier inits visible to the other threads of the cluster (and to the async proxy).
__device__ __forceinline__ void fence_mbar_init() {
#ifdef WLLM_HOPPER_ASYNC
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// Arrives and adds `bytes` to the transaction count the current phase waits for (TMA loads complete them).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
#ifdef WLLM_HOPPER_ASYNC
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#ifdef WLLM_HOPPER_ASYNC
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}

// Waits until the barrier's phase of parity `parity` has completed (a fresh barrier is in phase 0, so
// waiting for parity 1 returns at once).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#ifdef WLLM_HOPPER_ASYNC
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory at `dst`
// with the bulk-copy engine, counted on the barrier at `bar` (whose expected transaction count the caller
// raised by as much, mbar_expect_tx).
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#ifdef WLLM_HOPPER_ASYNC
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// TMA load of one box of a 3-D tensor map at coordinates (c0, c1, c2) into shared memory at `dst`, counted
// on the barrier at `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Arrives on the barrier once all cp.async copies this thread issued so far have landed (the barrier's
// count includes this arrival).
__device__ __forceinline__ void mbar_arrive_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Orders this thread's generic-proxy view of shared memory (st.shared, cp.async) with the async proxy
// (wgmma operands, TMA).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Named barrier `id` over `threads` threads: wait for all, or only arrive (a producer's signal).
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
#endif

// Shared-memory matrix descriptor of a 128-byte-swizzled operand at `addr` (1024-byte aligned groups of 8
// rows of 128 bytes): start address >> 4; leading byte offset (between the 64-element column blocks of an
// MN-major operand; unused by K-major ones); stride byte offset 1024 (the next 8 rows); swizzle mode 1
// (128 B) in bits 62-63.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead_bytes = 16) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lead_bytes >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// Host: a TMA descriptor of a fp16/bf16 tensor of `rank` dimensions (innermost first; strides in bytes for
// dimensions 1..rank-1), boxes of `box` elements, 128-byte swizzled. False when the driver cannot encode
// it (too old, or a layout TMA does not take).
bool make_tensor_map(CUtensorMap* map, bool is_half, const void* ptr, int rank, const uint64_t* dims,
                     const uint64_t* strides, const uint32_t* box);

// Host: the K and V maps of a paged cache pair [blocks][block size][KV heads x head stride] (strides in
// elements), viewed as [blocks][block rows][KV-head columns] with boxes of box_rows rows x 64 columns --
// the prefill and decode attention kernels' tiles. Remembered per key, so repeated calls (every layer of
// every eager step) encode nothing. False when TMA cannot describe the layout.
bool paged_cache_maps(CUtensorMap* map_k, CUtensorMap* map_v, bool is_half, const void* k, const void* v,
                      int num_kv_heads, int64_t head_stride, int head_size, int block_size, int64_t token_stride,
                      int64_t block_stride, int box_rows);

}  // namespace hopper
}  // namespace WLLM_NS
