#include "draft_tree.h"

#include <algorithm>
#include <cmath>
#include <queue>

#include "prompt_history.h"

namespace ngc {

void DraftTree::reset() {
  nodes_.clear();
  nodes_.push_back(Node{-1, -1, -1, -1, 0, 0.f, 0.f, 0, 0.f, 0, 0.f, 0.f, 0, 0});
}

int32_t DraftTree::child(int32_t parent, int32_t token) {
  int32_t prev = -1;
  for (int32_t c = nodes_[parent].first_child; c != -1; c = nodes_[c].next_sibling) {
    if (nodes_[c].token == token) return c;
    prev = c;
  }
  int32_t id = static_cast<int32_t>(nodes_.size());
  nodes_.push_back(Node{token, parent, -1, -1, nodes_[parent].depth + 1, 0.f, 0.f, 0, 0.f, 0, 0.f, 0.f, 0, 0});
  if (prev == -1)
    nodes_[parent].first_child = id;
  else
    nodes_[prev].next_sibling = id;
  return id;
}

const float* DraftTree::pow_table(const ScoreParams& sp) {
  const size_t n = static_cast<size_t>(sp.match_cap) + 1;
  for (PowTable& t : tables_)
    if (t.alpha == sp.alpha && t.values.size() == n) return t.values.data();
  std::swap(tables_[0], tables_[1]);  // keep the most recent exponent in slot 0
  PowTable& t = tables_[0];
  t.values.resize(n);
  for (size_t i = 0; i < n; ++i) t.values[i] = std::pow(static_cast<float>(i), sp.alpha);
  t.alpha = sp.alpha;
  return t.values.data();
}

void DraftTree::add(const int32_t* tokens, int n, int match_len, float scale, uint64_t recency,
                    DraftMode mode, const ScoreParams& sp, uint8_t cls) {
  // weight(d) = scale * min(match_len + gain * d, cap)^alpha, from a table when it is an integer.
  const bool score = mode == DraftMode::kScore;
  const float* tab = score ? pow_table(sp) : nullptr;
  const float cap = static_cast<float>(sp.match_cap);
  const int gain = static_cast<int>(sp.depth_gain);
  const bool integral = static_cast<float>(gain) == sp.depth_gain;  // the common case: a table lookup
  auto weight = [&](int depth) -> float {
    if (!score) return 1.0f;
    if (integral) return scale * tab[std::min(match_len + gain * depth, sp.match_cap)];
    float m = std::min(static_cast<float>(match_len) + sp.depth_gain * static_cast<float>(depth), cap);
    return scale * std::pow(m, sp.alpha);
  };
  int32_t u = 0;
  float w = weight(0);
  const float own = cls == kSrcOwn ? 1.0f : 0.0f;
  nodes_[0].mass += w;
  nodes_[0].own_mass += own * w;
  nodes_[0].recency = std::max(nodes_[0].recency, recency);
  for (int i = 0; i < n; ++i) {
    int32_t c = child(u, tokens[i]);
    Node& node = nodes_[c];
    node.vote += w;
    node.own_vote += own * w;
    if (w > node.top) node.top = w, node.cls = cls;
    w = weight(i + 1);
    node.mass += w;
    node.own_mass += own * w;
    node.recency = std::max(node.recency, recency);
    if (cls == kSrcOwn) node.own_recency = std::max(node.own_recency, recency + 1);
    if (cls == kSrcLearned) node.learned_recency = std::max(node.learned_recency, recency + 1);
    u = c;
  }
}

int DraftTree::select(int budget, float min_prob, DraftMode mode, const ScoreParams& sp,
                      std::vector<int32_t>& tokens, std::vector<int32_t>& parents,
                      std::vector<float>& probs, const AcceptanceModel* model,
                      const FeedbackParams* fp, DraftRecord* record, const RankContext* rank) {
  if (nodes_.empty()) return 0;
  if (mode != DraftMode::kScore) model = nullptr, rank = nullptr;
  if (rank && !rank->model) rank = nullptr;
  if (rank) model = nullptr;
  if (model) cells_.resize(nodes_.size());
  constexpr int kF = RankModel::kFeatures;
  constexpr int kC = RankModel::kNodeCells;
  if (rank) rank_feats_.resize(nodes_.size() * kF), rank_cells_.resize(nodes_.size() * kC);
  // Under the rank model the tree's estimates are its features: their prior mass is the model's own
  // (RankParams::tree_lambda), so today's ranking keeps ScoreParams::lambda.
  const float lambda = mode == DraftMode::kScore ? (rank ? rank->params->tree_lambda : sp.lambda) : 0.f;
  size_t out_base = tokens.size();
  // Heap entries: (priority, node, output index of the parent, path probability).
  struct Entry {
    double key;
    int32_t node;
    int32_t parent_out;
    float prob;
    bool operator<(const Entry& o) const { return key < o.key; }
  };
  std::priority_queue<Entry> heap;
  auto push_children = [&](int32_t u, int32_t u_out, float u_prob) {
    // The model ranks the children of u if they are within its depth (rank_model.h RankParams::max_depth);
    // deeper ones are ranked as without it (ScoreParams::lambda), and their cells say so (kNoCell: the
    // commit does not learn from them).
    const bool ranked = rank && (rank->params->max_depth <= 0 || nodes_[u].depth < rank->params->max_depth);
    const float lam = rank && !ranked ? sp.lambda : lambda;
    float denom = nodes_[u].mass + lam;
    if (denom <= 0.f) return;
    const float own_denom = nodes_[u].own_mass + lam;
    const float shared_denom = nodes_[u].mass - nodes_[u].own_mass + lam;
    int siblings = 0;
    int32_t parent_token = -1, grand_token = -1;
    uint64_t latest = 0, latest_own = 0;
    if (ranked) {
      for (int32_t c = nodes_[u].first_child; c != -1; c = nodes_[c].next_sibling)
        ++siblings, latest = std::max(latest, nodes_[c].learned_recency),
                    latest_own = std::max(latest_own, nodes_[c].own_recency);
      parent_token = u == 0 ? rank->root_token : nodes_[u].token;
      const int32_t g = nodes_[u].parent;
      grand_token = u == 0 ? rank->root_prev : g == 0 ? rank->root_token : nodes_[g].token;
    }
    for (int32_t c = nodes_[u].first_child; c != -1; c = nodes_[c].next_sibling) {
      float q = std::min(1.0f, nodes_[c].vote / denom);
      if (rank && !ranked) {
        rank_cells_[static_cast<size_t>(c) * kC] = RankModel::kNoCell;
      } else if (rank) {
        const Node& n = nodes_[c];
        const RankInputs in{q, own_denom > 0.f ? n.own_vote / own_denom : 0.f,
                            shared_denom > 0.f ? (n.vote - n.own_vote) / shared_denom : 0.f, n.depth, parent_token,
                            grand_token, n.token, n.vote > 0.f ? n.top / n.vote : 0.f, siblings,
                            siblings > 1 && latest > 0 && n.learned_recency == latest,
                            siblings > 1 && latest_own > 0 && n.own_recency == latest_own, n.cls};
        q = rank->model->predict(in, rank->request, rank->own, *rank->params, &rank_feats_[static_cast<size_t>(c) * kF],
                                 &rank_cells_[static_cast<size_t>(c) * kC]);
      } else if (model)
        q = model->conditional(q, nodes_[c].depth, nodes_[c].token, *fp, &cells_[c].depth_cell, &cells_[c].token_cell);
      float p = u_prob * q;
      double key;
      if (mode == DraftMode::kBfs)  // shallower first, then most recent
        key = -static_cast<double>(nodes_[c].depth) * 1e13 + static_cast<double>(nodes_[c].recency % 1000000000000ull);
      else
        key = p;
      heap.push(Entry{key, c, u_out, p});
    }
  };
  push_children(0, -1, 1.0f);
  int taken = 0;
  while (!heap.empty() && taken < budget) {
    Entry e = heap.top();
    heap.pop();
    if (mode != DraftMode::kBfs && e.prob < min_prob) {
      heap.push(e);  // the best node left out, for the record below
      break;
    }
    tokens.push_back(nodes_[e.node].token);
    parents.push_back(e.parent_out);
    probs.push_back(e.prob);
    if (record) {
      const int32_t par = e.parent_out;
      record->tokens.push_back(nodes_[e.node].token);
      record->parents.push_back(par);
      // The conditional it was taken with: the path probability over its parent's.
      const float parent_p = par < 0 ? 1.0f : probs[out_base + static_cast<size_t>(par)];
      record->q.push_back(parent_p > 0.f ? e.prob / parent_p : 0.f);
      record->cls.push_back(nodes_[e.node].cls);
      if (rank) {
        const size_t c = static_cast<size_t>(e.node);
        record->feats.insert(record->feats.end(), &rank_feats_[c * kF], &rank_feats_[c * kF] + kF);
        record->rank_cells.insert(record->rank_cells.end(), &rank_cells_[c * kC], &rank_cells_[c * kC] + kC);
        record->ranked = true;
      }
      if (model) {
        record->depth_cell.push_back(cells_[e.node].depth_cell);
        record->token_cell.push_back(cells_[e.node].token_cell);
        record->cells = true;
      }
    }
    ++taken;
    push_children(e.node, static_cast<int32_t>(tokens.size() - out_base - 1), e.prob);
  }
  if (rank && record) {
    // The best nodes left out, best first: where the budget cut, the ranking decided, and the commit
    // labels those under an accepted parent (rank_model.h).
    for (int k = 0; k < rank->params->left_out && !heap.empty(); ++k) {
      const Entry e = heap.top();
      heap.pop();
      const size_t c = static_cast<size_t>(e.node);
      record->out_tokens.push_back(nodes_[e.node].token);
      record->out_parents.push_back(e.parent_out);
      record->out_feats.insert(record->out_feats.end(), &rank_feats_[c * kF], &rank_feats_[c * kF] + kF);
      record->out_cells.insert(record->out_cells.end(), &rank_cells_[c * kC], &rank_cells_[c * kC] + kC);
    }
  }
  return taken;
}

}  // namespace ngc
