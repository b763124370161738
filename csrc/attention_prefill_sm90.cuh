// Hopper (SM 9.0) paged prefill attention: the online-softmax algorithm of flash_prefill_kernel on
// warpgroup MMAs (wgmma), which on this GPU run about twice as fast as the mma.sync ones.
//
// A CTA computes 128 query rows of one head with two warpgroups (64 rows each) over tiles of BN keys:
//  - all 256 threads gather Q once and then the K and V tiles through the block table with cp.async into
//    double buffers, in the 128-byte-swizzled layout wgmma reads (rows of 64 head dims, 16-byte chunk c of
//    row r at c ^ (r % 8)), zero-filled past the context;
//  - S = Q K^T: wgmma m64nBNk16 with both operands in shared memory (K-major);
//  - the softmax runs on the fp32 accumulators in registers, exactly as in the mma.sync kernel (the
//    wgmma accumulator layout of each warp is the m16n8 one);
//  - O += P V: wgmma m64nDk16 with P straight from registers (an accumulator quad of 16 keys is the
//    m64k16 A fragment) and V read N-major (head dims contiguous) from the same layout as K;
//  - the next K tile loads during the softmax and P V, the next V tile during the next Q K^T.
// Compiled only for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); the launcher uses it on SM 9.0 for fp16/bf16 and
// head sizes 64 and 128, the mma.sync kernel elsewhere.
#pragma once
#include <stdint.h>

#include "attention_prefill_mma.cuh"
#include "attention_prefill_tile.cuh"
#include "common.cuh"
#include "wgmma_sm90.cuh"

