// parent_child: a parent forks 4 children, calls each, and prints the results.
//
// Each child serves two handlers: SQUARE squares a number, WHOAMI describes
// the child. The parent calls both on every child concurrently, shows that a
// remote exception arrives as CallError, asks the children to shut down, and
// prints their exit statuses.
#include <unistd.h>

#include <cstdio>
#include <future>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/child.h"

namespace {
constexpr std::uint32_t kSquare = 2000;
constexpr std::uint32_t kWhoAmI = 2001;

int child_main(spindle::ChildEnv& env) {
  auto& r = env.router();
  r.add_handler(
      [&r](spindle::Message&& m) {
        long n = std::stol(m.text());  // throws std::invalid_argument on bad input
        r.reply(m, spindle::Payload::copy_of(std::to_string(n * n)));
      },
      {}, kSquare);
  r.add_handler(
      [&r](spindle::Message&& m) {
        r.reply(m, spindle::Payload::copy_of(
                       fmt::format("context {} pid {} parent {}", r.id(), ::getpid(), *r.parent_id())));
      },
      {}, kWhoAmI);
  spindle::log().info("ready to serve");
  env.serve();
  return 0;
}

// Forks the children, calls them, and stops them; 0 if all exited cleanly.
int run() {
  spindle::Broker broker;
  spindle::RouterOptions opts;
  opts.name = "parent";
  spindle::Router router(broker, opts);

  std::vector<spindle::Context> children;
  for (int i = 0; i < 4; ++i)
    children.push_back(spindle::fork_child(router, child_main, {.name = fmt::format("worker-{}", i), .router = {}}));

  std::vector<std::future<spindle::Message>> squares;
  for (std::size_t i = 0; i < children.size(); ++i)
    squares.push_back(children[i].call_async(kSquare, spindle::Payload::copy_of(std::to_string(7 + i))));
  for (std::size_t i = 0; i < children.size(); ++i) {
    std::string who = children[i].call(kWhoAmI, std::string_view{});
    std::printf("%-9s %-40s square(%zu) = %s\n", children[i].name().c_str(), who.c_str(), 7 + i,
                squares[i].get().text().c_str());
  }
  try {
    children[0].call(kSquare, std::string_view("not a number"));
  } catch (const spindle::CallError& e) {
    std::printf("remote exception arrived as CallError: %s\n", e.what());
  }
  for (auto& c : children) c.shutdown();
  int failures = 0;
  for (auto& c : children) {
    auto st = c.wait_exit(std::chrono::seconds(10));
    std::printf("%s (pid %d): %s\n", c.name().c_str(), c.pid(),
                st ? spindle::describe_wait_status(*st).c_str() : "did not exit in time");
    if (!st || *st != 0) ++failures;
  }
  return failures == 0 ? 0 : 1;
}
}  // namespace

int main() {
  spindle::set_log_level_from_env();
  try {
    return run();
  } catch (const std::exception& e) {  // a child that died or never came up
    std::fprintf(stderr, "parent_child: %s\n", e.what());
    return 1;
  }
}
