// A batch's draft rows turned into the verifier's step plan: the host work between a batch's drafts
// and its verify step, in one pass over the rows (verifier/step/tree_batch.py holds the numpy
// reference of each function; binding.cc exposes them as verifier.step._native, which the engine's
// Engine._plan calls for every verify step).
//
// A batch of drafts is [n, W] padded rows, as the corpus returns them: row i holds counts[i] nodes
// (tokens, parents: -1 = a child of the root, probs: path probabilities; padding has probability 0).
// The verify step takes K = 1 + nodes per request: node 0 is the root (the request's last token),
// draft node j is node j + 1, padding nodes repeat the root and are isolated (parent -1). At batch 1
// the numpy form of this work is some 25 calls of a few microseconds each, more than the work itself.
#pragma once

#include <cstdint>
#include <vector>

namespace vstep {

// A read-only view of [n, width] padded draft rows (tokens and parents may be null where only the
// probabilities are read).
struct DraftRows {
  const int32_t* tokens;
  const int32_t* parents;
  const float* probs;
  const int32_t* counts;
  int64_t n, width;
};

// What the node choice needs: the widest row's node count (at most width), whether every row's
// probabilities are non-increasing over the whole width (the corpus ranks its trees best-first),
// and, per column j below that count, the sum over rows of each row's j-th largest probability
// (padding counts 0; for best-first rows, simply column j).
struct RowsSummary {
  int32_t nodes = 0;
  bool best_first = true;
  std::vector<double> column_sums;
};
RowsSummary summarize_rows(const DraftRows& rows);

// Where the step's padding goes: rows past n (a graph's batch bucket) are isolated nodes at
// position 0 of cache slot `scratch_slot`, which no request owns.
struct PlanShape {
  int k;               // draft nodes kept per row (0..width)
  int k_min;           // the step's K at least this (a graph's node bucket)
  int64_t rows;        // the step's rows R >= n
  int64_t scratch_slot;
};

// Keeps each row's k most probable nodes as a valid tree (the rows' order; ties keep their order):
// best-first rows keep their first k; otherwise the k largest by a stable sort, and a row whose
// chosen nodes leave a parent out keeps its first k nodes instead (parents precede children).
// Then packs the step plan for shape.rows rows: `host` = tokens [R, K], parents [R, K] (node indices,
// -1 = the root or isolated), prefix lens [R], cache slots [R]; K = max(k_min, 1 + the longest kept
// row) (plan_width); `host` must hold 2 R K + 2 R values. `num_nodes[i]` = 1 + row i's kept nodes;
// returns the kept nodes' probability sum.
int plan_width(const DraftRows& rows, int k, int k_min);
double pack_plan(const DraftRows& rows, const PlanShape& shape, bool best_first, const int64_t* last_tokens,
                 const int64_t* prefix_lens, const int64_t* slots, int64_t* host, std::vector<int32_t>& num_nodes);

}  // namespace vstep
