#include "token_index.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "snapshot.h"

namespace ngc {

namespace {
// Runs fn(lo, hi) over [begin, end) cut into ranges of at least 2^20 items, one thread each (up to
// the machine's cores), and rethrows the failure of the lowest range that failed: the message
// names the first violation, as one sequential walk would.
template <class Fn>
void parallel_ranges(uint64_t begin, uint64_t end, Fn fn) {
  const uint64_t n = end > begin ? end - begin : 0;
  uint64_t threads = std::clamp<uint64_t>(std::thread::hardware_concurrency(), 1, 32);
  threads = std::min<uint64_t>(threads, std::max<uint64_t>(1, n >> 20));
  if (threads <= 1) {
    fn(begin, end);
    return;
  }
  const uint64_t step = (n + threads - 1) / threads;
  std::vector<std::exception_ptr> errors(threads);
  std::vector<std::thread> pool;
  for (uint64_t t = 0; t < threads; ++t) {
    const uint64_t lo = begin + t * step, hi = std::min(end, lo + step);
    pool.emplace_back([&fn, &errors, t, lo, hi] {
      try {
        if (lo < hi) fn(lo, hi);
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

constexpr int kMinHeadBits = 8;
constexpr int kMaxHeadBits = 31;
// Head tables double once an order holds more than kLoad entries per slot: chains that share a
// slot are told apart by verification, so a load of 2 trades a few extra steps for half the memory.
constexpr size_t kLoad = 2;
}  // namespace

TokenIndex::TokenIndex(std::vector<int> orders) : orders_(std::move(orders)) {
  if (orders_.empty() || orders_.size() > static_cast<size_t>(kMaxOrders))
    throw std::invalid_argument("orders: expected 1.." + std::to_string(kMaxOrders) +
                                " n-gram orders, got " + std::to_string(orders_.size()));
  std::sort(orders_.begin(), orders_.end());
  for (size_t i = 0; i < orders_.size(); ++i) {
    if (orders_[i] < 1 || orders_[i] > kMaxOrder)
      throw std::invalid_argument("orders: each order must be in [1, " + std::to_string(kMaxOrder) +
                                  "], got " + std::to_string(orders_[i]));
    if (i && orders_[i] == orders_[i - 1])
      throw std::invalid_argument("orders: duplicate order " + std::to_string(orders_[i]));
  }
  bits_.assign(orders_.size(), kMinHeadBits);
  heads_.assign(orders_.size(), std::vector<uint32_t>(size_t{1} << kMinHeadBits, 0));
}

void TokenIndex::reserve_more(size_t n) {
  if (tokens_.size() + n + 1 <= tokens_.capacity()) return;
  size_t cap = std::max(tokens_.size() + n + 1, tokens_.size() + tokens_.size() / 4 + 64);
  tokens_.reserve(cap);
  prev_.reserve(cap * orders_.size());
}

void TokenIndex::push(int32_t stored) {
  // Grow by 1.25x instead of libstdc++'s 2x: the learned store is the bulk of the memory bound.
  if (tokens_.size() == tokens_.capacity()) {
    size_t cap = tokens_.size() + tokens_.size() / 4 + 64;
    tokens_.reserve(cap);
    prev_.reserve(cap * orders_.size());
  }
  tokens_.push_back(stored);
  prev_.resize(prev_.size() + orders_.size(), 0);
}

bool TokenIndex::key_at(uint64_t pos, int k, uint64_t* hash) const {
  if (pos + 1 < base_ + static_cast<uint64_t>(k)) return false;
  const int32_t* last = &tokens_[pos - shift_];
  uint64_t h = 0;
  for (int i = 0; i < k; ++i) {
    int32_t v = decode_token(*(last - i));
    if (v == kSep) return false;
    h += hash_term(v, i);
  }
  *hash = h;
  return true;
}

uint64_t TokenIndex::decode_head(uint32_t stored) const {
  if (stored == 0) return UINT64_MAX;
  uint64_t e = end();
  uint32_t d = static_cast<uint32_t>(static_cast<uint32_t>(e) - stored);
  if (static_cast<uint64_t>(d) + 1 > e) return UINT64_MAX;
  uint64_t pos = e - d - 1;
  return pos >= base_ ? pos : UINT64_MAX;
}

void TokenIndex::link(uint64_t pos, int oi, uint64_t h) {
  uint32_t& head = heads_[oi][slot(h, oi)];
  uint64_t q = decode_head(head);
  prev(pos, oi) = (q == UINT64_MAX || pos - q > UINT32_MAX) ? 0 : static_cast<uint32_t>(pos - q);
  head = static_cast<uint32_t>(pos + 1);
}

void TokenIndex::index_range(uint64_t a, uint64_t b) {
  // Rolling keys: H_k(p) = (v(p)+1) + P * (H_k(p-1) - (v(p-k)+1) * P^(k-1)), so each order costs
  // O(1) per position once its first key in the run is computed directly (index_position).
  if (a >= b) return;
  index_position(a);
  const size_t n_orders = orders_.size();
  const int max_k = orders_.back();
  // run: consecutive tokens (no separator, not evicted) ending at the current position, <= max_k.
  int run = 0;
  for (uint64_t q = a; run < max_k && q + 1 > base_ && decode_token(at(q)) != kSep; --q) {
    ++run;
    if (q == 0) break;
  }
  uint64_t h[kMaxOrders];
  for (size_t oi = 0; oi < n_orders; ++oi)
    if (run >= orders_[oi]) key_at(a, orders_[oi], &h[oi]);
  const uint64_t P = kHashPowers.p[1];
  for (uint64_t pos = a + 1; pos < b; ++pos) {
    const uint64_t v = static_cast<uint64_t>(static_cast<uint32_t>(decode_token(at(pos)))) + 1;
    const int prev_run = run;
    run = std::min(run + 1, max_k);
    for (size_t oi = 0; oi < n_orders; ++oi) {
      const int k = orders_[oi];
      if (prev_run >= k) {
        const uint64_t old = static_cast<uint64_t>(static_cast<uint32_t>(decode_token(at(pos - k)))) + 1;
        h[oi] = v + P * (h[oi] - old * kHashPowers.p[k - 1]);
      } else if (run >= k) {
        key_at(pos, k, &h[oi]);
      } else {
        continue;
      }
      link(pos, static_cast<int>(oi), h[oi]);
    }
    ++indexed_;
  }
}

void TokenIndex::index_position(uint64_t pos) {
  // One backward pass over the last max-order tokens gives the key of every order (orders are
  // sorted ascending); a document boundary or evicted data ends the pass.
  uint64_t h = 0;
  size_t oi = 0;
  const int32_t* p = &tokens_[pos - shift_];
  const int max_k = orders_.back();
  for (int i = 0; i < max_k && oi < orders_.size(); ++i) {
    if (pos < base_ + static_cast<uint64_t>(i)) break;
    int32_t v = decode_token(*(p - i));
    if (v == kSep) break;
    h += hash_term(v, i);
    if (i + 1 != orders_[oi]) continue;
    link(pos, static_cast<int>(oi), h);
    ++oi;
  }
  ++indexed_;
}

uint64_t TokenIndex::append_document(const int32_t* tokens, size_t n, size_t context, uint64_t continues) {
  if (context > n) throw std::invalid_argument("context longer than the document");
  if (n == 0) return UINT64_MAX;
  if (live() > 0) push(kSep);
  ++documents_;
  for (size_t i = 0; i < context; ++i) push(-tokens[i] - 1);
  if (continues != UINT64_MAX && continues >= base_ && continues < end() && n > context)
    links_[continues] = end();
  maybe_grow_heads(indexed_ + (n - context));  // size the heads once, before indexing
  reserve_more(n - context);
  const uint64_t first = end();
  for (size_t i = context; i < n; ++i) push(tokens[i]);
  index_range(first, end());
  return end() - 1;
}

void TokenIndex::extend_last(const int32_t* tokens, size_t n) {
  if (live() == 0 && n > 0) ++documents_;
  maybe_grow_heads(indexed_ + n);
  reserve_more(n);
  const uint64_t first = end();
  for (size_t i = 0; i < n; ++i) push(tokens[i]);
  index_range(first, end());
}

std::vector<std::pair<int, int>> TokenIndex::heads_to_grow(size_t expected) const {
  std::vector<std::pair<int, int>> out;
  for (size_t oi = 0; oi < orders_.size(); ++oi) {
    if (expected <= kLoad << bits_[oi] || bits_[oi] >= kMaxHeadBits) continue;
    int bits = bits_[oi];
    while (expected > kLoad << bits && bits < kMaxHeadBits) ++bits;
    out.emplace_back(static_cast<int>(oi), bits);
  }
  return out;
}

void TokenIndex::maybe_grow_heads(size_t expected) {
  for (auto [oi, bits] : heads_to_grow(expected)) rebuild_heads(oi, bits);
}

template <class SetPrev>
std::vector<uint32_t> TokenIndex::build_heads(int oi, int bits, SetPrev&& set_prev) const {
  std::vector<uint32_t> heads(size_t{1} << bits, 0);
  const uint64_t e = end();
  for (uint64_t pos = base_; pos < e; ++pos) {
    uint64_t h;
    if (at(pos) < 0 || !key_at(pos, orders_[oi], &h)) {
      set_prev(pos, 0u);
      continue;
    }
    uint32_t& head = heads[slot_at(h, bits)];
    uint64_t p = decode_head(head);  // measured from end(): every stored pos is < end()
    set_prev(pos, (p == UINT64_MAX || pos - p > UINT32_MAX) ? 0u : static_cast<uint32_t>(pos - p));
    head = static_cast<uint32_t>(pos + 1);
  }
  return heads;
}

void TokenIndex::rebuild_heads(int oi, int bits) {
  heads_[oi] = build_heads(oi, bits, [&](uint64_t pos, uint32_t d) { prev(pos, oi) = d; });
  bits_[oi] = bits;
}

bool TokenIndex::needs_growth(size_t more, size_t expected, size_t max_live) const {
  if (tokens_.size() + more + 1 > tokens_.capacity()) return true;  // push would reallocate
  // evict_to would compact: the dead prefix past a quarter of the live part.
  const size_t dead = first_ + evictions(more, max_live);
  if (dead >= 64 && dead > std::min(live() + more, max_live ? max_live : SIZE_MAX) / 4) return true;
  return !heads_to_grow(expected).empty();
}

TokenIndex::Growth TokenIndex::prepare_growth(size_t more, size_t expected, size_t max_live) const {
  Growth g;
  g.from = base_, g.to = end();
  const size_t n = live(), n_orders = orders_.size();
  // The copy holds only live positions (compacted); room to grow by 1.25x as push() would, and at
  // least for `more`. Under a bound the storage stays within ~1.25x of it, as evict_to keeps it.
  size_t cap = std::max(n + more + 1, n + n / 4 + 64);
  // Under a bound the live tokens never pass it (the writer evicts before each item) and the dead
  // prefix stays under a quarter of them, so the storage the group needs is at most 1.25x the bound
  // however much it adds.
  if (max_live) cap = std::max(n + 1, std::min(cap, max_live + max_live / 4 + 64));
  g.tokens.reserve(cap);
  g.prev.reserve(cap * n_orders);
  g.tokens.assign(tokens_.begin() + static_cast<std::ptrdiff_t>(first_), tokens_.end());
  g.prev.assign(prev_.begin() + static_cast<std::ptrdiff_t>(first_ * n_orders), prev_.end());
  g.grown = heads_to_grow(expected);
  for (const auto& [oi, bits] : g.grown) {
    uint32_t* col = g.prev.data() + oi;
    g.heads.push_back(build_heads(oi, bits, [&](uint64_t pos, uint32_t d) { col[(pos - g.from) * n_orders] = d; }));
  }
  return g;
}

bool TokenIndex::install_growth(Growth&& g) {
  const size_t n_orders = orders_.size();
  if (g.from != base_ || g.to != end() || g.tokens.size() != g.to - g.from ||
      g.prev.size() != g.tokens.size() * n_orders || g.heads.size() != g.grown.size())
    return false;
  for (size_t i = 0; i < g.grown.size(); ++i) {
    const auto [oi, bits] = g.grown[i];
    if (oi < 0 || oi >= static_cast<int>(n_orders) || g.heads[i].size() != size_t{1} << bits) return false;
  }
  tokens_.swap(g.tokens);
  prev_.swap(g.prev);
  first_ = 0;
  shift_ = base_;
  for (size_t i = 0; i < g.grown.size(); ++i) {
    const auto [oi, bits] = g.grown[i];
    heads_[oi].swap(g.heads[i]);
    bits_[oi] = bits;
  }
  return true;  // the old storage leaves with g (freed by the caller, outside any lock)
}

void TokenIndex::evict_to(size_t max_live) {
  if (live() <= max_live) return;
  size_t drop = live() - max_live;
  for (size_t i = 0; i < drop; ++i)
    if (tokens_[first_ + i] >= 0) --indexed_;
  first_ += drop;
  base_ += drop;
  links_.erase(links_.begin(), links_.lower_bound(base_));
  // Compact once the dead prefix exceeds a quarter of the live part: amortized O(1) per evicted
  // token, and storage stays within 1.25x of the live tokens (the memory bound counts on it).
  if (first_ > live() / 4 && first_ >= 64) {
    tokens_.erase(tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(first_));
    prev_.erase(prev_.begin(), prev_.begin() + static_cast<std::ptrdiff_t>(first_ * orders_.size()));
    shift_ += first_;
    first_ = 0;
  }
  if (live() == 0) clear();
}

void TokenIndex::clear() {
  uint64_t e = end();
  tokens_.clear();
  prev_.clear();
  tokens_.shrink_to_fit();
  prev_.shrink_to_fit();
  first_ = 0;
  shift_ = base_ = e;  // positions keep increasing so stale references can never revive
  indexed_ = 0;
  links_.clear();
  for (size_t oi = 0; oi < orders_.size(); ++oi) {
    bits_[oi] = kMinHeadBits;
    heads_[oi].assign(size_t{1} << kMinHeadBits, 0);
  }
}

void TokenIndex::reset() {
  uint64_t e = end();
  tokens_.clear();
  prev_.clear();
  first_ = 0;
  shift_ = base_ = e;
  indexed_ = 0;
  documents_ = 0;
  links_.clear();
  for (auto& h : heads_) std::fill(h.begin(), h.end(), 0u);
}

int TokenIndex::match_backwards(uint64_t pos, const int32_t* ctx, int ctx_len, int max_match) const {
  int limit = std::min(ctx_len, max_match);
  int m = 0;
  while (m < limit && pos >= base_ + static_cast<uint64_t>(m)) {
    int32_t v = decode_token(at(pos - m));
    if (v == kSep || v != ctx[ctx_len - 1 - m]) break;
    ++m;
  }
  return m;
}

int TokenIndex::find(const int32_t* ctx, int ctx_len, const FindLimits& lim, uint64_t exclude_from,
                     Candidate* out, const PositionRanges* skip) const {
  auto skipped = [&](uint64_t p) {  // skip is sorted: the last range starting at or before p
    if (!skip || skip->empty()) return false;
    auto it = std::upper_bound(skip->begin(), skip->end(), p,
                               [](uint64_t v, const std::pair<uint64_t, uint64_t>& r) { return v < r.first; });
    return it != skip->begin() && p <= std::prev(it)->second;
  };
  const int max_cands = lim.max_candidates, max_chain = lim.max_chain, max_match = lim.max_match;
  const int64_t max_skipped = static_cast<int64_t>(max_chain) * kSkippedPerStep;
  int found = 0;
  for (int oi = static_cast<int>(orders_.size()) - 1; oi >= 0 && found < max_cands; --oi) {
    int k = orders_[oi];
    if (lim.enough > 0 && found >= lim.enough && k < lim.enough_order) break;
    if (ctx_len < k) continue;
    uint64_t p = decode_head(heads_[oi][slot(ngram_hash(ctx + ctx_len - 1, k), oi)]);
    // Skipped positions (a request's own chunks, inserted asynchronously) do not use up the chain
    // budget, so whether they were inserted yet does not change what else is found, up to
    // kSkippedPerStep of them per step of the budget: a request caught in a generation loop puts
    // its own positions by the thousand at the head of the loop's chains, and walking them all made
    // its drafts cost milliseconds (a 3-token loop 36k tokens long: 8.7 ms per draft).
    int64_t n_skipped = 0;
    for (int step = 0; p != UINT64_MAX && step < max_chain && found < max_cands;) {
      const bool skip_p = skipped(p);
      if (!skip_p) {
        ++step;
      } else if (++n_skipped > max_skipped) {
        break;
      }
      if (p < exclude_from && !skip_p) {
        int m = match_backwards(p, ctx, ctx_len, max_match);
        if (m >= k) {
          bool dup = false;
          for (int j = 0; j < found && !dup; ++j) dup = out[j].pos == p;
          if (!dup) out[found++] = Candidate{p, m};
        }
      }
      uint32_t d = prev(p, oi);
      p = (d == 0 || p < base_ + d) ? UINT64_MAX : p - d;
    }
  }
  return found;
}

int TokenIndex::continuation(uint64_t pos, int n, int32_t* out) const {
  int c = 0;
  uint64_t e = end();
  for (uint64_t q = pos + 1; c < n;) {
    if (q >= e || at(q) == kSep) {  // end of a chunk: follow its continuation, if any
      auto it = links_.find(q - 1);
      if (it == links_.end() || it->second <= q - 1 || it->second >= e) break;
      q = it->second;
      continue;
    }
    out[c++] = decode_token(at(q++));
  }
  return c;
}

size_t TokenIndex::memory_bytes() const {
  size_t b = tokens_.capacity() * sizeof(int32_t) + prev_.capacity() * sizeof(uint32_t);
  for (const auto& h : heads_) b += h.capacity() * sizeof(uint32_t);
  return b + sizeof(*this);
}

void TokenIndex::tail(int n, int32_t* out) const {
  uint64_t start = end() - static_cast<uint64_t>(n);
  for (int i = 0; i < n; ++i) out[i] = decode_token(at(start + i));
}

void TokenIndex::read(uint64_t pos, size_t n, int32_t* out) const {
  if (pos < base_ || pos + n > end()) throw std::out_of_range("TokenIndex::read: positions outside the live range");
  for (size_t i = 0; i < n; ++i) out[i] = decode_token(at(pos + i));
}

std::vector<int32_t> TokenIndex::dump_tokens() const {
  std::vector<int32_t> out;
  out.reserve(live());
  for (uint64_t p = base_; p < end(); ++p) out.push_back(decode_token(at(p)));
  return out;
}

void TokenIndex::check_integrity() const {
  auto fail = [](const std::string& what) { throw std::logic_error("TokenIndex integrity: " + what); };
  if (first_ > tokens_.size()) fail("first_ beyond storage");
  if (prev_.size() != tokens_.size() * orders_.size()) fail("chain array size mismatch");
  if (base_ != shift_ + first_) fail("base/shift/first disagree");
  // Positions are independent: the walk runs on several threads (a snapshot's load ends with it).
  std::atomic<size_t> indexed{0};
  parallel_ranges(base_, end(), [&](uint64_t lo, uint64_t hi) {
    size_t mine = 0;
    for (uint64_t p = lo; p < hi; ++p) {
      int32_t v = at(p);
      if (v >= 0) ++mine;
      // A separator may open the live range after eviction, but a store never ends on one.
      if (v == kSep && p + 1 == end()) fail("store ends on a separator");
      for (size_t oi = 0; oi < orders_.size(); ++oi) {
        uint32_t d = prev(p, oi);
        if (d == 0) continue;
        if (v < 0) fail("chain link on an unindexed position " + std::to_string(p));
        // A link into evicted data ends the chain; keys that reach before base_ cannot be recomputed.
        if (d > p || p - d < base_ + static_cast<uint64_t>(orders_[oi]) - 1) continue;
        uint64_t h1, h2;
        if (!key_at(p, orders_[oi], &h1) || !key_at(p - d, orders_[oi], &h2))
          fail("chain link at " + std::to_string(p) + " without a key");
        if (slot(h1, oi) != slot(h2, oi))
          fail("chain link at " + std::to_string(p) + " joins different slots");
      }
    }
    indexed += mine;
  });
  for (auto [from, to] : links_) {
    if (from < base_ || to <= from || to >= end() || at(to) < 0)
      fail("continuation link " + std::to_string(from) + " -> " + std::to_string(to));
  }
  if (indexed != indexed_) fail("indexed count " + std::to_string(indexed_) + " != " + std::to_string(indexed));
  for (size_t oi = 0; oi < orders_.size(); ++oi) {
    if (heads_[oi].size() != size_t{1} << bits_[oi]) fail("head table size");
    parallel_ranges(0, heads_[oi].size(), [&](uint64_t lo, uint64_t hi) {
      for (size_t s = lo; s < hi; ++s) {
        uint64_t p = decode_head(heads_[oi][s]);
        if (p == UINT64_MAX) continue;
        uint64_t h;
        // A head may point at a stale evicted-then-wrapped slot only beyond 2^32 tokens; verify.
        if (p < base_ + static_cast<uint64_t>(orders_[oi]) - 1) continue;  // key reaches evicted data
        if (at(p) < 0 || !key_at(p, orders_[oi], &h) || slot(h, oi) != s)
          fail("head slot " + std::to_string(s) + " of order " + std::to_string(orders_[oi]) +
               " points at a position with another key");
      }
    });
  }
}

void TokenIndex::save(ByteWriter& w) const {
  w.put_vec(std::vector<int32_t>(orders_.begin(), orders_.end()));
  w.put<uint64_t>(base_);
  w.put<uint64_t>(indexed_);
  w.put<uint64_t>(documents_);
  w.put_range(tokens_.data() + first_, live());
  w.put_range(prev_.data() + first_ * orders_.size(), live() * orders_.size());
  for (size_t oi = 0; oi < orders_.size(); ++oi) {
    w.put<int32_t>(bits_[oi]);
    w.put_vec(heads_[oi]);
  }
  std::vector<uint64_t> links;
  for (auto [from, to] : links_) links.push_back(from), links.push_back(to);
  w.put_vec(links);
}

TokenIndex TokenIndex::load(ByteReader& r) {
  auto orders32 = r.get_vec<int32_t>();
  TokenIndex idx(std::vector<int>(orders32.begin(), orders32.end()));
  idx.base_ = idx.shift_ = r.get<uint64_t>();
  idx.indexed_ = r.get<uint64_t>();
  idx.documents_ = r.get<uint64_t>();
  idx.tokens_ = r.get_vec<int32_t>();
  idx.prev_ = r.get_vec<uint32_t>();
  for (size_t oi = 0; oi < idx.orders_.size(); ++oi) {
    idx.bits_[oi] = r.get<int32_t>();
    if (idx.bits_[oi] < kMinHeadBits || idx.bits_[oi] > kMaxHeadBits)
      throw CorruptSnapshot("corrupt snapshot: head table size out of range");
    idx.heads_[oi] = r.get_vec<uint32_t>();
  }
  auto links = r.get_vec<uint64_t>();
  if (links.size() % 2) throw CorruptSnapshot("corrupt snapshot: odd link array");
  for (size_t i = 0; i < links.size(); i += 2) idx.links_[links[i]] = links[i + 1];
  if (idx.prev_.size() != idx.tokens_.size() * idx.orders_.size())
    throw CorruptSnapshot("corrupt snapshot: chain array size mismatch");
  for (size_t oi = 0; oi < idx.orders_.size(); ++oi)
    if (idx.heads_[oi].size() != size_t{1} << idx.bits_[oi])
      throw CorruptSnapshot("corrupt snapshot: head table size mismatch");
  return idx;
}

}  // namespace ngc
