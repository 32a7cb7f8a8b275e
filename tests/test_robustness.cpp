// Issue #11 §3 (clients check the server) and §4 (broker and pool
// robustness), in process: real sockets, real children, real fork().
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <future>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "broker/broker.h"
#include "broker/errors.h"
#include "broker/process.h"
#include "router/child.h"
#include "router/connect.h"
#include "router/router.h"
#include "router/unix_address.h"
#include "stream/memfd.h"
#include "stream/stream.h"
#include "tests/fds_test_util.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_robustness {

using namespace testutil;
using namespace std::chrono_literals;

// A listening UNIX socket that never accepts.
int listen_on(const UnixAddress& a, int backlog) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  socklen_t len = a.to_sockaddr(sa);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), len), 0) << errno_text(errno);
  EXPECT_EQ(::listen(fd, backlog), 0);
  return fd;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// §3: a socket in a directory others can write to may have been put there by
// anyone: connect() refuses it, and says why.
TEST(ConnectChecks, RefusesASocketInADirectoryOthersCanWrite) {
  TempDir dir;
  std::string open_dir = dir.path() + "/open";
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);
  auto addr = UnixAddress::parse(open_dir + "/router.sock");
  int l = listen_on(addr, 8);
  std::string why = error_of([&] { ::close(connect_unix(addr)); });
  EXPECT_NE(why.find("mode 0777"), std::string::npos) << why;
  // The same socket in a private directory is fine.
  ASSERT_EQ(::chmod(open_dir.c_str(), 0700), 0);
  EXPECT_EQ(error_of([&] { ::close(connect_unix(addr)); }), "no error");
  ::close(l);
}

// §3: the process listening must run as this user or as root.
TEST(ConnectChecks, RefusesARouterOfAnotherUid) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to listen as another uid";
  auto addr = UnixAddress::parse(fmt::format("@spindle-test-squat-{}", ::getpid()));
  int ready[2];
  ASSERT_EQ(::pipe2(ready, O_CLOEXEC), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    int l = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sa{};
    socklen_t len = addr.to_sockaddr(sa);
    if (::bind(l, reinterpret_cast<sockaddr*>(&sa), len) != 0 || ::listen(l, 8) != 0) ::_exit(4);
    char c = 'r';
    if (::write(ready[1], &c, 1) != 1) ::_exit(5);
    ::pause();
    ::_exit(0);
  }
  ::close(ready[1]);
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  std::string why = error_of([&] { ::close(connect_unix(addr)); });
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  EXPECT_NE(why.find("runs as uid 65534"), std::string::npos) << why;
}

// §3: connect() gives up at its timeout when the router does not accept.
TEST(ConnectChecks, TimesOutWhenTheRouterNeverAccepts) {
  auto addr = UnixAddress::parse(fmt::format("@spindle-test-stuck-{}", ::getpid()));
  int l = listen_on(addr, 0);
  std::vector<int> queued;
  std::string why;
  for (int i = 0; i < 8 && why.empty(); ++i) {
    try {
      queued.push_back(connect_unix(addr, 300ms));
    } catch (const Error& e) {
      why = e.what();
    }
  }
  for (int fd : queued) ::close(fd);
  ::close(l);
  EXPECT_NE(why.find("no answer within 300 ms"), std::string::npos) << why;
}

// A "router" on a UNIX socket in a private directory (mode 0700, ours) that
// accepts one connection, reads the client's hello and then sends `answer`
// (nothing at all, if empty) instead of a welcome. It keeps the connection
// open until the client closes it (or 20 s pass), so a client that waited
// for a welcome would wait for ever.
class SilentRouter {
 public:
  explicit SilentRouter(std::string answer) : answer_(std::move(answer)) {
    path_ = dir_.path() + "/router.sock";
    listen_fd_ = listen_on(UnixAddress::parse(path_), 8);
    thread_ = std::thread([this] { serve(); });
  }
  ~SilentRouter() {
    thread_.join();
    ::close(listen_fd_);
  }
  const std::string& path() const { return path_; }
  bool accepted() const { return accepted_.load(); }
  std::string hello() {
    std::lock_guard lk(mu_);
    return hello_;
  }

