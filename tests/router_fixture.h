// RouterFixture: a real spindle-router process in a temporary directory and
// one well-behaved client ("good"), for the tests that play a hostile peer
// against the router (test_hostile.cpp, test_hardening.cpp). Raw clients
// come from raw_client(); each test ends by checking that the good client is
// still served.
//
// Thread safety: the test's own thread. Ownership: owns the router process,
// its directory and the good client.
#pragma once

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "router/connect.h"
#include "router/unix_address.h"
#include "services/builtin.h"
#include "services/client.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/router_probe.h"
#include "tests/router_test_util.h"

namespace spindle::testutil {

class RouterFixture : public ::testing::Test {
 protected:
  // Starts the router with `extra` flags (logging at info) and connects the
  // good client.
  void start(std::vector<std::string> extra = {}) {
    extra.insert(extra.end(), {"--log-level", "info"});
    router_ = std::make_unique<RouterProcess>(SPINDLE_ROUTER_BINARY, socket(), extra);
    ASSERT_TRUE(router_->wait_ready()) << router_->log();
    RouterOptions ro;
    ro.name = "good";
    good_ = connect(socket(), ro);
  }
  std::string socket() const { return dir_.path() + "/router.sock"; }
  UnixAddress address() const { return UnixAddress::parse(socket()); }
  // A raw client that has completed the Spindle handshake; its id is id_.
  RawPeer raw_client(std::uint16_t flags = kFlagNone) {
    RawPeer p = RawPeer::connect_to(address());
    id_ = p.handshake(flags);
    return p;
  }
  // The good client still gets answers from the router's ping service.
  void expect_served(const std::string& after) {
    std::string text = "alive after " + after;
    EXPECT_EQ(services::call_text(good_->router_context(), services::kPingService,
                                  services::kPingMethod, text, std::chrono::seconds(20)),
              text)
        << router_->log();
  }
  // The stats line of client `id` ("" if it is not connected).
  std::string client_line(std::uint32_t id) {
    std::istringstream in(router_stats_text(socket()));
    std::string line, want = "client id=" + std::to_string(id) + " ";
    while (std::getline(in, line))
      if (line.rfind(want, 0) == 0) return line;
    return {};
  }
  // Waits until the router's log holds `needle`.
  bool logged(std::string_view needle, std::chrono::milliseconds t = std::chrono::seconds(20)) {
    return eventually([&] { return contains(router_->log(), needle); }, t);
  }

  TempDir dir_;
  std::unique_ptr<RouterProcess> router_;
  std::unique_ptr<Connection> good_;
  std::uint32_t id_ = 0;  // the last raw client's id
};

}  // namespace spindle::testutil
