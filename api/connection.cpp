// A Connection is the fork_child machinery seen from the other side: the same
// Router::attach_parent handshake, over a socket this process dialled rather
// than one its parent handed it. The router speaks the Spindle dialect to it
// (a "SPDL" hello and welcome); a refusal arrives as the router's reason.
// Names and find() are typed calls to the router's names service
// (services/names.h).
#include "spindle/connection.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "broker/broker.h"
#include "broker/errors.h"
#include "broker/log.h"
#include "router/connect.h"
#include "router/router.h"
#include "router/unix_address.h"

namespace spindle {
namespace {

inline constexpr method<void(std::string)> names_register{"names.register"};
inline constexpr method<std::vector<std::tuple<std::uint32_t, std::string>>(std::string)> names_find{
    "names.find"};

std::vector<Context> contexts_of(Router& r, const std::vector<std::tuple<std::uint32_t, std::string>>& found) {
  std::vector<Context> out;
  out.reserve(found.size());
  for (auto& [id, name] : found) out.emplace_back(r, id, name);
  return out;
}

}  // namespace

Connection Connection::open(const std::string& socket, ConnectOptions opts) {
  opts.router.handshake_timeout = std::min(opts.router.handshake_timeout, opts.timeout);
  if (opts.router.name.empty()) opts.router.name = opts.name;
  Connection c(std::move(opts.router));
  // A named client is there to be found: what others send it before it
  // serves waits (bounded) instead of being refused as "invalid handle".
  if (!opts.name.empty()) c.router_->hold_unknown_handles(true);
  c.connect(socket.empty() ? default_router_address() : UnixAddress::parse(socket), opts.timeout);
  if (!opts.name.empty()) c.register_name(opts.name);
  return c;
}

Connection::Connection(RouterOptions opts)
    : broker_(std::make_unique<Broker>(Broker::options_for(opts))),
      router_(std::make_unique<Router>(*broker_, std::move(opts))) {}

Connection::Connection(Connection&&) noexcept = default;

Connection& Connection::operator=(Connection&& o) noexcept {
  if (this != &o) {
    this->~Connection();
    new (this) Connection(std::move(o));
  }
  return *this;
}

Connection::~Connection() {
  // noexcept. On its own broker thread (dropped inside a handler) it cannot
  // join that thread, nor free what the thread is running on: it begins the
  // shutdown and hands everything to a thread that joins the broker, then
  // frees it in order (what serves on the router, the router, the broker).
  if (broker_ && broker_->on_broker_thread()) {
    broker_->shutdown();
    std::thread([e = std::move(env_), r = std::move(router_), b = std::move(broker_)]() mutable {
      b->join();
      e.reset();
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
  env_.reset();  // before the router it serves on
}

std::uint32_t Connection::id() const { return router_->id(); }

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

void Connection::register_name(std::string_view name) {
  router_context().with_timeout(std::chrono::milliseconds(10000)).call(names_register, std::string(name));
}

std::vector<Context> Connection::find(std::string_view pattern) const {
  return contexts_of(*router_, router_context().call(names_find, std::string(pattern)));
}

std::future<std::vector<Context>> Connection::async_find(std::string_view pattern) const {
  auto promise = std::make_shared<std::promise<std::vector<Context>>>();
  auto f = promise->get_future();
  start_find(pattern, [promise](std::exception_ptr error, std::vector<Context> found) {
    if (error) promise->set_exception(error);
    else promise->set_value(std::move(found));
  });
  return f;
}

void Connection::start_find(std::string_view pattern, FindCompletion done) const {
  // Shared, so that the completion survives a start_call that throws (the
  // runtime gone, a full queue) and still runs exactly once.
  struct Once {
    std::atomic<bool> ran{false};
    FindCompletion done;
    void operator()(std::exception_ptr error, std::vector<Context> found) {
      if (!ran.exchange(true)) done(error, std::move(found));
    }
  };
  auto once = std::make_shared<Once>();
  once->done = std::move(done);
  try {
    if (!router_) throw ShutdownError("this Connection has been moved from");
    Router* r = router_.get();  // alive while the completion can run
    router_context().start_call(
        names_find.name(), detail::encode_args<std::string>(std::string(pattern)),
        [r, once](std::exception_ptr error, Payload bytes) {
          std::vector<Context> found;
          if (!error) {
            try {
              found = contexts_of(*r, detail::decode_value<std::vector<std::tuple<std::uint32_t, std::string>>>(bytes));
            } catch (...) {
              error = std::current_exception();
            }
          }
          (*once)(error, std::move(found));
        });
  } catch (...) {  // not sent: complete with why, as a call does; never throw
    (*once)(std::current_exception(), {});
  }
}

Context Connection::router_context() const {
  auto parent = router_->parent_id();
  if (!parent) throw Error("not connected to a spindle-router");
  return Context(*router_, *parent, "spindle-router");
}

Context Connection::context(std::uint32_t id, std::string name) const {
  return Context(*router_, id, name.empty() ? fmt::format("client-{}", id) : std::move(name));
}

ChildEnv& Connection::env() {
  if (!env_) env_ = std::make_unique<ChildEnv>(*router_, *broker_);
  return *env_;
}

}  // namespace spindle