 private:
  void serve() {
    pollfd p{listen_fd_, POLLIN, 0};
    if (::poll(&p, 1, 20000) != 1) return;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    accepted_ = true;
    std::string got = read_some(fd, kHelloSize, 10s);
    {
      std::lock_guard lk(mu_);
      hello_ = got;
    }
    if (!answer_.empty()) (void)!::send(fd, answer_.data(), answer_.size(), MSG_NOSIGNAL);
    // Hold the connection until the client gives up on it.
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < until) {
      pollfd q{fd, POLLIN, 0};
      if (::poll(&q, 1, 100) <= 0) continue;
      char buf[256];
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) break;
    }
    ::close(fd);
  }

  TempDir dir_;
  std::string path_;
  std::string answer_;
  int listen_fd_ = -1;
  std::atomic<bool> accepted_{false};
  std::mutex mu_;
  std::string hello_;
  std::thread thread_;
};

// §3 "connect() takes a timeout, as the docs already say." The socket is
// accepted (so connect_unix's own timeout, checked above for a full backlog,
// does not apply) but no welcome ever comes: spindle::connect() gives up at
// its timeout and says so, rather than waiting on the handshake.
TEST(ConnectChecks, ConnectTimesOutWhenTheRouterAcceptsButNeverWelcomes) {
  SilentRouter silent("");
  struct stat st{};
  ASSERT_EQ(::stat(silent.path().substr(0, silent.path().rfind('/')).c_str(), &st), 0);
  ASSERT_EQ(st.st_mode & 07777, 0700u);
  ASSERT_EQ(st.st_uid, ::geteuid());
  const auto t0 = std::chrono::steady_clock::now();
  std::string why = error_of([&] { connect(silent.path(), RouterOptions{}, 300ms); });
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(silent.accepted()) << "the connection was never accepted: this tested connect_unix";
  EXPECT_EQ(silent.hello().substr(0, 4), "SPDL") << "the client sent no hello";
  EXPECT_LT(took, 10s) << "connect() waited far beyond its 300 ms timeout";
  EXPECT_GE(took, 250ms) << "connect() gave up before its timeout: " << why;
  EXPECT_NE(why.find("handshake timed out after 300 ms"), std::string::npos) << why;
  EXPECT_NE(why.find(silent.path()), std::string::npos) << "the error does not name the socket: " << why;
}

// §3: a peer that accepts and answers with something that is not a welcome
// (here an HTTP server's) is refused at once, with the reason.
TEST(ConnectChecks, ConnectRefusesAPeerThatAnswersWithGarbage) {
  SilentRouter garbage("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
  const auto t0 = std::chrono::steady_clock::now();
  std::string why = error_of([&] { connect(garbage.path(), RouterOptions{}, 5000ms); });
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(garbage.accepted());
  EXPECT_LT(took, 4s) << "the garbage was not refused as soon as it arrived: " << why;
  EXPECT_NE(why.find("not a Spindle server"), std::string::npos) << why;
  EXPECT_NE(why.find("48545450"), std::string::npos) << "the error does not show the bad magic: " << why;
}

// §4: ~Broker reaps the children it watches and cancels its timers.
TEST(BrokerEnd, DestructorReapsWatchedChildrenAndCancelsTimers) {
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::pause();
    ::_exit(0);
  }
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  ASSERT_GE(pidfd, 0) << errno_text(errno);
  std::atomic<bool> fired{false};
  // The timer's handler holds a token: once ~Broker has cancelled the timer,
  // the handler is destroyed with it, and only the test holds the token. A
  // timer left armed (or its handler leaked) would keep it.
  auto token = std::make_shared<int>(0);
  const std::weak_ptr<int> watched = token;
  {
    Broker::Options o;
    o.shutdown_grace = 200ms;
    Broker broker(o);
    broker.watch_child(std::make_shared<ChildProcess>(pid, pidfd), [](int) {});
    broker.call_later(1h, [&fired, t = std::move(token)] { fired = true; });
  }
  errno = 0;
  EXPECT_EQ(::waitpid(pid, nullptr, WNOHANG), -1) << "the child was left a zombie (or running)";
  EXPECT_EQ(errno, ECHILD);
  EXPECT_FALSE(fired.load());
  EXPECT_TRUE(watched.expired()) << "the pending timer's handler outlived the broker";
}

