// Hopper (SM 9.0) GEMM on TMA + wgmma, with an optional gated-activation epilogue.
//
// C[m, n] = A[m, k] @ B[n, k]^T (both K-contiguous: x @ W^T as nn.Linear computes it), fp32 accumulation,
// rounded once. With a gated epilogue B is the MLP's gate_up weight [2n, k] ([gate rows | up rows]) and
// C = act(A @ gate^T) * (A @ up^T), [m, n]: the activation never leaves the registers and the [m, 2n]
// intermediate is never written. Compiled as sm_90a (the build's 9.0 target); other SMs get no kernel and
// the entry point refuses them.
//
// Design (how it measured: README.md next to this file, benchmarks/RESULTS.md). A persistent grid of
// clusters of 2 CTAs, one CTA per SM, 384 threads each:
//  - warpgroup 0 produces: one thread issues TMA loads of 64-wide k-tiles of A (128 rows) and B (256 rows)
//    into a 4-stage ring, 128-byte swizzled by the TMA unit, zero-filled past the matrix (m, n, k free);
//  - the two CTAs of a cluster take neighbouring 128-row tiles of A with the same B tile: each loads half
//    of the B tile and multicasts it to both (halves B's L2 traffic; for the gated epilogue the halves are
//    the gate and the up rows of the same 128 output columns);
//  - warpgroups 1-2 consume: 64 rows x 256 columns each, wgmma m64n256k16 from shared memory; a stage is
//    released to the producers of both CTAs once both of their consumers' wgmmas have read it;
//  - the epilogue converts (and gates) in registers, writes 64 x 64 chunks to shared memory (two 8 KB
//    buffers per warpgroup) and TMA-stores them (clipped at the matrix edges), so the next tile's main
//    loop starts while the stores drain.
// Tiles are visited in groups of 8 cluster rows so that a wave of CTAs shares A rows and B columns in L2.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <mutex>
#include <type_traits>

#include "common.cuh"
#include "hopper.cuh"
#include "wgmma_sm90.cuh"

