// Router services: typed calls to the services every spindle-router hosts
// (docs/ROUTER.md), for a client that reaches the router through
// Connection::router_context().
//
//   spindle::Connection me = spindle::Connection::open(socket);
//   std::string pong = spindle::router_ping(me.router_context(), "hello");   // "hello"
//   std::string stats = spindle::router_stats(me.router_context());
//
// Their wire format predates typed calls: ping.echo and stats.get take and
// return raw bytes (a raw service call, not the msgpack envelope flag), so
// they are functions here rather than spindle::method constants, and a
// typed call to them would be refused. Both throw as a call does: CallError,
// ChannelError (e.g. stats.get refused by the router's policy to a client
// of another uid), TimeoutError, ShutdownError.
//
// Thread safety: any thread but the broker's (they block). Ownership: none.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include <spindle/context.h>

namespace spindle {

// ping.echo: returns `text` unchanged, after a round trip through the
// router's service pool.
std::string router_ping(const Context& router, std::string_view text = "ping",
                        std::chrono::milliseconds timeout = Context::kDefaultTimeout);
// stats.get: the router's snapshot, one line per record ("router id=0 pid=..."
// then "client id=I name=S ..."), as `spindle-ctl stats --raw` prints it.
// Each value is a number or a token without spaces (docs/ROUTER.md).
std::string router_stats(const Context& router,
                         std::chrono::milliseconds timeout = Context::kDefaultTimeout);

}  // namespace spindle
