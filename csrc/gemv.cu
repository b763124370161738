// Skinny GEMM for decode: out[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) for a few rows of x (M ~ 1..16),
// fp16/bf16 in and out, fp32 accumulation. Optionally x is [M, 2K] = [gate | up] and the kernel uses
// act(gate) * up as its input (the gated MLP's down projection without a separate activation kernel), or
// W is [gate | up] and the kernel writes act(gate) * up (the gated MLP's gate_up projection: the
// activation once per output instead of once per CTA of the down projection, and half the output).
//
// Decode reads every weight once per step for a handful of tokens, so this is a bandwidth problem: one
// pass over W with 16-byte loads, many loads in flight per SM, all M rows of x computed from that single
// read. x (after the optional activation, rounded to the dtype as the unfused path would) is staged once
// per CTA in shared memory; CTAs are persistent over rows so that staging (and the activation math) is
// paid per CTA, not per row. Three kernels:
//  - register-prefetch kernel (M <= 2, aligned 16-byte rows, decode inside a PDL chain): like the
//    row-group kernel, but every lane loads its first 16 chunks of W into registers before pdl_wait(),
//    so up to ~17 MB of W is in flight while the previous kernel still runs;
//  - row-group kernel (M <= 4, aligned 16-byte rows): a group of G lanes (8, 16 or 32)
//    owns one output row over the whole of K, streams it with U independent 16-byte loads per lane in
//    flight, reduces with shuffles inside the group and writes; no __syncthreads after staging x, so
//    every warp keeps loads in flight back to back and groups never wait for each other.
//  - split-K kernel (more rows, odd K, misaligned pointers): ROWS rows of W per task, done by `wk` warps
//    that split K and reduce through shared memory.
//  - tensor-core kernel (3..16 rows of a plain x, SM 8.0+, aligned rows, K a multiple of 32): mma.sync
//    with W as the 16-row A operand and the x rows as the n8 B operand, so the FMA rate of the kernels
//    above (which binds them from ~4 rows on) stops mattering and one pass over W serves 16 rows.
#include <stdint.h>

#include "attention_prefill_mma.cuh"
#include "common.cuh"

namespace WLLM_NS {
namespace {

enum GemvPrologue { PROLOGUE_NONE = 0, PROLOGUE_SILU_AND_MUL = 1, PROLOGUE_GELU_TANH_AND_MUL = 2 };
// Epilogues (the EPI template argument of the row-group kernel): none, the gated activations above
// (codes 1 and 2: act(gate) * up), or the rotary one: the qkv projection of decode rows writing rotated
// q, and rotated k and v straight into one layer's paged KV caches (wllm_gemv_rotary_cache).
enum GemvEpilogue { EPILOGUE_ROTARY = 3 };

// Kernel choice, bits 8..15 of the prologue argument (benchmarks and tests; 0 = automatic). A forced
// row-group variant that does not apply (rows > 4, unaligned or odd K) falls back to the split-K kernel;
// a forced register-prefetch one with 3-4 rows to the row-group kernel, with more (or unaligned W) to split-K.
enum GemvVariant {
  VARIANT_AUTO = 0,
  VARIANT_SPLIT_K = 1,
  VARIANT_ROW_GROUP = 2,  // row-group kernel, lanes per row chosen from K
  VARIANT_ROW_GROUP_32 = 3,
  VARIANT_ROW_GROUP_16 = 4,
  VARIANT_ROW_GROUP_8 = 5,
  VARIANT_REG_PREFETCH = 6,  // register-prefetch kernel (M <= 2); the automatic choice where it applies
  VARIANT_MMA = 7,           // tensor-core kernel (plain x, SM 8.0+, aligned rows, K % 32 == 0); else auto
  VARIANT_LAST = VARIANT_MMA
};

constexpr int kRows = 2;      // rows of W per task
constexpr int kUnroll = 4;    // chunks per lane loaded before any is used (loads in flight = kUnroll * kRows)
constexpr int kMaxWarps = 8;  // CTA size is 4 or 8 warps

// The rotary epilogue's inputs and outputs: W rows are [q heads | k heads | v heads] of head_size rows
// each; q (rotated) goes to GemvParams::out, k (rotated) and v to the caches [blocks, block_size, Hkv, D]
// at slots[m] (skipped when < 0 or >= num_slots: graph padding).
template <typename T>
struct RopeOut {
  const int64_t* positions;  // [m], clamped to [0, max_position)
  const int64_t* slots;      // [m]
  const float* cos_sin;      // [max_position, rot_dim]: cos half, then sin half (rotary_embedding's table)
  T* key_cache;
  T* value_cache;
  int num_heads;
  int num_kv_heads;
  int head_size;
  int rot_dim;
  int neox;
  int block_size;
  int64_t num_slots;
  int64_t max_position;
  int64_t c_block;  // cache strides in elements: block, token, head
  int64_t c_tok;
  int64_t c_head;
};

template <typename T>
struct GemvParams {
  T* out;
  const T* x;
  const T* w;
  const T* bias;  // may be null
  int m;          // rows of x in this launch (<= MAXM of the kernel)
  int n;
  int k;
  int k_pad;  // row pitch of x in shared memory (elements, multiple of 8: keeps 16-byte rows)
  int64_t ldo;
  int64_t ldx;
  int64_t ldw;
  int wk;     // warps per task (they split K); divides blockDim.x / 32
  int tasks;  // ceil(n / kRows)
  int x_vec;  // x rows can be read with 16-byte loads
  int64_t up_offset;  // gated output only: elements from a gate row of W to its up row (0 otherwise)
  RopeOut<T> rope;    // rotary epilogue only
};

// act(g) * u in fp32. Both activations are g * sigmoid(z): z = g for SiLU, and for tanh-GELU
// 0.5 * (1 + tanh(t)) = sigmoid(2t), which avoids the cancellation of 1 + tanh(t) for very negative t.
// Fast exp/divide: every CTA recomputes this for its copy of x, and the special-function units would
// otherwise bound the small matrices; the result is rounded to fp16/bf16 right after, far coarser.
template <int PRO>
__device__ __forceinline__ float gated(float g, float u) {
  float z = g;
  if (PRO == PROLOGUE_GELU_TANH_AND_MUL) z = 1.5957691216057308f * (g + 0.044715f * g * g * g);  // 2*sqrt(2/pi)
  // For z -> -inf, exp overflows to inf and the approximate division returns 0, the right limit.
  return __fdividef(g, 1.0f + __expf(-z)) * u;
}

__device__ __forceinline__ void unpack2(uint32_t w, __nv_bfloat16, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

__device__ __forceinline__ void unpack2(uint32_t w, __half, float& lo, float& hi) {
  lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
  hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}

// VEC consecutive elements of one row: 16 bytes (VEC = 8) or one element (VEC = 1, any alignment).
template <typename T, int VEC>
struct Pack;

template <typename T>
struct Pack<T, 8> {
  uint4 v;
  // Weights are read exactly once: bypass L1 so the staged x and other CTAs' lines are not evicted.
  __device__ __forceinline__ void load_weight(const T* p) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  }
  __device__ __forceinline__ void load_shared(const T* p) { v = *reinterpret_cast<const uint4*>(p); }
  __device__ __forceinline__ void to_float(float (&f)[8]) const {
    unpack2(v.x, T(), f[0], f[1]);
    unpack2(v.y, T(), f[2], f[3]);
    unpack2(v.z, T(), f[4], f[5]);
    unpack2(v.w, T(), f[6], f[7]);
  }
};

template <typename T>
struct Pack<T, 1> {
  T v;
  __device__ __forceinline__ void load_weight(const T* p) { v = __ldg(p); }
  __device__ __forceinline__ void load_shared(const T* p) { v = *p; }
  __device__ __forceinline__ void to_float(float (&f)[1]) const { f[0] = Conv<T>::to_float(v); }
};

// gate (8 elements of T in 16 bytes) <- act(gate) * up, rounded to T.
template <typename T, int PRO>
__device__ __forceinline__ void apply_gate(uint4& gate, const uint4& up) {
  T* g = reinterpret_cast<T*>(&gate);
  const T* u = reinterpret_cast<const T*>(&up);
#pragma unroll
  for (int j = 0; j < 8; ++j) g[j] = Conv<T>::from_float(gated<PRO>(Conv<T>::to_float(g[j]), Conv<T>::to_float(u[j])));
}

// Writes x (or act(gate) * up) rows 0..m-1 into shared memory, rounded to T.
template <typename T, int PRO>
__device__ __forceinline__ void stage_x(T* xs, const GemvParams<T>& p) {
  const int gate_width = p.k;  // with a prologue, row r of x is [gate (k) | up (k)]
  if (p.x_vec) {
    const int per_row = p.k / 8;
    const int total = p.m * per_row;
    // Unrolled so that several loads of x are in flight at once: staging sits on the critical path
    // before any weight is used (the first weights are only prefetched into L2 meanwhile).
#pragma unroll 4
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
      const int r = i / per_row;
      const int c = (i - r * per_row) * 8;
      const T* src = p.x + r * p.ldx + c;
      uint4 a = __ldg(reinterpret_cast<const uint4*>(src));
      if (PRO != PROLOGUE_NONE) apply_gate<T, PRO>(a, __ldg(reinterpret_cast<const uint4*>(src + gate_width)));
      *reinterpret_cast<uint4*>(xs + r * p.k_pad + c) = a;
    }
  } else {
    const int total = p.m * p.k;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
      const int r = i / p.k;
      const int c = i - r * p.k;
      const T* src = p.x + r * p.ldx + c;
      T v = src[0];
      if (PRO != PROLOGUE_NONE) {
        v = Conv<T>::from_float(gated<PRO>(Conv<T>::to_float(v), Conv<T>::to_float(src[gate_width])));
      }
      xs[r * p.k_pad + c] = v;
    }
  }
}

