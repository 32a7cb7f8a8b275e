// RawPeer: one end of a connection to a router, driven by hand, byte by byte.
//
// Role: speaks the wire protocol (docs/PROTOCOL.md) without a Broker or a
// Router of its own, so tests, benchmarks and fuzzers can send what no
// well-behaved peer would: forged ids, bad magic, truncated frames, floods.
// Either a socketpair whose other end a Router adopts as a child (router_end),
// or a connected UNIX socket to a listening router (connect_to()).
// Failures to write or to read in time throw Error (no gtest here: the fuzzers
// use it too).
//
// Thread safety: one thread at a time. Ownership: owns fd; router_end, once
// handed to a router, belongs to it.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <string>
#include <string_view>
#include <vector>

#include "broker/errors.h"
#include "router/router.h"
#include "router/unix_address.h"
#include "stream/byte_order.h"
#include "stream/fd_frame.h"
#include "spindle/fds.h"
#include "spindle/frame.h"
#include "stream/handshake.h"
#include "stream/listener_handshake.h"
#include "spindle/message.h"

namespace spindle::testutil {

// A frame header in the Spindle raw encoding; length is set when sent.
inline Header frame(std::uint32_t dst, std::uint32_t src, std::uint32_t auth, std::uint32_t handle,
                    std::uint32_t reply_to, std::uint16_t enc = kEncRaw) {
  Header h;
  h.enc = enc;
  h.dst_id = dst;
  h.src_id = src;
  h.auth_id = auth;
  h.handle = handle;
  h.reply_to = reply_to;
  return h;
}

// A sealed, sparse memfd of `size` bytes: nothing in it is ever touched, so
// it costs nothing to make whatever size it claims. Throws Error.
inline UniqueFd sparse_memfd(std::size_t size) {
  UniqueFd fd(::memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd.get() < 0) throw Error(std::string("memfd_create: ") + errno_text(errno));
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0)
    throw Error(std::string("ftruncate(memfd): ") + errno_text(errno));
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0)
    throw Error(std::string("F_ADD_SEALS: ") + errno_text(errno));
  return fd;
}

// The bytes of an SF frame whose body is the one memfd sent with them
// (docs/PROTOCOL.md §13): header and fd prefix, no inline body.
inline std::vector<std::uint8_t> memfd_frame(std::uint32_t dst, std::uint32_t src, std::uint32_t handle,
                                             std::uint32_t reply_to, std::uint16_t body_enc = kEncRaw) {
  Header h = frame(dst, src, src, handle, reply_to, kEncFds);
  h.length = kFdPrefixSize;
  HeaderBytes hb = encode_header(h);
  auto prefix = encode_fd_prefix(FdPrefix{body_enc, 1, kFdFlagMemfdBody});
  std::vector<std::uint8_t> v(hb.begin(), hb.end());
  v.insert(v.end(), prefix.begin(), prefix.end());
  return v;
}

// A frame's bytes: its 26-byte header (length = body size) and body.
inline std::string frame_bytes(Header h, std::string_view body) {
  h.length = static_cast<std::uint32_t>(body.size());
  HeaderBytes hb = encode_header(h);
  std::string out(reinterpret_cast<const char*>(hb.data()), hb.size());
  out.append(body);
  return out;
}

class RawPeer {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kDefaultTimeout{10000};

  // A socketpair: fd is ours, router_end is for the router to adopt.
  RawPeer() {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
      throw Error(std::string("socketpair: ") + errno_text(errno));
    router_end = sv[0];
    fd = sv[1];
  }
  // A client socket connected to a listening router.
  static RawPeer connect_to(const UnixAddress& address) { return RawPeer(connect_unix(address)); }
  RawPeer(RawPeer&& o) noexcept : fd(o.fd), router_end(o.router_end), server_id(o.server_id) {
    o.fd = o.router_end = -1;
  }
  RawPeer& operator=(RawPeer&&) = delete;
  ~RawPeer() {
    if (fd >= 0) ::close(fd);
  }

