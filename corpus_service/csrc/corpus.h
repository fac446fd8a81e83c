// Corpus: one namespace's draft corpus. Its sources of drafts (each request's own context, its
// group's siblings, its prompt key's history of rollouts, the shared learned corpus of committed
// tokens, named external corpora) merged into one draft tree.
//
// Threads: lookups take the learned corpus' shared lock and run in parallel; inserts are queued and
// applied by one background thread under the exclusive lock, in groups of bounded size with waiting
// lookups let in between, after any growth the group needs was prepared under the shared lock
// (Corpus::grow_learned); synchronize() waits for the queue.
// External corpora are immutable once committed and handed to readers as shared_ptrs, so loading
// and removing never block lookups.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "acceptance_model.h"
#include "draft_pool.h"
#include "draft_tree.h"
#include "group.h"
#include "prompt_history.h"
#include "rank_model.h"
#include "request_state.h"
#include "token_index.h"
#include "tree_rows.h"

namespace ngc {

struct CorpusConfig {
  std::vector<int> own_orders{1, 3, 8};               // n-gram orders indexed per request
  std::vector<int> learned_orders{1, 2, 4, 8};        // ... in the learned corpus
  std::vector<int> external_orders{1, 2, 4, 8, 16};  // ... in external corpora
  int max_candidates = 32;       // occurrences used per source per draft
  int max_chain = 16;            // chain steps per order per lookup
  int max_match = 64;            // longest backward match measured
  int max_depth = 64;            // deepest draft node
  int enough_candidates = 8;     // with this many candidates found ...
  int enough_order = 4;          // ... orders below this one are not searched (0 candidates: never)
  DraftMode mode = DraftMode::kScore;
  ScoreParams score;
  float shared_alpha = 2.0f;     // match-length exponent for the learned and external corpora
  FeedbackParams feedback;       // online calibration from commits (kScore)
  RankParams rank;               // online acceptance model ranking the nodes (kScore; rank_model.h)
  float min_prob = 0.0f;         // stop adding nodes below this path probability
  float weak_weight = 1.0f;      // candidates weighing less than this ...
  int weak_depth = 5;            // ... read at most this many continuation tokens
  float own_weight = 1.0f;       // source weights (kScore)
  float learned_weight = 0.1f;
  float external_weight = 1.0f;
  float group_weight = 0.5f;     // siblings in a request group (own-context scoring; group.h)
  bool learn_prompts = true;     // also feed prompts into the learned corpus
  size_t learned_max_tokens = 0; // memory bound of the learned corpus in tokens (0 = unbounded)
  size_t flush_tokens = 128;     // committed tokens per learned-corpus chunk
  size_t overlap = 16;           // left context carried into a continuing chunk
  int64_t vocab_size = 0;        // if > 0, token ids must be below it
  double request_ttl_s = 600.0;  // idle requests are dropped after this long (0 = never)
  size_t max_requests = 1 << 20; // live requests at most
  size_t max_request_tokens = 1 << 22;  // tokens of one request (prompt + output) at most
  size_t max_external_tokens = size_t{1} << 32;  // tokens in all external corpora together
  int draft_threads = 1;         // threads drafting one batch's requests (draft_pool.h); 1 = the caller alone
  bool learned_copy_growth = true;  // grow the learned index in a copy prepared beside it (Corpus::grow_learned)
  HistoryConfig history;          // prompt history bounds (prompt_history.h); max_charged_tokens 0: off
  float history_weight = 1.0f;    // source weight of a prompt key's rollouts (times the learned multiplier)
  bool learn_source_weights = true;  // learn the sibling and history multipliers from commits (SourceWeights)
  uint32_t source_window = 256;   // tested nodes of a class per multiplier update
};

// How a request starts (Corpus::start_request).
struct StartOptions {
  // 1 feeds the prompt to the learned corpus, 0 does not, -1 follows the config (0 suits a request
  // re-established after a restart, whose tokens were learned already).
  int learn_prompt = -1;
  std::string group;              // requests of one non-empty group key draft from each other (group.h)
  bool learn = true;              // false keeps the request's tokens out of the learned corpus and its
                                  // output out of the history (a replica's requests: the log brings them)
  std::string prompt_key;         // its prompt history key ("" none)
  int64_t policy_version = -1;    // the policy version sampling it (-1: the namespace's current)
  bool key_group = false;         // with no `group`: the key's live requests form one (an explicit key)
};

// A finished request's output as its prompt key's history keeps it (Corpus::rollout).
struct Rollout {
  std::string key;
  int64_t version = 0;
  std::vector<int32_t> tokens;    // the prompt's last tokens (up to HistoryConfig::context), then the output
  size_t output = 0;
};

struct DraftOutput {
  std::vector<int32_t> tokens, parents, counts;
  std::vector<float> probs;
  std::vector<uint64_t> earlier_only;  // draft_merged: per row, merge_with_earlier's earlier_only mask
};

// Trees drafted earlier for the same requests (a pipelined remote step's), to merge into fresh
// ones row by row (tree_merge.h): row i of `earlier`, re-rooted along since[off[i] .. off[i + 1]),
// or, with `since_from`, along request i's tokens after its first since_from[i] (its
// context_lengths() when the earlier tree was asked for; a length it no longer holds re-roots
// nothing, and the fresh tree stands alone).
struct EarlierTrees {
  TreeRows earlier;
  const int32_t* since = nullptr;
  const int64_t* off = nullptr;
  const int64_t* since_from = nullptr;
};

class Corpus {
 public:
  explicit Corpus(CorpusConfig cfg);
  ~Corpus();
  Corpus(const Corpus&) = delete;
  Corpus& operator=(const Corpus&) = delete;

