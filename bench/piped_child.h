// PipedChild: a helper process forked by a bench before it starts any thread,
// driven through two pipes. The bench writes to the child's control pipe and
// ends the child's work by closing it (EOF); the child writes its figures to
// the output pipe and exits. Shared by the scheduler probe and the isolated
// round-trip probe (bench/sched_probe.h, bench/rtt_probe.h).
//
// Thread safety: one thread drives it; fork() must happen before the process
// has other threads. Ownership: owns the child (killed and reaped if still
// there at destruction) and the parent's ends of both pipes.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <functional>
#include <string>
#include <string_view>

#include "broker/errors.h"

namespace spindle::bench {

class PipedChild {
 public:
  // Forks; the child runs `body(ctl_read_fd, out_write_fd)`, which must end
  // with _exit().
  void fork(const std::function<void(int ctl, int out)>& body) {
    int ctl[2], out[2];
    if (::pipe2(ctl, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0)
      throw Error(std::string("pipe2: ") + errno_text(errno));
    pid_ = ::fork();
    if (pid_ < 0) throw Error(std::string("fork: ") + errno_text(errno));
    if (pid_ == 0) {
      ::close(ctl[1]);
      ::close(out[0]);
      body(ctl[0], out[1]);
      ::_exit(1);  // body returned: a bug of the bench
    }
    ::close(ctl[0]);
    ::close(out[1]);
    ctl_ = ctl[1];
    out_ = out[0];
  }
  bool forked() const { return pid_ > 0; }

  void send(std::string_view s) { write_all(ctl_, s); }

  // Closes the control pipe (the child's signal to finish), reads all the
  // child wrote, and reaps it.
  std::string finish() {
    if (ctl_ >= 0) ::close(ctl_);
    ctl_ = -1;
    std::string bytes;
    char buf[64 * 1024];
    for (;;) {
      ssize_t n = ::read(out_, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      bytes.append(buf, static_cast<std::size_t>(n));
    }
    ::close(out_);
    out_ = -1;
    while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return bytes;
  }

  ~PipedChild() {
    if (ctl_ >= 0) ::close(ctl_);
    if (out_ >= 0) ::close(out_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  static void write_all(int fd, std::string_view s) {
    while (!s.empty()) {
      ssize_t n = ::write(fd, s.data(), s.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw Error(std::string("bench helper pipe: write: ") + errno_text(errno));
      s.remove_prefix(static_cast<std::size_t>(n));
    }
  }

 private:
  pid_t pid_ = -1;
  int ctl_ = -1, out_ = -1;
};

}  // namespace spindle::bench
