// PromptHistory: each prompt key's finished rollouts, a drafting source of their own.
//
// RL rollouts sample the same prompt again and again (G samples per step, every step an epoch),
// across replicas and over time; what earlier samples of a prompt generated is the best evidence of
// what the next one will. Each key (a client's prompt id, or a hash of the prompt ids) keeps its
// rollouts in one TokenIndex, one document per rollout: the prompt's last `context` tokens, indexed,
// so the first output tokens can be drafted, then the output. Rollouts carry the policy version that
// generated them; SourceWeights learns from commits how much each version age (and a live sibling)
// counts.
//
// Bounds: per key at most max_rollouts rollouts and max_key_tokens stored tokens (the oldest rollouts
// go first), rollouts max_age or more versions older than the key's newest (or the namespace's
// announced version) are dropped, and in total at most max_charged_tokens charged tokens, whole keys
// evicted least recently written first. A key is charged max(stored, kMinKeyCharge) + 2 per rollout +
// 8 tokens, so the bound also covers small keys' fixed costs (head tables, metadata): with 3 orders a
// charged token costs at most kBytesPerChargedToken bytes (worst_case_history_bytes_per_token in
// engine/config.py says why), and the byte bound becomes a token bound that every replica applies
// identically (it depends only on the rollouts and announcements applied, in their order).
//
// Threads: writers (add, announce, clear, load) hold mu_ throughout; drafts read a key's index under
// its shared lock, holding the KeyHistory by shared_ptr (an evicted key lives on until its last
// reader lets go). Lock order: mu_ -> a key's mu.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "acceptance_model.h"
#include "token_index.h"

namespace ngc {

class ByteWriter;
class ByteReader;

constexpr size_t kMinKeyCharge = 256;
constexpr double kBytesPerChargedToken = 48.0;
constexpr size_t kIndexBytesPerChargedToken = 40;  // of which the index; the rest: records, the key, slack

struct HistoryConfig {
  size_t max_rollouts = 64;        // per key
  size_t max_key_tokens = 32768;   // stored tokens per key
  size_t max_charged_tokens = 0;   // in total (0: no history)
  int64_t max_age = 4;             // rollouts this many versions old are dropped (0: never)
  int context = 16;                // prompt tail tokens stored ahead of each output
};

struct HistoryRollout {
  uint64_t first;    // its first position in the key's index
  uint32_t tokens;   // stored tokens: prompt tail + output
  uint32_t output;   // output tokens
  int64_t version;   // policy version that generated it
};

struct KeyHistory {
  explicit KeyHistory(const std::vector<int>& orders) : index(orders) {}
  mutable std::shared_mutex mu;  // written exclusively (under PromptHistory::mu_), read shared by drafts
  TokenIndex index;
  std::deque<HistoryRollout> rollouts;  // arrival order, oldest first
  int64_t newest = -1;                  // newest version added
  std::atomic<bool> evicted{false};     // dropped from the registry: holders look the key up again
  // The rollout holding position pos (a live position of the index).
  const HistoryRollout& rollout_at(uint64_t pos) const;
};

// A rollout as stored, for inspection, digests and the replication tests.
struct RolloutView {
  std::string key;
  int64_t version;
  uint32_t output;
  std::vector<int32_t> tokens;
};

class PromptHistory {
 public:
  PromptHistory(std::vector<int> orders, HistoryConfig cfg);
  bool enabled() const { return cfg_.max_charged_tokens > 0; }
  const HistoryConfig& config() const { return cfg_; }

  // Adds a rollout: tokens[0..n) are the prompt tail (n - output tokens) then the output. Returns
  // false when nothing was stored (history off, no output, or max_age versions older than the key's
  // newest rollout or the announced version: counted as dropped).
  bool add(const std::string& key, int64_t version, const int32_t* tokens, size_t n, size_t output);
  // The key's history (null if it has none); `created` receives the count of keys ever created, so a
  // request without one looks again only when a key was created since.
  std::shared_ptr<const KeyHistory> find(const std::string& key) const;
  uint64_t created() const { return created_.load(std::memory_order_acquire); }
  // The namespace's policy version is now `current`: rollouts max_age or more versions older go.
  void announce(int64_t current);
  void clear();

