#include "prompt_history.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "errors.h"
#include "snapshot.h"

namespace ngc {

const HistoryRollout& KeyHistory::rollout_at(uint64_t pos) const {
  auto it = std::upper_bound(rollouts.begin(), rollouts.end(), pos,
                             [](uint64_t p, const HistoryRollout& r) { return p < r.first; });
  return *std::prev(it);  // positions before the first rollout are evicted: never found
}

PromptHistory::PromptHistory(std::vector<int> orders, HistoryConfig cfg) : orders_(std::move(orders)), cfg_(cfg) {
  TokenIndex probe(orders_);  // a bad order set fails here, at construction
  if (cfg_.max_rollouts < 1) throw std::invalid_argument("history max_rollouts must be >= 1");
  if (cfg_.context < 0 || cfg_.context > 256) throw std::invalid_argument("history context must be in [0, 256]");
  if (cfg_.max_age < 0) throw std::invalid_argument("history max_age must be >= 0");
}

size_t PromptHistory::charge_of(const KeyHistory& h) {
  return std::max(h.index.live(), kMinKeyCharge) + 2 * h.rollouts.size() + 8;
}

void PromptHistory::drop_front(KeyHistory& h, size_t n) {
  n = std::min(n, h.rollouts.size());
  if (n == 0) return;
  dropped_rollouts_ += n;
  if (n == h.rollouts.size()) {
    h.rollouts.clear();
    h.index.evict_to(0);
    return;
  }
  // Rollouts are stored in arrival order: the oldest ones are the index's oldest positions (with
  // the separator after them), so FIFO eviction drops exactly them.
  h.index.evict_to(h.index.end() - h.rollouts[n].first);
  h.rollouts.erase(h.rollouts.begin(), h.rollouts.begin() + static_cast<std::ptrdiff_t>(n));
  // Head tables never shrink: a key that lost most of its tokens (an announcement dropped its old
  // versions) is rebuilt at its new size, so its bytes stay within what it is charged.
  if (h.index.memory_bytes() > kIndexBytesPerChargedToken * charge_of(h)) {
    TokenIndex fresh(h.index.orders());
    std::vector<int32_t> t;
    for (auto& r : h.rollouts) {
      t.resize(r.tokens);
      h.index.read(r.first, r.tokens, t.data());
      r.first = fresh.live() > 0 ? fresh.end() + 1 : fresh.end();
      fresh.append_document(t.data(), t.size());
    }
    h.index = std::move(fresh);
  }
}

void PromptHistory::drop_old(KeyHistory& h, int64_t newest) {
  if (cfg_.max_age == 0) return;
  auto old = [&](const HistoryRollout& r) { return newest - r.version >= cfg_.max_age; };
  size_t front = 0;
  while (front < h.rollouts.size() && old(h.rollouts[front])) ++front;
  drop_front(h, front);
  // Rollouts are kept in arrival order, and an older version may arrive after a newer one (a slow
  // replica): one that is now too old behind a younger one cannot be evicted as a prefix, so the
  // key's index is rebuilt without it (rare: only out-of-order versions need it).
  if (std::none_of(h.rollouts.begin(), h.rollouts.end(), old)) return;
  TokenIndex fresh(h.index.orders());
  std::deque<HistoryRollout> kept;
  std::vector<int32_t> t;
  for (HistoryRollout r : h.rollouts) {
    if (old(r)) {
      ++dropped_rollouts_;
      continue;
    }
    t.resize(r.tokens);
    h.index.read(r.first, r.tokens, t.data());
    r.first = fresh.live() > 0 ? fresh.end() + 1 : fresh.end();
    fresh.append_document(t.data(), t.size());
    kept.push_back(r);
  }
  h.index = std::move(fresh);
  h.rollouts = std::move(kept);
}

void PromptHistory::recharge(Entry& e) {
  charged_ -= e.charged;
  e.charged = charge_of(*e.h);
  charged_ += e.charged;
}

void PromptHistory::erase(std::unordered_map<std::string, Entry>::iterator it) {
  charged_ -= it->second.charged;
  it->second.h->evicted.store(true, std::memory_order_release);
  lru_.erase(it->second.lru);
  keys_.erase(it);
}

void PromptHistory::enforce_total(const std::string& keep) {
  while (charged_ > cfg_.max_charged_tokens && !lru_.empty()) {
    auto it = keys_.find(lru_.front());
    if (it->first == keep) {
      if (lru_.size() == 1) {  // the key alone is over the bound: its oldest rollouts go
        KeyHistory& h = *it->second.h;
        std::unique_lock<std::shared_mutex> wl(h.mu);
        while (charge_of(h) > cfg_.max_charged_tokens && !h.rollouts.empty()) drop_front(h, 1);
        wl.unlock();
        recharge(it->second);
        if (h.rollouts.empty()) erase(it), ++evicted_keys_;
        return;
      }
      lru_.splice(lru_.end(), lru_, lru_.begin());  // never the key just written while others remain
      continue;
    }
    dropped_rollouts_ += it->second.h->rollouts.size();
    ++evicted_keys_;
    erase(it);
  }
}

bool PromptHistory::add(const std::string& key, int64_t version, const int32_t* tokens, size_t n, size_t output) {
  if (!enabled() || output == 0 || output > n || key.empty()) return false;
  std::lock_guard<std::mutex> g(mu_);
  auto it = keys_.find(key);
  // A rollout max_age versions older than its key's newest, or than the announced version, arrives
  // late (a slow replica, a reordered log): kept, it would be dropped at once; it is counted instead,
  // and neither creates its key nor makes it the most recently written.
  const int64_t newest = std::max(announced_, it == keys_.end() ? int64_t{-1} : it->second.h->newest);
  if (cfg_.max_age > 0 && newest - version >= cfg_.max_age) {
    ++dropped_rollouts_;
    return false;
  }
  if (it == keys_.end()) {
    Entry e;
    e.h = std::make_shared<KeyHistory>(orders_);
    lru_.push_back(key);
    e.lru = std::prev(lru_.end());
    it = keys_.emplace(key, std::move(e)).first;
    created_.fetch_add(1, std::memory_order_acq_rel);
  } else {
    lru_.splice(lru_.end(), lru_, it->second.lru);
  }
  KeyHistory& h = *it->second.h;
  {
    std::unique_lock<std::shared_mutex> wl(h.mu);
    if (n + 1 > cfg_.max_key_tokens) {  // longer than a key may hold: its beginning (what siblings share most)
      const size_t tail = n - output;     // max_key_tokens > 2 * the largest context: output stays > 0
      n = cfg_.max_key_tokens - 1;
      output = n - tail;
      ++truncated_;
    }
    h.newest = std::max(h.newest, version);
    drop_old(h, h.newest);  // nothing max_age old
    size_t drop = 0;
    // Room for it: at most max_rollouts, max_key_tokens (with the separator).
    while (drop < h.rollouts.size() &&
           (h.rollouts.size() - drop + 1 > cfg_.max_rollouts ||
            h.index.end() - h.rollouts[drop].first + n + 1 > cfg_.max_key_tokens))
      ++drop;
    drop_front(h, drop);
    const uint64_t first = h.index.live() > 0 ? h.index.end() + 1 : h.index.end();  // after the separator
    h.index.append_document(tokens, n);
    h.rollouts.push_back(HistoryRollout{first, static_cast<uint32_t>(n), static_cast<uint32_t>(output), version});
    ++added_;
  }
  recharge(it->second);
  enforce_total(key);
  return keys_.count(key) != 0;  // a rollout larger than the whole bound did not stay
}

std::shared_ptr<const KeyHistory> PromptHistory::find(const std::string& key) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = keys_.find(key);
  return it == keys_.end() ? nullptr : it->second.h;
}

