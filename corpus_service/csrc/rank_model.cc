#include "rank_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "prompt_history.h"
#include "snapshot.h"

namespace ngc {

namespace {
// q bins on a square-root scale, as acceptance_model.cc's: bin = floor(sqrt(q) * 12).
int q_bin(float q) {
  static constexpr float kEdges[RankModel::kQBins - 1] = {
      1 / 144.f, 4 / 144.f, 9 / 144.f, 16 / 144.f, 25 / 144.f, 36 / 144.f,
      49 / 144.f, 64 / 144.f, 81 / 144.f, 100 / 144.f, 121 / 144.f};
  int b = 0;
  for (float e : kEdges) b += q >= e;
  return b;
}
uint32_t tested_of(uint32_t v) { return v >> 16; }
uint32_t accepted_of(uint32_t v) { return v & 0xffffu; }
// ln(x) for x > 0 from the float's exponent and a quartic in its mantissa (|error| < 1e-4): the model
// takes several logarithms per ranked node, and std::log was most of its draft cost. Deterministic
// (plain float arithmetic), so the same calls still give the same drafts.
float fast_log(float x) {
  int32_t i;
  std::memcpy(&i, &x, 4);
  const float e = static_cast<float>(((i >> 23) & 255) - 127);
  i = (i & 0x007FFFFF) | 0x3f800000;
  float m;
  std::memcpy(&m, &i, 4);  // in [1, 2)
  const float log2m = -1.7417939f + (2.8212026f + (-1.4699568f + (0.44717955f - 0.056570851f * m) * m) * m) * m;
  return (e + log2m) * 0.69314718f;
}
// Probabilities are kept in [1e-4, 1 - 1e-4] so logits stay finite (|logit| <= 9.2).
float clamp_p(float p) { return std::clamp(p, 1e-4f, 1.0f - 1e-4f); }
float logit(float p) {
  p = clamp_p(p);
  return fast_log(p / (1.0f - p));
}
float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }
constexpr uint32_t kTokenBase = RankModel::kDepthCells;
constexpr uint32_t kPairBase = kTokenBase + (1u << RankModel::kTokenBits);
constexpr uint32_t kTripleBase = kPairBase + (1u << RankModel::kPairBits);
constexpr uint32_t kSourcePairBase = kTripleBase + (1u << RankModel::kTripleBits);
// The source of a vote in three groups: the request's own context, the learned and external corpora,
// and the rest (group members, the key's rollouts).
uint32_t source_group(uint8_t cls) { return cls == kSrcOwn ? 0u : cls >= kSrcLearned ? 1u : 2u; }
constexpr float kOwnPrior = 4.0f;  // pseudo-observations of the shared rate per request cell
}  // namespace

constexpr float RankModel::kInitialWeights[RankModel::kFeatures];

RankModel::RankModel() : cells_(new std::atomic<uint32_t>[kCells]) { clear(); }

void RankModel::clear() {
  std::lock_guard<std::mutex> g(mu_);
  for (int i = 0; i < kCells; ++i) cells_[i].store(0, std::memory_order_relaxed);
  for (int i = 0; i < kFeatures; ++i) w_[i].store(kInitialWeights[i], std::memory_order_relaxed), g2_[i] = 0.0;
  tested_ = 0, accepted_ = 0;
  queue_.clear();
}

float RankModel::request_feature(const DraftRecord& rec) {
  return fast_log((rec.req_accepted + 1.0f) / (rec.req_expected + 1.0f));
}

