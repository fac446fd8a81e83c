// RankModel: an online acceptance model that ranks draft nodes by what verifiers accepted.
//
// The tree's estimate q = vote / (mass + lambda) (draft_tree.h) and its (q, depth) calibration
// (acceptance_model.h) are monotone in q within a cell, so they barely reorder nodes. What tells the
// right sibling from the wrong one is how often a token, and a (parent token, token) step, was
// accepted when drafted before, how this request's drafts fared lately, and which source votes for it.
// The model combines them in a logistic regression learned online from every commit:
//     P(child accepted | parent accepted) = sigmoid(w . f)
//     f = [1, logit q, logit c, logit t - logit c, logit p - logit c, logit g - logit c, request,
//          q_own, q_shared, depth / 8, dominance, log2(1 + siblings) / 4, latest learned, latest own,
//          logit s - logit c, logit p' - logit p, logit t' - logit t]
//   c = (A + k q) / (T + k)          the (q bin, depth) cell's calibrated rate
//   t = (A + k_t c) / (T + k_t)      the hashed (coarse q bin, token) cell, shrunk towards c (0 without evidence)
//   p = (A + k_p c) / (T + k_p)      the hashed (parent token, token) cell, likewise
//   g = (A + k_p c) / (T + k_p)      the hashed (grandparent, parent, token) cell, likewise
//   s = (A + k_p c) / (T + k_p)      the hashed (source, coarse q bin, parent token, token) cell, likewise:
//                                    a step is not one number for the request's own context and the
//                                    learned corpus, nor for its confident and its doubtful drafts
//   p', t'                           the request's own (parent token, token) and token cells (RequestCells),
//                                    shrunk towards p and t (k = 4): what this request accepted lately
//   request = log((a + 1) / (e + 1)) the request's recent accepted over expected tested nodes (decayed)
//   q_own, q_shared                  the estimate from the request's own context and from the others
//   dominance                        the heaviest single vote for the child over all its votes
//   latest learned, latest own       1 if the child continues the most recent learned-corpus (own-context)
//                                    occurrence among its siblings' (prompt lookup drafts the latest)
// (A accepted, T tested in the cell). w starts at [0, 0, 1, 1, 1, 1, 0, ...]: the calibrated estimate
// with its token, pair and triple levels; each tested node then takes one AdaGrad step of the log loss.
// What it learns from: the drafted nodes a commit tested, and the best nodes the budget left out
// (RankParams::left_out) whose parent was accepted: the commit labels them as well (the committed token
// at their depth), and they are where the budget cut, which the drafted nodes alone never show. Each
// accepted node then takes a pairwise step against each rejected sibling, drafted or left out,
//     w += rate (1 - sigmoid(w . (f_a - f_r))) (f_a - f_r)        (AdaGrad, as above)
// which moves only the order of siblings, where the decision is (the log loss also rewards features
// on nodes that never decide a tree). Both together: +0.3% / +0.8% MAT at B = 7 on the dev traces.
// Measured (docs/ranking.md): +1.3-2.7% MAT on the dev traces at B = 7 and 15, about twice what the
// (q, depth) and token calibration alone gains; a wider candidate search under it gained nothing. The
// tree's estimates it reads use their own prior mass (RankParams::tree_lambda, 24 against today's 16).
// The tree takes nodes best-first by the product of these along the path (a product of numbers <= 1:
// the path probability never grows with depth, so best-first yields the top connected tree), over
// every node its candidates hold, a far wider pool than the budget it keeps. Only the first
// RankParams::max_depth levels (3) are ranked and learned from: a prediction is most of the model's
// draft cost, and the first levels hold most of its gain (85-115% of the every-level model's on the dev
// and t07x4 traces at about 0.63x its extra draft time; docs/ranking.md).
//
// State: fixed tables (96 + 4 x 2^16 cells of 4 bytes, 1.05 MB) and 17 weights per corpus; per request
// one draft's nodes and features (DraftRecord), two decayed sums and its own cells (RequestCells, 2 KB). Threads: drafts read cells and weights with
// relaxed atomic loads; commits update them under one mutex. Determinism: the same sequence of calls
// gives the same drafts (the updates are a function of the calls alone). Replicas: export_delta()
// hands out what this engine observed since the last call, apply_delta() adds one (any replica's)
// to the tables, so replicas that apply the same deltas in the same order hold the same model; an
// engine that learns locally applies the same words it would export, so both learn alike.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "acceptance_model.h"

