// AcceptanceModel: calibrates the draft tree's estimate of P(child accepted | parent accepted)
// online, from what the verifier commits after each draft.
//
// The raw estimate q = vote(c) / (mass(u) + lambda) of draft_tree.h ranks candidates within one
// tree but is not a probability: how often a node with a given q is accepted depends on its depth
// and on the token itself (some tokens are where outputs diverge, some always follow), in ways no
// fixed exponent captures. Each draft is remembered per request (DraftRecord); the next commit tells
// which of its nodes were tested (the parent was accepted and the commit reached that depth) and
// which of those were accepted. Counts per cell give the calibrated estimate, each level shrunk
// towards the one before, so an empty table reproduces q:
//     depth = (A + k q) / (T + k)            cell (q bin, depth)
//     token = (A + k2 depth) / (T + k2)      cell (coarse q bin, hashed token id)
// (A accepted, T tested, k = prior, k2 = token_prior).
//
// Measured (docs/benchmarks.md): the calibrated estimates match the observed acceptance rates; MAT
// gains come from the token level (0.3-1.2% on the dev traces). Finer cells (dominant source, match
// length) and a per-request source factor reordered almost nothing and were not kept.
//
// Threads: drafts read cells with relaxed atomic loads; commits update them under one mutex (a few
// adds per commit), so a cell's two counts are always read as one consistent 32-bit word.
// Determinism: the same sequence of calls gives the same drafts. Memory: a fixed 256 KB table per
// corpus and at most one draft's nodes per request.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace ngc {

struct FeedbackParams {
  bool enabled = false;         // calibrate from commits (kScore only); false: the raw estimate q
  float prior = 32.0f;          // pseudo-observations of q in each (q, depth) cell
  float token_prior = 16.0f;    // pseudo-observations of the (q, depth) estimate per token cell (0: no token level)
  uint32_t window = 1u << 15;   // a cell's counts are halved when its tests reach this (<= 2^15)
};

// A request's latest draft, kept until the next commit shows which of its nodes were accepted.
struct DraftRecord {
  std::vector<int32_t> tokens, parents;  // the drafted tree (parents before children)
  std::vector<uint16_t> depth_cell;      // each node's (q, depth) cell (with an AcceptanceModel only)
  std::vector<uint32_t> token_cell;      // ... and its token cell (AcceptanceModel::kNoCell: none)
  std::vector<float> q;                  // each node's conditional estimate P(node | parent)
  std::vector<uint8_t> cls;              // ... and the source class of its heaviest vote (prompt_history.h)
  bool cells = false;                    // depth_cell/token_cell were filled (feedback on)
  bool armed = false;                    // a draft is waiting for its commit
  // With a RankModel (rank_model.h): each node's features and cells, and the request's decayed sums
  // of accepted and expected tested nodes (kept across drafts; reset() clears them).
  std::vector<float> feats;              // RankModel::kFeatures per node
  std::vector<uint32_t> rank_cells;      // RankModel::kNodeCells per node
  bool ranked = false;                   // feats/rank_cells were filled (rank model on)
  // The best nodes the draft left out (RankParams::left_out), best first: token, parent (an index into
  // tokens; -1 the root), features and cells. The commit labels those under an accepted parent.
  std::vector<int32_t> out_tokens, out_parents;
  std::vector<float> out_feats;
  std::vector<uint32_t> out_cells;
  float req_accepted = 0.0f, req_expected = 0.0f;
  // The request's own cells (rank_model.h RequestCells: tested in the high byte, accepted in the low;
  // empty until its first scored draft) and the context's last token when it drafted (the parent of
  // its depth-1 nodes).
  std::vector<uint16_t> own_cells;
  int32_t root_token = -1;

  void start_draft();  // empties the node lists and arms the record
  void reset();        // disarms it too (a new request)
};

// What a commit says of each node of a draft: -1 not tested, 0 tested and rejected, 1 accepted. Node
// i (depth d) was tested iff its parent was accepted (or is the root) and the commit reached depth d;
// it was accepted iff it also equals the d-th committed token. Parents precede children. The result
// is this thread's scratch, valid until the next call on the thread.
inline const std::vector<int8_t>& draft_outcomes(const DraftRecord& rec, const int32_t* committed, size_t n) {
  thread_local std::vector<int32_t> depth;
  thread_local std::vector<int8_t> out;
  const size_t m = rec.tokens.size();
  depth.resize(m), out.resize(m);
  for (size_t i = 0; i < m; ++i) {
    const int32_t par = rec.parents[i];
    depth[i] = par < 0 ? 1 : depth[par] + 1;
    out[i] = -1;
    if ((par < 0 || out[par] == 1) && static_cast<size_t>(depth[i]) <= n)
      out[i] = rec.tokens[i] == committed[depth[i] - 1] ? 1 : 0;
  }
  return out;
}

class AcceptanceModel {
 public:
  AcceptanceModel();
  // Calibrated P(child accepted | parent accepted) for raw estimate q of a child at `depth` drafting
  // `token`; writes the cells it read.
  float conditional(float q, int depth, int32_t token, const FeedbackParams& p, uint16_t* depth_cell,
                    uint32_t* token_cell) const;
  // Scores an armed record against the committed tokens that followed it, updates the cells and
  // disarms the record.
  void observe(DraftRecord& rec, const int32_t* committed, size_t n, const FeedbackParams& p);
  void clear();
  // (tested, accepted) summed over the (q, depth) cells: for stats and tests.
  std::pair<uint64_t, uint64_t> totals() const;

  static constexpr int kQBins = 12, kDepthBins = 8;
  static constexpr int kDepthCells = kQBins * kDepthBins;
  static constexpr int kTokenQBins = 4, kTokenBits = 14;  // 64k cells
  static constexpr int kTokenCells = kTokenQBins << kTokenBits;
  static constexpr uint32_t kNoCell = 0xffffffffu;

 private:
  // One word per cell: tested in the high 16 bits, accepted in the low 16 (window <= 2^15).
  std::unique_ptr<std::atomic<uint32_t>[]> depth_, token_;
  std::mutex mu_;
  void bump(std::atomic<uint32_t>& cell, bool accepted, uint32_t window);
};

}  // namespace ngc
