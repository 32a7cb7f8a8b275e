// The listener in this process: both dialects on one socket, client-to-client
// routing, disconnects, admission (uid, max-clients) and a client that says
// nothing. Clients are real Connections (own broker and router each) and raw
// sockets that speak bytes by hand.
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/reasons.h"
#include "stream/byte_order.h"
#include "spindle/frame.h"
#include "stream/listener_handshake.h"
#include "tests/listener_test_util.h"
#include "tests/raw_peer.h"
#include "tests/router_probe.h"

namespace spindle {
namespace test_listener {

using namespace testutil;
using namespace std::chrono_literals;

constexpr std::uint32_t kEcho = 2000;
constexpr std::uint32_t kNeverReply = 2001;

void serve_echo(Router& r) {
  r.add_handler(
      [&r](Message&& m) { r.reply(m, Payload::copy_of("echo:" + m.text())); }, {}, kEcho);
}

TEST(Listener, SpindleClientsGetIdsAndCallEachOtherById) {
  InProcessRouter r;
  auto a = r.client(serve_echo);
  auto b = r.client();
  EXPECT_NE(a->id(), 0u);
  EXPECT_NE(a->id(), b->id());
  EXPECT_EQ(b->router().parent_id(), std::optional<std::uint32_t>(0));
  EXPECT_EQ(b->context(a->id()).call(kEcho, "hi", 10s), "echo:hi");
  EXPECT_EQ(r.router().client_count(), 2u);
}

// The router remembers where each link's last frame went (Link::last_route):
// once that destination has gone, the same link's next frame to it finds no
// route, instead of the link the router freed. The sender is a raw peer: a
// Connection would itself refuse to call a context it was told had gone.
TEST(Listener, AFrameToADestinationThatLeftAfterTheLastOneFindsNoRoute) {
  constexpr std::uint32_t kReplyTo = 7000;
  InProcessRouter r;
  auto a = r.client(serve_echo);
  RawPeer raw = RawPeer::connect_to(r.address());
  const std::uint32_t self = raw.handshake();
  const std::uint32_t gone = a->id();
  Message m;
  for (int i = 0; i < 3; ++i) {
    raw.send_frame(frame(gone, self, self, kEcho, kReplyTo), "hi");
    ASSERT_TRUE(raw.read_frame_for(self, kReplyTo, m));
    EXPECT_EQ(m.text(), "echo:hi");
  }
  a->close();
  ASSERT_TRUE(eventually([&] { return r.router().client_count() == 1u; }));
  raw.send_frame(frame(gone, self, self, kEcho, kReplyTo), "again");
  ASSERT_TRUE(raw.read_frame_for(self, kReplyTo, m));
  EXPECT_TRUE(m.header.is_dead());
  EXPECT_TRUE(contains(m.text(), reason::kNoRoute)) << m.text();
  auto c = r.client(serve_echo);  // and its frames to another context go there
  raw.send_frame(frame(c->id(), self, self, kEcho, kReplyTo), "new");
  ASSERT_TRUE(raw.read_frame_for(self, kReplyTo, m));
  EXPECT_EQ(m.text(), "echo:new");
}

// The router's welcome says how large a body it takes; a client with a
// larger maximum of its own refuses a larger send itself, with the reason,
// and keeps its link. (Sent, the frame would be a protocol error at the
// router, which closes the link and fails everything else on it.)
TEST(Listener, AClientRefusesABodyLargerThanTheRouterTakesAndKeepsItsLink) {
  constexpr std::uint32_t kRouterMax = 64 * 1024;
  RouterOptions ro = root_opts("router");
  ro.max_message_size = kRouterMax;
  InProcessRouter r({}, ro);
  auto a = r.client(serve_echo);
  auto b = r.client();  // its own maximum: the default, far larger
  const std::string big(kRouterMax + 1, 'x');
  std::string what = expect_throw<Error>([&] { b->context(a->id()).call(kEcho, big, 10s); });
  EXPECT_TRUE(what.starts_with(reason::kTooLarge)) << what;
  EXPECT_TRUE(what.find(std::to_string(kRouterMax)) != std::string::npos) << what;
  what = expect_throw<Error>([&] { b->router().send(a->id(), kEcho, std::span<const std::uint8_t>(
                                       reinterpret_cast<const std::uint8_t*>(big.data()), big.size())); });
  EXPECT_TRUE(what.starts_with(reason::kTooLarge)) << what;
  // The link is whole: the next call goes through, and so does one at the limit.
  EXPECT_EQ(b->context(a->id()).call(kEcho, "still here", 10s), "echo:still here");
  const std::string at_limit(kRouterMax - 5, 'y');  // "echo:" makes the reply exactly the limit
  EXPECT_EQ(b->context(a->id()).call(kEcho, at_limit, 10s).size(), kRouterMax);
  EXPECT_EQ(r.router().client_count(), 2u);
}

// A client announces its own maximum in its hello, so the router sends it
// nothing larger: another client's larger call gets a dead reply that says
// so, and a reply too large for its caller fails that call at once. Before,
// the router forwarded both, and the small client closed its link over the
// protocol error: any client could cut another off.
TEST(Listener, TheRouterSendsAClientNothingLargerThanItsHelloAnnounced) {
  constexpr std::uint32_t kSmallMax = 64 * 1024;
  InProcessRouter r;
  RouterOptions small;
  small.max_message_size = kSmallMax;
  auto a = r.client(serve_echo, small);
  auto b = r.client(serve_echo);  // the default maximum, far larger
  const std::string big(kSmallMax + 1, 'x');
  std::string what = expect_throw<ChannelError>([&] { b->context(a->id()).call(kEcho, big, 10s); });
  EXPECT_TRUE(what.starts_with(reason::kTooLarge)) << what;
  EXPECT_TRUE(contains(what, std::to_string(kSmallMax))) << what;
  EXPECT_TRUE(contains(what, "towards context " + std::to_string(a->id()))) << what;
  // b's reply ("echo:" + body) outgrows a's limit although a's call fits it.
  const std::string fits(kSmallMax - 2, 'y');
  const auto t0 = std::chrono::steady_clock::now();
  what = expect_throw<ChannelError>([&] { a->context(b->id()).call(kEcho, fits, 60s); });
  EXPECT_TRUE(what.starts_with(reason::kTooLarge)) << what;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s) << "the call waited for its deadline";
  // a kept its link: it is called and calls as before, up to its limit.
  EXPECT_EQ(b->context(a->id()).call(kEcho, "still here", 10s), "echo:still here");
  EXPECT_EQ(a->context(b->id()).call(kEcho, std::string(kSmallMax - 5, 'z'), 10s).size(), kSmallMax);
  EXPECT_EQ(r.router().client_count(), 2u);
}

TEST(Listener, ClientThatLeavesFailsPendingCallsAtOnceAndFiresWatchers) {
  InProcessRouter r;
  std::promise<void> arrived;
  auto a = r.client([&](Router& ar) {
    ar.add_handler([&](Message&&) { arrived.set_value(); }, {}, kNeverReply);
  });
  auto b = r.client();
  std::promise<std::string> watched;
  b->router().on_disconnect(a->id(), [&](const std::string& why) { watched.set_value(why); });
  auto pending = b->context(a->id()).call_async(kNeverReply, {}, 600s);
  ASSERT_EQ(arrived.get_future().wait_for(20s), std::future_status::ready);
  a->close();
  // "At once": long before the call's own 600 s deadline (the guard is a hang guard).
  ASSERT_EQ(pending.wait_for(30s), std::future_status::ready);
  try {
    pending.get();
    FAIL() << "the call to a client that left succeeded";
  } catch (const ChannelError& e) {
    EXPECT_TRUE(contains(e.what(), reason::kPeerDisconnected)) << e.what();
  }
  auto w = watched.get_future();
  ASSERT_EQ(w.wait_for(30s), std::future_status::ready);
  EXPECT_TRUE(contains(w.get(), reason::kPeerDisconnected));
}

TEST(Listener, UnidirectionalRouterKeepsClientsApartButServesThem) {
  RouterOptions ro = root_opts("router");
  ro.unidirectional = true;
  InProcessRouter r({}, ro);
  auto a = r.client(serve_echo);
  auto b = r.client();
  try {
    b->context(a->id()).call(kEcho, "sibling", 10s);
    FAIL() << "a client reached another client through a unidirectional router";
  } catch (const ChannelError& e) {
    EXPECT_TRUE(contains(e.what(), reason::kUnidirectional)) << e.what();
  }
  // The router itself is still reachable (its root ALLOCATE_ID handler answers).
  EXPECT_FALSE(b->router_context().call(kHandleAllocateId, "", 10s).empty());
}

TEST(Listener, SilentClientStallsNobodyAndIsDroppedAtTheTimeout) {
  RouterOptions ro = root_opts("router");
  ro.handshake_timeout = 1500ms;
  InProcessRouter r({}, ro);
  int silent = r.raw_connect();
  auto server = r.client(serve_echo);
  std::vector<std::unique_ptr<Connection>> others;
  for (int i = 0; i < 8; ++i) {
    others.push_back(r.client());
    EXPECT_EQ(others.back()->context(server->id()).call(kEcho, std::to_string(i), 10s),
              "echo:" + std::to_string(i));
  }
  EXPECT_TRUE(closed_by_peer(silent, 30s)) << "the silent client was never dropped";
  ::close(silent);
  // The socket closes a moment before the router forgets the client.
  for (int i = 0; i < 500 && r.router().client_stats().size() != 9; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(r.router().client_stats().size(), 9u);
}

TEST(Listener, MitogenClientHandshakeRoutingAndAuthority) {
  InProcessRouter r;
  std::promise<Header> seen;
  auto a = r.client([&](Router& ar) {
    ar.add_handler(
        [&](Message&& m) {
          seen.set_value(m.header);
          ar.reply(m, Payload::copy_of("pong"), kEncMitogen);
        },
        {}, kEcho);
  });
  RawPeer peer = RawPeer::connect_to(r.address());
  std::uint32_t listener_id = 99, listener_pid = 0;
  std::uint32_t id = peer.mitogen_handshake(4242, &listener_id, &listener_pid);
  EXPECT_NE(id, 0u);
  EXPECT_EQ(listener_id, 0u);
  EXPECT_EQ(listener_pid, static_cast<std::uint32_t>(::getpid()));
  Header h{kEncMitogen, a->id(), id, id, kEcho, 1234, 0};
  peer.send_frame(h, "ping");
  auto f = seen.get_future();
  ASSERT_EQ(f.wait_for(20s), std::future_status::ready);
  Header got = f.get();
  EXPECT_EQ(got.src_id, id);
  EXPECT_EQ(got.auth_id, id) << "each client's messages carry its own auth_id";
  Message reply;
  ASSERT_TRUE(peer.read_frame(reply));
  EXPECT_EQ(reply.header.enc, kEncMitogen);
  EXPECT_EQ(reply.header.dst_id, id);
  EXPECT_EQ(reply.header.src_id, a->id());
  EXPECT_EQ(reply.header.handle, 1234u);
  EXPECT_EQ(reply.text(), "pong");
}

TEST(Listener, SpindleEncodingIsNeverWrittenToAMitogenPeer) {
  InProcessRouter r;
  auto b = r.client();
  RawPeer peer = RawPeer::connect_to(r.address());
  std::uint32_t id = peer.mitogen_handshake(4243);
  try {
    b->context(id).call(kEcho, "spindle bytes", 20s);  // enc SR
    FAIL() << "an SR frame was accepted for a Mitogen peer";
  } catch (const ChannelError& e) {
    EXPECT_TRUE(contains(e.what(), reason::kUndecodable)) << e.what();
  }
  // The next frame the peer reads is the MI one sent after: the SR one never came.
  b->router().send(Message::make(id, 1500, Payload::copy_of("readable"), kEncMitogen));
  Message m;
  ASSERT_TRUE(peer.read_frame(m));
  EXPECT_EQ(m.header.enc, kEncMitogen);
  EXPECT_EQ(m.header.handle, 1500u);
  EXPECT_EQ(m.text(), "readable");
}

TEST(Listener, AFirstByteOfNeitherDialectIsRefusedAtOnce) {
  InProcessRouter r;
  int fd = r.raw_connect();
  ASSERT_EQ(::write(fd, "X", 1), 1);
  std::string got = read_some(fd, 4, 10s);
  EXPECT_EQ(got, "SPNO");
  EXPECT_TRUE(closed_by_peer(fd, 10s));
  ::close(fd);
}

TEST(Listener, MaxClientsRefusesWithTheReason) {
  ListenerOptions lo;
  lo.max_clients = 1;
  InProcessRouter r(lo);
  auto a = r.client();
  try {
    r.client();
    FAIL() << "a second client was admitted past max-clients 1";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "router full")) << e.what();
  }
  EXPECT_EQ(r.listener().stats().refused_full, 1u);
  a->close();
  // The slot is free again once the router has seen A leave.
  for (int i = 0; i < 200 && r.router().client_count() != 0; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_NO_THROW(r.client());
}

// With two uids allowed, max-clients 8 gives each a share of 4. One uid
// may go past its share while the router has room (6 = three quarters),
// then it is refused with the reason, and the room left is the other uid's
// (checked as uid 65534 when the test runs as root). A departure gives the
// first uid its room back.
TEST(Listener, OneUidCannotTakeTheRoomLeftForTheOthers) {
  ListenerOptions lo;
  lo.max_clients = 8;
  lo.allowed_uids = {::geteuid(), 65534, ::geteuid()};  // a repeated uid counts once
  lo.address = UnixAddress::parse(fmt::format("@spindle-test-share-{}", ::getpid()));
  InProcessRouter r(lo);
  std::vector<std::unique_ptr<Connection>> mine;
  for (int i = 0; i < 6; ++i) ASSERT_NO_THROW(mine.push_back(r.client())) << "client " << i;
  try {
    r.client();
    FAIL() << "a seventh client of one uid took the room left for the other";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), fmt::format("router full for uid {}: it has 6 of 6 clients", ::geteuid())))
        << e.what();
    EXPECT_TRUE(contains(e.what(), "its share of max-clients 8 among 2 uids is 4")) << e.what();
  }
  EXPECT_EQ(r.listener().stats().refused_full, 1u);
  if (::geteuid() == 0) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
      try {
        RawPeer peer = RawPeer::connect_to(lo.address);
        peer.handshake();
        ::_exit(peer.goodbye() ? 0 : 11);
      } catch (...) {
        ::_exit(12);
      }
    }
    int st = 0;
    ASSERT_EQ(::waitpid(pid, &st, 0), pid);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "the other uid was refused: " << describe_wait_status(st);
  }
  mine.back()->close();
  mine.pop_back();
  for (int i = 0; i < 500 && r.router().client_count() > 5; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_NO_THROW(mine.push_back(r.client()));
}