namespace WLLM_NS {
namespace sm90 {

constexpr int BM = 128, BN = 256, BK = 64, STAGES = 4, THREADS = 384, CLUSTER = 2, GROUP = 8;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int C_CHUNK = 64 * 64 * 2, C_BYTES = 2 * 2 * C_CHUNK;  // two chunk buffers per consumer warpgroup
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + C_BYTES + 1024 + 2 * STAGES * 8;
enum Epilogue { EPI_NONE = 0, EPI_SILU = 1, EPI_GELU_TANH = 2 };

// Output tile (cluster row tile mt, column tile nt) of global tile index `tile`, in groups of GROUP rows.
__device__ __forceinline__ void tile_coords(int tile, int m_tiles, int n_tiles, int& mt, int& nt) {
  const int per_group = GROUP * n_tiles, group = tile / per_group, first = group * GROUP;
  const int size = min(m_tiles - first, GROUP), in = tile - group * per_group;
  mt = first + in % size;
  nt = in / size;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using hopper::mbar_expect_tx;
using hopper::mbar_init;
using hopper::mbar_wait;

// Arrive on the barrier at the same shared offset in CTA `rank` of the cluster. The consumers only read
// the stage they release, so no cluster-scope release is needed (it doubled the time when used).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

// The same load into the same shared offset of both CTAs of the cluster, each CTA's barrier at `bar`
// counting the bytes it receives.
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                                   uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "h"((uint16_t)((1 << CLUSTER) - 1))
      : "memory");
}

__device__ __forceinline__ void tma_store(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Named barrier 1 + w over the 128 threads of consumer warpgroup w.
__device__ __forceinline__ void warpgroup_sync(int w) { hopper::named_sync(1 + w, 128); }

__device__ __forceinline__ void flag_release(int* flag) {
  asm volatile("st.release.gpu.global.s32 [%0], 1;\n" ::"l"(flag) : "memory");
}

__device__ __forceinline__ void flag_wait(const int* flag) {
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  } while (v == 0);
}

#endif

struct Shape {
  int m, n, k;        // n: output columns
  int stream_k;       // 0: whole tiles per cluster; 1: each cluster an even share of all k-blocks (below)
  int* flags;         // stream-K: a ready flag per consumer warpgroup of each CTA, zero between launches
  float4* partials;   // stream-K: a 128 x 256 fp32 partial tile per CTA (PARTIAL_BYTES)
};

constexpr int WG_PARTIAL_FLOAT4 = 128 * (BN / 2) / 4;  // a consumer warpgroup's accumulators (64 x 256 fp32)
constexpr int64_t PARTIAL_BYTES = 2 * (int64_t)WG_PARTIAL_FLOAT4 * 16;  // per CTA

// The (tile, k-blocks [k0, k1)) segments a cluster works through, in order. Whole tiles: cluster,
// cluster + clusters, ... Stream-K (few tiles for the SMs, i.e. decode-sized m): all tiles' k-blocks in
// one sequence, cluster c taking [c units / clusters, (c + 1) units / clusters), cut at tile edges, so
// every SM is busy to the end. A tile cut between clusters is finished by the one holding its first
// k-block (that segment is the last of its share); the others (whose cut segment comes first in theirs)
// leave fp32 partial sums in the workspace for it.
struct Segments {
  int pos, end, step, kt, stream_k;
  __device__ __forceinline__ static int share(int c, int clusters, int units) {
    return (int)(((int64_t)c * units) / clusters);
  }
  __device__ __forceinline__ Segments(int stream_k_, int cluster, int clusters, int tiles, int kt_)
      : kt(kt_), stream_k(stream_k_) {
    if (stream_k) {
      pos = share(cluster, clusters, tiles * kt);
      end = share(cluster + 1, clusters, tiles * kt);
      step = 0;
    } else {
      pos = cluster;
      end = tiles;
      step = clusters;
    }
  }
  __device__ __forceinline__ bool next(int& tile, int& k0, int& k1) {
    if (pos >= end) return false;
    if (!stream_k) {
      tile = pos;
      k0 = 0;
      k1 = kt;
      pos += step;
      return true;
    }
    tile = pos / kt;
    k0 = pos - tile * kt;
    k1 = min(kt, k0 + (end - pos));
    pos += k1 - k0;
    return true;
  }
};

template <typename T, int EPI>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                const __grid_constant__ CUtensorMap map_c, const Shape shape) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int OUT_N = EPI == EPI_NONE ? BN : BN / 2;  // output columns per tile
  extern __shared__ unsigned char smem_raw[];
  const uint32_t ring = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t cbufs = ring + STAGES * STAGE_BYTES;
  const uint32_t full = cbufs + C_BYTES, empty = full + STAGES * 8;
  // Counted in cluster tiles (2 BM rows) and clusters; CTA `rank` takes row tile 2 mt + rank.
  const int m_tiles = (shape.m + CLUSTER * BM - 1) / (CLUSTER * BM), n_tiles = (shape.n + OUT_N - 1) / OUT_N;
  const int tiles = m_tiles * n_tiles, kt = (shape.k + BK - 1) / BK;
  const int clusters = (int)gridDim.x / CLUSTER, cluster = (int)blockIdx.x / CLUSTER;
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  const int wg = threadIdx.x >> 7;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 2 * CLUSTER);  // one arrival per consumer warpgroup of each CTA
    }
    hopper::fence_mbar_init();
  }
  cluster_sync();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == 0) {
      Segments seg(shape.stream_k, cluster, clusters, tiles, kt);
      int it = 0, tile, k0, k1;
      while (seg.next(tile, k0, k1)) {
        int mt, nt;
        tile_coords(tile, m_tiles, n_tiles, mt, nt);
        // This CTA's half of the B tile: rows nt BN + 128 rank (plain); the gate (rank 0) or up (rank 1)
        // rows of output columns nt 128 .. nt 128 + 127 (gated).
        const int b_row = EPI == EPI_NONE ? nt * BN + (int)rank * (BN / 2) : (int)rank * shape.n + nt * (BN / 2);
        for (int t = k0; t < k1; ++t, ++it) {
          const int s = it % STAGES;
          mbar_wait(empty + 8 * s, ((it / STAGES) & 1) ^ 1);
          const uint32_t dst = ring + s * STAGE_BYTES;
          mbar_expect_tx(full + 8 * s, STAGE_BYTES);
          tma_load(dst, &map_a, t * BK, (mt * CLUSTER + (int)rank) * BM, full + 8 * s);
          tma_load_multicast(dst + A_BYTES + rank * (B_BYTES / 2), &map_b, t * BK, b_row, full + 8 * s);
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int cw = wg - 1, wt = threadIdx.x & 127, warp = wt >> 5, lane = threadIdx.x & 31;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
    Segments seg(shape.stream_k, cluster, clusters, tiles, kt);
    int it = 0, nbuf = 0, tile, k0, k1;
    while (seg.next(tile, k0, k1)) {
      int mt, nt;
      tile_coords(tile, m_tiles, n_tiles, mt, nt);
      for (int t = k0; t < k1; ++t, ++it) {
        const int s = it % STAGES;
        mbar_wait(full + 8 * s, (it / STAGES) & 1);
        const uint32_t s_a = ring + s * STAGE_BYTES;
        const uint64_t da = hopper::smem_desc(s_a + cw * 64 * 128), db = hopper::smem_desc(s_a + A_BYTES);
        hopper::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          // 16 more columns of K: 32 bytes further inside the 128-byte swizzle atom.
          wgmma<T, BN>(acc, da + (uint64_t)(kk * 2), db + (uint64_t)(kk * 2), (t > k0 || kk > 0) ? 1 : 0);
        }
        hopper::wgmma_commit();
        // Keep this k-tile's wgmmas in flight; the previous one's are done, release its stage (thread r of
        // the warpgroup signals CTA r).
        hopper::wgmma_wait<1>();
        if (t > k0 && wt < CLUSTER) mbar_arrive_cluster(empty + 8 * ((it - 1) % STAGES), wt);
      }
      hopper::wgmma_wait<0>();
      if (wt < CLUSTER) mbar_arrive_cluster(empty + 8 * ((it - 1) % STAGES), wt);

      if (k0 > 0) {
        // Stream-K, a tile's later k-blocks (the first segment of this cluster's share): leave the fp32
        // sums for the cluster that finishes the tile, in this thread's register order (coalesced).
        float4* dst = shape.partials + ((int64_t)blockIdx.x * 2 + cw) * WG_PARTIAL_FLOAT4 + wt;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          __stcg(dst + i * 128, make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]));
        }
        __threadfence();  // each thread's sums visible at GPU scope before the flag is
        warpgroup_sync(cw);
        if (wt == 0) flag_release(shape.flags + blockIdx.x * 2 + cw);
        continue;
      }
      if (k1 < kt) {
        // Stream-K, a tile's first k-blocks ending this share: add the sums of the clusters after this one
        // that started inside the tile (each did so first, so they are done or nearly).
        const int units = tiles * kt;
        for (int c = cluster + 1; c < clusters && Segments::share(c, clusters, units) < (tile + 1) * kt; ++c) {
          const int peer = c * CLUSTER + (int)rank;
          if (wt == 0) {
            flag_wait(shape.flags + peer * 2 + cw);
            shape.flags[peer * 2 + cw] = 0;  // only this warpgroup reads it: zero again for the next launch
          }
          warpgroup_sync(cw);
          const float4* src = shape.partials + ((int64_t)peer * 2 + cw) * WG_PARTIAL_FLOAT4 + wt;
#pragma unroll
          for (int i = 0; i < BN / 8; ++i) {
            const float4 v = __ldcg(src + i * 128);
            acc[4 * i] += v.x;
            acc[4 * i + 1] += v.y;
            acc[4 * i + 2] += v.z;
            acc[4 * i + 3] += v.w;
          }
        }
      }

      // Epilogue. Accumulator layout: column block j (8 columns) of row (16 warp + lane / 4) holds
      // acc[4 j], acc[4 j + 1] at columns 8 j + 2 (lane % 4) + {0, 1}, and the row 8 below in + 2, + 3.
      // Gated: blocks 0-15 are the gate, 16-31 the up columns of the same 128 outputs.
      const int row0 = (mt * CLUSTER + (int)rank) * BM + cw * 64;
      const uint32_t cbuf = cbufs + cw * 2 * C_CHUNK;
