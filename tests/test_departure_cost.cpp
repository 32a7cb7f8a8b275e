// Issue #11 §4: a context that goes away costs O(its own ids), however many
// routes other links hold. One raw client holds the most routes a link may
// (65,536, allocated and announced the legitimate way); small clients then
// come and go. The router's own count of what each departure visited
// (stats: departures, departure_steps) must stay proportional to what the
// departing link owned: a handful of entries for a small client, about
// 65,536 for the big one. An operation count, not a clock, so it holds in
// every build flavour and on any machine.
#include <algorithm>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "router/control.h"
#include "tests/router_fixture.h"

namespace spindle {
namespace test_departure_cost {

using namespace testutil;
using namespace std::chrono_literals;

constexpr std::size_t kRoutesPerLink = 65536;     // the router's limit (PROTOCOL.md §7.3.2)

struct DepartureCount {
  long long departures = 0, steps = 0, routes = 0;
};

class DepartureCost : public RouterFixture {
 protected:
  DepartureCount count() {
    const std::string s = router_stats_text(socket());
    return {stats_field(s, " departures="), stats_field(s, " departure_steps="), stats_field(s, " routes=")};
  }
};

TEST_F(DepartureCost, ALinksDepartureVisitsOnlyWhatItOwned) {
  start();
  RawPeer big = raw_client();
  const std::uint32_t big_id = id_;
  // Its own id is one route already: kRoutesPerLink in all.
  const std::vector<std::uint32_t> behind_big = big.allocate_and_announce(big_id, kRoutesPerLink - 1);
  ASSERT_TRUE(eventually([&] { return count().routes >= static_cast<long long>(kRoutesPerLink); }, 60s))
      << "the router holds " << count().routes << " routes";

  // Small clients, each sending one message to a context behind the big
  // link (so each has an egress entry and is a talker of that context), then
  // leaving. Every stats query is a client that departs too: the count of
  // departures is a lower bound taken after the small ones have all gone.
  constexpr int kSmall = 16;
  const DepartureCount before = count();
  for (int i = 0; i < kSmall; ++i) {
    RawPeer small = raw_client();
    small.send_frame(frame(behind_big[static_cast<std::size_t>(i)], id_, id_, 4242, 0), "hello");
    ASSERT_TRUE(small.goodbye()) << "small client " << i << " was not let go";
  }
  DepartureCount after;
  ASSERT_TRUE(eventually([&] {
    after = count();
    return after.departures >= before.departures + kSmall;
  }, 30s));
  const long long departed = after.departures - before.departures;
  const long long per_departure = (after.steps - before.steps) / departed;
  // A small client owns its id, one egress entry and nothing queued: a few
  // steps. Anything that walked the big link's routes would cost 65,536.
  EXPECT_LE(per_departure, 16) << departed << " departures visited " << after.steps - before.steps
                               << " entries while another link held " << after.routes << " routes";

  // The big link's own departure visits its own routes: the count is real.
  const DepartureCount pre_big = count();
  ASSERT_TRUE(big.goodbye());
  DepartureCount post_big;
  ASSERT_TRUE(eventually([&] {
    post_big = count();
    return post_big.routes < static_cast<long long>(kRoutesPerLink);
  }, 30s));
  EXPECT_GE(post_big.steps - pre_big.steps, static_cast<long long>(kRoutesPerLink));
  EXPECT_LE(post_big.steps - pre_big.steps, static_cast<long long>(4 * kRoutesPerLink));
  expect_served("65,536 routes came and went");
}

// Clients that talked to each other go at once. Each departure tells the
// others (DEL_ROUTE), and the write to one that has gone too closes its
// stream within the first departure's handling. The router must survive and
// serve: it crashed when that nested close freed a Link that the first
// departure's loop over the links to tell still held (the departure is now
// corked, so its writes go out after the loop).
TEST_F(DepartureCost, ClientsThatTalkedToEachOtherAndGoAtOnceLeaveTheRouterServing) {
  start();
  constexpr int kPeers = 24;
  constexpr std::uint32_t kHandle = 2700;
  std::vector<RawPeer> peers;
  std::vector<std::uint32_t> ids;
  for (int i = 0; i < kPeers; ++i) {
    peers.push_back(raw_client());
    ids.push_back(id_);
  }
  // One frame from each to each other: each is then told when the others go.
  for (int i = 0; i < kPeers; ++i) {
    std::string burst;
    for (int j = 0; j < kPeers; ++j)
      if (j != i) burst += frame_bytes(frame(ids[j], ids[i], ids[i], kHandle, 0), "");
    peers[i].write_all(burst);
  }
  std::vector<std::uint8_t> in((kPeers - 1) * kHeaderSize);
  for (int i = 0; i < kPeers; ++i)
    ASSERT_EQ(peers[i].read_exact(in.data(), in.size(), 20s), static_cast<long>(in.size())) << "peer " << i;
  peers.clear();  // every socket closed within microseconds
  expect_served(std::to_string(kPeers) + " clients that talked to each other went at once");
}

}  // namespace test_departure_cost
}  // namespace spindle
