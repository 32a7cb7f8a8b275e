// Issue #11 §1, the two limits of the accounting rule against the real
// spindle-router (docs/PROTOCOL.md §14): each peer has its own limit, and all
// of them share one global limit. Over the global limit, a peer holding more
// than its fair share (limit / peers) is no longer read, however much its own
// limit would still allow, while a peer holding little goes on being served.
// So the router holds at most about twice its global limit whatever its
// per-peer limits add up to. Also §2's aggregation of repeated refusals.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "router/reasons.h"
#include "tests/hardening_fixture.h"
#include "tests/listener_test_util.h"
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

// Raw clients of another uid: a child process takes that uid, connects `n`
// clients to `address` (each completes the handshake, then `then` runs on
// it), reports their ids and keeps them connected until this object goes.
// ids() has those it reported, fewer if the child failed.
class OtherUidClients {
 public:
  OtherUidClients(uid_t uid, const UnixAddress& address, int n,
                  const std::function<void(RawPeer&, std::uint32_t)>& then = {}) {
    int ids[2], hold[2];
    if (::pipe2(ids, O_CLOEXEC) != 0 || ::pipe2(hold, O_CLOEXEC) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(ids[0]);
      ::close(hold[1]);
      if (::setgid(uid) != 0 || ::setuid(uid) != 0) ::_exit(2);
      std::vector<RawPeer> peers;
      for (int i = 0; i < n; ++i) {
        RawPeer p = RawPeer::connect_to(address);
        const std::uint32_t id = p.handshake();
        if (then) then(p, id);
        if (::write(ids[1], &id, sizeof id) != sizeof id) ::_exit(3);
        peers.push_back(std::move(p));
      }
      ::close(ids[1]);
      char c;
      while (::read(hold[0], &c, 1) > 0) {
      }
      ::_exit(0);
    }
    ::close(ids[1]);
    ::close(hold[0]);
    hold_ = hold[1];
    for (std::uint32_t id; pid_ > 0 && ::read(ids[0], &id, sizeof id) == sizeof id;) ids_.push_back(id);
    ::close(ids[0]);
  }
  ~OtherUidClients() { release(); }
  const std::vector<std::uint32_t>& ids() const { return ids_; }
  // Disconnects them: the child exits and is reaped.
  void release() {
    if (hold_ >= 0) ::close(std::exchange(hold_, -1));
    if (pid_ > 0) {
      int st = 0;
      ::waitpid(std::exchange(pid_, -1), &st, 0);
    }
  }

 private:
  pid_t pid_ = -1;
  int hold_ = -1;
  std::vector<std::uint32_t> ids_;
};