  const CorpusConfig& config() const { return cfg_; }
  void check_tokens(const int32_t* t, size_t n, const char* what) const;

  // Request-level API.
  // learn_prompt: 1 feeds the prompt to the learned corpus, 0 does not, -1 follows the config
  // (0 suits a request re-established after a restart, whose tokens were learned already).
  // group: requests of one non-empty group key draft from each other's context (group.h).
  // learn: false keeps all of the request's tokens out of the learned corpus (a replica's requests).
  void start_request(const std::string& id, const int32_t* prompt, size_t n, const StartOptions& opt = {});
  // A live request's prompt key and version, for one that started without them (SGLang's windows);
  // keep_rollout: its output joins the history when it is erased.
  void set_prompt_key(const std::string& id, const std::string& key, int64_t version, bool keep_rollout);
  void extend(const std::string& id, const int32_t* tokens, size_t n);
  // Extends ids[i] by the next lengths[i] tokens of `tokens`; all or nothing.
  void extend_many(const std::vector<std::string>& ids, const int32_t* tokens, const int64_t* lengths);
  // rollout: its output joins its key's history (a request that ended without finishing, its stream
  // closed or its client gone, does not: a cut rollout would skew what the history says of lengths).
  void finish(const std::string& id, bool rollout = true);
  // What finish would add to the history (false: nothing, e.g. no key or no output yet), for a
  // replica that publishes it to the commit log instead.
  bool rollout(const std::string& id, Rollout* out);
  bool has_request(const std::string& id) const;
  // Drafts at most `budget` nodes per request: tokens/parents/probs padded to budget per row
  // (padding token -1, parent -1, prob 0), counts per request.
  void draft(const std::vector<std::string>& ids, int budget, DraftOutput* out);
  // draft(), each fresh tree merged with its earlier one as it is drafted (tree_merge.h), so a
  // batch's merges run on the draft pool's threads with its drafts (padded [n, budget] output).
  void draft_merged(const std::vector<std::string>& ids, int budget, const EarlierTrees& earlier, DraftOutput* out);
  // Tokens in each request so far (prompt and committed output; -1 for an id it does not hold): what
  // EarlierTrees::since_from counts.
  void context_lengths(const std::vector<std::string>& ids, int64_t* out);
  // The last n tokens of a live request (n <= what it holds: its prompt may be a group's, held once).
  std::vector<int32_t> context_tail(const std::string& id, int64_t n);
  // The same trees unpadded: request i's counts[i] nodes follow request i-1's (the wire layout).
  void draft_compact(const std::vector<std::string>& ids, int budget, DraftOutput* out);
  // SGLang's flattened form: K = budget + 1 tokens per request starting with the last token,
  // padded with token 0 under the root; mask[i][j] = 1 iff j is i or an ancestor of i.
  void draft_flat(const std::vector<std::string>& ids, int k, std::vector<int64_t>* tokens,
                  std::vector<int64_t>* mask);
  // SGLang's stateful match: brings each request in line with its last `window` tokens of
  // `total_len`; starts a request (not feeding the learned corpus) when it is unknown.
  void sync_window(const std::string& id, const int32_t* window, size_t n, uint64_t total_len);
  void erase(const std::string& id);