void PromptHistory::announce(int64_t current) {
  std::lock_guard<std::mutex> g(mu_);
  announced_ = std::max(announced_, current);
  if (cfg_.max_age == 0) return;
  for (auto it = keys_.begin(); it != keys_.end();) {
    KeyHistory& h = *it->second.h;
    {
      std::unique_lock<std::shared_mutex> wl(h.mu);
      drop_old(h, current);
    }
    recharge(it->second);
    auto next = std::next(it);
    if (h.rollouts.empty()) erase(it);
    it = next;
  }
}

void PromptHistory::clear() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [k, e] : keys_) e.h->evicted.store(true, std::memory_order_release);
  keys_.clear();
  lru_.clear();
  charged_ = 0;
}

PromptHistory::Totals PromptHistory::totals() const {
  std::lock_guard<std::mutex> g(mu_);
  Totals t;
  t.keys = keys_.size();
  t.charged = charged_;
  t.added = added_, t.truncated = truncated_, t.evicted_keys = evicted_keys_, t.dropped_rollouts = dropped_rollouts_;
  for (const auto& [k, e] : keys_) {
    std::shared_lock<std::shared_mutex> rl(e.h->mu);
    t.rollouts += e.h->rollouts.size();
    for (const auto& r : e.h->rollouts) t.stored += r.tokens, t.output += r.output;
    // What the key really holds: its index, rollout records, the key and its registry entry.
    t.bytes += e.h->index.memory_bytes() + sizeof(KeyHistory) + e.h->rollouts.size() * sizeof(HistoryRollout) +
               2 * k.capacity() + sizeof(Entry) + 64;
  }
  return t;
}