// A same-uid process that connects and goes in a loop (each handshake
// completes: a client's arrival and departure) costs a bounded number of
// log lines, not two per connection.
TEST(Listener, ClientsThatComeAndGoInALoopAreLoggedInSummary) {
  constexpr int kConnections = 600;
  ScopedLogCapture capture;
  CaptureSink* sink = &capture.sink();
  InProcessRouter r;
  for (int i = 0; i < kConnections; ++i) {
    RawPeer peer = RawPeer::connect_to(r.address());
    peer.handshake();
    ASSERT_TRUE(peer.goodbye());
  }
  for (int i = 0; i < 1000 && r.router().client_count() != 0; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(r.router().client_count(), 0u);
  const auto arrived = sink->lines_with(" connected (");
  const auto left = sink->lines_with(" disconnected: ");
  std::printf("%d connections: %zu arrival and %zu departure lines\n", kConnections, arrived.size(), left.size());
  // Up to Router::kClientLinesPerSecond of each a second, one after.
  EXPECT_GE(arrived.size(), 1u);
  EXPECT_LT(arrived.size() + left.size(), static_cast<std::size_t>(kConnections));
  bool summed = false;
  for (const auto& l : arrived) summed |= l.find("such in the last second") != std::string::npos;
  for (const auto& l : left) summed |= l.find("such in the last second") != std::string::npos;
  EXPECT_TRUE(summed || arrived.size() + left.size() <= 4 * Router::kClientLinesPerSecond);
}

TEST(Listener, AnotherUidIsRefusedAndLoggedInSummary) {
  constexpr int kRefusedConnections = 200;
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  ScopedLogCapture capture;
  CaptureSink* sink = &capture.sink();
  ListenerOptions lo;
  lo.address = UnixAddress::parse(fmt::format("@spindle-test-uid-{}", ::getpid()));
  InProcessRouter r(lo);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
    try {
      // As often as it likes: any local user can reach an abstract address.
      for (int i = 0; i < kRefusedConnections; ++i) {
        int fd = connect_unix(lo.address);
        if (!closed_by_peer(fd, 10s)) ::_exit(11);
        ::close(fd);
      }
      ::_exit(0);
    } catch (...) {
      ::_exit(12);
    }
  }
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << describe_wait_status(st);
  std::string line;
  spdlog::level::level_enum level;
  EXPECT_TRUE(sink->wait_for_line(fmt::format("refused client pid={} uid=65534", pid), 10s, &line,
                                  &level));
  EXPECT_EQ(r.listener().stats().refused_uid, static_cast<std::uint64_t>(kRefusedConnections));
  // Each refused, and logged in summary: not a line per connection.
  const auto lines = sink->lines_with("refused client");
  std::printf("%d refused connections: %zu log lines\n", kRefusedConnections, lines.size());
  EXPECT_LT(lines.size(), 20u);
}

