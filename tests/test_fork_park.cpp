// fork_child parks the loop of every broker in the process, not only the one
// it forks from (broker/fork_park.h): a loop that allocates at the moment of
// a fork can leave an allocator lock held in the child (GCC 12's ASan does
// not reset its own), and the child then hangs starting its broker thread.
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "broker/broker.h"
#include "broker/fork_park.h"
#include "router/child.h"
#include "router/router.h"
#include "router/zygote.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_fork_park {

using namespace std::chrono_literals;
using testutil::named;
using testutil::root_opts;

constexpr std::uint32_t kEcho = 2100;

// Keeps `b`'s loop busy with short tasks that allocate, each posting the
// next, until stopped; counts them.
class BusyLoop {
 public:
  explicit BusyLoop(Broker& b) : b_(b) {
    task_ = [this] {
      std::vector<int> v(64 + runs_ % 512);  // allocates, in several size classes
      v.back() = 1;
      runs_.fetch_add(1);
      if (!stop_.load() && b_.try_post(task_)) return;  // the next one carries on
      chain_ended_.store(true);  // the last touch of this object by the loop
    };
    b_.defer(task_);
  }
  ~BusyLoop() { stop(); }
  // Ends the chain and waits until its last task has returned.
  void stop() {
    stop_.store(true);
    const auto end = std::chrono::steady_clock::now() + 10s;
    while (!chain_ended_.load() && std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(1ms);
    ASSERT_TRUE(chain_ended_.load()) << "the busy loop's last task never returned";
  }
  std::uint64_t runs() const { return runs_.load(); }
  bool runs_past(std::uint64_t n, std::chrono::milliseconds within) const {
    const auto end = std::chrono::steady_clock::now() + within;
    while (runs() <= n && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(1ms);
    return runs() > n;
  }

 private:
  Broker& b_;
  std::function<void()> task_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> chain_ended_{false};
  std::atomic<std::uint64_t> runs_{0};
};

TEST(ForkPark, EveryOtherBrokersLoopWaitsWhileParked) {
  Broker busy, forking;
  BusyLoop loop(busy);
  ASSERT_TRUE(loop.runs_past(100, 5s)) << "the busy loop never ran";
  {
    fork_park::Parked parked = fork_park::park_all(&forking, 2s);
    EXPECT_EQ(parked.count(), 2u) << "both brokers should be parked";
    const std::uint64_t at_park = loop.runs();
    std::this_thread::sleep_for(30ms);
    EXPECT_EQ(loop.runs(), at_park) << "the other broker's loop ran while parked";
  }
  EXPECT_TRUE(loop.runs_past(loop.runs(), 5s)) << "the other broker's loop did not go on after";
  loop.stop();
}

TEST(ForkPark, AHostedBrokerAndTheCallersOwnLoopAreNotWaitedFor) {
  asio::io_context app;
  Broker hosted(app, {});  // its loop is this thread's: never parked, never waited for
  Broker forking;
  const auto t0 = std::chrono::steady_clock::now();
  fork_park::Parked parked = fork_park::park_all(&forking, 2s);
  EXPECT_EQ(parked.count(), 1u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s) << "waited for a loop nobody runs";
}

// A child that echoes kEcho until told to shut down.
int echo_child(ChildEnv& env) {
  Router& r = env.router();
  r.add_handler([&r](Message&& m) { r.reply(m, std::move(m.data)); }, {}, kEcho);
  env.serve();
  return 0;
}

// `c` (an echo_child) answers, then exits when told to.
void expect_echo_then_exit(Context& c, const std::string& who) {
  EXPECT_EQ(c.call(kEcho, std::string_view("up"), 20s), "up") << who;
  c.shutdown();
  ASSERT_TRUE(c.wait_exit(20s).has_value()) << who << " did not exit";
}

// Children forked from one router while another broker of the process
// allocates without pause: each starts and answers (under ASan, without the
// parking, some hang in their handshake).
TEST(ForkPark, ChildrenForkedWhileAnotherBrokerAllocatesAllStart) {
  Broker busy;
  BusyLoop loop(busy);
  Broker broker;
  Router router(broker, root_opts());
  for (int i = 0; i < 12; ++i) {
    Context c = fork_child(router, echo_child, named("forked-" + std::to_string(i)));
    ASSERT_NO_FATAL_FAILURE(expect_echo_then_exit(c, "child " + std::to_string(i)));
  }
  EXPECT_GT(loop.runs(), 100u);
}

// The same for zygotes: each is started while another broker allocates
// without pause, and the child it clones starts and answers. Every child of
// a zygote is a copy of it, so a lock held at Zygote::start()'s fork would
// hang them all.
TEST(ForkPark, ZygotesStartedWhileAnotherBrokerAllocatesHaveChildrenThatStart) {
  Broker busy;
  BusyLoop loop(busy);
  Broker broker;
  Router router(broker, root_opts());
  for (int i = 0; i < 8; ++i) {
    auto zygote = Zygote::start();
    Context c = zygote->fork_child(
        router, [](ChildEnv& env, std::string_view) { return echo_child(env); }, "", named("cloned-" + std::to_string(i)));
    ASSERT_NO_FATAL_FAILURE(expect_echo_then_exit(c, "child of zygote " + std::to_string(i)));
  }
  EXPECT_GT(loop.runs(), 100u);
}

}  // namespace test_fork_park
}  // namespace spindle