// Grid: persistent CTAs of 4 or 8 warps; warps [g * wk, (g + 1) * wk) form group g. Group g of CTA b
// takes tasks b * groups + g, then + gridDim.x * groups, ... Lane l of warp kw in a group takes chunks
// (VEC elements) kw * 32 + l, + 32 * wk, ... of the task's rows.
// Shared memory: x [m][k_pad] of T, then the reduction buffer float [2][warps][MAXM * kRows].
template <typename T, int PRO, int MAXM, int VEC>
__global__ void __launch_bounds__(kMaxWarps * 32, 2) gemv_kernel(const GemvParams<T> p) {
  pdl_trigger_early<PDL_GEMV>();
  constexpr int MR = MAXM * kRows;  // partial sums per thread
  static_assert(MR <= 32, "one lane per partial sum in the reduction");
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);
  float* red = reinterpret_cast<float*>(smem + ((static_cast<size_t>(p.m) * p.k_pad * sizeof(T) + 15) & ~size_t(15)));

  const int warps = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int groups = warps / p.wk;
  const int group = warp / p.wk;
  const int kw = warp - group * p.wk;
  const int chunks = p.k / VEC;
  const int kstep = 32 * p.wk;  // chunks between one lane's consecutive chunks

  // Start the first task's weights moving into L2 (no registers held) before waiting for the previous
  // kernel (PDL: weights are never written by a kernel in flight), and while x, its output, is staged.
  {
    const int task = blockIdx.x * groups + group;
    if (task < p.tasks) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const T* row = p.w + static_cast<int64_t>(min(task * kRows + r, p.n - 1)) * p.ldw;
        for (int u = 0, c = kw * 32 + lane; u < 2 * kUnroll && c < chunks; ++u, c += kstep) {
          asm volatile("prefetch.global.L2 [%0];" ::"l"(row + static_cast<int64_t>(c) * VEC));
        }
      }
    }
  }
  pdl_wait_and_trigger<PDL_GEMV>();
  stage_x<T, PRO>(xs, p);
  __syncthreads();

  int parity = 0;
  // The bound is uniform over the CTA, so the __syncthreads inside is reached by every thread.
  for (int base = blockIdx.x * groups; base < p.tasks; base += gridDim.x * groups) {
    const int task = base + group;
    float acc[MAXM][kRows];
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[m][r] = 0.0f;
    }
    if (task < p.tasks) {  // uniform over the warp
      const T* rows[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        // Past the last row (odd n): read row n - 1 again, never written back.
        rows[r] = p.w + static_cast<int64_t>(min(task * kRows + r, p.n - 1)) * p.ldw;
      }
      // Warp-uniform trip count; lanes past the end of K are masked per chunk.
      for (int c0 = kw * 32; c0 < chunks; c0 += kstep * kUnroll) {
        Pack<T, VEC> wv[kUnroll][kRows];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int c = c0 + u * kstep + lane;
          if (c < chunks) {
#pragma unroll
            for (int r = 0; r < kRows; ++r) wv[u][r].load_weight(rows[r] + static_cast<int64_t>(c) * VEC);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int c = c0 + u * kstep + lane;
          if (c < chunks) {
            float wf[kRows][VEC];
#pragma unroll
            for (int r = 0; r < kRows; ++r) wv[u][r].to_float(wf[r]);
#pragma unroll
            for (int m = 0; m < MAXM; ++m) {
              if (m < p.m) {
                Pack<T, VEC> xv;
                xv.load_shared(xs + m * p.k_pad + c * VEC);
                float xf[VEC];
                xv.to_float(xf);
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
#pragma unroll
                  for (int j = 0; j < VEC; ++j) acc[m][r] = fmaf(wf[r][j], xf[j], acc[m][r]);
                }
              }
            }
          }
        }
      }
    }

    // Every lane ends up with every sum of its warp; lane i then owns partial sum i (m = i / kRows).
    float mine = 0.0f;
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float s = (m < p.m) ? warp_sum(acc[m][r]) : 0.0f;
        if (lane == m * kRows + r) mine = s;
      }
    }

    if (p.wk == 1) {
      const int m = lane / kRows;
      const int row = task * kRows + (lane - m * kRows);
      if (task < p.tasks && lane < MR && m < p.m && row < p.n) {
        const float b = p.bias != nullptr ? Conv<T>::to_float(p.bias[row]) : 0.0f;
        p.out[m * p.ldo + row] = Conv<T>::from_float(mine + b);
      }
    } else {
      // Double-buffered: the buffer written here was last read two iterations ago, before the
      // __syncthreads of the previous iteration.
      float* buf = red + parity * (warps * MR);
      if (lane < MR) buf[warp * MR + lane] = mine;
      __syncthreads();
      for (int t = threadIdx.x; t < groups * MR; t += blockDim.x) {
        const int g = t / MR;
        const int i = t - g * MR;
        const int m = i / kRows;
        const int tk = base + g;
        const int row = tk * kRows + (i - m * kRows);
        if (tk < p.tasks && m < p.m && row < p.n) {
          float s = p.bias != nullptr ? Conv<T>::to_float(p.bias[row]) : 0.0f;
          for (int w = 0; w < p.wk; ++w) s += buf[(g * p.wk + w) * MR + i];
          p.out[m * p.ldo + row] = Conv<T>::from_float(s);
        }
      }
      parity ^= 1;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Row-group kernel (M <= MAXM <= 4, 16-byte aligned rows of W, K a multiple of 8).
// ---------------------------------------------------------------------------------------------------

constexpr int kRgMaxThreads = 512;  // CTA of 128, 256 or 512 threads (chosen by the launcher)
constexpr int kRgUnroll = 8;        // 16-byte loads per lane in flight (one row: U * 16 B per lane)
constexpr int kRgPrefetch = 32;     // L2 prefetches per lane of the first row, issued before the PDL wait

// acc[m] += (8 weights of chunk c, already loaded) . (the same 8 elements of row m of the staged x), for
// the p.m rows of x.
template <typename T, int MAXM>
__device__ __forceinline__ void fma_chunk(const Pack<T, 8>& w, const T* xs, const GemvParams<T>& p, int c,
                                          float (&acc)[MAXM]) {
  float wf[8];
  w.to_float(wf);
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    if (m < p.m) {
      Pack<T, 8> xv;
      xv.load_shared(xs + m * p.k_pad + c * 8);
      float xf[8];
      xv.to_float(xf);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[m] = fmaf(wf[j], xf[j], acc[m]);
    }
  }
}

// Sum over the G lanes of this lane's group (aligned runs of G lanes in the warp); every lane of the
// group gets the sum. The mask names only the group, so groups of one warp may diverge in trip count.
template <int G>
__device__ __forceinline__ float group_sum(float v, unsigned mask) {
#pragma unroll
  for (int offset = G / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(mask, v, offset, G);
  return v;
}

// Sums each row's partials over the group and adds the bias; lane m of the group writes row m of x's
// result to column n (MAXM <= G). Every lane of the group must call it (shuffles).
template <typename T, int MAXM, int G>
__device__ __forceinline__ void write_group_rows(const GemvParams<T>& p, int n, int lane, unsigned mask,
                                                 const float (&acc)[MAXM]) {
  const float b = (p.bias != nullptr && lane < p.m) ? Conv<T>::to_float(p.bias[n]) : 0.0f;
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    if (m < p.m) {  // uniform over the group
      const float s = group_sum<G>(acc[m], mask);
      if (lane == m) p.out[m * p.ldo + n] = Conv<T>::from_float(s + b);
    }
  }
}

