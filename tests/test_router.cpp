// Router rules, exercised over real forked children and over a raw socket
// driven by hand from the test thread.
//
// Every child reports through messages or its exit status; no gtest macro
// runs inside a forked child.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "broker/errors.h"
#include "router/child.h"
#include "router/reasons.h"
#include "router/router.h"
#include "tests/raw_peer.h"
#include "tests/router_test_util.h"
#include "spindle/frame.h"
#include "stream/handshake.h"
#include "spindle/message.h"
#include "stream/port.h"

namespace spindle {
namespace test_router {

using namespace testutil;

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kEcho = 3000;
constexpr std::uint32_t kRefuseAll = 3001;
constexpr std::uint32_t kOnlyPassword = 3002;
constexpr std::uint32_t kAskSibling = 3010;
constexpr std::uint32_t kPing = 3011;
constexpr std::uint32_t kGetGrandchild = 3100;
constexpr std::uint32_t kGcHang = 3101;
constexpr std::uint32_t kGcEcho = 3102;
constexpr std::uint32_t kRootArrived = 3103;

// Registers an echo handler on `r`.
void add_echo(Router& r, std::uint32_t handle = kEcho) {
  r.add_handler([&r](Message&& m) { r.reply(m, m.data); }, {}, handle);
}

// ------------------------------------------------------------ forked children

int echo_child(ChildEnv& env) {
  add_echo(env.router());
  env.serve();
  return 0;
}

TEST(RouterRules, CallToUnregisteredHandleIsInvalidHandle) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, echo_child, named("echo"));
  // The child is alive and serving: its registered handle answers.
  EXPECT_EQ(c.call(kEcho, std::string_view("hi"), 10s), "hi");
  std::string what = expect_throw<ChannelError>([&] { c.call(4242, std::string_view("x"), 10s); });
  EXPECT_TRUE(what.starts_with(reason::kInvalidHandle)) << what;
  EXPECT_TRUE(contains(what, "4242")) << what;
  c.shutdown();
  expect_exit_code(c, 0);
}

TEST(RouterRules, RequestToUnknownContextIsNoRoute) {
  Broker broker;
  Router router(broker, root_opts());
  auto t0 = Clock::now();
  std::string what = expect_throw<ChannelError>([&] {
    router.request(Message::make(9999, kEcho, Payload::copy_of("anyone?")), 3s).get();
  });
  EXPECT_TRUE(contains(what, reason::kNoRoute)) << what;
  EXPECT_TRUE(contains(what, "9999")) << what;
  // A dead reply, not the timeout.
  EXPECT_LT(Clock::now() - t0, 2s);
}

TEST(RouterRules, RequestToUnknownContextFromChildIsNoRoute) {
  // The same rule one level down: the child's request for 9999 goes to the
  // root, which has no route and answers with a dead reply.
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, [](ChildEnv& env) {
    Router& r = env.router();
    OffBrokerThreads workers;
    r.add_handler([&](Message&& m) {
      workers.run([&r, m = std::move(m)] {
        std::string out;
        try {
          r.request(Message::make(9999, kEcho, Payload::copy_of("x")), 3s).get();
          out = "ok";
        } catch (const std::exception& e) {
          out = fmt::format("{}|{}", typeid(e).name(), e.what());
        }
        try {
          r.reply(m, Payload::copy_of(out));
        } catch (...) {
        }
      });
    }, {}, kAskSibling);
    env.serve();
    workers.join_all();
    return 0;
  }, named("asker"));
  std::string out = c.call(kAskSibling, std::string_view{}, 15s);
  EXPECT_TRUE(contains(out, reason::kNoRoute)) << out;
  EXPECT_TRUE(contains(out, "ChannelError")) << out;
  c.shutdown();
  expect_exit_code(c, 0);
}

