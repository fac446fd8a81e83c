// Per-thread last-error message for the ctypes boundary (see common.cuh).
#include <stdio.h>

#include "common.cuh"

namespace {
thread_local char g_last_error[512] = "";
}

namespace ngk {
int record_error(const char* file, int line, cudaError_t err) {
  snprintf(g_last_error, sizeof(g_last_error), "%s:%d: CUDA error %d (%s): %s", file, line,
           static_cast<int>(err), cudaGetErrorName(err), cudaGetErrorString(err));
  return static_cast<int>(err);
}

int record_arg_error(const char* file, int line, const char* what) {
  snprintf(g_last_error, sizeof(g_last_error), "%s:%d: invalid argument: %s", file, line, what);
  return -1;
}
}  // namespace ngk

extern "C" const char* ngk_last_error() { return g_last_error; }

// Lets the loader check it got the library version it expects.
extern "C" int ngk_abi_version() { return 5; }
