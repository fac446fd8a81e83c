// A linear layer for the few rows of a decode or small verify step, with the layer's RMSNorm
// (and the residual add before it) as its prologue and SwiGLU's activation as its epilogue.
//
// Why: at batch 1 a step of SmolLM2-135M is bound by the number of kernels (30 layers, each a
// few microseconds of work), and a step of an 8B model by how close its matmuls come to the
// weight-read time. In torch a layer's MLP half is add + RMSNorm, the gate/up matmul, SiLU * up
// and the down matmul; here it is two kernels, and the attention half's norm goes into the qkv
// projection the same way.
//
//   y = epilogue( prologue(x) @ W^T + bias )
//   prologue: none | rms: w * rmsnorm(x) | add_rms: s = x + residual (written out), w * rmsnorm(s)
//   epilogue: none | silu_mul: W has 2I rows (gate, then up), y[:, j] = silu(g_j) * u_j
//
// The norm is folded into the matmul: rmsnorm(s) @ W^T = rstd * ((w * s) @ W^T), with rstd =
// 1 / sqrt(mean(s^2) + eps) summed from the same loads of s as the matmul's operand, and applied
// to the float32 sums. So the rows are never staged or normalised before the matmul starts (no
// extra pass, no synchronisation, no limit on K). Rounding: s = x + residual rounded to the
// model's dtype (as torch's add), w * s rounded once (eager torch rounds s * rstd, then w times
// that: the results differ by about one rounding of the dtype); the sums rounded before SiLU and
// the product, as torch's. bfloat16 only with a norm: w * s unnormalised could overflow float16.
//
// The matmul runs on the tensor cores (mma.sync m16n8k16, float32 accumulation): a block owns 8
// output columns (16 for qkv, or with silu_mul 8 gate + their 8 up columns) of 8 rows, a warp a
// contiguous quarter of K; the block's 4 warps add their partial sums in a fixed order. Each lane loads 16
// contiguous bytes of a weight row per 32-wide slice of K: within a slice the k order of the two
// MMAs is permuted (A and B the same way), which a sum does not notice, so no shuffles or shared
// memory are needed to build the fragments. A row's result never depends on the other rows (each
// row group is its own block, zero rows fill the tile, the K split is fixed): a token computes the
// same in a decode step of one request, in a batch, and in a verify step, which keeps greedy
// speculative output equal to plain decoding.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kMaxRows = 32;  // rows per call (row groups of 8): checks.NORM_LINEAR_MAX_ROWS

enum : int { kNone = 0, kRms = 1, kAddRms = 2 };

template <typename T> struct Vec;
template <> struct Vec<__nv_bfloat16> {
  static __device__ __forceinline__ float2 to_f2(uint32_t v) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  }
  static __device__ __forceinline__ uint32_t from_f2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
  static __device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ void mma(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};
