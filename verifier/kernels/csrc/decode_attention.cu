// The attention half of a decode/verify layer in two or three kernels instead of eight.
//
// A decode or tree-verify step of a small model is bound by the number of kernels, not by their
// work (SmolLM2-135M, batch 1: 30 layers of a few microseconds each). In plain torch the attention
// half of a layer was: RoPE, stacking K/V, scattering them into the cache, gathering every
// request's K and V back out of the cache (the graph's slots are dynamic, so no view), a memset
// and SDPA. Here:
//
//   rope_store:   q and k rotated (HF "rotate half" layout, in float32, rounded once), q written
//                 to its own buffer, k and v written straight into the request's cache rows
//                 (rope_store.cu);
//   attn_split:   flash-decoding over the cache in place (cache rows read through the request's
//                 slot, no gather): each block takes one kv head, a tile of the query rows that
//                 share it (grouped-query attention: G heads x T tree nodes) and a fixed span of
//                 S cache rows, and writes a partial (unnormalised output, max, sum); on tensor
//                 cores for bf16/fp16 caches (attn_split_mma_kernel), on CUDA cores for float32;
//   attn_combine: the partials of each query row merged into the output [bs, T, H, D]; in a
//                 decode step the last split block of a row tile does this itself instead.
//
// The span S is fixed per head size, so a query row's arithmetic does not depend on the batch
// size or on the number of tree nodes: a token computes the same in a plain decode step and in a
// verify step as long as its keys sit at the same cache rows (the root; the nodes of a chain,
// whose index is their depth; not a tree node whose index exceeds its depth, whose ancestors then
// fall into other lanes of the spans). Spans the mask hides entirely are skipped, and a NaN left in
// a masked cache row cannot reach the output (unlike 0 * NaN in SDPA): the CUDA-core kernel never
// multiplies a masked key's value, the tensor-core one zeroes the keys no row of its tile sees.
//
// Cache layout (verifier.model.kv_cache): one layer's keys are rows [num_slots * max_len, Hkv, D]
// (row r of slot s at s * max_len + r), its values the same. The mask is the dense [bs, T, L]
// bool of kernels.tree_attention_mask (True = attend).
#include "attention_parts.cuh"

