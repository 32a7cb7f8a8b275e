// The holes of issue #11 (hardening), each against the real spindle-router:
// memory a peer makes the router hold is charged to it and bounded, logs
// cannot be forged or flooded, and a client cannot act for another context.
// Each case keeps a well-behaved client and checks it is still served.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "router/call_table.h"
#include "router/reasons.h"
#include "stream/fd_frame.h"
#include "tests/fds_test_util.h"
#include "tests/hardening_fixture.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/router_fixture.h"
#include "tests/router_probe.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_hardening {

using namespace testutil;
using namespace std::chrono_literals;

constexpr std::uint32_t kEcho = 2000;

// §1: a client that sends tiny frames wanting replies to a context that does
// not exist, and never reads: the dead replies queued for it are charged to
// it. The router stops reading it at its limit, disconnects it when it still
// takes nothing, and says so in one line, not one per reply.
TEST_F(Hardening, DeadReplyFloodAtANonReaderIsChargedBoundedAndLoggedOnce) {
  start({"--peer-memory-limit", "8M", "--stall-timeout", "2s"});
  const long before = rss_kib();
  RawPeer p = raw_client();
  std::string burst;
  for (int i = 0; i < 4096; ++i) burst += frame_bytes(frame(999999, id_, id_, kEcho, 7), "");
  std::size_t written = flood(p, burst, 1s, 20s);
  const long peak = rss_kib();
  std::printf("flooded %zu bytes (%zu frames); router VmRSS %ld -> %ld KiB\n", written,
              written / kHeaderSize, before, peak);
  EXPECT_GT(written / kHeaderSize, 100000u) << "the flood was too small to prove anything";
  // 8 MiB limit: the router charges at most that much to this peer, plus one
  // receive chunk; its resident set also holds its socket buffers and what the
  // allocator keeps. Before the fix: +100 MiB per 500k frames.
  const long long charged = memory_peak();
  std::printf("router memory_peak %lld bytes\n", charged);
  EXPECT_GT(charged, 0);
  EXPECT_LE(charged, (8 << 20) + (1 << 20)) << "the router held more than the peer's limit for it";
  if (kRssIsMeaningful) {
    EXPECT_LT(peak - before, 40 * 1024) << "a non-reader's dead replies grew the router by "
                                        << (peak - before) << " KiB";
  }
  EXPECT_TRUE(logged("closed with")) << router_->log();
  auto summary = lines_with("closed with");
  ASSERT_EQ(summary.size(), 1u);
  EXPECT_NE(summary[0].find("dead replies"), std::string::npos) << summary[0];
  EXPECT_LT(lines_with("999999").size(), 10u) << "one log line per dropped dead reply";
  expect_served("a dead-reply flood");
}

