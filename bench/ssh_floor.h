// The raw floor of bench_ssh: the same kind of ssh session Runtime::ssh()
// starts, running `cat` on the remote side, driven through a plain socket.
//
//   RawSshPipe cat(ssh_command(host, opts, "cat"), log_path);
//   double start_ms = cat.wait_echo(timeout);           // session up: 1 byte back
//   auto [line, ms] = upload.send_then_line(bytes, timeout);  // a command that reads them
//   std::vector<double> us = cat.rtt(64, 200, 2000);      // 64 B written, 64 B read back
//   double bytes_per_s = cat.stream(128 << 20, 64 << 10, 256 << 10);  // written and read
//                                                        // concurrently, 256 KiB in flight
//
// ssh_command() is the argv Runtime::ssh() gives ssh for the same options
// (router/ssh_bootstrap.h: -T, BatchMode, ConnectTimeout, -l, -p, -i, the
// pass-through arguments), so the floor pays the same cipher, the same
// window and the same sshd, and the remote login shell's start too; what it
// lacks is exactly what Spindle adds: the bootstrap script, framing, the
// agent, routing and the broker threads on both ends. ssh's stdin and
// stdout are one end of a socketpair, as router/ssh.cpp gives them (ours is
// O_CLOEXEC and non-blocking); its stderr goes to a log file that errors
// quote. Every wait has a deadline: a session that stops answering
// throws instead of hanging the bench.
//
// Thread safety: one thread, except that stream() writes from a thread of
// its own while the caller's reads. Ownership: owns the ssh process (killed
// and reaped by the destructor) and our end of the socket.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <spindle/ssh.h>

#include "router/ssh_bootstrap.h"

extern char** environ;

namespace spindle::bench {

// The ssh argv for `host` and `opts`, running `remote` there: the library's
// own ssh_argv(), so the floor's session has exactly Runtime::ssh()'s options.
inline std::vector<std::string> ssh_command(const std::string& host, const SshOptions& opts,
                                            const std::string& remote) {
  return ssh_argv(host, opts, remote);
}

class RawSshPipe {
 public:
  using Clock = std::chrono::steady_clock;

  RawSshPipe(const std::vector<std::string>& argv, std::string log_path)
      : log_path_(std::move(log_path)), started_(Clock::now()) {
    // One socket for ssh's stdin and stdout, as router/ssh.cpp gives it.
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) fail("socketpair");
    posix_spawn_file_actions_t fa;
    int rc = ::posix_spawn_file_actions_init(&fa);
    if (rc == 0) {
      // dup2 onto 0 and 1 clears O_CLOEXEC there; the original closes at exec.
      rc = ::posix_spawn_file_actions_adddup2(&fa, sv[1], 0);
      if (rc == 0) rc = ::posix_spawn_file_actions_adddup2(&fa, sv[1], 1);
      if (rc == 0)
        rc = ::posix_spawn_file_actions_addopen(&fa, 2, log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      if (rc == 0) rc = ::posix_spawnp(&pid_, args[0], &fa, nullptr, args.data(), environ);
      ::posix_spawn_file_actions_destroy(&fa);
    }
    ::close(sv[1]);
    fd_ = sv[0];
    if (rc != 0) {
      pid_ = -1;
      fail("posix_spawnp " + argv[0], rc);
    }
    // Our end only (the two ends are separate sockets): every write can
    // then wait in poll() with a deadline instead of blocking for good.
    int fl = ::fcntl(fd_, F_GETFL);
    if (fl < 0 || ::fcntl(fd_, F_SETFL, fl | O_NONBLOCK) != 0) fail("fcntl O_NONBLOCK");
  }
  ~RawSshPipe() {
    close_input();
    if (fd_ >= 0) ::close(fd_);
    if (pid_ > 0) {
      // cat ends when its input does: give ssh a moment to exit cleanly.
      auto until = Clock::now() + std::chrono::seconds(2);
      int st = 0;
      pid_t r = 0;
      while ((r = ::waitpid(pid_, &st, WNOHANG)) == 0 && Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (r == 0) {  // still running (and so not reaped: the pid is still its own)
        ::kill(pid_, SIGKILL);
        while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
        }
      }
    }
  }
  RawSshPipe(const RawSshPipe&) = delete;
  RawSshPipe& operator=(const RawSshPipe&) = delete;

  // One byte through cat and back: the session is up. Returns the ms since
  // the spawn (ssh's start, key exchange, authentication, the first echo).
  double wait_echo(std::chrono::milliseconds timeout) {
    const char b = 'x';
    write_all(&b, 1, timeout);
    char back = 0;
    read_exact(&back, 1, timeout);
    if (back != b) throw std::runtime_error("the raw ssh echo came back wrong");
    return std::chrono::duration<double, std::milli>(Clock::now() - started_).count();
  }

  // `bytes` written (for a remote command that reads them, such as the
  // upload floor's `head -c N > f; sha256sum < f`), then one line read
  // back, which is returned (without its newline) with the ms since the
  // spawn.
  std::pair<std::string, double> send_then_line(const std::string& bytes, std::chrono::milliseconds timeout) {
    write_all(bytes.data(), bytes.size(), timeout);
    std::string line;
    char buf[256];
    while (line.find('\n') == std::string::npos) {
      if (line.size() > 4096) throw std::runtime_error("the raw ssh command's answer has no end of line");
      line.append(buf, read_some(buf, sizeof buf, timeout));
    }
    line.resize(line.find('\n'));
    return {line, std::chrono::duration<double, std::milli>(Clock::now() - started_).count()};
  }

