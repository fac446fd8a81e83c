// Top-k / top-p truncation as a per-row floor on the logits, for sampling straight from the logits
// (verify_sampling.cu's logits form): a token is kept iff its logit is >= the row's floor.
//
// The semantics (verifier.step.sampling.truncation_floor is the torch reference). Order the row's
// logits x descending. top-k keeps x >= x_(k), the k-th largest (ties at it all kept, as vLLM and
// SGLang do). top-p then takes q = softmax(x / T) over what top-k kept and keeps x >= x_(m), where
// m is the smallest index whose cumulative q reaches top_p (again every token tied with x_(m)).
// The floor is the larger of the two thresholds; -inf where neither truncates, for greedy rows
// (temperature 0) and for rows holding a NaN or an infinity (the sampling kernel treats those as
// zeroed logits).
//
// How. Floats map to order-preserving 32-bit keys, and each threshold is found by a radix select
// from the most significant byte: four passes over the row, each building a 256-bin histogram of
// the candidates still sharing the prefix chosen so far, then picking the bin where the count
// (top-k) or the mass (top-p) from the top first reaches its target. Masses are fixed-point
// integers (exp((x - max) / T) scaled by 2^40, integer atomics into a histogram per warp): sums in
// any order are the same, so the floor is deterministic run to run (the torch reference sums
// float32 in another order with an accurate exp: the two can pick different ends of a boundary
// only when the cumulative mass is within rounding of top_p).
// One block per row; rows without truncation return after reading their parameters.
#include <math.h>

#include "common.cuh"
#include "dtypes.cuh"

namespace {

constexpr int kFloorThreads = 512;
constexpr int kWarps = kFloorThreads / 32;
constexpr float kMassScale = 1099511627776.f;  // 2^40: V * 2^40 < 2^63 for any V < 2^23

__device__ __forceinline__ uint32_t key_of(float x) {
  const uint32_t u = __float_as_uint(x == 0.f ? 0.f : x);  // -0 is +0, as the floor's >= has it
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending keys for ascending floats
}

__device__ __forceinline__ float float_of(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// A token's mass in fixed point: the fast exp (as the sampling kernel's q) and a float product.
// Every pass computes the same integer for the same logit, which is all the select needs; an
// accurate expf and a float64 product per token made the block compute-bound.
__device__ __forceinline__ unsigned long long weight(float x, float mx, float it) {
  return __float2ull_rz(__expf((x - mx) * it) * kMassScale);
}

// Calls f(x, index) for every element of the row, each thread a strided share, with 16-byte loads
// two at a time where the row allows (a 49k row is 96 scalar loads per thread a pass otherwise).
template <typename T, typename F>
__device__ __forceinline__ void for_row(const T* row, int64_t V, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  if (V % kVec == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    const uint4* r16 = reinterpret_cast<const uint4*>(row);
    const int64_t n = V / kVec;
    int64_t j = threadIdx.x;
    for (; j + kFloorThreads < n; j += 2 * kFloorThreads) {
      const uint4 a = r16[j], b = r16[j + kFloorThreads];
      const T* ea = reinterpret_cast<const T*>(&a);
      const T* eb = reinterpret_cast<const T*>(&b);
#pragma unroll
      for (int k = 0; k < kVec; ++k) f(ngk::to_f(ea[k]), kVec * j + k);
#pragma unroll
      for (int k = 0; k < kVec; ++k) f(ngk::to_f(eb[k]), kVec * (j + kFloorThreads) + k);
    }
    if (j < n) {
      const uint4 a = r16[j];
      const T* ea = reinterpret_cast<const T*>(&a);
#pragma unroll
      for (int k = 0; k < kVec; ++k) f(ngk::to_f(ea[k]), kVec * j + k);
    }
  } else {
    for (int64_t v = threadIdx.x; v < V; v += kFloorThreads) f(ngk::to_f(row[v]), v);
  }
}

// Picks the histogram bin (descending digits) where `above` plus the bins from the top first reaches
// `target`; returns the digit and adds the bins above it to `above`. Warp 0 does the scan: lane L
// owns digits 255 - 8L down to 248 - 8L.
__device__ int pick_bin(const unsigned long long* hist, unsigned long long target, unsigned long long* above,
                        int* digit_out) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    unsigned long long mine = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) mine += hist[255 - 8 * lane - j];
    unsigned long long incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    const unsigned long long base = *above;
    const unsigned long long excl = incl - mine;
    // The first lane whose inclusive sum reaches the target (the last lane if rounding left it short).
    const unsigned hit = __ballot_sync(0xffffffffu, base + incl >= target);
    const int owner = hit ? __ffs(hit) - 1 : 31;
    if (lane == owner) {
      unsigned long long acc = base + excl;
      int d = 255 - 8 * lane - 7;
      for (int j = 0; j < 8; ++j) {
        const int dj = 255 - 8 * lane - j;
        if (acc + hist[dj] >= target || j == 7) { d = dj; break; }
        acc += hist[dj];
      }
      *above = acc;
      *digit_out = d;
    }
  }
  __syncthreads();
  return *digit_out;
}

