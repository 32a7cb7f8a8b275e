// SchedulerProbe: what the kernel alone gives a process while a bench loads
// the machine. A child process, in a session of its own (so, with autogroup
// scheduling, a group of its own, as a service would be), sleeps 1 ms at a
// time and records how late each wake-up came. Its oversleep is the floor of
// any round trip measured in the same run: a router or client that waits
// for the CPU as long as this sleeper did was delayed by the scheduler, not
// by its own work.
//
// Thread safety: start() before the process starts any thread (it forks);
// stop() once, from the same thread. Ownership: owns the child (PipedChild).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "bench/piped_child.h"
#include "bench/report.h"
#include "broker/errors.h"

namespace spindle::bench {

class SchedulerProbe {
 public:
  struct Result {
    std::size_t samples = 0;
    double p99_ms = 0, max_ms = 0;
  };

  void start() { child_.fork(run_child); }

  // Ends the child's sampling; its figures, or an Error.
  Result stop() {
    if (!child_.forked()) return {};
    const std::string bytes = child_.finish();  // EOF: the child writes its figures
    Result r;
    if (bytes.size() != sizeof r) throw Error("the scheduler probe ended without its figures");
    std::memcpy(&r, bytes.data(), sizeof r);
    return r;
  }

 private:
  [[noreturn]] static void run_child(int ctl, int out) {
    ::setsid();
    using Clock = std::chrono::steady_clock;
    std::vector<double> late_ms;
    late_ms.reserve(1 << 18);
    for (;;) {
      pollfd pf{ctl, POLLIN, 0};
      const auto t0 = Clock::now();
      int r = ::poll(&pf, 1, 1);
      if (r < 0 && errno == EINTR) continue;
      if (r != 0) break;  // EOF on ctl: the bench is done
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      late_ms.push_back(ms > 1 ? ms - 1 : 0);
    }
    Result res;
    res.samples = late_ms.size();
    for (double v : late_ms) res.max_ms = std::max(res.max_ms, v);
    res.p99_ms = percentiles(std::move(late_ms)).p99;
    ssize_t w = ::write(out, &res, sizeof res);
    ::_exit(w == static_cast<ssize_t>(sizeof res) ? 0 : 1);
  }

  PipedChild child_;
};

}  // namespace spindle::bench
