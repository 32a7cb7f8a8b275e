// RPC to real children: forked with fork_child(), or started with
// spawn_child() from tests/helpers/spawned_echo.cpp.
//
// Children report through replies, log lines or their exit status; no gtest
// macro runs inside a forked child.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <future>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "router/child.h"
#include "router/reasons.h"
#include "router/router.h"
#include "tests/router_test_util.h"
#include "tests/stream_test_util.h"

namespace spindle {
namespace test_rpc {

using namespace testutil;

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kEcho = 3000;
constexpr std::uint32_t kThrow = 3001;
constexpr std::uint32_t kNeverReply = 3002;
constexpr std::uint32_t kHangAndNotify = 3003;
constexpr std::uint32_t kParentArrived = 4000;
constexpr std::uint32_t kSpawnedOpenFiles = 3005;  // tests/helpers/spawned_echo.cpp

// Deterministic bytes that differ per size and seed.
std::string pattern(std::size_t n, std::uint32_t seed) {
  std::string s(n, '\0');
  std::uint32_t x = seed * 2654435761u + static_cast<std::uint32_t>(n) + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

// The call behind `f` must end, within 10 s, in a TimeoutError.
void expect_timed_out(std::future<Message>& f) {
  ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << "the call never completed";
  try {
    f.get();
    ADD_FAILURE() << "no exception";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(contains(e.what(), errtext::kCallTimedOut)) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception: " << e.what();
  }
}

int service_child(ChildEnv& env) {
  Router& r = env.router();
  r.add_handler([&r](Message&& m) { r.reply(m, m.data); }, {}, kEcho);
  r.add_handler([](Message&& m) -> void {
    throw std::runtime_error("boom: bad input " + m.text());
  }, {}, kThrow);
  r.add_handler([](Message&&) { /* never replies */ }, {}, kNeverReply);
  r.add_handler([&r](Message&&) {
    // Never replies: tells the parent the call is in progress instead.
    r.send(Message::make(*r.parent_id(), kParentArrived, Payload::copy_of(std::to_string(::getpid()))));
  }, {}, kHangAndNotify);
  env.serve();
  return 0;
}

// ------------------------------------------------------------ forked RPC

TEST(RpcFork, RoundTripPayloadSizes) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, service_child, named("echo"));
  for (std::size_t size : {std::size_t{0}, std::size_t{64}, std::size_t{200} * 1024,
                           std::size_t{8} * 1024 * 1024}) {
    SCOPED_TRACE(fmt::format("payload of {} bytes", size));
    std::string sent = pattern(size, 1);
    Payload got = c.call(kEcho, Payload::copy_of(sent), 30s);
    ASSERT_EQ(got.size(), size);
    EXPECT_TRUE(got.to_string() == sent) << "content differs";
  }
  c.shutdown();
  expect_exit_code(c, 0);
}

TEST(RpcFork, CallAsyncToFourChildrenConcurrently) {
  Broker broker;
  Router router(broker, root_opts());
  std::vector<Context> children;
  for (int i = 0; i < 4; ++i) children.push_back(fork_child(router, service_child, named(fmt::format("worker-{}", i))));
  std::vector<std::string> sent;
  std::vector<std::future<Message>> futs;
  for (std::size_t i = 0; i < children.size(); ++i) {
    sent.push_back(fmt::format("to {}:", children[i].id()) + pattern(100 * 1024 + i, static_cast<std::uint32_t>(i)));
    futs.push_back(children[i].call_async(kEcho, Payload::copy_of(sent[i]), 30s));
  }
  for (std::size_t i = 0; i < futs.size(); ++i) {
    ASSERT_EQ(futs[i].wait_for(30s), std::future_status::ready) << "child " << i;
    Message m = futs[i].get();
    EXPECT_EQ(m.header.src_id, children[i].id());
    EXPECT_TRUE(m.text() == sent[i]) << "child " << i << " content differs";
  }
  for (auto& c : children) c.shutdown();
  for (auto& c : children) expect_exit_code(c, 0);
}

TEST(RpcFork, RemoteExceptionArrivesAsCallError) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, service_child, named("thrower"));
  try {
    c.call(kThrow, std::string_view("42"), 10s);
    ADD_FAILURE() << "no exception";
  } catch (const CallError& e) {
    EXPECT_TRUE(contains(e.type(), "runtime_error")) << e.type();
    EXPECT_EQ(e.message(), "boom: bad input 42");
    EXPECT_EQ(std::string(e.what()), e.type() + ": " + e.message());
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception: " << e.what();
  }
  // The child survives its handler's exception.
  EXPECT_EQ(c.call(kEcho, std::string_view("still here"), 10s), "still here");
  c.shutdown();
  expect_exit_code(c, 0);
}