float RankModel::predict(const RankInputs& in, float request, const uint16_t* own, const RankParams& p, float* f,
                         uint32_t* cells) const {
  const float q = std::clamp(in.q, 0.0f, 1.0f);
  const int qb = q_bin(q);
  const uint32_t dc = static_cast<uint32_t>(qb * kDepthBins + std::clamp(in.depth, 1, kDepthBins) - 1);
  // Fibonacci hashing of the token and of the (parent, token) pair.
  // The token cell in 4 coarse q bins: a token's rate is not one number for its confident and its
  // doubtful drafts.
  const uint32_t tc = kTokenBase + (static_cast<uint32_t>(qb * 4 / kQBins) << (kTokenBits - 2) |
                                    (static_cast<uint32_t>(in.token) * 2654435761u) >> (32 - kTokenBits + 2));
  const uint64_t pair = (static_cast<uint64_t>(static_cast<uint32_t>(in.parent_token)) << 32) | static_cast<uint32_t>(in.token);
  const uint32_t pc = kPairBase + static_cast<uint32_t>((pair * 0x9E3779B97F4A7C15ull) >> (64 - kPairBits));
  const uint64_t triple = pair * 0x9E3779B97F4A7C15ull ^ static_cast<uint32_t>(in.grand_token) * 0xC2B2AE3D27D4EB4Full;
  const uint32_t gc = kTripleBase + static_cast<uint32_t>((triple * 0xD6E8FEB86659FD93ull) >> (64 - kTripleBits));
  // The pair again, by source group and coarse q bin (4 x 3 variants of each pair).
  const uint64_t variant = source_group(in.cls) * 4 + static_cast<uint64_t>(qb * 4 / kQBins) + 1;
  const uint64_t sp = pair * 0x9E3779B97F4A7C15ull + variant * 0x632BE59BD9B4E019ull;
  const uint32_t sc = kSourcePairBase + static_cast<uint32_t>((sp * 0xD6E8FEB86659FD93ull) >> (64 - kSourcePairBits));
  cells[0] = dc, cells[1] = tc, cells[2] = pc, cells[3] = gc, cells[4] = sc;
  const uint32_t vd = cells_[dc].load(std::memory_order_relaxed);
  const float c = (static_cast<float>(accepted_of(vd)) + p.prior * q) / (static_cast<float>(tested_of(vd)) + p.prior);
  const float cc = clamp_p(c);
  const float lc = fast_log(cc / (1.0f - cc));
  // A cell's rate shrunk towards `base` (cb: base clamped), and logit r - logit base as one logarithm:
  // ln(r (1 - b) / ((1 - r) b)).
  auto rate = [](uint32_t v, float k, float base) {
    return clamp_p((static_cast<float>(accepted_of(v)) + k * base) / (static_cast<float>(tested_of(v)) + k));
  };
  auto log_ratio = [](float r, float b) { return fast_log(r * (1.0f - b) / ((1.0f - r) * b)); };
  auto shrunk = [&](uint32_t cell, float k) {
    const uint32_t v = cells_[cell].load(std::memory_order_relaxed);
    if (tested_of(v) == 0) return 0.0f;  // no evidence: exactly the cell estimate
    return log_ratio(rate(v, k, c), cc);
  };
  f[0] = 1.0f;
  f[1] = logit(q);
  f[2] = lc;
  f[3] = shrunk(tc, p.token_prior);
  f[4] = in.parent_token < 0 ? 0.0f : shrunk(pc, p.pair_prior);
  f[5] = in.parent_token < 0 || in.grand_token < 0 ? 0.0f : shrunk(gc, p.pair_prior);
  f[6] = request;
  f[7] = std::min(in.q_own, 1.0f);
  f[8] = std::min(in.q_shared, 1.0f);
  f[9] = static_cast<float>(std::min(in.depth, 16)) / 8.0f;
  f[10] = std::min(in.dominance, 1.0f);
  f[11] = fast_log(1.0f + static_cast<float>(std::min(in.siblings, 256))) * (1.4426950f / 4.0f);
  f[12] = in.latest ? 1.0f : 0.0f;
  f[13] = in.latest_own ? 1.0f : 0.0f;
  f[14] = in.parent_token < 0 ? 0.0f : shrunk(sc, p.pair_prior);
  f[15] = f[16] = 0.0f;
  if (own != nullptr) {
    // The request's own cells, shrunk towards the shared token and pair rates: what sets this request
    // apart from the others (0 without its own evidence).
    const uint16_t ot = own[RequestCells::token(in.token)];
    const uint16_t op = in.parent_token < 0 ? 0 : own[RequestCells::pair(in.parent_token, in.token)];
    if ((ot >> 8) != 0 || (op >> 8) != 0) {
      const uint32_t vt = cells_[tc].load(std::memory_order_relaxed);
      const float rt = tested_of(vt) == 0 ? cc : rate(vt, p.token_prior, c);
      const uint32_t vp = in.parent_token < 0 ? 0u : cells_[pc].load(std::memory_order_relaxed);
      const float rp = tested_of(vp) == 0 ? rt : rate(vp, p.pair_prior, rt);
      auto own_rate = [](uint16_t v, float base) {
        return clamp_p((static_cast<float>(v & 0xffu) + kOwnPrior * base) / (static_cast<float>(v >> 8) + kOwnPrior));
      };
      if ((op >> 8) != 0) f[15] = log_ratio(own_rate(op, rp), rp);
      if ((ot >> 8) != 0) f[16] = log_ratio(own_rate(ot, rt), rt);
    }
  }
  float z = 0.0f;
  for (int i = 0; i < kFeatures; ++i) z += w_[i].load(std::memory_order_relaxed) * f[i];
  return sigmoid(z);
}

