// The parts both split-attention kernels of decode_attention.cu share: the block's tile, its
// loads (mask, K/V span), the merge of a row's partials, and the launch constants. Included by
// decode_attention.cu only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common.cuh"
#include "dtypes.cuh"

namespace {

using ngk::from_f;
using ngk::to_f;

constexpr int kWarps = 4;
constexpr int kMaxT = 64;  // query tokens per request (tree nodes): the mask tile is [kMaxT, S]
constexpr int RPW = 4;     // query rows a warp works on together

// Two consecutive elements as floats.
template <typename T> __device__ __forceinline__ float2 load2(const T* p) { return make_float2(to_f(p[0]), to_f(p[1])); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Cache rows per split (both kernels: a query row's arithmetic depends on the spans only).
template <int D>
constexpr int kSpan = D == 64 ? 64 : 32;

template <typename T, int D>
struct Shape {
  static constexpr int S = kSpan<D>;  // cache rows per split
  static constexpr int KPL = S / 32;           // keys per lane in the score pass
  static constexpr int DPL = D / 32;           // output dims per lane in the value pass
  // Shared-memory row stride of K/V in elements: an odd number of 32-bit words, so that the 32
  // lanes of a warp reading 32 different keys hit 32 different banks.
  static constexpr int KS = sizeof(T) == 4 ? D + 1 : D + 2;
  static constexpr int TR = (sizeof(T) == 4 && D == 128) ? 16 : 32;  // query rows per block
};

// The dims a lane owns in the value pass: pairs (2 lane, 2 lane + 1), and for D = 128 also
// (64 + 2 lane, 64 + 2 lane + 1).
template <int D> __device__ __forceinline__ int lane_dim(int lane, int k) { return (k / 2) * 64 + 2 * lane + (k % 2); }

// One query row's output from its nsplit partials [nsplit, D + 2] (written by other blocks: read
// past L1), merged in split order; a warp per row. Each lane loads the max and sum of one split of
// a chunk of 32 (shuffled to the others), and the value loads of 8 splits are issued before any
// is used: one memory latency per 8 splits, not one per split (6.3 of 14.7 us of a layer's
// attention in a 8B-shaped decode step, 16 splits, before). The arithmetic is a fixed chain in
// split order, an empty partial (max -inf: its other fields were never written) left out.
template <typename T, int D>
__device__ __forceinline__ void combine_row(const float* __restrict__ p, T* __restrict__ o, int nsplit, int lane) {
  constexpr int DPL = D / 32, U = 8;
  constexpr unsigned kAll = 0xffffffffu;
  auto max_of = [&](int s) { return s < nsplit ? __ldcg(p + s * (D + 2) + D) : -INFINITY; };
  auto sum_of = [&](int s) { return s < nsplit ? __ldcg(p + s * (D + 2) + D + 1) : 0.f; };
  float m_lane = max_of(lane), l_lane = sum_of(lane);  // the first chunk's
  float M = m_lane;
  for (int s = lane + 32; s < nsplit; s += 32) M = fmaxf(M, max_of(s));
  M = warp_max(M);
  float acc[DPL];
#pragma unroll
  for (int k = 0; k < DPL; ++k) acc[k] = 0.f;
  float l = 0.f;
  if (M != -INFINITY) {
    for (int c = 0; c < nsplit; c += 32) {
      if (c > 0) m_lane = max_of(c + lane), l_lane = sum_of(c + lane);
      const int n = min(32, nsplit - c);
      for (int j0 = 0; j0 < n; j0 += U) {
        float v[U][DPL];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int k = 0; k < DPL; ++k)
            v[u][k] = j0 + u < n ? __ldcg(p + (c + j0 + u) * (D + 2) + lane_dim<D>(lane, k)) : 0.f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (j0 + u >= n) break;  // the same for every lane
          const float m = __shfl_sync(kAll, m_lane, j0 + u), ls = __shfl_sync(kAll, l_lane, j0 + u);
          if (m == -INFINITY) continue;
          const float w = exp2f(m - M);
          l = fmaf(w, ls, l);
#pragma unroll
          for (int k = 0; k < DPL; ++k) acc[k] = fmaf(w, v[u][k], acc[k]);
        }
      }
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that sees nothing gets zeros
#pragma unroll
  for (int k = 0; k < DPL; ++k) o[lane_dim<D>(lane, k)] = from_f<T>(acc[k] * inv);
}

// What a split block works on (grid: spans x (kv heads x row tiles) x requests): request b, kv
// head hkv, query rows r0 .. r0 + nr - 1 of that head (row r = t * G + g: token t, head g of the G
// sharing it), which belong to tokens t_lo .. t_lo + nt - 1, over cache rows c0 .. c0 + nc - 1.
// With kv_lens, rows at or past kv_lens[b] are masked whatever the mask says: the span ends there
// (nc = 0 past it), so nothing of them is loaded.
template <int TR, int S>
struct BlockTile {
  int G, split, hkv, r0, nr, c0, nc, t_lo, nt, T_, H;
  int64_t b;
  __device__ __forceinline__ BlockTile(int H_, int Hkv, int T, int L, const int64_t* kv_lens) : T_(T), H(H_) {
    G = H / Hkv;
    const int rows = G * T_;
    const int tiles = (rows + TR - 1) / TR;
    split = blockIdx.x;
    hkv = blockIdx.y / tiles, r0 = (blockIdx.y % tiles) * TR;
    b = blockIdx.z;
    nr = min(TR, rows - r0);
    c0 = split * S, nc = min(S, L - c0);
    if (kv_lens != nullptr) {
      const int64_t left = kv_lens[b] - c0;
      nc = left <= 0 ? 0 : static_cast<int>(min(static_cast<int64_t>(nc), left));
    }
    t_lo = r0 / G, nt = (r0 + nr - 1) / G - t_lo + 1;
  }
  // Tile row r (token t, head g of this kv head) as a row of q and out [bs * T * H].
  __device__ __forceinline__ int64_t query_row(int r) const {
    const int t = r / G, g = r % G;
    return (b * T_ + t) * H + hkv * G + g;
  }
  // Row r's partial of this block's span in part [bs * T * H, nsplit, D + 2].
  template <int D>
  __device__ __forceinline__ float* partial(float* part, int nsplit, int r) const {
    return part + (query_row(r) * nsplit + split) * (D + 2);
  }
};

// The mask rows of a tile's nt <= TR tokens over one span of S cache rows, 4 columns per load
// where rows are 4-aligned: loaded into registers with the block's other loads (issued before any
// is waited for), then stored to shared memory.
template <int TR, int S>
struct MaskTile {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWords = (TR * S / 4 + kThreads - 1) / kThreads;
  uint32_t w[kWords];

  // rows: the mask row of the tile's first token; the span is columns c0 .. c0 + nc - 1.
  __device__ __forceinline__ void load(const uint8_t* rows, int L, int c0, int nc, int nt) {
    const bool aligned = L % 4 == 0 && (reinterpret_cast<uintptr_t>(rows) & 3) == 0;
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      const int i = 4 * (threadIdx.x + k * kThreads);  // first of 4 columns
      const int t = i / S, c = i % S;
      const uint8_t* src = rows + static_cast<int64_t>(t) * L + c0 + c;
      w[k] = 0;
      if (i < nt * S && c < nc) {
        if (aligned && c + 4 <= nc) {
          w[k] = *reinterpret_cast<const uint32_t*>(src);
        } else {
          for (int e = 0; e < 4 && c + e < nc; ++e) w[k] |= static_cast<uint32_t>(src[e]) << (8 * e);
        }
      }
    }
  }

  // Into ms [nt, S]; whether this thread's part of the tile sees any key.
  __device__ __forceinline__ bool store(uint8_t* ms, int nt) const {
    bool visible = false;
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      const int i = 4 * (threadIdx.x + k * kThreads);
      if (i < nt * S) *reinterpret_cast<uint32_t*>(ms + i) = w[k];
      visible |= w[k] != 0;
    }
    return visible;
  }
};

// One span's K and V rows in 16-byte pieces (a row of D elements is 128 or 256 bytes, so pieces
// never straddle rows), in registers until the block stores them to shared memory; rows past the
// span's end are zeros.
template <typename T, int D, int S>
struct KvSpan {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int PPR = D * static_cast<int>(sizeof(T)) / 16;  // pieces per row
  static constexpr int kIters = S * PPR / kThreads;
  static_assert(S * PPR % kThreads == 0, "K/V pieces must divide among the threads");
  uint4 k[kIters], v[kIters];