TEST(RpcFork, HandlerThatNeverRepliesTimesOut) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, service_child, named("silent"));
  ASSERT_EQ(c.call(kEcho, std::string_view("up"), 10s), "up");
  auto t0 = Clock::now();
  try {
    c.call(kNeverReply, std::string_view("hello?"), 200ms);
    ADD_FAILURE() << "no exception";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(contains(e.what(), errtext::kCallTimedOut)) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception: " << e.what();
  }
  auto elapsed = Clock::now() - t0;
  EXPECT_GE(elapsed, 190ms);
  EXPECT_LT(elapsed, 5s);
  // The pending-call handler is gone (only ALLOCATE_ID remains) and the child still works.
  EXPECT_EQ(router.stats().handlers, 1u);
  EXPECT_EQ(c.call(kEcho, std::string_view("after"), 10s), "after");
  c.shutdown();
  expect_exit_code(c, 0);
}

// An asynchronous call made from a thread of the application is written by
// that thread when the stream is idle, as a blocking one is, and its deadline
// is left for the broker to arm at its next turn: the broker is not woken for
// it, unless the deadline is earlier than its timer's. So 200 calls, one at a
// time, post one wake-up (the first arms the timer), where each used to post
// its own (through the outbox). A deadline earlier than the timer's still
// wakes it (300 ms after 30 s), and one just later (600 ms) is armed when
// that timer fires: both calls time out.
TEST(RpcFork, AsyncCallsFromAThreadWakeTheBrokerOnlyForAnEarlierDeadline) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, service_child, named("async"));
  ASSERT_EQ(c.call(kEcho, std::string_view("up"), 10s), "up");

  const auto before = broker.stats();
  const auto direct_before = router.stats().direct_writes;
  for (int i = 0; i < 200; ++i) {
    std::string text = fmt::format("call {}", i);
    std::future<Message> f = c.call_async(kEcho, Payload::copy_of(text), 30s);
    ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << text;
    ASSERT_EQ(f.get().text(), text);
  }
  const auto wakes = broker.stats().wakeups_posted - before.wakeups_posted;
  // A call that found the stream busy (the broker still in the turn that
  // read the previous reply, which a loaded machine makes likelier) was
  // queued, and its queue's wake-up is not the deadline's: those are
  // allowed for. Most calls are written directly, so a wake-up per
  // deadline would still be over the bound.
  const auto direct = router.stats().direct_writes - direct_before;
  ASSERT_LE(direct, 200u);
  EXPECT_GE(direct, 100u) << "most calls should find the stream idle";
  EXPECT_LE(wakes, 10u + (200u - direct)) << "the broker was woken for the calls' deadlines ("
                                          << direct << " of 200 calls written directly)";

  auto t0 = Clock::now();
  std::future<Message> sooner = c.call_async(kNeverReply, Payload::copy_of("300 ms"), 300ms);
  std::future<Message> later = c.call_async(kNeverReply, Payload::copy_of("600 ms"), 600ms);
  for (auto [f, at_least] : {std::pair{&sooner, 290ms}, std::pair{&later, 590ms}}) {
    expect_timed_out(*f);
    EXPECT_GE(Clock::now() - t0, at_least);
  }
  EXPECT_EQ(c.call(kEcho, std::string_view("after"), 10s), "after");
  c.shutdown();
  expect_exit_code(c, 0);
}

