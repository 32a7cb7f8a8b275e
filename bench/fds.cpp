// bench_fds: file descriptors and large payloads across processes, each
// figure beside the floor measured in the same run on the same machine.
//
//   fds     fds passed per second: Context::send of N messages carrying one
//           fd each to a forked child that closes them (the last message is
//           a call that answers with the count), vs. a raw socketpair loop of
//           sendmsg/recvmsg with one SCM_RIGHTS fd per 90-byte frame.
//   big     one 256 MiB payload to a forked child that reads every byte and
//           answers with its VmHWM: through a sealed memfd the producer filled
//           in place (PayloadBuffer), through the socket (memfd disabled), and
//           as a memcpy into fresh and into pre-faulted memory. Throughput is
//           end to end: from send() until the receiver's handler has read the
//           last byte (both processes read CLOCK_MONOTONIC); the producer's
//           fill and the reply's way back are shown apart in the notes.
//
// Usage: bench_fds [--quick] [--section fds|big] [--json PATH]
// Rows (bench/report.h; names in bench/README.md) go to PATH as JSON.
// Exits 0 whether or not the targets are met; non-zero only on real errors.
#include <malloc.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "bench/report.h"
#include "broker/log.h"
#include "router/child.h"
#include "stream/memfd.h"

namespace {

using Clock = std::chrono::steady_clock;
using spindle::Payload;

constexpr std::uint32_t kTakeFd = 2200, kCount = 2201, kSum = 2202;
constexpr std::size_t kFdWindow = 4096;
constexpr double kMemfdTargetGBs = 5.0;
constexpr double kRssTarget = 1.1;

struct Config {
  bool quick = false, fds = true, big = true;
  std::size_t n_fds = 200'000;
  std::size_t big_size = std::size_t{256} << 20;
};

[[noreturn]] void fail_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A field of /proc/self/status ("VmHWM", "VmRSS") in bytes.
std::uint64_t status_kib_bytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1)) * 1024;
  return 0;
}

std::vector<std::string> g_lines, g_notes;
spindle::bench::Report g_report("bench_fds");
void row(const std::string& what, const std::string& spindle, const std::string& floor,
         const std::string& ratio, const std::string& target = {}, int met = -1) {
  g_lines.push_back(fmt::format("{:<44} {:>12} {:>16} {:>7}  {:<14} {}", what, spindle, floor, ratio,
                                target, met < 0 ? "" : met ? "MET" : "MISSED"));
}

// ------------------------------------------------------------------ fds/s

// A msghdr over one iovec with room for one fd of ancillary data.
msghdr one_fd_msghdr(iovec& iov, char (&control)[CMSG_SPACE(sizeof(int))]) {
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  return mh;
}

// The floor: one fd per sendmsg over a raw socketpair to a process that
// receives and closes it.
double raw_fds_per_second(std::size_t n) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) fail_errno("socketpair");
  const int passed = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  pid_t pid = ::fork();
  if (pid < 0) fail_errno("fork");
  std::uint8_t frame[spindle::kHeaderSize + 64] = {};
  if (pid == 0) {
    ::close(sv[0]);
    std::size_t got = 0;
    while (got < n) {
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
      iovec iov{frame, sizeof frame};
      msghdr mh = one_fd_msghdr(iov, control);
      ssize_t r = ::recvmsg(sv[1], &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL);
      if (r <= 0) ::_exit(1);
      for (cmsghdr* c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
        ::close(fd);
        ++got;
      }
    }
    (void)!::write(sv[1], &got, sizeof got);
    ::_exit(0);
  }
  ::close(sv[1]);
  auto t0 = Clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    iovec iov{frame, sizeof frame};
    msghdr mh = one_fd_msghdr(iov, control);
    cmsghdr* c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &passed, sizeof passed);
    if (::sendmsg(sv[0], &mh, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof frame)) fail_errno("sendmsg");
  }
  std::size_t got = 0;
  if (::read(sv[0], &got, sizeof got) != sizeof got || got != n)
    throw std::runtime_error("raw fds: the receiver did not count every fd");
  double s = since(t0);
  ::close(sv[0]);
  ::close(passed);
  ::waitpid(pid, nullptr, 0);
  return static_cast<double>(n) / s;
}

