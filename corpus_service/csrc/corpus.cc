// Corpus: construction and requests (corpus.h; the other parts in corpus_draft.cc, corpus_learned.cc, corpus_persist.cc).
#include "corpus.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "corpus_detail.h"
#include "errors.h"
#include "snapshot.h"
#include "tree_merge.h"

namespace ngc {

using namespace corpus_detail;


Corpus::Corpus(CorpusConfig cfg)
    : cfg_(std::move(cfg)), learned_(cfg_.learned_orders), history_(cfg_.own_orders, cfg_.history) {
  if (cfg_.history.max_key_tokens < 1024) throw std::invalid_argument("history max_key_tokens must be >= 1024");
  if (cfg_.source_window < 1) throw std::invalid_argument("source_window must be >= 1");
  if (cfg_.rank.window < 2 || cfg_.rank.window > (1u << 15)) throw std::invalid_argument("rank window must be in [2, 32768]");
  if (!(cfg_.rank.learning_rate >= 0.0f && cfg_.rank.learning_rate <= 1.0f))
    throw std::invalid_argument("rank learning_rate must be in [0, 1]");
  if (!(cfg_.rank.request_decay >= 0.0f && cfg_.rank.request_decay <= 1.0f))
    throw std::invalid_argument("rank request_decay must be in [0, 1]");
  if (!(cfg_.rank.prior >= 0.0f && cfg_.rank.token_prior >= 0.0f && cfg_.rank.pair_prior >= 0.0f))
    throw std::invalid_argument("rank priors must be >= 0");
  if (cfg_.rank.left_out < 0 || cfg_.rank.left_out > 256) throw std::invalid_argument("rank left_out must be in [0, 256]");
  if (cfg_.rank.max_depth < 0 || cfg_.rank.max_depth > 64) throw std::invalid_argument("rank max_depth must be in [0, 64]");
  if (!(cfg_.rank.pair_rate >= 0.0f && cfg_.rank.pair_rate <= 1.0f)) throw std::invalid_argument("rank pair_rate must be in [0, 1]");
  // Validate the other order sets eagerly so a bad config fails at construction.
  TokenIndex probe_own(cfg_.own_orders), probe_ext(cfg_.external_orders);
  if (cfg_.max_candidates < 1 || cfg_.max_candidates > 1024)
    throw std::invalid_argument("max_candidates must be in [1, 1024]");
  if (cfg_.draft_threads < 1 || cfg_.draft_threads > 64) throw std::invalid_argument("draft_threads must be in [1, 64]");
  if (cfg_.draft_threads > 1) draft_pool_ = std::make_unique<DraftPool>(cfg_.draft_threads);
  worker_ = std::thread([this] { worker(); });
}

Corpus::~Corpus() {
  {
    std::lock_guard<std::mutex> g(q_mu_);
    stop_ = true;
  }
  q_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void Corpus::check_tokens(const int32_t* t, size_t n, const char* what) const {
  for (size_t i = 0; i < n; ++i) {
    if (t[i] < 0)
      throw std::invalid_argument(std::string(what) + ": token ids must be >= 0, got " +
                                  std::to_string(t[i]) + " at index " + std::to_string(i));
    if (cfg_.vocab_size > 0 && t[i] >= cfg_.vocab_size)
      throw std::invalid_argument(std::string(what) + ": token id " + std::to_string(t[i]) + " at index " +
                                  std::to_string(i) + " is outside the vocabulary (size " +
                                  std::to_string(cfg_.vocab_size) + ")");
  }
}

// ---------------------------------------------------------------- requests

std::shared_ptr<RequestState> Corpus::get(const std::string& id) const {
  std::lock_guard<std::mutex> g(req_mu_);
  auto it = requests_.find(id);
  if (it == requests_.end()) throw unknown_request(id);
  return it->second;
}

std::shared_ptr<RequestState> Corpus::new_state(bool learn) {
  {
    std::lock_guard<std::mutex> g(req_mu_);
    if (!pool_.empty()) {
      auto rs = std::move(pool_.back());
      pool_.pop_back();
      rs->recycle(learn, next_serial_++);
      return rs;
    }
  }
  return std::make_shared<RequestState>(cfg_.own_orders, learn, next_serial_++);
}

void Corpus::release(std::shared_ptr<RequestState> rs) {
  // Only a state nobody else holds (no draft in flight on it) may be reused.
  if (rs.use_count() != 1 || rs->own.live() > kMaxPooledTokens) return;
  std::lock_guard<std::mutex> g(req_mu_);
  if (pool_.size() < kMaxPooled) pool_.push_back(std::move(rs));
}

bool Corpus::has_request(const std::string& id) const {
  std::lock_guard<std::mutex> g(req_mu_);
  return requests_.count(id) > 0;
}

void Corpus::sweep_idle() {
  if (cfg_.request_ttl_s <= 0) return;
  int64_t now = now_ns();
  std::vector<std::shared_ptr<RequestState>> expired;
  {
    std::lock_guard<std::mutex> g(req_mu_);
    if (now - last_sweep_ns_ < 1'000'000'000) return;  // at most once a second
    last_sweep_ns_ = now;
    int64_t ttl = static_cast<int64_t>(cfg_.request_ttl_s * 1e9);
    for (auto it = requests_.begin(); it != requests_.end();) {
      if (now - it->second->last_used_ns > ttl) {
        expired.push_back(it->second);
        it = requests_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // What an abandoned request committed is still good data: keep it.
  for (auto& rs : expired) {
    {
      std::lock_guard<std::mutex> g(rs->mu);
      LearnChunk c;
      if (rs->take_chunk(0, cfg_.overlap, true, &c)) enqueue_chunk(std::move(c));
    }
    leave_group(*rs);
  }
}

void Corpus::check_request_size(size_t have, size_t more) const {
  if (have + more > cfg_.max_request_tokens)
    throw LimitExceeded("a request would hold " + std::to_string(have + more) +
                        " tokens, more than max_request_tokens = " + std::to_string(cfg_.max_request_tokens));
}

void Corpus::start_request(const std::string& id, const int32_t* prompt, size_t n, const StartOptions& opt) {
  check_tokens(prompt, n, "prompt");
  check_request_size(0, n);
  if (opt.policy_version < -1) throw std::invalid_argument("policy_version must be >= 0 (or -1: the namespace's)");
  sweep_idle();
  const bool learn = opt.learn;
  auto rs = new_state(learn);
  // An explicit prompt key stands for "samples of one prompt": its live requests form a group
  // (namespace-wide, unlike a client's group keys), so siblings on every replica draft from each
  // other at once; finished ones live on in the key's history.
  const bool implied = opt.group.empty() && opt.key_group && !opt.prompt_key.empty();
  const std::string group = implied ? std::string(kKeyGroupPrefix) + opt.prompt_key : opt.group;
  // A later member of a group leaves the prompt prefix it shares to the founder's index (group.h):
  // it keeps the prefix's tail as unindexed left context, so matches still reach into its output.
  const size_t borrow = group.empty() ? 0 : groups_.shared_prefix(group, prompt, n);
  if (borrow > 0) {
    const size_t c = std::min(borrow, static_cast<size_t>(cfg_.max_match));
    rs->own.append_document(prompt + borrow - c, n - borrow + c, c);
    rs->borrowed = true;
    rs->shared_prefix = borrow;
  } else {
    rs->own.extend_last(prompt, n);
  }
  rs->total_len = n;
  rs->prompt_len = n;
  rs->history_key = opt.prompt_key;
  rs->policy_version = opt.policy_version >= 0 ? opt.policy_version : policy_version();
  rs->keep_rollout = learn && !opt.prompt_key.empty();
  const bool learn_p = learn && (opt.learn_prompt > 0 || (opt.learn_prompt < 0 && cfg_.learn_prompts));
  rs->touch();
  std::lock_guard<std::mutex> g(req_mu_);
  if (requests_.count(id)) throw AlreadyExists("request id '" + id + "' is already live");
  if (requests_.size() >= cfg_.max_requests)
    throw LimitExceeded("too many live requests (max_requests = " + std::to_string(cfg_.max_requests) + ")");
  // A later member of a group does not feed the learned corpus the prompt prefix it shares.
  std::vector<uint64_t> dropped;
  size_t skip = 0;
  if (!group.empty()) {
    try {
      skip = groups_.join(group, rs, prompt, n, learn_p, &dropped);
    } catch (const LimitExceeded&) {
      if (!implied) throw;
      // A key's group is full (kMaxGroupMembers live): this one drafts from the history alone.
      ++implied_group_full_;
      rs->borrowed = false;
    }
  }
  if (borrow > 0 && !rs->borrowed) {  // the group changed since the look-up: index the whole prompt
    GroupWriteLock gw(*rs);
    rs->own.reset();
    rs->own.extend_last(prompt, n);
    rs->shared_prefix = rs->group ? rs->shared_prefix : 0;
  }
  // Pending tokens are read back from `own`: a borrowed prefix is not there to learn (the founder's is).
  if (rs->borrowed) skip = rs->shared_prefix;
  if (learn_p) rs->pending.assign(prompt + skip, prompt + n);
  requests_.emplace(id, std::move(rs));
  drop_chunk_records(dropped);
}

void Corpus::set_prompt_key(const std::string& id, const std::string& key, int64_t version, bool keep_rollout) {
  if (version < -1) throw std::invalid_argument("policy_version must be >= 0 (or -1: the namespace's)");
  auto rs = get(id);
  std::lock_guard<std::mutex> g(rs->mu);
  rs->history_key = key;
  rs->policy_version = version >= 0 ? version : policy_version();
  rs->keep_rollout = keep_rollout && !key.empty();
  // SGLang's window path: what the request held when it was first seen is its prompt; its output is
  // what follows (a rollout of the whole window would store the prompt as output).
  rs->prompt_len = rs->total_len;
  rs->history.reset();
  rs->history_seen = UINT64_MAX;
}

void Corpus::extend(const std::string& id, const int32_t* tokens, size_t n) {
  check_tokens(tokens, n, "tokens");
  auto rs = get(id);
  LearnChunk c;
  bool flush;
  {
    std::lock_guard<std::mutex> g(rs->mu);
    check_request_size(rs->own.live(), n);
    observe_commit(*rs, tokens, n);
    GroupWriteLock gw(*rs);
    rs->append(tokens, n);
    rs->touch();
    flush = rs->take_chunk(cfg_.flush_tokens, cfg_.overlap, false, &c);
  }
  n_extend_tokens_ += n;
  if (flush) enqueue_chunk(std::move(c));
}

void Corpus::extend_many(const std::vector<std::string>& ids, const int32_t* tokens, const int64_t* lengths) {
  // Everything is checked before anything is applied: a refused batch changes nothing.
  std::vector<std::shared_ptr<RequestState>> states;
  states.reserve(ids.size());
  size_t total = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (lengths[i] < 0) throw std::invalid_argument("lengths must be >= 0, got " + std::to_string(lengths[i]));
    total += static_cast<size_t>(lengths[i]);
    states.push_back(get(ids[i]));
  }
  check_tokens(tokens, total, "tokens");
  for (size_t i = 0; i < ids.size(); ++i) {
    std::lock_guard<std::mutex> g(states[i]->mu);
    check_request_size(states[i]->own.live(), static_cast<size_t>(lengths[i]));
  }
  const int32_t* t = tokens;
  for (size_t i = 0; i < ids.size(); ++i) {
    size_t n = static_cast<size_t>(lengths[i]);
    LearnChunk c;
    bool flush;
    {
      std::lock_guard<std::mutex> g(states[i]->mu);
      observe_commit(*states[i], t, n);
      GroupWriteLock gw(*states[i]);
      states[i]->append(t, n);
      states[i]->touch();
      flush = states[i]->take_chunk(cfg_.flush_tokens, cfg_.overlap, false, &c);
    }
    if (flush) enqueue_chunk(std::move(c));
    t += n;
  }
  n_extend_tokens_ += total;
}

void Corpus::finish(const std::string& id, bool rollout) {
  std::shared_ptr<RequestState> rs;
  {
    std::lock_guard<std::mutex> g(req_mu_);
    auto it = requests_.find(id);
    if (it == requests_.end()) throw unknown_request(id);
    rs = std::move(it->second);
    requests_.erase(it);
  }
  Rollout r;
  bool add = false;
  {
    std::lock_guard<std::mutex> g(rs->mu);
    LearnChunk c;
    if (rs->take_chunk(0, cfg_.overlap, true, &c)) enqueue_chunk(std::move(c));
    add = rollout && rs->keep_rollout && history_.enabled() && take_rollout(*rs, &r);
  }
  // Into the history before its siblings stop drafting it from `own`: they see it twice for a
  // moment, never not at all.
  if (add && history_.add(r.key, r.version, r.tokens.data(), r.tokens.size(), r.output)) {
    GroupWriteLock gw(*rs);
    rs->in_history = true;
  }
  leave_group(*rs);
  release(std::move(rs));
}

bool Corpus::take_rollout(RequestState& rs, Rollout* out) {
  if (rs.history_key.empty() || rs.total_len <= rs.prompt_len) return false;
  const uint64_t output = rs.total_len - rs.prompt_len;
  const uint64_t want = output + std::min<uint64_t>(rs.prompt_len, static_cast<uint64_t>(cfg_.history.context));
  const size_t n = static_cast<size_t>(std::min<uint64_t>(want, rs.own.live()));
  std::vector<int32_t> t(n);
  if (n) rs.own.tail(static_cast<int>(n), t.data());
  // SGLang's window path may hold several documents (a gap) or fewer tokens than it committed (a
  // rewind): only a whole output after the last document boundary is a rollout.
  auto from = std::find(t.rbegin(), t.rend(), kSep).base();
  if (static_cast<uint64_t>(t.end() - from) < output) {
    ++rollouts_incomplete_;
    return false;
  }
  out->key = rs.history_key;
  out->version = rs.policy_version;
  out->tokens.assign(from, t.end());
  out->output = static_cast<size_t>(output);
  return true;
}

bool Corpus::rollout(const std::string& id, Rollout* out) {
  auto rs = get(id);
  std::lock_guard<std::mutex> g(rs->mu);
  return take_rollout(*rs, out);
}

void Corpus::leave_group(RequestState& rs) {
  std::vector<uint64_t> ended;
  groups_.leave(rs, &ended);
  drop_chunk_records(ended);  // the group is gone
}

void Corpus::drop_chunk_records(const std::vector<uint64_t>& serials) {
  // Ended group members' chunks become ordinary learned documents again, after their last chunks
  // (queue order).
  for (uint64_t serial : serials) {
    LearnChunk c;
    c.doc = serial;
    c.last = true;
    enqueue_chunk(std::move(c));
  }
}

void Corpus::erase(const std::string& id) {
  if (has_request(id)) finish(id);
}

void Corpus::sync_window(const std::string& id, const int32_t* window, size_t n, uint64_t total_len) {
  check_tokens(window, n, "batch_tokens");
  check_request_size(0, n);
  if (total_len < n)
    throw std::invalid_argument("total_len " + std::to_string(total_len) + " is shorter than the " +
                                std::to_string(n) + " tokens given");
  std::shared_ptr<RequestState> rs;
  {
    std::lock_guard<std::mutex> g(req_mu_);
    auto it = requests_.find(id);
    if (it != requests_.end()) rs = it->second;
  }
  if (rs) {
    std::lock_guard<std::mutex> g(rs->mu);
    GroupWriteLock gw(*rs);
    rs->touch();
    uint64_t known = rs->total_len;
    if (total_len >= known && total_len - known <= n) {
      size_t fresh = static_cast<size_t>(total_len - known);
      // The tokens both sides know must agree; otherwise the request was rewound: start over.
      size_t overlap = std::min<size_t>(n - fresh, rs->own.live());
      std::vector<int32_t> mine(overlap);
      if (overlap) rs->own.tail(static_cast<int>(overlap), mine.data());
      // Only the last document (after a window gap, below) is contiguous with the window.
      auto from = std::find(mine.rbegin(), mine.rend(), kSep).base();
      if (std::equal(from, mine.end(), window + (n - fresh - (mine.end() - from)))) {
        if (rs->own.live() + fresh > cfg_.max_request_tokens) {
          rs->last_draft.armed = false;
          rs->own.clear();  // keep only the window: drafting needs the recent context most
          rs->own.extend_last(window, n);
          rs->shared_prefix = 0;  // the shared prompt is gone from it
          rs->borrowed = false;
          rs->total_len = total_len;
          return;
        }
        observe_commit(*rs, window + (n - fresh), fresh);
        rs->append(window + (n - fresh), fresh);
        return;
      }
    } else if (total_len > known + n && rs->own.live() + n + 1 <= cfg_.max_request_tokens) {
      // Tokens were committed that no window showed (a step committed more tokens than the window
      // holds, as with draft_token_num > the window, or the request skipped steps). What the request
      // held is still its own text: the window starts a new document after it, matches never reach
      // across the gap, and the request keeps drafting from its history (clearing it lost that).
      rs->own.append_document(window, n);
      rs->total_len = total_len;
      rs->last_draft.armed = false;
      return;
    }
    rs->own.clear();  // rewound: the last draft no longer precedes what comes next
    rs->own.extend_last(window, n);
    rs->shared_prefix = 0;
    rs->borrowed = false;
    rs->total_len = total_len;
    rs->last_draft.armed = false;
    return;
  }
  sweep_idle();
  // The SGLang path feeds the learned corpus through batch_put, so this state does not.
  rs = new_state(false);
  rs->own.extend_last(window, n);
  rs->total_len = total_len;
  rs->touch();
  std::lock_guard<std::mutex> g(req_mu_);
  if (requests_.size() >= cfg_.max_requests)
    throw LimitExceeded("too many live requests (max_requests = " + std::to_string(cfg_.max_requests) + ")");
  requests_.emplace(id, std::move(rs));
}

}  // namespace ngc