TEST(RouterRules, PolicyRefusalIsRefusedByPolicy) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, [](ChildEnv& env) {
    Router& r = env.router();
    HandlerOptions never;
    never.policy = [](const Message&) { return false; };
    r.add_handler([&r](Message&& m) { r.reply(m, Payload::copy_of("should not run")); }, never,
                  kRefuseAll);
    HandlerOptions password;
    password.policy = [](const Message& m) { return m.text() == "let me in"; };
    r.add_handler([&r](Message&& m) { r.reply(m, Payload::copy_of("welcome")); }, password,
                  kOnlyPassword);
    env.serve();
    return 0;
  }, named("guarded"));
  std::string what = expect_throw<ChannelError>([&] { c.call(kRefuseAll, std::string_view("x"), 10s); });
  EXPECT_TRUE(what.starts_with(reason::kRefusedByPolicy)) << what;
  // The policy sees the message itself.
  EXPECT_EQ(c.call(kOnlyPassword, std::string_view("let me in"), 10s), "welcome");
  what = expect_throw<ChannelError>([&] { c.call(kOnlyPassword, std::string_view("guess"), 10s); });
  EXPECT_TRUE(contains(what, reason::kRefusedByPolicy)) << what;
  c.shutdown();
  expect_exit_code(c, 0);
}

TEST(RouterRules, SendAboveMaxMessageSizeThrowsTooLarge) {
  constexpr std::uint32_t kMax = 1u << 20;
  Broker broker;
  RouterOptions opts = root_opts();
  opts.max_message_size = kMax;
  Router router(broker, opts);
  Context c = fork_child(router, echo_child, named("echo"));

  std::string big(kMax + 1, 'x');
  std::string what = expect_throw<Error>(
      [&] { router.send(Message::make(c.id(), kEcho, Payload::copy_of(big))); });
  EXPECT_TRUE(contains(what, "too large")) << what;
  what = expect_throw<Error>([&] { c.call(kEcho, Payload::copy_of(big), 10s); });
  EXPECT_TRUE(contains(what, "too large")) << what;
  // No handler leaked for the refused request: only ALLOCATE_ID remains.
  EXPECT_EQ(router.stats().handlers, 1u);

  // Exactly at the limit is fine, both ways.
  std::string at_limit(kMax, 'y');
  EXPECT_TRUE(c.call(kEcho, Payload::copy_of(at_limit), 20s).to_string() == at_limit);
  c.shutdown();
  expect_exit_code(c, 0);
}

// Child A: on kAskSibling (payload = a sibling's id), calls kPing on that
// sibling from a worker thread (never block the broker thread) and replies
// with "ok:<reply>" or "error:<type>|<what>".
int asking_child(ChildEnv& env) {
  Router& r = env.router();
  OffBrokerThreads workers;
  r.add_handler([&](Message&& m) {
    workers.run([&r, m = std::move(m)] {
      std::string out;
      try {
        auto sibling = static_cast<std::uint32_t>(std::stoul(m.text()));
        Message reply = r.request(Message::make(sibling, kPing, Payload::copy_of("ping")), 5s).get();
        out = "ok:" + reply.text();
      } catch (const std::exception& e) {
        out = fmt::format("error:{}|{}", typeid(e).name(), e.what());
      }
      try {
        r.reply(m, Payload::copy_of(out));
      } catch (...) {
      }
    });
  }, {}, kAskSibling);
  env.serve();
  workers.join_all();
  return 0;
}

int pong_child(ChildEnv& env) {
  Router& r = env.router();
  r.add_handler([&r](Message&& m) { r.reply(m, Payload::copy_of(fmt::format("pong from {}", r.id()))); },
                {}, kPing);
  env.serve();
  return 0;
}

std::string sibling_call(bool unidirectional) {
  Broker broker;
  RouterOptions opts = root_opts();
  opts.unidirectional = unidirectional;
  Router router(broker, opts);
  Context a = fork_child(router, asking_child, named("A"));
  Context b = fork_child(router, pong_child, named("B"));
  // B is up before A asks.
  EXPECT_EQ(b.call(kPing, std::string_view{}, 10s), fmt::format("pong from {}", b.id()));
  std::string out = a.call(kAskSibling, std::to_string(b.id()), 20s);
  a.shutdown();
  b.shutdown();
  expect_exit_code(a, 0);
  expect_exit_code(b, 0);
  return out + fmt::format(" [B={}]", b.id());
}

