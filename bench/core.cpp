// bench_core: Spindle's core paths beside the physical floor, measured in the
// same run on the same machine.
//
//   rtt     64 B round trip parent <-> forked child: Context::call to an echo
//           handler vs. a blocking socketpair ping-pong between two processes,
//           both ends on one core, then on two cores.
//   oneway  64 B one-way messages per second: Context::send of N messages to
//           a counting handler vs. a writev loop (64 frames of 26+64 bytes per
//           call) to a reader process. Five rounds, floor and Spindle in
//           turn; each side's rows come from its median round.
//   big     one 256 MiB message: throughput and the receiver's peak RSS, vs. a
//           raw socketpair transfer into one buffer and a memcpy.
//
// Also: allocations per message (the counting operator new of
// bench/alloc_count.h) on each side of the one-way run, in steady state.
//
// Usage: bench_core [--quick] [--section rtt|oneway|big] [--json PATH]
// Rows (bench/report.h; names in bench/README.md) go to PATH as JSON.
// Exits 0 whether or not the targets are met; non-zero only on real errors
// (a wrong reply, a child that failed, a syscall that failed).
#include <dirent.h>
#include <malloc.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <semaphore>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench/alloc_count.h"
#include "bench/report.h"
#include "broker/errors.h"
#include "broker/log.h"
#include "router/child.h"
#include "spindle/spindle.h"

namespace {

using Clock = std::chrono::steady_clock;
using spindle::Payload;

constexpr std::uint32_t kEcho = 2100;
constexpr std::uint32_t kWhere = 2101;
constexpr std::uint32_t kCount = 2102;
constexpr std::uint32_t kStatus = 2103;
constexpr std::uint32_t kBig = 2104;

constexpr std::size_t kSmall = 64;
constexpr std::size_t kFrame = spindle::kHeaderSize + kSmall;  // 90 bytes on the wire

// Targets, as ratios to the floor measured in the same run: issue #12's for
// the round trip and the one-way rate (#1 asked <= 2x and 8 M msgs/s, an
// absolute rate that depends on the machine); #1's for the receiver's RSS.
constexpr double kRttTargetRatio = 1.3;
constexpr double kOnewayTargetRatio = 0.6;
constexpr double kBigRssTarget = 1.1;

struct Config {
  bool quick = false;
  bool rtt = true, oneway = true, big = true;
  int rtt_warmup = 2000;
  int rtt_iters = 20000;
  std::size_t oneway_n = 2'000'000;
  // One run of each side takes under half a second, so one unlucky moment
  // of the machine (a timer storm, another process) moved the ratio from
  // 0.47 to 0.91 between bench.sh runs. Alternating rounds put both sides
  // under the same spells, and the median drops the unlucky ones.
  int oneway_rounds = 5;
  std::size_t big_size = std::size_t{256} << 20;
};

[[noreturn]] void fail_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// CPU time (user + system) of every thread of this process, in ns.
std::uint64_t cpu_ns() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  auto ns = [](const timeval& tv) {
    return static_cast<std::uint64_t>(tv.tv_sec) * 1'000'000'000u +
           static_cast<std::uint64_t>(tv.tv_usec) * 1000u;
  };
  return ns(ru.ru_utime) + ns(ru.ru_stime);
}

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a + " " + b + " " + c;
}

// "same core" -> "same_core", for row names.
std::string row_word(std::string s) {
  std::replace(s.begin(), s.end(), ' ', '_');
  return s;
}

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double usecs(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// ---------------------------------------------------------------------------
// CPU affinity
// ---------------------------------------------------------------------------
cpu_set_t g_original_mask;

cpu_set_t one_cpu(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  return s;
}

void pin_this_thread(int cpu) {
  cpu_set_t s = one_cpu(cpu);
  if (::sched_setaffinity(0, sizeof s, &s) < 0) fail_errno("sched_setaffinity");
}

void restore_affinity() {
  if (::sched_setaffinity(0, sizeof g_original_mask, &g_original_mask) < 0)
    fail_errno("sched_setaffinity(restore)");
}

// Every thread of this process (the broker thread exists before a child's
// main runs, so pinning only the calling thread would miss it).
void pin_all_threads(int cpu) {
  cpu_set_t s = one_cpu(cpu);
  DIR* d = ::opendir("/proc/self/task");
  if (!d) fail_errno("opendir /proc/self/task");
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    pid_t tid = static_cast<pid_t>(std::atoi(e->d_name));
    if (::sched_setaffinity(tid, sizeof s, &s) < 0) {
      int err = errno;
      ::closedir(d);
      errno = err;
      fail_errno("sched_setaffinity(tid)");
    }
  }
  ::closedir(d);
}

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------
// VmHWM / VmRSS of this process in bytes.
std::uint64_t proc_status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::size_t klen = std::strlen(key);
  while (std::getline(f, line)) {
    if (line.compare(0, klen, key) == 0 && line.size() > klen && line[klen] == ':')
      return std::strtoull(line.c_str() + klen + 1, nullptr, 10) * 1024;
  }
  return 0;
}

void write_all(int fd, const void* p, std::size_t n) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, b, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_errno("write");
    }
    b += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Returns false on EOF before the first byte.
bool read_all(int fd, void* p, std::size_t n) {
  auto* b = static_cast<std::uint8_t*>(p);
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, b + got, n - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      fail_errno("read");
    }
    if (r == 0) {
      if (got == 0) return false;
      throw std::runtime_error("unexpected EOF mid-record");
    }
    got += static_cast<std::size_t>(r);
  }
  return true;
}

// An epoll instance watching fd for input; -1 when not wanted.
int epoll_for(int fd, bool wanted) {
  if (!wanted) return -1;
  int ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) fail_errno("epoll_create1");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  if (::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) < 0) fail_errno("epoll_ctl");
  return ep;
}

