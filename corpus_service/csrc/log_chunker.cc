#include "log_chunker.h"

#include <stdexcept>

namespace ngc {

LogChunker::LogChunker(size_t flush_tokens, bool learn_prompts)
    : flush_tokens_(flush_tokens), learn_prompts_(learn_prompts) {
  if (flush_tokens == 0) throw std::invalid_argument("flush_tokens: expected >= 1");
}

void LogChunker::start(const std::string& rid, const int32_t* prompt, size_t n, int learn, Chunks* out) {
  const bool keep = learn < 0 ? learn_prompts_ : learn != 0;
  std::lock_guard<std::mutex> g(mu_);
  auto& p = pending_[rid];
  p.clear();
  if (!keep || n == 0) return;
  if (n >= flush_tokens_)
    out->emplace_back(prompt, prompt + n);
  else
    p.assign(prompt, prompt + n);
}

void LogChunker::extend_packed(const std::vector<std::string>& rids, const int64_t* lengths,
                               const int32_t* tokens, Chunks* out) {
  std::lock_guard<std::mutex> g(mu_);
  size_t pos = 0;
  for (size_t i = 0; i < rids.size(); ++i) {
    const size_t n = static_cast<size_t>(lengths[i]);
    auto it = pending_.find(rids[i]);
    if (it != pending_.end()) {
      auto& p = it->second;
      p.insert(p.end(), tokens + pos, tokens + pos + n);
      if (p.size() >= flush_tokens_) {
        out->push_back(std::move(p));
        p = std::vector<int32_t>();
        p.reserve(flush_tokens_);
      }
    }
    pos += n;
  }
}

void LogChunker::finish(const std::string& rid, Chunks* out) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = pending_.find(rid);
  if (it == pending_.end()) return;
  if (!it->second.empty()) out->push_back(std::move(it->second));
  pending_.erase(it);
}

size_t LogChunker::live() const {
  std::lock_guard<std::mutex> g(mu_);
  return pending_.size();
}

}  // namespace ngc
