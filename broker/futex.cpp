#include "broker/futex.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>

namespace spindle::futex {

bool wait(std::atomic<std::uint32_t>& word, std::uint32_t expected,
          std::chrono::steady_clock::time_point deadline) {
  using namespace std::chrono;
  timespec ts{};
  timespec* tsp = nullptr;
  if (deadline != steady_clock::time_point::max()) {
    auto left = deadline - steady_clock::now();
    if (left <= steady_clock::duration::zero()) return false;
    auto s = duration_cast<seconds>(left);
    ts.tv_sec = static_cast<time_t>(s.count());
    ts.tv_nsec = static_cast<long>(duration_cast<nanoseconds>(left - s).count());
    tsp = &ts;
  }
  long r = ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE,
                     expected, tsp, nullptr, 0);
  if (r < 0 && errno == ETIMEDOUT) return false;
  return true;
}

void wake(std::atomic<std::uint32_t>& word, int n) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, n, nullptr,
            nullptr, 0);
}

}  // namespace spindle::futex
