// Connection: this process as a client of a spindle-router.
//
// Role: owns a Broker and a Router whose parent is the spindle-router at the
// end of a UNIX socket. Once connected, this context has an id assigned by the
// router and can reach every other client by id (Context, Router::send), the
// router's services, and whatever the router's --unidirectional setting allows.
// Register handlers on router() before connect(): a sibling may send the
// moment the handshake completes, and a message for an unknown handle is
// answered "invalid handle".
//
// If the router goes away, every pending call fails at once with "peer
// disconnected" and the broker shuts down (a client does not outlive its
// router link, as a child does not outlive its parent).
//
// Thread safety: connect(), the destructor and close() on any thread but the
// broker's; router() and its members as documented there.
// Ownership: owns its Broker and Router; Contexts made from it borrow the Router.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "router/router.h"
#include "spindle/context.h"
#include "router/unix_address.h"

namespace spindle {

class Connection {
 public:
  explicit Connection(RouterOptions opts = {});
  ~Connection();  // close() with the broker's default grace
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Connects and completes the handshake within `timeout` (and the router
  // options' handshake_timeout). Checks the server first (unix_address.h:
  // its uid, its directory). Throws Error: cannot connect, not a router of
  // ours, refused (with the router's reason), or timed out.
  void connect(const UnixAddress& address,
               std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));
  // Graceful: queued messages are flushed, then the link closes. Idempotent.
  void close(std::chrono::milliseconds grace = std::chrono::milliseconds(5000));

  Router& router() { return *router_; }
  Broker& broker() { return *broker_; }
  std::uint32_t id() const { return router_->id(); }
  // The spindle-router's own context (it hosts the services).
  Context router_context() const;
  // Another client, by the id the router assigned it.
  Context context(std::uint32_t id, std::string name = {}) const;

 private:
  std::unique_ptr<Broker> broker_;
  std::unique_ptr<Router> router_;
};

// Connects to `address` ("@name" for abstract; empty for the per-user default)
// within `timeout`.
std::unique_ptr<Connection> connect(const std::string& address = {}, RouterOptions opts = {},
                                    std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));

}  // namespace spindle