#pragma unroll
      for (int cc = 0; cc < OUT_N / 64; ++cc) {
        if (row0 >= shape.m || nt * OUT_N + cc * 64 >= shape.n) continue;  // wholly outside C (uniform)
        const uint32_t buf = cbuf + (nbuf & 1) * C_CHUNK;
        // The store that last read `buf` (two chunks ago) must be done reading it.
        if (wt == 0) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
        warpgroup_sync(cw);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int b = cc * 8 + j;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float lo = acc[4 * b + 2 * h], hi = acc[4 * b + 2 * h + 1];
            if (EPI == EPI_SILU) {
              lo = gated<ACT_SILU>(lo, acc[4 * (b + 16) + 2 * h]);
              hi = gated<ACT_SILU>(hi, acc[4 * (b + 16) + 2 * h + 1]);
            } else if (EPI == EPI_GELU_TANH) {
              lo = gated<ACT_GELU_TANH>(lo, acc[4 * (b + 16) + 2 * h]);
              hi = gated<ACT_GELU_TANH>(hi, acc[4 * (b + 16) + 2 * h + 1]);
            }
            // 128-byte swizzled chunk: row r's 16-byte piece j at (j ^ (r % 8)) * 16 -- the 8 rows of one
            // store instruction hit 8 different pieces, no bank conflicts.
            const int r = warp * 16 + (lane >> 2) + 8 * h;
            const uint32_t addr = buf + r * 128 + ((j ^ (r & 7)) << 4) + (lane & 3) * 4;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pack2<T>(lo, hi)) : "memory");
          }
        }
        hopper::fence_proxy_async();  // visible to the TMA unit
        warpgroup_sync(cw);
        if (wt == 0) tma_store(&map_c, buf, nt * OUT_N + cc * 64, row0);
        ++nbuf;
      }
    }
    if (wt == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
  // No CTA leaves while its peer may still multicast into it or arrive on its barriers.
  cluster_sync();
#endif
}

