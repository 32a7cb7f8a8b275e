// Faults against the real spindle-router: clients killed with SIGKILL at the
// worst moments, the router itself killed, the router out of fds, and a
// consumer that stops reading. After each, the router's fds, clients and
// memory are back within bounds, every pending call has failed with a reason
// (within a hang guard; how long it took is printed, never asserted), and
// well-behaved clients are still served.
//
// Victims are forked processes that speak raw bytes (tests/raw_peer.h) and
// report on a pipe once they reached the moment to be killed at; they start
// no threads, so forking them from this threaded test process is safe.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "router/reasons.h"
#include "stream/fd_frame.h"
#include "services/envelope.h"
#include "tests/fds_test_util.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/router_probe.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_faults {

using namespace testutil;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kNeverReply = 2400;
constexpr std::uint32_t kSink = 2401;
constexpr auto kHangGuard = 30s;
// RSS bounds allow for the sanitizers' own memory: ASan keeps freed memory in
// its quarantine (256 MiB by default); TSan shadows every touched byte of the
// heap several times over (we allow 5x).
#if defined(__SANITIZE_ADDRESS__)
constexpr long kRssSlackKiB = (32 + 256) * 1024;
constexpr long kShadowFactor = 1;
#elif defined(__SANITIZE_THREAD__)
constexpr long kRssSlackKiB = 32 * 1024;
constexpr long kShadowFactor = 5;
#else
constexpr long kRssSlackKiB = 32 * 1024;
constexpr long kShadowFactor = 1;
#endif

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// A forked raw client: runs `act` (which reports on `report` once it reached
// the moment to die at), then waits to be killed.
pid_t fork_victim(const UnixAddress& addr, int report,
                  const std::function<void(RawPeer&, int report)>& act) {
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  try {
    RawPeer p = RawPeer::connect_to(addr);
    act(p, report);
  } catch (...) {
    ::_exit(3);
  }
  for (;;) ::pause();
}

void report_u32(int fd, std::uint32_t v) {
  if (::write(fd, &v, sizeof v) != static_cast<ssize_t>(sizeof v)) ::_exit(4);
}

// Reads one u32 report; nullopt if the victim never got there.
std::optional<std::uint32_t> read_report(int fd) {
  std::string r = read_some(fd, sizeof(std::uint32_t), 20s);
  if (r.size() != sizeof(std::uint32_t)) return std::nullopt;
  std::uint32_t v;
  std::memcpy(&v, r.data(), sizeof v);
  return v;
}

void kill_and_reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
}

class Faults : public ::testing::Test {
 protected:
  void start_router(std::vector<std::string> extra = {}, std::vector<std::string> wrapper = {}) {
    extra.insert(extra.end(), {"--log-level", "info"});
    router_ = std::make_unique<RouterProcess>(SPINDLE_ROUTER_BINARY, socket(), extra,
                                              std::string{}, std::move(wrapper));
    ASSERT_TRUE(router_->wait_ready()) << router_->log();
  }
  std::string socket() const { return dir_.path() + "/router.sock"; }
  UnixAddress address() const { return UnixAddress::parse(socket()); }
  std::unique_ptr<Connection> client(const std::string& name) {
    RouterOptions ro;
    ro.name = name;
    return connect(socket(), ro);
  }
  void expect_ping(Connection& c, const std::string& text) {
    EXPECT_EQ(services::call_text(c.router_context(), services::kPingService, services::kPingMethod,
                                  text, 20s),
              text);
  }

  TempDir dir_;
  std::unique_ptr<RouterProcess> router_;
};

