// The floor of a routed message for bench_router: a raw two-hop relay
// (bench/relay.h) between threads of this process, exactly where
// spindle-router sits between two clients, so each message makes the same
// two hops.
//
//   relay_rtt         one frame A -> relay -> B (echo) -> relay -> A.
//   relay_throughput  N writers -> relay -> N readers.
//
// Thread safety: each function runs on the caller's thread and joins every
// thread it starts; errors in any of them are rethrown.
#pragma once

#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <vector>

#include "bench/relay.h"
#include "spindle/frame.h"
#include "spindle/options.h"

namespace spindle::bench {

inline constexpr const char* kErrRelayTimeout = "relay floor: not every frame arrived within 120 s";
inline constexpr const char* kErrRelayEcho = "relay floor: the echo came back wrong";


// A frame for the relay: header (dst, src, handle) + body.
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

inline std::array<int, 2> stream_pair() {
  std::array<int, 2> sv{};
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv.data()) < 0) relay_fail("socketpair");
  return sv;
}

inline void write_exact(int fd, const void* p, std::size_t n) {
  iovec iov{const_cast<void*>(p), n};
  writev_all(fd, &iov, 1);
}

// Round trips of one frame A -> relay -> B (echo) -> relay -> A, in us.
// `caller_polls`: A polls for its answer before it sleeps, as a Spindle
// caller that leads its loop does (RouterOptions::wait_spin); the relay and
// the echo sleep, as the router's and the callee's broker threads do.
inline void poll_before_read(int fd) {
  const auto until = std::chrono::steady_clock::now() + kDefaultWaitSpin;
  pollfd p{fd, POLLIN, 0};
  while (std::chrono::steady_clock::now() < until) {
    int n = ::poll(&p, 1, 0);
    if (n > 0) return;
    if (n < 0 && errno != EINTR) relay_fail("poll");
    ::sched_yield();
  }
}

