// Hostile input against the real spindle-router: raw peers (tests/raw_peer.h)
// send what a well-behaved client never would. Each case must end in a clear
// error, a dead reply, or a logged disconnect of that peer alone, and the
// router must keep serving a well-behaved client throughout: after each case
// that client makes a ping call.
#include <fcntl.h>
#include <sys/socket.h>

#include <atomic>
#include <future>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "router/reasons.h"
#include "spindle/fds.h"
#include "tests/fds_test_util.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/router_fixture.h"
#include "tests/router_probe.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_hostile {

using namespace testutil;
using namespace std::chrono_literals;

constexpr std::uint32_t kEcho = 2000;
constexpr std::size_t kMaxMessage = 4096;  // the router's --max-message-size here

// A spindle-router with a small message limit, and a well-behaved client.
class Hostile : public RouterFixture {
 protected:
  void SetUp() override { start({"--max-message-size", std::to_string(kMaxMessage)}); }
};

TEST_F(Hostile, BadHelloMagicIsRefusedWithAReason) {
  RawPeer p = RawPeer::connect_to(address());
  p.write_all("HELO, world");
  char head[6];
  ASSERT_EQ(p.read_exact(head, sizeof head), 6);
  EXPECT_EQ(std::string(head, 4), "SPNO");
  EXPECT_TRUE(closed_by_peer(p.fd, 20s));  // after the reason, EOF
  EXPECT_TRUE(logged("neither a Spindle hello"));
  expect_served("bad hello magic");
}

// A client that sent fds with its hello's first byte, and then nothing, made
// the router hold them until the handshake timed out (10 s): a few such
// connections could pin thousands of the router's fds. They end the
// handshake at once now: no peer sends fds before the welcome said it may.
TEST_F(Hostile, FdsSentBeforeTheHandshakeCompletesEndIt) {
  const std::size_t before = count_open_fds(router_->pid());
  RawPeer p = RawPeer::connect_to(address());
  std::vector<UniqueFd> ends;
  std::vector<int> raw;
  for (int i = 0; i < 100; ++i) {
    int pf[2];
    ASSERT_EQ(::pipe2(pf, O_CLOEXEC), 0);
    for (int fd : pf) {
      ends.emplace_back(fd);
      raw.push_back(fd);
    }
  }
  const std::uint8_t first = 'S';  // a Spindle hello's first byte
  ASSERT_TRUE(send_with_fds(p.fd, std::span<const std::uint8_t>(&first, 1), raw));
  EXPECT_TRUE(closed_by_peer(p.fd, 5s)) << "the router waited for the rest of the hello";
  EXPECT_TRUE(logged("fds arrived before the handshake completed")) << router_->log();
  EXPECT_TRUE(eventually([&] { return count_open_fds(router_->pid()) <= before; }, 5s))
      << count_open_fds(router_->pid()) << " fds open, " << before << " before";
  expect_served("fds sent with a hello");
}

TEST_F(Hostile, BadFrameMagicDisconnectsThatPeerWithALogLine) {
  RawPeer p = raw_client();
  p.send_frame(frame(0, id_, id_, kEcho, 55, 0x5858), "garbage");
  EXPECT_TRUE(p.wait_eof(nullptr));
  EXPECT_TRUE(logged("protocol error: bad magic 0x5858"));
  EXPECT_TRUE(logged(fmt::format("client ctx={} pid=", id_)));
  expect_served("bad frame magic");
}

TEST_F(Hostile, LengthOverTheMaximumGetsADeadReplyThenADisconnect) {
  RawPeer p = raw_client();
  Header h = frame(0, id_, id_, kEcho, 56);
  h.length = kMaxMessage + 1;
  HeaderBytes hb = encode_header(h);
  p.write_all(hb.data(), hb.size());  // the body never comes: the header alone decides
  std::vector<Message> seen;
  EXPECT_TRUE(p.wait_eof(&seen));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_TRUE(seen[0].is_dead());
  EXPECT_EQ(seen[0].header.handle, 56u);
  EXPECT_TRUE(contains(seen[0].text(), reason::kTooLarge)) << seen[0].text();
  EXPECT_TRUE(logged("protocol error: message too large"));
  expect_served("a length over the maximum");
}

TEST_F(Hostile, TruncatedHeaderThenEofIsALoggedDisconnect) {
  RawPeer p = raw_client();
  std::string f = frame_bytes(frame(0, id_, id_, kEcho, 57), "cut short");
  p.write_all(f.substr(0, 10));
  ::shutdown(p.fd, SHUT_WR);
  std::vector<Message> seen;
  EXPECT_TRUE(p.wait_eof(&seen));
  EXPECT_TRUE(seen.empty()) << "a partial frame was acted on";
  EXPECT_TRUE(logged("peer closed mid-message"));
  expect_served("a truncated header");
}

