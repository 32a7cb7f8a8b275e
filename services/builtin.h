// The services every spindle-router hosts.
//
//   ping.echo   (any caller)   returns its argument bytes unchanged: a
//                              round trip through the router and its pool.
//   stats.get   (parents: the router itself, or a same-uid client acting
//                with its authority)  a snapshot, one record per line:
//     router id=0 pid=P fds=F clients=N routed=R delivered=D dead_replies=X
//            accepted=A refused_uid=U refused_full=F refused_no_fds=E
//            memory_held=B memory_peak=B memory_limit=B routes=R
//            departures=N departure_steps=S
//     client id=I name=S dialect=spindle|mitogen pid=P uid=U messages_in=..
//            messages_out=.. bytes_in=.. bytes_out=.. queued_bytes=..
//            memory_held=B memory_peak=B paused=0|1
//   memory_* are the accounts of docs/PROTOCOL.md §14, in bytes; a peak is
//   the most held at once since the router (or the client) started.
//   clients counts every client link, handshaking ones included.
//   departures counts the links that closed; departure_steps the entries
//   their teardowns visited (RouterStats: O(what each link owned)).
//   Every value is a number or a token without spaces, so the format is
//   both readable and trivially parsed (spindle-ctl, tests, shell scripts).
//
// Thread safety: the methods run on pool workers; make_*() on any thread.
// Ownership: the returned services borrow the Router (and the Listener, if
// given), which must outlive the ServiceHost that owns them.
#pragma once

#include <memory>
#include <string>

#include "router/listener.h"
#include "services/service.h"

namespace spindle::services {

inline constexpr const char* kPingService = "ping";
inline constexpr const char* kPingMethod = "echo";
inline constexpr const char* kStatsService = "stats";
inline constexpr const char* kStatsMethod = "get";

std::unique_ptr<Service> make_ping_service();
std::unique_ptr<Service> make_stats_service(Router& router, Listener* listener);
// The stats text for `router` (and its listener, if any), as stats.get returns it.
std::string format_stats(Router& router, Listener* listener);

}  // namespace spindle::services
