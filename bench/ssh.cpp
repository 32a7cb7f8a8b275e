// bench_ssh: a context over ssh to localhost (Runtime::ssh, the real OpenSSH
// client, spindle-agent on the far side), beside the raw floor of the same
// kind of ssh session running `cat` (bench/ssh_floor.h), in the same run,
// against a throwaway sshd on 127.0.0.1 (tests/sshd_fixture.h).
//
//   rtt         spindle.echo of 64 B, one call at a time: median and p99,
//               in rounds that alternate with the floor's.
//               Floor: 64 B written to `ssh ... cat`, 64 B read back.
//               Then the same rounds with every process of both sessions
//               (this one, ssh, sshd, the agent, cat) on one CPU: the
//               kernel's placement of the chain, which on a 2-vCPU guest
//               moves either side by 2x (bench/README.md), is then out of
//               the figure (`ssh_rtt_64B_one_cpu`).
//   throughput  spindle.echo of 64 KiB with 4, 8 and 32 calls in flight
//               (256 KiB, 512 KiB, 2 MiB), each answer checked byte for
//               byte. Floor: the same number of bytes streamed through
//               `ssh ... cat` in 64 KiB writes while another thread reads
//               them back, with the same bytes in flight. Both count bytes
//               echoed per second: each byte crosses the session once each
//               way. OpenSSH itself slows down with more in flight (on an
//               idle 2-core VM: ~90 MB/s at 256 KiB, ~20 MB/s unbounded), so
//               the headline row compares the best of each side, and one
//               row per window compares like with like.
//   remote fork spindle.fork on the remote context (the agent forks a child
//               of its own on its host and answers with its id), one at a
//               time: the median wall time. Floor: the same run's median
//               spindle.echo round trip over that session, the least any
//               request to the far side costs.
//   first call  Runtime::ssh() plus one echo, to a remote_dir with no agent
//               (the upload included), then to the same remote_dir again
//               (the agent cached). Floors: for the upload, a raw session
//               running `head -c N > f; sha256sum < f` fed the agent's bytes,
//               until the checksum is back; for the cached agent, the raw
//               session's start, from spawning ssh until `cat` echoed its
//               first byte.
// Targets (issue #15), printed as ratios and never asserted: rtt within
// 1.3x of the floor, throughput at least 0.8x, the first call with upload
// under 2 s.
//
// The agent is the build's spindle-agent beside this program. If sshd cannot
// start, the bench says why, writes the one row `sshd_unavailable` and exits
// 0: a machine without openssh-server has nothing to measure, not a
// failure. A watchdog ends the bench (exit 1) if it runs past its deadline,
// so that a session that stops answering never hangs it.
//
// Usage: bench_ssh [--quick] [--json PATH]
// Exit status non-zero if a reply was wrong or a session failed, never on a figure.
#include <fcntl.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <spindle/runtime.h>
#include <spindle/ssh.h>

#include "bench/process_tree.h"
#include "bench/report.h"
#include "bench/ssh_floor.h"
#include "broker/broker.h"
#include "broker/log.h"
#include "tests/sshd_fixture.h"

