#include "acceptance_model.h"

#include <algorithm>

namespace ngc {

namespace {
// q bins on a square-root scale (resolution where most nodes are: small q): bin = floor(sqrt(q) * 12),
// the number of edges (b / 12)^2, b = 1..11, at or below q.
int q_bin(float q) {
  static constexpr float kEdges[AcceptanceModel::kQBins - 1] = {
      1 / 144.f, 4 / 144.f, 9 / 144.f, 16 / 144.f, 25 / 144.f, 36 / 144.f,
      49 / 144.f, 64 / 144.f, 81 / 144.f, 100 / 144.f, 121 / 144.f};
  int b = 0;
  for (float e : kEdges) b += q >= e;  // branch-free: q is random from call to call
  return b;
}
uint32_t tested_of(uint32_t v) { return v >> 16; }
uint32_t accepted_of(uint32_t v) { return v & 0xffffu; }
}  // namespace

void DraftRecord::start_draft() {
  tokens.clear(), parents.clear(), depth_cell.clear(), token_cell.clear(), q.clear(), cls.clear();
  feats.clear(), rank_cells.clear();
  out_tokens.clear(), out_parents.clear(), out_feats.clear(), out_cells.clear();
  cells = false;
  ranked = false;
  armed = true;
}

void DraftRecord::reset() {
  start_draft();
  armed = false;
  req_accepted = req_expected = 0.0f;
  own_cells.clear();
  root_token = -1;
}

AcceptanceModel::AcceptanceModel()
    : depth_(new std::atomic<uint32_t>[kDepthCells]), token_(new std::atomic<uint32_t>[kTokenCells]) {
  clear();
}

void AcceptanceModel::clear() {
  std::lock_guard<std::mutex> g(mu_);
  for (int i = 0; i < kDepthCells; ++i) depth_[i].store(0, std::memory_order_relaxed);
  for (int i = 0; i < kTokenCells; ++i) token_[i].store(0, std::memory_order_relaxed);
}

float AcceptanceModel::conditional(float q, int depth, int32_t token, const FeedbackParams& p,
                                   uint16_t* depth_cell, uint32_t* token_cell) const {
  const int qb = q_bin(q);
  const int c = qb * kDepthBins + std::clamp(depth, 1, kDepthBins) - 1;
  *depth_cell = static_cast<uint16_t>(c);
  const uint32_t vc = depth_[c].load(std::memory_order_relaxed);
  const float k = p.prior;
  const float den = static_cast<float>(tested_of(vc)) + k;
  const float est = den > 0.0f ? (static_cast<float>(accepted_of(vc)) + k * q) / den : q;
  if (p.token_prior <= 0.0f) {
    *token_cell = kNoCell;
    return est;
  }
  // Fibonacci hashing of the token id; q in 4 coarse bins so a token's rate is not one number for
  // both its confident and its doubtful drafts.
  const uint32_t h = (static_cast<uint32_t>(token) * 2654435761u) >> (32 - kTokenBits);
  const uint32_t t = static_cast<uint32_t>(qb * kTokenQBins / kQBins) << kTokenBits | h;
  *token_cell = t;
  const uint32_t vt = token_[t].load(std::memory_order_relaxed);
  const float k2 = p.token_prior;
  return (static_cast<float>(accepted_of(vt)) + k2 * est) / (static_cast<float>(tested_of(vt)) + k2);
}

void AcceptanceModel::bump(std::atomic<uint32_t>& cell, bool accepted, uint32_t window) {
  uint32_t v = cell.load(std::memory_order_relaxed);
  uint32_t t = tested_of(v) + 1, a = accepted_of(v) + (accepted ? 1 : 0);
  if (t >= window) t /= 2, a /= 2;  // forget slowly: the workload may change
  cell.store(t << 16 | a, std::memory_order_relaxed);
}

void AcceptanceModel::observe(DraftRecord& rec, const int32_t* committed, size_t n, const FeedbackParams& p) {
  if (!rec.armed) return;
  rec.armed = false;
  const size_t m = rec.tokens.size();
  if (m == 0 || n == 0 || !rec.cells) return;
  const std::vector<int8_t>& ok = draft_outcomes(rec, committed, n);
  std::lock_guard<std::mutex> g(mu_);
  for (size_t i = 0; i < m; ++i) {
    if (ok[i] < 0) continue;
    bump(depth_[rec.depth_cell[i]], ok[i] == 1, p.window);
    if (rec.token_cell[i] != kNoCell) bump(token_[rec.token_cell[i]], ok[i] == 1, p.window);
  }
}

std::pair<uint64_t, uint64_t> AcceptanceModel::totals() const {
  uint64_t t = 0, a = 0;
  for (int i = 0; i < kDepthCells; ++i) {
    uint32_t v = depth_[i].load(std::memory_order_relaxed);
    t += tested_of(v), a += accepted_of(v);
  }
  return {t, a};
}

}  // namespace ngc
