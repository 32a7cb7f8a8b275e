// Blocks of context ids (docs/PROTOCOL.md 6.4): a sub-router asks the root
// for a block once and forks its next children from it; the root records
// each block on the link that asked, accepts ADD_ROUTE for each id of it
// once, from that link only, and gives a listener's client one id per
// request whatever it asks for.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <limits>
#include <string>
#include <tuple>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <spindle/spindle.h>

#include "router/child.h"
#include "router/control.h"
#include "router/id_grants.h"
#include "tests/raw_peer.h"
#include "tests/router_fixture.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_id_blocks {

using namespace testutil;
using namespace std::chrono_literals;

TEST(IdGrants, EachGrantedIdIsClaimedOnceAndNothingElse) {
  IdGrants g;
  g.grant(10, 3);  // 10, 11, 12
  g.grant(40, 1);
  EXPECT_EQ(g.blocks(), 2u);
  EXPECT_EQ(g.ids(), 4u);
  EXPECT_FALSE(g.claim(9));
  EXPECT_FALSE(g.claim(13));
  EXPECT_FALSE(g.claim(39));
  EXPECT_TRUE(g.holds(11));
  EXPECT_FALSE(g.holds(13));
  EXPECT_TRUE(g.claim(11));
  EXPECT_FALSE(g.holds(11)) << "an announced id is still held";
  EXPECT_FALSE(g.claim(11)) << "an id was claimed twice";
  EXPECT_TRUE(g.claim(10));
  EXPECT_TRUE(g.claim(12));
  EXPECT_EQ(g.blocks(), 1u) << "an announced block was not forgotten";
  EXPECT_TRUE(g.claim(40));
  EXPECT_EQ(g.blocks(), 0u);
  EXPECT_EQ(g.ids(), 0u);
  g.grant(0xffffffe0u, IdGrants::kMaxIdBlock);
  EXPECT_TRUE(g.claim(0xffffffffu));
  EXPECT_FALSE(g.claim(0xffffffdfu));
}

TEST(IdGrants, RangesParseAsFirstAndCount) {
  using R = std::pair<std::uint32_t, std::uint32_t>;
  EXPECT_EQ(parse_id_range("7"), (R{7, 1}));
  EXPECT_EQ(parse_id_range("7-7"), (R{7, 1}));
  EXPECT_EQ(parse_id_range("3-34"), (R{3, 32}));
  for (const char* bad : {"", "-", "7-", "-7", "7-6", "7-8-9", " 7", "7 -8", "a-b", "0-4294967295"})
    EXPECT_FALSE(parse_id_range(bad).has_value()) << bad;
}

// A child link of an in-process root asks for blocks by hand.
// PROTOCOL.md 6.4: a request without reply_to consumes its grant and gets
// no reply (it was answered on handle 0 of the sender before).
TEST(IdBlocks, ARequestWithoutReplyToGetsNoReplyButItsIdIsSpent) {
  Broker broker;
  Router router(broker, root_opts());
  const std::uint32_t n = router.allocate_id();
  RawPeer peer;
  ASSERT_TRUE(attach_raw(router, peer, n));
  ASSERT_EQ(peer.handshake(), n);
  peer.send_frame(frame(0, n, n, kHandleAllocateId, 0, kEncMitogen), "");
  peer.send_frame(frame(0, n, n, kHandleAllocateId, 7, kEncMitogen), "");
  Message first;
  ASSERT_TRUE(peer.read_frame(first, 20s));
  EXPECT_EQ(first.header.handle, 7u) << "a reply came for a request without reply_to: " << first.text();
  EXPECT_EQ(first.text(), std::to_string(n + 2)) << "the silent request's id was not spent";
  EXPECT_TRUE(peer.goodbye());
}

// Once the root has gone round the id space, a block is the run of free ids
// from the first free one: it ends where an id in use (a route, or a grant
// not yet announced) begins, and the next block starts past it.
TEST(IdBlocks, PastTheEndOfTheIdSpaceABlockStopsAtTheFirstIdInUse) {
  Broker broker;
  Router router(broker, root_opts());
  const std::uint32_t n = router.allocate_id();
  // Two ids handed out and never routed: free again, once round.
  const std::uint32_t unused = router.allocate_id();
  router.allocate_id();
  RawPeer peer;
  ASSERT_TRUE(attach_raw(router, peer, n));
  ASSERT_EQ(peer.handshake(), n);
  Message m;
  peer.send_frame(frame(0, n, n, kHandleAllocateId, 1001, kEncMitogen), "4");
  ASSERT_TRUE(peer.read_frame_for(n, 1001, m, 20s));
  const auto held = parse_id_range(m.text());  // granted, not announced: in use
  ASSERT_TRUE(held) << m.text();

  router.skip_ids_for_testing(std::numeric_limits<std::uint32_t>::max());
  peer.send_frame(frame(0, n, n, kHandleAllocateId, 1002, kEncMitogen), "32");
  ASSERT_TRUE(peer.read_frame_for(n, 1002, m, 20s));
  EXPECT_EQ(parse_id_range(m.text()), (std::pair{unused, held->first - unused}))
      << m.text() << ": from the first id not in use up to the grant";
  peer.send_frame(frame(0, n, n, kHandleAllocateId, 1003, kEncMitogen), "32");
  ASSERT_TRUE(peer.read_frame_for(n, 1003, m, 20s));
  EXPECT_EQ(parse_id_range(m.text()), (std::pair{held->first + held->second, IdGrants::kMaxIdBlock}))
      << m.text() << ": past the grant";
  EXPECT_TRUE(peer.goodbye());
}

