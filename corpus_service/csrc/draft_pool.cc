#include "draft_pool.h"

#include <stdexcept>

namespace ngc {

DraftPool::DraftPool(int threads) {
  if (threads < 2 || threads > 64) throw std::invalid_argument("draft pool: expected 2..64 threads");
  workers_.reserve(static_cast<size_t>(threads - 1));
  for (int i = 0; i < threads - 1; ++i) workers_.emplace_back([this] { work(); });
}

DraftPool::~DraftPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void DraftPool::drain() {
  for (size_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) {
    try {
      (*fn_)(i);
    } catch (...) {
      std::lock_guard<std::mutex> g(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void DraftPool::work() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> g(mu_);
      wake_.wait(g, [&] { return stop_ || batch_ != seen; });
      if (stop_) return;
      seen = batch_;
    }
    drain();
    {
      std::lock_guard<std::mutex> g(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }
}

bool DraftPool::try_run(size_t n, const std::function<void(size_t)>& fn) {
  std::unique_lock<std::mutex> run(run_mu_, std::try_to_lock);
  if (!run.owns_lock()) return false;
  {
    std::lock_guard<std::mutex> g(mu_);
    fn_ = &fn, n_ = n, error_ = nullptr, busy_ = static_cast<int>(workers_.size());
    next_.store(0);
    ++batch_;
  }
  wake_.notify_all();
  drain();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> g(mu_);
    done_.wait(g, [&] { return busy_ == 0; });  // workers are done with fn_ before it goes away
    fn_ = nullptr;
    error = error_;
  }
  if (error) std::rethrow_exception(error);
  return true;
}

}  // namespace ngc