// A call answered off the broker thread (here a local handler that runs on
// the caller's thread and replies at once) leaves its slot retired until the
// broker reaps it. The broker is no longer woken for each call (its deadline
// is not armed: the call is over before it could be), so every 256 retired
// slots post one reap: 5,000 calls, one at a time, reuse a few hundred
// slots and post a few dozen wake-ups, where each call used to post one.
// Without the reap nothing brought the broker round, and each call took a
// slot of its own. On a loaded machine the broker thread may not get a CPU
// at all during the 20 ms of calls (CI once saw 4,032 slots): every 512
// calls the loop waits for one turn of the broker, which runs the reaps
// posted so far (the turn itself reaps nothing), so the bound holds
// whatever the scheduler does.
TEST(RpcLocal, CallsAnsweredOffTheBrokerThreadGiveTheirSlotsBack) {
  Broker broker;
  Router router(broker, root_opts());
  HandlerOptions anywhere;
  anywhere.any_thread = true;
  const std::uint32_t echo = router.add_handler([&router](Message&& m) { router.reply(m, m.data); }, anywhere);
  Context self(router, router.id(), "self");
  const auto before = broker.stats();
  for (int i = 0; i < 5000; ++i) {
    std::future<Message> f = self.call_async(echo, Payload::copy_of("x"), 30s);
    ASSERT_EQ(f.wait_for(10s), std::future_status::ready) << "call " << i;
    ASSERT_EQ(f.get().text(), "x");
    if (i % 512 == 511) testutil::settle(broker);
  }
  EXPECT_LT(router.stats().call_slots, 2048u);
  EXPECT_EQ(router.stats().pending_calls, 0u);
  EXPECT_LT(broker.stats().wakeups_posted - before.wakeups_posted, 500u);
}

// An asynchronous call to a handler of this same context keeps its deadline,
// whichever thread makes it and wherever the handler runs: from the broker
// thread (the handler is posted there), and from another thread to a handler
// that may run on any thread (it runs on the caller's). Both skip the outbox,
// where the broker arms an async call's deadline: a handler that never
// answered left the call pending for ever.
TEST(RpcLocal, AsyncCallToALocalHandlerThatNeverRepliesTimesOut) {
  Broker broker;
  Router router(broker, root_opts());
  std::atomic<int> seen{0};
  const std::uint32_t on_broker = router.add_handler([&](Message&&) { ++seen; });
  HandlerOptions anywhere;
  anywhere.any_thread = true;
  const std::uint32_t any_thread = router.add_handler([&](Message&&) { ++seen; }, anywhere);
  Context self(router, router.id(), "self");

  // From the broker thread, to a broker-thread handler.
  std::promise<std::future<Message>> made;
  broker.defer([&] { made.set_value(self.call_async(on_broker, Payload::copy_of("from the broker"), 200ms)); });
  std::future<Message> from_broker = made.get_future().get();
  // From this thread, to a handler that runs here.
  std::future<Message> from_here = self.call_async(any_thread, Payload::copy_of("from here"), 200ms);

  for (auto* f : {&from_broker, &from_here}) expect_timed_out(*f);
  EXPECT_EQ(seen.load(), 2);
  EXPECT_EQ(router.stats().pending_calls, 0u);
}

