// Corpus: drafting (corpus.h).
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

}  // namespace ngc