// Gated output (EPI = the activation): column n of the result is act(g) * u, g and u being output rows n
// and n + p.n of the matmul (plus their biases), each rounded to T first as the unfused path (GEMM writing
// [gate | up], then wllm_act_and_mul) rounds them. Every lane of the group must call it (shuffles).
template <typename T, int MAXM, int G, int EPI>
__device__ __forceinline__ void write_gated_rows(const GemvParams<T>& p, int n, int lane, unsigned mask,
                                                 const float (&gate)[MAXM], const float (&up)[MAXM]) {
  const bool biased = p.bias != nullptr && lane < p.m;
  const float bg = biased ? Conv<T>::to_float(p.bias[n]) : 0.0f;
  const float bu = biased ? Conv<T>::to_float(p.bias[n + p.n]) : 0.0f;
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    if (m < p.m) {  // uniform over the group
      const float g = group_sum<G>(gate[m], mask);
      const float u = group_sum<G>(up[m], mask);
      if (lane == m) {
        const float gr = Conv<T>::to_float(Conv<T>::from_float(g + bg));
        const float ur = Conv<T>::to_float(Conv<T>::from_float(u + bu));
        p.out[m * p.ldo + n] = Conv<T>::from_float(gated<EPI>(gr, ur));
      }
    }
  }
}

// Rotary epilogue: output pair n (of (Hq + 2 * Hkv) * head_size / 2) is two rows a, b of head `head`.
// Rotated dims pair as rotary_embedding pairs them (NeoX: j and j + rot_dim / 2; GPT-J: 2j and 2j + 1,
// j < rot_dim / 2, table column j); the dims past rot_dim of q and k heads, and all of v, pair up
// adjacently and pass through.
struct RotaryPair {
  int head, a, b, j;
  bool rotate;
};

template <typename T>
__device__ __forceinline__ RotaryPair rotary_pair(const RopeOut<T>& r, int n) {
  const int hp = r.head_size / 2;
  const int half = r.rot_dim / 2;
  RotaryPair q;
  q.head = n / hp;
  const int j = n - q.head * hp;
  const bool is_v = q.head >= r.num_heads + r.num_kv_heads;
  q.rotate = !is_v && j < half;
  q.j = j;
  if (q.rotate) {
    q.a = r.neox ? j : 2 * j;
    q.b = r.neox ? j + half : 2 * j + 1;
  } else {
    q.a = is_v ? 2 * j : r.rot_dim + 2 * (j - half);
    q.b = q.a + 1;
  }
  return q;
}

// Sums the pair's partials over the group, adds the biases, rounds each to T (as the projection's output
// is stored), rotates in fp32 with one rounding (rotary_and_cache's math), and writes q to p.out or k / v
// into the caches. Every lane of the group must call it (shuffles).
template <typename T, int MAXM, int G>
__device__ __forceinline__ void write_rotary_rows(const GemvParams<T>& p, int n, int lane, unsigned mask,
                                                  const float (&acc0)[MAXM], const float (&acc1)[MAXM]) {
  const RopeOut<T>& r = p.rope;
  const RotaryPair q = rotary_pair(r, n);
  const int64_t row0 = static_cast<int64_t>(q.head) * r.head_size + q.a;
  const int64_t row1 = static_cast<int64_t>(q.head) * r.head_size + q.b;
  const bool biased = p.bias != nullptr && lane < p.m;
  const float b0 = biased ? Conv<T>::to_float(p.bias[row0]) : 0.0f;
  const float b1 = biased ? Conv<T>::to_float(p.bias[row1]) : 0.0f;
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    if (m < p.m) {  // uniform over the group
      const float s0 = group_sum<G>(acc0[m], mask);
      const float s1 = group_sum<G>(acc1[m], mask);
      if (lane == m) {
        const float x1 = Conv<T>::to_float(Conv<T>::from_float(s0 + b0));
        const float x2 = Conv<T>::to_float(Conv<T>::from_float(s1 + b1));
        float y1 = x1, y2 = x2;
        if (q.rotate) {
          int64_t pos = r.positions[m];
          if (pos < 0) pos = 0;
          if (pos >= r.max_position) pos = r.max_position - 1;
          const float* cos_row = r.cos_sin + pos * r.rot_dim;
          const float c = __ldg(cos_row + q.j);
          const float sn = __ldg(cos_row + r.rot_dim / 2 + q.j);
          y1 = x1 * c - x2 * sn;
          y2 = x2 * c + x1 * sn;
        }
        const T o1 = Conv<T>::from_float(y1);
        const T o2 = Conv<T>::from_float(y2);
        if (q.head < r.num_heads) {
          T* dst = p.out + m * p.ldo + static_cast<int64_t>(q.head) * r.head_size;
          dst[q.a] = o1;
          dst[q.b] = o2;
        } else {
          const int64_t slot = r.slots[m];
          if (slot >= 0 && slot < r.num_slots) {
            const bool is_v = q.head >= r.num_heads + r.num_kv_heads;
            const int kv = q.head - r.num_heads - (is_v ? r.num_kv_heads : 0);
            const int64_t block = slot / r.block_size;
            T* dst = (is_v ? r.value_cache : r.key_cache) + block * r.c_block + (slot - block * r.block_size) * r.c_tok +
                     kv * r.c_head;
            dst[q.a] = o1;
            dst[q.b] = o2;
          }
        }
      }
    }
  }
}

// The rows of W that output column (or pair) n of the row-group kernel reads: row n; rows n and n + p.n
// for a gated output; the rotary pair's two rows.
template <typename T, int EPI, int NR>
__device__ __forceinline__ void group_rows(const GemvParams<T>& p, int n, const T* (&rows)[NR]) {
  if constexpr (EPI == EPILOGUE_ROTARY) {
    const RotaryPair q = rotary_pair(p.rope, n);
    const T* head = p.w + static_cast<int64_t>(q.head) * p.rope.head_size * p.ldw;
    rows[0] = head + static_cast<int64_t>(q.a) * p.ldw;
    rows[NR - 1] = head + static_cast<int64_t>(q.b) * p.ldw;
  } else {
    rows[0] = p.w + static_cast<int64_t>(n) * p.ldw;
    if constexpr (NR > 1) rows[1] = rows[0] + p.up_offset;
  }
}