// §4: a handler that throws something that is not a std::exception gets its
// caller an error reply, and the stream it came on keeps flushing.
TEST(HandlerFailures, NonStdExceptionBecomesAnErrorReplyAndTheStreamGoesOn) {
  constexpr std::uint32_t kThrower = 2050;
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, [](ChildEnv& env) {
    int calls = 0;
    Router& r = env.router();
    r.add_handler(
        [&](Message&& m) {
          if (++calls % 2 == 1) throw 42;
          r.reply(m, Payload::copy_of("fine"));
        },
        {}, kThrower);
    env.serve();
    return 0;
  }, named("thrower"));
  for (int round = 0; round < 3; ++round) {
    std::string why;
    try {
      c.call(kThrower, "x", 10s);
    } catch (const CallError& e) {
      why = e.what();
    }
    EXPECT_NE(why.find("not a std::exception"), std::string::npos) << why;
    EXPECT_EQ(c.call(kThrower, "y", 10s), "fine");
  }
  c.shutdown();
  expect_exit_code(c, 0);
}

// A handler that throws spindle::CallError answers with that error's own type
// and message, not "spindle::CallError": that is how a handler passes on a
// failure it was told of, or names another language's exception.
TEST(HandlerFailures, AThrownCallErrorKeepsItsTypeAndMessage) {
  constexpr std::uint32_t kThrower = 2051;
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, [](ChildEnv& env) {
    env.router().add_handler(
        [](Message&&) -> void { throw CallError("KeyError", "'gone'"); }, {}, kThrower);
    env.serve();
    return 0;
  }, named("thrower"));
  try {
    c.call(kThrower, "x", 10s);
    ADD_FAILURE() << "no CallError";
  } catch (const CallError& e) {
    EXPECT_EQ(e.type(), "KeyError");
    EXPECT_EQ(e.message(), "'gone'");
  }
  c.shutdown();
  expect_exit_code(c, 0);
}

// §4: a context sending to itself from the broker thread, message after
// message, runs each handler from the queue, not nested inside the last.
TEST(HandlerFailures, SelfSendsFromTheBrokerThreadDoNotRecurse) {
  Broker broker;
  Router router(broker);
  constexpr std::uint32_t kSelf = 2051;
  constexpr int kHops = 200000;
  std::promise<int> done;
  std::atomic<int> max_depth{0};
  thread_local int depth = 0;
  router.add_handler(
      [&](Message&& m) {
        ++depth;
        max_depth = std::max(max_depth.load(), depth);
        int n = std::stoi(m.text());
        if (n == kHops) done.set_value(n);
        else router.send(Message::make(router.id(), kSelf, Payload::copy_of(std::to_string(n + 1))));
        --depth;
      },
      {}, kSelf);
  router.send(Message::make(router.id(), kSelf, Payload::copy_of("0")));
  auto f = done.get_future();
  ASSERT_EQ(f.wait_for(60s), std::future_status::ready);
  EXPECT_EQ(f.get(), kHops);
  EXPECT_EQ(max_depth.load(), 1);
}

