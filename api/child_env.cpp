// ChildEnv's exposed functions are services on the one mechanism every
// service uses (services/host.h): a ServiceHost on handle 110 hands each
// call to a lane of a Pool. With serve(), the pool has no thread of its own:
// serve() lends it the calling thread (PoolOptions::caller_thread), so the
// functions run one at a time, in arrival order, on main's thread, and a
// SHUTDOWN from the parent stops the pool, which ends serve(). With
// serve(Pool{n}), the pool has n workers and the services are concurrent;
// the calling thread waits for the shutdown request, then stops the pool
// (calls in flight get its stop deadline to finish). A name "svc.fn" is
// method fn of service svc; a bare name belongs to kDefaultService. Fd
// arguments decode from the request's fd set (detail::ReceivedFds).
#include "spindle/child.h"

#include <algorithm>
#include <map>
#include <vector>

#include <fmt/format.h>

#include "broker/broker.h"
#include "broker/errors.h"
#include "broker/log.h"
#include "router/router.h"
#include "services/host.h"
#include "services/pool.h"
#include "services/service.h"

namespace spindle {
namespace detail {

struct Exposed {
  struct Fn {
    std::string method;
    Allow allow;
    std::function<Payload(const Payload&)> fn;
    bool on_receiver = false;
  };
  std::map<std::string, std::vector<Fn>, std::less<>> services;
  // Destroyed host first: it stops the pool it borrows.
  std::unique_ptr<services::Pool> pool;
  std::unique_ptr<services::ServiceHost> host;
};

}  // namespace detail

ChildEnv::ChildEnv(Router& router, Broker& broker) : router_(router), broker_(broker) {}
ChildEnv::~ChildEnv() = default;

std::uint32_t ChildEnv::id() const { return router_.id(); }

Context ChildEnv::parent() {
  auto pid = router_.parent_id();
  if (!pid) throw Error("this context has no parent");
  return Context(router_, *pid, "parent");
}

void ChildEnv::ready() {
  // Functions are exposed but not served yet: what callers send them waits
  // for serve(), which declares readiness once its host is registered.
  // (Released here, a call that came between ready() and serve() was
  // answered "invalid handle: 110": python.test_router failed so once.)
  if (exposed_ && !exposed_->host && broker_.accepting()) return;
  router_.hold_unknown_handles(false);
}

void ChildEnv::expose_encoded(std::string_view name, Allow allow,
                              std::function<Payload(const Payload&)> fn) {
  add_exposed(name, allow, std::move(fn), false);
}

void ChildEnv::add_exposed(std::string_view name, Allow allow, std::function<Payload(const Payload&)> fn,
                           bool on_receiver) {
  if (exposed_ && exposed_->host) throw Error(fmt::format("expose({}): serve() has already begun", name));
  std::string_view service = kDefaultService, method = name;
  if (auto dot = name.rfind('.'); dot != std::string_view::npos) {
    service = name.substr(0, dot);
    method = name.substr(dot + 1);
  }
  if (service.empty() || method.empty())
    throw Error(fmt::format("expose: '{}' is not a method name (\"fn\" or \"service.fn\")", name));
  if (!exposed_) exposed_ = std::make_shared<detail::Exposed>();
  auto& fns = exposed_->services[std::string(service)];
  for (auto& f : fns)
    if (f.method == method) throw Error(fmt::format("expose: {} is already exposed", name));
  fns.push_back({std::string(method), allow, std::move(fn), on_receiver});
}

void ChildEnv::expose_on_receiver(std::string_view name, Allow allow,
                                  std::function<Payload(const Payload&)> fn) {
  add_exposed(name, allow, std::move(fn), true);
}

int ChildEnv::serve() { return serve_on(0); }

int ChildEnv::serve(Pool pool) {
  if (pool.threads < 1 || pool.threads > services::Pool::kMaxThreads)
    throw Error(fmt::format("serve(Pool{{.threads = {}}}): threads must be 1..{}", pool.threads,
                            services::Pool::kMaxThreads));
  return serve_on(pool.threads);
}

int ChildEnv::serve_on(std::size_t threads) {
  if (!exposed_) {  // nothing exposed: only handlers registered on the router
    ready();
    broker_.wait_for_shutdown_request();
    return 0;
  }
  auto& ex = *exposed_;
  if (ex.host) throw Error("serve() was already called");
  if (!broker_.accepting()) {  // SHUTDOWN came before serve(): nothing to serve
    ready();
    return 0;
  }
  const bool here = threads == 0;
  ex.pool = std::make_unique<services::Pool>(services::PoolOptions{
      .threads = here ? 1 : threads, .name = "serve", .caller_thread = here});
  std::vector<std::unique_ptr<services::Service>> services;
  for (auto& [name, fns] : ex.services) {
    auto svc = std::make_unique<services::Service>(
        name, here ? services::RunMode::kSerialized : services::RunMode::kConcurrent);
    for (auto& f : fns) {
      auto access = f.allow == Allow::kAnyone ? services::Access::any()
                    : f.allow == Allow::kUpstream
                        ? services::Access::when("parent and above",
                                                 [r = &router_](const services::Caller& c) {
                                                   return c.auth_id == c.self_id || r->is_ancestor(c.auth_id);
                                                 })
                        : services::Access::parents();
      svc->expose(f.method, std::move(access),
                  [fn = f.fn](services::Request& req) {
                    detail::ReceivedFds fds(req.message().fds);  // for UniqueFd arguments
                    detail::CallingContext caller(req.caller().auth_id);
                    return fn(req.args());
                  },
                  services::Encoding::kMsgpack, f.on_receiver && !here);
    }
    services.push_back(std::move(svc));
  }
  try {
    ex.host = std::make_unique<services::ServiceHost>(router_, *ex.pool, std::move(services));
  } catch (const ShutdownError&) {  // the broker stopped meanwhile
    ready();
    return 0;
  }
  // SHUTDOWN (or the parent's loss) stops the pool, which ends serve_here.
  broker_.on_shutdown_request([ex = exposed_] { ex->pool->request_stop(); });
  ready();
  if (here) {
    ex.pool->serve_here();
  } else {
    broker_.wait_for_shutdown_request();
    ex.pool->stop();  // joins the workers; calls in flight get the stop deadline
  }
  return 0;
}

FdPolicy FdPolicy::close_all_except(std::vector<int> keep) {
  for (int fd : keep)
    if (fd < 0) throw Error(fmt::format("FdPolicy::close_all_except: {} is not an fd", fd));
  std::sort(keep.begin(), keep.end());
  keep.erase(std::unique(keep.begin(), keep.end()), keep.end());
  return FdPolicy(Kind::kCloseAllExcept, std::move(keep));
}

Child& Child::operator=(Child&& o) noexcept {
  if (this != &o) {
    stop();
    static_cast<Context&>(*this) = std::move(static_cast<Context&>(o));
    grace_ = o.grace_;
    status_ = o.status_;
    stopped_ = o.stopped_;
  }
  return *this;
}

Child::~Child() { stop(); }

int Child::stop() noexcept {
  const auto& proc = process();
  if (!proc || stopped_) return status_;
  bool on_broker = false;
  try {
    Router& r = router();
    on_broker = r.broker().on_broker_thread();
    // A child that is gone already (killed, crashed) has no link left to
    // tell: SHUTDOWN would only be dropped, with a warning about an
    // undeliverable message, when a program closes after a worker died.
    if (r.routed_through(id(), id())) shutdown();
  } catch (const std::exception& e) {
    // The runtime is gone (its broker reaped the child) or the link is:
    // the steps below still reap it.
    log().debug("child {} ({}): SHUTDOWN not sent: {}", name(), id(), e.what());
  }
  if (on_broker) return -1;  // never block the broker: it reaps the child itself
  try {
    status_ = proc->finish(grace_);
    stopped_ = true;
    return status_;
  } catch (const std::exception& e) {
    log().error("child {} ({}): cannot reap pid {}: {}", name(), id(), proc->pid(), e.what());
    return -1;
  }
}

}  // namespace spindle
