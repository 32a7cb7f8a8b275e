// ChildProcess: a child process and its exit status, reaped exactly once.
//
// Role: whoever gets there first reaps the child: the broker when the child's
// pidfd becomes readable, a caller waiting in wait(), or the Broker's
// destructor, which reaps every child still registered with it (waiting out
// the shutdown grace, then SIGKILL), so a process that uses Spindle never
// leaves zombies behind. The status is kept, so every later caller sees it.
//
// The pidfd is closed as soon as the child is reaped (once no wait() polls
// it): a handle kept after its child is gone (a stopped Child the
// application still refers to, after its Router has closed) holds no fd.
// Nothing outside uses the fd number, which a closed pidfd frees for reuse:
// a signal goes through signal() and a watcher gets a duplicate, both under
// the mutex that orders them against the reap. After the reap the pid may be
// another process's, so signal() sends nothing then.
//
// Thread safety: any thread (one mutex). Ownership: shared by the parent's
// handle on the child (a Context) and the broker's watch.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <string>

namespace spindle {

class ChildProcess {
 public:
  ChildProcess(pid_t pid, int pidfd);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  pid_t pid() const { return pid_; }
  // Non-blocking reap. Returns the wait status once the child has exited.
  std::optional<int> reap();
  // Waits up to `timeout` for the child to exit; returns its wait status.
  std::optional<int> wait(std::chrono::milliseconds timeout);
  // wait(grace), then SIGKILL and reap: the child is gone when this returns.
  int finish(std::chrono::milliseconds grace);
  // Sends `sig` through the pidfd. False, sending nothing, once it has been
  // reaped; throws Error if the kernel refuses.
  bool signal(int sig);
  // A CLOEXEC duplicate of the pidfd (the caller owns it), or -1 once the
  // child has been reaped. Throws Error if it cannot be duplicated.
  int dup_pidfd();
  // Whether it still holds its pidfd (tests).
  bool holds_pidfd();

 private:
  std::optional<int> reap_locked();
  void close_pidfd_locked();

  const pid_t pid_;
  std::mutex mu_;
  int pidfd_;       // -1 once reaped and no wait() polls it
  int pollers_ = 0; // wait() calls polling pidfd_ now, outside the mutex
  std::optional<int> status_;
};

std::string describe_wait_status(int status);

}  // namespace spindle
