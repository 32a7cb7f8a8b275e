// Helpers shared by the services tests: a root context with a pool and a
// host, a gate that blocks handlers until the test opens it, and waiting for
// a condition with a generous hang guard (never a timing assertion).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "broker/errors.h"
#include "spindle/context.h"
#include "router/router.h"
#include "services/client.h"
#include "services/host.h"
#include "services/pool.h"
#include "services/service.h"

namespace spindle::testutil {

// Polls `cond` until true; fails the test if it is not within the hang guard.
inline bool eventually(const std::function<bool()>& cond,
                       std::chrono::milliseconds guard = std::chrono::seconds(20)) {
  auto until = std::chrono::steady_clock::now() + guard;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

class Gate {
 public:
  void open() {
    std::lock_guard lk(mu_);
    open_ = true;
    cv_.notify_all();
  }
  // Returns false if the hang guard ran out first.
  bool wait(std::chrono::milliseconds guard = std::chrono::seconds(20)) {
    std::unique_lock lk(mu_);
    ++waiting_;
    bool opened = cv_.wait_for(lk, guard, [&] { return open_; });
    --waiting_;
    return opened;
  }
  // Threads inside wait(): a handler that blocks here has started. (The
  // pool's `running` counts a message from the moment it is handed to a
  // worker, which may not have woken yet.)
  int waiting() {
    std::lock_guard lk(mu_);
    return waiting_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  int waiting_ = 0;
};

inline services::PoolOptions pool_of(std::size_t threads,
                                     std::chrono::milliseconds deadline = std::chrono::seconds(5)) {
  services::PoolOptions o;
  o.threads = threads;
  o.name = "test";
  o.stop_deadline = deadline;
  return o;
}

// A root context serving services on a pool; `self` calls them in-process.
struct ServiceRig {
  explicit ServiceRig(std::size_t threads, std::chrono::milliseconds deadline = std::chrono::seconds(5))
      : router(broker, RouterOptions{.name = "root"}), pool(pool_of(threads, deadline)),
        host(router, pool), self(router, router.id(), "self") {}
  services::Service& add(std::unique_ptr<services::Service> s) { return host.add(std::move(s)); }
  Broker broker;
  Router router;
  services::Pool pool;
  services::ServiceHost host;
  Context self;
};

// The reason of the dead reply a call got, or "" if it did not get one.
inline std::string dead_reason(const std::function<void()>& call) {
  try {
    call();
  } catch (const ChannelError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception: ") + e.what();
  }
  return "";
}

}  // namespace spindle::testutil