template <> struct Vec<__half> {
  static __device__ __forceinline__ float2 to_f2(uint32_t v) {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
  static __device__ __forceinline__ uint32_t from_f2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float round(float x) { return __half2float(__float2half_rn(x)); }
  static __device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
  static __device__ __forceinline__ void mma(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// Weights are read once per call: keep them out of L1.
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 load_vec(const void* p) { return *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// s = x + residual, rounded (8 elements).
template <typename T>
__device__ __forceinline__ uint4 add_round(uint4 x, uint4 r) {
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = Vec<T>::to_f2(word(x, i)), b = Vec<T>::to_f2(word(r, i));
    o[i] = Vec<T>::from_f2(b.x + a.x, b.y + a.y);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// w * s, rounded (8 elements).
template <typename T>
__device__ __forceinline__ uint4 scale_round(uint4 s, uint4 w) {
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = Vec<T>::to_f2(word(s, i)), g = Vec<T>::to_f2(word(w, i));
    o[i] = Vec<T>::from_f2(g.x * a.x, g.y * a.y);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

template <typename T>
__device__ __forceinline__ float sum_squares(uint4 s) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Vec<T>::to_f2(word(s, i));
    ss += f.x * f.x + f.y * f.y;
  }
  return ss;
}

// One block computes CT tiles of 8 output columns (16 with silu_mul) for one group of 8 rows
// (blockIdx.y); rows 8 .. 15 of the MMA tile are zeros. A call of M rows runs ceil(M / 8) row groups
// side by side, each the work of a call of at most 8 rows. (A tile of 16 real rows made every lane
// load and normalise two rows, serially, in every one of the N / 8 blocks: a SmolLM2 layer's four
// projections took 1.26x at 16 rows what they take at 8, 1.85-2.0x at 17-32; as row groups 1.14x and
// 1.47-1.59x, H200, one layer's weights in L2.) The weights are read once per row group (mostly L2
// hits after the first).
template <typename T, int PRO, bool SILU, int CT>
__global__ void __launch_bounds__(kWarps * 32)
    norm_linear_kernel(const T* __restrict__ x, const T* __restrict__ residual, T* __restrict__ residual_out,
                       const T* __restrict__ norm_w, float eps, const T* __restrict__ W, const T* __restrict__ bias,
                       T* __restrict__ y, int M, int N, int K) {
  constexpr int NT = SILU ? 2 : 1;  // weight tiles per column tile: the gate columns and their up columns
  constexpr int TT = CT * NT;        // weight tiles per warp (tile j * NT + t)
  // 32-wide K slices per group: a warp keeps two groups of weight loads in flight.
  static_assert(TT <= 2, "at most two weight tiles per warp (registers)");
  constexpr int kUnroll = (TT == 1 && PRO == kNone) ? 8 : 4;
  __shared__ float red[kWarps - 1][TT][2][32];
  __shared__ float ss_s[kWarps][8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int n0 = blockIdx.x * 8 * CT, row = blockIdx.y * 8 + g;  // this lane's A row and output row
  const bool row_ok = row < M;
  const int nslices = K / 32, begin = warp * nslices / kWarps, end = (warp + 1) * nslices / kWarps;

  const T* wrow[TT];
#pragma unroll
  for (int j = 0; j < CT; ++j)
#pragma unroll
    for (int t = 0; t < NT; ++t) wrow[j * NT + t] = W + (static_cast<int64_t>(n0 + 8 * j + g + t * N)) * K + 8 * q;
  // kUnroll slices of weights per group, two groups in flight: the next group's loads are issued
  // before this group's MMAs (slices past `end` are skipped).
  uint4 b0[kUnroll][TT], b1[kUnroll][TT];
  auto load_b = [&](uint4 (&b)[kUnroll][TT], int c) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int t = 0; t < TT; ++t)
        if (c + u < end) b[u][t] = load_stream(wrow[t] + 32 * (c + u));
  };
  load_b(b0, begin);

  float acc[TT][4];
  float ss = 0.f;  // this lane's part of its row's sum of squares (a norm)
#pragma unroll
  for (int t = 0; t < TT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;

  // One group: every A load first (one latency for the group), then the MMAs. In a 32-wide slice
  // c, lane (g, q) holds k = 32c + 8q .. +8 of weight row g and of A row g; the first MMA takes
  // elements 0..3 as logical k (2q, 2q+1 | 2q+8, 2q+9), the second elements 4..7.
  const int64_t row_at = static_cast<int64_t>(row) * K + 8 * q;
  auto compute = [&](const uint4 (&b)[kUnroll][TT], int c) {
    uint4 a[kUnroll], r[kUnroll], w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool ok = row_ok && c + u < end;
      if constexpr (PRO != kNone) {
        if (c + u < end) w[u] = load_vec(norm_w + 32 * (c + u) + 8 * q);
      }
      a[u] = ok ? load_vec(x + row_at + 32 * (c + u)) : make_uint4(0u, 0u, 0u, 0u);
      if constexpr (PRO == kAddRms) r[u] = ok ? load_vec(residual + row_at + 32 * (c + u)) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (c + u >= end) break;
      uint4 v = a[u];
      if constexpr (PRO == kAddRms) {
        v = add_round<T>(v, r[u]);
        // Slice c of the residual stream is written by one block of the row group (c mod grid).
        if (row_ok && (c + u) % gridDim.x == blockIdx.x) {
          *reinterpret_cast<uint4*>(residual_out + row_at + 32 * (c + u)) = v;
        }
      }
      if constexpr (PRO != kNone) {
        ss += sum_squares<T>(v);
        v = scale_round<T>(v, w[u]);
      }
#pragma unroll
      for (int t = 0; t < TT; ++t) {  // A rows 8 .. 15 are zeros
        Vec<T>::mma(acc[t], v.x, 0u, v.y, 0u, b[u][t].x, b[u][t].y);
        Vec<T>::mma(acc[t], v.z, 0u, v.w, 0u, b[u][t].z, b[u][t].w);
      }
    }
  };

  for (int c = begin; c < end; c += 2 * kUnroll) {
    load_b(b1, c + kUnroll);
    compute(b0, c);
    load_b(b0, c + 2 * kUnroll);
    compute(b1, c + kUnroll);
  }

  if (warp > 0) {  // the accumulators of rows 0 .. 7: c[0], c[1]
#pragma unroll
    for (int t = 0; t < TT; ++t)
#pragma unroll
      for (int i = 0; i < 2; ++i) red[warp - 1][t][i][lane] = acc[t][i];
  }
  if constexpr (PRO != kNone) {  // row g's squares: the 4 lanes of the row, then the warps in order
    float v = ss;
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if (q == 0) ss_s[warp][g] = v;
  }
  __syncthreads();
  if (warp != 0 || !row_ok) return;
  float rstd = 1.f;
  if constexpr (PRO != kNone) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t += ss_s[w][g];
    rstd = rsqrtf(t / static_cast<float>(K) + eps);
  }
#pragma unroll
  for (int j = 0; j < CT; ++j) {  // column tile j: columns n0 + 8 j .. + 8
    float out[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = n0 + 8 * j + 2 * q + e;
      float v[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float s = acc[j * NT + t][e];
#pragma unroll
        for (int w = 0; w < kWarps - 1; ++w) s += red[w][j * NT + t][e][lane];
        v[t] = s * rstd;
      }
      if constexpr (SILU) {
        const float gate = Vec<T>::round(v[0]), up = Vec<T>::round(v[NT - 1]);
        out[e] = Vec<T>::round(gate / (1.f + __expf(-gate))) * up;
      } else {
        out[e] = bias != nullptr ? v[0] + Vec<T>::to_f(bias[col]) : v[0];
      }
    }
    T* out_at = y + static_cast<int64_t>(row) * N + n0 + 8 * j + 2 * q;
    *reinterpret_cast<uint32_t*>(out_at) = Vec<T>::from_f2(out[0], out[1]);
  }
}

template <typename T, int PRO>
int launch_silu(bool silu, const void* x, const void* residual, void* residual_out, const void* norm_w, float eps,
                const void* W, const void* bias, void* y, int M, int N, int K, cudaStream_t stream) {
  auto run = [&](auto kernel, int ct) -> int {
    const dim3 grid(N / (8 * ct), (M + 7) / 8), block(kWarps * 32);
    kernel<<<grid, block, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(residual),
                                          static_cast<T*>(residual_out), static_cast<const T*>(norm_w), eps,
                                          static_cast<const T*>(W), static_cast<const T*>(bias), static_cast<T*>(y),
                                          M, N, K);
    NGK_CHECK_LAUNCH();
    return 0;
  };
  // Two column tiles per block where the prologue normalises the rows (qkv): the loads of x and the
  // residual, the add and the norm are repeated by every column block, and two tiles halve them. Not
  // with SwiGLU (a warp already has two weight tiles) or without a norm: there half as many blocks
  // cost more. (H100, SmolLM2, batch-1 step kernel tables with two tiles everywhere: qkv 174 -> 157 us
  // at one node, 221 -> 189 at 16; o + down 172 -> 205 at one node, gate/up 156 -> 174.) The choice
  // depends on the projection, never on M: a token computes the same in every step.
  if constexpr (PRO != kNone) {
    if (!silu && N % 16 == 0) return run(norm_linear_kernel<T, PRO, false, 2>, 2);
  }
  return silu ? run(norm_linear_kernel<T, PRO, true, 1>, 1) : run(norm_linear_kernel<T, PRO, false, 1>, 1);
}

template <typename T>
int launch_rows(int prologue, bool silu, const void* x, const void* residual, void* residual_out, const void* norm_w,
                float eps, const void* W, const void* bias, void* y, int M, int N, int K, cudaStream_t stream) {
  if constexpr (std::is_same<T, __half>::value) {  // float16: no norm (checked by the caller)
    return launch_silu<T, kNone>(silu, x, residual, residual_out, norm_w, eps, W, bias, y, M, N, K, stream);
  } else {
    switch (prologue) {
      case kNone:
        return launch_silu<T, kNone>(silu, x, residual, residual_out, norm_w, eps, W, bias, y, M, N, K, stream);
      case kRms:
        return launch_silu<T, kRms>(silu, x, residual, residual_out, norm_w, eps, W, bias, y, M, N, K, stream);
      default:
        return launch_silu<T, kAddRms>(silu, x, residual, residual_out, norm_w, eps, W, bias, y, M, N, K, stream);
    }
  }
}

}  // namespace

