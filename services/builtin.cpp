// ping and stats are ordinary services: they go through the same envelope,
// policy check and pool as any user's, so a ping measures exactly the path a
// real service call takes. Stats are gathered on the broker thread (the
// Router's and Listener's own snapshots) and formatted on the worker.
#include "services/builtin.h"

#include <dirent.h>
#include <unistd.h>

#include <fmt/format.h>

namespace spindle::services {
namespace {

// Open fds of this process (without the one that lists them), or -1.
long open_fds() {
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return -1;
  long n = 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n - 1;
}

}  // namespace

std::unique_ptr<Service> make_ping_service() {
  auto s = std::make_unique<Service>(kPingService);
  s->expose(kPingMethod, Access::any(), [](Request& r) { return r.args(); });
  return s;
}

std::string format_stats(Router& router, Listener* listener) {
  RouterStats rs = router.stats();
  std::vector<ClientStats> clients = router.client_stats();
  ListenerStats ls = listener ? listener->stats() : ListenerStats{};
  std::string out = fmt::format(
      "router id={} pid={} fds={} clients={} routed={} delivered={} dead_replies={} accepted={} "
      "refused_uid={} refused_full={} refused_no_fds={} memory_held={} memory_peak={} memory_limit={} "
      "routes={} departures={} departure_steps={} fds_held={} fd_limit={} state_held={} state_limit={}\n",
      router.id(), ::getpid(), open_fds(), clients.size(), rs.routed, rs.delivered_locally, rs.dead_replies,
      ls.accepted, ls.refused_uid, ls.refused_full, ls.refused_no_fds, rs.memory_held, rs.memory_peak,
      rs.memory_limit, rs.routes, rs.departures, rs.departure_steps, rs.fds_held, rs.fd_limit, rs.state_held,
      rs.state_limit);
  for (const ClientStats& c : clients)
    out += fmt::format(
        "client id={} name={} dialect={} pid={} uid={} messages_in={} messages_out={} "
        "bytes_in={} bytes_out={} queued_bytes={} memory_held={} memory_peak={} paused={} held={} "
        "holds={} fds_held={} state_held={}\n",
        c.id, c.name, c.dialect == Dialect::kMitogen ? "mitogen" : "spindle", c.pid, c.uid,
        c.messages_in, c.messages_out, c.bytes_in, c.bytes_out, c.queued_bytes, c.memory_held,
        c.memory_peak, c.paused ? 1 : 0, c.held ? 1 : 0, c.holds, c.fds_held, c.state_held);
  return out;
}

std::unique_ptr<Service> make_stats_service(Router& router, Listener* listener) {
  auto s = std::make_unique<Service>(kStatsService);
  // The stats name every client's pid, uid and traffic: only the router
  // itself and clients of its own uid may read them, not one admitted with
  // --allow-uid (docs/ROUTER.md). Every client keeps its own auth_id
  // (PROTOCOL.md 7.3.1), so the caller's uid is its link's. The check is a
  // lookup: a refused caller costs the broker nothing (it used to gather
  // every client's stats on the broker thread for each call, twice for an
  // admitted one).
  auto same_uid = Access::when("the router or a same-uid client", [&router](const Caller& c) {
    if (c.auth_id == c.self_id) return true;
    auto uid = router.client_uid(c.auth_id);
    return uid && *uid == ::geteuid();
  });
  s->expose(kStatsMethod, std::move(same_uid), [&router, listener](Request&) {
    return Payload::copy_of(format_stats(router, listener));
  });
  return s;
}

}  // namespace spindle::services
