// Corpus: the learned corpus, prompt history and policy versions, external corpora (corpus.h).
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

}  // namespace ngc