TEST_F(Hostile, SpoofedSrcOrAuthGetsAReversePathDeadReply) {
  RawPeer p = raw_client();
  const std::uint32_t victim = good_->id();
  const long long victim_got = stats_field(client_line(victim), " messages_out=");
  ASSERT_GE(victim_got, 0) << client_line(victim);
  struct Case {
    std::uint32_t src, auth;
  };
  // Another client's id, the router's own id, and an id nobody has.
  for (Case c : {Case{victim, id_}, Case{id_, victim}, Case{0, id_}, Case{id_, 0}, Case{777, 777}}) {
    SCOPED_TRACE(fmt::format("src={} auth={}", c.src, c.auth));
    p.send_frame(frame(0, c.src, c.auth, kEcho, 58), "spoofed");
    Message d;
    ASSERT_TRUE(p.read_frame(d));
    EXPECT_TRUE(d.is_dead());
    EXPECT_EQ(d.header.handle, 58u);
    EXPECT_TRUE(contains(d.text(), reason::kReversePath)) << d.text();
    // PROTOCOL §8.1: it carries the src_id the frame claimed as its dst_id,
    // on the spoofer's own connection, and comes from the router (src: the
    // context the frame was for).
    EXPECT_EQ(d.header.dst_id, c.src);
    EXPECT_EQ(d.header.src_id, 0u);
    EXPECT_EQ(d.header.auth_id, p.server_id);
  }
  // None of them was routed to the client whose id was claimed.
  EXPECT_EQ(stats_field(client_line(victim), " messages_out="), victim_got);
  // The spoofer is not disconnected: an honest frame still gets its answer
  // (here: no such handle at the router).
  p.send_frame(frame(0, id_, id_, kEcho, 59), "honest");
  Message d;
  ASSERT_TRUE(p.read_frame(d));
  EXPECT_EQ(d.header.handle, 59u);
  EXPECT_TRUE(contains(d.text(), reason::kInvalidHandle)) << d.text();
  expect_served("spoofed ids");
}

TEST_F(Hostile, UnknownHandleGetsADeadReply) {
  RawPeer p = raw_client();
  p.send_frame(frame(0, id_, id_, 4321, 60), "anyone?");  // at the router
  Message d;
  ASSERT_TRUE(p.read_frame(d));
  EXPECT_TRUE(d.is_dead());
  EXPECT_EQ(d.text(), fmt::format("{}: 4321", reason::kInvalidHandle));
  p.send_frame(frame(good_->id(), id_, id_, 4321, 61), "anyone?");  // at another client
  ASSERT_TRUE(p.read_frame(d));
  EXPECT_TRUE(d.is_dead());
  EXPECT_EQ(d.header.handle, 61u);
  EXPECT_EQ(d.text(), fmt::format("{}: 4321", reason::kInvalidHandle));
  expect_served("unknown handles");
}

TEST_F(Hostile, ShutdownFromAClientIsRefusedByPolicy) {
  RawPeer p = raw_client();
  p.send_frame(frame(0, id_, id_, kHandleShutdown, 62, kEncMitogen), "");
  Message d;
  ASSERT_TRUE(p.read_frame(d));
  EXPECT_TRUE(d.is_dead());
  EXPECT_TRUE(contains(d.text(), reason::kRefusedByPolicy)) << d.text();
  expect_served("SHUTDOWN from a client");
}

// A client may announce only contexts the root has allocated: an id handed
// out later belongs to whoever it is handed to.
TEST_F(Hostile, AddRouteForAFutureIdCannotHijackTheNextClient) {
  RawPeer p = raw_client();
  std::string flood;
  for (std::uint32_t i = 1; i <= 64; ++i)
    flood += frame_bytes(frame(0, id_, id_, kHandleAddRoute, 0, kEncMitogen),
                         fmt::format("{}:hijack", id_ + i));
  p.write_all(flood);
  EXPECT_TRUE(logged(reason::kNotYourId));
  // The next clients get those ids, and messages to them reach them.
  std::vector<std::unique_ptr<Connection>> later;
  for (int i = 0; i < 3; ++i) {
    later.push_back(connect(socket()));
    Router& r = later.back()->router();
    r.add_handler([&r](Message&& m) { r.reply(m, Payload::copy_of("me:" + m.text())); }, {}, kEcho);
    EXPECT_EQ(good_->context(later.back()->id()).call(kEcho, "who?", 20s), "me:who?");
  }
  // And the hijacker's leaving takes nothing with it.
  p.goodbye();
  for (auto& c : later) EXPECT_EQ(good_->context(c->id()).call(kEcho, "still?", 20s), "me:still?");
  expect_served("ADD_ROUTE for future ids");
}