// The budget's fair shares go by uid first (stream/account.h, MemoryBudget):
// a user admitted with --allow-uid who opens many connections divides only
// his own half. Fifteen connections of uid 65534 flood dead replies at
// themselves and never read, past the 8 MiB global limit; a client of the
// router's own uid is then still read up to its uid's half shared with the
// good client (2 MiB), where by peers (limit / 17) it was paused under 0.9
// MiB, a 17th of the budget plus one read and its answers.
TEST(HardeningUids, ManyConnectionsOfOneUidDivideOnlyThatUidsPartOfTheBudget) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  constexpr uid_t kOther = 65534;
  constexpr int kHostile = 15;
  constexpr long long kGlobal = 8 << 20;
  TempDir dir;
  const std::string sock = fmt::format("@spindle-test-uid-share-{}", ::getpid());
  RouterProcess router(SPINDLE_ROUTER_BINARY, sock,
                       {"--allow-uid", std::to_string(kOther), "--memory-limit", "8M",
                        "--peer-memory-limit", "64M", "--stall-timeout", "120s", "--log-level", "info"},
                       dir.path() + "/router.log");
  ASSERT_TRUE(router.wait_ready()) << router.log();
  auto good = connect(sock, RouterOptions{.name = "good"});
  const UnixAddress address = UnixAddress::parse(sock);
  // Frames to nowhere that want an answer, from context `id` to itself.
  auto burst_from = [](std::uint32_t id) {
    std::string burst;
    for (int k = 0; k < 4096; ++k) burst += frame_bytes(frame(kNowhere, id, id, kEcho, 7), "");
    return burst;
  };
  // The other user: its connections flood, then stay.
  OtherUidClients hostile(kOther, address, kHostile,
                          [&](RawPeer& p, std::uint32_t id) { flood(p, burst_from(id), 500ms, 20s); });
  ASSERT_EQ(hostile.ids().size(), static_cast<std::size_t>(kHostile)) << router.log();
  const std::string before = router_stats_text(sock);
  EXPECT_GT(stats_field(before, " memory_held="), kGlobal)
      << "the other uid never exceeded the budget: the test proves nothing\n" << before;

  // A client of the router's own uid floods the same way until it is paused.
  RawPeer mine = RawPeer::connect_to(address);
  const std::uint32_t id = mine.handshake();
  const std::string burst = burst_from(id);
  auto line_of = [&](std::uint32_t cid) {
    std::istringstream in(router_stats_text(sock));
    std::string line, want = fmt::format("client id={} ", cid);
    while (std::getline(in, line))
      if (line.rfind(want, 0) == 0) return line;
    return std::string();
  };
  bool paused = false;
  for (int round = 0; round < 5 && !paused; ++round) {
    flood(mine, burst, 2s, 30s);
    paused = stats_field(line_of(id), " paused=") == 1;
  }
  const std::string line = line_of(id);
  std::printf("%s\n", line.c_str());
  hostile.release();
  ASSERT_TRUE(paused) << "never paused: " << line << "\n" << router_stats_text(sock);
  EXPECT_GT(stats_field(line, " memory_peak="), 3ll << 19)
      << "paused under 1.5 MiB: its share was cut by the other uid's connections\n" << line;
  EXPECT_LT(stats_field(line, " memory_peak="), 4ll << 20) << "past its uid's half: " << line;
  EXPECT_EQ(services::call_text(good->router_context(), services::kPingService, services::kPingMethod, "hi",
                                std::chrono::seconds(20)),
            "hi");
}

// What a service lane divides its bounds by (services/lanes.h) comes from
// the router: a client's link and the uid its stream was accepted with
// (SO_PEERCRED), this process's uid for anything else.
TEST(HardeningUids, AClientsShareKeyCarriesTheUidItConnectedWith) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  constexpr uid_t kOther = 65534;
  ListenerOptions lo;
  lo.address = UnixAddress{fmt::format("spindle-test-share-key-{}", ::getpid()), true};
  lo.allowed_uids = {::geteuid(), kOther};
  InProcessRouter root(lo);
  auto mine = root.client();
  OtherUidClients others(kOther, root.address(), 1);
  ASSERT_EQ(others.ids().size(), 1u) << "the other uid's client never connected";
  const std::uint32_t other = others.ids()[0];
  // The client has its id once the welcome is written; the router routes
  // it a moment later, on its broker thread.
  auto routed = [&](std::uint32_t id) { return root.router().share_key(id).sender > 0xffffffffull; };
  EXPECT_TRUE(eventually([&] { return routed(other) && routed(mine->id()); }, 10s));
  const Router::ShareKey theirs = root.router().share_key(other);
  const Router::ShareKey ours = root.router().share_key(mine->id());
  const Router::ShareKey nobody = root.router().share_key(999999);
  EXPECT_EQ(theirs.uid, kOther);
  EXPECT_EQ(ours.uid, ::geteuid());
  EXPECT_NE(theirs.sender, ours.sender);
  EXPECT_GT(theirs.sender, 0xffffffffull) << "a client's link, above every context id";
  EXPECT_EQ(nobody.sender, 999999u);
  EXPECT_EQ(nobody.uid, ::geteuid());
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