// With an epoll instance: waits until its fd is readable, as an event loop
// does before it reads. Nothing without one. `poll_first`: polls (a zero
// timeout) for up to spindle::kDefaultWaitSpin first, yielding the CPU
// between polls, as a Spindle caller that leads its loop does.
void await_readable(int ep, bool poll_first = false) {
  if (ep < 0) return;
  epoll_event ev;
  if (poll_first) {
    const auto until = Clock::now() + spindle::kDefaultWaitSpin;
    while (Clock::now() < until) {
      int n = ::epoll_wait(ep, &ev, 1, 0);
      if (n > 0) return;
      if (n < 0 && errno != EINTR) fail_errno("epoll_wait");
      ::sched_yield();
    }
  }
  while (::epoll_wait(ep, &ev, 1, -1) < 0)
    if (errno != EINTR) fail_errno("epoll_wait");
}

struct RawChild {
  pid_t pid = -1;
  int fd = -1;  // parent's end of the socketpair
};

// Forks a plain process running fn(fd); it _exit()s with fn's return value.
template <typename Fn>
RawChild fork_raw(Fn fn) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) fail_errno("socketpair");
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) fail_errno("fork");
  if (pid == 0) {
    ::close(sv[0]);
    int rc = 1;
    try {
      rc = fn(sv[1]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "raw child: %s\n", e.what());
    }
    ::_exit(rc);
  }
  ::close(sv[1]);
  return {pid, sv[0]};
}

void reap_raw(RawChild& c) {
  if (c.fd >= 0) ::close(c.fd);
  c.fd = -1;
  int st = 0;
  while (::waitpid(c.pid, &st, 0) < 0) {
    if (errno != EINTR) fail_errno("waitpid");
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    throw std::runtime_error("raw child " + spindle::describe_wait_status(st));
}

void stop_child(const spindle::Context& c) {
  c.shutdown();
  auto st = c.wait_exit(std::chrono::seconds(30));
  if (!st) throw std::runtime_error(c.name() + " did not exit in time");
  if (*st != 0) throw std::runtime_error(c.name() + " " + spindle::describe_wait_status(*st));
}

// The CPU the broker thread of this process runs on right now.
int broker_cpu(spindle::Broker& b) {
  std::promise<int> p;
  auto f = p.get_future();
  b.defer([&p] { p.set_value(::sched_getcpu()); });
  return f.get();
}

struct Stats {
  double median = 0, p99 = 0;
};

Stats summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Stats s;
  if (v.empty()) return s;
  s.median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  std::size_t i99 = static_cast<std::size_t>(std::ceil(0.99 * static_cast<double>(v.size()))) - 1;
  s.p99 = v[std::min(i99, v.size() - 1)];
  return s;
}

// ---------------------------------------------------------------------------
// Table
// ---------------------------------------------------------------------------
struct Row {
  std::string what, spindle, floor, ratio, target, result;
};
std::vector<Row> g_rows;
std::vector<std::string> g_notes;
std::string g_load_start;
spindle::bench::Report g_report("bench_core");

void add_row(std::string what, std::string sp, std::string fl, std::string ratio,
             std::string target = {}, std::optional<bool> met = std::nullopt) {
  g_rows.push_back({std::move(what), std::move(sp), std::move(fl), std::move(ratio),
                    std::move(target), met ? (*met ? "MET" : "MISSED") : ""});
}

void print_table(const Config& cfg) {
  std::size_t w[6] = {4, 7, 5, 5, 6, 6};
  const char* head[6] = {"case", "spindle", "floor (same run)", "ratio", "target", "result"};
  for (int i = 0; i < 6; ++i) w[i] = std::max(w[i], std::strlen(head[i]));
  for (const Row& r : g_rows) {
    const std::string* c[6] = {&r.what, &r.spindle, &r.floor, &r.ratio, &r.target, &r.result};
    for (int i = 0; i < 6; ++i) w[i] = std::max(w[i], c[i]->size());
  }
  auto line = [&](const char* const* c) {
    std::string s = fmt::format("{:<{}}  {:>{}}  {:>{}}  {:>{}}  {:<{}}  {}", c[0], w[0], c[1],
                                w[1], c[2], w[2], c[3], w[3], c[4], w[4], c[5]);
    while (!s.empty() && s.back() == ' ') s.pop_back();
    std::printf("%s\n", s.c_str());
  };
  std::size_t total = w[0] + w[1] + w[2] + w[3] + w[4] + w[5] + 10;
  std::printf("\nspindle bench_core%s  (%ld online CPUs, %s build)\n", cfg.quick ? " --quick" : "",
              ::sysconf(_SC_NPROCESSORS_ONLN),
#ifdef __OPTIMIZE__
              "optimized"
#else
              "UNOPTIMIZED"
#endif
  );
  std::printf("%s\n", std::string(total, '-').c_str());
  line(head);
  std::printf("%s\n", std::string(total, '-').c_str());
  for (const Row& r : g_rows) {
    const char* c[6] = {r.what.c_str(), r.spindle.c_str(), r.floor.c_str(),
                        r.ratio.c_str(), r.target.c_str(), r.result.c_str()};
    line(c);
  }
  std::printf("%s\n", std::string(total, '-').c_str());
  g_notes.push_back("load average at start: " + g_load_start + ", at end: " + loadavg() +
                    " (other load on the machine skews every row)");
  for (const auto& n : g_notes) std::printf("  %s\n", n.c_str());
  std::fflush(stdout);
}

// ---------------------------------------------------------------------------
// 1. Round trip
// ---------------------------------------------------------------------------
struct RttRun {
  std::vector<double> us;
  int parent_cpu = -1, parent_broker_cpu = -1, child_cpu = -1;
  std::uint64_t parent_cpu_ns = 0, child_cpu_ns = 0;  // over the timed calls
  // Spindle: waits in which the caller ran the loop itself, and times the
  // broker's own thread took it back (broker.h, leader/follower).
  std::uint64_t caller_leads = 0, loop_returns = 0;
};

// "cpu cpu_ns" from a kWhere reply.
std::pair<int, std::uint64_t> parse_where(const std::string& s) {
  int cpu = -1;
  unsigned long long ns = 0;
  if (std::sscanf(s.c_str(), "%d %llu", &cpu, &ns) != 2)
    throw std::runtime_error("where: bad reply '" + s + "'");
  return {cpu, ns};
}

