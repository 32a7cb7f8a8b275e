// A client's large inline bodies against the real spindle-router: what a
// header alone may make the router hold, and for how long (docs/PROTOCOL.md
// §14). A body of 64 KiB or more is read into a buffer of its own, charged
// whole from its header on. Three rules keep that charge bounded for an
// untrusted client: a frame may be no larger than the client's allowance
// (the router announces it in its welcome), a body is begun only when its
// whole size fits the allowance and the global budget (reading waits until
// it does), and a body once begun must arrive at kMinBodyRate or faster.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "stream/stream.h"
#include "tests/hardening_fixture.h"
#include "tests/raw_peer.h"
#include "tests/router_probe.h"

namespace spindle {
namespace test_hardening_bodies {

using namespace testutil;
using namespace std::chrono_literals;

// Before: the router announced (and read) up to the maximum message size,
// 128 MiB, whatever the client's allowance; a header for a body beyond the
// allowance was charged in full and its body waited for, so one client could
// make the router promise 128 MiB with 26 bytes.
TEST_F(Hardening, AClientsFrameMayBeNoLargerThanItsAllowance) {
  constexpr std::uint32_t kAllowance = 8u << 20;
  start({"--peer-memory-limit", "8M"});
  RawPeer to = raw_client();
  const std::uint32_t to_id = id_;
  RawPeer p = raw_client();
  EXPECT_EQ(p.announced_max, kAllowance) << "the welcome says what the router reads";

  // A body of exactly the allowance travels.
  const std::string body(kAllowance, 'b');
  std::thread writer([&] { p.send_frame(frame(to_id, id_, id_, 7, 0), body); });
  Message back;
  const bool got = to.read_frame_for(to_id, 7, back, 30s);
  writer.join();
  ASSERT_TRUE(got) << router_->log();
  EXPECT_EQ(back.data.size(), body.size());

  // One byte more is refused at its header, with the limit named.
  Header h = frame(to_id, id_, id_, 7, 0);
  h.length = kAllowance + 1;
  HeaderBytes hb = encode_header(h);
  p.write_all(hb.data(), hb.size());
  EXPECT_TRUE(p.wait_eof(nullptr, 20s)) << "the router waited for the body: " << router_->log();
  EXPECT_TRUE(logged(fmt::format("message too large: {} bytes exceeds the maximum of {}",
                                 kAllowance + 1, kAllowance)))
      << router_->log();
  expect_served("a frame over the allowance");
}

// Three clients each begin a 6 MiB body and never finish it: one stops, one
// trickles, one stops. The router's budget is 16 MiB, so two bodies fit and
// the third waits, unread and uncharged. Each body that began is cut off
// once an honest sender would long have finished, and the waiting one then
// begins (and is cut off in turn). Before: all three were charged at once
// (18 MiB, over the budget) and held for as long as the clients liked.
TEST_F(Hardening, ABodyIsBegunOnlyWhenItFitsAndMustThenArrive) {
  constexpr long long kGlobal = 16 << 20;
  constexpr std::size_t kBody = 6u << 20;
  start({"--memory-limit", "16M", "--peer-memory-limit", "8M", "--stall-timeout", "2s"});
  std::vector<RawPeer> senders;
  std::vector<std::uint32_t> ids;
  for (int i = 0; i < 3; ++i) {
    senders.push_back(raw_client());
    ids.push_back(id_);
    Header h = frame(id_, id_, id_, 7, 0);
    h.length = kBody;
    HeaderBytes hb = encode_header(h);
    senders.back().write_all(hb.data(), hb.size());
    senders.back().write_all(std::string(64 << 10, 'x'));
  }
  // The trickler: 4 KiB every 100 ms (40 KiB/s) until it is cut off.
  std::atomic<bool> stop{false};
  std::thread trickler([&] {
    const std::string piece(4096, 't');
    while (!stop) {
      if (::send(senders[1].fd, piece.data(), piece.size(), MSG_NOSIGNAL | MSG_DONTWAIT) < 0 &&
          errno != EAGAIN)
        return;
      std::this_thread::sleep_for(100ms);
    }
  });
  // Two bodies began; the third waits for room, its client paused.
  int waiting = -1;
  ASSERT_TRUE(eventually([&] {
    for (int i = 0; i < 3; ++i)
      if (stats_field(client_line(ids[i]), " paused=") == 1) waiting = i;
    return waiting >= 0;
  }, 10s)) << router_stats_text(socket());
  const std::string stats = router_stats_text(socket());
  EXPECT_LE(stats_field(stats, " memory_held="), kGlobal) << stats;
  EXPECT_LE(stats_field(client_line(ids[waiting]), " memory_held="), 1 << 20)
      << "the waiting body is not charged: " << stats;

  // Each is cut off: the two that began after 2 s + 6 MiB at 4 MiB/s, the
  // waiting one as long again after it began.
  for (RawPeer& s : senders) EXPECT_TRUE(s.wait_eof(nullptr, 30s)) << router_->log();
  stop = true;
  trickler.join();
  // (The client sees its EOF a moment before the router logs why.)
  EXPECT_TRUE(eventually([&] { return lines_with("must arrive at 4 MiB/s").size() == 3; }, 10s))
      << router_->log();
  EXPECT_LE(stats_field(router_stats_text(socket()), " memory_peak="), kGlobal)
      << router_stats_text(socket());
  EXPECT_TRUE(eventually([&] {
    return stats_field(router_stats_text(socket()), " memory_held=") < (1 << 20);
  }, 10s)) << router_stats_text(socket());
  expect_served("three bodies that never arrived");
}

// A small frame (its body under 64 KiB) waits in the receive chunks until it
// is whole, charged to nobody, and no other deadline applied: a client could
// send part of one and hold up to 256 KiB of the router for as long as it
// stayed. It is now cut off once an honest sender would have finished (the
// stall timeout plus 64 KiB at 4 MiB/s). A client that sends small frames
// slowly but finishes each is not.
TEST_F(Hardening, ASmallFrameLeftUnfinishedIsCutOff) {
  start({"--stall-timeout", "1s"});
  RawPeer to = raw_client();
  const std::uint32_t to_id = id_;
  RawPeer honest = raw_client();
  const std::uint32_t honest_id = id_;
  RawPeer half = raw_client();
  // 10 bytes of a header, then 26 bytes and half a 1 KiB body: never more.
  const std::string whole = frame_bytes(frame(to_id, id_, id_, 7, 0), std::string(1024, 'h'));
  half.write_all(whole.substr(0, 10));
  // The honest one: a frame every 300 ms, each in two halves.
  const std::string mine = frame_bytes(frame(to_id, honest_id, honest_id, 7, 0), std::string(100, 'm'));
  for (int i = 0; i < 8; ++i) {
    honest.write_all(mine.substr(0, 40));
    std::this_thread::sleep_for(150ms);
    honest.write_all(mine.substr(40));
    std::this_thread::sleep_for(150ms);
    if (i == 0) half.write_all(whole.substr(10, 26 + 512));
  }
  EXPECT_TRUE(half.wait_eof(nullptr, 10s)) << router_->log();
  EXPECT_TRUE(eventually([&] { return !lines_with("left a frame unfinished").empty(); }, 10s)) << router_->log();
  Message m;
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(to.read_frame_for(to_id, 7, m, 10s)) << "frame " << i << ": " << router_->log();
    EXPECT_EQ(m.header.src_id, honest_id);
    EXPECT_EQ(m.data.size(), 100u);
  }
  expect_served("a small frame left unfinished");
}

// Connections that each leave a frame unfinished: the router keeps each
// one's bytes (charged to it), not a receive chunk each. Each client first
// sends two 60,000-byte frames to a handle nobody serves (the router
// answers each with a dead reply), so that the chunk it is read into has
// been written over; then 300 bytes of a 1,000-byte frame, in the same
// write as the second frame, so that the answer to that frame shows that
// the router has read them. Before, every such connection held its 128 KiB
// chunk, resident and charged to nobody, until the stall rule cut it off
// (the router grew by 129 KiB per client; 9.5 KiB after, a spindle-router
// built for release, 1,000 clients).
TEST_F(Hardening, ConnectionsLeavingAFrameUnfinishedHoldItsBytesNotAChunkEach) {
  if (!kRssIsMeaningful) GTEST_SKIP() << "a sanitizer's heap makes the resident set meaningless";
  constexpr int kClients = 200;
  start({"--stall-timeout", "30s"});
  const long before_kib = rss_kib();
  std::vector<RawPeer> peers;
  std::vector<std::uint32_t> ids;
  for (int i = 0; i < kClients; ++i) {
    peers.push_back(raw_client());
    ids.push_back(id_);
    RawPeer& p = peers.back();
    const std::string filler = frame_bytes(frame(0, id_, id_, 9999, 55), std::string(60000, 'y'));
    const std::string whole = frame_bytes(frame(0, id_, id_, 9999, 55), std::string(1000, 'u'));
    p.write_all(filler);
    p.write_all(filler + whole.substr(0, kHeaderSize + 300));
  }
  // Each client's two whole frames were answered: the router has read them,
  // and the unfinished frame's start with the second.
  Message m;
  for (int i = 0; i < kClients; ++i)
    for (int k = 0; k < 2; ++k)
      ASSERT_TRUE(peers[static_cast<std::size_t>(i)].read_frame_for(ids[static_cast<std::size_t>(i)], 55, m, 10s))
          << "client " << i << ": " << router_->log();
  const long per_client_kib = (rss_kib() - before_kib) / kClients;
  EXPECT_LT(per_client_kib, 64) << "each connection that left a frame unfinished costs the router "
                                << per_client_kib << " KiB";
  // The frames still complete.
  for (int i = 0; i < kClients; ++i) {
    const std::uint32_t id = ids[static_cast<std::size_t>(i)];
    const std::string whole = frame_bytes(frame(0, id, id, 9999, 55), std::string(1000, 'u'));
    peers[static_cast<std::size_t>(i)].write_all(whole.substr(kHeaderSize + 300));
  }
  for (int i = 0; i < kClients; ++i)
    ASSERT_TRUE(peers[static_cast<std::size_t>(i)].read_frame_for(ids[static_cast<std::size_t>(i)], 55, m, 10s))
        << "client " << i << ": the completed frame was not answered: " << router_->log();
  expect_served("connections leaving frames unfinished");
}

}  // namespace test_hardening_bodies
}  // namespace spindle
