// zygote_workers: children forked from a zygote, so that a parent that has
// grown (here: a 256 MiB table it loaded) does not pay for its size at every
// child, and its children do not hold that memory.
//
// The zygote is started first thing in main, while the process is small.
// Each worker is a plain function that gets its shard name as bytes and
// serves the typed function `report`; the parent calls every worker, prints
// what each reports (its shard, its parent pid, its resident memory), stops
// them and prints their exit statuses. Exit status 0 only if every worker
// is this process's child, holds far less than the table, and exited 0.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include <spindle/spindle.h>

namespace {

struct Report {
  std::string shard;
  long pid = 0;
  long parent = 0;
  long resident_kib = 0;
  MSGPACK_DEFINE_MAP(shard, pid, parent, resident_kib)
};

inline constexpr spindle::method<Report()> report{"report"};

long resident_kib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  return -1;
}

// A worker: runs in the child, on the child's main thread. A plain function,
// not a closure: the zygote's copy of this process has no later objects.
int worker(spindle::ChildEnv& env, std::string_view shard) {
  env.expose(report, [shard = std::string(shard)] {
    return Report{shard, ::getpid(), ::getppid(), resident_kib()};
  });
  return env.serve();
}

}  // namespace

int main() {
  auto zygote = spindle::Zygote::start();  // first: the process is still small

  std::vector<char> table(256u << 20);  // the parent grows
  std::memset(table.data(), 7, table.size());

  spindle::Runtime rt({.name = "parent"});
  std::vector<spindle::Child> workers;
  for (int i = 0; i < 4; ++i)
    workers.push_back(zygote->fork_child(rt, worker, "s" + std::to_string(i),
                                         {.name = "worker-" + std::to_string(i)}));

  int failures = 0;
  const long mine = resident_kib();
  std::printf("parent pid %d, resident %ld KiB\n", ::getpid(), mine);
  for (auto& w : workers) {
    Report r = w.call(report);
    std::printf("%s: shard %s pid %ld parent %ld resident %ld KiB\n", w.name().c_str(), r.shard.c_str(),
                r.pid, r.parent, r.resident_kib);
    if (r.parent != ::getpid() || r.pid != w.pid()) ++failures;  // our child, not the zygote's
    if (r.resident_kib <= 0 || r.resident_kib >= (256 << 10) / 2) ++failures;  // no copy of the table
  }
  for (auto& w : workers) {
    int st = w.stop();  // SHUTDOWN, grace, reap
    std::printf("%s (pid %d): %s\n", w.name().c_str(), w.pid(),
                WIFEXITED(st) ? ("exit " + std::to_string(WEXITSTATUS(st))).c_str() : "did not exit cleanly");
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ++failures;
  }
  return failures == 0 && table[12345] == 7 ? 0 : 1;
}
