// RequestState: what the corpus keeps for one live request.
//
// `own` indexes the request's prompt and output (prompt lookup: any earlier occurrence of the
// current suffix). Committed output also flows into the shared learned corpus, in chunks of at
// least `flush_tokens` so each chunk is one contiguous document there; a chunk that continues the
// request carries the preceding tokens as unindexed left context so matches reach across.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "acceptance_model.h"
#include "prompt_history.h"
#include "token_index.h"

namespace ngc {

struct RequestGroup;  // group.h

// A chunk headed for the learned corpus: tokens[0..context) are left context only.
struct LearnChunk {
  std::vector<int32_t> tokens;
  size_t context = 0;
  uint64_t doc = 0;   // serial of the request it comes from: chunks of one request are linked
  bool last = false;  // the request ended: no chunk will continue this one
  bool keep = false;  // with last: keep the request's chunk records (its group still drafts around them)
};

struct RequestState {
  RequestState(const std::vector<int>& orders, bool learn, uint64_t serial)
      : own(orders), learn(learn), serial(serial) {}

  std::mutex mu;
  TokenIndex own;                  // prompt + output of this request
  std::vector<int32_t> pending;    // committed tokens not yet sent to the learned corpus
  bool learn;                      // whether committed tokens feed the learned corpus
  uint64_t serial;                 // unique per request, names its chunks in the learned corpus
  uint64_t total_len = 0;          // tokens in the request so far (may exceed own.live() for windows)
  int64_t last_used_ns = 0;        // for the idle timeout
  std::shared_ptr<RequestGroup> group;  // the group it drafts with (null: none; group.h)
  size_t shared_prefix = 0;        // leading prompt tokens equal to the group's prompt
  bool borrowed = false;           // `own` holds only the tail of that prefix, as unindexed context:
                                   // the group's founder indexes it for every member (group.h)
  bool ended = false;              // a group member that finished (still a source for its siblings)
  DraftRecord last_draft;          // the latest draft, scored by the next commit (feedback)
  // Prompt history (prompt_history.h): the request's key ("" none), the policy version sampling it,
  // where its prompt ends, whether its output joins the history when it finishes (false on a
  // replica: the commit log brings it), and its key's history (looked up again once `history_seen`
  // keys were created since, or once it was evicted).
  std::string history_key;
  int64_t policy_version = 0;
  uint64_t prompt_len = 0;
  bool keep_rollout = false;
  std::shared_ptr<const KeyHistory> history;
  uint64_t history_seen = UINT64_MAX;
  bool in_history = false;         // ended, and its output is in its key's history: siblings draft it
                                   // from there, not from `own` (group.h; written under the group's lock)

  // Makes a finished request's state reusable for a new one, keeping its allocations.
  void recycle(bool learn_tokens, uint64_t new_serial) {
    own.reset();
    pending.clear();
    learn = learn_tokens;
    serial = new_serial;
    total_len = 0;
    group.reset();
    shared_prefix = 0;
    borrowed = false;
    ended = false;
    last_draft.reset();
    history_key.clear();
    policy_version = 0;
    prompt_len = 0;
    keep_rollout = false;
    history.reset();
    history_seen = UINT64_MAX;
    in_history = false;
  }

  void touch() {
    last_used_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  // Appends committed tokens; they are queued for the learned corpus when `learn` is set.
  void append(const int32_t* tokens, size_t n) {
    own.extend_last(tokens, n);
    total_len += n;
    if (learn) pending.insert(pending.end(), tokens, tokens + n);
  }
  // Takes the pending tokens as a chunk with up to `overlap` tokens of left context, if at least
  // min_tokens are pending. Returns false when nothing is taken.
  bool take_chunk(size_t min_tokens, size_t overlap, bool last, LearnChunk* out) {
    out->doc = serial;
    out->last = last;
    out->keep = last && group != nullptr;
    if (pending.size() < min_tokens || (pending.empty() && !last)) return false;
    size_t before = own.live() - pending.size();  // tokens of own that precede the pending ones
    size_t ctx = before < overlap ? before : overlap;
    out->tokens.resize(ctx + pending.size());
    own.tail(static_cast<int>(ctx + pending.size()), out->tokens.data());
    out->context = ctx;
    pending.clear();
    return true;
  }
};

}  // namespace ngc