// 2-D map of a row-major [rows, cols] matrix with row stride ld (elements), boxes of box_rows x 64 elements,
// 128-byte swizzled.
bool make_map(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, int64_t rows, int64_t cols, int64_t ld,
              int box_rows) {
  const uint64_t dims[2] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
  const uint64_t strides[1] = {static_cast<uint64_t>(ld) * 2};
  const uint32_t box[2] = {64, static_cast<uint32_t>(box_rows)};
  return hopper::make_tensor_map(map, type == CU_TENSOR_MAP_DATA_TYPE_FLOAT16, ptr, 2, dims, strides, box);
}

constexpr int kMaxDevices = 64;
enum Schedule { SCHED_AUTO = 0, SCHED_TILES = 1, SCHED_STREAM_K = 2 };

// Workspace of a device with `sms` multiprocessors: the flags (2 per CTA, padded to 1 KB), then a partial
// tile per CTA.
int64_t flag_bytes(int sms) { return ((int64_t)sms * 2 * 4 + 1023) / 1024 * 1024; }
int64_t workspace_bytes(int sms) { return flag_bytes(sms) + (int64_t)sms * PARTIAL_BYTES; }

bool is_sm90(const DeviceProps& props) { return props.major == 9 && props.minor == 0; }

template <typename T, int EPI>
int launch(void* c, const void* a, const void* b, Shape shape, int64_t lda, int64_t ldb, int64_t ldc,
           void* workspace, int64_t workspace_size, int schedule, const DeviceProps& props, cudaStream_t stream) {
  auto kernel = gemm_kernel<T, EPI>;
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CLUSTER;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = SMEM_BYTES;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  int device = 0;
  cudaGetDevice(&device);
  // Per kernel instantiation and device: the shared-memory opt-in and the resident cluster count (every
  // cluster of the grid is resident at once: stream-K's finishing clusters wait for the others).
  static std::atomic<int> slots_of[kMaxDevices];
  int slots = device < kMaxDevices ? slots_of[device].load(std::memory_order_acquire) : 0;
  if (slots == 0) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    config.gridDim = dim3(props.sms / CLUSTER * CLUSTER);
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveClusters(&slots, kernel, &config);
    if (err != cudaSuccess || slots <= 0) {
      cudaGetLastError();
      return fail(WLLM_ERR_CUDA, "gemm_sm90: cannot configure the kernel: %s",
                  err != cudaSuccess ? cudaGetErrorString(err) : "no cluster fits on an SM pair");
    }
    if (slots * CLUSTER > props.sms) slots = props.sms / CLUSTER;  // the workspace has a slot per SM
    if (device < kMaxDevices) slots_of[device].store(slots, std::memory_order_release);
  }
  constexpr int out_n = EPI == EPI_NONE ? BN : BN / 2;
  const int64_t tiles = ((shape.m + CLUSTER * BM - 1) / (CLUSTER * BM)) * (int64_t)((shape.n + out_n - 1) / out_n);
  const int64_t units = tiles * ((shape.k + BK - 1) / BK);
  const bool have_workspace = workspace != nullptr && workspace_size >= workspace_bytes(props.sms);
  bool stream_k = false;
  if (schedule == SCHED_STREAM_K) {
    if (!have_workspace || units > INT_MAX) {
      return fail(WLLM_ERR_INVALID_ARGUMENT,
                  "gemm_sm90: stream-K needs a workspace of wllm_gemm_sm90_workspace_size bytes (got %lld) and "
                  "fewer than 2^31 k-blocks in all",
                  (long long)(workspace != nullptr ? workspace_size : 0));
    }
    stream_k = true;
  } else if (schedule == SCHED_AUTO && have_workspace && units <= INT_MAX) {
    // Stream-K where whole tiles would leave SMs idle: a few waves whose last is under 90% full (decode
    // steps: Llama-3.1-8B's gate_up at 240 rows is 112 tiles for 66 clusters). Many waves keep whole
    // tiles, whose grouped order shares A and B in L2 across a wave.
    const int64_t waves = (tiles + slots - 1) / slots;
    stream_k = waves <= 4 && tiles * 10 < waves * slots * 9;
  }
  int64_t clusters = tiles < slots ? tiles : slots;
  if (stream_k) {
    clusters = units < slots ? units : slots;
    shape.stream_k = 1;
    shape.flags = static_cast<int*>(workspace);
    shape.partials = reinterpret_cast<float4*>(static_cast<unsigned char*>(workspace) + flag_bytes(props.sms));
  }
  constexpr CUtensorMapDataType type =
      std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const int64_t b_rows = EPI == EPI_NONE ? shape.n : 2 * (int64_t)shape.n;
  CUtensorMap map_a, map_b, map_c;
  if (!make_map(&map_a, type, a, shape.m, shape.k, lda, BM) || !make_map(&map_b, type, b, b_rows, shape.k, ldb, BN / 2) ||
      !make_map(&map_c, type, c, shape.m, shape.n, ldc, 64)) {
    return fail(WLLM_ERR_CUDA, "gemm_sm90: cannot encode the TMA descriptors (driver too old?)");
  }
  config.gridDim = dim3((unsigned)(clusters * CLUSTER));
  cudaLaunchKernelEx(&config, kernel, map_a, map_b, map_c, shape);
  return check_launch("gemm_sm90");
}

}  // namespace sm90