  // Learned corpus.
  void put(std::vector<std::vector<int32_t>> sequences);  // SGLang batch_put (windows de-duplicated)
  // Each sequence becomes one closed document, in order, with one wake of the insert thread: a
  // replica's log chunks (replication/applier.py). The same stored tokens as a put of the
  // sequence closed by two empty puts, for a fraction of the calls.
  void learn_documents(std::vector<std::vector<int32_t>> documents);
  void synchronize();
  void reset();

  // Prompt history and policy versions (prompt_history.h).
  // The namespace's policy version becomes max(current, v); strict: an older v is refused (StaleVersion).
  int64_t announce_policy_version(int64_t v, bool strict);
  int64_t policy_version() const { return policy_version_.load(std::memory_order_acquire); }
  // Adds a rollout as the commit log delivers it (tokens[0..n): prompt tail, then `output` tokens).
  bool add_rollout(const std::string& key, int64_t version, const int32_t* tokens, size_t n, size_t output);
  std::vector<RolloutView> history_dump() const { return history_.dump(); }
  std::vector<std::pair<int64_t, uint32_t>> history_lengths(const std::string& key) const { return history_.lengths(key); }

  // External corpora.
  // replace: the name may be committed already; the commit then swaps the new corpus in atomically
  // (drafts see the old one until then).
  void begin_external(const std::string& name, bool replace = false);
  void add_external(const std::string& name, const int32_t* tokens, size_t n);
  size_t commit_external(const std::string& name);
  void abort_external(const std::string& name);
  void remove_external(const std::string& name);
  std::map<std::string, size_t> list_externals() const;
  bool is_loading(const std::string& name) const;

  void save(const std::string& path);
  void load(const std::string& path);
  // Snapshots that do not stop the caller (fork_snapshot.h): freeze() flushes pending commits and
  // holds every lock a writer takes, so a fork() copies a consistent corpus; save_frozen() writes it
  // in the forked child (its only thread: no locks); thaw() lets writers and drafts go on.
  void freeze();
  void thaw();
  void save_frozen(const std::string& path) const;
  std::map<std::string, double> stats();
  // The rank model (rank_model.h): its weights, and the deltas replicas exchange.
  std::vector<float> rank_weights() const { return rank_.weights(); }
  std::vector<int32_t> export_rank_delta() { return rank_.export_delta(); }
  void apply_rank_delta(const int32_t* words, size_t n, size_t node_words = RankModel::kDeltaWords) {
    rank_.apply_delta(words, n, cfg_.rank, node_words);
  }
  void check_integrity();
  std::vector<int32_t> learned_tokens();

 private:
  std::shared_ptr<RequestState> get(const std::string& id) const;
  std::shared_ptr<RequestState> new_state(bool learn);
  void check_request_size(size_t have, size_t more) const;
  void release(std::shared_ptr<RequestState> rs);
  void leave_group(RequestState& rs);  // rs ended: drops its group with its last member
  void drop_chunk_records(const std::vector<uint64_t>& serials);  // of group members let go
  void draft_batch(const std::vector<std::string>& ids, int budget, bool pad, DraftOutput* out,
                   const EarlierTrees* merge = nullptr);
  void draft_one(RequestState& rs, int budget, const std::vector<std::shared_ptr<const TokenIndex>>& ext,
                 DraftTree& tree, std::vector<int32_t>& tokens, std::vector<int32_t>& parents,
                 std::vector<float>& probs);
  std::vector<std::shared_ptr<const TokenIndex>> externals_snapshot() const;
  void enqueue_chunk(LearnChunk chunk);
  void worker();
  void apply_chunk(const LearnChunk& c);          // under learned_mu_ exclusive
  void apply_put(std::vector<int32_t>& seq);      // under learned_mu_ exclusive
  void flush_open_docs(bool all);                 // under learned_mu_ exclusive
  void sweep_idle();
  void flush_all_pending();
  // Scores the request's last draft against tokens it commits next (under rs.mu).
  void observe_commit(RequestState& rs, const int32_t* tokens, size_t n);
  bool take_rollout(RequestState& rs, Rollout* out);  // under rs.mu
  // The request's key history, looked up again when keys were created or it was evicted (under rs.mu).
  const KeyHistory* key_history(RequestState& rs);

