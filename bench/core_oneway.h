// bench_core's `oneway` section (see bench/core.cpp): N one-way 64 B
// messages through Context::send to a counting handler, beside a writev
// loop of 64 frames per call to a reader process, in alternating rounds;
// with each side's CPU and allocations per message.
//
// Thread safety: the bench's main thread only.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "bench/alloc_count.h"
#include "bench/core_common.h"
#include "router/child.h"
#include "spindle/spindle.h"

namespace spindle::bench::core {

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

inline std::size_t steady_from(std::size_t n) { return n / 4; }

inline OnewayRun spindle_oneway(const Config& cfg) {
  const std::size_t n = cfg.oneway_n;
  OnewayRun run;
  BenchRouter parent;
  spindle::ChildOptions co;
  co.name = "oneway-counter";
  spindle::Context child = spindle::fork_child(
      parent.router,
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

inline OnewayRun raw_oneway(const Config& cfg) {
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
  if (!read_exact(c.fd, ack, sizeof ack)) throw std::runtime_error("raw reader died");
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
inline OnewayRun median_round(std::vector<OnewayRun> runs, std::string& spread) {
  std::sort(runs.begin(), runs.end(), [](const OnewayRun& a, const OnewayRun& b) { return a.seconds < b.seconds; });
  spread = fmt::format("{:.3f}-{:.3f} s", runs.front().seconds, runs.back().seconds);
  return runs[runs.size() / 2];
}

inline void section_oneway(const Config& cfg) {
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

}  // namespace spindle::bench::core
