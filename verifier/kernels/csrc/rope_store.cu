// RoPE and the KV-cache store of a decode/verify layer in one kernel (the attention that reads
// the cache: decode_attention.cu).
//
// q and k are rotated (HF "rotate half" layout, in float32, rounded once), q is written to its own
// buffer, k and v straight into the request's cache rows (verifier.model.kv_cache: row r of slot s
// at s * max_len + r).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common.cuh"
#include "dtypes.cuh"

namespace {

using ngk::from_f;
using ngk::to_f;
using ngk::kBF16;
using ngk::kF16;
using ngk::kF32;

template <typename T>
__global__ void __launch_bounds__(256)
    rope_store_kernel(const T* __restrict__ qkv, const int64_t* __restrict__ positions,
                      const T* __restrict__ cos, const T* __restrict__ sin,
                      const int64_t* __restrict__ rows, T* __restrict__ q_out, T* __restrict__ k_cache,
                      T* __restrict__ v_cache, int H, int Hkv, int D) {
  const int64_t n = blockIdx.x;  // token b * T + t
  const int half = D / 2;
  const T* src = qkv + n * static_cast<int64_t>(H + 2 * Hkv) * D;
  const T* c = cos + positions[n] * D;
  const T* s = sin + positions[n] * D;
  const int64_t row = rows[n];
  // A token's items: the rotated pairs (the H query heads, then the Hkv key heads; element j pairs
  // with j + D/2), then the Hkv * D values copied. blockIdx.y splits them, so a thread has about
  // one item: a loop of dependent load -> store trips, one memory latency each, made this kernel
  // 5.6 us of a 8B-shaped decode layer (40 heads of 64 pairs on one block).
  const int rot = (H + Hkv) * half, items = rot + Hkv * D;
  for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < items; i += gridDim.y * blockDim.x) {
    if (i < rot) {
      const int h = i / half, j = i % half;
      const float x1 = to_f(src[h * D + j]), x2 = to_f(src[h * D + j + half]);
      T* dst = h < H ? q_out + (n * H + h) * D : k_cache + (row * Hkv + (h - H)) * D;
      dst[j] = from_f<T>(x1 * to_f(c[j]) - x2 * to_f(s[j]));
      dst[j + half] = from_f<T>(x2 * to_f(c[j + half]) + x1 * to_f(s[j + half]));
    } else {
      const int v = i - rot;
      v_cache[row * Hkv * D + v] = src[(H + Hkv) * D + v];
    }
  }
}

template <typename T>
int launch_rope_store(const void* qkv, const int64_t* positions, const void* cos, const void* sin,
                      const int64_t* rows, void* q_out, void* k_cache, void* v_cache, int n, int H,
                      int Hkv, int D, cudaStream_t stream) {
  const int items = (H + Hkv) * (D / 2) + Hkv * D;
  const dim3 grid(n, static_cast<unsigned>(std::min(64, (items + 255) / 256)));
  rope_store_kernel<T><<<grid, 256, 0, stream>>>(
      static_cast<const T*>(qkv), positions, static_cast<const T*>(cos), static_cast<const T*>(sin), rows,
      static_cast<T*>(q_out), static_cast<T*>(k_cache), static_cast<T*>(v_cache), H, Hkv, D);
  NGK_CHECK_LAUNCH();
  return 0;
}

}  // namespace

extern "C" int ngk_rope_store_kv(int dtype, const void* qkv, const int64_t* positions, const void* cos,
                                 const void* sin, const int64_t* rows, void* q_out, void* k_cache, void* v_cache,
                                 int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                                 cudaStream_t stream) {
  NGK_REQUIRE(num_tokens >= 0 && num_heads >= 1 && num_kv_heads >= 1);
  NGK_REQUIRE(head_dim >= 2 && head_dim % 2 == 0);
  if (num_tokens == 0) return 0;
  switch (dtype) {
    case kF32:
      return launch_rope_store<float>(qkv, positions, cos, sin, rows, q_out, k_cache, v_cache, num_tokens,
                                      num_heads, num_kv_heads, head_dim, stream);
    case kF16:
      return launch_rope_store<__half>(qkv, positions, cos, sin, rows, q_out, k_cache, v_cache, num_tokens,
                                       num_heads, num_kv_heads, head_dim, stream);
    case kBF16:
      return launch_rope_store<__nv_bfloat16>(qkv, positions, cos, sin, rows, q_out, k_cache, v_cache,
                                              num_tokens, num_heads, num_kv_heads, head_dim, stream);
  }
  return ngk::record_arg_error(__FILE__, __LINE__, "dtype must be 0 (float32), 1 (float16) or 2 (bfloat16)");
}
