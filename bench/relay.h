// Relay: the least a router does, for bench_router's floor.
//
// One thread reads frames (Spindle's 26-byte header + body) from its input
// sockets, decodes each header to find the frame's length and destination,
// and writes runs of frames for one destination with one writev, pointing
// into what it read (no copy). No accounts, no queues, no back-pressure
// beyond the kernel's: what it cannot write it waits for. bench/relay_floor.h
// puts it between threads where spindle-router sits between two clients.
//
// Thread safety: a Relay is started and stopped by one thread; its loop runs
// on its own thread. An error in the loop (a bad frame, a failed syscall)
// shuts every socket it knows down (so nobody waits on it) and is rethrown
// by stop().
// Ownership: the Relay borrows the fds it is given; the callers close them.
#pragma once


#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "spindle/frame.h"

namespace spindle::bench {

inline constexpr const char* kErrRelayBadFrame = "relay: a frame with an unknown enc";
inline constexpr const char* kErrRelayNoRoute = "relay: no route for a frame's dst_id";
inline constexpr const char* kErrRelayEof = "relay: EOF while bytes were expected";
inline constexpr const char* kErrRelayTooLong = "relay: a frame longer than 16 MiB";

[[noreturn]] inline void relay_fail(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

// Writes every byte of iov[0..n) (a blocking or non-blocking fd).
inline void writev_all(int fd, iovec* iov, int n) {
  while (n > 0) {
    ssize_t w = ::writev(fd, iov, std::min(n, IOV_MAX));
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        pollfd p{fd, POLLOUT, 0};
        if (::poll(&p, 1, -1) < 0 && errno != EINTR) relay_fail("poll");
        continue;
      }
      relay_fail("writev");
    }
    auto left = static_cast<std::size_t>(w);
    while (n > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --n;
    }
    if (n > 0) {
      iov->iov_base = static_cast<std::uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
}

// Reads exactly n bytes from a blocking fd; false on EOF before the first.
inline bool read_exact(int fd, void* p, std::size_t n) {
  auto* b = static_cast<std::uint8_t*>(p);
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, b + got, n - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      relay_fail("read");
    }
    if (r == 0) {
      if (got == 0) return false;
      throw std::runtime_error(kErrRelayEof);
    }
    got += static_cast<std::size_t>(r);
  }
  return true;
}

class Relay {
 public:
  // Reads frames from `inputs`; a frame for dst_id d is written to routes[d].
  Relay(std::vector<int> inputs, std::unordered_map<std::uint32_t, int> routes)
      : routes_(std::move(routes)) {
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (epoll_ < 0) relay_fail("epoll_create1");
    stop_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (stop_ < 0) relay_fail("eventfd");
    add(stop_, -1);
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      int fl = ::fcntl(inputs[i], F_GETFL);
      if (fl < 0 || ::fcntl(inputs[i], F_SETFL, fl | O_NONBLOCK) < 0) relay_fail("fcntl");
      inputs_.push_back({inputs[i], std::vector<std::uint8_t>(kBuffer), 0});
      add(inputs[i], static_cast<int>(i));
    }
    thread_ = std::thread([this] {
      try {
        const std::uint64_t cpu0 = thread_cpu_ns();
        loop();
        cpu_ns_ = thread_cpu_ns() - cpu0;
      } catch (...) {
        error_ = std::current_exception();
        // Whoever waits on the other ends sees EOF (or EPIPE) instead of hanging.
        for (const Input& in : inputs_) ::shutdown(in.fd, SHUT_RDWR);
        for (const auto& [dst, fd] : routes_) ::shutdown(fd, SHUT_RDWR);
      }
    });
  }
  ~Relay() {
    try {
      stop();
    } catch (...) {
    }
  }
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;

  void stop() {
    if (thread_.joinable()) {
      std::uint64_t one = 1;
      if (::write(stop_, &one, sizeof one) != sizeof one) relay_fail("eventfd write");
      thread_.join();
      ::close(stop_);
      ::close(epoll_);
    }
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }
  // CPU time (user + sys) of the relay thread; valid after stop().
  std::uint64_t cpu_ns() const { return cpu_ns_; }

 private:
  static constexpr std::size_t kBuffer = 256 * 1024;
  static constexpr std::uint32_t kMaxFrame = 16u << 20;
  struct Input {
    int fd;
    std::vector<std::uint8_t> buf;
    std::size_t used;
  };

  static std::uint64_t thread_cpu_ns() {
    rusage ru{};
    if (::getrusage(RUSAGE_THREAD, &ru) < 0) relay_fail("getrusage");
    auto ns = [](const timeval& tv) {
      return static_cast<std::uint64_t>(tv.tv_sec) * 1'000'000'000u +
             static_cast<std::uint64_t>(tv.tv_usec) * 1000u;
    };
    return ns(ru.ru_utime) + ns(ru.ru_stime);
  }

  void add(int fd, int index) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = static_cast<std::uint64_t>(index + 1);  // 0: the stop eventfd
    if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev) < 0) relay_fail("epoll_ctl");
  }

  void loop() {
    epoll_event evs[64];
    for (;;) {
      int n = ::epoll_wait(epoll_, evs, 64, -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        relay_fail("epoll_wait");
      }
      for (int i = 0; i < n; ++i) {
        if (evs[i].data.u64 == 0) return;
        pump(inputs_[evs[i].data.u64 - 1]);
      }
    }
  }

  // One read, then every complete frame in the buffer goes out.
  void pump(Input& in) {
    ssize_t r = ::read(in.fd, in.buf.data() + in.used, in.buf.size() - in.used);
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) return;
      relay_fail("relay read");
    }
    if (r == 0) {  // the writer is gone: stop watching it
      if (::epoll_ctl(epoll_, EPOLL_CTL_DEL, in.fd, nullptr) < 0) relay_fail("epoll_ctl");
      return;
    }
    in.used += static_cast<std::size_t>(r);
    std::size_t at = 0, need = 0;
    int out_fd = -1;
    iov_.clear();
    while (in.used - at >= kHeaderSize) {
      const std::uint8_t* p = in.buf.data() + at;
      Header h = decode_header(p);
      if (!is_known_enc(h.enc)) throw std::runtime_error(kErrRelayBadFrame);
      if (h.length > kMaxFrame) throw std::runtime_error(kErrRelayTooLong);
      if (in.used - at < kHeaderSize + h.length) {
        need = kHeaderSize + h.length;
        break;
      }
      auto route = routes_.find(h.dst_id);
      if (route == routes_.end()) throw std::runtime_error(kErrRelayNoRoute);
      if (route->second != out_fd || iov_.size() + 2 > IOV_MAX) {
        flush(out_fd);
        out_fd = route->second;
      }
      iov_.push_back({const_cast<std::uint8_t*>(p), kHeaderSize + h.length});
      at += kHeaderSize + h.length;
    }
    flush(out_fd);
    std::memmove(in.buf.data(), in.buf.data() + at, in.used - at);
    in.used -= at;
    if (need > in.buf.size()) in.buf.resize(need);  // after the writes: they point into it
  }

  void flush(int fd) {
    if (fd >= 0 && !iov_.empty()) writev_all(fd, iov_.data(), static_cast<int>(iov_.size()));
    iov_.clear();
  }

  std::unordered_map<std::uint32_t, int> routes_;
  std::vector<Input> inputs_;
  std::vector<iovec> iov_;
  int epoll_ = -1, stop_ = -1;
  std::uint64_t cpu_ns_ = 0;
  std::thread thread_;
  std::exception_ptr error_;
};

}  // namespace spindle::bench
