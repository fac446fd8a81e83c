#include "corpus.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "errors.h"
#include "snapshot.h"
#include "tree_merge.h"

namespace ngc {

namespace {
// SGLang's batch_put sends overlapping windows; a window continues an open document when its
// prefix ends with that document's last kTailKey tokens.
constexpr int kTailKey = 8;
// A batch_put document that no put call continued for this many calls is considered finished.
constexpr uint64_t kOpenDocIdleCalls = 2;
constexpr size_t kMaxOpenDocs = 1 << 16;
// The doc serial of a learned document that belongs to no request (learn_documents): request serials
// count up from 0 and never reach it.
constexpr uint64_t kNoRequestDoc = UINT64_MAX;
// Finished request states kept warm for reuse, and the largest one worth keeping.
constexpr size_t kMaxPooled = 64;
constexpr size_t kMaxPooledTokens = 1 << 16;
// Continuations of batch_put windows become visible in chunks of at most this many tokens, each
// carrying the kTailKey tokens before it as left context. SGLang puts every running request's
// window after every step, so a batch's requests draft from each other's fresh output: 8-token
// chunks drafted 1-3.6% more than 32-token chunks with 16 tokens of context at 16 requests at once
// (within 0.4% at one), for 51-62 instead of 42-51 bytes per learned token (bench/sglang_pattern.py).
constexpr size_t kPutFlushTokens = 8;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

UnknownRequest unknown_request(const std::string& id) {
  return UnknownRequest("unknown request id '" + id + "' (never started, finished, or expired)");
}
}  // namespace

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

// ---------------------------------------------------------------- drafting

std::vector<std::shared_ptr<const TokenIndex>> Corpus::externals_snapshot() const {
  std::lock_guard<std::mutex> g(ext_mu_);
  std::vector<std::shared_ptr<const TokenIndex>> v;
  v.reserve(externals_.size());
  for (auto& [name, idx] : externals_) v.push_back(idx);
  return v;
}

void Corpus::draft_one(RequestState& rs, int budget, const std::vector<std::shared_ptr<const TokenIndex>>& ext,
                       DraftTree& tree, std::vector<int32_t>& tokens, std::vector<int32_t>& parents,
                       std::vector<float>& probs) {
  const int ctx_len = static_cast<int>(std::min<size_t>(rs.own.live(), static_cast<size_t>(cfg_.max_match)));
  int32_t ctx[256];
  int32_t cont[256];
  Candidate cands[1024];
  const int depth = std::min({budget, cfg_.max_depth, 256});
  tree.reset();
  if (ctx_len > 0) {
    rs.own.tail(ctx_len, ctx);
    const FindLimits limits{cfg_.max_candidates, cfg_.max_chain, cfg_.max_match, cfg_.enough_candidates,
                            cfg_.enough_order};
    ScoreParams shared = cfg_.score;
    shared.alpha = cfg_.shared_alpha;
    // The request's own chunks in the learned corpus repeat its own context: not a second source.
    auto mine = live_chunks_.find(rs.serial);
    const PositionRanges* own_chunks = mine == live_chunks_.end() ? nullptr : &mine->second;
    auto add_source = [&](const TokenIndex& idx, uint64_t exclude_from, float scale, const ScoreParams& sp,
                          const PositionRanges* skip, uint8_t cls) {
      int n = idx.find(ctx, ctx_len, limits, exclude_from, cands, skip);
      // The tree's table of pow(m, alpha): the same values as calling pow, which was the hot spot here.
      const float* pw = cfg_.mode == DraftMode::kScore ? tree.pow_table(sp) : nullptr;
      for (int i = 0; i < n; ++i) {
        // A weak candidate's deep nodes never rank within a budget: read only a short continuation.
        bool weak = pw != nullptr && scale * pw[std::min(cands[i].match_len, sp.match_cap)] < cfg_.weak_weight;
        int c = idx.continuation(cands[i].pos, weak ? std::min(depth, cfg_.weak_depth) : depth, cont);
        tree.add(cont, c, cands[i].match_len, scale, cands[i].pos, cfg_.mode, sp, cls);
      }
    };
    // The request's current position trivially matches itself: exclude it.
    add_source(rs.own, rs.own.end() - 1, cfg_.own_weight, cfg_.score, nullptr, kSrcOwn);
    // A group's members draft from each other at once, and skip all their chunks (group.h).
    std::shared_lock<std::shared_mutex> group_lock;
    if (rs.group) {
      group_lock = std::shared_lock<std::shared_mutex>(rs.group->mu);
      thread_local std::vector<SiblingSource> siblings;
      thread_local PositionRanges chunks;
      sibling_sources(rs, &siblings);
      const float sibling = cfg_.group_weight * source_weights_.multiplier(kSrcSibling);
      for (auto& s : siblings)
        add_source(*s.index, s.exclude_from, s.as_own ? cfg_.own_weight : sibling, cfg_.score, &s.skip,
                   s.as_own ? kSrcOwn : kSrcSibling);
      group_chunks(*rs.group, live_chunks_, &chunks);
      own_chunks = &chunks;
    }
    // The key's rollouts, each weighted by how many policy versions it is from this request's.
    if (const KeyHistory* h = key_history(rs)) {
      std::shared_lock<std::shared_mutex> hl(h->mu);
      const int n = h->index.find(ctx, ctx_len, limits, UINT64_MAX, cands);
      const float* pw = cfg_.mode == DraftMode::kScore ? tree.pow_table(cfg_.score) : nullptr;
      const int64_t max_age = cfg_.history.max_age;
      for (int i = 0; i < n; ++i) {
        const HistoryRollout& r = h->rollout_at(cands[i].pos);
        const int64_t age = r.version > rs.policy_version ? r.version - rs.policy_version : rs.policy_version - r.version;
        if (max_age > 0 && age >= max_age) continue;  // dropped once it reaches the key's oldest
        const uint8_t cls = static_cast<uint8_t>(kSrcHistory + std::min<int64_t>(age, 3));
        const float scale = cfg_.history_weight * source_weights_.multiplier(cls);
        const bool weak = pw != nullptr && scale * pw[std::min(cands[i].match_len, cfg_.score.match_cap)] < cfg_.weak_weight;
        const int c = h->index.continuation(cands[i].pos, weak ? std::min(depth, cfg_.weak_depth) : depth, cont);
        tree.add(cont, c, cands[i].match_len, scale, cands[i].pos, cfg_.mode, cfg_.score, cls);
      }
    }
    add_source(learned_, UINT64_MAX, cfg_.learned_weight, shared, own_chunks, kSrcLearned);
    for (auto& e : ext) add_source(*e, UINT64_MAX, cfg_.external_weight, shared, nullptr, kSrcExternal);
  }
  // A draft is remembered for the next commit to score: for the calibration (feedback) and for the
  // learned source weights, when the request has a sibling or history source to learn about.
  const bool score = cfg_.mode == DraftMode::kScore;
  const bool learn_sources = score && cfg_.learn_source_weights && (rs.group || rs.history);
  const bool feedback = score && cfg_.feedback.enabled;
  const bool ranked = score && cfg_.rank.enabled;
  if (ranked) {
    RankContext rank;
    rank.model = &rank_;
    rank.params = &cfg_.rank;
    rank.root_token = ctx_len > 0 ? ctx[ctx_len - 1] : -1;
    rank.root_prev = ctx_len > 1 ? ctx[ctx_len - 2] : -1;
    rank.request = RankModel::request_feature(rs.last_draft);
    rank.own = rs.last_draft.own_cells.empty() ? nullptr : rs.last_draft.own_cells.data();
    rs.last_draft.start_draft();
    rs.last_draft.root_token = rank.root_token;
    tree.select(budget, cfg_.min_prob, cfg_.mode, cfg_.score, tokens, parents, probs, nullptr, nullptr,
                &rs.last_draft, &rank);
  } else if (feedback || learn_sources) {
    rs.last_draft.start_draft();
    tree.select(budget, cfg_.min_prob, cfg_.mode, cfg_.score, tokens, parents, probs, feedback ? &acceptance_ : nullptr,
                &cfg_.feedback, &rs.last_draft);
  } else {
    tree.select(budget, cfg_.min_prob, cfg_.mode, cfg_.score, tokens, parents, probs);
  }
}

const KeyHistory* Corpus::key_history(RequestState& rs) {
  if (rs.history_key.empty() || !history_.enabled()) return nullptr;
  const uint64_t created = history_.created();
  const bool stale = rs.history ? rs.history->evicted.load(std::memory_order_acquire) : created != rs.history_seen;
  if (stale) {
    rs.history_seen = created;
    rs.history = history_.find(rs.history_key);
  }
  return rs.history.get();
}

void Corpus::observe_commit(RequestState& rs, const int32_t* tokens, size_t n) {
  if (!rs.last_draft.armed) return;
  if (cfg_.learn_source_weights) source_weights_.observe(rs.last_draft, tokens, n, cfg_.source_window);
  rank_.observe(rs.last_draft, tokens, n, cfg_.rank);
  acceptance_.observe(rs.last_draft, tokens, n, cfg_.feedback);  // disarms the record
}

void Corpus::draft(const std::vector<std::string>& ids, int budget, DraftOutput* out) {
  draft_batch(ids, budget, true, out);
}

void Corpus::draft_merged(const std::vector<std::string>& ids, int budget, const EarlierTrees& earlier,
                          DraftOutput* out) {
  if (earlier.earlier.n != static_cast<int64_t>(ids.size()))
    throw std::invalid_argument("draft_merged: " + std::to_string(ids.size()) + " request ids but " +
                                std::to_string(earlier.earlier.n) + " earlier trees");
  draft_batch(ids, budget, true, out, &earlier);
}

void Corpus::context_lengths(const std::vector<std::string>& ids, int64_t* out) {
  for (size_t i = 0; i < ids.size(); ++i) {
    std::shared_ptr<RequestState> rs;
    {
      std::lock_guard<std::mutex> g(req_mu_);
      auto it = requests_.find(ids[i]);
      if (it != requests_.end()) rs = it->second;
    }
    if (!rs) {
      out[i] = -1;
      continue;
    }
    std::lock_guard<std::mutex> g(rs->mu);
    out[i] = static_cast<int64_t>(rs->total_len);
  }
}

std::vector<int32_t> Corpus::context_tail(const std::string& id, int64_t n) {
  auto rs = get(id);
  std::lock_guard<std::mutex> g(rs->mu);
  if (n < 0 || static_cast<uint64_t>(n) > rs->own.live())
    throw std::invalid_argument("context_tail: request '" + id + "' holds " + std::to_string(rs->own.live()) +
                                " tokens, asked for the last " + std::to_string(n));
  std::vector<int32_t> out(static_cast<size_t>(n));
  rs->own.tail(static_cast<int>(n), out.data());
  return out;
}

void Corpus::draft_compact(const std::vector<std::string>& ids, int budget, DraftOutput* out) {
  draft_batch(ids, budget, false, out);
}

void Corpus::draft_batch(const std::vector<std::string>& ids, int budget, bool pad, DraftOutput* out,
                         const EarlierTrees* merge) {
  if (budget < 1 || budget > 1024)
    throw std::invalid_argument("budget must be in [1, 1024], got " + std::to_string(budget));
  std::vector<std::shared_ptr<RequestState>> states;
  states.reserve(ids.size());
  for (auto& id : ids) states.push_back(get(id));  // all ids checked before any work
  auto ext = externals_snapshot();
  out->counts.assign(ids.size(), 0);
  out->earlier_only.assign(merge != nullptr ? ids.size() : 0, 0);
  if (pad) {
    out->tokens.assign(ids.size() * budget, -1);
    out->parents.assign(ids.size() * budget, -1);
    out->probs.assign(ids.size() * budget, 0.f);
  } else {
    out->tokens.clear(), out->parents.clear(), out->probs.clear();
  }
  const int64_t t0 = now_ns();
  drafts_entering_.fetch_add(1, std::memory_order_relaxed);
  { std::lock_guard<std::mutex> turn(turnstile_); }  // a waiting writer goes first (see corpus.h)
  std::shared_lock<std::shared_mutex> lg(learned_mu_);
  drafts_entering_.fetch_sub(1, std::memory_order_relaxed);
  const size_t n = ids.size(), b = static_cast<size_t>(budget);
  // Request i drafted into row i of `rows` (padded), on the calling thread's tree.
  auto draft_row = [&](size_t i, DraftOutput& rows) {
    thread_local DraftTree tree;
    thread_local std::vector<int32_t> t, p;
    thread_local std::vector<float> pr;
    t.clear(), p.clear(), pr.clear();
    thread_local std::vector<int32_t> since;  // since_from: the request's tokens after it
    bool reroot = true;
    {
      std::lock_guard<std::mutex> g(states[i]->mu);
      states[i]->touch();
      draft_one(*states[i], budget, ext, tree, t, p, pr);
      if (merge != nullptr && merge->since_from != nullptr) {
        const RequestState& rs = *states[i];
        const int64_t k = static_cast<int64_t>(rs.total_len) - merge->since_from[i];
        reroot = k >= 0 && static_cast<uint64_t>(k) <= rs.own.live();
        since.resize(reroot ? static_cast<size_t>(k) : 0);
        if (reroot) rs.own.tail(static_cast<int>(k), since.data());
      }
    }
    if (merge != nullptr) {  // the earlier tree merged in on this thread (outside the request's lock)
      thread_local std::vector<int32_t> mt, mp;
      thread_local std::vector<float> mpr;
      mt.clear(), mp.clear(), mpr.clear();
      const TreeRows& e = merge->earlier;
      const int64_t w = e.width, at = static_cast<int64_t>(i);
      const bool from = merge->since_from != nullptr;
      const int32_t* path = from ? since.data() : merge->since + merge->off[i];
      const int n_path = from ? static_cast<int>(since.size()) : static_cast<int>(merge->off[i + 1] - merge->off[i]);
      merge_with_earlier({t.data(), p.data(), pr.data(), static_cast<int>(t.size())},
                         {e.tokens + at * w, e.parents + at * w, e.probs + at * w, reroot ? e.counts[i] : 0}, path,
                         n_path, budget, mt, mp, mpr, &rows.earlier_only[i]);
      t.swap(mt), p.swap(mp), pr.swap(mpr);
    }
    std::copy(t.begin(), t.end(), rows.tokens.begin() + i * b);
    std::copy(p.begin(), p.end(), rows.parents.begin() + i * b);
    std::copy(pr.begin(), pr.end(), rows.probs.begin() + i * b);
    rows.counts[i] = static_cast<int32_t>(t.size());
  };
  // Parallel: every request drafts into its own padded row (the pool's threads read the learned
  // corpus under this thread's shared lock); a compact output is packed from the rows afterwards.
  // Below 8 requests per thread the hand-off costs more than it saves.
  bool pooled = false;
  if (draft_pool_ && n >= 8 * static_cast<size_t>(draft_pool_->threads())) {
    DraftOutput rows;
    DraftOutput& dst = pad ? *out : rows;
    if (!pad) {
      rows.tokens.assign(n * b, -1), rows.parents.assign(n * b, -1), rows.probs.assign(n * b, 0.f);
      rows.counts.assign(n, 0);
    }
    pooled = draft_pool_->try_run(n, [&](size_t i) { draft_row(i, dst); });
    if (pooled && !pad) {
      for (size_t i = 0; i < n; ++i) {
        const auto k = static_cast<size_t>(rows.counts[i]);
        out->counts[i] = rows.counts[i];
        out->tokens.insert(out->tokens.end(), rows.tokens.begin() + i * b, rows.tokens.begin() + i * b + k);
        out->parents.insert(out->parents.end(), rows.parents.begin() + i * b, rows.parents.begin() + i * b + k);
        out->probs.insert(out->probs.end(), rows.probs.begin() + i * b, rows.probs.begin() + i * b + k);
      }
    }
  }
  if (!pooled) {
    thread_local DraftTree tree;
    for (size_t i = 0; i < n; ++i) {
      if (pad) {
        draft_row(i, *out);
      } else {  // appended in place: no padded rows to pack
        const size_t before = out->tokens.size();
        std::lock_guard<std::mutex> g(states[i]->mu);
        states[i]->touch();
        draft_one(*states[i], budget, ext, tree, out->tokens, out->parents, out->probs);
        out->counts[i] = static_cast<int32_t>(out->tokens.size() - before);
      }
    }
  }
  uint64_t nodes = 0;
  for (int32_t k : out->counts) nodes += static_cast<uint64_t>(k);
  n_drafts_ += n;
  n_draft_nodes_ += nodes;
  n_draft_ns_ += static_cast<uint64_t>(now_ns() - t0);
}

void Corpus::draft_flat(const std::vector<std::string>& ids, int k, std::vector<int64_t>* tokens,
                        std::vector<int64_t>* mask) {
  if (k < 1 || k > 1025) throw std::invalid_argument("draft_token_num must be in [1, 1025], got " + std::to_string(k));
  DraftOutput d;
  std::vector<int32_t> last(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    auto rs = get(ids[i]);
    std::lock_guard<std::mutex> g(rs->mu);
    if (rs->own.live() == 0) throw std::invalid_argument("request '" + ids[i] + "' has no tokens");
    rs->own.tail(1, &last[i]);
  }
  if (k > 1) {
    draft(ids, k - 1, &d);
  } else {
    d.counts.assign(ids.size(), 0);
  }
  const size_t kk = static_cast<size_t>(k);
  tokens->assign(ids.size() * kk, 0);
  mask->assign(ids.size() * kk * kk, 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    int64_t* tok = tokens->data() + i * kk;
    int64_t* m = mask->data() + i * kk * kk;
    tok[0] = last[i];
    m[0] = 1;
    for (size_t j = 1; j < kk; ++j) {
      // Draft node j-1 becomes flat index j; its parent -1 (the root) becomes 0. Padding sits
      // under the root with token 0, as SGLang pads.
      bool real = static_cast<int>(j - 1) < d.counts[i];
      int64_t parent = real ? d.parents[i * (kk - 1) + j - 1] + 1 : 0;
      tok[j] = real ? d.tokens[i * (kk - 1) + j - 1] : 0;
      std::copy(m + parent * kk, m + parent * kk + parent + 1, m + j * kk);
      m[j * kk + j] = 1;
    }
  }
}

// ---------------------------------------------------------------- learned corpus

void Corpus::enqueue_chunk(LearnChunk chunk) {
  {
    std::lock_guard<std::mutex> g(q_mu_);
    queue_.push_back(Item{false, std::move(chunk), {}});
    ++enqueued_;
  }
  q_cv_.notify_one();
}

void Corpus::put(std::vector<std::vector<int32_t>> sequences) {
  for (size_t i = 0; i < sequences.size(); ++i) check_tokens(sequences[i].data(), sequences[i].size(), "batch_tokens");
  {
    std::lock_guard<std::mutex> g(q_mu_);
    queue_.push_back(Item{true, {}, std::move(sequences)});
    ++enqueued_;
  }
  q_cv_.notify_one();
}

void Corpus::learn_documents(std::vector<std::vector<int32_t>> documents) {
  for (size_t i = 0; i < documents.size(); ++i) check_tokens(documents[i].data(), documents[i].size(), "documents");
  {
    std::lock_guard<std::mutex> g(q_mu_);
    for (auto& d : documents) {
      if (d.empty()) continue;
      // No request's chunk: a doc serial no request takes, and last without keep, so nothing links
      // to it or is remembered for it (apply_chunk).
      queue_.push_back(Item{false, LearnChunk{std::move(d), 0, kNoRequestDoc, true, false}, {}});
      ++enqueued_;
    }
  }
  q_cv_.notify_one();
}

size_t Corpus::stored_estimate(const Item& it) const {
  if (!it.is_put) return it.chunk.tokens.size() + 1;
  size_t n = 0;  // an open document's kept tail comes back as context: kTailKey more per sequence
  for (const auto& seq : it.seqs) n += seq.size() + kTailKey + 1;
  return n;
}

size_t Corpus::indexed_estimate(const Item& it) {
  if (!it.is_put) return it.chunk.tokens.size() > it.chunk.context ? it.chunk.tokens.size() - it.chunk.context : 0;
  size_t n = 0;
  for (const auto& seq : it.seqs) n += seq.size();
  return n;
}

void Corpus::worker() {
  std::unique_lock<std::mutex> lk(q_mu_);
  for (;;) {
    q_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty() && stop_) return;
    std::deque<Item> batch;
    batch.swap(queue_);
    lk.unlock();
    // The batch is applied in groups of bounded size, each under its own hold of the exclusive
    // lock: drafts wait for one group at most, and under a memory bound a group's evictions stay
    // below the dead prefix that calls for a compaction (a quarter of the bound), which the
    // prepared copy before it has already done (grow_learned).
    const size_t bound = cfg_.learned_max_tokens;
    const size_t group_tokens = bound ? std::min(kApplyGroupTokens, std::max<size_t>(bound / 8, 1024)) : kApplyGroupTokens;
    bool failed = false;
    for (size_t i = 0; i < batch.size() && !failed;) {
      if (i > 0) let_drafts_in();
      size_t j = i, more = 0, indexed = 0;
      do {
        more += stored_estimate(batch[j]);
        indexed += indexed_estimate(batch[j]);
        ++j;
      } while (j < batch.size() && more + stored_estimate(batch[j]) <= group_tokens);
      try {
        grow_learned(more, indexed);
      } catch (const std::exception&) {
        // e.g. std::bad_alloc for the copy: applying the group grows the index in place, as before
      }
      std::lock_guard<std::mutex> turn(turnstile_);
      std::unique_lock<std::shared_mutex> wl(learned_mu_);
      try {
        for (; i < j; ++i) {
          Item& it = batch[i];
          // Room for the item first, so the store never holds more than the bound's tokens (the
          // byte bound's worst case counts on it: CorpusConfig.bytes_per_token); an item larger
          // than the bound keeps its last tokens only (the eviction after it).
          if (bound) {
            const size_t add = stored_estimate(it);
            learned_.evict_to(add < bound ? bound - add : 0);
          }
          if (it.is_put) {
            ++put_calls_;
            for (auto& s : it.seqs) apply_put(s);
            flush_open_docs(false);
          } else {
            apply_chunk(it.chunk);
          }
          // Evict after every item, not once per group: a long queue must not grow the store (and
          // its allocations) past the bound first.
          if (bound) learned_.evict_to(bound);
        }
      } catch (const std::exception& e) {  // e.g. std::bad_alloc: report at synchronize()
        std::lock_guard<std::mutex> g(q_mu_);
        worker_error_ = e.what();
        failed = true;
      }
    }
    lk.lock();
    applied_ += batch.size();
    done_cv_.notify_all();
  }
}

