// Hopper (SM 9.0) paged prefill attention: the online-softmax algorithm of flash_prefill_kernel on
// warpgroup MMAs (wgmma), warp-specialised and persistent.
//
// The grid has at most one CTA per SM; each CTA works through a list of work items (128 query rows of one
// head) with three warpgroups:
//  - warpgroup 0 produces: for each item, its Q rows into one of two Q buffers (cp.async, zero-filled past
//    the sequence) together with the item's description, then its K and V tiles into a 2-stage ring that
//    runs on across items, in the 128-byte-swizzled layout wgmma reads (rows of 64 head dims, 16-byte chunk
//    c of row r at c ^ (r % 8)); a tile inside the context by TMA, one box per cache block, each issued by
//    its own lane (the block-table reads overlap), the last tile by its 128 threads' cp.async gathers,
//    zero-filled past the context; full/empty mbarriers hand Q buffers and stages over. So the next item's
//    Q and first tiles load while the consumers finish the current one and write its output: short
//    prompts pay no per-item start-up latency;
//  - warpgroups 1 and 2 consume, 64 query rows each: S = Q K^T with both operands in shared memory
//    (K-major), the online softmax on the fp32 accumulators in registers, O += P V with P straight from
//    registers (an accumulator quad of 16 keys is the m64k16 A fragment) and V read N-major (head dims
//    contiguous) from the same layout as K;
//  - the two consumers take turns on the tensor cores (named barriers): one issues its MMAs -- this tile's
//    Q K^T together with the previous tile's P V -- while the other runs its softmax;
//  - each consumer writes its 64 output rows through its half of the item's Q buffer (no longer read by
//    then), so the global stores are whole 16-byte chunks of each row; the buffer goes back to the
//    producer after that.
// Compiled only for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); the launcher uses it on SM 9.0 for fp16/bf16 and
// head sizes 64 and 128, the mma.sync kernel elsewhere.
#pragma once
#include <stdint.h>

#include "attention_prefill_mma.cuh"
#include "attention_prefill_tile.cuh"
#include "common.cuh"
#include "hopper.cuh"
#include "wgmma_sm90.cuh"

