// Runtime::ssh() against a real OpenSSH server (issue #15): Debian's sshd on
// 127.0.0.1, started per test by tests/sshd_fixture.h with throwaway keys,
// host keys checked, and a fresh agent cache, so that every test sees the
// bootstrap from the start. Without sshd the tests skip and say why, and
// fail instead under SPINDLE_REQUIRE_SSHD=1 (scripts/test.sh, so CI).
//
// What is asserted is what a user would see: the bytes that come back, the
// files the upload leaves in the cache (their names, modes, inodes), the
// text and the promptness of each failure, the memory both ends used for a
// 64 MiB payload, and the log records of the session's stderr. Where the
// agent must do something the built-in spindle-agent cannot (sleep, send
// through a Sender, write to stderr), the test runs helpers/ssh_test_agent.
//
// Each test bounds its waits (Context::with_timeout, future::wait_for), so
// a hang fails in seconds instead of stalling the suite.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <string_view>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include <gtest/gtest.h>

#include <spindle/spindle.h>

#include "router/ssh_bootstrap.h"
#include "tests/fds_test_util.h"
#include "tests/router_probe.h"
#include "tests/sshd_fixture.h"

namespace test_ssh {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Info = std::tuple<std::string, long, std::string, long>;  // host, pid, machine, peak RSS

inline constexpr spindle::method<std::string(std::string)> echo{"spindle.echo"};
inline constexpr spindle::method<Info()> info{"spindle.info"};
// helpers/ssh_test_agent's functions.
inline constexpr spindle::method<long(long)> sleep_ms{"test.sleep_ms"};
inline constexpr spindle::method<long(spindle::Sender<long>, long)> count_to{"test.count_to"};
inline constexpr spindle::method<bool(std::string)> stderr_line{"test.stderr_line"};
// spindle.echo's name with an fd among the arguments: the router must
// refuse it before it leaves this host.
inline constexpr spindle::method<std::string(spindle::UniqueFd, std::string)> echo_fd{"spindle.echo"};

const char* const kTestAgent = SPINDLE_HELPER_DIR "/ssh_test_agent";

// ASan keeps freed blocks in quarantine and TSan touches shadow memory, so
// their peak RSS says nothing about copies: the memory bounds hold only in
// plain builds.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

using spindle::testing_sshd::read_file;

std::string sha256_of(const std::string& path) {
  std::string cmd = "sha256sum < '" + path + "'";
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return "popen failed";
  char buf[65] = {};
  std::size_t n = std::fread(buf, 1, 64, p);
  ::pclose(p);
  return std::string(buf, n);
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (auto& e : std::filesystem::directory_iterator(dir, ec)) out.push_back(e.path().filename());
  return out;
}

// A field of /proc/self/status in KiB ("VmHWM", "VmRSS"), -1 if missing.
long status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::atol(line.c_str() + field.size() + 1);
  return -1;
}

// The parent pid and the command name (comm) of a process, from /proc.
std::pair<long, std::string> parent_and_comm(long pid) {
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto open = stat.find('('), close = stat.rfind(')');
  if (open == std::string::npos || close == std::string::npos) return {-1, ""};
  long ppid = -1;
  std::sscanf(stat.c_str() + close + 2, "%*c %ld", &ppid);
  return {ppid, stat.substr(open + 1, close - open - 1)};
}

// Processes whose parent is `ppid` and whose comm is `comm`.
std::vector<long> children_named(long ppid, const std::string& comm) {
  std::vector<long> out;
  std::error_code ec;
  for (auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    auto [parent, c] = parent_and_comm(std::stol(name));
    if (parent == ppid && c == comm) out.push_back(std::stol(name));
  }
  return out;
}

using spindle::testutil::Pipe;
using spindle::testutil::reset_peak_rss;
constexpr auto make_pipe = spindle::testutil::make_owned_pipe;

