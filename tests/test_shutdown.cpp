// Shutdown end to end, over a real fork: what was accepted before shutdown is
// delivered, and what comes after fails with a clear error.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>

#include "broker/errors.h"
#include "router/child.h"
#include "router/router.h"
#include "tests/router_test_util.h"
#include "tests/stream_test_util.h"

namespace spindle {
namespace test_shutdown {

using namespace std::chrono_literals;
using namespace testutil;

constexpr std::uint32_t kCount = 5000;
constexpr int kMessages = 10000;

// Counts messages; exits 0 only if every one arrived, in order, before the
// parent's SHUTDOWN (which travels behind them on the same stream).
int counting_child(ChildEnv& env) {
  int seen = 0;
  bool in_order = true;
  env.router().add_handler(
      [&](Message&& m) {
        if (m.text() != std::to_string(seen)) in_order = false;
        ++seen;
      },
      {}, kCount);
  env.serve();
  return (seen == kMessages && in_order) ? 0 : 1;
}

TEST(Shutdown, TenThousandQueuedMessagesAreAllDeliveredBeforeGoodbye) {
  Broker broker;
  Router router(broker, root_opts());
  Context child = fork_child(router, counting_child, named("counter"));
  for (int i = 0; i < kMessages; ++i) child.send(kCount, Payload::copy_of(std::to_string(i)));
  // No waiting for delivery: shutdown begins with all 10,000 still queued.
  broker.shutdown();
  broker.join();
  expect_exit_code(child, 0);
}

TEST(Shutdown, SendAfterStopFailsWithShutdownError) {
  Broker broker;
  Router router(broker, root_opts());
  broker.shutdown();
  broker.join();
  try {
    router.send(Message::make(0, kFirstDynamicHandle, Payload::copy_of("late")));
    FAIL() << "send after stop was accepted";
  } catch (const ShutdownError& e) {
    EXPECT_TRUE(contains(e.what(), "shut down")) << e.what();
  }
  EXPECT_THROW(broker.defer([] {}), ShutdownError);
}

TEST(Shutdown, PendingCallFailsWithReasonWhenParentShutsDown) {
  Broker broker;
  Router router(broker, root_opts());
  constexpr std::uint32_t kSilent = 5001;
  Context child = fork_child(
      router,
      [](ChildEnv& env) {
        env.router().add_handler([](Message&&) {}, {}, kSilent);  // never replies
        env.serve();
        return 0;
      },
      named("silent"));
  auto pending = child.call_async(kSilent, Payload::copy_of("?"), 60s);
  broker.shutdown();
  ASSERT_EQ(pending.wait_for(20s), std::future_status::ready) << "pending call hung past shutdown";
  try {
    pending.get();
    FAIL() << "a call nobody answered succeeded";
  } catch (const ChannelError& e) {
    EXPECT_FALSE(std::string(e.what()).empty());
  }
  broker.join();
  expect_exit_code(child, 0);
}

TEST(Shutdown, RouteFailsFastWhenTheQueueIsFull) {
  Broker broker;
  RouterOptions opts = root_opts();
  opts.high_water_mark = 64 * 1024;
  Router router(broker, opts);
  constexpr std::uint32_t kSink = 5002;
  // A child that never reads after its first message: its queue fills up.
  Context child = fork_child(
      router,
      [](ChildEnv& env) {
        std::atomic<bool> stuck{false};
        env.router().add_handler([&stuck](Message&&) { stuck.wait(false); }, {}, kSink);
        env.serve();
        return 0;
      },
      named("stuck"));
  child.send(kSink, Payload::copy_of("block your broker"));
  std::string big(32 * 1024, 'x');
  bool refused = false;
  for (int i = 0; i < 10000 && !refused; ++i) {
    try {
      router.route(Message::make(child.id(), kSink, Payload::copy_of(big)));
    } catch (const QueueFullError& e) {
      refused = true;
      EXPECT_TRUE(contains(e.what(), "output queue full")) << e.what();
    }
  }
  EXPECT_TRUE(refused) << "the output queue grew without bound";
  ::kill(child.pid(), SIGKILL);
  auto st = child.wait_exit(10s);
  ASSERT_TRUE(st.has_value());
}

// A shutdown that waits out its whole grace says who it waited for: the
// links still open, by role and name. Before, the only line was "grace
// period over; force-closing 1 participant(s)", and a close that took the
// whole 5 s (seen once in bench_py) left nothing to go on.
TEST(Shutdown, TheGraceDeadlineNamesTheLinksStillOpen) {
  ScopedLogCapture capture;
  Broker::Options o;
  o.shutdown_grace = 200ms;
  Broker broker(o);
  Router router(broker, root_opts());
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  // A child that never says a word, nor closes: its stream handshakes until
  // the deadline (the handshake timeout is far longer).
  run_on(broker, [&] { router.add_child_stream(sv[0], sv[0], 7, "silent-child"); });
  const auto t0 = std::chrono::steady_clock::now();
  broker.shutdown();
  broker.join();
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 190ms) << "nothing kept it waiting?";
  std::string line;
  spdlog::level::level_enum level{};
  ASSERT_TRUE(capture.sink().wait_for_line("still open", 1s, &line, &level));
  EXPECT_EQ(level, spdlog::level::warn);
  EXPECT_TRUE(contains(line, "1 link(s) still open: child silent-child ctx=7 (handshaking")) << line;
  ::close(sv[1]);
}

}  // namespace test_shutdown
}  // namespace spindle