TEST(RpcFork, ChildKilledMidCallFailsPendingCall) {
  Broker broker;
  Router router(broker, root_opts());
  std::promise<std::string> arrived;
  std::atomic<bool> arrived_set{false};
  router.add_handler([&](Message&& m) {
    if (!arrived_set.exchange(true)) arrived.set_value(m.text());
  }, {}, kParentArrived);
  Context c = fork_child(router, service_child, named("victim"));

  auto call = std::async(std::launch::async, [&]() -> std::string {
    try {
      c.call(kHangAndNotify, std::string_view("wait"), 30s);
      return "no exception";
    } catch (const ChannelError& e) {
      return std::string("ChannelError:") + e.what();
    } catch (const std::exception& e) {
      return std::string("other:") + e.what();
    }
  });
  auto af = arrived.get_future();
  ASSERT_EQ(af.wait_for(15s), std::future_status::ready) << "the call never reached the child";
  EXPECT_EQ(af.get(), std::to_string(c.pid()));

  auto t0 = Clock::now();
  ASSERT_EQ(::kill(c.pid(), SIGKILL), 0);
  ASSERT_EQ(call.wait_for(10s), std::future_status::ready) << "pending call not failed";
  auto elapsed = Clock::now() - t0;
  std::string out = call.get();
  EXPECT_TRUE(out.starts_with("ChannelError:")) << out;
  EXPECT_TRUE(contains(out, reason::kPeerDisconnected)) << out;
  EXPECT_LT(elapsed, 5s);

  auto st = c.wait_exit(10s);
  ASSERT_TRUE(st.has_value());
  EXPECT_TRUE(WIFSIGNALED(*st)) << describe_wait_status(*st);
  if (WIFSIGNALED(*st)) {
    EXPECT_EQ(WTERMSIG(*st), SIGKILL);
  }

  // Later calls to the dead child fail at once, too.
  std::string later;
  try {
    c.call(kEcho, std::string_view("anyone?"), 5s);
  } catch (const std::exception& e) {
    later = e.what();
  }
  EXPECT_FALSE(later.empty());
}

// The same, with a handler that blocks the child's broker thread for good.
// The child signals "the call is being handled" through a FIFO the parent
// holds open (fork_child closes inherited fds, so the child opens it by path).
TEST(RpcFork, ChildKilledWhileHandlerBlocksFailsPendingCall) {
  char dir[] = "/tmp/spindle-rpc-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string fifo = std::string(dir) + "/arrived";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  int rd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ASSERT_GE(rd, 0);

  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, [&fifo](ChildEnv& env) {
    env.router().add_handler([&fifo](Message&&) {
      int wr = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);
      if (wr >= 0) {
        char b = 'x';
        (void)!::write(wr, &b, 1);
        ::close(wr);
      }
      for (;;) ::pause();  // blocks the broker thread until SIGKILL
    }, {}, kNeverReply);
    env.serve();
    return 0;
  }, named("blocked"));

  auto call = std::async(std::launch::async, [&]() -> std::string {
    try {
      c.call(kNeverReply, std::string_view("block"), 30s);
      return "no exception";
    } catch (const ChannelError& e) {
      return std::string("ChannelError:") + e.what();
    } catch (const std::exception& e) {
      return std::string("other:") + e.what();
    }
  });
  pollfd p{rd, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 15000), 1) << "the handler never started";
  char b = 0;
  ASSERT_EQ(::read(rd, &b, 1), 1);

  auto t0 = Clock::now();
  ASSERT_EQ(::kill(c.pid(), SIGKILL), 0);
  ASSERT_EQ(call.wait_for(10s), std::future_status::ready) << "pending call not failed";
  auto elapsed = Clock::now() - t0;
  std::string out = call.get();
  EXPECT_TRUE(out.starts_with("ChannelError:")) << out;
  EXPECT_TRUE(contains(out, reason::kPeerDisconnected)) << out;
  EXPECT_LT(elapsed, 5s);
  auto st = c.wait_exit(10s);
  ASSERT_TRUE(st.has_value());
  EXPECT_TRUE(WIFSIGNALED(*st) && WTERMSIG(*st) == SIGKILL) << describe_wait_status(*st);

  ::close(rd);
  ::unlink(fifo.c_str());
  ::rmdir(dir);
}

TEST(RpcFork, ChildLogLinesAreForwardedToParent) {
  ScopedLogCapture capture;
  CaptureSink* sink = &capture.sink();
  {
    Broker broker;
    Router router(broker, root_opts());
    const std::string marker = fmt::format("forward-log-marker-{}", ::getpid());
    Context c = fork_child(router, [&marker](ChildEnv& env) {
      log().warn("{} from the child", marker);
      env.serve();
      return 0;
    }, named("log-child"));
    std::string line;
    spdlog::level::level_enum level = spdlog::level::off;
    ASSERT_TRUE(sink->wait_for_line(marker, 15s, &line, &level)) << "child's log line never arrived";
    EXPECT_TRUE(contains(line, "log-child")) << line;
    EXPECT_TRUE(contains(line, fmt::format("ctx={}", c.id()))) << line;
    EXPECT_TRUE(contains(line, marker + " from the child")) << line;
    EXPECT_EQ(level, spdlog::level::warn) << line;
    c.shutdown();
    expect_exit_code(c, 0);
  }
}

