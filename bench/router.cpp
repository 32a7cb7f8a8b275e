// bench_router: messages routed by a real spindle-router process between
// clients of this process, beside a raw two-hop relay (bench/relay_floor.h)
// measured in the same run and, when libzmq is there, ZeroMQ's zmq_proxy
// (bench/zmq_peer.h).
//
//   rtt         64 B Context::call from client A to client B's echo handler:
//               A -> router -> B -> router -> A. Floor: one frame through the
//               relay thread to an echo thread and back.
//   throughput  N = 1, 16, 256 pairs of clients (2N connections); each sender
//               sends 64 B messages (Router::send) to its partner, from up to
//               4 threads that take their senders in turn, 64 messages per
//               turn, each turn in one SendBatch (the rows' `_no_send_batch` twin:
//               without); each receiver checks sender, sequence and size. Timed
//               from the first send to the last receipt. Floor: N writers ->
//               relay thread -> N readers, taken the same way, 64 frames (one
//               turn) per write. Also both with one message per turn (the
//               relay then writes one frame per write: what an interleaved
//               pattern costs raw).
//               The router's peak RSS (VmHWM, reset before each N) beside it.
//   raw clients the floor's own writers and readers (bench/raw_pairs.h), N
//               pairs, with spindle-router in the relay's place: the router
//               against the relay alone, since 2N Spindle clients on this
//               machine's cores cost more CPU per message than the whole
//               floor. Then a longer flood of the same, during which two
//               other clients time calls: what the bound on a chunk of
//               turns (broker/input_turns.h) leaves a client that is not
//               flooding.
//   forward     allocations per forwarded message on the broker thread of an
//               in-process router (Router + Listener, as spindle-router runs
//               them), counted by bench/alloc_count.h; the separate
//               spindle-router process cannot be counted from here.
//
// Usage: bench_router [--quick] [--messages M] [--json PATH]
// M: messages per throughput run (split over the pairs). Exit status non-zero
// if anything was lost, corrupted or reordered, never on a figure.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench/alloc_count.h"
#include "bench/proc_status.h"
#include "bench/relay_floor.h"
#include "bench/report.h"
#include "bench/router_pairs.h"
#include "broker/log.h"
#include "router/connect.h"
#include "router/listener.h"
#include "tests/process_util.h"
#include "tests/raw_peer.h"
#ifdef SPINDLE_BENCH_HAVE_ZMQ
#include "bench/zmq_peer.h"
#endif

namespace {

using namespace spindle;
using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kEcho = 2400;
constexpr std::size_t kSize = bench::kPairsMessageSize;
constexpr int kMaxSenderThreads = bench::kPairsMaxSenderThreads;
// The raw flood under which round trips are measured is this many times
// the throughput run's, so that it lasts a few seconds.
constexpr std::uint64_t kFloodRttScale = 16;

constexpr const char* kErrEcho = "the echo came back wrong";

struct Config {
  bool quick = false;
  int rtt_warmup = 1000, rtt_iters = 10000;
  std::uint64_t messages = 600'000;  // per throughput run, over all pairs
  std::vector<int> clients = {1, 16, 256};
};

std::string router_binary() {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "spindle-router").string();
}

void raise_fd_limit() {  // 512 clients, each a broker and a socket
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) std::perror("bench_router: setrlimit(RLIMIT_NOFILE)");
  }
}

// CPU time (user + sys, every thread) of process `pid`, or of this process
// when pid is 0, in ns. For another process: the sum of its threads' run
// time from /proc/<pid>/task/*/schedstat (ns; the router's threads live for
// the whole run), or clock ticks from /proc/<pid>/stat where schedstat is
// missing. For this process: getrusage, which also keeps the CPU of threads
// that have already exited (the senders).
std::uint64_t process_cpu_ns(pid_t pid) {
  if (pid == 0) {
    rusage ru{};
    if (::getrusage(RUSAGE_SELF, &ru) < 0) throw std::runtime_error("getrusage failed");
    return (static_cast<std::uint64_t>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1'000'000 +
            static_cast<std::uint64_t>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec)) * 1000;
  }
  const std::string proc = "/proc/" + std::to_string(pid);
  std::uint64_t sum = 0;
  bool any = false;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(proc + "/task", ec)) {
    std::ifstream in(task.path() / "schedstat");
    unsigned long long run_ns = 0;
    if (in >> run_ns) {
      sum += run_ns;
      any = true;
    }
  }
  if (any) return sum;
  std::ifstream in(proc + "/stat");
  std::string stat;
  std::getline(in, stat);
  auto close_paren = stat.rfind(')');  // the command name may hold spaces
  if (close_paren == std::string::npos) throw std::runtime_error("cannot read " + proc + "/stat");
  std::istringstream fields(stat.substr(close_paren + 2));
  std::string f;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> f; ++i) {  // field 3 is the state
    if (i == 14) utime = std::stoull(f);
    if (i == 15) stime = std::stoull(f);
  }
  return (utime + stime) * (1'000'000'000ull / static_cast<unsigned long long>(::sysconf(_SC_CLK_TCK)));
}

