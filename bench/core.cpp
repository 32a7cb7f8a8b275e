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
// The sections are bench/core_rtt.h, bench/core_oneway.h and
// bench/core_big.h; what they share (pinning, raw children, the table) is
// bench/core_common.h.
//
// Usage: bench_core [--quick] [--section rtt|oneway|big] [--json PATH]
// Rows (bench/report.h; names in bench/README.md) go to PATH as JSON.
// Exits 0 whether or not the targets are met; non-zero only on real errors
// (a wrong reply, a child that failed, a syscall that failed).
#include <sched.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "bench/core_big.h"
#include "bench/core_common.h"
#include "bench/core_oneway.h"
#include "bench/core_rtt.h"
#include "broker/log.h"

namespace {

void usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--quick] [--section rtt|oneway|big] [--json PATH]\n", argv0);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace spindle::bench::core;
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
