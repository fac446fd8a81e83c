// Greedy tree verification with sgl-kernel's verify_tree_greedy semantics.
//
// Walk from the root; at each step try the children of the last accepted node in sibling order
// (retrive_next_token, then retrive_next_sibling) and accept the first whose draft token equals
// the target's argmax at the last accepted node. Stop when no child matches or num_spec_steps - 1
// tokens were accepted. Outputs (flat indices are retrive_index values):
//   accept_index[b, 0..n]       flat indices of the root and the n accepted nodes, then -1
//   accept_token_num[b]         n
//   predicts[accept_index[b,t]] the token that follows node t: the next accepted draft token,
//                               and for the last node the bonus token (the target's argmax).
// Unlike sgl-kernel, every other predicts entry of the request is set to -1 (not left stale).
//
// A malformed link (outside [0, K)) reads as "none", and a walk examines at most K - 1 nodes (a
// tree has K - 1 non-root nodes), so cyclic links cannot hang the kernel. The reference agrees.
//
// One warp per request: the lanes stage the request's links and target tokens in shared memory
// with coalesced loads, then lane 0 walks on-chip. (sgl-kernel walks global memory from one
// thread, paying a dependent DRAM round trip per examined node.)
#include "common.cuh"

namespace {

constexpr int kWarpsPerBlock = 4;

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    verify_tree_greedy_kernel(int32_t* predicts, int32_t* accept_index, int32_t* accept_token_num,
                              const int64_t* __restrict__ candidates,
                              const int64_t* __restrict__ retrive_index,
                              const int64_t* __restrict__ next_token,
                              const int64_t* __restrict__ next_sibling,
                              const int64_t* __restrict__ target_predict, int batch_size, int K,
                              int num_spec_steps) {
  __shared__ int64_t cand_s[kWarpsPerBlock][NGK_MAX_NODES];
  __shared__ int64_t ridx_s[kWarpsPerBlock][NGK_MAX_NODES];
  __shared__ int64_t target_s[kWarpsPerBlock][NGK_MAX_NODES];
  __shared__ int8_t next_s[kWarpsPerBlock][NGK_MAX_NODES];
  __shared__ int8_t sibling_s[kWarpsPerBlock][NGK_MAX_NODES];
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.x * kWarpsPerBlock + w;
  if (b >= batch_size) return;  // whole warps only; no block-wide barrier below
  const int64_t base = static_cast<int64_t>(b) * K;
  const int S = num_spec_steps;
  for (int i = lane; i < K; i += 32) {
    const int64_t r = retrive_index[base + i];
    cand_s[w][i] = candidates[base + i];
    ridx_s[w][i] = r;
    target_s[w][i] = target_predict[r];
    next_s[w][i] = static_cast<int8_t>(ngk_node(next_token[base + i], K));
    sibling_s[w][i] = static_cast<int8_t>(ngk_node(next_sibling[base + i], K));
    predicts[r] = -1;
  }
  for (int t = lane; t < S; t += 32) accept_index[static_cast<int64_t>(b) * S + t] = -1;
  __syncwarp();
  if (lane != 0) return;

  int32_t* accepted_out = accept_index + static_cast<int64_t>(b) * S;
  accepted_out[0] = static_cast<int32_t>(ridx_s[w][0]);
  int last = 0, num_accepted = 0, examined = 0;
  for (int step = 1; step < S; ++step) {
    int cur = next_s[w][last];
    bool accepted = false;
    while (cur != -1 && examined < K - 1) {
      ++examined;
      if (cand_s[w][cur] == target_s[w][last]) {
        predicts[ridx_s[w][last]] = static_cast<int32_t>(cand_s[w][cur]);
        accepted_out[++num_accepted] = static_cast<int32_t>(ridx_s[w][cur]);
        last = cur;
        accepted = true;
        break;
      }
      cur = sibling_s[w][cur];
    }
    if (!accepted) break;
  }
  accept_token_num[b] = num_accepted;
  predicts[ridx_s[w][last]] = static_cast<int32_t>(target_s[w][last]);
}

}  // namespace

extern "C" int ngk_verify_tree_greedy(int32_t* predicts, int32_t* accept_index,
                                      int32_t* accept_token_num, const int64_t* candidates,
                                      const int64_t* retrive_index, const int64_t* next_token,
                                      const int64_t* next_sibling, const int64_t* target_predict,
                                      int batch_size, int K, int num_spec_steps,
                                      cudaStream_t stream) {
  NGK_REQUIRE(K >= 1 && K <= NGK_MAX_NODES);
  NGK_REQUIRE(num_spec_steps >= 1);
  if (batch_size == 0) return 0;
  const int blocks = (batch_size + kWarpsPerBlock - 1) / kWarpsPerBlock;
  verify_tree_greedy_kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
      predicts, accept_index, accept_token_num, candidates, retrive_index, next_token,
      next_sibling, target_predict, batch_size, K, num_spec_steps);
  NGK_CHECK_LAUNCH();
  return 0;
}
