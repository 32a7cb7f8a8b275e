// The floor of a routed message for bench_router: a raw two-hop relay
// (bench/relay.h) between threads of this process, exactly where
// spindle-router sits between two clients, so each message makes the same
// two hops.
//
//   relay_rtt         one frame A -> relay -> B (echo) -> relay -> A.
//   relay_throughput  N writers -> relay -> N readers (bench/raw_pairs.h).
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

#include "bench/raw_pairs.h"
#include "bench/relay.h"
#include "spindle/frame.h"
#include "spindle/options.h"

namespace spindle::bench {

inline constexpr const char* kErrRelayEcho = "relay floor: the echo came back wrong";


inline std::array<int, 2> stream_pair() {
  std::array<int, 2> sv{};
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv.data()) < 0) relay_fail("socketpair");
  return sv;
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
// counts the frames (bench/raw_pairs.h: the same clients as bench_router's
// raw-client rows). Timed from the start until the last frame is read.
struct RelayRun {
  double frames_per_s = 0;
  double relay_cpu_ns_per_frame = 0;  // the relay thread's CPU time (user + sys)
};

// Frames a writer sends to one pair before it turns to the next: the
// floor's batch, and the turn of bench_router's senders in the same rows.
inline constexpr std::uint64_t kFramesPerTurn = 64;

inline RelayRun relay_throughput(int pairs, std::uint64_t per_pair, std::size_t body, int threads,
                                 std::uint64_t batch = kFramesPerTurn) {
  std::vector<std::array<int, 2>> in, out;
  std::vector<int> inputs;
  std::unordered_map<std::uint32_t, int> routes;
  std::vector<RawPair> ends;
  for (int i = 0; i < pairs; ++i) {
    in.push_back(stream_pair());
    out.push_back(stream_pair());
    inputs.push_back(in.back()[1]);
    const std::uint32_t dst = 1000 + static_cast<std::uint32_t>(i);
    routes[dst] = out.back()[0];
    ends.push_back({in.back()[0], out.back()[1], dst, 2000 + static_cast<std::uint32_t>(i)});
  }
  std::exception_ptr error;
  double secs = 0;
  std::uint64_t relay_cpu = 0;
  {
    Relay relay(inputs, routes);
    try {
      secs = run_raw_pairs(ends, per_pair, body, threads, batch);
    } catch (...) {
      error = std::current_exception();
    }
    for (auto& i : in) ::close(i[0]);
    try {
      relay.stop();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
    relay_cpu = relay.cpu_ns();
  }
  for (auto& i : in) ::close(i[1]);
  for (auto& o : out) {
    ::close(o[0]);
    ::close(o[1]);
  }
  if (error) std::rethrow_exception(error);
  const double frames = static_cast<double>(pairs) * static_cast<double>(per_pair);
  return {frames / secs, static_cast<double>(relay_cpu) / frames};
}

}  // namespace spindle::bench