// Grid: persistent CTAs; lanes [g * G, (g + 1) * G) of the CTA form group g. Global group q takes rows
// q, q + groups_total, ... (each row over all of K). Lane l of a group takes 16-byte chunks l, l + G, ...
// of the row. Shared memory: x [m][k_pad] of T only. With a gated output (EPI != PROLOGUE_NONE) a group's
// "row" n is the pair of W rows n and n + p.n (gate and up, p.up_offset elements apart), streamed
// together, and the group writes act(gate) * up.
template <typename T, int PRO, int MAXM, int G, int EPI>
__global__ void __launch_bounds__(kRgMaxThreads, 1) gemv_row_group_kernel(const GemvParams<T> p) {
  // With the rotary epilogue this kernel stands where rotary_and_cache did, ahead of decode attention,
  // and triggers its dependent as that kernel does.
  constexpr int kFamily = EPI == EPILOGUE_ROTARY ? PDL_ROPE : PDL_GEMV;
  pdl_trigger_early<kFamily>();
  static_assert(G == 8 || G == 16 || G == 32, "lane groups are 8, 16 or 32 lanes");
  static_assert(PRO == PROLOGUE_NONE || EPI == PROLOGUE_NONE, "a prologue or an epilogue, not both");
  constexpr int NR = EPI != PROLOGUE_NONE ? 2 : 1;  // rows of W per output column
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);

  const int lane = threadIdx.x & (G - 1);
  const int groups_per_cta = blockDim.x / G;
  const int first_row = blockIdx.x * groups_per_cta + threadIdx.x / G;
  const int row_step = gridDim.x * groups_per_cta;
  const int chunks = p.k >> 3;
  const unsigned mask = (0xffffffffu >> (32 - G)) << ((threadIdx.x & 31) & ~(G - 1));  // this group's lanes

  // Start this group's first row moving into L2 (no registers held) before waiting for the previous
  // kernel (PDL: weights are never written by a kernel in flight, so this overlaps that kernel's tail)
  // and while x, its output, is staged. The whole row, up to kRgPrefetch loads per lane: in a decode
  // step most groups own one or two rows, so this covers most of the matrix.
  if (first_row < p.n) {
    const T* rows[NR];
    group_rows<T, EPI, NR>(p, first_row, rows);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      for (int u = 0, c = lane; u < kRgPrefetch / NR && c < chunks; ++u, c += G) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(rows[r] + static_cast<int64_t>(c) * 8));
      }
    }
  }
  pdl_wait_and_trigger<kFamily>();
  stage_x<T, PRO>(xs, p);
  __syncthreads();  // the only barrier: from here on each group runs on its own

  // The trip count is uniform over a group (the shuffles below name only the group's lanes).
  for (int n = first_row; n < p.n; n += row_step) {
    const T* rows[NR];
    group_rows<T, EPI, NR>(p, n, rows);
    float acc[NR][MAXM];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
      for (int m = 0; m < MAXM; ++m) acc[r][m] = 0.0f;
    }
    // Uniform over the group; lanes past the end of K are masked per chunk.
    for (int c0 = 0; c0 < chunks; c0 += G * kRgUnroll) {
      Pack<T, 8> wv[kRgUnroll][NR];
#pragma unroll
      for (int u = 0; u < kRgUnroll; ++u) {
        const int c = c0 + u * G + lane;
        if (c < chunks) {
#pragma unroll
          for (int r = 0; r < NR; ++r) wv[u][r].load_weight(rows[r] + static_cast<int64_t>(c) * 8);
        }
      }
#pragma unroll
      for (int u = 0; u < kRgUnroll; ++u) {
        const int c = c0 + u * G + lane;
        if (c < chunks) {
#pragma unroll
          for (int r = 0; r < NR; ++r) fma_chunk<T, MAXM>(wv[u][r], xs, p, c, acc[r]);
        }
      }
    }
    if constexpr (EPI == EPILOGUE_ROTARY) {
      write_rotary_rows<T, MAXM, G>(p, n, lane, mask, acc[0], acc[NR - 1]);
    } else if constexpr (EPI != PROLOGUE_NONE) {
      write_gated_rows<T, MAXM, G, EPI>(p, n, lane, mask, acc[0], acc[NR - 1]);
    } else {
      write_group_rows<T, MAXM, G>(p, n, lane, mask, acc[0]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Register-prefetch kernel (M <= 2, 16-byte aligned rows of W, K a multiple of 8): the decode case
// inside a PDL chain. Weights are constants, so every lane loads its first kPfUnroll chunks of W into
// registers BEFORE pdl_wait(): while the previous kernel (RMSNorm, attention, ...) still runs, the
// whole first round of W (~128 KB per SM, ~17 MB on an H200) is already on its way, not just hinted
// into L2. After the wait only x (or act(gate) * up) is staged, and the first round's FMAs run from
// registers. Rows beyond the first round stream as in the row-group kernel (their next batch is
// prefetched into L2 before the wait).
// ---------------------------------------------------------------------------------------------------

constexpr int kPfUnroll = 16;      // 16-byte chunks of W per lane held in registers (64 registers)
constexpr int kPfMaxThreads = 512;  // CTA of 64..512 threads; 128 registers per thread at 512
constexpr int kPfStage = 4;        // chunks of x (pairs with an activation) each thread loads at once

// One 16-byte chunk of W, issued before pdl_wait(): volatile with a memory clobber so that neither the
// compiler nor the scheduler moves it after the wait (which would defeat its purpose; it would still
// be correct, weights being constant).
template <typename T>
__device__ __forceinline__ void load_weight_early(Pack<T, 8>& pk, const T* p) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(pk.v.x), "=r"(pk.v.y), "=r"(pk.v.z), "=r"(pk.v.w)
               : "l"(p)
               : "memory");
}

// stage_x with every one of a thread's (up to kPfStage) loads of x issued before any is used: after
// pdl_wait() this is the only thing between the kernel and its FMAs, so it should cost one round trip
// to L2, not one per element. Same rounding as stage_x (act(gate) * up rounded to T).
template <typename T, int PRO>
__device__ __forceinline__ void stage_x_batched(T* xs, const GemvParams<T>& p) {
  if (!p.x_vec) {
    stage_x<T, PRO>(xs, p);  // misaligned or strided-odd x: the scalar path
    return;
  }
  const int per_row = p.k / 8;
  const int total = p.m * per_row;
  for (int base = threadIdx.x; base < total; base += kPfStage * blockDim.x) {
    uint4 a[kPfStage];
    uint4 b[kPfStage];
#pragma unroll
    for (int j = 0; j < kPfStage; ++j) {
      const int i = base + j * blockDim.x;
      if (i < total) {
        const int r = i / per_row;
        const T* src = p.x + r * p.ldx + (i - r * per_row) * 8;
        a[j] = __ldg(reinterpret_cast<const uint4*>(src));
        if (PRO != PROLOGUE_NONE) b[j] = __ldg(reinterpret_cast<const uint4*>(src + p.k));
      }
    }
#pragma unroll
    for (int j = 0; j < kPfStage; ++j) {
      const int i = base + j * blockDim.x;
      if (i < total) {
        const int r = i / per_row;
        if (PRO != PROLOGUE_NONE) apply_gate<T, PRO>(a[j], b[j]);
        *reinterpret_cast<uint4*>(xs + r * p.k_pad + (i - r * per_row) * 8) = a[j];
      }
    }
  }
}

// Grid: persistent CTAs, all resident at once (the launcher sizes it so). A team of L = G * p.wk lanes
// (G < 32: a part of a warp, p.wk = 1; G = 32: p.wk whole warps) owns one row per round over all of K;
// team lane t takes chunks t, t + L, ..., t + (kPfUnroll - 1) * L of the row per pass (one pass covers
// the row whenever the launcher could choose L so). Team j of CTA b takes rows b * teams + j, then
// + gridDim.x * teams, ... The round loop's bound is uniform over the CTA, so the barrier of the
// cross-warp reduction (p.wk > 1) is reached by every thread.
// Shared memory: x [m][k_pad] of T, then (p.wk > 1) float [2][warps][MAXM] of per-warp partial sums.
template <typename T, int PRO, int MAXM, int G>
__global__ void __launch_bounds__(kPfMaxThreads, 1) gemv_prefetch_kernel(const GemvParams<T> p) {
  static_assert(G == 8 || G == 16 || G == 32, "lane groups are 8, 16 or 32 lanes");
  static_assert(MAXM <= G, "lane m of a group writes row m");
  pdl_trigger_early<PDL_GEMV>();
  extern __shared__ __align__(16) unsigned char smem[];
  T* xs = reinterpret_cast<T*>(smem);
  float* red = reinterpret_cast<float*>(smem + ((static_cast<size_t>(p.m) * p.k_pad * sizeof(T) + 15) & ~size_t(15)));

  const int team_lanes = G * p.wk;
  const int teams = blockDim.x / team_lanes;
  const int team = threadIdx.x / team_lanes;
  const int tl = threadIdx.x - team * team_lanes;  // lane within the team
  const int lane = threadIdx.x & (G - 1);          // lane within the shuffle group
  const int warp = threadIdx.x >> 5;
  const int warps = blockDim.x >> 5;
  const int chunks = p.k >> 3;
  const int pass = team_lanes * kPfUnroll;  // chunks of a row per pass
  const int row_step = gridDim.x * teams;
  const unsigned mask = (0xffffffffu >> (32 - G)) << ((threadIdx.x & 31) & ~(G - 1));  // this group's lanes

  // Before the wait: the first pass of this team's first row into registers, and the pass after it
  // (the rest of the row, or the next row) into L2. Nothing else is read and nothing is written.
  Pack<T, 8> wv[kPfUnroll];
  const int first = blockIdx.x * teams + team;
  if (first < p.n) {
    const T* row = p.w + static_cast<int64_t>(first) * p.ldw;
#pragma unroll
    for (int u = 0; u < kPfUnroll; ++u) {
      const int c = u * team_lanes + tl;
      if (c < chunks) load_weight_early(wv[u], row + static_cast<int64_t>(c) * 8);
    }
    const int next_row = pass < chunks ? first : first + row_step;
    const int next_c0 = pass < chunks ? pass : 0;
    if (next_row < p.n) {
      const T* nrow = p.w + static_cast<int64_t>(next_row) * p.ldw;
      for (int u = 0, c = next_c0 + tl; u < kPfUnroll && c < chunks; ++u, c += team_lanes) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(nrow + static_cast<int64_t>(c) * 8));
      }
    }
  }
  pdl_wait_and_trigger<PDL_GEMV>();
  stage_x_batched<T, PRO>(xs, p);
  __syncthreads();

  bool preloaded = true;  // wv holds pass 0 of row `first` (or nothing, when first >= p.n)
  int parity = 0;
  for (int base = blockIdx.x * teams; base < p.n; base += row_step) {
    const int n = base + team;
    float acc[MAXM];
#pragma unroll
    for (int m = 0; m < MAXM; ++m) acc[m] = 0.0f;
    if (n < p.n) {  // uniform over the team
      const T* row = p.w + static_cast<int64_t>(n) * p.ldw;
      for (int c0 = 0; c0 < chunks; c0 += pass) {
        if (!preloaded) {
#pragma unroll
          for (int u = 0; u < kPfUnroll; ++u) {
            const int c = c0 + u * team_lanes + tl;
            if (c < chunks) wv[u].load_weight(row + static_cast<int64_t>(c) * 8);
          }
        }
        preloaded = false;
#pragma unroll
        for (int u = 0; u < kPfUnroll; ++u) {
          const int c = c0 + u * team_lanes + tl;
          if (c < chunks) fma_chunk<T, MAXM>(wv[u], xs, p, c, acc);
        }
      }
    }
    preloaded = false;

    if (p.wk == 1) {
      if (n < p.n) write_group_rows<T, MAXM, G>(p, n, lane, mask, acc);
    } else {
      // G == 32 here: whole warps. Each warp's partial sums go to shared memory, then one thread per
      // (row, m) adds the team's p.wk warps. Double-buffered: the buffer written here was last read two
      // rounds ago, before the previous round's barrier.
      float* buf = red + parity * (warps * MAXM);
#pragma unroll
      for (int m = 0; m < MAXM; ++m) {
        const float s = warp_sum(acc[m]);  // rows past p.n and m >= p.m sum zeros, never written
        if ((threadIdx.x & 31) == 0) buf[warp * MAXM + m] = s;
      }
      __syncthreads();
      for (int t = threadIdx.x; t < teams * MAXM; t += blockDim.x) {
        const int j = t / MAXM;
        const int m = t - j * MAXM;
        const int row = base + j;
        if (row < p.n && m < p.m) {
          float s = p.bias != nullptr ? Conv<T>::to_float(p.bias[row]) : 0.0f;
          for (int w = 0; w < p.wk; ++w) s += buf[(j * p.wk + w) * MAXM + m];
          p.out[m * p.ldo + row] = Conv<T>::from_float(s);
        }
      }
      parity ^= 1;
    }
  }
}