// Round trips of a 64 B call from client A to client B's echo: `warmup`,
// then `iters` measured, or, with `until`, measured until it is set.
std::vector<double> spindle_rtt(const UnixAddress& address, int warmup, int iters,
                                const std::atomic<bool>* until = nullptr) {
  Connection b(RouterOptions{.name = "echo"});
  b.router().add_handler([&r = b.router()](Message&& m) { r.reply(m, std::move(m.data)); }, {}, kEcho);
  b.connect(address);
  Connection a(RouterOptions{.name = "caller"});
  a.connect(address);
  Context to_b = a.context(b.id());
  std::uint8_t msg[kSize], back[kSize];
  for (std::size_t i = 0; i < kSize; ++i) msg[i] = static_cast<std::uint8_t>(i * 7 + 1);
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(iters));
  for (int i = 0; until ? !until->load() : i < warmup + iters; ++i) {
    auto t0 = Clock::now();
    Payload rep = to_b.call(kEcho, Payload::copy_of(std::span<const std::uint8_t>(msg, kSize)));
    auto t1 = Clock::now();
    if (rep.size() != kSize) throw std::runtime_error(kErrEcho);
    rep.copy_to(back);
    if (std::memcmp(msg, back, kSize) != 0) throw std::runtime_error(kErrEcho);
    if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  a.close();
  b.close();
  return us;
}

// The floor's own raw clients (bench/raw_pairs.h) with spindle-router in
// the relay's place: N raw writers and N raw readers, each a socket that
// has made the Spindle handshake, writer i addressing reader i by the id the
// router gave it. What differs from the floor is the middle hop alone.
// Returns frames/s and the router's CPU per frame; with `rtt`, also the
// round trips of a call between two other clients (spindle_rtt), made
// while the flood lasts: what a client that is not flooding waits while
// every other stream is busy (the bound on a chunk, broker/input_turns.h).
struct RawClientsRun {
  bench::RelayRun flood;
  std::vector<double> rtt_us;
};
RawClientsRun raw_clients_throughput(const UnixAddress& address, pid_t router, int n,
                                     std::uint64_t per_pair, bool rtt = false) {
  std::vector<testutil::RawPeer> peers;
  peers.reserve(2 * static_cast<std::size_t>(n));
  std::vector<bench::RawPair> ends;
  for (int i = 0; i < n; ++i) {
    peers.push_back(testutil::RawPeer::connect_to(address));
    const std::uint32_t reader = peers.back().handshake();
    const int reader_fd = peers.back().fd;
    peers.push_back(testutil::RawPeer::connect_to(address));
    const std::uint32_t writer = peers.back().handshake();
    ends.push_back({peers.back().fd, reader_fd, reader, writer});
  }
  const std::uint64_t cpu0 = process_cpu_ns(router);
  std::atomic<bool> flood_done{false};
  std::future<std::vector<double>> probe;
  if (rtt)
    probe = std::async(std::launch::async, [&] { return spindle_rtt(address, 10, 0, &flood_done); });
  double secs = 0;
  try {
    secs = bench::run_raw_pairs(ends, per_pair, kSize, std::min(n, kMaxSenderThreads),
                                bench::kFramesPerTurn);
  } catch (...) {
    flood_done.store(true);
    if (probe.valid()) probe.wait();
    throw;
  }
  flood_done.store(true);
  const double frames = static_cast<double>(per_pair) * n;
  RawClientsRun run{{frames / secs, static_cast<double>(process_cpu_ns(router) - cpu0) / frames}, {}};
  if (probe.valid()) run.rtt_us = probe.get();
  return run;
}

