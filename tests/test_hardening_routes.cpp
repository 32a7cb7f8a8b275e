// The routes a client announces are charged to it (docs/PROTOCOL.md §14):
// each context behind a client's link costs it Router::kRouteStateBytes of
// its memory allowance, and each context it sends to kEgressStateBytes, until
// the context or the client goes. An ADD_ROUTE that does not fit the
// client's allowance, or the router's global limit, is refused with the
// reason, and the id stays the client's to announce later.
//
// Before, only the per-link limit (65,536 routes) bounded them: every
// client could make the router keep some 15 MiB of routes (more with
// names), and the 4,096 clients --max-clients allows some 60 GiB, none of it
// on any account. This test prints what a route costs the router's RSS.
#include <future>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/hardening_fixture.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/router_probe.h"

namespace spindle {
namespace test_hardening_routes {

using namespace testutil;
using namespace std::chrono_literals;

constexpr long long kLimit = 1 << 20;  // --peer-memory-limit and --memory-limit
constexpr long long kRouteCost = Router::kRouteStateBytes;

TEST_F(Hardening, TheRoutesAClientAnnouncesAreChargedToItAndShared) {
  start({"--peer-memory-limit", "1M", "--memory-limit", "1M"});
  auto stat = [&](const char* key) { return stats_field(router_stats_text(socket()), key); };
  auto state_of = [&](std::uint32_t id) { return stats_field(client_line(id), " state_held="); };
  auto refusal_for = [&](std::uint32_t id) {
    auto lines = lines_with(fmt::format("stream=client-{}.", id));
    std::erase_if(lines, [](const std::string& l) { return l.find("refused ADD_ROUTE") == std::string::npos; });
    return lines.empty() ? std::string() : lines.front();
  };
  ASSERT_EQ(stat(" state_limit="), kLimit);
  const long long routes_before = stat(" routes="), state_before = stat(" state_held=");
  const long rss_before = rss_kib();

  // A announces 3,000 contexts: its 1 MiB pays for about 2,000 of them,
  // which fills the router's budget too.
  RawPeer a = raw_client();
  const std::uint32_t a_id = id_;
  a.allocate_and_announce(a_id, 3000);
  ASSERT_TRUE(eventually([&] { return !refusal_for(a_id).empty(); })) << router_->log();
  EXPECT_TRUE(contains(refusal_for(a_id), fmt::format("a context behind a link costs it {} bytes", kRouteCost)))
      << refusal_for(a_id);
  EXPECT_TRUE(contains(refusal_for(a_id), fmt::format("of its {} limit", kLimit))) << refusal_for(a_id);
  const long long a_routes = stat(" routes=") - routes_before;
  EXPECT_LE(a_routes, kLimit / kRouteCost) << "more routes than A's allowance pays for";
  EXPECT_GE(a_routes, kLimit / kRouteCost / 2) << "A's routes were refused well within its allowance";
  EXPECT_GE(state_of(a_id), a_routes * kRouteCost) << client_line(a_id);
  EXPECT_LE(state_of(a_id), kLimit) << client_line(a_id);
  const long rss_a = rss_kib();

  // Past its allowance, A cannot be recorded as a talker of a new
  // destination, so it would not be told when that one goes. Its call there
  // is refused, with the reason (it would wait out its timeout were the
  // callee to go); its one-way message is delivered, untracked: A is
  // charged nothing for it.
  auto delivered = std::make_shared<std::promise<std::string>>();
  good_->router().add_handler([delivered](Message&& m) { delivered->set_value(m.text()); }, {}, 4321);
  const long long a_state = state_of(a_id);
  a.send_frame(frame(good_->id(), a_id, a_id, 4321, 0), "a message past its allowance");
  a.send_frame(frame(good_->id(), a_id, a_id, 4321, 77), "a call past its allowance");
  Message d;
  ASSERT_TRUE(a.read_frame_for(a_id, 77, d, 20s)) << router_->log();
  EXPECT_TRUE(d.is_dead());
  EXPECT_TRUE(contains(d.text(), fmt::format("context {} cannot be told when context {} goes: over the memory "
                                             "limit for routes", a_id, good_->id()))) << d.text();
  auto message = delivered->get_future();
  ASSERT_EQ(message.wait_for(20s), std::future_status::ready) << "the one-way message was not delivered";
  EXPECT_EQ(message.get(), "a message past its allowance");
  EXPECT_EQ(state_of(a_id), a_state) << "A was charged for a destination it cannot be told about";

  // B, holding next to nothing, still gets its share past the router's
  // full budget, and is refused beyond it; the router holds at most twice
  // its budget.
  RawPeer b = raw_client();
  const std::uint32_t b_id = id_;
  const std::vector<std::uint32_t> b_ids = b.allocate_and_announce(b_id, 1000);
  ASSERT_TRUE(eventually([&] { return !refusal_for(b_id).empty(); })) << router_->log();
  EXPECT_TRUE(contains(refusal_for(b_id), "the router holds")) << refusal_for(b_id);
  const long long b_routes = stat(" routes=") - routes_before - a_routes;
  EXPECT_GE(b_routes, 16) << "B got no share of the full budget";
  EXPECT_LT(b_routes, 1000) << "B's routes were not bounded by its share";
  EXPECT_LE(stat(" state_held="), 2 * kLimit);

  // Messages still flow for everyone: they are not charged to this budget.
  expect_served("routes announced past the router's budget");

  // A leaves, and its charge with it; B's refused ids are still B's to
  // announce, and now they fit.
  EXPECT_TRUE(a.goodbye(30s));
  ASSERT_TRUE(eventually([&] { return state_of(a_id) < 0; }, 20s)) << "A is still listed";
  const long long routes_after_a = stat(" routes=");
  b.announce(b_id, b_ids);
  ASSERT_TRUE(eventually([&] { return stat(" routes=") >= routes_after_a + (1000 - b_routes) - 2; }, 20s))
      << router_stats_text(socket());
  EXPECT_GE(state_of(b_id), 1000 * kRouteCost) << client_line(b_id);

  // B leaves: every byte charged for routes is given back.
  EXPECT_TRUE(b.goodbye(30s));
  EXPECT_TRUE(eventually([&] { return stat(" routes=") == routes_before; }, 20s)) << router_stats_text(socket());
  EXPECT_TRUE(eventually([&] { return stat(" state_held=") == state_before; }, 20s))
      << router_stats_text(socket());
  std::printf("router VmRSS: %ld KiB before, %ld KiB with A's %lld routes (%.0f bytes a route)\n", rss_before,
              rss_a, a_routes, a_routes ? (rss_a - rss_before) * 1024.0 / static_cast<double>(a_routes) : 0.0);
  expect_served("routes given back");
}

}  // namespace test_hardening_routes
}  // namespace spindle
