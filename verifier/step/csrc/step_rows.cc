#include "step_rows.h"

#include <algorithm>
#include <numeric>

namespace vstep {
namespace {

int32_t clamp_count(const DraftRows& r, int64_t i) {
  return static_cast<int32_t>(std::clamp<int64_t>(r.counts[i], 0, r.width));
}

}  // namespace

RowsSummary summarize_rows(const DraftRows& r) {
  RowsSummary s;
  for (int64_t i = 0; i < r.n; ++i) {
    s.nodes = std::max(s.nodes, clamp_count(r, i));
    const float* p = r.probs + i * r.width;
    for (int64_t j = 1; j < r.width && s.best_first; ++j) s.best_first = p[j] <= p[j - 1];
  }
  s.column_sums.assign(static_cast<size_t>(s.nodes), 0.0);
  std::vector<float> sorted;
  for (int64_t i = 0; i < r.n; ++i) {
    const float* p = r.probs + i * r.width;
    if (!s.best_first) {  // column j of the rows' j-th best nodes (padding, 0, sorts last)
      sorted.assign(p, p + s.nodes);
      std::sort(sorted.begin(), sorted.end(), [](float a, float b) { return a > b; });
      p = sorted.data();
    }
    for (int32_t j = 0; j < s.nodes; ++j) s.column_sums[static_cast<size_t>(j)] += p[j];
  }
  return s;
}

int plan_width(const DraftRows& r, int k, int k_min) {
  k = static_cast<int>(std::clamp<int64_t>(k, 0, r.width));
  int32_t widest = 0;
  for (int64_t i = 0; i < r.n; ++i) widest = std::max(widest, std::min(clamp_count(r, i), k));
  return std::max(k_min, 1 + widest);
}

double pack_plan(const DraftRows& r, const PlanShape& shape, bool best_first, const int64_t* last_tokens,
                 const int64_t* prefix_lens, const int64_t* slots, int64_t* host, std::vector<int32_t>& num_nodes) {
  const int K = plan_width(r, shape.k, shape.k_min);
  const int k = static_cast<int>(std::clamp<int64_t>(shape.k, 0, r.width));
  const int64_t n = r.n, R = std::max(shape.rows, n);
  int64_t* tok = host;
  int64_t* par = host + R * K;
  num_nodes.assign(static_cast<size_t>(n), 1);
  std::vector<int32_t> order, remap, keep(static_cast<size_t>(std::max(k, 1))), kept_parents(keep.size());
  double predicted = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    int64_t* t = tok + i * K;
    int64_t* p = par + i * K;
    std::fill(t, t + K, last_tokens[i]);  // the root, and padding nodes repeating it
    std::fill(p, p + K, -1);              // the root, and isolated padding nodes
    const int32_t count = clamp_count(r, i), m = std::min(count, k);
    num_nodes[static_cast<size_t>(i)] = 1 + m;
    if (m == 0) continue;
    const int32_t* rpar = r.parents + i * r.width;
    bool first = best_first || count <= k;
    if (!first) {
      // The m most probable of the row's count nodes (stable: equal probabilities keep their order),
      // in their original order, parents remapped; a parent left out means the first m instead.
      const float* pr = r.probs + i * r.width;
      order.resize(static_cast<size_t>(count));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return pr[a] > pr[b]; });
      std::sort(order.begin(), order.begin() + m);
      remap.assign(static_cast<size_t>(count), -1);
      for (int32_t j = 0; j < m; ++j) remap[static_cast<size_t>(order[j])] = j;
      for (int32_t j = 0; j < m && !first; ++j) {
        const int32_t q = rpar[order[j]];
        const int32_t mapped = q >= 0 && q < count ? remap[static_cast<size_t>(q)] : -1;
        if (q >= 0 && mapped < 0) first = true;
        keep[static_cast<size_t>(j)] = order[j];
        kept_parents[static_cast<size_t>(j)] = q >= 0 ? mapped : -1;
      }
    }
    if (first) {
      for (int32_t j = 0; j < m; ++j) keep[static_cast<size_t>(j)] = j, kept_parents[static_cast<size_t>(j)] = rpar[j];
    }
    for (int32_t j = 0; j < m; ++j) {
      const int32_t src = keep[static_cast<size_t>(j)];
      t[1 + j] = r.tokens[i * r.width + src];
      p[1 + j] = kept_parents[static_cast<size_t>(j)] + 1;  // draft parent -1 (the root) -> node 0
      predicted += r.probs[i * r.width + src];
    }
  }
  std::fill(tok + n * K, tok + R * K, 0);  // padding rows: isolated nodes at position 0 of the scratch slot
  std::fill(par + n * K, par + R * K, -1);
  int64_t* prefix = par + R * K;
  int64_t* slot = prefix + R;
  std::copy(prefix_lens, prefix_lens + n, prefix);
  std::fill(prefix + n, prefix + R, 0);
  std::copy(slots, slots + n, slot);
  std::fill(slot + n, slot + R, shape.scratch_slot);
  return predicted;
}

}  // namespace vstep
