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

}  // namespace
}  // namespace spindle::services