// Whether `fd` reads EOF within `timeout` (every write end closed).
bool eof_within(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return false;
  char c;
  return ::read(fd, &c, 1) == 0;
}

class Ssh : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    sshd_ = spindle::testing_sshd::Sshd::start(why);
    if (!sshd_) SPINDLE_SSHD_SKIP_OR_FAIL(why);
  }
  void TearDown() override {
    spindle::reset_log_handler();
    if (sshd_ && HasFailure()) std::fprintf(stderr, "--- sshd's log ---\n%s\n", sshd_->log_tail(40).c_str());
  }

  spindle::SshOptions options() const { return sshd_->options(); }
  spindle::Child start(spindle::SshOptions o) { return rt.ssh(sshd_->host(), std::move(o)); }
  std::string cache() const { return sshd_->dir() + "/cache"; }

  // Declared first, destroyed last: the runtime stops its ssh children
  // while sshd still serves them.
  std::unique_ptr<spindle::testing_sshd::Sshd> sshd_;
  spindle::Runtime rt;
};

TEST_F(Ssh, StartsAContextAndCallsIt) {
  spindle::Child box = start(options());
  auto ctx = box.with_timeout(10s);
  std::string bytes("nul\0in the middle\0", 19);
  for (int c = 0; c < 256; ++c) bytes.push_back(static_cast<char>(c));
  EXPECT_EQ(ctx.call(echo, bytes), bytes);

  auto [host, pid, machine, peak] = ctx.call(info);
  utsname u{};
  ASSERT_EQ(::uname(&u), 0);
  EXPECT_EQ(machine, u.machine);
  EXPECT_EQ(host, u.nodename);
  EXPECT_GT(pid, 0);
  EXPECT_NE(pid, static_cast<long>(::getpid()));
  EXPECT_GT(peak, 0);
  // The remote agent is a process of sshd's, not of ours.
  EXPECT_NE(parent_and_comm(pid).first, static_cast<long>(::getpid()));

  // The Child's pid is the local ssh client, a child of this process.
  ASSERT_GT(box.pid(), 0);
  auto [ppid, comm] = parent_and_comm(box.pid());
  EXPECT_EQ(comm, "ssh");
  EXPECT_EQ(ppid, static_cast<long>(::getpid()));
  EXPECT_EQ(box.stop(), 0);
}

// The one cache entry after a start: spindle-agent-<sha256 of the agent>,
// mode 0700, nothing else (no temporary file left). Returns its stat.
struct stat expect_one_cached_agent(const std::string& cache, const std::string& agent) {
  struct stat st {};
  std::vector<std::string> names = entries(cache);
  EXPECT_EQ(names.size(), 1u) << "cache entries: " << ::testing::PrintToString(names);
  if (names.empty()) return st;
  EXPECT_TRUE(std::regex_match(names[0], std::regex("spindle-agent-[0-9a-f]{64}"))) << names[0];
  EXPECT_EQ(names[0], "spindle-agent-" + sha256_of(agent));
  const std::string path = cache + "/" + names[0];
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  EXPECT_TRUE(read_file(path) == read_file(agent)) << path << " is not the agent's bytes";
  return st;
}

TEST_F(Ssh, UploadsTheAgentOnceThenReusesIt) {
  spindle::SshOptions o = options();
  ASSERT_FALSE(std::filesystem::exists(cache())) << "the fixture's cache must start empty";
  {
    spindle::Child box = start(o);
    EXPECT_EQ(box.with_timeout(10s).call(echo, std::string("first")), "first");
  }
  struct stat first = expect_one_cached_agent(cache(), o.agent);
  {
    spindle::Child box = start(o);
    EXPECT_EQ(box.with_timeout(10s).call(echo, std::string("second")), "second");
  }
  struct stat again = expect_one_cached_agent(cache(), o.agent);
  EXPECT_EQ(again.st_ino, first.st_ino) << "the cached agent was written again";
  EXPECT_EQ(again.st_mtim.tv_sec, first.st_mtim.tv_sec);
  EXPECT_EQ(again.st_mtim.tv_nsec, first.st_mtim.tv_nsec);
}

