// Paged prefill attention: variable-length query chunks over a paged KV cache, causal with the
// queries aligned at the end of each sequence, GQA, optional sliding window and logit soft-cap.
//
// Work split (both kernels): one CTA per (query tile, query head). Query tiles of all sequences
// are numbered without a host-side max length: sequence s owns tile indices starting at
// query_start_loc[s] / BM + s, which leaves room for its ceil(q_len / BM) tiles, so the grid is
// (num_tokens / BM + num_seqs) tiles x num_heads CTAs and a CTA finds its sequence by binary
// search (attention_prefill_tile.cuh). Tiles are walked in reverse so the long (late, causally
// heavier) ones start first.
//
// SM 8.0+, fp16/bf16: FlashAttention-2-style kernel on tensor cores (mma.sync m16n8k16, fp32
// accumulators, online softmax in registers), K and V tiles gathered through the block table
// with cp.async so the V load overlaps Q.K^T and the next K load overlaps P.V.
// SM 9.0, fp16/bf16, head sizes 64 and 128: the same algorithm on warpgroup MMAs
// (attention_prefill_sm90.cuh); wllm_set_prefill_sm90(0) is the tests' hook to run the mma.sync kernel there.
// SM 7.x (and fp32 everywhere): a SIMT kernel with the same semantics, fp32 throughout.
#include <math.h>
#include <stdint.h>

#include <atomic>
#include <type_traits>

#include "attention_prefill_mma.cuh"
#include "attention_prefill_simt.cuh"
#include "attention_prefill_sm90.cuh"
#include "attention_prefill_tile.cuh"
#include "common.cuh"

