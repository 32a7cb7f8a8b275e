// SummaryLog: a log line that a peer can cause as often as it writes (a
// rejected request, a handler that threw on its arguments), written at most
// once a second, with the count of those it stands for. A line per event
// would let a peer fill the disk and the log pipe at no cost to itself.
//
// Thread safety: note() from any thread. Atomics only, no lock: a fork() at
// any moment leaves it usable in the child.
// Ownership: usually a function-local static per kind of line.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "broker/log.h"

namespace spindle {

class SummaryLog {
 public:
  explicit SummaryLog(spdlog::level::level_enum level = spdlog::level::info) : level_(level) {}

  // Counts one event; when the last line is a second old, logs the line
  // make_line() returns, with how many events it stands for.
  template <class MakeLine>
  void note(MakeLine&& make_line) {
    count_.fetch_add(1, std::memory_order_relaxed);
    const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now().time_since_epoch())
                                 .count();
    std::int64_t last = logged_ns_.load(std::memory_order_relaxed);
    if (last != 0 && now - last < kIntervalNs) return;
    if (!logged_ns_.compare_exchange_strong(last, now, std::memory_order_relaxed)) return;
    const std::uint64_t n = count_.exchange(0, std::memory_order_relaxed);
    const std::string line = make_line();
    if (n > 1) log().log(level_, "{} (1 of {} such in the last second)", line, n);
    else log().log(level_, "{}", line);
  }

 private:
  static constexpr std::int64_t kIntervalNs = 1'000'000'000;
  const spdlog::level::level_enum level_;
  std::atomic<std::uint64_t> count_{0};
  std::atomic<std::int64_t> logged_ns_{0};
};

}  // namespace spindle