double spindle_fds_per_second(std::size_t n) {
  spindle::Broker broker;
  spindle::Router router(broker, {});
  spindle::Context child = spindle::fork_child(router, [](spindle::ChildEnv& env) {
    auto& r = env.router();
    auto count = std::make_shared<std::size_t>(0);
    r.add_handler([count](spindle::Message&& m) { *count += m.fds.size(); }, {}, kTakeFd);
    r.add_handler([&r, count](spindle::Message&& m) {
      r.reply(m, Payload::copy_of(std::to_string(*count)));
    }, {}, kCount);
    env.serve();
    return 0;
  });
  const int passed = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int one[1] = {passed};
  auto t0 = Clock::now();
  for (std::size_t i = 0; i < n; ++i) {
    spindle::Message m = spindle::Message::make(child.id(), kTakeFd, {});
    m.fds = spindle::FdSet::dup_of(one);  // the message owns what it passes
    router.send(std::move(m));
    // Queued messages hold their fds open in this process (the byte
    // high-water mark does not bound them): a round trip now and then keeps
    // the sender far below its RLIMIT_NOFILE.
    if (i % kFdWindow == kFdWindow - 1) child.call(kCount, std::string_view{});
  }
  std::string got = child.call(kCount, std::string_view{}, std::chrono::seconds(120));
  double s = since(t0);
  ::close(passed);
  if (got != std::to_string(n)) throw std::runtime_error("fds: the child counted " + got);
  child.shutdown();
  child.wait_exit();
  return static_cast<double>(n) / s;
}

void section_fds(const Config& cfg) {
  double sp = spindle_fds_per_second(cfg.n_fds);
  double raw = raw_fds_per_second(cfg.n_fds);
  row("fds passed per second (1 fd per message)", fmt::format("{:.0f} k/s", sp / 1e3),
      fmt::format("{:.0f} k/s", raw / 1e3), fmt::format("{:.2f}x", sp / raw));
  g_report.add("fd_pass_per_s", sp, "fds/s", raw);
  g_notes.push_back(fmt::format("fds: N = {}; spindle Context::send with a dup'd fd each (the "
                                "dup is counted) and a call every {} sends; raw: blocking sendmsg "
                                "of one fd per frame",
                                cfg.n_fds, kFdWindow));
}

// ------------------------------------------------------------------ 256 MiB

constexpr std::uint64_t kPattern = 0x9E3779B97F4A7C15ull;

void fill(std::uint8_t* p, std::size_t size) {
  auto* w = reinterpret_cast<std::uint64_t*>(p);
  for (std::size_t k = 0; k < size / 8; ++k) w[k] = k * kPattern;
}

// Reads every byte, as a consumer of the payload would.
std::uint64_t checksum(const Payload& p) {
  std::uint64_t sum = 0;
  for (const spindle::Slice& s : p.slices()) {
    const std::uint8_t* d = s.data;
    std::size_t i = 0;
    for (; i + 8 <= s.size; i += 8) {
      std::uint64_t v;
      std::memcpy(&v, d + i, 8);
      sum += v;
    }
    for (; i < s.size; ++i) sum += d[i];
  }
  return sum;
}

struct BigRun {
  double fill_s = 0, transfer_s = 0;
  double to_handler_s = 0, read_s = 0;  // send -> handler runs; the handler's read
  std::uint64_t child_hwm = 0, child_base_hwm = 0;
  bool arrived_as_memfd = false;
};

enum class Path { kFabricMemfd, kHeapMemfd, kSocket };