size_t smem_bytes(int m, int k_pad, int elem, int warps, int maxm) {
  const size_t x_bytes = (static_cast<size_t>(m) * k_pad * elem + 15) & ~size_t(15);
  return x_bytes + static_cast<size_t>(2) * warps * maxm * kRows * sizeof(float);
}

// Reserves `smem` bytes of dynamic shared memory for `kernel` and returns how many CTAs of `threads`
// threads fit per SM (at least 1), or an error code (negative per_sm never escapes).
template <typename Kernel>
int configure(Kernel kernel, int threads, size_t smem, int* per_sm) {
  cudaError_t err = cudaSuccess;
  if (smem > 48 * 1024) err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, threads, smem);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so later launches start clean
    return fail(err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction
                    ? WLLM_ERR_NO_KERNEL_IMAGE
                    : WLLM_ERR_CUDA,
                "gemv: cannot configure the kernel (%zu bytes of shared memory): %s", smem, cudaGetErrorString(err));
  }
  if (*per_sm < 1) *per_sm = 1;
  return WLLM_OK;
}

// Row-group kernel: chooses the CTA size, sizes a persistent grid that gives every CTA the same number
// of rows, launches.
template <typename T, int PRO, int MAXM, int G, int EPI>
int launch_row_group(GemvParams<T> p, const DeviceProps& dev, cudaStream_t stream) {
  auto kernel = gemv_row_group_kernel<T, PRO, MAXM, G, EPI>;
  const size_t smem = static_cast<size_t>(p.m) * p.k_pad * sizeof(T);
  // 512-thread CTAs when few CTAs fit per SM (x fills shared memory, or the activation caps residency
  // below) so that each SM still has ~32 warps of loads in flight; else 256. Halved while the rows would
  // not give every SM one 512-thread CTA / two smaller ones: small matrices then spread over all SMs
  // instead of filling a few. A gated output streams two rows of W per group.
  const int64_t w_rows = static_cast<int64_t>(p.n) * (EPI != PROLOGUE_NONE ? 2 : 1);
  int threads = (PRO != PROLOGUE_NONE || smem > 64 * 1024) ? kRgMaxThreads : 256;
  while (threads > 128 &&
         w_rows * G < static_cast<int64_t>(dev.sms) * threads * (threads == kRgMaxThreads ? 1 : 2)) {
    threads /= 2;
  }
  int per_sm = 0;
  const int status = configure(kernel, threads, smem, &per_sm);
  if (status != WLLM_OK) return status;
  // Each resident CTA recomputes act(gate) * up for all of K (two special-function ops per element,
  // 16 per clock per SM): fewer, longer-lived CTAs keep that redundant work small.
  if (PRO != PROLOGUE_NONE && per_sm > 2) per_sm = 2;
  const int rows_per_cta = threads / G;
  const int64_t blocks = (p.n + rows_per_cta - 1) / rows_per_cta;
  const int64_t resident = static_cast<int64_t>(dev.sms) * per_sm;
  // As many rounds as the resident CTAs need, then as few CTAs as cover the rows in that many rounds:
  // every group gets the same number of rows (no CTA runs a lone extra round) and x is staged fewer times.
  const int64_t rounds = (blocks + resident - 1) / resident;
  const int grid = static_cast<int>((blocks + rounds - 1) / rounds);
  launch_pdl(kernel, dim3(grid), dim3(threads), smem, stream, p);
  return check_launch("gemv");
}

template <typename T, int PRO, int MAXM, int EPI = PROLOGUE_NONE>
int launch_row_group_lanes(GemvParams<T> p, int lanes, const DeviceProps& dev, cudaStream_t stream) {
  if (lanes == 32) return launch_row_group<T, PRO, MAXM, 32, EPI>(p, dev, stream);
  if (lanes == 16) return launch_row_group<T, PRO, MAXM, 16, EPI>(p, dev, stream);
  return launch_row_group<T, PRO, MAXM, 8, EPI>(p, dev, stream);
}

// Register-prefetch kernel: picks the team (lanes per row) so that one pass of kPfUnroll loads per lane
// covers a whole row where it can, the CTA size so that every SM gets work, and a grid that is entirely
// resident (a CTA that is not resident cannot load anything before the wait).
template <typename T, int PRO, int MAXM, int G>
int launch_prefetch(GemvParams<T> p, int wk, const DeviceProps& dev, cudaStream_t stream) {
  auto kernel = gemv_prefetch_kernel<T, PRO, MAXM, G>;
  p.wk = wk;
  const int team_lanes = G * wk;
  const auto blocks_for = [&](int threads) {
    const int teams = threads / team_lanes;
    return (static_cast<int64_t>(p.n) + teams - 1) / teams;
  };
  // With an activation every CTA recomputes act(gate) * up over all of K (two special-function ops per
  // element, 16 per clock per SM: ~1 us for K = 14336 at two CTAs per SM), so one 512-thread CTA per SM,
  // halved only while that still leaves at most one CTA per SM. Without one, staging x is a plain copy:
  // 256 threads, halved while the rows would leave SMs idle (small matrices spread over all SMs).
  int threads = PRO != PROLOGUE_NONE ? kPfMaxThreads : 256;
  const int min_threads = team_lanes > 64 ? team_lanes : 64;
  while (threads > min_threads &&
         (PRO != PROLOGUE_NONE ? blocks_for(threads / 2) <= dev.sms : blocks_for(threads) < dev.sms)) {
    threads /= 2;
  }
  const size_t x_bytes = (static_cast<size_t>(p.m) * p.k_pad * sizeof(T) + 15) & ~size_t(15);
  const size_t smem = x_bytes + (wk > 1 ? static_cast<size_t>(2) * (threads / 32) * MAXM * sizeof(float) : 0);
  int per_sm = 0;
  const int status = configure(kernel, threads, smem, &per_sm);
  if (status != WLLM_OK) return status;
  if (PRO != PROLOGUE_NONE && threads == kPfMaxThreads && per_sm > 1) per_sm = 1;
  const int64_t blocks = blocks_for(threads);
  const int64_t resident = static_cast<int64_t>(dev.sms) * per_sm;
  // Every resident slot gets a CTA (unlike the row-group kernel's equal rounds): what is loaded before
  // the wait is one row per team, so more teams hide more of W. Qwen2.5-0.5B's gate_up (9728 rows of
  // 8-lane teams): 8448 rows in registers, the other 1280 streamed from L2 by 40 CTAs, instead of
  // half the rows in registers with equal rounds of 152 CTAs.
  const int grid = static_cast<int>(blocks < resident ? blocks : resident);
  launch_pdl(kernel, dim3(grid), dim3(threads), smem, stream, p);
  return check_launch("gemv");
}

