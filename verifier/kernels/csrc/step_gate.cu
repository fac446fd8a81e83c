// A greedy step enqueued before its input exists (verifier.step.cuda_graphs, "armed" steps).
//
// A drafting step's input (the draft trees) is made on the host from the previous step's results,
// so the step cannot be launched until then. Launching a SmolLM2 step graph costs ~60 us of host
// time and its start lags the launch; at batch 1 on the H200 a drafting step took 1.22 ms against
// 0.82 ms of GPU work. Instead, the next step is enqueued while the current one runs, behind this
// kernel: one block that waits (polling a pinned host word) until the host has written the step's
// input into its pinned staging buffer and opened the gate, then copies that input to the graph's
// device input. The graph replay queued behind it starts as soon as the gate opens.
//
// The wait is bounded: past `timeout_ns` the kernel gives up, writes `seq` into the host's status
// word and fills the device input with padding (every row isolated nodes at position 0 of the
// scratch slot), so the graph behind it runs a harmless step and the host relaunches for real. A
// host that never opens the gate thus costs that timeout, never a hung GPU.
#include "common.cuh"

#include <atomic>

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t load_acquire_sys(const int64_t* p) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(kThreads)
    wait_gate_kernel(const int64_t* gate, int64_t* status, int64_t seq, int64_t timeout_ns, const int64_t* src,
                     int64_t* dst, int B, int K, int64_t scratch) {
  __shared__ int open;
  if (threadIdx.x == 0) {
    const uint64_t start = global_ns();
    int ok = 0;
    // Each poll is a read of host memory across PCIe: back off to one every few microseconds (the
    // host's work between steps is ~0.1-0.3 ms), so the polling stays out of the host's way.
    unsigned pause = 128;
    for (;;) {
      if (load_acquire_sys(gate) >= seq) {
        ok = 1;
        break;
      }
      if (global_ns() - start > static_cast<uint64_t>(timeout_ns)) break;
      __nanosleep(pause);
      pause = pause < 4096 ? 2 * pause : pause;
    }
    if (!ok) {
      *reinterpret_cast<volatile int64_t*>(status) = seq;
      __threadfence_system();
    }
    open = ok;
  }
  __syncthreads();
  const int64_t nk = static_cast<int64_t>(B) * K, n = 2 * nk + 2 * B;
  if (open) {
    const volatile int64_t* s = src;  // host memory written after this kernel was enqueued: no cached copy
    for (int64_t i = threadIdx.x; i < n; i += kThreads) dst[i] = s[i];
  } else {  // the step's padding input: tokens 0, isolated parents, prefix 0, the scratch slot
    for (int64_t i = threadIdx.x; i < n; i += kThreads)
      dst[i] = i < nk ? 0 : i < 2 * nk ? -1 : i < 2 * nk + B ? 0 : scratch;
  }
}

}  // namespace

// gate, status: pinned host int64 words; src: the step's pinned staging [2 B K + 2 B] (host);
// dst: the graph's device input of the same layout. Enqueued on `stream`; returns at once.
extern "C" int ngk_wait_gate(const int64_t* gate, int64_t* status, int64_t seq, int64_t timeout_ns, const int64_t* src,
                             int64_t* dst, int B, int K, int64_t scratch, cudaStream_t stream) {
  NGK_REQUIRE(B >= 1 && K >= 1 && seq >= 1 && timeout_ns >= 0);
  int64_t *dgate = nullptr, *dstatus = nullptr, *dsrc = nullptr;
  // Pinned host memory is device-accessible under unified addressing; the device pointers (the
  // same addresses there) are asked for so that memory that is not pinned fails here, not on the GPU.
  cudaError_t err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dgate), const_cast<int64_t*>(gate), 0);
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dstatus), status, 0);
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dsrc), const_cast<int64_t*>(src), 0);
  if (err != cudaSuccess) return ngk::record_error(__FILE__, __LINE__, err);
  wait_gate_kernel<<<1, kThreads, 0, stream>>>(dgate, dstatus, seq, timeout_ns, dsrc, dst, B, K, scratch);
  NGK_CHECK_LAUNCH();
  return 0;
}

// Opens the gate for step `seq`: every store the host made before (the step's input) is visible to
// the device once it sees the new value.
extern "C" int ngk_open_gate(int64_t* gate, int64_t seq) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  *reinterpret_cast<volatile int64_t*>(gate) = seq;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return 0;
}
