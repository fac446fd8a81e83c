// Corpus: snapshots, stats and the integrity check (corpus.h).
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