TEST(RouterRules, UnidirectionalRefusesSiblingCalls) {
  std::string out = sibling_call(true);
  EXPECT_TRUE(out.starts_with("error:")) << out;
  EXPECT_TRUE(contains(out, "unidirectional")) << out;
  EXPECT_TRUE(contains(out, reason::kUnidirectional)) << out;
  EXPECT_TRUE(contains(out, "ChannelError")) << out;
}

TEST(RouterRules, SiblingCallsRouteThroughParentByDefault) {
  std::string out = sibling_call(false);
  EXPECT_TRUE(out.starts_with("ok:pong from ")) << out;
}

// ------------------------------------------------------------ raw peer (tests/raw_peer.h)

// A root router with one raw child context whose handshake is done.
struct RawChild {
  Broker broker;
  Router router{broker, root_opts()};
  RawPeer peer;
  std::uint32_t id = 0;
  // Attaches the peer and completes its handshake; false if either failed.
  bool attach() {
    id = router.allocate_id();
    return attach_raw(router, peer, id) && peer.handshake() == id;
  }
};

TEST(RouterRawPeer, ForgedAuthOrSrcIsRefusedWithReversePath) {
  Broker broker;
  Router router(broker, root_opts());
  std::atomic<int> calls{0};
  router.add_handler([&](Message&& m) {
    ++calls;
    router.reply(m, Payload::copy_of("ok:" + m.text()));
  }, {}, kEcho);
  std::uint32_t n = router.allocate_id();
  RawPeer peer;
  ASSERT_TRUE(attach_raw(router, peer, n));
  ASSERT_EQ(peer.handshake(), n);
  EXPECT_EQ(peer.server_id, 0u);

  // Forged auth_id.
  peer.send_frame(frame(0, n, 7, kEcho, 1234), "forged auth");
  Message d;
  ASSERT_TRUE(peer.read_frame(d));
  EXPECT_EQ(d.header.reply_to, static_cast<std::uint32_t>(kHandleIsDead));
  EXPECT_EQ(d.header.handle, 1234u);
  EXPECT_EQ(d.header.dst_id, n);
  EXPECT_EQ(d.header.src_id, 0u);
  EXPECT_TRUE(contains(d.text(), reason::kReversePath)) << d.text();

  // Forged src_id.
  peer.send_frame(frame(0, 7, n, kEcho, 1235), "forged src");
  ASSERT_TRUE(peer.read_frame(d));
  EXPECT_EQ(d.header.reply_to, static_cast<std::uint32_t>(kHandleIsDead));
  EXPECT_EQ(d.header.handle, 1235u);
  EXPECT_TRUE(contains(d.text(), reason::kReversePath)) << d.text();

  // The stream survives; an honest frame reaches the handler.
  peer.send_frame(frame(0, n, n, kEcho, 1236), "honest");
  ASSERT_TRUE(peer.read_frame(d));
  EXPECT_FALSE(d.is_dead()) << d.text();
  EXPECT_EQ(d.header.handle, 1236u);
  EXPECT_EQ(d.header.dst_id, n);
  EXPECT_EQ(d.text(), "ok:honest");
  EXPECT_EQ(calls.load(), 1) << "a forged frame reached the handler";
  EXPECT_TRUE(peer.goodbye()) << "the router did not answer EOF with EOF";
}

TEST(RouterRawPeer, HonestFrameToUnknownHandleGetsInvalidHandle) {
  RawChild child;
  ASSERT_TRUE(child.attach());
  RawPeer& peer = child.peer;
  const std::uint32_t n = child.id;
  peer.send_frame(frame(0, n, n, 4321, 77), "anyone?");
  Message d;
  ASSERT_TRUE(peer.read_frame(d));
  EXPECT_EQ(d.header.reply_to, static_cast<std::uint32_t>(kHandleIsDead));
  EXPECT_EQ(d.header.handle, 77u);
  EXPECT_TRUE(d.text().starts_with(reason::kInvalidHandle)) << d.text();
  EXPECT_TRUE(contains(d.text(), "4321")) << d.text();
  EXPECT_TRUE(peer.goodbye()) << "the router did not answer EOF with EOF";
}

