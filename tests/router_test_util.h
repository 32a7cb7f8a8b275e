// Helpers shared by the router and RPC tests (real forked children).
#pragma once

#include <sys/wait.h>

#include <chrono>
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

}  // namespace spindle::testutil