// child_cpu < 0: the child keeps the mask it inherits at fork.
RttRun spindle_rtt(const Config& cfg, int parent_cpu, int child_cpu) {
  pin_this_thread(parent_cpu);  // before the Broker: its thread inherits the mask
  RttRun run;
  {
    spindle::Broker broker;
    spindle::RouterOptions ro;
    ro.name = "bench";
    spindle::Router router(broker, ro);
    spindle::ChildOptions co;
    co.name = "rtt-echo";
    spindle::Context child = spindle::fork_child(
        router,
        [child_cpu](spindle::ChildEnv& env) {
          if (child_cpu >= 0) pin_all_threads(child_cpu);  // main and broker thread
          auto& r = env.router();
          r.add_handler(
              [&r](spindle::Message&& m) {
                Payload p = std::move(m.data);
                r.reply(m, std::move(p));
              },
              {}, kEcho);
          r.add_handler(
              [&r](spindle::Message&& m) {
                r.reply(m, Payload::copy_of(fmt::format("{} {}", ::sched_getcpu(), cpu_ns())));
              },
              {}, kWhere);
          env.serve();
          return 0;
        },
        co);

    std::uint8_t msg[kSmall], back[kSmall];
    for (std::size_t i = 0; i < kSmall; ++i) msg[i] = static_cast<std::uint8_t>(i * 7 + 1);
    run.us.reserve(static_cast<std::size_t>(cfg.rtt_iters));
    std::uint64_t child_cpu0 = 0, cpu0 = 0;
    for (int i = 0; i < cfg.rtt_warmup + cfg.rtt_iters; ++i) {
      if (i == cfg.rtt_warmup) {
        child_cpu0 = parse_where(child.call(kWhere, std::string_view{})).second;
        cpu0 = cpu_ns();
      }
      auto t0 = Clock::now();
      Payload rep = child.call(kEcho, Payload::copy_of(std::span<const std::uint8_t>(msg, kSmall)));
      auto t1 = Clock::now();
      if (rep.size() != kSmall) throw std::runtime_error("echo: wrong reply size");
      rep.copy_to(back);
      if (std::memcmp(msg, back, kSmall) != 0) throw std::runtime_error("echo: wrong reply bytes");
      if (i >= cfg.rtt_warmup) run.us.push_back(usecs(t1 - t0));
    }
    run.parent_cpu_ns = cpu_ns() - cpu0;
    auto [ccpu, cns] = parse_where(child.call(kWhere, std::string_view{}));
    run.child_cpu = ccpu;
    run.child_cpu_ns = cns - child_cpu0;
    run.parent_cpu = ::sched_getcpu();
    run.parent_broker_cpu = broker_cpu(broker);
    const auto st = broker.stats();
    run.caller_leads = st.caller_leads;
    run.loop_returns = st.loop_returns;
    stop_child(child);
  }
  restore_affinity();
  return run;
}

// The same round trip as a typed call (<spindle/spindle.h>): the child
// exposes `echo` and serves it on its main thread; the bytes travel as a
// msgpack string inside the service envelope. With `bytes_only`, the call
// takes the same path (envelope, serving thread) with the 64 bytes as they
// are and no msgpack: the difference between the two is what typing costs.
inline constexpr spindle::method<std::string(std::string)> typed_echo{"bench.echo"};
constexpr std::string_view kBytesEcho = "bench.bytes";

RttRun typed_rtt(const Config& cfg, int parent_cpu, int child_cpu, bool bytes_only) {
  pin_this_thread(parent_cpu);
  RttRun run;
  {
    spindle::Runtime rt({.name = "bench"});
    spindle::Child child = rt.fork_child(
        [child_cpu](spindle::ChildEnv& env) {
          if (child_cpu >= 0) pin_all_threads(child_cpu);
          env.expose(typed_echo, [](std::string s) { return s; });
          env.expose_encoded(kBytesEcho, spindle::Allow::kParent,
                             [](const Payload& p) { return p; });
          return env.serve();
        },
        {.name = "typed-echo"});
    std::string msg(kSmall, '\0');
    for (std::size_t i = 0; i < kSmall; ++i) msg[i] = static_cast<char>(i * 7 + 1);
    run.us.reserve(static_cast<std::size_t>(cfg.rtt_iters));
    for (int i = 0; i < cfg.rtt_warmup + cfg.rtt_iters; ++i) {
      auto t0 = Clock::now();
      std::string back =
          bytes_only ? child.call_named(kBytesEcho, Payload::copy_of(msg)).to_string()
                     : child.call(typed_echo, msg);
      auto t1 = Clock::now();
      if (back != msg) throw std::runtime_error("typed echo: wrong reply");
      if (i >= cfg.rtt_warmup) run.us.push_back(usecs(t1 - t0));
    }
    run.parent_cpu = ::sched_getcpu();
    run.parent_broker_cpu = broker_cpu(rt.broker());
  }
  restore_affinity();
  return run;
}

// The round trip of one hand-off each way between two threads of this
// process on semaphores: what a typed call adds at least, since its function
// runs on the child's serving thread and not on its broker thread.
double semaphore_rtt_us(const Config& cfg, int cpu) {
  pin_this_thread(cpu);
  std::binary_semaphore ping{0}, pong{0};
  const int n = cfg.rtt_warmup + cfg.rtt_iters;
  std::thread t([&] {
    for (int i = 0; i < n; ++i) {
      ping.acquire();
      pong.release();
    }
  });
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(cfg.rtt_iters));
  for (int i = 0; i < n; ++i) {
    auto t0 = Clock::now();
    ping.release();
    pong.acquire();
    if (i >= cfg.rtt_warmup) us.push_back(usecs(Clock::now() - t0));
  }
  t.join();
  restore_affinity();
  return summarize(us).median;
}