TEST(Listener, AbstractAddressLeavesNoFile) {
  ListenerOptions lo;
  lo.address = UnixAddress::parse(fmt::format("@spindle-test-abstract-{}", ::getpid()));
  InProcessRouter r(lo);
  auto a = r.client(serve_echo);
  auto b = r.client();
  EXPECT_EQ(b->context(a->id()).call(kEcho, "abs", 10s), "echo:abs");
  EXPECT_TRUE(std::filesystem::is_empty(r.dir()));
}

TEST(Listener, StaleSocketIsReplacedLiveOneAndOtherFilesAreErrors) {
  TempDir dir;
  UnixAddress addr{dir.path() + "/router.sock", false};
  {  // a socket file nobody listens on
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    socklen_t len = addr.to_sockaddr(sa);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), len), 0);
    ::close(fd);
  }
  ListenerOptions lo;
  lo.address = addr;
  InProcessRouter live(lo);
  struct stat st {};
  ASSERT_EQ(::stat(addr.name.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "the socket file is private from the start";
  try {
    InProcessRouter second(lo);
    FAIL() << "a second listener took over a live socket";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "another process is listening")) << e.what();
  }
  ListenerOptions lf;
  lf.address = UnixAddress{dir.path() + "/plain-file", false};
  std::FILE* f = std::fopen(lf.address.name.c_str(), "w");
  std::fclose(f);
  try {
    InProcessRouter third(lf);
    FAIL() << "a regular file was replaced";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "is not a socket")) << e.what();
  }
}