  // base: the span's first row's element in the layer's cache; stride: elements between rows.
  __device__ __forceinline__ void load(const T* k_cache, const T* v_cache, int64_t base, int64_t stride, int nc) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int p = threadIdx.x + i * kThreads;
      const int c = p / PPR, w = p % PPR;
      k[i] = v[i] = make_uint4(0, 0, 0, 0);
      if (c < nc) {
        k[i] = reinterpret_cast<const uint4*>(k_cache + base + c * stride)[w];
        v[i] = reinterpret_cast<const uint4*>(v_cache + base + c * stride)[w];
      }
    }
  }
};

// The last block of this (request, kv head, row tile) to finish merges its rows' partials, in
// split order as attn_combine_kernel does (the same arithmetic): one kernel less per layer. The
// fences make every block's partials visible before its arrival is counted, and the counter is
// reset by that last block, ready for the next launch on the stream.
template <typename T, int D, typename RowFn>
__device__ __forceinline__ void merge_if_last(int* arrivals, const float* part, T* out, int nsplit, int r0, int nr,
                                              RowFn query_row) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* a = arrivals + (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y);
    last = atomicAdd(a, 1) == static_cast<int>(gridDim.x) - 1;
    if (last) *a = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x / 32; i < nr; i += kWarps) {
    const int64_t row = query_row(r0 + i);
    combine_row<T, D>(part + row * nsplit * (D + 2), out + row * D, nsplit, threadIdx.x % 32);
  }
}

// A block whose span lies past kv_lens: its rows' partials are empty (max -inf, left out by the
// merge), and it still counts its arrival.
template <typename T, int D, typename Tile>
__device__ __forceinline__ void empty_span(const Tile& tile, float* part, T* out, int* arrivals, int nsplit) {
  for (int i = threadIdx.x; i < tile.nr; i += blockDim.x)
    tile.template partial<D>(part, nsplit, tile.r0 + i)[D] = -INFINITY;
  if (arrivals != nullptr)
    merge_if_last<T, D>(arrivals, part, out, nsplit, tile.r0, tile.nr, [&](int r) { return tile.query_row(r); });
}

}  // namespace