BigRun spindle_big(std::size_t size, Path path) {
  const bool memfd = path != Path::kSocket;
  ::malloc_trim(0);
  BigRun run;
  spindle::Broker broker;
  spindle::RouterOptions ro;
  ro.max_message_size = static_cast<std::uint32_t>(size + (1u << 20));
  if (!memfd) ro.memfd_threshold = SIZE_MAX;  // the socket path
  spindle::Router router(broker, ro);
  spindle::ChildOptions co;
  co.router = ro;
  spindle::Context child = spindle::fork_child(router, [](spindle::ChildEnv& env) {
    auto& r = env.router();
    r.add_handler([&r](spindle::Message&& m) {
      auto t_in = Clock::now().time_since_epoch().count();  // CLOCK_MONOTONIC: same in both
      std::uint64_t sum = checksum(m.data);
      auto t_read = Clock::now().time_since_epoch().count();
      r.reply(m, Payload::copy_of(fmt::format("{} {} {} {} {} {}", m.data.size(), sum,
                                              status_kib_bytes("VmHWM"), m.data.memfd() ? 1 : 0,
                                              t_in, t_read)));
    }, {}, kSum);
    r.add_handler([&r](spindle::Message&& m) {
      r.reply(m, Payload::copy_of(std::to_string(status_kib_bytes("VmHWM"))));
    }, {}, kCount);
    env.serve();
    return 0;
  }, co);
  run.child_base_hwm = std::stoull(child.call(kCount, std::string_view{}));
  Payload payload;
  auto t0 = Clock::now();
  std::shared_ptr<spindle::Chunk> chunk;
  if (path == Path::kFabricMemfd) {
    spindle::PayloadBuffer buf(size);  // the producer writes into fabric memory
    fill(buf.bytes().data(), size);
    payload = std::move(buf).seal();
  } else {
    chunk = std::make_shared<spindle::Chunk>(size);
    fill(chunk->data(), size);
    payload = Payload::adopt(chunk, size);
  }
  run.fill_s = since(t0);
  std::uint64_t want = 0;
  for (std::size_t k = 0; k < size / 8; ++k) want += k * kPattern;
  auto t1 = Clock::now();
  std::string rep = child.call(kSum, std::move(payload), std::chrono::seconds(300)).to_string();
  run.transfer_s = since(t1);
  unsigned long long got = 0, sum = 0, hwm = 0;
  long long t_in = 0, t_read = 0;
  int as_memfd = 0;
  if (std::sscanf(rep.c_str(), "%llu %llu %llu %d %lld %lld", &got, &sum, &hwm, &as_memfd, &t_in,
                  &t_read) != 6 ||
      got != size || sum != want)
    throw std::runtime_error("big: wrong reply '" + rep + "'");
  run.child_hwm = hwm;
  run.to_handler_s = static_cast<double>(t_in - t1.time_since_epoch().count()) / 1e9;
  run.read_s = static_cast<double>(t_read - t_in) / 1e9;
  run.arrived_as_memfd = as_memfd == 1;
  child.shutdown();
  child.wait_exit();
  return run;
}

double memcpy_s(std::size_t size, bool prefault) {
  std::vector<std::uint8_t> src(size);
  fill(src.data(), size);
  auto* dst = static_cast<std::uint8_t*>(std::malloc(size));
  if (!dst) throw std::runtime_error("memcpy: malloc failed");
  if (prefault) std::memset(dst, 0xa5, size);
  auto t0 = Clock::now();
  std::memcpy(dst, src.data(), size);
  double s = since(t0);
  bool ok = dst[size - 1] == src[size - 1];
  std::free(dst);
  if (!ok) throw std::runtime_error("memcpy: wrong bytes");
  return s;
}