namespace {

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32)
    attn_split_kernel(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                      const int64_t* __restrict__ slots, int64_t max_len, const uint8_t* __restrict__ mask,
                      const int64_t* __restrict__ kv_lens, float* __restrict__ part, T* __restrict__ out,
                      int* __restrict__ arrivals, int T_, int H, int Hkv, int L, int nsplit, float qscale) {
  using Sh = Shape<T, D>;
  constexpr int S = Sh::S, KS = Sh::KS, TR = Sh::TR;
  __shared__ __align__(16) T ks[S * KS];
  __shared__ __align__(16) T vs[S * KS];
  __shared__ __align__(16) float qs[TR * D];
  __shared__ __align__(16) uint8_t ms[TR * S];  // nt <= TR tokens' rows
  __shared__ float ps[kWarps * RPW * S];
  __shared__ int any_visible;

  const BlockTile<TR, S> tile(H, Hkv, T_, L, kv_lens);
  const int G = tile.G, split = tile.split, hkv = tile.hkv, r0 = tile.r0, nr = tile.nr, c0 = tile.c0, nc = tile.nc;
  const int t_lo = tile.t_lo, nt = tile.nt;
  const int64_t b = tile.b;
  if (nc == 0) {  // a span past kv_lens[b]: an empty partial, nothing loaded (most spans of short
                  // requests in a batch whose KV bucket a long one sets)
    empty_span<T, D>(tile, part, out, arrivals, nsplit);
    return;
  }

  // Every load of this block is issued before any of them is waited for (fixed trip counts,
  // unrolled, predicated): a block's work is a few microseconds, so a loop of dependent loads,
  // one memory latency per iteration, would dominate it.
  constexpr int kThreads = kWarps * 32;
  MaskTile<TR, S> mtile;  // the mask rows of this tile's nt <= TR tokens
  mtile.load(mask + (b * T_ + t_lo) * L, L, c0, nc, nt);
  // K/V rows of the span (and q) are loaded before the mask is looked at, so that their latency
  // and the mask's overlap (a fully masked span wastes its loads; it is rare). Shared memory
  // takes them as 32-bit words (its rows are padded).
  KvSpan<T, D, S> span;  // this span's K/V rows
  span.load(k_cache, v_cache, ((slots[b] * max_len + c0) * Hkv + hkv) * D, static_cast<int64_t>(Hkv) * D, nc);
  constexpr int PPR = KvSpan<T, D, S>::PPR;
  constexpr int KV_ITERS = KvSpan<T, D, S>::kIters;
  constexpr int Q_ITERS = TR * D / kThreads;
  float qreg[Q_ITERS];
#pragma unroll
  for (int k = 0; k < Q_ITERS; ++k) {
    const int i = threadIdx.x + k * kThreads;
    const int r = r0 + i / D, d = i % D;
    const int t = r / G, g = r % G;
    qreg[k] = i < nr * D ? to_f(q[((b * T_ + t) * H + hkv * G + g) * D + d]) * qscale : 0.f;
  }
  if (threadIdx.x == 0) any_visible = 0;
  __syncthreads();
  if (mtile.store(ms, nt)) any_visible = 1;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto query_row = [&](int r) { return tile.query_row(r); };
  auto partial = [&](int r) { return tile.template partial<D>(part, nsplit, r); };
  if (!any_visible) {  // the whole span is masked for these rows: an empty partial
    for (int i = threadIdx.x; i < nr; i += blockDim.x) partial(r0 + i)[D] = -INFINITY;
  } else {
#pragma unroll
    for (int k = 0; k < KV_ITERS; ++k) {
      const int i = threadIdx.x + k * kThreads;
      const int c = i / PPR, w = i % PPR;
      uint32_t* kd = reinterpret_cast<uint32_t*>(ks + c * KS) + w * 4;
      uint32_t* vd = reinterpret_cast<uint32_t*>(vs + c * KS) + w * 4;
      if constexpr (sizeof(T) == 4) {  // rows of an odd number of words: 4-byte aligned only
        kd = reinterpret_cast<uint32_t*>(ks) + c * KS + w * 4;
        vd = reinterpret_cast<uint32_t*>(vs) + c * KS + w * 4;
      }
      kd[0] = span.k[k].x, kd[1] = span.k[k].y, kd[2] = span.k[k].z, kd[3] = span.k[k].w;
      vd[0] = span.v[k].x, vd[1] = span.v[k].y, vd[2] = span.v[k].z, vd[3] = span.v[k].w;
    }
#pragma unroll
    for (int k = 0; k < Q_ITERS; ++k) qs[threadIdx.x + k * kThreads] = qreg[k];
    __syncthreads();

    // Each warp takes RPW query rows at a time: every key/value element read from shared memory
    // serves RPW rows, and the rows' arithmetic chains are independent (latency, not work, bounds
    // a block this small).
    float* pw = ps + warp * RPW * S;  // this warp's probabilities [RPW][S]
    for (int i0 = warp * RPW; i0 < nr; i0 += kWarps * RPW) {
      const uint8_t* mrow[RPW];
      bool valid[RPW];
#pragma unroll
      for (int rr = 0; rr < RPW; ++rr) {
        valid[rr] = i0 + rr < nr;
        mrow[rr] = ms + (valid[rr] ? (r0 + i0 + rr) / G - t_lo : 0) * S;
      }
      // Scores: lane handles keys lane + 32 kk.
      float sc[RPW][Sh::KPL];
#pragma unroll
      for (int kk = 0; kk < Sh::KPL; ++kk) {
        const int j = lane + 32 * kk;
        const T* krow = ks + j * KS;
        float a[RPW];
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) a[rr] = 0.f;
#pragma unroll 8
        for (int d = 0; d < D; d += 2) {
          const float2 kv = load2(krow + d);
#pragma unroll
          for (int rr = 0; rr < RPW; ++rr) {
            const float2 qv = *reinterpret_cast<const float2*>(qs + (i0 + rr) * D + d);
            a[rr] = fmaf(qv.x, kv.x, a[rr]);
            a[rr] = fmaf(qv.y, kv.y, a[rr]);
          }
        }
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) sc[rr][kk] = (valid[rr] && mrow[rr][j]) ? a[rr] : -INFINITY;
      }
      float mx[RPW], l[RPW];
#pragma unroll
      for (int rr = 0; rr < RPW; ++rr) {
        float m = -INFINITY;
#pragma unroll
        for (int kk = 0; kk < Sh::KPL; ++kk) m = fmaxf(m, sc[rr][kk]);
        mx[rr] = warp_max(m);
        float sum = 0.f;
#pragma unroll
        for (int kk = 0; kk < Sh::KPL; ++kk) {
          const float p = mx[rr] == -INFINITY ? 0.f : exp2f(sc[rr][kk] - mx[rr]);  // exp2(-inf) = 0: masked
          pw[rr * S + lane + 32 * kk] = p;
          sum += p;
        }
        l[rr] = warp_sum(sum);
      }
      __syncwarp();
      // Values: lane owns output dims lane_dim(lane, k). A key whose probability is 0 (masked) is
      // skipped rather than multiplied, so a NaN in a masked row stays out.
      float acc[RPW][Sh::DPL];
#pragma unroll
      for (int rr = 0; rr < RPW; ++rr)
#pragma unroll
        for (int k = 0; k < Sh::DPL; ++k) acc[rr][k] = 0.f;
#pragma unroll 4
      for (int j = 0; j < S; ++j) {
        const T* vrow = vs + j * KS;
        float2 vv[Sh::DPL / 2];
#pragma unroll
        for (int k = 0; k < Sh::DPL; k += 2) vv[k / 2] = load2(vrow + lane_dim<D>(lane, k));
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) {
          const float pj = pw[rr * S + j];
#pragma unroll
          for (int k = 0; k < Sh::DPL; k += 2) {
            acc[rr][k] = pj != 0.f ? fmaf(pj, vv[k / 2].x, acc[rr][k]) : acc[rr][k];
            acc[rr][k + 1] = pj != 0.f ? fmaf(pj, vv[k / 2].y, acc[rr][k + 1]) : acc[rr][k + 1];
          }
        }
      }
      __syncwarp();  // pw is rewritten by the next rows