TEST(RpcFork, ExitStatusOfMainIsReported) {
  Broker broker;
  Router router(broker, root_opts());
  Context seven = fork_child(router, [](ChildEnv&) { return 7; }, named("seven"));
  auto st = seven.wait_exit(10s);
  ASSERT_TRUE(st.has_value());
  EXPECT_TRUE(WIFEXITED(*st)) << describe_wait_status(*st);
  EXPECT_EQ(WEXITSTATUS(*st), 7) << describe_wait_status(*st);
}

TEST(RpcFork, ShutdownRequestExitsZero) {
  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, service_child, named("polite"));
  ASSERT_EQ(c.call(kEcho, std::string_view("up"), 10s), "up");
  c.shutdown();
  expect_exit_code(c, 0);
}

// Result codes of the fd-hygiene child.
enum FdCheck {
  kFdsOk = 0,
  kInheritedFdOpen = 10,
  kDevNullOpen = 11,
  kUnexpectedFd = 12,
  kSocketCount = 13,
  kProcUnreadable = 14,
};

// FdPolicy::close_all_except({}): the child holds its link, stdio and what
// its own broker opens, nothing of the parent's. (The default policy keeps
// the application's fds: tests/test_fd_policy.cpp.)
TEST(RpcFork, ForkedChildUnderCloseAllInheritsNoParentFd) {
  // Opened without O_CLOEXEC, and moved high so the child's own broker cannot
  // reuse the number.
  int devnull = ::open("/dev/null", O_RDONLY);
  ASSERT_GE(devnull, 0);
  int leaked = ::fcntl(devnull, F_DUPFD, 100);
  ASSERT_GE(leaked, 100);
  ::close(devnull);
  ASSERT_EQ(::fcntl(leaked, F_GETFD) & FD_CLOEXEC, 0);

  Broker broker;
  Router router(broker, root_opts());
  Context c = fork_child(router, [leaked](ChildEnv&) -> int {
    errno = 0;
    if (::fcntl(leaked, F_GETFD) != -1 || errno != EBADF) {
      std::fprintf(stderr, "fd %d inherited from the parent is open\n", leaked);
      return kInheritedFdOpen;
    }
    DIR* d = ::opendir("/proc/self/fd");
    if (!d) return kProcUnreadable;
    int self = ::dirfd(d);
    int sockets = 0;
    int rc = kFdsOk;
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      int fd = std::atoi(e->d_name);
      if (fd == self || fd <= 2) continue;
      char link[256] = {};
      ssize_t n = ::readlink(fmt::format("/proc/self/fd/{}", fd).c_str(), link, sizeof link - 1);
      std::string target = n > 0 ? std::string(link, static_cast<std::size_t>(n)) : "?";
      if (target == "/dev/null") {
        std::fprintf(stderr, "fd %d is /dev/null\n", fd);
        rc = kDevNullOpen;
      } else if (target.starts_with("socket:")) {
        ++sockets;
      } else if (!target.starts_with("anon_inode:")) {
        // The broker's own fds are epoll, eventfd, timerfd: all anon inodes.
        std::fprintf(stderr, "unexpected fd %d -> %s\n", fd, target.c_str());
        rc = kUnexpectedFd;
      }
    }
    ::closedir(d);
    if (rc == kFdsOk && sockets != 1) {
      std::fprintf(stderr, "%d sockets open, expected 1\n", sockets);
      rc = kSocketCount;
    }
    return rc;
  }, [] {
    ChildOptions o = named("fd-check");
    o.fds = FdPolicy::close_all_except({});
    return o;
  }());
  auto st = c.wait_exit(10s);
  ::close(leaked);
  ASSERT_TRUE(st.has_value());
  ASSERT_TRUE(WIFEXITED(*st)) << describe_wait_status(*st);
  EXPECT_EQ(WEXITSTATUS(*st), kFdsOk)
      << "10: inherited fd open, 11: /dev/null open, 12: unexpected fd, 13: socket count, 14: no /proc";
}

