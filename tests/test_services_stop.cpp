// Stopping a pool: from inside a handler, requests after stop, the stop
// deadline for queued calls, on_shutdown, a broker shutdown stopping its
// pools first, and Select.
#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>
#include <memory>

#include <gtest/gtest.h>

#include "broker/errors.h"
#include "services/reasons.h"
#include "services/select.h"
#include "tests/router_test_util.h"
#include "tests/services_test_util.h"

namespace spindle {
namespace test_services_stop {

using namespace testutil;
using namespace std::chrono_literals;
using services::Access;
using services::Request;
using services::Service;

class Counted : public Service {
 public:
  explicit Counted(std::atomic<int>& shutdowns) : Service("counted"), shutdowns_(shutdowns) {}
  void on_shutdown() override { ++shutdowns_; }

 private:
  std::atomic<int>& shutdowns_;
};

TEST(ServicesStop, StopFromInsideAHandlerThenRequestsAfterStop) {
  std::atomic<int> shutdowns{0};
  ServiceRig rig(2);
  auto s = std::make_unique<Counted>(shutdowns);
  services::Pool& pool = rig.pool;
  s->expose("stop", Access::any(), [&pool](Request&) {
    pool.stop();  // returns at once on a worker: no self-join, no deadlock
    pool.stop();  // idempotent
    return Payload::copy_of("stopping");
  });
  s->expose("echo", Access::any(), [](Request& r) { return r.args(); });
  rig.add(std::move(s));
  EXPECT_EQ(services::call_text(rig.self, "counted", "stop"), "stopping");
  EXPECT_TRUE(rig.pool.stopping());
  auto after = services::call_async(rig.self, "counted", "echo", Payload::copy_of("too late"));
  std::string r = dead_reason([&] { after.get(); });
  EXPECT_TRUE(contains(r, services::reason::kShuttingDown)) << r;
  rig.pool.stop();  // from outside: joins
  EXPECT_EQ(shutdowns.load(), 1);
  rig.pool.stop();
  EXPECT_EQ(shutdowns.load(), 1);
}

// Local callers run the host's handler on their own threads (it only picks
// a lane), so a host may be destroyed while one is inside it. The
// destructor waits for them, and every call still gets an answer: its
// reply, or a dead reply (shutting down, or no handler once it is gone).
TEST(ServicesStop, HostDestroyedWhileLocalCallersAreInsideIt) {
  Broker broker;
  Router router(broker, RouterOptions{.name = "root"});
  services::Pool pool(pool_of(2));
  auto host = std::make_unique<services::ServiceHost>(router, pool);
  auto echo = std::make_unique<services::Service>("echo");
  echo->expose("say", Access::any(), [](Request& r) { return r.args(); });
  host->add(std::move(echo));
  Context self(router, router.id(), "self");

  std::atomic<bool> stop{false};
  std::atomic<int> replies{0}, dead{0}, other{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c)
    callers.emplace_back([&] {
      while (!stop.load()) {
        try {
          auto f = services::call_async(self, "echo", "say", Payload::copy_of("hi"), 10s);
          if (f.get().text() == "hi") ++replies;
          else ++other;
        } catch (const ChannelError&) {
          ++dead;
        } catch (...) {
          ++other;
        }
      }
    });
  ASSERT_TRUE(eventually([&] { return replies.load() > 100; }, 20s));
  host.reset();  // with callers inside, or about to be
  const int at_reset = dead.load() + replies.load();
  ASSERT_TRUE(eventually([&] { return dead.load() + replies.load() > at_reset + 100; }, 20s));
  stop = true;
  for (auto& t : callers) t.join();
  EXPECT_EQ(other.load(), 0) << "a call ended with neither its reply nor a dead reply";
  EXPECT_GT(dead.load(), 0) << "no call was refused after the host went";
  EXPECT_EQ(router.stats().pending_calls, 0u);
}

TEST(ServicesStop, InFlightCallFinishesQueuedCallsPastTheDeadlineAreAnswered) {
  std::atomic<int> shutdowns{0};
  ServiceRig rig(1, 0ms);  // queued calls may not start once stop begins
  Gate gate;
  auto s = std::make_unique<Counted>(shutdowns);
  s->expose("block", Access::any(), [&](Request&) {
    gate.wait();
    return Payload::copy_of("finished");
  });
  s->expose("echo", Access::any(), [](Request& r) { return r.args(); });
  rig.add(std::move(s));
  auto inflight = services::call_async(rig.self, "counted", "block");
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 1; }));
  std::vector<std::future<Message>> queued;
  for (int i = 0; i < 3; ++i) queued.push_back(services::call_async(rig.self, "counted", "echo"));
  ASSERT_TRUE(eventually([&] { return rig.pool.stats().queued == 3; }));
  std::thread stopper([&] { rig.pool.stop(); });
  ASSERT_TRUE(eventually([&] { return rig.pool.stopping(); }));
  EXPECT_EQ(shutdowns.load(), 0);  // a handler is still running
  gate.open();
  stopper.join();
  EXPECT_EQ(inflight.get().text(), "finished");
  for (auto& f : queued) {
    std::string r = dead_reason([&] { f.get(); });
    EXPECT_TRUE(contains(r, services::reason::kStopDeadline)) << r;
  }
  EXPECT_EQ(shutdowns.load(), 1);
}