// A flood of ALLOCATE_ID, ADD_ROUTE and DEL_ROUTE: the router stays correct,
// the ids one link may hold unannounced and the routes it may hold are
// bounded, and DEL_ROUTE for a context the peer does not route is ignored.
TEST_F(Hostile, AddRouteAndDelRouteFloodsStayBoundedAndCorrect) {
  const long rss_before = vm_rss_kib(router_->pid());
  RawPeer p = raw_client();
  // Too many ids at once: the first 1,024 are granted, the rest refused.
  std::string alloc;
  for (std::uint32_t i = 0; i < 2000; ++i)
    alloc += frame_bytes(frame(0, id_, id_, kHandleAllocateId, 0, kEncMitogen), "");
  p.write_all(alloc);
  EXPECT_TRUE(logged("are not announced yet"));
  // Announced in rounds (each id once it is the link's), up to the per-link
  // limit of 65,536 routes and past it.
  constexpr std::uint32_t kIds = 70000;
  std::string adds;
  for (std::uint32_t i = 1; i <= 1024; ++i)
    adds += frame_bytes(frame(0, id_, id_, kHandleAddRoute, 0, kEncMitogen), std::to_string(id_ + i));
  p.write_all(adds);
  for (std::uint32_t next = id_ + 1025; next <= id_ + kIds; next += 1000) {
    std::string batch;
    for (std::uint32_t i = 0; i < 1000; ++i)
      batch += frame_bytes(frame(0, id_, id_, kHandleAllocateId, 0, kEncMitogen), "");
    for (std::uint32_t i = 0; i < 1000; ++i)
      batch += frame_bytes(frame(0, id_, id_, kHandleAddRoute, 0, kEncMitogen), std::to_string(next + i));
    p.write_all(batch);
  }
  std::string dels;
  for (std::uint32_t i = 1; i <= kIds; ++i)
    dels += frame_bytes(frame(0, id_, id_, kHandleDelRoute, 0, kEncMitogen),
                        std::to_string(good_->id()));  // not the peer's to delete
  p.write_all(dels);
  EXPECT_TRUE(logged("the link already routes 65536 contexts (limit 65536)"));
  // The victim of the DEL_ROUTE flood is still reachable, and so is the router.
  Router& g = good_->router();
  g.add_handler([&g](Message&& m) { g.reply(m, Payload::copy_of("ok")); }, {}, kEcho);
  auto other = connect(socket());
  EXPECT_EQ(other->context(good_->id()).call(kEcho, "there?", 20s), "ok");
  // An announced route works: a frame to it reaches the announcer.
  p.send_frame(frame(id_ + 5, id_, id_, 4321, 0), "loop");  // leads back: a dead end, logged
  // The flood's memory is given back when the peer leaves.
  EXPECT_TRUE(p.goodbye(60s));
  const long rss_after = vm_rss_kib(router_->pid());
  RecordProperty("router_rss_kib_before", std::to_string(rss_before));
  RecordProperty("router_rss_kib_after", std::to_string(rss_after));
  std::printf("router VmRSS %ld KiB before, %ld KiB after the flood\n", rss_before, rss_after);
  EXPECT_LT(rss_after, rss_before + 64 * 1024) << "a route flood grew the router by over 64 MiB";
  expect_served("ADD_ROUTE and DEL_ROUTE floods");
}

// Messages to many ids that name no context cost nothing that lasts.
TEST_F(Hostile, MessagesToRandomIdsGetNoRouteAndLeaveNothingBehind) {
  RawPeer p = raw_client();
  std::mt19937 rng(1234);
  std::string burst;
  for (int i = 0; i < 20000; ++i)
    burst += frame_bytes(frame(100000 + (rng() % 1000000000), id_, id_, kEcho, 0), "x");
  p.write_all(burst);
  p.send_frame(frame(424242, id_, id_, kEcho, 63), "last");
  Message d;
  ASSERT_TRUE(p.read_frame_for(id_, 63, d, 60s));
  EXPECT_EQ(d.text(), fmt::format("{}: 424242", reason::kNoRoute));
  expect_served("messages to random ids");
}

