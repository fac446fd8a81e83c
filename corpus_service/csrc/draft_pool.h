// DraftPool: a few threads that draft the requests of one batch in parallel.
//
// A batch draft of 64 requests is ~300 us of independent per-request work (each request's state
// under its own mutex, the learned corpus under the caller's shared lock). The pool's threads sleep
// between batches; the calling thread works too. One batch at a time: a caller that finds the pool
// busy (another thread's batch) drafts its batch alone rather than wait.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ngc {

class DraftPool {
 public:
  explicit DraftPool(int threads);  // threads in all, the caller included (>= 2)
  ~DraftPool();
  DraftPool(const DraftPool&) = delete;
  DraftPool& operator=(const DraftPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(i) for every i in [0, n), spread over the pool and the calling thread; returns when all
  // are done (rethrowing the first exception). Returns false, having run nothing, if the pool is busy.
  bool try_run(size_t n, const std::function<void(size_t)>& fn);

 private:
  void work();
  void drain();  // takes items until none is left

  std::mutex run_mu_;  // held for a whole batch
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t n_ = 0;
  std::atomic<size_t> next_{0};
  int busy_ = 0;         // workers still on the current batch
  uint64_t batch_ = 0;   // batches started (workers wake on a change)
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
};

}  // namespace ngc
