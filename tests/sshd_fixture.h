// A real OpenSSH server for the tests and the benchmarks: Debian's
// /usr/sbin/sshd on 127.0.0.1 at a free port, with everything it needs made
// in a fresh private directory and removed with it.
//
//   std::string why;
//   auto sshd = spindle::testing_sshd::Sshd::start(why);  // nullptr: `why` says why
//   spindle::Child box = rt.ssh(sshd->host(), sshd->options());
//
// The directory holds a throwaway ed25519 host key, an authorized user key
// (and a second key that is not authorized, for the failure tests), the
// config, sshd's pid file and its log (LogLevel VERBOSE: what a failing test
// shows), and a known_hosts file naming the host key for [127.0.0.1]:PORT,
// so that the client still checks the host key: StrictHostKeyChecking=yes,
// nothing disabled. options() points the client at exactly these files
// (-F /dev/null: no ~/.ssh/config of whoever runs the tests) and sets
// remote_dir to <dir>/cache, so each fixture starts with no agent uploaded.
//
// sshd runs as the current user: as root it uses privilege separation and
// needs /run/sshd (made here if missing); as another user it runs without
// it and can only log that user in, which is all the tests need. It runs in
// a process group of its own, so that the destructor's SIGTERM (then
// SIGKILL after 2 s) reaches the per-connection processes too, and never
// this one. The port is found by binding port 0 and letting it go; another
// process may take it in between, so a start whose bind fails is retried on
// a new port.
//
// No gtest here: bench/ssh.cpp uses the same class. For gtest there is one
// macro, SPINDLE_SSHD_SKIP_OR_FAIL(why), which skips the test with the
// reason, or fails it when SPINDLE_REQUIRE_SSHD=1 (scripts/test.sh sets it:
// CI must run these tests, never skip them).
//
// Thread safety: one thread at a time. Every fd made here is O_CLOEXEC.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <spindle/ssh.h>

extern char** environ;

