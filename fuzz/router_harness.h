// RouterHarness: a root Router in this process with two peers on
// socketpairs: the fuzzed peer and a well-behaved sibling (child context 2).
// The fuzzed peer is a child (context 1), or a listener's client: an
// untrusted link whose id the router assigns in the listener's handshake, as
// spindle-router's clients are (fuzzed_id() says which). The root hosts an
// echo handler at kEcho and has a call pending at the fuzzed peer, so
// replies and dead replies have something to complete. It accepts clients'
// log lines at a high rate, so FORWARD_LOG's rate limit and hold are reached
// without slowing an input down. Shared by fuzz_router (raw bytes),
// fuzz_control (control frames) and fuzz_fds.
//
// finish() is where the invariants are checked, aborting (a fuzzer crash) if
// any breaks:
//   - the sibling is still served: its call to kEcho is answered;
//   - after the fuzzed peer's EOF the router closes its link (no hang);
//   - the call pending at the fuzzed peer completes once that link is gone;
//   - the router shuts down cleanly.
//
// Thread safety: the fuzzer's thread drives it; the Router runs its own
// broker thread. Ownership: owns the Broker, the Router and both peers.
#pragma once

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>

#include "broker/log.h"
#include "router/router.h"
#include "stream/listener_handshake.h"
#include "tests/raw_peer.h"

namespace spindle::fuzz {

inline constexpr std::uint32_t kFuzzedId = 1;
inline constexpr std::uint32_t kSiblingId = 2;
inline constexpr std::uint32_t kEcho = 1000;
inline constexpr std::uint32_t kPeerHandle = 2000;  // where the root's pending call goes
inline constexpr std::uint32_t kMaxMessage = 4096;  // small, so "too large" is reachable

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "router harness invariant broken: %s\n", what);
  std::abort();
}

enum class FuzzedLink { kChild, kClient };

class RouterHarness {
 public:
  // `fuzzed_flags`: the fuzzed peer's hello flags (kFlagFdPassing for a peer
  // that sends fds; the sibling never takes fds).
  explicit RouterHarness(std::uint16_t fuzzed_flags = kFlagNone, FuzzedLink link = FuzzedLink::kChild) {
    static const bool quiet = [] {
      log().set_level(spdlog::level::off);  // millions of warnings help nobody
      return true;
    }();
    (void)quiet;
    Broker::Options bo;
    bo.shutdown_grace = std::chrono::milliseconds(2000);
    broker_ = std::make_unique<Broker>(bo);
    RouterOptions ro;
    ro.name = "fuzz-root";
    ro.max_message_size = kMaxMessage;
    ro.high_water_mark = 64 * 1024;
    ro.accept_client_logs = true;
    ro.peer_log_rate = 1e6;  // a hold lasts about 1 ms
    router_ = std::make_unique<Router>(*broker_, ro);
    Router& r = *router_;
    r.add_handler([&r](Message&& m) { r.reply(m, Payload::copy_of("echo:" + m.text())); }, {}, kEcho);
    if (!testutil::attach_raw(r, sibling_, kSiblingId, "sibling")) fail("cannot attach the sibling");
    if (link == FuzzedLink::kChild) {
      if (!testutil::attach_raw(r, fuzzed_, kFuzzedId, "fuzzed")) fail("cannot attach the fuzzed peer");
    } else {
      while (r.allocate_id() <= kSiblingId) {  // the children's fixed ids are taken
      }
      if (!attach_client(r, fuzzed_)) fail("cannot attach the fuzzed client");
    }
    fuzzed_id_ = fuzzed_.handshake(fuzzed_flags);
    if ((link == FuzzedLink::kChild && fuzzed_id_ != kFuzzedId) || sibling_.handshake() != kSiblingId)
      fail("handshake gave the wrong ids");
    pending_ = r.request(Message::make(fuzzed_id_, kPeerHandle, Payload::copy_of("pending")),
                         std::chrono::seconds(60));
    Message req;
    if (!fuzzed_.read_frame_for(fuzzed_id_, kPeerHandle, req)) fail("the pending call never arrived");
    pending_handle_ = req.header.reply_to;
  }

  // The reply_to of the root's call pending at the fuzzed peer.
  std::uint32_t pending_handle() const { return pending_handle_; }
  std::uint32_t fuzzed_id() const { return fuzzed_id_; }
  testutil::RawPeer& fuzzed() { return fuzzed_; }

  // Writes bytes as the fuzzed peer; false once the router has closed on it.
  bool send(std::string_view bytes) {
    try {
      fuzzed_.write_all(bytes);
      return true;
    } catch (const Error&) {
      return false;
    }
  }

  void finish() {
    using namespace std::chrono_literals;
    // The sibling is served whatever the fuzzed peer did.
    sibling_.send_frame(testutil::frame(0, kSiblingId, kSiblingId, kEcho, 77), "still there?");
    // The fuzzed peer may itself send to the sibling, even to handle 77:
    // only the root's answer counts.
    Message echo;
    auto until = std::chrono::steady_clock::now() + 30s;
    bool answered = false;
    while (!answered && std::chrono::steady_clock::now() < until) {
      if (!sibling_.read_frame_for(kSiblingId, 77, echo, 30s)) break;
      answered = echo.header.src_id == 0 && !echo.is_dead();
    }
    if (!answered || echo.text() != "echo:still there?") fail("the sibling was not served");
    // EOF from the fuzzed peer: the router must close its link.
    ::shutdown(fuzzed_.fd, SHUT_WR);
    if (!fuzzed_.wait_eof(nullptr, 30s)) fail("the router never closed the fuzzed peer's link");
    if (pending_.wait_for(30s) != std::future_status::ready)
      fail("the call pending at the fuzzed peer never completed");
    try {
      pending_.get();
    } catch (const std::exception&) {
      // Failing with a reason is fine; so is a reply the fuzzer forged.
    }
    if (!sibling_.goodbye(30s)) fail("the router never closed the sibling's link");
    router_.reset();
    broker_.reset();
  }

 private:
  // Adopts `peer`'s router end as spindle-router's listener does a client:
  // untrusted, its id assigned in the handshake.
  static bool attach_client(Router& r, testutil::RawPeer& peer) {
    std::promise<void> done;
    r.broker().defer([&] {
      auto hs = std::make_unique<ListenerHandshake>(
          r.id(), static_cast<std::uint32_t>(::getpid()), r.options().max_message_size,
          [&r](const PeerInfo&) -> ServerHandshake::Assignment { return r.allocate_id(); });
      ClientLinkOptions o;
      o.pid = static_cast<std::uint32_t>(::getpid());
      r.add_client_stream(peer.router_end, "fuzzed-client", std::move(hs), o);
      done.set_value();
    });
    return done.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  }

  testutil::RawPeer fuzzed_;
  testutil::RawPeer sibling_;
  std::unique_ptr<Broker> broker_;
  std::unique_ptr<Router> router_;
  std::future<Message> pending_;
  std::uint32_t pending_handle_ = 0;
  std::uint32_t fuzzed_id_ = 0;
};

}  // namespace spindle::fuzz