// Allocations per forwarded message on the broker thread of a router in this
// process (Router + Listener, as spindle-router runs them), over one pair in
// steady state; also its throughput (msgs/s).
std::pair<double, double> inprocess_forward(const std::string& dir, std::uint64_t messages) {
  Broker broker;
  Router router(broker, RouterOptions{.name = "inproc-router"});
  ListenerOptions lo;
  lo.address = UnixAddress{dir + "/inproc.sock", false};
  lo.accept_systemd_socket = false;
  auto listener = Listener::open(router, lo);
  listener->start();
  auto router_thread_allocations = [&broker] {
    std::promise<std::uint64_t> p;
    auto f = p.get_future();
    broker.defer([&p] { p.set_value(bench::thread_allocations()); });
    return f.get();
  };
  double allocs = 0, rate = 0;
  {
    bench::Pairs pairs(lo.address, 1);
    // Warm-up, as long as the timed run: the receiver stalls first, so the
    // router's queue to it reaches its high-water mark and the block cache
    // holds what the deepest queue needs. With a warm-up a quarter as long
    // and no stall, a run whose receiver first fell far behind in the timed
    // part allocated the blocks then (0.0002-0.0003 per message, in two
    // runs of five).
    pairs.run(messages, bench::kFramesPerTurn, false, std::chrono::milliseconds(300));
    const std::uint64_t a0 = router_thread_allocations();
    const double secs = pairs.run(messages, bench::kFramesPerTurn, false);
    allocs = static_cast<double>(router_thread_allocations() - a0) / static_cast<double>(messages);
    rate = static_cast<double>(messages) / secs;
  }
  listener.reset();
  return {allocs, rate};
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--quick] [--messages M] [--clients N[,N...]] [--json PATH]\n", argv0);
  return 2;
}