namespace spindle::testing_sshd {

inline constexpr const char* kSshd = "/usr/sbin/sshd";
inline constexpr const char* kKeygen = "/usr/bin/ssh-keygen";

// Whether the environment says these tests must run (SPINDLE_REQUIRE_SSHD=1).
inline bool required() {
  const char* v = std::getenv("SPINDLE_REQUIRE_SSHD");
  return v && std::strcmp(v, "1") == 0;
}

inline std::string errno_text(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

// The whole file ("" if it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The last `n` lines of a file, for error messages.
inline std::string tail_lines(const std::string& path, int n = 15) {
  std::string text = read_file(path);
  std::size_t pos = text.size();
  if (pos > 0 && text[pos - 1] == '\n') --pos;
  for (int i = 0; i < n && pos > 0; ++i) {
    std::size_t nl = text.rfind('\n', pos - 1);
    pos = nl == std::string::npos ? 0 : nl;
  }
  return text.substr(pos == 0 ? 0 : pos + 1);
}

// Starts `args` with stdin from /dev/null and stdout+stderr appended to
// `log`, in a process group of its own if `own_group`. Throws on failure.
inline pid_t spawn(const std::vector<std::string>& args, const std::string& log, bool own_group) {
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t attr;
  int rc = ::posix_spawn_file_actions_init(&fa);
  if (rc != 0) throw std::runtime_error(errno_text("posix_spawn_file_actions_init", rc));
  rc = ::posix_spawnattr_init(&attr);
  if (rc != 0) {
    ::posix_spawn_file_actions_destroy(&fa);
    throw std::runtime_error(errno_text("posix_spawnattr_init", rc));
  }
  // The opens happen in the child: no fd of ours to leak or close.
  if (rc == 0) rc = ::posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  if (rc == 0)
    rc = ::posix_spawn_file_actions_addopen(&fa, 2, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  if (rc == 0) rc = ::posix_spawn_file_actions_adddup2(&fa, 2, 1);
  if (rc == 0 && own_group) rc = ::posix_spawnattr_setpgroup(&attr, 0);
  if (rc == 0 && own_group) rc = ::posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  pid_t pid = -1;
  if (rc == 0) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    rc = ::posix_spawn(&pid, argv[0], &fa, &attr, argv.data(), environ);
  }
  ::posix_spawnattr_destroy(&attr);
  ::posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw std::runtime_error(errno_text("posix_spawn " + args[0], rc));
  return pid;
}

// waitpid that retries EINTR; `flags` as waitpid's. Returns its result.
inline pid_t wait_for(pid_t pid, int* status, int flags) {
  for (;;) {
    pid_t r = ::waitpid(pid, status, flags);
    if (r >= 0 || errno != EINTR) return r;
  }
}

// Runs a program to completion (output appended to `log`); throws with the
// log's tail unless it exits 0.
inline void run_ok(const std::vector<std::string>& args, const std::string& log) {
  pid_t pid = spawn(args, log, false);
  int st = 0;
  if (wait_for(pid, &st, 0) != pid) throw std::runtime_error(errno_text("waitpid " + args[0], errno));
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    throw std::runtime_error(args[0] + " failed (wait status " + std::to_string(st) + "): " + tail_lines(log));
}

// A port on 127.0.0.1 that was free a moment ago (0 if none could be had).
inline int free_port(std::string& why) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    why = errno_text("socket", errno);
    return 0;
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    why = errno_text("bind 127.0.0.1:0", errno);
  else if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    why = errno_text("getsockname", errno);
  else
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// Whether 127.0.0.1:port accepts a connection now.
inline bool accepts(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

class Sshd {
 public:
  // A running sshd, or nullptr with `why_not` saying why not.
  static std::unique_ptr<Sshd> start(std::string& why_not) {
    why_not.clear();
    if (::access(kSshd, X_OK) != 0) {
      why_not = errno_text(std::string(kSshd) + " is not there (apt-get install openssh-server)", errno);
      return nullptr;
    }
    if (::access(kKeygen, X_OK) != 0) {
      why_not = errno_text(std::string(kKeygen) + " is not there (apt-get install openssh-client)", errno);
      return nullptr;
    }
    std::unique_ptr<Sshd> s(new Sshd);
    try {
      s->prepare();
      // Another process may take the port between free_port() and sshd's
      // bind: then sshd exits at once, and a new port is tried.
      for (int attempt = 0; attempt < 5; ++attempt) {
        std::string why;
        int port = free_port(why);
        if (port == 0) {
          why_not = "no free port on 127.0.0.1: " + why;
          return nullptr;
        }
        if (s->launch(port, why_not)) return s;
        if (why_not.find("Address already in use") == std::string::npos) return nullptr;
      }
    } catch (const std::exception& e) {
      why_not = e.what();
    }
    return nullptr;
  }

  ~Sshd() {
    stop();
    if (!dir_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }
  Sshd(const Sshd&) = delete;
  Sshd& operator=(const Sshd&) = delete;

  std::string host() const { return "127.0.0.1"; }
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  const std::string& dir() const { return dir_; }
  std::string identity_file() const { return dir_ + "/user_key"; }  // authorized
  std::string unauthorized_key() const { return dir_ + "/other_key"; }
  std::string known_hosts() const { return dir_ + "/known_hosts"; }
  std::string log_path() const { return dir_ + "/sshd.log"; }
  std::string log() const { return read_file(log_path()); }
  std::string log_tail(int lines = 15) const { return tail_lines(log_path(), lines); }

  // The client options for this server: its port, the authorized key, the
  // known_hosts file with its host key checked, and a private agent cache.
  SshOptions options() const {
    SshOptions o;
    o.port = port_;
    o.identity_file = identity_file();
    o.ssh_args = {"-F", "/dev/null", "-o", "UserKnownHostsFile=" + known_hosts(),
                  "-o", "StrictHostKeyChecking=yes", "-o", "LogLevel=ERROR",
                  // A sanitized agent runs with the suite's sanitizer options
                  // (TSan's die_after_fork=0 lets it fork; sshd passes them
                  // on: AcceptEnv below).
                  "-o", "SendEnv=ASAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS"};
    o.remote_dir = dir_ + "/cache";
    o.agent = default_agent();
    return o;
  }
  // The agent binary tests run by default: the build's spindle-agent when
  // the build says where it is; empty (the library's own choice) otherwise.
  static std::string default_agent() {
#if defined(SPINDLE_AGENT_BINARY)
    return SPINDLE_AGENT_BINARY;
#elif defined(SPINDLE_BINARY_DIR)
    return SPINDLE_BINARY_DIR "/spindle-agent";
#else
    return {};
#endif
  }

  // SIGTERM to sshd's process group, SIGKILL after 2 s, then reaped.
  // Idempotent.
  void stop() noexcept {
    if (pid_ <= 0) return;
    ::kill(-pid_, SIGTERM);
    // Watch for the exit without reaping (WNOWAIT): while sshd is a zombie
    // its pid, and so its process group's id, cannot be reused, so the
    // SIGKILL below reaches only what is left of that group.
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (std::chrono::steady_clock::now() < until) {
      siginfo_t si{};
      int r = ::waitid(P_PID, static_cast<id_t>(pid_), &si, WEXITED | WNOHANG | WNOWAIT);
      if (r == 0 && si.si_pid == pid_) break;
      if (r != 0 && errno != EINTR) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ::kill(-pid_, SIGKILL);  // sshd if still up, and any connection's process
    int st = 0;
    wait_for(pid_, &st, 0);
    pid_ = -1;
  }

 private:
  Sshd() = default;

  // The directory, the keys and (as root) /run/sshd.
  void prepare() {
    char tmpl[] = "/tmp/spindle-sshd-XXXXXX";
    if (!::mkdtemp(tmpl)) throw std::runtime_error(errno_text("mkdtemp", errno));
    dir_ = tmpl;
    if (::geteuid() == 0 && ::mkdir("/run/sshd", 0755) != 0 && errno != EEXIST)
      throw std::runtime_error(errno_text("mkdir /run/sshd (sshd's privilege separation needs it)", errno));
    const std::string keylog = dir_ + "/keygen.log";
    for (const char* name : {"host_key", "user_key", "other_key"})
      run_ok({kKeygen, "-q", "-t", "ed25519", "-N", "", "-C", std::string("spindle-test-") + name, "-f",
              dir_ + "/" + name},
             keylog);
    write(dir_ + "/authorized_keys", read_file(dir_ + "/user_key.pub"));
  }

  // Writes the config and known_hosts for `port`, starts sshd and waits up
  // to 5 s until the port accepts. false with `why_not` if it did not.
  bool launch(int port, std::string& why_not) {
    port_ = port;
    const std::string cfg = dir_ + "/sshd_config";
    write(cfg, "Port " + std::to_string(port) +
                   "\nListenAddress 127.0.0.1"
                   "\nAddressFamily inet"
                   "\nHostKey " + dir_ + "/host_key" +
                   "\nAuthorizedKeysFile " + dir_ + "/authorized_keys" +
                   "\nPidFile " + dir_ + "/sshd.pid" +
                   "\nStrictModes no"
                   "\nUsePAM no"
                   "\nPermitRootLogin prohibit-password"
                   "\nPubkeyAuthentication yes"
                   "\nPasswordAuthentication no"
                   "\nKbdInteractiveAuthentication no"
                   "\nX11Forwarding no"
                   "\nPrintMotd no"
                   // The account's ~/.bashrc stays out of the sessions: bash
                   // reads it for an ssh command only at SHLVL < 2. The tests
                   // and bench_ssh then measure Spindle and ssh, not the
                   // developer's dotfiles (here a pyenv init, ~1 s a session).
                   "\nSetEnv SHLVL=1"
                   "\nAcceptEnv ASAN_OPTIONS UBSAN_OPTIONS TSAN_OPTIONS"
                   "\nLogLevel VERBOSE\n");
    // known_hosts: "[127.0.0.1]:PORT <type> <key>" (the .pub's comment dropped).
    std::istringstream pub(read_file(dir_ + "/host_key.pub"));
    std::string type, key;
    pub >> type >> key;
    if (type.empty() || key.empty()) throw std::runtime_error("cannot read " + dir_ + "/host_key.pub");
    write(known_hosts(), "[127.0.0.1]:" + std::to_string(port) + " " + type + " " + key + "\n");

    // sshd rewrites nothing in the log: a retry appends to it, so mark
    // where this attempt's lines start.
    const std::size_t log_start = log().size();
    pid_ = spawn({kSshd, "-D", "-e", "-f", cfg}, log_path(), true);
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    for (;;) {
      int st = 0;
      pid_t r = wait_for(pid_, &st, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        why_not = "sshd exited at start (wait status " + std::to_string(st) + "); its log:\n" +
                  log().substr(log_start);
        return false;
      }
      if (r < 0) {
        why_not = errno_text("waitpid sshd", errno);
        stop();
        return false;
      }
      if (accepts(port)) return true;
      if (std::chrono::steady_clock::now() >= until) {
        why_not = "sshd did not accept on 127.0.0.1:" + std::to_string(port) + " within 5 s; its log:\n" +
                  log_tail();
        stop();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  static void write(const std::string& path, const std::string& text) {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) throw std::runtime_error(errno_text("open " + path, errno));
    std::size_t done = 0;
    while (done < text.size()) {
      ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        int err = errno;
        ::close(fd);
        throw std::runtime_error(errno_text("write " + path, err));
      }
      done += static_cast<std::size_t>(n);
    }
    if (::close(fd) != 0) throw std::runtime_error(errno_text("close " + path, errno));
  }

  std::string dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace spindle::testing_sshd

// In a gtest test body or SetUp(): when sshd cannot start, skip with the
// reason, or fail with it under SPINDLE_REQUIRE_SSHD=1 (CI). Expands to a
// return, like GTEST_SKIP() and FAIL().
#define SPINDLE_SSHD_SKIP_OR_FAIL(why)                                                        \
  do {                                                                                        \
    if (::spindle::testing_sshd::required()) {                                                \
      FAIL() << "sshd cannot start, and SPINDLE_REQUIRE_SSHD=1 says it must: " << (why);      \
    } else {                                                                                  \
      GTEST_SKIP() << "sshd cannot start: " << (why) << " (SPINDLE_REQUIRE_SSHD=1 fails instead)"; \
    }                                                                                         \
  } while (0)
