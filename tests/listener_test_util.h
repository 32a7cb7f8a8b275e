// Helpers for the listener and spindle-router tests: an in-process root
// router with a Listener on a private temp directory (process_util.h has the
// rest).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "broker/errors.h"
#include "router/connect.h"
#include "router/listener.h"
#include "tests/process_util.h"
#include "tests/router_test_util.h"


namespace spindle::testutil {

// A root router in this process, listening on <tempdir>/router.sock.
class InProcessRouter {
 public:
  explicit InProcessRouter(ListenerOptions lo = {}, RouterOptions ro = root_opts("router")) {
    broker_ = std::make_unique<Broker>();
    router_ = std::make_unique<Router>(*broker_, ro);
    if (lo.address.name.empty()) lo.address = UnixAddress{dir_.path() + "/router.sock", false};
    lo.accept_systemd_socket = false;
    address_ = lo.address;
    listener_ = Listener::open(*router_, lo);
    listener_->start();
  }
  ~InProcessRouter() {
    listener_.reset();
    router_.reset();
  }
  Router& router() { return *router_; }
  Listener& listener() { return *listener_; }
  const UnixAddress& address() const { return address_; }
  const std::string& dir() const { return dir_.path(); }
  int raw_connect() const { return connect_unix(address_); }
  // A connected client; `setup` registers handlers before the handshake.
  std::unique_ptr<Connection> client(const std::function<void(Router&)>& setup = {},
                                     RouterOptions ro = {}) const {
    auto c = std::make_unique<Connection>(std::move(ro));
    if (setup) setup(c->router());
    c->connect(address_);
    return c;
  }

 private:
  TempDir dir_;
  std::unique_ptr<Broker> broker_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<Listener> listener_;
  UnixAddress address_;
};

}  // namespace spindle::testutil
