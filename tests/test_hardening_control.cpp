// What a router client says about routes, and what it makes others log or
// hold, is checked (docs/PROTOCOL.md §7.3.2, §14):
// - route and shutdown messages pass only between the two ends of a link:
//   a client cannot delete its own route and keep its id, nor have the
//   router pass a DEL_ROUTE on to another client, and a context takes
//   them from its parent link only when the parent itself sent them;
// - what a client can make happen per frame it writes (a rejected one-way
//   service call, a one-way frame a Mitogen peer cannot decode) is logged
//   in summary, and the notices it causes are charged like frames.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "router/reasons.h"
#include "router/router.h"
#include "services/envelope.h"
#include "stream/handshake.h"
#include "tests/hardening_fixture.h"
#include "tests/listener_test_util.h"
#include "tests/raw_peer.h"
#include "tests/router_fixture.h"
#include "tests/router_probe.h"
#include "tests/router_test_util.h"
#include "tests/stream_test_util.h"

namespace spindle {
namespace test_hardening_control {

using namespace testutil;
using namespace std::chrono_literals;

constexpr std::uint32_t kLastId = std::numeric_limits<std::uint32_t>::max();

// Writes `bytes` without blocking until all is written or the socket stays
// full for `stuck` (the router stopped reading). Returns the bytes written.
std::size_t send_up_to(RawPeer& p, const std::string& bytes, std::chrono::milliseconds stuck) {
  int flags = ::fcntl(p.fd, F_GETFL);
  ::fcntl(p.fd, F_SETFL, flags | O_NONBLOCK);
  std::size_t off = 0;
  auto last_progress = std::chrono::steady_clock::now();
  while (off < bytes.size()) {
    ssize_t n = ::send(p.fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<std::size_t>(n);
      last_progress = std::chrono::steady_clock::now();
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) break;
    if (std::chrono::steady_clock::now() - last_progress > stuck) break;
    pollfd pf{p.fd, POLLOUT, 0};
    ::poll(&pf, 1, 10);
  }
  ::fcntl(p.fd, F_SETFL, flags);
  return off;
}

// A client that says "I am gone" about itself (DEL_ROUTE of its own id) and
// stays connected would leave its id counted as free while it still sends
// as that id: once the id space wraps round, the next client would share
// it, and calls to that client could be answered by this one.
TEST(HardeningControl, AClientCannotDeleteItsOwnRouteAndKeepItsId) {
  InProcessRouter r;
  Router& router = r.router();
  RawPeer h = RawPeer::connect_to(r.address());
  const std::uint32_t hid = h.handshake();
  // "I am gone", says the client about itself; it stays connected.
  h.send_frame(frame(0, hid, hid, kHandleDelRoute, 0, kEncMitogen), std::to_string(hid));
  // Answered after it on the same stream: the DEL_ROUTE has been handled.
  auto ping = router.request(Message::make(hid, 4241, Payload::copy_of("still there?")), 20s);
  Message asked;
  ASSERT_TRUE(h.read_frame_for(hid, 4241, asked, 20s));
  h.send_frame(frame(0, hid, hid, asked.header.reply_to, 0), "yes");
  ASSERT_EQ(ping.wait_for(20s), std::future_status::ready);
  EXPECT_EQ(ping.get().text(), "yes");
  EXPECT_TRUE(router.watch_if_routed(hid, [](const std::string&) {}))
      << "the router deleted the route of a client still connected, at its word";
  // The id space runs out (a client spends it at millions of ids a second:
  // PROTOCOL.md §7.3.2) and goes round again.
  router.skip_ids_for_testing(kLastId);
  RawPeer c = RawPeer::connect_to(r.address());
  const std::uint32_t cid = c.handshake();
  EXPECT_NE(cid, hid) << "the id of a client still connected was handed to another client";

  // A call from the router to the new client is answered by the hostile one.
  auto fut = router.request(Message::make(cid, 4242, Payload::copy_of("for the new client only")), 20s);
  Message req;
  ASSERT_TRUE(c.read_frame_for(cid, 4242, req, 20s));
  h.send_frame(frame(0, hid, hid, req.header.reply_to, 0), "answered by the hostile client");
  // Its dead reply comes after the forged answer has been handled (in order).
  h.send_frame(frame(0, hid, hid, 4999, 56), "");
  Message marker;
  ASSERT_TRUE(h.read_frame_for(hid, 56, marker, 20s));
  c.send_frame(frame(0, cid, cid, req.header.reply_to, 0), "answered by the callee");
  ASSERT_EQ(fut.wait_for(20s), std::future_status::ready);
  EXPECT_EQ(fut.get().text(), "answered by the callee")
      << "another connection completed a call to context " << cid;
}

// A context takes route messages from its parent link only when the parent
// itself sent them: a DEL_ROUTE from any other context that reaches it
// through the parent (a router that passes it on, such as one older than
// this check) leaves its calls alone. The parent's own DEL_ROUTE still ends
// them, at once.
TEST(HardeningControl, ADelRouteThroughTheParentFromAnotherContextIsIgnored) {
  constexpr std::uint32_t kChildId = 5, kParentId = 1, kThird = 9, kForger = 7, kEcho = 3000;
  FdPair sp = make_socketpair();
  const auto welcome = encode_welcome(kFlagNone, kChildId, kParentId, 4242, kDefaultMaxMessageSize);
  ASSERT_TRUE(write_all(sp.b, welcome));  // read once the child has said hello
  Broker broker;
  Router child(broker, root_opts());
  child.add_handler([&child](Message&& m) { child.reply(m, m.data); }, {}, kEcho);
  child.attach_parent(sp.a, sp.a);
  std::vector<std::uint8_t> hello(kHelloSize);
  ASSERT_TRUE(read_exact(sp.b, hello.data(), hello.size()));
  if (hello[7] & kFlagMaxMessageSize) {
    ASSERT_TRUE(read_exact(sp.b, hello.data(), kHelloLimitSize));
  }
  FrameReader up(sp.b);
  auto send = [&](Header h, const std::string& body) {
    ASSERT_TRUE(write_all(sp.b, frame_bytes(h, reinterpret_cast<const std::uint8_t*>(body.data()), body.size())));
  };
  // A round trip through the child's echo: what was written before it has
  // been handled.
  auto handled = [&](std::uint32_t marker) {
    send(frame(kChildId, kParentId, kParentId, kEcho, marker), "marker");
    for (auto m = up.next(); m; m = up.next())
      if (m->header.handle == marker) return true;
    return false;
  };

  auto call = child.request(Message::make(kThird, 4000, Payload::copy_of("to the third")), 20s);
  auto asked = up.next();
  ASSERT_TRUE(asked.has_value());
  ASSERT_EQ(asked->header.dst_id, kThird);
  send(frame(kChildId, kForger, kForger, kHandleDelRoute, 0, kEncMitogen), std::to_string(kThird));
  ASSERT_TRUE(handled(61));
  EXPECT_NE(call.wait_for(200ms), std::future_status::ready)
      << "a DEL_ROUTE from context " << kForger << " through the parent failed a call to context " << kThird;
  // The parent's own DEL_ROUTE: the call fails now, with the reason.
  send(frame(kChildId, kParentId, kParentId, kHandleDelRoute, 0, kEncMitogen), std::to_string(kThird));
  ASSERT_EQ(call.wait_for(20s), std::future_status::ready);
  try {
    call.get();
    ADD_FAILURE() << "the call to a context its parent said is gone succeeded";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(reason::kPeerDisconnected), std::string::npos) << e.what();
  }
  ::shutdown(sp.b, SHUT_WR);
  broker.shutdown();
  broker.join();
  close_fd(sp.b);
}

// A handler that throws on what a peer sent: the sender is told in a reply,
// and the log gets a summary, not a line per message (the exception's text,
// which often quotes the input, escaped).
TEST(HardeningControl, AHandlerThatThrowsOnEachMessageIsLoggedInSummary) {
  ScopedLogCapture capture;
  Broker broker;
  Router router(broker, root_opts());
  const std::uint32_t throws =
      router.add_handler([](Message&& m) { throw std::runtime_error("cannot parse " + m.text()); });
  std::promise<void> last;
  const std::uint32_t marker = router.add_handler([&last](Message&&) { last.set_value(); });
  constexpr int kMessages = 3000;
  const std::string input = "x\nforged line";
  for (int i = 0; i < kMessages; ++i)
    router.send(router.id(), throws, std::span(reinterpret_cast<const std::uint8_t*>(input.data()), input.size()));
  // Dispatched in order on the broker thread: the flood is handled first.
  router.send(router.id(), marker, {});
  ASSERT_EQ(last.get_future().wait_for(30s), std::future_status::ready);
  const auto lines = capture.sink().lines_with("threw");
  std::printf("%d messages to a throwing handler: %zu log lines\n", kMessages, lines.size());
  ASSERT_FALSE(lines.empty()) << "the throwing handler was never logged";
  EXPECT_LT(lines.size(), 20u) << "one log line per message a peer sends to a throwing handler; e.g.\n"
                               << lines.front();
  EXPECT_NE(lines.front().find(fmt::format("from context {}", router.id())), std::string::npos) << lines.front();
  EXPECT_NE(lines.front().find("x\\nforged line"), std::string::npos) << "not escaped: " << lines.front();
}

class HardeningControlRouter : public Hardening {
 protected:
  // Returns once the router's log holds every line written before this
  // call: a client connecting now is logged after them, in order.
  void log_caught_up() {
    RawPeer late = raw_client();
    ASSERT_TRUE(logged(fmt::format("client ctx={} ", id_))) << "the router never logged a new client";
  }
};

// A client that addresses DEL_ROUTE to another client: were it passed on,
// that client would take it as its parent's word and fail its calls to the
// third context named in it (a stock Mitogen client would; ours checks the
// sender too, below).
TEST_F(HardeningControlRouter, ADelRouteFromAnotherClientCannotFailACallToAThird) {
  start();
  constexpr std::uint32_t kEcho = 2000;
  auto callee = connect(socket());
  auto [call, question] = held_call(*callee, kEcho);
  ASSERT_FALSE(HasFailure());
  RawPeer attacker = raw_client();
  attacker.send_frame(frame(good_->id(), id_, id_, kHandleDelRoute, 0, kEncMitogen),
                      std::to_string(callee->id()));
  // Through the router (in order), then give the victim time to read it.
  attacker.send_frame(frame(0, id_, id_, 4999, 55), "");
  Message marker;
  ASSERT_TRUE(attacker.read_frame_for(id_, 55, marker, 20s));
  if (call.wait_for(2s) == std::future_status::ready) {
    std::string what = "(a result)";
    try {
      call.get();
    } catch (const std::exception& e) {
      what = e.what();
    }
    FAIL() << "a DEL_ROUTE forwarded from client " << id_ << " failed client " << good_->id()
           << "'s call to client " << callee->id() << ": " << what;
  }
  callee->router().reply(question, Payload::copy_of("real answer"));
  EXPECT_EQ(call.get(), "real answer");
  expect_served("a forwarded DEL_ROUTE");
}

// One-way service calls that are rejected (here: an unknown service, whose
// name the caller chooses): a log line for each would be written at the
// caller's will.
TEST_F(HardeningControlRouter, RejectedOneWayServiceCallsAreLoggedInSummary) {
  start();
  RawPeer h = raw_client();
  const std::uint32_t hid = id_;
  const std::string service(200, 'q');
  const std::string body = services::encode_call(service, "m", {}).to_string();
  constexpr int kFrames = 20000;
  std::string burst;
  for (int i = 0; i < kFrames; ++i)
    burst += frame_bytes(frame(0, hid, hid, kHandleCallService, 0), body);
  ASSERT_EQ(send_up_to(h, burst, 5s), burst.size());
  // In order: once this one is answered, the flood has been handled.
  h.send_frame(frame(0, hid, hid, kHandleCallService, 77), body);
  Message dead;
  ASSERT_TRUE(h.read_frame_for(hid, 77, dead, 30s));
  EXPECT_TRUE(dead.is_dead());
  log_caught_up();
  const auto lines = lines_with("not answered (no reply_to)");
  std::printf("%d one-way calls to an unknown service: %zu log lines\n", kFrames, lines.size());
  EXPECT_LT(lines.size(), 250u) << "one log line per rejected one-way call, at the caller's will; e.g.\n"
                                << (lines.empty() ? std::string() : lines.front());
  expect_served("a flood of one-way service calls");
}

// One-way frames a Mitogen client cannot decode: each becomes a notice to
// that client, in its terms. Those notices are charged on its mark like the
// frames would be, so the sender is held there, and logged in summary.
TEST_F(HardeningControlRouter, UndecodableOneWayFramesToAMitogenClientHoldTheSender) {
  start({"--high-water-mark", "1M", "--peer-memory-limit", "4M", "--stall-timeout", "120s"});
  std::uint32_t mid = 0;
  RawPeer m = mitogen_client(mid);  // reads nothing (a slow reader fares no better)
  RawPeer h = raw_client();
  const std::uint32_t hid = id_;
  constexpr int kFrames = 250000;
  std::string burst;
  burst.reserve(kFrames * (kHeaderSize + 1));
  for (int i = 0; i < kFrames; ++i) burst += frame_bytes(frame(mid, hid, hid, 4321, 0, kEncRaw), "x");
  const std::size_t written = send_up_to(h, burst, 3s);
  log_caught_up();  // the router stopped reading the sender: what it read is handled
  const long long peak = memory_peak();
  const std::string victim = client_line(mid), sender = client_line(hid);
  std::printf("wrote %zu of %zu bytes; memory_peak %lld\n%s\n%s\n", written, burst.size(), peak,
              victim.c_str(), sender.c_str());
  // Two peers with 4 MiB limits (the victim's queue, the sender's pinned
  // chunks), plus a receive chunk each, as QueuedFramesAreChargedAtWhatTheyCost
  // expects for ordinary one-way frames.
  EXPECT_LE(peak, 2 * ((4 << 20) + (1 << 20)))
      << "one-way frames the receiver cannot decode grew its queue without bound, the sender never held";
  const auto lines = lines_with("telling the receiver");
  EXPECT_LT(lines.size(), 250u) << "one warning per undecodable one-way frame; e.g.\n"
                                << (lines.empty() ? std::string() : lines.front());
  expect_served("undecodable frames to a Mitogen client");
}

}  // namespace test_hardening_control
}  // namespace spindle
