// A batch of draft trees as [n, width] padded rows, the layout of the engine's batch drafts
// (DraftOutput) and of the earlier trees a merge re-roots (tree_merge.h): row i holds counts[i]
// nodes (tokens, parents: -1 = a child of the root, probs: path probabilities); padding has
// probability 0.
#pragma once

#include <cstdint>

namespace ngc {

struct TreeRows {
  const int32_t* tokens;
  const int32_t* parents;
  const float* probs;
  const int32_t* counts;
  int64_t n, width;
};

}  // namespace ngc
