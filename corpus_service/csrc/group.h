// Request groups: the requests of one group (the n samples of one prompt) draft from each other.
//
// Every member's context index (RequestState::own) is a draft source for its siblings from the
// moment a token is committed, scored like the own context (weight group_weight). Members append to
// `own` under the group's exclusive lock (and their own mutex); drafts read siblings under the shared
// one. Lock order: req_mu_ -> registry -> a member's mu -> the group's mu.
//
// The prompt is indexed once: the first member (the founder, members[0]) indexes it; a later member
// that shares a prefix of it keeps only that prefix's last max_match tokens in `own`, as unindexed
// left context (matches reach across into its output), and drafts the prefix's occurrences from the
// founder's index with its own weight. So each occurrence counts once: only the founder feeds the
// prefix to the learned corpus, and drafts of any member skip every member's chunks in the learned
// corpus while the group lives (the siblings' indexes hold those tokens already). A member that
// indexed the prefix itself anyway (a concurrent start raced the founder's) skips it in its siblings.
//
// Finished members stay sources until the last member ends; then the group is dropped and the states
// it held are freed (or pooled).
//
// An explicit prompt key (StartOptions::key_group) makes its live requests a group of their own, under
// kKeyGroupPrefix + key: namespace-wide, where a client's group keys are scoped to its session.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "request_state.h"
#include "token_index.h"

namespace ngc {

// Members (live and ended) one group keeps as sources: a client that reuses one key for every
// request must not grow a group, and the work of each draft, without bound. Beyond it the oldest
// ended member is let go (its tokens stay in the learned corpus); live members beyond it are refused.
constexpr size_t kMaxGroupMembers = 64;
// Groups implied by prompt keys: no group key a caller passes starts with NUL (the facade refuses them).
inline constexpr std::string_view kKeyGroupPrefix{"\0key:", 5};

struct RequestGroup {
  explicit RequestGroup(std::string k) : key(std::move(k)) {}
  const RequestState* founder() const { return members.empty() ? nullptr : members.front().get(); }
  const std::string key;
  mutable std::shared_mutex mu;  // members' `own` are written under it exclusively, read by drafts shared
  std::vector<int32_t> prompt;   // the first member's prompt: later members share its common prefix
  bool prompt_learned = false;   // the first member fed its prompt to the learned corpus
  std::vector<std::shared_ptr<RequestState>> members;  // live and ended, in join order; founder first
  size_t live = 0;               // members not yet ended
};

// Holds the group's exclusive lock while a member's `own` is written (nothing outside a group).
class GroupWriteLock {
 public:
  explicit GroupWriteLock(const RequestState& rs) {
    if (rs.group) lock_ = std::unique_lock<std::shared_mutex>(rs.group->mu);
  }

 private:
  std::unique_lock<std::shared_mutex> lock_;
};

// One sibling as a draft source: its index, the positions to skip, where its current position
// starts (excluded like the own context's: it has no continuation), and whether it stands in for the
// drafting member's own context (the founder's copy of a borrowed prompt prefix).
struct SiblingSource {
  const TokenIndex* index;
  PositionRanges skip;
  uint64_t exclude_from;
  bool as_own;
};

// The siblings of rs as sources; the caller holds the group's shared lock.
void sibling_sources(const RequestState& rs, std::vector<SiblingSource>* out);
// Every member's chunks in the learned corpus (the union of their `live_chunks` entries) into *out;
// the caller holds the group's shared lock and the learned corpus' lock.
void group_chunks(const RequestGroup& g, const std::unordered_map<uint64_t, PositionRanges>& live_chunks,
                  PositionRanges* out);

class GroupRegistry {
 public:
  // How many leading prompt tokens a member whose prompt is prompt[0..n) shares with the group `key`
  // (0 if there is no such group yet): what it may leave to the founder's index.
  size_t shared_prefix(const std::string& key, const int32_t* prompt, size_t n) const;
  GroupRegistry() = default;
  GroupRegistry(const GroupRegistry&) = delete;
  GroupRegistry& operator=(const GroupRegistry&) = delete;
  ~GroupRegistry() { clear(); }

  // Adds rs, whose `own` holds its prompt, to the group `key` (created if new): sets rs->group and
  // rs->shared_prefix. Returns how many leading prompt tokens the learned corpus already gets from
  // an earlier member (0 for the first member). `learn_prompt`: whether rs feeds its prompt. The
  // serials of ended members let go to stay within kMaxGroupMembers are appended to *dropped;
  // LimitExceeded (nothing changed) if kMaxGroupMembers members are live. A borrowed rs whose
  // shared_prefix no longer holds (the group changed since `shared_prefix`) comes back with
  // borrowed = false: the caller then indexes its whole prompt.
  size_t join(const std::string& key, const std::shared_ptr<RequestState>& rs, const int32_t* prompt, size_t n,
              bool learn_prompt, std::vector<uint64_t>* dropped);
  // rs ended (finish, erase, idle expiry). When it was its group's last live member the group is
  // dropped; the serials of all its members are appended to *ended (their chunk records can go).
  void leave(RequestState& rs, std::vector<uint64_t>* ended);
  // Drops every group (reset, destruction), breaking the group <-> member references.
  void clear();
  size_t size() const;
  // Verifies the groups against the live requests (each live member is in its group, counts agree).
  void check_integrity(const std::vector<std::shared_ptr<RequestState>>& live) const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<RequestGroup>> groups_;
};

}  // namespace ngc
