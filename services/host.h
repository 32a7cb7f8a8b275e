// ServiceHost: serves CALL_SERVICE (110) on a Router with a Pool's workers.
//
// Role: registers handle 110 on the router. On the thread that receives a
// request (the broker for a peer's, the caller's own for a local call) it
// only reads the envelope's names (bounded) and hands the request to the
// service's lane in the pool: a malformed envelope or an unknown service is
// answered there with a dead reply naming it. On a worker it finds the
// method, checks its policy (an unknown method or a refusal: dead reply),
// and runs it under the service's mode (service.h). Requests that arrive
// once the pool is stopping get a dead "shutting down" reply.
//
// Each service is a lane of its own, so the pool's fairness rule holds per
// service: one busy service cannot starve the others.
//
// Usage:
//   Broker broker; Router router(broker);
//   services::Pool pool({.threads = 4});
//   services::ServiceHost host(router, pool);
//   auto svc = std::make_unique<services::Service>("echo");
//   svc->expose("say", services::Access::any(),
//               [](services::Request& r) { return r.args(); });
//   host.add(std::move(svc));
//
// Thread safety: every member is safe from any thread.
// Ownership: owns its services; borrows the Router and the Pool, which must
// outlive it. Attaches the pool to the router's broker (if it is not yet
// attached), so a broker shutdown stops the pool first. Destroying the host
// stops the pool (a service's methods cannot outlive the service), which
// runs each service's on_shutdown.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "router/router.h"
#include "services/pool.h"
#include "services/service.h"

namespace spindle::services {

struct HostStats {
  std::uint64_t received = 0;  // requests on handle 110
  std::uint64_t answered = 0;  // methods run (result, deferred or CallError)
  std::uint64_t rejected = 0;  // dead replies: malformed, unknown, refused, shutting down
};

class ServiceHost {
 public:
  // `initial` services are hosted before handle 110 is registered, so no
  // request can find the host without them.
  ServiceHost(Router& router, Pool& pool, std::vector<std::unique_ptr<Service>> initial = {});
  ~ServiceHost();
  ServiceHost(const ServiceHost&) = delete;
  ServiceHost& operator=(const ServiceHost&) = delete;

  // Throws Error if a service of that name is already hosted.
  Service& add(std::unique_ptr<Service> service);
  Service* find(std::string_view name) const;
  std::vector<std::string> names() const;
  HostStats stats() const;
  Router& router() const { return router_; }

 private:
  struct Entry {
    std::unique_ptr<Service> service;
    Lane* lane = nullptr;
  };
  // The thread that received the request: the broker, or a local caller.
  void on_request(Message&& m);
  void run(Service& svc, Message&& m);    // worker
  void reject(const Message& m, std::string_view why);

  Router& router_;
  Pool& pool_;
  mutable std::mutex mu_;
  std::map<std::string, Entry, std::less<>> services_;
  std::uint32_t handle_ = 0;
  std::atomic<std::uint64_t> received_{0}, answered_{0}, rejected_{0};
  // A local caller may be inside on_request() on its own thread while the
  // host is destroyed: the handler holds this gate (which outlives the
  // host), and the destructor closes it and waits for those inside.
  struct Entrance {
    std::atomic<int> inside{0};
    std::atomic<bool> closed{false};
  };
  std::shared_ptr<Entrance> entrance_ = std::make_shared<Entrance>();
};

}  // namespace spindle::services