// via_epoll: both sides wait in epoll_wait before each read, as any
// one-loop-for-every-connection design must (the floor of such a design).
// caller_polls (with via_epoll): the caller polls before it sleeps, exactly
// as Spindle's does (RouterOptions::wait_spin), and the echo side sleeps as
// the broker thread that answers Spindle's call does: that design's floor.
RttRun raw_rtt(const Config& cfg, int parent_cpu, int child_cpu, bool via_epoll = false,
               bool caller_polls = false) {
  pin_this_thread(parent_cpu);
  RttRun run;
  RawChild c = fork_raw([child_cpu, via_epoll](int fd) {
    if (child_cpu >= 0) pin_this_thread(child_cpu);
    const int ep = epoll_for(fd, via_epoll);
    std::uint8_t buf[kSmall];
    std::uint8_t cpu = static_cast<std::uint8_t>(::sched_getcpu());
    write_all(fd, &cpu, 1);
    // A record of all 0xff bytes asks for this process's CPU time instead.
    std::uint8_t probe[kSmall];
    std::memset(probe, 0xff, kSmall);
    while ((await_readable(ep), read_all(fd, buf, kSmall))) {
      if (std::memcmp(buf, probe, kSmall) == 0) {
        std::uint64_t ns = cpu_ns();
        std::memset(buf, 0, kSmall);
        std::memcpy(buf, &ns, sizeof ns);
      }
      write_all(fd, buf, kSmall);
    }
    return 0;
  });
  std::uint8_t cpu = 0;
  if (!read_all(c.fd, &cpu, 1)) throw std::runtime_error("raw echo child died");
  run.child_cpu = cpu;
  const int ep = epoll_for(c.fd, via_epoll);
  std::uint8_t msg[kSmall], back[kSmall];
  for (std::size_t i = 0; i < kSmall; ++i) msg[i] = static_cast<std::uint8_t>(i * 7 + 1);
  auto child_cpu_ns = [&c] {
    std::uint8_t rec[kSmall];
    std::memset(rec, 0xff, kSmall);
    write_all(c.fd, rec, kSmall);
    if (!read_all(c.fd, rec, kSmall)) throw std::runtime_error("raw echo: EOF");
    std::uint64_t ns = 0;
    std::memcpy(&ns, rec, sizeof ns);
    return ns;
  };
  run.us.reserve(static_cast<std::size_t>(cfg.rtt_iters));
  std::uint64_t child_cpu0 = 0, cpu0 = 0;
  for (int i = 0; i < cfg.rtt_warmup + cfg.rtt_iters; ++i) {
    if (i == cfg.rtt_warmup) {
      child_cpu0 = child_cpu_ns();
      cpu0 = cpu_ns();
    }
    auto t0 = Clock::now();
    write_all(c.fd, msg, kSmall);
    await_readable(ep, caller_polls);
    if (!read_all(c.fd, back, kSmall)) throw std::runtime_error("raw echo: EOF");
    auto t1 = Clock::now();
    if (std::memcmp(msg, back, kSmall) != 0) throw std::runtime_error("raw echo: wrong bytes");
    if (i >= cfg.rtt_warmup) run.us.push_back(usecs(t1 - t0));
  }
  run.parent_cpu_ns = cpu_ns() - cpu0;
  run.child_cpu_ns = child_cpu_ns() - child_cpu0;
  run.parent_cpu = run.parent_broker_cpu = ::sched_getcpu();
  if (ep >= 0) ::close(ep);
  reap_raw(c);
  restore_affinity();
  return run;
}

void section_rtt(const Config& cfg, int cpu_a, int cpu_b) {
  struct Case {
    const char* label;
    int parent, child;
  };
  std::vector<Case> cases = {{"same core", cpu_a, -1}};
  if (cpu_b >= 0) cases.push_back({"cross core", cpu_a, cpu_b});
  else g_notes.push_back("rtt: only one usable CPU; cross-core case skipped");
  for (const Case& k : cases) {
    RttRun raw = raw_rtt(cfg, k.parent, k.child);
    RttRun sp = spindle_rtt(cfg, k.parent, k.child);
    Stats r = summarize(raw.us), s = summarize(sp.us);
    double ratio = s.median / r.median;
    add_row(fmt::format("rtt 64 B {}, median", k.label), fmt::format("{:.1f} us", s.median),
            fmt::format("{:.1f} us", r.median), fmt::format("{:.2f}x", ratio),
            fmt::format("<= {:.1f}x raw", kRttTargetRatio), ratio <= kRttTargetRatio);
    add_row(fmt::format("rtt 64 B {}, p99", k.label), fmt::format("{:.1f} us", s.p99),
            fmt::format("{:.1f} us", r.p99), fmt::format("{:.2f}x", s.p99 / r.p99));
    const std::string name = "rtt_64B_" + row_word(k.label);
    g_report.add(name, s.median, "us", r.median);
    g_report.add(name + "_p99", s.p99, "us", r.p99);
    // The floor of any event-loop design: what the epoll_wait before each
    // read costs both sides, and Spindle against that floor.
    Stats e = summarize(raw_rtt(cfg, k.parent, k.child, true).us);
    g_report.add(name + "_raw_epoll", e.median, "us", r.median);
    g_report.add(name + "_over_raw_epoll", s.median, "us", e.median);
    // Spindle's caller polls before it sleeps (wait_spin): the same raw
    // ping-pong with the caller polling, and Spindle against it.
    Stats pl = summarize(raw_rtt(cfg, k.parent, k.child, true, true).us);
    g_report.add(name + "_raw_caller_polls", pl.median, "us", r.median);
    g_report.add(name + "_over_raw_caller_polls", s.median, "us", pl.median);
    g_notes.push_back(fmt::format(
        "rtt {}: {} calls after {} warm-up; spindle cpus: parent main {} broker {}, child broker {}; "
        "raw cpus: parent {} child {}",
        k.label, cfg.rtt_iters, cfg.rtt_warmup, sp.parent_cpu, sp.parent_broker_cpu, sp.child_cpu,
        raw.parent_cpu, raw.child_cpu));
    const auto all = static_cast<std::uint64_t>(cfg.rtt_warmup + cfg.rtt_iters + 2);
    g_notes.push_back(fmt::format(
        "rtt {}: the caller ran the loop itself in {} of {} calls; the broker thread took it back {} times",
        k.label, sp.caller_leads, all, sp.loop_returns));
    auto per = [&cfg](std::uint64_t ns) { return static_cast<double>(ns) / 1000.0 / cfg.rtt_iters; };
    g_notes.push_back(fmt::format(
        "rtt {}: CPU per round trip (user+sys): spindle parent {:.1f} us + child {:.1f} us; "
        "raw parent {:.1f} us + child {:.1f} us",
        k.label, per(sp.parent_cpu_ns), per(sp.child_cpu_ns), per(raw.parent_cpu_ns),
        per(raw.child_cpu_ns)));
    g_report.add(name + "_cpu_parent_us", per(sp.parent_cpu_ns), "us", per(raw.parent_cpu_ns));
    g_report.add(name + "_cpu_child_us", per(sp.child_cpu_ns), "us", per(raw.child_cpu_ns));
    // Issue 13's target: a typed call costs at most 1 us more than the raw
    // call above (its floor here). The typed function runs on the child's
    // main thread, not its broker's: one thread hand-off more.
    RttRun ty = typed_rtt(cfg, k.parent, k.child, false);
    Stats t = summarize(ty.us);
    // The same call with the bytes as they are: the hop without the typing.
    Stats b = summarize(typed_rtt(cfg, k.parent, k.child, true).us);
    const double hop = semaphore_rtt_us(cfg, k.child >= 0 ? k.child : k.parent);
    add_row(fmt::format("  thread hand-off there and back ({})", k.label), "", fmt::format("{:.1f} us", hop), "");
    g_report.add("thread_handoff_rtt_" + row_word(k.label), hop, "us");
    add_row(fmt::format("rtt 64 B {}, typed call, median", k.label), fmt::format("{:.1f} us", t.median),
            fmt::format("{:.1f} us (raw call)", s.median), fmt::format("+{:.1f} us", t.median - s.median),
            "<= +1 us", t.median - s.median <= 1.0);
    add_row(fmt::format("  typed call vs the same call in bytes ({})", k.label),
            fmt::format("{:.1f} us", t.median), fmt::format("{:.1f} us (bytes)", b.median),
            fmt::format("{:+.1f} us", t.median - b.median));
    g_report.add("rtt_64B_bytes_call_" + row_word(k.label), b.median, "us", s.median);
    g_report.add("rtt_64B_typed_call_" + row_word(k.label), t.median, "us", s.median);
    g_report.add("rtt_64B_typed_call_" + row_word(k.label) + "_p99", t.p99, "us", s.p99);
  }
}

