// AcceptanceModel: calibrates the draft tree's estimate of P(child accepted | parent accepted)
// online, from what the verifier commits after each draft.
//
// The raw estimate q = vote(c) / (mass(u) + lambda) of draft_tree.h ranks candidates within one
// tree well but is not a probability: how often a node with a given q is accepted depends on its
// depth, on which source votes for it and on how long its best match is, in ways no fixed exponent
// captures. Each draft is remembered per request (DraftRecord); the next commit tells which of its
// nodes were tested (the parent was accepted and the commit reached that depth) and which of those
// were accepted. Counts per feature cell then give the calibrated estimate, shrunk towards a coarser
// cell and that towards q, so an empty table reproduces q:
//     coarse = (A_c + k q) / (T_c + k),      fine = (A_f + k coarse) / (T_f + k)
// (A accepted, T tested, k = prior). Per request, the ratio of accepted to predicted tested nodes of
// each source learns whether this request copies from its own context or follows the corpora:
//     factor_s = (accepted_s + K) / (predicted_s + K)   (K = request_prior)
// and multiplies the calibrated estimate of nodes whose vote comes mostly from source s.
//
// Measured (docs/benchmarks.md): the calibrated estimates match the observed acceptance rates, but
// the drafts keep the same MAT as with q on the dev traces, so it is off by default; what it adds is
// path probabilities that are acceptance probabilities (min_prob, adaptive budgets).
//
// Threads: drafts read cells with relaxed atomic loads; commits update them under one mutex (a few
// adds per commit), so a cell's two counts are always read as one consistent 64-bit word.
// Determinism: the same sequence of calls gives the same drafts. Memory: a fixed table per corpus
// and at most one draft's nodes per request.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace ngc {

struct FeedbackParams {
  bool enabled = false;         // calibrate from commits (kScore only); false: the raw estimate q
  float prior = 32.0f;          // pseudo-observations of the coarser estimate in each cell
  float request_prior = 8.0f;   // pseudo-acceptances of a request's source factor (0: no factor)
  uint32_t window = 1u << 16;   // a cell's counts are halved when its tests reach this (adapts)
};

// Sources a node's vote can come mostly from.
enum : int { kSourceOwn = 0, kSourceLearned = 1, kSourceExternal = 2, kSources = 3 };

struct NodeFeatures {
  float q;     // raw conditional estimate vote(c) / (mass(u) + lambda), in [0, 1]
  int depth;   // depth of the child (1 = child of the root)
  int source;  // the source with the largest share of the child's vote
  int match;   // longest match length among the candidates through the child
};

// A request's latest draft, kept until the next commit shows which of its nodes were accepted.
struct DraftRecord {
  std::vector<int32_t> tokens, parents;  // the drafted tree (parents before children)
  std::vector<uint16_t> fine, coarse;    // calibration cells of each node
  std::vector<float> calibrated;         // each node's calibrated conditional (before the factor)
  std::vector<uint8_t> source;           // each node's dominant source
  bool armed = false;                    // a draft is waiting for its commit
  float predicted[kSources] = {};        // this request: calibrated estimates of its tested nodes
  float accepted[kSources] = {};         // ... and how many of them were accepted

  void start_draft();                    // empties the node lists (keeps the history)
  void reset();                          // forgets everything (a new request)
  // The request's multiplier for nodes of source s.
  float factor(int s, const FeedbackParams& p) const {
    return p.request_prior > 0.f ? (accepted[s] + p.request_prior) / (predicted[s] + p.request_prior) : 1.0f;
  }
};

class AcceptanceModel {
 public:
  AcceptanceModel();
  // Calibrated P(child accepted | parent accepted) for features f; writes the cells it read.
  float conditional(const NodeFeatures& f, const FeedbackParams& p, uint16_t* fine, uint16_t* coarse) const;
  // Scores an armed record against the committed tokens that followed it, updates the cells and
  // the record's per-source history, and disarms it.
  void observe(DraftRecord& rec, const int32_t* committed, size_t n, const FeedbackParams& p);
  void clear();
  // (tested, accepted) summed over all fine cells: for stats and tests.
  std::pair<uint64_t, uint64_t> totals() const;

  static constexpr int kQBins = 12, kDepthBins = 8, kMatchBins = 8;
  static constexpr int kCoarseCells = kQBins * kDepthBins;
  static constexpr int kFineCells = kCoarseCells * kSources * kMatchBins;

 private:
  // One word per cell: tested in the high 32 bits, accepted in the low 32.
  std::unique_ptr<std::atomic<uint64_t>[]> fine_, coarse_;
  std::mutex mu_;
  void bump(std::atomic<uint64_t>& cell, bool accepted, uint32_t window);
};

}  // namespace ngc
