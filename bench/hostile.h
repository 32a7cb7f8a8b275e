// Hostile clients for `bench_load --hostile K` (issue #11 §5): raw clients of
// one spindle-router that attack it while the honest load runs, each on a
// thread of its own, for as long as the Swarm lives. The kinds, assigned
// round-robin over K:
//   0 dead-reply flood: tiny frames with reply_to set, addressed to a context
//     that does not exist, from a client that never reads its own socket
//     (tests/test_hardening.cpp, DeadReplyFlood...);
//   1 sparse memfds: a Mitogen-dialect client that never reads, and an
//     fd-passing client sending it sealed sparse memfds, repeatedly: 120 MiB
//     ones, which no client allowance admits (AClientsMemfdBody...), in turn
//     with 12 MiB ones, which are streamed (SparseMemfdToAnFdlessPeer...);
//   2 log flood: FORWARD_LOG frames as fast as the router takes them
//     (ForwardLogFloodIsRateLimited; the router needs --accept-client-logs).
// A client the router disconnects (stall timeout, protocol error) is counted
// and connected again. Only the non-readers of kinds 0 and 1 never read: the
// memfd sender and the log flooder drain what the router sends them, so that
// what they exercise is their own flood, not the stall rule again.
//
// Thread safety: a Swarm is built, read (totals()) and stopped from one
// thread; its counters are atomics shared with its client threads.
// Ownership: the Swarm owns its threads and their sockets.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "broker/errors.h"
#include "stream/fd_control.h"
#include "stream/fd_frame.h"
#include "spindle/fds.h"
#include "tests/raw_peer.h"

