// Merging a fresh draft tree with one drafted earlier for the same request (the remote corpus'
// tree, asked for one or more steps ahead so the verifier never waits for it).
//
// The earlier tree was drafted from an older context: it is first re-rooted along the tokens
// committed since (the subtree under that path, its path probabilities divided by the path's,
// capped at 1), then united with the fresh tree (a path in both keeps the larger probability), and
// the `budget` most probable nodes are kept. Path probabilities never grow along a path in either
// tree, so the most probable nodes form a connected tree (ties go to the shallower node).
#pragma once

#include <cstdint>
#include <vector>

#include "tree_rows.h"

namespace ngc {

// One request's tree: n nodes, parent indices (-1: a child of the root) before children.
struct TreeView {
  const int32_t* tokens;
  const int32_t* parents;
  const float* probs;
  int n;
};

// Appends the merged tree of at most `budget` nodes (best first, parents before children) to the outputs and
// returns its size. `since` are the tokens committed after `earlier` was drafted (none: it was
// drafted from the current context). A re-rooting path the earlier tree does not contain leaves
// the fresh tree alone. `earlier_only` (if given) gets bit k set where merged node k < 64 is in the
// earlier tree alone: what the earlier tree added (the verifier attributes accepted tokens with it).
int merge_with_earlier(const TreeView& fresh, const TreeView& earlier, const int32_t* since, int n_since,
                       int budget, std::vector<int32_t>& tokens, std::vector<int32_t>& parents,
                       std::vector<float>& probs, uint64_t* earlier_only = nullptr);

// How many nodes of `tree` on the walk from its root along path[0 .. n) (until a token has no
// node) have their bit set in `marked` (node k < 64 is bit k): with merge_with_earlier's
// earlier_only and a request's accepted tokens, the accepted tokens only the earlier tree drafted.
int marked_on_path(const TreeView& tree, uint64_t marked, const int32_t* path, int n);

// Row by row over [n, width] padded batches (tree_rows.h; the same n): row i of `fresh` merged with
// row i of `earlier` re-rooted along since[off[i] .. off[i + 1]), into [n, budget] padded outputs
// (tokens and parents -1, probs 0 past each row's count), with each row's earlier_only mask.
void merge_rows(const TreeRows& fresh, const TreeRows& earlier, const int32_t* since, const int64_t* off,
                int budget, std::vector<int32_t>& tokens, std::vector<int32_t>& parents, std::vector<float>& probs,
                std::vector<int32_t>& counts, std::vector<uint64_t>& earlier_only);

}  // namespace ngc
