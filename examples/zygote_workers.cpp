// zygote_workers: children forked from a zygote, so that a parent that has
// grown (here: a 256 MiB table it loaded) does not pay for its size at every
// child, and its children do not hold that memory.
//
// The zygote is started first thing in main, while the process is small.
// Each worker is a plain function that gets its shard name as bytes; the
// parent calls every worker, prints what each reports (its shard, its parent
// pid, its resident memory), stops them and prints their exit statuses.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "broker/log.h"
#include "router/zygote.h"

namespace {
constexpr std::uint32_t kReport = 2000;

long resident_kib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  return -1;
}

// A worker: runs in the child, on the child's main thread.
int worker(spindle::ChildEnv& env, std::string_view shard) {
  auto& r = env.router();
  r.add_handler(
      [&r, shard = std::string(shard)](spindle::Message&& m) {
        r.reply(m, spindle::Payload::copy_of(fmt::format("shard {} pid {} parent {} resident {} KiB", shard,
                                                         ::getpid(), ::getppid(), resident_kib())));
      },
      {}, kReport);
  env.serve();
  return 0;
}
}  // namespace

int main() {
  auto zygote = spindle::Zygote::start();  // first: the process is still small

  std::vector<char> table(256u << 20);  // the parent grows
  std::memset(table.data(), 7, table.size());

  spindle::Broker broker;
  spindle::Router router(broker, spindle::RouterOptions{.name = "parent"});
  std::vector<spindle::Context> workers;
  for (int i = 0; i < 4; ++i)
    workers.push_back(zygote->fork_child(router, worker, fmt::format("s{}", i), {.name = fmt::format("worker-{}", i), .router = {}}));

  std::printf("parent pid %d, resident %ld KiB\n", ::getpid(), resident_kib());
  for (auto& w : workers) std::printf("%s: %s\n", w.name().c_str(), w.call(kReport, std::string_view{}).c_str());
  for (auto& w : workers) w.shutdown();
  int failures = 0;
  for (auto& w : workers) {
    auto st = w.wait_exit(std::chrono::seconds(10));
    std::printf("%s (pid %d): %s\n", w.name().c_str(), w.pid(),
                st ? spindle::describe_wait_status(*st).c_str() : "did not exit in time");
    if (!st || *st != 0) ++failures;
  }
  return failures == 0 && table[12345] == 7 ? 0 : 1;
}