// 100 clients killed with SIGKILL: 20 mid-handshake, 20 mid-message (half a
// 1 MiB frame written), 20 mid-fd-transfer (an SF frame whose 8 fds arrived
// with its first bytes, half its body written: the router must close them),
// 40 mid-call (a call of ours pending at the victim, and
// the victim's own call to the router's ping service unanswered).
TEST_F(Faults, KillNineClientsMidHandshakeMidMessageMidFdTransferMidCall) {
  start_router();
  RouterCounts before;
  ASSERT_TRUE(eventually([&] { return (before = router_counts(socket())).clients == 1; }));
  const long rss_before = vm_rss_kib(router_->pid());
  auto caller = client("caller");
  std::atomic<int> sunk{0};
  auto sink = client("sink");
  sink->router().add_handler([&](Message&&) { ++sunk; }, {}, kSink);
  int pipefd[2];
  ASSERT_EQ(::pipe2(pipefd, O_CLOEXEC), 0);
  const std::uint32_t sink_id = sink->id();
  double slowest_ms = 0;
  int kinds[4] = {0, 0, 0, 0};

  for (int i = 0; i < 100; ++i) {
    // 20 mid-handshake, 20 mid-message, 20 mid-fd-transfer, 40 mid-call.
    const int kind = i % 5 == 0 ? 0 : i % 5 == 1 ? 1 : i % 5 == 2 ? 3 : 2;
    ++kinds[kind];
    SCOPED_TRACE(fmt::format("iteration {} kind {}", i, kind));
    pid_t pid = fork_victim(address(), pipefd[1], [&](RawPeer& p, int report) {
      if (kind == 0) {  // three bytes of the hello, then nothing
        p.write_all("SPD");
        return report_u32(report, 0);
      }
      std::uint32_t me = p.handshake(kind == 3 ? kFlagFdPassing : kFlagNone);
      if (kind == 3) {  // an SF frame with 8 fds attached, half of its 1 MiB body written
        Header h = frame(sink_id, me, me, kSink, 0);
        h.enc = kEncFds;
        h.length = static_cast<std::uint32_t>(kFdPrefixSize + (1u << 20));
        HeaderBytes hb = encode_header(h);
        auto prefix = encode_fd_prefix(FdPrefix{kEncRaw, 8, 0});
        std::string head(reinterpret_cast<const char*>(hb.data()), hb.size());
        head.append(reinterpret_cast<const char*>(prefix.data()), prefix.size());
        head.append(256 * 1024, 'f');
        std::vector<int> fds;
        for (int k = 0; k < 4; ++k) {
          int pp[2];
          if (::pipe2(pp, O_CLOEXEC) != 0) ::_exit(6);
          fds.insert(fds.end(), {pp[0], pp[1]});
        }
        auto bytes = std::span(reinterpret_cast<const std::uint8_t*>(head.data()), head.size());
        if (!send_with_fds(p.fd, bytes, fds)) ::_exit(7);
        p.write_all(std::string(256 * 1024, 'f'));
        return report_u32(report, me);
      }
      if (kind == 1) {  // half of a 1 MiB frame to the sink
        Header h = frame(sink_id, me, me, kSink, 0);
        h.length = 1u << 20;
        HeaderBytes hb = encode_header(h);
        p.write_all(hb.data(), hb.size());
        p.write_all(std::string(512 * 1024, 'm'));
        return report_u32(report, me);
      }
      // A ping call of its own, left unread; then our call arrives.
      p.send_frame(frame(0, me, me, kHandleCallService, 1000),
                   services::encode_call(services::kPingService, services::kPingMethod,
                                         Payload::copy_of("unread"))
                       .to_string());
      report_u32(report, me);
      Message m;
      if (!p.read_frame_for(me, kNeverReply, m, 20s)) ::_exit(5);
      report_u32(report, me);
    });
    ASSERT_GT(pid, 0);
    auto id = read_report(pipefd[0]);
    ASSERT_TRUE(id.has_value()) << "victim never reached its moment";
    std::future<Message> pending;
    if (kind == 2) {
      pending = caller->context(*id).call_async(kNeverReply, Payload::copy_of("wait"), 600s);
      ASSERT_TRUE(read_report(pipefd[0]).has_value()) << "our call never reached the victim";
    }
    auto killed = Clock::now();
    kill_and_reap(pid);
    if (kind == 2) {
      ASSERT_EQ(pending.wait_for(kHangGuard), std::future_status::ready) << "hang guard";
      slowest_ms = std::max(slowest_ms, ms_since(killed));
      try {
        pending.get();
        ADD_FAILURE() << "a call to a killed client succeeded";
      } catch (const ChannelError& e) {
        EXPECT_TRUE(contains(e.what(), reason::kPeerDisconnected)) << e.what();
      }
    }
  }
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  std::printf("killed %d mid-handshake, %d mid-message, %d mid-fd-transfer, %d mid-call; slowest "
              "pending-call failure after the kill: %.1f ms\n",
              kinds[0], kinds[1], kinds[3], kinds[2], slowest_ms);
  RecordProperty("slowest_pending_call_failure_ms", fmt::format("{:.1f}", slowest_ms));
  EXPECT_EQ(sunk.load(), 0) << "half a frame was delivered";
  expect_ping(*caller, "after the killing");
  caller.reset();
  sink.reset();
  RouterCounts after;
  EXPECT_TRUE(eventually([&] { return (after = router_counts(socket())) == before; }))
      << "router fds " << after.fds << " (baseline " << before.fds << "), clients "
      << after.clients << " (baseline " << before.clients << ")";
  const long rss_after = vm_rss_kib(router_->pid());
  std::printf("router VmRSS %ld KiB before, %ld KiB after\n", rss_before, rss_after);
  // 40 half-megabyte partial frames were buffered at some point; none may
  // stay. ASan keeps freed memory in its quarantine (256 MiB by default), so
  // there the bound is the quarantine's size on top.
  EXPECT_LT(rss_after, rss_before + kShadowFactor * kRssSlackKiB) << "router RSS grew by over the bound";
}