void Corpus::let_drafts_in() {
  // Bounded: a steady stream of drafts must not hold the insert thread off either (the turnstile
  // lets it in once it stops waiting here).
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
  while (drafts_entering_.load(std::memory_order_relaxed) > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::yield();
}

void Corpus::grow_learned(size_t more, size_t indexed) {
  // Applying a group under the exclusive lock may grow the learned index: rehash every stored
  // position into larger head tables (41-75 ms at 1M tokens, twice as long at each doubling),
  // reallocate and copy its storage (tens of ms at millions of tokens), or compact it once
  // evictions under a memory bound leave a dead prefix (44 ms at 2.5M tokens), with every draft
  // waiting (bench/draft_stalls.py). This thread is the learned index's only writer, so the grown
  // copy is built here under the shared lock (drafts go on) and only swapped in under the
  // exclusive one. Until then the process holds both: about twice the store's bytes, for a moment.
  // learned_copy_growth off: everything grows in place under the exclusive lock (no extra memory).
  if (!cfg_.learned_copy_growth) return;
  const size_t bound = cfg_.learned_max_tokens;
  TokenIndex::Growth grown;
  {
    std::shared_lock<std::shared_mutex> lg(learned_mu_);
    size_t expected = learned_.indexed_tokens() + indexed;
    // Under a memory bound the evictions keep the index at the bound: never size the tables past
    // it (applying the group still grows them in place if it has to).
    if (bound) expected = std::min(expected, bound);
    if (!learned_.needs_growth(more, expected, bound)) return;
    const uint64_t epoch = learned_epoch_;
    grown = learned_.prepare_growth(more, expected, bound);
    lg.unlock();
    std::lock_guard<std::mutex> turn(turnstile_);
    std::unique_lock<std::shared_mutex> wl(learned_mu_);
    if (learned_epoch_ != epoch) return;      // reset or loaded meanwhile
    learned_.install_growth(std::move(grown));  // false if the index changed: nothing installed
  }
  // `grown` now holds the old storage: freed here, outside both locks.
}

void Corpus::apply_chunk(const LearnChunk& c) {
  auto it = live_chunks_.find(c.doc);
  uint64_t prev_end = it == live_chunks_.end() ? UINT64_MAX : it->second.back().second;
  uint64_t e = UINT64_MAX;
  if (c.tokens.size() > c.context) e = learned_.append_document(c.tokens.data(), c.tokens.size(), c.context, prev_end);
  if (c.last) {
    if (c.keep && e != UINT64_MAX) live_chunks_[c.doc].emplace_back(e + 1 - (c.tokens.size() - c.context), e);
    if (!c.keep && it != live_chunks_.end()) live_chunks_.erase(it);
  } else if (e != UINT64_MAX) {
    live_chunks_[c.doc].emplace_back(e + 1 - (c.tokens.size() - c.context), e);
  }
}

void Corpus::apply_put(std::vector<int32_t>& seq) {
  const size_t n = seq.size();
  // Find the longest prefix seq[0..i) whose last kTailKey tokens close an open document.
  for (size_t i = n; n >= static_cast<size_t>(kTailKey) && i >= static_cast<size_t>(kTailKey); --i) {
    auto it = open_by_tail_.find(ngram_hash(seq.data() + i - 1, kTailKey));
    if (it == open_by_tail_.end()) continue;
    for (uint64_t id : it->second) {
      OpenDoc& d = open_docs_[id];
      if (d.tokens.size() < static_cast<size_t>(kTailKey) ||
          !std::equal(d.tokens.end() - kTailKey, d.tokens.end(), seq.begin() + (i - kTailKey)))
        continue;
      if (i == n) {  // nothing new: the same window again
        d.last_put = put_calls_;
        return;
      }
      auto& ids = it->second;
      ids.erase(std::find(ids.begin(), ids.end(), id));
      if (ids.empty()) open_by_tail_.erase(it);
      d.tokens.insert(d.tokens.end(), seq.begin() + i, seq.end());
      d.pending += n - i;
      d.last_put = put_calls_;
      open_by_tail_[ngram_hash(d.tokens.data() + d.tokens.size() - 1, kTailKey)].push_back(id);
      if (d.pending >= std::min<size_t>(cfg_.flush_tokens, kPutFlushTokens)) {
        size_t ctx = d.tokens.size() - d.pending;
        d.last_end = learned_.append_document(d.tokens.data(), d.tokens.size(), ctx, d.last_end);
        size_t keep = std::min(d.tokens.size(), static_cast<size_t>(kTailKey));  // the next chunk's context
        d.tokens.erase(d.tokens.begin(), d.tokens.end() - static_cast<std::ptrdiff_t>(keep));
        d.pending = 0;
      }
      return;
    }
  }
  if (n == 0) return;
  // A new sequence is visible at once (SGLang reads right after synchronize); what continues it
  // is gathered into chunks.
  uint64_t last_end = learned_.append_document(seq.data(), n);
  uint64_t id = next_doc_++;
  OpenDoc& d = open_docs_[id];
  d.last_end = last_end;
  d.tokens = std::move(seq);
  d.pending = 0;
  d.last_put = put_calls_;
  if (n >= static_cast<size_t>(kTailKey))
    open_by_tail_[ngram_hash(d.tokens.data() + n - 1, kTailKey)].push_back(id);
  else
    flush_open_docs(false);  // too short to continue: it is flushed with the idle ones
}

void Corpus::flush_open_docs(bool all) {
  bool over = open_docs_.size() > kMaxOpenDocs;
  for (auto it = open_docs_.begin(); it != open_docs_.end();) {
    OpenDoc& d = it->second;
    bool idle = put_calls_ - d.last_put >= kOpenDocIdleCalls || d.tokens.size() < static_cast<size_t>(kTailKey);
    if (!(all || idle || over)) {
      ++it;
      continue;
    }
    if (d.pending) learned_.append_document(d.tokens.data(), d.tokens.size(), d.tokens.size() - d.pending, d.last_end);
    if (d.tokens.size() >= static_cast<size_t>(kTailKey)) {
      auto t = open_by_tail_.find(ngram_hash(d.tokens.data() + d.tokens.size() - 1, kTailKey));
      if (t != open_by_tail_.end()) {
        auto& ids = t->second;
        ids.erase(std::remove(ids.begin(), ids.end(), it->first), ids.end());
        if (ids.empty()) open_by_tail_.erase(t);
      }
    }
    it = open_docs_.erase(it);
  }
}

void Corpus::synchronize() {
  std::unique_lock<std::mutex> lk(q_mu_);
  uint64_t target = enqueued_;
  done_cv_.wait(lk, [&] { return applied_ >= target; });
  if (!worker_error_.empty()) {
    std::string e = std::move(worker_error_);
    worker_error_.clear();
    throw std::runtime_error("learned-corpus insert failed: " + e);
  }
}

void Corpus::flush_all_pending() {
  std::vector<std::shared_ptr<RequestState>> live;
  {
    std::lock_guard<std::mutex> g(req_mu_);
    for (auto& [id, rs] : requests_) live.push_back(rs);
  }
  for (auto& rs : live) {
    std::lock_guard<std::mutex> g(rs->mu);
    LearnChunk c;
    if (rs->take_chunk(1, cfg_.overlap, false, &c)) enqueue_chunk(std::move(c));
  }
  synchronize();
  std::unique_lock<std::shared_mutex> wl(learned_mu_);
  flush_open_docs(true);
}

void Corpus::reset() {
  synchronize();
  {
    std::lock_guard<std::mutex> g(req_mu_);
    requests_.clear();
    groups_.clear();
  }
  history_.clear();
  source_weights_.clear();
  std::unique_lock<std::shared_mutex> wl(learned_mu_);
  learned_.clear();
  ++learned_epoch_;
  acceptance_.clear();
  rank_.clear();
  open_docs_.clear();
  open_by_tail_.clear();
  live_chunks_.clear();
}

std::vector<int32_t> Corpus::learned_tokens() {
  synchronize();
  std::shared_lock<std::shared_mutex> lg(learned_mu_);
  return learned_.dump_tokens();
}

// ---------------------------------------------------------------- prompt history, policy versions

int64_t Corpus::announce_policy_version(int64_t v, bool strict) {
  if (v < 0) throw std::invalid_argument("policy version must be >= 0, got " + std::to_string(v));
  int64_t cur = policy_version_.load(std::memory_order_acquire);
  while (v > cur && !policy_version_.compare_exchange_weak(cur, v, std::memory_order_acq_rel)) {
  }
  if (v < cur) {
    if (strict)
      throw StaleVersion("policy version " + std::to_string(v) + " is older than the namespace's current " +
                         std::to_string(cur) + " (versions only move forward)");
    return cur;
  }
  history_.announce(v);
  return v;
}

bool Corpus::add_rollout(const std::string& key, int64_t version, const int32_t* tokens, size_t n, size_t output) {
  if (key.empty()) throw std::invalid_argument("rollout: the prompt key must not be empty");
  if (version < 0) throw std::invalid_argument("rollout: policy version must be >= 0, got " + std::to_string(version));
  if (output > n) throw std::invalid_argument("rollout: output longer than its tokens");
  check_tokens(tokens, n, "rollout");
  return history_.add(key, version, tokens, n, output);
}

// ---------------------------------------------------------------- external corpora

void Corpus::begin_external(const std::string& name, bool replace) {
  if (name.empty()) throw std::invalid_argument("external corpus name must not be empty");
  std::lock_guard<std::mutex> g(ext_mu_);
  if (staging_.count(name)) throw AlreadyExists("external corpus '" + name + "' is already being loaded");
  if (!replace && externals_.count(name))
    throw AlreadyExists("external corpus '" + name + "' already exists; remove it first");
  staging_.emplace(name, std::make_shared<TokenIndex>(cfg_.external_orders));
}

void Corpus::add_external(const std::string& name, const int32_t* tokens, size_t n) {
  check_tokens(tokens, n, "corpus chunk");
  std::shared_ptr<TokenIndex> idx;
  {
    std::lock_guard<std::mutex> g(ext_mu_);
    auto it = staging_.find(name);
    if (it == staging_.end())
      throw NotFound("external corpus '" + name + "' is not being loaded (call begin first)");
    size_t staged = 0;
    for (auto& [k, v] : staging_) staged += v->live();
    if (external_tokens_ + staged + n > cfg_.max_external_tokens)
      throw LimitExceeded("external corpora would exceed max_external_tokens = " +
                              std::to_string(cfg_.max_external_tokens));
    idx = it->second;
  }
  // Only this loader touches a staging index, and readers never see it until commit.
  if (n) idx->append_document(tokens, n);
}

size_t Corpus::commit_external(const std::string& name) {
  std::lock_guard<std::mutex> g(ext_mu_);
  auto it = staging_.find(name);
  if (it == staging_.end())
    throw NotFound("external corpus '" + name + "' was never started (nothing to commit)");
  size_t n = it->second->indexed_tokens();
  external_tokens_ += it->second->live();
  auto old = externals_.find(name);  // a replacement (begin_external with replace)
  if (old != externals_.end()) external_tokens_ -= old->second->live();
  externals_[name] = std::move(it->second);
  staging_.erase(it);
  return n;
}

void Corpus::abort_external(const std::string& name) {
  std::lock_guard<std::mutex> g(ext_mu_);
  staging_.erase(name);
}

bool Corpus::is_loading(const std::string& name) const {
  std::lock_guard<std::mutex> g(ext_mu_);
  return staging_.count(name) > 0;
}

void Corpus::remove_external(const std::string& name) {
  std::lock_guard<std::mutex> g(ext_mu_);
  auto it = externals_.find(name);
  if (it == externals_.end()) throw NotFound("no external corpus named '" + name + "'");
  external_tokens_ -= it->second->live();
  externals_.erase(it);
}

std::map<std::string, size_t> Corpus::list_externals() const {
  std::lock_guard<std::mutex> g(ext_mu_);
  std::map<std::string, size_t> out;
  for (auto& [name, idx] : externals_) out[name] = idx->indexed_tokens();
  return out;
}

// ---------------------------------------------------------------- persistence, stats

void Corpus::save(const std::string& path) {
  flush_all_pending();
  ByteWriter w;
  w.put_str("corpus");
  {
    std::shared_lock<std::shared_mutex> lg(learned_mu_);
    learned_.save(w);
  }
  auto ext = [&] {
    std::lock_guard<std::mutex> g(ext_mu_);
    return externals_;
  }();
  w.put<uint64_t>(ext.size());
  for (auto& [name, idx] : ext) {
    w.put_str(name);
    idx->save(w);
  }
  w.put_str("history");  // format 2
  w.put<int64_t>(policy_version());
  history_.save(w);
  w.put_str("rank");  // format 3
  {
    std::lock_guard<RankModel> g(rank_);
    rank_.save(w);
  }
  write_snapshot_file(path, w.bytes());
}

void Corpus::freeze() {
  flush_all_pending();
  turnstile_.lock();  // the insert thread's order: turnstile, then the learned lock
  learned_mu_.lock();
  ext_mu_.lock();
  history_.lock();
  rank_.lock();
}

void Corpus::thaw() {
  rank_.unlock();
  history_.unlock();
  ext_mu_.unlock();
  learned_mu_.unlock();
  turnstile_.unlock();
}

void Corpus::save_frozen(const std::string& path) const {
  ByteWriter w;
  w.put_str("corpus");
  learned_.save(w);
  w.put<uint64_t>(externals_.size());
  for (auto& [name, idx] : externals_) {
    w.put_str(name);
    idx->save(w);
  }
  w.put_str("history");
  w.put<int64_t>(policy_version());
  history_.save_locked(w);
  w.put_str("rank");
  rank_.save(w);
  write_snapshot_file(path, w.bytes());
}

void Corpus::load(const std::string& path) {
  uint32_t version = 0;
  auto payload = read_snapshot_file(path, &version);
  ByteReader r(payload.data(), payload.size());
  if (r.get_str() != "corpus") throw CorruptSnapshot("snapshot does not hold a corpus: '" + path + "'");
  TokenIndex learned = TokenIndex::load(r);
  auto expected = cfg_.learned_orders;  // TokenIndex keeps its orders sorted
  std::sort(expected.begin(), expected.end());
  if (learned.orders() != expected)
    throw CorruptSnapshot("snapshot was written with other learned_orders than this corpus uses");
  uint64_t n_ext = r.get<uint64_t>();
  std::map<std::string, std::shared_ptr<const TokenIndex>> ext;
  size_t ext_tokens = 0;
  for (uint64_t i = 0; i < n_ext; ++i) {
    std::string name = r.get_str();
    auto idx = std::make_shared<TokenIndex>(TokenIndex::load(r));
    ext_tokens += idx->live();
    ext[name] = std::move(idx);
  }
  int64_t policy = 0;  // format 1 predates policy versions and prompt history: none of either
  PromptHistory::Loaded history;
  if (version >= 2) {
    if (r.get_str() != "history") throw CorruptSnapshot("corrupt snapshot: no prompt history section: '" + path + "'");
    policy = r.get<int64_t>();
    if (policy < 0) throw CorruptSnapshot("corrupt snapshot: negative policy version: '" + path + "'");
    history = history_.parse(r);
    history.announced = policy;  // late rollouts older than the snapshot's version are dropped, as before it
  }
  // Format 3 adds the rank model (format 4: with the source-pair table; RankModel::load reads both
  // layouts); older files load with an empty one (today's ranking until it learns).
  RankModel rank;
  if (version >= 3) {
    if (r.get_str() != "rank") throw CorruptSnapshot("corrupt snapshot: no rank model section: '" + path + "'");
    rank.load(r);
  }
  if (!r.done()) throw CorruptSnapshot("corrupt snapshot: trailing bytes: '" + path + "'");
  learned.check_integrity();
  for (auto& [name, idx] : ext) idx->check_integrity();
  synchronize();
  {
    std::unique_lock<std::shared_mutex> wl(learned_mu_);
    learned_ = std::move(learned);
    ++learned_epoch_;
    open_docs_.clear();
    open_by_tail_.clear();
    live_chunks_.clear();
  }
  {
    std::lock_guard<std::mutex> g(ext_mu_);
    externals_ = std::move(ext);
    external_tokens_ = ext_tokens;
  }
  policy_version_.store(policy, std::memory_order_release);
  history_.install(std::move(history));
  rank_.copy_from(rank);
}

std::map<std::string, double> Corpus::stats() {
  std::map<std::string, double> s;
  {
    std::shared_lock<std::shared_mutex> lg(learned_mu_);
    s["learned_tokens"] = static_cast<double>(learned_.indexed_tokens());
    s["learned_stored_tokens"] = static_cast<double>(learned_.live());
    s["learned_documents"] = static_cast<double>(learned_.documents());
    s["learned_bytes"] = static_cast<double>(learned_.memory_bytes());
    s["learned_bytes_per_token"] =
        learned_.indexed_tokens() ? static_cast<double>(learned_.memory_bytes()) / learned_.indexed_tokens() : 0.0;
  }
  std::vector<std::shared_ptr<RequestState>> live;
  {
    std::lock_guard<std::mutex> g(req_mu_);
    s["live_requests"] = static_cast<double>(requests_.size());
    for (auto& [id, rs] : requests_) live.push_back(rs);
  }
  size_t request_bytes = 0;  // the live requests' own context indexes
  for (auto& rs : live) {
    std::lock_guard<std::mutex> g(rs->mu);
    request_bytes += rs->own.memory_bytes();
  }
  s["live_request_bytes"] = static_cast<double>(request_bytes);
  s["live_groups"] = static_cast<double>(groups_.size());
  {
    std::lock_guard<std::mutex> g(ext_mu_);
    s["external_corpora"] = static_cast<double>(externals_.size());
    s["external_tokens"] = static_cast<double>(external_tokens_);
    size_t b = 0;
    for (auto& [n, idx] : externals_) b += idx->memory_bytes();
    s["external_bytes"] = static_cast<double>(b);
  }
  {
    std::lock_guard<std::mutex> g(q_mu_);
    s["pending_inserts"] = static_cast<double>(enqueued_ - applied_);
  }
  auto [tested, accepted] = acceptance_.totals();
  s["feedback_tested_nodes"] = static_cast<double>(tested);
  s["feedback_accepted_nodes"] = static_cast<double>(accepted);
  const auto [rank_tested, rank_accepted] = rank_.totals();
  s["rank_tested_nodes"] = static_cast<double>(rank_tested);
  s["rank_accepted_nodes"] = static_cast<double>(rank_accepted);
  s["rank_delta_queued_nodes"] = static_cast<double>(rank_.queued());
  s["rank_delta_dropped_nodes"] = static_cast<double>(rank_.dropped());
  const auto h = history_.totals();
  s["history_keys"] = static_cast<double>(h.keys);
  s["history_rollouts"] = static_cast<double>(h.rollouts);
  s["history_tokens"] = static_cast<double>(h.stored);
  s["history_output_tokens"] = static_cast<double>(h.output);
  s["history_charged_tokens"] = static_cast<double>(h.charged);
  s["history_max_charged_tokens"] = static_cast<double>(cfg_.history.max_charged_tokens);
  s["history_bytes"] = static_cast<double>(h.bytes);
  s["history_bytes_per_token"] = h.stored ? static_cast<double>(h.bytes) / static_cast<double>(h.stored) : 0.0;
  // What the bound covers (a small key is charged at least kMinKeyCharge tokens for its fixed tables).
  s["history_bytes_per_charged_token"] = h.charged ? static_cast<double>(h.bytes) / static_cast<double>(h.charged) : 0.0;
  s["history_rollouts_added"] = static_cast<double>(h.added);
  s["history_rollouts_truncated"] = static_cast<double>(h.truncated);
  s["history_rollouts_dropped"] = static_cast<double>(h.dropped_rollouts);
  s["history_rollouts_incomplete"] = static_cast<double>(rollouts_incomplete_.load());
  s["history_keys_evicted"] = static_cast<double>(h.evicted_keys);
  s["history_key_group_full"] = static_cast<double>(implied_group_full_.load());
  s["policy_version"] = static_cast<double>(policy_version());
  static const char* kClassNames[kLearnedClasses] = {"sibling", "history_age0", "history_age1", "history_age2",
                                                     "history_age3"};
  for (int i = 0; i < kLearnedClasses; ++i) {
    const auto c = source_weights_.stats(i);
    const std::string name = kClassNames[i];
    s["source_" + name + "_weight"] = static_cast<double>(c.multiplier);
    s["source_" + name + "_tested_nodes"] = static_cast<double>(c.tested);
    s["source_" + name + "_accepted_nodes"] = static_cast<double>(c.accepted);
  }
  s["drafts"] = static_cast<double>(n_drafts_.load());
  s["draft_nodes"] = static_cast<double>(n_draft_nodes_.load());
  s["extend_tokens"] = static_cast<double>(n_extend_tokens_.load());
  s["draft_seconds"] = static_cast<double>(n_draft_ns_.load()) * 1e-9;
  return s;
}

void Corpus::check_integrity() {
  synchronize();
  {
    std::shared_lock<std::shared_mutex> lg(learned_mu_);
    learned_.check_integrity();
  }
  for (auto& e : externals_snapshot()) e->check_integrity();
  std::vector<std::shared_ptr<RequestState>> live;
  {
    std::lock_guard<std::mutex> g(req_mu_);
    for (auto& [id, rs] : requests_) live.push_back(rs);
  }
  for (auto& rs : live) {
    std::lock_guard<std::mutex> g(rs->mu);
    rs->own.check_integrity();
    if (rs->pending.size() > rs->own.live()) throw std::logic_error("request pending beyond its tokens");
  }
  groups_.check_integrity(live);
  history_.check_integrity();
}

}  // namespace ngc