// §1: a peer that never reads its queue. Another client's one-way messages
// to it are queued up to its mark, then the router stops reading the sender
// (backpressure: none is dropped), and a frame that wants an answer is
// refused with the reason. The router's memory stays near the limits
// (before the fix: "output queue full" came at +525 MiB of RSS for 64 MiB).
TEST_F(Hardening, QueuedFramesAreChargedAtWhatTheyCostNotTheirPayload) {
  // The stall timeout is long: the sink must still be there, full, below.
  start({"--high-water-mark", "4M", "--peer-memory-limit", "8M", "--stall-timeout", "120s"});
  RawPeer sink = raw_client();
  const std::uint32_t sink_id = id_;
  const long before = rss_kib();
  RawPeer src = raw_client();
  const std::uint32_t src_id = id_;
  std::string burst;
  for (int i = 0; i < 4096; ++i) burst += frame_bytes(frame(sink_id, id_, id_, kEcho, 0), "12345678");
  // Until the router stops reading src (the sink's socket buffers take about
  // 8 MiB first, then its queue its 4 MiB mark): a few seconds, longer under
  // a sanitizer.
  auto held = [&] { return stats_field(client_line(src_id), " held=") == 1; };
  for (auto until = std::chrono::steady_clock::now() + 90s;
       !held() && std::chrono::steady_clock::now() < until;)
    flood(src, burst, 1s, 3s, kHeaderSize + 8);
  const long peak = rss_kib();
  const long long charged = memory_peak();
  std::printf("router VmRSS %ld -> %ld KiB, memory_peak %lld bytes\n%s\n", before, peak, charged,
              router_stats_text(socket()).c_str());
  ASSERT_TRUE(held()) << "the router never stopped reading a sender whose destination was full\n"
                      << router_stats_text(socket()) << router_->log();
  // Two peers with 8 MiB limits: the sink's queue and the source's pinned
  // chunks, plus one chunk each.
  EXPECT_LE(charged, 2 * ((8 << 20) + (1 << 20))) << "the router held more than the peers' limits";
  if (kRssIsMeaningful) {
    EXPECT_LT(peak - before, 48 * 1024) << "small queued frames cost more than they were charged";
  }
  EXPECT_FALSE(logged(reason::kQueueFull, 0ms)) << "one-way frames were refused (dropped)\n" << router_->log();
  // A frame that wants an answer is refused with a dead reply that says why
  // (from a third client: src itself is not read now).
  RawPeer asker = raw_client();
  asker.send_frame(frame(sink_id, id_, id_, kEcho, 77), "12345678");
  Message dead;
  ASSERT_TRUE(asker.read_frame_for(id_, 77, dead, 20s)) << router_->log();
  EXPECT_TRUE(dead.is_dead());
  EXPECT_NE(dead.text().find(reason::kQueueFull), std::string::npos) << dead.text();
  expect_served("a full queue");
  // The sink goes: src is read again (what it still sends to the sink now
  // finds no route).
  ::close(sink.fd);
  sink.fd = -1;
  EXPECT_TRUE(eventually([&] { return !held(); }, 30s)) << client_line(src_id) << "\n" << router_->log();
  EXPECT_GE(stats_field(client_line(src_id), " holds="), 1);
}

// §7.3: an SF frame refused on arrival (its "memfd" body is a pipe) is
// refused before routing, so before the reverse-path check of on_stream_frame.
// Its dead reply must not go to the src_id it claims: a client could fail
// another context's pending call (reply_to) with a forged refusal. It is
// answered as any forgery is, on the link it came in on.
TEST_F(Hardening, AnFdFrameRefusedOnArrivalIsNotAnsweredToTheSenderItClaims) {
  start({});
  RawPeer victim = raw_client(kFlagFdPassing);
  const std::uint32_t victim_id = id_;
  RawPeer forger = raw_client(kFlagFdPassing);
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  UniqueFd rd(pipe_fds[0]), wr(pipe_fds[1]);
  int not_a_memfd = rd.get();
  ASSERT_TRUE(send_with_fds(forger.fd, memfd_frame(0, victim_id, 4000, 71),
                            std::span<const int>(&not_a_memfd, 1)));
  Message d;
  ASSERT_TRUE(forger.read_frame_for(victim_id, 71, d, 20s)) << router_->log();
  EXPECT_TRUE(d.is_dead());
  EXPECT_NE(d.text().find(reason::kReversePath), std::string::npos) << d.text();
  // The victim's next answer from the router is the one it asks for now:
  // nothing for handle 71 came before it.
  victim.send_frame(frame(0, victim_id, victim_id, 4000, 72), "");
  Message first;
  ASSERT_TRUE(victim.read_frame(first, 20s)) << router_->log();
  EXPECT_EQ(first.header.handle, 72u) << "the victim got a frame for handle " << first.header.handle << ": "
                                      << first.text();
  // A refusal of the real sender's own frame still reaches it.
  ASSERT_TRUE(send_with_fds(victim.fd, memfd_frame(0, victim_id, 4000, 73),
                            std::span<const int>(&not_a_memfd, 1)));
  ASSERT_TRUE(victim.read_frame_for(victim_id, 73, d, 20s)) << router_->log();
  EXPECT_NE(d.text().find(fdreason::kBadMemfd), std::string::npos) << d.text();
  expect_served("a forged fd frame");
}