namespace ngc {

class ByteWriter;
class ByteReader;

struct RankParams {
  bool enabled = false;          // rank by the model (kScore only); false: today's ranking, untouched
  float prior = 32.0f;           // pseudo-observations of q per (q, depth) cell
  float token_prior = 16.0f;     // pseudo-observations of the cell estimate per token cell
  float pair_prior = 8.0f;       // ... per (parent token, token) cell
  float learning_rate = 0.1f;    // of the weights' AdaGrad steps
  float request_decay = 0.9f;    // per step, of the request's accepted and expected sums
  uint32_t window = 1u << 15;    // a cell's counts are halved when its tests reach this (<= 2^15)
  bool learn = true;             // learn from this engine's commits (false: only from apply_delta)
  int left_out = 16;             // the best nodes a draft left out that its commit labels (0: none, <= 256)
  float pair_rate = 0.3f;        // of the pairwise steps between accepted and rejected siblings (0: none)
  float tree_lambda = 24.0f;     // the tree's lambda when the model ranks (ScoreParams::lambda otherwise)
  int max_depth = 3;             // the model ranks nodes up to this depth (0: every depth); deeper nodes rank
                                 // as without it and are not learned from (docs/ranking.md: the first
                                 // levels hold most of its gain, and each ranked node costs a prediction)
};

// A request's own acceptance of (parent token, token) steps and of tokens: kCells hashed cells of
// 8-bit tested and accepted counts, halved when the tests reach kWindow (recent drafts weigh most).
// The shared cells mix every request's drafts; these tell what this request accepts, e.g. the phrases
// a summary copies from its own prompt. Not replicated: a request lives on one engine (the features
// it gives are in the deltas, like the request feature).
struct RequestCells {
  static constexpr int kBits = 9;
  static constexpr uint32_t kCells = 2u << kBits;  // pairs, then tokens
  static constexpr uint32_t kWindow = 64;
  static uint32_t pair(int32_t parent, int32_t token) {
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
    return static_cast<uint32_t>((key * 0x9E3779B97F4A7C15ull) >> (64 - kBits));
  }
  static uint32_t token(int32_t token) {
    return (1u << kBits) + ((static_cast<uint32_t>(token) * 2654435761u) >> (32 - kBits));
  }
};

// What the tree knows about one child when it ranks it.
struct RankInputs {
  float q;                // the tree's estimate P(child | parent)
  float q_own, q_shared;  // ... from the request's own context alone, and from the other sources
  int depth;              // 1 = a child of the root
  int32_t parent_token;   // the parent's token (the context's last token for depth 1; -1 none)
  int32_t grand_token;    // the grandparent's token, likewise (-1 none)
  int32_t token;
  float dominance;        // the heaviest single vote for the child over all its votes
  int siblings;           // children of the parent, the child included
  bool latest;            // the child continues the most recent learned-corpus occurrence among its siblings' ...
  bool latest_own;        // ... the most recent own-context occurrence (prompt lookup's pick)
  uint8_t cls;            // the source class of its heaviest vote (prompt_history.h)
};

class RankModel {
 public:
  static constexpr int kFeatures = 17;
  static constexpr int kNodeCells = 5;  // (q, depth), token, pair, triple, source pair
  static constexpr int kQBins = 12, kDepthBins = 8, kDepthCells = kQBins * kDepthBins;
  static constexpr int kTokenBits = 16, kPairBits = 16, kTripleBits = 16, kSourcePairBits = 16;
  static constexpr int kCells =
      kDepthCells + (1 << kTokenBits) + (1 << kPairBits) + (1 << kTripleBits) + (1 << kSourcePairBits);
  static constexpr float kInitialWeights[kFeatures] = {0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  // The layout before the source-pair cell and the request's own cells (written before 2026-12-03):
  // 14 features, 4 cells; its snapshots and deltas still load (the new cell and features empty).
  static constexpr int kFeaturesV1 = 14, kNodeCellsV1 = 4;
  static constexpr int kCellsV1 = kDepthCells + (1 << kTokenBits) + (1 << kPairBits) + (1 << kTripleBits);

  RankModel();
  // P(child accepted | parent accepted); writes its features (kFeatures) and its kNodeCells cells.
  // `own`: the request's RequestCells (null: none yet).
  float predict(const RankInputs& in, float request_feature, const uint16_t* own, const RankParams& p, float* feats,
                uint32_t* cells) const;
  // The request feature from a record's decayed sums.
  static float request_feature(const DraftRecord& rec);
  // Scores an armed record (ranked: feats and rank_cells filled) against the committed tokens that
  // followed it: updates the record's request sums and own cells and, with p.learn, the cells and the
  // weights, and queues the same updates for export_delta(). Does not disarm the record.
  void observe(DraftRecord& rec, const int32_t* committed, size_t n, const RankParams& p);
  // Observations since the last call: per labelled node its cells, a flag word and its features
  // (kFeatures floats), flattened as int32 words (floats bit-cast). The flag: bit 0 accepted, bit 1
  // (kSiblingFlag) the node is a sibling of the one before it (same draft, same parent), so a delta
  // carries the sibling groups the pairwise steps need; deltas without bit 1 learn as before. At
  // most kMaxDelta nodes are queued; beyond that the oldest half is dropped (counted in dropped()).
  std::vector<int32_t> export_delta();
  // Applies a delta (any replica's export_delta) as if its nodes were observed here. `node_words`:
  // its words per node, kDeltaWords or kDeltaWordsV1 (a delta of the older layout: its nodes learn
  // without the source-pair cell, their new features 0).
  void apply_delta(const int32_t* words, size_t n, const RankParams& p, size_t node_words = kDeltaWords);
  void clear();
  void save(ByteWriter& w) const;  // caller holds lock() or no other thread runs
  void load(ByteReader& r);         // into a fresh model: checked before it is installed (copy_from);
                                    // tables of the older layout (kCellsV1, kFeaturesV1) load too
  void copy_from(RankModel& other);  // this model becomes other's (tables, weights, totals)
  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }
  std::pair<uint64_t, uint64_t> totals() const;  // (tested, accepted) nodes learned from
  std::vector<float> weights() const;
  uint64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  size_t queued() const;