// A thread that writes to a stream only now and then writes each frame
// itself (one sendmsg, no wake-up of the broker), even when the peer has not
// spoken since its last direct write: the stream is idle, and has been for
// longer than TxGate::kIdleForDirect. Before that rule, only the first send
// after the peer spoke went direct, so a thread writing for many connections
// in turn woke their brokers for most of its sends.
TEST(RouterRawPeer, SendsToAnIdleStreamAreWrittenByTheSender) {
  RawChild child;
  ASSERT_TRUE(child.attach());
  Router& router = child.router;
  RawPeer& peer = child.peer;
  const std::uint32_t n = child.id;
  const std::uint64_t before = router.stats().direct_writes;
  constexpr int kSends = 3;
  for (int i = 0; i < kSends; ++i) {
    // Idle: the broker has nothing queued for the peer, and the last direct
    // write is far more than kIdleForDirect ago. The peer stays silent.
    std::this_thread::sleep_for(5 * TxGate::kIdleForDirect + 2ms);
    router.send(Message{frame(n, 0, 0, kEcho, 0), Payload::copy_of("now and then " + std::to_string(i))});
  }
  for (int i = 0; i < kSends; ++i) {
    Message m;
    ASSERT_TRUE(peer.read_frame(m));
    EXPECT_EQ(m.text(), "now and then " + std::to_string(i));
  }
  EXPECT_EQ(router.stats().direct_writes - before, static_cast<std::uint64_t>(kSends))
      << "a send to an idle stream went through the broker's queue";
  EXPECT_TRUE(peer.goodbye()) << "the router did not answer EOF with EOF";
}

// A child link whose peer can no longer read (EPIPE on the next write) while
// the router still thinks it is open: shutting the router down writes SHUTDOWN
// to it, the write fails and closes the stream (freeing its Link) inside
// Router::on_shutdown_begin(). The router must survive that.
TEST(RouterRawPeer, ShutdownWithUnwritableChildLinkDoesNotCrash) {
  RawPeer peer;
  {
    Broker broker;
    Router router(broker, root_opts());
    std::uint32_t n = router.allocate_id();
    ASSERT_TRUE(attach_raw(router, peer, n));
    ASSERT_EQ(peer.handshake(), n);
    // Make sure the link is fully open on the router's side.
    peer.send_frame(frame(0, n, n, 4321, 77), "ping");
    Message d;
    ASSERT_TRUE(peer.read_frame(d));
    ASSERT_TRUE(d.is_dead());
    // The router's next write to this link fails with EPIPE; it sees no EOF.
    ASSERT_EQ(::shutdown(peer.fd, SHUT_RD), 0);
  }  // ~Router: shutdown sends SHUTDOWN to the child link
  SUCCEED();
}

TEST(RouterRawPeer, BadMagicClosesStream) {
  Broker broker;
  Router router(broker, root_opts());
  std::uint32_t n = router.allocate_id();
  std::promise<std::string> gone;
  router.on_disconnect(n, [&](const std::string& why) { gone.set_value(why); });
  RawPeer peer;
  ASSERT_TRUE(attach_raw(router, peer, n));
  ASSERT_EQ(peer.handshake(), n);
  Header h = frame(0, n, n, kEcho, 55);
  h.enc = 0xBEEF;
  peer.send_frame(h, "garbage");
  std::vector<Message> seen;
  EXPECT_TRUE(peer.wait_eof(&seen)) << "the router kept the stream open after a bad magic";
  for (const Message& m : seen) EXPECT_TRUE(m.is_dead()) << "unexpected frame: " << m.text();
  auto f = gone.get_future();
  ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << "on_disconnect did not fire";
  EXPECT_TRUE(contains(f.get(), reason::kPeerDisconnected));
}