// Lanes per row for the register-prefetch kernel: the fewest (8, 16, 32, then 2..8 whole warps) whose
// kPfUnroll loads each cover the row in one pass, so that the registers loaded before the wait hold
// whole rows (K = 896: 8 lanes x 14 chunks; 4096: one warp x 16; 4864: two warps x 9.5; 14336: four
// warps x 14).
template <typename T, int PRO, int MAXM>
int launch_prefetch_lanes(GemvParams<T> p, const DeviceProps& dev, cudaStream_t stream) {
  const int chunks = p.k / 8;
  if (chunks <= 8 * kPfUnroll) return launch_prefetch<T, PRO, MAXM, 8>(p, 1, dev, stream);
  if (chunks <= 16 * kPfUnroll) return launch_prefetch<T, PRO, MAXM, 16>(p, 1, dev, stream);
  int wk = 1;
  while (wk < 8 && 32 * wk * kPfUnroll < chunks) wk *= 2;
  return launch_prefetch<T, PRO, MAXM, 32>(p, wk, dev, stream);
}

// ---------------------------------------------------------------------------------------------------
// Tensor-core kernel: one CTA per 16 rows of W (the m16 of mma.m16n8k16), its 8 warps taking interleaved
// 32-wide slabs of K (warp w: slabs w, w + 8, ...; together they stream 512 contiguous bytes of each row)
// and reducing through shared memory at the end. Rows of x are the n8 operand: up to 8 (NB = 1) or 16
// (NB = 2) per launch. The K order inside a slab is permuted so both operands come straight from 16-byte
// loads: lane (g, t) loads elements 8t..8t+7 of W rows g and g+8 and of x row g; for the first mma those
// elements' pairs 0-1 / 2-3 play logical columns 2t, 2t+1 / 2t+8, 2t+9, pairs 4-5 / 6-7 the same in the
// second. A dot product does not depend on the order of its terms, and A and B use the same order.
constexpr int kMmaWarps = 8;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaUnroll = 4;  // slabs per warp in flight: 4 x 2 x 16 bytes of W per lane

template <typename T, int NB>
__global__ void __launch_bounds__(kMmaThreads, 2) gemv_mma_kernel(const GemvParams<T> p) {
  pdl_trigger_early<PDL_GEMV>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ float red[kMmaWarps][NB][32][4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int last = p.n - 1;  // rows past n are computed from row n - 1 and never written
  const T* wa = p.w + static_cast<int64_t>(min(row0 + g, last)) * p.ldw + 8 * t;
  const T* wb = p.w + static_cast<int64_t>(min(row0 + g + 8, last)) * p.ldw + 8 * t;
  const int slabs = p.k >> 5;
  constexpr int kStride = kMmaWarps * kMmaUnroll;  // slabs between one warp's consecutive groups
  Pack<T, 8> a[kMmaUnroll], b[kMmaUnroll];
  // The first group of W before the wait: no kernel of the chain writes weights.
#pragma unroll
  for (int u = 0; u < kMmaUnroll; ++u) {
    const int s = warp + u * kMmaWarps;
    if (s < slabs) {
      a[u].load_weight(wa + s * 32);
      b[u].load_weight(wb + s * 32);
    }
  }
  pdl_wait_and_trigger<PDL_GEMV>();
  const T* xr[NB];
  bool xok[NB];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int n = nb * 8 + g;
    xok[nb] = n < p.m;
    xr[nb] = p.x + static_cast<int64_t>(xok[nb] ? n : 0) * p.ldx + 8 * t;
  }
  float acc[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
  for (int s0 = warp; s0 < slabs; s0 += kStride) {
    Pack<T, 8> ca[kMmaUnroll], cb[kMmaUnroll];
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      ca[u] = a[u];
      cb[u] = b[u];
    }
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {  // the next group's W, in flight while this one computes
      const int s = s0 + kStride + u * kMmaWarps;
      if (s < slabs) {
        a[u].load_weight(wa + s * 32);
        b[u].load_weight(wb + s * 32);
      }
    }
    uint4 xv[kMmaUnroll][NB];  // this group's x, all loads issued before the first mma
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int s = s0 + u * kMmaWarps;
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        xv[u][nb] = make_uint4(0u, 0u, 0u, 0u);
        if (s < slabs && xok[nb]) xv[u][nb] = __ldg(reinterpret_cast<const uint4*>(xr[nb] + s * 32));
      }
    }
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      if (s0 + u * kMmaWarps >= slabs) break;  // warp-uniform: all lanes run the same mma sequence
      const uint32_t lo[4] = {ca[u].v.x, cb[u].v.x, ca[u].v.y, cb[u].v.y};
      const uint32_t hi[4] = {ca[u].v.z, cb[u].v.z, ca[u].v.w, cb[u].v.w};
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        prefill::Mma<T>::run(acc[nb], lo, xv[u][nb].x, xv[u][nb].y);
        prefill::Mma<T>::run(acc[nb], hi, xv[u][nb].z, xv[u][nb].w);
      }
    }
  }
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int e = 0; e < 4; ++e) red[warp][nb][lane][e] = acc[nb][e];
  }
  __syncthreads();
  // Thread i: row r = i % 16 of the tile, x row n = i / 16. In the accumulators, (row g (+8), x rows
  // 2t, 2t + 1) of n-block nb sit in lane 4g + t, elements 0, 1 (2, 3 for row g + 8).
  const int i = threadIdx.x;
  if (i < 16 * 8 * NB) {
    const int r = i & 15, n = i >> 4;
    const int nn = n & 7;
    const int src_lane = (r & 7) * 4 + (nn >> 1), e = (r >> 3) * 2 + (nn & 1);
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) sum += red[w][n >> 3][src_lane][e];
    const int row = row0 + r;
    if (row < p.n && n < p.m) {
      if (p.bias != nullptr) sum += Conv<T>::to_float(p.bias[row]);
      p.out[static_cast<int64_t>(n) * p.ldo + row] = Conv<T>::from_float(sum);
    }
  }
#endif
}

// Tensor-core kernel: up to 16 rows of a plain x; the caller checked SM 8.0+, alignment and K % 32.
template <typename T>
int launch_mma(const GemvParams<T>& p, cudaStream_t stream) {
  const dim3 grid((p.n + 15) / 16);
  if (p.m <= 8) {
    launch_pdl(gemv_mma_kernel<T, 1>, grid, dim3(kMmaThreads), 0, stream, p);
  } else {
    launch_pdl(gemv_mma_kernel<T, 2>, grid, dim3(kMmaThreads), 0, stream, p);
  }
  return check_launch("gemv");
}

// Split-K kernel: chooses warps per task and CTA size, reserves shared memory, sizes the persistent grid, launches.
template <typename T, int PRO, int MAXM, int VEC>
int launch(GemvParams<T> p, const DeviceProps& dev, cudaStream_t stream) {
  auto kernel = gemv_kernel<T, PRO, MAXM, VEC>;
  const int chunks = p.k / VEC;
  const int64_t target_warps = static_cast<int64_t>(dev.sms) * 16;
  // Split K over more warps while every lane keeps >= 1 chunk, and either the rows alone cannot fill
  // the GPU or a single warp's share of K would take more than two rounds of loads.
  int wk = 1;
  while (wk < kMaxWarps && chunks >= 64 * wk &&
         (static_cast<int64_t>(p.tasks) * wk < target_warps || chunks > 32 * wk * kUnroll * 2)) {
    wk *= 2;
  }
  // Small problems: 4-warp CTAs spread the same warps over twice as many SMs.
  const int warps = (wk <= 4 && static_cast<int64_t>(p.tasks) * wk < static_cast<int64_t>(dev.sms) * 8) ? 4 : 8;
  p.wk = wk;
  const int groups = warps / wk;
  const size_t smem = smem_bytes(p.m, p.k_pad, sizeof(T), warps, MAXM);
  int per_sm = 0;
  const int status = configure(kernel, warps * 32, smem, &per_sm);
  if (status != WLLM_OK) return status;
  // Each resident CTA recomputes act(gate) * up for all of K (two special-function ops per element,
  // 16 per clock per SM): fewer, longer-lived CTAs keep that redundant work small.
  if (PRO != PROLOGUE_NONE && per_sm > 2) per_sm = 2;
  const int64_t needed = (p.tasks + groups - 1) / groups;
  const int64_t resident = static_cast<int64_t>(dev.sms) * per_sm;
  const int grid = static_cast<int>(needed < resident ? needed : resident);
  launch_pdl(kernel, dim3(grid), dim3(warps * 32), smem, stream, p);
  return check_launch("gemv");
}

