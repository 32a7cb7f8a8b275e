// StreamPort: the part of a stream that threads other than the broker's use.
//
// Role: a sender on an application thread charges the stream's OutputGauge
// (and may wait on it), and, when the stream is idle, writes its frame to the
// socket itself: one writev for header and payload, no queue, no wake-up of
// the broker. The TxGate says who may write: the broker when it has frames
// queued, one application thread at a time when nothing is queued or under
// way. While an application thread writes, the broker may queue but not
// write, and may not close the fd: it marks what it wants (kPending,
// kClosed) and the writer kicks it when done.
//
// When is a stream idle enough for a direct write? Nothing queued, no write
// under way, and either the peer has spoken since the last direct write
// (kDirectOk) or no direct write went for the last 50 µs. The first rule
// gives a request/response rhythm the lowest latency (every request is
// written at once); the second serves a sender that writes to this stream
// only now and then (one thread writing for many connections in turn). A
// thread that streams messages to one stream writes the first itself and
// hands the rest to the broker, which gathers them into batches: one
// syscall per message would cost a streaming sender more than batching
// saves.
//
// Thread safety: every member is safe from any thread; the fd is used only
// by whoever holds the gate. Ownership: shared by the Stream and the senders
// that cache it; the Stream sets it up before sharing it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "spindle/frame.h"
#include "stream/output_gauge.h"
#include "stream/payload.h"

namespace spindle {

struct TxFrame;

class TxGate {
 public:
  static constexpr std::uint32_t kBusy = 1;      // frames queued, or a write under way
  static constexpr std::uint32_t kUser = 2;      // an application thread holds the fd
  static constexpr std::uint32_t kClosed = 4;    // no more direct writes
  static constexpr std::uint32_t kDirectOk = 8;  // the peer spoke since the last direct write
  static constexpr std::uint32_t kPending = 16;  // the broker queued while a user wrote
  // A direct write's rest is on its way to the broker, which must write it
  // before anything else. No thread holds the fd: the stream may close it,
  // and its end never waits for the rest (whose task may never run).
  static constexpr std::uint32_t kRest = 32;

  std::uint32_t load() const { return state_.load(std::memory_order_acquire); }

