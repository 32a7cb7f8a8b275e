// Broker: defer (inline / cross-thread / coalesced), idle cost, timers,
// shutdown and the participant drain protocol.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "broker/broker.h"
#include "broker/errors.h"
#include "stream_test_util.h"

namespace spindle {
namespace test_broker {

using namespace std::chrono_literals;
using testutil::join_bounded;
using testutil::kGuard;
using testutil::run_on;
using testutil::settle;

TEST(BrokerDefer, FromBrokerThreadRunsInline) {
  Broker broker;
  struct Result {
    bool inner_on_broker = false;
    bool ran_before_return = false;
  };
  Result r = run_on(broker, [&] {
    Result out;
    bool ran = false;
    broker.defer([&] {
      ran = true;
      out.inner_on_broker = broker.on_broker_thread();
    });
    out.ran_before_return = ran;
    return out;
  });
  EXPECT_TRUE(r.ran_before_return) << "defer() on the broker thread must run fn before returning";
  EXPECT_TRUE(r.inner_on_broker);

  // try_defer behaves the same way.
  bool ran_before = run_on(broker, [&] {
    bool ran = false;
    EXPECT_TRUE(broker.try_defer([&] { ran = true; }));
    return ran;
  });
  EXPECT_TRUE(ran_before);
}

TEST(BrokerDefer, FromOtherThreadRunsOnBrokerThread) {
  Broker broker;
  EXPECT_FALSE(broker.on_broker_thread());
  std::promise<std::pair<bool, std::thread::id>> p;
  auto f = p.get_future();
  broker.defer([&] { p.set_value({broker.on_broker_thread(), std::this_thread::get_id()}); });
  ASSERT_EQ(f.wait_for(kGuard), std::future_status::ready);
  auto [on_broker, id] = f.get();
  EXPECT_TRUE(on_broker);
  EXPECT_NE(id, std::this_thread::get_id());
  EXPECT_GT(broker.native_tid(), 0);
  EXPECT_NE(broker.native_tid(), static_cast<pid_t>(::gettid()));
}

TEST(BrokerDefer, TenThousandDefersCoalesceWakeups) {
  Broker broker;
  settle(broker);
  constexpr int kN = 10000;

  std::latch started(1), release(1);
  broker.defer([&] {
    started.count_down();
    release.wait();
  });
  started.wait();  // the broker thread is now inside the blocker

  const Broker::Stats before = broker.stats();
  std::vector<int> order;  // touched only on the broker thread until done
  order.reserve(kN);
  std::promise<void> all_ran;
  auto done = all_ran.get_future();
  for (int i = 0; i < kN; ++i) {
    broker.defer([&order, &all_ran, i] {
      order.push_back(i);
      if (i == kN - 1) all_ran.set_value();
    });
  }
  const Broker::Stats queued = broker.stats();
  release.count_down();
  ASSERT_EQ(done.wait_for(kGuard), std::future_status::ready);

  EXPECT_EQ(queued.deferred - before.deferred, static_cast<std::uint64_t>(kN));
  EXPECT_LE(queued.wakeups_posted - before.wakeups_posted, 2u)
      << "10,000 defers into a blocked broker must ride on one or two wake-ups";
  const Broker::Stats after = broker.stats();
  EXPECT_LE(after.wakeups_posted - before.wakeups_posted, 2u);

  ASSERT_EQ(order.size(), static_cast<std::size_t>(kN));
  for (int i = 0; i < kN; ++i) {
    if (order[static_cast<std::size_t>(i)] != i) {
      ADD_FAILURE() << "deferred functions ran out of order at index " << i << ": got "
                    << order[static_cast<std::size_t>(i)];
      break;
    }
  }
}

// A waker turn that found records keeps draining while they keep coming
// (Broker::keep_draining), with the wake-up flag set so producers skip the
// eventfd. Producers here publish in bursts with pauses around the turn's
// gap, so turns end in every phase of a burst: every record must still be
// handled (one published just as a turn gave up must bring a new wake-up),
// and without any further wake-up once the producers stop.
TEST(BrokerWake, NoRecordIsLeftBehindWhenADrainingTurnEnds) {
  Broker broker;
  std::atomic<std::uint64_t> published{0};
  std::uint64_t consumed = 0;  // broker thread
  std::atomic<std::uint64_t> consumed_seen{0};
  const int sink = run_on(broker, [&] {
    return broker.on_wake([&]() -> std::size_t {
      const std::uint64_t now = published.load(std::memory_order_seq_cst);
      const std::size_t n = static_cast<std::size_t>(now - consumed);
      consumed = now;
      consumed_seen.store(consumed, std::memory_order_release);
      return n;
    });
  });
  constexpr int kProducers = 3, kBursts = 300;
  std::vector<std::thread> ts;
  for (int p = 0; p < kProducers; ++p) {
    ts.emplace_back([&, p] {
      std::uint32_t x = 12345u + static_cast<std::uint32_t>(p);
      for (int b = 0; b < kBursts; ++b) {
        x = x * 1664525u + 1013904223u;
        const int records = 1 + static_cast<int>(x % 40);
        for (int r = 0; r < records; ++r) {
          published.fetch_add(1, std::memory_order_seq_cst);
          broker.wake();
        }
        // 0-12 us: some pauses outlast the turn's gap (5 us), some do not.
        const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds((x >> 8) % 12000);
        while (std::chrono::steady_clock::now() < until) {
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  const std::uint64_t total = published.load();
  const auto give_up = std::chrono::steady_clock::now() + kGuard;
  while (consumed_seen.load(std::memory_order_acquire) != total && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(1ms);
  EXPECT_EQ(consumed_seen.load(), total) << "records published were never drained";
  run_on(broker, [&] { broker.remove_wake_sink(sink); });
}

TEST(BrokerIdle, ZeroWakeupsWhileIdle) {
  Broker broker;
  settle(broker);
  const pid_t tid = broker.native_tid();
  ASSERT_GT(tid, 0);
  // The settle handshake returns as soon as the function ran; wait until the
  // broker thread is back asleep in epoll_wait before taking the first sample.
  ASSERT_TRUE(testutil::wait_until_sleeping(tid)) << "broker thread never went to sleep";

  const long long c0 = testutil::ctxt_switches(tid);
  ASSERT_GE(c0, 0) << "cannot read /proc/self/task/" << tid << "/status";
  std::this_thread::sleep_for(500ms);  // the measurement window itself
  const long long c1 = testutil::ctxt_switches(tid);
  ASSERT_GE(c1, 0);
  EXPECT_EQ(c1 - c0, 0) << "the idle broker thread woke up " << (c1 - c0) << " times in 500 ms";

  // Still alive and responsive afterwards.
  settle(broker);
}

TEST(BrokerTimer, CallLaterFiresOnBrokerThread) {
  Broker broker;
  std::promise<bool> p;
  auto f = p.get_future();
  const auto t0 = std::chrono::steady_clock::now();
  broker.call_later(20ms, [&] { p.set_value(broker.on_broker_thread()); });
  ASSERT_EQ(f.wait_for(kGuard), std::future_status::ready);
  EXPECT_TRUE(f.get());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 20ms) << "timer fired before its delay";
}

TEST(BrokerTimer, CancelTimerPreventsFiring) {
  Broker broker;
  std::atomic<bool> cancelled_fired{false};
  std::promise<void> barrier;
  auto f = barrier.get_future();
  auto id = broker.call_later(50ms, [&] { cancelled_fired = true; });
  broker.cancel_timer(id);
  // A later timer: once it has fired, the first one would have fired too.
  broker.call_later(150ms, [&] { barrier.set_value(); });
  ASSERT_EQ(f.wait_for(kGuard), std::future_status::ready);
  EXPECT_FALSE(cancelled_fired.load()) << "a cancelled timer fired";

  // Cancelling an already fired or unknown id is harmless.
  broker.cancel_timer(id);
  broker.cancel_timer(123456789);
  settle(broker);
}

TEST(BrokerTimer, CancelTimerFromBrokerThreadRightAfterCallLater) {
  // call_later() from another thread returns an id at once; a cancel_timer()
  // for that id issued afterwards must win, even when it is issued on the
  // broker thread while the timer's creation is still queued.
  Broker broker;
  settle(broker);
  std::atomic<bool> fired{false};
  std::atomic<Broker::TimerId> id{0};
  std::latch started(1), release(1);
  broker.defer([&] {
    started.count_down();
    release.wait();                 // test thread calls call_later() meanwhile
    broker.cancel_timer(id.load());  // broker thread: runs inline
  });
  started.wait();
  id = broker.call_later(30ms, [&] { fired = true; });
  release.count_down();
  std::promise<void> barrier;
  auto f = barrier.get_future();
  broker.call_later(200ms, [&] { barrier.set_value(); });
  ASSERT_EQ(f.wait_for(kGuard), std::future_status::ready);
  EXPECT_FALSE(fired.load())
      << "cancel_timer(id) called after call_later() returned id did not prevent firing";
}

TEST(BrokerShutdown, IdempotentFromTwoThreadsAndJoinReturns) {
  Broker broker;
  settle(broker);
  std::latch go(2);
  std::thread t1([&] {
    go.arrive_and_wait();
    broker.shutdown();
  });
  std::thread t2([&] {
    go.arrive_and_wait();
    broker.shutdown();
  });
  broker.shutdown();
  t1.join();
  t2.join();
  join_bounded(broker);
  EXPECT_EQ(broker.state(), Broker::State::kStopped);
  EXPECT_FALSE(broker.accepting());
  broker.wait_for_shutdown_request();  // returns at once
  broker.shutdown();                   // still harmless
  join_bounded(broker);                // second join returns too
}

TEST(BrokerShutdown, DeferAfterStopThrowsShutdownError) {
  Broker broker;
  broker.shutdown();
  join_bounded(broker);
  bool ran = false;
  try {
    broker.defer([&] { ran = true; });
    ADD_FAILURE() << "defer() after stop did not throw";
  } catch (const ShutdownError& e) {
    EXPECT_EQ(std::string(e.what()), std::string(errtext::kBrokerShutDown));
    EXPECT_NE(std::string(e.what()).find("shut down"), std::string::npos);
  }
  EXPECT_FALSE(broker.try_defer([&] { ran = true; }));
  EXPECT_THROW(broker.call_later(1ms, [&] { ran = true; }), ShutdownError);
  EXPECT_FALSE(ran);
  EXPECT_THROW(broker.defer([] {}), Error);  // ShutdownError is a spindle::Error
}

// A participant whose drain the test controls.
class TestParticipant : public ShutdownParticipant {
 public:
  explicit TestParticipant(Broker& b) : broker_(b) {}
  void on_shutdown_begin() override {
    begin_on_broker = broker_.on_broker_thread();
    ++begins;
    begun.set_value();
  }
  void on_shutdown_deadline() override {
    deadline_on_broker = broker_.on_broker_thread();
    ++deadlines;
  }
  Broker& broker_;
  std::promise<void> begun;
  std::atomic<int> begins{0}, deadlines{0};
  std::atomic<bool> begin_on_broker{false}, deadline_on_broker{false};
};

TEST(BrokerShutdown, DefersDuringDrainAllRun) {
  Broker broker;
  TestParticipant p(broker);
  run_on(broker, [&] { broker.add_participant(&p); });
  auto begun = p.begun.get_future();

  broker.shutdown(std::chrono::milliseconds(20000));
  ASSERT_EQ(begun.wait_for(kGuard), std::future_status::ready);
  EXPECT_TRUE(p.begin_on_broker.load());
  EXPECT_EQ(broker.state(), Broker::State::kDraining);
  EXPECT_FALSE(broker.accepting());

  constexpr int kN = 1000;
  std::atomic<int> ran{0};
  std::atomic<bool> in_order{true};
  int next = 0;  // broker thread only
  for (int i = 0; i < kN; ++i) {
    ASSERT_NO_THROW(broker.defer([&, i] {
      if (i != next) in_order = false;
      ++next;
      ++ran;
    })) << "defer() during the grace period must be accepted";
  }
  broker.defer([&] { broker.participant_drained(&p); });
  join_bounded(broker);
  EXPECT_EQ(ran.load(), kN) << "work accepted during the drain was dropped";
  EXPECT_TRUE(in_order.load());
  EXPECT_EQ(p.begins.load(), 1);
  EXPECT_EQ(p.deadlines.load(), 0) << "a drained participant must not be force-closed";
  EXPECT_EQ(broker.state(), Broker::State::kStopped);
  EXPECT_THROW(broker.defer([] {}), ShutdownError);
}

TEST(BrokerShutdown, GraceDeadlineForceClosesStuckParticipant) {
  Broker broker;
  TestParticipant stuck(broker);
  run_on(broker, [&] { broker.add_participant(&stuck); });
  auto begun = stuck.begun.get_future();
  const auto t0 = std::chrono::steady_clock::now();
  broker.shutdown(std::chrono::milliseconds(200));
  ASSERT_EQ(begun.wait_for(kGuard), std::future_status::ready);
  join_bounded(broker);
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(stuck.deadlines.load(), 1);
  EXPECT_TRUE(stuck.deadline_on_broker.load());
  EXPECT_GE(elapsed, 190ms) << "deadline fired before the grace period ran out";
  EXPECT_EQ(broker.state(), Broker::State::kStopped);
}

TEST(BrokerShutdown, DeferredBeforeDeadlineStillRuns) {
  // Work accepted during the grace period runs even when the grace period
  // ends by the deadline rather than by every participant draining.
  Broker broker;
  TestParticipant stuck(broker);
  run_on(broker, [&] { broker.add_participant(&stuck); });
  auto begun = stuck.begun.get_future();
  broker.shutdown(std::chrono::milliseconds(200));
  ASSERT_EQ(begun.wait_for(kGuard), std::future_status::ready);
  std::atomic<int> ran{0};
  for (int i = 0; i < 100; ++i) broker.defer([&] { ++ran; });
  join_bounded(broker);
  EXPECT_EQ(ran.load(), 100);
  EXPECT_EQ(stuck.deadlines.load(), 1);
}

TEST(BrokerShutdown, DestructorShutsDownAndJoins) {
  std::atomic<bool> ran{false};
  {
    Broker broker;
    broker.defer([&] { ran = true; });
  }
  EXPECT_TRUE(ran.load()) << "a function accepted before destruction was dropped";
}

}  // namespace test_broker
}  // namespace spindle
