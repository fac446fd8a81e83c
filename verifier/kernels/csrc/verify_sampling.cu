// Tree rejection sampling for deterministic (one-hot) drafts, with sgl-kernel's
// tree_speculative_sampling_target_only semantics (exact when both thresholds are 1).
//
// The math. At the last accepted node with target distribution q, its children c_1..c_m (sibling
// order) are one-hot drafts. With one coin u ~ U[0,1) per accepted node, child c_k is accepted iff
//     u < (q(c_1) + ... + q(c_k)) / threshold_acc   or   q(c_k) >= threshold_single,
// checked in order. With thresholds 1 this is sequential rejection: P(accept c_k | c_1..c_{k-1}
// rejected) = q(c_k) / (1 - q(c_1) - ... - q(c_{k-1})), i.e. exactly the residual distribution
// after removing the rejected tokens. If every child is rejected, the bonus token is drawn from
// q with the rejected children's tokens zeroed, renormalised (sgl-kernel's relu(q - p) with
// p = q on those tokens); if the walk stopped on num_spec_steps, from q itself. So every emitted
// token is distributed as q given its prefix.
// Differences from sgl-kernel, both deliberate: acceptance uses `u < acc` (sgl: `<=`), so a token
// with target probability 0 is never accepted even when u == 0; and no [bs, K, vocab] draft_probs
// scratch is read or written (the <= 63 rejected tokens are kept in shared memory instead).
//
// The coin for node i's children is coins[b, i] (the root's is coins[b, 0]); the bonus token
// uses final_coins[b] by inverse CDF: the first v with cumsum(residual)[v] > final_coin * total.
//
// One block of kThreads per request. Thread 0 walks the tree in shared memory (each node's q of
// its own token is fetched by all threads at once beforehand); the bonus draw is a block-wide
// chunked sum + scan over the vocabulary row, then one thread scans its own chunk.
//
// Two sources of q. ``ngk_tree_speculative_sampling`` reads a dense [bs, K, V] float32 q. The
// logits form (``ngk_tree_sampling_logits``) reads the LM head's logits [bs, K, V] as they are
// (float32 or 16-bit) with per-row softmax statistics (``ngk_softmax_rows``: the row's max, the
// reciprocal of its sum of exp((x - max) / T), its argmax and whether it holds a NaN or an
// infinity), and computes q(v) = exp((x_v - max) / T) / sum only where the walk and the bonus draw
// read it: at most K values per request and the bonus row, instead of writing and reading all
// bs * K * V. Top-k and top-p come as a per-row floor on the logits (logit_floor.cu): tokens below
// it have q = 0 and the sum runs over the rest. A temperature of 0 makes the row greedy (q one-hot
// at the argmax, as the engine's greedy rows in a sampled batch); a non-finite row counts as zeroed
// logits (uniform q, or one-hot at token 0 when greedy), as numerics.nonfinite_rows leaves it.
#include <math.h>

#include <type_traits>

#include "common.cuh"
#include "dtypes.cuh"