// Puts `bytes` (mode 0700) in place of the cached agent, through a rename:
// the old agent may still be running (ETXTBSY on a write in place).
void replace_cached_agent(const std::string& cache, const std::string& bytes) {
  std::vector<std::string> names = entries(cache);
  ASSERT_EQ(names.size(), 1u);
  const std::string tmp = cache + "/corrupt.tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good());
  }
  ASSERT_EQ(::chmod(tmp.c_str(), 0700), 0);
  ASSERT_EQ(::rename(tmp.c_str(), (cache + "/" + names[0]).c_str()), 0);
}

TEST_F(Ssh, ReplacesATruncatedCachedAgent) {
  spindle::SshOptions o = options();
  { spindle::Child box = start(o); }
  const std::string agent = read_file(o.agent);
  ASSERT_GT(agent.size(), 1000u);
  replace_cached_agent(cache(), agent.substr(0, agent.size() / 2));
  spindle::Child box = start(o);
  EXPECT_EQ(box.with_timeout(10s).call(echo, std::string("after truncation")), "after truncation");
  expect_one_cached_agent(cache(), o.agent);
}

// Same size, other bytes: a shell script that would leave a mark if the
// bootstrap ran it. Only the checksum can tell.
TEST_F(Ssh, ReplacesAnOverwrittenCachedAgentWithoutRunningIt) {
  spindle::SshOptions o = options();
  { spindle::Child box = start(o); }
  const std::string agent = read_file(o.agent);
  const std::string mark = sshd_->dir() + "/corrupt-agent-ran";
  std::string script = "#!/bin/sh\ntouch " + mark + "\nexit 1\n#";
  ASSERT_LT(script.size(), agent.size());
  script.resize(agent.size(), 'x');
  replace_cached_agent(cache(), script);
  spindle::Child box = start(o);
  EXPECT_EQ(box.with_timeout(10s).call(echo, std::string("after overwrite")), "after overwrite");
  EXPECT_FALSE(std::filesystem::exists(mark)) << "the corrupted cached agent was run";
  expect_one_cached_agent(cache(), o.agent);
}

// What the bootstrap answers when the cache is not ours alone: the error
// that ssh() throws (its exit status and the script's line).
std::string refusal(spindle::Runtime& rt, const std::string& host, const spindle::SshOptions& o) {
  try {
    spindle::Child box = rt.ssh(host, o);
    ADD_FAILURE() << "ssh() ran an agent from a cache that is not ours alone";
    return {};
  } catch (const spindle::Error& e) {
    return e.what();
  }
}

// A cache another user can write to could have its agent swapped between
// the checksum and the exec: the bootstrap refuses it, before running or
// uploading anything, and says how to fix it.
TEST_F(Ssh, RefusesACacheOtherUsersCanWriteTo) {
  spindle::SshOptions o = options();
  { spindle::Child box = start(o); }
  ASSERT_EQ(::chmod(cache().c_str(), 0777), 0);
  std::string what = refusal(rt, sshd_->host(), o);
  EXPECT_NE(what.find("other users can write to " + cache() + " (chmod go-w it)"), std::string::npos) << what;
  EXPECT_NE(what.find(std::to_string(spindle::kBootstrapUnsafeCache)), std::string::npos) << what;

  // The same for a directory above it (not sticky, as /tmp is).
  ASSERT_EQ(::chmod(cache().c_str(), 0700), 0);
  const std::string open_dir = sshd_->dir() + "/shared";
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);
  o.remote_dir = open_dir + "/cache";
  what = refusal(rt, sshd_->host(), o);
  EXPECT_NE(what.find("other users can write to " + open_dir + " "), std::string::npos) << what;
  EXPECT_FALSE(std::filesystem::exists(o.remote_dir + "/spindle-agent-" +
                                       spindle::AgentImage::load(o.agent)->sha256));

  // Sticky, as /tmp is: others cannot rename or remove what is ours there.
  ASSERT_EQ(::chmod(open_dir.c_str(), 01777), 0);
  spindle::Child box = start(o);
  EXPECT_EQ(box.with_timeout(10s).call(echo, std::string("under a sticky dir")), "under a sticky dir");
}

