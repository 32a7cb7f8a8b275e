// IdGrants: the ids the root handed one link with ALLOCATE_ID and that link
// has not announced yet (docs/PROTOCOL.md 6.4).
//
// A grant is a block of up to kMaxIdBlock consecutive ids: a sub-router
// takes a block and forks its children from it without asking again (as
// Mitogen's id allocator does), a listener's client one id at a time. Each
// id may be announced once, by the link it was granted to; an announced id
// leaves its block, and an empty block is forgotten. So what a peer makes
// the root hold is bounded by the number of blocks (the caller's limit), not
// by the ids in them: a block is one map entry.
//
// Thread: the root router's broker thread. Owned by the Router's Link, and
// by the Router for the union of every link's (Router::id_in_use).
#pragma once

#include <bit>
#include <cstdint>
#include <map>

namespace spindle {

class IdGrants {
 public:
  static constexpr std::uint32_t kMaxIdBlock = 32;
  static_assert(kMaxIdBlock < 64, "a block's ids are the bits of one u64 mask");

  // Blocks held (each with at least one id unannounced), and ids in them.
  std::size_t blocks() const { return unannounced_.size(); }
  std::size_t ids() const { return ids_; }

  // Records ids first .. first + count - 1 (count 1 .. kMaxIdBlock), which
  // the caller took from the id counter: they overlap no earlier grant.
  void grant(std::uint32_t first, std::uint32_t count) {
    unannounced_.emplace(first, (std::uint64_t{1} << count) - 1);
    ids_ += count;
  }

  // Whether `id` was granted here and is not announced yet.
  bool holds(std::uint32_t id) const { return block_of(unannounced_, id) != unannounced_.end(); }
  // Whether `id` was granted here and not announced yet; if so it is
  // announced now, so a second claim of it fails.
  bool claim(std::uint32_t id) {
    auto it = block_of(unannounced_, id);
    if (it == unannounced_.end()) return false;
    it->second &= ~(std::uint64_t{1} << (id - it->first));
    --ids_;
    if (it->second == 0) unannounced_.erase(it);
    return true;
  }
  // Removes every id that `theirs` holds: the router-wide index of all
  // links' grants forgets a link's when that link goes. Each block of
  // `theirs` was recorded here under the same first id.
  void forget(const IdGrants& theirs) {
    for (const auto& [first, mask] : theirs.unannounced_) {
      auto it = unannounced_.find(first);
      if (it == unannounced_.end()) continue;
      ids_ -= static_cast<std::size_t>(std::popcount(it->second & mask));
      it->second &= ~mask;
      if (it->second == 0) unannounced_.erase(it);
    }
  }

 private:
  // The block in `m` where `id` is unannounced, or m.end().
  template <class Map>
  static auto block_of(Map& m, std::uint32_t id) -> decltype(m.begin()) {
    auto it = m.upper_bound(id);
    if (it == m.begin()) return m.end();
    --it;
    const std::uint32_t offset = id - it->first;
    return offset < 64 && (it->second >> offset & 1) ? it : m.end();
  }

  std::map<std::uint32_t, std::uint64_t> unannounced_;  // first id -> bit i: first + i unannounced
  std::size_t ids_ = 0;
};

}  // namespace spindle
