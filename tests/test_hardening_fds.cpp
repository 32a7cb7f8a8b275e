// The fds clients make the real spindle-router hold, all together
// (docs/PROTOCOL.md §13.8): every fd received is charged to one budget
// (--fd-limit) until it is passed on or closed. Past it, a client's fds are
// not taken and the frames that carried them are refused with the reason;
// fds sent with a frame that is never completed are held no longer than
// --stall-timeout. Past the budget, a client holding less than its share
// is still given its fds, up to twice the budget. Before, a client that opened a few connections and sent
// 253 fds with the first byte of a frame on each (and nothing more) made the
// router hold them for good: enough connections filled its fd table.
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "router/connect.h"
#include "stream/fd_frame.h"
#include "tests/fds_test_util.h"
#include "tests/hardening_fixture.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/router_probe.h"

namespace spindle {
namespace test_hardening_fds {

using namespace testutil;
using namespace std::chrono_literals;

// `n` fds (pipe ends) that the test keeps open.
std::vector<UniqueFd> pipe_ends(int n) {
  std::vector<UniqueFd> v;
  for (int i = 0; i < n; i += 2) {
    int pf[2];
    if (::pipe2(pf, O_CLOEXEC) != 0) throw std::system_error(errno, std::generic_category(), "pipe2");
    v.emplace_back(pf[0]);
    v.emplace_back(pf[1]);
  }
  return v;
}

std::vector<int> raw_of(const std::vector<UniqueFd>& v, std::size_t n) {
  std::vector<int> out;
  for (std::size_t i = 0; i < n && i < v.size(); ++i) out.push_back(v[i].get());
  return out;
}

// A complete SF frame from `src` to `dst`'s handle `handle` (by default the
// router's 4000, which does not exist) carrying one fd; its dead reply goes
// to `reply_to`.
std::vector<std::uint8_t> one_fd_frame(std::uint32_t src, std::uint32_t reply_to, std::uint32_t dst = 0,
                                       std::uint32_t handle = 4000) {
  Header h = frame(dst, src, src, handle, reply_to, kEncFds);
  h.length = kFdPrefixSize + 4;
  HeaderBytes hb = encode_header(h);
  auto prefix = encode_fd_prefix(FdPrefix{kEncRaw, 1, 0});
  std::vector<std::uint8_t> v(hb.begin(), hb.end());
  v.insert(v.end(), prefix.begin(), prefix.end());
  v.insert(v.end(), {'p', 'i', 'n', 'g'});
  return v;
}

// Sends, on a fresh connection, 200 fds with the first byte of a frame that
// never follows.
RawPeer hoard(const std::vector<UniqueFd>& ends, const std::function<RawPeer()>& connect) {
  RawPeer p = connect();
  const std::uint8_t first = one_fd_frame(0, 0)[0];
  EXPECT_TRUE(send_with_fds(p.fd, std::span<const std::uint8_t>(&first, 1), raw_of(ends, 200)));
  return p;
}

// A TCP socket whose last close() waits up to `seconds`: connected over
// loopback to an end that never reads, its send buffer full, SO_LINGER on.
// `keep` holds the listener and the accepted end, which must stay open.
UniqueFd lingering_socket(int seconds, std::vector<UniqueFd>& keep) {
  UniqueFd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_TRUE(listener) << std::strerror(errno);
  int small = 4096;
  EXPECT_EQ(::setsockopt(listener.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  EXPECT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  EXPECT_EQ(::listen(listener.get(), 1), 0);
  EXPECT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  UniqueFd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_EQ(::setsockopt(sock.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
  EXPECT_EQ(::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  UniqueFd accepted(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  EXPECT_TRUE(accepted) << std::strerror(errno);
  ::fcntl(sock.get(), F_SETFL, ::fcntl(sock.get(), F_GETFL) | O_NONBLOCK);
  const std::string chunk(4096, 'x');
  std::size_t queued = 0;
  for (;;) {
    ssize_t n = ::send(sock.get(), chunk.data(), chunk.size(), MSG_NOSIGNAL);
    if (n <= 0) break;
    queued += static_cast<std::size_t>(n);
  }
  EXPECT_GT(queued, 0u);
  linger l{1, seconds};
  EXPECT_EQ(::setsockopt(sock.get(), SOL_SOCKET, SO_LINGER, &l, sizeof l), 0);
  keep.push_back(std::move(listener));
  keep.push_back(std::move(accepted));
  return sock;
}

// A socket whose close() waits, passed to the router and left with it: the
// router drops the message (a handle nobody serves), and with it the last
// reference. That close must not be made on its broker thread, which the
// linger would stop for its whole length (an audit measured 31 s).
TEST_F(Hardening, ASocketWhoseCloseWaitsDoesNotStopTheRouter) {
  start();
  std::vector<UniqueFd> keep;
  constexpr int kLingerSeconds = 30;
  UniqueFd sock = lingering_socket(kLingerSeconds, keep);
  RawPeer a = raw_client(kFlagFdPassing);
  const std::uint32_t aid = id_;
  const int fd = sock.get();
  ASSERT_TRUE(send_with_fds(a.fd, one_fd_frame(aid, 0), std::span<const int>(&fd, 1)));
  sock.reset();  // the copy in flight holds the socket: the router's close is the last
  // The same client then asks for an answer, in order after the first.
  const auto t0 = std::chrono::steady_clock::now();
  a.send_frame(frame(0, aid, aid, 4000, 71), "x");
  Message d;
  ASSERT_TRUE(a.read_frame_for(aid, 71, d, 10s)) << "the router stopped, closing the passed socket";
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("answered after %.3f s (the socket lingers %d s)\n", waited, kLingerSeconds);
  EXPECT_TRUE(d.is_dead());
  EXPECT_TRUE(logged("received socket(s) with SO_LINGER closed on the closing thread")) << router_->log();
  expect_served("a passed socket whose close waits");
}

TEST_F(Hardening, TheFdsClientsMakeTheRouterHoldAreBoundedSharedAndLetGo) {
  constexpr long long kLimit = 300;
  start({"--fd-limit", "300", "--stall-timeout", "2s"});
  ASSERT_EQ(stats_field(router_stats_text(socket()), " fd_limit="), kLimit);
  const std::size_t before = count_open_fds(router_->pid());
  const auto ends = pipe_ends(200);
  auto fds_held = [&] { return stats_field(router_stats_text(socket()), " fds_held="); };
  auto connect = [&] { return raw_client(kFlagFdPassing); };

  // Two connections hold 200 fds each: over the limit.
  std::vector<RawPeer> hoarders;
  for (int i = 0; i < 2; ++i) hoarders.push_back(hoard(ends, connect));
  ASSERT_TRUE(eventually([&] { return fds_held() >= 400; }, 10s)) << router_stats_text(socket());
  EXPECT_EQ(stats_field(client_line(id_), " fds_held="), 200) << client_line(id_);

  // Another client, holding nothing, still passes its fd: the frame is
  // answered for what it is (a handle nobody serves), not for the budget.
  RawPeer b = raw_client(kFlagFdPassing);
  const std::uint32_t b_id = id_;
  int one = ends[0].get();
  Message d;
  ASSERT_TRUE(send_with_fds(b.fd, one_fd_frame(b_id, 71), std::span<const int>(&one, 1)));
  ASSERT_TRUE(b.read_frame_for(b_id, 71, d, 20s)) << router_->log();
  EXPECT_TRUE(d.is_dead());
  EXPECT_FALSE(d.text().starts_with(fdreason::kFdBudgetSpent)) << d.text();

  // A third hoarder, holding nothing either, is given its fds: 600, twice
  // the limit. Past that nobody's are taken: b's next fd is refused, with
  // the reason, and its connection stays.
  hoarders.push_back(hoard(ends, connect));
  ASSERT_TRUE(eventually([&] { return fds_held() >= 600; }, 10s)) << router_stats_text(socket());
  ASSERT_TRUE(send_with_fds(b.fd, one_fd_frame(b_id, 72), std::span<const int>(&one, 1)));
  ASSERT_TRUE(b.read_frame_for(b_id, 72, d, 20s)) << router_->log();
  EXPECT_TRUE(d.is_dead());
  EXPECT_TRUE(d.text().starts_with(fdreason::kFdBudgetSpent)) << d.text();
  EXPECT_LE(count_open_fds(router_->pid()), before + 3 * 200 + 8) << "the refused fd was kept";

  // The hoarders are cut off once their fds wait longer than the stall
  // timeout for the rest of their frames; what they held is let go.
  for (RawPeer& h : hoarders) EXPECT_TRUE(h.wait_eof(nullptr, 20s)) << router_->log();
  EXPECT_TRUE(logged("fds with frames it did not complete within 2000 ms")) << router_->log();
  ASSERT_TRUE(eventually([&] { return fds_held() == 0; }, 10s)) << router_stats_text(socket());
  EXPECT_LE(count_open_fds(router_->pid()), before + 8);

  // With room again, b's fd is taken.
  ASSERT_TRUE(send_with_fds(b.fd, one_fd_frame(b_id, 73), std::span<const int>(&one, 1)));
  ASSERT_TRUE(b.read_frame_for(b_id, 73, d, 20s)) << router_->log();
  EXPECT_TRUE(d.is_dead());
  EXPECT_FALSE(d.text().starts_with(fdreason::kFdBudgetSpent)) << d.text();
  expect_served("fds hoarded past the router's fd limit");
}

// A named client holds messages for handles it has not registered yet,
// until it is ready (Connection::open). Each fd such a message carries
// counts against that budget (its high-water mark) at kFdCharge bytes, as
// on a send queue: a peer cannot make it hold more than 1,024 fds. Counted
// by their bytes alone, it held all 3,000.
TEST_F(Hardening, AClientNotReadyYetHoldsABoundedNumberOfFds) {
  start();
  const auto ends = pipe_ends(2);
  ConnectOptions co;
  co.name = "not-ready-yet";
  Connection victim = Connection::open(socket(), co);
  // A handle it serves already: its message, sent last, arrives after all
  // the others have been held or answered (in order).
  constexpr std::uint32_t kLast = 5556;
  std::promise<void> last;
  victim.router().add_handler([&](Message&&) { last.set_value(); }, {}, kLast);
  const std::size_t before = count_open_fds();
  RawPeer a = raw_client(kFlagFdPassing);
  constexpr int kSent = 3000;
  constexpr std::uint32_t kUnserved = 5555;
  int one = ends[0].get();
  for (int i = 0; i < kSent; ++i)
    ASSERT_TRUE(send_with_fds(a.fd, one_fd_frame(id_, 0, victim.id(), kUnserved), std::span<const int>(&one, 1)));
  a.send_frame(frame(victim.id(), id_, id_, kLast, 0), "last");
  ASSERT_EQ(last.get_future().wait_for(20s), std::future_status::ready) << "the last message never arrived";
  const std::size_t held = count_open_fds() - before;
  EXPECT_LE(held, kDefaultHighWaterMark / kFdCharge + 16) << "fds held for a client that is not ready";
  EXPECT_GE(held, kDefaultHighWaterMark / kFdCharge / 2) << "hardly any were held: this shows nothing";
  victim.ready();  // what was held is answered now (invalid handle), its fds closed
  EXPECT_TRUE(eventually([&] { return count_open_fds() <= before + 8; }, 20s)) << count_open_fds() - before;
  expect_served("fds sent to a client that is not ready");
}

}  // namespace test_hardening_fds
}  // namespace spindle
