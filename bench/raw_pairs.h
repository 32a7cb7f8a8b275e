// Raw pairs: the clients of a throughput row, written by hand so that they
// cost next to nothing, for bench_router. Writer i sends `per_pair` frames to
// reader i through whatever sits between their sockets: the relay of the
// floor (bench/relay_floor.h), or a real spindle-router. The two runs then
// differ only in that middle hop, which is what the rows compare.
//
// `threads` writer threads take their pairs in turn, `batch` prebuilt frames
// per write; one reader thread (epoll) reads every reader socket and counts
// the frames that carry kRawPairsHandle. It parses each header rather than
// counting bytes, since a router may also send a client frames of its own
// (route announcements); those are skipped.
//
// Thread safety: run_raw_pairs() runs on the caller's thread and joins every
// thread it starts; an error in any of them is rethrown.
// Ownership: borrows the fds it is given; the caller closes them.
#pragma once

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <thread>
#include <vector>

#include "bench/relay.h"
#include "spindle/frame.h"

namespace spindle::bench {

inline constexpr std::uint32_t kRawPairsHandle = 2400;
inline constexpr const char* kErrRawPairsTimeout = "raw pairs: not every frame arrived within 120 s";

// A frame: header (dst, src, handle) + body.
inline std::vector<std::uint8_t> relay_frame(std::uint32_t dst, std::uint32_t src,
                                             std::uint32_t handle, std::size_t body_size) {
  Header h;
  h.dst_id = dst;
  h.src_id = h.auth_id = src;
  h.handle = handle;
  h.length = static_cast<std::uint32_t>(body_size);
  HeaderBytes hb = encode_header(h);
  std::vector<std::uint8_t> f(hb.begin(), hb.end());
  for (std::size_t i = 0; i < body_size; ++i) f.push_back(static_cast<std::uint8_t>(i * 7 + 1));
  return f;
}

inline void write_exact(int fd, const void* p, std::size_t n) {
  iovec iov{const_cast<void*>(p), n};
  writev_all(fd, &iov, 1);
}

// One pair: the socket writer i writes to, the socket reader i reads from,
// and the ids its frames carry.
struct RawPair {
  int writer_fd = -1;
  int reader_fd = -1;
  std::uint32_t dst = 0, src = 0;
};

// Where the reader is in one socket's stream of frames.
struct FrameScan {
  int fd = -1;
  std::array<std::uint8_t, kHeaderSize> header{};
  std::size_t header_have = 0;
  std::uint64_t body_left = 0;

  // Consumes n bytes; returns how many frames for kRawPairsHandle began in them.
  std::uint64_t feed(const std::uint8_t* p, std::size_t n) {
    std::uint64_t counted = 0;
    while (n > 0) {
      if (body_left > 0) {
        const std::size_t skip = static_cast<std::size_t>(std::min<std::uint64_t>(body_left, n));
        body_left -= skip;
        p += skip;
        n -= skip;
        continue;
      }
      const std::size_t take = std::min(kHeaderSize - header_have, n);
      std::copy_n(p, take, header.begin() + static_cast<std::ptrdiff_t>(header_have));
      header_have += take;
      p += take;
      n -= take;
      if (header_have < kHeaderSize) break;
      header_have = 0;
      const Header h = decode_header(header.data());
      body_left = h.length;
      if (h.handle == kRawPairsHandle) ++counted;
    }
    return counted;
  }
};

// Seconds from the first write until reader i has counted `per_pair` frames
// for every i.
inline double run_raw_pairs(const std::vector<RawPair>& pairs, std::uint64_t per_pair, std::size_t body,
                            int threads, std::uint64_t batch) {
  using Clock = std::chrono::steady_clock;
  const std::size_t frame = kHeaderSize + body;
  const std::uint64_t total = static_cast<std::uint64_t>(pairs.size()) * per_pair;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto guard = [&](auto fn) {
    try {
      fn();
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
  };
  const Clock::time_point t0 = Clock::now();
  Clock::time_point t1 = t0;
  std::thread reader([&] {
    guard([&] {
      int ep = ::epoll_create1(EPOLL_CLOEXEC);
      if (ep < 0) relay_fail("epoll_create1");
      std::vector<FrameScan> scans(pairs.size());
      for (std::size_t i = 0; i < pairs.size(); ++i) {
        scans[i].fd = pairs[i].reader_fd;
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.ptr = &scans[i];
        if (::epoll_ctl(ep, EPOLL_CTL_ADD, pairs[i].reader_fd, &ev) < 0) relay_fail("epoll_ctl");
      }
      std::vector<std::uint8_t> buf(256 * 1024);
      std::uint64_t got = 0;
      const auto deadline = Clock::now() + std::chrono::seconds(120);
      epoll_event evs[64];
      while (got < total && !failed.load()) {
        if (Clock::now() > deadline) throw std::runtime_error(kErrRawPairsTimeout);
        int n = ::epoll_wait(ep, evs, 64, 200);
        if (n < 0 && errno != EINTR) relay_fail("epoll_wait");
        for (int i = 0; i < n; ++i) {
          auto* scan = static_cast<FrameScan*>(evs[i].data.ptr);
          ssize_t r = ::recv(scan->fd, buf.data(), buf.size(), MSG_DONTWAIT);
          if (r < 0 && errno != EAGAIN && errno != EINTR) relay_fail("recv");
          if (r == 0) throw std::runtime_error(kErrRelayEof);
          if (r > 0) got += scan->feed(buf.data(), static_cast<std::size_t>(r));
        }
      }
      t1 = Clock::now();
      ::close(ep);
    });
  });
  std::vector<std::thread> writers;
  const int n_pairs = static_cast<int>(pairs.size());
  for (int t = 0; t < threads; ++t)
    writers.emplace_back([&, t] {
      guard([&] {
        std::vector<std::vector<std::uint8_t>> batches;  // `batch` frames for each pair of ours
        std::vector<int> mine;
        for (int i = t; i < n_pairs; i += threads) {
          mine.push_back(i);
          const RawPair& p = pairs[static_cast<std::size_t>(i)];
          std::vector<std::uint8_t> f = relay_frame(p.dst, p.src, kRawPairsHandle, body);
          batches.emplace_back();
          for (std::uint64_t k = 0; k < batch; ++k)
            batches.back().insert(batches.back().end(), f.begin(), f.end());
        }
        for (std::uint64_t k = 0; k < per_pair && !failed.load(); k += batch) {
          const std::uint64_t n = std::min(batch, per_pair - k);
          for (std::size_t j = 0; j < mine.size(); ++j)
            write_exact(pairs[static_cast<std::size_t>(mine[j])].writer_fd, batches[j].data(), n * frame);
        }
      });
    });
  for (auto& w : writers) w.join();
  reader.join();
  if (error) std::rethrow_exception(error);
  return std::chrono::duration<double>(t1 - t0).count();
}

}  // namespace spindle::bench
