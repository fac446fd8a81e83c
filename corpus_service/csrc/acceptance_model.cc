#include "acceptance_model.h"

#include <algorithm>
#include <cmath>

namespace ngc {

namespace {
// q bins on a square-root scale: resolution where most nodes are (small q) without empty top bins.
int q_bin(float q) {
  int b = static_cast<int>(std::sqrt(std::clamp(q, 0.0f, 1.0f)) * AcceptanceModel::kQBins);
  return std::min(b, AcceptanceModel::kQBins - 1);
}
int depth_bin(int depth) { return std::clamp(depth, 1, AcceptanceModel::kDepthBins) - 1; }
// Match lengths 1, 2, 3, 4-5, 6-8, 9-12, 13-20, 21+.
int match_bin(int m) {
  static constexpr int8_t kBin[21] = {0, 0, 1, 2, 3, 3, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6};
  return m >= 21 ? AcceptanceModel::kMatchBins - 1 : kBin[std::max(m, 0)];
}
uint64_t tested_of(uint64_t v) { return v >> 32; }
uint64_t accepted_of(uint64_t v) { return v & 0xffffffffull; }
}  // namespace

void DraftRecord::start_draft() {
  tokens.clear(), parents.clear(), fine.clear(), coarse.clear(), calibrated.clear(), source.clear();
  armed = true;
}

void DraftRecord::reset() {
  start_draft();
  armed = false;
  std::fill(predicted, predicted + kSources, 0.0f);
  std::fill(accepted, accepted + kSources, 0.0f);
}

AcceptanceModel::AcceptanceModel()
    : fine_(new std::atomic<uint64_t>[kFineCells]), coarse_(new std::atomic<uint64_t>[kCoarseCells]) {
  clear();
}

void AcceptanceModel::clear() {
  std::lock_guard<std::mutex> g(mu_);
  for (int i = 0; i < kFineCells; ++i) fine_[i].store(0, std::memory_order_relaxed);
  for (int i = 0; i < kCoarseCells; ++i) coarse_[i].store(0, std::memory_order_relaxed);
}

float AcceptanceModel::conditional(const NodeFeatures& f, const FeedbackParams& p, uint16_t* fine,
                                   uint16_t* coarse) const {
  const int c = q_bin(f.q) * kDepthBins + depth_bin(f.depth);
  const int s = std::clamp(f.source, 0, kSources - 1);
  const int x = (c * kSources + s) * kMatchBins + match_bin(f.match);
  *coarse = static_cast<uint16_t>(c);
  *fine = static_cast<uint16_t>(x);
  const uint64_t vc = coarse_[c].load(std::memory_order_relaxed);
  const uint64_t vf = fine_[x].load(std::memory_order_relaxed);
  const float k = p.prior;
  const float den_c = static_cast<float>(tested_of(vc)) + k;
  const float est_c = den_c > 0.0f ? (static_cast<float>(accepted_of(vc)) + k * f.q) / den_c : f.q;
  const float den = static_cast<float>(tested_of(vf)) + k;
  return den > 0.0f ? (static_cast<float>(accepted_of(vf)) + k * est_c) / den : est_c;
}

void AcceptanceModel::bump(std::atomic<uint64_t>& cell, bool accepted, uint32_t window) {
  uint64_t v = cell.load(std::memory_order_relaxed);
  uint64_t t = tested_of(v) + 1, a = accepted_of(v) + (accepted ? 1 : 0);
  if (t >= window) t /= 2, a /= 2;  // forget slowly: the workload may change
  cell.store(t << 32 | a, std::memory_order_relaxed);
}

void AcceptanceModel::observe(DraftRecord& rec, const int32_t* committed, size_t n, const FeedbackParams& p) {
  if (!rec.armed) return;
  rec.armed = false;
  const size_t m = rec.tokens.size();
  if (m == 0 || n == 0) return;
  // Node i (depth d) was tested iff its parent was accepted (or is the root) and the commit reached
  // depth d; it was accepted iff it also equals the d-th committed token. Parents precede children.
  thread_local std::vector<int32_t> depth;
  thread_local std::vector<uint8_t> ok;
  depth.resize(m), ok.resize(m);
  std::lock_guard<std::mutex> g(mu_);
  for (size_t i = 0; i < m; ++i) {
    const int32_t par = rec.parents[i];
    depth[i] = par < 0 ? 1 : depth[par] + 1;
    ok[i] = 0;
    const bool tested = (par < 0 || ok[par]) && static_cast<size_t>(depth[i]) <= n;
    if (!tested) continue;
    ok[i] = rec.tokens[i] == committed[depth[i] - 1];
    bump(fine_[rec.fine[i]], ok[i], p.window);
    bump(coarse_[rec.coarse[i]], ok[i], p.window);
    rec.predicted[rec.source[i]] += rec.calibrated[i];
    rec.accepted[rec.source[i]] += ok[i];
  }
}

std::pair<uint64_t, uint64_t> AcceptanceModel::totals() const {
  uint64_t t = 0, a = 0;
  for (int i = 0; i < kFineCells; ++i) {
    uint64_t v = fine_[i].load(std::memory_order_relaxed);
    t += tested_of(v), a += accepted_of(v);
  }
  return {t, a};
}

}  // namespace ngc