namespace WLLM_NS {
namespace prefill {

constexpr int kSm90Threads = 384;  // a producer and two consumer warpgroups
constexpr int kSm90BM = 128;       // query rows per CTA (64 per consumer)
constexpr int kSm90BN = 128;       // keys per K/V tile
constexpr int kSm90Stages = 2;

template <int D>
constexpr size_t sm90_smem_bytes() {
  // Two Q buffers and the K and V rings, their barriers, the two buffers' items, and slack to align the
  // tiles to 1024 bytes (the swizzle atom).
  return (size_t)(2 * kSm90BM + 2 * kSm90Stages * kSm90BN) * D * 2 + (4 * kSm90Stages + 4) * 8 + 2 * sizeof(Tile) +
         1024;
}

// TMA descriptors of the K and V caches for sm90_prefill_kernel: [blocks][block rows][KV-head columns],
// boxes of min(block size, BN) rows x 64 columns. The block count is not known here; the table only names
// existing blocks, so the outer extent is simply large. False if TMA cannot describe the layout.
inline bool sm90_cache_maps(const Params& p, int head_size, bool is_half, CUtensorMap* map_k, CUtensorMap* map_v) {
  const int block_size = 1 << p.block_shift;
  return hopper::paged_cache_maps(map_k, map_v, is_half, p.k, p.v, p.num_kv_heads, p.kv_head, head_size, block_size,
                                  p.kv_tok, p.kv_block, block_size < kSm90BN ? block_size : kSm90BN);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Byte offset of 16-byte chunk c (of D / 8) of row r in a tile of `rows` rows: D / 64 column blocks of
// rows x 128 bytes, 128-byte swizzled.
template <int D>
__device__ __forceinline__ uint32_t swizzled(int rows, int r, int c) {
  return (uint32_t)((c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}
#endif

// map_k / map_v: TMA descriptors of the caches as [blocks][block rows][KV-head columns] with boxes of
// min(block size, BN) rows x 64 columns (sm90_cache_maps). Persistent: a grid of at most one CTA per SM,
// CTA c taking work items c, 2G - 1 - c, 2G + c, ... (G CTAs; a snake over the heaviest-first item order,
// so every CTA gets a similar mix of long and short causal tiles).
template <typename T, int D>
__global__ void __launch_bounds__(kSm90Threads, 1)
    sm90_prefill_kernel(const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
                        const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace hopper;
  constexpr int BM = kSm90BM, BN = kSm90BN, ST = kSm90Stages, CH = D / 8;
  constexpr uint32_t Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
  extern __shared__ unsigned char sm90_smem_raw[];
  const uint32_t base = (smem_addr(sm90_smem_raw) + 1023u) & ~1023u;
  unsigned char* const smem = sm90_smem_raw + (base - smem_addr(sm90_smem_raw));
  const uint32_t s_q = base, s_k = base + 2 * Q_BYTES, s_v = s_k + ST * KV_BYTES;
  const uint32_t full_k = s_v + ST * KV_BYTES, full_v = full_k + 8 * ST, empty_k = full_v + 8 * ST,
                 empty_v = empty_k + 8 * ST, full_q = empty_v + 8 * ST, empty_q = full_q + 16;
  // The item in each Q buffer, published by the producer with its Q rows (seq < 0: no more items).
  Tile* const s_tile = reinterpret_cast<Tile*>(smem + (empty_q + 16 - base));

  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127;
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) {
      mbar_init(full_k + 8 * s, 128);  // every producer thread's copies
      mbar_init(full_v + 8 * s, 128);
      mbar_init(empty_k + 8 * s, 2);  // both consumers
      mbar_init(empty_v + 8 * s, 2);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(full_q + 8 * b, 129);  // every producer thread's Q copies, then the item published
      mbar_init(empty_q + 8 * b, 2);
    }
    fence_mbar_init();
  }
  __syncthreads();

  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    // Each thread copies one fixed 16-byte column chunk of rows r0, r0 + RPP, ... of every tile: its
    // swizzled offset only moves by whole 1024-byte atoms from pass to pass. Keys past the context are
    // zero-filled so that 0 * garbage (possibly NaN) never reaches the accumulators.
    constexpr int RPP = 128 / CH, PASSES = BN / RPP;
    static_assert(RPP % 8 == 0 && BN % RPP == 0 && BM % RPP == 0, "passes must keep the swizzle phase");
    const int ch = wt % CH, r0 = wt / CH;
    const uint32_t dst0 = swizzled<D>(BN, r0, ch);
    const int block_mask = (1 << p.block_shift) - 1;
    const int box_rows = min(1 << p.block_shift, BN);
    const bool tma = (1 << p.block_shift) >= 8;
    const int total = p.num_tiles * p.group * p.num_kv_heads, grid = (int)gridDim.x;
    int g = 0, j = 0;  // K/V tiles and items this CTA has produced
    for (int r = 0; r * grid < total; ++r) {
      const int item = r * grid + ((r & 1) ? grid - 1 - (int)blockIdx.x : (int)blockIdx.x);
      Tile t;
      if (item >= total || !locate_tile_at(p, BM, (unsigned)item, t)) continue;
      const KeyRange kr = key_range(t, BM, p.window, BN);
      const int32_t* table = p.block_tables + (int64_t)t.seq * p.bt_stride;
      const int kv_col = (t.head / p.group) * (int)p.kv_head;
      const int ctx = t.ctx;
      {  // the item's Q rows into buffer j % 2, once the consumers are done with its previous item
        const int b = j & 1;
        mbar_wait(empty_q + 8 * b, ((j >> 1) & 1) ^ 1);
        const T* q = static_cast<const T*>(p.q);
#pragma unroll 4
        for (int row = r0; row < BM; row += RPP) {
          const bool ok = t.m0 + row < t.q_len;
          const T* src = ok ? q + (int64_t)(t.q_begin + t.m0 + row) * p.q_tok + (int64_t)t.head * p.q_head + ch * 8 : q;
          cp_async_16(smem + (s_q + b * Q_BYTES - base) + swizzled<D>(BM, row, ch), src, ok ? 16 : 0);
        }
        mbar_arrive_cp_async(full_q + 8 * b);
        if (wt == 0) {
          s_tile[b] = t;
          mbar_arrive(full_q + 8 * b);
        }
      }
      auto load = [&](uint32_t dst, const T* cache, int n0) {
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
          const int key = n0 + r0 + i * RPP;
          const bool ok = key < ctx;
          const T* src = ok ? cache + (int64_t)table[key >> p.block_shift] * p.kv_block +
                                  (int64_t)(key & block_mask) * p.kv_tok + kv_col + ch * 8
                            : cache;
          cp_async_16(smem + (dst - base) + dst0 + i * RPP * 128, src, ok ? 16 : 0);
        }
      };
      // A tile wholly inside the context (and blocks of 8+ rows, whole swizzle atoms) comes by TMA: lane i of
      // the first warp reads the block id of box i (min(block size, BN) rows) and issues that box for every
      // 64-column block, so the tile's block-table reads overlap instead of following one another; the
      // other threads only arrive. The last, partial tile takes the copies above for their zero fill.
      // Either way the barrier counts 128 arrivals, thread 0's raising the expected bytes first.
      auto tma_tile = [&](uint32_t dst, const CUtensorMap* map, uint32_t bar, int n0) {
        if (wt < 32) {
          if (wt == 0) mbar_expect_tx(bar, KV_BYTES);
          __syncwarp();
          if (wt * box_rows < BN) {
            const int rr = wt * box_rows, key = n0 + rr, blk = table[key >> p.block_shift];
#pragma unroll
            for (int cb = 0; cb < D / 64; ++cb) {
              tma_load_3d(dst + cb * BN * 128 + rr * 128, map, kv_col + cb * 64, key & block_mask, blk, bar);
            }
          }
          if (wt != 0) mbar_arrive(bar);
        } else {
          mbar_arrive(bar);
        }
      };
      for (int it = 0; it < kr.n_tiles; ++it) {
        const int s = (g + it) % ST, phase = ((g + it) / ST) & 1, n0 = kr.first_n0 + it * BN;
        const bool whole = tma && n0 + BN <= ctx;
        // This tile of one cache (K or V) into stage s of its ring, once the consumers have released it.
        auto fill = [&](uint32_t ring, uint32_t full, uint32_t empty, const CUtensorMap* map, const void* cache) {
          mbar_wait(empty + 8 * s, phase ^ 1);
          if (whole) {
            tma_tile(ring + s * KV_BYTES, map, full + 8 * s, n0);
          } else {
            load(ring + s * KV_BYTES, static_cast<const T*>(cache), n0);
            mbar_arrive_cp_async(full + 8 * s);
          }
        };
        fill(s_k, full_k, empty_k, &map_k, p.k);
        fill(s_v, full_v, empty_v, &map_v, p.v);
      }
      g += kr.n_tiles;
      ++j;
    }
    {  // no more items
      const int b = j & 1;
      mbar_wait(empty_q + 8 * b, ((j >> 1) & 1) ^ 1);
      mbar_arrive(full_q + 8 * b);
      if (wt == 0) {
        s_tile[b].seq = -1;
        mbar_arrive(full_q + 8 * b);
      }
    }
    cp_async_commit();  // leave no copy of this thread in flight behind it
    cp_async_wait_all();
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int cw = wg - 1, warp = wt >> 5, lane = tid & 31;
  const int g4 = lane >> 2, t4 = lane & 3;
  const bool capped = p.softcap > 0.0f;
  const float kLog2e = 1.4426950408889634f;
  const float pre = capped ? p.scale / p.softcap : p.scale * kLog2e;
  const float post = capped ? p.softcap * kLog2e : 1.0f;
  const float mul = capped ? 1.0f : pre;  // scores stay unscaled; the scale is folded into the exponent

  // Turns on the tensor cores: a consumer waits on its named barrier, which the other one arrives at once
  // it has issued its MMAs. Consumer 0 starts each item; turns strictly alternate, and consumer 1 does not
  // hand back an item's last turn (nobody would take it). So consumer 0 arrives twice in a row at item
  // boundaries (its last turn of one item, its first of the next), possibly before consumer 1 has waited
  // for the first: on one barrier the second arrival would complete the phase without the waiter (a hang).
  // Consumer 0 therefore hands over on barrier 4 or 5 by the parity of the item (counting items with key
  // tiles); before it can arrive at the same one again it takes a turn from consumer 1 (barrier 3) within
  // the next item, which consumer 1 gives only after its last wait of the previous one.
  // (experiments/prefill_turns_model.py checks the protocol.)
  int n_items = 0;  // items with key tiles so far
  auto bar_of = [&](int c) { return c == 0 ? 3 : 4 + (n_items & 1); };
  auto take_turn = [&]() { named_sync(bar_of(cw), 256); };
  auto pass_turn = [&]() { named_arrive(bar_of(cw ^ 1), 256); };

  int g = 0;  // K/V tiles this CTA has consumed: the ring position
  for (int j = 0;; ++j) {
    const int b = j & 1;
    mbar_wait(full_q + 8 * b, (j >> 1) & 1);
    const Tile t = s_tile[b];
    if (t.seq < 0) break;
    fence_proxy_async();  // Q came by cp.async (generic proxy); wgmma reads it through the async proxy
    const KeyRange kr = key_range(t, BM, p.window, BN);
    const uint32_t q_buf = s_q + b * Q_BYTES;

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    uint32_t pa[BN / 16][4];  // the previous tile's probabilities, A fragments of its P V

    // O += P V over the tile in stage `sv`: 16 keys (two 8-row groups, 2 KB) per step; V's 64-column
    // blocks are BN * 128 bytes apart.
    auto issue_pv = [&](int sv) {
      const uint32_t v = s_v + sv * KV_BYTES;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs_nmajor<T, D>(o, pa[kk], smem_desc(v + kk * 2048, BN * 128), 1);
    };

    for (int it = 0; it < kr.n_tiles; ++it) {
      const int n0 = kr.first_n0 + it * BN, s = (g + it) % ST, prev = (g + it + ST - 1) % ST;
      mbar_wait(full_k + 8 * s, ((g + it) / ST) & 1);
      if (it > 0) mbar_wait(full_v + 8 * prev, ((g + it - 1) / ST) & 1);
      fence_proxy_async();
      if (it > 0 || cw == 1) take_turn();
      // This tile's S = Q K^T over this warpgroup's 64 rows, and the previous tile's P V.
      float s_acc[BN / 2];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t cb = (kk >> 2), off = (kk & 3) * 32;
        wgmma<T, BN>(s_acc, smem_desc(q_buf + cb * BM * 128 + cw * 64 * 128 + off),
                     smem_desc(s_k + s * KV_BYTES + cb * BN * 128 + off), kk > 0 ? 1 : 0);
      }
      if (it > 0) issue_pv(prev);
      wgmma_commit();
      pass_turn();
      wgmma_wait<0>();
      if (wt == 0) {
        mbar_arrive(empty_k + 8 * s);
        if (it > 0) mbar_arrive(empty_v + 8 * prev);
      }

      if (capped) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) s_acc[i] = tanhf(s_acc[i] * pre) * post;
      }
      // Online softmax. Thread holds rows g4 and g4 + 8 (h = 0, 1) of its warp's 16, columns 8 jj + 2 t4 +
      // {0, 1} in s_acc[4 jj + 2 h + {0, 1}]; a row's 4 threads are lanes 4 g4 .. 4 g4 + 3. Whole tile
      // visible to every row of the CTA: no mask. Else key n0 + 8 jj + 2 t4 + e is visible to position
      // qpos iff lo < it <= qpos: one compare per bound against the column offset 8 jj + e. Keys past the
      // context need no test: they are zero-filled (finite scores), and the rows that could see them
      // (qpos >= ctx) are past the sequence's queries, never written.
      const bool full = n0 + BN - 1 <= kr.qp_first && (p.window <= 0 || n0 > kr.qp_last - p.window);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int qpos = kr.qp_first + cw * 64 + warp * 16 + g4 + h * 8;
        float mx = -INFINITY;
        if (full) {
#pragma unroll
          for (int jj = 0; jj < BN / 8; ++jj) mx = fmaxf(mx, fmaxf(s_acc[4 * jj + 2 * h], s_acc[4 * jj + 2 * h + 1]));
        } else {
          const int hi = qpos - (n0 + 2 * t4);
          const int lo = p.window > 0 ? hi - p.window : -(1 << 30);
#pragma unroll
          for (int jj = 0; jj < BN / 8; ++jj) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int c = 8 * jj + e;
              const float x = (c <= hi && c > lo) ? s_acc[4 * jj + 2 * h + e] : -INFINITY;
              s_acc[4 * jj + 2 * h + e] = x;
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
        for (int jj = 0; jj < BN / 8; ++jj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(fmaf(s_acc[4 * jj + 2 * h + e], mul, neg_m));
            s_acc[4 * jj + 2 * h + e] = pv;
            sum += pv;
          }
        }
        row_sum[h] = row_sum[h] * corr + sum;  // this thread's share of the row
#pragma unroll
        for (int jj = 0; jj < D / 8; ++jj) {  // O holds every tile's P V so far (the wait above)
          o[4 * jj + 2 * h] *= corr;
          o[4 * jj + 2 * h + 1] *= corr;
        }
      }
      // P as the A fragments of P V: keys 16 kk .. 16 kk + 15 are accumulator blocks 2 kk and 2 kk + 1.
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[kk][0] = pack2<T>(s_acc[8 * kk], s_acc[8 * kk + 1]);
        pa[kk][1] = pack2<T>(s_acc[8 * kk + 2], s_acc[8 * kk + 3]);
        pa[kk][2] = pack2<T>(s_acc[8 * kk + 4], s_acc[8 * kk + 5]);
        pa[kk][3] = pack2<T>(s_acc[8 * kk + 6], s_acc[8 * kk + 7]);
      }
    }
    if (kr.n_tiles > 0) {  // the last tile's P V
      const int last = (g + kr.n_tiles - 1) % ST;
      mbar_wait(full_v + 8 * last, ((g + kr.n_tiles - 1) / ST) & 1);
      fence_proxy_async();
      take_turn();
      wgmma_fence();
      issue_pv(last);
      wgmma_commit();
      if (cw == 0) pass_turn();
      wgmma_wait<0>();
      if (wt == 0) mbar_arrive(empty_v + 8 * last);
      ++n_items;
    }
    g += kr.n_tiles;

    // The output through this warpgroup's Q rows (no longer needed): each thread's fragments into the
    // swizzled rows (conflict-free), then whole 16-byte chunks to global memory, 16 threads per 256-byte row
    // (the fragments' own 4-byte stores left a third of the sectors written twice). The producer refills
    // the buffer only after both consumers have released it below.
    const uint32_t q_rows = q_buf - base + cw * 64 * 128;  // this warpgroup's rows in every column block
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = row_sum[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int row = warp * 16 + g4 + h * 8;  // within this warpgroup's 64
#pragma unroll
      for (int jj = 0; jj < D / 8; ++jj) {
        *reinterpret_cast<uint32_t*>(smem + q_rows + swizzled<D>(BM, row, jj) + 4 * t4) =
            pack2<T>(o[4 * jj + 2 * h] * inv, o[4 * jj + 2 * h + 1] * inv);
      }
    }
    named_sync(1 + cw, 128);
    T* out = static_cast<T*>(p.out);
    constexpr int OPP = 128 / CH;  // rows per pass of the warpgroup
#pragma unroll
    for (int row = wt / CH; row < 64; row += OPP) {
      const int qrow = t.m0 + cw * 64 + row, ch = wt % CH;
      if (qrow < t.q_len) {
        const uint4 v = *reinterpret_cast<const uint4*>(smem + q_rows + swizzled<D>(BM, row, ch));
        *reinterpret_cast<uint4*>(out + (int64_t)(t.q_begin + qrow) * p.o_tok + (int64_t)t.head * p.o_head + ch * 8) = v;
      }
    }
    named_sync(1 + cw, 128);
    if (wt == 0) mbar_arrive(empty_q + 8 * b);  // the item's last use of its Q buffer
  }
#endif
}

}  // namespace prefill
}  // namespace WLLM_NS