// §4 "The batch depth is RAII: an exception escaping a handler must not
// leave a stream that never flushes again." dispatch_local() catches what a
// handler throws, but a handler's policy runs before that try: what a policy
// throws leaves the router, the stream's read batch (Stream::process_input)
// and the Asio handler, and reaches Broker::run(), which logs it and runs the
// loop again. Here one read brings three frames: a call whose reply is corked
// in the batch, a message whose policy throws, and a call behind it.
// Afterwards (a) the corked reply is flushed, the frame behind the throw and
// later frames from the same peer are answered; (b) nothing hangs (every read
// is bounded). With the batch depth a plain counter that the exception skips,
// nothing is ever flushed again ("before" never arrives). Before the fix in
// Stream::on_read/input_turn, the batch did end (Stream::Batch is RAII) but
// the stream never read again: "behind" and every later frame went unanswered.
TEST(HandlerFailures, APolicyThatThrowsMidBatchLeavesTheStreamFlushingAndReading) {
  constexpr std::uint32_t kEchoHandle = 2060, kPicky = 2061;
  Broker broker;
  Router router(broker, root_opts());
  router.add_handler([&](Message&& m) { router.reply(m, Payload::copy_of("ok:" + m.text())); }, {},
                     kEchoHandle);
  std::atomic<int> policy_calls{0};
  HandlerOptions picky;
  picky.policy = [&](const Message&) -> bool {
    if (policy_calls++ == 0) throw std::runtime_error("the policy threw");
    return true;
  };
  router.add_handler([&](Message&& m) { router.reply(m, Payload::copy_of("picky:" + m.text())); },
                     picky, kPicky);
  const std::uint32_t n = router.allocate_id();
  RawPeer peer;
  ASSERT_TRUE(attach_raw(router, peer, n));
  ASSERT_EQ(peer.handshake(), n);

  // One write, so one read and one batch on the router's side.
  peer.write_all(frame_bytes(frame(0, n, n, kEchoHandle, 101), "before") +
                 frame_bytes(frame(0, n, n, kPicky, 102), "boom") +
                 frame_bytes(frame(0, n, n, kEchoHandle, 103), "behind"));
  // 101, 102 and 103 are answered in order: 102 with a dead reply that says
  // its policy threw (before, it got no answer and its caller waited out its
  // timeout).
  Message r;
  ASSERT_TRUE(peer.read_frame_for(n, 101, r, 10s)) << "the reply corked in the batch was never flushed";
  EXPECT_EQ(r.text(), "ok:before");
  ASSERT_TRUE(peer.read_frame_for(n, 102, r, 10s)) << "the message whose policy threw was not answered";
  EXPECT_TRUE(r.is_dead());
  EXPECT_NE(r.text().find("refused by policy: the policy of handle 2061 threw"), std::string::npos)
      << r.text();
  EXPECT_NE(r.text().find("the policy threw"), std::string::npos) << r.text();
  ASSERT_TRUE(peer.read_frame_for(n, 103, r, 10s)) << "the frame behind the throw was never answered";
  EXPECT_EQ(r.text(), "ok:behind");
  EXPECT_EQ(policy_calls.load(), 1);

  // Later frames, in reads of their own: the stream still reads, and output
  // is still flushed (the policy now lets the message through).
  peer.send_frame(frame(0, n, n, kEchoHandle, 104), "later");
  ASSERT_TRUE(peer.read_frame_for(n, 104, r, 10s)) << "the stream stopped reading after the throw";
  EXPECT_EQ(r.text(), "ok:later");
  peer.send_frame(frame(0, n, n, kPicky, 105), "again");
  ASSERT_TRUE(peer.read_frame_for(n, 105, r, 10s));
  EXPECT_EQ(r.text(), "picky:again");
  // Output that does not come from this peer's batches is flushed too.
  router.send(Message::make(n, 4242, Payload::copy_of("from the router")));
  ASSERT_TRUE(peer.read_frame_for(n, 4242, r, 10s));
  EXPECT_EQ(r.text(), "from the router");
  EXPECT_TRUE(peer.goodbye()) << "the router did not answer EOF with EOF";
}

// §4: a memfd body too large for the frame's 32-bit length field, for a peer
// that cannot take fds (so it would go inline): refused with the reason, not
// sent with a wrapped length.
TEST(HandlerFailures, BodyOverTheLengthFieldIsRefusedNotWrapped) {
  Broker broker;
  Router router(broker, root_opts());
  Context echo = spawn_echo_on_pipes(router, "pipes");
  UniqueFd fd(::memfd_create("huge", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_GE(fd.get(), 0);
  ASSERT_EQ(::ftruncate(fd.get(), off_t{5} << 30), 0);  // sparse: costs nothing
  ASSERT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE), 0);
  std::string error;
  Message m = Message::make(echo.id(), 3000, {});
  m.sealed_body = SealedMemfd::adopt(std::move(fd), error);
  ASSERT_TRUE(m.sealed_body) << error;
  std::string why;
  try {
    router.request(std::move(m), 20s).get();
  } catch (const Error& e) {
    why = e.what();
  }
  EXPECT_NE(why.find("message too large"), std::string::npos) << why;
  EXPECT_EQ(echo.call(3000, "still there?", 20s), "still there?");
}

