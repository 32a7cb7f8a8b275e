// The cost of starting one child context from a parent that has grown
// (bench_forks' second part, issue #12 §4). fork_child() copies the parent as
// it is now: page tables for all its memory, a parked broker. A Zygote
// (router/zygote.h) forks a copy of the parent taken when it was small. Each
// child is timed from the request until its first call is answered, so the
// figure is what a user waits for before the child is of use. The floor is a
// raw fork()+_exit()+waitpid() of the small process, measured by the caller
// before it grew.
//
// Thread safety: one thread. Ownership: the children it starts are shut down
// and reaped before it returns.
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <cstring>
#include <string_view>
#include <vector>

#include "bench/report.h"
#include "broker/broker.h"
#include "router/child.h"
#include "router/router.h"
#include "router/zygote.h"

namespace spindle::bench {

inline constexpr std::uint32_t kChildStartEcho = 2500;

inline int child_start_echo(ChildEnv& env, std::string_view) {
  Router& r = env.router();
  r.add_handler([&r](Message&& m) { r.reply(m, std::move(m.data)); }, {}, kChildStartEcho);
  env.serve();
  return 0;
}

struct ChildStartResult {
  double fork_child_ms = 0, zygote_ms = 0;  // median per child, until its first answer
  int failures = 0;                         // children that did not answer or exit 0
};

// Grows this process by `parent_mib` of touched heap, then starts `children`
// children each way, one at a time, alternating.
inline ChildStartResult measure_child_start(Zygote& zygote, std::size_t parent_mib, int children) {
  using Clock = std::chrono::steady_clock;
  std::vector<char> heap(parent_mib << 20);
  std::memset(heap.data(), 1, heap.size());
  Broker broker;
  RouterOptions ro;
  ro.name = "child-start";
  Router router(broker, ro);
  ChildStartResult res;
  std::vector<double> forked, zygoted;
  std::vector<Context> started;
  auto start_one = [&](bool via_zygote) {
    const auto t0 = Clock::now();
    try {
      Context c = via_zygote ? zygote.fork_child(router, child_start_echo)
                             : fork_child(router, [](ChildEnv& env) { return child_start_echo(env, {}); });
      c.call(kChildStartEcho, std::string_view("x"), std::chrono::seconds(30));
      (via_zygote ? zygoted : forked)
          .push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      started.push_back(std::move(c));
    } catch (const std::exception&) {
      ++res.failures;
    }
  };
  for (int i = 0; i < children; ++i) {
    start_one(false);
    start_one(true);
  }
  for (Context& c : started) c.shutdown();
  for (Context& c : started) {
    auto st = c.wait_exit(std::chrono::seconds(30));
    if (!st || !WIFEXITED(*st) || WEXITSTATUS(*st) != 0) ++res.failures;
  }
  res.fork_child_ms = percentiles(forked).median;
  res.zygote_ms = percentiles(zygoted).median;
  return res;
}

}  // namespace spindle::bench