// ---------------------------------------------------------------------------
// 2. One-way messages
// ---------------------------------------------------------------------------
struct OnewayRun {
  double seconds = 0, send_seconds = 0;
  std::uint64_t parent_cpu_ns = 0, child_cpu_ns = 0;  // during the timed run
  // operator new calls per message from message steady_from() on (the
  // first quarter warms the queues and pools up), all threads of each side.
  double parent_allocs = 0, child_allocs = 0;
};

std::size_t steady_from(std::size_t n) { return n / 4; }

OnewayRun spindle_oneway(const Config& cfg) {
  const std::size_t n = cfg.oneway_n;
  OnewayRun run;
  spindle::Broker broker;
  spindle::RouterOptions ro;
  ro.name = "bench";
  spindle::Router router(broker, ro);
  spindle::ChildOptions co;
  co.name = "oneway-counter";
  spindle::Context child = spindle::fork_child(
      router,
      [n](spindle::ChildEnv& env) {
        auto& r = env.router();
        std::uint64_t count = 0, bytes = 0, cpu0 = 0, allocs0 = 0;  // broker thread only
        r.add_handler(
            [&r, &count, &bytes, &cpu0, &allocs0, n](spindle::Message&& m) {
              if (count == steady_from(n)) allocs0 = spindle::bench::allocations();
              ++count;
              bytes += m.data.size();
              if (m.header.reply_to != 0)
                r.reply(m, Payload::copy_of(fmt::format("{} {} {} {}", count, bytes, cpu_ns() - cpu0,
                                                        spindle::bench::allocations() - allocs0)));
            },
            {}, kCount);
        r.add_handler(
            [&r, &cpu0](spindle::Message&& m) {
              cpu0 = cpu_ns();
              r.reply(m, std::move(m.data));
            },
            {}, kEcho);
        env.serve();
        return 0;
      },
      co);
  if (child.call(kEcho, std::string_view("ping")) != "ping") throw std::runtime_error("ping failed");

  std::uint8_t msg[kSmall];
  std::memset(msg, 0x5a, sizeof msg);
  const std::span<const std::uint8_t> body(msg, kSmall);
  // Bytes the sender keeps: Context::send copies them into the send queue
  // (no Payload, no allocation), as a user with a buffer in hand sends.
  const std::string_view kept(reinterpret_cast<const char*>(msg), kSmall);
  const std::uint64_t cpu0 = cpu_ns();
  std::uint64_t allocs0 = 0;
  auto t0 = Clock::now();
  for (std::size_t i = 0; i + 1 < n; ++i) {
    if (i == steady_from(n)) allocs0 = spindle::bench::allocations();
    child.send(kCount, kept);
  }
  // The last one asks for a reply; the child answers it with its count.
  auto fut = child.call_async(kCount, Payload::copy_of(body), std::chrono::seconds(300));
  auto t_sent = Clock::now();
  std::string got = fut.get().text();
  auto t1 = Clock::now();
  run.parent_cpu_ns = cpu_ns() - cpu0;
  const double steady = static_cast<double>(n - steady_from(n));
  run.parent_allocs = static_cast<double>(spindle::bench::allocations() - allocs0) / steady;
  unsigned long long cnt = 0, bytes = 0, child_cpu = 0, child_allocs = 0;
  if (std::sscanf(got.c_str(), "%llu %llu %llu %llu", &cnt, &bytes, &child_cpu, &child_allocs) != 4 ||
      cnt != n || bytes != n * kSmall)
    throw std::runtime_error(fmt::format("oneway: child counted '{}', want {} messages, {} bytes", got,
                                         n, n * kSmall));
  run.child_cpu_ns = child_cpu;
  run.child_allocs = static_cast<double>(child_allocs) / steady;
  run.seconds = secs(t1 - t0);
  run.send_seconds = secs(t_sent - t0);
  stop_child(child);
  return run;
}

