// connect() is Connection::connect with the address parsed and the default
// filled in.
#include "router/connect.h"

#include <algorithm>

namespace spindle {

std::unique_ptr<Connection> connect(const std::string& address, RouterOptions opts,
                                    std::chrono::milliseconds timeout) {
  opts.handshake_timeout = std::min(opts.handshake_timeout, timeout);
  auto c = std::make_unique<Connection>(std::move(opts));
  c->connect(address.empty() ? default_router_address() : UnixAddress::parse(address), timeout);
  return c;
}

}  // namespace spindle