// §4: a Stream whose constructor throws (here: one of its fds is unusable)
// closes the fds it was given, both of them, whichever one was bad. The
// good end is a socket: once it is closed, its peer's send fails with EPIPE.
TEST(StreamCreate, ClosesBothFdsWhenTheConstructorThrows) {
  Broker broker;
  constexpr int kUnusable = INT_MAX;  // never an open fd: fcntl says EBADF
  for (bool bad_is_write : {true, false}) {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    const int read_fd = bad_is_write ? sv[0] : kUnusable;
    const int write_fd = bad_is_write ? kUnusable : sv[0];
    EXPECT_THROW(Stream::create(broker, read_fd, write_fd, StreamOptions{}, nullptr, nullptr),
                 std::system_error);
    char byte = 'x';
    errno = 0;
    EXPECT_EQ(::send(sv[1], &byte, 1, MSG_NOSIGNAL), -1)
        << "the good fd (the " << (bad_is_write ? "read" : "write") << " end) was left open";
    EXPECT_EQ(errno, EPIPE);
    ::close(sv[1]);
  }
}

// A stream that ends tells its peer at once, even when another process holds
// a copy of its socket: one forked while the link was open (an os.fork() or
// multiprocessing child of a Python program keeps its parent's Spindle
// objects abandoned, fds and all). A plain close() released only this
// process's copy, so a peer waiting for the end (a child stopping, its
// goodbye sent) heard nothing until its grace ran out: Router.close() in
// bench_py took 5 s in about one run in six.
TEST(StreamEnd, ThePeerHearsTheEndWhileAForkedProcessHoldsACopyOfTheSocket) {
  Recorder rec;
  StreamHarness h;
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  Stream* s = h.make(sv[0], sv[0], &rec);
  int go[2];
  ASSERT_EQ(::pipe2(go, O_CLOEXEC), 0);
  pid_t holder = ::fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {  // keeps its copies of both ends until the test lets it go
    ::close(go[1]);
    char c;
    ssize_t r = ::read(go[0], &c, 1);
    ::_exit(r < 0 ? 1 : 0);
  }
  ::close(go[0]);
  h.on([&] { s->close("the test ends the link"); });
  EXPECT_TRUE(closed_by_peer(sv[1], 3s)) << "no EOF while the forked process held a copy of the stream's socket";
  ::close(go[1]);
  int st = 0;
  EXPECT_EQ(::waitpid(holder, &st, 0), holder);
  ::close(sv[1]);
}

// The process at the other end has exited, but no EOF comes (here the test
// holds the peer's end, as a process the peer forked would): what it wrote
// before is still delivered, in order, and then the stream ends with the
// reason it was given, at once when nothing is left to read.
TEST(StreamEnd, APeerThatExitedIsReadToTheEndThenClosedWithTheReason) {
  Recorder with_input, without;
  StreamHarness h;
  FdPair a = make_socketpair(), b = make_socketpair();
  Stream* sa = h.make(a.a, a.a, &with_input);
  Stream* sb = h.make(b.a, b.a, &without);
  h.on([&] {  // on the loop: the stream cannot read between the writes and the news
    for (int i = 0; i < 3; ++i) {
      auto bytes = frame_bytes(static_cast<std::uint32_t>(1000 + i), "before exit " + std::to_string(i));
      ASSERT_EQ(::write(a.b, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    }
    sa->peer_exited("the peer's process ended");
    sb->peer_exited("the peer's process ended too");
  });
  ASSERT_TRUE(with_input.wait_closed());
  EXPECT_EQ(with_input.close_reason(), "the peer's process ended");
  ASSERT_EQ(with_input.message_count(), 3u) << "what the peer wrote before it exited was lost";
  for (int i = 0; i < 3; ++i) EXPECT_EQ(with_input.messages[static_cast<std::size_t>(i)].text(), "before exit " + std::to_string(i));
  ASSERT_TRUE(without.wait_closed());
  EXPECT_EQ(without.close_reason(), "the peer's process ended too");
  ::close(a.b);
  ::close(b.b);
}

}  // namespace test_robustness
}  // namespace spindle