  CorpusConfig cfg_;

  mutable std::shared_mutex learned_mu_;
  // glibc's rwlock prefers readers: under a steady stream of overlapping drafts the insert thread
  // could wait forever. Drafts pass through this turnstile first, and the insert thread holds it
  // while it waits for and holds the exclusive lock, so new drafts queue behind it.
  std::mutex turnstile_;
  // Drafts between the turnstile and the shared lock. Mutexes are not fair: the insert thread,
  // applying a long queue in groups, would take the turnstile again the moment it let go, and a
  // draft could wait behind many groups in a row; so between groups it lets these in first.
  std::atomic<int> drafts_entering_{0};
  TokenIndex learned_;
  uint64_t learned_epoch_ = 0;  // bumped (under learned_mu_ exclusive) when learned_ is cleared or replaced
  AcceptanceModel acceptance_;  // calibration of node acceptance, learned from every request's commits
  RankModel rank_;              // the online acceptance model that ranks nodes (cfg_.rank)
  PromptHistory history_;       // each prompt key's rollouts
  SourceWeights source_weights_;  // learned multipliers of the sibling and history sources
  std::atomic<int64_t> policy_version_{0};
  std::atomic<uint64_t> implied_group_full_{0}, rollouts_incomplete_{0};

  mutable std::mutex req_mu_;
  std::unordered_map<std::string, std::shared_ptr<RequestState>> requests_;
  std::vector<std::shared_ptr<RequestState>> pool_;  // finished states kept for reuse (warm memory)
  int64_t last_sweep_ns_ = 0;
  GroupRegistry groups_;

  mutable std::mutex ext_mu_;
  std::map<std::string, std::shared_ptr<const TokenIndex>> externals_;
  std::map<std::string, std::shared_ptr<TokenIndex>> staging_;
  size_t external_tokens_ = 0;

  // Background inserts.
  struct Item {
    bool is_put;
    LearnChunk chunk;
    std::vector<std::vector<int32_t>> seqs;
  };
  // Stored tokens an item adds to the learned index (an upper estimate), and indexed ones.
  size_t stored_estimate(const Item& it) const;
  static size_t indexed_estimate(const Item& it);
  // Grows the learned index for a group of `more` stored (`indexed` indexed) tokens under the
  // shared lock, before the group is applied (see corpus_learned.cc).
  void grow_learned(size_t more, size_t indexed);
  // Between two groups of a batch: waits (up to 2 ms) until the drafts queued at the turnstile hold the shared lock.
  void let_drafts_in();
  // Stored tokens per exclusive hold of the learned lock when applying a batch, without a bound.
  static constexpr size_t kApplyGroupTokens = size_t{1} << 14;
  std::mutex q_mu_;
  std::condition_variable q_cv_, done_cv_;
  std::deque<Item> queue_;
  uint64_t enqueued_ = 0, applied_ = 0;
  bool stop_ = false;
  std::string worker_error_;
  std::thread worker_;

  // SGLang batch_put documents still open for continuation (worker thread only).
  struct OpenDoc {
    std::vector<int32_t> tokens;  // whole document so far (tail used for context)
    size_t pending = 0;           // trailing tokens not yet flushed
    uint64_t last_put = 0;
    uint64_t last_end = UINT64_MAX;  // last position of its latest chunk in the learned corpus
  };
  std::unordered_map<uint64_t, std::vector<uint64_t>> open_by_tail_;
  std::unordered_map<uint64_t, OpenDoc> open_docs_;
  uint64_t next_doc_ = 0, put_calls_ = 0;
  // Live requests' chunks in the learned corpus (first and last indexed position), by request
  // serial: the latest one is continued by the next chunk, and drafts for the request skip them all.
  // Written by the insert thread under the exclusive lock, read by drafts under the shared one.
  std::unordered_map<uint64_t, PositionRanges> live_chunks_;
  std::atomic<uint64_t> next_serial_{0};

  std::atomic<uint64_t> n_drafts_{0}, n_draft_nodes_{0}, n_extend_tokens_{0}, n_draft_ns_{0};
  std::unique_ptr<DraftPool> draft_pool_;  // draft_threads > 1
};

}  // namespace ngc