void section_big(const Config& cfg) {
  const std::size_t size = cfg.big_size;
  const double gb = static_cast<double>(size) / 1e9, mib = static_cast<double>(size) / (1 << 20);
  BigRun mfd = spindle_big(size, Path::kFabricMemfd);
  BigRun heap = spindle_big(size, Path::kHeapMemfd);
  BigRun sock = spindle_big(size, Path::kSocket);
  double cpy_fresh = memcpy_s(size, false), cpy = memcpy_s(size, true);
  if (!mfd.arrived_as_memfd || !heap.arrived_as_memfd)
    throw std::runtime_error("big: a memfd run arrived inline");
  if (sock.arrived_as_memfd) throw std::runtime_error("big: the socket run arrived as a memfd");
  const double heap_s = heap.to_handler_s + heap.read_s;
  const double mfd_s = mfd.to_handler_s + mfd.read_s, sock_s = sock.to_handler_s + sock.read_s;
  const double mfd_gbs = gb / mfd_s;
  row(fmt::format("{:.0f} MiB via memfd (fabric buffer), GB/s", mib), fmt::format("{:.2f} GB/s", mfd_gbs),
      fmt::format("{:.2f} GB/s", gb / cpy_fresh), fmt::format("{:.2f}x", cpy_fresh / mfd_s),
      fmt::format(">= {:.0f} GB/s", kMemfdTargetGBs), mfd_gbs >= kMemfdTargetGBs);
  row(fmt::format("{:.0f} MiB heap payload via memfd (1 copy), GB/s", mib),
      fmt::format("{:.2f} GB/s", gb / heap_s), fmt::format("{:.2f} GB/s", gb / cpy_fresh),
      fmt::format("{:.2f}x", cpy_fresh / heap_s));
  row(fmt::format("{:.0f} MiB via socket, GB/s", mib), fmt::format("{:.2f} GB/s", gb / sock_s),
      fmt::format("{:.2f} GB/s", gb / cpy_fresh), fmt::format("{:.2f}x", cpy_fresh / sock_s));
  row("  best any one-copy design could do, GB/s", fmt::format("{:.2f} GB/s", gb / (mfd_s + cpy)),
      fmt::format("{:.2f} GB/s", mfd_gbs), fmt::format("{:.2f}x", mfd_s / (mfd_s + cpy)));
  row(fmt::format("{:.0f} MiB memcpy, fresh / pre-faulted dst", mib), "",
      fmt::format("{:.2f} / {:.2f} GB/s", gb / cpy_fresh, gb / cpy), "");
  auto ratio = [&](const BigRun& r) { return static_cast<double>(r.child_hwm) / static_cast<double>(size); };
  row("  receiver VmHWM / payload, memfd", fmt::format("{:.3f}x", ratio(mfd)), "1.000x", "",
      fmt::format("<= {:.1f}x", kRssTarget), ratio(mfd) <= kRssTarget);
  row("  receiver VmHWM / payload, socket", fmt::format("{:.3f}x", ratio(sock)), "1.000x", "",
      fmt::format("<= {:.1f}x", kRssTarget), ratio(sock) <= kRssTarget);
  g_notes.push_back(fmt::format(
      "big: {} bytes; GB/s = send -> the receiver has read every byte; producer fill "
      "{:.3f} s (fresh memfd buffer) / {:.3f} s (heap); memfd incl. fill {:.2f} GB/s; receiver VmHWM "
      "before {:.1f} MiB (memfd run) / {:.1f} MiB (socket run); floor column = memcpy into fresh memory",
      size, mfd.fill_s, sock.fill_s, gb / (mfd.fill_s + mfd_s), mfd.child_base_hwm / 1048576.0,
      sock.child_base_hwm / 1048576.0));
  for (const auto& [name, r] : {std::pair<const char*, const BigRun&>{"memfd", mfd},
                                {"heap->memfd", heap}, {"socket", sock}})
    g_notes.push_back(fmt::format("big {}: send -> handler {:.1f} ms, handler reads all {:.1f} ms, "
                                  "reply back (incl. the receiver dropping the payload) {:.1f} ms",
                                  name, r.to_handler_s * 1e3, r.read_s * 1e3,
                                  (r.transfer_s - r.to_handler_s - r.read_s) * 1e3));

  // Rows: GB/s send -> read; the memfd and socket paths against memcpy into
  // fresh memory, the heap payload against the same payload built in a
  // fabric buffer (what the one copy into a memfd costs).
  const std::string sz = fmt::format("{:.0f}MiB", mib);
  g_report.add("fabric_memfd_" + sz, mfd_gbs, "GB/s", gb / cpy_fresh);
  g_report.add("heap_payload_memfd_" + sz, gb / heap_s, "GB/s", mfd_gbs);
  // The best any design that copies a heap payload once before delivering it
  // could do in this run: the fabric run's time (hand-off and the receiver's
  // read, which no copy removes) plus the copy at the speed of memcpy into
  // pre-faulted memory, the fastest a copy goes here. A message is delivered
  // whole, so the receiver cannot read while the copy runs. Its ratio to the
  // same floor is the ceiling of the row above.
  g_report.add("heap_payload_memfd_" + sz + "_one_copy_bound", gb / (mfd_s + cpy), "GB/s", mfd_gbs);
  g_report.add("socket_payload_" + sz, gb / sock_s, "GB/s", gb / cpy_fresh);
  g_report.add("payload_memcpy_fresh_" + sz, gb / cpy_fresh, "GB/s");
  g_report.add("payload_memcpy_prefaulted_" + sz, gb / cpy, "GB/s");
  g_report.add("fabric_memfd_" + sz + "_incl_fill", gb / (mfd.fill_s + mfd_s), "GB/s");
  // The whole job, building included, on each side: a producer that fills
  // heap memory and sends it (one copy into a memfd) against one that fills
  // a fabric buffer and sends it (no copy, but its fill faults in shmem
  // pages, which cost more than anonymous ones). The row above leaves the
  // building out: the copy against nothing.
  g_report.add("heap_payload_memfd_" + sz + "_incl_build", gb / (heap.fill_s + heap_s), "GB/s",
               gb / (mfd.fill_s + mfd_s));
  g_report.add("receiver_hwm_per_payload_memfd", ratio(mfd), "x", 1.0);
  g_report.add("receiver_hwm_per_payload_socket", ratio(sock), "x", 1.0);
  g_report.add("receiver_hwm_before_memfd_MiB", mfd.child_base_hwm / 1048576.0, "MiB");
  g_report.add("receiver_hwm_before_socket_MiB", sock.child_base_hwm / 1048576.0, "MiB");
  for (const auto& [name, r] : {std::pair<const char*, const BigRun&>{"fabric_memfd_", mfd},
                                {"heap_payload_memfd_", heap}, {"socket_payload_", sock}}) {
    const std::string base = name + sz;
    g_report.add(base + "_fill_ms", r.fill_s * 1e3, "ms");
    g_report.add(base + "_to_handler_ms", r.to_handler_s * 1e3, "ms");
    g_report.add(base + "_read_ms", r.read_s * 1e3, "ms");
    g_report.add(base + "_reply_ms", (r.transfer_s - r.to_handler_s - r.read_s) * 1e3, "ms");
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  try {
    g_report.take_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fds: %s\nusage: %s [--quick] [--section fds|big] [--json PATH]\n",
                 e.what(), argv[0]);
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") {
      cfg.quick = true;
      cfg.n_fds = 20'000;
      cfg.big_size = std::size_t{32} << 20;
    } else if (a == "--section" && i + 1 < argc) {
      std::string s = argv[++i];
      cfg.fds = s == "fds";
      cfg.big = s == "big";
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--section fds|big] [--json PATH]\n", argv[0]);
      return 2;
    }
  }
  spindle::log().set_level(spdlog::level::warn);
  ::signal(SIGPIPE, SIG_IGN);
  try {
    if (cfg.fds) section_fds(cfg);
    if (cfg.big) section_big(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fds: error: %s\n", e.what());
    return 1;
  }
  std::printf("\nspindle bench_fds%s  (%ld online CPUs)\n", cfg.quick ? " --quick" : "",
              ::sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("%-44s %12s %16s %7s  %-14s %s\n", "case", "spindle", "floor (same run)", "ratio",
              "target", "result");
  for (const auto& l : g_lines) std::printf("%s\n", l.c_str());
  for (const auto& n : g_notes) std::printf("  %s\n", n.c_str());
  try {
    g_report.finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fds: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