// §13: an inline body of exactly the maximum size may travel with fds; its
// SF frame is 8 bytes longer (the fd prefix). The router took that frame for
// one over the maximum and closed the link with a protocol error.
TEST_F(Hardening, AnInlineBodyOfTheMaximumSizeTravelsWithFds) {
  start({"--max-message-size", "64K"});
  RawPeer p = raw_client(kFlagFdPassing);
  const std::uint32_t p_id = id_;
  Header h = frame(0, p_id, p_id, 4000, 81, kEncFds);
  h.length = kFdPrefixSize + (64 << 10);
  HeaderBytes hb = encode_header(h);
  auto prefix = encode_fd_prefix(FdPrefix{kEncRaw, 1, 0});
  std::vector<std::uint8_t> bytes(hb.begin(), hb.end());
  bytes.insert(bytes.end(), prefix.begin(), prefix.end());
  bytes.resize(bytes.size() + (64 << 10), 0x5a);
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  UniqueFd rd(pipe_fds[0]), wr(pipe_fds[1]);
  int fd = rd.get();
  ASSERT_TRUE(send_with_fds(p.fd, bytes, std::span<const int>(&fd, 1)));
  Message d;
  ASSERT_TRUE(p.read_frame_for(p_id, 81, d, 20s)) << "the link closed\n" << router_->log();
  EXPECT_TRUE(d.is_dead());
  EXPECT_EQ(d.text().find("too large"), std::string::npos) << d.text();
  EXPECT_EQ(router_->log().find("message too large"), std::string::npos) << router_->log();
  expect_served("a body of the maximum size with fds");
}

// §1: a memfd body for the router itself is mapped only once its handler is
// known: sparse 100 MiB bodies to an unknown handle and to ping cost the router
// no memory (before the fix each was mapped with MAP_POPULATE first).
TEST_F(Hardening, MemfdBodyToAnUnknownHandleIsNeverMapped) {
  start({"--peer-memory-limit", "256M"});  // each body fits the allowance
  RawPeer p = raw_client(kFlagFdPassing);
  const long before = rss_kib();
  for (std::uint32_t i = 0; i < 8; ++i) {
    ASSERT_TRUE(send_sparse_memfd(p, id_, 100u << 20, 0, 4000 + i, 50 + i, kEncRaw));
    Message d;
    ASSERT_TRUE(p.read_frame_for(id_, 50 + i, d, 20s));
    EXPECT_TRUE(d.header.is_dead());
  }
  const long after = rss_kib();
  std::printf("router VmRSS %ld -> %ld KiB after 8 sparse 100 MiB memfds\n", before, after);
  EXPECT_LT(after - before, 32 * 1024) << "memfd bodies to unknown handles were faulted in";
  expect_served("memfds to unknown handles");
}

// §1: a memfd body for a handler that exists (CALL_SERVICE, whose envelope
// names the service inside the body) is mapped without MAP_POPULATE when a
// client sent it: only the pages a reader touches are faulted in, and on the
// thread that reads them. Before, every page of the body was faulted in on
// the broker thread first: a sparse 100 MiB body cost the router 100 MiB of
// page cache and tens of milliseconds of its loop, just to read the service
// name on its first page. The memfd's allocated blocks show it (the sender
// keeps its fd, so it can look).
TEST_F(Hardening, MemfdBodyToAServiceCallIsNotFaultedInWhole) {
  start({"--peer-memory-limit", "256M"});  // each body fits the allowance
  RawPeer p = raw_client(kFlagFdPassing);
  for (std::uint32_t i = 0; i < 4; ++i) {
    UniqueFd body = sparse_memfd(100u << 20);
    int raw = body.get();
    ASSERT_TRUE(send_with_fds(p.fd, memfd_frame(0, id_, kHandleCallService, 60 + i, kEncRaw),
                              std::span<const int>(&raw, 1)));
    Message reply;
    ASSERT_TRUE(p.read_frame_for(id_, 60 + i, reply, 20s));  // a malformed envelope: an error
    struct stat st {};
    ASSERT_EQ(::fstat(raw, &st), 0);
    const long long allocated = static_cast<long long>(st.st_blocks) * 512;
    EXPECT_LT(allocated, 1ll << 20) << "the router faulted in " << allocated << " bytes of a sparse "
                                    << "100 MiB service call's body";
  }
  expect_served("sparse memfds to the service handle");
}