#pragma unroll
      for (int rr = 0; rr < RPW; ++rr) {
        if (!valid[rr]) continue;
        float* out = partial(r0 + i0 + rr);
        if (mx[rr] == -INFINITY) {  // this row sees nothing in the span
          if (lane == 0) out[D] = -INFINITY;
          continue;
        }
#pragma unroll
        for (int k = 0; k < Sh::DPL; ++k) out[lane_dim<D>(lane, k)] = acc[rr][k];
        if (lane == 0) {
          out[D] = mx[rr];
          out[D + 1] = l[rr];
        }
      }
    }
  }
  if (arrivals != nullptr) merge_if_last<T, D>(arrivals, part, out, nsplit, r0, nr, query_row);
  // (else attn_combine_kernel merges the partials)
}

// ------------------------------------------------------------------ tensor-core split kernel

// 16-bit caches (bf16, fp16): the same spans, partials and merge as attn_split_kernel, with the
// two products on tensor cores (mma.sync m16n8k16, float32 accumulators). attn_split_kernel's
// CUDA-core dot products were 56 us of a 64-request, 16-node SmolLM2 layer on the H200 against
// 13 us for cuDNN's flash attention. A warp takes 16 query rows of a 64-row tile; the scores
// stay in registers, and the probabilities, rounded to the cache's type, are the A operand of
// the value product (their sum is taken of the rounded values, so the weights sum exactly to l).
// A query row's arithmetic still does not depend on the other rows of its tile (each output
// element is its own row's dot product), so plain and verify steps agree as before.
template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // Two probabilities rounded to bf16 (lo in the low half), and the rounded values back.
  static __device__ __forceinline__ uint32_t pack(float& lo, float& hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    const float2 f = __bfloat1622float2(v);
    lo = f.x, hi = f.y;
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float& lo, float& hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    const float2 f = __half22float2(v);
    lo = f.x, hi = f.y;
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// Four 8x8 matrices of 16-bit elements from shared memory (lane l gives the address of row l % 8
// of matrix l / 8); .trans hands each lane the transposed elements.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

template <int D>
struct MmaShape {
  static constexpr int S = kSpan<D>;  // the same spans as the CUDA-core kernel
  static constexpr int TR = 16 * kWarps;                // query rows per block: 16 per warp
  static constexpr int RS = D + 8;  // shared row stride in elements: 16-byte aligned rows, an odd
                                    // number of 16-byte units (ldmatrix reads without bank conflicts)
  static constexpr int NT = S / 8;  // key tiles of the score product
};

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32)
    attn_split_mma_kernel(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                          const int64_t* __restrict__ slots, int64_t max_len, const uint8_t* __restrict__ mask,
                          const int64_t* __restrict__ kv_lens, float* __restrict__ part, T* __restrict__ out,
                          int* __restrict__ arrivals, int T_, int H, int Hkv, int L, int nsplit, float qscale) {
  using Sh = MmaShape<D>;
  constexpr int S = Sh::S, TR = Sh::TR, RS = Sh::RS, NT = Sh::NT;
  __shared__ __align__(16) T ks[S * RS];
  __shared__ __align__(16) T vs[S * RS];
  __shared__ __align__(16) T qs[TR * RS];
  __shared__ __align__(16) uint8_t ms[TR * S];  // nt <= TR tokens' rows
  __shared__ uint8_t seen[S];                   // whether any row of the tile sees key c
  __shared__ int any_visible;

  const BlockTile<TR, S> tile(H, Hkv, T_, L, kv_lens);
  const int G = tile.G, split = tile.split, hkv = tile.hkv, r0 = tile.r0, nr = tile.nr, c0 = tile.c0, nc = tile.nc;
  const int t_lo = tile.t_lo, nt = tile.nt;
  const int64_t b = tile.b;
  if (nc == 0) {  // a span past kv_lens[b]: an empty partial, nothing loaded (most spans of short
                  // requests in a batch whose KV bucket a long one sets)
    empty_span<T, D>(tile, part, out, arrivals, nsplit);
    return;
  }
  constexpr int kThreads = kWarps * 32;

  // Loads first, all of them issued before any is waited for (see attn_split_kernel).
  MaskTile<TR, S> mtile;  // the mask rows of this tile's nt <= TR tokens
  mtile.load(mask + (b * T_ + t_lo) * L, L, c0, nc, nt);
  KvSpan<T, D, S> span;  // this span's K/V rows
  span.load(k_cache, v_cache, ((slots[b] * max_len + c0) * Hkv + hkv) * D, static_cast<int64_t>(Hkv) * D, nc);
  constexpr int PPR = KvSpan<T, D, S>::PPR;
  constexpr int KV_ITERS = KvSpan<T, D, S>::kIters;
  constexpr int Q_ITERS = TR * PPR / kThreads;
  uint4 qreg[Q_ITERS];
#pragma unroll
  for (int k = 0; k < Q_ITERS; ++k) {
    const int i = threadIdx.x + k * kThreads;
    const int r = i / PPR, w = i % PPR;
    const int t = (r0 + r) / G, g = (r0 + r) % G;
    qreg[k] = r < nr ? reinterpret_cast<const uint4*>(q + ((b * T_ + t) * H + hkv * G + g) * D)[w]
                     : make_uint4(0, 0, 0, 0);  // padding rows: zeros for the products
  }
  if (threadIdx.x == 0) any_visible = 0;
  __syncthreads();
  if (mtile.store(ms, nt)) any_visible = 1;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto query_row = [&](int r) { return tile.query_row(r); };
  auto partial = [&](int r) { return tile.template partial<D>(part, nsplit, r); };
  if (!any_visible) {  // the whole span is masked for these rows: an empty partial
    for (int i = threadIdx.x; i < nr; i += blockDim.x) partial(r0 + i)[D] = -INFINITY;
  } else {
    // A key no row of the tile sees gets zero K and V: a product multiplies every key (0 * NaN
    // is NaN, and a stale cache row may hold NaN), where the CUDA-core kernel skipped them.
    for (int c = threadIdx.x; c < S; c += kThreads) {
      int s = 0;
      for (int t = 0; t < nt; ++t) s |= ms[t * S + c];
      seen[c] = s != 0;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < KV_ITERS; ++k) {
      const int i = threadIdx.x + k * kThreads;
      const int c = i / PPR, w = i % PPR;
      const bool keep = seen[c];
      reinterpret_cast<uint4*>(ks + c * RS)[w] = keep ? span.k[k] : make_uint4(0, 0, 0, 0);
      reinterpret_cast<uint4*>(vs + c * RS)[w] = keep ? span.v[k] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < Q_ITERS; ++k) {
      const int i = threadIdx.x + k * kThreads;
      reinterpret_cast<uint4*>(qs + (i / PPR) * RS)[i % PPR] = qreg[k];
    }
    __syncthreads();

    const int w0 = warp * 16;  // this warp's first tile row
    if (w0 < nr) {
      const int g8 = lane / 4, t4 = lane % 4;  // fragment row group and column pair
      // Scores [16 rows, S keys] = q [16, D] . k^T, in NT tiles of 8 keys.
      float sc[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
        uint32_t qa0[4], qa1[4];
        ldsm_x4(qa0, qs + (w0 + lane % 16) * RS + kk * 16 + (lane / 16) * 8);
        ldsm_x4(qa1, qs + (w0 + lane % 16) * RS + (kk + 1) * 16 + (lane / 16) * 8);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          uint32_t kb[4];  // keys j * 8 .. + 7, dims kk * 16 .. + 31
          ldsm_x4(kb, ks + (j * 8 + lane % 8) * RS + kk * 16 + (lane / 8) * 8);
          Mma<T>::run(sc[j], qa0, kb[0], kb[1]);
          Mma<T>::run(sc[j], qa1, kb[2], kb[3]);
        }
      }
      // Rows ra (elements 0, 1 of a tile) and ra + 8 (elements 2, 3); columns j * 8 + 2 t4 + e.
      const int ra = w0 + g8, rb = ra + 8;
      const uint8_t* ma = ms + (ra < nr ? (r0 + ra) / G - t_lo : 0) * S;
      const uint8_t* mb = ms + (rb < nr ? (r0 + rb) / G - t_lo : 0) * S;
      float mxa = -INFINITY, mxb = -INFINITY;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = j * 8 + 2 * t4 + e;
          sc[j][e] = ra < nr && ma[c] ? sc[j][e] * qscale : -INFINITY;
          sc[j][2 + e] = rb < nr && mb[c] ? sc[j][2 + e] * qscale : -INFINITY;
          mxa = fmaxf(mxa, sc[j][e]);
          mxb = fmaxf(mxb, sc[j][2 + e]);
        }
      }
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {  // the 4 lanes of a row
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, o));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, o));
      }
      // Probabilities (exp2(-inf) = 0: masked), rounded to T as the value product takes them.
      uint32_t pa[NT][2];
      float la = 0.f, lb = 0.f;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        float p0 = mxa == -INFINITY ? 0.f : exp2f(sc[j][0] - mxa);
        float p1 = mxa == -INFINITY ? 0.f : exp2f(sc[j][1] - mxa);
        float p2 = mxb == -INFINITY ? 0.f : exp2f(sc[j][2] - mxb);
        float p3 = mxb == -INFINITY ? 0.f : exp2f(sc[j][3] - mxb);
        pa[j][0] = Mma<T>::pack(p0, p1);
        pa[j][1] = Mma<T>::pack(p2, p3);
        la += p0 + p1;
        lb += p2 + p3;
      }
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        la += __shfl_xor_sync(0xffffffffu, la, o);
        lb += __shfl_xor_sync(0xffffffffu, lb, o);
      }
      // Values: out [16 rows, D] = p [16, S] . v [S, D]; the score tiles 2 kc, 2 kc + 1 are
      // the A operand of keys kc * 16 .. + 15 as they lie in the registers.
      float acc[D / 8][4];