TEST(Listener, OutOfFdsRefusesNewClientsPromptlyAndExistingOnesKeepWorking) {
  InProcessRouter r;
  auto server = r.client(serve_echo);
  auto existing = r.client();
  constexpr int kTries = 8;
  std::vector<int> socks;
  for (int i = 0; i < kTries; ++i) socks.push_back(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = count_open_fds() + 1;  // room for one accepted client
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  sockaddr_un sa{};
  socklen_t len = r.address().to_sockaddr(sa);
  for (int s : socks) ASSERT_EQ(::connect(s, reinterpret_cast<sockaddr*>(&sa), len), 0);
  int refused = 0;
  for (int s : socks) refused += closed_by_peer(s, 2s) ? 1 : 0;
  // Each client was either taken into a handshake (while fds lasted) or
  // refused: none was left hanging in the backlog.
  const int accepted = static_cast<int>(r.router().client_count()) - 2;
  EXPECT_GE(refused, 1);
  EXPECT_EQ(accepted + refused, kTries) << accepted << " accepted, " << refused << " refused";
  EXPECT_EQ(existing->context(server->id()).call(kEcho, "still here", 10s), "echo:still here");
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  for (int s : socks) ::close(s);
  EXPECT_GE(r.listener().stats().refused_no_fds, static_cast<std::uint64_t>(refused));
  auto after = r.client();  // accepting again once fds are free
  EXPECT_EQ(after->context(server->id()).call(kEcho, "again", 10s), "echo:again");
}

}  // namespace test_listener
}  // namespace spindle

