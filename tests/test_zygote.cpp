// Zygote (router/zygote.h): children forked by a small process started
// early, but parented, watched and reaped by the process that asked.
//
// Children report through replies and their exit status; no gtest macro runs
// inside a child.
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "broker/errors.h"
#include "router/zygote.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_zygote {

using namespace testutil;
using namespace std::chrono_literals;

constexpr std::uint32_t kWhoAreYou = 3100;
constexpr std::uint32_t kFdsClosed = 3101;
constexpr std::uint32_t kRss = 3102;

// Resident set of this process, in KiB (VmRSS), or -1.
long rss_kib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  return -1;
}

// "<dev>:<ino>" of an open fd.
std::string file_id(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return "closed";
  return fmt::format("{}:{}", st.st_dev, st.st_ino);
}

// Answers kWhoAreYou with "<getppid> <tid-ok|tid-wrong> <arg>", kFdsClosed
// with "closed", or "open <file>" for the first of the files listed in the
// request ("<dev>:<ino>" each) that one of its fds refers to, kRss with its
// VmRSS.
int answering_child(ChildEnv& env, std::string_view arg) {
  Router& r = env.router();
  // On the child's main thread: glibc's cached thread id must be this
  // process's own. With the zygote's, this thread's CPU clock would name a
  // thread of another process, which clock_gettime() refuses (EINVAL).
  clockid_t cpu_clock;
  timespec ts;
  const bool tid_ok = ::pthread_getcpuclockid(::pthread_self(), &cpu_clock) == 0 &&
                      ::clock_gettime(cpu_clock, &ts) == 0;
  r.add_handler([&r, a = std::string(arg), tid_ok](Message&& m) {
    r.reply(m, Payload::copy_of(fmt::format("{} {} {}", ::getppid(), tid_ok ? "tid-ok" : "tid-wrong", a)));
  }, {}, kWhoAreYou);
  r.add_handler([&r](Message&& m) {
    std::string out = "closed";
    std::istringstream in(m.text());
    for (std::string file; in >> file;)
      for (int fd = 0; fd < 1024; ++fd)
        if (file_id(fd) == file) out = fmt::format("open {} as fd {}", file, fd);
    r.reply(m, Payload::copy_of(out));
  }, {}, kFdsClosed);
  r.add_handler([&r](Message&& m) { r.reply(m, Payload::copy_of(std::to_string(rss_kib()))); }, {}, kRss);
  env.serve();
  return 0;
}

int aborting_child(ChildEnv&, std::string_view) { std::abort(); }

int exit_with_arg(ChildEnv&, std::string_view arg) { return std::atoi(std::string(arg).c_str()); }

// The zygote first, while this process has no broker thread yet.
class ZygoteTest : public ::testing::Test {
 protected:
  std::unique_ptr<Zygote> zygote = Zygote::start();
  Broker broker;
  Router router{broker, root_opts()};
};

TEST_F(ZygoteTest, ChildIsThisProcesssChildAndAnswersCalls) {
  Context c = zygote->fork_child(router, answering_child, "shard-3", named("zchild"));
  std::string who = c.call(kWhoAreYou, std::string_view(""), 30s);
  EXPECT_EQ(who, fmt::format("{} tid-ok shard-3", ::getpid())) << "the zygote's pid is " << zygote->pid();
  c.shutdown();
  expect_exit_code(c, 0);
}

TEST_F(ZygoteTest, ChildsExitCodeReachesThisProcess) {
  Context c = zygote->fork_child(router, exit_with_arg, "7");
  expect_exit_code(c, 7);
}

// A child that aborts is reported as killed by SIGABRT, like any child.
TEST_F(ZygoteTest, AbortInTheChildEndsItWithSigabrt) {
  Context c = zygote->fork_child(router, aborting_child);
  auto st = c.wait_exit(30s);
  ASSERT_TRUE(st.has_value()) << "the child did not end";
  ASSERT_TRUE(WIFSIGNALED(*st)) << describe_wait_status(*st);
  EXPECT_EQ(WTERMSIG(*st), SIGABRT) << describe_wait_status(*st);
}

