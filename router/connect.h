// connect(): a Connection to a spindle-router from an address string, for
// the project's tools and tests (users call Connection::open).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "router/router.h"
#include "router/unix_address.h"
#include "spindle/connection.h"

namespace spindle {

// Connects to `address` ("@name" for abstract; empty for the per-user default)
// within `timeout`.
std::unique_ptr<Connection> connect(const std::string& address = {}, RouterOptions opts = {},
                                    std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));

}  // namespace spindle
