// A Connection is the fork_child machinery seen from the other side: the same
// Router::attach_parent handshake, over a socket this process dialled rather
// than one its parent handed it. The router speaks the Spindle dialect to it
// (a "SPDL" hello and welcome); a refusal arrives as the router's reason.
#include "router/connect.h"

#include <thread>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"

namespace spindle {

Connection::Connection(RouterOptions opts)
    : broker_(std::make_unique<Broker>()),
      router_(std::make_unique<Router>(*broker_, std::move(opts))) {}

Connection::~Connection() {
  // noexcept. On its own broker thread (dropped inside a handler) it cannot
  // join that thread, nor free what the thread is running on: it begins the
  // shutdown and hands both to a thread that joins the broker, then frees
  // them.
  if (broker_ && broker_->on_broker_thread()) {
    broker_->shutdown();
    std::thread([r = std::move(router_), b = std::move(broker_)]() mutable {
      b->join();
      r.reset();
      b.reset();
    }).detach();
    return;
  }
  try {
    close();
  } catch (const std::exception& e) {
    log().error("Connection: close failed: {}", e.what());
  }
}

void Connection::connect(const UnixAddress& address, std::chrono::milliseconds timeout) {
  if (router_->parent_id()) throw Error("this Connection is already connected");
  int fd = connect_unix(address, timeout);
  try {
    router_->attach_parent(fd, fd);
  } catch (const Error& e) {
    throw Error(fmt::format("spindle-router at {}: {}", address.to_string(), e.what()));
  }
}

void Connection::close(std::chrono::milliseconds grace) {
  if (!broker_) return;
  if (broker_->on_broker_thread()) throw Error("Connection::close() on its own broker thread");
  broker_->shutdown(grace);
  broker_->join();
}

Context Connection::router_context() const {
  auto parent = router_->parent_id();
  if (!parent) throw Error("not connected to a spindle-router");
  return Context(*router_, *parent, "spindle-router");
}

Context Connection::context(std::uint32_t id, std::string name) const {
  return Context(*router_, id, name.empty() ? fmt::format("client-{}", id) : std::move(name));
}

std::unique_ptr<Connection> connect(const std::string& address, RouterOptions opts,
                                    std::chrono::milliseconds timeout) {
  opts.handshake_timeout = std::min(opts.handshake_timeout, timeout);
  auto c = std::make_unique<Connection>(std::move(opts));
  c->connect(address.empty() ? default_router_address() : UnixAddress::parse(address), timeout);
  return c;
}

}  // namespace spindle
