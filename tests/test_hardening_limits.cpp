// Issue #11 §1, the two limits of the accounting rule against the real
// spindle-router (docs/PROTOCOL.md §14): each peer has its own limit, and all
// of them share one global limit. Over the global limit, a peer holding more
// than its fair share (limit / peers) is no longer read, however much its own
// limit would still allow, while a peer holding little goes on being served.
// So the router holds at most about twice its global limit whatever its
// per-peer limits add up to. Also §2's aggregation of repeated refusals.
#include <regex>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "router/reasons.h"
#include "tests/hardening_fixture.h"
#include "tests/raw_peer.h"
#include "tests/router_probe.h"

namespace spindle {
namespace test_hardening_limits {

using namespace testutil;
using namespace std::chrono_literals;

constexpr std::uint32_t kEcho = 2000;
constexpr std::uint32_t kNowhere = 999999;  // a context that does not exist

// Three clients flood dead replies at themselves and never read. Each may
// hold 64 MiB on its own, 192 MiB together; the router may hold 8 MiB in all.
// Before the global limit existed (or with it ignored by Account::over()),
// each flooder was read until its own 64 MiB.
TEST_F(Hardening, TheGlobalLimitStopsReadingPeersOverTheirFairShare) {
  constexpr long long kGlobal = 8 << 20, kPeer = 64 << 20;
  start({"--memory-limit", "8M", "--peer-memory-limit", "64M", "--stall-timeout", "120s"});
  std::vector<RawPeer> flooders;
  std::vector<std::uint32_t> ids;
  for (int i = 0; i < 3; ++i) {
    flooders.push_back(raw_client());
    ids.push_back(id_);
  }
  // Floods a client with frames that want a reply from nowhere, never
  // reading, until the router stops reading it (paused=1 in its stats line).
  auto flood_until_paused = [&](RawPeer& p, std::uint32_t id, const std::string& burst) {
    for (int round = 0; round < 5; ++round) {
      flood(p, burst, 2s, 30s);
      if (stats_field(client_line(id), " paused=") == 1) return true;
    }
    return false;
  };
  for (std::size_t i = 0; i < flooders.size(); ++i) {
    std::string burst;
    for (int k = 0; k < 4096; ++k) burst += frame_bytes(frame(kNowhere, ids[i], ids[i], kEcho, 7), "");
    ASSERT_TRUE(flood_until_paused(flooders[i], ids[i], burst))
        << "flooder " << i << " was never paused: " << client_line(ids[i]) << "\n"
        << router_stats_text(socket());
  }
  const std::string stats = router_stats_text(socket());
  std::printf("%s", stats.c_str());
  // Each flooder was stopped far below its own limit: by the global one.
  for (std::uint32_t id : ids) {
    const std::string line = client_line(id);
    EXPECT_EQ(stats_field(line, " paused="), 1) << line;
    EXPECT_LT(stats_field(line, " memory_peak="), kGlobal + (2 << 20)) << line;
  }
  // The router as a whole: the global limit, plus at most a fair share per
  // peer that was read while the limit was already exceeded, plus a read's
  // worth each; nowhere near the 192 MiB the per-peer limits allow.
  const long long peak = stats_field(stats, " memory_peak=");
  EXPECT_GT(peak, kGlobal) << "the flood never reached the global limit: the test proves nothing";
  EXPECT_LE(peak, 2 * kGlobal + (2 << 20)) << stats;
  EXPECT_LT(peak, kPeer) << stats;

  // A peer holding little is still read and answered while the budget is
  // exceeded: a new client's request to nowhere gets its dead reply.
  RawPeer light = raw_client();
  light.send_frame(frame(kNowhere, id_, id_, kEcho, 31), "");
  Message dead;
  ASSERT_TRUE(light.read_frame_for(id_, 31, dead, 20s)) << router_->log();
  EXPECT_TRUE(dead.is_dead());
  EXPECT_NE(dead.text().find(reason::kNoRoute), std::string::npos) << dead.text();
  expect_served("three peers paused by the global limit");

  // A flooder that leaves gives its share back; the others are read again
  // once the budget is under its limit (they still hold replies they never
  // read, so they may pause again, but the router's total falls).
  const long long held_before = stats_field(router_stats_text(socket()), " memory_held=");
  flooders[0].goodbye(20s);
  EXPECT_TRUE(eventually([&] {
    return stats_field(router_stats_text(socket()), " memory_held=") < held_before;
  }, 30s)) << router_stats_text(socket());
}

// §2: repeated refusals from one client are summed up, a line a second at
// most, and what is left unreported when it leaves is reported then: every
// refusal is counted, in a handful of lines (before: the count since the last
// line was lost when the client left).
TEST_F(Hardening, RefusalsAreSummedUpAndTheLastOnesReportedWhenTheClientLeaves) {
  start();
  RawPeer p = raw_client();
  constexpr int kRefused = 50;
  std::string burst;
  for (int i = 0; i < kRefused; ++i)
    burst += frame_bytes(frame(0, id_, id_, kHandleAddRoute, 0, kEncMitogen), fmt::format("bad{}", i));
  p.write_all(burst);
  ASSERT_TRUE(p.goodbye(20s));
  ASSERT_TRUE(logged("more refusal(s)")) << router_->log();
  long counted = 0;
  const auto lines = lines_with("refusal(s)");
  const std::regex count(R"( (\d+) (more )?refusal\(s\))");
  for (const std::string& line : lines) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(line, m, count)) << line;
    counted += std::stol(m[1].str());
  }
  EXPECT_EQ(counted, kRefused) << router_->log();
  EXPECT_LE(lines.size(), 4u) << router_->log();
  expect_served("a burst of refusals");
}

}  // namespace test_hardening_limits
}  // namespace spindle
