// KV-cache compaction after verification: move the accepted path's K/V to the front of each
// request's draft slots, so the cache holds [prefix | root | accepted drafts] contiguously in the
// request's own slot order and the remaining draft slots can be freed or overwritten.
//
// Layout: kv_cache is [num_caches, num_slots, row] (row = num_heads * head_dim elements of any
// dtype, copied as bytes); num_caches is e.g. 2 * num_layers (K and V of every layer) so one
// launch compacts the whole model. draft_slots[b, i] is the cache slot that holds tree node i of
// request b: prefix_len + i in a per-request contiguous cache, or SGLang's out_cache_loc viewed
// as [bs, K] for a paged / token-slot pool.
// For t = 1 .. accept_token_num[b]: slot draft_slots[b, t] <- slot draft_slots[b, node_t], with
// node_t = accept_index[b, t] - b*K. Slot 0 (the root) never moves.
//
// In-place hazard: node_t >= t (a node at depth t has t ancestors before it), so step t reads a
// slot that an earlier step never writes, but a later step t' may write slot node_t (when
// node_t == t'). Steps therefore run in order, separated by __syncthreads(); one block per
// (request, cache) pair copies each row with all its threads.
#include "common.cuh"

namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads)
    compact_kernel(uint8_t* kv_cache, const int64_t* __restrict__ draft_slots,
                   const int32_t* __restrict__ accept_index,
                   const int32_t* __restrict__ accept_token_num, int K, int S,
                   int64_t num_slots, int64_t row_bytes) {
  const int b = blockIdx.x;
  uint8_t* cache = kv_cache + static_cast<int64_t>(blockIdx.y) * num_slots * row_bytes;
  const int64_t* slots = draft_slots + static_cast<int64_t>(b) * K;
  const int n = min(accept_token_num[b], min(S - 1, K - 1));
  const bool vectorised = (row_bytes % 16 == 0) && ((reinterpret_cast<uintptr_t>(kv_cache) & 15) == 0);
  for (int t = 1; t <= n; ++t) {
    const int64_t node = static_cast<int64_t>(accept_index[static_cast<int64_t>(b) * S + t]) -
                         static_cast<int64_t>(b) * K;
    if (node == t || node < 0 || node >= K) continue;  // uniform across the block
    const int64_t src_slot = slots[node], dst_slot = slots[t];
    if (src_slot < 0 || src_slot >= num_slots || dst_slot < 0 || dst_slot >= num_slots) continue;
    const uint8_t* src = cache + src_slot * row_bytes;
    uint8_t* dst = cache + dst_slot * row_bytes;
    if (vectorised) {
      for (int64_t k = threadIdx.x; k < row_bytes / 16; k += kThreads) {
        reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
      }
    } else {
      for (int64_t k = threadIdx.x; k < row_bytes; k += kThreads) dst[k] = src[k];
    }
    __syncthreads();
  }
}

}  // namespace

extern "C" int ngk_compact_kv_cache(void* kv_cache, const int64_t* draft_slots,
                                    const int32_t* accept_index, const int32_t* accept_token_num,
                                    int batch_size, int K, int num_spec_steps, int num_caches,
                                    int64_t num_slots, int64_t row_bytes, cudaStream_t stream) {
  NGK_REQUIRE(K >= 1 && K <= NGK_MAX_NODES);
  NGK_REQUIRE(num_spec_steps >= 1);
  NGK_REQUIRE(num_caches >= 1 && num_caches <= 65535);
  NGK_REQUIRE(row_bytes >= 1);
  if (batch_size == 0) return 0;
  const dim3 grid(batch_size, num_caches);
  compact_kernel<<<grid, kThreads, 0, stream>>>(static_cast<uint8_t*>(kv_cache), draft_slots,
                                                accept_index, accept_token_num, K, num_spec_steps,
                                                num_slots, row_bytes);
  NGK_CHECK_LAUNCH();
  return 0;
}