std::vector<std::pair<int64_t, uint32_t>> PromptHistory::lengths(const std::string& key) const {
  auto h = find(key);
  std::vector<std::pair<int64_t, uint32_t>> out;
  if (!h) return out;
  std::shared_lock<std::shared_mutex> rl(h->mu);
  for (const auto& r : h->rollouts) out.emplace_back(r.version, r.output);
  return out;
}

std::vector<RolloutView> PromptHistory::dump() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<RolloutView> out;
  for (const auto& key : lru_) {
    const KeyHistory& h = *keys_.at(key).h;
    std::shared_lock<std::shared_mutex> rl(h.mu);
    for (const auto& r : h.rollouts) {
      RolloutView v{key, r.version, r.output, std::vector<int32_t>(r.tokens)};
      h.index.read(r.first, r.tokens, v.tokens.data());
      out.push_back(std::move(v));
    }
  }
  return out;
}

void PromptHistory::check_key(const std::string& key, const KeyHistory& h) {
  auto fail = [&](const std::string& what) { throw std::logic_error("PromptHistory integrity: key '" + key + "': " + what); };
  h.index.check_integrity();
  if (h.rollouts.empty()) fail("kept without rollouts");
  uint64_t expect = h.index.begin();
  for (const auto& r : h.rollouts) {
    if (r.first != expect) fail("its rollouts do not tile its index");
    if (r.output == 0 || r.output > r.tokens) fail("a rollout's output length is out of range");
    if (r.version < 0 || r.version > h.newest) fail("a rollout's version is out of range");
    expect = r.first + r.tokens + 1;
  }
  if (expect != h.index.end() + 1) fail("its index holds more than its rollouts");
  if (h.index.indexed_tokens() != h.index.live() - (h.rollouts.size() - 1)) fail("unindexed tokens in its rollouts");
}

void PromptHistory::check_integrity() const {
  std::lock_guard<std::mutex> g(mu_);
  auto fail = [](const std::string& what) { throw std::logic_error("PromptHistory integrity: " + what); };
  if (keys_.size() != lru_.size()) fail("registry and LRU list differ in size");
  size_t charged = 0;
  for (const auto& key : lru_) {
    auto it = keys_.find(key);
    if (it == keys_.end()) fail("a key in the LRU list is not registered");
    const KeyHistory& h = *it->second.h;
    std::shared_lock<std::shared_mutex> rl(h.mu);
    check_key(key, h);
    if (h.rollouts.size() > cfg_.max_rollouts) fail("key '" + key + "' holds more rollouts than max_rollouts");
    if (h.index.live() > cfg_.max_key_tokens) fail("key '" + key + "' holds more tokens than max_key_tokens");
    if (it->second.charged != charge_of(h)) fail("key '" + key + "': charge is stale");
    charged += it->second.charged;
  }
  if (charged != charged_) fail("total charge disagrees with the keys'");
  if (charged_ > cfg_.max_charged_tokens && !keys_.empty()) fail("history holds more than its bound");
}

void PromptHistory::save(ByteWriter& w) const {
  std::lock_guard<std::mutex> g(mu_);
  save_locked(w);
}

void PromptHistory::save_locked(ByteWriter& w) const {
  w.put<uint64_t>(keys_.size());
  for (const auto& key : lru_) {
    const KeyHistory& h = *keys_.at(key).h;
    w.put_str(key);
    w.put<int64_t>(h.newest);
    std::vector<int64_t> meta;
    for (const auto& r : h.rollouts) meta.insert(meta.end(), {static_cast<int64_t>(r.first), r.tokens, r.output, r.version});
    w.put_vec(meta);
    h.index.save(w);
  }
}

PromptHistory::Loaded PromptHistory::parse(ByteReader& r) const {
  Loaded out;
  auto& keys = out.keys;
  auto& lru = out.lru;
  size_t& charged = out.charged;
  const uint64_t n = r.get<uint64_t>();
  auto expected = orders_;
  std::sort(expected.begin(), expected.end());
  for (uint64_t i = 0; i < n; ++i) {
    std::string key = r.get_str();
    auto h = std::make_shared<KeyHistory>(orders_);
    h->newest = r.get<int64_t>();
    auto meta = r.get_vec<int64_t>();
    if (meta.size() % 4) throw CorruptSnapshot("corrupt snapshot: prompt history metadata");
    for (size_t j = 0; j < meta.size(); j += 4)
      h->rollouts.push_back(HistoryRollout{static_cast<uint64_t>(meta[j]), static_cast<uint32_t>(meta[j + 1]),
                                           static_cast<uint32_t>(meta[j + 2]), meta[j + 3]});
    h->index = TokenIndex::load(r);
    if (h->index.orders() != expected)
      throw CorruptSnapshot("snapshot's prompt history was written with other own_orders than this corpus uses");
    if (key.empty() || keys.count(key)) throw CorruptSnapshot("corrupt snapshot: prompt history key");
    try {
      check_key(key, *h);
    } catch (const std::logic_error& e) {
      throw CorruptSnapshot(std::string("corrupt snapshot: ") + e.what());
    }
    lru.push_back(key);
    Entry e{h, std::prev(lru.end()), charge_of(*h)};
    charged += e.charged;
    keys.emplace(std::move(key), std::move(e));
  }
  return out;
}