namespace WLLM_NS {
namespace prefill {

// ---------------------------------------------------------------------------------------------
// Tensor-core kernel (SM 8.0+, fp16/bf16)
// ---------------------------------------------------------------------------------------------

constexpr int kFlashThreads = 128;  // 4 warps; warp w owns rows [16*MT*w, 16*MT*(w+1)) of the tile

// MT: m16 row tiles per warp (reuses each K/V fragment MT times); BN: keys per K/V tile.
// Chosen so accumulators fit in registers and shared memory fits 99 KB parts (SM 8.6/8.9/12.0).
template <int D>
struct FlashShape {
  static constexpr int MT = 2, BN = 64;
};
template <>
struct FlashShape<256> {
  static constexpr int MT = 1, BN = 32;
};

template <typename T, int D>
constexpr size_t flash_smem_bytes() {
  return (size_t)(64 * FlashShape<D>::MT + 2 * FlashShape<D>::BN) * (D + 8) * sizeof(T);
}

template <typename T, int D>
__global__ void __launch_bounds__(kFlashThreads) flash_prefill_kernel(const Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int MT = FlashShape<D>::MT;
  constexpr int BN = FlashShape<D>::BN;
  constexpr int BM = 16 * MT * (kFlashThreads / 32);
  // Rows padded by 16 bytes: the 8 row addresses of one ldmatrix phase land in distinct banks.
  constexpr int S = D + 8;
  constexpr int CH = D / 8;   // 16-byte chunks per row
  constexpr int NB = BN / 8;  // n8 score blocks per row group
  constexpr int ND = D / 8;   // n8 output blocks
  static_assert(D % 16 == 0 && BN % 16 == 0, "tile shapes must be multiples of 16");
  extern __shared__ uint4 flash_smem[];
  T* sQ = reinterpret_cast<T*>(flash_smem);
  T* sK = sQ + BM * S;
  T* sV = sK + BN * S;

  Tile t;
  if (!locate_tile(p, BM, t)) return;
  const int head = t.head;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int wrow = warp * 16 * MT;
  const T* q = static_cast<const T*>(p.q);
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  const int32_t* table = p.block_tables + (int64_t)t.seq * p.bt_stride;
  const int64_t head_off = (int64_t)(head / p.group) * p.kv_head;
  const int block_mask = (1 << p.block_shift) - 1;
  const int ctx = t.ctx;

  for (int c = tid; c < BM * CH; c += kFlashThreads) {
    const int row = c / CH, col = (c - row * CH) * 8;
    const bool ok = t.m0 + row < t.q_len;
    const T* src = ok ? q + (int64_t)(t.q_begin + t.m0 + row) * p.q_tok + (int64_t)head * p.q_head + col : q;
    cp_async_16(sQ + row * S + col, src, ok ? 16 : 0);
  }
  // Keys n0.. of one cache into dst; rows past the context are zero-filled so that 0 * garbage
  // (possibly NaN) never reaches the accumulators.
  auto load_kv = [&](T* dst, const T* cache, int n0) {
    for (int c = tid; c < BN * CH; c += kFlashThreads) {
      const int row = c / CH, col = (c - row * CH) * 8;
      const int key = n0 + row;
      const bool ok = key < ctx;
      const T* src = cache;
      if (ok) {
        src = cache + (int64_t)table[key >> p.block_shift] * p.kv_block + (int64_t)(key & block_mask) * p.kv_tok +
              head_off + col;
      }
      cp_async_16(dst + row * S + col, src, ok ? 16 : 0);
    }
  };

  const KeyRange kr = key_range(t, BM, p.window, BN);
  const bool capped = p.softcap > 0.0f;
  // Scores go to the log2 domain so that exp2f does the softmax.
  const float kLog2e = 1.4426950408889634f;
  const float pre = capped ? p.scale / p.softcap : p.scale * kLog2e;
  const float post = capped ? p.softcap * kLog2e : 1.0f;

  float o[MT][ND][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int nd = 0; nd < ND; ++nd) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.0f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  if (kr.n_tiles > 0) load_kv(sK, kc, kr.first_n0);
  cp_async_commit();

  for (int it = 0; it < kr.n_tiles; ++it) {
    const int n0 = kr.first_n0 + it * BN;
    cp_async_wait_all();
    __syncthreads();  // K (and Q) landed; every warp is done with the previous V
    load_kv(sV, vc, n0);
    cp_async_commit();

    // S = Q K^T for this warp's rows: A fragments from Q rows, B fragments from K rows.
    float s[MT][NB][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) s[mt][nb][0] = s[mt][nb][1] = s[mt][nb][2] = s[mt][nb][3] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ldmatrix_x4(a[mt], sQ + (wrow + mt * 16 + (lane & 15)) * S + kk * 16 + (lane >> 4) * 8);
      }
#pragma unroll
      for (int nb2 = 0; nb2 < BN / 16; ++nb2) {
        uint32_t b[4];  // b[0..1]: keys nb2*16+0..7, b[2..3]: keys nb2*16+8..15
        ldmatrix_x4(b, sK + (nb2 * 16 + (lane & 7) + ((lane >> 4) << 3)) * S + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::run(s[mt][2 * nb2], a[mt], b[0], b[1]);
          Mma<T>::run(s[mt][2 * nb2 + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // Scores stay unscaled (soft-capped ones are already in the log2 domain) and the scale is folded
    // into the exponent, exp2(s * mul - m * mul): one FFMA and one MUFU.EX2 per score, where scaling
    // first and a full-range exp2f cost measurably more. The max of unscaled scores is the
    // max of scaled ones because mul > 0 (the API requires scale > 0).
    const float mul = capped ? 1.0f : pre;
    if (capped) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nb][e] = tanhf(s[mt][nb][e] * pre) * post;
        }
      }
    }
    // Online softmax. Thread holds rows g and g + 8 of each m16 tile (h = 0, 1), columns
    // nb*8 + 2*t4 + {0, 1}; a row's 4 threads are lanes 4g..4g+3.
    const bool full = n0 + BN - 1 <= kr.qp_first && (p.window <= 0 || n0 > kr.qp_last - p.window);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int qpos = kr.qp_first + wrow + mt * 16 + g + h * 8;
        float mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float x = s[mt][nb][2 * h + e];
            if (!full && !visible(n0 + nb * 8 + 2 * t4 + e, qpos, ctx, p.window)) x = -INFINITY;
            s[mt][nb][2 * h + e] = x;
            mx = fmaxf(mx, x);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(row_max[mt][h], mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // nothing visible yet: keep zeros
        const float corr = fast_exp2((row_max[mt][h] - m_use) * mul);
        row_max[mt][h] = m_new;
        const float neg_m = -m_use * mul;
        float sum = 0.0f;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(fmaf(s[mt][nb][2 * h + e], mul, neg_m));
            s[mt][nb][2 * h + e] = pv;
            sum += pv;
          }
        }
        row_sum[mt][h] = row_sum[mt][h] * corr + sum;  // this thread's share of the row
#pragma unroll
        for (int nd = 0; nd < ND; ++nd) {
          o[mt][nd][2 * h] *= corr;
          o[mt][nd][2 * h + 1] *= corr;
        }
      }
    }

    // The probabilities as A fragments of P.V (the score accumulators of keys 16kk..16kk+15 are
    // exactly one), packed now so the fp32 scores die before the next K load is issued.
    uint32_t pa[MT][BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[mt][kk][0] = Mma<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][kk][1] = Mma<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][kk][2] = Mma<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][kk][3] = Mma<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
    }

    cp_async_wait_all();
    __syncthreads();  // V landed; every warp is done with this K
    if (it + 1 < kr.n_tiles) {
      load_kv(sK, kc, n0 + BN);
      cp_async_commit();
    }

    // O += P V
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int nd2 = 0; nd2 < D / 16; ++nd2) {
        uint32_t b[4];  // transposed V: b[0..1] dims nd2*16+0..7, b[2..3] dims nd2*16+8..15
        ldmatrix_x4_trans(b, sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S + nd2 * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::run(o[mt][2 * nd2], pa[mt][kk], b[0], b[1]);
          Mma<T>::run(o[mt][2 * nd2 + 1], pa[mt][kk], b[2], b[3]);
        }
      }
    }
  }

  // With no key tile the Q copies (issued by all warps into all rows) may still be in flight.
  cp_async_wait_all();
  __syncthreads();
  // Normalise and stage this warp's rows in its own Q rows (only this warp ever read them), then
  // write whole 16-byte chunks.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = row_sum[mt][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      T* dst = sQ + (wrow + mt * 16 + g + h * 8) * S + 2 * t4;