inline std::vector<double> relay_rtt(std::size_t body, int warmup, int iters, bool caller_polls = false) {
  using Clock = std::chrono::steady_clock;
  auto a = stream_pair(), b = stream_pair();  // [0]: the client's end, [1]: the relay's
  std::vector<double> us;
  std::exception_ptr echo_error;
  {
    Relay relay({a[1], b[1]}, {{1, a[1]}, {2, b[1]}});
    std::thread echo([&] {
      try {
        std::vector<std::uint8_t> f(kHeaderSize + body);
        while (read_exact(b[0], f.data(), f.size())) {
          Header h = decode_header(f.data());
          std::swap(h.dst_id, h.src_id);
          HeaderBytes hb = encode_header(h);
          std::memcpy(f.data(), hb.data(), kHeaderSize);
          write_exact(b[0], f.data(), f.size());
        }
      } catch (...) {
        echo_error = std::current_exception();
      }
    });
    const std::vector<std::uint8_t> req = relay_frame(2, 1, 2400, body);
    std::vector<std::uint8_t> back(req.size());
    us.reserve(static_cast<std::size_t>(iters));
    std::exception_ptr error;
    try {
      for (int i = 0; i < warmup + iters; ++i) {
        auto t0 = Clock::now();
        write_exact(a[0], req.data(), req.size());
        if (caller_polls) poll_before_read(a[0]);
        if (!read_exact(a[0], back.data(), back.size())) throw std::runtime_error(kErrRelayEof);
        auto t1 = Clock::now();
        if (decode_header(back.data()).dst_id != 1 ||
            std::memcmp(back.data() + kHeaderSize, req.data() + kHeaderSize, body) != 0)
          throw std::runtime_error(kErrRelayEcho);
        if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
    } catch (...) {
      error = std::current_exception();
    }
    try {
      relay.stop();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    ::shutdown(b[1], SHUT_RDWR);  // the echo thread sees EOF
    echo.join();
    for (int fd : {a[0], a[1], b[0], b[1]}) ::close(fd);
    if (error) std::rethrow_exception(error);
  }
  if (echo_error) std::rethrow_exception(echo_error);
  return us;
}

// Frames per second from `pairs` writers to `pairs` readers through one
// relay thread: writer i -> relay -> reader i, `per_pair` frames each, from
// `threads` writer threads that take their pairs in turn, `batch` frames per
// write (64: the kernel's best; 1: each message its own write, the pattern
// of clients that interleave many destinations); one reader thread (epoll)
// counts the bytes. Timed from the start until the last byte is read.
struct RelayRun {
  double frames_per_s = 0;
  double relay_cpu_ns_per_frame = 0;  // the relay thread's CPU time (user + sys)
};

// Frames a writer sends to one pair before it turns to the next: the
// floor's batch, and the turn of bench_router's senders in the same rows.
inline constexpr std::uint64_t kFramesPerTurn = 64;

inline RelayRun relay_throughput(int pairs, std::uint64_t per_pair, std::size_t body, int threads,
                                 std::uint64_t batch = kFramesPerTurn) {
  using Clock = std::chrono::steady_clock;
  const std::size_t frame = kHeaderSize + body;
  std::vector<std::array<int, 2>> in, out;
  std::vector<int> inputs;
  std::unordered_map<std::uint32_t, int> routes;
  for (int i = 0; i < pairs; ++i) {
    in.push_back(stream_pair());
    out.push_back(stream_pair());
    inputs.push_back(in.back()[1]);
    routes[1000 + static_cast<std::uint32_t>(i)] = out.back()[0];
  }
  const std::uint64_t total = static_cast<std::uint64_t>(pairs) * per_pair * frame;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto guard = [&](auto fn) {
    try {
      fn();
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
  };
  Clock::time_point t0, t1;
  std::uint64_t relay_cpu = 0;
  {
    Relay relay(inputs, routes);
    t0 = Clock::now();
    std::thread reader([&] {
      guard([&] {
        int ep = ::epoll_create1(EPOLL_CLOEXEC);
        if (ep < 0) relay_fail("epoll_create1");
        for (auto& o : out) {
          epoll_event ev{};
          ev.events = EPOLLIN;
          ev.data.fd = o[1];
          if (::epoll_ctl(ep, EPOLL_CTL_ADD, o[1], &ev) < 0) relay_fail("epoll_ctl");
        }
        std::vector<std::uint8_t> buf(256 * 1024);
        std::uint64_t got = 0;
        const auto deadline = Clock::now() + std::chrono::seconds(120);
        epoll_event evs[64];
        while (got < total && !failed.load()) {
          if (Clock::now() > deadline) throw std::runtime_error(kErrRelayTimeout);
          int n = ::epoll_wait(ep, evs, 64, 200);
          if (n < 0 && errno != EINTR) relay_fail("epoll_wait");
          for (int i = 0; i < n; ++i) {
            ssize_t r = ::recv(evs[i].data.fd, buf.data(), buf.size(), MSG_DONTWAIT);
            if (r < 0 && errno != EAGAIN && errno != EINTR) relay_fail("recv");
            if (r == 0) throw std::runtime_error(kErrRelayEof);
            if (r > 0) got += static_cast<std::uint64_t>(r);
          }
        }
        t1 = Clock::now();
        ::close(ep);
      });
    });
    std::vector<std::thread> writers;
    for (int t = 0; t < threads; ++t)
      writers.emplace_back([&, t] {
        guard([&] {
          const std::uint64_t kBatch = batch;
          std::vector<std::vector<std::uint8_t>> batches;  // `batch` frames for each pair of ours
          std::vector<int> mine;
          for (int i = t; i < pairs; i += threads) {
            mine.push_back(i);
            std::vector<std::uint8_t> f = relay_frame(1000 + static_cast<std::uint32_t>(i),
                                                      2000 + static_cast<std::uint32_t>(i), 2400, body);
            batches.emplace_back();
            for (std::uint64_t k = 0; k < kBatch; ++k)
              batches.back().insert(batches.back().end(), f.begin(), f.end());
          }
          for (std::uint64_t k = 0; k < per_pair && !failed.load(); k += kBatch) {
            const std::uint64_t n = std::min(kBatch, per_pair - k);
            for (std::size_t j = 0; j < mine.size(); ++j)
              write_exact(in[static_cast<std::size_t>(mine[j])][0], batches[j].data(), n * frame);
          }
        });
      });
    for (auto& w : writers) w.join();
    reader.join();
    for (auto& i : in) ::close(i[0]);
    guard([&] { relay.stop(); });
    relay_cpu = relay.cpu_ns();
  }
  for (auto& i : in) ::close(i[1]);
  for (auto& o : out) {
    ::close(o[0]);
    ::close(o[1]);
  }
  if (error) std::rethrow_exception(error);
  const double frames = static_cast<double>(pairs) * static_cast<double>(per_pair);
  return {frames / std::chrono::duration<double>(t1 - t0).count(),
          static_cast<double>(relay_cpu) / frames};
}

}  // namespace spindle::bench