void RankModel::learn_one(const uint32_t* cells, bool ok, const float* f, const RankParams& p) {
  for (int k = 0; k < kNodeCells; ++k) {
    if (cells[k] == kNoCell) continue;  // an older delta's node: no source-pair cell
    std::atomic<uint32_t>& cell = cells_[cells[k]];
    const uint32_t v = cell.load(std::memory_order_relaxed);
    uint32_t t = tested_of(v) + 1, a = accepted_of(v) + (ok ? 1 : 0);
    if (t >= p.window) t /= 2, a /= 2;  // forget slowly: the workload may change
    cell.store(t << 16 | a, std::memory_order_relaxed);
  }
  // One step of the log loss' gradient at the current weights: w += lr (y - sigmoid(w . f)) f.
  float z = 0.0f;
  for (int i = 0; i < kFeatures; ++i) z += w_[i].load(std::memory_order_relaxed) * f[i];
  // AdaGrad: each weight's step shrinks with its gradients' summed squares (features differ in scale
  // and frequency; one rate for all of them either crawls or oscillates).
  const float err = (ok ? 1.0f : 0.0f) - sigmoid(z);
  for (int i = 0; i < kFeatures; ++i) {
    const float g = err * f[i];
    g2_[i] += static_cast<double>(g) * g;
    const float step = p.learning_rate * g / static_cast<float>(std::sqrt(g2_[i] + 1.0));
    w_[i].store(w_[i].load(std::memory_order_relaxed) + step, std::memory_order_relaxed);
  }
  tested_.fetch_add(1, std::memory_order_relaxed);
  if (ok) accepted_.fetch_add(1, std::memory_order_relaxed);
}

void RankModel::pair_step(const float* fa, const float* fr, const RankParams& p) {
  // One AdaGrad step of the pairwise log loss -log sigmoid(w . (f_a - f_r)): the accepted sibling
  // should score above the rejected one. Features equal among siblings (bias, depth, request) cancel.
  float d[kFeatures], z = 0.0f;
  for (int i = 0; i < kFeatures; ++i) d[i] = fa[i] - fr[i], z += w_[i].load(std::memory_order_relaxed) * d[i];
  const float err = 1.0f - sigmoid(z);
  for (int i = 0; i < kFeatures; ++i) {
    const float g = err * d[i];
    g2_[i] += static_cast<double>(g) * g;
    const float step = p.pair_rate * g / static_cast<float>(std::sqrt(g2_[i] + 1.0));
    w_[i].store(w_[i].load(std::memory_order_relaxed) + step, std::memory_order_relaxed);
  }
}

