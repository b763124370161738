// Shared by the prefill attention kernels: launch parameters, the mapping of a CTA to its query
// tile, the key range a tile can see, and the visibility rule.
#pragma once
#include <stdint.h>

#include "common.cuh"

namespace WLLM_NS {
namespace prefill {

struct Params {
  void* out;
  const void* q;
  const void* k;
  const void* v;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t bt_stride;
  int64_t q_tok, q_head, o_tok, o_head;
  int64_t kv_block, kv_tok, kv_head;
  int num_seqs;
  int num_tiles;    // query tiles in the grid: num_tokens / BM + num_seqs
  int num_kv_heads;
  int group;        // query heads per KV head
  int block_shift;  // log2(block_size)
  float scale;
  float softcap;  // 0: off
  int window;     // 0: off; else key k is visible to query position p iff p - window < k <= p
};

struct Tile {
  int seq, q_begin, q_len, m0, ctx, head;
};

// Which sequence, rows [m0, m0 + bm) and query head this CTA computes. The grid is 1-D,
// num_tiles * num_heads CTAs: consecutive CTAs take all heads of one tile (the KV heads of a
// GQA group stay hot in L2), and tiles go last to first so the causally heaviest start first.
// `item` in [0, num_tiles * num_heads) is the CTA index of a one-tile-per-CTA grid (locate_tile) or a
// persistent CTA's work item.
__device__ __forceinline__ bool locate_tile_at(const Params& p, int bm, unsigned item, Tile& t) {
  const int num_heads = p.group * p.num_kv_heads;
  t.head = (int)(item % (unsigned)num_heads);
  const int idx = p.num_tiles - 1 - (int)(item / (unsigned)num_heads);
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {  // the last s with query_start_loc[s] / bm + s <= idx (strictly increasing in s)
    const int mid = (lo + hi + 1) >> 1;
    if (p.query_start_loc[mid] / bm + mid <= idx) lo = mid;
    else hi = mid - 1;
  }
  t.seq = lo;
  t.q_begin = p.query_start_loc[lo];
  t.q_len = p.query_start_loc[lo + 1] - t.q_begin;
  t.m0 = (idx - (t.q_begin / bm + lo)) * bm;
  t.ctx = p.seq_lens[lo];
  // m0 < 0: a tile in front of the first sequence, whose query_start_loc need not be 0 (the
  // caller may hand over q rows of other sequences before it, e.g. the decode rows of a mixed step).
  return t.m0 >= 0 && t.m0 < t.q_len;
}

__device__ __forceinline__ bool locate_tile(const Params& p, int bm, Tile& t) {
  return locate_tile_at(p, bm, blockIdx.x, t);
}

// Keys the rows [m0, m0 + rows) can see, as n_tiles tiles of bn keys from first_n0.
struct KeyRange {
  int qp_first, qp_last, first_n0, n_tiles;
};

__device__ __forceinline__ KeyRange key_range(const Tile& t, int rows, int window, int bn) {
  KeyRange r;
  r.qp_first = t.ctx - t.q_len + t.m0;
  r.qp_last = t.ctx - t.q_len + min(t.m0 + rows, t.q_len) - 1;
  const int n_hi = r.qp_last + 1;
  const int n_lo = window > 0 ? max(0, r.qp_first - window + 1) : 0;
  r.first_n0 = (n_lo / bn) * bn;
  r.n_tiles = n_hi > r.first_n0 ? (n_hi - r.first_n0 + bn - 1) / bn : 0;
  return r;
}

__device__ __forceinline__ bool visible(int key, int qpos, int ctx, int window) {
  return key <= qpos && key < ctx && (window <= 0 || key > qpos - window);
}

}  // namespace prefill
}  // namespace WLLM_NS
