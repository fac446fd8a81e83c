// Corpus's internals shared by its translation units (corpus.cc: construction and requests;
// corpus_draft.cc: drafting; corpus_learned.cc: the learned corpus, prompt history and external
// corpora; corpus_persist.cc: snapshots and stats). Not part of the engine's interface.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "errors.h"

namespace ngc::corpus_detail {
// SGLang's batch_put sends overlapping windows; a window continues an open document when its
// prefix ends with that document's last kTailKey tokens.
inline constexpr int kTailKey = 8;
// A batch_put document that no put call continued for this many calls is considered finished.
inline constexpr uint64_t kOpenDocIdleCalls = 2;
inline constexpr size_t kMaxOpenDocs = 1 << 16;
// The doc serial of a learned document that belongs to no request (learn_documents): request serials
// count up from 0 and never reach it.
inline constexpr uint64_t kNoRequestDoc = UINT64_MAX;
// Finished request states kept warm for reuse, and the largest one worth keeping.
inline constexpr size_t kMaxPooled = 64;
inline constexpr size_t kMaxPooledTokens = 1 << 16;
// Continuations of batch_put windows become visible in chunks of at most this many tokens, each
// carrying the kTailKey tokens before it as left context. SGLang puts every running request's
// window after every step, so a batch's requests draft from each other's fresh output: 8-token
// chunks drafted 1-3.6% more than 32-token chunks with 16 tokens of context at 16 requests at once
// (within 0.4% at one), for 51-62 instead of 42-51 bytes per learned token (bench/sglang_pattern.py).
inline constexpr size_t kPutFlushTokens = 8;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline UnknownRequest unknown_request(const std::string& id) {
  return UnknownRequest("unknown request id '" + id + "' (never started, finished, or expired)");
}
}  // namespace ngc::corpus_detail
