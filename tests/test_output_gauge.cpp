// OutputGauge: the high-water mark, waiting, timeouts and close.
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "stream/output_gauge.h"
#include "stream_test_util.h"

namespace spindle {
namespace test_output_gauge {

using namespace std::chrono_literals;
using Admit = OutputGauge::Admit;
using testutil::kGuard;

pid_t current_tid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

TEST(OutputGauge, TryAcquireRespectsTheMark) {
  OutputGauge g(100);
  EXPECT_EQ(g.high_water_mark(), 100u);
  EXPECT_EQ(g.queued(), 0u);
  EXPECT_TRUE(g.try_acquire(60));
  EXPECT_TRUE(g.try_acquire(40));  // exactly at the mark is admitted
  EXPECT_EQ(g.queued(), 100u);
  EXPECT_FALSE(g.try_acquire(1)) << "admitted past the high-water mark";
  EXPECT_EQ(g.queued(), 100u) << "a refused try_acquire must not charge anything";
  g.release(30);
  EXPECT_EQ(g.queued(), 70u);
  EXPECT_FALSE(g.try_acquire(31));
  EXPECT_TRUE(g.try_acquire(30));
  g.release(100);
  EXPECT_EQ(g.queued(), 0u);
}

TEST(OutputGauge, EmptyQueueAlwaysAdmitsOneMessage) {
  OutputGauge g(100);
  EXPECT_TRUE(g.try_acquire(1000)) << "an empty queue must admit a message larger than the mark";
  EXPECT_EQ(g.queued(), 1000u);
  EXPECT_FALSE(g.try_acquire(1)) << "the queue may exceed the mark by one message only";
  g.release(1000);
  EXPECT_TRUE(g.try_acquire(1));
  EXPECT_FALSE(g.try_acquire(1000));
  g.release(1);
}

TEST(OutputGauge, AcquireSucceedsAtOnceUnderTheMark) {
  OutputGauge g(100);
  EXPECT_EQ(g.acquire(50, std::chrono::steady_clock::now() + kGuard), Admit::kOk);
  EXPECT_EQ(g.queued(), 50u);
  // A deadline already in the past does not matter when there is room.
  EXPECT_EQ(g.acquire(50, std::chrono::steady_clock::now() - 1s), Admit::kOk);
  EXPECT_EQ(g.queued(), 100u);
}

TEST(OutputGauge, AcquireWaitsUntilReleaseFromAnotherThread) {
  OutputGauge g(100);
  ASSERT_TRUE(g.try_acquire(100));
  std::atomic<bool> released{false};
  std::promise<pid_t> tid_p;
  auto tid_f = tid_p.get_future();
  auto result = std::async(std::launch::async, [&] {
    tid_p.set_value(current_tid());
    Admit a = g.acquire(50, std::chrono::steady_clock::now() + kGuard);
    // It can only have been admitted after the release below.
    EXPECT_TRUE(released.load()) << "acquire() returned before any room was made";
    return a;
  });
  ASSERT_EQ(tid_f.wait_for(kGuard), std::future_status::ready);
  // Know the waiter is really asleep in acquire() rather than guess.
  ASSERT_TRUE(testutil::wait_until_sleeping(tid_f.get()));
  EXPECT_EQ(result.wait_for(0s), std::future_status::timeout);
  released = true;
  g.release(60);
  ASSERT_EQ(result.wait_for(kGuard), std::future_status::ready) << "release() did not wake the waiter";
  EXPECT_EQ(result.get(), Admit::kOk);
  EXPECT_EQ(g.queued(), 90u);
}

TEST(OutputGauge, AcquireTimesOutUnderShortDeadline) {
  OutputGauge g(10);
  ASSERT_TRUE(g.try_acquire(10));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(g.acquire(5, t0 + 50ms), Admit::kTimeout);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 50ms) << "gave up before the deadline";
  EXPECT_EQ(g.queued(), 10u) << "a timed-out acquire must not charge anything";
  // Nothing left behind: a later release/acquire works normally.
  g.release(10);
  EXPECT_EQ(g.acquire(5, std::chrono::steady_clock::now() + 50ms), Admit::kOk);
}

TEST(OutputGauge, CloseWakesWaiterWithClosed) {
  OutputGauge g(10);
  ASSERT_TRUE(g.try_acquire(10));
  std::promise<pid_t> tid_p;
  auto tid_f = tid_p.get_future();
  auto result = std::async(std::launch::async, [&] {
    tid_p.set_value(current_tid());
    return g.acquire(5, std::chrono::steady_clock::now() + kGuard);
  });
  ASSERT_EQ(tid_f.wait_for(kGuard), std::future_status::ready);
  ASSERT_TRUE(testutil::wait_until_sleeping(tid_f.get()));
  g.close();
  ASSERT_EQ(result.wait_for(kGuard), std::future_status::ready) << "close() did not wake the waiter";
  EXPECT_EQ(result.get(), Admit::kClosed);
  EXPECT_TRUE(g.closed());
  // After close nothing is admitted, not even into an empty queue.
  g.release(10);
  EXPECT_FALSE(g.try_acquire(1));
  EXPECT_EQ(g.acquire(1, std::chrono::steady_clock::now() + kGuard), Admit::kClosed);
}

TEST(OutputGauge, ManyWaitersAllWokenByClose) {
  OutputGauge g(1);
  ASSERT_TRUE(g.try_acquire(1));
  constexpr int kWaiters = 4;
  std::vector<std::future<Admit>> results;
  std::vector<std::future<pid_t>> tids;
  std::vector<std::promise<pid_t>> tid_ps(kWaiters);
  for (int i = 0; i < kWaiters; ++i) {
    tids.push_back(tid_ps[static_cast<std::size_t>(i)].get_future());
    results.push_back(std::async(std::launch::async, [&, i] {
      tid_ps[static_cast<std::size_t>(i)].set_value(current_tid());
      return g.acquire(1, std::chrono::steady_clock::now() + kGuard);
    }));
  }
  for (auto& t : tids) {
    ASSERT_EQ(t.wait_for(kGuard), std::future_status::ready);
    ASSERT_TRUE(testutil::wait_until_sleeping(t.get()));
  }
  g.close();
  for (auto& r : results) {
    ASSERT_EQ(r.wait_for(kGuard), std::future_status::ready);
    EXPECT_EQ(r.get(), Admit::kClosed);
  }
}

}  // namespace test_output_gauge
}  // namespace spindle
