// Helpers shared by the router and RPC tests (real forked children).
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <cstdint>
#include <string>
#include <string_view>

#include <gtest/gtest.h>

#include "router/child.h"
#include "router/router.h"

namespace spindle::testutil {

inline bool contains(const std::string& hay, std::string_view needle) {
  return hay.find(needle) != std::string::npos;
}

inline ChildOptions named(std::string name) {
  ChildOptions o;
  o.name = std::move(name);
  return o;
}

inline RouterOptions root_opts(std::string name = "root") {
  RouterOptions o;
  o.name = std::move(name);
  return o;
}

// Waits for a child and checks it exited with `code`.
inline void expect_exit_code(const Context& c, int code) {
  auto st = c.wait_exit(std::chrono::seconds(10));
  ASSERT_TRUE(st.has_value()) << c.name() << " did not exit";
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == code)
      << c.name() << ": " << describe_wait_status(*st) << ", expected exit status " << code;
}

// Handlers run on the broker thread and must not block. A test handler that
// needs a blocking call hands it to a thread of its own here; join_all()
// (also run by the destructor) waits for every one, including any started
// while it waits.
class OffBrokerThreads {
 public:
  ~OffBrokerThreads() { join_all(); }
  void run(std::function<void()> fn) {
    std::lock_guard lk(mu_);
    threads_.emplace_back(std::move(fn));
  }
  void join_all() {
    for (;;) {
      std::vector<std::thread> ws;
      {
        std::lock_guard lk(mu_);
        ws.swap(threads_);
      }
      if (ws.empty()) return;
      for (auto& t : ws) t.join();
    }
  }

 private:
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

}  // namespace spindle::testutil