// Lanes per row of the row-group kernel: each lane should still issue several 16-byte loads per row
// (K = 896: 16 lanes, 7 loads each), and long rows use whole warps (fewer, longer streams; fewer
// shuffles per byte). A forced row-group variant names the lanes.
inline int row_group_lanes(int k, int variant) {
  if (variant == VARIANT_ROW_GROUP_32) return 32;
  if (variant == VARIANT_ROW_GROUP_16) return 16;
  if (variant == VARIANT_ROW_GROUP_8) return 8;
  return k >= 2048 ? 32 : (k >= 512 ? 16 : 8);
}

// Gated output (the gated MLP's gate_up projection writing act(gate) * up) or the rotary epilogue: the
// row-group kernel, 1-2 rows of x per launch (run_gemv passes at most 2), 16-byte aligned W rows and K a
// multiple of 8.
template <typename T, int EPI>
int launch_gated(GemvParams<T> p, int variant, const DeviceProps& dev, cudaStream_t stream) {
  const int lanes = row_group_lanes(p.k, variant);
  if (p.m <= 1) return launch_row_group_lanes<T, PROLOGUE_NONE, 1, EPI>(p, lanes, dev, stream);
  return launch_row_group_lanes<T, PROLOGUE_NONE, 2, EPI>(p, lanes, dev, stream);
}

// The tensor-core kernel can take these rows: a plain x (no activation on it), 16-byte vectors of W and x,
// K a multiple of 32, SM 8.0+ (its body is compiled for SM 8.0+ only, so the device check is what keeps
// older GPUs on the other kernels). launch_rows sends 3-16 such rows to it; run_gemv plans its passes of
// rows by the same rule.
inline bool mma_applies(int prologue, bool vec, bool x_vec, int64_t k, const DeviceProps& dev) {
  return prologue == PROLOGUE_NONE && vec && x_vec && k % 32 == 0 && dev.major >= 8;
}

template <typename T, int PRO>
int launch_rows(GemvParams<T> p, bool vec, int variant, const DeviceProps& dev, cudaStream_t stream) {
  // Automatic: the register-prefetch kernel where it measured fastest behind the kernel that writes x
  // (H200, benchmarks/kernels_gemv.py, PDL chain): one row, and either the activation fused in with K up
  // to 8K (Qwen2.5-0.5B's down projection: 4.35 us vs 6.3 for the row-group kernel) or K >= 2048 with W up
  // to 64 MB (Llama-3.1-8B's qkv and o: 15.1 / 12.0 us vs 15.2 / 12.4). Elsewhere (small K without the
  // activation, the 235 MB gate_up, two rows) the row-group or split-K kernel was as fast or faster.
  const int64_t w_bytes = static_cast<int64_t>(p.n) * p.k * static_cast<int64_t>(sizeof(T));
  const bool prefetch_wins = p.m <= 1 && ((PRO != PROLOGUE_NONE && p.k <= 8192) ||
                                          (PRO == PROLOGUE_NONE && p.k >= 2048 && w_bytes <= (int64_t(64) << 20)));
  // Long rows of a plain x (K >= 8192: Llama-3.1-8B's down projection once gate_up applies the activation)
  // measured fastest on the split-K kernel behind the kernel that writes x: 28.5 us vs 30.5-30.9 (M = 1),
  // 33.6 vs 37.6-40.5 (M = 2).
  // 3..16 rows of a plain x (or the forced variant): the tensor-core kernel, where it can run.
  const bool mma_fits = mma_applies(PRO, vec, p.x_vec != 0, p.k, dev) && p.m <= 16;
  if (mma_fits && (variant == VARIANT_MMA || (variant == VARIANT_AUTO && p.m >= 3))) return launch_mma(p, stream);
  if (variant == VARIANT_AUTO && PRO == PROLOGUE_NONE && p.m <= 2 && p.k >= 8192) {
    if (p.m <= 1) return launch<T, PRO, 1, 8>(p, dev, stream);
    return launch<T, PRO, 2, 8>(p, dev, stream);
  }
  if (vec && p.m <= 2 && (variant == VARIANT_REG_PREFETCH || (variant == VARIANT_AUTO && prefetch_wins))) {
    if (p.m <= 1) return launch_prefetch_lanes<T, PRO, 1>(p, dev, stream);
    return launch_prefetch_lanes<T, PRO, 2>(p, dev, stream);
  }
  if (vec && p.m <= 4 && variant != VARIANT_SPLIT_K) {
    const int lanes = row_group_lanes(p.k, variant);
    if (p.m <= 1) return launch_row_group_lanes<T, PRO, 1>(p, lanes, dev, stream);
    if (p.m <= 2) return launch_row_group_lanes<T, PRO, 2>(p, lanes, dev, stream);
    return launch_row_group_lanes<T, PRO, 4>(p, lanes, dev, stream);
  }
  if (!vec) return launch<T, PRO, 16, 1>(p, dev, stream);
  if (p.m <= 1) return launch<T, PRO, 1, 8>(p, dev, stream);
  if (p.m <= 2) return launch<T, PRO, 2, 8>(p, dev, stream);
  if (p.m <= 4) return launch<T, PRO, 4, 8>(p, dev, stream);
  if (p.m <= 8) return launch<T, PRO, 8, 8>(p, dev, stream);
  return launch<T, PRO, 16, 8>(p, dev, stream);
}

