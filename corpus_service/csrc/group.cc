#include "group.h"

#include <algorithm>
#include <stdexcept>

#include "errors.h"

namespace ngc {

void sibling_sources(const RequestState& rs, std::vector<SiblingSource>* out) {
  out->clear();
  const RequestState* founder = rs.group->founder();
  for (const auto& m : rs.group->members) {
    if (m.get() == &rs || m->own.live() == 0) continue;
    const uint64_t begin = m->own.begin(), last = m->own.end() - 1;
    // Prompt positions m indexed itself (a borrowed member indexed none of the shared prefix).
    size_t shared = m->borrowed ? 0 : std::min(rs.shared_prefix, m->shared_prefix);
    if (rs.borrowed && m.get() == founder && shared > 0) {
      // rs's prompt prefix lives in the founder's index: those positions are rs's own context,
      // except the prefix's last one, which continues into the founder's output, not rs's (a
      // founder in the history drafts its output from there).
      SiblingSource rest{&m->own, {}, last, false};
      if (shared > 1) {
        out->push_back(SiblingSource{&m->own, {{begin + shared - 1, last}}, UINT64_MAX, true});
        rest.skip.emplace_back(begin, begin + shared - 2);
      }
      if (!m->in_history) out->push_back(std::move(rest));
      continue;
    }
    if (m->in_history) continue;  // its rollout drafts from the key's history (prompt_history.h)
    SiblingSource s{&m->own, {}, last, false};
    // The prefix both indexed is in rs's own index already: its occurrences count once. Not rs's
    // current position though: rs's own index excludes it (it has no continuation there).
    if (!rs.borrowed) shared = std::min(shared, rs.own.live() - 1);
    if (shared > 0) s.skip.emplace_back(begin, begin + shared - 1);
    out->push_back(std::move(s));
  }
}

void group_chunks(const RequestGroup& g, const std::unordered_map<uint64_t, PositionRanges>& live_chunks,
                  PositionRanges* out) {
  out->clear();
  for (const auto& m : g.members) {
    auto it = live_chunks.find(m->serial);
    if (it != live_chunks.end()) out->insert(out->end(), it->second.begin(), it->second.end());
  }
  std::sort(out->begin(), out->end());  // members' chunks interleave: TokenIndex::find wants them sorted
}

size_t GroupRegistry::shared_prefix(const std::string& key, const int32_t* prompt, size_t n) const {
  std::lock_guard<std::mutex> g(mu_);
  auto it = groups_.find(key);
  if (it == groups_.end()) return 0;
  std::shared_lock<std::shared_mutex> rl(it->second->mu);
  const auto& p = it->second->prompt;
  if (it->second->members.empty()) return 0;
  return static_cast<size_t>(std::mismatch(p.begin(), p.end(), prompt, prompt + n).first - p.begin());
}

size_t GroupRegistry::join(const std::string& key, const std::shared_ptr<RequestState>& rs, const int32_t* prompt,
                           size_t n, bool learn_prompt, std::vector<uint64_t>* dropped) {
  std::lock_guard<std::mutex> g(mu_);
  auto& slot = groups_[key];
  if (!slot) slot = std::make_shared<RequestGroup>(key);
  RequestGroup& grp = *slot;
  std::unique_lock<std::shared_mutex> wl(grp.mu);
  if (grp.live >= kMaxGroupMembers)
    throw LimitExceeded("request group '" + key + "' already has " + std::to_string(grp.live) +
                        " live members (at most " + std::to_string(kMaxGroupMembers) + ")");
  while (grp.members.size() >= kMaxGroupMembers) {
    // Never the founder: it indexes the prompt for the others.
    auto oldest = std::find_if(grp.members.begin() + 1, grp.members.end(), [](const auto& m) { return m->ended; });
    dropped->push_back((*oldest)->serial);
    grp.members.erase(oldest);
  }
  size_t learned = 0;
  size_t shared = n;
  if (grp.members.empty()) {
    grp.prompt.assign(prompt, prompt + n);
    grp.prompt_learned = learn_prompt;
  } else {
    auto diff = std::mismatch(grp.prompt.begin(), grp.prompt.end(), prompt, prompt + n);
    shared = static_cast<size_t>(diff.first - grp.prompt.begin());
    if (grp.prompt_learned) learned = shared;
  }
  // A founder borrows nothing; a borrowed member built `own` for the prefix it was told it shares.
  if (rs->borrowed && (grp.members.empty() || shared != rs->shared_prefix)) rs->borrowed = false;
  rs->shared_prefix = shared;
  rs->group = slot;
  rs->ended = false;
  grp.members.push_back(rs);
  ++grp.live;
  return learned;
}

void GroupRegistry::leave(RequestState& rs, std::vector<uint64_t>* ended) {
  if (!rs.group) return;
  std::lock_guard<std::mutex> g(mu_);
  RequestGroup& grp = *rs.group;
  std::unique_lock<std::shared_mutex> wl(grp.mu);
  if (rs.ended) return;
  rs.ended = true;
  if (--grp.live > 0) return;
  for (const auto& m : grp.members) ended->push_back(m->serial);
  grp.members.clear();  // the members referenced the group and the group its members: break the cycle
  auto it = groups_.find(grp.key);
  if (it != groups_.end() && it->second.get() == &grp) groups_.erase(it);
}

void GroupRegistry::clear() {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [key, grp] : groups_) {
    std::unique_lock<std::shared_mutex> wl(grp->mu);
    for (const auto& m : grp->members) m->ended = true;
    grp->members.clear();
    grp->live = 0;
  }
  groups_.clear();
}

size_t GroupRegistry::size() const {
  std::lock_guard<std::mutex> g(mu_);
  return groups_.size();
}

void GroupRegistry::check_integrity(const std::vector<std::shared_ptr<RequestState>>& live) const {
  std::lock_guard<std::mutex> g(mu_);
  std::unordered_map<const RequestGroup*, size_t> live_members;
  for (const auto& rs : live) {
    if (!rs->group) continue;
    {
      // A request finished concurrently may still be in `live`: only one that has not left counts.
      std::shared_lock<std::shared_mutex> rl(rs->group->mu);
      if (rs->ended) continue;
    }
    auto it = groups_.find(rs->group->key);
    if (it == groups_.end() || it->second != rs->group) throw std::logic_error("a live group member's group is not registered");
    ++live_members[rs->group.get()];
  }
  for (const auto& [key, grp] : groups_) {
    std::shared_lock<std::shared_mutex> rl(grp->mu);
    if (grp->key != key) throw std::logic_error("group registered under another key");
    if (grp->live == 0 || grp->members.empty()) throw std::logic_error("a group without live members is kept");
    size_t not_ended = 0;
    for (const auto& m : grp->members) {
      if (m->group != grp) throw std::logic_error("a group member points to another group");
      if (m->shared_prefix > grp->prompt.size() || (!m->borrowed && m->shared_prefix > m->own.live()))
        throw std::logic_error("a group member's shared prefix exceeds the prompt");
      if (m->borrowed && m.get() == grp->founder()) throw std::logic_error("a group's founder borrows its prompt");
      not_ended += !m->ended;
    }
    if (not_ended != grp->live) throw std::logic_error("group live count disagrees with its members");
    auto lm = live_members.find(grp.get());
    if (lm != live_members.end() && lm->second > grp->live) throw std::logic_error("more live members than counted");
  }
}

}  // namespace ngc