// §1: a sparse memfd forwarded to a peer that cannot take fds (a Mitogen
// client) is streamed to it in bounded windows: while that peer reads
// nothing, the router holds a window, not the body.
TEST_F(Hardening, SparseMemfdToAnFdlessPeerIsStreamedInBoundedPieces) {
  // (A long stall timeout: this peer reads only at the end, on purpose.)
  start({"--max-message-size", "128M", "--stall-timeout", "120s", "--peer-memory-limit", "512M"});
  std::uint32_t mito_id = 0;
  RawPeer mito = mitogen_client(mito_id);
  RawPeer p = raw_client(kFlagFdPassing);
  const long before = rss_kib();
  for (std::uint32_t i = 0; i < 4; ++i) ASSERT_TRUE(send_sparse_memfd(p, id_, 120u << 20, mito_id, 4321, 0));
  // Give the router time to (wrongly) map and queue everything, then measure.
  ASSERT_TRUE(eventually([&] { return router_counts(socket()).clients >= 3; }, 10s));
  expect_served("four sparse 120 MiB memfds for an fd-less peer");
  const long held = rss_kib();
  std::printf("router VmRSS %ld -> %ld KiB with 480 MiB of memfd bodies queued\n", before, held);
  EXPECT_LT(held - before, 48 * 1024) << "the bodies were faulted in instead of streamed";
  // The peer then reads the first body whole, inline, all zeros.
  Message m;
  ASSERT_TRUE(mito.read_frame_for(mito_id, 4321, m, 60s));
  ASSERT_EQ(m.data.size(), 120u << 20) << m.text();
  auto c = m.data.contiguous();
  EXPECT_TRUE(std::all_of(c.begin(), c.end(), [](std::uint8_t b) { return b == 0; }));
}