OnewayRun raw_oneway(const Config& cfg) {
  const std::size_t n = cfg.oneway_n;
  const std::uint64_t total = n * kFrame;
  OnewayRun run;
  RawChild c = fork_raw([total](int fd) {
    std::vector<std::uint8_t> buf(128 * 1024);
    std::uint64_t got = 0, cpu0 = 0;
    bool started = false;
    while (got < total) {
      ssize_t r = ::read(fd, buf.data(), buf.size());
      if (r < 0) {
        if (errno == EINTR) continue;
        fail_errno("read");
      }
      if (r == 0) throw std::runtime_error("raw reader: EOF");
      if (!started) {
        cpu0 = cpu_ns();
        started = true;
      }
      got += static_cast<std::uint64_t>(r);
    }
    std::uint64_t ack[2] = {got / kFrame, cpu_ns() - cpu0};
    write_all(fd, ack, sizeof ack);
    return 0;
  });
  constexpr int kBatch = 64;
  std::vector<spindle::HeaderBytes> headers(kBatch);
  std::vector<std::uint8_t> bodies(kBatch * kSmall, 0x5a);
  for (int i = 0; i < kBatch; ++i) {
    spindle::Header h;
    h.dst_id = 1;
    h.handle = kCount;
    h.length = kSmall;
    headers[static_cast<std::size_t>(i)] = spindle::encode_header(h);
  }
  iovec iov[2 * kBatch];
  for (int i = 0; i < kBatch; ++i) {
    iov[2 * i] = {headers[static_cast<std::size_t>(i)].data(), spindle::kHeaderSize};
    iov[2 * i + 1] = {bodies.data() + static_cast<std::size_t>(i) * kSmall, kSmall};
  }
  const std::uint64_t cpu0 = cpu_ns();
  auto t0 = Clock::now();
  std::size_t left = n;
  while (left > 0) {
    int frames = static_cast<int>(std::min<std::size_t>(left, kBatch));
    std::size_t want = static_cast<std::size_t>(frames) * kFrame;
    ssize_t w = ::writev(c.fd, iov, 2 * frames);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail_errno("writev");
    }
    if (static_cast<std::size_t>(w) != want) {
      // A blocking socket write only stops short on a signal; finish by hand.
      std::vector<std::uint8_t> flat;
      for (int i = 0; i < 2 * frames; ++i)
        flat.insert(flat.end(), static_cast<std::uint8_t*>(iov[i].iov_base),
                    static_cast<std::uint8_t*>(iov[i].iov_base) + iov[i].iov_len);
      write_all(c.fd, flat.data() + w, want - static_cast<std::size_t>(w));
    }
    left -= static_cast<std::size_t>(frames);
  }
  auto t_sent = Clock::now();
  std::uint64_t ack[2] = {0, 0};
  if (!read_all(c.fd, ack, sizeof ack)) throw std::runtime_error("raw reader died");
  auto t1 = Clock::now();
  run.parent_cpu_ns = cpu_ns() - cpu0;
  run.child_cpu_ns = ack[1];
  const std::uint64_t frames = ack[0];
  if (frames != n) throw std::runtime_error(fmt::format("raw reader counted {} frames, want {}", frames, n));
  run.seconds = secs(t1 - t0);
  run.send_seconds = secs(t_sent - t0);
  reap_raw(c);
  return run;
}

// The run of median time among rounds (odd counts; the upper one of two
// middles otherwise), and the spread of the times as "min-max s".
OnewayRun median_round(std::vector<OnewayRun> runs, std::string& spread) {
  std::sort(runs.begin(), runs.end(), [](const OnewayRun& a, const OnewayRun& b) { return a.seconds < b.seconds; });
  spread = fmt::format("{:.3f}-{:.3f} s", runs.front().seconds, runs.back().seconds);
  return runs[runs.size() / 2];
}

void section_oneway(const Config& cfg) {
  std::vector<OnewayRun> raws, sps;
  for (int round = 0; round < cfg.oneway_rounds; ++round) {
    raws.push_back(raw_oneway(cfg));
    sps.push_back(spindle_oneway(cfg));
  }
  std::string raw_spread, sp_spread;
  const OnewayRun raw = median_round(std::move(raws), raw_spread);
  const OnewayRun sp = median_round(std::move(sps), sp_spread);
  g_notes.push_back(fmt::format("one-way: {} rounds, floor and spindle in turn; rows from each side's median "
                                "round; raw {}, spindle {}",
                                cfg.oneway_rounds, raw_spread, sp_spread));
  const double n = static_cast<double>(cfg.oneway_n);
  double sp_rate = n / sp.seconds, raw_rate = n / raw.seconds;
  add_row("one-way 64 B, msgs/s", fmt::format("{:.2f} M/s", sp_rate / 1e6),
          fmt::format("{:.2f} M/s", raw_rate / 1e6), fmt::format("{:.2f}x", sp_rate / raw_rate),
          fmt::format(">= {:.1f}x raw", kOnewayTargetRatio), sp_rate >= kOnewayTargetRatio * raw_rate);
  g_notes.push_back(fmt::format(
      "one-way: N = {} (unpinned); spindle: sends returned after {:.3f} s, last counted at {:.3f} s; "
      "raw: writev x{} frames, {:.3f} s",
      cfg.oneway_n, sp.send_seconds, sp.seconds, 64, raw.seconds));
  auto per = [n](std::uint64_t ns) { return static_cast<double>(ns) / n; };
  g_notes.push_back(fmt::format(
      "one-way CPU per message (user+sys, all threads): spindle parent {:.0f} ns + child {:.0f} ns; "
      "raw writer {:.0f} ns + reader {:.0f} ns",
      per(sp.parent_cpu_ns), per(sp.child_cpu_ns), per(raw.parent_cpu_ns), per(raw.child_cpu_ns)));
  g_notes.push_back(fmt::format(
      "one-way allocations (operator new, all threads) per message after the first {}: "
      "sender {:.2f}, receiver {:.2f}",
      steady_from(cfg.oneway_n), sp.parent_allocs, sp.child_allocs));
  g_report.add("oneway_64B", sp_rate, "msgs/s", raw_rate);
  g_report.add("oneway_64B_sender_cpu_ns", per(sp.parent_cpu_ns), "ns/msg", per(raw.parent_cpu_ns));
  g_report.add("oneway_64B_receiver_cpu_ns", per(sp.child_cpu_ns), "ns/msg", per(raw.child_cpu_ns));
  g_report.add("oneway_64B_sends_returned_s", sp.send_seconds, "s", raw.send_seconds);
  g_report.add("allocs_per_msg_send", sp.parent_allocs, "allocs/msg");
  g_report.add("allocs_per_msg_recv", sp.child_allocs, "allocs/msg");
}