void RankModel::apply_words(const int32_t* words, size_t n, const RankParams& p) {
  // Group by group (a node without kSiblingFlag starts one): each node's log-loss step, then the
  // group's pairwise steps, so the order of the updates is a function of the words alone.
  const size_t nodes = n / kDeltaWords;
  thread_local std::vector<float> f;  // the features, bit-cast back to floats
  f.resize(nodes * kFeatures);
  for (size_t i = 0; i < nodes; ++i)
    std::memcpy(&f[i * kFeatures], &words[i * kDeltaWords + kNodeCells + 1], sizeof(float) * kFeatures);
  auto feats = [&](size_t i) { return &f[i * kFeatures]; };
  auto accepted = [&](size_t i) { return (words[i * kDeltaWords + kNodeCells] & 1) != 0; };
  for (size_t s = 0; s < nodes;) {
    size_t e = s + 1;
    while (e < nodes && (words[e * kDeltaWords + kNodeCells] & kSiblingFlag)) ++e;
    for (size_t i = s; i < e; ++i) {
      uint32_t cells[kNodeCells];
      for (int k = 0; k < kNodeCells; ++k) cells[k] = static_cast<uint32_t>(words[i * kDeltaWords + k]);
      learn_one(cells, accepted(i), feats(i), p);
    }
    if (p.pair_rate > 0.0f)
      for (size_t a = s; a < e; ++a)
        if (accepted(a))
          for (size_t r = s; r < e; ++r)
            if (!accepted(r)) pair_step(feats(a), feats(r), p);
    s = e;
  }
}

void RankModel::observe(DraftRecord& rec, const int32_t* committed, size_t n, const RankParams& p) {
  if (!rec.armed || !rec.ranked) return;
  const size_t m = rec.tokens.size();
  if (m == 0 || n == 0) return;
  const std::vector<int8_t>& ok = draft_outcomes(rec, committed, n);
  // The labelled nodes: the drafted ones the commit tested, and the left-out ones under an accepted
  // parent (or the root) within the commit's depth, labelled by the committed token at their depth.
  // Index i < m: drafted node i; i >= m: left-out node i - m. Grouped by parent for the pairwise steps.
  thread_local std::vector<int32_t> depth;
  thread_local std::vector<std::pair<int32_t, int32_t>> labelled;  // (parent, index)
  thread_local std::vector<int8_t> label;
  depth.resize(m);
  labelled.clear();
  float acc = 0.0f, expected = 0.0f;
  for (size_t i = 0; i < m; ++i) {
    depth[i] = rec.parents[i] < 0 ? 1 : depth[rec.parents[i]] + 1;
    if (ok[i] < 0) continue;
    acc += ok[i], expected += rec.q[i];
    if (rec.rank_cells[kNodeCells * i] == kNoCell) continue;  // deeper than the model ranks (RankParams::max_depth)
    labelled.emplace_back(rec.parents[i], static_cast<int32_t>(i));
  }
  const size_t mo = rec.out_tokens.size();
  label.assign(mo, -1);
  for (size_t j = 0; j < mo; ++j) {
    const int32_t par = rec.out_parents[j];
    const size_t d = par < 0 ? 1 : static_cast<size_t>(depth[par]) + 1;
    if ((par >= 0 && ok[par] != 1) || d > n || rec.out_cells[kNodeCells * j] == kNoCell) continue;
    label[j] = rec.out_tokens[j] == committed[d - 1] ? 1 : 0;
    labelled.emplace_back(par, static_cast<int32_t>(m + j));
  }
  std::stable_sort(labelled.begin(), labelled.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  thread_local std::vector<int32_t> words;
  words.clear();
  for (size_t k = 0; k < labelled.size(); ++k) {
    const size_t i = static_cast<size_t>(labelled[k].second);
    const bool drafted = i < m;
    const uint32_t* cells = drafted ? &rec.rank_cells[kNodeCells * i] : &rec.out_cells[kNodeCells * (i - m)];
    const float* f = drafted ? &rec.feats[kFeatures * i] : &rec.out_feats[kFeatures * (i - m)];
    const int32_t sibling = k > 0 && labelled[k - 1].first == labelled[k].first ? kSiblingFlag : 0;
    for (int c = 0; c < kNodeCells; ++c) words.push_back(static_cast<int32_t>(cells[c]));
    words.push_back((drafted ? ok[i] : label[i - m]) | sibling);
    for (int c = 0; c < kFeatures; ++c) {
      int32_t word;
      std::memcpy(&word, &f[c], 4);
      words.push_back(word);
    }
  }
  std::lock_guard<std::mutex> g(mu_);
  if (p.learn) {
    apply_words(words.data(), words.size(), p);  // what a replica would apply from the exported delta
  } else {
    for (size_t i = 0; i < words.size(); i += kDeltaWords) {
      if (queue_.size() + kDeltaWords > kMaxDelta * kDeltaWords) {  // nobody exports: keep the newest
        queue_.erase(queue_.begin(), queue_.begin() + static_cast<std::ptrdiff_t>(queue_.size() / 2));
        dropped_.fetch_add(kMaxDelta / 2, std::memory_order_relaxed);
      }
      queue_.insert(queue_.end(), words.begin() + static_cast<std::ptrdiff_t>(i),
                    words.begin() + static_cast<std::ptrdiff_t>(i + kDeltaWords));
    }
  }
  // The request's own cells learn from every labelled node, this engine's own decision alone (not
  // replicated: the request lives here).
  if (rec.own_cells.empty()) rec.own_cells.assign(RequestCells::kCells, 0);
  auto bump = [&](uint32_t cell, bool yes) {
    uint32_t t = (rec.own_cells[cell] >> 8) + 1, a = (rec.own_cells[cell] & 0xffu) + (yes ? 1 : 0);
    if (t >= RequestCells::kWindow) t /= 2, a /= 2;
    rec.own_cells[cell] = static_cast<uint16_t>(t << 8 | a);
  };
  auto learn_own = [&](int32_t parent, int32_t token, bool yes) {
    const int32_t pt = parent < 0 ? rec.root_token : rec.tokens[static_cast<size_t>(parent)];
    if (pt >= 0) bump(RequestCells::pair(pt, token), yes);
    bump(RequestCells::token(token), yes);
  };
  for (size_t i = 0; i < m; ++i)
    if (ok[i] >= 0) learn_own(rec.parents[i], rec.tokens[i], ok[i] == 1);
  for (size_t j = 0; j < mo; ++j)
    if (label[j] >= 0) learn_own(rec.out_parents[j], rec.out_tokens[j], label[j] == 1);
  rec.req_accepted = rec.req_accepted * p.request_decay + acc;
  rec.req_expected = rec.req_expected * p.request_decay + expected;
}

std::vector<int32_t> RankModel::export_delta() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int32_t> out;
  out.swap(queue_);
  return out;
}

