// What a client makes the real spindle-router hold by asking and never
// reading the answers. A reply the router writes is never refused at the
// client's gauge (the client asked for it), so what bounds it is the
// client's own account: every queued byte is charged to the peer it is
// queued for (stream/tx_queue.h), each call waiting for its answer is
// charged Router::kCallInFlightBytes, and reading such a client stops at
// the frame that puts it over. What bounds the fds its echoed memfd bodies
// keep open is the fd budget (the budget's charge lives as long as the
// memfd does). Before, an audit made the router hold 5.5 GB with 20k
// names.find calls while its accounts showed 131 KB, and 20,000 fds past an
// --fd-limit of 10,000 with echoed memfds; with only the queue charged, the
// first test grew the router by 585 MB (the calls read ahead of their
// answers).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "services/envelope.h"
#include "services/names.h"
#include "spindle/codec.h"
#include "stream/memfd.h"
#include "tests/hardening_fixture.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/router_probe.h"

namespace spindle {
namespace test_hardening_replies {

using namespace testutil;
using namespace std::chrono_literals;

std::string names_call(std::string_view method, const std::string& arg) {
  return services::encode_call(services::kNamesService, method, detail::encode_args<std::string>(arg),
                               services::kEnvelopeMsgpack)
      .to_string();
}

// 200 named clients make each names.find("*") answer about 14 KB: larger than
// a frame copied into the queue's log, so it is queued by reference.
TEST_F(Hardening, AClientThatNeverReadsItsLargeAnswersIsStoppedAtItsOwnLimit) {
  constexpr long long kPeer = 16 << 20;
  start({"--peer-memory-limit", "16M", "--stall-timeout", "120s"});
  std::vector<RawPeer> named;
  for (int i = 0; i < 200; ++i) {
    named.push_back(raw_client());
    const std::uint32_t id = id_;
    named.back().send_frame(frame(0, id, id, kHandleCallService, 5),
                            names_call("register", fmt::format("{:0>60}", i)));
    Message answer;
    ASSERT_TRUE(named.back().read_frame_for(id, 5, answer, 10s)) << router_->log();
    ASSERT_FALSE(answer.is_dead()) << answer.text();
  }
  RawPeer h = raw_client();
  const std::uint32_t hid = id_;
  const long rss_before = rss_kib();
  std::string burst;
  for (int k = 0; k < 2000; ++k) burst += frame_bytes(frame(0, hid, hid, kHandleCallService, 9), names_call("find", "*"));
  // 20,000 calls would be answered with some 280 MB.
  for (int round = 0; round < 10 && stats_field(client_line(hid), " paused=") != 1; ++round) flood(h, burst, 2s, 10s);
  // The calls read before the pause are answered (by the pool) into the
  // queue the client never reads: once the last one is, its pledges are gone
  // and all it holds is that queue.
  std::string line;
  EXPECT_TRUE(eventually([&] {
    line = client_line(hid);
    return stats_field(line, " memory_held=") == stats_field(line, " queued_bytes=");
  }, 20s)) << "pledges left once the calls were answered: " << line;
  const long rss_after = rss_kib();
  std::printf("%s\nrouter RSS %ld -> %ld KiB\n", line.c_str(), rss_before, rss_after);
  EXPECT_EQ(stats_field(line, " paused="), 1) << "the router went on reading a client that never reads";
  EXPECT_GE(stats_field(line, " memory_peak="), kPeer) << "the answers it holds were not charged to it";
  // At the pause its calls in flight are pledged at kCallInFlightBytes each,
  // within the limit; each answer (about 14 KB) then replaces its pledge.
  EXPECT_LE(stats_field(line, " memory_peak="), 2 * kPeer) << "read ahead of its answers";
  if (kRssIsMeaningful) {  // not under a sanitizer (tests/router_probe.h)
    EXPECT_LT(rss_after - rss_before, 3 * kPeer / 1024) << "the router grew past what it charged";
  }
  expect_served("a client asking for large answers it never reads");
}

// One 64 KiB memfd holding a ping.echo call, sent 1,000 times (a fresh fd in
// the router each time): each answer echoes the body, so it keeps the memfd
// open until written, which the client never lets happen.
TEST_F(Hardening, EchoedMemfdBodiesStayChargedToTheFdBudget) {
  constexpr long long kLimit = 100;
  start({"--fd-limit", "100", "--peer-memory-limit", "1G", "--memory-limit", "2G", "--stall-timeout", "120s"});
  const std::size_t before = count_open_fds(router_->pid());
  RawPeer h = raw_client(kFlagFdPassing);
  const std::uint32_t hid = id_;
  const Payload call = services::encode_call(services::kPingService, services::kPingMethod,
                                             Payload::copy_of(std::string(64 << 10, 'e')));
  auto body = SealedMemfd::copy_of(call);
  const int fd = body->fd();
  const auto bytes = memfd_frame(0, hid, kHandleCallService, 11);
  int sent = 0;
  for (; sent < 1000; ++sent)
    if (!send_with_fds(h.fd, bytes, std::span<const int>(&fd, 1))) break;
  EXPECT_GT(sent, 300) << "the router stopped reading early: the test proves nothing";
  // What it holds settles once the calls are answered (the pool's work).
  EXPECT_TRUE(eventually([&] { return count_open_fds(router_->pid()) <= before + 2 * kLimit + 16; }, 20s))
      << count_open_fds(router_->pid()) - before << " fds held for " << sent << " echoed memfds; "
      << router_stats_text(socket());
  // Still so after a round trip through the router (ordered after the flood).
  expect_served("echoed memfd bodies the client never reads");
  EXPECT_LE(count_open_fds(router_->pid()), before + 2 * kLimit + 16);
}

}  // namespace test_hardening_replies
}  // namespace spindle