  struct Totals {
    size_t keys = 0, rollouts = 0, stored = 0, output = 0, charged = 0, bytes = 0;
    uint64_t added = 0, truncated = 0, evicted_keys = 0, dropped_rollouts = 0;
  };
  Totals totals() const;
  // Output lengths and versions of a key's rollouts (oldest first).
  std::vector<std::pair<int64_t, uint32_t>> lengths(const std::string& key) const;
  // Every rollout, keys least recently written first (what replicas must agree on).
  std::vector<RolloutView> dump() const;
  void check_integrity() const;

  // Snapshots: the caller holds no lock (save/load) or holds lock() (a frozen corpus, fork_snapshot.h).
  void save(ByteWriter& w) const;
  void save_locked(ByteWriter& w) const;
  // A snapshot's history, read and checked (CorruptSnapshot on bad data), then installed in place of
  // everything (a loading corpus installs it only once all of the snapshot was read).
  struct Entry {
    std::shared_ptr<KeyHistory> h;
    std::list<std::string>::iterator lru;
    size_t charged = 0;
  };
  struct Loaded {
    std::unordered_map<std::string, Entry> keys;
    std::list<std::string> lru;
    size_t charged = 0;
    int64_t announced = -1;  // the namespace's version when it was saved (set by the corpus)
  };
  Loaded parse(ByteReader& r) const;
  void install(Loaded&& l);
  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

 private:
  static size_t charge_of(const KeyHistory& h);
  static void check_key(const std::string& key, const KeyHistory& h);  // std::logic_error on a violation
  void drop_front(KeyHistory& h, size_t n);      // the n oldest rollouts (h.mu held)
  void drop_old(KeyHistory& h, int64_t newest);  // every rollout max_age versions older than newest (h.mu held)
  void recharge(Entry& e);                       // after h changed (mu_ held)
  void erase(std::unordered_map<std::string, Entry>::iterator it);
  void enforce_total(const std::string& keep);   // evicts least recently written keys

  std::vector<int> orders_;
  HistoryConfig cfg_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> keys_;
  std::list<std::string> lru_;  // least recently written first
  size_t charged_ = 0;
  std::atomic<uint64_t> created_{0};
  uint64_t added_ = 0, truncated_ = 0, evicted_keys_ = 0, dropped_rollouts_ = 0;
  int64_t announced_ = -1;  // the newest announced version (kept by clear: the namespace keeps its version)
};

// Source classes of draft candidates (DraftTree::add), for SourceWeights: what each node's heaviest
// vote came from.
enum SourceClass : uint8_t {
  kSrcOwn = 0,
  kSrcSibling = 1,   // a live (or ended) member of the request's group
  kSrcHistory = 2,   // + min(age, 3): a rollout of the request's prompt key, `age` versions apart
  kSrcLearned = 6,
  kSrcExternal = 7,
};
constexpr int kLearnedClasses = 5;  // sibling, history age 0, 1, 2, 3+

// Learned multipliers of the sibling and history source weights: the verifier's commits say how
// often a node whose heaviest vote came from a class was accepted, against the acceptance the tree
// estimated (its conditional q). Every `window` tested nodes of a class, its multiplier moves by the
// ratio (accepted + 4) / (estimated + 4), clamped to [1/2, 2] per update and [1/16, 16] in all, so
// the estimates of each class come to match what is accepted and the tree ranks a history node
// against an own-context one by their real chances. Own context, learned and external corpora are
// the reference (not learned). Same call sequence, same multipliers.
class SourceWeights {
 public:
  SourceWeights();
  float multiplier(int cls) const;  // cls a SourceClass in [kSrcSibling, kSrcHistory + 3]
  void observe(const DraftRecord& rec, const int32_t* committed, size_t n, uint32_t window);
  void clear();
  struct ClassStats {
    float multiplier;
    uint64_t tested, accepted;
  };
  ClassStats stats(int i) const;  // i in [0, kLearnedClasses)

 private:
  std::atomic<float> mult_[kLearnedClasses];
  mutable std::mutex mu_;
  double win_accepted_[kLearnedClasses], win_expected_[kLearnedClasses];
  uint32_t win_tested_[kLearnedClasses];
  uint64_t tested_[kLearnedClasses], accepted_[kLearnedClasses];
};

}  // namespace ngc
