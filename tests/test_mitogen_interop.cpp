// Interop with real Mitogen: two stock Mitogen 0.3 processes (python3-mitogen,
// run with /usr/bin/python3) connect to the real spindle-router binary with
// mitogen.unix.connect() and talk through it by context id. Each peer is
// tests/interop/mitogen_peer.py, driven line by line over pipes.
#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "router/reasons.h"
#include "tests/listener_test_util.h"

namespace spindle {
namespace test_mitogen_interop {

using namespace testutil;
using namespace std::chrono_literals;

constexpr const char* kPython = "/usr/bin/python3";

// A child process with its stdin and stdout on pipes; stderr goes to a file.
class PipedProcess {
 public:
  PipedProcess(const std::vector<std::string>& args, const std::string& stderr_path) {
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) throw Error("pipe2 failed");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addopen(&fa, 2, stderr_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    int rc = ::posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
    if (rc != 0) throw Error(std::string("posix_spawn: ") + errno_text(rc));
  }
  ~PipedProcess() {
    ::close(to_);
    ::close(from_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  void send(const std::string& line) {
    std::string l = line + "\n";
    ASSERT_EQ(::write(to_, l.data(), l.size()), static_cast<ssize_t>(l.size()));
  }
  // The next line starting with `prefix` (other lines are skipped), or "" on timeout/EOF.
  std::string expect(const std::string& prefix, std::chrono::milliseconds timeout = 30s) {
    auto until = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto nl = buf_.find('\n');
      while (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        if (line.rfind(prefix, 0) == 0) return line;
        nl = buf_.find('\n');
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
      char b[4096];
      ssize_t r = ::read(from_, b, sizeof b);
      if (r <= 0) return "";
      buf_.append(b, static_cast<std::size_t>(r));
    }
  }
  int wait_exit(std::chrono::milliseconds timeout = 30s) {
    auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return st;
      }
      std::this_thread::sleep_for(10ms);
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buf_;
};

std::vector<std::string> words(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> w;
  for (std::string s; in >> s;) w.push_back(s);
  return w;
}

TEST(MitogenInterop, TwoStockMitogenProcessesTalkThroughSpindleRouter) {
  std::string probe_out;
  TempDir dir;
  int probe = run_program({kPython, "-c", "import mitogen.unix"}, &probe_out, dir.path());
  ASSERT_TRUE(WIFEXITED(probe) && WEXITSTATUS(probe) == 0)
      << "python3-mitogen is missing (scripts/setup.sh installs it): " << probe_out;

  std::string sock = dir.path() + "/router.sock";
  RouterProcess router(SPINDLE_ROUTER_BINARY, sock);
  ASSERT_TRUE(router.wait_ready()) << router.log();
  std::string script = std::string(SPINDLE_SOURCE_DIR) + "/tests/interop/mitogen_peer.py";
  PipedProcess a({kPython, script, sock}, dir.path() + "/a.err");
  PipedProcess b({kPython, script, sock}, dir.path() + "/b.err");
  auto ra = words(a.expect("READY"));
  auto rb = words(b.expect("READY"));
  ASSERT_EQ(ra.size(), 4u) << router.log();
  ASSERT_EQ(rb.size(), 4u) << router.log();
  const std::string ida = ra[1], ha = ra[2], idb = rb[1], hb = rb[2];
  EXPECT_NE(ida, idb);
  EXPECT_EQ(ra[3], "0") << "the router is each client's parent";

  a.send("CALL " + idb + " " + hb + " hello from A");
  EXPECT_EQ(b.expect("GOT"), "GOT " + ida + " hello from A");
  EXPECT_EQ(a.expect("REPLY"), "REPLY ack:hello from A");
  b.send("CALL " + ida + " " + ha + " hello from B");
  EXPECT_EQ(a.expect("GOT"), "GOT " + idb + " hello from B");
  EXPECT_EQ(b.expect("REPLY"), "REPLY ack:hello from B");

  b.send("WATCH " + ida);
  ASSERT_FALSE(b.expect("WATCHING").empty());
  a.send("EXIT");
  int st = a.wait_exit();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << describe_wait_status(st);
  EXPECT_EQ(b.expect("DISCONNECT"), "DISCONNECT " + ida) << router.log();

  b.send("CALL 9999 1000 nobody home");
  std::string err = b.expect("CHANNELERROR");
  EXPECT_TRUE(contains(err, reason::kNoRoute)) << err;
  EXPECT_TRUE(contains(err, "9999")) << err;
  b.send("EXIT");
  st = b.wait_exit();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << describe_wait_status(st);
  EXPECT_EQ(WEXITSTATUS(router.stop(SIGTERM)), 0) << router.log();
}

}  // namespace test_mitogen_interop
}  // namespace spindle
