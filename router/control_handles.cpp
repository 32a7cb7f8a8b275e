// The control handles a router answers itself: ADD_ROUTE and DEL_ROUTE (what
// a child says about the contexts behind it), SHUTDOWN (from the parent
// only), FORWARD_LOG (log lines of children), and ALLOCATE_ID (the root).
// ANCESTORS (from the parent only) is in ancestors.cpp.
// Routes and SHUTDOWN are accepted only from the context at the other end of
// the link (src_id is its id), never from another context through it; so
// are log lines that come from the parent.
//
// Authority (docs/PROTOCOL.md §2.10): an id belongs to the link it was
// allocated on. The root remembers, on the link that asked, each id it hands
// out, and accepts ADD_ROUTE for that id only from that link, once: an id
// announced, or an id whose link has gone, can never be claimed by anyone
// again. The ids die with their link, so a departure costs only its own.
// A non-root router cannot know who asked the root, so it refuses only
// conflicts and the ids of its own block (kept for children it has not
// forked yet); the root, which every route reaches in the end, enforces
// ownership.
//
// Everything a peer writes is logged escaped (one record stays one line) and
// at a bounded rate per peer.
#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/control.h"
#include "router/reasons.h"
#include "router/router.h"

namespace spindle {
namespace {
// How many contexts one child link may announce with ADD_ROUTE, and how many
// blocks of ids it may hold granted but unannounced: bounds on what a
// misbehaving peer can make the root hold (docs/PROTOCOL.md, 6.2, 6.4).
constexpr std::size_t kMaxRoutesPerLink = 65536;
constexpr std::size_t kMaxPendingGrants = 1024;

std::string_view control_name(std::uint32_t handle) {
  switch (handle) {
    case kHandleAddRoute: return "ADD_ROUTE";
    case kHandleDelRoute: return "DEL_ROUTE";
    case kHandleForwardLog: return "FORWARD_LOG";
    case kHandleAncestors: return "ANCESTORS";
    default: return "SHUTDOWN";
  }
}
}  // namespace

// Request: empty (one id, answered "id") or the ASCII count of a block
// (answered "first-last"). A block goes to a child link, whose sub-router
// forks from it; a listener's client, possibly hostile, gets one id per
// request whatever it asks, so it cannot spend the id space faster than one
// id per message.
void Router::allocate_for(Message&& m) {
  if (parent_id()) return send_dead(m.header, "ALLOCATE_ID must be sent to the root context");
  const std::string asked = m.text();
  std::uint32_t count = 1;
  if (!asked.empty()) {
    auto n = parse_context_id(asked);
    if (!n || *n == 0)
      return send_dead(m.header, fmt::format("malformed ALLOCATE_ID request: {:?} is not a count of ids",
                                             asked.substr(0, 32)));
    count = std::min<std::uint32_t>(*n, IdGrants::kMaxIdBlock);
  }
  Link* via = m.header.src_id == id() ? nullptr : route_for(m.header.src_id);
  if (via && via->client) count = 1;
  if (via && via->allocated.blocks() >= kMaxPendingGrants)
    return send_dead(m.header, fmt::format("{}: {} ids allocated for stream {} are not announced yet",
                                           reason::kRefusedByPolicy, via->allocated.ids(),
                                           via->stream->name()));
  auto ids = take_ids(count);
  if (!ids) return send_dead(m.header, std::string(reason::kIdsExhausted));
  const auto [first, granted] = *ids;
  if (via) {
    via->allocated.grant(first, granted);
    granted_.grant(first, granted);
  }
  // No reply_to (0, or a dead frame's 999): the grant stands, and nobody is
  // told (PROTOCOL.md 6.4); a reply would go to handle 0 or 999 of the sender.
  if (m.header.reply_to == 0 || m.header.is_dead()) return;
  std::string text = asked.empty() ? std::to_string(first) : fmt::format("{}-{}", first, first + granted - 1);
  send_internal(Message::reply_to(m, Payload::copy_of(text), kEncMitogen));
}

bool Router::accept_add_route(Link& in, std::uint32_t target) {
  auto refuse = [&](std::string_view why) {
    note_refusal(in, "ADD_ROUTE",
                 [&] { return fmt::format("refused ADD_ROUTE for context {}: {}", target, why); });
    return false;
  };
  if (in.role != StreamRole::kChild) return refuse("routes are announced upwards only");
  Link* cur = route_for(target);
  if (target == id() || (parent_ && target == parent_->remote_id)) return refuse("that id is taken");
  if (routes_.count(target)) return cur == &in ? false : refuse("already routed elsewhere");
  if (in.behind.size() >= kMaxRoutesPerLink)
    return refuse(fmt::format("the link already routes {} contexts (limit {})", in.behind.size(),
                              kMaxRoutesPerLink));
  if (parent_ && holds_spare_id(target)) {
    // Ours, for a child not forked yet: the root would accept it from us.
    return refuse(reason::kNotYourId);
  }
  // A client pays for the routes it announces, within its allowance: the
  // per-link limit alone let 4,096 clients make the router keep some 270
  // million routes. Charged before the claim, so that a refusal for room
  // leaves the id claimable.
  if (!in.state.grow(kRouteStateBytes)) return refuse(route_state_spent(in));
  // The root: only the link that asked for the id, and only once.
  if (!parent_ && !in.allocated.claim(target)) {
    in.state.shrink(kRouteStateBytes);
    return refuse(reason::kNotYourId);
  }
  if (!parent_) granted_.claim(target);
  return true;
}

std::string Router::route_state_spent(const Link& in) const {
  return fmt::format("{} for routes: a context behind a link costs it {} bytes, a context it sends to {} ({})",
                     reason::kMemoryLimit, kRouteStateBytes, kEgressStateBytes,
                     in.state.account() ? in.state.account()->holdings() : "");
}

void Router::forward_log(Link& in, const Message& m) {
  // Children always; a listener's clients only where the router allows it.
  if (in.client && !opts_.accept_client_logs) {
    note_refusal(in, "FORWARD_LOG", [] { return std::string(reason::kClientLogsRefused); });
    return;
  }
  const auto now = Clock::now();
  if (!in.log_budget.take(now, opts_.peer_log_rate, opts_.peer_log_burst)) {
    // A client over its rate is not read until its next line is due: its
    // flood waits in its own socket and costs this router nothing. (A child,
    // our own, is only suppressed: its calls and replies must not wait.)
    if (in.client) in.stream->hold_input(in.log_budget.refill_time(opts_.peer_log_rate));
    return;
  }
  std::string text = m.text();
  auto a = text.find('\0');
  auto b = a == std::string::npos ? a : text.find('\0', a + 1);
  if (b == std::string::npos) {
    log().warn("stream={} malformed FORWARD_LOG payload ({} bytes)", in.stream->name(), text.size());
    return;
  }
  int levelno = std::atoi(text.substr(a + 1, b - a - 1).c_str());
  std::string_view name(text.data(), a), line(text.data() + b + 1, text.size() - b - 1);
  log().log(level_from_python(levelno), "[ctx={} stream={} name={:?}] {:?}", m.header.src_id,
            in.stream->name(), name.substr(0, 128), line.substr(0, 4096));
  if (std::uint64_t s = in.log_budget.take_suppressed(now))
    log().warn("stream={} suppressed {} log line(s) over its rate of {}/s", in.stream->name(), s,
               opts_.peer_log_rate);
}

bool Router::handle_control(Link& in, Message& m) {
  const std::uint32_t h = m.header.handle;
  if (h != kHandleAddRoute && h != kHandleDelRoute && h != kHandleShutdown && h != kHandleForwardLog &&
      h != kHandleAncestors)
    return false;
  // Each side of a link announces its own routes and asks its own child to
  // stop. The same handles addressed to us by any other context (a client,
  // through the router that is our parent) are refused: otherwise any client
  // could fail our calls to a third one with a DEL_ROUTE, or write into our
  // log. Log lines are the exception below us: Mitogen sends a context's
  // lines to the master through every hop, and their source passed the
  // reverse-path check, so it is behind this link.
  if (m.header.src_id != in.remote_id && (h != kHandleForwardLog || &in == parent_)) {
    if (h == kHandleShutdown) {
      send_dead(m.header, fmt::format("{}: SHUTDOWN is accepted only from the parent", reason::kRefusedByPolicy));
    } else {
      note_refusal(in, control_name(h), [&] {
        return fmt::format("{} (from context {} via stream {})", reason::kNotAdjacent, m.header.src_id,
                           in.stream->name());
      });
      if (m.header.reply_to != 0 && !m.is_dead()) send_dead(m.header, std::string(reason::kNotAdjacent));
    }
    return true;
  }
  if (h == kHandleForwardLog) {
    forward_log(in, m);
    return true;
  }
  if (h == kHandleAncestors) {
    take_ancestors(in, m);
    return true;
  }
  if (h == kHandleShutdown) {
    if (&in != parent_) {
      send_dead(m.header, fmt::format("{}: SHUTDOWN is accepted only from the parent", reason::kRefusedByPolicy));
      return true;
    }
    log().info("stream={} parent asked this context to shut down", in.stream->name());
    broker_.shutdown();
    return true;
  }
  // ADD_ROUTE "id[:name]" / DEL_ROUTE "id"
  std::string text = m.text();
  auto colon = text.find(':');
  auto target = parse_context_id(std::string_view(text).substr(0, colon));
  if (!target) {
    note_refusal(in, control_name(h),
                 [&] { return fmt::format("malformed payload {:?}", std::string_view(text).substr(0, 64)); });
    return true;
  }
  if (h == kHandleAddRoute) {
    if (accept_add_route(in, *target)) add_route(*target, in);
    return true;
  }
  // DEL_ROUTE
  auto it = routes_.find(*target);
  if (in.role == StreamRole::kChild) {
    if (it == routes_.end() || it->second != &in) return true;  // not theirs to delete
    if (*target == in.remote_id) {
      // Its id would count as free while it still sends as that id: the
      // next client given the id would share it (calls to it answered by
      // this one).
      note_refusal(in, control_name(h), [] { return std::string(reason::kOwnRoute); });
      return true;
    }
    remove_route(*target);
  } else if (it != routes_.end()) {
    return true;  // the parent cannot delete a route that runs through a child
  }
  context_gone(*target,
               fmt::format("{}: context {} (DEL_ROUTE from {})", reason::kPeerDisconnected, *target,
                           in.stream->name()),
               &in);
  return true;
}

}  // namespace spindle
