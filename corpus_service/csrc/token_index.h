// TokenIndex: an append-only store of token documents with hash-chain suffix lookup.
//
// Every indexed position p is linked, for each n-gram order k, to the previous position whose
// last k tokens hash to the same slot (the LZ77/zlib "head + prev" scheme). Looking up the tail of
// a context walks those chains from the longest order down, verifies each candidate by comparing
// tokens backwards (so hash collisions cost time, never correctness) and reports its exact match
// length. Each stored occurrence is one position, so counts are occurrence counts.
//
// Memory per token: 4 B token + 4 B per order (chain delta) + 2-4 B per order (head slots).
// Eviction drops the oldest tokens (FIFO) and never fails: chains that reach evicted positions
// simply end there.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <utility>
#include <vector>

namespace ngc {

class ByteWriter;
class ByteReader;

// Stored token encoding: v >= 0 is an indexed token; kSep ends a document; any other negative v is
// a context-only token -(v+1) (left context copied in front of a continued document so matches
// reach across the boundary, never itself indexed, so no occurrence is counted twice).
constexpr int32_t kSep = std::numeric_limits<int32_t>::min();
constexpr int kMaxOrder = 32;
constexpr int kMaxOrders = 8;

inline int32_t decode_token(int32_t v) { return v >= 0 ? v : (v == kSep ? kSep : -(v + 1)); }

// One match of a context tail inside an index.
struct Candidate {
  uint64_t pos;       // logical position of the last matched token
  int32_t match_len;  // number of tokens matched backwards from pos (>= 1)
};

// Hash of the k tokens ending at `last`: sum over i < k of (token[-i] + 1) * P^i mod 2^64. Its
// prefix sums over i are the hashes of every order, so one backward pass keys all orders, and the
// terms are independent multiplies (no serial dependency chain). Slots take the top bits after a
// Fibonacci multiply, which mixes the polynomial's weak low bits.
struct HashPowers {
  uint64_t p[kMaxOrder];
  constexpr HashPowers() : p() {
    uint64_t x = 1;
    for (int i = 0; i < kMaxOrder; ++i, x *= 0xC2B2AE3D27D4EB4Full) p[i] = x;
  }
};
inline constexpr HashPowers kHashPowers{};
inline uint64_t hash_term(int32_t token, int i) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(token)) + 1) * kHashPowers.p[i];
}
inline uint64_t ngram_hash(const int32_t* last, int k) {
  uint64_t h = 0;
  for (int i = 0; i < k; ++i) h += hash_term(*(last - i), i);
  return h;
}

// Inclusive position ranges a lookup must skip, sorted by their first position, not overlapping.
using PositionRanges = std::vector<std::pair<uint64_t, uint64_t>>;

// A lookup walks at most this many skipped positions per step of its chain budget (max_chain), per
// order: beyond that, a chain's head is all the asking request's own positions (TokenIndex::find).
constexpr int kSkippedPerStep = 16;

// Bounds of one lookup. Once `enough` candidates are found, orders below `enough_order` are not
// searched: short matches weigh little next to them and cost the longest chain walks.
struct FindLimits {
  int max_candidates = 32;
  int max_chain = 16;
  int max_match = 64;
  int enough = 0;  // 0: always search every order
  int enough_order = 4;
};

class TokenIndex {
 public:
  // orders: distinct n-gram orders in [1, kMaxOrder], at most kMaxOrders of them.
  explicit TokenIndex(std::vector<int> orders);

  // Starts a new document. The first `context` tokens are left context only (not indexed). If
  // `continues` names the last position of an earlier document, continuations read past that
  // document's end into this one. Returns the new document's last position (UINT64_MAX if empty).
  uint64_t append_document(const int32_t* tokens, size_t n, size_t context = 0,
                           uint64_t continues = UINT64_MAX);
  // Appends tokens to the last document; starts one if the store is empty.
  void extend_last(const int32_t* tokens, size_t n);
  // Drops the oldest tokens until at most max_live remain (whole store if max_live == 0).
  void evict_to(size_t max_live);
  void clear();
  // Empties the index but keeps its allocations (a recycled per-request index starts warm).
  void reset();

  // Finds up to max_candidates distinct positions p < exclude_from whose preceding tokens match
  // the tail of ctx[0..ctx_len), longest orders first, each chain walked at most max_chain steps
  // (positions in `skip` not counted, up to kSkippedPerStep * max_chain of them). Returns how
  // many were written to out.
  int find(const int32_t* ctx, int ctx_len, const FindLimits& limits, uint64_t exclude_from,
           Candidate* out, const PositionRanges* skip = nullptr) const;
  // Copies up to n tokens that follow pos in its document into out; returns how many.
  int continuation(uint64_t pos, int n, int32_t* out) const;