// Adds `w` to bin `d` of this warp's histogram through a two-slot cache per thread: logits crowd
// into a few bins (a pass's first byte is the sign and the exponent's top bits), and atomics on one
// shared address serialise, so runs of the same bin go up as one atomic.
struct BinCache {
  int d0 = -1, d1 = -1;
  unsigned long long s0 = 0, s1 = 0;
  __device__ __forceinline__ void add(unsigned long long* whist, int d, unsigned long long w) {
    if (d == d0) { s0 += w; return; }
    if (d == d1) { s1 += w; return; }
    if (d1 >= 0 && s1) atomicAdd(&whist[d1], s1);
    d1 = d0, s1 = s0, d0 = d, s0 = w;
  }
  __device__ __forceinline__ void flush(unsigned long long* whist) {
    if (d0 >= 0 && s0) atomicAdd(&whist[d0], s0);
    if (d1 >= 0 && s1) atomicAdd(&whist[d1], s1);
  }
};

// The key of the threshold: keys >= it are kept. mode 0 counts (target = k), mode 1 weighs (target =
// mass). Only keys >= lo take part, and in mode 1 only weights >= wmin (a bound below the
// threshold's own weight: the elements it drops lie below the threshold, and each pass picks the
// same bin without them). whist: a 256-bin histogram per warp; hist: their sum.
template <typename T>
__device__ uint32_t radix_select(const T* row, int64_t V, uint32_t lo, int mode, unsigned long long target,
                                 unsigned long long wmin, float mx, float it, unsigned long long (*whist)[256],
                                 unsigned long long* hist, unsigned long long* above, int* digit) {
  uint32_t prefix = 0, mask = 0;
  unsigned long long* mine = whist[threadIdx.x / 32];
  if (threadIdx.x == 0) *above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int j = threadIdx.x; j < kWarps * 256; j += kFloorThreads) whist[j / 256][j % 256] = 0;
    __syncthreads();
    BinCache cache;
    for_row(row, V, [&](float x, int64_t) {
      const uint32_t k = key_of(x);
      if (k >= lo && (k & mask) == prefix) {
        const unsigned long long w = mode == 0 ? 1ull : weight(x, mx, it);
        if (w >= wmin) cache.add(mine, static_cast<int>((k >> shift) & 255u), w);
      }
    });
    cache.flush(mine);
    __syncthreads();
    for (int j = threadIdx.x; j < 256; j += kFloorThreads) {
      unsigned long long sum = 0;
      for (int w = 0; w < kWarps; ++w) sum += whist[w][j];
      hist[j] = sum;
    }
    __syncthreads();
    const int d = pick_bin(hist, target, above, digit);
    prefix |= static_cast<uint32_t>(d) << shift;
    mask |= 255u << shift;
    __syncthreads();  // hist, above and digit are reused by the next pass
  }
  return prefix;
}

