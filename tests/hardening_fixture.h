// Hardening: the fixture of the tests that play a hostile client against a
// real spindle-router (issue #11: test_hardening.cpp, test_hardening_limits.cpp):
// RouterFixture plus what those tests read off the router (its resident set,
// its accounted memory peak, its log lines) and the ways they push at it (a
// non-blocking flood, a sparse memfd body).
//
// Thread safety: the test's own thread. Ownership: as RouterFixture.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "stream/fd_frame.h"
#include "tests/fds_test_util.h"
#include "tests/raw_peer.h"
#include "tests/router_fixture.h"
#include "tests/router_probe.h"

namespace spindle::testutil {

class Hardening : public RouterFixture {
 protected:
  long rss_kib() const { return vm_rss_kib(router_->pid()); }
  // The most the router's accounts ever held at once (all peers together).
  long long memory_peak() const { return stats_field(router_stats_text(socket()), " memory_peak="); }
  // A Mitogen-dialect client (it cannot take fds); its id in `id`.
  RawPeer mitogen_client(std::uint32_t& id) {
    RawPeer p = RawPeer::connect_to(address());
    id = p.mitogen_handshake(static_cast<std::uint32_t>(::getpid()));
    return p;
  }
  // Sends, from `from` (context `src`), one SF frame whose body is a fresh
  // sealed sparse memfd of `size` bytes. False if the send failed.
  static bool send_sparse_memfd(RawPeer& from, std::uint32_t src, std::size_t size, std::uint32_t dst,
                                std::uint32_t handle, std::uint32_t reply_to,
                                std::uint16_t body_enc = kEncMitogen) {
    UniqueFd body = sparse_memfd(size);
    int raw = body.get();
    return send_with_fds(from.fd, memfd_frame(dst, src, handle, reply_to, body_enc),
                         std::span<const int>(&raw, 1));
  }
  // A call from good_ to `callee`'s `handle`, which the callee holds
  // unanswered: the pending call, and the question as the callee got it
  // (answer it with callee.router().reply(question, ...)).
  struct HeldCall {
    std::future<std::string> call;
    Message question;
  };
  HeldCall held_call(Connection& callee, std::uint32_t handle) {
    auto held = std::make_shared<std::promise<Message>>();
    callee.router().add_handler([held](Message&& m) { held->set_value(std::move(m)); }, {}, handle);
    HeldCall h;
    h.call = std::async(std::launch::async, [this, id = callee.id(), handle] {
      return good_->context(id).call(handle, "real question", std::chrono::seconds(30));
    });
    auto pending = held->get_future();
    EXPECT_EQ(pending.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "the call never arrived";
    if (pending.wait_for(std::chrono::seconds(0)) == std::future_status::ready) h.question = pending.get();
    return h;
  }
  // The router's log lines that contain `needle`.
  std::vector<std::string> lines_with(std::string_view needle) const {
    std::vector<std::string> out;
    std::string log = router_->log();
    std::size_t at = 0;
    while (at < log.size()) {
      std::size_t nl = log.find('\n', at);
      if (nl == std::string::npos) nl = log.size();
      std::string_view line(log.data() + at, nl - at);
      if (line.find(needle) != std::string_view::npos) out.emplace_back(line);
      at = nl + 1;
    }
    return out;
  }
};

// Writes `chunk` over and over without blocking until the socket stays full
// for `stuck` (the router stopped reading) or `total` has passed. Returns the
// bytes written. With `frame` (the size of each frame in `chunk`), a flood
// that ends at `total` finishes the frame it began, so that more frames can
// follow; one that ends stuck cannot.
inline std::size_t flood(RawPeer& p, const std::string& chunk, std::chrono::milliseconds stuck,
                         std::chrono::milliseconds total, std::size_t frame = 0) {
  int flags = ::fcntl(p.fd, F_GETFL);
  EXPECT_EQ(::fcntl(p.fd, F_SETFL, flags | O_NONBLOCK), 0);
  std::size_t written = 0, off = 0;
  auto end = std::chrono::steady_clock::now() + total;
  auto last_progress = std::chrono::steady_clock::now();
  bool finishing = false;
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    if (!finishing && now >= end) {
      if (!frame || written % frame == 0) break;
      finishing = true;
    }
    const std::size_t want = finishing ? frame - written % frame : chunk.size() - off;
    ssize_t n = ::send(p.fd, chunk.data() + off, want, MSG_NOSIGNAL);
    if (n > 0) {
      written += static_cast<std::size_t>(n);
      off = (off + static_cast<std::size_t>(n)) % chunk.size();
      last_progress = std::chrono::steady_clock::now();
      if (finishing && written % frame == 0) break;
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) break;  // disconnected
    if (now - last_progress > stuck) break;
    pollfd pf{p.fd, POLLOUT, 0};
    ::poll(&pf, 1, 10);
  }
  ::fcntl(p.fd, F_SETFL, flags);
  return written;
}

}  // namespace spindle::testutil