// dtype: 1 float16, 2 bfloat16. x [M, K]; residual, residual_out [M, K] (prologue 2); norm_w [K]
// (prologues 1, 2); W [N_w, K] with N_w = 2 N for silu, else N; bias [N] or null (not with silu);
// y [M, N]. All contiguous and 16-byte aligned; K % 32 == 0, N % 8 == 0, 1 <= M <= 32; a prologue
// needs bfloat16.
extern "C" int ngk_norm_linear(int dtype, int prologue, int silu, const void* x, const void* residual,
                               void* residual_out, const void* norm_w, float eps, const void* W, const void* bias,
                               void* y, int M, int N, int K, cudaStream_t stream) {
  NGK_REQUIRE(M >= 0 && M <= kMaxRows);
  NGK_REQUIRE(N > 0 && N % 8 == 0 && K > 0 && K % 32 == 0);
  NGK_REQUIRE(prologue >= kNone && prologue <= kAddRms);
  NGK_REQUIRE(!(silu && bias != nullptr));
  NGK_REQUIRE(prologue == kNone || dtype == 2);
  if (M == 0) return 0;
  switch (dtype) {
    case 1:
      return launch_rows<__half>(prologue, silu != 0, x, residual, residual_out, norm_w, eps, W, bias, y, M, N, K,
                                 stream);
    case 2:
      return launch_rows<__nv_bfloat16>(prologue, silu != 0, x, residual, residual_out, norm_w, eps, W, bias, y, M,
                                        N, K, stream);
  }
  return ngk::record_arg_error(__FILE__, __LINE__, "dtype must be 1 (float16) or 2 (bfloat16)");
}
