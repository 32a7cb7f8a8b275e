// Issue #11: the router's limits that a hostile client runs into, each with
// real sockets (an in-process root router with a Listener, or a real
// spindle-router process):
//  - context ids wrap round at the end of the id space, and no id in use
//    (a living context's, or one granted) is handed out again (§3,
//    PROTOCOL §7.3.2);
//  - connect() refuses a socket whose directory another user owns (§3);
//  - a Select's receiver queue is bounded; the excess is answered with a
//    dead reply that says why (§1);
//  - control messages queued towards a client that does not read (DEL_ROUTEs
//    that another client's churn causes) are charged to that client, and the
//    client is dropped once they stay over its high-water mark (§1).
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <future>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "broker/errors.h"
#include "router/control.h"
#include "router/reasons.h"
#include "router/router.h"
#include "router/unix_address.h"
#include "services/reasons.h"
#include "services/select.h"
#include "tests/listener_test_util.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/router_fixture.h"
#include "tests/router_probe.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_router_limits {

using namespace testutil;
using namespace std::chrono_literals;

constexpr std::uint32_t kLastId = std::numeric_limits<std::uint32_t>::max();

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

// ALLOCATE_ID from a raw client: the id granted, or the dead reply's text.
struct Allocation {
  std::uint32_t id = 0;
  std::string refused;  // empty when granted
};
Allocation allocate(RawPeer& p, std::uint32_t self, std::uint32_t reply_to) {
  p.send_frame(frame(0, self, self, kHandleAllocateId, reply_to, kEncMitogen), "");
  Message r;
  if (!p.read_frame_for(self, reply_to, r, 20s)) return {0, "(no answer)"};
  if (r.is_dead()) return {0, r.text()};
  return {static_cast<std::uint32_t>(std::stoul(r.text())), {}};
}

// §3: ids are handed out by a counter. Once it reaches the end of the id
// space, the root hands out ids again from the start, in order, as Linux
// does pids, skipping every id still in use: a living context's (a route),
// and one granted and not yet announced. Every kind of asker gets them
// (ALLOCATE_ID, allocate_id() on another thread, a Spindle client, a
// Mitogen client). Before, the end was final: a client that made the root
// hand out ids (one per ALLOCATE_ID, and one per connection) stopped it
// taking any new client or child, for good, within half an hour.
TEST(RouterLimits, ContextIdsWrapRoundAndSkipEveryIdInUse) {
  InProcessRouter r;
  Router& router = r.router();
  // From the start of the id space: 1 stays connected, 2 stays connected
  // and holds a grant (3) it has not announced, 4 leaves holding a grant
  // (5) it never announced.
  std::promise<std::string> first_got;
  auto first = r.client([&](Router& cr) {
    cr.add_handler([&](Message&& m) { first_got.set_value(m.text()); }, {}, 4242);
  });
  ASSERT_EQ(first->id(), 1u);
  RawPeer holder = RawPeer::connect_to(r.address());
  const std::uint32_t holder_id = holder.handshake();
  ASSERT_EQ(holder_id, 2u);
  ASSERT_EQ(allocate(holder, holder_id, 60).id, 3u);
  {
    RawPeer gone = RawPeer::connect_to(r.address());
    ASSERT_EQ(gone.handshake(), 4u);
    ASSERT_EQ(allocate(gone, 4, 61).id, 5u);
    ASSERT_TRUE(gone.goodbye());
  }
  ASSERT_TRUE(eventually([&] { return !router.watch_if_routed(4, [](const std::string&) {}); }, 20s));

  router.skip_ids_for_testing(kLastId - 2);
  RawPeer b = RawPeer::connect_to(r.address());
  const std::uint32_t b_id = b.handshake();
  EXPECT_EQ(b_id, kLastId - 2);
  Allocation last = allocate(b, b_id, 70);
  ASSERT_TRUE(last.refused.empty()) << last.refused;
  EXPECT_EQ(last.id, kLastId - 1) << "the last fresh id";

  // Round again: 1, 2 and 3 are skipped; then each asker gets the next.
  Allocation wrapped = allocate(b, b_id, 71);
  ASSERT_TRUE(wrapped.refused.empty()) << wrapped.refused;
  EXPECT_EQ(wrapped.id, 4u) << "the first id not in use";
  EXPECT_EQ(router.allocate_id(), 5u) << "the grant of a link that left is free again";
  auto c = r.client();
  EXPECT_EQ(c->id(), 6u);
  RawPeer m = RawPeer::connect_to(r.address());
  EXPECT_EQ(m.mitogen_handshake(static_cast<std::uint32_t>(::getpid())), 7u);

  // The ids in use are still their owners': 1 gets its traffic, and 2 may
  // still announce its grant (3), after which 3 routes to it.
  router.send(Message::make(first->id(), 4242, Payload::copy_of("still yours")));
  auto got = first_got.get_future();
  ASSERT_EQ(got.wait_for(20s), std::future_status::ready);
  EXPECT_EQ(got.get(), "still yours");
  holder.announce(holder_id, {3});
  EXPECT_TRUE(eventually([&] { return router.routed_through(3, holder_id); }, 20s));
}

