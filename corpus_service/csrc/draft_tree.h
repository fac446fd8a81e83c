// DraftTree: merges candidate continuations from every source into one token trie and selects the
// `budget` nodes most likely to be accepted.
//
// Acceptance model (mode kScore). A candidate is an earlier occurrence of the context's tail with
// match length m. Once the verifier has accepted the first d draft tokens along a candidate's path,
// that occurrence matches the context over m + d tokens, so at depth d it votes for its next
// token with weight  w = s_src * min(m + g*d, cap)^alpha . For node u and child c:
//     P(c | u) = vote(c) / (mass(u) + lambda)
// where vote(c) sums the weights of the candidates through c and mass(u) the weights of all
// candidates through u (including those whose continuation ends at u); lambda is the prior mass of
// "something else". The path probability (product along the path) never grows with depth, so
// taking nodes best-first from the root yields the top-`budget` connected tree.
// With an AcceptanceModel (acceptance_model.h), P(c | u) is that estimate calibrated by what the
// verifier accepted before.
// Mode kProb weighs every occurrence 1 and uses lambda = 0 (SGLang's PROB: frequency).
// Mode kBfs fills level by level, most recent occurrence first (SGLang's BFS: recency).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "acceptance_model.h"
#include "rank_model.h"

namespace ngc {

// A RankModel and what it needs beyond the tree: the context's last tokens (the root's), the
// request's recent acceptance (RankModel::request_feature) and its own cells.
struct RankContext {
  const RankModel* model = nullptr;
  const RankParams* params = nullptr;
  int32_t root_token = -1, root_prev = -1;  // the context's last two tokens (-1: none)
  float request = 0.0f;
  const uint16_t* own = nullptr;  // the request's own cells (RequestCells; null: none yet)
};

enum class DraftMode : int { kScore = 0, kProb = 1, kBfs = 2 };

struct ScoreParams {
  float alpha = 2.0f;     // exponent of the match-length weight
  float lambda = 16.0f;    // prior mass of continuations not seen in any source
  int match_cap = 32;     // match lengths above this weigh the same
  float depth_gain = 1.0f;  // accepted draft tokens count this much towards the match length
};

class DraftTree {
 public:
  void reset();
  // Adds one candidate's continuation (tokens[0..n)) below the root.
  //   match_len: tokens matched before the continuation; scale: the source's weight;
  //   recency: larger is more recent (used by kBfs ordering); cls: its source class (each node
  //   remembers the class of its heaviest vote: prompt_history.h's SourceWeights learns from it).
  void add(const int32_t* tokens, int n, int match_len, float scale, uint64_t recency,
           DraftMode mode, const ScoreParams& sp, uint8_t cls = 0);
  // Selects at most budget nodes (parents before children). Nodes whose path probability falls
  // below min_prob are not taken (kScore and kProb). Appends to the outputs; returns the count.
  // With a model (kScore), conditionals are calibrated; with a rank model (kScore; it takes
  // precedence) they are its predictions. Each taken node is written to `record` (already started;
  // its cells or features with a model) so the next commit can score it.
  int select(int budget, float min_prob, DraftMode mode, const ScoreParams& sp,
             std::vector<int32_t>& tokens, std::vector<int32_t>& parents,
             std::vector<float>& probs, const AcceptanceModel* model = nullptr,
             const FeedbackParams* fp = nullptr, DraftRecord* record = nullptr,
             const RankContext* rank = nullptr);
  size_t nodes() const { return nodes_.size(); }
  // pow(m, alpha) for m = 0..sp.match_cap (cached per exponent; valid until the next call with
  // other parameters).
  const float* pow_table(const ScoreParams& sp);

 private:
  struct Node {
    int32_t token;
    int32_t parent;
    int32_t first_child;
    int32_t next_sibling;
    int32_t depth;
    float vote;         // weight of candidates through this node, at the parent's depth
    float mass;         // weight of candidates through this node, at this node's depth
    uint64_t recency;   // most recent candidate through this node
    float top;          // the heaviest single vote for this node ...
    uint8_t cls;        // ... and its source class
    float own_vote;     // vote and mass from the request's own context alone (the rank model's
    float own_mass;     // own-context vs shared estimates)
    // The most recent own-context and learned-corpus candidates through this node (position + 1; 0:
    // none): positions are comparable within one index only.
    uint64_t own_recency;
    uint64_t learned_recency;
  };
  int32_t child(int32_t parent, int32_t token);
  std::vector<Node> nodes_;
  // Per node, with an AcceptanceModel: its cells, set when it is pushed (each node has one parent).
  struct NodeCells {
    uint16_t depth_cell;
    uint32_t token_cell;
  };
  std::vector<NodeCells> cells_;
  // Per node, with a RankModel: its features and cells, set when it is pushed.
  std::vector<float> rank_feats_;
  std::vector<uint32_t> rank_cells_;
  // pow(m, alpha) for m = 0..match_cap, rebuilt when the parameters change (pow is the hot spot).
  struct PowTable {
    float alpha = -1.f;
    std::vector<float> values;
  };
  PowTable tables_[2];  // the two exponents in use (own context; shared corpora)
};

}  // namespace ngc