namespace spindle {
namespace test_listener {
using namespace testutil;
using namespace std::chrono_literals;

// A Connection dropped inside one of its own handlers (on its broker thread)
// must neither throw nor join itself: its destructor begins the shutdown and
// another thread frees it once the broker has stopped. Under ASan this also
// checks that nothing touches the freed Router after the handler returns.
TEST(Listener, ConnectionDroppedInsideItsOwnHandlerGoesAwayCleanly) {
  InProcessRouter r;
  std::unique_ptr<Connection> a;
  std::promise<void> dropped;
  a = r.client([&](Router& ar) {
    ar.add_handler([&](Message&&) {
      a.reset();
      dropped.set_value();
    }, {}, kNeverReply);
  });
  auto b = r.client();
  std::promise<std::string> gone;
  const std::uint32_t a_id = a->id();
  b->router().on_disconnect(a_id, [&](const std::string& why) { gone.set_value(why); });
  b->context(a_id).send(kNeverReply, std::string_view("drop yourself"));
  ASSERT_EQ(dropped.get_future().wait_for(10s), std::future_status::ready);
  auto why = gone.get_future();
  ASSERT_EQ(why.wait_for(10s), std::future_status::ready);
  EXPECT_THROW(b->context(a_id).call(kEcho, "x", 5s), ChannelError);
}

}  // namespace test_listener
}  // namespace spindle