namespace {

using namespace spindle;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kSmall = 64;
constexpr std::size_t kBig = 64 * 1024;
constexpr std::size_t kWindows[] = {4, 8, 32};  // 64 KiB calls in flight
constexpr int kRttRounds = 10;
// A rest before each round: a Spindle caller polls while it waits (its
// window stretches to the ~100 us an answer takes here), and without the
// rest the raw rounds after it ran slower (86-108 us before, 105-146 us
// after; Linux's load tracking of this thread, whose average decays with
// a 32 ms half-life, placing the woken ssh differently). 200 ms lets it
// decay on both sides alike.
constexpr auto kRoundRest = std::chrono::milliseconds(200);
constexpr double kRttTarget = 1.3, kThroughputTarget = 0.8, kFirstCallTargetMs = 2000;

struct Config {
  bool quick = false;
  int rtt_warmup = 200, rtt_iters = 3000;
  std::size_t stream_bytes = std::size_t{128} << 20;
  int first_call_runs = 3;
  int forks = 16;  // spindle.fork calls, each leaving a child on the far side
  std::chrono::seconds deadline{900};
};

// sshd's process group, for the watchdog: _exit() skips the fixture's
// destructor, which would otherwise stop it.
std::atomic<pid_t> g_sshd_group{0};

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The msgpack arguments of spindle.echo(std::string): [bytes].
Payload echo_args(const std::string& text) {
  msgpack::sbuffer buf;
  Packer p(buf);
  p.pack_array(1);
  p.pack(text);
  return Payload::copy_of(std::string_view(buf.data(), buf.size()));
}

// Whether `result` (slices) holds exactly `expected`'s bytes.
bool same_bytes(const Payload& result, std::string_view expected) {
  if (result.size() != expected.size()) return false;
  std::size_t at = 0;
  for (const Slice& s : result.slices()) {
    if (std::memcmp(s.data, expected.data() + at, s.size) != 0) return false;
    at += s.size;
  }
  return true;
}

// `iters` round trips after `warmup` more, appended to `us` (microseconds).
void spindle_rtt(const Context& remote, int warmup, int iters, std::vector<double>& us) {
  std::string msg(kSmall, '\0');
  for (int i = 0; i < warmup + iters; ++i) {
    for (std::size_t j = 0; j < kSmall; ++j) msg[j] = static_cast<char>('a' + (i + j) % 26);
    auto t0 = Clock::now();
    std::string back = remote.call<std::string>("spindle.echo", msg);
    auto t1 = Clock::now();
    if (back != msg) throw std::runtime_error("spindle.echo of 64 B came back wrong");
    if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
}

struct RttFigures {
  bench::Percentiles raw, spindle;
};

// kRttRounds rounds of the raw session's echo and spindle.echo in turn, so
// that a change in the machine's load (shared cores) falls on both alike.
RttFigures rtt_rounds(const Context& remote, bench::RawSshPipe& cat, const Config& cfg) {
  std::vector<double> raw_us, sp_us;
  for (int round = 0; round < kRttRounds; ++round) {
    const int warmup = round == 0 ? cfg.rtt_warmup : 0, iters = cfg.rtt_iters / kRttRounds;
    std::this_thread::sleep_for(kRoundRest);
    auto r = cat.rtt(kSmall, warmup, iters);
    raw_us.insert(raw_us.end(), r.begin(), r.end());
    std::this_thread::sleep_for(kRoundRest);
    spindle_rtt(remote, warmup, iters, sp_us);
  }
  return {bench::percentiles(raw_us), bench::percentiles(sp_us)};
}

struct ForkTimes {
  double median = 0, max = 0;
};

// `n` spindle.fork calls, one at a time, after one unmeasured (the first
// fork pays for what the agent sets up once). Each answer must carry an id
// and the name asked for.
ForkTimes remote_forks(const Context& remote, int n) {
  std::vector<double> ms;
  for (int i = 0; i <= n; ++i) {
    auto t0 = Clock::now();
    auto [id, name] = remote.call<std::tuple<long, std::string>>("spindle.fork", "f" + std::to_string(i));
    const double t = ms_since(t0);
    if (id <= 0 || name != "f" + std::to_string(i)) throw std::runtime_error("spindle.fork answered wrong");
    if (i > 0) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.back()};
}

// `calls` echoes of 64 KiB, `window` at a time (start_call: the answers are
// checked on the broker thread, the window refilled from this one).
// Returns bytes echoed per second.
double spindle_throughput(const Context& remote, std::size_t calls, std::size_t window) {
  std::string text(kBig, '\0');
  for (std::size_t j = 0; j < kBig; ++j) text[j] = static_cast<char>('A' + j % 53);
  const Payload args = echo_args(text);
  // The answer is the same string, msgpack-encoded: the arguments without
  // their one-byte array header.
  const std::string args_bytes = args.to_string();
  const std::string_view expected = std::string_view(args_bytes).substr(1);
  std::mutex mu;
  std::condition_variable cv;
  std::size_t in_flight = 0, done = 0;
  std::string error;
  const auto t0 = Clock::now();
  for (std::size_t started = 0; started < calls; ++started) {
    {
      std::unique_lock lk(mu);
      cv.wait(lk, [&] { return in_flight < window || !error.empty(); });
      if (!error.empty()) break;
      ++in_flight;
    }
    remote.start_call("spindle.echo", args, [&](std::exception_ptr e, Payload result) {
      std::string why;
      if (e) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& ex) {
          why = ex.what();
        }
      } else if (!same_bytes(result, expected)) {
        why = "spindle.echo of 64 KiB came back wrong";
      }
      std::lock_guard lk(mu);
      --in_flight;
      ++done;
      if (!why.empty() && error.empty()) error = why;
      cv.notify_one();
    });
  }
  std::unique_lock lk(mu);
  cv.wait(lk, [&] { return in_flight == 0; });  // each call ends: answer, error or timeout
  if (!error.empty()) throw std::runtime_error(error);
  return static_cast<double>(done * kBig) / std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runtime::ssh() and one echo, caching the agent in `remote_dir`; ms.
double first_call_ms(Runtime& rt, const testing_sshd::Sshd& sshd, SshOptions opts,
                     const std::string& remote_dir) {
  opts.remote_dir = remote_dir;
  const auto t0 = Clock::now();
  Child remote = rt.ssh(sshd.host(), opts);
  if (remote.call<std::string>("spindle.echo", std::string("first")) != "first")
    throw std::runtime_error("the first spindle.echo came back wrong");
  const double ms = ms_since(t0);
  remote.stop();
  return ms;
}

// How long the login shell takes to run `true` as sshd starts it for a
// command (Debian's bash reads ~/.bashrc when SSH_CLIENT is set and SHLVL
// is not): every ssh session, raw or Spindle's, pays this before its command
// runs, so it explains first-call figures. ms, or -1 if it could not run.
double login_shell_ms() {
  const passwd* pw = ::getpwuid(::geteuid());
  const std::string shell = pw && pw->pw_shell && *pw->pw_shell ? pw->pw_shell : "/bin/sh";
  std::vector<std::string> env = {"SSH_CLIENT=127.0.0.1 0 0"};
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "SHLVL=", 6) != 0 && std::strncmp(*e, "SSH_CLIENT=", 11) != 0) env.emplace_back(*e);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string c = "-c", t = "true", sh = shell;
  char* argv[] = {sh.data(), c.data(), t.data(), nullptr};
  posix_spawn_file_actions_t fa;
  if (::posix_spawn_file_actions_init(&fa) != 0) return -1;
  int rc = 0;
  for (int fd : {0, 1, 2})
    if (rc == 0) rc = ::posix_spawn_file_actions_addopen(&fa, fd, "/dev/null", fd ? O_WRONLY : O_RDONLY, 0);
  const auto t0 = Clock::now();
  pid_t pid = -1;
  if (rc == 0) rc = ::posix_spawn(&pid, shell.c_str(), &fa, nullptr, argv, envp.data());
  ::posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return -1;
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0)
    if (errno != EINTR) return -1;
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? ms_since(t0) : -1;
}