TEST_F(Hostile, RandomBytesDisconnectThatPeerAlone) {
  std::mt19937 rng(42);
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE(round);
    std::string junk(4096 + round * 1000, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    // Half before the handshake, half after it.
    RawPeer p = round % 2 ? raw_client() : RawPeer::connect_to(address());
    try {
      p.write_all(junk);
    } catch (const Error&) {
      // The router may close on the first bad byte, before the rest is sent.
    }
    // Whatever the router answered (a refusal, a dead reply), then EOF.
    EXPECT_TRUE(closed_by_peer(p.fd, 20s)) << "the router kept a peer that sent random bytes";
    expect_served("random bytes");
  }
  RouterCounts c;
  EXPECT_TRUE(eventually([&] { return (c = router_counts(socket())).clients == 2; }))
      << "clients=" << c.clients << " (the good client and the probe expected)";
}

// A flood of file descriptors at a receiver that has stopped reading: the
// router charges the sender's quota of fds in flight (1024 by default) and
// answers what is over it with a dead reply; nothing hangs, the receiver gets
// the rest once it reads again, and everyone else is served meanwhile.
TEST_F(Hostile, FloodOfFdsIsBoundedByTheSendersQuota) {
  constexpr std::uint32_t kSink = 2100;
  // Bodies big enough (but under the 1 MiB memfd threshold) to fill the
  // receiver's socket buffer (up to 8 MiB), so the fds wait in the router's
  // queue. The high-water marks are raised on both sides so that the only
  // limit this flood can meet is the fd quota.
  constexpr int kMessages = 48, kFdsEach = 100;
  constexpr std::size_t kBody = 900 * 1024;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<int> received{0};
  // This fixture's router allows 4 KiB messages: start one with the default limit.
  std::string sock = dir_.path() + "/fds.sock";
  RouterProcess router(SPINDLE_ROUTER_BINARY, sock, {"--high-water-mark", "256M"});
  ASSERT_TRUE(router.wait_ready()) << router.log();
  Connection b;
  b.router().add_handler(
      [&](Message&& m) {
        if (received.fetch_add(1) == 0) released.wait();  // stop reading for a while
        b.router().reply(m, Payload::copy_of(std::to_string(m.fds.size())));
      },
      {}, kSink);
  b.connect(UnixAddress::parse(sock));
  RouterOptions roomy;
  roomy.high_water_mark = 256u << 20;
  auto a = connect(sock, roomy);
  auto good = connect(sock);
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(devnull, 0);
  std::vector<int> same(kFdsEach, devnull);
  std::vector<std::future<Message>> calls;
  for (int i = 0; i < kMessages; ++i) {
    Message m = Message::make(b.id(), kSink, Payload::copy_of(std::string(kBody, 'f')));
    m.fds = FdSet::dup_of(same);
    try {
      calls.push_back(a->router().request(std::move(m), 60s));
    } catch (const Error& e) {
      FAIL() << "message " << i << ": " << e.what() << "\n" << router.log();
    }
  }
  ::close(devnull);
  auto ping = [&] {
    return services::call_text(good->router_context(), services::kPingService,
                               services::kPingMethod, "alive", 20s);
  };
  // The receiver is stalled, so nothing can be delivered yet: the first
  // call to complete is one the router refused over the quota.
  auto any_ready = [&] {
    for (auto& c : calls)
      if (c.wait_for(0s) == std::future_status::ready) return true;
    return false;
  };
  EXPECT_TRUE(eventually(any_ready, 20s)) << "no fds were refused while the receiver was stalled" << router.log();
  EXPECT_EQ(received.load(), 1) << "the receiver should still be stalled on its first message";
  EXPECT_EQ(ping(), "alive") << router.log();
  release.set_value();
  int delivered = 0, refused = 0;
  for (auto& c : calls) {
    ASSERT_EQ(c.wait_for(60s), std::future_status::ready) << "a call with fds hung";
    try {
      EXPECT_EQ(c.get().text(), std::to_string(kFdsEach));
      ++delivered;
    } catch (const ChannelError& e) {
      EXPECT_TRUE(contains(e.what(), reason::kFdQuota)) << e.what();
      ++refused;
    }
  }
  EXPECT_GT(refused, 0) << "4800 fds sent to a stalled receiver were never charged against the quota of 1024";
  EXPECT_GT(delivered, 0);
  EXPECT_EQ(delivered + refused, kMessages);
  EXPECT_EQ(ping(), "alive") << router.log();
}

}  // namespace test_hostile
}  // namespace spindle