// The parent grows after the zygote started; a zygote child does not map
// that memory, a fork_child() child does.
// Compared with a zygote child started before the growth, so that what this
// process held before (a sanitizer's shadow, earlier tests in the same
// process) does not count.
TEST_F(ZygoteTest, ChildDoesNotHoldWhatTheParentAllocatedLater) {
  constexpr std::size_t kBig = 256u << 20;
  constexpr long kBigKib = static_cast<long>(kBig / 1024);
  Context before = zygote->fork_child(router, answering_child, "", named("before-growth"));
  const long before_kib = std::stol(before.call(kRss, std::string_view(""), 30s));
  std::vector<char> big(kBig);
  std::memset(big.data(), 1, big.size());  // resident in the parent
  Context z = zygote->fork_child(router, answering_child, "", named("from-zygote"));
  Context f = fork_child(router, [](ChildEnv& env) { return answering_child(env, ""); }, named("forked"));
  const long z_kib = std::stol(z.call(kRss, std::string_view(""), 30s));
  const long f_kib = std::stol(f.call(kRss, std::string_view(""), 30s));
  EXPECT_LT(z_kib, before_kib + kBigKib / 8) << "the zygote's child maps the parent's later heap";
  EXPECT_GT(f_kib, kBigKib) << "fork_child's child should map it (the comparison's premise)";
  EXPECT_EQ(big[kBig / 2], 1);
  for (Context* c : {&before, &z, &f}) c->shutdown();
  for (Context* c : {&before, &z, &f}) expect_exit_code(*c, 0);
}

// Neither the fds the parent had when the zygote started nor those it opened
// later reach the child.
TEST(Zygote, ChildHoldsNoFdOfTheParent) {
  int before[2];
  ASSERT_EQ(::pipe2(before, O_CLOEXEC), 0);
  auto zygote = Zygote::start();
  int after[2];
  ASSERT_EQ(::pipe2(after, O_CLOEXEC), 0);
  Broker broker;
  Router router(broker, root_opts());
  Context c = zygote->fork_child(router, answering_child);
  const std::string fds = fmt::format("{} {} {} {}", file_id(before[0]), file_id(before[1]),
                                      file_id(after[0]), file_id(after[1]));
  EXPECT_EQ(c.call(kFdsClosed, std::string_view(fds), 30s), "closed");
  c.shutdown();
  expect_exit_code(c, 0);
  for (int fd : {before[0], before[1], after[0], after[1]}) ::close(fd);
}

TEST_F(ZygoteTest, BadRequestsAreClearErrors) {
  try {
    zygote->fork_child(router, answering_child, std::string(Zygote::kMaxArg + 1, 'x'));
    ADD_FAILURE() << "an argument over the limit was accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "over the limit")) << e.what();
  }
  // An address that is in no loaded object: what a function of a library
  // dlopen()ed after start() looks like to the zygote.
  auto not_code = reinterpret_cast<ZygoteMain>(std::uintptr_t{0x10});
  try {
    zygote->fork_child(router, not_code);
    ADD_FAILURE() << "a function outside loaded code was accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "not in code the zygote has loaded")) << e.what();
  }
  // The zygote still serves after refusing.
  Context c = zygote->fork_child(router, exit_with_arg, "0");
  expect_exit_code(c, 0);
}

TEST_F(ZygoteTest, AZygoteThatDiedIsAClearError) {
  ASSERT_EQ(::kill(zygote->pid(), SIGKILL), 0);
  try {
    zygote->fork_child(router, exit_with_arg, "0");
    ADD_FAILURE() << "fork_child through a dead zygote succeeded";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "the zygote is gone")) << e.what();
  }
}

TEST(Zygote, ChildrenOutliveTheZygoteAndForksFromManyThreadsAllAnswer) {
  Broker broker;
  Router router(broker, root_opts());
  std::vector<Context> children;
  {
    auto zygote = Zygote::start();
    std::mutex mu;
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&, t] {
        for (int i = 0; i < 4; ++i) {
          Context c = zygote->fork_child(router, answering_child, fmt::format("t{}-{}", t, i));
          std::lock_guard lk(mu);
          children.push_back(std::move(c));
        }
      });
    for (auto& th : threads) th.join();
  }  // the zygote ends here; its children are ours and go on
  ASSERT_EQ(children.size(), 16u);
  for (Context& c : children) {
    std::string who = c.call(kWhoAreYou, std::string_view(""), 30s);
    EXPECT_TRUE(who.rfind(fmt::format("{} tid-ok t", ::getpid()), 0) == 0) << who;
  }
  for (Context& c : children) c.shutdown();
  for (Context& c : children) expect_exit_code(c, 0);
}

TEST_F(ZygoteTest, RouterOptionsReachTheChild) {
  ChildOptions opts = named("opts");
  opts.router.max_message_size = 123456;
  opts.router.fd_quota = 77;
  opts.router.peer_log_rate = 3.5;
  opts.router.accept_client_logs = true;
  Context c = zygote->fork_child(router, [](ChildEnv& env, std::string_view) {
    const RouterOptions& o = env.router().options();
    const bool ok = o.max_message_size == 123456 && o.fd_quota == 77 && o.peer_log_rate == 3.5 &&
                    o.accept_client_logs && o.name == "opts";
    return ok ? 0 : 1;
  }, "", opts);
  expect_exit_code(c, 0);
}

}  // namespace test_zygote
}  // namespace spindle