#pragma unroll
      for (int nd = 0; nd < ND; ++nd) {
        *reinterpret_cast<uint32_t*>(dst + nd * 8) = Mma<T>::pack(o[mt][nd][2 * h] * inv, o[mt][nd][2 * h + 1] * inv);
      }
    }
  }
  __syncwarp();
  T* out = static_cast<T*>(p.out);
  for (int c = lane; c < 16 * MT * CH; c += 32) {
    const int row = c / CH, col = (c - row * CH) * 8;
    const int qrow = t.m0 + wrow + row;
    if (qrow < t.q_len) {
      *reinterpret_cast<uint4*>(out + (int64_t)(t.q_begin + qrow) * p.o_tok + (int64_t)head * p.o_head + col) =
          *reinterpret_cast<const uint4*>(sQ + (wrow + row) * S + col);
    }
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

template <typename K>
static int allow_smem(K kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return WLLM_OK;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
  if (err == cudaSuccess) return WLLM_OK;
  cudaGetLastError();  // not sticky: clear it so later launches start clean
  return fail(err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction ? WLLM_ERR_NO_KERNEL_IMAGE
                                                                                             : WLLM_ERR_CUDA,
              "paged_prefill_attention: cannot reserve %zu bytes of shared memory: %s", bytes,
              cudaGetErrorString(err));
}

// The query tiles of a launch (num_tokens / rows + num_seqs: every sequence may start a partial tile) into
// pt.num_tiles, or an error when tiles x heads overflows a 1-D grid.
static int count_tiles(Params& pt, int rows, int64_t num_tokens, int num_heads) {
  const int64_t tiles = num_tokens / rows + pt.num_seqs;
  if (tiles * num_heads >= (int64_t)1 << 31) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "paged_prefill_attention: %lld query tiles x %d heads is too large a grid",
                (long long)tiles, num_heads);
  }
  pt.num_tiles = (int)tiles;
  return WLLM_OK;
}

// One CTA per (query tile of `rows` rows, head): reserve the shared memory, size the grid, launch.
static int launch_tiles(void (*kernel)(Params), const Params& p, int rows, int threads, size_t smem,
                        int64_t num_tokens, int num_heads, cudaStream_t stream, const char* what) {
  if (int rc = allow_smem(kernel, smem)) return rc;
  Params pt = p;
  if (int rc = count_tiles(pt, rows, num_tokens, num_heads)) return rc;
  kernel<<<(unsigned)pt.num_tiles * (unsigned)num_heads, threads, smem, stream>>>(pt);
  return check_launch(what);
}

template <typename T, int D>
static int launch_simt(const Params& p, int64_t num_tokens, int num_heads, cudaStream_t stream) {
  return launch_tiles(simt_prefill_kernel<T, D>, p, kSimtRows, kSimtThreads, simt_smem_bytes<D>(), num_tokens,
                      num_heads, stream, "paged_prefill_attention (simt)");
}

