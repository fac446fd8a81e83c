// A replica's committed tokens -> learned-corpus chunks for the commit log (replication/chunker.py).
// A replicated engine does not feed its own learned corpus: the replica that received a request's
// tokens cuts them into chunks as a single node's engine would (the prompt when learned, then all
// pending tokens once flush_tokens are pending, the rest at finish) and publishes each chunk.
// Per request it holds fewer than flush_tokens tokens.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace ngc {

class LogChunker {
 public:
  using Chunks = std::vector<std::vector<int32_t>>;

  LogChunker(size_t flush_tokens, bool learn_prompts);

  // Each call appends the chunks that fall due to `out`, in order.
  // learn: 1 learn the prompt, 0 do not, -1 the chunker's default.
  void start(const std::string& rid, const int32_t* prompt, size_t n, int learn, Chunks* out);
  // Extends each of `rids` (distinct) by its next lengths[i] tokens; unknown ids are skipped (the
  // requests of finished sessions: their tokens are not learned).
  void extend_packed(const std::vector<std::string>& rids, const int64_t* lengths, const int32_t* tokens,
                     Chunks* out);
  void finish(const std::string& rid, Chunks* out);
  size_t live() const;

 private:
  const size_t flush_tokens_;
  const bool learn_prompts_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::vector<int32_t>> pending_;
};

}  // namespace ngc