template <typename T>
__global__ void __launch_bounds__(kFloorThreads)
    logit_floor_kernel(const T* __restrict__ logits, int64_t V, const float* __restrict__ temperature,
                       const float* __restrict__ top_k, const float* __restrict__ top_p,
                       float* __restrict__ out_floor) {
  __shared__ unsigned long long whist[kWarps][256];  // 32 KiB
  __shared__ unsigned long long hist[256];
  __shared__ unsigned long long above, total_s;
  __shared__ float wmax[kWarps];
  __shared__ int wbad[kWarps], digit;
  const int64_t r = blockIdx.x;
  const T* row = logits + r * V;
  const float t = temperature[r];
  const float kf = top_k != nullptr ? top_k[r] : 0.f;
  const float p = top_p != nullptr ? top_p[r] : 1.f;
  const bool use_k = kf >= 1.f && kf < static_cast<float>(V);
  const bool use_p = p < 1.f;
  if (!(t > 0.f) || (!use_k && !use_p)) {
    if (threadIdx.x == 0) out_floor[r] = -INFINITY;
    return;
  }
  const float it = 1.f / t;
  float m = -INFINITY;
  int bad = 0;
  for_row(row, V, [&](float x, int64_t) {
    bad |= !isfinite(x);
    m = fmaxf(m, x);
  });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  bad = __any_sync(0xffffffffu, bad);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) wmax[warp] = m, wbad[warp] = bad;
  __syncthreads();
  m = -INFINITY, bad = 0;
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, wmax[w]), bad |= wbad[w];
  if (bad) {
    if (threadIdx.x == 0) out_floor[r] = -INFINITY;
    return;
  }
  uint32_t lo = 0;
  if (use_k) lo = radix_select(row, V, 0u, 0, static_cast<unsigned long long>(kf), 0ull, m, it, whist, hist,
                              &above, &digit);
  if (use_p) {
    if (threadIdx.x == 0) total_s = 0;
    __syncthreads();
    unsigned long long mine = 0;
    for_row(row, V, [&](float x, int64_t) {
      if (key_of(x) >= lo) mine += weight(x, m, it);
    });
    atomicAdd(&total_s, mine);
    __syncthreads();
    // The smallest top prefix whose mass reaches p of the total (at least one unit: the max's
    // weight is 2^40, so the target is reached inside the row).
    const double total = static_cast<double>(total_s);
    const double want = ceil(static_cast<double>(p) * total);
    const unsigned long long target = want < 1.0 ? 1ull : static_cast<unsigned long long>(want);
    // The threshold's weight w is at least ((1 - p) * total - 1) / V: what lies at or below it
    // (more than total - target) is at most V tokens of weight <= w. Lighter tokens cannot
    // matter, and in a language model's row they are nearly all of them.
    // (Halved: the fast exp is monotone only up to its rounding, so a token below the threshold
    // may weigh a little more than it.)
    const double bound = floor(((1.0 - static_cast<double>(p)) * total - 1.0) / static_cast<double>(V) / 2.0);
    const unsigned long long wmin = bound > 0.0 ? static_cast<unsigned long long>(bound) : 0ull;
    const uint32_t kp = radix_select(row, V, lo, 1, target, wmin, m, it, whist, hist, &above, &digit);
    lo = kp > lo ? kp : lo;
  }
  if (threadIdx.x == 0) out_floor[r] = float_of(lo);
}

}  // namespace

// floor [rows] float32 for logits [rows, vocab_size] (dtype: 0 float32, 1 float16, 2 bfloat16,
// contiguous), temperature [rows] (0: greedy, no floor), top_k [rows] float32 holding whole
// numbers (0 or >= vocab_size: off) and top_p [rows] float32 in (0, 1] (1: off); either of the
// last two may be null (off for every row).
extern "C" int ngk_logit_floor_rows(int dtype, const void* logits, int64_t rows, int vocab_size,
                                    const float* temperature, const float* top_k, const float* top_p,
                                    float* out_floor, cudaStream_t stream) {
  NGK_REQUIRE(vocab_size >= 1 && vocab_size < (1 << 23));
  NGK_REQUIRE(rows >= 0);
  NGK_REQUIRE(dtype == ngk::kF32 || dtype == ngk::kF16 || dtype == ngk::kBF16);
  if (rows == 0) return 0;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    logit_floor_kernel<T><<<static_cast<unsigned>(rows), kFloorThreads, 0, stream>>>(
        static_cast<const T*>(logits), vocab_size, temperature, top_k, top_p, out_floor);
    NGK_CHECK_LAUNCH();
    return 0;
  };
  if (dtype == ngk::kF16) return go(__half{});
  if (dtype == ngk::kBF16) return go(__nv_bfloat16{});
  return go(float{});
}