// §3: a client refuses a socket whose directory belongs to another user (the
// /tmp/spindle-<uid> fallback squatted): it says so, and a directory of its
// own (or root's) is fine.
TEST(RouterLimits, ConnectRefusesASocketInADirectoryAnotherUserOwns) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory to another uid";
  constexpr uid_t kOther = 65534;
  TempDir dir;
  const std::string theirs = dir.path() + "/theirs";
  ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
  auto addr = UnixAddress::parse(theirs + "/router.sock");
  int l = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  socklen_t len = addr.to_sockaddr(sa);
  ASSERT_EQ(::bind(l, reinterpret_cast<sockaddr*>(&sa), len), 0) << errno_text(errno);
  ASSERT_EQ(::listen(l, 8), 0);
  ASSERT_EQ(::chown(theirs.c_str(), kOther, kOther), 0) << errno_text(errno);
  std::string why = error_of([&] { ::close(connect_unix(addr)); });
  EXPECT_NE(why.find(fmt::format("belongs to uid {}", kOther)), std::string::npos) << why;
  EXPECT_NE(why.find("refusing " + addr.name), std::string::npos) << why;
  // spindle::connect() says the same.
  why = error_of([&] { auto c = connect(addr.name); });
  EXPECT_NE(why.find(fmt::format("belongs to uid {}", kOther)), std::string::npos) << why;
  // Root's directory (ours here) is fine: the listening socket answers.
  ASSERT_EQ(::chown(theirs.c_str(), 0, 0), 0) << errno_text(errno);
  EXPECT_EQ(error_of([&] { ::close(connect_unix(addr)); }), "no error");
  ::close(l);
}

// The stats name every client's pid, uid and traffic: a client admitted
// with --allow-uid may ping the router but not read them; the router's own
// uid may.
TEST(RouterLimits, StatsAreForTheRoutersOwnUidOnly) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  constexpr uid_t kOther = 65534;
  TempDir dir;
  const std::string sock = fmt::format("@spindle-test-stats-uid-{}", ::getpid());
  RouterProcess router(SPINDLE_ROUTER_BINARY, sock, {"--allow-uid", std::to_string(kOther)},
                       dir.path() + "/router.log");
  ASSERT_TRUE(router.wait_ready()) << router.log();
  EXPECT_NE(router_stats_text(sock).find("client id="), std::string::npos);  // ours: fine
  int result[2];
  ASSERT_EQ(::pipe2(result, O_CLOEXEC), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(result[0]);
    std::string out;
    if (::setgid(kOther) != 0 || ::setuid(kOther) != 0) {
      out = "setuid failed";
    } else {
      try {
        auto c = connect(sock);
        out = services::call_text(c->router_context(), services::kPingService, services::kPingMethod,
                                  "hi", std::chrono::seconds(10));
        try {
          services::call_text(c->router_context(), services::kStatsService, services::kStatsMethod, "",
                              std::chrono::seconds(10));
          out += "|stats answered";
        } catch (const std::exception& e) {
          out += std::string("|") + e.what();
        }
      } catch (const std::exception& e) {
        out = std::string("error: ") + e.what();
      }
    }
    (void)!::write(result[1], out.data(), out.size());
    ::_exit(0);
  }
  ::close(result[1]);
  std::string got;
  char buf[4096];
  for (ssize_t n; (n = ::read(result[0], buf, sizeof buf)) > 0;) got.append(buf, static_cast<std::size_t>(n));
  ::close(result[0]);
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_EQ(got.substr(0, got.find('|')), "hi") << got;
  EXPECT_NE(got.find("refused"), std::string::npos) << got;
  EXPECT_NE(got.find("the router or a same-uid client"), std::string::npos) << got;
}