TEST_F(Ssh, RefusesACacheThatBelongsToAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "giving the cache to another uid needs root";
  spindle::SshOptions o = options();
  { spindle::Child box = start(o); }
  ASSERT_EQ(::chown(cache().c_str(), 65534, static_cast<gid_t>(-1)), 0);
  std::string what = refusal(rt, sshd_->host(), o);
  EXPECT_NE(what.find(cache() + " belongs to uid 65534, not to uid 0"), std::string::npos) << what;
}

// A symlink in the cache is not the file that was checked: its target can
// change after the checksum. The bootstrap uploads a regular file in its place.
TEST_F(Ssh, ReplacesACachedAgentThatIsASymlink) {
  spindle::SshOptions o = options();
  { spindle::Child box = start(o); }
  std::vector<std::string> names = entries(cache());
  ASSERT_EQ(names.size(), 1u);
  const std::string cached = cache() + "/" + names[0], elsewhere = sshd_->dir() + "/elsewhere";
  ASSERT_EQ(::rename(cached.c_str(), elsewhere.c_str()), 0);
  ASSERT_EQ(::symlink(elsewhere.c_str(), cached.c_str()), 0);
  spindle::Child box = start(o);
  EXPECT_EQ(box.with_timeout(10s).call(echo, std::string("after symlink")), "after symlink");
  struct stat st {};
  ASSERT_EQ(::lstat(cached.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the symlink is still the cached agent";
  expect_one_cached_agent(cache(), o.agent);
}

TEST_F(Ssh, AnUnauthorizedKeyFailsPromptlyWithSshsStatus) {
  spindle::SshOptions o = options();
  o.identity_file = sshd_->unauthorized_key();
  o.connect_timeout = 10s;
  auto t0 = Clock::now();
  try {
    spindle::Child box = start(o);
    ADD_FAILURE() << "ssh() started a context with a key sshd does not accept";
  } catch (const spindle::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("255"), std::string::npos) << what;
    EXPECT_NE(what.find("Permission denied"), std::string::npos) << what;
  }
  EXPECT_LT(seconds_since(t0), 4.0) << "a failed login must not wait for connect_timeout (or a prompt)";
}

// The bootstrap compares the remote `uname -s -m` with the one the agent was
// built for, which this process passes on its command line. A stand-in for
// ssh changes the machine it passes, as a parent of another architecture
// would: the remote side must refuse before anything is uploaded, and ssh()
// must say which architectures differ.
TEST_F(Ssh, ARemoteHostOfAnotherArchitectureIsAClearErrorAndGetsNoUpload) {
  utsname u{};
  ASSERT_EQ(::uname(&u), 0);
  const std::string machine = u.machine, other = std::string("not-") + u.machine;
  const std::string wrapper = sshd_->dir() + "/ssh-from-another-machine";
  {
    std::ofstream out(wrapper, std::ios::trunc);
    out << "#!/bin/bash\n"
           "# ssh, with the agent's machine in the bootstrap command (the last word) replaced\n"
           "cmd=\"${@: -1}\"\n"
           "exec ssh \"${@:1:$#-1}\" \"${cmd/\\'" << machine << "\\' /\\'" << other << "\\' }\"\n";
    ASSERT_TRUE(out.good());
  }
  ASSERT_EQ(::chmod(wrapper.c_str(), 0700), 0);
  spindle::SshOptions o = options();
  o.ssh_program = wrapper;
  auto t0 = Clock::now();
  try {
    spindle::Child box = start(o);
    ADD_FAILURE() << "ssh() started a context on a host of another architecture";
  } catch (const spindle::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(fmt::format("the remote host is {} {}, but the agent is built for {} {}",
                                    u.sysname, machine, u.sysname, other)),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("97"), std::string::npos) << "no exit status in: " << what;
  }
  EXPECT_LT(seconds_since(t0), 10.0);
  EXPECT_TRUE(entries(cache()).empty()) << "something was uploaded: "
                                        << ::testing::PrintToString(entries(cache()));
}

