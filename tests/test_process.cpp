// ChildProcess (broker/process.h): the reap, and the pidfd that goes with it.
//
// A handle on a child outlives the child: an application keeps its Child
// objects after their Router has stopped them. The pidfd closes at the reap,
// so such a handle holds no fd (the Python loader example counts its fds
// after the Router closed and once found one per worker it still referred
// to). The fd number is never used after the close: a poll in progress
// keeps it open, and a signal after the reap sends nothing, since the pid
// may be another process's by then.
#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "broker/process.h"

namespace spindle {
namespace test_process {

using namespace std::chrono_literals;

// A real child that waits for a byte (or EOF) on `hold`, then exits with `code`.
std::unique_ptr<ChildProcess> start_child(int code, int* hold_write) {
  int p[2];
  EXPECT_EQ(::pipe2(p, O_CLOEXEC), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    char c;
    ::close(p[1]);
    while (::read(p[0], &c, 1) < 0 && errno == EINTR) {
    }
    ::_exit(code);
  }
  EXPECT_GT(pid, 0);
  ::close(p[0]);
  *hold_write = p[1];
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  EXPECT_GE(pidfd, 0) << std::strerror(errno);
  return std::make_unique<ChildProcess>(pid, pidfd);
}

bool fd_open(int fd) { return ::fcntl(fd, F_GETFD) >= 0; }

TEST(ChildProcess, TheReapClosesThePidfd) {
  int hold;
  auto child = start_child(7, &hold);
  const int dup = child->dup_pidfd();
  ASSERT_GE(dup, 0);
  EXPECT_TRUE(child->holds_pidfd());
  EXPECT_FALSE(child->wait(20ms)) << "the child exited before it was let go";
  EXPECT_TRUE(child->holds_pidfd()) << "a wait that timed out closed the pidfd";

  ::close(hold);  // the child exits
  auto st = child->wait(10s);
  ASSERT_TRUE(st);
  ASSERT_TRUE(WIFEXITED(*st));
  EXPECT_EQ(WEXITSTATUS(*st), 7);
  EXPECT_FALSE(child->holds_pidfd()) << "a reaped child's handle still holds its pidfd";
  EXPECT_EQ(child->dup_pidfd(), -1) << "a watcher was given a reaped child's pidfd";
  EXPECT_FALSE(child->signal(SIGTERM)) << "a signal went to a pid that may be another process's";
  EXPECT_EQ(child->reap(), st) << "the status is kept for later callers";
  EXPECT_TRUE(fd_open(dup)) << "the watcher's duplicate is its own";
  ::close(dup);
}

// Threads polling in wait() while another reaps: each gets the status, and
// the pidfd closes once, after the last of them has stopped polling it.
TEST(ChildProcess, WaitersPollingWhenAnotherReapsAllGetTheStatus) {
  int hold;
  auto child = start_child(3, &hold);
  std::vector<std::thread> waiters;
  std::vector<std::optional<int>> seen(4);
  for (std::size_t i = 0; i < seen.size(); ++i)
    waiters.emplace_back([&, i] { seen[i] = child->wait(10s); });
  std::this_thread::sleep_for(20ms);  // most are in poll() by now
  ::close(hold);
  std::optional<int> st;
  while (!(st = child->reap())) std::this_thread::sleep_for(1ms);
  for (auto& t : waiters) t.join();
  for (const auto& s : seen) EXPECT_EQ(s, st);
  EXPECT_FALSE(child->holds_pidfd());
}

// finish() kills a child that outstays its grace, through the pidfd.
TEST(ChildProcess, FinishKillsAChildThatDoesNotExit) {
  int hold;
  auto child = start_child(0, &hold);
  EXPECT_TRUE(child->signal(0)) << "a live child refused signal 0";
  const int st = child->finish(10ms);
  ASSERT_TRUE(WIFSIGNALED(st)) << describe_wait_status(st);
  EXPECT_EQ(WTERMSIG(st), SIGKILL);
  EXPECT_FALSE(child->holds_pidfd());
  ::close(hold);
}

}  // namespace test_process
}  // namespace spindle