template <typename T>
int run_gemv(T* out, const T* x, const T* w, const T* bias, int64_t m, int64_t n, int64_t k, int64_t ldo,
             int64_t ldx, int64_t ldw, int prologue, int epilogue, int variant, cudaStream_t stream,
             const RopeOut<T>* rope = nullptr) {
  DeviceProps dev;
  int status = current_device_props(&dev);
  if (status != WLLM_OK) return status;
  const bool vec = k % 8 == 0 && ldw % 8 == 0 && (reinterpret_cast<uintptr_t>(w) & 15u) == 0;
  const bool x_vec = k % 8 == 0 && ldx % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  const int k_pad = static_cast<int>((k + 7) / 8 * 8);
  // Rows of x that fit in shared memory at once; more rows than that take several passes over W.
  int64_t per_pass = 16;
  while (per_pass > 0 && smem_bytes(static_cast<int>(per_pass), k_pad, sizeof(T), kMaxWarps, 16) >
                             static_cast<size_t>(dev.max_smem)) {
    per_pass /= 2;
  }
  if (per_pass == 0) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "gemv: in_features=%lld needs %zu bytes of shared memory for one row of x; this GPU allows %d",
                (long long)k, smem_bytes(1, k_pad, sizeof(T), kMaxWarps, 1), dev.max_smem);
  }
  // The tensor-core kernel reads x straight from global memory: where it takes the passes (launch_rows'
  // rule), they are 16 rows whatever K is, and only a remainder of 1-2 rows that another kernel takes
  // keeps the shared-memory limit (Llama's down projection, K = 14,336: one pass instead of four).
  const int64_t smem_pass = per_pass;
  const bool mma_passes = mma_applies(prologue, vec, x_vec, k, dev) && epilogue == PROLOGUE_NONE &&
                          (variant == VARIANT_MMA || variant == VARIANT_AUTO) && m >= 3;
  if (mma_passes) per_pass = 16;
  // Gated output: W is [gate rows | up rows]; out gets n / 2 columns. Rotary: n / 2 row pairs. Both take
  // 1-2 rows of x per pass.
  const int64_t out_n = epilogue != PROLOGUE_NONE ? n / 2 : n;
  if (epilogue != PROLOGUE_NONE) {
    if (!vec || n % 2 != 0) {
      return fail(WLLM_ERR_INVALID_ARGUMENT,
                  "gemv: a gated or rotary output needs an even out_features (%lld), in_features (%lld) and the "
                  "weight row stride (%lld) multiples of 8 and a 16-byte aligned weight",
                  (long long)n, (long long)k, (long long)ldw);
    }
    if (per_pass > 2) per_pass = 2;
  }
  for (int64_t m0 = 0, rows = 0; m0 < m; m0 += rows) {
    GemvParams<T> p;
    p.out = out + m0 * ldo;
    p.x = x + m0 * ldx;
    p.w = w;
    p.bias = bias;
    p.m = static_cast<int>(m - m0 < per_pass ? m - m0 : per_pass);
    if (mma_passes && variant != VARIANT_MMA && p.m < 3 && p.m > smem_pass) p.m = static_cast<int>(smem_pass);
    rows = p.m;
    p.n = static_cast<int>(out_n);
    p.k = static_cast<int>(k);
    p.k_pad = k_pad;
    p.up_offset = epilogue != PROLOGUE_NONE ? out_n * ldw : 0;
    p.ldo = ldo;
    p.ldx = ldx;
    p.ldw = ldw;
    p.wk = 1;
    p.tasks = static_cast<int>((n + kRows - 1) / kRows);
    p.x_vec = x_vec ? 1 : 0;
    if (rope != nullptr) {
      p.rope = *rope;
      p.rope.positions = rope->positions + m0;
      p.rope.slots = rope->slots + m0;
    }
    if (epilogue == EPILOGUE_ROTARY) {
      status = launch_gated<T, EPILOGUE_ROTARY>(p, variant, dev, stream);
    } else if (epilogue == PROLOGUE_SILU_AND_MUL) {
      status = launch_gated<T, PROLOGUE_SILU_AND_MUL>(p, variant, dev, stream);
    } else if (epilogue == PROLOGUE_GELU_TANH_AND_MUL) {
      status = launch_gated<T, PROLOGUE_GELU_TANH_AND_MUL>(p, variant, dev, stream);
    } else switch (prologue) {
      case PROLOGUE_NONE:
        status = launch_rows<T, PROLOGUE_NONE>(p, vec, variant, dev, stream);
        break;
      case PROLOGUE_SILU_AND_MUL:
        status = launch_rows<T, PROLOGUE_SILU_AND_MUL>(p, vec, variant, dev, stream);
        break;
      default:
        status = launch_rows<T, PROLOGUE_GELU_TANH_AND_MUL>(p, vec, variant, dev, stream);
        break;
    }
    if (status != WLLM_OK) return status;
  }
  return WLLM_OK;
}

}  // namespace
WLLM_TRACE_TU(gemv)
}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_gemv)(void* out, const void* x, const void* weight, const void* bias, int64_t rows,
                                int64_t out_features, int64_t in_features, int64_t out_row_stride,
                                int64_t x_row_stride, int64_t weight_row_stride, int prologue, int dtype,
                                void* stream) {
  using namespace WLLM_NS;
  if (rows < 0 || out_features <= 0 || in_features <= 0 || out_features > 0x7ffffffeLL ||
      in_features > 0x3fffffffLL || rows > 0x7fffffffLL) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "gemv: bad shape rows=%lld out_features=%lld in_features=%lld",
                (long long)rows, (long long)out_features, (long long)in_features);
  }
  // Bits 0..7: the activation on x; bits 8..15: the kernel variant (0 = automatic); bits 16..23: the
  // activation of a gated output.
  const int variant = (prologue >> 8) & 0xff;
  const int epilogue = (prologue >> 16) & 0xff;
  const int flags = prologue;
  prologue &= 0xff;
  if (flags < 0 || (flags >> 24) != 0 || prologue > PROLOGUE_GELU_TANH_AND_MUL || variant > VARIANT_LAST ||
      epilogue > PROLOGUE_GELU_TANH_AND_MUL || (prologue != PROLOGUE_NONE && epilogue != PROLOGUE_NONE)) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "gemv: unknown prologue %d (bits 0-7: 0 = none, 1 = silu_and_mul, 2 = gelu_tanh_and_mul; bits "
                "8-15: kernel variant 0..%d; bits 16-23: gated output, same codes, only without bits 0-7)",
                flags, (int)VARIANT_LAST);
  }
  const int64_t x_width = prologue == PROLOGUE_NONE ? in_features : 2 * in_features;
  const int64_t out_width = epilogue == PROLOGUE_NONE ? out_features : out_features / 2;
  if (weight_row_stride < in_features || (rows > 1 && (x_row_stride < x_width || out_row_stride < out_width))) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "gemv: row strides (out %lld, x %lld, weight %lld) shorter than the rows (out %lld, x %lld, weight "
                "%lld)",
                (long long)out_row_stride, (long long)x_row_stride, (long long)weight_row_stride,
                (long long)out_width, (long long)x_width, (long long)in_features);
  }
  if (dtype != WLLM_FLOAT16 && dtype != WLLM_BFLOAT16) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "gemv: dtype code %d unsupported (fp16 = 1, bf16 = 2 only)", dtype);
  }
  if (rows == 0) return WLLM_OK;
  if (out == nullptr || x == nullptr || weight == nullptr) return fail(WLLM_ERR_INVALID_ARGUMENT, "gemv: null pointer");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == WLLM_FLOAT16) {
    return run_gemv<__half>(static_cast<__half*>(out), static_cast<const __half*>(x), static_cast<const __half*>(weight),
                            static_cast<const __half*>(bias), rows, out_features, in_features, out_row_stride,
                            x_row_stride, weight_row_stride, prologue, epilogue, variant, s);
  }
  return run_gemv<__nv_bfloat16>(static_cast<__nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(x),
                                 static_cast<const __nv_bfloat16*>(weight), static_cast<const __nv_bfloat16*>(bias),
                                 rows, out_features, in_features, out_row_stride, x_row_stride, weight_row_stride,
                                 prologue, epilogue, variant, s);
}

WLLM_API int WLLM_FN(wllm_gemv_rotary_cache)(void* q_out, const void* x, const void* weight, const void* bias,
                                             int64_t rows, int64_t in_features, int64_t q_row_stride,
                                             int64_t x_row_stride, int64_t weight_row_stride, const int64_t* positions,
                                             const int64_t* slots, const float* cos_sin, int64_t max_position,
                                             int rot_dim, void* key_cache, void* value_cache, int64_t num_blocks,
                                             int block_size, int num_heads, int num_kv_heads, int head_size,
                                             int64_t cache_block_stride, int64_t cache_token_stride,
                                             int64_t cache_head_stride, int is_neox, int dtype, void* stream) {
  using namespace WLLM_NS;
  const int64_t heads = static_cast<int64_t>(num_heads) + 2 * static_cast<int64_t>(num_kv_heads);
  if (rows < 0 || in_features <= 0 || in_features > 0x3fffffffLL || num_heads <= 0 || num_kv_heads <= 0 ||
      head_size <= 0 || head_size % 2 != 0 || rot_dim < 0 || rot_dim % 2 != 0 || rot_dim > head_size ||
      heads * head_size > 0x7ffffffeLL || block_size <= 0 || num_blocks <= 0 || max_position <= 0) {
    return fail(WLLM_ERR_INVALID_ARGUMENT,
                "gemv_rotary_cache: bad sizes (rows=%lld in_features=%lld heads %d/%d head_size=%d rot_dim=%d "
                "block_size=%d num_blocks=%lld max_position=%lld)",
                (long long)rows, (long long)in_features, num_heads, num_kv_heads, head_size, rot_dim, block_size,
                (long long)num_blocks, (long long)max_position);
  }
  if (weight_row_stride < in_features || (rows > 1 && (x_row_stride < in_features ||
                                                      q_row_stride < static_cast<int64_t>(num_heads) * head_size))) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "gemv_rotary_cache: row strides shorter than the rows");
  }
  if (dtype != WLLM_FLOAT16 && dtype != WLLM_BFLOAT16) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "gemv_rotary_cache: dtype code %d unsupported (fp16 = 1, bf16 = 2 only)",
                dtype);
  }
  if (rows == 0) return WLLM_OK;
  if (q_out == nullptr || x == nullptr || weight == nullptr || positions == nullptr || slots == nullptr ||
      key_cache == nullptr || value_cache == nullptr || (rot_dim > 0 && cos_sin == nullptr)) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "gemv_rotary_cache: null pointer");
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t n = heads * head_size;
  if (dtype == WLLM_FLOAT16) {
    RopeOut<__half> r{positions, slots, cos_sin, static_cast<__half*>(key_cache), static_cast<__half*>(value_cache),
                      num_heads, num_kv_heads, head_size, rot_dim, is_neox ? 1 : 0, block_size,
                      num_blocks * block_size, max_position, cache_block_stride, cache_token_stride,
                      cache_head_stride};
    return run_gemv<__half>(static_cast<__half*>(q_out), static_cast<const __half*>(x),
                            static_cast<const __half*>(weight), static_cast<const __half*>(bias), rows, n, in_features,
                            q_row_stride, x_row_stride, weight_row_stride, PROLOGUE_NONE, EPILOGUE_ROTARY,
                            VARIANT_AUTO, s, &r);
  }
  RopeOut<__nv_bfloat16> r{positions, slots, cos_sin, static_cast<__nv_bfloat16*>(key_cache),
                           static_cast<__nv_bfloat16*>(value_cache), num_heads, num_kv_heads, head_size, rot_dim,
                           is_neox ? 1 : 0, block_size, num_blocks * block_size, max_position, cache_block_stride,
                           cache_token_stride, cache_head_stride};
  return run_gemv<__nv_bfloat16>(static_cast<__nv_bfloat16*>(q_out), static_cast<const __nv_bfloat16*>(x),
                                 static_cast<const __nv_bfloat16*>(weight), static_cast<const __nv_bfloat16*>(bias),
                                 rows, n, in_features, q_row_stride, x_row_stride, weight_row_stride, PROLOGUE_NONE,
                                 EPILOGUE_ROTARY, VARIANT_AUTO, s, &r);
}