std::size_t occurrences(const std::string& text, std::string_view what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// SshOptions::control_path: the first context's ssh becomes the master, and
// the second context's session runs over the same connection, so sshd
// authenticates once and opens two sessions.
TEST_F(Ssh, TwoContextsShareOneControlMaster) {
  spindle::SshOptions o = options();
  o.control_path = sshd_->dir() + "/master.sock";
  {
    spindle::Child a = start(o);
    EXPECT_EQ(a.with_timeout(10s).call(echo, std::string("a")), "a");
    struct stat st {};
    ASSERT_EQ(::stat(o.control_path.c_str(), &st), 0) << "no master socket at " << o.control_path;
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    spindle::Child b = start(o);
    EXPECT_EQ(b.with_timeout(10s).call(echo, std::string("b")), "b");
    EXPECT_EQ(a.with_timeout(10s).call(echo, std::string("a again")), "a again");
    const std::string log = sshd_->log();
    EXPECT_EQ(occurrences(log, "Accepted publickey"), 1u) << sshd_->log_tail(30);
    EXPECT_EQ(occurrences(log, "Starting session: command"), 2u) << sshd_->log_tail(30);
    EXPECT_EQ(b.stop(), 0);
    EXPECT_EQ(a.stop(), 0);
  }
  // ControlPersist keeps the master for a while: end it now.
  const std::string exit_master = fmt::format("ssh -F /dev/null -o ControlPath={} -O exit 127.0.0.1 2>/dev/null",
                                              o.control_path);
  EXPECT_EQ(std::system(exit_master.c_str()), 0);
}

// Kills the ssh of a context that is serving a long call: the call fails at
// once, with ssh's status.
void expect_killing_ssh_fails_the_pending_call(spindle::Child box) {
  auto ctx = box.with_timeout(30s);
  ASSERT_EQ(ctx.call(sleep_ms, 1L), 1);  // the agent serves
  // The agent logs the line below as the call starts: then it is running.
  std::promise<void> running;
  std::once_flag once;
  spindle::set_log_handler([&](const spindle::LogRecord& r) {
    if (std::string_view(r.text).find("test.sleep_ms: sleeping 10000 ms") != std::string_view::npos)
      std::call_once(once, [&] { running.set_value(); });
  });
  std::future<long> pending = ctx.call_async(sleep_ms, 10000L);
  const bool started = running.get_future().wait_for(10s) == std::future_status::ready;
  spindle::reset_log_handler();
  ASSERT_TRUE(started) << "the agent never said the call was running";
  ASSERT_GT(box.pid(), 0);
  auto t0 = Clock::now();
  ASSERT_EQ(::kill(box.pid(), SIGKILL), 0);
  ASSERT_EQ(pending.wait_for(5s), std::future_status::ready) << "the call still waits after ssh died";
  EXPECT_LT(seconds_since(t0), 2.0);
  try {
    pending.get();
    ADD_FAILURE() << "the call returned although ssh was killed";
  } catch (const spindle::ChannelError& e) {
    EXPECT_NE(std::string(e.what()).find("killed by signal 9"), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a ChannelError: " << e.what();
  }
  // Later calls fail at once too.
  auto t1 = Clock::now();
  EXPECT_THROW(ctx.call(sleep_ms, 1L), spindle::Error);
  EXPECT_LT(seconds_since(t1), 2.0);
}

TEST_F(Ssh, KillingSshFailsThePendingCallAtOnce) {
  spindle::SshOptions o = options();
  o.agent = kTestAgent;
  expect_killing_ssh_fails_the_pending_call(start(o));
}

// Through a ControlMaster, the ssh we start hands its stdin and stdout to the
// master process. Killing that ssh still fails the call at once: the master
// drops them when its client goes (OpenSSH 9.2, checked before ssh's pidfd
// ended links), and ssh's pidfd would end the link if it kept them.
TEST_F(Ssh, KillingSshFailsThePendingCallAtOnceThroughAControlMaster) {
  spindle::SshOptions o = options();
  o.agent = kTestAgent;
  o.control_path = sshd_->dir() + "/master.sock";
  expect_killing_ssh_fails_the_pending_call(start(o));
  const std::string exit_master = fmt::format("ssh -F /dev/null -o ControlPath={} -O exit 127.0.0.1 2>/dev/null",
                                              o.control_path);
  EXPECT_EQ(std::system(exit_master.c_str()), 0);
}

TEST_F(Ssh, TwoHops) {
  spindle::Child first = start(options());
  spindle::SshOptions o2 = options();
  o2.via = first;
  spindle::Child second = start(o2);
  auto one = first.with_timeout(10s);
  auto two = second.with_timeout(10s);
  std::string bytes("through\0two hops", 16);
  EXPECT_EQ(two.call(echo, bytes), bytes);
  long first_pid = std::get<1>(one.call(info));
  long second_pid = std::get<1>(two.call(info));
  EXPECT_NE(first_pid, second_pid);
  EXPECT_NE(second_pid, static_cast<long>(::getpid()));
  // The second session's ssh client runs under the first agent: the hop
  // really goes through it.
  EXPECT_EQ(children_named(first_pid, "ssh").size(), 1u);
  EXPECT_TRUE(children_named(static_cast<long>(::getpid()), "ssh").size() == 1u)
      << "this process should run one ssh only (the first hop's)";
}

// A hop may be compromised: the context it says it started must be routed
// through it. A stand-in hop (a local child serving spindle.ssh, no sshd
// needed) that answers another child's id, or its own, is refused: calls
// meant for the remote host would go to that context instead.
inline constexpr spindle::method<std::tuple<long, std::string>(std::string, std::vector<std::string>)>
    hop_ssh{"spindle.ssh"};

TEST(SshHop, AContextTheHopDidNotStartBehindItIsRefused) {
  spindle::Runtime rt;
  spindle::Child other = rt.fork_child([](spindle::ChildEnv& env) { return env.serve(); }, {.name = "other"});
  for (long claimed : {static_cast<long>(other.id()), -1L, 0L}) {
    spindle::Child liar = rt.fork_child(
        [claimed](spindle::ChildEnv& env) {
          env.expose(hop_ssh, [claimed, &env](std::string, std::vector<std::string>) {
            return std::tuple<long, std::string>(claimed == -1 ? static_cast<long>(env.id()) : claimed, "evil");
          });
          return env.serve();
        },
        {.name = "liar"});
    spindle::SshOptions o;
    o.via = liar;
    o.connect_timeout = 10s;
    try {
      spindle::Child c = rt.ssh("example.invalid", o);
      ADD_FAILURE() << "a hop's answer naming context " << c.id() << " was taken";
    } catch (const spindle::Error& e) {
      EXPECT_NE(std::string(e.what()).find("which is not routed through it"), std::string::npos) << e.what();
    }
    EXPECT_EQ(liar.stop(), 0);
  }
  EXPECT_EQ(other.stop(), 0);
}

// The agent forks a child of its own on its host: a context routed through
// it, whose process is the agent's child and serves the same names.
TEST_F(Ssh, TheAgentForksALocalChildThatServesTheSameNames) {
  spindle::Child agent = start(options());
  auto [id, name] = agent.with_timeout(10s).call<std::tuple<long, std::string>>("spindle.fork",
                                                                               std::string("forked"));
  EXPECT_EQ(name, "forked");
  spindle::Context forked = rt.context(static_cast<std::uint32_t>(id), name).with_timeout(10s);
  EXPECT_EQ(forked.call(echo, std::string("from a fork")), "from a fork");
  long agent_pid = std::get<1>(agent.with_timeout(10s).call(info));
  long forked_pid = std::get<1>(forked.call(info));
  EXPECT_NE(forked_pid, agent_pid);
  EXPECT_EQ(parent_and_comm(forked_pid).first, agent_pid);
}

TEST_F(Ssh, Echoes64MiBWithBoundedMemoryOnBothEnds) {
  constexpr std::size_t kSize = 64u << 20;
  std::string payload(kSize, '\0');
  std::uint64_t x = 0x9E3779B97F4A7C15ull;  // xorshift64: varied, incompressible bytes
  for (std::size_t i = 0; i < kSize; i += 8) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(&payload[i], &x, 8);
  }
  spindle::Child box = start(options());
  auto ctx = box.with_timeout(60s);
  ASSERT_EQ(ctx.call(echo, std::string("warm")), "warm");
  ASSERT_TRUE(reset_peak_rss()) << "cannot reset VmHWM through /proc/self/clear_refs";
  const long base_kib = status_kib("VmRSS");
  auto t0 = Clock::now();
  std::string back = ctx.call(echo, payload);
  const double secs = seconds_since(t0);
  const long growth = (status_kib("VmHWM") - base_kib) * 1024;
  EXPECT_TRUE(back == payload) << "64 MiB came back different (" << back.size() << " bytes)";
  back = std::string();
  const long agent_peak = std::get<3>(ctx.call(info));
  std::printf("[ ssh 64 MiB ] %.2f s, this process +%.0f MiB at peak, agent peak %.0f MiB\n", secs,
              growth / 1048576.0, agent_peak / 1048576.0);
  if (kSanitized) return;  // the echo was checked; the bounds mean nothing here
  // This end holds the encoded argument, the result's bytes and the string
  // decoded from them: 3x, which is what the same echo through a local
  // fork_child() child costs too (measured: +192 MiB for both). A link that
  // gathered a whole frame before writing it, or after reading it, adds a
  // fourth copy.
  EXPECT_LT(growth, static_cast<long>(3 * kSize + kSize / 2));
  // The agent answers with the argument's own bytes (measured: 66 MiB in
  // all); one more copy anywhere on its side would pass 2x.
  EXPECT_LT(agent_peak, static_cast<long>(kSize + kSize / 2));
}

TEST_F(Ssh, RefusesFdsWithAReasonThatSaysSo) {
  spindle::Child box = start(options());
  auto ctx = box.with_timeout(10s);
  Pipe p = make_pipe();
  auto t0 = Clock::now();
  try {
    ctx.call(echo_fd, std::move(p.write), std::string("fd?"));
    ADD_FAILURE() << "a call with an fd reached a remote context";
  } catch (const spindle::ChannelError& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.find("file descriptor") != std::string::npos || what.find("fds") != std::string::npos)
        << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a ChannelError (a TimeoutError is the silence this refuses): " << e.what();
  }
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_TRUE(eof_within(p.read.get(), 5000ms)) << "the refused message's fd was not closed";
  EXPECT_EQ(ctx.call(echo, std::string("still fine")), "still fine");
}