  void write_all(const void* p, std::size_t n) {
    auto* c = static_cast<const std::uint8_t*>(p);
    while (n > 0) {
      ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw Error(std::string("raw peer write: ") + errno_text(errno));
      c += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  void write_all(std::string_view bytes) { write_all(bytes.data(), bytes.size()); }
  // Reads exactly n bytes. Returns n on success, 0 on EOF before any byte,
  // -1 on timeout, error or EOF part-way.
  long read_exact(void* p, std::size_t n, std::chrono::milliseconds timeout = kDefaultTimeout) {
    auto* c = static_cast<std::uint8_t*>(p);
    std::size_t got = 0;
    auto deadline = Clock::now() + timeout;
    while (got < n) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return -1;
      pollfd pf{fd, POLLIN, 0};
      int pr = ::poll(&pf, 1, static_cast<int>(left.count()));
      if (pr < 0 && errno == EINTR) continue;
      if (pr <= 0) return -1;
      ssize_t r = ::read(fd, c + got, n - got);
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (r < 0 && errno == ECONNRESET) return got == 0 ? 0 : -1;
      if (r < 0) return -1;
      if (r == 0) return got == 0 ? 0 : -1;
      got += static_cast<std::size_t>(r);
    }
    return static_cast<long>(n);
  }
  void send_frame(Header h, std::string_view payload) { write_all(frame_bytes(h, payload)); }
  // Reads one frame; false on EOF or timeout.
  bool read_frame(Message& out, std::chrono::milliseconds timeout = kDefaultTimeout) {
    std::uint8_t hb[kHeaderSize];
    if (read_exact(hb, kHeaderSize, timeout) != static_cast<long>(kHeaderSize)) return false;
    out.header = decode_header(hb);
    std::string body(out.header.length, '\0');
    if (out.header.length &&
        read_exact(body.data(), body.size(), timeout) != static_cast<long>(body.size()))
      return false;
    out.data = Payload::copy_of(body);
    return true;
  }
  // Reads frames until one with dst `dst` and handle `handle` arrives (others
  // are skipped); false on EOF or timeout.
  bool read_frame_for(std::uint32_t dst, std::uint32_t handle, Message& out,
                      std::chrono::milliseconds timeout = kDefaultTimeout) {
    auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (!read_frame(out, left)) return false;
      if (out.header.dst_id == dst && out.header.handle == handle) return true;
    }
    return false;
  }
  // The Spindle handshake: sends the hello (with `flags`, e.g. kFlagFdPassing),
  // reads the welcome; returns the id assigned (and records the server's). Throws Error on a refusal or timeout.
  std::uint32_t handshake(std::uint16_t flags = kFlagNone) {
    auto hello = encode_hello(kProtocolVersion, flags, static_cast<std::uint32_t>(::getpid()));
    write_all(hello.data(), hello.size());
    std::uint8_t w[kWelcomeSize];
    if (read_exact(w, kWelcomeSize) != static_cast<long>(kWelcomeSize) ||
        std::memcmp(w, "SPDL", 4) != 0)
      throw Error("raw peer: no welcome");
    server_id = be::get32(w + 12);
    announced_max = be::get32(w + 20);
    return be::get32(w + 8);
  }
  // The Mitogen handshake (mitogen.unix.connect): our pid as 4 bytes, then
  // 12 bytes back (new id, listener id, listener pid). Returns the new id.
  std::uint32_t mitogen_handshake(std::uint32_t pid, std::uint32_t* listener_id = nullptr,
                                  std::uint32_t* listener_pid = nullptr) {
    std::uint8_t hello[kMitogenHelloSize];
    be::put32(hello, pid);
    write_all(hello, sizeof hello);
    std::uint8_t r[kMitogenReplySize];
    if (read_exact(r, sizeof r) != static_cast<long>(sizeof r)) throw Error("raw peer: no Mitogen reply");
    server_id = be::get32(r + 4);
    if (listener_id) *listener_id = server_id;
    if (listener_pid) *listener_pid = be::get32(r + 8);
    return be::get32(r);
  }
  // Reads until EOF; true if EOF came within the timeout. Frames seen on the
  // way are appended to `seen`.
  bool wait_eof(std::vector<Message>* seen, std::chrono::milliseconds timeout = kDefaultTimeout) {
    auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      Message m;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      std::uint8_t hb[kHeaderSize];
      long r = read_exact(hb, kHeaderSize, left);
      if (r == 0) return true;
      if (r < 0) return false;
      m.header = decode_header(hb);
      std::string body(m.header.length, '\0');
      if (m.header.length && read_exact(body.data(), body.size(), left) != static_cast<long>(body.size()))
        return false;
      m.data = Payload::copy_of(body);
      if (seen) seen->push_back(std::move(m));
    }
    return false;
  }
  // Asks the root for `n` ids, one ALLOCATE_ID each and at most 1,024 at a
  // time (what a link may hold unannounced), and announces each with
  // ADD_ROUTE, as a client with children behind it does (`self` is this
  // peer's id). Returns the ids granted. Throws Error if a request is
  // refused or unanswered.
  std::vector<std::uint32_t> allocate_and_announce(std::uint32_t self, std::size_t n) {
    constexpr std::size_t kWindow = 1024;
    std::vector<std::uint32_t> ids;
    for (std::size_t done = 0; done < n;) {
      const std::size_t window = std::min(kWindow, n - done);
      std::string batch;
      // reply_to from 1000 up: 999 is IS_DEAD, and a dead request gets no answer.
      for (std::size_t k = 0; k < window; ++k)
        batch += frame_bytes(frame(0, self, self, kHandleAllocateId, static_cast<std::uint32_t>(1000 + k), kEncMitogen), "");
      write_all(batch);
      std::vector<std::uint32_t> granted;
      for (std::size_t k = 0; k < window; ++k) {
        Message m;
        if (!read_frame_for(self, static_cast<std::uint32_t>(1000 + k), m))
          throw Error("raw peer: ALLOCATE_ID " + std::to_string(done + k) + " got no answer");
        if (m.header.is_dead()) throw Error("raw peer: ALLOCATE_ID refused: " + m.text());
        granted.push_back(static_cast<std::uint32_t>(std::stoul(m.text())));
      }
      announce(self, granted);
      ids.insert(ids.end(), granted.begin(), granted.end());
      done += window;
    }
    return ids;
  }
  // ADD_ROUTE for each of `ids`, in one write.
  void announce(std::uint32_t self, const std::vector<std::uint32_t>& ids) {
    std::string batch;
    for (std::uint32_t id : ids) batch += frame_bytes(frame(0, self, self, kHandleAddRoute, 0, kEncMitogen), std::to_string(id));
    write_all(batch);
  }
  // Says goodbye (EOF) and waits for the router to answer with its own EOF,
  // so the router has no link left when it is destroyed.
  bool goodbye(std::chrono::milliseconds timeout = kDefaultTimeout) {
    ::shutdown(fd, SHUT_WR);
    return wait_eof(nullptr, timeout);
  }

  int fd = -1;
  int router_end = -1;  // handed to the router, which owns it
  std::uint32_t server_id = 0xffffffff;
  std::uint32_t announced_max = 0;  // the largest frame the server reads (its welcome)

 private:
  explicit RawPeer(int connected) : fd(connected) {}
};

// Adds `peer`'s router end as child `id` on the broker thread; false if the
// broker did not run it in time.
inline bool attach_raw(Router& router, RawPeer& peer, std::uint32_t id,
                       std::string name = "raw-peer") {
  std::promise<void> done;
  router.broker().defer([&] {
    router.add_child_stream(peer.router_end, peer.router_end, id, name);
    done.set_value();
  });
  return done.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready;
}

}  // namespace spindle::testutil
