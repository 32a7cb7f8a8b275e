// SummaryLog: a log line that a peer can cause as often as it writes (a
// rejected request, a handler that threw on its arguments), written at most
// `burst` times a second (once, by default), the next one with the count of
// those it stands for. A line per event would let a peer fill the disk and
// the log pipe at no cost to itself. A burst above one keeps lines that are
// worth reading one by one at an honest rate (a client connecting) while a
// flood of them costs a line a second.
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
  explicit SummaryLog(spdlog::level::level_enum level = spdlog::level::info, std::uint32_t burst = 1)
      : level_(level), burst_(burst == 0 ? 1 : burst) {}

  // Counts one event; logs the line make_line() returns if fewer than
  // `burst` were logged in this second, else only counts it. The first
  // line of the next second says how many were not logged.
  template <class MakeLine>
  void note(MakeLine&& make_line) {
    const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now().time_since_epoch())
                                 .count();
    std::int64_t start = window_ns_.load(std::memory_order_relaxed);
    if ((start == 0 || now - start >= kIntervalNs) &&
        window_ns_.compare_exchange_strong(start, now, std::memory_order_relaxed)) {
      in_window_.store(1, std::memory_order_relaxed);
      const std::uint64_t n = suppressed_.exchange(0, std::memory_order_relaxed) + 1;
      const std::string line = make_line();
      if (n > 1) log().log(level_, "{} (1 of {} such in the last second)", line, n);
      else log().log(level_, "{}", line);
      return;
    }
    if (in_window_.fetch_add(1, std::memory_order_relaxed) < burst_) {
      log().log(level_, "{}", make_line());
      return;
    }
    suppressed_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  static constexpr std::int64_t kIntervalNs = 1'000'000'000;
  const spdlog::level::level_enum level_;
  const std::uint32_t burst_;
  std::atomic<std::int64_t> window_ns_{0};   // when this second's first line was logged
  std::atomic<std::uint32_t> in_window_{0};  // events noted in it
  std::atomic<std::uint64_t> suppressed_{0};  // not logged since
};

}  // namespace spindle