TEST_F(Ssh, ASenderCarriesValuesBackAcrossSsh) {
  spindle::SshOptions o = options();
  o.agent = kTestAgent;
  spindle::Child box = start(o);
  spindle::Receiver<long> rx(rt);
  EXPECT_EQ(box.with_timeout(10s).call(count_to, rx.sender(), 3L), 3);
  for (long i = 1; i <= 3; ++i) {
    std::optional<long> v = rx.receive_for(5s);
    ASSERT_TRUE(v.has_value()) << "value " << i << " did not arrive in 5 s";
    EXPECT_EQ(*v, i);
  }
  EXPECT_FALSE(rx.receive_for(200ms).has_value());
}

TEST_F(Ssh, EachStderrLineIsOneEscapedLogRecordOfTheContext) {
  std::mutex mu;
  std::vector<std::string> records;  // "<logger> | <text>"
  spindle::set_log_handler([&](const spindle::LogRecord& r) {
    std::lock_guard<std::mutex> lock(mu);
    records.push_back(std::string(r.logger) + " | " + std::string(r.text));
  });
  spindle::SshOptions o = options();
  o.agent = kTestAgent;
  spindle::Child box = start(o);
  EXPECT_TRUE(box.with_timeout(10s).call(stderr_line, std::string("hello\x1b[31m")));
  const std::string escaped = "hello\\x1b[31m";
  auto matching = [&] {
    std::vector<std::string> out;
    std::lock_guard<std::mutex> lock(mu);
    for (auto& r : records)
      if (r.find("hello") != std::string::npos) out.push_back(r);
    return out;
  };
  auto until = Clock::now() + 5s;
  while (matching().empty() && Clock::now() < until) std::this_thread::sleep_for(10ms);
  std::this_thread::sleep_for(200ms);  // a duplicate would arrive by now
  std::vector<std::string> got = matching();
  spindle::reset_log_handler();
  ASSERT_EQ(got.size(), 1u) << ::testing::PrintToString(got);
  EXPECT_NE(got[0].find(escaped), std::string::npos) << got[0];
  EXPECT_EQ(got[0].find('\x1b'), std::string::npos) << "a raw escape reached the log";
  const std::string id = "ctx=" + std::to_string(box.id());
  std::size_t at = got[0].find(id);
  bool names_ctx = at != std::string::npos &&
                   (at + id.size() == got[0].size() || !std::isdigit(static_cast<unsigned char>(got[0][at + id.size()])));
  EXPECT_TRUE(names_ctx || got[0].find(box.name()) != std::string::npos)
      << "the record does not name the context (" << id << " or " << box.name() << "): " << got[0];
}