  // --- application threads ---
  // A direct write may go now: the peer spoke since the last one (kDirectOk),
  // or the stream is idle (nothing queued, no write under way, open) and no
  // direct write went for kIdleForDirect. The second rule serves a thread
  // that writes to many streams in turn: each stream sees a send now and
  // then, and a wake-up of its broker would cost more than one sendmsg. A
  // tight stream of sends to one stream still batches through the broker.
  // The clock is read only when the state alone does not decide.
  static constexpr std::chrono::nanoseconds kIdleForDirect{50'000};
  bool direct_allowed() const {
    const std::uint32_t s = load();
    return s == kDirectOk || (s == 0 && idle_long_enough());
  }
  // Takes the fd for a direct write that direct_allowed() just allowed, if
  // the stream is still idle. The idle time is not read again: another
  // thread's direct write in between costs at most one more direct write.
  bool try_acquire_direct() {
    std::uint32_t expect = kDirectOk;
    if (state_.compare_exchange_strong(expect, kBusy | kUser, std::memory_order_acq_rel)) return true;
    return expect == 0 && state_.compare_exchange_strong(expect, kBusy | kUser, std::memory_order_acq_rel);
  }
  // After a direct write: the idle rule counts from here.
  void note_direct_write() {
    last_direct_ns_.store(std::chrono::steady_clock::now().time_since_epoch().count(),
                          std::memory_order_relaxed);
  }
  // After a partial write: the fd is let go, and the rest goes to the broker
  // (the caller posts it next). Until the broker takes it, neither the broker
  // nor another user may write.
  void hand_over_rest() {
    std::uint32_t s = state_.load(std::memory_order_acquire);
    while (!state_.compare_exchange_weak(s, (s & ~kUser) | kRest, std::memory_order_acq_rel)) {
    }
  }
  // Gives the fd back after a frame written whole. Returns the bits the
  // broker set meanwhile (kPending: it queued frames; kClosed): it must then
  // be kicked. With kPending the stream stays busy: its queue is not empty.
  std::uint32_t release_direct() {
    std::uint32_t s = state_.load(std::memory_order_acquire);
    while (true) {
      std::uint32_t next = (s & kPending) ? (s & ~kUser) : (s & ~(kUser | kBusy));
      if (state_.compare_exchange_weak(s, next, std::memory_order_acq_rel))
        return s & (kPending | kClosed);
    }
  }

  // --- broker thread ---
  // The broker's queue is not empty (kPending tells a user writing now that
  // it must kick the broker when done).
  void mark_queued() { state_.fetch_or(kBusy | kPending, std::memory_order_acq_rel); }
  // Whether the broker may write its queue now (no user holds the fd, and no
  // rest of a direct write is on its way).
  bool broker_may_write() const { return !(load() & (kUser | kRest)); }
  // The broker has taken over the rest of a frame a user began (or nobody
  // ever will): writes may resume.
  void clear_rest() { state_.fetch_and(~kRest, std::memory_order_acq_rel); }
  // Nothing queued any more: direct writes may resume (if allowed).
  void clear_busy() { state_.fetch_and(~(kBusy | kPending), std::memory_order_acq_rel); }
  void allow_direct() {
    if (!(state_.load(std::memory_order_relaxed) & kDirectOk))
      state_.fetch_or(kDirectOk, std::memory_order_acq_rel);
  }
  // No more direct writes. Returns true if a user holds the fd right now:
  // the broker must wait for its kick before closing it.
  bool close() { return state_.fetch_or(kClosed, std::memory_order_acq_rel) & kUser; }

 private:
  bool idle_long_enough() const {
    const std::int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
    return now - last_direct_ns_.load(std::memory_order_relaxed) >= kIdleForDirect.count();
  }
  std::atomic<std::uint32_t> state_{kBusy};  // busy until the handshake is done
  std::atomic<std::int64_t> last_direct_ns_{0};
};

class StreamPort {
 public:
  StreamPort(std::size_t high_water_mark, std::uint32_t peer_uid);

  const std::uint64_t serial;  // unique in the process, never reused
  const std::uint32_t uid;     // the peer's (StreamOptions::uid, else this process's)
  OutputGauge gauge;
  TxGate gate;

  enum class Direct { kNotIdle, kWritten, kFailed };
  // On an application thread, for a frame without fds or memfd body whose
  // `charged` bytes are already on the gauge, once gate.direct_allowed()
  // said yes: writes it now if the stream is still idle. kWritten: the frame
  // is the stream's (written whole, or its rest handed to the broker).
  // kNotIdle: queue it the usual way. kFailed: the connection is gone;
  // `error` says why (the broker closes the stream).
  Direct try_write(const Header& h, const Payload& body, std::size_t charged, std::string& error);

  // Set by the stream before it is shared.
  int fd = -1;
  bool is_socket = false;
  // False once it is known that the peer cannot take fds (a pipe link; a
  // handshake without kFlagFdPassing: an ssh session, a Mitogen peer). A
  // sender then does not copy a large payload into a memfd that could only
  // be written inline again.
  std::atomic<bool> peer_takes_fds{true};
  // The largest body this stream may carry: the lower of this side's
  // maximum and the one the peer announced (a server's in its welcome, a
  // client's in its hello). A sender refuses a larger body itself with a
  // clear error: sent, it would be a protocol error that closes the link
  // and fails everything else on it.
  std::atomic<std::uint32_t> max_message_size{UINT32_MAX};
  std::string name;
  // The broker takes over: the rest of a frame (null: only a kick).
  std::function<void(TxFrame* rest, const std::string& error)> hand_over;
  std::atomic<std::uint64_t> direct_writes{0};
};

}  // namespace spindle