#pragma unroll
      for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < S / 16; ++kc) {
        const uint32_t a[4] = {pa[2 * kc][0], pa[2 * kc][1], pa[2 * kc + 1][0], pa[2 * kc + 1][1]};
#pragma unroll
        for (int n0 = 0; n0 < D; n0 += 16) {
          uint32_t vb[4];  // keys kc * 16 .. + 15, dims n0 .. n0 + 15
          ldsm_x4_trans(vb, vs + (kc * 16 + lane % 8 + ((lane / 8) % 2) * 8) * RS + n0 + (lane / 16) * 8);
          Mma<T>::run(acc[n0 / 8], a, vb[0], vb[1]);
          Mma<T>::run(acc[n0 / 8 + 1], a, vb[2], vb[3]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = h ? rb : ra;
        const float m = h ? mxb : mxa, l = h ? lb : la;
        if (r >= nr) continue;
        float* o = partial(r0 + r);
        if (m == -INFINITY) {  // this row sees nothing in the span
          if (t4 == 0) o[D] = -INFINITY;
          continue;
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
          *reinterpret_cast<float2*>(o + n * 8 + 2 * t4) = make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
        if (t4 == 0) o[D] = m, o[D + 1] = l;
      }
    }
  }
  if (arrivals != nullptr) merge_if_last<T, D>(arrivals, part, out, nsplit, r0, nr, query_row);
  // (else attn_combine_kernel merges the partials)
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32)
    attn_combine_kernel(const float* __restrict__ part, T* __restrict__ out, int64_t nrows, int nsplit) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= nrows) return;
  combine_row<T, D>(part + row * nsplit * (D + 2), out + row * D, nsplit, threadIdx.x % 32);
}