// §1: a Select whose receiver takes nothing holds at most its lane's bound
// (services/lanes.h: kDefaultLaneMaxMessages); past it every message is
// refused with a dead reply that names the bound, and nothing more is held.
// Once the application takes what waited, the receiver accepts again.
TEST(RouterLimits, ASelectReceiverThatTakesNothingIsBounded) {
  Broker broker;
  Router router(broker, root_opts());
  services::Select sel;
  services::Receiver rx(router, sel);
  RawPeer peer;
  const std::uint32_t n = router.allocate_id();
  ASSERT_TRUE(attach_raw(router, peer, n));
  ASSERT_EQ(peer.handshake(), n);

  constexpr std::uint32_t kBound = static_cast<std::uint32_t>(services::kDefaultLaneMaxMessages);
  constexpr std::uint32_t kExcess = 500;
  // reply_to i + 1 for message i: the dead replies say which were refused.
  std::string flood;
  for (std::uint32_t i = 0; i < kBound + kExcess; ++i)
    flood += frame_bytes(frame(0, n, n, rx.handle(), i + 1), fmt::format("{}", i));
  peer.write_all(flood);
  std::set<std::uint32_t> refused;
  for (std::uint32_t i = 0; i < kExcess; ++i) {
    Message d;
    ASSERT_TRUE(peer.read_frame(d, 30s)) << "only " << refused.size() << " refusals came";
    ASSERT_TRUE(d.is_dead()) << d.text();
    EXPECT_NE(d.text().find(services::reason::kQueueFull), std::string::npos) << d.text();
    EXPECT_NE(d.text().find(fmt::format("holds {} messages at most", kBound)), std::string::npos)
        << d.text();
    refused.insert(d.header.handle);
  }
  // The last kExcess were refused, and nothing else was.
  EXPECT_EQ(refused.size(), kExcess);
  EXPECT_EQ(*refused.begin(), kBound + 1);
  EXPECT_EQ(*refused.rbegin(), kBound + kExcess);
  services::LaneStats st = sel.stats();
  EXPECT_EQ(st.queued, kBound);
  EXPECT_EQ(st.refused_full, kExcess);
  // What was held is the first kBound messages, in order.
  for (std::uint32_t i = 0; i < kBound; ++i) {
    auto ev = sel.get(0ms);
    ASSERT_TRUE(ev.has_value()) << "only " << i << " messages were held";
    ASSERT_EQ(ev->msg.header.reply_to, i + 1);
  }
  EXPECT_FALSE(sel.get(0ms).has_value());
  // Taken: room again.
  peer.send_frame(frame(0, n, n, rx.handle(), 0), "after");
  auto ev = sel.get(20s);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->msg.text(), "after");
  Message stray;
  EXPECT_FALSE(peer.read_frame(stray, 200ms)) << "unexpected: " << stray.text();
  EXPECT_TRUE(peer.goodbye());
}

// --- §1: control messages towards a non-reader, with a real spindle-router

class RouterLimitsProcess : public RouterFixture {};

// One round of churn by `b`: `count` ids allocated and announced, `c` sends
// one frame to each (so it has talked to them), then `b` deletes them all:
// the router queues one DEL_ROUTE per id towards `c`. Returns false (with a
// gtest failure) if a step did not complete.
bool churn_round(RawPeer& b, std::uint32_t b_id, RawPeer& c, std::uint32_t c_id,
                 std::uint32_t count) {
  std::string out;
  for (std::uint32_t i = 0; i < count; ++i)
    out += frame_bytes(frame(0, b_id, b_id, kHandleAllocateId, 1000 + i, kEncMitogen), "");
  b.write_all(out);
  std::vector<std::uint32_t> ids;
  while (ids.size() < count) {
    Message r;
    if (!b.read_frame(r, 20s)) {
      ADD_FAILURE() << "ALLOCATE_ID: " << ids.size() << " of " << count << " answered";
      return false;
    }
    if (r.header.handle < 1000 || r.header.handle >= 1000 + count) continue;
    if (r.is_dead()) {
      ADD_FAILURE() << "ALLOCATE_ID refused: " << r.text();
      return false;
    }
    ids.push_back(static_cast<std::uint32_t>(std::stoul(r.text())));
  }
  out.clear();
  for (std::uint32_t x : ids)
    out += frame_bytes(frame(0, b_id, b_id, kHandleAddRoute, 0, kEncMitogen), std::to_string(x));
  b.write_all(out);
  // c talks to each; b's reading them proves the router routed them (and
  // noted that c talked to them).
  out.clear();
  for (std::uint32_t x : ids) out += frame_bytes(frame(x, c_id, c_id, 4321, 0), "hi");
  c.write_all(out);
  for (std::uint32_t got = 0; got < count;) {
    Message m;
    if (!b.read_frame(m, 20s)) {
      ADD_FAILURE() << "b received " << got << " of " << count << " frames from c";
      return false;
    }
    if (m.header.handle == 4321) ++got;
  }
  out.clear();
  for (std::uint32_t x : ids)
    out += frame_bytes(frame(0, b_id, b_id, kHandleDelRoute, 0, kEncMitogen), std::to_string(x));
  out += frame_bytes(frame(0, b_id, b_id, 4999, 55), "");
  b.write_all(out);
  Message sync;
  if (!b.read_frame_for(b_id, 55, sync, 20s)) {
    ADD_FAILURE() << "no answer after the DEL_ROUTEs";
    return false;
  }
  return true;
}