  static constexpr size_t kDeltaWords = kNodeCells + 1 + kFeatures;  // cells, flag, features
  static constexpr size_t kDeltaWordsV1 = kNodeCellsV1 + 1 + kFeaturesV1;
  static constexpr uint32_t kNoCell = 0xffffffffu;  // an older delta's node has no source-pair cell
  static constexpr int32_t kSiblingFlag = 2;
  static constexpr size_t kMaxDelta = 1 << 16;          // queued nodes at most (6 MB)

 private:
  // One word per cell: tested in the high 16 bits, accepted in the low 16 (window <= 2^15).
  std::unique_ptr<std::atomic<uint32_t>[]> cells_;
  std::atomic<float> w_[kFeatures];
  double g2_[kFeatures];  // AdaGrad: summed squared gradients per weight (under mu_)
  std::atomic<uint64_t> tested_{0}, accepted_{0}, dropped_{0};
  mutable std::mutex mu_;
  std::vector<int32_t> queue_;  // export_delta's pending words (under mu_)
  void learn_one(const uint32_t* cells, bool accepted, const float* feats, const RankParams& p);  // under mu_
  void pair_step(const float* accepted, const float* rejected, const RankParams& p);               // under mu_
  void apply_words(const int32_t* words, size_t n, const RankParams& p);  // checked words, under mu_
};

}  // namespace ngc