size_t RankModel::queued() const {
  std::lock_guard<std::mutex> g(mu_);
  return queue_.size() / kDeltaWords;
}

void RankModel::apply_delta(const int32_t* words, size_t n, const RankParams& p, size_t node_words) {
  if (node_words != kDeltaWords && node_words != kDeltaWordsV1)
    throw std::invalid_argument("rank delta: " + std::to_string(node_words) + " words per node, expected " +
                                std::to_string(kDeltaWords) + " (or " + std::to_string(kDeltaWordsV1) +
                                ", the older layout)");
  if (n % node_words != 0)
    throw std::invalid_argument("rank delta: " + std::to_string(n) + " words is not a multiple of " +
                                std::to_string(node_words));
  const bool v1 = node_words == kDeltaWordsV1;
  const int cells = v1 ? kNodeCellsV1 : kNodeCells, features = v1 ? kFeaturesV1 : kFeatures;
  const int max_cell = v1 ? kCellsV1 : kCells;  // the older cells keep their indices
  // Everything is checked before anything is applied: a refused delta changes nothing.
  for (size_t i = 0; i < n; i += node_words) {
    for (int k = 0; k < cells; ++k)
      if (words[i + k] < 0 || words[i + k] >= max_cell)
        throw std::invalid_argument("rank delta: cell " + std::to_string(words[i + k]) + " out of range");
    if (words[i + cells] < 0 || words[i + cells] > (1 | kSiblingFlag))
      throw std::invalid_argument("rank delta: flag word " + std::to_string(words[i + cells]) + " not in [0, 3]");
    for (int k = 0; k < features; ++k) {
      float v;
      std::memcpy(&v, &words[i + cells + 1 + k], 4);
      if (!std::isfinite(v) || std::fabs(v) > 1e3f) throw std::invalid_argument("rank delta: feature not finite");
    }
  }
  if (!v1) {
    std::lock_guard<std::mutex> g(mu_);
    apply_words(words, n, p);
    return;
  }
  // The older layout in today's: no source-pair cell (kNoCell), the new features 0 (no evidence).
  std::vector<int32_t> wide;
  wide.reserve(n / kDeltaWordsV1 * kDeltaWords);
  for (size_t i = 0; i < n; i += kDeltaWordsV1) {
    wide.insert(wide.end(), words + i, words + i + kNodeCellsV1);
    wide.push_back(static_cast<int32_t>(kNoCell));
    wide.insert(wide.end(), words + i + kNodeCellsV1, words + i + kDeltaWordsV1);  // the flag, 14 features
    wide.insert(wide.end(), kFeatures - kFeaturesV1, 0);  // bit pattern of 0.0f
  }
  std::lock_guard<std::mutex> g(mu_);
  apply_words(wide.data(), wide.size(), p);
}