// ------------------------------------------------------------ spawn_child

class RpcSpawn : public ::testing::TestWithParam<ChildTransport> {};

TEST_P(RpcSpawn, EchoesLargePayloadAndExitsCleanly) {
  Broker broker;
  Router router(broker, root_opts());
  ChildOptions o;
  o.name = GetParam() == ChildTransport::kSocketPair ? "spawned-socket" : "spawned-stdio";
  o.transport = GetParam();
  Context c = spawn_child(router, SPINDLE_HELPER_DIR "/spawned_echo", {}, o);
  ASSERT_GT(c.pid(), 0);
  std::string sent = pattern(300 * 1024, 7);
  Payload got = c.call(kEcho, Payload::copy_of(sent), 30s);
  ASSERT_EQ(got.size(), sent.size());
  EXPECT_TRUE(got.to_string() == sent) << "content differs";
  EXPECT_EQ(c.call(kEcho, std::string_view{}, 10s), "");
  c.shutdown();
  expect_exit_code(c, 0);
}

// A spawned program holds the link and its stdio, nothing else of the
// parent's: not even an fd the parent opened without O_CLOEXEC.
TEST_P(RpcSpawn, ProgramInheritsNoOtherFdOfTheParent) {
  int leaky[2];
  ASSERT_EQ(::pipe(leaky), 0);  // no O_CLOEXEC: what a careless caller has open
  struct stat st;
  ASSERT_EQ(::fstat(leaky[0], &st), 0);
  const std::string pipe_file = fmt::format("{}:{}", st.st_dev, st.st_ino);
  Broker broker;
  Router router(broker, root_opts());
  ChildOptions o;
  o.transport = GetParam();
  Context c = spawn_child(router, SPINDLE_HELPER_DIR "/spawned_echo", {}, o);
  const std::string files = c.call(kSpawnedOpenFiles, std::string_view{}, 30s);
  EXPECT_FALSE(contains(files, pipe_file)) << "the spawned program holds the parent's pipe: " << files;
  c.shutdown();
  expect_exit_code(c, 0);
  ::close(leaky[0]);
  ::close(leaky[1]);
}

// pass_fds reach the program (CLOEXEC or not); other fds still do not.
TEST_P(RpcSpawn, ProgramGetsPassFdsAndNothingElse) {
  int leaky[2], passed[2];
  ASSERT_EQ(::pipe(leaky), 0);
  ASSERT_EQ(::pipe2(passed, O_CLOEXEC), 0);
  auto identity = [](int fd) {
    struct stat st;
    EXPECT_EQ(::fstat(fd, &st), 0);
    return fmt::format("{}:{}", st.st_dev, st.st_ino);
  };
  Broker broker;
  Router router(broker, root_opts());
  ChildOptions o;
  o.transport = GetParam();
  o.pass_fds = {passed[1]};
  Context c = spawn_child(router, SPINDLE_HELPER_DIR "/spawned_echo", {}, o);
  const std::string files = c.call(kSpawnedOpenFiles, std::string_view{}, 30s);
  EXPECT_TRUE(contains(files, identity(passed[1]))) << files;
  EXPECT_FALSE(contains(files, identity(leaky[0]))) << files;
  c.shutdown();
  expect_exit_code(c, 0);
  // An fd that cannot be passed is refused before anything starts.
  o.pass_fds = {1};
  EXPECT_THROW(spawn_child(router, SPINDLE_HELPER_DIR "/spawned_echo", {}, o), Error);
  for (int fd : {leaky[0], leaky[1], passed[0], passed[1]}) ::close(fd);
}

INSTANTIATE_TEST_SUITE_P(RpcSpawnTransports, RpcSpawn,
                         ::testing::Values(ChildTransport::kSocketPair, ChildTransport::kStdio),
                         [](const ::testing::TestParamInfo<ChildTransport>& i) {
                           return std::string(i.param == ChildTransport::kSocketPair ? "SocketPair"
                                                                                     : "Stdio");
                         });

}  // namespace test_rpc
}  // namespace spindle
