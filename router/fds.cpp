// File descriptors through the router (docs/PROTOCOL.md §13).
//
// Fds ride in Message::fds and a memfd body in Message::sealed_body; the
// streams frame them. The router's part is policy:
// - a sender's message: at most 253 fds (an error to the caller, never a
//   silent split), and a payload of memfd_threshold bytes or more is copied
//   once into a sealed memfd on the sender's thread (a PayloadBuffer's payload
//   already is one and is not copied at all), unless its first hop cannot
//   take fds;
// - forwarding: fds pass unchanged, and each peer is charged for the fds it
//   has in flight through this router, dbus-broker style. The charge rides in
//   the FdSet, so it is released whenever the fds go (written, refused,
//   dropped with a closed stream): no path can leak it. Over the quota the
//   sender gets a dead reply at once; nothing waits;
// - a memfd body is mapped read-only only for local delivery, never for
//   forwarding to a peer that takes fds;
// - a stream that cannot deliver a message with its fds reports it through
//   on_stream_refused(), and the sender gets a dead reply naming the reason.
#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/reasons.h"
#include "router/router.h"
#include "stream/memfd.h"

namespace spindle {
namespace {

// Returned to the sender's peer when the last holder of the fds lets go.
class FdCharge {
 public:
  FdCharge(std::shared_ptr<std::atomic<std::size_t>> counter, std::size_t n)
      : counter_(std::move(counter)), n_(n) {}
  ~FdCharge() { counter_->fetch_sub(n_, std::memory_order_relaxed); }
  FdCharge(const FdCharge&) = delete;
  FdCharge& operator=(const FdCharge&) = delete;

 private:
  std::shared_ptr<std::atomic<std::size_t>> counter_;
  std::size_t n_;
};

}  // namespace

void Router::prepare_fds_for_send(Message& msg) {
  if (msg.fds.size() > kMaxFdsPerMessage)
    throw Error(fmt::format("{}: {} exceeds the limit of {} per message (send them in several messages)",
                            reason::kTooManyFds, msg.fds.size(), kMaxFdsPerMessage));
  // Bytes for this context itself are never copied; a memfd payload already is one.
  if (msg.header.dst_id == id() || msg.data.memfd_span().memfd || msg.data.size() < opts_.memfd_threshold ||
      msg.data.size() == 0 || msg.fds.size() == kMaxFdsPerMessage)
    return;
  // A link that cannot carry the memfd (a pipe, an ssh session, a Mitogen
  // peer): the bytes would be copied into it only to be written inline again.
  if (PortView p = port_for(msg.header.dst_id); p.port && !p.port->peer_takes_fds.load(std::memory_order_acquire))
    return;
  // At most one copy into the memfd on the caller's thread (none for bytes
  // that already sit in a received memfd), then a view of it: the size (and
  // so every gauge charge) is unchanged; a peer that cannot take fds is sent
  // the bytes from this view. The view is not populated: the fd is what
  // travels, and building its page tables cost the caller 25 ms per 256 MiB
  // (a quarter of the copy), and the broker as much again to tear them down
  // after the send (bench_fds' heap row, 2026-11-28). What goes inline
  // beside a memfd range stays below the threshold: a small message's size.
  try {
    msg.data = memfd_ready(msg.data, opts_.memfd_threshold);
  } catch (const std::system_error& e) {
    // No memfd (fd limit, memory): the bytes still go, inline.
    log().warn("payload of {} bytes sent inline: {}", msg.data.size(), e.what());
  }
}

bool Router::charge_fds(Link& in, Message& m) {
  const std::size_t n = m.fds.size() + (m.sealed_body ? 1 : 0);
  if (n == 0) return true;
  std::size_t before = in.fds_in_flight->fetch_add(n, std::memory_order_relaxed);
  if (before + n > opts_.fd_quota) {
    in.fds_in_flight->fetch_sub(n, std::memory_order_relaxed);
    std::string why = fmt::format("{}: context {} has {} fds in flight via stream {} (quota {}, this message {})",
                                  reason::kFdQuota, m.header.src_id, before, in.stream->name(),
                                  opts_.fd_quota, n);
    note_refusal(in, reason::kFdQuota, [&] { return why; });
    send_dead(m.header, why);
    return false;
  }
  m.fds = std::move(m.fds).with_charge(std::make_shared<FdCharge>(in.fds_in_flight, n));
  return true;
}

// Mapped without MAP_POPULATE: this runs on the broker thread, and a
// handler may read a page of the body (a service call's envelope names its
// service on the first one) or none of it. Populating faulted in every page
// here first, so a client's sparse body within its allowance cost the router
// that much page cache and its loop tens of milliseconds per 100 MiB. Now
// whoever reads the bytes faults them in, on its own thread.
bool Router::map_sealed_body(Message& m) {
  try {
    m.data = m.sealed_body->map();
  } catch (const std::system_error& e) {
    send_dead(m.header, fmt::format("{}: {}", reason::kBadMemfd, e.what()));
    return false;
  }
  m.sealed_body.reset();
  return true;
}

void Router::on_stream_refused(Stream& s, Message&& m, Refused where, const std::string& why) {
  // A local sender's message refused on the way out, or a frame refused on
  // arrival: either way the reply goes to its src_id, routed as usual (and
  // without reply_to, send_dead counts it). A frame refused on arrival is
  // refused before on_stream_frame() checked who it claims to come from, so
  // that claim is checked here first: a forged src_id would otherwise route
  // the dead reply to a context that never sent the frame, and fail its call
  // (the reverse-path check answers a forgery on the link it came in on).
  // The log line is the link's refusal summary, at most one a second: a peer
  // that sends a refusable frame in a loop must not write one line per frame.
  Link* l = link_of(s);
  if (where == Refused::kOnArrival && l && !reverse_path_ok(*l, m.header)) return;
  auto what = [&] {
    return fmt::format("message from context {} to context {} handle {}: {}", m.header.src_id,
                       m.header.dst_id, m.header.handle, why);
  };
  if (l) note_refusal(*l, "undeliverable SF frame", what);
  else log().warn("stream={} {}", s.name(), what());
  send_dead(m.header, why);
}

}  // namespace spindle