// SIGKILL the router: every client's pending calls fail with a reason, and
// every client shuts down without hanging.
TEST_F(Faults, KillTheRouterFailsEveryPendingCallPromptly) {
  start_router();
  std::vector<std::unique_ptr<Connection>> clients;
  std::atomic<int> arrived{0};
  for (int i = 0; i < 4; ++i) {
    clients.push_back(std::make_unique<Connection>([&] {
      RouterOptions ro;
      ro.name = fmt::format("client-{}", i);
      return ro;
    }()));
    clients.back()->router().add_handler([&](Message&&) { ++arrived; }, {}, kNeverReply);
    clients.back()->connect(address());
  }
  std::vector<std::future<Message>> pending;
  for (std::size_t i = 0; i < clients.size(); ++i) {
    Connection& from = *clients[i];
    Connection& to = *clients[(i + 1) % clients.size()];
    for (int k = 0; k < 5; ++k)
      pending.push_back(from.context(to.id()).call_async(kNeverReply, Payload::copy_of("w"), 600s));
  }
  ASSERT_TRUE(eventually([&] { return arrived.load() == static_cast<int>(pending.size()); }));
  auto killed = Clock::now();
  router_->stop(SIGKILL);
  double slowest_ms = 0;
  for (auto& f : pending) {
    ASSERT_EQ(f.wait_for(kHangGuard), std::future_status::ready) << "hang guard";
    slowest_ms = std::max(slowest_ms, ms_since(killed));
    try {
      f.get();
      ADD_FAILURE() << "a call survived the router's death";
    } catch (const ChannelError& e) {
      EXPECT_TRUE(contains(e.what(), reason::kPeerDisconnected)) << e.what();
    }
  }
  // No client hangs: each closes (its broker already shut itself down).
  auto closed = std::async(std::launch::async, [&] { clients.clear(); });
  ASSERT_EQ(closed.wait_for(kHangGuard), std::future_status::ready) << "a client hung";
  std::printf("router killed: %zu pending calls failed, the slowest %.1f ms after the kill; "
              "clients closed %.1f ms after it\n",
              pending.size(), slowest_ms, ms_since(killed));
}

