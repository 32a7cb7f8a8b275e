// Looking at a running spindle-router from outside: its open fds and clients
// through its stats service, its resident memory and its peak through /proc,
// and a polling helper. Shared by the forks-scaling, fault, hostile-input and load tests.
//
// Thread safety: free functions; router_counts() connects a client of its own.
#pragma once

#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <string_view>
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

// The stats service's text, through a client of the probe's own.
inline std::string router_stats_text(const std::string& socket) {
  RouterOptions ro;
  ro.name = "stats-probe";
  auto c = connect(socket, ro);
  return services::call_text(c->router_context(), services::kStatsService, services::kStatsMethod, {},
                             std::chrono::seconds(30));
}

// The first value of `key` (" memory_peak=") in a stats text; -1 if absent.
inline long long stats_field(const std::string& text, const char* key) {
  auto at = text.find(key);
  return at == std::string::npos ? -1LL : std::atoll(text.c_str() + at + std::strlen(key));
}

inline RouterCounts router_counts(const std::string& socket) {
  std::string text = router_stats_text(socket);
  return {static_cast<long>(stats_field(text, " fds=")), static_cast<long>(stats_field(text, " clients="))};
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

// Whether a process's resident set measures what its code holds. Under a
// sanitizer it does not: ASan keeps freed blocks in a quarantine (256 MiB by
// default) and pads every allocation, TSan shadows the heap several times
// over. Tests bound the router's own accounting (memory_peak) in every build
// and its resident set only where that is meaningful.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kRssIsMeaningful = false;
#else
inline constexpr bool kRssIsMeaningful = true;
#endif

// A field of /proc/<pid>/status in KiB ("VmRSS:", "VmHWM:"); -1 if gone.
inline long proc_status_kib(pid_t pid, std::string_view field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::atol(line.c_str() + field.size());
  return -1;
}

// A process's resident set (VmRSS), in KiB; -1 if gone.
inline long vm_rss_kib(pid_t pid) { return proc_status_kib(pid, "VmRSS:"); }

// A process's peak resident set since it started (VmHWM), in KiB; -1 if gone.
inline long vm_hwm_kib(pid_t pid) { return proc_status_kib(pid, "VmHWM:"); }

// Resets this process's VmHWM to its current RSS (Linux's clear_refs "5"),
// so that a test can measure the peak of one step.
inline bool reset_peak_rss() {
  int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = ::write(fd, "5", 1) == 1;
  return ::close(fd) == 0 && ok;
}

}  // namespace spindle::testutil