namespace WLLM_NS {
namespace prefill {

constexpr int kSm90Threads = 256;  // two warpgroups of 64 query rows
constexpr int kSm90BM = 128;
constexpr int kSm90BN = 128;  // keys per K/V tile

template <int D>
constexpr size_t sm90_smem_bytes() {
  // Q, two K and two V tiles, and slack to align the first to 1024 bytes (the swizzle atom).
  return (size_t)(kSm90BM + 4 * kSm90BN) * D * 2 + 1024;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Byte offset of 16-byte chunk c (of D / 8) of row r in a tile of `rows` rows: D / 64 column blocks of
// rows x 128 bytes, 128-byte swizzled.
template <int D>
__device__ __forceinline__ uint32_t swizzled(int rows, int r, int c) {
  return (uint32_t)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// wgmma shared-memory descriptor, 128-byte swizzle: start >> 4, leading byte offset (between 64-column
// blocks of an N-major operand; unused for K-major), stride byte offset 1024 (8 rows of 128 bytes).
__device__ __forceinline__ uint64_t sm90_desc(uint32_t addr, uint32_t lead_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lead_bytes >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

// cp.async writes go through the generic proxy, wgmma reads through the async one.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif

template <typename T, int D>
__global__ void __launch_bounds__(kSm90Threads, 1) sm90_prefill_kernel(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int BM = kSm90BM, BN = kSm90BN, CH = D / 8;
  constexpr uint32_t Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
  extern __shared__ unsigned char sm90_smem_raw[];
  const uint32_t base = (smem_addr(sm90_smem_raw) + 1023u) & ~1023u;
  unsigned char* const smem = sm90_smem_raw + (base - smem_addr(sm90_smem_raw));
  const uint32_t s_q = base, s_k = base + Q_BYTES, s_v = s_k + 2 * KV_BYTES;  // K and V double-buffered

  Tile t;
  if (!locate_tile(p, BM, t)) return;
  const int head = t.head, tid = threadIdx.x;
  const int cw = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const T* q = static_cast<const T*>(p.q);
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  const int32_t* table = p.block_tables + (int64_t)t.seq * p.bt_stride;
  const int64_t head_off = (int64_t)(head / p.group) * p.kv_head;
  const int block_mask = (1 << p.block_shift) - 1;
  const int ctx = t.ctx;

  for (int c = tid; c < BM * CH; c += kSm90Threads) {
    const int row = c / CH, ch = c - row * CH;
    const bool ok = t.m0 + row < t.q_len;
    const T* src = ok ? q + (int64_t)(t.q_begin + t.m0 + row) * p.q_tok + (int64_t)head * p.q_head + ch * 8 : q;
    cp_async_16(smem + (s_q - base) + swizzled<D>(BM, row, ch), src, ok ? 16 : 0);
  }
  // Keys n0.. of one cache into the tile at `dst`; rows past the context are zero-filled so that 0 * garbage
  // (possibly NaN) never reaches the accumulators. Each thread copies one fixed 16-byte column chunk of
  // rows r0, r0 + RPP, ...: its swizzled offset only moves by whole 1024-byte atoms from pass to pass.
  constexpr int RPP = kSm90Threads / CH, PASSES = BN / RPP;
  static_assert(RPP % 8 == 0 && BN % RPP == 0, "passes must keep the swizzle phase");
  const int kv_ch = tid % CH, kv_r0 = tid / CH;
  const uint32_t kv_dst = swizzled<D>(BN, kv_r0, kv_ch);
  const int64_t kv_col = head_off + kv_ch * 8;
  auto load_kv = [&](uint32_t dst, const T* cache, int n0) {
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
      const int key = n0 + kv_r0 + i * RPP;
      const bool ok = key < ctx;
      const T* src = ok ? cache + (int64_t)table[key >> p.block_shift] * p.kv_block +
                              (int64_t)(key & block_mask) * p.kv_tok + kv_col
                        : cache;
      cp_async_16(smem + (dst - base) + kv_dst + i * RPP * 128, src, ok ? 16 : 0);
    }
  };

  const KeyRange kr = key_range(t, BM, p.window, BN);
  const bool capped = p.softcap > 0.0f;
  const float kLog2e = 1.4426950408889634f;
  const float pre = capped ? p.scale / p.softcap : p.scale * kLog2e;
  const float post = capped ? p.softcap * kLog2e : 1.0f;
  const float mul = capped ? 1.0f : pre;  // scores stay unscaled; the scale is folded into the exponent

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};

  if (kr.n_tiles > 0) load_kv(s_k, kc, kr.first_n0);
  cp_async_commit();  // Q and the first K
  if (kr.n_tiles > 0) load_kv(s_v, vc, kr.first_n0);
  cp_async_commit();

  for (int it = 0; it < kr.n_tiles; ++it) {
    const int n0 = kr.first_n0 + it * BN;
    const uint32_t k_cur = s_k + (it & 1) * KV_BYTES, v_cur = s_v + (it & 1) * KV_BYTES;
    cp_async_wait_one();  // this K (and Q) landed; this V may still be in flight
    fence_async_shared();
    __syncthreads();  // every thread's copies done; every warpgroup is past the previous tile
    if (it + 1 < kr.n_tiles) load_kv(s_k + ((it + 1) & 1) * KV_BYTES, kc, n0 + BN);
    cp_async_commit();

    // S = Q K^T over this warpgroup's 64 rows.
    float s[BN / 2];
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t cb = (kk >> 2), off = (kk & 3) * 32;
      wgmma<T, BN>(s, sm90_desc(s_q + cb * BM * 128 + cw * 64 * 128 + off, 16),
                   sm90_desc(k_cur + cb * BN * 128 + off, 16), kk > 0 ? 1 : 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");

    if (capped) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) s[i] = tanhf(s[i] * pre) * post;
    }
    // Online softmax. Thread holds rows g and g + 8 (h = 0, 1) of its warp's 16, columns 8 j + 2 t4 + {0, 1}
    // in s[4 j + 2 h + {0, 1}]; a row's 4 threads are lanes 4 g .. 4 g + 3.
    // Whole tile visible to every row of the CTA: no mask. Else key n0 + 8 j + 2 t4 + e is visible to
    // position qpos iff lo < it <= qpos: one compare per bound against the column offset 8 j + e. Keys
    // past the context need no test: they are zero-filled (finite scores), and the rows that could see
    // them (qpos >= ctx) are past the sequence's queries, never written.
    const bool full = n0 + BN - 1 <= kr.qp_first && (p.window <= 0 || n0 > kr.qp_last - p.window);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int qpos = kr.qp_first + cw * 64 + warp * 16 + g + h * 8;
      float mx = -INFINITY;
      if (full) {
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      } else {
        const int hi = qpos - (n0 + 2 * t4);
        const int lo = p.window > 0 ? hi - p.window : -(1 << 30);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = 8 * j + e;
            const float x = (c <= hi && c > lo) ? s[4 * j + 2 * h + e] : -INFINITY;
            s[4 * j + 2 * h + e] = x;
            mx = fmaxf(mx, x);
          }
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(row_max[h], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet: keep zeros
      const float corr = fast_exp2((row_max[h] - m_use) * mul);
      row_max[h] = m_new;
      const float neg_m = -m_use * mul;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pv = fast_exp2(fmaf(s[4 * j + 2 * h + e], mul, neg_m));
          s[4 * j + 2 * h + e] = pv;
          sum += pv;
        }
      }
      row_sum[h] = row_sum[h] * corr + sum;  // this thread's share of the row
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[4 * j + 2 * h] *= corr;
        o[4 * j + 2 * h + 1] *= corr;
      }
    }
    // P as the A fragments of P V: keys 16 kk .. 16 kk + 15 are accumulator blocks 2 kk and 2 kk + 1.
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = pack2<T>(s[8 * kk], s[8 * kk + 1]);
      pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }

    cp_async_wait_one();  // this V landed; the next K may still be in flight
    fence_async_shared();
    __syncthreads();  // every warpgroup is past the previous tile's P V
    if (it + 1 < kr.n_tiles) load_kv(s_v + ((it + 1) & 1) * KV_BYTES, vc, n0 + BN);
    cp_async_commit();

    // O += P V: 16 keys (two 8-row groups, 2 KB) per step; V's 64-column blocks are BN * 128 bytes apart.
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      wgmma_rs_nmajor<T, D>(o, pa[kk], sm90_desc(v_cur + kk * 2048, BN * 128), 1);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  cp_async_wait_all();  // (empty groups only, but leave none behind)

  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_sum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int qrow = t.m0 + cw * 64 + warp * 16 + g + h * 8;
    if (qrow < t.q_len) {
      T* dst = out + (int64_t)(t.q_begin + qrow) * p.o_tok + (int64_t)head * p.o_head + 2 * t4;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        *reinterpret_cast<uint32_t*>(dst + j * 8) = pack2<T>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
      }
    }
  }
#endif
}

}  // namespace prefill
}  // namespace WLLM_NS