namespace spindle::bench::hostile {

enum Kind : int { kDeadReplyFlood = 0, kSparseMemfds = 1, kLogFlood = 2 };
inline constexpr int kKinds = 3;
inline constexpr std::array<const char*, kKinds> kKindNames = {"dead_reply_flood", "sparse_memfds",
                                                                "log_flood"};

inline constexpr std::uint32_t kNoSuchContext = 999999;
inline constexpr std::uint32_t kAnyHandle = 2000;
inline constexpr std::size_t kSparseBody = 120u << 20;  // under the default 128M message size
inline constexpr std::size_t kSmallSparseBody = 12u << 20;  // within a 16M peer limit
inline constexpr int kFramesPerBurst = 4096;
inline constexpr int kPyWarning = 30;  // logged by a router at --log-level warn
inline constexpr std::chrono::milliseconds kPollSlice{20};  // how often a blocked client checks stop
inline constexpr std::chrono::milliseconds kReconnectPause{50};  // after a failed connect

struct Counters {
  std::atomic<std::uint64_t> clients{0}, frames{0}, bytes{0}, connects{0}, disconnects{0},
      connect_failures{0};
};

struct KindTotals {
  std::uint64_t clients = 0, frames = 0, bytes = 0, connects = 0, disconnects = 0,
                connect_failures = 0;
};

namespace detail {

// Whether the router has closed (or half-closed) this connection. Polls for
// hang-up only: nothing is read, so a non-reader stays one.
inline bool hung_up(int fd, std::chrono::milliseconds wait = std::chrono::milliseconds(0),
                    short also = 0) {
  pollfd pf{fd, static_cast<short>(POLLRDHUP | also), 0};
  int r = ::poll(&pf, 1, static_cast<int>(wait.count()));
  return r > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// Reads and discards what is waiting; false once the router has closed.
inline bool drain(int fd) {
  char buf[64 * 1024];
  for (;;) {
    ssize_t r = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (r > 0) continue;
    if (r < 0 && errno == EINTR) continue;
    return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
}

}  // namespace detail

class Swarm {
 public:
  // Starts `count` hostile clients of the router listening on `socket`.
  Swarm(std::string socket, int count) : address_(UnixAddress::parse(socket)) {
    for (int i = 0; i < count; ++i) {
      Counters& c = counters_[i % kKinds];
      ++c.clients;
      threads_.emplace_back([this, i, &c] { run(static_cast<Kind>(i % kKinds), c); });
    }
  }
  ~Swarm() { stop(); }
  Swarm(const Swarm&) = delete;
  Swarm& operator=(const Swarm&) = delete;

  void stop() {
    stop_.store(true);
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }
  KindTotals totals(Kind k) const {
    const Counters& c = counters_[k];
    return {c.clients.load(), c.frames.load(), c.bytes.load(), c.connects.load(),
            c.disconnects.load(), c.connect_failures.load()};
  }
  // Errors that ended a client's thread early (none expected).
  std::vector<std::string> errors() const {
    std::lock_guard lk(err_mu_);
    return errors_;
  }

 private:
  bool stopping() const { return stop_.load(std::memory_order_relaxed); }

  void run(Kind kind, Counters& c) {
    try {
      while (!stopping()) {
        if (kind == kSparseMemfds)
          sparse_memfds(c);
        else
          flood(kind, c);
      }
    } catch (const std::exception& e) {
      std::lock_guard lk(err_mu_);
      errors_.push_back(fmt::format("{}: {}", kKindNames[kind], e.what()));
    }
  }

  // A connected, handshaken raw client, or null (counted) if the router
  // refused it; the pause keeps a refusing router from being hammered.
  template <typename Handshake>
  std::unique_ptr<testutil::RawPeer> join(Counters& c, Handshake hs, std::uint32_t& id) {
    try {
      auto p = std::make_unique<testutil::RawPeer>(testutil::RawPeer::connect_to(address_));
      id = hs(*p);
      ++c.connects;
      return p;
    } catch (const Error&) {
      ++c.connect_failures;
      std::this_thread::sleep_for(kReconnectPause);
      return nullptr;
    }
  }

  // Kinds 0 and 2: one connection, written as fast as the router reads it,
  // until the router disconnects it (counted) or the swarm stops.
  void flood(Kind kind, Counters& c) {
    std::uint32_t id = 0;
    auto p = join(c, [](testutil::RawPeer& r) { return r.handshake(); }, id);
    if (!p) return;
    std::string burst, one;
    for (int i = 0; i < kFramesPerBurst; ++i) {
      if (kind == kDeadReplyFlood)
        one = testutil::frame_bytes(testutil::frame(kNoSuchContext, id, id, kAnyHandle, 7), "");
      else
        one = testutil::frame_bytes(
            testutil::frame(0, id, id, kHandleForwardLog, 0, kEncMitogen),
            fmt::format("hostile{}{}{}LINE-{}", '\0', kPyWarning, '\0', i));
      burst += one;
    }
    const bool reads = kind == kLogFlood;
    const std::size_t frame_size = one.size();  // every frame of a burst has the same size
    std::size_t off = 0;
    while (!stopping()) {
      if (reads && !detail::drain(p->fd)) break;
      ssize_t n = ::send(p->fd, burst.data() + off, burst.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.bytes += static_cast<std::uint64_t>(n);
        c.frames += (off + static_cast<std::size_t>(n)) / frame_size - off / frame_size;
        off = (off + static_cast<std::size_t>(n)) % burst.size();
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) break;  // EPIPE, ECONNRESET
      // The router stopped reading us: wait for room, or for it to hang up.
      if (detail::hung_up(p->fd, kPollSlice, POLLOUT)) break;
    }
    if (!stopping()) ++c.disconnects;
  }

  // Kind 1: a Mitogen client that never reads, and an fd-passing client
  // sending it sparse memfds. Whichever the router disconnects is counted and
  // connected again; the sender then addresses the new non-reader.
  void sparse_memfds(Counters& c) {
    std::uint32_t mito_id = 0, src_id = 0;
    const auto pid = static_cast<std::uint32_t>(::getpid());
    auto mito = join(c, [pid](testutil::RawPeer& r) { return r.mitogen_handshake(pid); }, mito_id);
    if (!mito) return;
    std::unique_ptr<testutil::RawPeer> src;
    while (!stopping()) {
      if (detail::hung_up(mito->fd)) break;
      if (!src) {
        src = join(c, [](testutil::RawPeer& r) { return r.handshake(kFlagFdPassing); }, src_id);
        continue;
      }
      if (!send_memfd(*src, *mito, mito_id, src_id, c)) {
        src.reset();
        if (!stopping()) ++c.disconnects;
      }
    }
    if (!stopping()) ++c.disconnects;
  }

  // One SF frame with a fresh sparse memfd; false if the router closed the
  // sender. Returns true without sending when the non-reader was closed or
  // the swarm stops before the first byte went out (the caller looks again).
  bool send_memfd(testutil::RawPeer& src, testutil::RawPeer& mito, std::uint32_t mito_id,
                  std::uint32_t src_id, Counters& c) {
    UniqueFd body = testutil::sparse_memfd(c.frames.load() % 2 ? kSparseBody : kSmallSparseBody);
    const auto bytes = testutil::memfd_frame(mito_id, src_id, kAnyHandle, 0, kEncMitogen);
    std::size_t off = 0;
    while (off < bytes.size()) {
      // Once a frame is part-written it is finished, or the stream is garbage
      // (unless the swarm stops: then the connection is dropped anyway).
      if (stopping() || (off == 0 && detail::hung_up(mito.fd))) return true;
      if (!detail::drain(src.fd)) return false;
      ssize_t n;
      if (off == 0) {
        int fd = body.get();
        iovec iov{const_cast<std::uint8_t*>(bytes.data()), bytes.size()};
        msghdr mh{};
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        FdControl control;
        control.attach(mh, std::span<const int>(&fd, 1));
        n = ::sendmsg(src.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      } else {
        n = ::send(src.fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      if (n > 0) {
        off += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return false;
      if (detail::hung_up(src.fd, kPollSlice, POLLOUT)) return false;
    }
    ++c.frames;
    c.bytes += kSparseBody;
    return true;
  }

  UnixAddress address_;
  std::atomic<bool> stop_{false};
  std::array<Counters, kKinds> counters_;
  std::vector<std::thread> threads_;
  mutable std::mutex err_mu_;
  std::vector<std::string> errors_;
};

}  // namespace spindle::bench::hostile
