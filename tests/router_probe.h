// Looking at a running spindle-router from outside: its open fds and clients
// through its stats service, its resident memory through /proc, and a polling
// helper. Shared by the forks-scaling, fault, hostile-input and load tests.
//
// Thread safety: free functions; router_counts() connects a client of its own.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "router/connect.h"
#include "services/builtin.h"
#include "services/client.h"

namespace spindle::testutil {

// The router's open fds and clients, as its stats service reports them while
// the probe itself is connected (so both include the probe's own socket).
struct RouterCounts {
  long fds = -1, clients = -1;
  bool operator==(const RouterCounts&) const = default;
};

inline RouterCounts router_counts(const std::string& socket) {
  RouterOptions ro;
  ro.name = "stats-probe";
  auto c = connect(socket, ro);
  std::string text = services::call_text(c->router_context(), services::kStatsService,
                                         services::kStatsMethod, {}, std::chrono::seconds(30));
  auto field = [&](const char* key) {
    auto at = text.find(key);
    return at == std::string::npos ? -1L : std::atol(text.c_str() + at + std::strlen(key));
  };
  return {field(" fds="), field(" clients=")};
}

// Polls until `pred` holds, for at most `timeout`.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  auto until = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// A process's resident set (VmRSS in /proc/<pid>/status), in KiB; -1 if gone.
inline long vm_rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  return -1;
}

}  // namespace spindle::testutil
