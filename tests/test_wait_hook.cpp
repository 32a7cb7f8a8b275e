// WaitHook: a sending thread's hook runs around the two sleeps of the send
// path (OutputGauge over its mark, the Outbox's full ring), outside their
// locks, and never when the send does not wait.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>

#include "broker/wait_hook.h"
#include "router/outbox.h"
#include "stream/output_gauge.h"
#include "stream_test_util.h"

namespace spindle {
namespace test_wait_hook {

using namespace std::chrono_literals;
using testutil::kGuard;

// Counts the hook's calls; `on_release` runs inside the release, on the
// waiting thread.
struct CountingHook {
  int released = 0, reacquired = 0;
  bool held = true;  // what the hook stands for (a GIL): let go between the two
  std::function<void()> on_release;
  WaitHook hook{[](void* self) {
                  auto* h = static_cast<CountingHook*>(self);
                  ++h->released;
                  h->held = false;
                  if (h->on_release) h->on_release();
                },
                [](void* self) {
                  auto* h = static_cast<CountingHook*>(self);
                  ++h->reacquired;
                  h->held = true;
                },
                this};
};

TEST(WaitHook, AGaugeWithRoomRunsNoHook) {
  OutputGauge g(100);
  CountingHook h;
  WaitHook::Scope scope(h.hook);
  EXPECT_EQ(g.acquire(60, std::chrono::steady_clock::now() + kGuard), OutputGauge::Admit::kOk);
  EXPECT_EQ(h.released, 0);
  EXPECT_EQ(h.reacquired, 0);
}

// The release runs before the sleep and outside the gauge's lock: from
// inside it, another thread closes the gauge, which takes that lock. Under
// the lock, the close would wait until the waiter slept (and the hook would
// see it time out); outside it, it is done at once, and the wait ends with
// kClosed.
TEST(WaitHook, AGaugeWaitRunsTheHookOutsideItsLock) {
  OutputGauge g(100);
  ASSERT_TRUE(g.try_acquire(100));
  CountingHook h;
  bool closed_in_hook = false;
  std::future<void> closer;
  h.on_release = [&] {
    closer = std::async(std::launch::async, [&] { g.close(); });
    closed_in_hook = closer.wait_for(2s) == std::future_status::ready;
  };
  auto admit = std::async(std::launch::async, [&] {
    WaitHook::Scope scope(h.hook);
    return g.acquire(10, std::chrono::steady_clock::now() + kGuard);
  });
  ASSERT_EQ(admit.wait_for(kGuard), std::future_status::ready);
  EXPECT_TRUE(closed_in_hook) << "the hook ran under the gauge's lock";
  EXPECT_EQ(admit.get(), OutputGauge::Admit::kClosed);
  EXPECT_EQ(h.released, 1);
  EXPECT_EQ(h.reacquired, 1);
  EXPECT_TRUE(h.held) << "the thread came back without what it let go";
}

TEST(WaitHook, AFullOutboxRunsTheHookAroundItsWaitAndTheScopeEnds) {
  Outbox box(4096);
  const std::uint8_t body[64] = {};
  OutboxRecord rec;
  CountingHook h;
  {
    WaitHook::Scope scope(h.hook);
    int pushed = 0;
    while (box.push(rec, body, nullptr, 0ms) == Outbox::Push::kOk) ++pushed;
    ASSERT_GT(pushed, 0);
    EXPECT_EQ(h.released, 0) << "a push that may not wait ran the hook";
    EXPECT_EQ(box.push(rec, body, nullptr, 20ms), Outbox::Push::kTimeout);
    EXPECT_EQ(h.released, 1);
    EXPECT_EQ(h.reacquired, 1);
    EXPECT_TRUE(h.held);
  }
  // Out of the scope, the thread has no hook.
  EXPECT_EQ(box.push(rec, body, nullptr, 20ms), Outbox::Push::kTimeout);
  EXPECT_EQ(h.released, 1);
  box.drain([](OutboxRecord&, std::span<const std::uint8_t>, Message*) {});
}

}  // namespace test_wait_hook
}  // namespace spindle