// §1: "the control messages that the peer caused". A client c talks to
// contexts another client b keeps creating and deleting, and never reads:
// the DEL_ROUTE notices queued for c are charged to c's account (not to b,
// not to nobody), and once they stay over c's high-water mark untaken, c is
// dropped after the stall timeout and the router holds nothing for it.
TEST_F(RouterLimitsProcess, ControlMessagesQueuedForANonReaderAreChargedToItAndBounded) {
  constexpr std::size_t kMark = 128 << 10;
  start({"--high-water-mark", "128K", "--stall-timeout", "5s"});
  RawPeer c = raw_client();
  const std::uint32_t c_id = id_;
  RawPeer b = raw_client();
  const std::uint32_t b_id = id_;
  // Enough DEL_ROUTEs (about 30 bytes each) to fill c's socket buffers (the
  // router asks for 4 MiB; Linux doubles it) and then its queue past the mark.
  constexpr std::uint32_t kPerRound = 1000;
  std::size_t rounds = 0, queued = 0, held = 0;
  std::string line;
  while (rounds < 1000) {
    ASSERT_TRUE(churn_round(b, b_id, c, c_id, kPerRound)) << router_->log();
    if (++rounds % 10 != 0) continue;
    line = client_line(c_id);
    ASSERT_FALSE(line.empty()) << "c was dropped before its queue reached the mark\n" << router_->log();
    queued = static_cast<std::size_t>(stats_field(line, " queued_bytes="));
    held = static_cast<std::size_t>(stats_field(line, " memory_held="));
    if (queued > 2 * kMark) break;
  }
  std::printf("after %zu rounds of %u DEL_ROUTEs: c has %zu bytes queued, %zu held\n%s\n", rounds,
              kPerRound, queued, held, line.c_str());
  ASSERT_GT(queued, 2 * kMark) << "c's queue never passed its mark";
  // Charged to c: its account holds at least what is queued for it.
  EXPECT_GE(held, queued) << line;
  // Not to b, which reads everything.
  std::string b_line = client_line(b_id);
  EXPECT_LT(stats_field(b_line, " memory_held="), static_cast<long long>(queued)) << b_line;
  // Bounded: c took nothing of a queue over its mark, so it is dropped, and
  // what was queued for it is let go.
  EXPECT_TRUE(logged("took nothing of the")) << router_->log();
  EXPECT_TRUE(eventually([&] { return client_line(c_id).empty(); }, 30s)) << router_->log();
  EXPECT_TRUE(eventually([&] {
    return stats_field(router_stats_text(socket()), " memory_held=") < static_cast<long long>(queued);
  }, 30s)) << router_stats_text(socket());
  expect_served("DEL_ROUTEs queued for a non-reader");
}

// §1 backpressure: one-way frames to a client that reads slowly are never
// dropped. The receiver reads nothing while the sender pushes 20 MB (more
// than the sockets and the 64 KiB mark hold), until the router stops
// reading the sender instead of refusing its frames, and every frame arrives,
// in order. Before, the router dropped (and only counted) what went over the
// receiver's mark: bench_router's one-pair run lost up to 18,000 of 600,000.
TEST_F(RouterLimitsProcess, OneWayFramesToASlowReaderWaitAndAreNeverDropped) {
  start({"--high-water-mark", "64K"});
  RawPeer rx = raw_client();
  const std::uint32_t rx_id = id_;
  RawPeer tx = raw_client();
  const std::uint32_t tx_id = id_;
  constexpr std::uint32_t kFrames = 20000;
  const std::string pad(1000, 'x');
  std::string bytes;
  for (std::uint32_t i = 0; i < kFrames; ++i)
    bytes += frame_bytes(frame(rx_id, tx_id, tx_id, 4321, 0), fmt::format("{:08}", i) + pad);
  std::thread writer([&] { tx.write_all(bytes); });  // blocks while the router holds tx
  // The receiver reads nothing until the router has stopped reading tx.
  const bool held = eventually([&] { return stats_field(client_line(tx_id), " held=") == 1; }, 60s);
  const std::string tx_line = client_line(tx_id);
  std::uint32_t next = 0;
  while (next < kFrames) {
    Message m;
    if (!rx.read_frame(m, 30s)) break;
    if (m.header.handle != 4321) continue;
    ASSERT_EQ(m.text().substr(0, 8), fmt::format("{:08}", next)) << "lost or out of order";
    ++next;
  }
  writer.join();
  EXPECT_EQ(next, kFrames) << router_->log();
  std::printf("while the receiver did not read: %s\n", tx_line.c_str());
  EXPECT_TRUE(held) << tx_line;
  EXPECT_FALSE(logged(reason::kQueueFull, 0ms)) << router_->log();
  expect_served("a one-way flood to a slow reader");
}

}  // namespace test_router_limits
}  // namespace spindle
