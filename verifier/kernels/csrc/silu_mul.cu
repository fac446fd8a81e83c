// SwiGLU's activation on the fused gate/up projection: out[r, j] = silu(g[r, j]) * u[r, j], where
// row r of the input holds the I gate values, then the I up values.
//
// Computed in float32 and rounded once to the tensor's type, as the compiled torch version
// (verifier.model.fusion.silu_mul under torch.compile) does. That Triton kernel, compiled for
// dynamic shapes, moved about 1.1 TB/s on the H200: 8.6 us per layer at 64 x 16 tree nodes of
// SmolLM2, 256 us of a 2.4 ms verify step. This one reads and writes 16 bytes per thread per
// access: 101 us (3.4 us per layer, about 2.8 TB/s).
#include "common.cuh"
#include "dtypes.cuh"

namespace {

using ngk::from_f;
using ngk::to_f;

constexpr int kThreads = 256;

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.f + expf(-g)) * u; }

// One thread per 16 bytes of output (kVec elements); ``cols`` = I / kVec vectors per row.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    silu_mul_vec_kernel(const T* __restrict__ in, T* __restrict__ out, int64_t n_vec, int64_t cols, int64_t I) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (v >= n_vec) return;
  const int64_t r = v / cols, c = (v - r * cols) * kVec;
  const uint4 graw = *reinterpret_cast<const uint4*>(in + r * 2 * I + c);
  const uint4 uraw = *reinterpret_cast<const uint4*>(in + r * 2 * I + I + c);
  const T* g = reinterpret_cast<const T*>(&graw);
  const T* u = reinterpret_cast<const T*>(&uraw);
  uint4 oraw;
  T* o = reinterpret_cast<T*>(&oraw);
#pragma unroll
  for (int k = 0; k < kVec; ++k) o[k] = from_f<T>(silu_times(to_f(g[k]), to_f(u[k])));
  *reinterpret_cast<uint4*>(out + r * I + c) = oraw;
}

// Any I or alignment: one element per thread.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    silu_mul_kernel(const T* __restrict__ in, T* __restrict__ out, int64_t n, int64_t I) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= n) return;
  const int64_t r = e / I, c = e - r * I;
  out[e] = from_f<T>(silu_times(to_f(in[r * 2 * I + c]), to_f(in[r * 2 * I + I + c])));
}

template <typename T>
int launch(const void* in_, void* out_, int64_t rows, int64_t I, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* in = static_cast<const T*>(in_);
  T* out = static_cast<T*>(out_);
  const bool vec = I % kVec == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t n = vec ? rows * (I / kVec) : rows * I;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  NGK_REQUIRE(blocks <= 0x7fffffff);
  if (vec) {
    silu_mul_vec_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, out, n, I / kVec, I);
  } else {
    silu_mul_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, out, n, I);
  }
  NGK_CHECK_LAUNCH();
  return 0;
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16. in [rows, 2 I] contiguous (gate, then up); out [rows, I].
extern "C" int ngk_silu_mul(int dtype, const void* in, void* out, int64_t rows, int64_t I, cudaStream_t stream) {
  NGK_REQUIRE(rows >= 0 && I >= 1);
  NGK_REQUIRE(dtype == ngk::kF32 || dtype == ngk::kF16 || dtype == ngk::kBF16);
  if (rows == 0) return 0;
  if (dtype == ngk::kF16) return launch<__half>(in, out, rows, I, stream);
  if (dtype == ngk::kBF16) return launch<__nv_bfloat16>(in, out, rows, I, stream);
  return launch<float>(in, out, rows, I, stream);
}