// §1: a listener client's memfd body must fit its memory allowance when it
// arrives. Before, one sparse frame charged it (and the router) the body's
// whole size at once, whatever the limits: the hostile bench's memfd senders
// took the router's accounted peak to twice its global limit. A body over the
// client's own limit, or over what is left of the global one, is refused with
// the reason; the connection stays, and a body that fits goes through.
TEST_F(Hardening, AClientsMemfdBodyMustFitItsMemoryAllowance) {
  start({"--peer-memory-limit", "16M", "--memory-limit", "24M", "--stall-timeout", "60s"});
  // A Mitogen client that reads nothing: a body sent to it stays queued,
  // streamed inline, charged to its sender.
  std::uint32_t mito_id = 0;
  RawPeer mito = mitogen_client(mito_id);
  auto dead_reply_text = [&](RawPeer& p, std::uint32_t id, std::uint32_t reply_to) {
    Message d;
    if (!p.read_frame_for(id, reply_to, d, 20s)) return std::string("(no reply)");
    return d.header.is_dead() ? d.text() : std::string("(not a dead reply)");
  };
  const std::string kDoesNotFit = "do not fit the sender's memory allowance";

  // 1. Over the client's own limit: refused, and the client is still served.
  RawPeer a = raw_client(kFlagFdPassing);
  const std::uint32_t a_id = id_;
  ASSERT_TRUE(send_sparse_memfd(a, a_id, 20u << 20, mito_id, 4321, 61));
  std::string why = dead_reply_text(a, a_id, 61);
  EXPECT_NE(why.find(fdreason::kBadMemfd), std::string::npos) << why;
  EXPECT_NE(why.find(kDoesNotFit), std::string::npos) << why;
  EXPECT_NE(why.find("of its 16777216 limit"), std::string::npos) << why;

  // 2. Within it: accepted, queued for the non-reader, charged to a.
  ASSERT_TRUE(send_sparse_memfd(a, a_id, 12u << 20, mito_id, 4321, 0));
  ASSERT_TRUE(eventually([&] {
    return stats_field(router_stats_text(socket()), " memory_held=") >= (12 << 20);
  }, 20s));

  // 3. Another client's body that fits its own limit but not what is left of
  //    the router's global one (24 MiB, 12 of it held): refused.
  RawPeer b = raw_client(kFlagFdPassing);
  const std::uint32_t b_id = id_;
  ASSERT_TRUE(send_sparse_memfd(b, b_id, 14u << 20, mito_id, 4321, 62));
  why = dead_reply_text(b, b_id, 62);
  EXPECT_NE(why.find(kDoesNotFit), std::string::npos) << why;
  EXPECT_NE(why.find("the router holds"), std::string::npos) << why;
  // ...while a small one from it still fits (to an unknown handle of the
  // router: its dead reply names that, not the allowance).
  ASSERT_TRUE(send_sparse_memfd(b, b_id, 4u << 20, 0, 4000, 63));
  why = dead_reply_text(b, b_id, 63);
  EXPECT_EQ(why.find(kDoesNotFit), std::string::npos) << why;
  EXPECT_NE(why, "(no reply)");

  // 4. Refused bodies in a loop cost the log a summary line a second, not a
  //    line each (§2: a peer cannot drive the router's log).
  constexpr int kLoop = 1000;
  for (int i = 0; i < kLoop; ++i) ASSERT_TRUE(send_sparse_memfd(b, b_id, 14u << 20, mito_id, 4321, 0));
  ASSERT_TRUE(send_sparse_memfd(b, b_id, 14u << 20, mito_id, 4321, 64));
  why = dead_reply_text(b, b_id, 64);  // after the loop's frames: one link, in order
  EXPECT_NE(why.find(kDoesNotFit), std::string::npos) << why;
  const std::size_t lines = lines_with(kDoesNotFit).size();
  std::printf("%d refused bodies: %zu log lines name the refusal\n", kLoop + 4, lines);
  EXPECT_LT(lines, 30u) << router_->log();

  const long long charged = memory_peak();
  std::printf("router memory_peak %lld bytes (global limit 24 MiB)\n", charged);
  EXPECT_LE(charged, (24 << 20) + (1 << 20)) << "memfd bodies took the router over its global limit";
  expect_served("memfd bodies over the allowance");
}

// §1: a client that takes nothing of a queue over its high-water mark is
// disconnected after the stall timeout, even though it sends nothing (so it
// is never paused for its own input): what is queued for it, here a streamed
// memfd body charged to its sender, is not held forever.
TEST_F(Hardening, AClientThatNeverReadsItsFullQueueIsDropped) {
  start({"--max-message-size", "64M", "--high-water-mark", "1M", "--stall-timeout", "1s"});
  std::uint32_t mito_id = 0;
  RawPeer mito = mitogen_client(mito_id);
  RawPeer p = raw_client(kFlagFdPassing);
  ASSERT_TRUE(send_sparse_memfd(p, id_, 32u << 20, mito_id, 4321, 0));
  ASSERT_TRUE(logged("took nothing of the")) << router_->log();
  // What the router had written before closing is read, then EOF (the body
  // is cut short, so RawPeer's frame-by-frame wait_eof does not apply).
  auto closed_by_router = [&] {
    std::vector<char> buf(1 << 16);
    auto until = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < until) {
      pollfd pf{mito.fd, POLLIN, 0};
      if (::poll(&pf, 1, 100) <= 0) continue;
      ssize_t n = ::read(mito.fd, buf.data(), buf.size());
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
      if (n < 0 && errno != EINTR) return false;
    }
    return false;
  };
  EXPECT_TRUE(closed_by_router()) << "the router kept the non-reader's link";
  expect_served("a client that never reads");
}

