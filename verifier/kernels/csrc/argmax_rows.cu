// Greedy verification's per-row reductions in one kernel: the argmax of every logits row and
// whether the row holds a NaN or an infinity (such a row is zeroed in place and its argmax is 0,
// as numerics.nonfinite_rows + torch.argmax give). In torch these were four kernels per step
// (isfinite, any, masked_fill, argmax), 20 us of a 1 ms SmolLM2 step on the H200: a torch argmax
// of one 49,152-wide row runs on one block.
//
// Logits come in float32 or in the model's 16-bit type. Every 16-bit value converts to float32
// exactly, so the argmax, the ties and the non-finite rows are those of the float32 copy; the
// greedy step graph reads the LM head's bf16 output directly instead of first writing a float32
// copy of it (at 64 x 16 tree nodes that copy was 300 MB of traffic, 146 us of a 2.4 ms step).
#include <math.h>

#include "common.cuh"
#include "dtypes.cuh"

namespace {

using ngk::to_f;

constexpr int kThreads = 1024;

// The larger value wins; equal values keep the lower index (torch.argmax: the first maximum).
__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i)) v = v2, i = i2;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    argmax_rows_kernel(T* __restrict__ logits, int64_t V, int64_t* __restrict__ out_idx,
                       uint8_t* __restrict__ out_bad) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  __shared__ int sbad;
  T* row = logits + blockIdx.x * V;
  float best = -INFINITY;
  int idx = 0x7fffffff;
  int bad = 0;
  const bool vec = (V % kVec == 0) && (reinterpret_cast<uintptr_t>(row) % 16 == 0);
  if (vec) {
    const uint4* r16 = reinterpret_cast<const uint4*>(row);
    for (int64_t j = threadIdx.x; j < V / kVec; j += kThreads) {
      const uint4 raw = r16[j];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float x = to_f(e[k]);
        bad |= !isfinite(x);
        if (x > best) best = x, idx = static_cast<int>(kVec * j + k);  // increasing j: first max kept
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) {
      const float x = to_f(row[j]);
      bad |= !isfinite(x);
      if (x > best) best = x, idx = static_cast<int>(j);
    }
  }
  if (threadIdx.x == 0) sbad = 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    better(best, idx, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, idx, o));
  }
  bad = __any_sync(0xffffffffu, bad);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // sbad = 0 before any warp sets it
  if (lane == 0) {
    sv[warp] = best, si[warp] = idx;
    if (bad) sbad = 1;
  }
  __syncthreads();
  if (sbad) {  // rare: zero the row, as nonfinite_rows does
    for (int64_t j = threadIdx.x; j < V; j += kThreads) row[j] = T(0.f);
    if (threadIdx.x == 0) out_idx[blockIdx.x] = 0, out_bad[blockIdx.x] = 1;
    return;
  }
  if (warp == 0) {
    best = sv[lane], idx = si[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      better(best, idx, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, idx, o));
    }
    if (lane == 0) {
      // A row of -inf only is non-finite (caught above), so idx is a real index here.
      out_idx[blockIdx.x] = idx;
      out_bad[blockIdx.x] = 0;
    }
  }
}

template <typename T>
int launch(void* logits, int64_t rows, int64_t V, int64_t* out_idx, uint8_t* out_bad, cudaStream_t stream) {
  argmax_rows_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(static_cast<T*>(logits), V, out_idx,
                                                                              out_bad);
  NGK_CHECK_LAUNCH();
  return 0;
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16 (dtypes.cuh). logits [rows, V],
// contiguous (rows with a NaN or inf are zeroed in place); out_idx [rows] int64; out_bad [rows] bool.
extern "C" int ngk_argmax_rows(int dtype, void* logits, int64_t rows, int64_t V, int64_t* out_idx, uint8_t* out_bad,
                               cudaStream_t stream) {
  NGK_REQUIRE(rows >= 0 && V >= 1 && V < 0x7fffffff);
  NGK_REQUIRE(rows <= 0x7fffffff);
  NGK_REQUIRE(dtype == ngk::kF32 || dtype == ngk::kF16 || dtype == ngk::kBF16);
  if (rows == 0) return 0;
  if (dtype == ngk::kF16) return launch<__half>(logits, rows, V, out_idx, out_bad, stream);
  if (dtype == ngk::kBF16) return launch<__nv_bfloat16>(logits, rows, V, out_idx, out_bad, stream);
  return launch<float>(logits, rows, V, out_idx, out_bad, stream);
}