bool agent_cached(const std::string& remote_dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(remote_dir, ec))
    if (e.path().filename().string().rfind("spindle-agent-", 0) == 0) return true;
  return false;
}

int run(const Config& cfg, bench::Report& report) {
  std::string why;
  auto sshd = testing_sshd::Sshd::start(why);
  if (!sshd) {
    std::printf("bench_ssh: sshd cannot start, nothing measured: %s\n", why.c_str());
    report.add("sshd_unavailable", 1, "flag");
    report.finish();
    return 0;
  }
  g_sshd_group = sshd->pid();
  SshOptions opts = sshd->options();
  opts.agent = (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "spindle-agent").string();
  if (::access(opts.agent.c_str(), X_OK) != 0)
    throw std::runtime_error(opts.agent + " is not built (make spindle-agent)");
  std::printf("\nspindle bench_ssh%s: ssh to %s:%d (sshd pid %d), agent %s\n", cfg.quick ? " --quick" : "",
              sshd->host().c_str(), sshd->port(), static_cast<int>(sshd->pid()), opts.agent.c_str());
  const std::string cat_log = sshd->dir() + "/raw-ssh.log";
  const auto cat_argv = bench::ssh_command(sshd->host(), opts, "cat");
  Runtime rt;

  // First calls: a fresh remote_dir each run (upload), then the same again (cached).
  const std::string agent_bytes = testing_sshd::read_file(opts.agent);
  std::vector<double> upload, cached, session, raw_upload;
  for (int i = 0; i < cfg.first_call_runs; ++i) {
    const std::string dir = sshd->dir() + "/first-" + std::to_string(i);
    upload.push_back(first_call_ms(rt, *sshd, opts, dir));
    if (!agent_cached(dir)) throw std::runtime_error("no spindle-agent-* in " + dir + " after the upload");
    cached.push_back(first_call_ms(rt, *sshd, opts, dir));
    bench::RawSshPipe cat(cat_argv, cat_log);
    session.push_back(cat.wait_echo(opts.connect_timeout));
    const std::string copy = dir + "/raw-upload";  // the fixture's own directory: a plain path
    bench::RawSshPipe up(bench::ssh_command(sshd->host(), opts,
                                            "head -c " + std::to_string(agent_bytes.size()) + " > " + copy +
                                                " && sha256sum < " + copy),
                         cat_log);
    auto [sum, ms] = up.send_then_line(agent_bytes, opts.connect_timeout);
    if (sum.size() < 64 || testing_sshd::read_file(copy) != agent_bytes)
      throw std::runtime_error("the raw upload came back wrong: " + sum);
    raw_upload.push_back(ms);
  }
  const double up = bench::percentiles(upload).median, hit = bench::percentiles(cached).median,
               floor_ms = bench::percentiles(session).median,
               raw_up_ms = bench::percentiles(raw_upload).median, shell_ms = login_shell_ms();
  std::printf("first call (median of %d): with upload %.1f ms (target < %.0f ms; raw ssh upload of the "
              "same %.1f MB and its sha256sum %.1f ms), agent cached %.1f ms (raw ssh session to its "
              "first echo %.1f ms); the login shell's own start, which every ssh command pays "
              "(~/.bashrc and the like), about %.1f ms\n",
              cfg.first_call_runs, up, kFirstCallTargetMs, agent_bytes.size() / 1e6, raw_up_ms, hit,
              floor_ms, shell_ms);
  report.add("first_call_upload_ms", up, "ms", raw_up_ms);
  report.add("first_call_cached_ms", hit, "ms", floor_ms);
  report.add("login_shell_start_ms", shell_ms, "ms");

  // Round trips and throughput: one remote context, one raw session.
  Child remote = rt.ssh(sshd->host(), opts);
  bench::RawSshPipe cat(cat_argv, cat_log);
  cat.wait_echo(opts.connect_timeout);
  // In kRttRounds alternating rounds, so that a change in the machine's
  // load (shared cores) falls on both sides alike.
  const Broker::Stats lead0 = rt.broker().stats();
  const auto [raw, sp] = rtt_rounds(remote, cat, cfg);
  const Broker::Stats lead1 = rt.broker().stats();
  std::printf("rtt 64 B (median / p99 us, %d calls): spindle.echo %.1f / %.1f, raw ssh cat %.1f / %.1f; "
              "ratio %.2f (target <= %.1f)\n",
              cfg.rtt_iters, sp.median, sp.p99, raw.median, raw.p99, sp.median / raw.median, kRttTarget);
  // How the caller waited (broker/loop_lead.cpp): whether it read its own
  // replies (each time the broker thread took the loop back, a later call
  // paid a wake-up), and how many of its waits a poll answered before sleep.
  std::printf("  the caller led the loop in %llu waits, the broker thread took it back %llu times; "
              "%llu waits polled, %llu of them answered while polling\n",
              static_cast<unsigned long long>(lead1.caller_leads - lead0.caller_leads),
              static_cast<unsigned long long>(lead1.loop_returns - lead0.loop_returns),
              static_cast<unsigned long long>(lead1.wait_polls - lead0.wait_polls),
              static_cast<unsigned long long>(lead1.wait_polls_answered - lead0.wait_polls_answered));
  report.add("ssh_rtt_64B", sp.median, "us", raw.median);
  report.add("ssh_rtt_64B_p99", sp.p99, "us", raw.p99);

  // The same rounds with every process of both sessions on one CPU (the
  // first this bench may use), where the kernel has no placement to choose:
  // the figure then holds each side's own work and wake-ups only.
  {
    cpu_set_t all, one;
    if (::sched_getaffinity(0, sizeof all, &all) != 0) throw std::system_error(errno, std::generic_category(), "sched_getaffinity");
    int cpu = 0;
    while (!CPU_ISSET(cpu, &all)) ++cpu;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    const auto tree = bench::process_tree(::getpid());
    if (const int refused = bench::set_tree_affinity(tree, one); refused > 0) {
      std::printf("rtt 64 B on one CPU: not measured, %d threads of the sessions' processes refused to move "
                  "(EPERM)\n", refused);
    } else {
      const auto [raw1, sp1] = rtt_rounds(remote, cat, cfg);
      std::printf("rtt 64 B, all %zu processes on CPU %d (median / p99 us): spindle.echo %.1f / %.1f, raw ssh "
                  "cat %.1f / %.1f; ratio %.2f\n",
                  tree.size(), cpu, sp1.median, sp1.p99, raw1.median, raw1.p99, sp1.median / raw1.median);
      report.add("ssh_rtt_64B_one_cpu", sp1.median, "us", raw1.median);
      report.add("ssh_rtt_64B_one_cpu_p99", sp1.p99, "us", raw1.p99);
    }
    bench::set_tree_affinity(bench::process_tree(::getpid()), all);
  }

  const std::size_t calls = std::max<std::size_t>(cfg.stream_bytes / kBig, 1);
  const std::string mib = std::to_string(calls * kBig >> 20) + "MiB";
  spindle_throughput(remote, std::min<std::size_t>(calls, 64), 8);  // warm-up
  double best_sp = 0, best_raw = 0;
  std::printf("throughput, %s in 64 KiB messages (bytes echoed/s, each byte both ways):\n", mib.c_str());
  for (std::size_t w : kWindows) {
    const double raw_bps = cat.stream(calls * kBig, kBig, w * kBig);
    const double sp_bps = spindle_throughput(remote, calls, w);
    best_sp = std::max(best_sp, sp_bps);
    best_raw = std::max(best_raw, raw_bps);
    std::printf("  %3zu KiB in flight: spindle.echo %.1f MB/s (%zu calls), raw ssh cat %.1f MB/s; ratio %.2f\n",
                w * kBig >> 10, sp_bps / 1e6, w, raw_bps / 1e6, sp_bps / raw_bps);
    report.add("ssh_throughput_64KiB_" + mib + "_inflight_" + std::to_string(w * kBig >> 10) + "KiB",
               sp_bps / 1e6, "MB/s", raw_bps / 1e6);
  }
  std::printf("  best of each: spindle.echo %.1f MB/s, raw ssh cat %.1f MB/s; ratio %.2f (target >= %.1f)\n",
              best_sp / 1e6, best_raw / 1e6, best_sp / best_raw, kThroughputTarget);
  report.add("ssh_throughput_64KiB_" + mib, best_sp / 1e6, "MB/s", best_raw / 1e6);

  const auto forks = remote_forks(remote, cfg.forks);
  std::printf("remote fork (median / max ms, %d forks): spindle.fork %.2f / %.2f; one spindle.echo %.3f ms\n",
              cfg.forks, forks.median, forks.max, sp.median / 1e3);
  report.add("ssh_remote_fork_ms", forks.median, "ms", sp.median / 1e3);
  remote.stop();
  report.finish();
  return 0;
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--quick] [--json PATH]\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Report report("bench_ssh");
  Config cfg;
  try {
    report.take_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ssh: %s\n", e.what());
    return usage(argv[0]);
  }
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) cfg.quick = true;
    else return usage(argv[0]);
  }
  if (cfg.quick) {
    cfg.rtt_warmup = 50;
    cfg.rtt_iters = 500;
    cfg.stream_bytes = std::size_t{16} << 20;
    cfg.first_call_runs = 1;
    cfg.forks = 4;
    cfg.deadline = std::chrono::seconds(240);  // inside smoke.bench_ssh's 300 s
  }
  log().set_level(spdlog::level::warn);
  ::signal(SIGPIPE, SIG_IGN);  // a raw session that dies shows up as EPIPE
  // The watchdog: a stalled session must end the bench, not hang it. It
  // takes sshd's process group down first (the ssh clients then see EOF).
  std::thread([d = cfg.deadline] {
    std::this_thread::sleep_for(d);
    std::fprintf(stderr, "bench_ssh: still running after %lld s: giving up\n",
                 static_cast<long long>(d.count()));
    if (pid_t g = g_sshd_group.load(); g > 0) ::kill(-g, SIGKILL);
    std::fflush(nullptr);
    ::_exit(1);
  }).detach();
  try {
    return run(cfg, report);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ssh: error: %s\n", e.what());
    return 1;
  }
}
