// A WakeWord is a private futex: FUTEX_WAIT with a relative timeout computed
// from the deadline, FUTEX_WAKE of one waiter. Private futexes never cross a
// process, so a forked child sleeping on its copy of a word is never woken by
// the parent (it has no reason to sleep on one anyway).
#include "services/futex.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>

#include "broker/errors.h"
#include "broker/log.h"
#include "broker/poll_history.h"

namespace spindle::services {
namespace {

// The spin-wait hint of the CPU: lets a hyperthread sibling run, and costs
// the loop a few dozen cycles rather than a bus lock per look.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace

bool WakeWord::wait(std::uint32_t expected, std::chrono::steady_clock::time_point deadline,
                    std::chrono::nanoseconds poll) {
  using namespace std::chrono;
  if (deadline != steady_clock::time_point::max() && deadline <= steady_clock::now()) return false;
  // A hand-off that comes within a few microseconds (a producer that posts
  // in bursts, a reply already on its way) is taken without sleeping: the
  // waker, seeing no kAsleep mark, makes no syscall either, and the thread
  // keeps its CPU. Bounded, so an idle waiter burns next to nothing: a few
  // pauses, then a few yields, which also let a waker on this CPU run.
  for (int i = 0; i < kSpinPauses + kSpinYields; ++i) {
    if (word_.load(std::memory_order_seq_cst) != expected) return true;
    if (i < kSpinPauses) cpu_relax();
    else sched_yield();
  }
  // Then, with a window, a longer look (yielding between looks).
  const steady_clock::time_point began = poll.count() > 0 ? steady_clock::now() : steady_clock::time_point{};
  if (const nanoseconds window = poll_history::window(poll); window.count() > 0) {
    const steady_clock::time_point until = std::min(began + window, deadline);
    bool answered = false;
    while (!(answered = word_.load(std::memory_order_seq_cst) != expected) && steady_clock::now() < until)
      sched_yield();
    poll_history::polled(answered);
    if (answered) {
      poll_history::answered_after(steady_clock::now() - began);
      return true;
    }
  }
  timespec ts{};
  timespec* tsp = nullptr;
  if (deadline != steady_clock::time_point::max()) {
    auto left = deadline - steady_clock::now();
    if (left <= nanoseconds::zero()) return false;
    auto s = duration_cast<seconds>(left);
    ts.tv_sec = static_cast<time_t>(s.count());
    ts.tv_nsec = static_cast<long>(duration_cast<nanoseconds>(left - s).count());
    tsp = &ts;
  }
  // Announce the sleep; a value stored meanwhile ends the wait at once.
  std::uint32_t w = expected;
  if (!word_.compare_exchange_strong(w, expected | kAsleep, std::memory_order_seq_cst) && w != (expected | kAsleep))
    return true;
  long rc = ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word_), FUTEX_WAIT_PRIVATE,
                      expected | kAsleep, tsp, nullptr, 0);
  int err = rc == 0 ? 0 : errno;
  // Awake: take the mark back unless a waker already replaced the word.
  w = expected | kAsleep;
  word_.compare_exchange_strong(w, expected, std::memory_order_relaxed);
  if (poll.count() > 0 && word_.load(std::memory_order_relaxed) != expected)
    poll_history::answered_after(steady_clock::now() - began);
  if (rc == 0) return true;
  if (err == ETIMEDOUT) return steady_clock::now() < deadline;
  // EAGAIN: the word changed before we slept; EINTR: a signal. Both re-check.
  if (err != EAGAIN && err != EINTR) log().error("futex wait failed: {}", errno_text(err));
  return true;
}

void WakeWord::set_and_wake(std::uint32_t value) {
  // seq_cst: a waiter that runs the broker's loop instead of sleeping looks
  // at the word after it takes the loop, and a waker from another thread
  // looks at the loop after this store (lanes.cpp, wake_all).
  if ((word_.exchange(value, std::memory_order_seq_cst) & kAsleep) == 0) return;  // nobody sleeps
  // The result is ignored on purpose: once the value is stored, a waiter that
  // woke spuriously may already have returned and left the word's frame, so
  // this wake can land on a stale address. That is harmless (it wakes nobody,
  // or a thread that re-checks its own word and sleeps again), and an EFAULT
  // would say nothing about this waiter.
  (void)::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word_), FUTEX_WAKE_PRIVATE, 1,
                  nullptr, nullptr, 0);
}

}  // namespace spindle::services
