// The spindle-router and spindle-ctl programs as an operator meets them:
// options and exit codes, graceful SIGTERM, an address already in use, the
// private default directory, systemd socket activation, and spindle-ctl's
// answers. Every test runs the real binaries.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "router/reasons.h"
#include "services/builtin.h"
#include "services/client.h"
#include "tests/listener_test_util.h"
#include "tools/options.h"

namespace spindle {
namespace test_router_program {

using namespace testutil;
using namespace std::chrono_literals;

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

TEST(RouterProgram, HelpVersionAndUsageErrors) {
  TempDir dir;
  std::string out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_ROUTER_BINARY, "--help"}, &out, dir.path())), 0);
  EXPECT_TRUE(contains(out, "--max-message-size")) << out;
  EXPECT_TRUE(contains(out, "exit codes")) << out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_ROUTER_BINARY, "--version"}, &out, dir.path())), 0);
  EXPECT_TRUE(contains(out, "spindle-router")) << out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_ROUTER_BINARY, "--bogus"}, &out, dir.path())), 2);
  EXPECT_TRUE(contains(out, "unknown option '--bogus'")) << out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_ROUTER_BINARY, "--max-message-size", "12Q"}, &out, dir.path())), 2);
  EXPECT_TRUE(contains(out, "--max-message-size")) << out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_ROUTER_BINARY, "--handshake-timeout"}, &out, dir.path())), 2);
  EXPECT_TRUE(contains(out, "needs a value")) << out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_ROUTER_BINARY, "--log-level", "loud"}, &out, dir.path())), 2);
  EXPECT_EQ(exit_code(run_program({SPINDLE_ROUTER_BINARY, "--wait-spin", "2000000"}, &out, dir.path())), 2);
  EXPECT_TRUE(contains(out, "--wait-spin: '2000000' is out of range (0 to 1000000)")) << out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_CTL_BINARY, "frobnicate"}, &out, dir.path())), 2);
  EXPECT_TRUE(contains(out, "unknown command")) << out;
}

// Durations are finite numbers: from_chars reads "nan" and "inf", and NaN
// passed the range check (every comparison with it is false).
TEST(RouterProgram, ADurationIsAFiniteNumber) {
  using tools::parse_duration;
  EXPECT_EQ(parse_duration("--grace", "500ms"), 500ms);
  EXPECT_EQ(parse_duration("--grace", "1.5"), 1500ms);
  EXPECT_EQ(parse_duration("--grace", "2s"), 2000ms);
  EXPECT_EQ(parse_duration("--grace", "0"), 0ms);
  EXPECT_EQ(parse_duration("--grace", "86400s"), 86400000ms);
  for (const char* bad : {"nan", "NaN", "nans", "nanms", "-nan", "nan(1)", "inf", "infs", "-inf", "infinity",
                          "1e999", "-1s", "86401s", "5m", "s", ""}) {
    try {
      parse_duration("--grace", bad);
      ADD_FAILURE() << "'" << bad << "' was taken as a duration";
    } catch (const tools::UsageError& e) {
      EXPECT_EQ(std::string(e.what()),
                fmt::format("--grace: '{}' is not a duration (e.g. 500ms, 10s; at most a day)", bad));
    }
  }
  TempDir dir;
  std::string out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_CTL_BINARY, "--socket", dir.path() + "/nothing.sock", "--timeout",
                                   "nan", "ping"}, &out, dir.path())), 2) << out;
  EXPECT_TRUE(contains(out, "--timeout: 'nan' is not a duration")) << out;
}

// spindle-ctl's usage errors: a --timeout of 0, and words its command does
// not take, are refused (exit 2) with what was wrong, never ignored.
TEST(RouterProgram, SpindleCtlRefusesAZeroTimeoutAndExtraWords) {
  TempDir dir;
  const std::string sock = dir.path() + "/nothing.sock";
  std::string out;
  auto ctl = [&](std::vector<std::string> args) {
    args.insert(args.begin(), SPINDLE_CTL_BINARY);
    return exit_code(run_program(args, &out, dir.path()));
  };
  for (const char* zero : {"0", "0s", "0ms", "0.4ms"}) {
    EXPECT_EQ(ctl({"--socket", sock, "--timeout", zero, "ping"}), 2) << zero << ": " << out;
    EXPECT_TRUE(contains(out, fmt::format("spindle-ctl: --timeout: '{}' must be more than 0", zero))) << out;
  }
  EXPECT_EQ(ctl({"--socket", sock, "--timeout=0", "ping"}), 2) << out;
  EXPECT_TRUE(contains(out, "--timeout: '0' must be more than 0")) << out;
  EXPECT_EQ(ctl({"--socket", sock, "stats", "foo"}), 2) << out;
  EXPECT_TRUE(contains(out, "stats: unexpected argument 'foo'")) << out;
  EXPECT_EQ(ctl({"--socket", sock, "stats", "--raw", "--raw"}), 2) << out;
  EXPECT_TRUE(contains(out, "stats: unexpected argument '--raw'")) << out;
  EXPECT_EQ(ctl({"--socket", sock, "ping", "a", "b"}), 2) << out;
  EXPECT_TRUE(contains(out, "ping: unexpected argument 'b'")) << out;
  EXPECT_TRUE(contains(out, "see spindle-ctl --help")) << out;
  EXPECT_EQ(ctl({"--socket=" + sock, "--help=x"}), 2) << out;
  EXPECT_TRUE(contains(out, "--help takes no value")) << out;
  EXPECT_EQ(ctl({"--socket", sock, "--timeout"}), 2) << out;
  EXPECT_TRUE(contains(out, "--timeout needs a value")) << out;
  EXPECT_EQ(ctl({"--socket=", "--bogus=1", "ping"}), 2) << out;
  EXPECT_TRUE(contains(out, "unknown option '--bogus'")) << out;
}

