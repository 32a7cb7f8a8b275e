// The stderr log sink across fork(): its writer thread must leave no lock
// held in a child, whatever it is doing at the moment of the fork.
//
// The sink starts its writer thread on the first line. A process that logs
// and forks at once forks while that thread is being set up, which allocates;
// under GCC 12's ASan the child then hung in its first allocation (the
// allocator's lock was copied held), which is how example.parent_child timed
// out in CI. Each round here is a fresh process with a fresh sink, so each one
// opens that window again.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "broker/log.h"
#include "tests/router_test_util.h"

namespace spindle {
namespace test_log_sink {

using namespace std::chrono_literals;

// Waits for `pid` at most `limit`; kills it if it is still running.
// Returns its wait status, or -1 if it had to be killed.
int wait_bounded(pid_t pid, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return status;
    if (r < 0) return -2;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(1ms);
  }
}

// The grandchild: what a forked child does first (a thread, allocations).
[[noreturn]] void grandchild() {
  std::thread([] { auto v = std::make_unique<std::vector<std::string>>(64, std::string(100, 'x')); }).join();
  auto* p = std::malloc(1 << 20);
  std::free(p);
  ::_exit(0);
}

// One round: a process with a fresh sink logs its first line and forks at
// once. Exit 0: the grandchild ran; 1: it hung; 2: it failed otherwise.
[[noreturn]] void round_process() {
  int devnull = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (devnull < 0 || ::dup2(devnull, STDERR_FILENO) < 0) ::_exit(2);
  reset_logging_after_fork(1, "round");  // a new sink; its writer is not started
  log().warn("the first line starts the writer thread");
  pid_t pid = ::fork();
  if (pid < 0) ::_exit(2);
  if (pid == 0) grandchild();
  int status = wait_bounded(pid, 5s);
  if (status == -1) ::_exit(1);
  ::_exit(WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 2);
}

// A context's name is in every record of its process. A client's name is
// checked only by the router it asks, so a refused one ("bad\nname") was
// already in the label, and each record broke into two lines.
TEST(LogLabel, AContextNameWithAControlCharacterIsEscaped) {
  testutil::ScopedLogCapture capture;
  set_log_context(7, "bad\nname\x1b[31m");
  log().warn("label probe");
  set_log_context(0, {});
  std::string line;
  spdlog::level::level_enum level;
  ASSERT_TRUE(capture.sink().wait_for_line("label probe", 5s, &line, &level));
  while (!line.empty() && line.back() == '\n') line.pop_back();
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  EXPECT_EQ(line.find('\x1b'), std::string::npos) << line;
  EXPECT_NE(line.find("ctx=7(\"bad\\nname\\x1b[31m\")"), std::string::npos) << line;
}

TEST(LogSinkFork, AChildForkedAsTheWriterStartsIsNotLeftHoldingALock) {
  constexpr int kRounds = 60;
  int hung = 0, failed = 0;
  for (int i = 0; i < kRounds; ++i) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) round_process();
    int status = wait_bounded(pid, 30s);
    ASSERT_NE(status, -1) << "round " << i << " itself hung";
    ASSERT_TRUE(WIFEXITED(status)) << "round " << i << " died: status " << status;
    if (WEXITSTATUS(status) == 1) ++hung;
    if (WEXITSTATUS(status) == 2) ++failed;
  }
  EXPECT_EQ(hung, 0) << "children hung after a fork during the log writer's start";
  EXPECT_EQ(failed, 0);
}

}  // namespace test_log_sink
}  // namespace spindle
