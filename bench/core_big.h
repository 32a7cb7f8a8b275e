// bench_core's `big` section (see bench/core.cpp): one 256 MiB message to a
// forked child over the socket path, its throughput and the receiver's peak
// RSS, beside a raw socketpair transfer into one buffer and two memcpys.
//
// Thread safety: the bench's main thread only.
#pragma once

#include <malloc.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "bench/core_common.h"
#include "router/child.h"
#include "spindle/spindle.h"

namespace spindle::bench::core {

// ---------------------------------------------------------------------------
// 3. One big message
// ---------------------------------------------------------------------------
// The payload pattern: 64-bit word k holds k * a constant, so a sample of
// words shows the bytes arrived in the right places.
inline constexpr std::uint64_t kPattern = 0x9E3779B97F4A7C15ull;

inline void check_sample(const Payload& p) {
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

inline BigRun spindle_big(const Config& cfg, std::shared_ptr<spindle::Chunk>& chunk_out) {
  const std::size_t size = cfg.big_size;
  BigRun run;
  ::malloc_trim(0);  // the child inherits our resident pages at fork; keep it lean
  spindle::RouterOptions ro;
  ro.max_message_size = static_cast<std::uint32_t>(
      std::max<std::uint64_t>(spindle::kDefaultMaxMessageSize, size + (1u << 20)));
  ro.memfd_threshold = SIZE_MAX;  // this row is the socket path; bench_fds measures memfd
  BenchRouter parent(ro);
  spindle::ChildOptions co;
  co.name = "big-receiver";
  co.router = BenchRouter::named(ro);
  spindle::Context child = spindle::fork_child(
      parent.router,
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

inline double raw_big(const std::shared_ptr<spindle::Chunk>& chunk, std::size_t size) {
  RawChild c = fork_raw([size](int fd) {
    // One preallocated buffer, not pre-faulted: the receiver of a fresh
    // message pays its page faults, as Spindle's receiver does.
    auto* buf = static_cast<std::uint8_t*>(std::malloc(size));
    if (!buf) throw std::runtime_error("raw big: malloc failed");
    if (!read_exact(fd, buf, size)) throw std::runtime_error("raw big: EOF");
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
  if (!read_exact(c.fd, &last, sizeof last)) throw std::runtime_error("raw big: reader died");
  auto t1 = Clock::now();
  if (last != (size / 8 - 1) * kPattern) throw std::runtime_error("raw big: wrong bytes");
  reap_raw(c);
  return secs(t1 - t0);
}

// prefault: true measures memory bandwidth alone; false adds the page faults
// a receiver of fresh memory pays (as the two socket rows above do).
inline double memcpy_big(const std::shared_ptr<spindle::Chunk>& chunk, std::size_t size, bool prefault) {
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

inline void section_big(const Config& cfg) {
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

}  // namespace spindle::bench::core