// ---------------------------------------------------------------------------
// 3. One big message
// ---------------------------------------------------------------------------
// The payload pattern: 64-bit word k holds k * a constant, so a sample of
// words shows the bytes arrived in the right places.
constexpr std::uint64_t kPattern = 0x9E3779B97F4A7C15ull;

void check_sample(const Payload& p) {
  std::size_t words = p.size() / 8;
  std::size_t step = std::max<std::size_t>(1, words / 4096);
  std::size_t slice_base = 0;
  auto slices = p.slices();
  std::size_t si = 0;
  for (std::size_t k = 0; k < words; k += step) {
    std::size_t off = k * 8;
    while (si < slices.size() && off >= slice_base + slices[si].size) slice_base += slices[si++].size;
    if (si == slices.size()) throw std::runtime_error("big: payload shorter than its size");
    std::uint64_t v = 0;
    if (off + 8 <= slice_base + slices[si].size) {
      std::memcpy(&v, slices[si].data + (off - slice_base), 8);
    } else {
      continue;  // a word straddling two slices: skip it
    }
    if (v != k * kPattern) throw std::runtime_error(fmt::format("big: wrong bytes at offset {}", off));
  }
}

struct BigRun {
  double seconds = 0;
  std::uint64_t child_base_hwm = 0, child_hwm = 0, child_rss = 0;
  std::uint64_t parent_hwm_before = 0, parent_hwm_after = 0;
};

BigRun spindle_big(const Config& cfg, std::shared_ptr<spindle::Chunk>& chunk_out) {
  const std::size_t size = cfg.big_size;
  BigRun run;
  ::malloc_trim(0);  // the child inherits our resident pages at fork; keep it lean
  spindle::Broker broker;
  spindle::RouterOptions ro;
  ro.name = "bench";
  ro.max_message_size = static_cast<std::uint32_t>(
      std::max<std::uint64_t>(spindle::kDefaultMaxMessageSize, size + (1u << 20)));
  ro.memfd_threshold = SIZE_MAX;  // this row is the socket path; bench_fds measures memfd
  spindle::Router router(broker, ro);
  spindle::ChildOptions co;
  co.name = "big-receiver";
  co.router = ro;
  spindle::Context child = spindle::fork_child(
      router,
      [](spindle::ChildEnv& env) {
        auto& r = env.router();
        r.add_handler(
            [&r](spindle::Message&& m) {
              r.reply(m, Payload::copy_of(fmt::format("{} {}", proc_status_bytes("VmHWM"),
                                                      proc_status_bytes("VmRSS"))));
            },
            {}, kStatus);
        r.add_handler(
            [&r](spindle::Message&& m) {
              check_sample(m.data);
              std::uint64_t hwm = proc_status_bytes("VmHWM"), rss = proc_status_bytes("VmRSS");
              r.reply(m, Payload::copy_of(fmt::format("{} {} {}", m.data.size(), hwm, rss)));
            },
            {}, kBig);
        env.serve();
        return 0;
      },
      co);
  {
    std::string base = child.call(kStatus, std::string_view{});
    run.child_base_hwm = std::strtoull(base.c_str(), nullptr, 10);
  }
  // Built after the fork, so the child does not inherit these pages; filled
  // once, and never touched again by the parent except by the kernel's reads.
  run.parent_hwm_before = proc_status_bytes("VmHWM");
  auto chunk = std::make_shared<spindle::Chunk>(size);
  auto* words = reinterpret_cast<std::uint64_t*>(chunk->data());
  for (std::size_t k = 0; k < size / 8; ++k) words[k] = k * kPattern;
  Payload payload = Payload::adopt(chunk, size);

  auto t0 = Clock::now();
  std::string rep = child.call(kBig, std::move(payload), std::chrono::seconds(300)).to_string();
  auto t1 = Clock::now();
  run.seconds = secs(t1 - t0);
  run.parent_hwm_after = proc_status_bytes("VmHWM");
  unsigned long long got = 0, hwm = 0, rss = 0;
  if (std::sscanf(rep.c_str(), "%llu %llu %llu", &got, &hwm, &rss) != 3 || got != size)
    throw std::runtime_error("big: wrong reply '" + rep + "'");
  run.child_hwm = hwm;
  run.child_rss = rss;
  stop_child(child);
  chunk_out = std::move(chunk);
  return run;
}

double raw_big(const std::shared_ptr<spindle::Chunk>& chunk, std::size_t size) {
  RawChild c = fork_raw([size](int fd) {
    // One preallocated buffer, not pre-faulted: the receiver of a fresh
    // message pays its page faults, as Spindle's receiver does.
    auto* buf = static_cast<std::uint8_t*>(std::malloc(size));
    if (!buf) throw std::runtime_error("raw big: malloc failed");
    std::size_t got = 0;
    while (got < size) {
      ssize_t r = ::read(fd, buf + got, size - got);
      if (r < 0) {
        if (errno == EINTR) continue;
        fail_errno("read");
      }
      if (r == 0) throw std::runtime_error("raw big: EOF");
      got += static_cast<std::size_t>(r);
    }
    std::uint64_t last = 0;
    std::memcpy(&last, buf + size - 8, 8);
    write_all(fd, &last, sizeof last);
    std::free(buf);
    return 0;
  });
  constexpr std::size_t kChunk = 1u << 20;
  auto t0 = Clock::now();
  for (std::size_t off = 0; off < size; off += kChunk)
    write_all(c.fd, chunk->data() + off, std::min(kChunk, size - off));
  std::uint64_t last = 0;
  if (!read_all(c.fd, &last, sizeof last)) throw std::runtime_error("raw big: reader died");
  auto t1 = Clock::now();
  if (last != (size / 8 - 1) * kPattern) throw std::runtime_error("raw big: wrong bytes");
  reap_raw(c);
  return secs(t1 - t0);
}