void PromptHistory::install(Loaded&& l) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [k, e] : keys_) e.h->evicted.store(true, std::memory_order_release);
  keys_ = std::move(l.keys);
  lru_ = std::move(l.lru);  // a list's nodes move with it: the entries' iterators stay valid
  charged_ = l.charged;
  announced_ = l.announced;  // as the corpus takes the snapshot's policy version
  created_.fetch_add(1, std::memory_order_acq_rel);
  // What a smaller max_age than the snapshot's drops (as an announcement of its version would).
  if (cfg_.max_age > 0) {
    for (auto it = keys_.begin(); it != keys_.end();) {
      auto next = std::next(it);
      drop_old(*it->second.h, std::max(it->second.h->newest, announced_));
      recharge(it->second);
      if (it->second.h->rollouts.empty()) erase(it);
      it = next;
    }
  }
  // Smaller bounds than the snapshot's: what does not fit goes, oldest rollouts and least recently
  // written keys first.
  for (auto& [k, e] : keys_) {
    KeyHistory& h = *e.h;
    size_t drop = 0;
    while (drop < h.rollouts.size() && (h.rollouts.size() - drop > cfg_.max_rollouts ||
                                        h.index.end() - h.rollouts[drop].first > cfg_.max_key_tokens))
      ++drop;
    if (drop == 0) continue;
    drop_front(h, std::min(drop, h.rollouts.size() - 1));  // a key keeps its newest rollout here ...
    recharge(e);
  }
  for (auto it = keys_.begin(); it != keys_.end();) {  // ... unless even that one does not fit
    auto next = std::next(it);
    if (it->second.h->index.live() > cfg_.max_key_tokens) erase(it);
    it = next;
  }
  if (charged_ > cfg_.max_charged_tokens) {
    if (!enabled()) {
      keys_.clear(), lru_.clear(), charged_ = 0;
    } else {
      enforce_total(lru_.empty() ? std::string() : lru_.back());
    }
  }
}

// ---------------------------------------------------------------- learned source weights

SourceWeights::SourceWeights() { clear(); }

void SourceWeights::clear() {
  std::lock_guard<std::mutex> g(mu_);
  for (int i = 0; i < kLearnedClasses; ++i) {
    mult_[i].store(1.0f, std::memory_order_relaxed);
    win_accepted_[i] = win_expected_[i] = 0.0;
    win_tested_[i] = 0;
    tested_[i] = accepted_[i] = 0;
  }
}

float SourceWeights::multiplier(int cls) const {
  const int i = cls - kSrcSibling;
  return i >= 0 && i < kLearnedClasses ? mult_[i].load(std::memory_order_relaxed) : 1.0f;
}

SourceWeights::ClassStats SourceWeights::stats(int i) const {
  std::lock_guard<std::mutex> g(mu_);
  return {mult_[i].load(std::memory_order_relaxed), tested_[i], accepted_[i]};
}

void SourceWeights::observe(const DraftRecord& rec, const int32_t* committed, size_t n, uint32_t window) {
  const size_t m = rec.tokens.size();
  if (m == 0 || n == 0 || rec.cls.size() != m) return;
  const std::vector<int8_t>& ok = draft_outcomes(rec, committed, n);
  std::lock_guard<std::mutex> g(mu_);
  for (size_t i = 0; i < m; ++i) {
    if (ok[i] < 0) continue;
    const int c = static_cast<int>(rec.cls[i]) - kSrcSibling;
    if (c < 0 || c >= kLearnedClasses) continue;
    ++tested_[c], accepted_[c] += ok[i];
    win_accepted_[c] += ok[i];
    win_expected_[c] += rec.q[i];
    if (++win_tested_[c] < window) continue;
    const double ratio = std::clamp((win_accepted_[c] + 4.0) / (win_expected_[c] + 4.0), 0.5, 2.0);
    const float next = std::clamp(static_cast<float>(mult_[c].load(std::memory_order_relaxed) * ratio), 1.0f / 16, 16.0f);
    mult_[c].store(next, std::memory_order_relaxed);
    win_accepted_[c] = win_expected_[c] = 0.0;
    win_tested_[c] = 0;
  }
}

}  // namespace ngc