  uint64_t begin() const { return base_; }       // oldest live logical position
  uint64_t end() const { return base_ + live(); }  // one past the newest position
  size_t live() const { return tokens_.size() - first_; }
  size_t indexed_tokens() const { return indexed_; }
  size_t documents() const { return documents_; }
  size_t memory_bytes() const;
  const std::vector<int>& orders() const { return orders_; }
  // Copies the last n tokens (decoded; n <= live()) into out: the context tail of a request.
  void tail(int n, int32_t* out) const;
  // Copies the n tokens (decoded) from live position pos on into out.
  void read(uint64_t pos, size_t n, int32_t* out) const;
  // Copies the live tokens (decoded, documents separated by kSep) for inspection.
  std::vector<int32_t> dump_tokens() const;

  // Growing the learned index without holding lookups off (Corpus::worker, its only writer). What
  // applying about `more` stored tokens would otherwise do under the exclusive lock: reallocate and
  // copy the storage, compact it after evictions (under the bound `max_live`, 0 = none), or rehash
  // every position into a larger head table for `expected` indexed positions. A Growth is a copy of
  // the live storage with room for those tokens and the outgrown head tables rebuilt, prepared
  // while lookups run (nothing may write the index meanwhile) and then swapped in, O(1).
  struct Growth {
    uint64_t from = 0, to = 0;  // the live positions [begin(), end()) when prepared
    std::vector<int32_t> tokens;
    std::vector<uint32_t> prev;
    std::vector<std::pair<int, int>> grown;    // (order index, bits) of the rebuilt head tables
    std::vector<std::vector<uint32_t>> heads;  // their tables, in the same order
  };
  bool needs_growth(size_t more, size_t expected, size_t max_live = 0) const;
  Growth prepare_growth(size_t more, size_t expected, size_t max_live = 0) const;
  // false (nothing changed) if the positions are not those it was prepared for.
  bool install_growth(Growth&& g);

  // Verifies every structural invariant; throws std::logic_error naming the first violation.
  void check_integrity() const;

  void save(ByteWriter& w) const;
  static TokenIndex load(ByteReader& r);

 private:
  int32_t at(uint64_t pos) const { return tokens_[pos - shift_]; }
  uint32_t& prev(uint64_t pos, int oi) { return prev_[(pos - shift_) * orders_.size() + oi]; }
  uint32_t prev(uint64_t pos, int oi) const { return prev_[(pos - shift_) * orders_.size() + oi]; }
  void push(int32_t stored);
  void index_position(uint64_t pos);
  void index_range(uint64_t a, uint64_t b);  // indexes positions [a, b) (all real tokens)
  void link(uint64_t pos, int oi, uint64_t hash);
  bool key_at(uint64_t pos, int k, uint64_t* hash) const;
  size_t slot(uint64_t hash, int oi) const { return slot_at(hash, bits_[oi]); }
  static size_t slot_at(uint64_t hash, int bits) {
    hash ^= hash >> 29;
    return static_cast<size_t>((hash * 0x9E3779B97F4A7C15ull) >> (64 - bits));
  }
  uint64_t decode_head(uint32_t stored) const;
  // The orders whose head tables are too small for `expected` indexed positions, with the bits each needs.
  std::vector<std::pair<int, int>> heads_to_grow(size_t expected) const;
  void maybe_grow_heads(size_t expected);
  void reserve_more(size_t n);
  void rebuild_heads(int oi, int bits);
  // Order oi's head table at `bits` over the live positions; each position's chain delta goes to
  // set_prev(pos, delta). Reads the tokens only.
  template <class SetPrev>
  std::vector<uint32_t> build_heads(int oi, int bits, SetPrev&& set_prev) const;
  size_t evictions(size_t more, size_t max_live) const {
    return max_live && live() + more > max_live ? live() + more - max_live : 0;
  }
  int match_backwards(uint64_t pos, const int32_t* ctx, int ctx_len, int max_match) const;

  std::vector<int> orders_;
  std::vector<int32_t> tokens_;   // physical storage; tokens_[first_..] are live
  std::vector<uint32_t> prev_;    // per position and order: distance to previous position in chain
  std::vector<std::vector<uint32_t>> heads_;  // per order: low 32 bits of (pos + 1), 0 = empty
  std::vector<int> bits_;         // per order: log2 of head slots
  std::map<uint64_t, uint64_t> links_;  // last position of a chunk -> first indexed position of its continuation
  size_t first_ = 0;              // physical index of the oldest live position
  uint64_t shift_ = 0;            // logical position of physical index 0
  uint64_t base_ = 0;             // logical position of the oldest live token
  size_t indexed_ = 0;            // live positions that are indexed
  size_t documents_ = 0;          // documents started (including evicted ones)
};

}  // namespace ngc