TEST(RouterProgram, SigtermDrainsTellsClientsAndExitsZero) {
  TempDir dir;
  std::string sock = dir.path() + "/r.sock";
  RouterProcess router(SPINDLE_ROUTER_BINARY, sock);
  ASSERT_TRUE(router.wait_ready()) << router.log();
  auto client = connect(sock);
  std::promise<std::string> lost;
  client->router().on_disconnect(0, [&](const std::string& why) { lost.set_value(why); });
  int st = router.stop(SIGTERM);
  EXPECT_EQ(exit_code(st), 0) << describe_wait_status(st) << router.log();
  // The client was told: its link to the router ended and its broker shut down.
  client->broker().wait_for_shutdown_request();
  EXPECT_FALSE(client->router().parent_connected());
  auto why = lost.get_future();
  ASSERT_EQ(why.wait_for(10s), std::future_status::ready);
  EXPECT_TRUE(contains(why.get(), reason::kPeerDisconnected));
  struct stat sb {};
  EXPECT_NE(::stat(sock.c_str(), &sb), 0) << "the socket file was left behind";
  EXPECT_TRUE(contains(router.log(), "received SIGTERM: shutting down gracefully")) << router.log();
}

TEST(RouterProgram, AnAddressInUseExitsThree) {
  TempDir dir;
  std::string sock = dir.path() + "/r.sock";
  RouterProcess first(SPINDLE_ROUTER_BINARY, sock);
  ASSERT_TRUE(first.wait_ready()) << first.log();
  std::string out;
  int st = run_program({SPINDLE_ROUTER_BINARY, "--socket", sock}, &out, dir.path());
  EXPECT_EQ(exit_code(st), 3) << out;
  EXPECT_TRUE(contains(out, "another process is listening")) << out;
  // The live router was not disturbed.
  EXPECT_EQ(services::call_text(connect(sock)->router_context(), "ping", "echo", "still", 10s), "still");
}