  // `iters` round trips of `size` bytes after `warmup` more; microseconds.
  std::vector<double> rtt(std::size_t size, int warmup, int iters) {
    std::vector<char> msg(size), back(size);
    std::vector<double> us;
    us.reserve(static_cast<std::size_t>(iters));
    for (int i = 0; i < warmup + iters; ++i) {
      for (std::size_t j = 0; j < size; ++j) msg[j] = static_cast<char>(i * 31 + j * 7);
      auto t0 = Clock::now();
      write_all(msg.data(), size, kStall);
      read_exact(back.data(), size, kStall);
      auto t1 = Clock::now();
      if (msg != back) throw std::runtime_error("the raw ssh echo came back wrong");
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    return us;
  }

  // `total` bytes written in `chunk`-sized writes by a thread of its own
  // while this one reads them back, with at most `window` bytes written and
  // not yet read back (as a caller with that many bytes of calls in flight
  // has); bytes echoed per second (each byte crosses the session both
  // ways), from the first write to the last read.
  double stream(std::size_t total, std::size_t chunk, std::size_t window) {
    std::vector<char> out(chunk);
    for (std::size_t j = 0; j < chunk; ++j) out[j] = static_cast<char>(j * 13 + 5);
    std::mutex mu;
    std::condition_variable cv;
    std::size_t got = 0;  // under mu: read back so far
    bool stop = false;    // under mu: the reader failed
    std::string writer_error;
    const auto t0 = Clock::now();
    std::thread writer([&] {
      try {
        for (std::size_t sent = 0; sent < total; sent += chunk) {
          {
            std::unique_lock lk(mu);
            if (!cv.wait_for(lk, kStall, [&] { return stop || sent + chunk <= got + window; }))
              throw std::runtime_error("the raw ssh stream stalled");
            if (stop) return;
          }
          write_all(out.data(), std::min(chunk, total - sent), kStall);
        }
      } catch (const std::exception& e) {
        writer_error = e.what();
      }
    });
    std::vector<char> in(chunk);
    std::size_t seen = 0;  // this thread's copy of `got`
    std::string reader_error;
    try {
      while (seen < total) {
        std::size_t n = read_some(in.data(), std::min(chunk, total - seen), kStall);
        for (std::size_t j = 0; j < n; ++j)  // cat gives back what went in, in order
          if (in[j] != out[(seen + j) % chunk]) throw std::runtime_error("the raw ssh stream came back wrong");
        seen += n;
        std::lock_guard lk(mu);
        got = seen;
        cv.notify_one();
      }
    } catch (const std::exception& e) {
      reader_error = e.what();
      {
        std::lock_guard lk(mu);
        stop = true;
        cv.notify_one();
      }
      // The writer may be waiting for room in the socket: with ssh gone its
      // writes fail with EPIPE at once.
      if (pid_ > 0) ::kill(pid_, SIGKILL);
    }
    writer.join();
    if (!reader_error.empty()) throw std::runtime_error(reader_error);
    if (!writer_error.empty()) throw std::runtime_error(writer_error);
    return static_cast<double>(total) / std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // EOF on ssh's stdin (cat then ends, and ssh with it).
  void close_input() {
    if (fd_ >= 0 && !input_closed_) ::shutdown(fd_, SHUT_WR);
    input_closed_ = true;
  }

 private:
  static constexpr std::chrono::milliseconds kStall{30000};  // no progress this long: give up

  [[noreturn]] void fail(const std::string& what, int err = errno) const {
    throw std::runtime_error(what + ": " + std::strerror(err));
  }
  std::string log_tail() const {
    std::string s;
    if (FILE* f = std::fopen(log_path_.c_str(), "r")) {
      char buf[2048];
      std::size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
      std::fclose(f);
    }
    return s.size() > 600 ? s.substr(s.size() - 600) : s;
  }
  // poll() for `events` on fd until `timeout`; throws on a timeout.
  void wait_fd(int fd, short events, std::chrono::milliseconds timeout) const {
    pollfd p{fd, events, 0};
    for (;;) {
      int r = ::poll(&p, 1, static_cast<int>(timeout.count()));
      if (r > 0) return;
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail("poll");
      throw std::runtime_error("the raw ssh session stalled for " + std::to_string(timeout.count()) +
                               " ms; ssh said: " + log_tail());
    }
  }
  void write_all(const char* p, std::size_t n, std::chrono::milliseconds timeout) {
    while (n > 0) {
      ssize_t w = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && errno == EAGAIN) {
        wait_fd(fd_, POLLOUT, timeout);
        continue;
      }
      if (w < 0) throw std::runtime_error(std::string("write to ssh: ") + std::strerror(errno) +
                                          "; ssh said: " + log_tail());
      p += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  std::size_t read_some(char* p, std::size_t n, std::chrono::milliseconds timeout) {
    for (;;) {
      wait_fd(fd_, POLLIN, timeout);
      ssize_t r = ::read(fd_, p, n);
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (r < 0) fail("read from ssh");
      if (r == 0) throw std::runtime_error("ssh ended the session; it said: " + log_tail());
      return static_cast<std::size_t>(r);
    }
  }
  void read_exact(char* p, std::size_t n, std::chrono::milliseconds timeout) {
    for (std::size_t got = 0; got < n;) got += read_some(p + got, n - got, timeout);
  }

  std::string log_path_;
  Clock::time_point started_;
  pid_t pid_ = -1;
  int fd_ = -1;  // our end of ssh's stdin and stdout
  bool input_closed_ = false;
};

}  // namespace spindle::bench
