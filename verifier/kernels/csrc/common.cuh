// Shared helpers for the verifier kernels. The library exposes plain `extern "C"` host functions
// taking raw device pointers and a cudaStream_t, so it builds without torch headers (seconds, not
// a minute) and is loaded from Python with ctypes.
//
// Every host entry point returns 0 on success or a cudaError_t value; the message, with the
// file:line that detected it, is kept per thread and read back with ngk_last_error().
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

// The largest tree (root included) the kernels accept: ancestor sets are 64-bit masks.
#define NGK_MAX_NODES 64

namespace ngk {
// Records `err` with its source location for ngk_last_error(); returns err as an int.
int record_error(const char* file, int line, cudaError_t err);
// Records an argument error (not a CUDA error) with its source location; returns -1.
int record_arg_error(const char* file, int line, const char* what);
}  // namespace ngk

// Checks the launch that just happened (bad configuration, missing kernel image, ...).
#define NGK_CHECK_LAUNCH()                                                 \
  do {                                                                     \
    cudaError_t ngk_err_ = cudaGetLastError();                             \
    if (ngk_err_ != cudaSuccess) {                                         \
      return ngk::record_error(__FILE__, __LINE__, ngk_err_);              \
    }                                                                      \
  } while (0)

#define NGK_REQUIRE(cond)                                                  \
  do {                                                                     \
    if (!(cond)) return ngk::record_arg_error(__FILE__, __LINE__, #cond);  \
  } while (0)

// Loads node index `v` of a linked tree, treating anything outside [0, K) as "none" (-1), so a
// malformed link can never index out of bounds. The torch reference applies the same rule.
__device__ __forceinline__ int ngk_node(int64_t v, int K) {
  return (v >= 0 && v < K) ? static_cast<int>(v) : -1;
}