void RankModel::save(ByteWriter& w) const {
  std::vector<uint32_t> cells(kCells);
  for (int i = 0; i < kCells; ++i) cells[i] = cells_[i].load(std::memory_order_relaxed);
  std::vector<float> weights(kFeatures);
  for (int i = 0; i < kFeatures; ++i) weights[i] = w_[i].load(std::memory_order_relaxed);
  std::vector<double> g2(g2_, g2_ + kFeatures);  // AdaGrad's sums: a loaded model takes the same steps
  w.put_vec(cells);
  w.put_vec(weights);
  w.put_vec(g2);
  w.put<uint64_t>(tested_.load());
  w.put<uint64_t>(accepted_.load());
}

void RankModel::load(ByteReader& r) {
  auto cells = r.get_vec<uint32_t>();
  auto weights = r.get_vec<float>();
  auto g2 = r.get_vec<double>();
  const uint64_t tested = r.get<uint64_t>(), accepted = r.get<uint64_t>();
  // Tables of the older layout (format 3: no source-pair table, 14 weights) load with those empty.
  const bool v1 = cells.size() == static_cast<size_t>(kCellsV1) && weights.size() == static_cast<size_t>(kFeaturesV1) &&
                  g2.size() == static_cast<size_t>(kFeaturesV1);
  if (!v1 && (cells.size() != static_cast<size_t>(kCells) || weights.size() != static_cast<size_t>(kFeatures) ||
              g2.size() != static_cast<size_t>(kFeatures)))
    throw CorruptSnapshot("corrupt snapshot: rank model tables of another shape");
  if (v1) {
    cells.resize(kCells, 0u);
    for (int i = kFeaturesV1; i < kFeatures; ++i) weights.push_back(kInitialWeights[i]), g2.push_back(0.0);
  }
  for (float v : weights)
    if (!std::isfinite(v)) throw CorruptSnapshot("corrupt snapshot: rank model weight not finite");
  for (double v : g2)
    if (!(v >= 0.0) || !std::isfinite(v)) throw CorruptSnapshot("corrupt snapshot: rank model step sums not finite");
  for (uint32_t v : cells)
    if (accepted_of(v) > tested_of(v)) throw CorruptSnapshot("corrupt snapshot: rank model cell accepts more than it tested");
  std::lock_guard<std::mutex> g(mu_);
  for (int i = 0; i < kCells; ++i) cells_[i].store(cells[i], std::memory_order_relaxed);
  for (int i = 0; i < kFeatures; ++i) w_[i].store(weights[i], std::memory_order_relaxed), g2_[i] = g2[i];
  tested_ = tested, accepted_ = accepted;
  queue_.clear();
}

void RankModel::copy_from(RankModel& other) {
  std::scoped_lock g(mu_, other.mu_);
  for (int i = 0; i < kCells; ++i) cells_[i].store(other.cells_[i].load(std::memory_order_relaxed), std::memory_order_relaxed);
  for (int i = 0; i < kFeatures; ++i)
    w_[i].store(other.w_[i].load(std::memory_order_relaxed), std::memory_order_relaxed), g2_[i] = other.g2_[i];
  tested_ = other.tested_.load(), accepted_ = other.accepted_.load();
  queue_.clear();
}

std::pair<uint64_t, uint64_t> RankModel::totals() const { return {tested_.load(), accepted_.load()}; }

std::vector<float> RankModel::weights() const {
  std::vector<float> out(kFeatures);
  for (int i = 0; i < kFeatures; ++i) out[i] = w_[i].load(std::memory_order_relaxed);
  return out;
}

}  // namespace ngc
