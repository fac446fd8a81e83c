#include "tree_merge.h"

#include <algorithm>
#include <numeric>

namespace ngc {
namespace {

struct MergedNode {
  int32_t token;
  int32_t parent;  // merged index, -1: the root
  int32_t depth;
  float prob;
  bool fresh;  // in the fresh tree (else only in the earlier one)
};

// The merged node for (parent, token), created with probability 0 if absent. Trees are small
// (tens of nodes), so a scan beats any index.
int32_t child_of(std::vector<MergedNode>& nodes, int32_t parent, int32_t token) {
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (nodes[i].parent == parent && nodes[i].token == token) return static_cast<int32_t>(i);
  }
  const int32_t depth = parent < 0 ? 1 : nodes[parent].depth + 1;
  nodes.push_back({token, parent, depth, 0.f, false});
  return static_cast<int32_t>(nodes.size() - 1);
}

bool valid_parent(int32_t p, int i) { return p >= -1 && p < i; }

// The index of `tree`'s node for (parent, token), or -1: the step of a walk along committed or
// accepted tokens.
int32_t find_child(const TreeView& tree, int32_t parent, int32_t token) {
  for (int i = 0; i < tree.n; ++i)
    if (tree.parents[i] == parent && tree.tokens[i] == token) return i;
  return -1;
}

}  // namespace

int merge_with_earlier(const TreeView& fresh, const TreeView& earlier, const int32_t* since, int n_since,
                       int budget, std::vector<int32_t>& tokens, std::vector<int32_t>& parents,
                       std::vector<float>& probs, uint64_t* earlier_only) {
  // Scratch kept per thread: a batch merges a tree per request, several per step (no allocations).
  thread_local std::vector<MergedNode> nodes;
  thread_local std::vector<int32_t> map, order, chosen, out_index;
  thread_local std::vector<char> below, kept;
  nodes.clear();
  map.assign(static_cast<size_t>(std::max(fresh.n, earlier.n)), -1);
  for (int i = 0; i < fresh.n; ++i) {
    const int32_t p = fresh.parents[i];
    if (!valid_parent(p, i) || (p >= 0 && map[p] < 0)) continue;  // malformed: dropped with its subtree
    const int32_t m = child_of(nodes, p < 0 ? -1 : map[p], fresh.tokens[i]);
    nodes[m].prob = std::max(nodes[m].prob, fresh.probs[i]);
    nodes[m].fresh = true;
    map[i] = m;
  }
  // Re-root the earlier tree: follow the committed tokens from its root.
  int32_t at = -1;
  bool found = earlier.n > 0;
  for (int s = 0; s < n_since && found; ++s) {
    const int32_t next = find_child(earlier, at, since[s]);
    found = next >= 0;
    if (found) at = next;
  }
  if (found) {
    const float base = at < 0 ? 1.f : earlier.probs[at];
    std::fill(map.begin(), map.end(), -1);
    below.assign(static_cast<size_t>(earlier.n), 0);  // in the subtree under `at`
    for (int i = 0; i < earlier.n; ++i) {
      const int32_t p = earlier.parents[i];
      if (!valid_parent(p, i)) continue;
      if (p == at) {
        below[i] = 1;
      } else if (p >= 0 && below[p]) {
        below[i] = 1;
      } else {
        continue;
      }
      if (p != at && map[p] < 0) continue;
      const int32_t m = child_of(nodes, p == at ? -1 : map[p], earlier.tokens[i]);
      const float q = base > 0.f ? std::min(1.f, earlier.probs[i] / base) : 0.f;
      nodes[m].prob = std::max(nodes[m].prob, q);
      map[i] = m;
    }
  }
  // The budget most probable nodes, written out best first (shallower first on ties): path
  // probabilities never grow along a path, so a parent is never after its child, and the row is
  // ranked as the corpus ranks its own trees (the verifier then prunes and sizes it without sorting).
  order.resize(nodes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (nodes[a].prob != nodes[b].prob) return nodes[a].prob > nodes[b].prob;
    return nodes[a].depth < nodes[b].depth;
  });
  kept.assign(nodes.size(), 0);
  chosen.clear();
  for (int32_t i : order) {
    if (static_cast<int>(chosen.size()) >= budget) break;
    const int32_t p = nodes[i].parent;
    if (p >= 0 && !kept[p]) continue;  // only on equal probabilities deeper than the parent: skip
    kept[i] = 1;
    chosen.push_back(i);
  }
  out_index.assign(nodes.size(), -1);
  uint64_t only = 0;
  for (size_t k = 0; k < chosen.size(); ++k) {
    const MergedNode& nd = nodes[chosen[k]];
    out_index[chosen[k]] = static_cast<int32_t>(k);
    if (!nd.fresh && k < 64) only |= uint64_t{1} << k;
    tokens.push_back(nd.token);
    parents.push_back(nd.parent < 0 ? -1 : out_index[nd.parent]);
    probs.push_back(nd.prob);
  }
  if (earlier_only != nullptr) *earlier_only = only;
  return static_cast<int>(chosen.size());
}

int marked_on_path(const TreeView& tree, uint64_t marked, const int32_t* path, int n) {
  int32_t at = -1;
  int found = 0;
  for (int s = 0; s < n; ++s) {
    const int32_t next = find_child(tree, at, path[s]);
    if (next < 0) break;
    if (next < 64 && (marked >> next) & 1) ++found;
    at = next;
  }
  return found;
}

void merge_rows(const TreeRows& fresh, const TreeRows& earlier, const int32_t* since, const int64_t* off,
                int budget, std::vector<int32_t>& tokens, std::vector<int32_t>& parents, std::vector<float>& probs,
                std::vector<int32_t>& counts, std::vector<uint64_t>& earlier_only) {
  const int64_t n = fresh.n;
  const size_t b = static_cast<size_t>(budget);
  tokens.assign(static_cast<size_t>(n) * b, -1);
  parents.assign(tokens.size(), -1);
  probs.assign(tokens.size(), 0.f);
  counts.assign(static_cast<size_t>(n), 0);
  earlier_only.assign(static_cast<size_t>(n), 0);
  std::vector<int32_t> t, p;
  std::vector<float> q;
  for (int64_t i = 0; i < n; ++i) {
    t.clear(), p.clear(), q.clear();
    const TreeView f{fresh.tokens + i * fresh.width, fresh.parents + i * fresh.width, fresh.probs + i * fresh.width,
                     fresh.counts[i]};
    const TreeView e{earlier.tokens + i * earlier.width, earlier.parents + i * earlier.width,
                     earlier.probs + i * earlier.width, earlier.counts[i]};
    const int k = merge_with_earlier(f, e, since + off[i], static_cast<int>(off[i + 1] - off[i]), budget, t, p, q,
                                    &earlier_only[static_cast<size_t>(i)]);
    std::copy(t.begin(), t.end(), tokens.begin() + static_cast<int64_t>(i * budget));
    std::copy(p.begin(), p.end(), parents.begin() + static_cast<int64_t>(i * budget));
    std::copy(q.begin(), q.end(), probs.begin() + static_cast<int64_t>(i * budget));
    counts[static_cast<size_t>(i)] = k;
  }
}

}  // namespace ngc