using ngk::kBF16;
using ngk::kF16;
using ngk::kF32;

template <typename T, int D>
int launch_attention(const void* q, const void* k_cache, const void* v_cache, const int64_t* slots,
                     int64_t max_len, const uint8_t* mask, const int64_t* kv_lens, float* part, void* out,
                     int* arrivals, int64_t arrivals_len, int bs, int T_, int H, int Hkv, int L, float scale,
                     cudaStream_t stream) {
  // 16-bit caches take the tensor-core kernel (64-row tiles); float32 the CUDA-core one. Both
  // write the same partials over the same spans.
  constexpr bool kMma = sizeof(T) == 2;
  constexpr int TR = [] {
    if constexpr (kMma) return MmaShape<D>::TR;
    else return Shape<T, D>::TR;
  }();
  const int nsplit = (L + kSpan<D> - 1) / kSpan<D>;
  const int tiles = (H / Hkv * T_ + TR - 1) / TR;
  NGK_REQUIRE(static_cast<int64_t>(Hkv) * tiles <= 65535);
  const dim3 grid(nsplit, Hkv * tiles, bs);
  const float qscale = scale * 1.4426950408889634f;  // scores in log2 units: exp2 in the kernels
  // The split kernel merges the partials itself where the arrival counters cover the grid and a
  // tile has at most 2 query rows per warp (a decode step: G heads of one token). With more, the
  // last block's merge of its rows became a serial tail (SmolLM2 verify steps of 16 nodes: 13-16%
  // slower on the H200), and the merge kernel spreads the rows over the GPU instead.
  const bool fused = arrivals != nullptr && static_cast<int64_t>(bs) * Hkv * tiles <= arrivals_len &&
                     H / Hkv * T_ <= 2 * kWarps;
  if constexpr (kMma) {
    attn_split_mma_kernel<T, D><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), slots, max_len,
        mask, kv_lens, part, static_cast<T*>(out), fused ? arrivals : nullptr, T_, H, Hkv, L, nsplit, qscale);
  } else {
    attn_split_kernel<T, D><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), slots, max_len,
        mask, kv_lens, part, static_cast<T*>(out), fused ? arrivals : nullptr, T_, H, Hkv, L, nsplit, qscale);
  }
  NGK_CHECK_LAUNCH();
  if (fused) return 0;
  const int64_t nrows = static_cast<int64_t>(bs) * T_ * H;
  attn_combine_kernel<T, D><<<static_cast<unsigned>((nrows + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
      part, static_cast<T*>(out), nrows, nsplit);
  NGK_CHECK_LAUNCH();
  return 0;
}

