// ChildProcess: a child process and its exit status, reaped exactly once.
//
// Role: whoever gets there first reaps the child: the broker when the child's
// pidfd becomes readable, a caller waiting in wait(), or the Broker's
// destructor, which reaps every child still registered with it (waiting out
// the shutdown grace, then SIGKILL), so a process that uses Spindle never
// leaves zombies behind. The status is kept, so every later caller sees it.
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
  int pidfd() const { return pidfd_; }
  // Non-blocking reap. Returns the wait status once the child has exited.
  std::optional<int> reap();
  // Waits up to `timeout` for the child to exit; returns its wait status.
  std::optional<int> wait(std::chrono::milliseconds timeout);
  // wait(grace), then SIGKILL and reap: the child is gone when this returns.
  int finish(std::chrono::milliseconds grace);

 private:
  const pid_t pid_;
  const int pidfd_;
  std::mutex mu_;
  std::optional<int> status_;
};

std::string describe_wait_status(int status);

}  // namespace spindle