int run(const Config& cfg, bench::Report& report) {
  testutil::TempDir dir;
  const std::string sock = dir.path() + "/router.sock";
  testutil::RouterProcess proc(router_binary(), sock, {"--log-level", "warn"});
  if (!proc.wait_ready()) {
    std::fprintf(stderr, "bench_router: spindle-router did not start:\n%s\n", proc.log().c_str());
    return 1;
  }
  const UnixAddress address = UnixAddress::parse(sock);
  std::printf("\nspindle bench_router%s: clients of one spindle-router (pid %d), %zu B messages, unpinned\n",
              cfg.quick ? " --quick" : "", static_cast<int>(proc.pid()), kSize);
  report.add("router_rss_idle_MiB", bench::status_kib(proc.pid(), "VmRSS") / 1024.0, "MiB");

  // Round trips.
  auto sp = bench::percentiles(spindle_rtt(address, cfg.rtt_warmup, cfg.rtt_iters));
  auto raw = bench::percentiles(bench::relay_rtt(kSize, cfg.rtt_warmup, cfg.rtt_iters));
  std::printf("rtt (median / p99 us, %d calls): routed %.1f / %.1f, raw relay %.1f / %.1f\n",
              cfg.rtt_iters, sp.median, sp.p99, raw.median, raw.p99);
  report.add("routed_rtt_64B", sp.median, "us", raw.median);
  report.add("routed_rtt_64B_p99", sp.p99, "us", raw.p99);
  // Spindle's caller polls before it sleeps (wait_spin): the same relay with
  // the caller polling, and Spindle against it.
  auto raw_polls = bench::percentiles(bench::relay_rtt(kSize, cfg.rtt_warmup, cfg.rtt_iters, true));
  report.add("routed_rtt_64B_raw_caller_polls", raw_polls.median, "us", raw.median);
  report.add("routed_rtt_64B_over_raw_caller_polls", sp.median, "us", raw_polls.median);

  // Throughput, N pairs.
  std::vector<std::pair<int, double>> floors;
  for (int n : cfg.clients) {
    const std::uint64_t per_pair = std::max<std::uint64_t>(cfg.messages / static_cast<std::uint64_t>(n), 1);
    const bool peak_reset = bench::reset_peak_rss(proc.pid());
    double secs = 0, secs_unbatched = 0, secs_one = 0;
    std::uint64_t router_cpu = 0, client_cpu = 0, client_cpu_unbatched = 0;
    {
      bench::Pairs pairs(address, n);
      pairs.run(std::max<std::uint64_t>(per_pair / 10, 1), bench::kFramesPerTurn, true);  // warm-up
      const std::uint64_t r0 = process_cpu_ns(proc.pid()), c0 = process_cpu_ns(0);
      secs = pairs.run(per_pair, bench::kFramesPerTurn, true);
      router_cpu = process_cpu_ns(proc.pid()) - r0;
      client_cpu = process_cpu_ns(0) - c0;
      const std::uint64_t u0 = process_cpu_ns(0);
      secs_unbatched = pairs.run(per_pair, bench::kFramesPerTurn, false);
      client_cpu_unbatched = process_cpu_ns(0) - u0;
      secs_one = pairs.run(per_pair, 1, false);
    }
    const double peak_mib = bench::status_kib(proc.pid(), "VmHWM") / 1024.0;
    const double msgs = static_cast<double>(per_pair) * n;
    const double rate = msgs / secs;
    const int threads = std::min(n, kMaxSenderThreads);
    const bench::RelayRun floor = bench::relay_throughput(n, per_pair, kSize, threads);
    const bench::RelayRun unbatched = bench::relay_throughput(n, per_pair, kSize, threads, 1);
    const bench::RelayRun raw_clients = raw_clients_throughput(address, proc.pid(), n, per_pair).flood;
    const RawClientsRun raw_busy =
        raw_clients_throughput(address, proc.pid(), n, per_pair * kFloodRttScale, true);
    floors.emplace_back(n, floor.frames_per_s);
    const double rate_one = msgs / secs_one;
    std::printf("throughput, %d pair(s) x %llu messages, %llu per turn: routed %.0f msgs/s (a "
                "SendBatch per turn; %.0f without), raw relay "
                "%.0f msgs/s; one per turn: routed %.0f, relay %.0f (one frame per write); CPU per "
                "message: router %.0f ns (relay thread %.0f ns), clients %.0f ns; router peak RSS "
                "%.1f MiB%s\n"
                "  the floor's raw clients through spindle-router: %.0f msgs/s, router CPU %.0f ns "
                "per message\n",
                n, static_cast<unsigned long long>(per_pair),
                static_cast<unsigned long long>(bench::kFramesPerTurn), rate, msgs / secs_unbatched,
                floor.frames_per_s,
                rate_one, unbatched.frames_per_s, router_cpu / msgs, floor.relay_cpu_ns_per_frame,
                client_cpu / msgs, peak_mib, peak_reset ? "" : " (peak since start: clear_refs refused)",
                raw_clients.frames_per_s, raw_clients.relay_cpu_ns_per_frame);
    const std::string suffix = fmt::format("{}_clients", n);
    report.add("routed_throughput_" + suffix, rate, "msgs/s", floor.frames_per_s);
    report.add("routed_throughput_" + suffix + "_no_send_batch", msgs / secs_unbatched, "msgs/s",
               floor.frames_per_s);
    report.add("relay_unbatched_throughput_" + suffix, unbatched.frames_per_s, "msgs/s",
               floor.frames_per_s);
    report.add("routed_throughput_" + suffix + "_one_per_turn", rate_one, "msgs/s",
               unbatched.frames_per_s);
    report.add("router_cpu_ns_per_msg_" + suffix, router_cpu / msgs, "ns/msg",
               floor.relay_cpu_ns_per_frame);
    report.add("client_cpu_ns_per_msg_" + suffix, client_cpu / msgs, "ns/msg");
    report.add("client_cpu_ns_per_msg_" + suffix + "_no_send_batch", client_cpu_unbatched / msgs, "ns/msg");
    const std::string raw_suffix = fmt::format("{}_raw_clients", n);
    report.add("routed_throughput_" + raw_suffix, raw_clients.frames_per_s, "msgs/s", floor.frames_per_s);
    report.add("router_cpu_ns_per_msg_" + raw_suffix, raw_clients.relay_cpu_ns_per_frame, "ns/msg",
               floor.relay_cpu_ns_per_frame);
    if (raw_busy.rtt_us.empty()) {
      std::printf("  no call completed while those raw clients flooded (%.0f msgs/s)\n",
                  raw_busy.flood.frames_per_s);
    } else {
      const auto busy = bench::percentiles(raw_busy.rtt_us);
      std::printf("  a call's round trip while they flood (%.0f msgs/s): median %.1f us, p99 %.1f us "
                  "(%zu calls)\n", raw_busy.flood.frames_per_s, busy.median, busy.p99,
                  raw_busy.rtt_us.size());
      report.add("routed_rtt_64B_during_raw_flood_" + suffix, busy.median, "us");
      report.add("routed_rtt_64B_during_raw_flood_" + suffix + "_p99", busy.p99, "us");
    }
    report.add("router_peak_rss_" + suffix + "_MiB", peak_mib, "MiB");
  }

  // Allocations on the forwarding thread (in-process router).
  auto [allocs, inproc_rate] = inprocess_forward(dir.path(), cfg.messages);
  std::printf("in-process router, 1 pair: %.0f msgs/s, %.3f allocations per forwarded message "
              "on its broker thread\n", inproc_rate, allocs);
  report.add("allocs_per_msg_forward", allocs, "allocs/msg");
  report.add("routed_throughput_1_clients_inprocess_router", inproc_rate, "msgs/s",
             floors.empty() ? std::nullopt : std::optional<double>(floors.front().second));

#ifdef SPINDLE_BENCH_HAVE_ZMQ
  {
    bench::ZmqProxy zproxy(dir.path());
    auto z = bench::percentiles(bench::zmq_rtt(zproxy, kSize, cfg.rtt_warmup, cfg.rtt_iters));
    report.add("zmq_proxy_rtt_64B", z.median, "us", raw.median);
    report.add("zmq_proxy_rtt_64B_p99", z.p99, "us", raw.p99);
    constexpr int kZmqClients = 16;
    const std::uint64_t per_client = std::max<std::uint64_t>(cfg.messages / kZmqClients, 1);
    const double zrate = bench::zmq_throughput(zproxy, kZmqClients, per_client, kSize,
                                               std::min(kZmqClients, kMaxSenderThreads));
    double floor = 0;
    for (auto& [n, f] : floors)
      if (n == kZmqClients) floor = f;
    if (floor == 0)
      floor = bench::relay_throughput(kZmqClients, per_client, kSize, kMaxSenderThreads).frames_per_s;
    std::printf("zmq_proxy (libzmq %d.%d.%d, ipc://): rtt median %.1f us / p99 %.1f us; "
                "16 clients %.0f msgs/s\n", ZMQ_VERSION_MAJOR, ZMQ_VERSION_MINOR, ZMQ_VERSION_PATCH,
                z.median, z.p99, zrate);
    report.add("zmq_proxy_throughput_16_clients", zrate, "msgs/s", floor);
  }
#else
  std::printf("zmq_proxy rows skipped: bench_router was built without libzmq\n");
#endif

  std::printf("load average at end: %s", [] {
    std::ifstream f("/proc/loadavg");
    std::string s;
    std::getline(f, s);
    return s + " (other load on the machine skews every row)\n";
  }().c_str());
  proc.stop(SIGTERM);
  report.finish();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Report report("bench_router");
  Config cfg;
  try {
    report.take_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_router: %s\n", e.what());
    return usage(argv[0]);
  }
  bool messages_given = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") {
      cfg.quick = true;
    } else if (a == "--messages" && i + 1 < argc) {
      long long m = std::atoll(argv[++i]);
      if (m < 1) return usage(argv[0]);
      cfg.messages = static_cast<std::uint64_t>(m);
      messages_given = true;
    } else if (a == "--clients" && i + 1 < argc) {  // e.g. 256, or 1,16
      cfg.clients.clear();
      std::stringstream list(argv[++i]);
      for (std::string n; std::getline(list, n, ',');) {
        const int c = std::atoi(n.c_str());
        if (c < 1 || c > 4096) return usage(argv[0]);
        cfg.clients.push_back(c);
      }
    } else {
      return usage(argv[0]);
    }
  }
  if (cfg.quick) {
    cfg.rtt_warmup = 200;
    cfg.rtt_iters = 2000;
    if (!messages_given) cfg.messages = 60'000;
  }
  log().set_level(spdlog::level::warn);
  ::signal(SIGPIPE, SIG_IGN);  // the raw relay's writers: a dead peer shows up as EPIPE
  raise_fd_limit();
  try {
    return run(cfg, report);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_router: error: %s\n", e.what());
    return 1;
  }
}
