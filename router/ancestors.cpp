// Ancestors: which contexts are above this one. A function exposed with
// Allow::kUpstream (the agent's spindle.ssh and spindle.fork, which start
// processes) answers the parent and the contexts above it, since the root
// asks a hop to start the next hop. Frames from a sibling (another child of
// the parent, or a client of the router above) also arrive through the parent
// link, carrying the sibling's own auth_id; "not routed through a child" is
// therefore not "above". So each parent tells each Spindle child, as the
// link's first frame, who is above it (kHandleAncestors: its own ancestors,
// nearest first); the child adds its parent in front. The frame is queued
// before anything else can be routed to the child, and a link keeps its
// order, so a call from above never arrives before the list that admits it.
// A parent that learns its ancestors late (its own parent link opened after
// it forked, or the list came after) tells its children again. Mitogen
// derives the same set from its bootstrap's parent_ids.
//
// Only the parent link is believed, and only from the context at its other
// end (handle_control's adjacency check); a list longer than kMaxAncestors
// or not made of ids is refused and logged in summary.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "router/control.h"
#include "router/router.h"

namespace spindle {
namespace {
constexpr std::size_t kMaxAncestors = 1024;

// "a,b,c" -> ids; nullopt for anything else (empty items, non-digits, 0).
std::optional<std::vector<std::uint32_t>> parse_ids(std::string_view text) {
  std::vector<std::uint32_t> ids;
  while (!text.empty()) {
    auto comma = text.find(',');
    std::string_view item = text.substr(0, comma);
    auto id = parse_context_id(item);
    if (!id || ids.size() == kMaxAncestors) return std::nullopt;
    ids.push_back(*id);
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
    if (text.empty()) return std::nullopt;  // a trailing comma
  }
  return ids;
}
}  // namespace

std::vector<std::uint32_t> Router::ancestors() const {
  std::lock_guard lk(ports_mu_);
  std::vector<std::uint32_t> out;
  if (!parent_id_) return out;
  out.reserve(1 + above_parent_.size());
  out.push_back(*parent_id_);
  out.insert(out.end(), above_parent_.begin(), above_parent_.end());
  return out;
}

bool Router::is_ancestor(std::uint32_t id) const {
  std::lock_guard lk(ports_mu_);
  if (!parent_id_) return false;
  return id == *parent_id_ || std::find(above_parent_.begin(), above_parent_.end(), id) != above_parent_.end();
}

void Router::take_ancestors(Link& in, const Message& m) {
  if (&in != parent_) {
    note_refusal(in, "ANCESTORS", [] { return std::string("accepted only from the parent"); });
    return;
  }
  const std::string text = m.text();
  auto ids = parse_ids(text);
  if (!ids) {
    note_refusal(in, "ANCESTORS", [&] {
      return fmt::format("malformed payload {:?} ({} bytes)", std::string_view(text).substr(0, 64), text.size());
    });
    return;
  }
  {
    std::lock_guard lk(ports_mu_);
    above_parent_ = std::move(*ids);
  }
  tell_children_ancestors();
}

void Router::tell_ancestors(Link& child) {
  if (child.role != StreamRole::kChild || child.remote_id == 0 || child.dialect == Dialect::kMitogen) return;
  const std::vector<std::uint32_t> ids = ancestors();
  if (ids.empty()) return;  // the root: the child's parent is all there is above it
  Message m = Message::make(child.remote_id, kHandleAncestors,
                            Payload::copy_of(fmt::format("{}", fmt::join(ids, ","))), kEncMitogen);
  m.header.src_id = m.header.auth_id = id();
  enqueue_on(child, std::move(m), 0);
}

void Router::tell_children_ancestors() {
  for (auto& [sp, l] : links_)
    if (l->stream->accepts_output()) tell_ancestors(*l);
}

}  // namespace spindle