// §1: a client that keeps its queue over the mark while reading just enough
// to look alive held every peer writing to it for as long as it liked (the
// stall timer re-armed whenever it took a byte). Now a peer is held up for
// one stall timeout at a stretch at most: then the slow reader is dropped
// and the writer is read again.
TEST_F(Hardening, AClientThatDrainsSlowlyCannotHoldItsWritersForGood) {
  start({"--high-water-mark", "1M", "--stall-timeout", "1s"});
  RawPeer slow = raw_client();
  const std::uint32_t slow_id = id_;
  RawPeer writer = raw_client();
  const std::uint32_t writer_id = id_;
  // 16 MiB of one-way frames (they cannot be refused, so the writer is held
  // while slow's queue is over its mark), then a probe that wants an answer.
  std::string flood;
  const std::string body(64 << 10, 'x');
  for (int i = 0; i < 256; ++i) flood += frame_bytes(frame(slow_id, writer_id, writer_id, 4321, 0), body);
  flood += frame_bytes(frame(0, writer_id, writer_id, 4000, 99), "probe");
  std::thread flooder([&] { writer.write_all(flood); });
  // 64 KiB every 200 ms: enough for the router to write a little each time
  // (bytes_out moves), far too little to drain 16 MiB within the test.
  std::atomic<bool> stop{false};
  std::thread drainer([&] {
    std::vector<char> buf(64 << 10);
    while (!stop) {
      std::this_thread::sleep_for(200ms);
      ssize_t n = ::recv(slow.fd, buf.data(), buf.size(), MSG_DONTWAIT);
      if (n == 0) return;
    }
  });
  Message answer;
  const bool answered = writer.read_frame_for(writer_id, 99, answer, 20s);
  stop = true;
  drainer.join();
  flooder.join();
  ASSERT_TRUE(answered) << "the writer stayed held behind a slow reader\n" << router_->log();
  EXPECT_TRUE(answer.is_dead());
  EXPECT_TRUE(logged("held up the peers writing to it")) << router_->log();
  expect_served("a slow reader holding its writers");
}

// §2: bytes a client supplies never start a log line of their own.
TEST_F(Hardening, ClientBytesAreEscapedSoOneRecordIsOneLine) {
  start({"--accept-client-logs"});
  RawPeer p = raw_client();
  const std::uint32_t p_id = id_;
  // A second client for DEL_ROUTE: refusals are summed up a line a second per
  // link, so from p it could be folded into the ADD_ROUTE's line unseen.
  RawPeer q = raw_client();
  const std::uint32_t q_id = id_;
  // Short enough to survive the 64-byte cut of a refused control payload.
  auto forged = [](std::string_view marker) { return "\n2030-01-01 [critical] " + std::string(marker); };
  p.send_frame(frame(0, p_id, p_id, kHandleAddRoute, 0, kEncMitogen), "notanid" + forged("FORGED-ADD"));
  q.send_frame(frame(0, q_id, q_id, kHandleDelRoute, 0, kEncMitogen), "x" + forged("FORGED-DEL"));
  // FORWARD_LOG "name\0level\0line": both the name and the line are the client's.
  p.send_frame(frame(0, p_id, p_id, kHandleForwardLog, 0, kEncMitogen),
               "evil" + forged("FORGED-NAME") + std::string("\0" "20\0", 4) + "hello" +
                   forged("FORGED-LOG") + "\x1b[2J");
  ASSERT_TRUE(logged("hello")) << router_->log();
  ASSERT_TRUE(logged("FORGED-DEL")) << router_->log();
  for (std::string_view needle : {"FORGED-ADD", "FORGED-DEL", "FORGED-NAME", "FORGED-LOG"}) {
    auto lines = lines_with(needle);
    ASSERT_FALSE(lines.empty()) << needle << "\n" << router_->log();
    EXPECT_NE(lines[0].find("\\n2030-01-01"), std::string::npos) << "not escaped: " << lines[0];
  }
  for (const std::string& line : lines_with("2030-01-01")) {
    EXPECT_EQ(line.rfind("2030-01-01", 0), std::string::npos) << "a forged line: " << line;
    EXPECT_NE(line.find("\\n2030-01-01"), std::string::npos) << "not escaped: " << line;
  }
  EXPECT_EQ(router_->log().find('\x1b'), std::string::npos) << "an escape sequence reached the log";
  // The forwarded line names the context it came from.
  auto hello = lines_with("hello");
  ASSERT_FALSE(hello.empty());
  EXPECT_NE(hello[0].find(fmt::format("ctx={}", p_id)), std::string::npos) << hello[0];
  expect_served("forged log lines");
}

