// Across processes: each policy accepting and refusing real callers, fork()
// while a pool is busy, and the watcher (including after fork). Children
// report through replies, dead replies and exit statuses; no gtest macro runs
// in a forked child.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "broker/errors.h"
#include "router/child.h"
#include "services/reasons.h"
#include "services/fork.h"
#include "services/watcher.h"
#include "tests/router_test_util.h"
#include "tests/services_test_util.h"

namespace spindle {
namespace test_services_fork {

using namespace testutil;
using namespace std::chrono_literals;
using services::Access;
using services::Request;
using services::Service;

constexpr std::uint32_t kReport = 5000;

std::unique_ptr<Service> guarded_service(std::uint32_t only_ctx) {
  auto s = std::make_unique<Service>("guarded");
  s->expose("open", Access::any(), [](Request&) { return Payload::copy_of("open ok"); });
  s->expose("family", Access::parents(), [](Request&) { return Payload::copy_of("family ok"); });
  s->expose("picky", Access::when(fmt::format("context {} only", only_ctx),
                                  [only_ctx](const services::Caller& c) { return c.auth_id == only_ctx; }),
            [](Request&) { return Payload::copy_of("picky ok"); });
  return s;
}

// "ok:<result>" or "dead:<reason>" or "error:<what>".
std::string outcome(const Context& to, std::string_view method) {
  try {
    return "ok:" + services::call_text(to, "guarded", method, {}, 10s);
  } catch (const ChannelError& e) {
    return std::string("dead:") + e.what();
  }
  catch (const std::exception& e) {
    return std::string("error:") + e.what();
  }
}

TEST(ServicesPolicy, EachPolicyAcceptsAndRefusesRealCallers) {
  ServiceRig rig(2);
  // The root's own "picky" method admits context 1: the first child.
  rig.add(guarded_service(1));
  std::promise<std::string> report;
  rig.router.add_handler([&](Message&& m) { report.set_value(m.text()); }, {}, kReport);
  Context child = fork_child(rig.router, [](ChildEnv& env) {
    // The child hosts the same service: its parent (the root) is family.
    services::Pool pool(pool_of(1));
    services::ServiceHost host(env.router(), pool);
    host.add(guarded_service(12345));
    env.ready();
    Context root = env.parent();
    std::string r = outcome(root, "open") + "|" + outcome(root, "family") + "|" + outcome(root, "picky");
    root.send(kReport, Payload::copy_of(r));
    env.serve();
    return 0;
  }, named("caller"));
  ASSERT_EQ(child.id(), 1u);
  auto f = report.get_future();
  ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
  std::string seen = f.get();
  // The child calling the root: any accepts, parents refuses (the child is
  // not the root's parent), the predicate accepts context 1.
  EXPECT_TRUE(contains(seen, "ok:open ok|")) << seen;
  EXPECT_TRUE(contains(seen, std::string("|dead:") + std::string(services::reason::kRefused))) << seen;
  EXPECT_TRUE(contains(seen, "guarded.family (parents only) refused context 1")) << seen;
  EXPECT_TRUE(contains(seen, "|ok:picky ok")) << seen;
  // The root calling the child: parents accepts, the predicate refuses.
  EXPECT_EQ(outcome(child, "family"), "ok:family ok");
  std::string picky = outcome(child, "picky");
  EXPECT_TRUE(contains(picky, "dead:") && contains(picky, "context 12345 only") && contains(picky, "refused context 0"))
      << picky;
  // The root calling itself: parents admits self, the predicate refuses.
  EXPECT_EQ(outcome(rig.self, "family"), "ok:family ok");
  EXPECT_TRUE(contains(outcome(rig.self, "picky"), "dead:")) << "picky admitted context 0";
  child.shutdown();
  expect_exit_code(child, 0);
}

// A forked child's life in the tests below: its own pool serving child.pid.
// The service is hosted from the start (ServiceHost's `initial`), as
// services/host.h asks: the parent calls as soon as the child is connected,
// and a host built empty and given the service just after can receive that
// call in between, once a pool worker that waits for work leads the child's
// loop. CI saw it once under ASan (2026-12-02: "unknown service: child").
int serve_pid(ChildEnv& env) {
  services::Pool pool(pool_of(2));
  auto svc = std::make_unique<Service>("child");
  svc->expose("pid", Access::any(), [](Request&) { return Payload::copy_of(std::to_string(::getpid())); });
  std::vector<std::unique_ptr<Service>> initial;
  initial.push_back(std::move(svc));
  services::ServiceHost host(env.router(), pool, std::move(initial));
  env.serve();
  return 0;
}

// A busy pool, callers keeping calls in flight, and fork_child() in the
// middle: each child builds its own broker, router and pool and serves a
// call. The callers pause at each fork with their calls still queued or
// running (their own threads are the application's to quiesce, like any
// application thread); the pool's workers are quiesced by the fork guard and
// the broker thread by fork_child().
TEST(ServicesFork, ForkWhileThePoolIsBusy) {
  ServiceRig rig(4);
  auto s = std::make_unique<Service>("churn");
  s->expose("work", Access::any(), [](Request& r) {
    std::vector<std::string> junk;  // allocator traffic while forking
    for (int i = 0; i < 50; ++i) junk.push_back(std::string(100 + i, 'x'));
    return r.args();
  });
  rig.add(std::move(s));
  std::atomic<bool> go{true}, pause{false};
  std::atomic<int> paused{0};
  std::atomic<long> calls{0};
  std::vector<std::thread> hammer;
  struct StopHammer {
    std::atomic<bool>& go;
    std::atomic<bool>& pause;
    std::vector<std::thread>& threads;
    ~StopHammer() {
      go = false;
      pause = false;
      for (auto& t : threads)
        if (t.joinable()) t.join();
    }
  } stop_hammer{go, pause, hammer};
  for (int t = 0; t < 2; ++t)
    hammer.emplace_back([&] {
      while (go.load()) {
        std::vector<std::future<Message>> fs;
        for (int i = 0; i < 8; ++i)
          fs.push_back(services::call_async(rig.self, "churn", "work", Payload::copy_of("w")));
        if (pause.load()) {  // hold still with 8 calls in flight
          ++paused;
          while (pause.load()) std::this_thread::sleep_for(1ms);
          --paused;
        }
        for (auto& f : fs) f.get();
        calls += 8;
      }
    });
  ASSERT_TRUE(eventually([&] { return calls.load() > 100; }));
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    pause = true;
    ASSERT_TRUE(eventually([&] { return paused.load() == 2; }));
    // Before the fix a fork waited up to 2 s for pool jobs that needed the
    // broker; the guard now waits at most kForkQuiesceLimit (10 ms).
    const auto fork_began = std::chrono::steady_clock::now();
    Context child = fork_child(rig.router, serve_pid, named(fmt::format("forked-{}", round)));
    const auto fork_took = std::chrono::steady_clock::now() - fork_began;
    EXPECT_LT(fork_took, 1500ms) << "a fork from a busy process stalled";
    pause = false;
    // fork_child() defers adding the child's stream; a drain of the outbox
    // deferred earlier by the callers may run first and find no route yet.
    // Wait for the stream (a router ordering issue, not the pool's).
    ASSERT_TRUE(eventually([&] { return rig.router.stats().streams == 1; }));
    EXPECT_EQ(services::call_text(child, "child", "pid", {}, 30s), std::to_string(child.pid()));
    child.shutdown();
    expect_exit_code(child, 0);
  }
  long before = calls.load();
  EXPECT_TRUE(eventually([&] { return calls.load() > before + 100; })) << "the parent's pool stalled";
  // Whether each fork found the workers between messages within the guard's
  // 10 ms is the scheduler's to say (a worker preempted mid-handler on a
  // loaded machine, or under TSan, misses it, and the fork goes ahead as
  // designed): ForkGoesAheadPastAWorkerStuckInAMessage checks the count.
}

// The fork guard waits for workers inside a message for kForkQuiesceLimit at
// most, then forks anyway and counts it: a fork from an idle pool counts
// nothing, a fork while a handler is stuck counts one, and both children
// work.
TEST(ServicesFork, ForkGoesAheadPastAWorkerStuckInAMessage) {
  ServiceRig rig(2);
  std::promise<void> entered, release;
  std::shared_future<void> released = release.get_future().share();
  auto s = std::make_unique<Service>("stuck");
  s->expose("wait", Access::any(), [&entered, released](Request& r) {
    entered.set_value();
    released.wait();
    return r.args();
  });
  rig.add(std::move(s));
  auto fork_and_call = [&rig](const std::string& name) {
    Context child = fork_child(rig.router, serve_pid, named(name));
    EXPECT_EQ(services::call_text(child, "child", "pid", {}, 30s), std::to_string(child.pid()));
    child.shutdown();
    expect_exit_code(child, 0);
  };
  const unsigned long idle_before = services::fork_guard::forks_not_quiesced();
  fork_and_call("from-idle");
  EXPECT_EQ(services::fork_guard::forks_not_quiesced(), idle_before) << "an idle pool was not quiet";
  auto stuck = services::call_async(rig.self, "stuck", "wait", Payload::copy_of("w"));
  entered.get_future().wait();
  const auto began = std::chrono::steady_clock::now();
  fork_and_call("past-a-stuck-worker");
  EXPECT_LT(std::chrono::steady_clock::now() - began, 1500ms) << "the fork waited for the stuck handler";
  EXPECT_EQ(services::fork_guard::forks_not_quiesced(), idle_before + 1);
  release.set_value();
  EXPECT_EQ(stuck.get().text(), "w");
}

TEST(ServicesWatcher, ThreadExitShutsBrokerDownOneWatcherPerThread) {
  Broker broker;
  std::size_t before = services::watcher_count();
  std::promise<void> installed, may_exit;
  std::size_t count_inside = 0, brokers_inside = 0;
  std::thread target([&] {
    services::install_watcher(broker);
    services::install_watcher(broker);  // the same target: still one watcher
    count_inside = services::watcher_count();
    brokers_inside = services::watched_brokers_of_this_thread();
    installed.set_value();
    may_exit.get_future().wait();
  });
  installed.get_future().wait();
  EXPECT_EQ(count_inside, before + 1);
  EXPECT_EQ(brokers_inside, 1u);
  EXPECT_EQ(broker.state(), Broker::State::kRunning);
  may_exit.set_value();
  target.join();
  EXPECT_TRUE(eventually([&] { return broker.state() != Broker::State::kRunning; }));
  broker.join();
  EXPECT_EQ(services::watcher_count(), before);
}

TEST(ServicesWatcher, ChildGetsItsOwnWatchers) {
  Broker broker;
  Router router(broker, RouterOptions{.name = "root"});
  services::install_watcher(broker);  // this (forking) thread watches the parent's broker
  ASSERT_EQ(services::watched_brokers_of_this_thread(), 1u);
  Context child = fork_child(router, [](ChildEnv& env) {
    // The map was reset: the forking thread's copy watches nothing here.
    if (services::watcher_count() != 0 || services::watched_brokers_of_this_thread() != 0) return 2;
    // A watcher of the child's own: its thread's exit shuts this child's
    // broker down, which ends serve() without any word from the parent.
    std::thread([&env] { services::install_watcher(env.broker()); }).join();
    env.serve();
    return 0;
  }, named("watched"));
  expect_exit_code(child, 0);
  EXPECT_EQ(broker.state(), Broker::State::kRunning);  // the child did not touch it
  broker.shutdown();
  broker.join();
  // The broker forgot this thread once it shut down.
  EXPECT_EQ(services::watched_brokers_of_this_thread(), 0u);
}

}  // namespace test_services_fork
}  // namespace spindle