TEST(RouterProgram, DefaultAddressLivesInAPrivateDirectory) {
  TempDir dir;
  ::setenv("XDG_RUNTIME_DIR", dir.path().c_str(), 1);
  std::string out;
  pid_t pid = RouterProcess::spawn({SPINDLE_ROUTER_BINARY}, dir.path() + "/router.log");
  std::string sock = dir.path() + "/spindle/router.sock";
  bool up = false;
  for (int i = 0; i < 500 && !up; ++i) {
    try {
      ::close(connect_unix(UnixAddress{sock, false}));
      up = true;
    } catch (const Error&) {
      std::this_thread::sleep_for(20ms);
    }
  }
  ::unsetenv("XDG_RUNTIME_DIR");
  EXPECT_TRUE(up);
  struct stat sb {};
  ASSERT_EQ(::stat((dir.path() + "/spindle").c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 0777, 0700u);
  ::kill(pid, SIGTERM);
  int st = 0;
  ::waitpid(pid, &st, 0);
  EXPECT_EQ(exit_code(st), 0);
}

TEST(RouterProgram, RefusesADefaultDirectoryOthersCanReach) {
  TempDir dir;
  ASSERT_EQ(::mkdir((dir.path() + "/spindle").c_str(), 0755), 0);
  ASSERT_EQ(::chmod((dir.path() + "/spindle").c_str(), 0755), 0);
  ::setenv("XDG_RUNTIME_DIR", dir.path().c_str(), 1);
  std::string out;
  int st = run_program({SPINDLE_ROUTER_BINARY}, &out, dir.path());
  ::unsetenv("XDG_RUNTIME_DIR");
  EXPECT_EQ(exit_code(st), 1) << out;
  EXPECT_TRUE(contains(out, "other users could reach the socket")) << out;
}

TEST(RouterProgram, AcceptsASocketFromSystemd) {
  TempDir dir;
  std::string path = dir.path() + "/activated.sock";
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un sa{};
  socklen_t len = UnixAddress{path, false}.to_sockaddr(sa);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), len), 0);
  ASSERT_EQ(::listen(fd, 16), 0);
  std::string log = dir.path() + "/router.log";
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // what systemd does: fd 3, LISTEN_PID = the service's own pid
    int logfd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    // dup2 onto itself would keep FD_CLOEXEC: clear it explicitly.
    if ((fd == 3 ? ::fcntl(3, F_SETFD, 0) : ::dup2(fd, 3)) < 0 || ::dup2(logfd, 2) < 0) ::_exit(99);
    ::setenv("LISTEN_PID", std::to_string(::getpid()).c_str(), 1);
    ::setenv("LISTEN_FDS", "1", 1);
    ::execl(SPINDLE_ROUTER_BINARY, SPINDLE_ROUTER_BINARY, "--socket", "@not-used", nullptr);
    ::_exit(98);
  }
  ::close(fd);
  std::string got;
  for (int i = 0; i < 500 && got.empty(); ++i) {
    try {
      got = services::call_text(connect(path)->router_context(), "ping", "echo", "activated", 10s);
    } catch (const Error&) {
      std::this_thread::sleep_for(20ms);
    }
  }
  // The router's log writer is a thread of its own: the line may land a
  // moment after the answer (read at once, it failed once in a full run).
  std::string text;
  for (int i = 0; i < 250 && !contains(text, "(from systemd)"); ++i) {
    if (i) std::this_thread::sleep_for(20ms);
    if (FILE* f = std::fopen(log.c_str(), "r")) {
      char buf[8192];
      text.assign(buf, std::fread(buf, 1, sizeof buf, f));
      std::fclose(f);
    }
  }
  EXPECT_EQ(got, "activated") << text;
  EXPECT_TRUE(contains(text, "(from systemd)")) << text;
  ::kill(pid, SIGTERM);
  int st = 0;
  ::waitpid(pid, &st, 0);
  EXPECT_EQ(exit_code(st), 0);
  struct stat sb {};
  EXPECT_EQ(::stat(path.c_str(), &sb), 0) << "systemd's socket file must be left to systemd";
}

TEST(RouterProgram, SpindleCtlPrintsStatsAndPings) {
  TempDir dir;
  std::string sock = dir.path() + "/r.sock";
  RouterProcess router(SPINDLE_ROUTER_BINARY, sock);
  ASSERT_TRUE(router.wait_ready()) << router.log();
  auto a = connect(sock);
  a->router().send(Message::make(0, 2999, Payload::copy_of("to nobody"), kEncRaw));  // counted
  std::string out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_CTL_BINARY, "--socket", sock, "ping", "hello"}, &out, dir.path())), 0);
  EXPECT_TRUE(contains(out, "hello: answered in")) << out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_CTL_BINARY, "--socket", sock, "stats", "--raw"}, &out, dir.path())), 0);
  EXPECT_TRUE(contains(out, "router id=0")) << out;
  EXPECT_TRUE(contains(out, fmt::format("client id={} name=client-{}.pid{}", a->id(), a->id(), ::getpid()))) << out;
  EXPECT_TRUE(contains(out, "queued_bytes=")) << out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_CTL_BINARY, "--socket", sock, "stats"}, &out, dir.path())), 0);
  EXPECT_TRUE(contains(out, "msgs in")) << out;
  // What the router holds for its clients: a's own route is route state,
  // in the last column of a's row.
  EXPECT_TRUE(contains(out, "bytes of route state")) << out;
  std::istringstream rows(out);
  std::string a_row;
  for (std::string line; std::getline(rows, line);)
    if (contains(line, fmt::format("client-{}.pid", a->id()))) a_row = line;
  EXPECT_TRUE(a_row.ends_with(fmt::format(" {}", Router::kRouteStateBytes))) << out;
  EXPECT_EQ(exit_code(run_program({SPINDLE_CTL_BINARY, "--socket", dir.path() + "/nothing.sock", "stats"}, &out, dir.path())), 1);
  EXPECT_TRUE(contains(out, "cannot connect")) << out;
  // "--name=value", as spindle-router takes its options.
  EXPECT_EQ(exit_code(run_program({SPINDLE_CTL_BINARY, "--socket=" + sock, "--timeout=5s", "ping", "eq"}, &out,
                                  dir.path())), 0) << out;
  EXPECT_TRUE(contains(out, "eq: answered in")) << out;
}

}  // namespace test_router_program
}  // namespace spindle
