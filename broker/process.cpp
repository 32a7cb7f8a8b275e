// Reaping goes through one mutex-guarded status: waitpid() succeeds once per
// child, and whoever gets that status keeps it for everyone else. The pidfd
// goes with the reap; a wait() polling it outside the mutex counts itself in
// (pollers_), and the last one out closes it, so no poll ever sees a number
// that another open() took in the meantime.
#include "broker/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
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

ChildProcess::~ChildProcess() { close_pidfd_locked(); }  // the last owner: nobody else locks

void ChildProcess::close_pidfd_locked() {
  if (pidfd_ < 0) return;
  fd_registry::forget(pidfd_);  // an anonymous inode before Linux 6.9
  ::close(pidfd_);
  pidfd_ = -1;
}

std::optional<int> ChildProcess::reap_locked() {
  if (status_) return status_;
  int st = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &st, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid_) {
    status_ = st;
    if (pollers_ == 0) close_pidfd_locked();
  } else if (r < 0) {
    log().warn("waitpid({}): {}", pid_, errno_text(errno));
  }
  return status_;
}

std::optional<int> ChildProcess::reap() {
  std::lock_guard lk(mu_);
  return reap_locked();
}

std::optional<int> ChildProcess::wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    // Rounded up: poll() counts whole milliseconds, and a wait truncated to
    // them gave up to 1 ms before the deadline (a grace shorter than asked).
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    int fd;
    {
      std::lock_guard lk(mu_);
      if (auto st = reap_locked()) return st;
      if (left.count() <= 0) return std::nullopt;
      fd = pidfd_;
      ++pollers_;
    }
    // The pidfd becomes readable when the child exits.
    pollfd p{fd, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left.count()));
    const int err = errno;
    {
      std::lock_guard lk(mu_);
      if (--pollers_ == 0 && status_) close_pidfd_locked();
    }
    if (n < 0 && err != EINTR) throw Error(std::string("poll(pidfd): ") + errno_text(err));
  }
}

int ChildProcess::finish(std::chrono::milliseconds grace) {
  if (auto st = wait(grace)) return *st;
  log().warn("child pid={} did not exit within {} ms; killing it", pid_, grace.count());
  try {
    signal(SIGKILL);
  } catch (const Error& e) {
    log().warn("{}", e.what());
  }
  while (true) {
    if (auto st = wait(std::chrono::milliseconds(1000))) return *st;
  }
}

bool ChildProcess::signal(int sig) {
  std::lock_guard lk(mu_);
  if (status_) return false;
  // Via syscall(): Debian 12's <sys/pidfd.h> lacks C linkage for C++ callers.
  if (::syscall(SYS_pidfd_send_signal, pidfd_, sig, nullptr, 0) < 0) {
    const int err = errno;
    if (err == ESRCH) return true;  // exited, not reaped yet: nothing to stop
    throw Error(fmt::format("pidfd_send_signal(pid {}, SIG{}): {}", pid_, ::sigabbrev_np(sig), errno_text(err)));
  }
  return true;
}

int ChildProcess::dup_pidfd() {
  std::lock_guard lk(mu_);
  if (pidfd_ < 0 || status_) return -1;
  int fd = ::fcntl(pidfd_, F_DUPFD_CLOEXEC, 3);
  if (fd < 0) throw Error(fmt::format("dup(pidfd) of pid {}: {}", pid_, errno_text(errno)));
  return fd;
}

bool ChildProcess::holds_pidfd() {
  std::lock_guard lk(mu_);
  return pidfd_ >= 0;
}

std::string describe_wait_status(int st) {
  if (WIFEXITED(st)) return fmt::format("exited with status {}", WEXITSTATUS(st));
  if (WIFSIGNALED(st)) return fmt::format("killed by signal {} ({})", WTERMSIG(st), ::sigdescr_np(WTERMSIG(st)));
  return fmt::format("wait status {:#x}", st);
}

}  // namespace spindle