// A remote login shell that prints empty lines without end before the
// bootstrap can answer (a profile running `yes ''`). The bound on what may
// come first counts every byte, newlines too, so ssh() fails as soon as the
// bound is passed, with that reason, instead of spinning until
// connect_timeout. A stand-in for ssh prints the lines: no sshd is needed.
TEST(SshBootstrap, EndlessEmptyLinesFailAtTheBoundNotAtTheTimeout) {
  spindle::testutil::TempDir dir;
  const std::string fake = dir.path() + "/ssh-printing-empty-lines";
  {
    std::ofstream out(fake, std::ios::trunc);
    out << "#!/bin/sh\n"
           "# what a login shell whose profile runs `yes ''` sends back\n"
           "exec yes ''\n";
    ASSERT_TRUE(out.good());
  }
  ASSERT_EQ(::chmod(fake.c_str(), 0700), 0);
  spindle::Runtime rt;
  spindle::SshOptions o;
  o.ssh_program = fake;
  o.agent = SPINDLE_AGENT_BINARY;
  o.connect_timeout = 30s;
  auto t0 = Clock::now();
  try {
    spindle::Child box = rt.ssh("example.invalid", o);
    ADD_FAILURE() << "ssh() started a context from a stream of empty lines";
  } catch (const spindle::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ssh to example.invalid: the remote shell printed over 65536 bytes instead of "
                        "the bootstrap's answer"),
              std::string::npos)
        << what;
  }
  EXPECT_LT(seconds_since(t0), 10.0) << "empty lines must not keep ssh() waiting for connect_timeout";
}

}  // namespace test_ssh
