// SIMT prefill attention: the path for SM 7.x (fp16/bf16) and for fp32 on every SM. fp32
// throughout; one CTA of 128 threads per 16 query rows, 8 threads per row.
#pragma once
#include <math.h>
#include <stdint.h>

#include "attention_prefill_tile.cuh"

namespace WLLM_NS {
namespace prefill {

constexpr int kSimtRows = 16;
constexpr int kSimtKeys = 16;
constexpr int kSimtThreads = 128;  // 8 threads per query row

template <int D>
constexpr size_t simt_smem_bytes() {
  return (size_t)(kSimtRows * (D + 1) + 2 * kSimtKeys * (D + 1) + kSimtRows * (kSimtKeys + 1)) * sizeof(float);
}

template <typename T, int D>
__device__ __forceinline__ void simt_body(const Params& p) {
  static_assert(D % 8 == 0, "head size must be a multiple of 8");
  constexpr int kS = D + 1;  // padded rows: the 8 keys a warp reads at once sit in different banks
  constexpr int kPS = kSimtKeys + 1;
  extern __shared__ float simt_smem[];
  float* sQ = simt_smem;
  float* sK = sQ + kSimtRows * kS;
  float* sV = sK + kSimtKeys * kS;
  float* sP = sV + kSimtKeys * kS;

  Tile t;
  if (!locate_tile(p, kSimtRows, t)) return;
  const int head = t.head;
  const int kvh = head / p.group;
  const int tid = threadIdx.x;
  const int r = tid >> 3;
  const int g = tid & 7;
  const T* q = static_cast<const T*>(p.q);
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  const int32_t* table = p.block_tables + (int64_t)t.seq * p.bt_stride;
  const int block_mask = (1 << p.block_shift) - 1;

  for (int i = tid; i < kSimtRows * D; i += kSimtThreads) {
    const int row = i / D, d = i - row * D;
    float v = 0.0f;
    if (t.m0 + row < t.q_len) {
      v = Conv<T>::to_float(q[(int64_t)(t.q_begin + t.m0 + row) * p.q_tok + (int64_t)head * p.q_head + d]);
    }
    sQ[row * kS + d] = v;
  }
  const KeyRange kr = key_range(t, kSimtRows, p.window, kSimtKeys);
  const int qpos = kr.qp_first + r;

  float m = -INFINITY, l = 0.0f;
  float o[D / 8];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i] = 0.0f;

  for (int it = 0; it < kr.n_tiles; ++it) {
    const int n0 = kr.first_n0 + it * kSimtKeys;
    __syncthreads();  // Q is in place and nobody still reads the previous K/V/P
    for (int i = tid; i < kSimtKeys * D; i += kSimtThreads) {
      const int row = i / D, d = i - row * D;
      const int key = n0 + row;
      float kv = 0.0f, vv = 0.0f;  // keys past the context read as zeros (never NaN garbage)
      if (key < t.ctx) {
        const int64_t off = (int64_t)table[key >> p.block_shift] * p.kv_block + (int64_t)(key & block_mask) * p.kv_tok +
                            (int64_t)kvh * p.kv_head + d;
        kv = Conv<T>::to_float(kc[off]);
        vv = Conv<T>::to_float(vc[off]);
      }
      sK[row * kS + d] = kv;
      sV[row * kS + d] = vv;
    }
    __syncthreads();
    float s[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = g + 8 * j;
      float dot = 0.0f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) dot += sQ[r * kS + d] * sK[c * kS + d];
      float x = p.softcap > 0.0f ? p.softcap * tanhf(dot * p.scale / p.softcap) : dot * p.scale;
      s[j] = visible(n0 + c, qpos, t.ctx, p.window) ? x : -INFINITY;
    }
    float mx = fmaxf(s[0], s[1]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    const float m_new = fmaxf(m, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet stays at 0
    const float corr = expf(m - m_use);
    const float p0 = expf(s[0] - m_use), p1 = expf(s[1] - m_use);
    m = m_new;
    l = l * corr + p0 + p1;  // this thread's share; the row total is summed at the end
    sP[r * kPS + g] = p0;
    sP[r * kPS + g + 8] = p1;
    __syncwarp();  // a row's 8 threads are in one warp
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i] *= corr;
    for (int c = 0; c < kSimtKeys; ++c) {
      const float pv = sP[r * kPS + c];
#pragma unroll
      for (int i = 0; i < D / 8; ++i) o[i] += pv * sV[c * kS + g + 8 * i];
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  l += __shfl_xor_sync(0xffffffffu, l, 4);
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  if (t.m0 + r < t.q_len) {
    T* out = static_cast<T*>(p.out) + (int64_t)(t.q_begin + t.m0 + r) * p.o_tok + (int64_t)head * p.o_head;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) out[g + 8 * i] = Conv<T>::from_float(o[i] * inv);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kSimtThreads) simt_prefill_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  // On SM 8.0+ only fp32 takes this kernel; fp16/bf16 go to the tensor-core one (keeps the build lean).
  if constexpr (sizeof(T) == 4) simt_body<T, D>(p);
#else
  simt_body<T, D>(p);
#endif
}

}  // namespace prefill
}  // namespace WLLM_NS
