// WakeWord (services/futex.h): a waker pays a FUTEX_WAKE only when the waiter
// is really asleep; a waiter that leads the broker's loop instead costs none.
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "services/futex.h"
#include "tests/seccomp_util.h"
#include "tests/stream_test_util.h"

namespace spindle::services {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST(WakeWord, ASetWithNobodyAsleepMakesNoFutexCall) {
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    WakeWord w;
    if (!testutil::forbid_syscall(SYS_futex)) ::_exit(testutil::kNoSeccomp);
    w.set_and_wake(1);
    ::_exit(w.load() == 1 ? 0 : 2);
  }
  const std::string outcome = testutil::child_outcome(pid);
  if (outcome == "skip") GTEST_SKIP() << "seccomp is not available here";
  EXPECT_EQ(outcome, "");
}

TEST(WakeWord, ASleeperIsWokenAndSeesTheValue) {
  WakeWord w;
  std::atomic<bool> returned{false};
  std::uint32_t seen = 99;
  std::thread t([&] {
    const auto deadline = Clock::now() + 10s;
    while (w.load() == 0 && Clock::now() < deadline) w.wait(0, deadline);
    seen = w.load();
    returned = true;
  });
  std::this_thread::sleep_for(30ms);  // most likely asleep by now; either way it must see the value
  EXPECT_FALSE(returned.load());
  w.set_and_wake(1);
  t.join();
  EXPECT_EQ(seen, 1u);
}

TEST(WakeWord, AValueStoredBeforeTheWaitEndsItAtOnce) {
  WakeWord w;
  w.set_and_wake(2);
  const auto t0 = Clock::now();
  EXPECT_TRUE(w.wait(0, Clock::now() + 10s));
  EXPECT_LT(Clock::now() - t0, 5s);
  EXPECT_EQ(w.load(), 2u);
}

TEST(WakeWord, ATimedOutWaitLeavesTheWordAsItWas) {
  WakeWord w;
  const auto deadline = Clock::now() + 20ms;
  int wakes = 0;
  while (w.wait(0, deadline) && wakes < 1000) ++wakes;  // true: spurious, look again
  EXPECT_LT(wakes, 1000);
  EXPECT_EQ(w.load(), 0u);
  EXPECT_FALSE(WakeWord::is_set(&w)) << "the sleeper's mark was left in the word";
  w.set_and_wake(1);
  EXPECT_TRUE(WakeWord::is_set(&w));
}

// With a poll window, a value stored while the waiter polls costs the waker
// no FUTEX_WAKE: in a child whose storing thread may not make the call,
// the store goes through and the waiter returns with it.
TEST(WakeWord, AValueStoredWithinThePollWindowCostsTheWakerNoFutexCall) {
#if defined(__SANITIZE_THREAD__)
  // TSan's runtime takes futex-backed locks of its own when two threads
  // touch one atomic at once (the waiter polls the word the store writes).
  GTEST_SKIP() << "under TSan the runtime's own locks make futex calls";
#endif
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    WakeWord w;
    std::atomic<bool> polling{false};
    // The waiter ends the process once it has the value (a join would
    // wait on a futex); the storing thread only stores, then pauses.
    std::thread waiter([&] {
      polling = true;
      const bool woke = w.wait(0, Clock::now() + 20s, 10s);
      ::_exit(woke && w.load() == 1 ? 0 : 2);
    });
    while (!polling.load()) std::this_thread::yield();
    std::this_thread::sleep_for(20ms);  // well inside the 10 s window
    if (!testutil::forbid_syscall(SYS_futex)) ::_exit(testutil::kNoSeccomp);
    w.set_and_wake(1);
    for (;;) ::pause();
  }
  const std::string outcome = testutil::child_outcome(pid);
  if (outcome == "skip") GTEST_SKIP() << "seccomp is not available here";
  EXPECT_EQ(outcome, "");
}

// Windows that end unanswered four times in a row make the thread sleep at
// once for its next waits (broker/poll_history.h), so a waiter whose work
// comes seldom does not poll for nothing: the fifth wait sleeps. It is
// given 200 ms: with 5 ms, a loaded machine (CI's tests two at a time)
// could spend them in the short spin's sched_yield()s before any wait
// began, and the wait returned at its deadline without sleeping (20 of
// 100 runs beside three busy loops).
TEST(WakeWord, AWaiterWhosePollsFindNothingStopsPolling) {
  std::thread([] {  // a fresh thread: the history is per thread
    WakeWord w;
    const pid_t self = testutil::gettid_now();
    for (int i = 0; i < 4; ++i) {
      const long before = testutil::voluntary_switches(self);
      EXPECT_FALSE(w.wait(0, Clock::now() + 5ms, 10s));  // polled until the deadline
      EXPECT_EQ(testutil::voluntary_switches(self), before) << "wait " << i << " slept instead of polling";
    }
    const long before = testutil::voluntary_switches(self);
    const auto deadline = Clock::now() + 200ms;
    while (w.wait(0, deadline, 10s)) {
    }
    EXPECT_GT(testutil::voluntary_switches(self), before) << "the fifth wait polled again";
  }).join();
}

}  // namespace
}  // namespace spindle::services