TEST(IdBlocks, TheRootGrantsAChildLinkABlockAndEachIdOnce) {
  Broker broker;
  Router router(broker, root_opts());
  const std::uint32_t n = router.allocate_id();
  RawPeer peer;
  ASSERT_TRUE(attach_raw(router, peer, n));
  ASSERT_EQ(peer.handshake(), n);
  auto ask = [&](std::string_view body, std::uint32_t reply_to) {
    peer.send_frame(frame(0, n, n, kHandleAllocateId, reply_to, kEncMitogen), body);
    Message m;
    EXPECT_TRUE(peer.read_frame_for(n, reply_to, m, 20s));
    return m;
  };
  Message a = ask("1000", 1001);  // more than a block: a block
  ASSERT_FALSE(a.is_dead()) << a.text();
  auto block = parse_id_range(a.text());
  ASSERT_TRUE(block) << a.text();
  EXPECT_EQ(block->second, IdGrants::kMaxIdBlock);
  Message one = ask("", 1002);  // the old form: one id, as a bare number
  ASSERT_FALSE(one.is_dead()) << one.text();
  EXPECT_EQ(one.text(), std::to_string(block->first + block->second)) << "ids were skipped or reused";
  for (const char* bad : {"0", "abc", "-1", "99999999999"}) {
    Message d = ask(bad, 1003);
    EXPECT_TRUE(d.is_dead()) << bad;
    EXPECT_TRUE(contains(d.text(), "malformed ALLOCATE_ID request")) << d.text();
  }

  // Every id granted announced twice (the block, then the one id after it),
  // and the next id, granted to nobody: each granted id becomes a route
  // once; the others are refused.
  const std::size_t routes_before = router.stats().routes;
  const std::uint32_t granted = block->second + 1;
  std::string adds;
  for (std::uint32_t i = 0; i <= granted; ++i)
    for (int twice = 0; twice < 2; ++twice)
      adds += frame_bytes(frame(0, n, n, kHandleAddRoute, 0, kEncMitogen), std::to_string(block->first + i));
  peer.write_all(adds);
  ASSERT_TRUE(eventually([&] { return router.stats().routes == routes_before + granted; }, 20s))
      << router.stats().routes;
  // A frame to an id of the block reaches the peer: the route is its.
  router.send(Message::make(block->first + 5, 4242, Payload::copy_of("for you")));
  Message m;
  ASSERT_TRUE(peer.read_frame_for(block->first + 5, 4242, m, 20s));
  EXPECT_EQ(m.text(), "for you");
  EXPECT_EQ(router.stats().routes, routes_before + granted) << "an id granted to nobody was routed";
  EXPECT_TRUE(peer.goodbye());
}

// A listener's client (possibly hostile) gets one id however many it asks.
class IdBlocksClient : public RouterFixture {};

TEST_F(IdBlocksClient, AListenersClientGetsOneIdPerRequest) {
  start();
  RawPeer p = raw_client();
  std::uint32_t last = 0;
  for (std::uint32_t i = 0; i < 3; ++i) {
    p.send_frame(frame(0, id_, id_, kHandleAllocateId, 1100 + i, kEncMitogen), "32");
    Message m;
    ASSERT_TRUE(p.read_frame_for(id_, 1100 + i, m, 20s));
    auto r = parse_id_range(m.text());
    ASSERT_TRUE(r) << m.text();
    EXPECT_EQ(r->second, 1u) << m.text();
    EXPECT_GT(r->first, last);
    last = r->first;
  }
  expect_served("block requests from a client");
}

// ------------------------------------------------- a sub-router's children

inline constexpr method<long()> kForkOne{"test.fork_one"};
inline constexpr method<long()> kEchoId{"test.my_id"};
inline constexpr method<long()> kForkHijacker{"test.fork_hijacker"};
inline constexpr method<long()> kForkBlockHijacker{"test.fork_block_hijacker"};
inline constexpr method<long()> kPid{"test.pid"};

int leaf_main(ChildEnv& env) {
  env.expose(kEchoId, [&env] { return static_cast<long>(env.router().id()); }, Allow::kAnyone);
  return env.serve();
}