// RLIMIT_NOFILE 32 (hard and soft, so the router cannot raise it): clients
// beyond what fits are refused with a logged reason; those inside keep working.
TEST_F(Faults, LowFdLimitRefusesNewClientsAndKeepsTheOld) {
  std::vector<std::string> wrapper{"/usr/bin/prlimit", "--nofile=32:32"};
  start_router({}, wrapper);
  std::vector<std::unique_ptr<Connection>> in;
  int refused = 0;
  for (int i = 0; i < 40 && refused < 3; ++i) {
    try {
      RouterOptions ro;
      ro.name = fmt::format("fd-client-{}", i);
      ro.handshake_timeout = 10s;
      auto c = connect(socket(), ro);
      if (refused == 0) in.push_back(std::move(c));
      else ADD_FAILURE() << "a client got in after one was refused, without any leaving";
    } catch (const Error&) {
      ++refused;
    }
  }
  ASSERT_GT(in.size(), 0u) << router_->log();
  ASSERT_GT(refused, 0) << "RLIMIT_NOFILE 32 admitted 40 clients";
  EXPECT_TRUE(eventually([&] { return contains(router_->log(), "refusing new clients until fds are free"); }))
      << router_->log();
  for (std::size_t i = 0; i < in.size(); ++i) {
    try {
      expect_ping(*in[i], fmt::format("still here {}", i));
    } catch (const Error& e) {
      ADD_FAILURE() << "admitted client " << i << " lost: " << e.what() << "\n" << router_->log();
    }
  }
  // One leaves: a new client fits again.
  in.pop_back();
  EXPECT_TRUE(eventually([&] {
    try {
      in.push_back(connect(socket()));
      return true;
    } catch (const Error&) {
      return false;
    }
  })) << "no client was admitted after one left";
  std::printf("RLIMIT_NOFILE 32: %zu clients admitted, %d refused\n", in.size(), refused);
}

// A consumer that stops reading: the router's queue towards it fills to the
// high-water mark (64 MiB by default), then forwarded requests get the dead
// reply "output queue full"; other clients are unaffected and the router's
// memory stays bounded. When the consumer goes, what was queued fails.
TEST_F(Faults, ConsumerThatStopsReadingHitsTheHighWaterMark) {
  start_router();
  const long rss_before = vm_rss_kib(router_->pid());
  RawPeer consumer = RawPeer::connect_to(address());
  const std::uint32_t consumer_id = consumer.handshake();
  int small = 4096;
  ::setsockopt(consumer.fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  auto producer = client("producer");
  Payload chunk = Payload::copy_of(std::string(256 * 1024, 'q'));
  std::vector<std::future<Message>> sent;
  bool full = false;
  std::string full_reason;
  // 64 MiB / 256 KiB = 256 fit; stop at the first refusal (or a hang guard of 600).
  for (int i = 0; i < 600 && !full; ++i) {
    sent.push_back(producer->context(consumer_id).call_async(kSink, chunk, 120s));
    for (auto& f : sent) {
      if (f.valid() && f.wait_for(0s) == std::future_status::ready) {
        try {
          f.get();
        } catch (const ChannelError& e) {
          full_reason = e.what();
          full = contains(full_reason, reason::kQueueFull);
        }
        if (!full) ADD_FAILURE() << "unexpected outcome: " << full_reason;
      }
    }
    if (i > 250 && !full) std::this_thread::sleep_for(10ms);  // let the dead replies arrive
  }
  ASSERT_TRUE(full) << "600 requests of 256 KiB never hit the high-water mark";
  EXPECT_TRUE(contains(full_reason, fmt::format("context {}", consumer_id))) << full_reason;
  // Others are unaffected.
  auto a = client("a");
  auto b = client("b");
  b->router().add_handler([&](Message&& m) { b->router().reply(m, Payload::copy_of("b")); }, {}, kSink);
  expect_ping(*a, "unaffected");
  EXPECT_EQ(a->context(b->id()).call(kSink, "hi", 20s), "b");
  const long rss_full = vm_rss_kib(router_->pid());
  std::printf("router VmRSS %ld KiB before, %ld KiB with the consumer's queue full (%s)\n",
              rss_before, rss_full, full_reason.c_str());
  // The queue may hold the mark plus one message; allow as much again.
  EXPECT_LT(rss_full, rss_before + kShadowFactor * 128 * 1024 + kRssSlackKiB)
      << "router RSS over twice the mark plus the slack";
  // The consumer goes: everything queued for it fails with a reason.
  ::close(consumer.fd);
  consumer.fd = -1;
  for (auto& f : sent) {
    if (!f.valid()) continue;
    ASSERT_EQ(f.wait_for(kHangGuard), std::future_status::ready) << "hang guard";
    try {
      f.get();
      ADD_FAILURE() << "a request to a consumer that never read was answered";
    } catch (const ChannelError& e) {
      EXPECT_TRUE(contains(e.what(), reason::kPeerDisconnected) || contains(e.what(), reason::kQueueFull))
          << e.what();
    }
  }
}

}  // namespace test_faults
}  // namespace spindle