TEST(ServicesStop, QueuedCallsRunWhenStoppedWithinTheDeadline) {
  ServiceRig rig(1);
  Gate gate;
  auto s = std::make_unique<Service>("q");
  s->expose("block", Access::any(), [&](Request&) {
    gate.wait();
    return Payload();
  });
  s->expose("echo", Access::any(), [](Request& r) { return r.args(); });
  rig.add(std::move(s));
  auto inflight = services::call_async(rig.self, "q", "block");
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 1; }));
  auto queued = services::call_async(rig.self, "q", "echo", Payload::copy_of("still run"));
  ASSERT_TRUE(eventually([&] { return rig.pool.stats().queued == 1; }));
  std::thread stopper([&] { rig.pool.stop(); });
  ASSERT_TRUE(eventually([&] { return rig.pool.stopping(); }));
  gate.open();
  stopper.join();
  inflight.get();
  EXPECT_EQ(queued.get().text(), "still run");
}

TEST(ServicesStop, BrokerShutdownStopsThePoolFirst) {
  std::atomic<int> shutdowns{0};
  Broker broker;
  Router router(broker, RouterOptions{.name = "root"});
  services::Pool pool(pool_of(2));
  services::ServiceHost host(router, pool);
  Gate gate;
  auto s = std::make_unique<Counted>(shutdowns);
  s->expose("block", Access::any(), [&](Request&) {
    gate.wait();
    return Payload::copy_of("answered during shutdown");
  });
  host.add(std::move(s));
  Context self(router, router.id(), "self");
  auto inflight = services::call_async(self, "counted", "block");
  ASSERT_TRUE(eventually([&] { return gate.waiting() == 1; }));
  broker.shutdown();
  ASSERT_TRUE(eventually([&] { return pool.stopping(); }));
  // The broker waits for the pool: it has not stopped with a call in flight.
  EXPECT_NE(broker.state(), Broker::State::kStopped);
  gate.open();
  EXPECT_EQ(inflight.get().text(), "answered during shutdown");
  broker.join();
  EXPECT_EQ(shutdowns.load(), 1);
}

// The ordering a pool relies on: participants added first drain before the
// others are told to begin.
TEST(ServicesStop, BrokerTellsFirstParticipantsBeforeTheOthers) {
  struct Recorder : ShutdownParticipant {
    std::atomic<bool> begun{false};
    void on_shutdown_begin() override { begun = true; }
    void on_shutdown_deadline() override {}
  };
  Broker broker;
  Recorder first, other;
  broker.defer([&] {
    broker.add_participant(&other);
    broker.add_first_participant(&first);
  });
  broker.shutdown();
  ASSERT_TRUE(eventually([&] { return first.begun.load(); }));
  // Give the broker every chance to tell the other one too early.
  for (int i = 0; i < 3; ++i) {
    std::promise<void> turn;
    broker.defer([&] { turn.set_value(); });
    turn.get_future().wait();
  }
  EXPECT_FALSE(other.begun.load());
  broker.defer([&] { broker.participant_drained(&first); });
  ASSERT_TRUE(eventually([&] { return other.begun.load(); }));
  EXPECT_NE(broker.state(), Broker::State::kStopped);
  broker.defer([&] { broker.participant_drained(&other); });
  broker.join();
  EXPECT_EQ(broker.state(), Broker::State::kStopped);
}

TEST(ServicesSelect, WaitsOnSeveralReceiversAndWakesOneWaiter) {
  Broker broker;
  Router router(broker, RouterOptions{.name = "root"});
  services::Select sel;
  services::Receiver a(router, sel), b(router, sel);
  EXPECT_FALSE(sel.get(1ms).has_value());  // timeout: nothing
  std::atomic<int> got{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 4; ++i)
    waiters.emplace_back([&] {
      if (sel.get(20s)) ++got;
    });
  ASSERT_TRUE(eventually([&] { return sel.stats().idle == 4; }));
  auto before = sel.stats();
  router.send(Message::make(router.id(), b.handle(), Payload::copy_of("to b")));
  ASSERT_TRUE(eventually([&] { return got.load() == 1; }));
  // One message: one waiter woken, three still asleep.
  EXPECT_EQ(sel.stats().wakeups - before.wakeups, 1u);
  EXPECT_EQ(sel.stats().idle, 3u);
  sel.close();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(got.load(), 1);
  // After close a request gets a dead reply.
  try {
    router.call(Message::make(router.id(), a.handle(), Payload::copy_of("late")), 10s);
    ADD_FAILURE() << "no exception";
  } catch (const ChannelError& e) {
    EXPECT_TRUE(contains(e.what(), services::reason::kSelectClosed)) << e.what();
  }
}

TEST(ServicesSelect, ReceiversTakeTurns) {
  Broker broker;
  Router router(broker, RouterOptions{.name = "root"});
  services::Select sel;
  services::Receiver a(router, sel), b(router, sel);
  for (int i = 0; i < 5; ++i) router.send(Message::make(router.id(), a.handle(), Payload::copy_of("a")));
  router.send(Message::make(router.id(), b.handle(), Payload::copy_of("b")));
  ASSERT_TRUE(eventually([&] { return sel.stats().queued == 6; }));
  std::string order;
  while (auto ev = sel.get(0ms)) {
    order += ev->msg.text();
    EXPECT_EQ(ev->from, ev->msg.text() == "a" ? &a : &b);
  }
  EXPECT_EQ(order, "abaaaa");
}

}  // namespace test_services_stop
}  // namespace spindle