namespace {

constexpr int kThreads = 1024;

// 1 / temperature, or 0 for a greedy row (temperature 0): the stats and the walk agree on it.
__device__ __forceinline__ float inv_temp_of(float t) { return t > 0.f ? 1.f / t : 0.f; }

// A dense float32 row of q.
struct DenseRow {
  const float* p;
  __device__ __forceinline__ float operator()(int v) const { return __ldg(p + v); }
};

struct DenseProbs {
  static constexpr bool kDense = true;
  const float* p;
  int64_t V;
  __device__ __forceinline__ DenseRow row(int64_t r) const { return DenseRow{p + r * V}; }
};

// q of one logits row: softmax at temperature 1 / it (mode 0), one-hot at `amax` (mode 1: greedy,
// or a non-finite greedy row, whose argmax is 0) or uniform (mode 2: a non-finite sampled row).
template <typename T>
struct LogitRow {
  const T* l;
  float mx, it, inv_sum, uniform, floor;
  int64_t amax;
  int mode;
  __device__ __forceinline__ float operator()(int v) const {
    if (mode == 0) {
      const float x = ngk::to_f(l[v]);
      return x >= floor ? __expf((x - mx) * it) * inv_sum : 0.f;
    }
    if (mode == 1) return v == amax ? 1.f : 0.f;
    return uniform;
  }
};

template <typename T>
struct LogitProbs {
  static constexpr bool kDense = false;
  const T* logits;
  const float* temperature;  // [rows]; 0: greedy row
  const float* row_max;
  const float* row_inv_sum;
  const int64_t* row_argmax;
  const uint8_t* row_bad;
  const float* row_floor;  // null: no truncation
  int64_t V;
  __device__ __forceinline__ LogitRow<T> row(int64_t r) const {
    const float it = inv_temp_of(temperature[r]);
    const bool bad = row_bad[r] != 0;
    const int mode = it == 0.f ? 1 : (bad ? 2 : 0);
    return LogitRow<T>{logits + r * V, row_max[r], it, row_inv_sum[r], 1.f / static_cast<float>(V),
                       row_floor != nullptr ? row_floor[r] : -INFINITY, bad ? 0 : row_argmax[r], mode};
  }
};

// Sum of the residual over [start, end) in index order, sequentially in float32. Tokens in
// rejected[0..num_rejected) count as 0.
template <typename Row>
__device__ float chunk_sum(const Row& row, int start, int end, const int* rejected,
                           int num_rejected, bool vectorised) {
  bool any_rejected = false;
  for (int k = 0; k < num_rejected; ++k) any_rejected |= (rejected[k] >= start && rejected[k] < end);
  float sum = 0.f;
  if constexpr (std::is_same_v<Row, DenseRow>) {
    if (!any_rejected && vectorised) {
      for (int v = start; v < end; v += 4) {  // start, end are multiples of 4 here
        const float4 x = __ldg(reinterpret_cast<const float4*>(row.p + v));
        sum += x.x; sum += x.y; sum += x.z; sum += x.w;  // same order as the scalar loop
      }
      return sum;
    }
  }
  for (int v = start; v < end; ++v) {
    float x = row(v);
    if (any_rejected) {
      for (int k = 0; k < num_rejected; ++k) x = (rejected[k] == v) ? 0.f : x;
    }
    sum += x;
  }
  return sum;
}

// Exclusive block scan of one float per thread; also returns the block total.
__device__ float block_exclusive_scan(float value, float* total, float* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float incl = value;
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  float excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = 0.f;
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    float s = warp_sums[lane];
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  *total = warp_sums[kThreads / 32 - 1];
  const float offset = warp > 0 ? warp_sums[warp - 1] : 0.f;
  __syncthreads();  // warp_sums may be reused by the caller
  return offset + excl;
}

template <typename Probs>
__global__ void __launch_bounds__(kThreads)
    tree_sampling_kernel(int32_t* predicts, int32_t* accept_index, int32_t* accept_token_num,
                         const int64_t* __restrict__ candidates,
                         const int64_t* __restrict__ retrive_index,
                         const int64_t* __restrict__ next_token,
                         const int64_t* __restrict__ next_sibling,
                         const float* __restrict__ coins, const float* __restrict__ final_coins,
                         const Probs probs, int K, int S, int V,
                         float threshold_single, float threshold_acc) {
  __shared__ int64_t cand_s[NGK_MAX_NODES], ridx_s[NGK_MAX_NODES];
  __shared__ int next_s[NGK_MAX_NODES], sibling_s[NGK_MAX_NODES], parent_s[NGK_MAX_NODES];
  __shared__ float q_s[NGK_MAX_NODES];
  __shared__ int rejected_s[NGK_MAX_NODES];
  __shared__ int num_rejected_s, last_s, owner_s;
  __shared__ float warp_sums[kThreads / 32];
  const int b = blockIdx.x, tid = threadIdx.x;
  const int64_t base = static_cast<int64_t>(b) * K;

  if (tid < K) {
    const int64_t r = retrive_index[base + tid];
    cand_s[tid] = candidates[base + tid];
    ridx_s[tid] = r;
    next_s[tid] = ngk_node(next_token[base + tid], K);
    sibling_s[tid] = ngk_node(next_sibling[base + tid], K);
    parent_s[tid] = -1;
    predicts[r] = -1;
  }
  for (int t = tid; t < S; t += kThreads) accept_index[static_cast<int64_t>(b) * S + t] = -1;
  __syncthreads();
  if (tid < K) {  // node tid claims its children, so every q below is fetched in one round trip
    int c = next_s[tid];
    for (int steps = 0; c != -1 && steps < K; ++steps, c = sibling_s[c]) parent_s[c] = tid;
  }
  __syncthreads();
  if (tid < K) {
    const int p = parent_s[tid];
    const int64_t tok = cand_s[tid];
    q_s[tid] = (p >= 0 && tok >= 0 && tok < V) ? probs.row(base + p)(static_cast<int>(tok)) : 0.f;
  }
  __syncthreads();

  if (tid == 0) {
    int32_t* accepted_out = accept_index + static_cast<int64_t>(b) * S;
    accepted_out[0] = static_cast<int32_t>(ridx_s[0]);
    float coin = coins[base], prob_acc = 0.f;
    int last = 0, num_accepted = 0, examined = 0, num_rejected = 0;
    for (int step = 1; step < S; ++step) {
      int cur = next_s[last];
      bool accepted = false;
      while (cur != -1 && examined < K - 1) {
        ++examined;
        const int64_t tok = cand_s[cur];
        float q = q_s[cur];
        if (parent_s[cur] != last) {  // only for malformed links: read q at the node we are at
          q = (tok >= 0 && tok < V) ? probs.row(base + last)(static_cast<int>(tok)) : 0.f;
        }
        prob_acc += q;
        if (coin < prob_acc / threshold_acc || q >= threshold_single) {
          predicts[ridx_s[last]] = static_cast<int32_t>(tok);
          accepted_out[++num_accepted] = static_cast<int32_t>(ridx_s[cur]);
          last = cur;
          prob_acc = 0.f;
          coin = coins[base + cur];
          num_rejected = 0;
          accepted = true;
          break;
        }
        if (tok >= 0 && tok < V) rejected_s[num_rejected++] = static_cast<int>(tok);
        cur = sibling_s[cur];
      }
      if (!accepted) break;
    }
    accept_token_num[b] = num_accepted;
    last_s = last;
    num_rejected_s = num_rejected;
    owner_s = -1;
  }
  __syncthreads();

  // Bonus token: inverse CDF over the residual row, thread tid owning [start, end).
  const int last = last_s;
  const auto row = probs.row(base + last);
  const int chunk = ((V + kThreads - 1) / kThreads + 3) & ~3;
  const int start = min(V, tid * chunk), end = min(V, start + chunk);
  bool vectorised = false;
  if constexpr (Probs::kDense) vectorised = (V % 4 == 0) && ((reinterpret_cast<uintptr_t>(probs.p) & 15) == 0);
  int num_rejected = num_rejected_s;
  float partial = chunk_sum(row, start, end, rejected_s, num_rejected, vectorised);
  float total;
  float excl = block_exclusive_scan(partial, &total, warp_sums);
  if (!(total > 0.f) && num_rejected > 0) {  // all mass was on rejected tokens: draw from q
    num_rejected = 0;
    partial = chunk_sum(row, start, end, rejected_s, 0, vectorised);
    excl = block_exclusive_scan(partial, &total, warp_sums);
  }
  const float u = final_coins[b] * total;
  // The owner is the last thread with mass whose chunk starts at or below u; it always exists
  // when total > 0 (the first thread with mass starts at 0), also when rounding puts u >= total.
  if (partial > 0.f && excl <= u) atomicMax(&owner_s, tid);
  __syncthreads();
  if (tid == owner_s) {
    float running = excl;
    int pick = -1;
    for (int v = start; v < end; ++v) {
      float x = row(v);
      for (int k = 0; k < num_rejected; ++k) x = (rejected_s[k] == v) ? 0.f : x;
      if (x > 0.f) {
        pick = v;
        running += x;
        if (running > u) break;
      }
    }
    predicts[ridx_s[last]] = pick;
  } else if (tid == 0 && owner_s == -1) {  // an all-zero row: sgl-kernel also falls back to V - 1
    predicts[ridx_s[last]] = V - 1;
  }
}

// Per-row softmax statistics of logits [rows, V] at temperature[r] (0: only the argmax is
// needed), over the tokens at or above the row's floor (logit_floor.cu; none: every token):
// the max, 1 / sum exp((x - max) / temperature), the argmax (ties to the lowest
// index, as torch.argmax) and whether the row holds a NaN or an infinity (then argmax 0 and the
// other figures unused). One pass over the row: each thread keeps a running max and a sum
// rescaled when the max grows (online softmax), merged across the block.
constexpr int kStatThreads = 512;

__device__ __forceinline__ void merge_stats(float& m, float& s, int& i, float m2, float s2, int i2, float it) {
  if (m2 > m || (m2 == m && i2 < i)) {
    s = (s > 0.f ? s * __expf((m - m2) * it) : 0.f) + s2;
    m = m2, i = i2;
  } else {
    s += s2 > 0.f ? s2 * __expf((m2 - m) * it) : 0.f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kStatThreads)
    softmax_rows_kernel(const T* __restrict__ logits, int64_t V, const float* __restrict__ temperature,
                        const float* __restrict__ row_floor, float* __restrict__ out_max,
                        float* __restrict__ out_inv_sum, int64_t* __restrict__ out_idx,
                        uint8_t* __restrict__ out_bad) {
  constexpr int kVec = 16 / sizeof(T);
  __shared__ float sm[kStatThreads / 32], ss[kStatThreads / 32];
  __shared__ int si[kStatThreads / 32], sbad[kStatThreads / 32];
  const T* row = logits + blockIdx.x * V;
  const float it = inv_temp_of(temperature[blockIdx.x]);
  const float floor = row_floor != nullptr ? row_floor[blockIdx.x] : -INFINITY;
  float m = -INFINITY, s = 0.f;
  int idx = 0x7fffffff, bad = 0;
  auto add = [&](float x, int j) {
    bad |= !isfinite(x);
    if (x < floor) return;  // truncated away (the row's max is always kept)
    if (x > m) {
      s = (m == -INFINITY ? 0.f : s * __expf((m - x) * it)) + 1.f;
      m = x, idx = j;
    } else {
      s += __expf((x - m) * it);
    }
  };
  const bool vec = (V % kVec == 0) && (reinterpret_cast<uintptr_t>(row) % 16 == 0);
  if (vec) {
    const uint4* r16 = reinterpret_cast<const uint4*>(row);
    for (int64_t j = threadIdx.x; j < V / kVec; j += kStatThreads) {
      const uint4 raw = r16[j];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < kVec; ++k) add(ngk::to_f(e[k]), static_cast<int>(kVec * j + k));
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += kStatThreads) add(ngk::to_f(row[j]), static_cast<int>(j));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    merge_stats(m, s, idx, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o),
                __shfl_xor_sync(0xffffffffu, idx, o), it);
  }
  bad = __any_sync(0xffffffffu, bad);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) sm[warp] = m, ss[warp] = s, si[warp] = idx, sbad[warp] = bad;
  __syncthreads();
  if (warp == 0) {
    constexpr int kWarps = kStatThreads / 32;
    m = lane < kWarps ? sm[lane] : -INFINITY;
    s = lane < kWarps ? ss[lane] : 0.f;
    idx = lane < kWarps ? si[lane] : 0x7fffffff;
    bad = lane < kWarps ? sbad[lane] : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      merge_stats(m, s, idx, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o),
                  __shfl_xor_sync(0xffffffffu, idx, o), it);
    }
    bad = __any_sync(0xffffffffu, bad);
    if (lane == 0) {
      out_bad[blockIdx.x] = bad ? 1 : 0;
      out_idx[blockIdx.x] = bad ? 0 : idx;
      out_max[blockIdx.x] = bad ? 0.f : m;
      out_inv_sum[blockIdx.x] = (bad || !(s > 0.f)) ? 0.f : 1.f / s;
    }
  }
}

