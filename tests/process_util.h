// Process-level helpers shared by the tests and the benchmarks (no gtest
// here): temp directories, raw socket reads, fd counts, and a real
// spindle-router process.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "broker/errors.h"
#include "router/unix_address.h"

extern char** environ;

namespace spindle::testutil {

// A private directory removed (with its contents) at the end of the test.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/spindle-test-XXXXXX";
    if (!::mkdtemp(tmpl)) throw Error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Reads until `n` bytes arrived, EOF, or `timeout`. Returns what arrived.
inline std::string read_some(int fd, std::size_t n, std::chrono::milliseconds timeout) {
  std::string out;
  auto until = std::chrono::steady_clock::now() + timeout;
  while (out.size() < n) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buf[4096];
    ssize_t r = ::read(fd, buf, std::min(sizeof buf, n - out.size()));
    if (r <= 0) break;
    out.append(buf, static_cast<std::size_t>(r));
  }
  return out;
}

// Whether the peer closed `fd` (EOF or reset) within `timeout`.
inline bool closed_by_peer(int fd, std::chrono::milliseconds timeout) {
  auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
    char buf[256];
    ssize_t r = ::read(fd, buf, sizeof buf);
    if (r == 0 || (r < 0 && errno == ECONNRESET)) return true;
  }
}

// Open fds of `pid` (0: this process), not counting the one used to list them.
inline std::size_t count_open_fds(pid_t pid = 0) {
  std::string dir = pid ? "/proc/" + std::to_string(pid) + "/fd" : "/proc/self/fd";
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw Error("cannot open " + dir + ": " + errno_text(errno));
  std::size_t n = 0;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return pid ? n : n - 1;  // our own listing fd is in /proc/self/fd
}

// A real spindle-router process; stderr goes to <dir>/router.log. `wrapper`
// runs it through a program that execs it in place, e.g. {"prlimit",
// "--nofile=32:32"}, so pid() is still the router's.
class RouterProcess {
 public:
  RouterProcess(const std::string& binary, const std::string& socket,
                std::vector<std::string> extra = {}, std::string log_path = {},
                std::vector<std::string> wrapper = {})
      : socket_(socket), log_path_(log_path.empty() ? socket + ".log" : std::move(log_path)) {
    std::vector<std::string> args = std::move(wrapper);
    args.insert(args.end(), {binary, "--socket", socket});
    args.insert(args.end(), extra.begin(), extra.end());
    pid_ = spawn(args, log_path_);
  }
  ~RouterProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  // Waits until the socket accepts connections.
  bool wait_ready(std::chrono::milliseconds timeout = std::chrono::seconds(20)) const {
    auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      try {
        ::close(connect_unix(UnixAddress::parse(socket_)));
        return true;
      } catch (const Error&) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    return false;
  }
  // Sends `sig` and returns the wait status (or -1 if it did not exit in time).
  int stop(int sig = SIGTERM, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    ::kill(pid_, sig);
    return wait(timeout);
  }
  int wait(std::chrono::milliseconds timeout) {
    auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      int st = 0;
      pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return st;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  std::string log() const {
    std::string s;
    if (FILE* f = std::fopen(log_path_.c_str(), "r")) {
      char buf[4096];
      std::size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
      std::fclose(f);
    }
    return s;
  }

  // posix_spawn with stdout and stderr appended to `log_path`.
  static pid_t spawn(const std::vector<std::string>& args, const std::string& log_path) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 2, log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    posix_spawn_file_actions_adddup2(&fa, 2, 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    pid_t pid = -1;
    int rc = ::posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) throw Error(std::string("posix_spawn ") + args[0] + ": " + errno_text(rc));
    return pid;
  }

 private:
  std::string socket_;
  std::string log_path_;
  pid_t pid_ = -1;
};

// Runs a program to completion; returns its wait status and output.
inline int run_program(const std::vector<std::string>& args, std::string* output,
                       const std::string& scratch_dir) {
  std::string log = scratch_dir + "/run.out";
  ::unlink(log.c_str());
  pid_t pid = RouterProcess::spawn(args, log);
  int st = 0;
  ::waitpid(pid, &st, 0);
  if (output) {
    output->clear();
    if (FILE* f = std::fopen(log.c_str(), "r")) {
      char buf[4096];
      std::size_t n;
      while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) output->append(buf, n);
      std::fclose(f);
    }
  }
  return st;
}

}  // namespace spindle::testutil
