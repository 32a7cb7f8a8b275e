// bench_load: the load scenario (tests/load_scenario.h) at the full
// size, 256 clients x 10,000 messages to random peers through one real
// spindle-router, and messages per second beside a floor measured in the same
// run: the same frames (26-byte header + payload) written through one raw
// socketpair by one thread and read by another, which is what one hop costs
// the kernel without any routing (each routed message makes two hops).
//
// Usage: bench_load [--quick] [--clients N] [--messages M] [--size BYTES] [--json PATH]
// Rows (bench/report.h; names in bench/README.md) go to the --json PATH.
// --quick (the CI smoke run): 16 clients x 500 messages.
// Exit status 0 only if nothing was lost, corrupted or reordered.
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench/report.h"
#include "tests/load_scenario.h"
#include "tests/process_util.h"
#include "tests/router_probe.h"

namespace {

using namespace spindle;

std::string router_binary() {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "spindle-router").string();
}

// Frames per second through one socketpair, writer and reader threads.
double socketpair_floor(std::size_t frame_size, std::size_t frames) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw Error("socketpair");
  const std::size_t total = frame_size * frames;
  auto start = std::chrono::steady_clock::now();
  std::thread reader([&] {
    std::vector<char> buf(256 * 1024);
    std::size_t got = 0;
    while (got < total) {
      ssize_t r = ::read(sv[1], buf.data(), buf.size());
      if (r <= 0) break;
      got += static_cast<std::size_t>(r);
    }
  });
  std::vector<char> frame(frame_size, 'f');
  for (std::size_t i = 0; i < frames; ++i) {
    std::size_t off = 0;
    while (off < frame_size) {
      ssize_t w = ::write(sv[0], frame.data() + off, frame_size - off);
      if (w <= 0) throw Error(std::string("socketpair write: ") + errno_text(errno));
      off += static_cast<std::size_t>(w);
    }
  }
  reader.join();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::close(sv[0]);
  ::close(sv[1]);
  return static_cast<double>(frames) / s;
}

void raise_fd_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bench::Report report("bench_load");
  const char* usage = "usage: bench_load [--quick] [--clients N] [--messages M] [--size BYTES] [--json PATH]\n";
  try {
    report.take_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_load: %s\n%s", e.what(), usage);
    return 2;
  }
  load::Options o;
  o.clients = 256;
  o.messages = 10000;
  o.guard = std::chrono::seconds(900);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--quick") {
      o.clients = 16;
      o.messages = 500;
    } else if (a == "--clients" && i + 1 < argc) {
      o.clients = std::atoi(argv[++i]);
    } else if (a == "--messages" && i + 1 < argc) {
      o.messages = std::atoi(argv[++i]);
    } else if (a == "--size" && i + 1 < argc) {
      o.size = static_cast<std::size_t>(std::atol(argv[++i]));
    } else {
      std::fprintf(stderr, "%s", usage);
      return 2;
    }
  }
  raise_fd_limit();  // each client is a broker and a socket: 256 of them need fds
  log().set_level(spdlog::level::warn);
  testutil::TempDir dir;
  o.socket = dir.path() + "/router.sock";
  testutil::RouterProcess router(router_binary(), o.socket, {"--log-level", "warn"});
  if (!router.wait_ready()) {
    std::fprintf(stderr, "bench_load: the router did not start:\n%s\n", router.log().c_str());
    return 1;
  }
  const long rss_before = testutil::vm_rss_kib(router.pid());
  load::Result r = load::run(o);
  const long rss_after = testutil::vm_rss_kib(router.pid());
  const std::uint64_t total = static_cast<std::uint64_t>(o.clients) * o.messages;
  const double floor = socketpair_floor(26 + std::max<std::size_t>(o.size, 12), std::min<std::uint64_t>(total, 2000000));

  std::printf("bench_load: %d clients x %d messages of %zu bytes to random peers\n", o.clients,
              o.messages, o.size);
  std::printf("  delivered       %llu / %llu  (out of order %llu, corrupt %llu, send errors %llu%s)\n",
              static_cast<unsigned long long>(r.received), static_cast<unsigned long long>(total),
              static_cast<unsigned long long>(r.out_of_order), static_cast<unsigned long long>(r.corrupt),
              static_cast<unsigned long long>(r.send_errors), r.timed_out ? ", TIMED OUT" : "");
  std::printf("  routed          %10.0f messages/s  (%.2f s)\n", r.received / r.seconds, r.seconds);
  std::printf("  floor           %10.0f frames/s through one raw socketpair (one hop; a routed\n"
              "                  message makes two, so half of this is the kernel's ceiling: %.0f/s)\n",
              floor, floor / 2);
  std::printf("  router VmRSS    %ld KiB before, %ld KiB after\n", rss_before, rss_after);
  for (auto& e : r.errors) std::printf("  error: %s\n", e.c_str());
  bool ok = !r.timed_out && r.received == total && r.out_of_order == 0 && r.corrupt == 0 &&
            r.send_errors == 0;
  // The floor of a routed message is two hops: half the one-hop rate.
  const std::string name = fmt::format("load_{}_clients_random_peers", o.clients);
  report.add(name, r.received / r.seconds, "msgs/s", floor / 2);
  report.add("load_socketpair_one_hop", floor, "frames/s");
  report.add(name + "_seconds", r.seconds, "s");
  report.add(name + "_lost", static_cast<double>(total - std::min(total, r.received)), "msgs");
  report.add(name + "_out_of_order", static_cast<double>(r.out_of_order), "msgs");
  report.add(name + "_corrupt", static_cast<double>(r.corrupt), "msgs");
  report.add(name + "_send_errors", static_cast<double>(r.send_errors), "msgs");
  report.add("load_router_rss_before_KiB", static_cast<double>(rss_before), "KiB");
  report.add("load_router_rss_after_KiB", static_cast<double>(rss_after), "KiB");
  try {
    report.finish();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_load: error: %s\n", e.what());
    return 1;
  }
  return ok ? 0 : 1;
}
