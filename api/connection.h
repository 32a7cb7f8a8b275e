// Connection: this process as a client of a spindle-router.
//
//   auto conn = spindle::Connection::open("", {.name = "upper-1"});  // the per-user router
//   conn.expose(upper, [](std::string s) { ... }, spindle::Allow::kAnyone);
//   conn.serve();                                       // until the router goes
//
//   auto conn = spindle::Connection::open();
//   for (spindle::Context w : conn.find("upper-*")) w.call(upper, "hi");
//
// Role: owns a broker and a router whose parent is the spindle-router at the
// end of a UNIX socket. Once connected, this context has an id the router
// assigned; it reaches every other client by id or by name (find), and the
// router's services. Names are registered with the router's names service
// (docs/ROUTER.md): unique among living clients, gone when the client goes.
// It serves typed functions as a child does (expose, serve): by default only
// its parent, the router, may call them; Allow::kAnyone opens them to the
// other clients.
//
// If the router goes away, every pending call fails at once with "peer
// disconnected" and the broker shuts down: a client does not outlive its
// router link, as a child does not outlive its parent.
//
// Thread safety: open(), close() and the destructor on any thread (dropped
// on its own broker thread, inside a handler, it hands its teardown to a
// thread of its own). find() and the Contexts it returns as Context.
// Ownership: owns its broker and router; Contexts made from it refer to them
// through a link and throw ShutdownError once the Connection is gone.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <spindle/child.h>
#include <spindle/context.h>
#include <spindle/function.h>
#include <spindle/method.h>
#include <spindle/options.h>

namespace spindle {

class Broker;
struct UnixAddress;

// The completion of Connection::start_find: (nullptr, contexts) or (error, {}).
using FindCompletion = UniqueFunction<void(std::exception_ptr, std::vector<Context>)>;

struct ConnectOptions {
  std::string name;  // registered with the router's names service; empty: none
  std::chrono::milliseconds timeout{10000};  // connect, handshake and registration
  RouterOptions router;                      // this client's router settings
};

class Connection {
 public:
  // Connects to `socket` ("@name" for an abstract address; empty for the
  // per-user default) and, if opts.name is set, registers that name. A
  // named client is there to be found: messages for handlers it has not
  // registered yet wait (up to its high-water mark, each fd they carry
  // counted as 8 KiB) until serve() or ready(), instead of being refused as
  // "invalid handle".
  // Throws Error: cannot connect, not a router of ours, refused (with the
  // router's reason), timed out, or the name is invalid or taken.
  static Connection open(const std::string& socket = {}, ConnectOptions opts = {});

  explicit Connection(RouterOptions opts = {});
  ~Connection();
  Connection(Connection&&) noexcept;
  Connection& operator=(Connection&&) noexcept;
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  std::uint32_t id() const;
  // The contexts whose registered names match the glob `pattern` (* ? []),
  // sorted by name.
  std::vector<Context> find(std::string_view pattern) const;
  std::future<std::vector<Context>> async_find(std::string_view pattern) const;
  // With an Asio completion token, signature void(std::exception_ptr,
  // std::vector<Context>); defined in <spindle/asio.h> and
  // <spindle/boost_asio.h>. Like any I/O object's, this Connection must
  // outlive the operation's start (with deferred: until it is launched).
  template <class Token>
  auto async_find(std::string_view pattern, Token&& token) const;
  // The initiation seam under both: `done` runs exactly once, on the broker
  // thread, with the contexts found or the error (ShutdownError once the
  // Connection is closed, Error when not connected).
  void start_find(std::string_view pattern, FindCompletion done) const;
  // Names this client (once per connection; open() does it for opts.name).
  void register_name(std::string_view name);
  // The spindle-router's own context (it hosts the services).
  Context router_context() const;
  // Another client, by the id the router assigned it.
  Context context(std::uint32_t id, std::string name = {}) const;

  // Typed functions this client serves, as ChildEnv's.
  template <class R, class... A, class F>
  void expose(const method<R(A...)>& m, F fn, Allow allow = Allow::kParent) {
    env().expose(m, std::move(fn), allow);
  }
  // Runs exposed functions on this thread until the link to the router is
  // lost or close() is called from another thread. Returns 0.
  int serve() { return env().serve(); }
  // The same, on pool.threads workers of their own, concurrently (ChildEnv).
  int serve(Pool pool) { return env().serve(pool); }
  // Declares the handlers registered without serving (see open()).
  void ready() { env().ready(); }

  // Connects and completes the handshake within `timeout`, checking the
  // server first (its uid, its directory).
  void connect(const UnixAddress& address, std::chrono::milliseconds timeout = std::chrono::milliseconds(10000));
  // Graceful: queued messages are flushed, then the link closes. Idempotent.
  void close(std::chrono::milliseconds grace = std::chrono::milliseconds(5000));

  // Internal: the machinery underneath, for the project's own tests.
  Router& router() { return *router_; }
  Broker& broker() { return *broker_; }

 private:
  ChildEnv& env();

  std::unique_ptr<Broker> broker_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<ChildEnv> env_;  // made on first expose()
};

}  // namespace spindle