// §2: FORWARD_LOG from a router client is refused unless the router allows it.
TEST_F(Hardening, ForwardLogFromAClientIsRefusedByDefault) {
  start();
  RawPeer p = raw_client();
  p.send_frame(frame(0, id_, id_, kHandleForwardLog, 0, kEncMitogen),
               std::string("evil\0" "20\0" "SHOULD-NOT-APPEAR", 25));
  EXPECT_TRUE(logged("FORWARD_LOG")) << router_->log();
  expect_served("a refused FORWARD_LOG");
  EXPECT_TRUE(lines_with("SHOULD-NOT-APPEAR").empty()) << router_->log();
}

// §2: a client allowed to log is rate-limited, and told so in one line.
// Past its rate the router stops reading it until its next line is due
// (backpressure): the flood waits in the client's own socket instead of
// costing the router a parse per line, and everyone else is served.
TEST_F(Hardening, ForwardLogFloodIsRateLimitedAndHeldInItsOwnSocket) {
  start({"--accept-client-logs"});
  RawPeer p = raw_client();
  std::string burst;
  for (int i = 0; i < 50000; ++i)
    burst += frame_bytes(frame(0, id_, id_, kHandleForwardLog, 0, kEncMitogen),
                         std::string("flood\0" "20\0", 9) + fmt::format("LINE-{}", i));
  const std::size_t sent = flood(p, burst, 1s, 20s);
  std::printf("the router took %zu of the flood's %zu bytes before it stopped reading\n", sent,
              burst.size());
  EXPECT_LT(sent, burst.size() / 2) << "the router kept reading a client far over its log rate";
  expect_served("a log flood");
  ASSERT_TRUE(logged("suppressed")) << router_->log();
  const std::size_t written = lines_with("LINE-").size();
  std::printf("%zu flooded lines were logged\n", written);
  EXPECT_LT(written, 1000u);
}

// §3: an id handed out by ALLOCATE_ID belongs to the link that asked for it:
// another client cannot announce it, before or after its owner does.
TEST_F(Hardening, AnAllocatedIdCannotBeAnnouncedByAnotherClient) {
  start();
  RawPeer owner = raw_client();
  const std::uint32_t owner_id = id_;
  RawPeer thief = raw_client();
  const std::uint32_t thief_id = id_;
  owner.send_frame(frame(0, owner_id, owner_id, kHandleAllocateId, 77, kEncMitogen), "");
  Message granted;
  ASSERT_TRUE(owner.read_frame_for(owner_id, 77, granted, 20s));
  const std::uint32_t x = static_cast<std::uint32_t>(std::stoul(granted.text()));
  // Before the owner announces it, and again after.
  thief.send_frame(frame(0, thief_id, thief_id, kHandleAddRoute, 0, kEncMitogen), std::to_string(x));
  EXPECT_TRUE(logged(reason::kNotYourId)) << router_->log();
  owner.send_frame(frame(0, owner_id, owner_id, kHandleAddRoute, 0, kEncMitogen), std::to_string(x));
  thief.send_frame(frame(0, thief_id, thief_id, kHandleAddRoute, 0, kEncMitogen), std::to_string(x));
  // Traffic for x reaches its owner, never the thief.
  ASSERT_TRUE(eventually([&] {
    good_->router().send(Message::make(x, 4242, Payload::copy_of("for x")));
    Message m;
    return owner.read_frame_for(x, 4242, m, 200ms) && m.text() == "for x";
  }, 20s));
  Message stray;
  EXPECT_FALSE(thief.read_frame_for(x, 4242, stray, 300ms)) << "the thief received x's traffic";
  expect_served("an id claimed by another client");
}