template <typename T>
int launch_logits(const void* logits, int64_t rows, int64_t V, const float* temperature,
                  const float* row_floor, float* row_max,
                  float* row_inv_sum, int64_t* row_argmax, uint8_t* row_bad, int32_t* predicts,
                  int32_t* accept_index, int32_t* accept_token_num, const int64_t* candidates,
                  const int64_t* retrive_index, const int64_t* next_token, const int64_t* next_sibling,
                  const float* coins, const float* final_coins, int batch_size, int K, int S,
                  float threshold_single, float threshold_acc, cudaStream_t stream) {
  const T* l = static_cast<const T*>(logits);
  softmax_rows_kernel<T><<<static_cast<unsigned>(rows), kStatThreads, 0, stream>>>(
      l, V, temperature, row_floor, row_max, row_inv_sum, row_argmax, row_bad);
  NGK_CHECK_LAUNCH();
  const LogitProbs<T> probs{l, temperature, row_max, row_inv_sum, row_argmax, row_bad, row_floor, V};
  tree_sampling_kernel<LogitProbs<T>><<<batch_size, kThreads, 0, stream>>>(
      predicts, accept_index, accept_token_num, candidates, retrive_index, next_token, next_sibling,
      coins, final_coins, probs, K, S, static_cast<int>(V), threshold_single, threshold_acc);
  NGK_CHECK_LAUNCH();
  return 0;
}

}  // namespace

