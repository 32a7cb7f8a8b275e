// The load test: many clients of the real spindle-router send messages to
// random peers (tests/load_scenario.h). Zero lost, none corrupted, per-pair
// FIFO order kept, and the router's resident memory bounded. bench/load.cpp
// runs the full size (256 clients x 10,000 messages) and prints rates.
//
// CI size: 32 clients x 2,000 messages (64,000 messages, two hops each), the
// same under ASan and TSan (about a second there).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "tests/load_scenario.h"
#include "tests/process_util.h"
#include "tests/router_probe.h"

namespace spindle {
namespace test_load {

using namespace testutil;
using namespace std::chrono_literals;

constexpr int kMessagesPerClient = 2000;

TEST(Load, ManyClientsToRandomPeersLoseNothingAndKeepPairOrder) {
  TempDir dir;
  std::string sock = dir.path() + "/router.sock";
  RouterProcess router(SPINDLE_ROUTER_BINARY, sock, {"--log-level", "warn"});
  ASSERT_TRUE(router.wait_ready()) << router.log();
  const long rss_before = vm_rss_kib(router.pid());

  load::Options o;
  o.socket = sock;
  o.clients = 32;
  o.messages = kMessagesPerClient;
  load::Result r = load::run(o);

  const long rss_after = vm_rss_kib(router.pid());
  std::printf("load: %d clients x %d messages: %llu received in %.2f s; router VmRSS %ld -> %ld KiB\n",
              o.clients, o.messages, static_cast<unsigned long long>(r.received), r.seconds,
              rss_before, rss_after);
  EXPECT_FALSE(r.timed_out) << "hang guard: not every message arrived";
  EXPECT_EQ(r.send_errors, 0u) << fmt::format("{}", fmt::join(r.errors, "\n"));
  EXPECT_EQ(r.received, static_cast<std::uint64_t>(o.clients) * o.messages);
  EXPECT_EQ(r.out_of_order, 0u) << fmt::format("{}", fmt::join(r.errors, "\n"));
  EXPECT_EQ(r.corrupt, 0u) << fmt::format("{}", fmt::join(r.errors, "\n"));
  // Messages are tiny and the senders wait on back-pressure: the router never
  // holds more than a few queues' worth. 256 MiB is a generous ceiling.
  EXPECT_LT(rss_after, rss_before + 256 * 1024) << "router RSS grew by over 256 MiB";
  RouterCounts c;
  EXPECT_TRUE(eventually([&] { return (c = router_counts(sock)).clients == 1; }))
      << "clients=" << c.clients << " after every load client left";
  int st = router.stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << router.log();
}

}  // namespace test_load
}  // namespace spindle