// §3: the id of a client that has left is not up for grabs.
TEST_F(Hardening, ADepartedClientsIdCannotBeClaimed) {
  start();
  std::uint32_t departed = 0;
  {
    auto gone = connect(socket());
    departed = gone->id();
  }
  ASSERT_TRUE(eventually([&] { return router_counts(socket()).clients == 2; }, 20s));  // good + the probe
  RawPeer thief = raw_client();
  thief.send_frame(frame(0, id_, id_, kHandleAddRoute, 0, kEncMitogen), std::to_string(departed));
  EXPECT_TRUE(logged(reason::kNotYourId)) << router_->log();
  thief.send_frame(frame(departed, id_, id_, kEcho, 91), "anyone?");
  Message d;
  ASSERT_TRUE(thief.read_frame_for(id_, 91, d, 20s));
  EXPECT_EQ(d.text(), fmt::format("{}: {}", reason::kNoRoute, departed));
  EXPECT_EQ(d.header.src_id, departed) << "the router answers on the unreachable context's behalf";
  expect_served("a claim on a departed client's id");
}

// §3: a third client spraying dead messages over another client's reply
// handles cannot fail its pending call: replies are accepted only from the
// callee (or from the router on its behalf), and a forged src_id is refused
// by the reverse-path check.
TEST_F(Hardening, ForgedDeadRepliesCannotFailAnotherClientsCall) {
  start();
  auto callee = connect(socket());
  auto [call, question] = held_call(*callee, kEcho);
  ASSERT_FALSE(HasFailure());
  const std::uint32_t victim_handle = question.header.reply_to;
  ASSERT_TRUE(is_call_handle(victim_handle));
  RawPeer attacker = raw_client();
  std::string spray;
  for (std::uint32_t gen = 0; gen < 2048; ++gen)
    for (std::uint32_t idx = 0; idx < 4; ++idx) {
      Header h = frame(good_->id(), id_, id_, kCallHandleBit | gen << 20 | idx, kHandleIsDead);
      spray += frame_bytes(h, reason::kPeerDisconnected);
    }
  // And with the callee's id as src_id: the reverse-path check refuses these.
  for (std::uint32_t idx = 0; idx < 4; ++idx) {
    Header h = frame(good_->id(), callee->id(), callee->id(), victim_handle, kHandleIsDead);
    spray += frame_bytes(h, reason::kPeerDisconnected);
  }
  attacker.write_all(spray);
  EXPECT_TRUE(logged(reason::kReversePath)) << router_->log();
  // Make sure the spray has been through the router before the real answer.
  attacker.send_frame(frame(0, id_, id_, 4999, 55), "");
  Message marker;
  ASSERT_TRUE(attacker.read_frame_for(id_, 55, marker, 20s));
  ASSERT_EQ(call.wait_for(0s), std::future_status::timeout) << "a forged dead reply completed the call";
  callee->router().reply(question, Payload::copy_of("real answer"));
  EXPECT_EQ(call.get(), "real answer");
  expect_served("forged dead replies");
}

}  // namespace test_hardening
}  // namespace spindle