// The TMA descriptor helpers it uses (hopper::make_tensor_map) are in csrc/hopper.cu, shared with the
// attention kernels.
}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_gemm_sm90_supported)(void) {
  using namespace WLLM_NS;
  DeviceProps props;
  return current_device_props(&props) == WLLM_OK && sm90::is_sm90(props) ? 1 : 0;
}

WLLM_API int WLLM_FN(wllm_gemm_sm90_workspace_size)(int64_t* bytes) {
  using namespace WLLM_NS;
  if (bytes == nullptr) return fail(WLLM_ERR_INVALID_ARGUMENT, "gemm_sm90_workspace_size: null pointer");
  DeviceProps props;
  const int rc = current_device_props(&props);
  if (rc != WLLM_OK) return rc;
  *bytes = sm90::workspace_bytes(props.sms);
  return WLLM_OK;
}

WLLM_API int WLLM_FN(wllm_gemm_sm90)(void* c, const void* a, const void* b, int64_t m, int64_t n, int64_t k,
                                     int64_t lda, int64_t ldb, int64_t ldc, int epilogue, int dtype, void* workspace,
                                     int64_t workspace_size, int schedule, void* stream) {
  using namespace WLLM_NS;
  using namespace WLLM_NS::sm90;
  if (c == nullptr || a == nullptr || b == nullptr) return fail(WLLM_ERR_INVALID_ARGUMENT, "gemm_sm90: null pointer");
  if (m < 0 || n <= 0 || k <= 0 || m > 0x7fffffffLL || n > 0x3fffffffLL || k > 0x7fffffffLL) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "gemm_sm90: bad shape m=%lld n=%lld k=%lld", (long long)m, (long long)n,
                (long long)k);
  }
  if (epilogue < EPI_NONE || epilogue > EPI_GELU_TANH) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "gemm_sm90: unknown epilogue %d (0 none, 1 SiLU-gated, 2 GELU-gated)",
                epilogue);
  }
  if (dtype != WLLM_FLOAT16 && dtype != WLLM_BFLOAT16) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "gemm_sm90: dtype %d unsupported (float16 or bfloat16 only)", dtype);
  }
  if (schedule < SCHED_AUTO || schedule > SCHED_STREAM_K) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "gemm_sm90: unknown schedule %d (0 auto, 1 whole tiles, 2 stream-K)",
                schedule);
  }
  // TMA: 16-byte aligned bases and row strides; the workspace's partial tiles are float4s.
  if (((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | reinterpret_cast<uintptr_t>(c) |
        reinterpret_cast<uintptr_t>(workspace)) & 15u) ||
      lda % 8 || ldb % 8 || ldc % 8 || lda < k || ldb < k || ldc < n) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "gemm_sm90: needs 16-byte aligned matrices and workspace and row strides that are multiples of 8 "
                "elements, at least the row length (lda=%lld ldb=%lld ldc=%lld, k=%lld n=%lld)",
                (long long)lda, (long long)ldb, (long long)ldc, (long long)k, (long long)n);
  }
  DeviceProps props;
  const int rc = current_device_props(&props);
  if (rc != WLLM_OK) return rc;
  if (!is_sm90(props)) {
    return fail(WLLM_ERR_NO_KERNEL_IMAGE, "gemm_sm90: this kernel runs on SM 9.0 GPUs only (this one is %d.%d)",
                props.major, props.minor);
  }
  if (m == 0) return WLLM_OK;
  const Shape shape{(int)m, (int)n, (int)k, 0, nullptr, nullptr};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
#define WLLM_GEMM_SM90_LAUNCH(T, E) launch<T, E>(c, a, b, shape, lda, ldb, ldc, workspace, workspace_size, schedule, props, s)
  if (dtype == WLLM_BFLOAT16) {
    if (epilogue == EPI_SILU) return WLLM_GEMM_SM90_LAUNCH(__nv_bfloat16, EPI_SILU);
    if (epilogue == EPI_GELU_TANH) return WLLM_GEMM_SM90_LAUNCH(__nv_bfloat16, EPI_GELU_TANH);
    return WLLM_GEMM_SM90_LAUNCH(__nv_bfloat16, EPI_NONE);
  }
  if (epilogue == EPI_SILU) return WLLM_GEMM_SM90_LAUNCH(__half, EPI_SILU);
  if (epilogue == EPI_GELU_TANH) return WLLM_GEMM_SM90_LAUNCH(__half, EPI_GELU_TANH);
  return WLLM_GEMM_SM90_LAUNCH(__half, EPI_NONE);
#undef WLLM_GEMM_SM90_LAUNCH
}