extern "C" int ngk_tree_speculative_sampling(
    int32_t* predicts, int32_t* accept_index, int32_t* accept_token_num,
    const int64_t* candidates, const int64_t* retrive_index, const int64_t* next_token,
    const int64_t* next_sibling, const float* coins, const float* final_coins,
    const float* target_probs, int batch_size, int K, int num_spec_steps, int vocab_size,
    float threshold_single, float threshold_acc, cudaStream_t stream) {
  NGK_REQUIRE(K >= 1 && K <= NGK_MAX_NODES);
  NGK_REQUIRE(num_spec_steps >= 1);
  NGK_REQUIRE(vocab_size >= 1);
  if (batch_size == 0) return 0;
  const float capped_acc = fmaxf(threshold_acc, 1e-9f);  // as sgl-kernel
  tree_sampling_kernel<DenseProbs><<<batch_size, kThreads, 0, stream>>>(
      predicts, accept_index, accept_token_num, candidates, retrive_index, next_token,
      next_sibling, coins, final_coins, DenseProbs{target_probs, vocab_size}, K, num_spec_steps,
      vocab_size, threshold_single, capped_acc);
  NGK_CHECK_LAUNCH();
  return 0;
}

// The same from logits [batch_size, K, vocab_size] (dtype: 0 float32, 1 float16, 2 bfloat16,
// contiguous), temperature [batch_size * K] float32 (0: a greedy row) and row_floor [batch_size *
// K] float32 (top-k / top-p as a floor on the logits, ngk_logit_floor_rows; null: no truncation).
// The per-row statistics go to row_max, row_inv_sum [rows] float32, row_argmax [rows] int64 and
// row_bad [rows] uint8 (a NaN or an infinity in the row), rows = batch_size * K; the caller reads
// row_bad.
extern "C" int ngk_tree_sampling_logits(
    int dtype, const void* logits, const float* temperature, const float* row_floor, float* row_max,
    float* row_inv_sum,
    int64_t* row_argmax, uint8_t* row_bad, int32_t* predicts, int32_t* accept_index,
    int32_t* accept_token_num, const int64_t* candidates, const int64_t* retrive_index,
    const int64_t* next_token, const int64_t* next_sibling, const float* coins,
    const float* final_coins, int batch_size, int K, int num_spec_steps, int vocab_size,
    float threshold_single, float threshold_acc, cudaStream_t stream) {
  NGK_REQUIRE(K >= 1 && K <= NGK_MAX_NODES);
  NGK_REQUIRE(num_spec_steps >= 1);
  NGK_REQUIRE(vocab_size >= 1);
  NGK_REQUIRE(dtype == ngk::kF32 || dtype == ngk::kF16 || dtype == ngk::kBF16);
  if (batch_size == 0) return 0;
  const int64_t rows = static_cast<int64_t>(batch_size) * K;
  const float capped_acc = fmaxf(threshold_acc, 1e-9f);
  auto go = [&](auto tag) {
    using T = decltype(tag);
    return launch_logits<T>(logits, rows, vocab_size, temperature, row_floor, row_max, row_inv_sum, row_argmax,
                            row_bad, predicts, accept_index, accept_token_num, candidates, retrive_index, next_token,
                            next_sibling, coins, final_coins, batch_size, K, num_spec_steps, threshold_single,
                            capped_acc, stream);
  };
  if (dtype == ngk::kF16) return go(__half{});
  if (dtype == ngk::kBF16) return go(__nv_bfloat16{});
  return go(float{});
}
