// Reaping goes through one mutex-guarded status: waitpid() succeeds once per
// child, and whoever gets that status keeps it for everyone else.
#include "broker/process.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/fd_registry.h"
#include "broker/log.h"

namespace spindle {

ChildProcess::ChildProcess(pid_t pid, int pidfd) : pid_(pid), pidfd_(pidfd) {
  fd_registry::note(pidfd_);
}

ChildProcess::~ChildProcess() {
  if (pidfd_ >= 0) {
    fd_registry::forget(pidfd_);  // an anonymous inode before Linux 6.9
    ::close(pidfd_);
  }
}

std::optional<int> ChildProcess::reap() {
  std::lock_guard lk(mu_);
  if (status_) return status_;
  int st = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &st, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid_) status_ = st;
  else if (r < 0) log().warn("waitpid({}): {}", pid_, errno_text(errno));
  return status_;
}

std::optional<int> ChildProcess::wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (auto st = reap()) return st;
    // Rounded up: poll() counts whole milliseconds, and a wait truncated to
    // them gave up to 1 ms before the deadline (a grace shorter than asked).
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    // The pidfd becomes readable when the child exits.
    pollfd p{pidfd_, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno != EINTR) throw Error(std::string("poll(pidfd): ") + errno_text(errno));
  }
}

int ChildProcess::finish(std::chrono::milliseconds grace) {
  if (auto st = wait(grace)) return *st;
  log().warn("child pid={} did not exit within {} ms; killing it", pid_, grace.count());
  if (::kill(pid_, SIGKILL) < 0 && errno != ESRCH)
    log().warn("kill({}, SIGKILL): {}", pid_, errno_text(errno));
  while (true) {
    if (auto st = wait(std::chrono::milliseconds(1000))) return *st;
  }
}

std::string describe_wait_status(int st) {
  if (WIFEXITED(st)) return fmt::format("exited with status {}", WEXITSTATUS(st));
  if (WIFSIGNALED(st)) return fmt::format("killed by signal {} ({})", WTERMSIG(st), ::sigdescr_np(WTERMSIG(st)));
  return fmt::format("wait status {:#x}", st);
}

}  // namespace spindle