// A grandchild that announces the id `kAhead` after its own, as if a
// context of its own had it: with 1, the next id of its parent's block;
// with a block's size, the first of the block its parent will get next.
template <std::uint32_t kAhead>
int hijacker_main(ChildEnv& env) {
  Router& r = env.router();
  r.send(Message::make(*r.parent_id(), kHandleAddRoute,
                       Payload::copy_of(fmt::format("{}:stolen", r.id() + kAhead)), kEncMitogen));
  env.expose(kPid, [] { return static_cast<long>(::getpid()); }, Allow::kAnyone);
  return env.serve();
}

// Its leaves end when it does: their parent link closes.
int sub_router_main(ChildEnv& env) {
  env.expose(kForkOne, [&env] { return static_cast<long>(fork_child(env.router(), leaf_main, named("leaf")).id()); });
  env.expose(kForkHijacker, [&env] {
    return static_cast<long>(fork_child(env.router(), hijacker_main<1>, named("hijacker")).id());
  });
  env.expose(kForkBlockHijacker, [&env] {
    return static_cast<long>(fork_child(env.router(), hijacker_main<IdGrants::kMaxIdBlock>, named("hijacker")).id());
  });
  return env.serve();
}

// The sub-router's second child gets the id after its first, although the
// root handed out another id in between: it came from the block, without a
// round trip. Both are routed and answer calls.
TEST(IdBlocks, ASubRouterForksItsChildrenFromOneBlock) {
  Runtime rt;
  Child sub = rt.fork_child(sub_router_main);
  const long first = sub.call(kForkOne);
  Child other = rt.fork_child(leaf_main);  // the root's next id
  const long second = sub.call(kForkOne);
  EXPECT_EQ(second, first + 1);
  EXPECT_GT(static_cast<long>(other.id()), first + static_cast<long>(IdGrants::kMaxIdBlock) - 1)
      << "the root handed out an id of the sub-router's block";
  for (long id : {first, second})
    EXPECT_EQ(rt.context(static_cast<std::uint32_t>(id), "leaf").call(kEchoId), id);
  EXPECT_EQ(other.call(kEchoId), static_cast<long>(other.id()));
}

// Kills the context `h` (whose pid is `pid`) and waits until the root
// knows that it is gone.
void kill_and_wait(const Context& h, long pid) {
  ASSERT_EQ(::kill(static_cast<pid_t>(pid), SIGKILL), 0);
  ASSERT_TRUE(eventually([&] {
    try {
      h.call(kPid);
      return false;
    } catch (const std::exception&) {
      return true;
    }
  }, 20s)) << "the hijacker's death never reached the root";
}

// A child cannot claim an id its parent keeps for a child not forked yet:
// the parent refuses it (the root would accept it, from the parent's link).
TEST(IdBlocks, AGrandchildCannotTakeAnIdItsParentKeepsForAChild) {
  Runtime rt;
  Child sub = rt.fork_child(sub_router_main);
  const long hijacker = sub.call(kForkHijacker);
  Context h = rt.context(static_cast<std::uint32_t>(hijacker), "hijacker").with_timeout(10s);
  const long pid = h.call(kPid);  // answered after its ADD_ROUTE went up
  const long leaf = sub.call(kForkOne);
  ASSERT_EQ(leaf, hijacker + 1) << "the leaf did not get the id the hijacker announced";
  Context l = rt.context(static_cast<std::uint32_t>(leaf), "leaf").with_timeout(10s);
  EXPECT_EQ(l.call(kEchoId), leaf);
  kill_and_wait(h, pid);
  EXPECT_EQ(l.call(kEchoId), leaf) << "the hijacker's departure took the leaf's route with it";
}

// An id announced before its parent has it (the first of the next block)
// is the real child's once the parent forks it: the announcer's departure
// then leaves the child's route alone.
TEST(IdBlocks, AnIdAnnouncedBeforeItsBlockCameIsTheRealChildsOnceForked) {
  Runtime rt;
  Child sub = rt.fork_child(sub_router_main);
  const long hijacker = sub.call(kForkBlockHijacker);
  Context h = rt.context(static_cast<std::uint32_t>(hijacker), "hijacker").with_timeout(10s);
  const long pid = h.call(kPid);
  long leaf = 0;
  for (std::uint32_t i = 0; i < IdGrants::kMaxIdBlock; ++i) leaf = sub.call(kForkOne);
  ASSERT_EQ(leaf, hijacker + static_cast<long>(IdGrants::kMaxIdBlock))
      << "the last leaf did not get the id the hijacker announced";
  Context l = rt.context(static_cast<std::uint32_t>(leaf), "leaf").with_timeout(10s);
  EXPECT_EQ(l.call(kEchoId), leaf);
  kill_and_wait(h, pid);
  EXPECT_EQ(l.call(kEchoId), leaf) << "the hijacker's departure took the leaf's route with it";
}

}  // namespace test_id_blocks
}  // namespace spindle
