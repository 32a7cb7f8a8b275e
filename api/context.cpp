// Every operation is inside the router link's gate for its whole length (see
// router/router_link.h): a destroyed runtime is a ShutdownError, never a
// dangling Router*. Typed calls are CALL_SERVICE requests whose envelope
// carries the msgpack flag; the name splits at its last dot into service and
// method (a bare name belongs to kDefaultService).
#include "spindle/context.h"

#include <mutex>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/process.h"
#include "router/router.h"
#include "services/envelope.h"

namespace spindle {
namespace {

// Runs fn(router) while the router is held alive.
template <class Fn>
decltype(auto) with_router(const std::shared_ptr<detail::RouterLink>& link, std::uint32_t id, Fn&& fn) {
  if (!link) throw ShutdownError(fmt::format("context {}: this Context refers to no runtime", id));
  SectionGate::Scope inside(link->gate);
  if (!inside) throw ShutdownError(fmt::format("context {}: its runtime has been destroyed", id));
  return fn(*link->router.load(std::memory_order_relaxed));
}

Message typed_request(std::uint32_t dst, std::string_view name, Payload args) {
  std::string_view service = kDefaultService, method = name;
  if (auto dot = name.rfind('.'); dot != std::string_view::npos) {
    service = name.substr(0, dot);
    method = name.substr(dot + 1);
  }
  FdSet fds = detail::fds_of(args);  // UniqueFd arguments (codec.h)
  Message m = Message::make(dst, kHandleCallService,
                            services::encode_call(service, method, std::move(args),
                                                  services::kEnvelopeMsgpack));
  m.fds = std::move(fds);
  return m;
}

}  // namespace

Context::Context(Router& router, std::uint32_t id, std::string name,
                 std::shared_ptr<ChildProcess> process)
    : link_(router.link()), id_(id), name_(std::move(name)), process_(std::move(process)) {}

pid_t Context::pid() const { return process_ ? process_->pid() : 0; }

Context Context::with_timeout(std::chrono::milliseconds timeout) const {
  Context c = *this;
  c.timeout_ = timeout;
  return c;
}

Router& Context::router() const {
  return with_router(link_, id_, [](Router& r) -> Router& { return r; });
}

void Context::start_call(std::string_view name, Payload args, CallCompletion done) const {
  Message m = typed_request(id_, name, std::move(args));
  with_router(link_, id_, [&](Router& r) {
    r.request(std::move(m), timeout_,
              [done = std::move(done)](Message&& reply, std::exception_ptr error) mutable {
                done(error, error ? Payload{} : std::move(reply.data));
              });
  });
}

Payload Context::call_named(std::string_view name, Payload args) const {
  Message m = typed_request(id_, name, std::move(args));
  return with_router(link_, id_, [&](Router& r) { return r.call(std::move(m), timeout_).data; });
}

std::future<Message> Context::call_async(std::uint32_t handle, Payload data,
                                         std::chrono::milliseconds timeout) const {
  return with_router(link_, id_, [&](Router& r) {
    return r.request(Message::make(id_, handle, std::move(data)), timeout);
  });
}

Payload Context::call(std::uint32_t handle, Payload data, std::chrono::milliseconds timeout) const {
  return with_router(link_, id_, [&](Router& r) {
    return r.call(Message::make(id_, handle, std::move(data)), timeout).data;
  });
}

std::string Context::call(std::uint32_t handle, std::string_view data,
                          std::chrono::milliseconds timeout) const {
  return call(handle, Payload::copy_of(data), timeout).to_string();
}

void Context::send(std::uint32_t handle, Payload data) const {
  with_router(link_, id_, [&](Router& r) { r.send(Message::make(id_, handle, std::move(data))); });
}

void Context::send(std::uint32_t handle, std::string_view bytes) const {
  // Copied straight into the send queue (or written at once): no Payload,
  // no allocation.
  const std::span<const std::uint8_t> view(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                                           bytes.size());
  with_router(link_, id_, [&](Router& r) { r.send(id_, handle, view); });
}

void Context::shutdown() const {
  with_router(link_, id_,
              [&](Router& r) { r.send(Message::make(id_, kHandleShutdown, {}, kEncMitogen)); });
}

std::optional<int> Context::wait_exit(std::chrono::milliseconds timeout) const {
  if (!process_) throw Error(fmt::format("context {} is not a child process of this one", id_));
  return process_->wait(timeout);
}

}  // namespace spindle