template <typename T, int D>
static int launch_flash(const Params& p, int64_t num_tokens, int num_heads, cudaStream_t stream) {
  constexpr int BM = 16 * FlashShape<D>::MT * (kFlashThreads / 32);
  return launch_tiles(flash_prefill_kernel<T, D>, p, BM, kFlashThreads, flash_smem_bytes<T, D>(), num_tokens,
                      num_heads, stream, "paged_prefill_attention");
}

template <typename T, int D>
static int launch_sm90(const Params& p, int64_t num_tokens, int num_heads, cudaStream_t stream) {
  CUtensorMap map_k, map_v;
  if (!sm90_cache_maps(p, D, std::is_same<T, __half>::value, &map_k, &map_v)) {
    return launch_flash<T, D>(p, num_tokens, num_heads, stream);  // a cache layout TMA cannot describe
  }
  auto kernel = sm90_prefill_kernel<T, D>;
  const size_t smem = sm90_smem_bytes<D>();
  if (int rc = allow_smem(kernel, smem)) return rc;
  Params pt = p;
  if (int rc = count_tiles(pt, kSm90BM, num_tokens, num_heads)) return rc;
  DeviceProps dev;
  if (int rc = current_device_props(&dev)) return rc;
  // Persistent: one CTA per SM (its shared memory allows no second), each taking several work items.
  const int64_t items = (int64_t)pt.num_tiles * num_heads;
  const unsigned grid = (unsigned)(items < dev.sms ? items : dev.sms);
  kernel<<<grid, kSm90Threads, smem, stream>>>(map_k, map_v, pt);
  return check_launch("paged_prefill_attention (sm90)");
}

// The Hopper kernel on SM 9.0: 1 (the default), 0 the mma.sync kernel of other tensor-core GPUs (the tests'
// hook wllm_set_prefill_sm90, so that one GPU covers both).
static std::atomic<int> g_sm90_switch(1);

enum Path { PATH_SIMT = 0, PATH_MMA = 1, PATH_SM90 = 2 };

template <typename T, int D>
static int launch_path(const Params& p, int64_t num_tokens, int num_heads, Path path, cudaStream_t stream) {
  if constexpr (D == 64 || D == 128) {
    if (path == PATH_SM90) return launch_sm90<T, D>(p, num_tokens, num_heads, stream);
  }
  return path != PATH_SIMT ? launch_flash<T, D>(p, num_tokens, num_heads, stream)
                           : launch_simt<T, D>(p, num_tokens, num_heads, stream);
}

template <typename T>
static int launch(const Params& p, int64_t num_tokens, int num_heads, int head_size, Path path,
                  cudaStream_t stream) {
#define WLLM_PREFILL_CASE(D) \
  case D:                    \
    return launch_path<T, D>(p, num_tokens, num_heads, path, stream);
  switch (head_size) {
    WLLM_PREFILL_CASE(64)
    WLLM_PREFILL_CASE(80)
    WLLM_PREFILL_CASE(96)
    WLLM_PREFILL_CASE(128)
    WLLM_PREFILL_CASE(256)
    default:
      return fail(WLLM_ERR_INVALID_ARGUMENT, "paged_prefill_attention: head size %d unsupported", head_size);
  }
#undef WLLM_PREFILL_CASE
}

template <>
int launch<float>(const Params& p, int64_t num_tokens, int num_heads, int head_size, Path, cudaStream_t stream) {
  switch (head_size) {
    case 64: return launch_simt<float, 64>(p, num_tokens, num_heads, stream);
    case 80: return launch_simt<float, 80>(p, num_tokens, num_heads, stream);
    case 96: return launch_simt<float, 96>(p, num_tokens, num_heads, stream);
    case 128: return launch_simt<float, 128>(p, num_tokens, num_heads, stream);
    case 256: return launch_simt<float, 256>(p, num_tokens, num_heads, stream);
    default:
      return fail(WLLM_ERR_INVALID_ARGUMENT, "paged_prefill_attention: head size %d unsupported", head_size);
  }
}

static bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

}  // namespace prefill
}  // namespace WLLM_NS

