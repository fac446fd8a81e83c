// Attention masks for verifying a draft tree on top of a cached prefix, for the whole batch in
// one launch (SGLang builds these with a Python loop over requests).
//
// Request b has prefix_lens[b] cached tokens; its K tree tokens (root first) are appended after
// them. Query row i (tree node i) may attend to key column c iff
//     c < prefix_len                                          (the whole prefix), or
//     0 <= c - prefix_len < K and tree_mask[b, i, c - prefix_len]   (its ancestors and itself).
// Two layouts of that predicate:
//   dense: out[b, i, c] for c in [0, kv_len): a padded boolean mask for SDPA / flex_attention
//          over a per-request cache whose tree tokens sit at columns prefix_len .. prefix_len+K-1.
//   flat:  SGLang/FlashInfer's custom_mask: request b's K rows of (prefix_len + K) columns, laid
//          out from mask_indptr[b] (= sum over earlier requests of K * (prefix_len + K)).
// One block per query row; the row's ancestor set is read once into a 64-bit mask with ballots.
#include "common.cuh"

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ unsigned long long load_ancestors(const uint8_t* row, int K) {
  __shared__ unsigned long long anc_s;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const unsigned lo = __ballot_sync(0xffffffffu, lane < K && row[lane] != 0);
    const unsigned hi = __ballot_sync(0xffffffffu, lane + 32 < K && row[lane + 32] != 0);
    if (lane == 0) anc_s = (static_cast<unsigned long long>(hi) << 32) | lo;
  }
  __syncthreads();
  return anc_s;
}

__device__ __forceinline__ uint8_t allowed(unsigned long long anc, int64_t c, int64_t prefix_len,
                                           int K) {
  const int64_t t = c - prefix_len;
  return static_cast<uint8_t>(c < prefix_len || (t >= 0 && t < K && ((anc >> t) & 1ull)));
}

__global__ void __launch_bounds__(kThreads)
    dense_mask_kernel(const uint8_t* __restrict__ tree_mask, const int64_t* __restrict__ prefix_lens,
                      uint8_t* out, int K, int64_t kv_len) {
  const int64_t row = blockIdx.x;  // b * K + i
  const int64_t b = row / K;
  const unsigned long long anc = load_ancestors(tree_mask + row * K, K);
  const int64_t prefix_len = prefix_lens[b];
  uint8_t* dst = out + row * kv_len;
  if (kv_len % 16 == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0) {  // 16 columns per store
    for (int64_t c0 = threadIdx.x * 16; c0 < kv_len; c0 += kThreads * 16) {
      uint4 pack;
      uint8_t* bytes = reinterpret_cast<uint8_t*>(&pack);
#pragma unroll
      for (int k = 0; k < 16; ++k) bytes[k] = allowed(anc, c0 + k, prefix_len, K);
      *reinterpret_cast<uint4*>(dst + c0) = pack;
    }
  } else {
    for (int64_t c = threadIdx.x; c < kv_len; c += kThreads) dst[c] = allowed(anc, c, prefix_len, K);
  }
}

__global__ void __launch_bounds__(kThreads)
    flat_mask_kernel(const uint8_t* __restrict__ tree_mask, const int64_t* __restrict__ prefix_lens,
                     const int64_t* __restrict__ mask_indptr, uint8_t* out, int K) {
  const int64_t row = blockIdx.x;
  const int64_t b = row / K, i = row % K;
  const unsigned long long anc = load_ancestors(tree_mask + row * K, K);
  const int64_t prefix_len = prefix_lens[b];
  const int64_t width = prefix_len + K;
  uint8_t* dst = out + mask_indptr[b] + i * width;
  for (int64_t c = threadIdx.x; c < width; c += kThreads) dst[c] = allowed(anc, c, prefix_len, K);
}

}  // namespace

extern "C" int ngk_tree_attention_mask_dense(const void* tree_mask, const int64_t* prefix_lens,
                                             void* out, int batch_size, int K, int64_t kv_len,
                                             cudaStream_t stream) {
  NGK_REQUIRE(K >= 1 && K <= NGK_MAX_NODES);
  NGK_REQUIRE(kv_len >= 1);
  if (batch_size == 0) return 0;
  dense_mask_kernel<<<batch_size * K, kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(tree_mask), prefix_lens, static_cast<uint8_t*>(out), K, kv_len);
  NGK_CHECK_LAUNCH();
  return 0;
}

extern "C" int ngk_tree_attention_mask_flat(const void* tree_mask, const int64_t* prefix_lens,
                                            const int64_t* mask_indptr, void* out, int batch_size,
                                            int K, cudaStream_t stream) {
  NGK_REQUIRE(K >= 1 && K <= NGK_MAX_NODES);
  if (batch_size == 0) return 0;
  flat_mask_kernel<<<batch_size * K, kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(tree_mask), prefix_lens, mask_indptr,
      static_cast<uint8_t*>(out), K);
  NGK_CHECK_LAUNCH();
  return 0;
}