TEST(RouterRawPeer, BadHelloMagicIsRefusedAndClosed) {
  Broker broker;
  Router router(broker, root_opts());
  std::uint32_t n = router.allocate_id();
  RawPeer peer;
  ASSERT_TRUE(attach_raw(router, peer, n));
  const char bad[kHelloSize] = {'N', 'O', 'P', 'E', 0, 1, 0, 0, 0, 0, 0, 1};
  peer.write_all(bad, sizeof bad);
  std::uint8_t head[6];
  ASSERT_EQ(peer.read_exact(head, sizeof head), 6);
  EXPECT_EQ(std::memcmp(head, "SPNO", 4), 0);
  std::size_t len = (std::size_t{head[4]} << 8) | head[5];
  std::string why(len, '\0');
  if (len) {
    ASSERT_EQ(peer.read_exact(why.data(), len), static_cast<long>(len));
  }
  std::uint8_t extra;
  EXPECT_EQ(peer.read_exact(&extra, 1), 0) << "stream not closed after refusing the hello";
}

// ------------------------------------------------------------ ADD_ROUTE / DEL_ROUTE

int grandchild_main(ChildEnv& env) {
  Router& r = env.router();
  add_echo(r, kGcEcho);
  r.add_handler([&r](Message&& m) {
    // Never replies; tells the root (two hops up) that the call arrived.
    r.send(Message::make(0, kRootArrived, Payload::copy_of(std::to_string(m.header.src_id))));
  }, {}, kGcHang);
  env.serve();
  return 0;
}

int middle_main(ChildEnv& env) {
  Router& r = env.router();
  Context gc = fork_child(r, grandchild_main, named("grandchild"));
  r.add_handler([&r, gc](Message&& m) {
    r.reply(m, Payload::copy_of(fmt::format("{} {}", gc.id(), gc.pid())));
  }, {}, kGetGrandchild);
  env.serve();
  gc.wait_exit(10s);
  return 0;
}

TEST(RouterRoutes, GrandchildReachableAndItsDeathPropagates) {
  Broker broker;
  Router router(broker, root_opts());
  std::promise<std::string> arrived;
  std::atomic<bool> arrived_set{false};
  router.add_handler([&](Message&& m) {
    if (!arrived_set.exchange(true)) arrived.set_value(m.text());
  }, {}, kRootArrived);

  Context middle = fork_child(router, middle_main, named("middle"));
  std::string info = middle.call(kGetGrandchild, std::string_view{}, 15s);
  std::uint32_t gc_id = 0;
  pid_t gc_pid = 0;
  ASSERT_EQ(std::sscanf(info.c_str(), "%u %d", &gc_id, &gc_pid), 2) << info;
  ASSERT_NE(gc_id, middle.id());
  ASSERT_GT(gc_pid, 0);

  // Routed through the middle child thanks to ADD_ROUTE.
  Context gc(router, gc_id, "grandchild");
  EXPECT_EQ(gc.call(kGcEcho, std::string_view("hello down there"), 15s), "hello down there");
  EXPECT_EQ(router.stats().routes, 2u);

  std::promise<std::string> watcher;
  router.on_disconnect(gc_id, [&](const std::string& why) { watcher.set_value(why); });
  auto pending = gc.call_async(kGcHang, {}, 30s);
  auto af = arrived.get_future();
  ASSERT_EQ(af.wait_for(15s), std::future_status::ready) << "grandchild never saw the call";
  EXPECT_EQ(af.get(), "0");

  auto t0 = Clock::now();
  ASSERT_EQ(::kill(gc_pid, SIGKILL), 0);
  ASSERT_EQ(pending.wait_for(10s), std::future_status::ready) << "pending call not failed";
  std::string what = expect_throw<ChannelError>([&] { pending.get(); });
  EXPECT_TRUE(contains(what, reason::kPeerDisconnected)) << what;
  EXPECT_LT(Clock::now() - t0, 5s);

  auto wf = watcher.get_future();
  ASSERT_EQ(wf.wait_for(10s), std::future_status::ready) << "on_disconnect watcher did not fire";
  EXPECT_TRUE(contains(wf.get(), reason::kPeerDisconnected));
  // DEL_ROUTE removed the route; the middle child's own route remains.
  EXPECT_EQ(router.stats().routes, 1u);
  EXPECT_EQ(middle.call(kGetGrandchild, std::string_view{}, 10s), info);

  middle.shutdown();
  expect_exit_code(middle, 0);
}

}  // namespace test_router
}  // namespace spindle