WLLM_API int WLLM_FN(wllm_paged_prefill_attention)(
    void* out, const void* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* seq_lens, const int32_t* query_start_loc, int64_t num_tokens, int num_seqs, int num_heads,
    int num_kv_heads, int head_size, int block_size, int64_t block_table_stride, int64_t q_token_stride,
    int64_t q_head_stride, int64_t out_token_stride, int64_t out_head_stride, int64_t kv_block_stride,
    int64_t kv_token_stride, int64_t kv_head_stride, float scale, int sliding_window, float logit_softcap,
    int dtype, void* stream) {
  using namespace WLLM_NS;
  using namespace WLLM_NS::prefill;
  const char* what = "paged_prefill_attention";
  if (num_tokens < 0 || num_seqs < 0 || num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "%s: bad shape tokens=%lld seqs=%d heads=%d kv_heads=%d", what,
                (long long)num_tokens, num_seqs, num_heads, num_kv_heads);
  }
  if (head_size != 64 && head_size != 80 && head_size != 96 && head_size != 128 && head_size != 256) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "%s: head size %d unsupported (supported: 64, 80, 96, 128, 256)", what,
                head_size);
  }
  if (block_size <= 0 || (block_size & (block_size - 1)) != 0) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "%s: block size %d is not a power of two", what, block_size);
  }
  if (sliding_window < 0 || !(logit_softcap >= 0.0f) || !isfinite(scale) || !(scale > 0.0f)) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "%s: bad sliding_window=%d / logit_softcap=%g / scale=%g", what,
                sliding_window, (double)logit_softcap, (double)scale);
  }
  if (num_tokens == 0 || num_seqs == 0) return WLLM_OK;
  if (!out || !q || !k_cache || !v_cache || !block_tables || !seq_lens || !query_start_loc) {
    return fail(WLLM_ERR_INVALID_ARGUMENT, "%s: null pointer", what);
  }
  DeviceProps dev;
  if (int rc = current_device_props(&dev)) return rc;
  // The tensor-core kernels copy 16-byte chunks: rows must start on 16-byte boundaries.
  const bool tensor_cores = dtype != WLLM_FLOAT32 && dev.major >= 8;
  const bool sm90 = dev.major == 9 && dev.minor == 0 && g_sm90_switch.load(std::memory_order_relaxed) != 0;
  const Path path = !tensor_cores ? PATH_SIMT : sm90 ? PATH_SM90 : PATH_MMA;
  if (tensor_cores) {
    const int64_t strides[7] = {q_token_stride, q_head_stride, out_token_stride, out_head_stride,
                                kv_block_stride, kv_token_stride, kv_head_stride};
    bool ok = aligned16(out) && aligned16(q) && aligned16(k_cache) && aligned16(v_cache);
    for (int i = 0; i < 7; ++i) ok = ok && strides[i] % 8 == 0;
    if (!ok) {
      return fail(WLLM_ERR_INVALID_ARGUMENT,
                  "%s: fp16/bf16 tensors must be 16-byte aligned with strides that are multiples of 8 elements",
                  what);
    }
  }
  int shift = 0;
  while ((1 << shift) < block_size) ++shift;
  Params p;
  p.out = out;
  p.q = q;
  p.k = k_cache;
  p.v = v_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.bt_stride = block_table_stride;
  p.q_tok = q_token_stride;
  p.q_head = q_head_stride;
  p.o_tok = out_token_stride;
  p.o_head = out_head_stride;
  p.kv_block = kv_block_stride;
  p.kv_tok = kv_token_stride;
  p.kv_head = kv_head_stride;
  p.num_seqs = num_seqs;
  p.num_tiles = 0;  // set by the launcher, which knows its tile height
  p.num_kv_heads = num_kv_heads;
  p.group = num_heads / num_kv_heads;
  p.block_shift = shift;
  p.scale = scale;
  p.softcap = logit_softcap;
  p.window = sliding_window;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case WLLM_FLOAT32: return launch<float>(p, num_tokens, num_heads, head_size, PATH_SIMT, s);
    case WLLM_FLOAT16: return launch<__half>(p, num_tokens, num_heads, head_size, path, s);
    case WLLM_BFLOAT16: return launch<__nv_bfloat16>(p, num_tokens, num_heads, head_size, path, s);
    default: return fail(WLLM_ERR_INVALID_ARGUMENT, "%s: unsupported dtype code %d", what, dtype);
  }
}

WLLM_API int WLLM_FN(wllm_set_prefill_sm90)(int enabled) {
  return WLLM_NS::prefill::g_sm90_switch.exchange(enabled ? 1 : 0);
}
