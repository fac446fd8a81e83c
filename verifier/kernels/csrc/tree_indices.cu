// Tree structure -> the sgl-kernel index arrays, for a whole batch in one launch.
//
// Per request b with K nodes (node 0 = the root, i.e. the last committed token; nodes in
// topological order, parents before children):
//   positions[b*K+i]             = prefix_lens[b] + depth(i)      (the root sits at prefix_lens[b])
//   retrive_index[b,i]           = b*K + i                         (flat index of node i)
//   retrive_next_token[b,i]      = smallest j > i with parent(j) == i, else -1   (first child)
//   retrive_next_sibling[b,i]    = smallest j > i with parent(j) == parent(i), else -1
// where parent(i) is the nearest marked ancestor: the largest j < i with mask[i][j] set. For a
// valid ancestor mask these are exactly sgl-kernel's reconstruct_indices_from_tree_mask outputs.
//
// One block per request, NGK_MAX_NODES threads: thread i owns node i. The K*K mask is staged in
// shared memory with coalesced loads, so every later read is on-chip.
#include "common.cuh"

namespace {

__device__ __forceinline__ void write_links(int b, int i, int K, int parent, int depth,
                                            const int* parent_s, const int64_t* prefix_lens,
                                            int64_t* positions, int64_t* retrive_index,
                                            int64_t* next_token, int64_t* next_sibling) {
  int first_child = -1, sibling = -1;
  for (int j = i + 1; j < K; ++j) {
    if (parent_s[j] == i) { first_child = j; break; }
  }
  if (parent >= 0) {
    for (int j = i + 1; j < K; ++j) {
      if (parent_s[j] == parent) { sibling = j; break; }
    }
  }
  const int64_t flat = static_cast<int64_t>(b) * K + i;
  positions[flat] = prefix_lens[b] + depth;
  retrive_index[flat] = flat;
  next_token[flat] = first_child;
  next_sibling[flat] = sibling;
}

__global__ void tree_indices_from_mask_kernel(const uint8_t* __restrict__ tree_mask,
                                              const int64_t* __restrict__ prefix_lens,
                                              int64_t* positions, int64_t* retrive_index,
                                              int64_t* next_token, int64_t* next_sibling, int K) {
  __shared__ uint8_t mask_s[NGK_MAX_NODES * NGK_MAX_NODES];
  __shared__ int parent_s[NGK_MAX_NODES];
  const int b = blockIdx.x, i = threadIdx.x;
  const uint8_t* m = tree_mask + static_cast<size_t>(b) * K * K;
  for (int x = i; x < K * K; x += blockDim.x) mask_s[x] = m[x];
  __syncthreads();
  int parent = -1, depth = 0;
  if (i < K) {
    for (int j = 0; j < i; ++j) {
      if (mask_s[i * K + j]) { ++depth; parent = j; }
    }
    parent_s[i] = parent;
  }
  __syncthreads();
  if (i < K) {
    write_links(b, i, K, parent, depth, parent_s, prefix_lens, positions, retrive_index,
                next_token, next_sibling);
  }
}

// parents[b,i]: parent node of node i; a value outside [0, i) (the root's -1, or a padding slot)
// makes node i parentless. Also writes the K x K ancestor-or-self mask.
__global__ void tree_indices_from_parents_kernel(const int64_t* __restrict__ parents,
                                                 const int64_t* __restrict__ prefix_lens,
                                                 uint8_t* tree_mask, int64_t* positions,
                                                 int64_t* retrive_index, int64_t* next_token,
                                                 int64_t* next_sibling, int K) {
  __shared__ int parent_s[NGK_MAX_NODES];
  __shared__ unsigned long long anc_s[NGK_MAX_NODES];
  const int b = blockIdx.x, i = threadIdx.x;
  if (i < K) {
    const int64_t p = parents[static_cast<int64_t>(b) * K + i];
    parent_s[i] = (p >= 0 && p < i) ? static_cast<int>(p) : -1;
  }
  __syncthreads();
  int depth = 0;
  if (i < K) {
    // parent < child, so this walk ends within i steps.
    unsigned long long anc = 1ull << i;
    for (int p = parent_s[i]; p >= 0; p = parent_s[p]) {
      anc |= 1ull << p;
      ++depth;
    }
    anc_s[i] = anc;
  }
  __syncthreads();
  uint8_t* out = tree_mask + static_cast<size_t>(b) * K * K;
  for (int x = i; x < K * K; x += blockDim.x) {
    out[x] = static_cast<uint8_t>((anc_s[x / K] >> (x % K)) & 1ull);
  }
  if (i < K) {
    write_links(b, i, K, parent_s[i], depth, parent_s, prefix_lens, positions, retrive_index,
                next_token, next_sibling);
  }
}

}  // namespace

extern "C" int ngk_tree_indices_from_mask(const void* tree_mask, const int64_t* prefix_lens,
                                          int64_t* positions, int64_t* retrive_index,
                                          int64_t* next_token, int64_t* next_sibling,
                                          int batch_size, int K, cudaStream_t stream) {
  NGK_REQUIRE(K >= 1 && K <= NGK_MAX_NODES);
  if (batch_size == 0) return 0;
  tree_indices_from_mask_kernel<<<batch_size, NGK_MAX_NODES, 0, stream>>>(
      static_cast<const uint8_t*>(tree_mask), prefix_lens, positions, retrive_index, next_token,
      next_sibling, K);
  NGK_CHECK_LAUNCH();
  return 0;
}

extern "C" int ngk_tree_indices_from_parents(const int64_t* parents, const int64_t* prefix_lens,
                                             void* tree_mask, int64_t* positions,
                                             int64_t* retrive_index, int64_t* next_token,
                                             int64_t* next_sibling, int batch_size, int K,
                                             cudaStream_t stream) {
  NGK_REQUIRE(K >= 1 && K <= NGK_MAX_NODES);
  if (batch_size == 0) return 0;
  tree_indices_from_parents_kernel<<<batch_size, NGK_MAX_NODES, 0, stream>>>(
      parents, prefix_lens, static_cast<uint8_t*>(tree_mask), positions, retrive_index,
      next_token, next_sibling, K);
  NGK_CHECK_LAUNCH();
  return 0;
}
