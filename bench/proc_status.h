// What /proc says about another process's memory, for the benches that
// report a router's RSS beside their figures (bench_router, bench_forks).
#pragma once

#include <sys/types.h>

#include <cstdlib>
#include <fstream>
#include <string>

namespace spindle::bench {

// A field of /proc/<pid>/status in KiB (-1 if absent).
inline long status_kib(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + ":", 0) == 0) return std::atol(line.c_str() + key.size() + 1);
  return -1;
}

// Resets VmHWM to the current RSS (Linux >= 4.0), so the next reading is
// the peak since now. False if the kernel refused.
inline bool reset_peak_rss(pid_t pid) {
  std::ofstream f("/proc/" + std::to_string(pid) + "/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace spindle::bench