// prefault: true measures memory bandwidth alone; false adds the page faults
// a receiver of fresh memory pays (as the two socket rows above do).
double memcpy_big(const std::shared_ptr<spindle::Chunk>& chunk, std::size_t size, bool prefault) {
  auto* dst = static_cast<std::uint8_t*>(std::malloc(size));
  if (!dst) throw std::runtime_error("memcpy: malloc failed");
  // Non-zero: a zero memset right after malloc may be folded into calloc,
  // which would leave the pages untouched.
  if (prefault) std::memset(dst, 0xa5, size);
  auto t0 = Clock::now();
  std::memcpy(dst, chunk->data(), size);
  auto t1 = Clock::now();
  std::uint64_t last = 0;
  std::memcpy(&last, dst + size - 8, 8);
  std::free(dst);
  if (last != (size / 8 - 1) * kPattern) throw std::runtime_error("memcpy: wrong bytes");
  return secs(t1 - t0);
}

void section_big(const Config& cfg) {
  const std::size_t size = cfg.big_size;
  const double mib = static_cast<double>(size) / (1 << 20);
  std::shared_ptr<spindle::Chunk> chunk;
  BigRun sp = spindle_big(cfg, chunk);
  double raw_s = raw_big(chunk, size);
  double cpy_fresh_s = memcpy_big(chunk, size, false);
  double cpy_s = memcpy_big(chunk, size, true);
  chunk.reset();
  const double gb = static_cast<double>(size) / 1e9;
  add_row(fmt::format("{:.0f} MiB message, GB/s", mib), fmt::format("{:.2f} GB/s", gb / sp.seconds),
          fmt::format("{:.2f} GB/s", gb / raw_s), fmt::format("{:.2f}x", raw_s / sp.seconds));
  add_row(fmt::format("{:.0f} MiB memcpy, fresh dst", mib), "",
          fmt::format("{:.2f} GB/s", gb / cpy_fresh_s), "");
  add_row(fmt::format("{:.0f} MiB memcpy, dst pre-faulted", mib), "",
          fmt::format("{:.2f} GB/s", gb / cpy_s), "");
  double rss_ratio = static_cast<double>(sp.child_hwm) / static_cast<double>(size);
  add_row(fmt::format("{:.0f} MiB receive: child VmHWM / payload", mib),
          fmt::format("{:.3f}x", rss_ratio), "1.000x", "",
          fmt::format("<= {:.1f}x", kBigRssTarget), rss_ratio <= kBigRssTarget);
  add_row("  child VmHWM before transfer", fmt::format("{:.1f} MiB", sp.child_base_hwm / 1048576.0),
          "", "");
  add_row("  child VmHWM after transfer", fmt::format("{:.1f} MiB", sp.child_hwm / 1048576.0), "",
          "");
  g_notes.push_back(fmt::format(
      "big: {} bytes (unpinned); spindle {:.3f} s call->reply; raw socketpair 1 MiB writes {:.3f} s; "
      "child VmRSS after {:.1f} MiB; parent VmHWM {:.1f} -> {:.1f} MiB (payload built once)",
      size, sp.seconds, raw_s, sp.child_rss / 1048576.0, sp.parent_hwm_before / 1048576.0,
      sp.parent_hwm_after / 1048576.0));
  const std::string name = fmt::format("big_message_{:.0f}MiB", mib);
  g_report.add(name, gb / sp.seconds, "GB/s", gb / raw_s);
  g_report.add(name + "_memcpy_fresh", gb / cpy_fresh_s, "GB/s");
  g_report.add(name + "_memcpy_prefaulted", gb / cpy_s, "GB/s");
  g_report.add(name + "_child_hwm_per_payload", rss_ratio, "x", 1.0);
  g_report.add(name + "_child_hwm_before_MiB", sp.child_base_hwm / 1048576.0, "MiB");
  g_report.add(name + "_child_hwm_after_MiB", sp.child_hwm / 1048576.0, "MiB");
  g_report.add(name + "_child_rss_after_MiB", sp.child_rss / 1048576.0, "MiB");
}

void usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--quick] [--section rtt|oneway|big] [--json PATH]\n", argv0);
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  try {
    g_report.take_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_core: %s\n", e.what());
    usage(argv[0]);
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") {
      cfg.quick = true;
    } else if (a == "--section" && i + 1 < argc) {
      std::string s = argv[++i];
      cfg.rtt = s == "rtt";
      cfg.oneway = s == "oneway";
      cfg.big = s == "big";
      if (!cfg.rtt && !cfg.oneway && !cfg.big) {
        usage(argv[0]);
        return 2;
      }
    } else if (a == "-h" || a == "--help") {
      usage(argv[0]);
      return 0;
    } else {
      usage(argv[0]);
      return 2;
    }
  }
  if (cfg.quick) {
    cfg.rtt_warmup = 200;
    cfg.rtt_iters = 2000;
    cfg.oneway_n = 200'000;
    cfg.oneway_rounds = 1;
    cfg.big_size = std::size_t{64} << 20;
  }

  spindle::log().set_level(spdlog::level::warn);
  ::signal(SIGPIPE, SIG_IGN);  // raw writers: a dead reader shows up as EPIPE

  g_load_start = loadavg();
  try {
    if (::sched_getaffinity(0, sizeof g_original_mask, &g_original_mask) < 0)
      fail_errno("sched_getaffinity");
    int cpu_a = -1, cpu_b = -1;
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (!CPU_ISSET(c, &g_original_mask)) continue;
      if (cpu_a < 0) cpu_a = c;
      else if (cpu_b < 0) cpu_b = c;
    }
    if (cfg.rtt) section_rtt(cfg, cpu_a, cpu_b);
    if (cfg.oneway) section_oneway(cfg);
    if (cfg.big) section_big(cfg);
    // The 1-minute load average: other load on the machine skews every row.
    g_report.add("core_loadavg_1min_start", std::atof(g_load_start.c_str()), "");
    g_report.add("core_loadavg_1min_end", std::atof(loadavg().c_str()), "");
  } catch (const std::exception& e) {
    if (!g_rows.empty()) print_table(cfg);
    std::fprintf(stderr, "bench_core: error: %s\n", e.what());
    return 1;
  }
  print_table(cfg);
  try {
    g_report.finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_core: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