template <int D>
int dispatch_attention(int dtype, const void* q, const void* k_cache, const void* v_cache, const int64_t* slots,
                       int64_t max_len, const uint8_t* mask, const int64_t* kv_lens, float* part, void* out,
                       int* arrivals, int64_t arrivals_len, int bs, int T_, int H, int Hkv, int L, float scale,
                       cudaStream_t stream) {
  switch (dtype) {
    case kF32:
      return launch_attention<float, D>(q, k_cache, v_cache, slots, max_len, mask, kv_lens, part, out, arrivals,
                                        arrivals_len, bs, T_, H, Hkv, L, scale, stream);
    case kF16:
      return launch_attention<__half, D>(q, k_cache, v_cache, slots, max_len, mask, kv_lens, part, out, arrivals,
                                         arrivals_len, bs, T_, H, Hkv, L, scale, stream);
    case kBF16:
      return launch_attention<__nv_bfloat16, D>(q, k_cache, v_cache, slots, max_len, mask, kv_lens, part, out, arrivals,
                                                arrivals_len, bs, T_, H, Hkv, L, scale, stream);
  }
  return ngk::record_arg_error(__FILE__, __LINE__, "dtype must be 0 (float32), 1 (float16) or 2 (bfloat16)");
}

}  // namespace


// Splits of S cache rows (S = 64 for head_dim 64, 32 for 128): ``partials`` holds
// bs * T * num_heads * ceil(kv_len / S) * (head_dim + 2) floats (verifier/kernels/ops.py sizes it).
// ``arrivals``: arrivals_len zeroed int32 counters owned by the caller (the KV cache), left zeroed
// by every call, never used by two calls at once; with enough of them (bs * num_kv_heads * row
// tiles) and at most 8 query rows per kv head, the partials are merged by the split kernel itself,
// else (or null) by a second kernel, with the same arithmetic. ``kv_lens``: null, or [bs] int64: rows
// at or past kv_lens[b] are masked for request b whatever the mask says, and never read.
extern "C" int ngk_decode_attention(int dtype, const void* q, const void* k_cache, const void* v_cache,
                                    const int64_t* slots, int64_t max_len, const void* mask,
                                    const int64_t* kv_lens, float* partials,
                                    void* out, int* arrivals, int64_t arrivals_len, int batch_size,
                                    int num_tokens, int num_heads, int num_kv_heads, int head_dim, int kv_len,
                                    float scale, cudaStream_t stream) {
  NGK_REQUIRE(num_tokens >= 1 && num_tokens <= kMaxT);
  NGK_REQUIRE(num_kv_heads >= 1 && num_heads % num_kv_heads == 0);
  NGK_REQUIRE(head_dim == 64 || head_dim == 128);
  NGK_REQUIRE(kv_len >= 1 && kv_len <= max_len);
  NGK_REQUIRE(batch_size >= 0 && batch_size <= 65535);
  if (batch_size == 0) return 0;
  const auto* m = static_cast<const uint8_t*>(mask);
  if (head_dim == 64) {
    return dispatch_attention<64>(dtype, q, k_cache, v_cache, slots, max_len, m, kv_lens, partials, out, arrivals,
                                  arrivals_len, batch_size, num_tokens, num_heads, num_kv_heads, kv_len, scale,
                                  stream);
  }
  return dispatch_attention<128>(dtype, q, k_cache, v_cache, slots, max_len, m, kv_lens, partials, out, arrivals,
                                 arrivals_len, batch_size, num_tokens, num_heads, num_kv_heads, kv_len, scale,
                                 stream);
}
